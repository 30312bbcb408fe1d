"""The router's own errors follow the servers' OpenAI error shape {"error": {"message", "type", "param", "code"}}:
an unknown route or a wrong method was FastAPI's bare {"detail": "Not Found"}."""

import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from test_router import Fake, _router, servers  # noqa: E402,F401


def _openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status, err
    return err


def test_router_errors_have_the_openai_shape(servers):  # noqa: F811
    p, d = Fake("p0"), Fake("d0")
    url, router = _router(servers, *([u] for u in servers(p, d)))
    with httpx.Client(timeout=10) as c:
        err = _openai_error(c.get(f"{url}/v1/nothing"), 404)
        assert err["type"] == "not_found_error" and "/v1/nothing" in err["message"]
        err = _openai_error(c.get(f"{url}/v1/completions"), 405)
        assert "POST" in err["message"]
        d.healthy = False
        deadline = time.monotonic() + 5
        while router.decode[0].healthy and time.monotonic() < deadline:
            time.sleep(0.05)
        err = _openai_error(c.post(f"{url}/v1/completions", json={"prompt": "x"}), 503)
        assert err["type"] == "service_unavailable"


def test_a_model_the_pair_does_not_serve_is_404_through_the_router():
    """The router passes the body on unchanged; both servers of a disaggregated pair refuse a `model` they do not
    serve with the 404 a colocated server gives (it was served as the served model), stream or not, and the pair
    keeps serving the served name."""
    from pdlab.runtime.disagg.launch import serve_role, serve_router
    from pdlab.runtime.router.router import RouterConfig
    from pdlab.runtime.supervisor import ChildSpec, Supervisor

    base = dict(device="cpu", page_size=16, max_total_tokens=2048, chunked_prefill_size=32, max_prefill_tokens=64,
                max_context_len=256, log_level="warning", port=0, transfer_timeout=5.0, served_model_name="tiny-r1")
    factory = {"model_factory": "disagg_children:load_sensitive_toy"}
    sup = Supervisor(start_timeout=120, stop_timeout=5)
    try:
        acks = sup.start([ChildSpec("prefill", serve_role, args=({**base, "role": "prefill"},), kwargs=factory),
                          ChildSpec("decode", serve_role, args=({**base, "role": "decode"},), kwargs=factory)])
        rcfg = RouterConfig(prefill=[acks["prefill"]["url"]], decode=[acks["decode"]["url"]], port=0,
                            health_interval=0.5, health_timeout=1.0)
        url = sup.start([ChildSpec("router", serve_router, args=(rcfg.model_dump(),))])["router"]["url"]
        with httpx.Client(timeout=30) as c:
            assert c.get(f"{url}/v1/models").json()["data"][0]["id"] == "tiny-r1"
            for stream in (False, True):
                body = {"model": "gpt-4o", "prompt": [5, 6, 7], "max_tokens": 3, "stream": stream}
                err = _openai_error(c.post(f"{url}/v1/completions", json=body), 404)
                assert err["type"] == "not_found_error" and err["param"] == "model", err
                assert "'gpt-4o'" in err["message"] and "'tiny-r1'" in err["message"], err
            ok = c.post(f"{url}/v1/completions", json={"model": "tiny-r1", "prompt": [5, 6, 7], "max_tokens": 3,
                                                       "ignore_eos": True})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3, ok.text
            assert ok.json()["model"] == "tiny-r1"
    finally:
        sup.stop()


def test_a_client_that_leaves_a_non_stream_request_aborts_it_on_the_servers(servers):  # noqa: F811
    """A client that gave up on a non-stream request (a timeout) left it running on the server to its last token:
    the router kept waiting for the answer nobody would read. Now the router drops the upstream request, the
    server aborts it and frees its pages, as it does for a client of its own."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "runtime"))
    from test_server_api import SlowToy, _server

    srv = _server(SlowToy)  # 10 ms a token: 200 tokens take 2 s
    try:
        url, _ = _router(servers, [], [f"http://127.0.0.1:{srv.port}"])
        body = {"prompt": "take your time", "max_tokens": 200, "ignore_eos": True}
        with httpx.Client(timeout=0.5) as c:
            try:
                c.post(f"{url}/v1/completions", json=body)
                raise AssertionError("the request finished before the client's timeout")
            except httpx.TimeoutException:
                pass
        deadline = time.monotonic() + 1.0  # well before the 2 s the request would run
        while srv.metrics.finished.get("abort", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert srv.metrics.finished.get("abort", 0) == 1 and not srv.metrics.finished.get("length"), \
            srv.metrics.finished
        assert not srv.scheduler.by_rid
        assert srv.engine.pool.num_free_pages == srv.engine.pool.allocator.capacity
    finally:
        srv.stop()


def test_a_client_that_leaves_a_non_stream_request_aborts_both_sides_of_a_pair(servers):  # noqa: F811
    p, d = Fake("p0"), Fake("d0")
    d.hold.clear()  # the decode server holds the non-stream answer until released
    url, _ = _router(servers, *([u] for u in servers(p, d)))
    try:
        with httpx.Client(timeout=0.5) as c:
            try:
                c.post(f"{url}/v1/completions", json={"prompt": "x"})
                raise AssertionError("the held request was answered")
            except httpx.TimeoutException:
                pass
        deadline = time.monotonic() + 5
        while (not p.aborts or not d.aborts) and time.monotonic() < deadline:
            time.sleep(0.02)
        tid = d.seen[0][1]["x-pd-transfer-id"]
        assert [a["transfer_id"] for a in d.aborts] == [tid] and [a["transfer_id"] for a in p.aborts] == [tid]
        assert d.aborts[0]["reason"] == "client disconnected"
    finally:
        d.hold.set()
