"""Sampling: greedy, temperature, top-k, top-p, min-p, seeds, logprobs (batched sampler), and stop
strings / stop token ids / EOS / ignore_eos / max_tokens through the offline engine."""

import math

import pytest
import torch

from pdlab.runtime.core import Req, SamplingParams
from pdlab.runtime.engine.loop import LLM
from pdlab.runtime.engine.sample import SamplingTensors, gumbel_noise, sample
from pdlab.runtime.engine.testing import ToyModel, load_toy




def _reqs(n, **kw):
    out = []
    for i in range(n):
        r = Req([1], SamplingParams(**kw))
        r.seed = 1000 + i
        out.append(r)
    return out


def _st(reqs, V):
    return SamplingTensors.from_reqs(reqs, V, torch.device("cpu"))


def test_greedy_is_argmax(seed):
    logits = torch.randn(7, 50)
    out = sample(logits, _st(_reqs(7, temperature=0.0), 50))
    assert torch.equal(out.next_ids, logits.argmax(-1))


@pytest.mark.parametrize("temperature", [1e-6, 1e-30, 1e-40, 1e-45])
def test_a_temperature_too_small_to_sample_at_is_greedy(temperature):
    """logits / T past fp32's range are +-inf, whose argmax is the first positive logit, not the largest: a
    temperature that small (below 1e-5) samples greedily, as temperature 0 does."""
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.0], [4.0, 1.0, 4.5, -2.0]])
    reqs = _reqs(2, temperature=temperature)
    assert reqs[0].params.greedy
    assert sample(logits, _st(reqs, 4)).next_ids.tolist() == [1, 2]


def test_temperature_matches_softmax_frequencies():
    V, N, T = 5, 40000, 0.7
    base = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0])
    reqs = _reqs(N, temperature=T)
    ids = sample(base.expand(N, V).clone(), _st(reqs, V)).next_ids
    freq = torch.bincount(ids, minlength=V).float() / N
    want = torch.softmax(base / T, -1)
    assert torch.allclose(freq, want, atol=0.01), (freq, want)


def test_gumbel_noise_is_standard_gumbel():
    g = gumbel_noise(torch.arange(64, dtype=torch.int64), torch.zeros(64, dtype=torch.int64), 4096)
    assert abs(g.mean().item() - 0.5772) < 0.01 and abs(g.var().item() - math.pi ** 2 / 6) < 0.05


def test_seeded_sampling_is_reproducible_and_batch_independent():
    V = 100
    logits = torch.randn(1, V).expand(6, V).clone()
    reqs = _reqs(6, temperature=1.0)
    a = sample(logits, _st(reqs, V)).next_ids
    b = sample(logits[3:4], _st(reqs[3:4], V)).next_ids
    assert a[3] == b[0]
    assert len(set(a.tolist())) > 1  # different seeds, different draws (6 draws from a flat-ish dist)


@pytest.mark.parametrize("kw,check", [
    ({"top_k": 3}, "topk"), ({"top_p": 0.6}, "topp"), ({"min_p": 0.3}, "minp")])
def test_filters_keep_only_allowed_tokens(kw, check):
    V, N = 12, 3000
    base = torch.linspace(3, -3, V)
    probs = torch.softmax(base, -1)
    allowed = {"topk": set(range(3)),
               "topp": {i for i in range(V) if probs[:i].sum() < 0.6},
               "minp": {i for i in range(V) if probs[i] >= 0.3 * probs[0]}}[check]
    ids = sample(base.expand(N, V).clone(), _st(_reqs(N, temperature=1.0, **kw), V)).next_ids
    seen = set(ids.tolist())
    assert seen <= allowed and seen == allowed, (seen, allowed)


def test_mixed_batch_rows_keep_their_own_settings():
    V = 30
    logits = torch.randn(3, V)
    reqs = [Req([1], SamplingParams(temperature=0.0)), Req([1], SamplingParams(temperature=1.0, top_k=1)),
            Req([1], SamplingParams(temperature=2.0, top_p=0.5))]
    out = sample(logits, _st(reqs, V)).next_ids
    assert out[0] == logits[0].argmax() and out[1] == logits[1].argmax()


def test_logprobs_are_log_softmax():
    V = 40
    logits = torch.randn(4, V)
    out = sample(logits, _st(_reqs(4, temperature=0.0, logprobs=3), V))
    lp = torch.log_softmax(logits, -1)
    assert torch.allclose(out.chosen_logprobs, lp.max(-1).values)
    assert torch.equal(out.top_ids, lp.topk(3).indices)


def test_bad_params_are_rejected_with_the_field_named():
    for kw, field in [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": 0}, "top_k"),
                      ({"min_p": 2}, "min_p"), ({"max_tokens": 0}, "max_tokens"), ({"logprobs": 50}, "logprobs")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kw).validate()


# ---- stop conditions through the engine -----------------------------------------------------------
class EosAfter(ToyModel):
    """Toy model that strongly prefers EOS once a sequence has 12 tokens."""

    def forward(self, input_ids, positions, ctx):
        logits = super().forward(input_ids, positions, ctx)
        logits[ctx.seqlens >= 12, self.config.eos_token_id] += 1000.0
        return logits


def _llm(model=None):
    m, tok, cfg = load_toy(max_position_embeddings=256)
    return LLM(model=model or m, tokenizer=tok, model_config=cfg, device="cpu", page_size=16, max_total_tokens=2048)


def test_stop_strings_and_token_ids_and_max_tokens():
    llm = _llm()
    base = llm.generate(["stop here"], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    assert base["finish_reason"] == "length" and len(base["token_ids"]) == 30
    stop_id = base["token_ids"][7]
    first = base["token_ids"].index(stop_id)
    out = llm.generate(["stop here"], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_id]))[0]
    assert out["finish_reason"] == "stop" and out["token_ids"] == base["token_ids"][:first + 1]
    text = base["text"]
    stop = text[10:13]
    out = llm.generate(["stop here"], SamplingParams(temperature=0, max_tokens=30, stop=[stop]))[0]
    assert out["finish_reason"] == "stop" and out["text"] == text[:text.index(stop)]


def test_eos_and_ignore_eos():
    m, _, _ = load_toy(max_position_embeddings=256)
    model = EosAfter(m.config)
    llm = _llm(model)
    out = llm.generate(["hi there"], SamplingParams(temperature=0, max_tokens=20))[0]
    assert out["finish_reason"] == "stop" and out["token_ids"][-1] == 256 and len(out["token_ids"]) == 12 - 8 + 1
    out = llm.generate(["hi there"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    assert out["finish_reason"] == "length" and len(out["token_ids"]) == 20


def test_logprobs_through_the_engine():
    llm = _llm()
    out = llm.generate(["abc"], SamplingParams(temperature=0, max_tokens=5, logprobs=2))[0]
    assert len(out["logprobs"]) == 5
    for tok, (lp, top) in zip(out["token_ids"], out["logprobs"]):
        assert top[0][0] == tok and abs(top[0][1] - lp) < 1e-6 and lp <= 0
