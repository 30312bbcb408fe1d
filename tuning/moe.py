"""`tune moe`: the expert runners (op `moe_experts`: gate_up → SiLU·mul → down) at a model's EP shapes,
inputs built for the public op `pdlab.moe.experts.run_experts`.

Buckets (the keys `run_experts` passes to `resolve_config`):
  tokens_per_expert {1, 4, 16, 64, 256, 1024, 2048} (contiguous: rows / experts; masked: M_max) on every
  local expert (active_experts = experts), plus decode steps that reach only some experts: one token on
  active_experts {8, 32, 128} of them (fewer than all; EP1 decode of 1, 4 and 16 tokens at top-8)
  × experts {E (EP1), E/4 (EP4)} local experts × layout {contiguous, masked (≤ 256 tokens per expert)}
  × payload {nvfp4, bf16} (activations as dispatched), with hidden = H and intermediate = I of the model.
NVFP4 weights are random (DeepSeek-R1 sizes by default), quantized once per shape and reused (NVFP4 only:
the bf16 originals are dropped, so every runner, the reference included, sees the same weights).
"""

from __future__ import annotations

import argparse

import torch

from pdlab.bench.harness import cosine_error
from pdlab.kernels.nvfp4 import nvfp4_size_problem
from pdlab.moe.weights import quantize_in_chunks
from pdlab.tuning.command import add_common_arguments, run_tune
from pdlab.tuning.models import ModelShape
from pdlab.tuning.target import TuneTarget, register_target

TOKENS_PER_EXPERT = (1, 4, 16, 64, 256, 1024, 2048)
SPARSE_ACTIVE = (8, 32, 128)  # experts holding one token each (decode of 1, 4, 16 tokens at top-8)
MASKED_MAX_TPE = 256  # low-latency (masked) dispatch carries decode batches only
EP_SIZES = (1, 4)
PAYLOADS = ("nvfp4", "bf16")

_WEIGHTS: dict[tuple, object] = {}


def experts_buckets(model: ModelShape) -> list[dict]:
    out = []
    for ep in EP_SIZES:
        experts = model.n_routed_experts // ep
        fills = [(tpe, experts) for tpe in TOKENS_PER_EXPERT] + [(1, a) for a in SPARSE_ACTIVE if a < experts]
        for tpe, active in fills:
            for layout in ("contiguous", "masked"):
                if layout == "masked" and tpe > MASKED_MAX_TPE:
                    continue
                for payload in PAYLOADS:
                    out.append({"tokens_per_expert": tpe, "experts": experts, "active_experts": active,
                                "hidden": model.hidden_size, "intermediate": model.moe_intermediate_size,
                                "layout": layout, "payload": payload})
    return out


def expert_weights(experts: int, hidden: int, inter: int, device: torch.device):
    """Random NVFP4 ExpertWeights of one shape (DeepSeek-R1 EP1: 256 × 44M parameters, 6.3 GB of
    NVFP4 bytes), built once per process, 16 experts at a time: the whole bf16 copy plus the
    quantizer's fp32 temporaries (~100 GB) would not fit. NVFP4 only: the runners and the reference
    then share exactly the same weights."""
    key = (experts, hidden, inter, str(device))
    if key not in _WEIGHTS:
        _WEIGHTS.clear()
        g = torch.Generator(device=device).manual_seed(7)

        def make_chunk(e0: int, n: int):
            w13 = torch.randn(n, 2 * inter, hidden, generator=g, device=device, dtype=torch.bfloat16) * 0.02
            w2 = torch.randn(n, hidden, inter, generator=g, device=device, dtype=torch.bfloat16) * 0.02
            return w13, w2

        _WEIGHTS[key] = quantize_in_chunks(make_chunk, experts)
    return _WEIGHTS[key]


def active_ids(experts: int, active: int) -> torch.Tensor:
    """The experts holding tokens in a bucket with `active` of `experts` filled: spread evenly over the local
    experts (int64 [active]), as random routing spreads a decode step's few tokens."""
    return torch.arange(active) * experts // active


class ExpertInputs:
    """One bucket: the dispatched layout (tokens_per_expert rows on each of the bucket's active experts, none on
    the others) and the weights of every local expert."""

    def __init__(self, bucket: dict, model: ModelShape, device: torch.device) -> None:
        from pdlab.kernels.nvfp4 import global_scale_from_amax, quantize_nvfp4
        from pdlab.moe.layouts import Contiguous, Masked

        E, M, H = bucket["experts"], bucket["tokens_per_expert"], bucket["hidden"]
        A = int(bucket.get("active_experts", E))
        self.expected_m, self.active_experts = M, A
        self.weights = expert_weights(E, H, bucket["intermediate"], device)
        counts = torch.zeros(E, dtype=torch.int32)
        counts[active_ids(E, A)] = M
        g = torch.Generator(device=device).manual_seed(11)
        masked = bucket["layout"] == "masked"
        x = torch.randn((E if masked else A) * M, H, generator=g, device=device, dtype=torch.bfloat16)
        payload = bucket["payload"]
        extra = {}
        if payload == "nvfp4":
            gs = global_scale_from_amax(x.float().abs().amax()).to(device)
            x, scales = quantize_nvfp4(x, gs)
            extra = {"payload": "nvfp4", "scales": scales, "global_scale": gs}
        elif payload != "bf16":
            raise ValueError(f"payload {payload!r}: the tuner builds bf16 or nvfp4 activations")
        if not masked:
            offsets = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(counts, 0, dtype=torch.int32)])
            self.layout = Contiguous(hidden=x, counts=counts.to(device), offsets=offsets.to(device), **extra)
        else:
            extra = {k: (v.view(E, M, -1) if k == "scales" else v) for k, v in extra.items()}
            # the rows bound a dispatcher hands over with its slab (what the experts size their grids by)
            self.layout = Masked(hidden=x.view(E, M, -1), masked_m=counts.to(device), max_rows=A * M, **extra)


