"""A small self-contained op for the tuner's tests: `toy_matmul` (C = A @ B, fp32) with a torch
reference backend and a blocked backend whose knobs change speed — and, for some values, fail to
"compile" (BLOCK_K = 0) or give a wrong result (skip_last = True), like a real kernel's bad configs.

Run as a script it tunes the op on CPU (used by the resume test, which kills it mid-run):
    python toy.py STORAGE STORE_DIR [TRIALS]
with TOY_DELAY=<seconds> added to every trial.
"""

from __future__ import annotations

import os
import sys
import time

import torch

from pdlab.kernels.registry import register_backend
from pdlab.tuning.models import DEEPSEEK_R1
from pdlab.tuning.target import TuneTarget, register_target

OP = "toy_matmul"
BLOCKED_SPACE = {"BLOCK_K": [0, 4, 16, 64], "skip_last": [False, True]}  # 8 configs: grid
BLOCKED_DEFAULT = {"BLOCK_K": 4, "skip_last": False}
WIDE_SPACE = {"rows": [1, 2, 4, 8, 16, 32, 64], "cols": [1, 2, 4, 8, 16, 32], "flip": [False, True]}  # 84: TPE


def register() -> TuneTarget:
    @register_backend(OP, "torch", archs=("cpu", "cuda"), reference=True)
    def toy_torch(a, b, *, config=None):
        return a.double().matmul(b.double()).float()

    @register_backend(OP, "blocked", archs=("cpu", "cuda"), priority=10, config_space=BLOCKED_SPACE,
                      default_config=BLOCKED_DEFAULT)
    def toy_blocked(a, b, *, config):
        bk = config["BLOCK_K"]
        if bk <= 0:
            raise RuntimeError(f"compile error: BLOCK_K={bk} (simulated)")
        if os.environ.get("TOY_BREAK_BK") == str(bk):  # what DeviceBroken records on a GPU
            raise RuntimeError(f"blocked config {config} broke the CUDA context (simulated)")
        delay = float(os.environ.get("TOY_DELAY", "0"))
        if delay:
            time.sleep(delay)
        k = a.shape[1]
        stop = k - bk if config["skip_last"] else k
        out = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float32)
        for s in range(0, max(stop, 0), bk):
            out += a[:, s:s + bk] @ b[s:s + bk]
        return out

    @register_backend(OP, "wide", archs=("cpu",), priority=5, config_space=WIDE_SPACE,
                      default_config={"rows": 1, "cols": 1, "flip": False})
    def toy_wide(a, b, *, config):
        out = a @ b
        return out.flip(0) if config["flip"] else out

    @register_backend(OP, "sm100only", archs=("sm100",), packages=("definitely_not_installed_pkg",),
                      config_space={"tile": [64, 128]}, default_config={"tile": 128})
    def toy_sm100(a, b, *, config):
        raise AssertionError("never runs on this machine")

    return register_target(TuneTarget(
        op=OP, description="toy matmul", buckets=lambda model: [{"m": m, "k": 64, "dtype": "fp32"} for m in (16, 64)],
        build=_build, call=_call, error=_error, tolerance=lambda bucket: 1e-5,
        bucket_doc="m × k, fp32"))


def _build(bucket, model, device):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(bucket["m"], bucket["k"], generator=g), torch.randn(bucket["k"], 32, generator=g))


LOOKUP = {"keys": ("m", "k", "dtype")}  # the bucket keys the toy op asks the store for


def _call(backend, cfg, inputs):
    """The op's public function: an explicit config, else the tuned one for its bucket."""
    from pdlab.kernels import registry, tuned

    if cfg is None:
        a = inputs[0]
        full = {"m": a.shape[0], "k": a.shape[1], "dtype": "fp32"}
        cfg, _ = tuned.resolve_config(OP, backend, {k: full[k] for k in LOOKUP["keys"]}, device=a.device)
    return registry.get_backend(OP, backend).impl(*inputs, config=cfg)


def _error(out, ref) -> float:
    return float((out - ref).abs().max() / ref.abs().max())


def settings(storage, trials: int = 50, **kw):
    """Fast CPU settings; storage None = optuna in-memory (the resume test uses a sqlite file)."""
    import optuna

    from pdlab.tuning.search import SearchSettings

    storage = storage or optuna.storages.InMemoryStorage()

    base = dict(storage=storage, budget_s=None, max_trials=trials, warmup=1, repeats=3, max_seconds=0.05,
                remeasure_rounds=1, show_progress=False, backends=["blocked"])
    base.update(kw)
    return SearchSettings(**base)


def run(storage, store_dir: str, trials: int, backends=("blocked",), buckets=None):
    from pdlab.tuning.search import tune_op

    target = register()
    return tune_op(target, buckets or [{"m": 16, "k": 64, "dtype": "fp32"}], DEEPSEEK_R1,
                   settings(storage, trials, backends=list(backends)), device=torch.device("cpu"),
                   store_root=store_dir, metadata=metadata())


def metadata() -> dict:
    from pdlab.kernels import tuned

    return {"device": "cpu", "device_key": "cpu", "arch": "cpu", "versions": tuned.running_versions(["torch"]),
            "date": "2026-11-29T00:00:00Z", "model": "toy", "command": "tests"}


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 50)


COLLECTIVE = "toy_allreduce"


def register_collective() -> TuneTarget:
    """A collective op for the multi-rank (lockstep) search: sum of x over ranks, in chunks.
    chunks=0 "fails to compile"; the expected output is computed by each rank itself."""

    @register_backend(COLLECTIVE, "chunked", archs=("cpu",), config_space={"chunks": [0, 1, 2, 4]},
                      default_config={"chunks": 1})
    def toy_chunked(x, *, config):
        import torch.distributed as dist

        if config["chunks"] <= 0:
            raise RuntimeError("compile error: chunks=0 (simulated)")
        out = x.clone()
        for part in out.chunk(config["chunks"]):
            dist.all_reduce(part)
        return out

    def build(bucket, model, device):
        import torch.distributed as dist

        r = dist.get_rank()
        return torch.arange(bucket["n"], dtype=torch.float32) * (r + 1)

    def expected(x):
        import torch.distributed as dist

        w = dist.get_world_size()
        return x / (dist.get_rank() + 1) * (w * (w + 1) / 2)

    from pdlab.kernels import registry

    return register_target(TuneTarget(
        op=COLLECTIVE, description="toy all-reduce", buckets=lambda model: [{"n": 4096}], build=build,
        call=lambda b, cfg, x: registry.get_backend(COLLECTIVE, b).impl(x, config=cfg),
        error=_error, tolerance=lambda bucket: 1e-6, reference_output=expected))
