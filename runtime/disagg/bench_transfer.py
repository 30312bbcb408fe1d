"""KV transfer bandwidth: move the KV of one N-token prompt (all layers) from a prefill pool to a
decode pool in another process through a transfer backend, against a plain copy of the same bytes
between the same devices (the ceiling).

    python -m pdlab.runtime.disagg.bench_transfer --tokens 8192 --layers 61 --src cuda:0 --dst cuda:1
    python -m pdlab.runtime.disagg.bench_transfer --tokens 512 --layers 4 --src cpu --dst cpu   # smoke

Pools are [num_pages, page_size, 576] per layer (bf16, or fp8 bytes). The prompt's pages are
scattered (a random permutation on both sides), as in a busy server. Results: one row per method
(bytes, median / p10 / p90 ms, GB/s) printed and written as JSON + CSV to --out.
"""

from __future__ import annotations

import csv
import json
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path

import torch

from pdlab._subcommands import arg_parser


def _pools(layers: int, pages: int, page: int, dtype: torch.dtype, device: str, fill: bool) -> list[torch.Tensor]:
    if dtype == torch.uint8:
        return [(torch.randint(0, 120, (pages, page, 576), dtype=torch.uint8, device=device) if fill else
                 torch.zeros(pages, page, 576, dtype=torch.uint8, device=device)) for _ in range(layers)]
    return [(torch.randn(pages, page, 576, device=device).to(dtype) if fill else
             torch.zeros(pages, page, 576, dtype=dtype, device=device)) for _ in range(layers)]


def _decode_side(args: dict, q_meta, q_done) -> None:
    from pdlab.runtime.disagg.transfer.base import create_transfer

    dtype = torch.uint8 if args["kv_dtype"] == "fp8" else torch.bfloat16
    pool = _pools(args["layers"], args["pages"], args["page_size"], dtype, args["dst"], fill=False)
    t = create_transfer(args["backend"], f"bench-decode-{args['tag']}", layer_group_size=args["group"])
    q_meta.put(t.register(pool, 1.0 if dtype == torch.uint8 else None))
    n = 0
    for _ in range(args["repeats"] + args["warmup"]):
        t.wait_notification(f"x{n}", timeout=120)
        n += 1
    # correctness of the last transfer: the pages got the source's bytes (checked by the sender's checksum)
    idx = torch.tensor(args["dst_pages"], device=args["dst"])
    sums = [float(p.index_select(0, idx).float().sum()) for p in pool]
    q_done.put(sums)
    t.close()
    q_done.close()
    q_done.join_thread()
    # NOTE: a process whose file_system-shared tensors are still mapped by another process hangs in
    # interpreter exit (torch's shm refcounting); leave without the exit handlers
    os._exit(0)


