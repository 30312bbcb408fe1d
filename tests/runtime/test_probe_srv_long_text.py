"""A text prompt too long for the context by its characters alone is refused before it is tokenized: tokenizing
megabytes holds the GIL for seconds (a 4 MB prompt stopped /health and every stream for 3.5 s), for a request that
is refused anyway."""

import httpx
import pytest
import torch

from pdlab.runtime.config import ServerConfig, build_config
from pdlab.runtime.server.serve import Server

CTX = 512


@pytest.fixture(scope="module")
def embedded():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    srv = Server(build_config(ServerConfig, device="cpu", port=0, page_size=64, max_total_tokens=2048,
                              max_context_len=CTX))
    srv.start()
    encoded: list[int] = []
    tok = srv.codec.tok
    real = tok.encode
    tok.encode = lambda text, *a, **kw: encoded.append(len(text)) or real(text, *a, **kw)
    with httpx.Client(base_url=f"http://127.0.0.1:{srv.port}", timeout=60) as c:
        yield srv, c, encoded
    srv.stop()
    torch.set_num_threads(n)


def test_the_codec_bounds_the_characters_of_a_text_of_n_tokens(embedded):
    srv, _, _ = embedded
    limit = srv.codec.max_text_chars(CTX)
    assert limit is not None and limit >= CTX
    text = "abcdefghijklmnopqrstuvwxyz " * (limit // 27 + 1)
    assert len(srv.codec.encode(text)) > CTX  # what it refuses could never fit


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/generate"])
def test_a_text_too_long_for_any_tokenization_is_refused_untokenized(embedded, path):
    srv, c, encoded = embedded
    big = "a b " * (srv.codec.max_text_chars(CTX) // 4 + 1)
    field, body = {"/v1/completions": ("prompt", {"prompt": big}),
                   "/v1/chat/completions": ("messages", {"messages": [{"role": "user", "content": big}]}),
                   "/generate": ("text", {"text": big})}[path]
    encoded.clear()
    r = c.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and f"{len(big)} characters" in err["message"], err
    assert f"context of {CTX} tokens" in err["message"] and "shorten" in err["message"], err
    assert not any(n >= len(big) for n in encoded)  # never tokenized
    small = {"/v1/completions": {"prompt": "Hi", "max_tokens": 2},
             "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
             "/generate": {"text": "Hi", "sampling_params": {"max_new_tokens": 2}}}[path]
    assert c.post(path, json=small).status_code == 200
