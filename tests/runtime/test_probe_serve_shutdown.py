"""A server that stops (Ctrl-C, SIGTERM, `Server.stop()`) while requests are in flight: those that finish within
`shutdown_timeout` are served in full, the rest end with a 503 their clients receive (never a cut connection or a
500 from inside the HTTP stack), and requests that arrive meanwhile get a 503 naming the shutdown."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import httpx

sys.path.insert(0, os.path.dirname(__file__))
from test_server_api import SlowToy, _server  # noqa: E402


def _events(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


def test_stop_drains_then_aborts_with_503():
    srv = _server(SlowToy, shutdown_timeout=1.0)
    base = f"http://127.0.0.1:{srv.port}"
    res: dict = {}

    def call(name: str, body: dict):
        try:
            with httpx.Client(base_url=base, timeout=30) as c:
                res[name] = c.post("/v1/completions", json=body)
        except httpx.HTTPError as exc:  # a cut connection is the fault this test pins
            res[name] = exc

    long = {"prompt": "a long answer", "max_tokens": 240, "ignore_eos": True, "temperature": 0}
    threads = [threading.Thread(target=call, args=("stream", {**long, "stream": True})),
               threading.Thread(target=call, args=("non_stream", long)),
               threading.Thread(target=call, args=("short", {**long, "max_tokens": 20}))]
    for t in threads:
        t.start()
    deadline = time.time() + 10
    while len(srv.scheduler.by_rid) < 3 and time.time() < deadline:
        time.sleep(0.01)
    assert len(srv.scheduler.by_rid) == 3
    stopper = threading.Thread(target=srv.stop)
    t0 = time.time()
    stopper.start()
    time.sleep(0.2)
    try:  # while the server drains, a new request is refused with a clear 503 (or the port is closed already)
        late = httpx.post(f"{base}/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=10)
        assert late.status_code == 503, late.text
        assert "shutting down" in late.json()["error"]["message"]
    except httpx.ConnectError:
        pass
    for t in threads:
        t.join(30)
    stopper.join(30)
    took = time.time() - t0

    short = res["short"]
    assert isinstance(short, httpx.Response) and short.status_code == 200, short
    assert short.json()["usage"]["completion_tokens"] == 20 and short.json()["choices"][0]["finish_reason"] == "length"

    stream = res["stream"]
    assert isinstance(stream, httpx.Response) and stream.status_code == 200, stream
    ev = _events(stream.text)
    assert ev[-1] == "[DONE]", ev[-3:]
    err = json.loads(ev[-2])["error"]
    assert err["code"] == 503 and "shutting down" in err["message"]

    ns = res["non_stream"]  # tokens already made, but no answer: the 503 (it was a 200 with finish_reason "abort")
    assert isinstance(ns, httpx.Response), ns
    assert ns.status_code == 503 and "shutting down" in ns.json()["error"]["message"], ns.text

    assert not srv.scheduler.by_rid
    assert srv.engine.pool.num_free_pages == srv.engine.pool.allocator.capacity
    assert took < 1.0 + 5.0


def test_stop_without_requests_is_quick():
    srv = _server()
    t0 = time.time()
    srv.stop()
    assert time.time() - t0 < 2.0


_CHILD = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    import torch
    from test_server_api import SlowToy, CTX
    from pdlab.runtime.config import build_config, ServerConfig
    from pdlab.runtime.engine.testing import load_toy
    from pdlab.runtime.server.serve import Server
    torch.set_num_threads(1)
    m, tok, cfg = load_toy(max_position_embeddings=CTX)
    sc = build_config(ServerConfig, device="cpu", port=0, page_size=16, max_total_tokens=2048, max_context_len=CTX,
                      shutdown_timeout={grace})
    srv = Server(sc, model=SlowToy(cfg), tokenizer=tok, model_config=cfg)
    srv.start = (lambda start: lambda *a: print("PORT", start(*a), flush=True))(srv.start)
    srv.serve_forever()
    print("CLEAN EXIT", flush=True)
""")


def _stream_until_stopped(grace: float, signals: int) -> tuple[list[str], float, subprocess.Popen, str]:
    """Start `runtime serve`'s loop in a child with shutdown_timeout `grace`, read 3 events of a long stream, send
    SIGTERM `signals` times 0.5 s apart; returns the stream's data events, the seconds from the first signal to the
    stream's end, the child and its output."""
    code = _CHILD.format(tests=os.path.dirname(__file__), grace=grace)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        port = None
        deadline = time.time() + 60
        while port is None and time.time() < deadline:
            line = proc.stdout.readline()
            if line.startswith("PORT "):
                port = int(line.split()[1])
        assert port, "child server did not start"
        body = {"prompt": "go on", "max_tokens": 240, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
            with c.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                got = [next(lines) for _ in range(3)]
                t0 = time.time()
                for i in range(signals):
                    if i:
                        time.sleep(0.5)
                    proc.send_signal(signal.SIGTERM)
                got += list(lines)
                took = time.time() - t0
        out, _ = proc.communicate(timeout=30)
        return [g[6:] for g in got if g.startswith("data: ")], took, proc, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigterm_stops_a_server_gracefully():
    """`runtime serve` under SIGTERM (docker stop, systemd, kill): the stream in flight ends with a 503 error event
    and [DONE] instead of a cut connection, and the process exits cleanly."""
    ev, _, proc, out = _stream_until_stopped(0.5, 1)
    assert ev[-1] == "[DONE]", ev[-3:]
    assert json.loads(ev[-2])["error"]["code"] == 503
    assert proc.returncode == 0, out
    assert "CLEAN EXIT" in out, out


def test_a_second_signal_ends_the_drain_at_once():
    """A second Ctrl-C / SIGTERM while the server drains ends the wait: the stream gets its 503 then, not after the
    60 s grace period."""
    ev, took, proc, out = _stream_until_stopped(60.0, 2)
    assert ev[-1] == "[DONE]", ev[-3:]
    assert json.loads(ev[-2])["error"]["code"] == 503
    assert took < 30, took
    assert proc.returncode == 0, out
    assert "interrupted" in out, out
