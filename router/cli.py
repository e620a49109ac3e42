"""`beamserve router`: the front door (HTTP, plus gRPC ext_proc and Route when asked)."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import socket
import sys
from pathlib import Path
from typing import Any

import uvloop

from beamserve.argtypes import positive_float, positive_int


def _inline_json(text: str) -> bool:
    return text.lstrip().startswith(("{", "["))


def _is_file(text: str) -> bool:
    """`Path(text).is_file()`, False where the text cannot be a path at all (a component over
    the file system's name limit raises ENAMETOOLONG)."""
    try:
        return Path(text).is_file()
    except OSError:
        return False


def _json_arg(text: str) -> Any:
    """An option's JSON, inline (an object or a list, of any length) or in a file."""
    raw = Path(text).read_text() if not _inline_json(text) and _is_file(text) else text
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON (or a JSON file): {exc}") from exc


def add_router(sub: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        "router",
        help="serve the router (OpenAI + Anthropic APIs) in front of beamserve workers",
        description="Routes each turn to the worker that holds its KV (prefix index fed by "
        "the workers' KV events, hybrid-aware), balances load, disaggregates prefill when it "
        "pays, keeps continuing turns first under overload, and shares sessions through Redis. "
        'Prints one JSON line {"event": "router_ready", ...} on stdout once it serves.',
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--endpoints", type=_json_arg, help="static workers: a JSON list of endpoint specs "
        "(url, role, pool, revision, engine, kv_events, kv_replay, kv_layout, labels) or a "
        "file holding it",
    )  # fmt: skip
    src.add_argument("--local-runtime", type=Path, help="the endpoints file `beamserve up` writes")
    src.add_argument("--kubernetes", metavar="DEPLOYMENT", help="watch this BeamDeployment's "
                     "Services and EndpointSlices (in-cluster or --kubeconfig)")  # fmt: skip
    p.add_argument("--namespace", default=None)
    p.add_argument("--kubeconfig", type=Path, default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080, help="0 = any free port")
    p.add_argument("--grpc-port", type=int, default=None, help="serve ext_proc + Route here")
    p.add_argument("--policy", type=_json_arg_or_name, default="sticky-until-saturated",
                   help="a preset (sticky-until-saturated, weighted, round-robin, least-load, "
                   "prefix-only) or a JSON policy config")  # fmt: skip
    p.add_argument(
        "--disaggregation",
        type=_json_arg,
        default=None,
        help='JSON, e.g. {"min_uncached_tokens": 2048, "max_cached_ratio": 0.7}',
    )
    p.add_argument("--flow", type=_json_arg, default=None, help="JSON flow-control config")
    p.add_argument(
        "--saturation",
        type=_json_arg,
        default=None,
        help='JSON saturation detector, e.g. {"max_queue_len": 5, "max_kv_usage": 0.8}',
    )
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="checkpoint directory: precise mode (else approximate)")  # fmt: skip
    # The default KV geometry, for workers that do not report their own (a worker's report
    # wins; a mismatch is logged once per worker).
    p.add_argument("--block-size", type=positive_int, default=64,
                   help="tokens per KV block for workers that report none")  # fmt: skip
    p.add_argument(
        "--sliding-window",
        type=positive_int,
        default=None,
        help="the model's window for workers that report none (default: config.json of "
        "--tokenizer, else Beam's 512)",
    )
    p.add_argument("--hash-scheme", choices=("vllm", "sglang"), default="vllm",
                   help="block hashes (and KV events) for workers that report none")  # fmt: skip
    p.add_argument("--redis", default=None, help="redis://host:port/db for shared sessions")
    p.add_argument(
        "--redis-op-timeout-s",
        type=positive_float,
        default=None,
        metavar="S",
        help="with --redis: budget of one session-store operation, event-loop lag included; "
        "past it the router serves sessions from local state until Redis answers again "
        "(default: the store's op_timeout_s, 0.25)",
    )
    p.add_argument(
        "--replica-sync",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --redis: share this replica's bookings and routing-time predictions with "
        "the other router replicas over Redis pub/sub (router/sync.py); --no-replica-sync: "
        "learn their load from scrapes only",
    )
    p.add_argument("--sync-channel", default=None, metavar="NAME",
                   help="Redis pub/sub channel of replica sync (default: from the session "
                   "key prefix, beamserve:session-sync)")  # fmt: skip
    p.add_argument("--api-keys", type=_json_arg, default=None,
                   help='JSON {key: {"tenant", "priority": new|sheddable, "rate_per_s", '
                   '"burst"}} or a file; without it no key is required')  # fmt: skip
    p.add_argument("--served-model-name", nargs="+", default=["beam"])
    p.add_argument("--max-body-bytes", type=positive_int, default=32 * 1024 * 1024)
    p.add_argument("--scrape-interval-s", type=float, default=1.0)
    p.add_argument("--prefill-timeout-s", type=float, default=30.0)
    p.add_argument("--no-debug-header", action="store_true")
    p.add_argument("--no-speculative-dispatch", action="store_true",
                   help="never send a session's next turn to its worker before deciding "
                   "(docs/router.md, \"Speculative dispatch\")")  # fmt: skip
    p.add_argument("--config", type=Path, default=None, metavar="FILE",
                   help="RouterConfig YAML (a BeamDeployment's spec.router; the operator's "
                   "ConfigMap): flags given on the command line override it")  # fmt: skip
    # recorded so that --config fills only the flags left at their defaults
    p.set_defaults(router_flag_defaults={a.dest: a.default for a in p._actions})
    return p


