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


def _exit_code(argv: list[str]) -> int:
    """`pdlab ARGV` in this process: its exit code, whether returned or raised (argparse's usage errors)."""
    from pdlab.cli import main

    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


@pytest.mark.parametrize("argv,flag", [
    (["runtime", "serve", "--max-run", "0"], "--max-run"),  # was --max-running-requests
    (["runtime", "serve", "--role", "prefill", "--max-run", "0"], "--max-run"),
    (["runtime", "serve", "--role", "router", "--decode", "http://127.0.0.1:9", "--pol", "x"], "--pol"),
    (["bench", "moe", "--tok", "0"], "--tok"),  # was --tokens
    (["tune", "attention", "--tri", "0"], "--tri"),  # was --trials
])
def test_a_partial_flag_is_a_usage_error_naming_it(argv, flag, capsys):
    """argparse took a flag's prefix for the flag it begins (allow_abbrev), so `runtime serve --decode URL` without
    --role read URL as --decode-reserve-tokens; now a flag that is not spelt out is unknown, exit 2 naming it."""
    assert _exit_code(argv) == 2
    err = capsys.readouterr().err
    assert f"unrecognized arguments: {flag}" in err, err


@pytest.mark.parametrize("argv,said", [
    (["--decode", "http://127.0.0.1:9"], "--decode is a router setting: start the router with `runtime serve --role "
                                         "router --decode URL"),  # was read as --decode-reserve-tokens
    (["--policy=least_loaded"], "--policy is a router setting"),
    (["--transfer-timeout", "5"], "--transfer-timeout is a setting of a disaggregated server: add --role prefill or "
                                  "--role decode, or use --disagg"),
    (["--start-timeout", "5"], "--start-timeout is how long --disagg waits for its servers to start: add --disagg"),
])
def test_a_disaggregation_flag_without_role_says_which_mode_takes_it(argv, said, capsys):
    """`runtime serve` (colocated) given a flag only the router, a role server or --disagg reads: one line naming
    the flag and the mode that takes it, exit 2, nothing started (it said only "unrecognized arguments")."""
    assert _exit_code(["runtime", "serve", "--model", "tiny", *argv]) == 2
    err = capsys.readouterr().err
    assert said in err and err.count("\n") == 1, err


def test_every_pdlab_parser_refuses_abbreviations():
    """Every pdlab parser comes from `arg_parser` (a new tool's too), and it takes flags only as spelt out in full."""
    import ast
    import pathlib

    import pdlab
    from pdlab._subcommands import arg_parser

    root = pathlib.Path(pdlab.__file__).parent
    direct = []
    for path in root.rglob("*.py"):
        if "tests" in path.relative_to(root).parts or path.name == "_subcommands.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == \
                    "ArgumentParser":
                direct.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not direct, f"argparse.ArgumentParser called directly (use pdlab._subcommands.arg_parser): {direct}"
    p = arg_parser(prog="t")
    p.add_argument("--decode-reserve-tokens", type=int)
    assert p.parse_args(["--decode-reserve-tokens", "3"]).decode_reserve_tokens == 3
    with pytest.raises(SystemExit):
        p.parse_args(["--decode", "3"])


def test_an_unknown_flag_names_the_flag_it_likely_meant(capsys):
    """argparse said only "unrecognized arguments: --max-running-request 4": the message names the flag a misspelt one
    likely meant, and nothing for one that is like no flag."""
    assert _exit_code(["runtime", "serve", "--max-running-request", "4"]) == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --max-running-request 4 (--max-running-request: did you mean " \
           "--max-running-requests?)" in err
    assert _exit_code(["bench", "attention", "--batchs=3", "--zzz"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith("unrecognized arguments: --batchs=3 --zzz (--batchs: did you mean --batch?)"), err


@pytest.mark.parametrize("mode", [["--disagg", "--device", "cpu"],
                                  ["--role", "router", "--decode", "http://127.0.0.1:9"]])
@pytest.mark.parametrize("flag,value,field", [("--health-interval", "0", "health_interval"),
                                              ("--request-timeout", "-1", "request_timeout")])
def test_a_bad_router_setting_is_one_line_before_anything_starts(mode, flag, value, field):
    """`--disagg --health-interval 0` started both servers, then died with a pydantic traceback when it built the
    router; --role router printed pydantic's raw report (input dict, documentation link). Now both are the
    configuration error every other setting gets, exit 2, before any server starts."""
    p = _serve(*mode, flag, value, "--port", "0", timeout=60)
    out = p.stdout + p.stderr
    assert p.returncode == 2, out
    assert f"{field}: Input should be greater than 0" in out, out
    assert "Traceback" not in out and "pydantic" not in out and "ready" not in out, out


@pytest.mark.parametrize("mode", [[], ["--role", "router", "--decode", "http://127.0.0.1:9"]])
@pytest.mark.parametrize("host", ["", " "])
def test_an_empty_host_is_refused(mode, host):
    """`--host "$HOST"` with HOST unset: the server listened on every interface (0.0.0.0) though it binds 127.0.0.1
    unless told otherwise, and the router silently took 127.0.0.1; now a usage error naming --host."""
    p = _serve(*mode, "--host", host, "--port", "0", timeout=60)
    out = p.stdout + p.stderr
    assert p.returncode == 2, out
    assert "--host is empty" in out and "0.0.0.0" in out, out
    assert "serving on" not in out and "ready" not in out, out
