"""`X-Request-Id`: the id a client (or a proxy in front of it) gives a request, echoed on every response so that the
client can match its logs with ours. Used by the servers and the router."""

from __future__ import annotations

HEADER = "x-request-id"
_HEADER_BYTES = HEADER.encode()
MAX_LEN = 200  # the longest id a server takes as a request's id (the /generate body's `rid` has the same limit)


class EchoRequestId:
    """ASGI middleware: a request's X-Request-Id header goes back on its response (unless the handler set one).
    A plain ASGI wrapper, not an HTTP middleware: those hide client disconnects from the handlers."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        value = None
        if scope["type"] == "http":
            value = next((v for k, v in scope.get("headers", []) if k.lower() == _HEADER_BYTES), None)
        if value is None:
            return await self.app(scope, receive, send)

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                if not any(k.lower() == _HEADER_BYTES for k, _ in headers):
                    message = {**message, "headers": headers + [(_HEADER_BYTES, value)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def request_id(headers) -> str | None:
    """The X-Request-Id of a request (`headers`: a Starlette Headers mapping), or None when it sent none. ValueError
    for one that cannot name a request: empty or blank, longer than MAX_LEN, or with control characters."""
    value = headers.get(HEADER)
    if value is None:
        return None
    if not value.strip() or len(value) > MAX_LEN or any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in value):
        raise ValueError(f"the X-Request-Id header ({len(value)} characters) cannot name a request: send 1 to "
                         f"{MAX_LEN} printable characters, or leave it out")
    return value