def _json_arg_or_name(text: str) -> Any:
    return _json_arg(text) if _inline_json(text) or _is_file(text) else text


def router_main(args: argparse.Namespace) -> int:
    from beamserve.operator.router_config import RouterConfigError, apply_router_config

    try:
        args = apply_router_config(args)
    except RouterConfigError as exc:
        print(f"beamserve router: {exc}", file=sys.stderr)
        return 2
    try:
        # uvloop (libuv) runs the serving loop: the router is I/O-bound, one event loop
        # carries every client and worker connection.
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(_serve(args))
    except KeyboardInterrupt:
        return 0


def _discovery(args: argparse.Namespace) -> Any:
    from beamserve.router import discovery as d

    if args.endpoints is not None:
        return d.StaticDiscovery(d.parse_endpoint_specs(args.endpoints, "--endpoints"))
    if args.local_runtime is not None:
        return d.LocalRuntimeDiscovery(args.local_runtime)
    access = (
        d.KubeAccess.from_kubeconfig(args.kubeconfig)
        if args.kubeconfig
        else d.KubeAccess.in_cluster()
    )
    return d.KubernetesDiscovery(args.kubernetes, access, namespace=args.namespace)


def runtime_config(args: argparse.Namespace) -> Any:
    """The `RuntimeConfig` (`beamserve.router.server`) of parsed `beamserve router` arguments."""
    from beamserve.router.app import KeyPolicy, RouterSettings
    from beamserve.router.server import RuntimeConfig

    keys = {
        k: KeyPolicy(
            tenant=str(v.get("tenant", k[:8])),
            priority=v.get("priority", "new"),
            rate_per_s=v.get("rate_per_s"),
            burst=int(v.get("burst", 10)),
        )
        for k, v in (args.api_keys or {}).items()
    }
    settings = RouterSettings(
        served_models=tuple(args.served_model_name),
        api_keys=keys,
        max_body_bytes=args.max_body_bytes,
        debug_header=not args.no_debug_header,
        speculate=not args.no_speculative_dispatch,
    )
    return RuntimeConfig(
        policy=args.policy,
        disaggregation=args.disaggregation,
        flow=args.flow,
        saturation=args.saturation,
        tokenizer=args.tokenizer,
        block_size=args.block_size,
        sliding_window=args.sliding_window,  # None: config.json of --tokenizer, else 512
        hash_scheme=args.hash_scheme,
        redis_url=args.redis,
        **(
            {}
            if args.redis_op_timeout_s is None
            else {"redis_op_timeout_s": args.redis_op_timeout_s}
        ),
        replica_sync=args.replica_sync,
        sync_channel=args.sync_channel,
        scrape_interval_s=args.scrape_interval_s,
        prefill_timeout_s=args.prefill_timeout_s,
        settings=settings,
    )


async def _serve(args: argparse.Namespace) -> int:
    import structlog
    import uvicorn
    from beamserve.router.server import GrpcGlue, RouterRuntime

    logger = structlog.get_logger("beamserve.router")
    config = runtime_config(args)
    rt = RouterRuntime(_discovery(args), config)
    await rt.start()
    grpc_server = None
    grpc_port = None
    if args.grpc_port is not None:
        from beamserve.router.grpc_api import build_server

        glue = GrpcGlue(rt)
        grpc_server, grpc_port, _ = build_server(
            args.grpc_port, glue.pick, glue.route, host=args.host
        )
        await grpc_server.start()
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(
            rt.app,
            log_level="warning",
            lifespan="off",
            timeout_graceful_shutdown=5,
            http="httptools",  # C HTTP/1.1 parser (uvicorn's default is pure-Python h11)
        )
    )
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
    serve = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not serve.done():
        await asyncio.sleep(0.01)
    ready = {
        "event": "router_ready",
        "url": f"http://{args.host}:{port}",
        "grpc_port": grpc_port,
        "workers": [e.id for e in rt.discovery.endpoints],
    }
    print(json.dumps(ready), flush=True)
    logger.info("router_ready", **{k: v for k, v in ready.items() if k != "event"})
    try:
        await serve
    finally:
        if grpc_server is not None:
            await grpc_server.stop(2)
        await rt.stop()
    return 0
