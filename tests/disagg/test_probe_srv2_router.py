"""The router ends a request on both servers of its pair when one of them is done with it early."""

import asyncio
import sys
import threading
import time
from pathlib import Path

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

sys.path.insert(0, str(Path(__file__).parent))
from test_router import Fake, _router, servers  # noqa: E402,F401


class _HoldingPrefill:
    """A prefill server that holds every request (as one waiting for the decode side's page ids does) until its
    client leaves, and records that it left."""

    def __init__(self):
        self.arrived, self.left = threading.Event(), threading.Event()
        self.aborts = []
        app = FastAPI()

        @app.get("/health")
        async def health():
            return {"ok": True}

        @app.post("/disagg/abort")
        async def abort(request: Request):
            self.aborts.append(await request.json())
            return {"ok": True}

        @app.post("/v1/completions")
        async def completions(request: Request):
            self.arrived.set()
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                if await request.is_disconnected():
                    self.left.set()
                    break
                await asyncio.sleep(0.01)
            return JSONResponse({"error": {"message": "held too long"}}, status_code=500)

        self.app = app


def test_a_refusal_of_the_decode_server_ends_the_request_on_the_prefill_server(servers):  # noqa: F811
    """The decode server refused a request its prefill server took (e.g. max_tokens beyond the context: the prefill
    server samples one token, so it never sees that limit). The prefill server kept the prompt's pages until its
    transfer timeout (60 s), waiting for page ids that never came, and the router counted the request in flight all
    that time; a client repeating the mistake filled the prefill server's KV pool. Now the router drops the request
    on the prefill server as soon as the decode server's answer is not a 200."""
    p, d = _HoldingPrefill(), Fake("d0")
    d.refuse = True
    url, router = _router(servers, *([u] for u in servers(p.app, d)))
    with httpx.Client(timeout=10) as c:
        for stream in (False, True):
            p.arrived.clear(), p.left.clear()
            r = c.post(f"{url}/v1/completions", json={"prompt": "x", "stream": stream})
            assert r.status_code == 400 and "context" in r.json()["error"]["message"], r.text
            assert p.arrived.wait(5)
            gone = p.left.wait(5) or any(a["transfer_id"] == d.seen[-1][1]["x-pd-transfer-id"] for a in p.aborts)
            assert gone, "the prefill server still holds a request the decode server refused"
            deadline = time.monotonic() + 5
            while router.prefill[0].inflight and time.monotonic() < deadline:
                time.sleep(0.02)
            assert router.prefill[0].inflight == 0 and router.decode[0].inflight == 0
