"""Supervised launch of child processes (servers, workers): spawn them, wait for exactly one start-up
ack from each, and turn a child's death before its ack into the launch's own error carrying that
child's traceback and exit code. Generic: any `target(ack, *args, **kwargs)` function can be a child.

    sup = Supervisor(start_timeout=600)
    acks = sup.start([ChildSpec("prefill", "pdlab.runtime.disagg.launch:serve_role", args=(cfg,))])
    rc = sup.wait()          # until a child exits or SIGINT/SIGTERM; then the others are stopped

A child calls `ack(info)` once it is ready (info: a small picklable dict, e.g. its bound URL). If it
raises before that, the parent raises `LaunchError` naming the child, its exit code and its own
traceback, and stops every other child. A child that dies without a word (os._exit, a signal, a
crash in C) is reported with its exit code (or signal) as soon as the OS says it is gone: there is
no pipe read that could turn into an EOFError, and every wait has a timeout.
"""

from __future__ import annotations

import faulthandler
import importlib
import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

log = logging.getLogger("pdlab.supervisor")

__all__ = ["ChildSpec", "LaunchError", "Supervisor", "launch"]


class LaunchError(RuntimeError):
    """A child failed to start (or died); `.child`, `.exitcode`, `.child_traceback` say which and why."""

    def __init__(self, message: str, *, child: str | None = None, exitcode: int | None = None,
                 child_traceback: str = ""):
        super().__init__(message)
        self.child = child
        self.exitcode = exitcode
        self.child_traceback = child_traceback


@dataclass
class ChildSpec:
    """One child process. `target` is a top-level function or its "module:function" path; it is
    called as `target(ack, *args, **kwargs)` in a fresh (spawned) interpreter and must call
    `ack(info: dict | None)` exactly once when ready. `env` entries are set before the target is
    imported (e.g. CUDA_VISIBLE_DEVICES)."""

    name: str
    target: str | Callable[..., Any]
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class _Child:
    spec: ChildSpec
    proc: Any  # multiprocessing.Process
    conn: Any  # parent end of the child's pipe (child -> parent messages)
    acked: bool = False
    info: dict = field(default_factory=dict)
    error: str = ""  # traceback text the child sent, if any
    closed: bool = False


class Supervisor:
    """Spawns children and supervises them; see the module docstring.

    start_timeout: seconds to wait for all acks of one `start` call (a hang becomes a LaunchError).
    stop_timeout: seconds a child gets to exit after SIGTERM before it is killed.
    """

    def __init__(self, *, start_timeout: float = 600.0, stop_timeout: float = 5.0):
        self.start_timeout = float(start_timeout)
        self.stop_timeout = float(stop_timeout)
        self._ctx = mp.get_context("spawn")
        self._children: list[_Child] = []

    # ------------------------------------------------------------------ public
    @property
    def children(self) -> dict[str, int | None]:
        """name -> pid of every child started so far."""
        return {c.spec.name: c.proc.pid for c in self._children}

    def start(self, specs: list[ChildSpec]) -> dict[str, dict]:
        """Spawn `specs` and wait for exactly one ack from each. Returns name -> ack info.

        Raises LaunchError (after stopping every child, earlier ones included) when a child raises or
        dies before its ack, or when not all acks arrive within `start_timeout` seconds."""
        names = [s.name for s in specs] + [c.spec.name for c in self._children]
        if len(set(names)) != len(names):
            raise ValueError(f"child names must be unique, got {names}")
        batch: list[_Child] = []
        for spec in specs:
            parent_conn, child_conn = self._ctx.Pipe(duplex=False)
            proc = self._ctx.Process(target=_child_entry, name=f"pdlab-{spec.name}", daemon=False,
                                     args=(spec.name, spec.target, spec.args, spec.kwargs, child_conn,
                                           spec.env))
            proc.start()
            child_conn.close()  # parent keeps only its end, so a dead child means EOF, not a hang
            child = _Child(spec, proc, parent_conn)
            self._children.append(child)
            batch.append(child)
            log.info("started %s (pid %d)", spec.name, proc.pid)
        deadline = time.monotonic() + self.start_timeout
        try:
            while not all(c.acked for c in batch):
                left = deadline - time.monotonic()
                if left <= 0:
                    waiting = [c.spec.name for c in batch if not c.acked]
                    raise LaunchError(
                        f"launch timed out after {self.start_timeout:.0f} s: no start-up ack from "
                        f"{', '.join(waiting)} (raise the start timeout if loading is slow)",
                        child=waiting[0])
                self._pump(min(left, 0.5), batch)
                for c in self._children:  # an earlier child's death also fails this launch
                    if not c.proc.is_alive() and not c.closed:
                        self._drain(c)
                    if not c.proc.is_alive():
                        raise self._death_error(c, during="start-up" if not c.acked else "launch")
        except BaseException:
            self.stop()
            raise
        return {c.spec.name: c.info for c in batch}

    def wait(self, timeout: float | None = None) -> int:
        """Block until a child exits, SIGINT/SIGTERM arrives, or `timeout` passes; then stop the
        others. Returns 0 on a signal/timeout or a clean child exit, else the dead child's exit code
        (its traceback, if it sent one, is logged to stderr)."""
        stop_flag = {"sig": None}

        def _on_signal(signum, _frame):
            stop_flag["sig"] = signum

        old = {}
        if _in_main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                old[s] = signal.signal(s, _on_signal)
        deadline = None if timeout is None else time.monotonic() + timeout
        rc = 0
        try:
            while stop_flag["sig"] is None and (deadline is None or time.monotonic() < deadline):
                self._pump(0.2, self._children)
                dead = [c for c in self._children if not c.proc.is_alive()]
                if dead:
                    c = dead[0]
                    self._drain(c)
                    code = c.proc.exitcode
                    if code != 0:
                        err = self._death_error(c, during="serving")
                        print(str(err), file=sys.stderr, flush=True)
                        rc = code if code and code > 0 else 1
                    else:
                        log.info("%s exited cleanly; stopping the others", c.spec.name)
                    break
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            self.stop()
        return rc

    def stop(self) -> None:
        """SIGTERM every live child, wait up to `stop_timeout` (servers drain their requests meanwhile), then SIGKILL
        what remains. A Ctrl-C during the wait kills them at once."""
        for c in self._children:
            if c.proc.is_alive():
                c.proc.terminate()
        deadline = time.monotonic() + self.stop_timeout
        for c in self._children:
            try:
                _join(c.proc, max(0.0, deadline - time.monotonic()))
            except KeyboardInterrupt:
                log.warning("interrupted while the children stop; killing them")
                deadline = 0.0
            if c.proc.is_alive():
                log.warning("%s did not exit within %.0f s of SIGTERM; killing it", c.spec.name,
                            self.stop_timeout)
                c.proc.kill()
                _join(c.proc, 2.0)
            if not c.closed:
                c.conn.close()
                c.closed = True

    # ----------------------------------------------------------------- helpers
    def _pump(self, timeout: float, among: list[_Child]) -> None:
        """Read whatever messages are ready (acks, errors); returns after at most `timeout` s."""
        conns = [c.conn for c in among if not c.closed]
        sentinels = [c.proc.sentinel for c in self._children]
        ready = mpc.wait(conns + sentinels, timeout=max(0.0, timeout))
        for c in among:
            if not c.closed and c.conn in ready:
                self._read_one(c)

    def _read_one(self, c: _Child) -> None:
        try:
            kind, payload = c.conn.recv()
        except (EOFError, OSError):  # the child closed its end: it exited; its exit code will tell
            c.conn.close()
            c.closed = True
            return
        if kind == "ack":
            if c.acked:
                log.warning("%s acked twice; ignoring the second ack", c.spec.name)
            c.acked = True
            c.info = dict(payload or {})
            log.info("%s is up: %s", c.spec.name, c.info)
        elif kind == "error":
            c.error = str(payload)

    def _drain(self, c: _Child) -> None:
        """After a child died, read what it sent before dying (bounded: the pipe is finite)."""
        _join(c.proc, 1.0)
        for _ in range(64):
            if c.closed or not c.conn.poll(0):
                break
            self._read_one(c)

    def _death_error(self, c: _Child, *, during: str) -> LaunchError:
        code = c.proc.exitcode
        if code is not None and code < 0:
            try:
                how = f"killed by signal {signal.Signals(-code).name}"
            except ValueError:
                how = f"killed by signal {-code}"
        else:
            how = f"exit code {code}"
        tb = c.error.rstrip()
        detail = f"\n--- {c.spec.name}'s own error ---\n{tb}" if tb else (
            "\n(it sent no traceback: it died outside Python or was killed; see its stderr above)")
        return LaunchError(f"{c.spec.name} (pid {c.proc.pid}) died during {during}: {how}{detail}",
                           child=c.spec.name, exitcode=code, child_traceback=tb)


