"""`runtime serve` as a new user types it: a bad --host or a taken --port is a one-line error naming that flag and its
value, before any model is loaded."""

import socket
import subprocess
import sys

import pytest


def _serve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdlab.runtime", "serve", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("mode", [[], ["--role", "prefill"], ["--role", "router", "--decode", "http://127.0.0.1:9"],
                                  ["--disagg"]])
@pytest.mark.parametrize("host", ["999.1.1.1", "10.123.45.67"])
def test_a_host_this_machine_cannot_listen_on_names_host(mode, host):
    """`--host 999.1.1.1` (no such address) or an address of another machine failed with 'pick another --port' (or
    a bare errno), after loading the model; now exit 2 at once, naming --host and the value."""
    p = _serve(*mode, "--host", host, "--port", "0", "--device", "cpu") if mode[:2] != ["--role", "router"] else \
        _serve(*mode, "--host", host, "--port", "0")
    out = p.stdout + p.stderr
    assert p.returncode == 2, out
    assert f"--host {host}" in out and "--port" not in out, out
    assert "warm-up" not in out and "ready" not in out, out  # refused before a model was loaded or a process started


@pytest.mark.parametrize("mode", [[], ["--role", "prefill", "--device", "cpu"],
                                  ["--role", "router", "--decode", "http://127.0.0.1:9"]])
def test_a_port_in_use_names_port(mode):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        p = _serve(*mode, "--port", str(port))
    out = p.stdout + p.stderr
    assert p.returncode == 2, out
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use; choose another --port" in out, out
    assert "--host" not in out, out
    assert "warm-up" not in out, out
