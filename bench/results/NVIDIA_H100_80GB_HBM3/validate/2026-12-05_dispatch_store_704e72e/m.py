"""Host time per low-latency local dispatch of 1 token (R1 shapes, bf16): store-read vs explicit config."""
import time

import torch

from pdlab.moe.dispatch import create_dispatcher

H, E, K = 7168, 256, 8
x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
ids = torch.randperm(E, device="cuda")[:K].view(1, K).int()
w = torch.rand(1, K, device="cuda")
for label, cfg in (("store", None), ("explicit", {"chunk_rows": 4096}), ("store", None),
                   ("explicit", {"chunk_rows": 4096})):
    d = create_dispatcher("local", E, H, mode="low_latency", config=cfg)
    for _ in range(50):
        d.dispatch(x, ids, w, "bf16")
    torch.cuda.synchronize()
    t, n = time.perf_counter(), 2000
    for _ in range(n):
        layout, h = d.dispatch(x, ids, w, "bf16")
    torch.cuda.synchronize()
    print(label, h.config_source.split(":")[0], "host us/call %.1f" % ((time.perf_counter() - t) / n * 1e6))
