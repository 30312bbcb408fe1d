"""`runtime serve`: one colocated server (prefill + decode) with the embedded default model or
`--model-path DIR`. Settings from flags and/or `--config FILE` (YAML/JSON), validated into one
`ServerConfig`. (`--disagg` / `--role` are handled by the disaggregation launcher, see runtime/cli.py.)

Programmatic use (tests, the disaggregation roles): `Server(cfg, model=..., hooks=...)` then
`start()` (engine loop thread + uvicorn thread, returns the bound port) and `stop()`.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import threading
import time

from pdlab.runtime.config import LAUNCHER_FIELDS, ConfigError, ServerConfig, add_config_arguments, config_from_args

log = logging.getLogger("pdlab.runtime")



def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, ServerConfig, exclude=LAUNCHER_FIELDS)
    parser.add_argument("--disagg", action="store_true",
                        help="start prefill + decode servers and a router (handled by the disaggregation launcher)")


class Server:
    """Engine + scheduler + engine loop + HTTP app of one server."""

    def __init__(self, cfg: ServerConfig, model=None, tokenizer=None, model_config=None, hooks=None):
        from pdlab.runtime.engine.engine import Engine
        from pdlab.runtime.engine.loop import EngineLoop, make_codec
        from pdlab.runtime.scheduler.scheduler import Scheduler
        from pdlab.runtime.server.api import create_app
        from pdlab.runtime.server.metrics import RuntimeMetrics

        self.cfg = cfg
        self.engine = Engine(cfg, model, tokenizer, model_config, max_running_requests=cfg.max_running_requests)
        self.codec = make_codec(self.engine.tokenizer, self.engine.model_config)
        self.metrics = RuntimeMetrics()
        self.scheduler = Scheduler(cfg, self.engine, self.codec, hooks=hooks, metrics=self.metrics)
        self.warmup: dict | None = None
        if cfg.warmup and self.engine.device.type == "cuda":
            self.warmup = self.scheduler.warmup()
        if self.warmup and self.warmup["requests"]:
            log.info("warm-up: %d prompts, %d tokens in %.1f s", self.warmup["requests"], self.warmup["tokens"],
                     self.warmup["seconds"])
        self.loop = EngineLoop(self.scheduler)
        self.app = create_app(self.loop, self.codec, self.metrics, model_name=cfg.served_model_name,
                              api_key=cfg.api_key, max_queue=cfg.max_queue)
        self._uvicorn = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None

    def describe(self) -> list[str]:
        c = self.cfg
        return [f"pdlab runtime serve ({c.role}): model {c.model_path or 'embedded tiny default'}",
                *self.engine.describe(),
                f"scheduler: max_running_requests {c.max_running_requests}, chunked_prefill_size "
                f"{c.chunked_prefill_size}, max_prefill_tokens {c.max_prefill_tokens}, decode_reserve_tokens "
                f"{c.decode_reserve_tokens}, retract_mode {c.retract_mode}, prefix caching "
                f"{'on' if c.enable_prefix_caching else 'off'}",
                "warm-up: " + (f"{self.warmup['requests']} prompts, {self.warmup['tokens']} tokens in "
                               f"{self.warmup['seconds']:.1f} s" if self.warmup and self.warmup["requests"] else
                               "none (decode role: the CUDA graphs)" if self.warmup is not None else
                               "off" if not c.warmup else "none (not on CUDA)")]

    def start(self, sock: socket.socket | None = None) -> int:
        """Start the engine loop and uvicorn in background threads; returns the bound port. sock: a socket bound
        to the config's host and port (`bind`), else it is bound here (BindError naming --host or --port)."""
        import uvicorn

        from pdlab.runtime.disagg.http import bind

        if sock is None:
            sock = bind(self.cfg.host, self.cfg.port, listen=False)
        self.loop.start()
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2)
        self._uvicorn = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._uvicorn.run, kwargs={"sockets": [sock]}, daemon=True,
                                        name="pdlab-http")
        self._thread.start()
        deadline = time.time() + 30
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.time() > deadline:
                raise RuntimeError(f"HTTP server failed to start on {self.cfg.host}:{self.port}")
            time.sleep(0.02)
        return self.port

    def stop(self, shutdown_timeout: float | None = None) -> None:
        """Stop serving. New requests get a 503 at once; the requests in flight get `shutdown_timeout` seconds
        (default: the config's) to finish, then those left end with a 503 that their clients receive (an error
        event and [DONE] in a stream); then the HTTP server and the engine loop stop. A Ctrl-C during the wait
        ends it: the requests left get their 503 at once."""
        grace = self.cfg.shutdown_timeout if shutdown_timeout is None else shutdown_timeout
        state = self.app.state
        if self._thread is not None and self._thread.is_alive() and getattr(state, "inflight", None) is not None:
            state.draining = True
            if not _wait_while(lambda: state.inflight and self.loop._thread is not None
                               and self.loop._thread.is_alive(), grace):
                log.warning("shutting down: interrupted; the requests in flight end now")
            if state.inflight:
                log.warning("shutting down: %d request(s) still in flight get a 503", len(state.inflight))
                state.abort_inflight("server is shutting down; retry the request on another server", 503)
                # their handlers send the error, then the connections close
                _wait_while(lambda: state.inflight, 5.0)
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(10)
        self.loop.stop()

    def serve_forever(self, sock: socket.socket | None = None) -> None:
        """Serve (on `sock`, as `start`) until Ctrl-C or SIGTERM, then stop gracefully (`stop`)."""
        port = self.start(sock)
        print(f"serving on http://{self.cfg.host}:{port} (OpenAI API under /v1, /generate, /health, /metrics)",
              flush=True)
        old = None
        if threading.current_thread() is threading.main_thread():  # SIGTERM (docker stop, kill) as Ctrl-C

            def _on_term(*_):
                raise KeyboardInterrupt

            old = signal.signal(signal.SIGTERM, _on_term)
        try:
            # sleep, not join: on Python 3.11 a KeyboardInterrupt inside Thread.join marks the (still running) HTTP
            # thread as stopped, so stop() would skip the drain and the process exit under the open connections
            while self._thread.is_alive():
                time.sleep(0.2)
        except KeyboardInterrupt:
            print(f"stopping: requests in flight get up to {self.cfg.shutdown_timeout:g} s to finish "
                  "(Ctrl-C again ends them now)", flush=True)
        finally:
            try:
                self.stop()
            finally:
                if old is not None:
                    signal.signal(signal.SIGTERM, old)


