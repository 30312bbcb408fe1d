"""Disaggregated serving over HTTP (prefill server, decode server, router in their own processes),
the launcher's failure modes, and the per-role configuration checks."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from pdlab.runtime.config import ConfigError, build_config
from pdlab.runtime.core import SamplingParams
from pdlab.runtime.disagg.config import RoleConfig
from pdlab.runtime.disagg.launch import launch_disagg, serve_role, serve_router
from pdlab.runtime.disagg.transfer.nixl import available as nixl_available
from pdlab.runtime.engine.loop import LLM
from pdlab.runtime.router.router import RouterConfig
from pdlab.runtime.supervisor import ChildSpec, Supervisor

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from disagg_children import load_sensitive_toy  # noqa: E402

FACTORY = "disagg_children:load_sensitive_toy"
BASE = dict(device="cpu", page_size=16, max_total_tokens=4096, chunked_prefill_size=32, max_prefill_tokens=64,
            max_context_len=512, log_level="warning", port=0, transfer_timeout=5.0)


@pytest.fixture(scope="module")
def stack():
    """prefill + decode + router, supervised; yields (router_url, acks, supervisor)."""
    sup = Supervisor(start_timeout=120, stop_timeout=5)
    try:
        acks = sup.start([
            ChildSpec("prefill", serve_role, args=({**BASE, "role": "prefill"},), kwargs={"model_factory": FACTORY}),
            ChildSpec("decode", serve_role, args=({**BASE, "role": "decode"},), kwargs={"model_factory": FACTORY}),
        ])
        rcfg = RouterConfig(prefill=[acks["prefill"]["url"]], decode=[acks["decode"]["url"]], port=0,
                            health_interval=0.5, health_timeout=1.0)
        acks.update(sup.start([ChildSpec("router", serve_router, args=(rcfg.model_dump(),))]))
        yield acks["router"]["url"], acks, sup
    finally:
        sup.stop()


def _generate(client, url, ids, max_new=10, stream=False):
    body = {"input_ids": ids, "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new}, "stream": stream}
    if not stream:
        r = client.post(f"{url}/generate", json=body)
        assert r.status_code == 200, r.text
        return r.json()["output_ids"]
    last = None
    with client.stream("POST", f"{url}/generate", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                last = json.loads(line[6:])
                assert "error" not in last, last
    return last["output_ids"]


def test_http_greedy_equals_colocated(stack):
    url, acks, _ = stack
    lens = [1, 3, 15, 16, 17, 32, 37, 103]  # short, page-boundary, longer than one prefill chunk
    prompts = [[(7 * i + 3 * n) % 256 for i in range(n)] for n in lens]
    model, tok, cfg = load_sensitive_toy()
    settings = {k: v for k, v in BASE.items() if k not in ("log_level", "port", "transfer_timeout")}
    ref = [r["token_ids"] for r in LLM(model=model, tokenizer=tok, model_config=cfg, **settings)
           .generate(prompts, SamplingParams(temperature=0.0, max_tokens=10))]
    with httpx.Client(timeout=60) as c:
        got = [_generate(c, url, p, stream=(i % 2 == 1)) for i, p in enumerate(prompts)]
        assert got == ref
        # states visible in metrics on both servers
        m = c.get(f"{acks['decode']['url']}/metrics").text
        assert 'pdlab_disagg_transitions_total{role="decode",state="done"}' in m
        st = c.get(f"{acks['prefill']['url']}/disagg/state").json()
        assert st["total"]["transferring"] >= len(prompts) and st["bytes_sent"] > 0
        # an OpenAI completion with token ids through the router
        r = c.post(f"{url}/v1/completions", json={"prompt": prompts[2], "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        # a client's X-Request-Id: /generate takes it as its id on both servers (whose ids are the transfer's) and
        # it comes back from the router, twice in a row (the first is no longer in flight)
        for _ in range(2):
            r = c.post(f"{url}/generate", json={"input_ids": prompts[2], "sampling_params": {"max_new_tokens": 3}},
                       headers={"X-Request-Id": "client-1"})
            assert r.status_code == 200 and r.headers["x-request-id"] == "client-1", r.text


def test_http_client_disconnect_frees_pages_on_both_sides(stack):
    url, acks, _ = stack
    with httpx.Client(timeout=30) as c:
        before = {r: c.get(f"{acks[r]['url']}/disagg/state").json()["total"] for r in ("decode", "prefill")}
        _leave_after_the_first_token_and_check_pages(c, url, acks)
        # a client that leaves is counted as aborted on the decode server, not as one of its failures
        after = c.get(f"{acks['decode']['url']}/disagg/state").json()["total"]
        assert after["aborted"] == before["decode"]["aborted"] + 1 and after["failed"] == before["decode"]["failed"]
        assert 'pdlab_disagg_transitions_total{role="decode",state="aborted"}' in \
            c.get(f"{acks['decode']['url']}/metrics").text
        r = c.post(f"{acks['decode']['url']}/disagg/abort", json={"transfer_id": "x", "fault": "yes"})
        assert r.status_code == 400 and "fault must be true or false" in r.json()["error"]["message"]


def _leave_after_the_first_token_and_check_pages(c, url, acks):
    """Stream a long generation through the router, leave at the first token, then wait until both servers hold no
    KV page (the router's aborts reached them)."""
    body = {"input_ids": [5] * 40, "sampling_params": {"temperature": 0.0, "max_new_tokens": 400, "ignore_eos": True},
            "stream": True}
    with c.stream("POST", f"{url}/generate", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # first token arrived: leave
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        d = c.get(f"{acks['decode']['url']}/metrics").text
        p = c.get(f"{acks['prefill']['url']}/metrics").text
        if _gauge(d, "kv_cache_usage_ratio") == 0 and _gauge(p, "kv_cache_usage_ratio") == 0:
            break
        time.sleep(0.1)
    assert _gauge(d, "kv_cache_usage_ratio") == 0 and _gauge(p, "kv_cache_usage_ratio") == 0, (d, p)


def _gauge(text, name):
    for line in text.splitlines():
        if not line.startswith("#") and name in line.split("{")[0].split(" ")[0]:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no metric containing {name!r} in:\n{text[:2000]}")


def test_a_prompt_only_the_prefill_server_refuses_gets_its_400_at_once():
    """Servers started with other settings (here the prefill server's context is shorter): the decode server takes a
    prompt the prefill server refuses. The client gets the prefill server's 400 and its reason at once, not a 502
    after the decode server's transfer timeout (30 s here), and both servers keep serving."""
    sup = Supervisor(start_timeout=120, stop_timeout=5)
    try:
        acks = sup.start([
            ChildSpec("prefill", serve_role, args=({**BASE, "role": "prefill", "max_context_len": 64},),
                      kwargs={"model_factory": FACTORY}),
            ChildSpec("decode", serve_role, args=({**BASE, "role": "decode", "transfer_timeout": 30.0},),
                      kwargs={"model_factory": FACTORY}),
        ])
        rcfg = RouterConfig(prefill=[acks["prefill"]["url"]], decode=[acks["decode"]["url"]], port=0,
                            health_interval=0.5, health_timeout=1.0)
        url = sup.start([ChildSpec("router", serve_router, args=(rcfg.model_dump(),))])["router"]["url"]
        with httpx.Client(timeout=60) as c:
            t0 = time.monotonic()
            r = c.post(f"{url}/generate", json={"input_ids": [5] * 100, "sampling_params": {"max_new_tokens": 4}})
            took = time.monotonic() - t0
            assert r.status_code == 400, r.text
            msg = r.json()["error"]["message"]
            # the router's word, or the prefill server's refusal of the page hand-off, whichever comes first
            assert "context is 64 tokens" in msg, msg
            assert took < 10, took
            assert len(_generate(c, url, [(7 * i + 3) % 256 for i in range(20)], max_new=6)) == 6
            state = c.get(f"{acks['decode']['url']}/disagg/state").json()
            assert all(v["state"] in ("done", "failed") for v in state["requests"].values()), state
    finally:
        sup.stop()


_DISAGG_CHILD = """
import sys
sys.path.insert(0, {here!r})
from pdlab.runtime.disagg.launch import launch_disagg
base = {base!r}
rc = launch_disagg({{**base, "role": "prefill"}}, {{**base, "role": "decode"}},
                   router={{"host": "127.0.0.1", "port": 0, "shutdown_timeout": base["shutdown_timeout"]}},
                   model_factory="disagg_children:load_slow_decode_toy",
                   on_ready=lambda acks: print("ROUTER", acks["router"]["url"], flush=True))
print("EXIT", rc, flush=True)
"""


def test_disagg_stop_drains_then_ends_the_rest_with_503():
    """`runtime serve --disagg` under SIGTERM (or Ctrl-C): the servers and the router take no new requests, those in
    flight get shutdown_timeout (2 s here) to finish, the rest end with a 503 error event and [DONE] that reach the
    client through the router (before, every child exited at once and cut the streams), and the launcher exits 0."""
    base = {**BASE, "shutdown_timeout": 2.0}
    code = _DISAGG_CHILD.format(here=str(HERE), base=base)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    res: dict = {}
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()  # the launcher's children share its stdout: read it without blocking the test
    try:
        url = None
        deadline = time.time() + 120
        while url is None and time.time() < deadline and (proc.poll() is None or reader.is_alive()):
            url = next((ln.split()[1] for ln in list(lines) if ln.startswith("ROUTER ")), None)
            time.sleep(0.05)
        assert url, "the disaggregated stack did not start:\n" + "".join(lines)

        def call(name, max_new, stream):
            body = {"input_ids": [5, 6, 7], "stream": stream,
                    "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new, "ignore_eos": True}}
            with httpx.Client(timeout=60) as c:
                try:
                    res[name] = c.post(f"{url}/generate", json=body)
                except httpx.HTTPError as exc:  # a cut connection is the fault this test pins
                    res[name] = exc

        long = threading.Thread(target=call, args=("long", 480, True))  # 20 ms a token: ~10 s
        short = threading.Thread(target=call, args=("short", 30, False))  # ~0.6 s: finishes within the grace
        long.start()
        short.start()
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        long.join(60)
        short.join(60)
        proc.wait(timeout=60)
        reader.join(10)
        out = "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    short = res["short"]
    assert isinstance(short, httpx.Response) and short.status_code == 200, short
    assert len(short.json()["output_ids"]) == 30
    long = res["long"]
    assert isinstance(long, httpx.Response) and long.status_code == 200, long
    events = [ln[6:] for ln in long.text.splitlines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    err = json.loads(events[-2])["error"]
    assert err["code"] == 503 and "shutting down" in err["message"], err
    assert proc.returncode == 0 and "EXIT 0" in out, out


def test_a_launch_that_fails_after_the_servers_started_stops_them(monkeypatch):
    """A bad router setting is found after the prefill and decode servers started: the launcher raises, and stops
    them (they were left running, holding the launcher's stdout open)."""
    import pdlab.runtime.supervisor as supervisor
    from pydantic import ValidationError

    made = []

    class Recording(supervisor.Supervisor):
        def __init__(self, **kw):
            super().__init__(**kw)
            made.append(self)

    monkeypatch.setattr(supervisor, "Supervisor", Recording)
    cfgs = [{**BASE, "role": r} for r in ("prefill", "decode")]
    with pytest.raises(ValidationError, match="no_such_router_setting"):
        launch_disagg(*cfgs, router={"host": "127.0.0.1", "port": 0, "no_such_router_setting": 1},
                      model_factory=FACTORY)
    (sup,) = made
    assert set(sup.children) == {"prefill", "decode"}
    assert all(not c.proc.is_alive() for c in sup._children)


def test_greedy_check_collects_and_compares(stack, tmp_path):
    from pdlab.runtime.disagg import greedy_check

    url = stack[0]
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert greedy_check.main(["--base-url", url, "--out", str(a), "--page-size", "16", "--chunk", "32",
                              "--vocab", "256", "--max-new-tokens", "3"]) == 0
    rec = json.loads(a.read_text())
    assert rec["prompt_lens"] == [1, 2, 7, 15, 16, 17, 32, 31, 33, 51] and all(len(o) == 3 for o in rec["outputs"])
    rec["outputs"][4][1] += 1
    b.write_text(json.dumps(rec))
    assert greedy_check.main(["--compare", str(a), str(a)]) == 0
    assert greedy_check.main(["--compare", str(a), str(b)]) == 1


def test_prefill_death_fails_request_marks_unhealthy_and_readmits(stack):
    """Kill the prefill server mid-flight: the client gets an error in time, the router marks it
    unhealthy; a new prefill on the same port is re-admitted once its health check passes.
    NOTE: kills the stack's prefill, so it is the last test that uses the `stack` fixture."""
    url, acks, sup = stack
    with httpx.Client(timeout=30) as c:
        pid = sup.children["prefill"]
        os.kill(pid, 9)
        t0 = time.monotonic()
        r = c.post(f"{url}/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}})
        # the prefill side failed, not the request: 502 (a client may retry it), named as such
        assert r.status_code == 502 and time.monotonic() - t0 < 10, r.text
        assert r.json()["error"]["type"] == "bad_gateway" and "prefill" in r.json()["error"]["message"]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            b = c.get(f"{url}/router/backends").json()
            if not b[0]["healthy"]:
                break
            time.sleep(0.1)
        assert b[0]["role"] == "prefill" and not b[0]["healthy"]
        assert c.post(f"{url}/generate", json={"input_ids": [1], "sampling_params": {}}).status_code == 503
        # decode freed the pages of the failed request
        assert _gauge(c.get(f"{acks['decode']['url']}/metrics").text, "kv_cache_usage_ratio") == 0
        # a new prefill on the same port: re-admitted, requests flow again
        port = int(acks["prefill"]["url"].rsplit(":", 1)[1])
        sup2 = Supervisor(start_timeout=120)
        try:
            sup2.start([ChildSpec("prefill2", serve_role, args=({**BASE, "role": "prefill", "port": port},),
                                  kwargs={"model_factory": FACTORY, "factory_kwargs": {"slow_token": 254}})])
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and not c.get(f"{url}/router/backends").json()[0]["healthy"]:
                time.sleep(0.1)
            assert _generate(c, url, [9, 8, 7], max_new=3)
            # now kill it while it computes a prompt whose pages the decode server holds
            box = {}
            th = threading.Thread(target=lambda: box.setdefault("r", c.post(f"{url}/generate", json={
                "input_ids": [254, 1, 2], "sampling_params": {"max_new_tokens": 4}})))
            th.start()
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                st = c.get(f"{acks['decode']['url']}/disagg/state").json()
                if st["current"]["waiting"] or st["current"]["transferring"]:
                    break
                time.sleep(0.05)
            assert st["current"]["waiting"] + st["current"]["transferring"] == 1
            assert _gauge(c.get(f"{acks['decode']['url']}/metrics").text, "kv_cache_usage_ratio") > 0
            os.kill(sup2.children["prefill2"], 9)
            t0 = time.monotonic()
            th.join(BASE["transfer_timeout"] + 10)
            # the router saw the prefill's connection break: the client's 502 comes at once, not at the timeout
            assert box["r"].status_code == 502 and time.monotonic() - t0 < BASE["transfer_timeout"] / 2, \
                (box["r"].text, time.monotonic() - t0)
            assert "prefill" in box["r"].text
            # the decode pages go once the prefill can no longer write them (here: at the transfer timeout)
            deadline = time.monotonic() + BASE["transfer_timeout"] + 5
            while time.monotonic() < deadline and _gauge(c.get(f"{acks['decode']['url']}/metrics").text,
                                                         "kv_cache_usage_ratio"):
                time.sleep(0.1)
            assert _gauge(c.get(f"{acks['decode']['url']}/metrics").text, "kv_cache_usage_ratio") == 0
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and c.get(f"{url}/router/backends").json()[0]["healthy"]:
                time.sleep(0.1)
            assert not c.get(f"{url}/router/backends").json()[0]["healthy"]
        finally:
            sup2.stop()


@pytest.mark.skipif(not nixl_available()[0], reason="NIXL not importable")
def test_http_nixl_between_processes():
    """The NIXL backend between two server processes (UCX over shared memory / TCP on one host)."""
    cfg = {**BASE, "kv_transfer": "nixl"}
    sup = Supervisor(start_timeout=120, stop_timeout=5)
    try:
        acks = sup.start([
            ChildSpec("prefill", serve_role, args=({**cfg, "role": "prefill"},), kwargs={"model_factory": FACTORY}),
            ChildSpec("decode", serve_role, args=({**cfg, "role": "decode"},), kwargs={"model_factory": FACTORY}),
        ])
        rcfg = RouterConfig(prefill=[acks["prefill"]["url"]], decode=[acks["decode"]["url"]], port=0)
        url = sup.start([ChildSpec("router", serve_router, args=(rcfg.model_dump(),))])["router"]["url"]
        prompts = [[(5 * i + n) % 256 for i in range(n)] for n in (16, 45)]
        model, tok, mcfg = load_sensitive_toy()
        settings = {k: v for k, v in BASE.items() if k not in ("log_level", "port", "transfer_timeout")}
        ref = [r["token_ids"] for r in LLM(model=model, tokenizer=tok, model_config=mcfg, **settings)
               .generate(prompts, SamplingParams(temperature=0.0, max_tokens=6))]
        with httpx.Client(timeout=60) as c:
            assert [_generate(c, url, p, max_new=6) for p in prompts] == ref
    finally:
        sup.stop()


# ------------------------------------------------------------------------------ launch failures
def _cli(*args, timeout=60):
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "pdlab", "runtime", "serve", *args], capture_output=True, text=True,
                       timeout=timeout, env={**os.environ, "PYTHONPATH": str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", "")})
    return p.returncode, p.stderr + p.stdout, time.monotonic() - t0


def test_disagg_bad_model_path_exits_with_one_line_before_any_child():
    rc, out, dt = _cli("--disagg", "--model-path", "/nonexistent/model", "--device", "cpu", "--port", "0")
    assert rc == 2 and "EOFError" not in out and "Traceback" not in out, out
    assert "/nonexistent/model" in out and "is not a directory" in out, out
    assert dt < 30  # includes three interpreters importing torch on a 2-core machine


def test_disagg_port_in_use_exits_with_childs_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        rc, out, dt = _cli("--role", "router", "--decode", "http://127.0.0.1:9", "--port", str(port))
    assert rc != 0 and "Address already in use" in out and "choose another --port" in out, out


def test_import_error_in_a_worker_fails_launch_fast(capfd):
    t0 = time.monotonic()
    rc = launch_disagg({**BASE, "role": "prefill"}, {**BASE, "role": "decode"},
                       router={"host": "127.0.0.1", "port": 0}, model_factory="pdlab_no_such_module_q:load",
                       start_timeout=60)
    err = capfd.readouterr().err
    assert rc == 1 and time.monotonic() - t0 < 15
    assert "ModuleNotFoundError" in err and "pdlab_no_such_module_q" in err and "EOFError" not in err


# ------------------------------------------------------------------------------ configuration
@pytest.mark.parametrize("settings, match", [
    (dict(role="prefill", moe_dispatch_mode="low_latency", chunked_prefill_size=4096, dispatch_max_tokens_per_rank=128),
     "exceeds the dispatch buffer's 128 tokens per rank"),
    (dict(role="decode", moe_dispatch_mode="normal", moe_runner="cutedsl"),
     "accepts only the masked layout"),
    (dict(role="decode", max_total_tokens=1024, max_context_len=4096, page_size=64),
     "smaller than one maximal request"),
    (dict(role="prefill", kv_transfer="nixl", kv_transfer_convert=True), "needs the local transfer backend"),
    (dict(role="decode", moe_runner="no_such_runner"), "unknown MoE runner"),
    (dict(role="decode", dispatch_max_tokens_per_rank=64),  # normal mode: the buffer it sizes is never built
     "--dispatch-max-tokens-per-rank 64 sizes the low-latency dispatch buffer, but --moe-dispatch-mode is normal"),
])
def test_impossible_role_configs_rejected(settings, match):
    with pytest.raises(ConfigError, match=match):
        build_config(RoleConfig, **settings)


def test_valid_role_configs():
    build_config(RoleConfig, role="decode", moe_dispatch_mode="low_latency", moe_runner="cutedsl")
    assert build_config(RoleConfig, role="decode", moe_dispatch_mode="low_latency",
                        dispatch_max_tokens_per_rank=64).dispatch_max_tokens_per_rank == 64
    c = build_config(RoleConfig, role="decode")
    assert build_config(RoleConfig, **c.model_dump()) == c  # a dumped config repeats each default, and loads
    build_config(RoleConfig, role="prefill", moe_runner="triton", chunked_prefill_size=4096)



def test_disagg_with_an_api_key():
    """Tried as a new user would: `runtime serve --disagg --api-key K` failed every request with the key (the decode
    server handed its page ids to the prefill's /disagg/pages without it: 401), and the router's /v1/models
    answered 401 to a client holding the key. The servers of one deployment share the key; the router passes the
    client's on (its own calls too: /v1/models, aborts)."""
    key = {"api_key": "sekret"}
    sup = Supervisor(start_timeout=120, stop_timeout=5)
    try:
        acks = sup.start([
            ChildSpec("prefill", serve_role, args=({**BASE, **key, "role": "prefill"},),
                      kwargs={"model_factory": FACTORY}),
            ChildSpec("decode", serve_role, args=({**BASE, **key, "role": "decode"},),
                      kwargs={"model_factory": FACTORY}),
        ])
        rcfg = RouterConfig(prefill=[acks["prefill"]["url"]], decode=[acks["decode"]["url"]], port=0,
                            health_interval=0.5, health_timeout=1.0)
        acks.update(sup.start([ChildSpec("router", serve_router, args=(rcfg.model_dump(),))]))
        url = acks["router"]["url"]
        auth = {"Authorization": "Bearer sekret"}
        with httpx.Client(timeout=60, headers=auth) as c:
            assert len(_generate(c, url, [5, 6, 7, 8] * 5, max_new=6)) == 6
            assert len(_generate(c, url, [9, 10] * 20, max_new=4, stream=True)) == 4
            r = c.get(f"{url}/v1/models")
            assert r.status_code == 200 and r.json()["data"][0]["id"], r.text
            # a client that leaves mid-stream: the router's aborts carry its key, both servers free the pages
            _leave_after_the_first_token_and_check_pages(c, url, acks)
        with httpx.Client(timeout=30) as c:  # without the key: 401 through the router, on both paths
            body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}
            assert c.post(f"{url}/generate", json=body).status_code == 401
            assert c.get(f"{url}/v1/models").status_code == 401
            assert c.post(f"{acks['prefill']['url']}/disagg/pages", json={}).status_code == 401
    finally:
        sup.stop()


@pytest.mark.parametrize("flags, says", [
    (("--max-context-len", "100000000"), ["max_context_len 100000000 exceeds the model's context",
                                          "--allow-long-context"]),
])
def test_disagg_setting_that_conflicts_with_the_model_is_one_line_before_any_child(flags, says):
    """A setting the model cannot serve is refused by the launcher itself (exit 2, one line), not by the prefill
    child's traceback after three interpreters started."""
    rc, out, _ = _cli("--disagg", "--device", "cpu", "--port", "0", *flags)
    assert rc == 2, out
    assert "Traceback" not in out and "prefill ready" not in out, out
    for s in says:
        assert s in out, out
    rc, out, _ = _cli("--role", "decode", "--device", "cpu", "--port", "0", *flags)
    assert rc == 2 and "Traceback" not in out and says[0] in out, out


def test_disagg_with_prefix_caching_turns_it_on_for_the_prefill_server_only(monkeypatch, capsys):
    """`--disagg --enable-prefix-caching` failed: the decode server's share of the flags asked it to cache prompts it
    never computes, which its config refuses. The prefill server caches; the decode server does not; `--role decode`
    with the flag is still refused, in one line."""
    from pdlab.runtime.disagg import launch

    seen = {}
    monkeypatch.setattr(launch, "launch_disagg", lambda pre, dec, **kw: seen.update(pre=pre, dec=dec) or 0)
    assert launch.main(["--disagg", "--device", "cpu", "--port", "0", "--enable-prefix-caching"]) == 0
    assert seen["pre"]["enable_prefix_caching"] and not seen["dec"]["enable_prefix_caching"]
    assert launch.main(["--role", "decode", "--device", "cpu", "--enable-prefix-caching"]) == 2
    assert "enable it on the prefill server" in capsys.readouterr().err


def test_disagg_on_one_device_starts_the_servers_one_after_another(monkeypatch):
    """Both roles on one device: the launcher marks them the two servers of that device (each sizes an equal KV
    pool) and starts the decode server once the prefill one is up, so its memory checks see what prefill took
    (started together, both measured the same free memory and sized pools for all of it)."""
    import pdlab.runtime.supervisor as supervisor
    from pdlab.runtime.disagg import launch

    seen = {}
    monkeypatch.setattr(launch, "launch_disagg", lambda pre, dec, **kw: seen.update(pre=pre, dec=dec) or 0)
    assert launch.main(["--disagg", "--device", "cpu", "--port", "0"]) == 0
    assert [(c["role"], c["device"], c["device_servers"], c["device_server_index"])
            for c in (seen["pre"], seen["dec"])] == [("prefill", "cpu", 2, 0), ("decode", "cpu", 2, 1)]
    with pytest.raises(SystemExit):  # set by the launcher, not a flag
        launch.main(["--disagg", "--device", "cpu", "--device-servers", "3"])
    monkeypatch.undo()

    batches = []

    class Recording(supervisor.Supervisor):
        def start(self, specs):
            batches.append([s.name for s in specs])
            return super().start(specs)

    monkeypatch.setattr(supervisor, "Supervisor", Recording)
    cfgs = [{**BASE, "role": r, "device_servers": 2, "device_server_index": i}
            for i, r in enumerate(("prefill", "decode"))]
    with pytest.raises(ValueError, match="no_such_router_setting"):  # stops once both servers are up
        launch_disagg(*cfgs, router={"host": "127.0.0.1", "port": 0, "no_such_router_setting": 1},
                      model_factory=FACTORY)
    assert batches == [["prefill"], ["decode"]]
    batches.clear()
    with pytest.raises(ValueError, match="no_such_router_setting"):  # servers of their own devices: together
        launch_disagg(*[{**BASE, "role": r} for r in ("prefill", "decode")],
                      router={"host": "127.0.0.1", "port": 0, "no_such_router_setting": 1}, model_factory=FACTORY)
    assert batches == [["prefill", "decode"]]
