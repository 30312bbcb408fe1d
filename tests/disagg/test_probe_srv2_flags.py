"""`runtime serve --role/--disagg` refuses flags that the chosen role would ignore."""

import os
import subprocess
import sys

import pytest


def _serve(*args, timeout=60):
    try:
        p = subprocess.run([sys.executable, "-m", "pdlab", "runtime", "serve", *args], capture_output=True,
                           text=True, timeout=timeout, env=os.environ)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"runtime serve {' '.join(args)} started instead of refusing its flags") from None
    return p.returncode, p.stderr + p.stdout


@pytest.mark.parametrize("args, names", [
    (["--role", "router", "--decode", "http://127.0.0.1:9", "--page-size", "32", "--device", "cpu"],
     ["--page-size", "--device"]),
    (["--role", "router", "--decode", "http://127.0.0.1:9", "--api-key", "k"], ["--api-key"]),
    (["--role", "prefill", "--device", "cpu", "--decode", "http://127.0.0.1:9"], ["--decode"]),
    (["--role", "decode", "--device", "cpu", "--policy", "least_loaded"], ["--policy"]),
    (["--disagg", "--device", "cpu", "--prefill", "http://127.0.0.1:9"], ["--prefill"]),
])
def test_flags_the_role_ignores_are_refused(args, names):
    """A router started with server flags (a KV page size, a device, an API key: the router holds none) or a server
    role given the router's server lists served as if they were not there, and said nothing. Now the launch exits 2
    with one line naming them, before any process starts."""
    rc, out = _serve(*args, "--port", "0")
    assert rc == 2 and "Traceback" not in out, out
    assert all(n in out for n in names) and "ignore" in out, out
