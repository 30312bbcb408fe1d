"""The router: an OpenAI-compatible front that sends each request to a prefill/decode pair and
streams the decode server's answer back (SSE passes through byte for byte).

Pair choice (`policy`):
- "round_robin": the next healthy prefill and the next healthy decode server, each in turn.
- "least_loaded": the healthy prefill and the healthy decode server with the fewest requests in
  flight through this router (ties: the one after the last pick, so equal loads still rotate).
- "prefix": requests whose prompts begin alike go to the same prefill server (where its prefix cache, see
  `--enable-prefix-caching`, holds their shared system prompt): the server is chosen by rendezvous hashing of the
  prompt's first PREFIX_KEY_CHARS characters (or PREFIX_KEY_IDS token ids) over the healthy servers, so that a
  server going down or coming back moves only its own prompts; unless it has PREFIX_IMBALANCE more requests in
  flight than the least loaded one, which then takes the request. Decode servers: least loaded.
With no prefill servers configured the router balances over the decode list alone (colocated servers; "prefix" then
picks among them by prompt).

Each request gets a transfer id. The router sends the body unchanged to both servers with headers
`X-PD-Transfer-Id`, `X-PD-Prefill` (the prefill URL the decode server hands its page ids to) and
`X-PD-Role`; the prefill server's reply is only checked for failure. If the prefill request fails to
connect, the prefill server is marked unhealthy and the decode server is told to abort the transfer
(`POST /disagg/abort`); if the client goes away, both servers are told to abort.

Health: every `health_interval` seconds each server's GET /health is probed (timeout
`health_timeout`); a failed probe or a failed connection marks it unhealthy and no request goes to it;
the first probe that passes re-admits it. Router endpoints: the OpenAI ones, /generate, /health,
/metrics (Prometheus), /router/backends (JSON), POST /flush_cache (every server's).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Literal, Mapping

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdlab.runtime.config import check_host
from pdlab.runtime.server.request_id import EchoRequestId

log = logging.getLogger("pdlab.router")

H_TID, H_PREFILL, H_DECODE, H_ROLE = "X-PD-Transfer-Id", "X-PD-Prefill", "X-PD-Decode", "X-PD-Role"
# "prefix" policy: how much of a prompt names its prefix (about 256 tokens of text), and how many more requests in
# flight than the least loaded server its server may have before the least loaded one takes the request
PREFIX_KEY_CHARS, PREFIX_KEY_IDS, PREFIX_IMBALANCE = 1024, 256, 16
_HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "accept-encoding"}


class RouterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    prefill: list[str] = Field(default_factory=list, description="prefill server URLs (none: plain balancing)")
    decode: list[str] = Field(..., min_length=1, description="decode (or colocated) server URLs")
    policy: Literal["round_robin", "least_loaded", "prefix"] = "round_robin"
    health_interval: float = Field(2.0, gt=0, description="seconds between /health probes")
    health_timeout: float = Field(2.0, gt=0, description="seconds a /health probe may take")
    request_timeout: float = Field(600.0, gt=0, description="seconds an upstream request may take")
    connect_timeout: float = Field(5.0, gt=0, description="seconds to connect to an upstream server")
    shutdown_timeout: float = Field(10.0, ge=0, description="seconds the requests in flight get to finish when the "
                                    "router stops (SIGTERM, Ctrl-C); it takes no new connections meanwhile")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)

    @field_validator("host")
    @classmethod
    def _check_host(cls, host: str) -> str:
        return check_host(host)

    @model_validator(mode="after")
    def _check(self):
        for u in self.prefill + self.decode:
            if not u.startswith(("http://", "https://")):
                raise ValueError(f"server URL {u!r} must start with http:// or https://")
        both = set(self.prefill) & set(self.decode)
        if both:
            raise ValueError(f"{sorted(both)} listed as both prefill and decode; a server has one role")
        return self


def prefix_key(body) -> bytes | None:
    """What names a request's prompt prefix for the "prefix" policy: the first PREFIX_KEY_CHARS characters of its
    text (a completion's prompt, /generate's text, a chat's messages as role: content lines) or its first
    PREFIX_KEY_IDS token ids; None for a body that has none (any server will do)."""
    if not isinstance(body, dict):
        return None
    prompt = body.get("prompt", body.get("text"))
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    ids = prompt if isinstance(prompt, list) else body.get("input_ids")
    if isinstance(prompt, str):
        return prompt[:PREFIX_KEY_CHARS].encode("utf-8", "surrogatepass")
    if isinstance(ids, list) and ids:
        return json.dumps(ids[:PREFIX_KEY_IDS]).encode()
    messages = body.get("messages")
    if isinstance(messages, list) and messages:
        text = "\n".join(f"{m.get('role')}: {m.get('content')}" for m in messages if isinstance(m, dict))
        return text[:PREFIX_KEY_CHARS].encode("utf-8", "surrogatepass")
    return None


def _credentials(headers: Mapping[str, str]) -> dict[str, str]:
    """The client's Authorization header out of `headers`, for the router's own calls on the client's behalf (a
    server started with --api-key asks for it; the router holds no key)."""
    return {k: v for k, v in headers.items() if k.lower() == "authorization"}


@dataclass
class Backend:
    url: str
    role: str  # "prefill" | "decode"
    healthy: bool = True
    inflight: int = 0
    requests: int = 0
    errors: int = 0
    last_error: str = ""
    changed_at: float = field(default_factory=time.time)

    def mark(self, healthy: bool, why: str = "") -> None:
        if healthy != self.healthy:
            self.healthy, self.changed_at = healthy, time.time()
            if healthy:
                log.warning("%s server %s is healthy again; re-admitted", self.role, self.url)
            else:
                log.warning("%s server %s marked unhealthy: %s", self.role, self.url, why)
        if not healthy:
            self.last_error = why


class Router:
    def __init__(self, cfg: RouterConfig):
        self.cfg = cfg
        self.prefill = [Backend(u.rstrip("/"), "prefill") for u in cfg.prefill]
        self.decode = [Backend(u.rstrip("/"), "decode") for u in cfg.decode]
        self._rr = {"prefill": 0, "decode": 0}
        self.client: httpx.AsyncClient | None = None
        self._health_task: asyncio.Task | None = None

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill)

    # ---- choice ------------------------------------------------------------------------------------
    def _pick(self, group: list[Backend], kind: str, key: bytes | None = None) -> Backend | None:
        """The next server of `group` by the policy; `key`: the prompt's prefix key ("prefix" policy, the group that
        computes prompts), None for the others."""
        live = [b for b in group if b.healthy]
        if not live:
            return None
        start = self._rr[kind] % len(group)
        order = group[start:] + group[:start]
        order = [b for b in order if b.healthy]
        least = min(order, key=lambda b: b.inflight)  # min keeps the first of equals: rotation order
        if self.cfg.policy == "prefix" and key is not None:
            best = max(order, key=lambda b: hashlib.blake2b(key + b.url.encode(), digest_size=8).digest())
            if best.inflight - least.inflight > PREFIX_IMBALANCE:
                best = least
        elif self.cfg.policy in ("least_loaded", "prefix"):
            best = least
        else:
            best = order[0]
        self._rr[kind] = group.index(best) + 1
        return best

    def pick(self, key: bytes | None = None) -> tuple[Backend | None, Backend]:
        """(prefill or None, decode); raises LookupError naming what is missing. key: the prompt's prefix key
        (`prefix_key`), which the "prefix" policy routes by."""
        d = self._pick(self.decode, "decode", None if self.disaggregated else key)
        if d is None:
            raise LookupError("no healthy decode server: " + _why(self.decode))
        if not self.disaggregated:
            return None, d
        p = self._pick(self.prefill, "prefill", key)
        if p is None:
            raise LookupError("no healthy prefill server: " + _why(self.prefill))
        return p, d

    # ---- health ------------------------------------------------------------------------------------
    async def check_health(self) -> None:
        async def probe(b: Backend):
            try:
                r = await self.client.get(f"{b.url}/health", timeout=self.cfg.health_timeout)
                b.mark(r.status_code == 200, f"/health answered {r.status_code}")
            except httpx.HTTPError as e:
                b.mark(False, f"/health failed: {type(e).__name__}: {e}")

        await asyncio.gather(*(probe(b) for b in self.prefill + self.decode))

    async def _health_loop(self) -> None:
        """Probe every `health_interval` seconds; `start` ran the first round itself."""
        while True:
            await asyncio.sleep(self.cfg.health_interval)
            try:
                await self.check_health()
            except Exception:  # noqa: BLE001 - the loop must survive anything
                log.exception("health check round failed")

    async def start(self) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        timeout = httpx.Timeout(self.cfg.request_timeout, connect=self.cfg.connect_timeout)
        self.client = httpx.AsyncClient(timeout=timeout, limits=limits)
        await self.check_health()
        self._health_task = asyncio.create_task(self._health_loop())

    async def stop(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._health_task
        if self.client is not None:
            await self.client.aclose()

    # ---- forwarding ---------------------------------------------------------------------------------
    async def forward(self, request: Request, path: str) -> Response:
        body = await request.body()
        try:
            parsed = json.loads(body or b"{}")
            stream = bool(parsed.get("stream", False))
        except (ValueError, AttributeError):
            parsed, stream = None, False  # not a JSON object: the server answers 400 for it
        try:
            p, d = self.pick(prefix_key(parsed) if self.cfg.policy == "prefix" else None)
        except LookupError as e:
            return _error(503, str(e), "service_unavailable")
        tid = f"pd-{uuid.uuid4().hex}"
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        headers[H_TID] = tid
        if p is not None:
            headers[H_PREFILL], headers[H_DECODE] = p.url, d.url
        prefill_task = None
        if p is not None:
            p.inflight += 1
            p.requests += 1
            prefill_task = asyncio.create_task(self._prefill(p, d, path, body, headers, tid))
        d.inflight += 1
        d.requests += 1
        released = False

        def release():
            nonlocal released
            if not released:
                released = True
                d.inflight -= 1

        up_req = self.client.build_request("POST", f"{d.url}{path}", content=body,
                                           headers={**headers, H_ROLE: "decode"})
        # a client that leaves before the answer (a non-stream request, or before a stream's first byte) drops the
        # request on both servers, as one that leaves mid-stream does
        watch = asyncio.ensure_future(_disconnected(request))
        try:
            try:
                upstream = await _until_gone(self.client.send(up_req, stream=True), watch)
            except httpx.HTTPError as e:
                release()
                d.errors += 1
                d.mark(False, f"{type(e).__name__}: {e}")
                if prefill_task is not None:
                    asyncio.create_task(self._abort(p, tid, "decode server unreachable", headers))
                return _error(502, f"decode server {d.url} failed: {type(e).__name__}: {e}", "bad_gateway")
            except _ClientGone:
                release()
                return self._client_gone(p, d, tid, headers)
            if not stream or upstream.status_code != 200:
                try:
                    content = await _until_gone(upstream.aread(), watch)
                except httpx.HTTPError as e:
                    d.errors += 1
                    return _error(502, f"decode server {d.url} broke off: {e}", "bad_gateway")
                except _ClientGone:
                    return self._client_gone(p, d, tid, headers)
                finally:
                    await upstream.aclose()  # closed before the end: the server sees its client leave
                    release()
                if upstream.status_code != 200 and prefill_task is not None:
                    # the decode server refused the request or failed it: the prefill server, waiting for page ids
                    # that never come, sees its client leave and drops the request (its pages, its compute)
                    prefill_task.cancel()
                return Response(content, status_code=upstream.status_code,
                                media_type=upstream.headers.get("content-type", "application/json"))
        finally:
            watch.cancel()  # a stream notices a disconnect itself (its relay is closed)

        async def relay():
            finished = False
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
                finished = True
            except httpx.HTTPError as e:
                d.errors += 1
                msg = json.dumps({"error": {"message": f"decode server broke off: {e}", "type": "bad_gateway",
                                            "param": None, "code": 502}})
                yield f"data: {msg}\n\n".encode()
                finished = True
            finally:
                await upstream.aclose()
                release()
                if not finished:  # the client went away mid-stream: both servers drop the request
                    log.info("client left %s; aborting on both servers", tid)
                    self._abort_pair(p, d, tid, "client disconnected", headers)

        return StreamingResponse(relay(), status_code=200,
                                 media_type=upstream.headers.get("content-type", "text/event-stream"),
                                 headers={H_TID: tid})

    async def _prefill(self, p: Backend, d: Backend, path: str, body: bytes, headers: dict, tid: str) -> None:
        try:
            r = await self.client.post(f"{p.url}{path}", content=body, headers={**headers, H_ROLE: "prefill"})
            if r.status_code >= 500:
                p.errors += 1
                log.warning("prefill %s answered %d for %s", p.url, r.status_code, tid)
            elif r.status_code >= 400:
                # the prefill server refused what the decode server took (servers started with other settings):
                # the decode side would wait for KV until its transfer timeout; end the request with the refusal
                why = f"the prefill server {p.url} refused the request ({r.status_code}): {_message(r)}"
                log.warning("%s [%s]", why, tid)
                await self._abort(d, tid, why, headers, refused_status=r.status_code)
        except httpx.HTTPError as e:
            p.errors += 1
            p.mark(False, f"{type(e).__name__}: {e}")
            await self._abort(d, tid, f"prefill server {p.url} failed: {type(e).__name__}: {e}", headers, fault=True)
        finally:
            p.inflight -= 1

    def _client_gone(self, p: Backend | None, d: Backend, tid: str, headers: Mapping[str, str]) -> Response:
        log.info("client left %s; aborting on both servers", tid)
        self._abort_pair(p, d, tid, "client disconnected", headers)
        return _error(499, "client disconnected", "invalid_request_error")  # nobody reads it

    def _abort_pair(self, p: Backend | None, d: Backend, tid: str, why: str, headers: Mapping[str, str]) -> None:
        """Tell the decode server and the prefill server (if any) to drop transfer tid, in the background."""
        asyncio.create_task(self._abort(d, tid, why, headers))
        if p is not None:
            asyncio.create_task(self._abort(p, tid, why, headers))

    async def _abort(self, b: Backend, tid: str, why: str, headers: Mapping[str, str] | None = None,
                     refused_status: int | None = None, fault: bool = False) -> None:
        """Tell server b to drop transfer tid, with the client request's credentials (`headers`: its Authorization
        is what a server started with --api-key asks for; the router holds no key of its own). refused_status: the
        prefill server's 4xx for the request, which the decode server then answers the client with. fault: the
        request fails for a server's fault (counted as failed there, not as aborted)."""
        body: dict = {"transfer_id": tid, "reason": why}
        if refused_status is not None:
            body["refused_status"] = refused_status
        if fault:
            body["fault"] = True
        try:
            await self.client.post(f"{b.url}/disagg/abort", json=body,
                                   headers=_credentials(headers or {}), timeout=self.cfg.health_timeout)
        except httpx.HTTPError as e:
            log.info("abort of %s on %s failed: %s", tid, b.url, e)

    # ---- reporting --------------------------------------------------------------------------------
    def backends(self) -> list[dict]:
        return [{"url": b.url, "role": b.role, "healthy": b.healthy, "inflight": b.inflight,
                 "requests": b.requests, "errors": b.errors, "last_error": b.last_error}
                for b in self.prefill + self.decode]

    def prometheus(self) -> str:
        out = []
        for name, help_, attr, kind in (
                ("pdlab_router_backend_healthy", "1 if the server passes its health check", "healthy", "gauge"),
                ("pdlab_router_backend_inflight", "requests in flight through the router", "inflight", "gauge"),
                ("pdlab_router_backend_requests_total", "requests sent", "requests", "counter"),
                ("pdlab_router_backend_errors_total", "failed upstream requests", "errors", "counter")):
            out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
            out += [f'{name}{{url="{b.url}",role="{b.role}"}} {int(getattr(b, attr))}' for b in self.prefill + self.decode]
        return "\n".join(out) + "\n"


