"""Prefill and decode roles: per-request state machines plugged into the scheduler through its
`RoleHooks` (on_prefill_done, poll) and its decode-side calls (preallocate, kv_ready, kv_failed,
release). A colocated server is the same scheduler without these hooks.

Flow of one request with transfer id T (rid = T on both servers):
  decode:  bootstrapping ─ preallocate pages, hand their ids + this pool's metadata to the prefill
           (a `PeerLink`: HTTP in servers, a direct call in tests) ─▶ waiting ─ "transferring" notice
           ─▶ transferring ─ "done" notice with the first token ─▶ decoding (kv_ready) ─▶ done | failed | aborted
  prefill: bootstrapping (request and page ids both needed) ─▶ waiting (queued / computing the prompt,
           chunked) ─ first token sampled, scheduler hands the request over ─▶ transferring (one batch
           per layer group into the decode pages) ─ done: release own pages, notify ─▶ done | failed | aborted
  failed: a fault (a timeout, a transfer or a peer that failed, a request the prefill server refused); aborted:
  ended by its client (a disconnect) or by the server (an operator's abort, a shutdown), on either side.

Every wait has a deadline (`transfer_timeout`): a decode request whose KV does not arrive is failed
with a clear error and its pages freed; a prefill whose decode side never sends pages releases its
own. Pages a peer may still be writing are never freed early: a decode abort during a transfer
waits for the prefill's final notice (or the deadline) before freeing them.

Threads: the scheduler's loop thread runs poll() / on_prefill_done() and all scheduler calls; HTTP
handlers call submit/on_pages/abort, which only queue work (or go through `loop.call`); the decode
role runs one listener thread that turns transfer notifications into `loop.call`s (waking the loop).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from pdlab.runtime.core import FinishReason, Req, StepOutput
from pdlab.runtime.disagg.transfer.base import (KVLayoutMismatch, KVTransferBackend, KVTransferError,
                                               TransferStatus)
from pdlab.runtime.scheduler.scheduler import RoleHooks

log = logging.getLogger("pdlab.disagg")


class State(str, enum.Enum):
    BOOTSTRAPPING = "bootstrapping"
    WAITING = "waiting"
    TRANSFERRING = "transferring"
    DECODING = "decoding"
    DONE = "done"
    FAILED = "failed"
    ABORTED = "aborted"


TERMINAL = (State.DONE, State.FAILED, State.ABORTED)


@dataclass
class Record:
    """One request's disaggregation state on this server."""

    transfer_id: str
    state: State = State.BOOTSTRAPPING
    since: float = field(default_factory=time.monotonic)
    created: float = field(default_factory=time.monotonic)
    req: Req | None = None
    peer: str = ""  # prefill address (decode side) / decode agent (prefill side)
    dst_pages: list[int] | None = None
    peer_meta: dict | None = None
    handle: Any = None
    sink: Callable[[StepOutput], None] | None = None
    error: str = ""
    first_token: int | None = None
    first_logprob: Any = None  # (logprob, [(id, logprob), ...]) of the first token when the request asks for them
    abort_requested: bool = False
    abort_status: int | None = None  # the HTTP status of an abort's error (None: 502, the prefill side failed)
    aborted: bool = False  # ended by its client or the server (State.ABORTED), not by a fault (State.FAILED)
    done_event: threading.Event = field(default_factory=threading.Event)
    nbytes: int = 0
    transfer_s: float = 0.0
    counted: bool = False  # RoleMetrics bookkeeping


