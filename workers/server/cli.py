"""`beamserve worker`: serve one engine instance over HTTP (what every pool pod runs)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import sys
import traceback
from pathlib import Path
from typing import Any

from beamserve.kv_transfer.backends.names import BACKENDS
from beamserve.workers.sim.engine import DEFAULT_CATCH_UP_S

from beamserve.argtypes import positive_int

ENGINES = ("sim", "ref")


def add_worker(sub: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        "worker",
        help="serve one engine (sim or ref) with vLLM's or SGLang's HTTP surface",
        description="Serves the OpenAI API (and SGLang's native endpoints with --api sglang), "
        "/health, /metrics with the engine's metric names, KV events on ZMQ in vLLM's wire "
        "format, and the P/D handoff for --role prefill|decode. Prints one JSON line "
        '{"event": "worker_ready", ...} on stdout once it serves.',
    )
    p.add_argument("--engine", choices=ENGINES, default="sim")
    p.add_argument("--role", choices=("both", "prefill", "decode"), default="both")
    p.add_argument(
        "--api", choices=("vllm", "sglang"), default="vllm", help="HTTP surface and P/D style"
    )
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="checkpoint directory (tokenizer + chat template; weights for ref); the sim "
        "engine without it uses an approximate word-level tokenizer",
    )
    p.add_argument("--served-model-name", default="beam")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 = any free port")
    p.add_argument(
        "--advertise-host", default=None, help="host other workers reach this one at (pod IP)"
    )
    p.add_argument("--profile", default="tiny-cpu", help="sim hardware profile")
    p.add_argument("--page-size", type=positive_int, default=None, help="sim 64, ref 16")
    p.add_argument("--speed", type=float, default=1.0, help="sim: simulated s per wall s")
    p.add_argument(
        "--catch-up-s",
        type=float,
        default=DEFAULT_CATCH_UP_S,
        help="sim: a step timer that runs up to this late (a busy host) does not delay the "
        f"steps after it; 0 = every lateness delays them (default {DEFAULT_CATCH_UP_S:g})",
    )
    p.add_argument("--tp", type=positive_int, default=1, help="ref: KV shards (TP size)")
    p.add_argument("--transfer-backend", choices=BACKENDS, default="nixl")
    p.add_argument(
        "--kv-events-endpoint",
        default=None,
        help="ZMQ PUB endpoint for KV events, e.g. tcp://*:5557 (default: off)",
    )
    p.add_argument("--kv-replay-endpoint", default=None, help="ZMQ ROUTER replay endpoint")
    p.add_argument(
        "--handshake-port",
        type=int,
        default=0,
        help="prefill: the KV handshake / SGLang bootstrap port (0 = any free port)",
    )
    p.add_argument("--lease-s", type=float, default=30.0, help="prefill: KV lease duration")
    p.add_argument(
        "--kv-deadline-s",
        type=float,
        default=10.0,
        help="decode: time to get the KV before recomputing the prefill locally",
    )
    p.add_argument(
        "--max-model-len",
        type=positive_int,
        default=None,
        help="longest prompt + output per request (default: KV capacity, at most 131072)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=positive_int,
        default=None,
        help="sim: tokens one engine step may carry, prefill chunks and decodes together "
        "(vLLM's --max-num-batched-tokens, SGLang's --chunked-prefill-size; default: the "
        "profile's, 8,192 for h200-bf16-tp8)",
    )
    p.add_argument("--faults", default=None, help="sim: initial faults as JSON")
    return p


# `EngineConfig` fields the worker's flags set, for its error messages
SIM_FLAGS = {"max_batched_tokens": "--max-num-batched-tokens", "page_size": "--page-size"}


def worker_main(args: argparse.Namespace) -> int:
    code = 0
    try:
        code = asyncio.run(_serve(args))
        return code
    except KeyboardInterrupt:
        return 0
    except Exception:
        code = 1
        if args.engine == "ref":  # os._exit below skips the interpreter's own report
            traceback.print_exc()
        raise
    finally:
        if args.engine == "ref":
            # nixl-cu12's bundled libnl segfaults in its exit handlers (docs/ref-engine.md);
            # the exit status is still the command's (a refused flag exits 2)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


def _publisher(args: argparse.Namespace) -> Any:
    if args.kv_events_endpoint is None:
        return None
    from beamserve.workers.kv_events import KVEventPublisher

    return KVEventPublisher(
        args.kv_events_endpoint, args.kv_replay_endpoint, topic="kv-events"
    ).start()


def _backend_args(args: argparse.Namespace) -> dict[str, Any]:
    """What both engines' backends take from the command line."""
    return {
        "role": args.role,
        "model_name": args.served_model_name,
        "publisher": _publisher(args),
        "handshake_host": args.host,
        "handshake_port": args.handshake_port,
        "advertise_host": args.advertise_host,
        "lease_s": args.lease_s,
        "kv_deadline_s": args.kv_deadline_s,
    }


