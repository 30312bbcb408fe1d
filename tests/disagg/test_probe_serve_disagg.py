"""Disaggregated requests at the edges a colocated server accepts: a prompt that fills the context but one token,
and logprobs, whose first token is sampled on the prefill server."""

import sys
from pathlib import Path

import pytest

from pdlab.runtime.core import SamplingParams
from pdlab.runtime.disagg.offline import DisaggLLM
from pdlab.runtime.engine.loop import LLM
sys.path.insert(0, str(Path(__file__).parent))
from disagg_children import load_sensitive_toy  # noqa: E402

MODEL, TOK, CFG = load_sensitive_toy()
CTX = 64


def _settings(**kw):
    return dict(model=MODEL, tokenizer=TOK, model_config=CFG, device="cpu", page_size=16, max_total_tokens=1024,
                max_context_len=CTX, chunked_prefill_size=32, max_prefill_tokens=64, **kw)


@pytest.fixture
def disagg():
    d = DisaggLLM(_settings(), _settings(), transfer_timeout=10.0)
    yield d
    d.close()


@pytest.mark.parametrize("prompt_len,max_tokens", [(CTX - 1, 1), (CTX - 2, 2)])
def test_a_prompt_that_fills_the_context_is_served_as_colocated(disagg, prompt_len, max_tokens):
    """The prefill server's copy of a request asked for 2 tokens: a prompt of context - 1 tokens with max_tokens 1
    (valid, and served by a colocated server) was refused by the prefill server, and the decode server waited for
    its KV until the transfer timeout (a 502 after 60 s through the router)."""
    prompt = [(5 * i + 3) % 200 + 2 for i in range(prompt_len)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ref = LLM(**_settings()).generate([prompt], params)[0]
    out = disagg.generate([prompt], params, timeout=8.0)[0]
    assert out["error"] is None, out
    assert out["token_ids"] == ref["token_ids"] and len(out["token_ids"]) == max_tokens
    assert out["finish_reason"] == "length"


def test_logprobs_include_the_first_token(disagg):
    """The first token is sampled on the prefill server; its logprobs were dropped, so a disaggregated request
    got one logprob fewer than tokens (and none at max_tokens 1)."""
    prompts = [[7, 8, 9, 10], [11] * 20]
    for n in (1, 4):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2)
        ref = LLM(**_settings()).generate(prompts, params)
        out = disagg.generate(prompts, params, timeout=8.0)
        for o, r in zip(out, ref):
            assert o["error"] is None and o["token_ids"] == r["token_ids"]
            assert len(o["logprobs"]) == len(o["token_ids"]) == n
            for (lp, top), (rlp, rtop) in zip(o["logprobs"], r["logprobs"]):
                assert lp == pytest.approx(rlp, abs=1e-4)
                assert [t for t, _ in top] == [t for t, _ in rtop]