def create_router_app(cfg: RouterConfig) -> FastAPI:
    router = Router(cfg)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await router.start()
        yield
        await router.stop()

    app = FastAPI(title="pdlab router", lifespan=lifespan)
    app.add_middleware(EchoRequestId)  # the servers get the header with the request (it is no hop-by-hop header)
    app.state.router = router

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        # an unknown route or method: the servers' OpenAI error shape, not FastAPI's {"detail": ...}
        if exc.status_code == 404:
            return _error(404, f"no route {request.url.path}; this router serves /v1/completions, "
                          "/v1/chat/completions, /generate, /v1/models, /health, /metrics, /router/backends, "
                          "/flush_cache",
                          "not_found_error")
        if exc.status_code == 405:
            allowed = exc.headers.get("Allow", "") if exc.headers else ""
            return _error(405, f"method {request.method} not allowed on {request.url.path}"
                          + (f"; use {allowed}" if allowed else ""), "invalid_request_error",
                          headers=exc.headers)
        return _error(exc.status_code, str(exc.detail), "invalid_request_error" if exc.status_code < 500
                      else "server_error", headers=exc.headers)

    for path in ("/v1/completions", "/v1/chat/completions", "/generate"):
        async def handler(request: Request, _path=path):
            return await router.forward(request, _path)

        app.add_api_route(path, handler, methods=["POST"])

    @app.api_route("/health", methods=["GET", "HEAD"])  # load balancers probe with HEAD (the server sends no body)
    async def health():
        ok_d = any(b.healthy for b in router.decode)
        ok_p = not router.disaggregated or any(b.healthy for b in router.prefill)
        body = {"status": "ok" if ok_d and ok_p else "unavailable", "backends": router.backends()}
        return JSONResponse(body, status_code=200 if ok_d and ok_p else 503)

    @app.get("/v1/models")
    async def models(request: Request):
        try:
            _, d = router.pick()
            r = await router.client.get(f"{d.url}/v1/models", headers=_credentials(request.headers),
                                        timeout=cfg.health_timeout)
            return Response(r.content, status_code=r.status_code, media_type="application/json")
        except (LookupError, httpx.HTTPError) as e:
            return _error(503, str(e), "service_unavailable")

    @app.get("/metrics")
    async def metrics():
        return Response(router.prometheus(), media_type="text/plain; version=0.0.4")

    @app.get("/router/backends")
    async def backends():
        return router.backends()

    @app.post("/flush_cache")
    async def flush_cache(request: Request):
        """Every server's POST /flush_cache (their prefix caches), with the client's credentials: {url: answer}."""
        async def one(b: Backend):
            try:
                r = await router.client.post(f"{b.url}/flush_cache", headers=_credentials(request.headers),
                                             timeout=cfg.request_timeout)
                return b.url, {"status": r.status_code, **(r.json() if r.content else {})}
            except (httpx.HTTPError, ValueError) as e:
                return b.url, {"status": 502, "error": f"{type(e).__name__}: {e}"}

        answers = dict(await asyncio.gather(*(one(b) for b in router.prefill + router.decode)))
        ok = any(a["status"] == 200 for a in answers.values())
        return JSONResponse(answers, status_code=200 if ok else 502)

    return app


def _error(status: int, message: str, kind: str, headers: Mapping[str, str] | None = None) -> JSONResponse:
    """The OpenAI error body the servers send: {"error": {"message", "type", "param", "code"}}."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status}},
                        status_code=status, headers=dict(headers) if headers else None)


class _ClientGone(Exception):
    """The client closed its connection before the upstream answer came."""


async def _until_gone(coro, watch: asyncio.Future):
    """The result of `coro`, unless `watch` (the client's disconnect) finishes first: then `coro` is cancelled and
    _ClientGone raised."""
    task = asyncio.ensure_future(coro)
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():  # the client left, or this handler was cancelled
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
    if task.cancelled():
        raise _ClientGone
    return task.result()


async def _disconnected(request: Request) -> None:
    """Returns when the client has closed the connection (its body is read already, so the next ASGI message is
    http.disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _message(r: httpx.Response) -> str:
    """The error message of a server's OpenAI-shaped error response, else the start of its body."""
    try:
        return str(r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return r.text[:300]


def _why(group: list[Backend]) -> str:
    return "; ".join(f"{b.url}: {b.last_error or 'unhealthy'}" for b in group) or "none configured"
