#!/usr/bin/env python3
"""Where a long prompt's time goes inside the router: one request at a time, stage by stage.

    .venv/bin/python scripts/router-timeline.py [--router beamserve-adaptive-spill]
        [--tokens 100000] [-n 40] [--cold | --grow] [--max-tokens 1] [--no-speculate]
        [--json FILE]

`beamserve bench wire-overhead` measures what a router adds to TTFT over a direct call, but a
sim worker's own TTFT varies by ±5–10 ms from one request to the next, so differences under a
millisecond take many runs to see. This script looks inside instead. It starts one sim worker
(as the bench does: KV events on) and runs the router in this process, configured from the
bench's router spec `--router` (its `beamserve router` argv, parsed by the real parser), with
uvicorn on uvloop and httptools as `beamserve router` serves it. It wraps the dispatch path's
steps with timestamps: the body read, the parse, the prompt's hashes, admission, the routing
decision, the upstream call (aiohttp's socket write), the rest of a prompt routed on its head
(`--cold`: each request a new session with new text), the index predictions and the decision's
record, the worker's answer, the first chunk, the response's start, the first body bytes
sent to the client and the response's end. A client process sends `-n` streamed requests of
`--max-tokens` (1) with the same `--tokens`-token chat (built as `wire-overhead` builds it) —
or, with `--grow`, one conversation that grows by a short reply and a new user message each
request (a session's continuing turns) — one at a time, 50 ms apart, after two warm-up
requests; it stops reading at `[DONE]`, as the bench's client does. The two processes share
`time.perf_counter` (CLOCK_MONOTONIC), so every stage is timed from the client's send (the
client's first token and `[DONE]` included). Printed (and written with `--json`): each stage's
median time since the send and since the stage before it, in the order they happen.

A session's next turn may go out before it is parsed (the router's speculative dispatch,
docs/router.md): then the upstream call and its socket write come right after the body read;
`--no-speculate` runs the router with `--no-speculative-dispatch`.

`--cold` runs the router with `flow.prefill_first_pieces` off: on the one worker every new
session lands beside the last one resting there, and a first turn beside live sessions goes in
pieces, keyed whole before the first (docs/policies.md, "First turns beside live sessions");
this script times the path of a long prompt that goes whole, on its head.

The wrappers cost a few microseconds a stage. A stage that runs off the path to the worker
(the predictions, after the upstream write) shows where it lands.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

EVENTS: list[tuple[str, float]] = []

CLIENT = r"""
import httpx, json, sys, time
from beamserve.router.bench.agentic import NODELAY
from beamserve.router.bench.agentic_workload import PromptBuilder, synthetic_prompt
url, tokens, n, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
max_tokens = int(sys.argv[5])
builder = PromptBuilder(64)
grown = synthetic_prompt(builder, tokens, "timeline")
def request(i):
    global grown
    name = f"timeline-{i}" if mode == "cold" else "timeline"
    if mode == "grow":  # the next turn of one conversation: a reply and a new user message
        grown = grown + [{"role": "assistant", "content": f"done with step {i}"},
                         {"role": "user", "content": f"now step {i + 1}, and check the tests"}]
        messages = grown
    else:
        messages = synthetic_prompt(builder, tokens, name)
    body = json.dumps({"model": "beam", "messages": messages, "max_tokens": max_tokens,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    return body, {"x-session-id": name, "content-type": "application/json"}
with httpx.Client(transport=httpx.HTTPTransport(socket_options=NODELAY), timeout=60) as c:
    for i in range(n + 2):
        body, headers = request(i)
        first = done = None
        t0 = time.perf_counter()
        with c.stream("POST", url + "/v1/chat/completions", content=body, headers=headers) as r:
            for line in r.iter_lines():
                if first is None and line.startswith("data:") and '"content":"' in line:
                    first = time.perf_counter()
                if line.startswith("data: [DONE]"):
                    done = time.perf_counter()
                    break
        print(json.dumps({"i": i, "send": t0, "first": first, "done": done,
                          "status": r.status_code}), flush=True)
        time.sleep(0.05)
"""


def _mark(label: str) -> None:
    EVENTS.append((label, time.perf_counter()))


def _wrap(owner: Any, name: str, before: str | None, after: str | None) -> None:
    """Stamp `before` on entering `owner.name` and `after` on leaving it (async or not)."""
    orig = getattr(owner, name)
    if asyncio.iscoroutinefunction(orig):

        async def wrapped_async(*a: Any, **k: Any) -> Any:
            if before:
                _mark(before)
            out = await orig(*a, **k)
            if after:
                _mark(after)
            return out

        setattr(owner, name, wrapped_async)
        return

    def wrapped(*a: Any, **k: Any) -> Any:
        if before:
            _mark(before)
        out = orig(*a, **k)
        if after:
            _mark(after)
        return out

    setattr(owner, name, wrapped)


def _probe() -> None:
    import aiohttp.http_writer as http_writer
    import beamserve.router.app as app
    import beamserve.router.core as core
    import beamserve.router.index.prefix_index as prefix_index
    import beamserve.router.pd as pd

    _wrap(app.Router, "_read_body", "request in", "body read")
    parse = app.parse_request

    def parsed(*a: Any, **k: Any) -> Any:
        out = parse(*a, **k)
        _mark("parsed")
        return out

    app.parse_request = parsed  # type: ignore[assignment]
    _wrap(app.Router, "route_request", None, "hashed")
    if hasattr(app.Router, "_whole_key"):  # (not in a tree older than the head keys)
        _wrap(app.Router, "_whole_key", None, "rest hashed")
    _wrap(app.Router, "_admit", None, "admitted")
    _wrap(core.RoutingCore, "decide", None, "decided")
    _wrap(app.Router, "_route", None, "routed (booked)")
    _wrap(pd.Upstreams, "stream", "upstream call", None)
    _wrap(pd.Upstreams, "post_now", "upstream call", None)  # a speculative dispatch's
    _wrap(pd.Upstreams, "open_stream", None, "worker answered")
    _wrap(http_writer.StreamWriter, "_writelines", "socket write", "written")
    _wrap(prefix_index.PrefixIndex, "predict", None, "predicted")
    _wrap(app.Router, "_record_decision", None, "decision recorded")
    _wrap(pd.UpstreamChunks, "first", None, "first chunk")


class _FirstBody:
    """ASGI wrapper: stamps the response's start and its first body bytes sent."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        first = True

        async def stamped(msg: dict[str, Any]) -> None:
            nonlocal first
            if msg["type"] == "http.response.start":
                _mark("response start")
            await send(msg)
            if msg["type"] == "http.response.body" and msg.get("body") and first:
                first = False
                _mark("first bytes sent")
            if msg["type"] == "http.response.body" and not msg.get("more_body"):
                _mark("response ended")

        await self.inner(scope, receive, stamped)


def _with_flow(argv: list[str], extra: dict[str, object]) -> list[str]:
    """`argv` with `extra` laid over its `--flow` JSON (added when it has none)."""
    if "--flow" not in argv:
        return [*argv, "--flow", json.dumps(extra)]
    i = argv.index("--flow") + 1
    return [*argv[:i], json.dumps({**json.loads(argv[i]), **extra}), *argv[i + 1 :]]


async def _run(
    router_name: str, tokens: int, n: int, mode: str, max_tokens: int, speculate: bool = True
) -> dict[str, list[float]]:
    import uvicorn
    from beamserve.operator.router_config import apply_router_config
    from beamserve.router.bench.agentic_procs import ROUTERS, Procs, start_workers
    from beamserve.router.cli import _discovery, runtime_config
    from beamserve.router.server import RouterRuntime

    from beamserve.cli import build_parser

    spec = ROUTERS[router_name]
    with Procs() as procs:
        workers = start_workers(procs, 1, "h200-bf16-tp8", kv_both=spec.kv_both)
        argv = spec.argv(spec, workers, 0)
        if not speculate:
            argv.append("--no-speculative-dispatch")
        if mode == "cold":
            argv = _with_flow(argv, {"prefill_first_pieces": False})
        args = apply_router_config(build_parser().parse_args(argv[1:]))
        rt = RouterRuntime(_discovery(args), runtime_config(args))
        await rt.start()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        config = uvicorn.Config(
            _FirstBody(rt.app), log_level="warning", lifespan="off", http="httptools"
        )
        server = uvicorn.Server(config)
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.01)
        client = await asyncio.create_subprocess_exec(
            sys.executable, "-c", CLIENT, f"http://127.0.0.1:{port}", str(tokens), str(n),
            mode, str(max_tokens), stdout=subprocess.PIPE,
        )  # fmt: skip
        stages: dict[str, list[float]] = {}
        assert client.stdout is not None
        while line := await client.stdout.readline():
            sent = json.loads(line)
            events = list(EVENTS)
            EVENTS.clear()
            if sent["i"] < 2 or sent["status"] != 200 or sent["first"] is None:
                continue
            seen: set[str] = set()
            for label, t in events:
                if label not in seen:  # the first of each (the predictions: the decode's)
                    seen.add(label)
                    stages.setdefault(label, []).append((t - sent["send"]) * 1e3)
            stages.setdefault("client's first token", []).append(
                (sent["first"] - sent["send"]) * 1e3
            )
            if sent["done"] is not None:
                stages.setdefault("client's [DONE]", []).append((sent["done"] - sent["send"]) * 1e3)
        await client.wait()
        server.should_exit = True
        await serving
        await rt.stop()
    return stages


def timeline(stages: dict[str, list[float]]) -> list[dict[str, Any]]:
    """Stages in the order of their median time since the send, with the step from the one
    before."""
    rows = sorted(
        ((label, statistics.median(ts), len(ts)) for label, ts in stages.items()),
        key=lambda r: r[1],
    )
    out, before = [], 0.0
    for label, ms, count in rows:
        out.append({"stage": label, "ms": round(ms, 3), "step_ms": round(ms - before, 3),
                    "n": count})  # fmt: skip
        before = ms
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--router", default="beamserve-adaptive-spill",
                   help="a beamserve router of `beamserve bench agentic --routers`")  # fmt: skip
    p.add_argument("--tokens", type=int, default=100_000)
    p.add_argument("-n", type=int, default=40)
    p.add_argument("--cold", action="store_true",
                   help="each request a new session with text never seen before")  # fmt: skip
    p.add_argument(
        "--grow",
        action="store_true",
        help="each request the next turn of one conversation (a continuing turn)",
    )
    p.add_argument("--max-tokens", type=int, default=1)
    p.add_argument("--no-speculate", action="store_true",
                   help="the router's `--no-speculative-dispatch`: every request parsed, keyed "
                   "and routed before its upstream call")  # fmt: skip
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    import uvloop
    from beamserve.router.bench.agentic_procs import ROUTERS

    from beamserve import log

    if args.router not in ROUTERS or ROUTERS[args.router].kind != "beamserve":
        names = [k for k, s in ROUTERS.items() if s.kind == "beamserve"]
        p.error(f"--router {args.router!r}: use one of {', '.join(names)}")
    log.setup(json=True)
    _probe()
    if args.cold and args.grow:
        p.error("--cold and --grow: give one")
    mode = "cold" if args.cold else "grow" if args.grow else "warm"
    rows = timeline(uvloop.run(_run(args.router, args.tokens, args.n, mode, args.max_tokens,
                                    not args.no_speculate)))  # fmt: skip
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"{args.router}: {args.tokens:,}-token chat, {mode}, "
        f"max_tokens {args.max_tokens}, n={args.n}, median ms"
    )
    for col in ("stage", "since send", "step"):
        table.add_column(col, justify="left" if col == "stage" else "right")
    for r in rows:
        table.add_row(r["stage"], f"{r['ms']:.2f}", f"{r['step_ms']:+.2f}")
    Console().print(table)
    if args.json is not None:
        report = {"command": sys.argv, "router": args.router, "tokens": args.tokens,
                  "n": args.n, "cold": args.cold, "mode": mode, "max_tokens": args.max_tokens,
                  "stages": rows}  # fmt: skip
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
