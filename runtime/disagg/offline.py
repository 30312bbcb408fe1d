"""Disaggregated generation inside one process: a prefill engine and a decode engine (same or
different devices), each with its own scheduler, KV pool and role, joined by a KV transfer backend
and a direct control link. Used by the tests and the GPU checks to compare, token for token, with
the colocated `LLM`; servers use the same roles over HTTP (see launch.py).
"""

from __future__ import annotations

import time
import uuid

from pdlab.runtime.core import Req, SamplingParams
from pdlab.runtime.disagg.roles import DecodeRole, PrefillRole
from pdlab.runtime.disagg.transfer.base import create_transfer
from pdlab.runtime.engine.loop import LLM, collect_output


class DirectLink:
    """PeerLink for roles in one process: prefill address -> PrefillRole."""

    def __init__(self, prefills: dict[str, PrefillRole]):
        self.prefills = prefills

    def send_pages(self, prefill: str, msg: dict) -> None:
        if prefill not in self.prefills:
            raise ConnectionError(f"no prefill server at {prefill!r}")
        self.prefills[prefill].on_pages(msg["transfer_id"], msg["decode_meta"], msg["pages"])

    def send_abort(self, prefill: str, transfer_id: str) -> None:
        if prefill in self.prefills:
            self.prefills[prefill].abort(transfer_id)


class DisaggLLM:
    """`prefill` / `decode`: keyword settings of each side's `LLM` (SchedulerConfig fields, plus
    model/tokenizer/model_config objects); `transfer`: "local" or "nixl"."""

    def __init__(self, prefill: dict, decode: dict, *, transfer: str = "local", transfer_timeout: float = 30.0,
                 convert: bool = False, layer_group_size: int = 8):
        tag = uuid.uuid4().hex[:8]
        self.prefill_role = PrefillRole(create_transfer(transfer, f"prefill-{tag}", convert=convert,
                                                        layer_group_size=layer_group_size),
                                        transfer_timeout=transfer_timeout)
        self.link = DirectLink({"prefill-0": self.prefill_role})
        self.decode_role = DecodeRole(create_transfer(transfer, f"decode-{tag}", layer_group_size=layer_group_size),
                                      self.link, transfer_timeout=transfer_timeout)
        self.prefill = LLM(hooks=self.prefill_role, role="prefill", **prefill)
        self.decode = LLM(hooks=self.decode_role, role="decode", **decode)
        self.prefill_role.attach(self.prefill.loop)
        self.decode_role.attach(self.decode.loop)

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 timeout: float = 120.0, prefill: list[str] | None = None) -> list[dict]:
        """Like `LLM.generate`: per prompt {token_ids, text, logprobs, finish_reason, error, num_retractions,
        transfer_id}. `prefill`: per prompt the prefill address in `self.link` (default "prefill-0")."""
        params = params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        results, reqs = {}, []
        addrs = prefill or ["prefill-0"] * len(prompts)
        for p, sp, addr in zip(prompts, plist, addrs):
            ids = self.decode.codec.encode(p) if isinstance(p, str) else list(p)
            tid = f"t-{uuid.uuid4().hex[:12]}"
            res = results[tid] = {"text": "", "token_ids": [], "logprobs": [], "finish_reason": None, "error": None,
                                  "transfer_id": tid}
            req = Req(ids, sp, rid=tid)
            reqs.append(req)
            self.decode_role.submit(req, tid, addr, lambda out, res=res: collect_output(res, out))
            if addr in self.link.prefills:
                self.link.prefills[addr].submit(Req(ids, sp, rid=tid), tid)
        deadline = time.monotonic() + timeout
        while any(r["finish_reason"] is None for r in results.values()):
            busy = self.prefill.loop.run_once()
            busy = self.decode.loop.run_once() or busy
            if time.monotonic() > deadline:
                raise TimeoutError(f"disaggregated generate() not done after {timeout} s: "
                                   f"{self.decode_role.metrics.snapshot()['current']}")
            if not busy:
                time.sleep(0.0005)
        for req in reqs:
            results[req.rid]["num_retractions"] = req.num_retractions
        return [results[r.rid] for r in reqs]

    def close(self) -> None:
        self.decode_role.close()
        self.prefill_role.transfer.close()
        self.decode_role.transfer.close()

