"""Greedy outputs of a server for a fixed batch of varied prompts (short, page-boundary lengths,
longer than one prefill chunk), to compare a disaggregated deployment with a colocated one token
for token.

    python -m pdlab.runtime.disagg.greedy_check --base-url http://127.0.0.1:30000 --out colocated.json
    python -m pdlab.runtime.disagg.greedy_check --base-url http://127.0.0.1:8000 --out disagg.json
    python -m pdlab.runtime.disagg.greedy_check --compare colocated.json disagg.json   # rc 0 iff equal
"""

from __future__ import annotations

import json
import random
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx

from pdlab._subcommands import arg_parser


def prompts(page_size: int, chunk: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lens = [1, 2, 7, page_size - 1, page_size, page_size + 1, 2 * page_size, chunk - 1, chunk + 1,
            chunk + page_size + 3]
    return [[rng.randrange(vocab) for _ in range(n)] for n in lens]


def collect(base_url: str, batch: list[list[int]], max_new: int, concurrency: int = 1) -> list[list[int]]:
    """Greedy output ids per prompt. concurrency 1 keeps decode batches at size 1 on every server, so
    bf16 kernels see the same shapes on both deployments (batch-dependent rounding cannot differ)."""
    with httpx.Client(timeout=600) as c:
        def one(ids):
            r = c.post(f"{base_url}/generate", json={"input_ids": ids, "sampling_params": {
                "temperature": 0.0, "max_new_tokens": max_new, "ignore_eos": True}})
            r.raise_for_status()
            return r.json()["output_ids"]

        with ThreadPoolExecutor(concurrency) as ex:
            return list(ex.map(one, batch))


def main(argv: list[str] | None = None) -> int:
    p = arg_parser(prog="python -m pdlab.runtime.disagg.greedy_check",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url")
    p.add_argument("--out")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"))
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--chunk", type=int, default=512, help="the servers' --chunked-prefill-size")
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=1, help="requests in flight at once")
    a = p.parse_args(argv)
    if a.compare:
        x, y = (json.load(open(f)) for f in a.compare)
        same = [u == v for u, v in zip(x["outputs"], y["outputs"])]
        print(json.dumps({"equal": all(same) and len(x["outputs"]) == len(y["outputs"]),
                          "per_prompt": same, "prompt_lens": x["prompt_lens"]}))
        return 0 if all(same) else 1
    batch = prompts(a.page_size, a.chunk, a.vocab)
    outs = collect(a.base_url, batch, a.max_new_tokens, a.concurrency)
    rec = {"base_url": a.base_url, "prompt_lens": [len(b) for b in batch], "outputs": outs}
    if a.out:
        json.dump(rec, open(a.out, "w"))
    print(json.dumps({"prompt_lens": rec["prompt_lens"], "first_outputs": [o[:4] for o in outs]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
