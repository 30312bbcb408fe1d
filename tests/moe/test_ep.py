"""Expert parallelism: the MoE layer split over ranks (each holding E/R experts and its own tokens)
gives the single-process layer's output. CPU: 2 gloo ranks. GPU (multigpu): 2 NCCL ranks on 2 GPUs
vs the single-GPU reference, both modes (bench/gpu/moe_ep.sh runs these on the H200s)."""

import os

import pytest
import torch

from pdlab.moe.config import MoEConfig
from pdlab.moe.dispatch.selftest import ep_layer_forward, low_latency_graph, random_moe
from pdlab.moe.dispatch.spawn import run_ranks
from pdlab.moe.layer import MoELayer

CFG = MoEConfig(num_experts=8, top_k=3, hidden_size=128, intermediate_size=64, n_group=4, topk_group=2,
                routed_scaling_factor=2.5)
SEED, T = 5, 6


def single_process(cfg, tokens_per_rank, world, case, device="cpu"):
    weights, gate, bias = random_moe(SEED, cfg, device)
    g = torch.Generator().manual_seed(SEED + 7)
    x = torch.randn(world * tokens_per_rank, cfg.hidden_size, generator=g).to(torch.bfloat16).to(device)
    layer = MoELayer(cfg, weights, gate, bias, None, "local", case.get("runner"), case["mode"],
                     payload=case.get("payload", "bf16"), num_max_dispatch_tokens_per_rank=world * tokens_per_rank)
    return layer(x).cpu()


def _compare(out, ref, tol):
    # bf16 tolerance: the expert outputs are the same rows through the same runner; what differs is
    # the combine order (per rank, then over ranks) and, with bf16 partial sums, one extra bf16
    # rounding per (token, rank): |Δ| ≤ 2^-8 · |partial|, so a few bf16 ulps of the output
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * float(ref.abs().max()))


CASES = [
    dict(mode="normal", payload="bf16", runner="torch"),
    dict(mode="low_latency", payload="bf16", runner="torch"),
    dict(mode="normal", payload="nvfp4", runner="torch"),
    dict(mode="low_latency", payload="fp8", runner="torch", dispatcher_kwargs={"combine_dtype": "fp32"}),
]


def test_ep2_gloo_layer_equals_single_process():
    outs = run_ranks(ep_layer_forward, 2, kwargs=dict(seed=SEED, cfg=CFG, tokens_per_rank=T, cases=CASES),
                     backend="gloo", timeout_s=120)
    for i, case in enumerate(CASES):
        ref = single_process(CFG, T, 2, case)
        out = torch.cat([outs[r][i] for r in range(2)])
        fp32_combine = (case.get("dispatcher_kwargs") or {}).get("combine_dtype") == "fp32"
        _compare(out, ref, 1e-3 if fp32_combine else 1.6e-2)


GPU_CFG = MoEConfig(num_experts=32, top_k=8, hidden_size=1024, intermediate_size=512, n_group=8, topk_group=4,
                    routed_scaling_factor=2.5)


def _gpu_world() -> int:
    """EP size of the GPU test: $PDLAB_EP (bench/gpu/moe_ep.sh sets it), else every GPU (2, 4 or 8)."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return int(os.environ.get("PDLAB_EP", min(n, 8)))


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_epN_nccl_layer_equals_single_gpu(mode):
    world = _gpu_world()
    cases = [dict(mode=mode, payload=p, runner=r) for p, r in (("bf16", "torch_grouped"), ("nvfp4", "triton"))]
    tpr = 64
    outs = run_ranks(ep_layer_forward, world, kwargs=dict(seed=SEED, cfg=GPU_CFG, tokens_per_rank=tpr, cases=cases),
                     backend="nccl", timeout_s=240)
    for i, case in enumerate(cases):
        ref = single_process(GPU_CFG, tpr, world, case, device="cuda")
        out = torch.cat([outs[r][i] for r in range(world)])
        err = float((out.float() - ref.float()).abs().max() / ref.float().abs().max())
        print(f"EP{world} {mode} {case['payload']} {case['runner']}: max |EP - single| / max |single| = {err:.2e}")
        _compare(out, ref, 2e-2)


@pytest.mark.gpu
@pytest.mark.multigpu
def test_nccl_low_latency_is_sync_free_and_graph_capturable():
    """The fixed low-latency exchange: no host sync (sync debug mode "error"), and a CUDA graph of
    dispatch + combine replays to the eager result (DeepSeek-R1 sizes, nvfp4 payload)."""
    world = _gpu_world()
    res = run_ranks(low_latency_graph, world, backend="nccl", timeout_s=240)
    for rank, r in enumerate(res):
        print(f"rank {rank}: graph diff {r['graph_diff']:.2e}, no-sync diff {r['nosync_diff']:.2e} (scale {r['scale']:.2f})")
        assert r["nosync_diff"] == 0.0 and r["graph_diff"] == 0.0
