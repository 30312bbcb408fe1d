"""What a CUDA-graph capture invalidated by a host sync leaves behind, with torch's own `torch.cuda.graph` and with
pdlab's `capture_graph`: whether the caller's stream is current again and whether a random op works afterwards.
Each way runs in a process of its own (the first one may leave its process unusable). Prints one JSON line each.

    python3 -m pdlab.bench.gpu.capture_failure_probe
"""

from __future__ import annotations

import json
import subprocess
import sys

import torch


def probe(way: str) -> dict:
    from pdlab.kernels.graphs import capture_graph

    enter = torch.cuda.graph if way == "torch.cuda.graph" else capture_graph
    before = torch.cuda.current_stream()
    x = torch.ones(4, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(before)
    g = torch.cuda.CUDAGraph()
    out = {"way": way, "torch": torch.__version__}
    try:
        with enter(g, stream=side):
            (x * 2).sum().item()
        out["capture"] = "no error"
    except Exception as exc:
        out["capture"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    out["caller_stream_current"] = torch.cuda.current_stream() == before
    try:
        torch.rand(8, device="cuda")
        out["random_op"] = "ok"
    except Exception as exc:
        out["random_op"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    return out


def main() -> None:
    if len(sys.argv) > 1:
        print(json.dumps(probe(sys.argv[1])), flush=True)
        return
    for way in ("torch.cuda.graph", "pdlab.kernels.graphs.capture_graph"):
        r = subprocess.run([sys.executable, "-m", "pdlab.bench.gpu.capture_failure_probe", way], capture_output=True,
                           text=True)
        print(r.stdout.strip() or json.dumps({"way": way, "rc": r.returncode, "stderr": r.stderr[-400:]}))


if __name__ == "__main__":
    main()
