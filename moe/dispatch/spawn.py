"""Start N ranks of a function on this host (torch.distributed: NCCL on GPUs, gloo on CPU).

A rank that raises surfaces in the parent as `RankFailed` carrying that rank's own traceback (never
an EOFError or a hang); the other ranks are terminated. Results come back pickled through
torch.save, so they may hold tensors.
"""

from __future__ import annotations

import io
import os
import queue
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch


class RankFailed(RuntimeError):
    """A spawned rank raised or died. Attributes: rank, remote_traceback (text), exitcode."""

    def __init__(self, rank: int, remote_traceback: str, exitcode: int | None = None):
        self.rank, self.remote_traceback, self.exitcode = rank, remote_traceback, exitcode
        super().__init__(f"rank {rank} failed" + (f" (exit code {exitcode})" if exitcode is not None else "")
                         + f"; its traceback:\n{remote_traceback}")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, kwargs: dict[str, Any] | None = None,
              backend: str | None = None, timeout_s: float = 300.0, env: dict[str, str] | None = None
              ) -> list[Any]:
    """Run `fn(rank, world_size, *args, **kwargs)` in `world_size` spawned processes with the default process
    group initialised (`backend`: "nccl" when CUDA has enough GPUs, else "gloo"; each NCCL rank uses
    cuda:rank). `fn` must be importable (a module-level function). Returns the results by rank.
    Raises RankFailed (first failing rank, with its traceback) or TimeoutError after `timeout_s`."""
    import torch.multiprocessing as mp

    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise RuntimeError(f"{world_size} NCCL ranks need {world_size} GPUs; this machine has "
                           f"{torch.cuda.device_count()}. Use --ep {max(torch.cuda.device_count(), 1)} or gloo on CPU")
    ctx = mp.get_context("spawn")
    results_q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(fn, rank, world_size, port, backend, timeout_s, args,
                                                  kwargs or {}, results_q, env or {}), daemon=True)
             for rank in range(world_size)]
    for p in procs:
        p.start()
    # a SIGTERM to this process (e.g. `timeout`) must still stop the ranks: turn it into an exception
    # so the `finally` below terminates them instead of leaving them holding the GPUs
    previous = _install_sigterm()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world_size:
            try:
                status, rank, blob = results_q.get(timeout=0.5)
            except queue.Empty:
                for rank, p in enumerate(procs):
                    if rank not in results and p.exitcode not in (None, 0):
                        # give a dying rank a moment to deliver its traceback
                        try:
                            status, r2, blob = results_q.get(timeout=2.0)
                        except queue.Empty:
                            raise RankFailed(rank, "(no traceback: the process died without reporting, e.g. "
                                             "killed or crashed in native code)", p.exitcode) from None
                        if status == "error":
                            raise RankFailed(r2, blob)
                        results[r2] = torch.load(io.BytesIO(blob), weights_only=False)
                        break
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(results))
                    raise TimeoutError(f"ranks {missing} of {world_size} did not finish within {timeout_s:g} s")
                continue
            if status == "error":
                raise RankFailed(rank, blob)
            results[rank] = torch.load(io.BytesIO(blob), weights_only=False)
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        _restore_sigterm(previous)
    return [results[r] for r in range(world_size)]


def _install_sigterm():
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None

    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}: stopping the spawned ranks")

    return signal.signal(signal.SIGTERM, on_term)


def _restore_sigterm(previous) -> None:
    import signal
    import threading

    if previous is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, previous)


def _worker(fn, rank, world_size, port, backend, timeout_s, args, kwargs, results_q, env) -> None:
    import torch.distributed as dist

    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    for key in ("NCCL_NVLS_ENABLE",):
        os.environ.setdefault(key, "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    try:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        pg_kwargs = {}
        if backend == "nccl":
            torch.cuda.set_device(rank)
            pg_kwargs["device_id"] = torch.device("cuda", rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=max(30.0, timeout_s)), **pg_kwargs)
        result = fn(rank, world_size, *args, **kwargs)
        buf = io.BytesIO()
        torch.save(result, buf)
        results_q.put(("ok", rank, buf.getvalue()))
    except BaseException:  # report everything, including KeyboardInterrupt/SystemExit
        results_q.put(("error", rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
