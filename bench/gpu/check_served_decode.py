"""Check every triton `mla_decode` call of a served run against the torch reference (GPU).

Runs the fp8 retraction scenario (`fp8_retraction_pools`, which tests/runtime/test_engine_gpu.py runs too: a
pool large enough for every request, then one so tight that a request is retracted and re-prefilled) with the configs of the tuned
store (PDLAB_CONFIG_DIR, then the shipped files), in eager mode so that each decode call passes through
Python, and compares each call's output and lse with the torch fp32 reference on the same inputs
(`bench.harness.reference_checked`); then the same runs with CUDA graphs, for the token outcome.

    python3 bench/gpu/check_served_decode.py --out DIR [--pinned] [--fuzz N]

--pinned runs both pools again with every decode call under one config (each config the store chose,
the backend default, and the torch reference as the decode kernel): it tells a retraction that loses
KV (the pinned pools part) from correct kernels that round differently (the pinned pools agree, the
large-pool runs of two configs part). --fuzz N runs N random decode problems per chosen config shaped
like the served ones (4 heads, page 64, a 512-token block table, ragged lengths, NaN or random bytes
past each length, kv_scale as a float and as a tensor). Writes DIR/served_decode.json (+ the inputs of
calls with cosine error above 1e-4).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from pdlab.attention import ops  # noqa: F401  (registers the backends)
from pdlab.bench.harness import cosine_error, reference_checked
from pdlab.kernels import registry
from pdlab.runtime.core import SamplingParams
from pdlab.runtime.engine.loop import LLM
from pdlab._subcommands import arg_parser

BAD = 1e-4


def served_llm(**kw):
    """The embedded model on CUDA as the engine GPU tests serve it: page 64, 512-token contexts, 8 running."""
    return LLM(device="cuda", page_size=64, max_context_len=512, max_running_requests=8, **kw)


def fp8_retraction_pools(graphs: bool = True):
    """The fp8 retraction scenario: six prompts of 30–63 tokens, 24 greedy tokens each with 2 logprobs, once
    in a pool large enough for all (8192 tokens), once in one of 576 tokens (requests are retracted and
    re-prefilled). Returns (large-pool outputs, tight-pool outputs, retractions in the tight pool)."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (50, 57, 44, 61, 30, 63)]
    kw = dict(kv_dtype="fp8", kv_scale=0.05, chunked_prefill_size=32, max_prefill_tokens=64,
              disable_cuda_graph=not graphs)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    ref = served_llm(max_total_tokens=8192, **kw).generate(prompts, sp)
    tight = served_llm(max_total_tokens=512 + 64, decode_reserve_tokens=0, **kw)
    return ref, tight.generate(prompts, sp), tight.scheduler.num_retractions


def compare(ref, got) -> dict:
    """Where two greedy runs part (per request), and how far their chosen-token logprobs were apart
    before that: a near-tie parting after logprobs agreed to ~1e-3 is rounding; a clear margin is not."""
    parts, drift = [], 0.0
    for n, (r, o) in enumerate(zip(ref, got)):
        a, b = r["token_ids"], o["token_ids"]
        i = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), None)
        upto = len(a) if i is None else i
        d = [abs(r["logprobs"][k][0] - o["logprobs"][k][0]) for k in range(upto)]
        drift = max([drift] + d)
        if i is not None:
            parts.append({"request": n, "token": i, "ref": a[i], "got": b[i], "ref_top2": r["logprobs"][i][1][:2],
                          "got_top2": o["logprobs"][i][1][:2], "lp_diff_before": [round(x, 5) for x in d[-6:]]})
    return {"equal": not parts, "parts": parts, "max_lp_diff_while_equal": drift}


def _scenario(graphs: bool):
    ref, got, retr = fp8_retraction_pools(graphs)
    return {"graphs": graphs, "retractions": retr, **compare(ref, got)}