def _call(backend: str, cfg: dict, x: ExpertInputs):
    from pdlab.moe.experts import run_experts

    out = run_experts(x.layout, x.weights, runner=backend, config=cfg, expected_m=x.expected_m,
                      active_experts=x.active_experts)
    if backend == "torch":
        # the reference runs once per bucket; its cached fp32 copy of the weights (45 GB at EP1
        # DeepSeek-R1) would otherwise crowd out every trial after it
        x.weights.prepared.pop("torch_fp32", None)
    return out


def _tensor(y) -> torch.Tensor:
    return y.hidden if hasattr(y, "hidden") else y


def _error(out, ref) -> float:
    """Cosine error over the rows the layout holds (a masked slab's rows past masked_m are unspecified)."""
    a, b = _tensor(out), _tensor(ref)
    masked_m = getattr(ref, "masked_m", None)
    if masked_m is not None and a.dim() == 3:
        valid = torch.arange(a.shape[1], device=a.device)[None, :] < masked_m.to(a.device)[:, None]
        a, b = a[valid], b[valid]
    return cosine_error(a, b)


def _tolerance(bucket) -> float:
    # Runners see the same NVFP4 weights as the reference: they differ by bf16 rounding of the
    # SiLU·mul intermediate and accumulation order (~1e-5). With bf16 weights (another weights
    # builder) the NVFP4 quantization error itself shows (~1.4e-2 cosine at random weights), hence
    # the margin. A broken tile / split-K config is off by O(1), far above either.
    return 3e-2


def _accepts(backend, bucket) -> bool:
    opts = backend.options or {}
    layouts, payloads = opts.get("layouts"), opts.get("payloads")
    return (layouts is None or bucket["layout"] in layouts) and (payloads is None or bucket["payload"] in payloads)


def _resolve(backend: str, config: dict, bucket) -> dict:
    """The triton runner's auto knobs as it resolves them for this bucket's tokens per expert."""
    if backend != "triton":
        return dict(config)
    from pdlab.moe.runners.triton_nvfp4 import resolve_config

    return resolve_config(dict(config), int(bucket["tokens_per_expert"]))


def _space(backend, bucket, arch: str) -> dict | None:
    """On sm90 with a Triton that has Gluon the triton runner runs the fragment-order GEMMs (the runtime stores the
    experts for them, and they ignore FRAG): only their knobs, and the dense path's for contiguous bf16 rows, change
    its speed there."""
    if backend.name != "triton":
        return None
    from pdlab.moe.triton.nvfp4_frag import HAVE_GLUON

    if arch != "sm90" or not HAVE_GLUON:
        return None
    full = backend.config_space
    space = {k: full[k] for k in ("FRAG_BM", "FRAG_UNROLL", "FRAG_XASYNC", "FRAG_RING", "FRAG_RING_DOWN",
                                  "FRAG_PAIR_DOWN", "FRAG_XRING", "FRAG_PDL", "FRAG_MMA_ASYNC")}
    if bucket["layout"] == "contiguous" and bucket["payload"] == "bf16":
        space.update({k: full[k] for k in ("DENSE_MIN_M", "DENSE_CHUNK", "DENSE_OVERLAP")})
    return space


MOE_EXPERTS = register_target(TuneTarget(
    op="moe_experts", description="MoE expert runners (gate_up → SiLU·mul → down)",
    buckets=experts_buckets, build=lambda b, m, d: ExpertInputs(b, m, d), call=_call, error=_error,
    tolerance=_tolerance, accepts=_accepts, modules=("pdlab.moe.experts",), resolve=_resolve, space=_space,
    # as decode runs them (CUDA graphs): timed eagerly, a call on a few experts measures the host's ~0.3–0.6 ms of
    # launches instead of the kernels (one token on 8 of 256 experts: 269 µs eager against 91 µs in a graph)
    cuda_graph=True, model_problem=lambda m: nvfp4_size_problem(m.hidden_size, m.moe_intermediate_size),
    bucket_doc="tokens_per_expert × active_experts (all, or one token on 8/32/128) × experts (EP1, EP4) × layout "
               "× payload at the model's hidden/intermediate"))

OPS = ("moe_experts",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, OPS, "moe_experts")


def run(args: argparse.Namespace) -> int:
    return run_tune("tune moe", args, OPS)