def _wait_while(busy, seconds: float) -> bool:
    """Poll `busy()` every 20 ms for up to `seconds`; False when a KeyboardInterrupt (a second Ctrl-C, or SIGTERM
    while stopping) cut the wait short."""
    deadline = time.monotonic() + seconds
    try:
        while busy() and time.monotonic() < deadline:
            time.sleep(0.02)
    except KeyboardInterrupt:
        return False
    return True


def run(args: argparse.Namespace) -> int:
    if getattr(args, "disagg", False):
        print("runtime serve --disagg: run it through `runtime serve --disagg ...` (the launcher); "
              "this module serves one colocated server", file=sys.stderr)
        return 2
    from pdlab.runtime.disagg.http import BindError, bind

    try:
        cfg = config_from_args(ServerConfig, args)
        sock = bind(cfg.host, cfg.port, listen=False)  # a wrong --host or a taken --port fails before loading
    except (ConfigError, BindError) as exc:
        print(f"runtime serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        server = Server(cfg)
    except (ConfigError, FileNotFoundError, ValueError) as exc:  # bad path, checkpoint, or settings
        sock.close()
        print(f"runtime serve: {exc}", file=sys.stderr)
        return 2
    for line in server.describe():
        print(line, flush=True)
    server.serve_forever(sock)
    return 0
