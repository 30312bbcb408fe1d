"""Scheduler: continuous batching over one engine. One `step()` = schedule → engine.forward →
post-process (append tokens, stop checks, free finished requests, emit `StepOutput`s).

Policy per step: a prefill step when the prefill manager can admit or continue something (chunked
requests alternate with decode steps so running decodes are never starved by a long prompt),
otherwise a decode step over every running request. Decode steps first make sure each request has a
page for its next token, retracting victims (retract.py) when the pool runs dry.

Roles (issue: prefill/decode disaggregation): `role="colocated"` runs both phases. A `RoleHooks`
object plugs the other cases in without subclassing: after a request's prompt is computed and its
first token sampled, `hooks.on_prefill_done(sched, req)` may take the request over (prefill role:
its pages stay allocated until `release(rid)`); a decode server admits requests whose KV a peer
writes with `preallocate(req)` → `kv_ready(rid, first_token)` / `kv_failed(rid, why)`.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import logging
import os
import time
from typing import Callable

from pdlab.runtime.config import SchedulerConfig
from pdlab.runtime.core import (Batch, FinishReason, Req, ReqStatus, RequestError, SamplingParams, StepOutput,
                               bad_logits_error, filler_ids)
from pdlab.kernels.env import ENV
from pdlab.runtime.scheduler.decode import DecodeManager
from pdlab.runtime.scheduler.output import TextCodec, process_token
from pdlab.runtime.scheduler.prefill import PrefillManager
from pdlab.runtime.scheduler.retract import pick_victim, retract

log = logging.getLogger("pdlab.runtime")


class RoleHooks:
    """Extension points for non-colocated roles. The default does nothing (colocated)."""

    def on_prefill_done(self, sched: "Scheduler", req: Req) -> bool:
        """Called after req's prompt KV is complete and its first token sampled. Return True to take
        ownership (the scheduler stops scheduling it; call `sched.release(req.rid)` when done)."""
        return False

    def poll(self, sched: "Scheduler") -> None:
        """Called once per loop iteration (e.g. to complete finished KV transfers)."""

    def on_abort(self, sched: "Scheduler", req: Req, reason: str) -> bool:
        """Called when a request parked for this role (waiting for KV, or handed off) is aborted.
        Return True if a peer may still be writing or reading its pages: the hook then finishes the
        request once the peer is done (through `sched.abort` again, or `sched.release`)."""
        return False


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, engine, codec: TextCodec | None = None,
                 on_output: Callable[[StepOutput], None] | None = None, hooks: RoleHooks | None = None,
                 metrics=None):
        self.cfg = cfg
        self.engine = engine
        self.pool = engine.pool
        self.codec = codec
        self.on_output = on_output or (lambda out: None)
        self.hooks = hooks or RoleHooks()
        self.metrics = metrics
        self.max_context_len = engine.max_context_len
        self.waiting: list[Req] = []  # sorted by arrival order
        self.decode = DecodeManager(self.pool.page_size, cfg.decode_reserve_tokens)
        self.prefill = PrefillManager(self.pool, cfg.chunked_prefill_size, cfg.max_prefill_tokens,
                                      cfg.max_running_requests, cfg.decode_reserve_tokens)
        self.parked: dict[str, Req] = {}  # WAITING_FOR_KV / HANDED_OFF: pages held for a role hook
        if cfg.enable_prefix_caching:
            self.pool.enable_prefix_cache()
        self.by_rid: dict[str, Req] = {}
        self.num_retractions = 0
        self._warming = False
        self._step_log = open(ENV.step_log, "a", buffering=1) if ENV.step_log else None  # line-buffered JSONL
        self.num_admitted = 0
        self._last_was_chunk = False
        self.overlap = cfg.overlap_schedule  # may be switched between steps (benchmarks compare both)
        self.num_chained = 0  # overlap mode: decode steps launched before the previous one was processed
        self._pending = None  # overlap mode: a launched decode step whose outputs are not processed yet
        self.last_step: dict = {}

    @property
    def prefix_cache(self):
        """The pool's prefix cache (`--enable-prefix-caching`), or None."""
        return self.pool.prefix_cache

    # ---- requests in ----------------------------------------------------------------------------
    def validate(self, req: Req) -> None:
        """Raise ValueError (sent to the client as a 400) for a request that can never run."""
        req.params.validate()
        if not req.prompt_ids:
            raise RequestError("the prompt is empty; send at least one token", "prompt")
        if min(req.prompt_ids) < 0 or max(req.prompt_ids) >= self.engine.vocab_size:
            raise RequestError(f"prompt token ids must be in [0, {self.engine.vocab_size}); got "
                               f"{min(req.prompt_ids)}..{max(req.prompt_ids)}", "prompt")
        bad = [t for t in req.params.stop_token_ids if not 0 <= t < self.engine.vocab_size]
        if bad:  # it could never be sampled, so it would never stop the request
            raise RequestError(f"stop_token_ids must be in [0, {self.engine.vocab_size}) (the vocabulary); got "
                               f"{bad[0]}", "stop_token_ids")
        if req.prompt_len >= self.max_context_len:
            raise RequestError(f"the prompt has {req.prompt_len} tokens; this server's context is "
                               f"{self.max_context_len} tokens (prompt + output); shorten the prompt", "prompt")
        if self.cfg.role != "prefill" and req.prompt_len + req.params.max_tokens > self.max_context_len:
            # (a prefill server samples one token per request: the prompt's check above is its whole limit)
            raise RequestError(f"prompt ({req.prompt_len} tokens) + max_tokens ({req.params.max_tokens}) exceeds "
                               f"the context of {self.max_context_len} tokens; lower max_tokens to at most "
                               f"{self.max_context_len - req.prompt_len}", "max_tokens")

    def add_request(self, req: Req) -> None:
        self.validate(req)
        if req.rid in self.by_rid:
            raise ValueError(f"request id {req.rid!r} is already in flight; use a unique id")
        if req.params.seed is not None:
            req.seed = req.params.seed
        elif not req.seed:
            req.seed = (hash((req.rid, req.order, self.cfg.seed)) & ((1 << 62) - 1)) or 1
        req.status = ReqStatus.WAITING
        self.by_rid[req.rid] = req
        self._enqueue(req)

    def abort(self, rid: str, reason: str = "aborted", error_status: int = 400) -> bool:
        """Stop a request wherever it is and free its pages. False if it is unknown or finished.
        error_status: the HTTP status of the failure (`StepOutput.error_status`)."""
        req = self.by_rid.get(rid)
        if req is None:
            return False
        if rid in self.parked and self.hooks.on_abort(self, req, reason):
            return True  # pages stay until the role's peer stops using them
        self._finish(req, FinishReason.ABORT, error=reason if reason != "aborted" else None,
                     error_status=error_status)
        return True

    # ---- disaggregation hooks ----------------------------------------------------------------
    def preallocate(self, req: Req) -> list[int] | None:
        """Decode role: reserve pages for req's prompt KV (+1 token) that a peer will write.
        Returns the page ids, or None when they do not fit now (retry later)."""
        self.validate(req)
        need = -(-(req.prompt_len + 1) // self.pool.page_size)
        if need > self.pool.num_free_pages - self.decode.reserve_pages():
            return None
        if len(self.decode.running) + len(self.prefill.prefilling) + len(self.parked) >= self.cfg.max_running_requests:
            return None  # kv_ready would push the running set past max_running_requests
        req.pages = self.pool.allocate(need)
        req.status = ReqStatus.WAITING_FOR_KV
        req.seed = req.params.seed if req.params.seed is not None else (hash(req.rid) & ((1 << 62) - 1)) or 1
        self.by_rid[req.rid] = req
        self.parked[req.rid] = req
        return req.pages

    def kv_ready(self, rid: str, first_token: int, first_logprob=None) -> None:
        """Decode role: the prompt KV of a preallocated request is in its pages; continue decoding.
        first_logprob: (logprob, [(id, logprob), ...]) of the first token, sampled by the prefill server, when the
        request asks for logprobs."""
        req = self.parked.pop(rid, None)
        if req is None or req.status != ReqStatus.WAITING_FOR_KV:
            return  # aborted (client gone) while its KV was in flight: nothing to continue
        req.cached_len = req.prompt_len
        req.admitted_at = self.num_admitted
        self.num_admitted += 1
        req.status = ReqStatus.RUNNING
        self._append_token(req, first_token, first_logprob if req.params.logprobs is not None else None)
        if not req.finished:
            self.decode.add(req)

    def kv_failed(self, rid: str, why: str, error_status: int = 502) -> None:
        """Decode role: the prompt KV of a preallocated request will not come (`error_status`: 502 the peer failed,
        400 the request itself, 503 no pages in time)."""
        req = self.by_rid.get(rid)
        if req is not None:
            self._finish(req, FinishReason.ERROR, error=why, error_status=error_status)

    def release(self, rid: str) -> None:
        """Prefill role: the hook is done with a handed-off request; free its pages."""
        req = self.parked.pop(rid, None)
        if req is not None:
            self._free_pages(req)
            req.status = ReqStatus.FINISHED
            self.by_rid.pop(rid, None)

    # ---- start-up ------------------------------------------------------------------------------
    def warmup_batches(self) -> list[list[int]]:
        """The prompt lengths of `warmup`, one list per prefill batch: totals of 1, 2, 4, … tokens up to
        max_prefill_tokens (and max_prefill_tokens itself), and the step sizes at which the model's MoE experts
        first launch each of their kernel variants (`Engine.warmup_token_counts`: tuned configs change at bucket
        boundaries that need not be powers of two), each as few prompts of at most chunked_prefill_size tokens as
        add up to it, so that every kernel a prefill batch can launch is compiled. Batches are capped by the
        running-request limit and the free pages."""
        cfg = self.cfg
        chunk = max(1, min(cfg.chunked_prefill_size, self.max_context_len - 2))
        top = max(1, cfg.max_prefill_tokens)
        counts = getattr(self.engine, "warmup_token_counts", None)
        experts = {t for t in counts(top) if 1 <= t <= top} if counts is not None else set()
        totals = sorted({1 << i for i in range(top.bit_length()) if 1 << i <= top} | {top} | experts)
        free = self.pool.num_free_pages
        batches = []
        for total in totals:
            n = -(-total // chunk)
            sizes = [total // n + (1 if i < total % n else 0) for i in range(n)]
            while sizes and (len(sizes) > cfg.max_running_requests
                             or sum(self.pool.allocator.pages_for(x + 2) for x in sizes) > free):
                sizes.pop()
            if sizes and sizes not in batches:
                batches.append(sizes)
        return batches

    def warmup(self) -> dict:
        """Run the prompts of `warmup_batches()` through prefill (and, colocated, one decode step) before serving,
        so that kernels compiled on first use (Triton compiles per config, and the MoE experts pick configs by
        tokens per expert) compile now instead of stalling the first requests for seconds.
        Role hooks, metrics and outputs are switched off meanwhile: nothing is handed off, counted or sent,
        and nothing is left behind (no request, no page). A decode-role server is skipped: its decode steps
        are the captured CUDA graphs. A warm-up step that fails raises RuntimeError with the step's error: a
        server whose prefill fails at start would fail every request. Returns {"requests", "tokens", "seconds"}."""
        if self.cfg.role == "decode":
            return {"requests": 0, "tokens": 0, "seconds": 0.0}
        if self.has_work or self.by_rid:
            raise RuntimeError("warmup runs before the first request; this scheduler already has work")
        t0 = time.perf_counter()
        saved = self.hooks, self.metrics, self.on_output
        errors: list[str] = []
        self.hooks, self.metrics = RoleHooks(), None
        self._warming = True
        self.on_output = lambda out: errors.append(out.error) if out.error else None
        vocab = max(3, self.engine.vocab_size)
        steps = 2 if self.cfg.role == "colocated" else 1
        n_req = n_tok = 0
        # eagerly: the prefill graphs compiled their kernels when captured, the eager steps that do not fit one have not
        eager = getattr(self.engine, "eager_prefill", contextlib.nullcontext)
        try:
            with eager():
                for group in self.warmup_batches():
                    for n in group:
                        self.add_request(Req(filler_ids(n, vocab, salt=n),
                                             SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)))
                        n_req, n_tok = n_req + 1, n_tok + n
                    while self.has_work and not errors:
                        self.step()
                    if errors:
                        for rid in list(self.by_rid):
                            self.abort(rid, "warm-up failed")
                        raise RuntimeError(f"the start-up warm-up (a {sum(group)}-token prefill batch) failed: "
                                           f"{errors[0]}; this server would fail the same way on requests "
                                           "(--no-warmup skips the warm-up)")
        finally:
            self.hooks, self.metrics, self.on_output = saved
            self._warming = False
            if self.prefix_cache is not None:  # the warm-up's filler prompts were not cached: nor are their lookups
                self.prefix_cache.hit_tokens = self.prefix_cache.queried_tokens = 0
        if self.by_rid:
            raise RuntimeError(f"warmup left {len(self.by_rid)} request(s) behind")
        return {"requests": n_req, "tokens": n_tok, "seconds": time.perf_counter() - t0}

    # ---- the step ------------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.decode.running or self.prefill.prefilling or self._pending is not None)

    @property
    def busy(self) -> bool:
        """has_work, or requests parked for a role hook (whose poll must run often)."""
        return self.has_work or bool(self.parked)

    def step(self) -> bool:
        """Run one batch if there is work; returns whether a batch ran."""
        self.hooks.poll(self)
        if self._pending is not None:
            return self._step_overlapped()
        t0 = time.perf_counter()
        batch = self._schedule()
        if batch is None:
            return False
        t1 = time.perf_counter()
        try:
            if self.overlap and batch.is_decode:
                self._pending = self._launch(batch, None)
                self.last_step = {"decode": True, "bs": batch.size, "tokens": batch.size,
                                  "schedule_ms": (t1 - t0) * 1e3, "forward_ms": 0.0, "process_ms": 0.0}
                return True
            out = self.engine.forward(batch)
        except Exception as exc:  # fail this batch's requests, keep serving the others
            self._fail_batch(batch, exc)
            return True
        t2 = time.perf_counter()
        self._process(batch, out)
        t3 = time.perf_counter()
        self.last_step = {"decode": batch.is_decode, "bs": batch.size, "tokens": batch.num_tokens,
                          "schedule_ms": (t1 - t0) * 1e3, "forward_ms": (t2 - t1) * 1e3, "process_ms": (t3 - t2) * 1e3}
        self._record_step()
        if ENV.check_invariants:
            self.check_invariants()
        return True

    # ---- overlap: launch decode step k+1 before processing step k --------------------------------
    def _launch(self, batch: Batch, input_ids):
        p = self.engine.launch(batch, input_ids)
        for r in batch.reqs:
            r.cached_len += 1  # its KV row is being written; the sampled token arrives at collect
        return p

    def _can_chain(self, batch: Batch) -> bool:
        """Step k+1 may be launched blind when nothing about the batch can change at step k: same
        running set, nobody finishing by length, no admissions pending, pages without retraction,
        no logprobs (they need the host round trip)."""
        if self.waiting or self.prefill.prefilling or self.decode.running != batch.reqs:
            return False
        need = 0
        for r in batch.reqs:
            p = r.params
            if r.finished or len(r.output_ids) + 2 > p.max_tokens or r.seq_len + 2 > self.max_context_len \
                    or p.logprobs is not None:
                return False
            need += self.decode.pages_for_step(r)
        return need <= self.pool.num_free_pages

    def _step_overlapped(self) -> bool:
        t0 = time.perf_counter()
        prev, nxt = self._pending, None
        self._pending = None
        try:
            if self._can_chain(prev.batch):
                reqs = list(prev.batch.reqs)
                for r in reqs:
                    n = self.decode.pages_for_step(r)
                    if n:
                        r.pages += self.pool.allocate(n)
                nxt = self._launch(Batch(reqs, [1] * len(reqs), is_decode=True), prev.out.next_ids)
                self.num_chained += 1
            t1 = time.perf_counter()
            out = self.engine.collect(prev)
        except Exception as exc:
            self._fail_batch(prev.batch, exc)
            return True
        t2 = time.perf_counter()
        self._process(prev.batch, out, advanced=True)
        self._pending = nxt
        self.last_step = {"decode": True, "bs": prev.batch.size, "tokens": prev.batch.size,
                          "schedule_ms": (t1 - t0) * 1e3, "forward_ms": (t2 - t1) * 1e3,
                          "process_ms": (time.perf_counter() - t2) * 1e3}
        self._record_step()
        if ENV.check_invariants and nxt is None:
            self.check_invariants()
        return True

    def _record_step(self) -> None:
        """Hand the step that just produced outputs (`last_step`) to the metrics (step-time histograms) and to the
        PDLAB_STEP_LOG file (with the allocator's reserved MiB on CUDA). An overlapped decode step is recorded when
        it is collected: its forward_ms is the wait for the GPU, its schedule_ms includes launching the next step."""
        st = self.last_step
        if self.metrics is not None:
            self.metrics.on_step(st["decode"], (st["schedule_ms"] + st["forward_ms"] + st["process_ms"]) / 1e3)
        if self._step_log is not None:
            rec = {"t": round(time.time(), 6), "role": self.cfg.role, "pid": os.getpid(),
                   "kind": "decode" if st["decode"] else "prefill", "bs": st["bs"], "tokens": st["tokens"],
                   **{k: round(st[k], 3) for k in ("schedule_ms", "forward_ms", "process_ms")},
                   "waiting": len(self.waiting), "running": len(self.decode.running), "warmup": self._warming,
                   "reserved_mib": self._reserved_mib()}
            self._step_log.write(json.dumps(rec) + "\n")

    def _reserved_mib(self) -> int | None:
        """The CUDA caching allocator's reserved memory (MiB; it grows by cudaMalloc calls), None off CUDA."""
        dev = getattr(self.engine, "device", None)
        if dev is None or getattr(dev, "type", None) != "cuda":
            return None
        import torch
        return torch.cuda.memory_reserved(dev) >> 20

    def _fail_batch(self, batch: Batch, exc: Exception) -> None:
        log.exception("forward step failed for %d request(s)", batch.size)
        for r in batch.reqs:
            self._finish(r, FinishReason.ERROR, error=f"internal error: {type(exc).__name__}: {exc}", error_status=500)

    def _schedule(self) -> Batch | None:
        for _ in range(len(self.prefill.prefilling) + len(self.decode.running) + 2):
            want_decode = self._last_was_chunk and self.decode.running
            if not want_decode and (self.waiting or self.prefill.prefilling):
                plan = self.prefill.plan(self.waiting, len(self.decode.running), self.decode.reserve_pages(),
                                         self.num_admitted)
                self.num_admitted += len(plan.admitted)
                for r in plan.admitted:
                    self.waiting.remove(r)
                for r in plan.to_decode:
                    self.decode.add(r)
                if plan.reqs:
                    self._last_was_chunk = any(r.cached_len + n < r.seq_len for r, n in zip(plan.reqs, plan.extend_lens))
                    return Batch(plan.reqs, plan.extend_lens, is_decode=False)
            self._last_was_chunk = False
            if self.decode.running:
                return self._decode_batch()
            if not self.prefill.prefilling:
                return None
            # chunked requests hold the pages and none can continue: park the newest one
            victim = pick_victim(self.prefill.prefilling)
            if victim is None:
                if self.parked:
                    return None  # pages are held by parked requests; a role hook will release them
                raise RuntimeError("a lone prefill cannot get pages: the pool is smaller than one request "
                                   "(should have been rejected at start-up)")
            self._retract(victim)
        return None

    def _decode_batch(self) -> Batch | None:
        while True:
            need = sum(self.decode.pages_for_step(r) for r in self.decode.running)
            if need <= self.pool.num_free_pages:
                break
            victim = pick_victim(self.decode.running + self.prefill.prefilling)
            if victim is None:
                if self.parked:
                    return None  # wait for a role hook to release parked pages
                raise RuntimeError("out of KV pages with a single running request; the pool is smaller "
                                   "than one request (should have been rejected at start-up)")
            self._retract(victim)
        for r in self.decode.running:
            n = self.decode.pages_for_step(r)
            if n:
                r.pages += self.pool.allocate(n)
        reqs = list(self.decode.running)
        return Batch(reqs, [1] * len(reqs), is_decode=True)

    def _retract(self, req: Req) -> None:
        if req in self.decode.running:
            self.decode.remove(req)
        if req in self.prefill.prefilling:
            self.prefill.prefilling.remove(req)
        retract(req, self.pool, self.engine.page_table, self.cfg.retract_mode)
        self.num_retractions += 1
        if self.metrics is not None:
            self.metrics.on_retract()
        log.debug("retracted %s (cached %d tokens, backup=%s)", req.rid, req.cached_len, req.backup is not None)
        self._enqueue(req)

    def _process(self, batch: Batch, out, advanced: bool = False) -> None:
        if not advanced:
            for r, n in zip(batch.reqs, batch.extend_lens):
                r.cached_len += n
        if self.prefix_cache is not None and not batch.is_decode and not self._warming:
            for r in batch.reqs:  # the prompt pages just computed: later requests may read them from now on
                self.prefix_cache.insert_computed(r)
        for i, tok, lp in zip(out.sampled, out.next_ids, out.logprobs):
            r = batch.reqs[i]
            if r.finished:
                continue
            if tok < 0:  # its logits could not be sampled: end this request alone, as a failed step would
                why = bad_logits_error(tok, len(r.output_ids) + 1)
                log.error("request %s: %s", r.rid, why)
                self._finish(r, FinishReason.ERROR, error=why, error_status=500)
                continue
            if r.status == ReqStatus.PREFILLING:
                self.prefill.prefilling.remove(r)
                r.status = ReqStatus.RUNNING
                self._append_token(r, tok, lp)
                if r.finished:
                    continue
                if self.hooks.on_prefill_done(self, r):
                    r.status = ReqStatus.HANDED_OFF
                    self.parked[r.rid] = r
                    self.engine.page_table.release(r)  # it never runs here again; its pages stay
                elif self.cfg.role == "prefill":
                    self._finish(r, FinishReason.LENGTH)
                else:
                    self.decode.add(r)
            else:
                self._append_token(r, tok, lp)

    def _append_token(self, r: Req, tok: int, lp) -> None:
        now = time.perf_counter()
        r.output_ids.append(int(tok))
        if lp is not None:
            r.output_logprobs.append(lp)
        if self.metrics is not None:
            self.metrics.on_token(r, now)
        if r.first_token_time is None:
            r.first_token_time = now
        r.last_token_time = now
        # a prefill server never runs a step after the first token, so that token may take the last position
        ctx = self.max_context_len + (self.cfg.role == "prefill")
        text, finish = process_token(r, int(tok), self.codec, ctx)
        if finish is not None:
            self._finish(r, finish, text=text, new_ids=[int(tok)], new_lps=[lp] if lp is not None else [])
        else:
            self.on_output(StepOutput(r.rid, [int(tok)], text, False, None, r.prompt_len, len(r.output_ids),
                                      [lp] if lp is not None else []))

    def _finish(self, r: Req, reason: FinishReason, text: str = "", new_ids: list[int] | None = None,
                new_lps: list | None = None, error: str | None = None, error_status: int = 400) -> None:
        if r.finished:
            return
        if r in self.decode.running:
            self.decode.remove(r)
        if r in self.prefill.prefilling:
            self.prefill.prefilling.remove(r)
        if r in self.waiting:
            self.waiting.remove(r)
        self.parked.pop(r.rid, None)
        # a failed step may have left its KV wrong, and the warm-up's filler prompts are no prefix to keep
        self._free_pages(r, keep=reason is not FinishReason.ERROR and not self._warming)
        r.backup = None
        r.status = ReqStatus.ABORTED if reason in (FinishReason.ABORT, FinishReason.ERROR) else ReqStatus.FINISHED
        r.finish_reason = reason
        r.error = error
        self.by_rid.pop(r.rid, None)
        if self.metrics is not None:
            self.metrics.on_finish(r)
        self.on_output(StepOutput(r.rid, new_ids or [], text, True, reason, r.prompt_len, len(r.output_ids),
                                  new_lps or [], error, error_status, r.cached_tokens))

    def _free_pages(self, r: Req, keep: bool = True) -> None:
        """Give back r's pages (with a prefix cache: its full computed pages are cached when `keep`)."""
        if r.pages:
            self.pool.release_pages(r, keep)
        self.engine.page_table.release(r)

    def _enqueue(self, req: Req) -> None:
        keys = [w.order for w in self.waiting]
        self.waiting.insert(bisect.bisect(keys, req.order), req)

    # ---- checks and stats ----------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Every allocated page belongs to exactly one live request or to the prefix cache, and each cached page is
        read by as many live requests as it counts; raises AssertionError otherwise."""
        holders = self.decode.running + self.prefill.prefilling + list(self.parked.values())
        owned = [p for r in holders for p in r.pages[r.prefix_pages:]]
        assert len(owned) == len(set(owned)), "a page is owned by two requests"
        cached = self.prefix_cache.check(holders) if self.prefix_cache is not None else set()
        assert not cached & set(owned), "a request owns a page the prefix cache holds"
        in_use = self.pool.allocator.capacity - self.pool.allocator.num_free
        assert in_use == len(owned) + len(cached), \
            f"{in_use} pages in use but requests own {len(owned)} and the prefix cache {len(cached)} (leak)"
        for r in self.waiting:
            assert not r.pages, f"waiting request {r.rid} holds pages"
        live = {r.rid for r in holders + self.waiting}
        assert live == set(self.by_rid), "a request was lost or duplicated"

    def stats(self) -> dict:
        cache = self.prefix_cache
        return {"num_waiting": len(self.waiting), "num_running": len(self.decode.running),
                "num_prefilling": len(self.prefill.prefilling), "num_parked": len(self.parked),
                "kv_usage": self.pool.usage, "kv_free_pages": self.pool.num_free_pages,
                "num_retractions": self.num_retractions,
                **({"prefix_cache_pages": cache.num_pages, "prefix_cache_hit_tokens": cache.hit_tokens,
                    "prefix_cache_queried_tokens": cache.queried_tokens} if cache is not None else {})}