def _fuzz(configs: list[dict], n: int, seed: int = 0) -> list[dict]:
    """n random problems per config shaped like the served ones; each problem once with NaN past every
    length and once with random bytes there, and with kv_scale as a float and as a 1-element tensor."""
    from pdlab.attention.workloads import decode_problem

    tri = registry.get_backend("mla_decode", "triton").impl
    ref = registry.get_backend("mla_decode", "torch").impl
    rng = random.Random(seed)
    rows = []
    for cfg in configs:
        worst = {"config": cfg, "problems": 0, "max_err_out": 0.0, "max_err_lse": 0.0, "bad": []}
        for i in range(n):
            B = rng.randint(1, 8)
            lens = [rng.choice([1, 17, 63, 64, 65, 80, 81, 128, 129, rng.randint(1, 512)]) for _ in range(B)]
            for poison in (True, False):
                p = decode_problem(lens, 4, 1, 64, torch.bfloat16, kv_dtype="fp8", device="cuda", capacity=512,
                                   poison=poison, seed=seed * 100003 + i)
                scale = p.kv_scale if i % 2 else torch.tensor([p.kv_scale], device="cuda")
                o, lse = tri(p.q, p.kv_cache, p.block_table, p.seqlens, p.softmax_scale, kv_scale=scale, config=cfg)
                ro, rl = ref(p.q, p.kv_cache, p.block_table, p.seqlens, p.softmax_scale, kv_scale=p.kv_scale)
                e_o, e_l = cosine_error(o, ro), cosine_error(lse, rl)
                worst["problems"] += 1
                worst["max_err_out"] = max(worst["max_err_out"], e_o)
                worst["max_err_lse"] = max(worst["max_err_lse"], e_l)
                if (e_o > BAD or e_l > BAD) and len(worst["bad"]) < 5:
                    worst["bad"].append({"lens": lens, "poison": poison, "err_out": e_o, "err_lse": e_l})
        rows.append(worst)
        print("FUZZ", json.dumps({k: worst[k] for k in ("config", "max_err_out", "max_err_lse")}), len(worst["bad"]))
    return rows


def _pinned(tri, configs: list[dict]) -> list[dict]:
    """Both pools (eager) with every decode call run under one config; each large-pool run is also
    compared with the large-pool run of the first config (rounding of different, correct kernels)."""
    torch_ref = registry.get_backend("mla_decode", "torch").impl
    orig = tri.impl
    rows, base = [], None
    for cfg in configs + [None, "torch"]:
        if cfg == "torch":  # the fp32 reference as the decode kernel
            tri.impl = lambda *a, config=None, kv_scale=None: torch_ref(*a, kv_scale=kv_scale)
        else:
            tri.impl = lambda *a, config=None, _c=cfg, **k: orig(*a, config=_c, **k)
        try:
            ref, got, retr = fp8_retraction_pools(graphs=False)
        finally:
            tri.impl = orig
        row = {"config": cfg or "default", "retractions": retr, "tight_vs_large": compare(ref, got)}
        if base is None:
            base = ref
        else:
            row["large_vs_first_config"] = compare(base, ref)
        rows.append(row)
        print("PINNED", json.dumps(row, default=str))
    return rows


def main() -> None:
    ap = arg_parser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--pinned", action="store_true",
                    help="also run both pools with every decode call pinned to one config (each config seen, and "
                         "the default): separates retraction from configs that change with the batch size")
    ap.add_argument("--fuzz", type=int, default=0, help="random problems per config seen (0: none)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    tri = registry.get_backend("mla_decode", "triton")
    with reference_checked("mla_decode", "triton", dump_dir=str(out)) as calls:
        eager = _scenario(graphs=False)
    graphs = _scenario(graphs=True)
    bad = [c for c in calls if not all(e <= BAD for e in c["errors"])]
    configs = sorted({json.dumps(c["config"], sort_keys=True) for c in calls})
    summary = {"eager": eager, "graphs": graphs, "decode_calls": len(calls), "bad_calls": len(bad),
               "max_err": max((max(c["errors"]) for c in calls), default=0.0),
               "configs_seen": [json.loads(c) for c in configs], "first_bad": bad[:8]}
    if args.pinned:
        summary["pinned"] = _pinned(tri, summary["configs_seen"])
    if args.fuzz:
        summary["fuzz"] = _fuzz(summary["configs_seen"], args.fuzz)
    (out / "served_decode.json").write_text(json.dumps(summary, indent=1, default=str))
    print(json.dumps({k: summary[k] for k in ("eager", "graphs", "decode_calls", "bad_calls", "max_err")},
                     default=str))
    for c in bad[:8]:
        print("BAD", c)


if __name__ == "__main__":
    main()