class RoleMetrics:
    """Counts of requests per state (current) and of transitions (total), plus transfer totals."""

    def __init__(self, role: str):
        self.role = role
        self.current = {s: 0 for s in State}
        self.transitions = {s: 0 for s in State}
        self.bytes_sent = 0
        self.transfer_seconds = 0.0
        self._lock = threading.Lock()

    def move(self, rec: Record, new: State, why: str = "") -> None:
        with self._lock:
            if rec.counted:
                self.current[rec.state] -= 1
            rec.counted = True
            self.current[new] += 1
            self.transitions[new] += 1
        old = rec.state
        rec.state, rec.since = new, time.monotonic()
        lvl = logging.WARNING if new is State.FAILED else logging.INFO  # an abort is no fault of the server's
        log.log(lvl, "[%s] %s: %s -> %s%s", self.role, rec.transfer_id, old.value, new.value,
                f" ({why})" if why else "")

    def forget(self, rec: Record) -> None:
        with self._lock:
            if rec.counted:
                rec.counted = False
                self.current[rec.state] -= 1

    def snapshot(self) -> dict:
        with self._lock:
            return {"role": self.role, "current": {s.value: n for s, n in self.current.items()},
                    "total": {s.value: n for s, n in self.transitions.items()},
                    "bytes_sent": self.bytes_sent, "transfer_seconds": self.transfer_seconds}

    def prometheus(self) -> str:
        snap = self.snapshot()
        lines = ["# HELP pdlab_disagg_requests Disaggregated requests now in each state.",
                 "# TYPE pdlab_disagg_requests gauge"]
        lines += [f'pdlab_disagg_requests{{role="{self.role}",state="{s}"}} {n}' for s, n in snap["current"].items()]
        lines += ["# HELP pdlab_disagg_transitions_total Requests that entered each state.",
                  "# TYPE pdlab_disagg_transitions_total counter"]
        lines += [f'pdlab_disagg_transitions_total{{role="{self.role}",state="{s}"}} {n}'
                  for s, n in snap["total"].items()]
        lines += [f'pdlab_disagg_kv_bytes_sent_total{{role="{self.role}"}} {snap["bytes_sent"]}',
                  f'pdlab_disagg_kv_transfer_seconds_total{{role="{self.role}"}} {snap["transfer_seconds"]:.6f}']
        return "\n".join(lines) + "\n"


class TransferFailed(Exception):
    """The prefill server already failed this transfer (e.g. it refused the request): pages for it are refused.
    status: the HTTP status the client gets for it (400 a request the prefill server refused, else 502)."""

    def __init__(self, message: str, status: int = 502):
        super().__init__(message)
        self.status = status


class PeerLink(Protocol):
    """Decode → prefill control messages (HTTP between servers; a direct call in tests)."""

    def send_pages(self, prefill: str, msg: dict) -> None:
        """msg = {"transfer_id", "decode_meta", "pages"}; raise on failure."""

    def send_abort(self, prefill: str, transfer_id: str) -> None:
        """Best effort: tell the prefill to drop transfer_id."""


def prefill_params(req: Req) -> Req:
    """The prefill server's copy of a request: same prompt, the client's sampling for the first
    token, but never finished by it (the decode server applies EOS / stop / max_tokens)."""
    p = dataclasses.replace(req.params, max_tokens=2, ignore_eos=True, stop=[], stop_token_ids=[])
    return Req(list(req.prompt_ids), p, rid=req.rid, seed=req.seed)


