"""`runtime serve --disagg` and `runtime serve --role prefill|decode|router`.

--disagg (one machine): a prefill server and a decode server (on cuda:0 / cuda:1 when there are two
GPUs, else both on the configured device), each on a free port, then the router on --host/--port in
front of them; all three supervised (runtime/supervisor.py): a child that fails to start makes the
launch exit non-zero within seconds with that child's own traceback and exit code, and stops the others.

--role prefill|decode: one server of that role (settings as for `runtime serve`, plus the transfer
and dispatch settings of `RoleConfig`). --role router: the router alone, with --prefill URL... and
--decode URL... (no --prefill: plain balancing over --decode servers).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import uuid

from pdlab.runtime.config import LAUNCHER_FIELDS, ConfigError, add_config_arguments, build_config, config_from_args
from pdlab._subcommands import arg_parser

log = logging.getLogger("pdlab.disagg")

ROUTER_FLAGS = ("prefill", "decode", "policy", "health_interval", "health_timeout", "request_timeout")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pdlab.runtime.disagg.config import RoleConfig

    add_config_arguments(parser, RoleConfig, exclude=LAUNCHER_FIELDS)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--disagg", action="store_true", help="prefill + decode servers and a router on this machine")
    mode.add_argument("--role", choices=["prefill", "decode", "router"], help="start one role")
    g = parser.add_argument_group("router")
    g.add_argument("--prefill", nargs="+", default=[], metavar="URL", help="prefill server URLs (--role router)")
    g.add_argument("--decode", nargs="+", default=[], metavar="URL", help="decode server URLs (--role router)")
    g.add_argument("--policy", choices=["round_robin", "least_loaded", "prefix"], default="round_robin",
                   help="how the router picks a prefill/decode pair (prefix: prompts that begin alike go to the "
                        "same prefill server, for its prefix cache)")
    g.add_argument("--health-interval", type=float, default=2.0, help="seconds between health probes")
    g.add_argument("--health-timeout", type=float, default=2.0, help="seconds a health probe may take")
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds an upstream request may take")
    g.add_argument("--start-timeout", type=float, default=900.0, help="seconds --disagg waits for start-up acks")


def main(argv: list[str] | None = None) -> int:
    """Entry point of `runtime serve --disagg|--role ...` (argv without the leading 'serve')."""
    parser = arg_parser(prog="runtime serve", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    return run(args)


def run(args: argparse.Namespace) -> int:
    from pdlab.runtime.disagg.config import RoleConfig
    from pdlab.runtime.disagg.http import check_bind
    from pdlab.runtime.engine.engine import preflight
    from pdlab.runtime.router.router import RouterConfig

    rargs = {k: getattr(args, k) for k in ROUTER_FLAGS}
    if getattr(args, "shutdown_timeout", None) is not None:  # the servers' flag: the router drains as long
        rargs["shutdown_timeout"] = args.shutdown_timeout
    try:
        _check_ignored_flags(args)
        if args.role == "router":
            if not args.decode:
                raise ValueError("--role router needs --decode URL [URL ...] (and --prefill URL ... for "
                                 "disaggregated pairs)")
            rcfg = build_config(RouterConfig, host="127.0.0.1" if args.host is None else args.host,
                                port=30000 if args.port is None else args.port, **rargs)
            return _run_inline(serve_router, rcfg.model_dump())
        if args.role in ("prefill", "decode"):
            cfg = config_from_args(RoleConfig, args)
            cfg = build_config(RoleConfig, **{**cfg.model_dump(), "role": args.role})
            preflight(cfg)
            check_bind(cfg.host, cfg.port)  # a wrong --host or a taken --port fails before the model loads
            return _run_inline(serve_role, cfg.model_dump())
        base = config_from_args(RoleConfig, args).model_dump()
        pre, dec = _split_devices(base)
        if pre["device"] == dec["device"]:  # one device: started one after another, each pool an equal share
            pre, dec = ({**c, "device_servers": 2, "device_server_index": i} for i, c in enumerate((pre, dec)))
        pcfg = build_config(RoleConfig, **{**pre, "role": "prefill", "port": 0})
        # prefix caching reuses computed prompts: the prefill server's (the decode server computes none)
        dcfg = build_config(RoleConfig, **{**dec, "role": "decode", "port": 0, "enable_prefix_caching": False})
        for c in (pcfg, dcfg):  # settings that conflict with the model: one line here, not a child's traceback
            preflight(c)
        check_bind(base["host"], base["port"])  # the router's address; the servers listen on the same host
        # the router's settings, before any server starts (its server lists are the servers started; any URL here)
        build_config(RouterConfig, **{**rargs, "host": base["host"], "port": base["port"], "decode": ["http://-"]})
    except (ConfigError, ValueError, OSError) as exc:  # OSError: a model path or config.json that cannot be read
        print(f"runtime serve: {exc}", file=sys.stderr)
        return 2
    return launch_disagg(pcfg.model_dump(), dcfg.model_dump(), router={**rargs, "host": base["host"],
                                                                         "port": base["port"]},
                         start_timeout=args.start_timeout)


def _check_ignored_flags(args: argparse.Namespace) -> None:
    """ValueError naming the flags given (away from their defaults) that the chosen mode would ignore: server settings
    for --role router (it honours --host, --port and --shutdown-timeout), the router's server lists for a server role
    or --disagg (which makes its own), the other router settings and --start-timeout for one server role."""
    from pdlab.runtime.disagg.config import RoleConfig

    parser = arg_parser(add_help=False)
    add_arguments(parser)
    given = lambda name: getattr(args, name, None) not in (None, parser.get_default(name))  # noqa: E731
    if args.role == "router":
        kept = {"host", "port", "shutdown_timeout"}
        names = [n for n in ("config", *RoleConfig.model_fields) if n not in kept | LAUNCHER_FIELDS and given(n)]
        names += ["start_timeout"] if given("start_timeout") else []
        why = "a router serves no model and holds no API key (it passes the client's on)"
    else:
        router_only = ("prefill", "decode") if args.disagg else (*ROUTER_FLAGS, "start_timeout")
        names = [n for n in router_only if given(n)]
        why = "--disagg starts its own servers" if args.disagg else f"--role {args.role} is one server, not the router"
    if names:
        flags = ", ".join("--" + n.replace("_", "-") for n in names)
        mode = "--disagg" if args.disagg else f"--role {args.role}"
        raise ValueError(f"{mode} would ignore {flags}: {why}; drop {'them' if len(names) > 1 else 'it'}")


def launch_disagg(prefill_cfg: dict, decode_cfg: dict, *, router: dict, start_timeout: float = 900.0,
                  model_factory: str | None = None, on_ready=None) -> int:
    """Start prefill + decode, then the router in front of them; supervise until one exits or
    Ctrl-C. Returns the exit code. on_ready(acks) is called once everything is up (tests)."""
    from pdlab.runtime.router.router import RouterConfig
    from pdlab.runtime.supervisor import ChildSpec, LaunchError, Supervisor

    # a child gets its drain (shutdown_timeout) and then some to exit after SIGTERM, before it is killed
    grace = max(float(c.get("shutdown_timeout", 10.0)) for c in (prefill_cfg, decode_cfg, router))
    sup = Supervisor(start_timeout=start_timeout, stop_timeout=grace + 10.0)
    try:
        specs = [ChildSpec(role, serve_role, args=(c,), kwargs={"model_factory": model_factory})
                 for role, c in (("prefill", prefill_cfg), ("decode", decode_cfg))]
        if any(c.get("device_servers", 1) > 1 for c in (prefill_cfg, decode_cfg)):
            # servers sharing a device start one after another: each checks and sizes its memory against what the
            # one before it took (started together, both would see the same free memory and over-commit it)
            acks = {}
            for spec in sorted(specs, key=lambda sp: sp.args[0].get("device_server_index", 0)):
                acks.update(sup.start([spec]))
        else:
            acks = sup.start(specs)
        rcfg = RouterConfig(**{**router, "prefill": [acks["prefill"]["url"]], "decode": [acks["decode"]["url"]]})
        acks.update(sup.start([ChildSpec("router", serve_router, args=(rcfg.model_dump(),))]))
        for name in ("prefill", "decode", "router"):
            print(f"{name} ready at {acks[name]['url']}", flush=True)
        print(f"serving (disaggregated) on {acks['router']['url']}", flush=True)
        if on_ready is not None:
            on_ready(acks)
    except LaunchError as exc:
        print(f"runtime serve --disagg: launch failed: {exc}", file=sys.stderr, flush=True)
        return exc.exitcode if exc.exitcode and exc.exitcode > 0 else 1
    except BaseException:  # a bad router setting, Ctrl-C during start-up: the servers started must not outlive us
        sup.stop()
        raise
    return sup.wait()


# ---------------------------------------------------------------------------------------- children
def serve_role(ack, cfg: dict, *, model_factory: str | None = None, factory_kwargs: dict | None = None) -> None:
    """Child: one prefill or decode server. Acks {"url", "role", "agent"} once it accepts requests,
    then serves until SIGTERM."""
    from pdlab.runtime.disagg.bootstrap import HttpLink, RoleLoop, install
    from pdlab.runtime.disagg.config import RoleConfig
    from pdlab.runtime.disagg.roles import DecodeRole, PrefillRole
    from pdlab.runtime.disagg.transfer.base import create_transfer
    from pdlab.runtime.server.api import create_app
    from pdlab.runtime.server.serve import Server

    cfg = RoleConfig(**cfg)
    if cfg.device.startswith("cuda:"):  # both roles see every GPU (CUDA IPC needs the peer's device visible)
        import torch

        torch.cuda.set_device(cfg.device)
    logging.basicConfig(level=cfg.log_level.upper(), format=f"%(asctime)s %(levelname)s {cfg.role} %(name)s: %(message)s")
    model, tok, mcfg = _load(cfg, model_factory, factory_kwargs)
    agent = cfg.agent_name or f"{cfg.role}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    transfer = create_transfer(cfg.kv_transfer, agent, layer_group_size=cfg.transfer_layer_group,
                               **({"convert": True} if cfg.kv_transfer_convert and cfg.role == "prefill" else {}))
    if cfg.role == "prefill":
        role = PrefillRole(transfer, transfer_timeout=cfg.transfer_timeout)
    else:
        role = DecodeRole(transfer, HttpLink(api_key=cfg.api_key), transfer_timeout=cfg.transfer_timeout)
    server = Server(cfg, model, tok, mcfg, hooks=role)
    role.attach(server.loop)
    # the same OpenAI handlers, over a loop that hands router-tagged requests to the role
    server.app = create_app(RoleLoop(server.loop, role), server.codec, server.metrics,
                            model_name=cfg.served_model_name, api_key=cfg.api_key, max_queue=cfg.max_queue,
                            extra_metrics=role.metrics.prometheus)
    install(server.app, role)
    for line in server.describe():
        log.info("%s", line)
    port = server.start()
    if cfg.device_servers > 1 and cfg.device.startswith("cuda"):  # the next server on this device sizes its share
        import torch  # from the free memory: hand back what the warm-up left cached here

        torch.cuda.empty_cache()
    url = f"http://{cfg.host}:{port}"
    log.info("%s server ready at %s (transfer %s, agent %s)", cfg.role, url, cfg.kv_transfer, agent)
    ack({"url": url, "role": cfg.role, "agent": agent})
    try:
        while True:
            time.sleep(3600)
    finally:  # SIGTERM: drain the requests in flight (shutdown_timeout), then release the transfer endpoints
        try:
            server.stop()
        finally:
            if isinstance(role, DecodeRole):
                role.close()
            transfer.close()


def serve_router(ack, cfg: dict) -> None:
    """Child: the router. Acks {"url"} once it accepts requests."""
    from pdlab.runtime.disagg.http import serve_app
    from pdlab.runtime.router.router import RouterConfig, create_router_app

    rcfg = RouterConfig(**cfg)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s router %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per proxied request is too much
    # a little past the servers' own grace: the 503s they end their last requests with still reach the clients
    serve_app(create_router_app(rcfg), rcfg.host, rcfg.port, on_ready=lambda url: ack({"url": url}),
              graceful_timeout=rcfg.shutdown_timeout + 2.0)


def _run_inline(target, cfg: dict) -> int:
    """One role in this process; the 'ack' just prints where it serves."""
    try:
        target(lambda info: print(f"ready: {info}", flush=True), cfg)
    except KeyboardInterrupt:
        return 0
    return 0


def _load(cfg, model_factory: str | None, factory_kwargs: dict | None):
    if model_factory is not None:
        from pdlab.runtime.supervisor import _resolve

        return _resolve(model_factory)(**(factory_kwargs or {}))
    import torch

    from pdlab.runtime.engine.engine import TORCH_DTYPES
    from pdlab.runtime.model import LoadOptions, load_model

    from pdlab.runtime.engine.synthetic import is_synthetic, load_synthetic

    device, dtype = torch.device(cfg.resolved_device), TORCH_DTYPES[cfg.resolved_dtype]
    mode, moe_kwargs = cfg.moe_dispatch_mode, {}
    if mode == "low_latency":
        moe_kwargs = {"num_max_dispatch_tokens_per_rank": cfg.dispatch_max_tokens_per_rank,
                      "max_num_tokens": cfg.max_running_requests}
    elif cfg.role != "prefill" and device.type == "cuda" and cfg.use_cuda_graph:
        # captured decode steps must not sync with the host: low-latency (masked) dispatch, one slot per
        # running request
        mode, moe_kwargs = "low_latency", {"num_max_dispatch_tokens_per_rank": cfg.max_running_requests}
    moe_kwargs["weights_layout"] = None if cfg.moe_weights_layout == "auto" else cfg.moe_weights_layout
    opts = LoadOptions(moe_runner=cfg.moe_runner, dispatcher=cfg.moe_dispatcher, moe_decode_mode=mode,
                       moe_kwargs=moe_kwargs)
    if is_synthetic(cfg.model_path):
        return load_synthetic(cfg.model_path, device, dtype, cfg.seed, opts)
    return load_model(cfg.model_path, device, dtype, options=opts)


def _split_devices(base: dict) -> tuple[dict, dict]:
    """Prefill on cuda:0 and decode on cuda:1 when two GPUs exist and no device was forced."""
    dev = base.get("device", "auto")
    if dev in ("auto", "cuda"):
        try:
            import torch

            n = torch.cuda.device_count()
        except Exception:  # noqa: BLE001 - no usable CUDA: both on the configured device
            n = 0
        if n >= 2:
            return {**base, "device": "cuda:0"}, {**base, "device": "cuda:1"}
    return dict(base), dict(base)
