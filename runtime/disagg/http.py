"""Serving a FastAPI app with uvicorn on a socket bound up front: a host or port that cannot be listened on is a
BindError (an OSError) raised in the caller, naming --host or --port, and the caller learns the real port when it
asked for port 0. `serve_app` blocks (a server process); `serve_in_thread` is for tests and tools."""

from __future__ import annotations

import errno
import socket
import threading
import time
from typing import Callable

# bind() errors that are the address's fault (not one of this machine's, or of a family it lacks), not the port's
_HOST_ERRNOS = {errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT, errno.EINVAL}


class BindError(OSError):
    """host:port cannot be listened on; str() is one line naming the flag to change (--host or --port)."""

    def __str__(self) -> str:
        return self.strerror


def bind(host: str, port: int, listen: bool = True) -> socket.socket:
    """A TCP socket bound to host:port (port 0 = any free port), listening unless `listen` is False (uvicorn
    listens on it when it starts). BindError naming --host for an address this machine does not have (or a name
    that does not resolve), --port for a port that is taken or needs privileges."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP (not 0): asyncio then sets TCP_NODELAY on accepted connections; without it, Nagle + delayed
    # ACKs add ~40 ms to every response on a kept-alive connection
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        if listen:
            sock.listen(2048)
    except OSError as e:
        sock.close()
        where = f"cannot listen on {host}:{port}: {e.strerror or e}"
        if isinstance(e, socket.gaierror) or e.errno in _HOST_ERRNOS:
            raise BindError(e.errno, f"{where}; --host {host} is not an address of this machine: give one of its "
                                     "addresses or names, 127.0.0.1 (this machine only) or 0.0.0.0 (every "
                                     "interface)") from None
        hint = " (ports below 1024 need privileges)" if e.errno == errno.EACCES else ""
        raise BindError(e.errno, f"{where}{hint}; choose another --port (0 = any free port)") from None
    return sock


def check_bind(host: str, port: int) -> None:
    """BindError (as `bind`) when host:port cannot be listened on now: checked before a model is loaded or a
    process started, so that a wrong flag fails at once."""
    bind(host, port, listen=False).close()


def _server(app, sock, log_level: str, graceful_timeout: float = 2.0):
    import uvicorn

    cfg = uvicorn.Config(app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=graceful_timeout)
    return uvicorn.Server(cfg)


def serve_app(app, host: str, port: int, *, on_ready: Callable[[str], None] | None = None,
              log_level: str = "warning", graceful_timeout: float = 2.0) -> None:
    """Serve until SIGINT/SIGTERM. on_ready(url) runs once the server accepts connections. On the signal it takes
    no new connections and gives the requests in flight `graceful_timeout` seconds before cancelling them."""
    sock = bind(host, port)
    url = f"http://{host}:{sock.getsockname()[1]}"
    server = _server(app, sock, log_level, graceful_timeout)
    if on_ready is not None:
        def watch():
            for _ in range(60_000):  # bounded: 10 min at 10 ms
                if server.started:
                    on_ready(url)
                    return
                if server.should_exit:
                    return
                time.sleep(0.01)
        threading.Thread(target=watch, daemon=True, name="pdlab-ready").start()
    server.run(sockets=[sock])
    if not server.started:
        raise RuntimeError(f"the HTTP server on {url} did not start (see the log above)")


class ThreadedServer:
    """`with ThreadedServer(app) as url:` serves app on 127.0.0.1:<free port> in a thread."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.sock = bind(host, port)
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self.server = _server(app, self.sock, log_level)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self, timeout: float = 20.0) -> str:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"server on {self.url} did not start within {timeout} s")
            time.sleep(0.01)
        return self.url

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
