"""`bench serving`: a load generator against any OpenAI-compatible server.

Random dataset: prompt and output lengths drawn uniformly from [len * range_ratio, len] (the
`sglang.bench_serving` convention), prompts of random token ids (decoded to text with --tokenizer, else
sent as a token-id list, which /v1/completions accepts). Shared-prefix dataset (`--dataset shared-prefix`): the
same, each prompt behind one of --shared-prefix-groups random "system prompts" of --shared-prefix-len tokens
(requests take the groups in turn), to measure a server's prefix caching. Requests arrive as a Poisson process at
--request-rate (inf = all at once), at most --max-concurrency in flight, always streamed.

Definitions (as `vllm bench serve` / `sglang.bench_serving`): TTFT = POST → first chunk carrying
choices; ITL = gaps between consecutive chunks carrying choices; TPOT = (latency − TTFT)/(output_tokens − 1);
E2E = POST → last chunk; goodput = requests meeting every SLO of --goodput (ms) per second.
Writes <out>/<tag>.json (summary + per request), <tag>.csv (per request), <tag>_summary.csv and
<tag>_latency.png (distributions), --tag serving by default, and prints each path it wrote.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

SLO_KEYS = ("ttft", "tpot", "e2e", "itl")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:30000", type=server_url,
                   help="server root, http://host:port (no /v1)")
    p.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    p.add_argument("--model", default=None, help="model id (default: the first of GET /v1/models)")
    p.add_argument("--dataset", default="random", choices=["random", "shared-prefix"],
                   help="random prompts, or random prompts behind shared system prompts (shared-prefix)")
    p.add_argument("--shared-prefix-len", type=int, default=2048,
                   help="shared-prefix: tokens of each system prompt (the random part follows it)")
    p.add_argument("--shared-prefix-groups", type=int, default=1,
                   help="shared-prefix: how many distinct system prompts (requests take them in turn)")
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len * ratio, len] (1.0 = fixed lengths)")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s, Poisson (inf = all at once)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--goodput", nargs="*", default=[], help="SLOs in ms, e.g. ttft:5000 tpot:50 (keys: ttft tpot e2e itl)")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json or HF directory to decode prompts into text")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="token-id range of random prompts (default: the tokenizer's, else the vocab_size GET /v1/models "
                        "publishes, else 1000)")
    p.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos (outputs may stop early)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--out", default=None, help="output folder (default bench/results/<device>/serving)")
    from pdlab.bench._args import add_no_plot, file_stem

    p.add_argument("--tag", default="serving", type=file_stem, help="file name stem of the outputs")
    add_no_plot(p)


def server_url(text: str) -> str:
    """An argparse `type`: a server root URL, http(s)://host[:port] (the usage error names the expected form)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(text)
        ok = parts.scheme in ("http", "https") and bool(parts.hostname) and (parts.port or 0) >= 0
    except ValueError:  # a port that is not a number, an unclosed [IPv6 bracket
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"{text!r} is not a server URL; expected http://host:port, e.g. "
                                         "http://127.0.0.1:30000")
    if parts.path.rstrip("/").endswith("/v1"):  # the endpoints are appended to it: /v1/v1/completions
        raise argparse.ArgumentTypeError(f"{text!r} is the API path, not the server root; drop the /v1 "
                                         "(expected http://host:port)")
    return text


@dataclass
class RequestResult:
    prompt_len: int
    output_len_requested: int
    success: bool = False
    error: str = ""
    ttft: float = 0.0  # seconds
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    usage_reported: bool = False
    start: float = 0.0

    @property
    def tpot(self) -> float | None:
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def parse_goodput(items: list[str]) -> dict[str, float]:
    """--goodput items KEY:MS → {key: ms}; ValueError naming the item for an unknown key, a value that is not a
    number > 0, or a key given twice."""
    slos: dict[str, float] = {}
    for it in items:
        key, _, val = it.partition(":")
        if key not in SLO_KEYS or not val:
            raise ValueError(f"--goodput item {it!r}: expected KEY:MS with KEY in {', '.join(SLO_KEYS)}")
        try:
            ms = float(val)
        except ValueError:
            raise ValueError(f"--goodput item {it!r}: {val!r} is not a number of ms; expected KEY:MS, e.g. "
                             "ttft:5000") from None
        if not ms > 0:  # zero, negative or nan: no request could meet it
            raise ValueError(f"--goodput {key} must be > 0 ms, got {val}")
        if key in slos:
            raise ValueError(f"--goodput names {key} twice ({slos[key]:g} and {ms:g}); give each SLO once")
        slos[key] = ms
    return slos


