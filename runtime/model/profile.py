"""Where a forward's time goes, by model stage: embed, attention, dense MLP, MoE, head.

    python -m pdlab.runtime.model.profile [--model-path synthetic:deepseek-r1:4 | DIR]
        [--batch 1,8,32,64,128,256] [--context 1024] [--prefill 1024,8192] [--repeats N] [--out DIR]

Decode: B sequences of `context` cached tokens (pages of 64; the KV values do not change the cost,
so nothing is prefilled) each add one token. Prefill: one sequence of N new tokens. Each forward is
timed whole and per stage (CUDA events on GPU, perf_counter on CPU; eager, no CUDA graphs), median
of `--repeats`. Writes stages.csv (phase, batch, tokens, stage, ms, share) and forward.csv (phase,
batch, tokens, ms, tok_per_s) to --out, and prints the table."""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from pdlab.runtime.context import ForwardContext
from pdlab._subcommands import arg_parser

PAGE = 64


def build_context(cfg, batch: int, context: int, new: int, device, kv_dtype) -> tuple[ForwardContext, torch.Tensor]:
    """Batch `batch` sequences with `context` cached tokens each adding `new` tokens (decode when new == 1): the
    ForwardContext over zeroed pools [pages, 64, latent_dim] of kv_dtype, and positions [batch * new] int64."""
    total = context + new
    pages_per = -(-total // PAGE)
    pools = [torch.zeros(batch * pages_per, PAGE, cfg.latent_dim, dtype=kv_dtype, device=device)
             for _ in range(cfg.num_hidden_layers)]
    table = torch.arange(batch * pages_per, dtype=torch.int32, device=device).view(batch, pages_per)
    pos = torch.arange(context, total, device=device).repeat(batch)  # [batch * new]
    seq = torch.arange(batch, device=device).repeat_interleave(new)
    slots = (table[seq, pos // PAGE].long() * PAGE + pos % PAGE)
    ctx = ForwardContext(
        is_decode=new == 1, block_table=table, seqlens=torch.full((batch,), total, dtype=torch.int32, device=device),
        qo_indptr=torch.arange(0, batch * new + 1, new, dtype=torch.int32, device=device), slots=slots,
        logits_indices=torch.arange(new - 1, batch * new, new, device=device), kv_caches=pools, kv_scale=None,
        max_q_len=new)
    return ctx, pos


class StageTimer:
    """stage_hook that accumulates per-stage time of one forward (CUDA events or perf_counter)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, object, object]] = []

    @contextlib.contextmanager
    def __call__(self, name: str):
        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            yield
            b.record()
        else:
            a = time.perf_counter()
            yield
            b = time.perf_counter()
        self.marks.append((name, a, b))

    def totals(self) -> dict[str, float]:
        if self.cuda:
            torch.cuda.synchronize()
        out: dict[str, float] = defaultdict(float)
        for name, a, b in self.marks:
            out[name] += a.elapsed_time(b) if self.cuda else (b - a) * 1e3
        self.marks.clear()
        return out


def profile(model, cfg, *, phase: str, batch: int, tokens: int, context: int, repeats: int, device,
            warmup: int = 2) -> tuple[dict, float]:
    """Median per-stage ms and median whole-forward ms of one configuration."""
    new = 1 if phase == "decode" else tokens
    ctx, pos = build_context(cfg, batch, context if phase == "decode" else 0, new, device,
                             next(model.parameters()).dtype if device.type == "cuda" else torch.float32)
    ids = torch.randint(2, cfg.vocab_size, (batch * new,), device=device)
    timer = StageTimer(device)
    stage_runs, whole = defaultdict(list), []
    for i in range(repeats + warmup):
        model.stage_hook = timer
        model(ids, pos, ctx)
        totals = timer.totals()
        model.stage_hook = None
        _sync(device)
        t0 = time.perf_counter()
        model(ids, pos, ctx)
        _sync(device)
        if i >= warmup:
            whole.append((time.perf_counter() - t0) * 1e3)
            for k, v in totals.items():
                stage_runs[k].append(v)
    return {k: statistics.median(v) for k, v in stage_runs.items()}, statistics.median(whole)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> int:
    ap = arg_parser(prog="python -m pdlab.runtime.model.profile",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None,
                    help="synthetic:deepseek-r1[:LAYERS], a checkpoint dir, or none (tiny)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", default="1,8,32,64,128,256")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--prefill", default="1024,8192")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.model_path and args.model_path.startswith("synthetic:"):
        from pdlab.runtime.engine.synthetic import load_synthetic  # the engine's synthetic R1 builder

        model, _, cfg = load_synthetic(args.model_path, device, dtype)
    else:
        from pdlab.runtime.model import load_model

        model, _, cfg = load_model(args.model_path, device, dtype, require_tokenizer=False)
    rows, fwd = [], []
    plan = [("decode", b, 1) for b in map(int, args.batch.split(",") if args.batch else [])]
    plan += [("prefill", 1, n) for n in map(int, args.prefill.split(",") if args.prefill else [])]
    for phase, batch, tokens in plan:
        stages, ms = profile(model, cfg, phase=phase, batch=batch, tokens=tokens, context=args.context,
                             repeats=args.repeats, device=device, warmup=args.warmup)
        total = sum(stages.values()) or 1.0
        for k, v in stages.items():
            rows.append({"phase": phase, "batch": batch, "tokens": batch * tokens, "stage": k, "ms": round(v, 4),
                         "share": round(v / total, 4)})
        fwd.append({"phase": phase, "batch": batch, "tokens": batch * tokens, "ms": round(ms, 4),
                    "tok_per_s": round(batch * tokens / ms * 1e3, 1)})
        print(f"{phase:7s} B={batch:4d} tokens={batch * tokens:6d} forward {ms:9.3f} ms  " +
              "  ".join(f"{k} {v:.3f}" for k, v in stages.items()), flush=True)
    if args.out:
        import pandas as pd

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        pd.DataFrame(rows).to_csv(out / "stages.csv", index=False)
        pd.DataFrame(fwd).to_csv(out / "forward.csv", index=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