# ================================================================================ prefill role
class PrefillRole(RoleHooks):
    """Prefill server side. `transfer` must already be registered with this server's KV pool."""

    def __init__(self, transfer: KVTransferBackend, *, transfer_timeout: float = 60.0):
        self.transfer = transfer
        self.timeout = transfer_timeout
        self.metrics = RoleMetrics("prefill")
        self.records: dict[str, Record] = {}
        self._lock = threading.Lock()
        self.loop = None

    def attach(self, loop) -> dict:
        """Register this server's KV pool with the transfer backend; returns its metadata."""
        self.loop = loop
        pool = loop.scheduler.pool
        return self.transfer.register(pool.kv_caches, pool.kv_scale)

    # ---- any thread ---------------------------------------------------------------------------
    def submit(self, req: Req, transfer_id: str, sink: Callable[[StepOutput], None] | None = None) -> Record:
        """Start prefilling `req` for the decode side's transfer `transfer_id`. ValueError for a bad
        request (raised here). The outcome goes to `sink` as one final StepOutput (the first token, or
        an error), and `wait(transfer_id, timeout)` blocks for it."""
        preq = prefill_params(req)
        preq.rid = transfer_id
        preq.meta["transfer_id"] = transfer_id
        with self._lock:
            rec = self.records.get(transfer_id)
            if rec is None:
                rec = self.records[transfer_id] = Record(transfer_id)
                self.metrics.move(rec, State.BOOTSTRAPPING, "request arrived")
            if rec.req is not None:
                raise ValueError(f"transfer id {transfer_id!r} is already in flight; use a unique id")
            rec.req, rec.sink = preq, sink
            self.metrics.move(rec, State.WAITING, "queued for prefill")
        try:
            self.loop.submit(preq, lambda out, rec=rec: self._on_output(rec, out))
        except ValueError as e:
            rec.abort_status = 400  # the request itself: the decode side answers its client with a 400 too
            self._fail(None, rec, f"bad request: {e}")
            raise
        return rec

    def on_pages(self, transfer_id: str, decode_meta: dict, pages: list[int]) -> None:
        """The decode side's pre-allocated page ids (and its pool metadata) for transfer_id. TransferFailed when
        this server failed the transfer already (the decode side then fails it too, instead of waiting for KV)."""
        with self._lock:
            rec = self.records.get(transfer_id)
            if rec is not None and rec.state is State.FAILED:
                raise TransferFailed(f"transfer {transfer_id} failed on the prefill server: {rec.error}",
                                     rec.abort_status or 502)
            if rec is None:
                rec = self.records[transfer_id] = Record(transfer_id)
                self.metrics.move(rec, State.BOOTSTRAPPING, "pages arrived before the request")
            rec.dst_pages, rec.peer_meta, rec.peer = list(pages), decode_meta, decode_meta.get("agent", "")

    def abort(self, transfer_id: str, why: str = "aborted by the decode side", error_status: int | None = None,
              *, fault: bool = False) -> None:
        """Drop transfer_id: a queued / computing request is aborted, a handed-off one released; a
        transfer already in flight completes first (the decode side frees its pages on the notice).
        error_status: a 5xx the decode side answers its client with (e.g. 503 when this server stops; else 502).
        fault: the request ends as failed (a deadline passed), not as aborted (its client or the server ended it)."""
        with self._lock:
            rec = self.records.get(transfer_id)
            if rec is None or rec.state in TERMINAL:
                return
            rec.abort_requested, rec.error = True, why
            rec.aborted = rec.aborted or not fault
            if error_status is not None and 500 <= error_status < 600:
                rec.abort_status = error_status
        if self.loop is not None:
            self.loop.call(lambda sched: self._abort(sched, rec))

    def _abort(self, sched, rec: Record) -> None:
        if rec.state in (State.BOOTSTRAPPING, State.WAITING):
            self._fail(sched, rec, rec.error)

    def wait(self, transfer_id: str, timeout: float) -> Record:
        rec = self.records.get(transfer_id)
        if rec is None:
            raise KeyError(f"unknown transfer id {transfer_id!r}")
        if not rec.done_event.wait(timeout):
            self.abort(transfer_id, f"prefill did not finish within {timeout} s", fault=True)
        return rec

    # ---- loop thread --------------------------------------------------------------------------
    def _on_output(self, rec: Record, out: StepOutput) -> None:
        if out.finished and rec.state in (State.BOOTSTRAPPING, State.WAITING):
            # the scheduler finished it (bad request, abort, error) before handing it over
            rec.aborted = rec.aborted or out.finish_reason is FinishReason.ABORT
            self._fail(None, rec, out.error or f"prefill ended early ({out.finish_reason})")

    def on_abort(self, sched, req: Req, reason: str) -> bool:
        tid = req.meta.get("transfer_id")
        rec = self.records.get(tid) if tid else None
        if rec is None or rec.state is not State.TRANSFERRING:
            return False
        rec.abort_requested, rec.error, rec.aborted = True, reason, True  # the send in flight completes, then
        # poll frees
        return True

    def on_prefill_done(self, sched, req: Req) -> bool:
        tid = req.meta.get("transfer_id")
        rec = self.records.get(tid) if tid else None
        if rec is None:
            return False  # a plain request on a prefill server: the scheduler finishes it
        rec.first_token = req.output_ids[0]
        rec.first_logprob = req.output_logprobs[0] if req.output_logprobs else None
        return True  # parked with its pages until release()

    def poll(self, sched) -> None:
        now = time.monotonic()
        with self._lock:
            recs = list(self.records.values())
        for rec in recs:
            if rec.state in TERMINAL:
                if now - rec.since > 60.0:  # keep finished records a while for /disagg/state
                    with self._lock:
                        self.records.pop(rec.transfer_id, None)
                    self.metrics.forget(rec)
                continue
            handed = rec.req is not None and rec.req.rid in sched.parked
            if rec.state is State.TRANSFERRING:
                self._progress(sched, rec, now)
            elif rec.abort_requested and handed:
                self._fail(sched, rec, rec.error)
            elif handed and rec.dst_pages is not None:
                self._start(sched, rec)
            elif now - rec.created > self.timeout:
                what = "page ids from the decode server" if rec.dst_pages is None else "the prompt's prefill"
                self._fail(sched, rec, f"no {what} within {self.timeout} s")

    def _start(self, sched, rec: Record) -> None:
        try:
            peer = self.transfer.add_peer(rec.peer_meta)
            self.transfer.notify(peer, {"transfer_id": rec.transfer_id, "event": "transferring"})
            rec.handle = self.transfer.send_pages(
                peer, rec.transfer_id, rec.req.pages, rec.dst_pages, rec.req.prompt_len,
                notify={"event": "done", "first_token": rec.first_token, "first_logprob": rec.first_logprob,
                        "cached_tokens": rec.req.cached_tokens})
        except (KVTransferError, ValueError) as e:
            self._fail(sched, rec, f"KV transfer could not start: {e}")
            return
        self.metrics.move(rec, State.TRANSFERRING, f"{rec.req.prompt_len} tokens -> {rec.peer}")
        self._progress(sched, rec, time.monotonic())

    def _progress(self, sched, rec: Record, now: float) -> None:
        st = self.transfer.poll(rec.handle)
        if st is TransferStatus.PROC:
            if now - rec.since > self.timeout:
                self._fail(sched, rec, f"KV transfer not done after {self.timeout} s")
            elif self.loop is not None:
                self.loop.call(lambda _s: None)  # keep the loop awake (polling = progress) while in flight
            return
        self.transfer.release(rec.handle)
        if st is TransferStatus.ERR:
            self._fail(sched, rec, f"KV transfer failed: {rec.handle.error}")
            return
        rec.nbytes, rec.transfer_s = rec.handle.nbytes, time.perf_counter() - rec.handle.started
        with self.metrics._lock:
            self.metrics.bytes_sent += rec.nbytes
            self.metrics.transfer_seconds += rec.transfer_s
        sched.release(rec.req.rid)
        self.metrics.move(rec, State.DONE, f"{rec.nbytes} bytes in {rec.transfer_s * 1e3:.2f} ms")
        self._answer(rec)

    def _fail(self, sched, rec: Record, why: str) -> None:
        if rec.state in TERMINAL:
            return
        rec.error = why
        self.metrics.move(rec, _end_state(rec), why)  # first: the abort below reports back re-entrantly
        if sched is not None and rec.req is not None:
            if rec.req.rid in sched.parked:
                sched.release(rec.req.rid)
            elif rec.req.rid in sched.by_rid:
                sched.abort(rec.req.rid, why)
        if rec.peer_meta is not None:
            try:
                try:
                    self.transfer.add_peer(rec.peer_meta)  # makes the peer reachable for notices
                except KVLayoutMismatch:
                    pass  # reachable all the same: the mismatch is what we are reporting
                notice = {"transfer_id": rec.transfer_id, "event": "failed", "error": why}
                if rec.abort_status is not None:
                    notice["status"] = rec.abort_status
                self.transfer.notify(rec.peer, notice)
            except (KVTransferError, ValueError, OSError) as e:
                log.info("could not tell %s that %s failed: %s", rec.peer, rec.transfer_id, e)
        self._answer(rec)

    def _answer(self, rec: Record) -> None:
        rec.done_event.set()
        if self.loop is not None:
            self.loop.drop_sink(rec.transfer_id)  # the scheduler emits nothing more for it
        if rec.sink is None:
            return
        n = rec.req.prompt_len if rec.req is not None else 0
        if rec.state is State.DONE:
            out = StepOutput(rec.transfer_id, [rec.first_token], "", True, FinishReason.LENGTH, n, 1)
        else:
            out = StepOutput(rec.transfer_id, [], "", True, FinishReason.ERROR, n, 0, error=rec.error)
        sink, rec.sink = rec.sink, None
        sink(out)


