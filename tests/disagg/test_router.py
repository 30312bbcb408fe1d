"""Router against small fake servers on 127.0.0.1 ephemeral ports: SSE pass-through, transfer-id
tagging, both pick policies, health marking and re-admission, failures and client disconnects."""

import asyncio
import json
import threading
import time

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pdlab.runtime.disagg.http import ThreadedServer
from pdlab.runtime.router.router import RouterConfig, create_router_app


class Fake:
    """A fake prefill or decode server that records what it got."""

    def __init__(self, name, chunks=3, delay=0.0):
        self.name, self.chunks, self.delay = name, chunks, delay
        self.healthy = True
        self.refuse = False  # answer every completion with a 400 (a server started with other settings)
        self.seen = []  # (path, headers, body)
        self.aborts = []
        self.flushes = []
        self.disconnected = threading.Event()
        self.hold = threading.Event()
        self.hold.set()
        app = FastAPI()

        @app.get("/health")
        async def health():
            return JSONResponse({"ok": self.healthy}, status_code=200 if self.healthy else 503)

        @app.post("/disagg/abort")
        async def abort(request: Request):
            self.aborts.append(await request.json())
            return {"ok": True}

        @app.post("/flush_cache")
        async def flush(request: Request):
            self.flushes.append(dict(request.headers))
            return {"flushed_pages": 3, "cached_pages": 0}

        @app.get("/v1/models")
        async def models():
            return {"data": [{"id": self.name}]}

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = await request.json()
            self.seen.append(("/v1/completions", dict(request.headers), body))
            if body.get("bad"):
                return JSONResponse({"error": {"message": "bad field"}}, status_code=400)
            if self.refuse:
                return JSONResponse({"error": {"message": "the prompt exceeds this server's context"}},
                                    status_code=400)
            if not body.get("stream"):
                while not self.hold.is_set():
                    await asyncio.sleep(0.01)
                return {"server": self.name, "tid": request.headers.get("x-pd-transfer-id")}

            async def gen():
                try:
                    for i in range(self.chunks):
                        yield f"data: {json.dumps({'server': self.name, 'i': i})}\n\n"
                        await asyncio.sleep(self.delay)
                    yield "data: [DONE]\n\n"
                except asyncio.CancelledError:
                    self.disconnected.set()
                    raise

            return StreamingResponse(gen(), media_type="text/event-stream")

        self.app = app


@pytest.fixture
def servers():
    started = []

    def start(*fakes_or_apps):
        urls = []
        for f in fakes_or_apps:
            s = ThreadedServer(f.app if isinstance(f, Fake) else f)
            urls.append(s.start())
            started.append(s)
        return urls

    yield start
    for s in reversed(started):
        s.stop()


def _router(servers, prefill, decode, **kw):
    cfg = RouterConfig(prefill=prefill, decode=decode, health_interval=kw.pop("health_interval", 0.2),
                       health_timeout=1.0, **kw)
    app = create_router_app(cfg)
    (url,) = servers(app)
    return url, app.state.router