def launch(specs: list[ChildSpec], *, start_timeout: float = 600.0) -> int:
    """Start `specs`, print each ack, then supervise until a child exits or Ctrl-C. Returns the exit
    code for the command line: 0, or the failing child's non-zero code (a failed start prints the
    child's error and returns its exit code, 1 if it had none)."""
    sup = Supervisor(start_timeout=start_timeout)
    try:
        acks = sup.start(specs)
    except LaunchError as e:
        print(f"launch failed: {e}", file=sys.stderr, flush=True)
        return e.exitcode if e.exitcode and e.exitcode > 0 else 1
    for name, info in acks.items():
        print(f"{name} ready: {info}", flush=True)
    return sup.wait()


# ------------------------------------------------------------------- child side
def _resolve(target: str | Callable[..., Any]) -> Callable[..., Any]:
    if callable(target):
        return target
    module, sep, attr = str(target).partition(":")
    if not sep:
        raise ValueError(f"child target {target!r} must be 'package.module:function'")
    fn = importlib.import_module(module)
    for part in attr.split("."):
        fn = getattr(fn, part)
    return fn


def _child_entry(name, target, args, kwargs, conn, env) -> None:
    os.environ.update({k: str(v) for k, v in (env or {}).items()})
    faulthandler.enable()  # a crash in C still prints a Python stack to stderr
    # the parent handles Ctrl-C and stops children with SIGTERM; make SIGTERM a clean exit
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    acked = []

    def ack(info: dict | None = None) -> None:
        if not acked:
            acked.append(True)
            conn.send(("ack", dict(info or {})))

    code = 0
    try:
        _resolve(target)(ack, *args, **(kwargs or {}))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if code != 0:
            _send_error(conn, f"SystemExit({e.code!r}) in {name}:\n{traceback.format_exc()}")
    except BaseException:  # noqa: BLE001 - the whole point is to ship any failure to the parent
        code = 1
        _send_error(conn, traceback.format_exc())
    finally:
        try:
            conn.close()
        except OSError:
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _send_error(conn, text: str) -> None:
    try:
        conn.send(("error", text))
    except (OSError, EOFError, BrokenPipeError):
        sys.stderr.write(text)


def _join(proc, timeout: float) -> None:
    """Wait for a process by its pid (waitpid), not by its sentinel pipe: a helper process it forked
    (e.g. torch_shm_manager for shared KV pools) may hold that pipe open long after it exited."""
    deadline = time.monotonic() + timeout
    while proc.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