# ================================================================================= decode role
class DecodeRole(RoleHooks):
    """Decode server side. `transfer` is registered here with this server's KV pool (its metadata
    travels with every page hand-off). `link` carries page ids and aborts to prefill servers."""

    def __init__(self, transfer: KVTransferBackend, link: PeerLink, *,
                 transfer_timeout: float = 60.0, poll_interval: float = 0.002):
        self.transfer = transfer
        self.link = link
        self.meta: dict = {}
        self.timeout = transfer_timeout
        self.metrics = RoleMetrics("decode")
        self.records: dict[str, Record] = {}  # touched only in the loop thread
        # transfer ids the prefill server refused before this server admitted them (the router's abort can overtake
        # the request): id -> (why, HTTP status, monotonic time); loop thread only, kept 60 s
        self._refused: dict[str, tuple[str, int, float]] = {}
        self.loop = None
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="pdlab-disagg-link")
        self._stop = threading.Event()
        self._listener: threading.Thread | None = None
        self._poll_interval = poll_interval

    def attach(self, loop) -> dict:
        """Register this server's KV pool with the transfer backend, start the notification listener;
        returns the pool's metadata (sent to prefill servers with every page hand-off)."""
        self.loop = loop
        pool = loop.scheduler.pool
        self.meta = self.transfer.register(pool.kv_caches, pool.kv_scale)
        self._listener = threading.Thread(target=self._listen, name="pdlab-disagg-notify", daemon=True)
        self._listener.start()
        return self.meta

    def close(self) -> None:
        self._stop.set()
        if self._listener is not None:
            self._listener.join(2.0)
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- any thread ---------------------------------------------------------------------------
    def submit(self, req: Req, transfer_id: str, prefill: str, sink: Callable[[StepOutput], None]) -> None:
        """Admit `req` whose prompt KV the prefill server at `prefill` computes. Outputs (the first
        token onwards, or a final error) go to `sink` like any request's. ValueError for a bad
        request (raised here, in the caller's thread)."""
        req.rid = transfer_id
        req.meta["transfer_id"] = transfer_id
        self.loop.scheduler.validate(req)
        self.loop.call(lambda sched: self._admit(sched, req, prefill, sink))

    def abort(self, transfer_id: str, why: str = "client disconnected", refused_status: int | None = None,
              error_status: int | None = None, *, fault: bool = False) -> None:
        """Drop transfer_id. `refused_status`: the prefill server refused the request with this HTTP status (a
        4xx, as the router saw it), so it never took it and writes no KV: a request still waiting for its KV ends
        at once with that status instead of at the transfer timeout. `error_status`: the HTTP status its client
        gets for `why` otherwise (e.g. 503 when the server stops; default 400, or 502 before its KV arrived).
        The request ends as aborted (its client or the server ended it), or as failed with a refusal or `fault`
        (the router saw its prefill server fail)."""
        aborted = refused_status is None and not fault
        self.loop.call(lambda sched: self._abort(sched, transfer_id, why, refused_status, error_status, aborted))

    # ---- loop thread --------------------------------------------------------------------------
    def _admit(self, sched, req: Req, prefill: str, sink) -> None:
        if req.rid in self.records or req.rid in sched.by_rid:
            sink(StepOutput(req.rid, [], "", True, FinishReason.ERROR,
                            error=f"transfer id {req.rid!r} is already in flight; use a unique id"))
            return
        refused = self._refused.pop(req.rid, None)
        if refused is not None:  # the prefill server refused it already
            sink(StepOutput(req.rid, [], "", True, FinishReason.ERROR, error=refused[0], error_status=refused[1]))
            return
        rec = self.records[req.rid] = Record(req.rid, req=req, peer=prefill, sink=sink)
        self.loop.add_sink(req.rid, self._wrap_sink(rec))
        self.metrics.move(rec, State.BOOTSTRAPPING, f"prefill {prefill}")
        self._try_allocate(sched, rec)

    def _wrap_sink(self, rec: Record):
        def sink(out: StepOutput) -> None:
            if out.finished and rec.state not in TERMINAL:
                if out.finish_reason is FinishReason.ABORT:
                    rec.aborted = True
                if out.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
                    self.metrics.move(rec, _end_state(rec), out.error or out.finish_reason.value)
                else:
                    self.metrics.move(rec, State.DONE, out.finish_reason.value if out.finish_reason else "")
            if rec.sink is not None:  # None: answered early (`_answer_early`)
                rec.sink(out)
        return sink

    def _try_allocate(self, sched, rec: Record) -> None:
        try:
            pages = sched.preallocate(rec.req)
        except ValueError as e:
            self._finish_failed(sched, rec, str(e), 400)  # the request itself (too long, bad ids)
            return
        if pages is None:
            return  # no room now; poll() retries (bounded by the timeout)
        rec.dst_pages = list(pages)
        self.metrics.move(rec, State.WAITING, f"{len(pages)} pages pre-allocated")
        msg = {"transfer_id": rec.transfer_id, "decode_meta": self.meta, "pages": rec.dst_pages}
        fut = self._pool.submit(self.link.send_pages, rec.peer, msg)
        fut.add_done_callback(lambda f, tid=rec.transfer_id: self._link_done(tid, f))

    def _link_done(self, tid: str, fut) -> None:
        exc = fut.exception()
        if isinstance(exc, TransferFailed):  # the prefill server failed (or refused) the request already
            self.loop.call(lambda sched: self._on_notice(sched, {
                "transfer_id": tid, "event": "failed", "error": str(exc), "status": exc.status}))
        elif exc is not None:
            self.loop.call(lambda sched: self._on_notice(sched, {
                "transfer_id": tid, "event": "failed", "error": f"handing pages to the prefill server failed: {exc}"}))

    def _listen(self) -> None:
        while not self._stop.is_set():
            try:
                msgs = self.transfer.poll_notifications()
            except Exception as e:  # noqa: BLE001 - keep listening; the per-request deadlines still apply
                log.warning("notification poll failed: %s", e)
                msgs = []
            for m in msgs:
                self.loop.call(lambda sched, m=m: self._on_notice(sched, m))
            self._stop.wait(self._poll_interval)

    def _on_notice(self, sched, msg: dict) -> None:
        rec = self.records.get(msg.get("transfer_id", ""))
        if rec is None or rec.state in TERMINAL or rec.state is State.DECODING:
            return
        event = msg.get("event")
        if event == "transferring" and rec.state is State.WAITING:
            self.metrics.move(rec, State.TRANSFERRING, "prefill is writing KV")
        elif event == "done":
            if rec.abort_requested:  # the peer is done writing: now the pages can go
                self._finish_failed(sched, rec, rec.error, rec.abort_status or 502)
                return
            rec.first_token = int(msg["first_token"])
            cached = msg.get("cached_tokens")  # the prefill server's prefix cache served these prompt tokens
            rec.req.cached_tokens = cached if isinstance(cached, int) and not isinstance(cached, bool) else None
            lp = msg.get("first_logprob")  # through JSON: lists for tuples
            lp = (float(lp[0]), [(int(i), float(v)) for i, v in lp[1]]) if lp is not None else None
            self.metrics.move(rec, State.DECODING, f"first token {rec.first_token}")
            sched.kv_ready(rec.transfer_id, rec.first_token, lp)  # may finish at once (EOS, max_tokens=1)
        elif event == "failed":
            if rec.abort_requested:
                self._finish_failed(sched, rec, rec.error, rec.abort_status or 502)
            else:  # the prefill side's status where it gives one (400 it refused the request, 503 it is
                # stopping), else 502
                status = msg.get("status")
                status = status if isinstance(status, int) and 400 <= status < 600 else 502
                self._finish_failed(sched, rec, f"prefill failed: {msg.get('error', 'unknown error')}", status)

    def on_abort(self, sched, req: Req, reason: str) -> bool:
        rec = self.records.get(req.rid)
        if rec is None or rec.state not in (State.WAITING, State.TRANSFERRING):
            return False
        rec.aborted = True
        if not rec.abort_requested:  # free pages once the prefill stops writing (its final notice)
            rec.abort_requested, rec.error = True, reason
            self._pool.submit(_quiet, self.link.send_abort, rec.peer, rec.transfer_id)
        return True

    def _abort(self, sched, tid: str, why: str, refused_status: int | None = None,
               error_status: int | None = None, aborted: bool = True) -> None:
        rec = self.records.get(tid)
        if rec is None:
            if refused_status is not None:  # the refusal overtook the request: answer it when it arrives
                self._refused[tid] = (why, refused_status, time.monotonic())
            sched.abort(tid, why, error_status=error_status or 400)  # not a disaggregated request
            return
        if rec.state in TERMINAL:
            return
        rec.aborted = aborted
        if refused_status is not None and rec.state in (State.BOOTSTRAPPING, State.WAITING):
            self._finish_failed(sched, rec, why, refused_status)  # nothing writes its pages: free them now
        elif rec.state in (State.WAITING, State.TRANSFERRING):
            # the client gets its answer now (a prefill server that died sends no final notice: it waited for the
            # transfer timeout); the pages are freed once the prefill stops writing them, or at that timeout
            if not rec.abort_requested:
                rec.abort_requested, rec.error, rec.abort_status = True, why, error_status
                self._pool.submit(_quiet, self.link.send_abort, rec.peer, tid)
            self._answer_early(rec)
        elif rec.state is State.BOOTSTRAPPING:
            self._finish_failed(sched, rec, why, error_status or 502)
        else:
            sched.abort(tid, why, error_status=error_status or 400)

    def _answer_early(self, rec: Record) -> None:
        """Give the client of an aborted request, whose pages a prefill may still write, its error now; the scheduler
        frees the pages later (`_finish_failed`) and emits nothing more for it."""
        if rec.sink is None:
            return
        self.loop.drop_sink(rec.transfer_id)
        sink, rec.sink = rec.sink, None
        sink(StepOutput(rec.transfer_id, [], "", True, FinishReason.ERROR, error=rec.error,
                        error_status=rec.abort_status or 502))

    def _finish_failed(self, sched, rec: Record, why: str, status: int = 502) -> None:
        """Fail the request with `why`; status: its HTTP status (502 the prefill side failed, the default)."""
        if rec.state in TERMINAL:
            return
        self.metrics.move(rec, _end_state(rec), why)
        if rec.req.rid in sched.by_rid:
            sched.kv_failed(rec.transfer_id, why, status)  # frees the pre-allocated pages, emits the error
        elif rec.sink is not None:  # never admitted: no pages; answer the client directly
            self.loop.drop_sink(rec.transfer_id)
            rec.sink(StepOutput(rec.transfer_id, [], "", True, FinishReason.ERROR, error=why, error_status=status))

    def poll(self, sched) -> None:
        now = time.monotonic()
        if self._refused:  # (every step: skip the scan when empty, as it almost always is)
            for tid in [t for t, (_, _, at) in self._refused.items() if now - at > 60.0]:
                del self._refused[tid]
        for tid, rec in list(self.records.items()):
            if rec.state in TERMINAL:
                if now - rec.since > 60.0:
                    del self.records[tid]
                    self.metrics.forget(rec)
            elif rec.state is State.BOOTSTRAPPING:
                if now - rec.since > self.timeout:
                    self._finish_failed(sched, rec, f"no free KV pages for {self.timeout} s", 503)
                else:
                    self._try_allocate(sched, rec)
            elif rec.state in (State.WAITING, State.TRANSFERRING) and now - rec.since > self.timeout:
                if not rec.abort_requested:
                    self._pool.submit(_quiet, self.link.send_abort, rec.peer, tid)
                if rec.abort_requested:
                    self._finish_failed(sched, rec, rec.error, rec.abort_status or 502)
                else:
                    self._finish_failed(sched, rec, f"the prefill server sent no KV within {self.timeout} s "
                                                    f"(state {rec.state.value}); is {rec.peer} alive?")


def _end_state(rec: Record) -> State:
    """The terminal state of a request that did not finish: aborted when its client or the server ended it."""
    return State.ABORTED if rec.aborted else State.FAILED


def _quiet(fn, *args) -> None:
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - best-effort notices
        log.info("best-effort %s failed: %s", getattr(fn, "__name__", fn), e)
