"""Supervised launch: acks, and every way a child can fail before (or after) its ack."""

import os
import socket
import time
from pathlib import Path

import pytest

from pdlab.runtime.supervisor import ChildSpec, LaunchError, Supervisor

HERE = str(Path(__file__).parent)
M = "disagg_children"


@pytest.fixture(autouse=True)
def _children_importable(monkeypatch):
    monkeypatch.syspath_prepend(HERE)  # spawned children inherit the parent's sys.path


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); read its state
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _fail_launch(specs, start_timeout=30.0):
    sup = Supervisor(start_timeout=start_timeout, stop_timeout=3.0)
    t0 = time.monotonic()
    with pytest.raises(LaunchError) as ei:
        sup.start(specs)
    elapsed = time.monotonic() - t0
    for name, pid in sup.children.items():
        assert not _alive(pid), f"{name} (pid {pid}) still running after a failed launch"
    return ei.value, elapsed


def test_all_children_ack_and_stop():
    sup = Supervisor(start_timeout=30)
    acks = sup.start([ChildSpec("a", f"{M}:ok", args=(1,)), ChildSpec("b", f"{M}:ok", args=(2,))])
    assert {k: v["value"] for k, v in acks.items()} == {"a": 1, "b": 2}
    pids = sup.children
    assert all(_alive(p) for p in pids.values())
    assert sup.wait(timeout=0.2) == 0  # timeout -> stops the children
    assert not any(_alive(p) for p in pids.values())


def test_exception_before_ack_reports_child_traceback_and_stops_others():
    err, elapsed = _fail_launch([ChildSpec("decode", f"{M}:ok"),
                                 ChildSpec("prefill", f"{M}:raises_before_ack", args=(0.5,))])
    assert elapsed < 10
    assert err.child == "prefill" and err.exitcode == 1
    assert "RuntimeError: model path /nonexistent/model does not exist" in str(err)
    assert "raises_before_ack" in err.child_traceback  # the child's own frames, not ours
    assert "EOFError" not in str(err)


def test_hard_exit_reports_exit_code():
    err, elapsed = _fail_launch([ChildSpec("worker", f"{M}:hard_exit", args=(7,)),
                                 ChildSpec("other", f"{M}:ok")])
    assert elapsed < 10
    assert err.child == "worker" and err.exitcode == 7
    assert "exit code 7" in str(err)


def test_import_error_in_worker():
    err, elapsed = _fail_launch([ChildSpec("worker", f"{M}:import_error")])
    assert elapsed < 10
    assert "ModuleNotFoundError" in err.child_traceback and "pdlab_no_such_module_xyz" in str(err)


def test_unresolvable_target():
    err, _ = _fail_launch([ChildSpec("worker", "pdlab.runtime.no_such_module:main")])
    assert "No module named 'pdlab.runtime.no_such_module'" in str(err)


def test_port_in_use():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        err, elapsed = _fail_launch([ChildSpec("router", f"{M}:bind_port", args=(port,))])
    assert elapsed < 10
    assert "Address already in use" in str(err) and err.exitcode == 1


def test_hang_becomes_timeout_error():
    err, elapsed = _fail_launch([ChildSpec("slow", f"{M}:never_acks")], start_timeout=3.0)
    assert "timed out" in str(err) and err.child == "slow"
    assert elapsed < 10


def test_death_after_ack_ends_wait_with_its_code(capfd):
    sup = Supervisor(start_timeout=30, stop_timeout=3.0)
    sup.start([ChildSpec("decode", f"{M}:dies_after_ack"), ChildSpec("prefill", f"{M}:ok")])
    pids = sup.children
    t0 = time.monotonic()
    assert sup.wait(timeout=20) == 1
    assert time.monotonic() - t0 < 10
    assert not any(_alive(p) for p in pids.values())
    assert "worker lost its engine after start-up" in capfd.readouterr().err


def test_clean_exit_returns_zero():
    sup = Supervisor(start_timeout=30, stop_timeout=3.0)
    sup.start([ChildSpec("a", f"{M}:exits_cleanly_after_ack")])
    assert sup.wait(timeout=20) == 0


def test_staged_start_earlier_child_death_fails_later_stage():
    sup = Supervisor(start_timeout=30, stop_timeout=3.0)
    sup.start([ChildSpec("decode", f"{M}:dies_after_ack", kwargs={"delay": 0.1})])
    time.sleep(1.0)
    with pytest.raises(LaunchError) as ei:
        sup.start([ChildSpec("router", f"{M}:never_acks")])
    assert ei.value.child == "decode"
    assert not any(_alive(p) for p in sup.children.values())


def test_duplicate_names_rejected():
    with pytest.raises(ValueError, match="unique"):
        Supervisor().start([ChildSpec("a", f"{M}:ok"), ChildSpec("a", f"{M}:ok")])