def test_stream_passthrough_and_tagging(servers):
    p, d = Fake("p0"), Fake("d0")
    pu, du = servers(p, d)
    url, _ = _router(servers, [pu], [du])
    with httpx.Client(timeout=10) as c:
        with c.stream("POST", f"{url}/v1/completions", json={"prompt": "hi", "stream": True}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            raw = b"".join(r.iter_raw())
    assert raw.decode() == "".join(f"data: {json.dumps({'server': 'd0', 'i': i})}\n\n" for i in range(3)) + "data: [DONE]\n\n"
    deadline = time.monotonic() + 5
    while not p.seen and time.monotonic() < deadline:
        time.sleep(0.01)
    (_, ph, pb), (_, dh, db) = p.seen[0], d.seen[0]
    assert ph["x-pd-transfer-id"] == dh["x-pd-transfer-id"] and ph["x-pd-transfer-id"].startswith("pd-")
    assert ph["x-pd-role"] == "prefill" and dh["x-pd-role"] == "decode"
    assert dh["x-pd-prefill"] == pu and pb == db == {"prompt": "hi", "stream": True}


def test_non_stream_and_error_status_pass_through(servers):
    p, d = Fake("p0"), Fake("d0")
    url, _ = _router(servers, *([u] for u in servers(p, d)))
    with httpx.Client(timeout=10) as c:
        r = c.post(f"{url}/v1/completions", json={"prompt": "x"})
        assert r.status_code == 200 and r.json()["server"] == "d0"
        r = c.post(f"{url}/v1/completions", json={"prompt": "x", "bad": 1})
        assert r.status_code == 400 and r.json()["error"]["message"] == "bad field"
        assert c.get(f"{url}/v1/models").json()["data"][0]["id"] == "d0"


def test_x_request_id_is_passed_on_and_echoed(servers):
    p, d = Fake("p0"), Fake("d0")
    pu, du = servers(p, d)
    url, _ = _router(servers, [pu], [du])
    h = {"X-Request-Id": "trace-9"}
    with httpx.Client(timeout=10) as c:
        r = c.post(f"{url}/v1/completions", json={"prompt": "x"}, headers=h)
        assert r.status_code == 200 and r.headers["x-request-id"] == "trace-9"
        r = c.post(f"{url}/v1/completions", json={"prompt": "x", "stream": True}, headers=h)
        assert r.status_code == 200 and r.headers["x-request-id"] == "trace-9"
        r = c.post(f"{url}/v1/completions", json={"prompt": "x", "bad": 1}, headers=h)
        assert r.status_code == 400 and r.headers["x-request-id"] == "trace-9"
        assert c.get(f"{url}/health", headers=h).headers["x-request-id"] == "trace-9"
    deadline = time.monotonic() + 5
    while len(p.seen) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(hd["x-request-id"] == "trace-9" for _, hd, _ in p.seen + d.seen)


def test_a_refusal_of_the_prefill_server_reaches_the_decode_server(servers):
    """The decode server took a request that its prefill server refused (servers started with other settings): the
    router tells the decode server the refusal, with its status, instead of letting it wait for KV until the
    transfer timeout. A prefill server's 5xx is not a refusal (its failure notice reaches the decode side)."""
    p, d = Fake("p0"), Fake("d0")
    p.refuse = True
    d.hold.clear()  # the decode server waits (for KV) until told
    url, _ = _router(servers, *([u] for u in servers(p, d)))
    with httpx.Client(timeout=10) as c:
        fut = threading.Thread(target=lambda: c.post(f"{url}/v1/completions", json={"prompt": "x"}))
        fut.start()
        deadline = time.monotonic() + 5
        while not d.aborts and time.monotonic() < deadline:
            time.sleep(0.02)
        d.hold.set()
        fut.join(10)
    (ab,) = d.aborts
    assert ab["refused_status"] == 400 and ab["transfer_id"] == d.seen[0][1]["x-pd-transfer-id"]
    assert "refused the request (400): the prompt exceeds this server's context" in ab["reason"]


def test_prefix_policy_sends_prompts_that_begin_alike_to_one_prefill_server(servers):
    """--policy prefix: every request behind the same long system prompt goes to one prefill server (its prefix
    cache holds that prompt), whatever follows it; other system prompts spread over the servers; a server that goes
    down moves only its own prompts; a server far busier than the least loaded one gives the request up."""
    from pdlab.runtime.router import router as rmod

    fakes = [Fake(f"p{i}") for i in range(3)] + [Fake("d0")]
    urls = servers(*fakes)
    url, router = _router(servers, urls[:3], urls[3:], policy="prefix", health_interval=30)
    systems = [f"system prompt {k}: " + "you are a helpful assistant. " * 40 for k in range(12)]
    with httpx.Client(timeout=10) as c:
        for k, system in enumerate(systems):
            for q in range(3):
                assert c.post(f"{url}/v1/completions", json={"prompt": system + f"question {q}"}).status_code == 200
    deadline = time.monotonic() + 5
    while sum(len(f.seen) for f in fakes[:3]) < 36 and time.monotonic() < deadline:
        time.sleep(0.01)
    where = {}
    for i, f in enumerate(fakes[:3]):
        for _, _, body in f.seen:
            where.setdefault(body["prompt"][:40], set()).add(i)
    assert len(where) == 12 and all(len(v) == 1 for v in where.values())  # one server per system prompt
    assert len(set().union(*where.values())) >= 2  # and not all on one server
    # the same choice from the other prompt shapes: token ids, /generate's text, a chat's messages
    key = rmod.prefix_key
    assert key({"prompt": "x" * 2000}) == key({"text": "x" * 1500 + "y"}) == key({"prompt": ["x" * 1024]})
    assert key({"input_ids": list(range(300))}) == key({"prompt": list(range(256)) + [7]})
    chat = {"messages": [{"role": "system", "content": "s" * 2000}, {"role": "user", "content": "q"}]}
    assert key(chat) == key({**chat, "messages": chat["messages"][:1]}) and key({"prompt": ""}) == b""
    assert key([1, 2]) is None and key({"max_tokens": 3}) is None
    # one server down: only its prompts move
    k = next(k for k in systems if where[k[:40]] == {0})
    router.prefill[0].healthy = False
    moved = {s[:40]: router.pick(key({"prompt": s}))[0].url for s in systems}
    for s in systems:
        if where[s[:40]] != {0}:
            assert moved[s[:40]] == urls[next(iter(where[s[:40]]))], "a prompt of a live server moved"
    assert moved[k[:40]] in urls[1:3]
    router.prefill[0].healthy = True
    # far busier than the least loaded server: the least loaded one takes it
    router.prefill[0].inflight = rmod.PREFIX_IMBALANCE + 1
    assert router.pick(key({"prompt": k}))[0].url != urls[0]
    router.prefill[0].inflight = rmod.PREFIX_IMBALANCE
    assert router.pick(key({"prompt": k}))[0].url == urls[0]
    router.prefill[0].inflight = 0


def test_flush_cache_reaches_every_server_with_the_clients_key(servers):
    fakes = [Fake("p0"), Fake("d0"), Fake("d1")]
    urls = servers(*fakes)
    dead = "http://127.0.0.1:9"  # nothing listens: its answer is the error, the others still flush
    url, _ = _router(servers, urls[:1], urls[1:] + [dead], health_interval=30)
    with httpx.Client(timeout=10) as c:
        r = c.post(f"{url}/flush_cache", headers={"Authorization": "Bearer k"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [body[u] for u in urls] == [{"status": 200, "flushed_pages": 3, "cached_pages": 0}] * 3
    assert body[dead]["status"] == 502 and "ConnectError" in body[dead]["error"]
    assert all(f.flushes and f.flushes[0]["authorization"] == "Bearer k" for f in fakes)


def test_round_robin_over_pairs(servers):
    fakes = [Fake(n) for n in ("p0", "p1", "d0", "d1", "d2")]
    urls = servers(*fakes)
    url, _ = _router(servers, urls[:2], urls[2:])
    with httpx.Client(timeout=10) as c:
        got = [c.post(f"{url}/v1/completions", json={"prompt": "x"}).json()["server"] for _ in range(6)]
    assert got == ["d0", "d1", "d2", "d0", "d1", "d2"]
    time.sleep(0.2)
    assert [len(f.seen) for f in fakes[:2]] == [3, 3]


def test_least_loaded_avoids_the_busy_server(servers):
    d0, d1 = Fake("d0"), Fake("d1")
    urls = servers(d0, d1)
    url, router = _router(servers, [], urls, policy="least_loaded")
    d0.hold.clear()  # d0 keeps its requests in flight

    async def run():
        async with httpx.AsyncClient(timeout=10) as c:
            first = asyncio.create_task(c.post(f"{url}/v1/completions", json={"prompt": "a"}))
            for _ in range(200):
                if router.decode[0].inflight or router.decode[1].inflight:
                    break
                await asyncio.sleep(0.01)
            rest = [(await c.post(f"{url}/v1/completions", json={"prompt": "b"})).json()["server"] for _ in range(3)]
            d0.hold.set()
            return (await first).json()["server"], rest

    first, rest = asyncio.run(run())
    assert first == "d0" and rest == ["d1", "d1", "d1"]


def test_unhealthy_server_is_skipped_then_readmitted(servers):
    p0, p1, d = Fake("p0"), Fake("p1"), Fake("d0")
    pu0, pu1, du = servers(p0, p1, d)
    url, router = _router(servers, [pu0, pu1], [du])
    p1.healthy = False
    deadline = time.monotonic() + 5
    while router.prefill[1].healthy and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not router.prefill[1].healthy
    with httpx.Client(timeout=10) as c:
        for _ in range(4):
            c.post(f"{url}/v1/completions", json={"prompt": "x"})
        time.sleep(0.2)
        assert len(p1.seen) == 0 and len(p0.seen) == 4
        m = c.get(f"{url}/metrics").text
        assert f'pdlab_router_backend_healthy{{url="{pu1}",role="prefill"}} 0' in m
        p1.healthy = True
        deadline = time.monotonic() + 5
        while not router.prefill[1].healthy and time.monotonic() < deadline:
            time.sleep(0.05)
        for _ in range(4):
            c.post(f"{url}/v1/completions", json={"prompt": "x"})
        time.sleep(0.2)
    assert len(p1.seen) == 2


def test_dead_prefill_marked_unhealthy_and_decode_told(servers):
    d = Fake("d0")
    (du,) = servers(d)
    dead = ThreadedServer(Fake("p-dead").app)
    pu = dead.start()
    dead.stop()  # connection refused from now on
    live = Fake("p-live")
    (lu,) = servers(live)
    url, router = _router(servers, [pu, lu], [du], health_interval=30)  # only the request path notices
    deadline = time.monotonic() + 5
    while router.prefill[0].healthy and time.monotonic() < deadline:  # start-up probed it: unhealthy
        time.sleep(0.02)
    router.prefill[0].healthy = True  # as if it had died after that round
    with httpx.Client(timeout=10) as c:
        c.post(f"{url}/v1/completions", json={"prompt": "x"})
        deadline = time.monotonic() + 5
        while not d.aborts and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not router.prefill[0].healthy
        assert d.aborts and "prefill server" in d.aborts[0]["reason"]
        assert d.aborts[0]["fault"] is True  # the decode server counts it as failed, not as aborted
        for _ in range(3):  # other requests keep flowing, to the live prefill only
            assert c.post(f"{url}/v1/completions", json={"prompt": "x"}).status_code == 200
    time.sleep(0.2)
    assert len(live.seen) == 3


def test_no_healthy_server_is_503(servers):
    d = Fake("d0")
    (du,) = servers(d)
    url, router = _router(servers, [], [du])
    d.healthy = False
    deadline = time.monotonic() + 5
    while router.decode[0].healthy and time.monotonic() < deadline:
        time.sleep(0.05)
    with httpx.Client(timeout=10) as c:
        r = c.post(f"{url}/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and "no healthy decode server" in r.json()["error"]["message"]
        assert c.get(f"{url}/health").status_code == 503
        head = c.head(f"{url}/health")  # load balancers probe with HEAD
        assert head.status_code == 503 and head.content == b""
        d.healthy = True
        deadline = time.monotonic() + 5
        while c.head(f"{url}/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        head = c.head(f"{url}/health")
        assert head.status_code == 200 and head.content == b""


def test_client_disconnect_aborts_both_sides(servers):
    p, d = Fake("p0"), Fake("d0", chunks=200, delay=0.02)
    pu, du = servers(p, d)
    url, _ = _router(servers, [pu], [du])
    with httpx.Client(timeout=10) as c:
        with c.stream("POST", f"{url}/v1/completions", json={"prompt": "x", "stream": True}) as r:
            it = r.iter_raw()
            next(it)
    deadline = time.monotonic() + 5
    while (not p.aborts or not d.aborts) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert p.aborts and p.aborts[0]["reason"] == "client disconnected"
    assert d.aborts and d.aborts[0]["transfer_id"] == p.aborts[0]["transfer_id"]
    assert "fault" not in d.aborts[0] and "fault" not in p.aborts[0]  # counted as aborted there


def test_config_rejects_bad_urls():
    with pytest.raises(ValueError, match="http://"):
        RouterConfig(decode=["localhost:1"])
    with pytest.raises(ValueError, match="both prefill and decode"):
        RouterConfig(prefill=["http://a:1"], decode=["http://a:1"])


def test_the_page_link_reads_a_prefill_refusal_with_its_status(servers):
    """/disagg/pages answers 409 with the status of a transfer the prefill server failed: the decode side's link
    raises TransferFailed carrying it (400: the request's own fault), any other refusal stays a plain error."""
    from pdlab.runtime.disagg.bootstrap import HttpLink
    from pdlab.runtime.disagg.roles import TransferFailed

    app = FastAPI()

    @app.post("/disagg/pages")
    async def pages(request: Request):
        body = await request.json()
        if body["transfer_id"] == "refused":
            return JSONResponse({"error": {"message": "transfer refused failed on the prefill server: bad request"},
                                 "status": 400}, status_code=409)
        return JSONResponse({"error": {"message": "nope"}}, status_code=500)

    (url,) = servers(app)
    link = HttpLink()
    with pytest.raises(TransferFailed, match="bad request") as exc:
        link.send_pages(url, {"transfer_id": "refused", "decode_meta": {}, "pages": [1]})
    assert exc.value.status == 400
    with pytest.raises(RuntimeError, match=r"refused the page ids \(500\)"):
        link.send_pages(url, {"transfer_id": "other", "decode_meta": {}, "pages": [1]})
    link.close()
