"""The fp8 two-warpgroup MLA decode test (tests/attention/test_gluon_mla_wide.py,
test_gpu_seesaw_decode_over_fp8_matches_the_reference) over many seeds instead of one: each of its five cases at
seed 4064410839 (sequence 0 holds two near-tied tokens) and at --seeds more; prints each failure and a count. The
cases are the test's own (its parametrize mark).

    python3 bench/gpu/seesaw_fp8_seeds.py --seeds 24
"""

from __future__ import annotations

import os
import random
import sys

from pdlab._subcommands import arg_parser


def main() -> None:
    ap = arg_parser()
    ap.add_argument("--seeds", type=int, default=24)
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests", "attention"))
    import test_gluon_mla_wide as T

    test = T.test_gpu_seesaw_decode_over_fp8_matches_the_reference
    cases = next(m.args[1] for m in test.pytestmark if m.name == "parametrize")
    seeds = [4064410839] + [random.Random(7000 + i).getrandbits(32) for i in range(args.seeds)]
    runs = failed = 0
    for seed in seeds:
        for case in cases:
            runs += 1
            try:
                test(*case, seed)
            except AssertionError as e:
                failed += 1
                print("FAIL", seed, case[:4], str(e)[:300], flush=True)
    print(f"{runs} runs ({len(seeds)} seeds x {len(cases)} cases), {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
