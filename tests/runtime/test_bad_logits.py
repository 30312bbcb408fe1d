"""Logits that cannot be sampled (NaN, +inf, every logit -inf) end that request alone with an error (500 over HTTP),
on the greedy and the sampling path, eagerly and with the overlap schedule; the other requests of the batch go on
exactly as without the fault."""

import json

import httpx
import pytest
import torch

from pdlab.runtime.config import ServerConfig, build_config
from pdlab.runtime.core import SamplingParams
from pdlab.runtime.engine.loop import LLM
from pdlab.runtime.engine.sample import SamplingTensors, sample
from pdlab.runtime.engine.testing import ToyModel, load_toy
from pdlab.runtime.server.serve import Server


class BadRowToy(ToyModel):
    """Toy model whose logits row is `value` for each sequence of exactly `bad_len` tokens (a numerical fault of one
    request's row; the other rows are untouched)."""

    bad_len = -1
    value = float("nan")

    def forward(self, input_ids, positions, ctx):
        logits = super().forward(input_ids, positions, ctx)
        bad = ctx.seqlens.to(torch.int64) == self.bad_len
        return torch.where(bad[:, None], torch.full_like(logits, self.value), logits)


def _llm(bad_len: int, value: float, overlap: bool) -> LLM:
    m, tok, cfg = load_toy(max_position_embeddings=64)
    model = BadRowToy(cfg)
    model.bad_len, model.value = bad_len, value
    return LLM(model=model, tokenizer=tok, model_config=cfg, device="cpu", page_size=4, max_total_tokens=256,
               overlap_schedule=overlap)


PARAMS = {"greedy": dict(temperature=0.0), "sampled": dict(temperature=0.9, seed=7, top_k=40),
          "logprobs": dict(temperature=0.0, logprobs=2)}


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
@pytest.mark.parametrize("kind", list(PARAMS))
@pytest.mark.parametrize("value, word", [(float("nan"), "NaN"), (float("-inf"), "-inf"), (float("inf"), "+inf")],
                         ids=["nan", "all_neg_inf", "pos_inf"])
@pytest.mark.parametrize("bad_len", [4, 6], ids=["prefill", "decode"])
def test_bad_logits_end_that_request_alone(overlap, kind, value, word, bad_len):
    """Request A (4 prompt tokens) meets the fault at its first (prefill) or third (decode) token; B (10 tokens)
    never does and must equal a clean run."""
    sp = SamplingParams(max_tokens=8, ignore_eos=True, **PARAMS[kind])
    prompts = [[5, 6, 7, 8], list(range(20, 30))]
    clean = _llm(-1, value, overlap).generate(prompts, sp)
    a, b = _llm(bad_len, value, overlap).generate(prompts, sp)
    assert b["finish_reason"] == "length" and b["error"] is None
    assert b["token_ids"] == clean[1]["token_ids"]
    assert a["finish_reason"] == "error", a
    assert word in a["error"] and "logits" in a["error"], a["error"]
    good = bad_len - 4  # tokens sampled before the faulty row
    assert a["token_ids"] == clean[0]["token_ids"][:good]


def test_sampler_flags_rows_it_cannot_sample():
    """sample() keeps next_ids in the vocabulary (a chained step feeds them to the model) and marks the rows whose
    logits cannot be sampled in checked_ids, for the host."""
    from pdlab.runtime.core import Req

    V = 16
    logits = torch.randn(4, V)
    logits[1, 3] = float("nan")
    logits[2] = float("-inf")
    reqs = [Req([1], SamplingParams(temperature=t)) for t in (0.0, 0.8, 0.0, 0.8)]
    for r in reqs:
        r.seed = 3
    out = sample(logits, SamplingTensors.from_reqs(reqs, V, torch.device("cpu")))
    assert bool(((out.next_ids >= 0) & (out.next_ids < V)).all())
    checked = out.checked_ids.tolist()
    assert checked[0] == out.next_ids[0] and checked[3] == out.next_ids[3]
    assert checked[1] < 0 and checked[2] < 0 and checked[1] != checked[2]


@pytest.fixture(scope="module")
def bad_server():
    m, tok, cfg = load_toy(max_position_embeddings=256)
    model = BadRowToy(cfg)
    model.bad_len = 7
    sc = build_config(ServerConfig, device="cpu", port=0, page_size=16, max_total_tokens=2048, max_context_len=256)
    srv = Server(sc, model=model, tokenizer=tok, model_config=cfg)
    srv.start()
    yield srv
    srv.stop()


def test_nan_logits_over_http_are_a_500_and_the_server_keeps_serving(bad_server):
    with httpx.Client(base_url=f"http://127.0.0.1:{bad_server.port}", timeout=30) as c:
        body = {"prompt": [5, 6, 7, 8, 9], "max_tokens": 6, "ignore_eos": True, "temperature": 0}
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["type"] == "server_error" and err["code"] == 500 and "NaN logits" in err["message"], err
        r = c.post("/v1/completions", json={**body, "stream": True})
        assert r.status_code == 200
        events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert "NaN logits" in chunks[-1]["error"]["message"] and chunks[-1]["error"]["code"] == 500
        assert all(ch["choices"][0]["finish_reason"] is None for ch in chunks[:-1])  # no answer passed for whole
        ok = c.post("/v1/completions", json={**body, "prompt": list(range(20, 30))})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 6
