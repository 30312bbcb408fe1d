"""Is the EP4 expert call's time a property of where its weights landed in memory? Builds the same experts (same
seed, same bytes) at several placements, each behind a spacer allocation of another size, and times the whole
call several times at each: a spread within one placement is run-to-run noise, a spread between placements that
repeats within each is the placement.

    python3 bench/gpu/placement_probe.py --tokens 16 --payloads nvfp4,bf16 --placements 6 --repeats 4
"""

from __future__ import annotations

import json
import datetime
import statistics

import torch

from pdlab._subcommands import arg_parser


def main() -> None:
    from pdlab.bench.moe_experts import make_layout, random_nvfp4_weights, time_runner

    ap = arg_parser()
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--payloads", default="nvfp4,bf16")
    ap.add_argument("--placements", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--stamp", action="store_true", help="also each timing's wall-clock end (to line up with a "
                    "clock / power log such as nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw -lms 200)")
    args = ap.parse_args()
    E, H, I, m, dev = args.experts, 7168, 2048, args.tokens, torch.device("cuda")
    gs = torch.tensor(2688.0 / 4.0, device=dev)
    layouts = {p: make_layout("masked", p, E, m, H, dev, gs) for p in args.payloads.split(",")}
    for placement in range(args.placements):
        spacer = torch.empty(placement * 37 * 2**20 + 1, dtype=torch.uint8, device=dev)  # moves what follows
        w = random_nvfp4_weights(E, H, I, dev, with_bf16=False).frag_()
        for payload, layout in layouts.items():
            times, stamps = [], []
            for _ in range(args.repeats):
                times.append(time_runner(layout, w, "triton", None, expected_m=m).median_ms * 1e3)
                stamps.append(datetime.datetime.now().strftime("%H:%M:%S.%f")[:-3])
            extra = {"ended": stamps} if args.stamp else {}
            print(json.dumps({**extra, "placement": placement, "spacer_mib": round(spacer.numel() / 2**20, 1),
                              "weights_ptr_mod_2mib": w.w13_weight.data_ptr() % 2**21, "payload": payload,
                              "tokens": m, "us": [round(t, 1) for t in times],
                              "median_us": round(statistics.median(times), 1)}), flush=True)
        del w, spacer
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