def run(tokens: int, layers: int, page_size: int, kv_dtype: str, src: str, dst: str, backend: str,
        group: int, repeats: int, warmup: int) -> list[dict]:
    n_pages = -(-tokens // page_size)
    pool_pages = n_pages * 2
    g = torch.Generator().manual_seed(0)
    src_pages = torch.randperm(pool_pages, generator=g)[:n_pages].tolist()
    dst_pages = torch.randperm(pool_pages, generator=g)[:n_pages].tolist()
    tag = f"{int(time.time() * 1000) % 10**8}"
    args = dict(layers=layers, pages=pool_pages, page_size=page_size, kv_dtype=kv_dtype, dst=dst, backend=backend,
                group=group, repeats=repeats, warmup=warmup, tag=tag, dst_pages=dst_pages)
    ctx = mp.get_context("spawn")
    q_meta, q_done = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_decode_side, args=(args, q_meta, q_done), daemon=True)
    child.start()
    from pdlab.runtime.disagg.transfer.base import create_transfer

    dtype = torch.uint8 if kv_dtype == "fp8" else torch.bfloat16
    pool = _pools(layers, pool_pages, page_size, dtype, src, fill=True)
    t = create_transfer(backend, f"bench-prefill-{tag}", layer_group_size=group)
    t.register(pool, 1.0 if dtype == torch.uint8 else None)
    meta = _get(q_meta, child, 300)
    peer = t.add_peer(meta)
    nbytes = n_pages * page_size * 576 * pool[0].element_size() * layers
    times = []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        h = t.send_pages(peer, f"x{i}", src_pages, dst_pages, tokens, notify={})
        t.wait(h, timeout=120)
        if src.startswith("cuda"):
            torch.cuda.synchronize(src)
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
        t.release(h)
    sums = _get(q_done, child, 300)
    _join(child, 30)
    idx = torch.tensor(src_pages, device=src)
    want = [float(p.index_select(0, idx).float().sum()) for p in pool]
    ok = all(abs(a - b) <= 1e-3 * max(1.0, abs(b)) for a, b in zip(sums, want))
    rows = [_row(f"{backend} transfer ({n_pages} scattered pages x {layers} layers, group {group})",
                 nbytes, times, src, dst, ok)]
    # ceiling: one contiguous copy of the same bytes between the same devices
    a = torch.empty(nbytes, dtype=torch.uint8, device=src)
    b = torch.empty(nbytes, dtype=torch.uint8, device=dst)
    ctimes = []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        b.copy_(a, non_blocking=True)
        for d in {src, dst}:
            if d.startswith("cuda"):
                torch.cuda.synchronize(d)
        if i >= warmup:
            ctimes.append((time.perf_counter() - t0) * 1e3)
    rows.append(_row("contiguous copy (ceiling)", nbytes, ctimes, src, dst, True))
    t.close()
    return rows


def _join(proc, timeout: float) -> None:
    """Wait for a process by its pid, not its sentinel pipe: a helper it forked (torch_shm_manager)
    can hold that pipe open long after the process itself exited."""
    deadline = time.monotonic() + timeout
    while proc.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)


def _get(q, child, timeout: float):
    """q.get that fails at once (instead of after `timeout`) when the child process died."""
    import queue

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return q.get(timeout=0.5)
        except queue.Empty:
            if not child.is_alive():
                raise RuntimeError(f"the decode-side process died (exit code {child.exitcode}); see its stderr")
    raise TimeoutError(f"no answer from the decode-side process within {timeout} s")


def _row(method, nbytes, times, src, dst, ok) -> dict:
    med = statistics.median(times)
    q = sorted(times)
    return {"method": method, "src": src, "dst": dst, "bytes": nbytes, "median_ms": round(med, 4),
            "p10_ms": round(q[len(q) // 10], 4), "p90_ms": round(q[(len(q) * 9) // 10], 4),
            "gb_per_s": round(nbytes / med / 1e6, 2), "correct": ok}


def main(argv: list[str] | None = None) -> int:
    p = arg_parser(prog="python -m pdlab.runtime.disagg.bench_transfer",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--layers", type=int, default=61, help="KV layers (DeepSeek-R1: 61)")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--kv-dtype", choices=["bf16", "fp8"], default="bf16")
    p.add_argument("--src", default="cuda:0")
    p.add_argument("--dst", default="cuda:1")
    p.add_argument("--backend", choices=["local", "nixl"], default="local")
    p.add_argument("--group", type=int, default=8, help="layers per batched copy")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default=None, help="folder for kv_transfer.json / .csv")
    a = p.parse_args(argv)
    rows = run(a.tokens, a.layers, a.page_size, a.kv_dtype, a.src, a.dst, a.backend, a.group, a.repeats, a.warmup)
    for r in rows:
        print(f"{r['method']:<60} {r['bytes'] / 1e6:9.1f} MB  {r['median_ms']:9.3f} ms  {r['gb_per_s']:8.2f} GB/s"
              f"  correct={r['correct']}")
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = {"tokens": a.tokens, "layers": a.layers, "page_size": a.page_size, "kv_dtype": a.kv_dtype,
                "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
        (out / "kv_transfer.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
        with open(out / "kv_transfer.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    return 0 if all(r["correct"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