async def _serve(args: argparse.Namespace) -> int:
    import structlog
    import uvicorn
    from beamserve.kvwire.codec import load_codec
    from beamserve.workers.server.app import build_worker_app

    logger = structlog.get_logger("beamserve.worker")
    backend: Any
    if args.engine == "sim":
        from beamserve.workers.server.sim_backend import SimBackend
        from beamserve.workers.sim.config import EngineConfigError

        codec = load_codec(args.model)
        overrides = {}
        if args.max_num_batched_tokens is not None:
            overrides["max_batched_tokens"] = args.max_num_batched_tokens
        backend = SimBackend(
            codec,
            profile=args.profile,
            page_size=args.page_size or 64,
            speed=args.speed,
            catch_up_s=args.catch_up_s,
            engine_overrides=overrides,
            **_backend_args(args),
        )
        try:
            await backend.start()
        except EngineConfigError as exc:
            # the message leads with the engine field; name the flag that sets it instead
            field, _, why = str(exc).partition(": ")
            print(f"beamserve worker: {SIM_FLAGS.get(field, field)}: {why}", file=sys.stderr)
            await backend.close()
            return 2
        if args.faults:
            backend.set_faults(json.loads(args.faults))
    else:
        from beamserve.workers.server.ref_backend import RefBackend

        if args.model is None:
            print("beamserve worker: --engine ref needs --model DIR", file=sys.stderr)
            return 2
        if args.max_num_batched_tokens is not None:
            print(
                "beamserve worker: --max-num-batched-tokens is a sim setting; the ref engine "
                "prefills in chunks of --page-size tokens (drop the flag)",
                file=sys.stderr,
            )
            return 2
        codec = load_codec(args.model)
        backend = RefBackend(
            args.model,
            codec,
            tp_size=args.tp,
            transfer_backend=args.transfer_backend,
            page_size=args.page_size or 16,
            **_backend_args(args),
        )
        await backend.start()

    app = build_worker_app(
        backend,
        api=args.api,
        served_model_name=args.served_model_name,
        max_model_len=args.max_model_len,
    )
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
    config.install_signal_handlers = False  # type: ignore[attr-defined]
    info = backend.server_info()
    ready = {
        "event": "worker_ready",
        "url": f"http://{args.advertise_host or args.host}:{port}",
        "engine": args.engine,
        "role": args.role,
        "api": args.api,
        "handshake_url": backend.handshake_url,
        "kv_events": info.get("kv_events_endpoint"),
        "kv_replay": info.get("kv_replay_endpoint"),
        "page_size": backend.page_size,
        "tp_size": backend.tp_size,
        "chunked_prefill_size": info.get("chunked_prefill_size"),
        "pid": os.getpid(),
    }
    serve = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not serve.done():
        await asyncio.sleep(0.01)
    print(json.dumps(ready), flush=True)
    logger.info("worker_ready", **{k: v for k, v in ready.items() if k != "event"})
    try:
        await serve
    finally:
        await backend.close()
    return 0
