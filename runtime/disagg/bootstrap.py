"""The HTTP side of the roles: the control endpoints a prefill / decode server adds to its app, the
`HttpLink` a decode server uses to hand page ids to prefill servers, and `RoleLoop`, which routes a
request that carries the router's headers (`X-PD-Transfer-Id`, `X-PD-Role`, `X-PD-Prefill`) to the
role instead of the plain engine loop, so the server's OpenAI handlers serve both cases unchanged.

Endpoints (JSON): POST /disagg/pages {transfer_id, decode_meta, pages} (prefill: the decode side's
pre-allocated page ids and pool metadata), POST /disagg/abort {transfer_id, reason[, refused_status, fault]}
(both roles; the request ends as aborted, or as failed with a refused_status or "fault": true),
GET /disagg/state (records and counts), GET /disagg/kv_meta (decode: this pool's transfer metadata).
"""

from __future__ import annotations

import contextvars
import logging
from dataclasses import dataclass

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from pdlab.runtime.disagg.roles import DecodeRole, PrefillRole, TransferFailed

log = logging.getLogger("pdlab.disagg")


@dataclass(frozen=True)
class PDHeaders:
    transfer_id: str
    role: str  # "prefill" | "decode"
    prefill: str  # prefill server URL (decode side uses it)


_CURRENT: contextvars.ContextVar[PDHeaders | None] = contextvars.ContextVar("pdlab_pd_headers", default=None)


class HttpLink:
    """PeerLink over HTTP (blocking; the decode role calls it from a worker thread)."""

    def __init__(self, timeout: float = 10.0, api_key: str | None = None):
        # the servers of one deployment share --api-key: the prefill's /disagg endpoints ask for it as every other
        self.client = httpx.Client(timeout=timeout,
                                   headers={"Authorization": f"Bearer {api_key}"} if api_key else None)

    def send_pages(self, prefill: str, msg: dict) -> None:
        r = self.client.post(f"{prefill.rstrip('/')}/disagg/pages", json=msg)
        refusal = _transfer_failed(r)
        if refusal is not None:
            raise refusal
        if r.status_code != 200:
            raise RuntimeError(f"{prefill} refused the page ids ({r.status_code}): {r.text[:300]}")

    def send_abort(self, prefill: str, transfer_id: str) -> None:
        self.client.post(f"{prefill.rstrip('/')}/disagg/abort",
                         json={"transfer_id": transfer_id, "reason": "aborted by the decode server"})

    def close(self) -> None:
        self.client.close()


def _transfer_failed(r: httpx.Response) -> TransferFailed | None:
    """The prefill role's 409 for a transfer it failed already, as TransferFailed with the client's status; None for
    any other answer."""
    if r.status_code != 409:
        return None
    try:
        body = r.json()
        return TransferFailed(str(body["error"]["message"]), int(body.get("status", 502)))
    except (ValueError, KeyError, TypeError):
        return None


class RoleLoop:
    """Stands in for the server's EngineLoop: requests tagged by the router go to the role, the rest
    (and every other attribute) to the real loop."""

    def __init__(self, loop, role: PrefillRole | DecodeRole):
        self._loop = loop
        self._role = role

    def __getattr__(self, name):
        return getattr(self._loop, name)

    def submit(self, req, sink) -> None:
        pd = _CURRENT.get()
        if pd is None:
            return self._loop.submit(req, sink)
        if isinstance(self._role, DecodeRole):
            if pd.role != "decode" or not pd.prefill:
                raise ValueError(f"this is a decode server; request {pd.transfer_id} came tagged for role "
                                 f"{pd.role!r} (prefill {pd.prefill!r}); check the router's server lists")
            self._role.submit(req, pd.transfer_id, pd.prefill, sink)
        else:
            if pd.role != "prefill":
                raise ValueError(f"this is a prefill server; request {pd.transfer_id} came tagged for role "
                                 f"{pd.role!r}; check the router's server lists")
            req.rid = pd.transfer_id
            self._role.submit(req, pd.transfer_id, sink)

    def abort(self, rid: str, reason: str = "aborted", error_status: int = 400) -> None:
        if isinstance(self._role, DecodeRole):  # falls back to a plain abort for untagged requests
            self._role.abort(rid, reason, error_status=error_status)
        elif rid in self._role.records:
            self._role.abort(rid, reason, error_status)
        else:
            self._loop.abort(rid, reason, error_status)


def install(app: FastAPI, role: PrefillRole | DecodeRole) -> None:
    """Add the /disagg endpoints and the header middleware to a server app (the role's metrics go in
    through `create_app(extra_metrics=role.metrics.prometheus)`)."""

    @app.post("/disagg/pages")
    async def pages(request: Request):
        if not isinstance(role, PrefillRole):
            return JSONResponse({"error": {"message": "this is not a prefill server"}}, status_code=400)
        try:
            body = await request.json()
            tid, meta, ids = str(body["transfer_id"]), dict(body["decode_meta"]), [int(p) for p in body["pages"]]
        except (KeyError, TypeError, ValueError) as e:
            return JSONResponse({"error": {"message": f"bad /disagg/pages body: {e}"}}, status_code=400)
        try:
            role.on_pages(tid, meta, ids)
        except TransferFailed as e:  # its status: what the decode side answers its client with
            return JSONResponse({"error": {"message": str(e)}, "status": e.status}, status_code=409)
        return {"ok": True}

    @app.post("/disagg/abort")
    async def abort(request: Request):
        try:
            body = await request.json()
            tid, why = str(body["transfer_id"]), str(body.get("reason", "aborted"))
            refused = body.get("refused_status")  # the router: the prefill server refused the request (a 4xx)
            refused = int(refused) if refused is not None else None
            if refused is not None and not 400 <= refused < 500:
                raise ValueError(f"refused_status {refused} is not a 4xx status")
            fault = body.get("fault", False)  # the router: the request's prefill server failed
            if not isinstance(fault, bool):
                raise ValueError(f"fault must be true or false, not {fault!r}")
        except (KeyError, TypeError, ValueError) as e:
            return JSONResponse({"error": {"message": f"bad /disagg/abort body: {e}"}}, status_code=400)
        if refused is not None and isinstance(role, DecodeRole):
            role.abort(tid, why, refused_status=refused)
        else:
            role.abort(tid, why, fault=fault)
        return {"ok": True}

    @app.get("/disagg/state")
    async def state():
        recs = {tid: {"state": r.state.value, "error": r.error, "peer": r.peer}
                for tid, r in list(role.records.items())}
        return {**role.metrics.snapshot(), "requests": recs}

    @app.get("/disagg/kv_meta")
    async def kv_meta():
        return getattr(role, "meta", {}) or {}

    inner = app.build_middleware_stack

    def build():
        asgi = inner()

        async def tagged(scope, receive, send):
            token = None
            if scope["type"] == "http":
                h = {k.decode().lower(): v.decode() for k, v in scope.get("headers", [])}
                tid = h.get("x-pd-transfer-id")
                if tid:
                    token = _CURRENT.set(PDHeaders(tid, h.get("x-pd-role", ""), h.get("x-pd-prefill", "")))
            try:
                await asgi(scope, receive, send)
            finally:
                if token is not None:
                    _CURRENT.reset(token)

        return tagged

    app.build_middleware_stack = build