def random_requests(n: int, in_len: int, out_len: int, ratio: float, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    """n (prompt token ids, output length) pairs; lengths uniform in [len * ratio, len]."""
    if not (0.0 <= ratio <= 1.0):
        raise ValueError(f"--random-range-ratio must be in [0, 1], got {ratio:g}")
    rng = np.random.default_rng(seed)
    ins = rng.integers(max(1, int(in_len * ratio)), in_len + 1, size=n)
    outs = rng.integers(max(1, int(out_len * ratio)), out_len + 1, size=n)
    return [(rng.integers(0, vocab, size=int(i)).tolist(), int(o)) for i, o in zip(ins, outs)]


def shared_prefix_requests(n: int, groups: int, prefix_len: int, in_len: int, out_len: int, ratio: float, vocab: int,
                           seed: int) -> list[tuple[list[int], int]]:
    """As `random_requests`, each prompt behind system prompt i % groups (`groups` random prompts of prefix_len
    tokens)."""
    if groups < 1 or prefix_len < 1:
        raise ValueError(f"--shared-prefix-groups and --shared-prefix-len must be >= 1, got {groups} and {prefix_len}")
    rng = np.random.default_rng([seed, 1])
    prefixes = [rng.integers(0, vocab, size=prefix_len).tolist() for _ in range(groups)]
    return [(prefixes[i % groups] + ids, o)
            for i, (ids, o) in enumerate(random_requests(n, in_len, out_len, ratio, vocab, seed))]


def summarize(results: list[RequestResult], duration: float, slos: dict[str, float]) -> dict:
    """Aggregate metrics (ms for latencies) over successful requests."""
    ok = [r for r in results if r.success]
    def stats(xs: list[float], name: str) -> dict:
        a = np.asarray(xs, dtype=np.float64) * 1e3
        if a.size == 0:
            return {f"mean_{name}_ms": None, f"median_{name}_ms": None, f"p99_{name}_ms": None}
        return {f"mean_{name}_ms": float(a.mean()), f"median_{name}_ms": float(np.median(a)),
                f"p99_{name}_ms": float(np.percentile(a, 99))}
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    good = 0
    for r in ok:
        checks = {"ttft": r.ttft, "e2e": r.latency, "tpot": r.tpot or 0.0, "itl": max(r.itl, default=0.0)}
        if all(checks[k] * 1e3 <= v for k, v in slos.items()):
            good += 1
    s = {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
         "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
         "request_throughput": len(ok) / duration if duration > 0 else 0.0,
         "output_throughput": out_tokens / duration if duration > 0 else 0.0,
         "total_token_throughput": (in_tokens + out_tokens) / duration if duration > 0 else 0.0,
         "goodput": (good / duration if duration > 0 else 0.0) if slos else None, "slos_ms": slos,
         "usage_reported": all(r.usage_reported for r in ok) if ok else False}
    s.update(stats([r.ttft for r in ok], "ttft"))
    s.update(stats([r.tpot for r in ok if r.tpot is not None], "tpot"))
    s.update(stats([x for r in ok for x in r.itl], "itl"))
    s.update(stats([r.latency for r in ok], "e2e"))
    return s


async def _one(session, url: str, payload: dict, res: RequestResult, headers: dict, timeout: float) -> None:
    import aiohttp
    res.start = t0 = time.perf_counter()
    last = None
    chunks = 0
    try:
        async with session.post(url, json=payload, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return
            buf = b""
            async for data in resp.content.iter_any():
                buf += data.replace(b"\r\n", b"\n")  # SSE allows CRLF line ends
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    line = event.strip()
                    if not line.startswith(b"data:"):
                        continue
                    body = line[5:].strip()
                    if body == b"[DONE]":
                        continue
                    obj = json.loads(body)
                    if "error" in obj:
                        res.error = str(obj["error"])[:300]
                        return
                    now = time.perf_counter()
                    if obj.get("usage"):
                        res.output_tokens = int(obj["usage"].get("completion_tokens") or 0)
                        res.usage_reported = True
                    ch = obj.get("choices") or []
                    if not ch:
                        continue
                    # every chunk with choices is a token event (as `vllm bench serve` counts), also
                    # when its text is empty (token ids without text, held-back stop prefixes); only a
                    # chat role-only opening chunk is skipped
                    delta = ch[0].get("delta")
                    if delta is not None and "content" not in delta and ch[0].get("finish_reason") is None:
                        continue
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    chunks += 1
                    last = now
        res.latency = time.perf_counter() - t0
        if not res.usage_reported:
            res.output_tokens = chunks  # one chunk per token on servers that stream token by token
        res.success = last is not None or res.output_tokens > 0
        if not res.success:
            res.error = "stream ended without any content"
    except Exception as exc:  # network errors are results, not crashes of the benchmark
        res.error = f"{type(exc).__name__}: {exc}"[:300]


async def run_benchmark(args, prompts: list[tuple[object, int, int]], model: str) -> tuple[list[RequestResult], float]:
    import aiohttp
    url = args.base_url.rstrip("/") + args.endpoint
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    rng = np.random.default_rng(args.seed + 1)
    results = [RequestResult(prompt_len=pl, output_len_requested=ol) for _, pl, ol in prompts]

    async def launch(i, prompt, out_len, session):
        if args.endpoint.endswith("chat/completions"):
            payload = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": out_len}
        else:
            payload = {"model": model, "prompt": prompt, "max_tokens": out_len}
        payload.update(temperature=0.0, stream=True, stream_options={"include_usage": True})
        if not args.no_ignore_eos:
            payload["ignore_eos"] = True
        if sem is None:
            await _one(session, url, payload, results[i], headers, args.timeout)
        else:
            async with sem:
                await _one(session, url, payload, results[i], headers, args.timeout)

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        tasks = []
        t0 = time.perf_counter()
        for i, (prompt, _, out_len) in enumerate(prompts):
            tasks.append(asyncio.create_task(launch(i, prompt, out_len, session)))
            if math.isfinite(args.request_rate) and args.request_rate > 0 and i + 1 < len(prompts):
                await asyncio.sleep(float(rng.exponential(1.0 / args.request_rate)))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    return results, duration


def _get_model(args) -> dict:
    """The first model card of the server's GET /v1/models (id, and vocab_size where the server publishes it)."""
    import urllib.request
    req = urllib.request.Request(args.base_url.rstrip("/") + "/v1/models",
                                 headers={"Authorization": f"Bearer {args.api_key}"} if args.api_key else {})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())["data"][0]


def _load_tokenizer(path: str):
    from tokenizers import Tokenizer
    p = Path(path)
    return Tokenizer.from_file(str(p / "tokenizer.json" if p.is_dir() else p))


def plot_latency(results: list[RequestResult], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ok = [r for r in results if r.success]
    series = {"TTFT (ms)": [r.ttft * 1e3 for r in ok], "TPOT (ms)": [r.tpot * 1e3 for r in ok if r.tpot is not None],
              "ITL (ms)": [x * 1e3 for r in ok for x in r.itl], "E2E latency (ms)": [r.latency * 1e3 for r in ok]}
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (name, xs) in zip(axes.flat, series.items()):
        if xs:
            ax.hist(xs, bins=min(50, max(5, len(xs) // 4)), color="tab:blue", alpha=0.8)
            for q, style in ((50, "--"), (99, ":")):
                ax.axvline(float(np.percentile(xs, q)), color="k", linestyle=style, label=f"p{q}")
            ax.legend()
        ax.set_title(name)
        ax.set_ylabel("count")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    try:
        slos = parse_goodput(args.goodput)
        for name in ("random_input_len", "random_output_len", "num_prompts", "shared_prefix_len",
                     "shared_prefix_groups"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
        if args.max_concurrency is not None and args.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
        if args.vocab_size is not None and args.vocab_size < 1:  # 0 read as "not given"
            raise ValueError(f"--vocab-size must be >= 1, got {args.vocab_size}")
        if not args.timeout > 0:  # zero, negative or nan: every request would time out
            raise ValueError(f"--timeout must be > 0 seconds per request, got {args.timeout:g}")
        if not 0.0 <= args.random_range_ratio <= 1.0:
            raise ValueError(f"--random-range-ratio must be in [0, 1], got {args.random_range_ratio:g}")
        if args.dataset != "shared-prefix" and (args.shared_prefix_len != 2048 or args.shared_prefix_groups != 1):
            raise ValueError("--shared-prefix-len / --shared-prefix-groups shape the shared-prefix dataset; add "
                             "--dataset shared-prefix, or drop them")
        if not args.request_rate >= 0:  # negative or nan (0 and inf: all at once)
            raise ValueError(f"--request-rate must be >= 0 requests/s (inf: all at once), got {args.request_rate:g}")
        try:
            tok = _load_tokenizer(args.tokenizer) if args.tokenizer else None
        except Exception as exc:  # the tokenizers package's own errors name neither the option nor the path
            raise ValueError(f"--tokenizer {args.tokenizer}: {exc}; give a tokenizer.json or an HF model "
                             "folder holding one") from None
    except (ValueError, OSError, Exception) as exc:
        print(f"bench serving: {exc}", file=sys.stderr)
        return 2
    if args.endpoint.endswith("chat/completions") and tok is None:
        print("bench serving: the chat endpoint needs text prompts: pass --tokenizer", file=sys.stderr)
        return 2
    from pdlab.bench._args import out_dir_problem

    out = Path(args.out) if args.out else _default_out()
    problem = out_dir_problem(out)
    if problem:  # checked before the requests: the results would be lost at the end
        print(f"bench serving: --out {problem}; give a folder to write the results into", file=sys.stderr)
        return 2
    card: dict = {}
    if args.model is None or not (args.vocab_size or tok):
        try:
            card = _get_model(args)
        except Exception as exc:
            if args.model is None:
                print(f"bench serving: cannot reach {args.base_url}/v1/models ({exc}); is the server up? "
                      "(or pass --model)", file=sys.stderr)
                return 1
    model = args.model or card["id"]
    # token ids of random prompts: --vocab-size, the tokenizer's, the server's (pdlab and others that publish it)
    vocab = args.vocab_size or (tok.get_vocab_size() if tok else None) or card.get("vocab_size") or 1000
    try:
        if args.dataset == "shared-prefix":
            reqs = shared_prefix_requests(args.num_prompts, args.shared_prefix_groups, args.shared_prefix_len,
                                          args.random_input_len, args.random_output_len, args.random_range_ratio,
                                          int(vocab), args.seed)
        else:
            reqs = random_requests(args.num_prompts, args.random_input_len, args.random_output_len,
                                   args.random_range_ratio, int(vocab), args.seed)
    except ValueError as exc:
        print(f"bench serving: {exc}", file=sys.stderr)
        return 2
    prompts = [(tok.decode(ids) if tok else ids, len(ids), n) for ids, n in reqs]
    results, duration = asyncio.run(run_benchmark(args, prompts, model))
    summary = summarize(results, duration, slos)
    meta = {"base_url": args.base_url, "endpoint": args.endpoint, "model": model, "num_prompts": args.num_prompts,
            "dataset": args.dataset, **({"shared_prefix_len": args.shared_prefix_len,
                                         "shared_prefix_groups": args.shared_prefix_groups}
                                        if args.dataset == "shared-prefix" else {}),
            "random_input_len": args.random_input_len, "random_output_len": args.random_output_len,
            "random_range_ratio": args.random_range_ratio, "request_rate": args.request_rate,
            "max_concurrency": args.max_concurrency, "seed": args.seed,
            "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),  # as bench.report records it
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    out.mkdir(parents=True, exist_ok=True)
    rows = [{**{k: v for k, v in asdict(r).items() if k != "itl"}, "tpot": r.tpot,
             "max_itl": max(r.itl, default=None), "num_chunks": len(r.itl) + (1 if r.success else 0)} for r in results]
    import pandas as pd
    paths = [out / f"{args.tag}.json", out / f"{args.tag}.csv", out / f"{args.tag}_summary.csv"]
    paths[0].write_text(json.dumps({"meta": meta, "summary": summary, "requests": rows}, indent=1))
    pd.DataFrame(rows).to_csv(paths[1], index=False)
    pd.DataFrame([{**meta, **{k: v for k, v in summary.items() if k != "slos_ms"}}]).to_csv(paths[2], index=False)
    if not args.no_plot:
        paths.append(out / f"{args.tag}_latency.png")
        shared = f"{args.shared_prefix_len} shared + " if args.dataset == "shared-prefix" else ""
        plot_latency(results, paths[-1], f"{model} @ {args.base_url}: {args.num_prompts} req, in "
                     f"{shared}{args.random_input_len}, out {args.random_output_len}")
    _print(summary)
    errors = [r.error for r in results if not r.success]
    if errors:
        print(f"{len(errors)} request(s) failed; first error: {errors[0]}", file=sys.stderr)
    for path in paths:
        print(f"wrote {path}")
    return 0 if summary["completed"] > 0 else 1


def _default_out() -> Path:
    try:
        from pdlab.bench.report import default_out_dir
        return default_out_dir("serving")
    except Exception:
        return Path("bench/results/serving")


def _print(s: dict) -> None:
    print("============ serving benchmark ============")
    for k in ("completed", "failed", "duration_s", "total_input_tokens", "total_output_tokens", "request_throughput",
              "output_throughput", "total_token_throughput", "goodput"):
        print(f"{k:<28} {s[k] if not isinstance(s[k], float) else round(s[k], 3)}")
    for m in ("ttft", "tpot", "itl", "e2e"):
        vals = [s[f"{q}_{m}_ms"] for q in ("mean", "median", "p99")]
        print(f"{m.upper():<5} ms  mean / median / p99   " + " / ".join("-" if v is None else f"{v:.2f}" for v in vals))
