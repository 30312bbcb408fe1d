"""A tiny transformers DeepseekV3 checkpoint served through the runtime (Engine, scheduler, sampler: `LLM`, as
`runtime serve --model-path DIR` builds it) generates the same greedy tokens as transformers' own
`generate` on the CPU. test_model_reference compares the model class with a hand-made paged KV; this
covers the serving path: config defaults, page tables, chunked prefill, batching and the sampler."""

from __future__ import annotations

import pytest
import torch

from pdlab.runtime.core import SamplingParams
from pdlab.runtime.engine.loop import LLM
from pdlab.runtime.model.testing import hf_config, hf_model
from pdlab.runtime.model.tiny import write_tokenizer

pytest.importorskip("transformers")
NEW = 12


def test_served_greedy_equals_transformers(tmp_path):
    hf = hf_model(hf_config(layers=2), seed=5)
    hf.save_pretrained(tmp_path)
    write_tokenizer(tmp_path)
    # page 16 and a 24-token chunk: the 38-token prompt spans pages and is prefilled in two steps
    llm = LLM(model_path=str(tmp_path), device="cpu", dtype="fp32", page_size=16, max_total_tokens=1024,
              max_context_len=128, chunked_prefill_size=24, max_prefill_tokens=64)
    prompts = [[5, 17, 200, 3, 99], list(range(2, 40)), [7]]
    out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    for p, o in zip(prompts, out):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(p):].tolist()
        assert o["error"] is None and o["token_ids"] == ref, (p, o["token_ids"], ref)
