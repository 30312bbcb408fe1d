"""Prefix caching on a GPU: greedy outputs with and without --enable-prefix-caching, and the prefill work and time
it saves, for requests that share a long system prompt (the embedded tiny DeepSeek-V3, so that it runs in seconds).

    python3 bench/gpu/prefix_cache.py --out DIR [--device cuda] [--system 1536] [--requests 16]
                                      [--model synthetic:deepseek-r1:2]

Writes prefix_cache.json (per run: wall time of the second wave, prefill tokens computed, cache hits, outputs equal
or not) and prints it. On CPU it runs too (small sizes), as a check of the script."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from pdlab._subcommands import arg_parser
from pdlab.runtime.core import SamplingParams
from pdlab.runtime.engine.loop import LLM
from pdlab.runtime.model import load_model


def run(model, tok, cfg, device: str, cache: bool, prompts: list[list[int]], params, dtype: str,
        one_by_one: bool = False) -> dict:
    """One run: the first prompt alone, then the rest (timed), batched or one request at a time."""
    llm = LLM(model=model, tokenizer=tok, model_config=cfg, device=device, dtype=dtype, page_size=64,
              max_total_tokens=64 * 1024, chunked_prefill_size=2048, max_prefill_tokens=8192, max_context_len=4096,
              enable_prefix_caching=cache, disable_cuda_graph=True, cuda_graph_max_prefill_tokens=0)
    first = llm.generate(prompts[:1], params)  # computes (and with the cache keeps) the system prompt
    computed = [0]
    real = llm.engine.forward

    def counting(batch):
        if not batch.is_decode:
            computed[0] += batch.num_tokens
        return real(batch)

    llm.engine.forward = counting
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    rest = [o for p in prompts[1:] for o in llm.generate([p], params)] if one_by_one else \
        llm.generate(prompts[1:], params)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    stats = llm.scheduler.stats()
    return {"prefix_caching": cache, "second_wave_s": wall, "second_wave_prefill_tokens": computed[0],
            "hit_tokens": stats.get("prefix_cache_hit_tokens", 0),
            "errors": [o["error"] for o in first + rest if o["error"]],
            "token_ids": [o["token_ids"] for o in first + rest]}


def main() -> int:
    p = arg_parser(prog="python3 bench/gpu/prefix_cache.py", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--system", type=int, default=None, help="system prompt tokens (GPU 1536, CPU 192)")
    p.add_argument("--requests", type=int, default=None, help="requests after the first (GPU 16, CPU 3)")
    p.add_argument("--model", default=None, help="synthetic:deepseek-r1:LAYERS (R1 widths, random weights) instead "
                   "of the embedded tiny model")
    args = p.parse_args()
    gpu = args.device.startswith("cuda")
    system_len = args.system or (1536 if gpu else 192)
    n = args.requests or (16 if gpu else 3)
    dtype = "bf16" if gpu else "fp32"
    torch_dtype = torch.bfloat16 if gpu else torch.float32
    if args.model:
        from pdlab.runtime.engine.synthetic import load_synthetic

        model, tok, cfg = load_synthetic(args.model, torch.device(args.device), torch_dtype)
    else:
        model, tok, cfg = load_model(None, torch.device(args.device), torch_dtype)
    vocab = int(cfg.vocab_size)
    system = [(37 * i + 11) % vocab for i in range(system_len)]
    prompts = [system + [(13 * i + 7 * k + 1) % vocab for i in range(32 + 8 * k)] for k in range(n + 1)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    runs = [run(model, tok, cfg, args.device, cache, prompts, params, dtype) for cache in (False, True, False, True)]
    off, on = runs[2], runs[3]  # the second pair: kernels compiled by the first
    single = run(model, tok, cfg, args.device, False, prompts, params, dtype, one_by_one=True)
    same = sum(a == b for a, b in zip(off["token_ids"], on["token_ids"]))
    # the control: without the cache, batched against one request at a time (bf16 results depend on the batch)
    same_single = sum(a == b for a, b in zip(off["token_ids"], single["token_ids"]))
    from pdlab.bench.report import git_commit

    result = {"device": torch.cuda.get_device_name() if gpu else "cpu", "model": args.model or "embedded tiny",
              "commit": git_commit(), "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "system_tokens": system_len,
              "requests": n + 1, "outputs_equal": f"{same}/{len(prompts)}",
              "outputs_equal_without_cache_batched_vs_one_by_one": f"{same_single}/{len(prompts)}",
              "prefill_tokens_off": off["second_wave_prefill_tokens"],
              "prefill_tokens_on": on["second_wave_prefill_tokens"], "hit_tokens": on["hit_tokens"],
              "second_wave_s_off": off["second_wave_s"], "second_wave_s_on": on["second_wave_s"],
              "speedup": off["second_wave_s"] / on["second_wave_s"], "errors": off["errors"] + on["errors"]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefix_cache.json").write_text(json.dumps({**result, "runs": [
        {k: v for k, v in r.items() if k != "token_ids"} for r in runs]}, indent=1))
    print(json.dumps(result, indent=1))
    return 0 if not result["errors"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
