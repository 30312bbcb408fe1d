"""The engine loop (one for online and offline use) and the offline `LLM.generate()` API.

`EngineLoop` owns a scheduler and runs `run_once()` = drain the inbox (submits, aborts, calls from
other threads) → one scheduler step → hand each `StepOutput` to the sink of its request. The HTTP
server runs it in a background thread (`start()`); `LLM.generate()` drives it in the caller's thread.
Only the loop thread touches the scheduler, engine and KV pool.
"""

from __future__ import annotations

import logging
import numbers
import queue
import threading
import traceback
from typing import Any, Callable

from pdlab.runtime.config import SchedulerConfig, build_config
from pdlab.runtime.core import FinishReason, Req, RequestError, SamplingParams, StepOutput
from pdlab.runtime.scheduler.output import TextCodec
from pdlab.runtime.scheduler.scheduler import RoleHooks, Scheduler

log = logging.getLogger("pdlab.runtime")
Sink = Callable[[StepOutput], None]


class EngineLoop:
    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        scheduler.on_output = self._dispatch
        self._inbox: queue.Queue = queue.Queue()
        self._sinks: dict[str, Sink] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.errors = 0

    # ---- thread-safe entry points --------------------------------------------------------------
    def submit(self, req: Req, sink: Sink) -> None:
        """Queue a request; ValueError (bad request) is raised here, in the caller's thread."""
        self.scheduler.validate(req)
        self._inbox.put(("add", req, sink))

    def abort(self, rid: str, reason: str = "aborted", error_status: int = 400) -> None:
        """Stop request `rid` in the loop thread; `error_status`: the HTTP status its client gets for `reason`."""
        self._inbox.put(("abort", rid, (reason, error_status)))

    def add_sink(self, rid: str, sink: Sink) -> None:
        """Route the outputs of `rid` to `sink` for a request added another way (role hooks,
        `call(lambda s: s.preallocate(req))`). A finished output removes the sink."""
        self._sinks[rid] = sink

    def drop_sink(self, rid: str) -> None:
        self._sinks.pop(rid, None)

    def call(self, fn: Callable[[Scheduler], Any]) -> None:
        """Run fn(scheduler) in the loop thread (role hooks: kv_ready, preallocate, release...)."""
        self._inbox.put(("call", fn, None))

    # ---- running ---------------------------------------------------------------------------------
    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="pdlab-engine-loop", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(("wake", None, None))
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.run_once(block=True) and self.scheduler.busy:
                # work exists but none can run now (e.g. waiting for pages held by requests whose KV a
                # peer is writing): wait for a message instead of spinning on the GIL
                try:
                    self._handle(self._inbox.get(timeout=0.002))
                except queue.Empty:
                    pass

    def run_once(self, block: bool = False) -> bool:
        """Drain the inbox, then run one step. Blocks briefly on an empty inbox when idle and `block`."""
        if block and not self.scheduler.busy and self._inbox.empty():
            try:
                self._handle(self._inbox.get(timeout=0.05))
            except queue.Empty:
                pass
        while True:
            try:
                self._handle(self._inbox.get_nowait())
            except queue.Empty:
                break
        try:
            return self.scheduler.step()
        except Exception as exc:  # a bug in one step must not take the server down: fail the batch
            self.errors += 1
            log.error("engine step failed: %s\n%s", exc, traceback.format_exc())
            for rid in list(self.scheduler.by_rid):
                self.scheduler.abort(rid, f"internal error: {type(exc).__name__}: {exc}", error_status=500)
            return False

    def _handle(self, item) -> None:
        kind, a, b = item
        if kind == "add":
            if a.rid in self._sinks or a.rid in self.scheduler.by_rid:
                # the id of a request in flight: answer the newcomer only, the running request keeps its sink
                b(StepOutput(a.rid, [], "", True, FinishReason.ERROR,
                             error=f"request id {a.rid!r} is already in flight; use a unique id"))
                return
            self._sinks[a.rid] = b
            try:
                self.scheduler.add_request(a)
            except ValueError as exc:
                self._dispatch(StepOutput(a.rid, [], "", True, FinishReason.ERROR, error=str(exc)))
        elif kind == "abort":
            self.scheduler.abort(a, b[0], error_status=b[1])
        elif kind == "call":
            a(self.scheduler)

    def _dispatch(self, out: StepOutput) -> None:
        sink = self._sinks.pop(out.rid, None) if out.finished else self._sinks.get(out.rid)
        if sink is not None:
            try:
                sink(out)
            except Exception:
                log.exception("output sink of %s failed", out.rid)
                if not out.finished:  # nobody receives its outputs any more (e.g. its HTTP event loop closed)
                    self.scheduler.abort(out.rid, "its output sink failed", error_status=500)


