"""The dispatch tuning target's correctness check: identity experts on every payload (bf16, fp8,
nvfp4) must give back x·Σw within the payload's tolerance through the local dispatcher."""

import pytest
import torch

from pdlab.bench.harness import cosine_error
from pdlab.tuning import dispatch as target
from pdlab.tuning.models import ModelShape

SHAPE = ModelShape(name="tiny", hidden_size=256, num_heads=4, kv_lora_rank=512, qk_rope_head_dim=64,
                   qk_nope_head_dim=32, moe_intermediate_size=64, n_routed_experts=16, num_experts_per_tok=4)


@pytest.mark.parametrize("payload", ["bf16", "fp8", "nvfp4"])
@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_local_dispatch_target_within_tolerance(payload, mode):
    bucket = {"tokens_per_rank": 16, "ranks": 1, "mode": mode, "payload": payload, "hidden": 256,
              "experts": 16, "top_k": 4}
    assert bucket in [dict(b, hidden=256, experts=16, top_k=4) for b in target.dispatch_buckets(SHAPE)]
    x = target.DispatchInputs(bucket, SHAPE, torch.device("cpu"))
    out = target._call("local", {}, x)
    err = cosine_error(out.float(), target._expected(x))
    assert err < target._tolerance(bucket), (payload, mode, err)
    if payload != "bf16":  # a quantized payload really was quantized (error above bf16 rounding)
        assert err > 1e-6