class LLM:
    """Offline generation over the same loop. `LLM(model=..., tokenizer=..., model_config=..., **settings)`
    with settings = SchedulerConfig fields (e.g. page_size=64, kv_dtype="fp8", max_total_tokens=4096)."""

    def __init__(self, cfg: SchedulerConfig | None = None, *, model=None, tokenizer=None, model_config=None,
                 hooks: RoleHooks | None = None, metrics=None, **settings):
        from pdlab.runtime.engine.engine import Engine
        self.cfg = cfg or build_config(SchedulerConfig, **settings)
        self.engine = Engine(self.cfg, model, tokenizer, model_config,
                             max_running_requests=self.cfg.max_running_requests)
        tok = self.engine.tokenizer
        self.codec = make_codec(tok, self.engine.model_config)
        self.scheduler = Scheduler(self.cfg, self.engine, self.codec, hooks=hooks, metrics=metrics)
        self.loop = EngineLoop(self.scheduler)

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 max_steps: int = 1_000_000) -> list[dict]:
        """Generate for each prompt (text or token ids). Returns per prompt a dict with token_ids,
        text, finish_reason, logprobs, num_retractions, error.

        params: one SamplingParams for every prompt, or one per prompt. Every prompt is checked before any is
        queued: a list of params of another length, a prompt that is neither text nor a list of int token ids,
        and a request that can never run (empty, ids outside the vocabulary, longer than the context) raise a
        ValueError naming the prompt's index, and nothing runs. If generation stops early (max_steps, an
        interrupt), the requests of this call are aborted, so none is left running into the next call."""
        params = params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"generate() got {len(prompts)} prompts but {len(plist)} SamplingParams; pass one "
                             "SamplingParams for all prompts, or one per prompt")
        reqs = []
        for i, (p, sp) in enumerate(zip(prompts, plist)):
            if isinstance(p, str):
                if self.codec is None:
                    raise ValueError(f"prompt {i} is text but this model has no tokenizer; pass token ids")
                ids = self.codec.encode(p)
            elif isinstance(p, (list, tuple)) and _first_bad(p) < 0:
                ids = [int(t) for t in p]
            else:
                got = type(p).__name__
                if isinstance(p, (list, tuple)):
                    got += f" holding {p[_first_bad(p)]!r}"
                raise ValueError(f"prompt {i} must be a str or a list of int token ids, got {got}")
            if not isinstance(sp, SamplingParams):
                raise ValueError(f"params for prompt {i} must be a SamplingParams, got {type(sp).__name__}")
            req = Req(ids, sp)
            try:
                self.scheduler.validate(req)
            except ValueError as exc:
                raise RequestError(f"prompt {i}: {exc}", getattr(exc, "param", None)) from None
            reqs.append(req)
        results: dict[str, dict] = {}
        for req in reqs:
            results[req.rid] = {"text": "", "token_ids": [], "logprobs": [], "finish_reason": None, "error": None}
            self.loop.submit(req, lambda out, res=results[req.rid]: collect_output(res, out))
        steps = 0
        try:
            while any(r["finish_reason"] is None for r in results.values()):
                self.loop.run_once()
                steps += 1
                if steps > max_steps:
                    raise RuntimeError(f"generate() did not finish within {max_steps} steps")
        except BaseException:
            for rid, res in results.items():
                if res["finish_reason"] is None:
                    self.loop.abort(rid, "generate() stopped early")
            self.loop.run_once()  # queues the adds not yet taken, then their aborts: nothing is left behind
            raise
        out = []
        for req in reqs:
            res = results[req.rid]
            res["num_retractions"] = req.num_retractions
            out.append(res)
        return out


def make_codec(tokenizer, model_config) -> TextCodec | None:
    """TextCodec with the EOS ids of both the tokenizer and the model config (None without a tokenizer)."""
    if tokenizer is None:
        return None
    eos = []
    for name in ("eos_token_id", "eos_token_ids"):
        v = getattr(model_config, name, None)
        eos += [v] if isinstance(v, int) else list(v or [])
    return TextCodec(tokenizer, eos)


def _first_bad(p) -> int:
    """The index of the first element of a prompt that is not an integer token id (numpy integers count), else -1."""
    return next((i for i, t in enumerate(p) if not isinstance(t, numbers.Integral) or isinstance(t, bool)), -1)


def collect_output(res: dict, out: StepOutput) -> None:
    """Append one StepOutput to an offline result dict (token_ids, text, logprobs; finish_reason, error and
    cached_tokens once finished): what `LLM.generate` and the offline disaggregated pair return per request."""
    res["token_ids"] += out.token_ids
    res["text"] += out.text
    res["logprobs"] += out.logprobs
    if out.finished:
        res["finish_reason"] = out.finish_reason.value if out.finish_reason else None
        res["error"] = out.error
        res["cached_tokens"] = out.cached_tokens
