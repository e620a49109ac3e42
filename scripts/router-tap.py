#!/usr/bin/env python3
"""What each router adds to one agent's turn, seen from a tap in front of its worker.

    .venv/bin/python scripts/router-tap.py [--routers A,B,...] [--tokens 20000] [-n 30]
        [--max-tokens 64] [--rounds 1] [--first-turns [--warm 10]] [--json FILE]

At one agent, a router's throughput is the sum of its turns' lengths, and a turn through a
router is: the client's request reaching the worker whole, the worker's own time, and the
worker's `[DONE]` reaching the client. `wire-overhead` compares TTFT through a router with a
direct call, but a sim worker's own time moves by ±5–10 ms from one request to the next, more
than what routers differ by. This script takes the worker's time out: for each router it starts
one fresh sim worker (as the bench does: KV events on) behind a *tap*, a TCP relay in its own
process that stamps every read in each direction with `time.perf_counter` (CLOCK_MONOTONIC,
shared with the client process), and puts the router in front of the tap. A client then plays
one conversation: a `--tokens`-token chat followed by `-n` continuing turns (each a short
reply and a new user message, as an agent's turns mostly are), streamed, `--max-tokens` each,
through the bench's client (`send_turn`: TCP_NODELAY; it stops reading at `[DONE]`, and a
turn ends when it has let go of the response).

`--first-turns`: each turn is instead a new session's first turn of `--tokens` tokens (a
prompt of its own, cold at the worker), after `--warm` such turns that are not measured (they
fill the router's tokenizer memo, as a long run's shared vocabulary does, and leave sessions
resting on the worker: a first turn longer than a piece then goes in first-turn pieces, and
"to worker" runs to its request itself, after the pieces — the pieces' answers carry no
`[DONE]`).

Per request (medians over the turns after the first two), ms:
- **to worker**: from the client's send to the request's last byte read at the tap — the
  router's whole request path (body intake, parse, key, decision, upstream write);
- **worker**: from there to the tap's read of the `[DONE]` event (the worker's own time);
- **back**: from the `[DONE]` at the tap to the end of the client's turn (the relay of the
  last event);
- **turn**: the client's send to the end of its turn — what one agent's run adds up.

`direct` in `--routers` is the worker through the tap alone (no router). `forwarder` is the
least a Python router can do: a bare relay on the router's own stack (uvicorn with httptools
on uvloop in front, aiohttp behind) that reads each body whole and posts it on unparsed — the
floor under whatever a Python router decides before its upstream call. The tap costs the same
on every path; its own relay is in every number.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Any

TAP = r"""
import asyncio, json, socket, sys, time
import uvloop
listen, target, log_path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
host, port = target.rsplit(":", 1)
log = open(log_path, "w", buffering=1)
conns = 0
async def relay(r, w, tag, c):
    while data := await r.read(1 << 20):
        log.write(json.dumps([c, tag, time.perf_counter(), len(data), data[:8].decode("latin1"),
                              b"[DONE]" in data]) + "\n")
        w.write(data)
        await w.drain()
    w.close()
async def serve(cr, cw):
    global conns
    conns += 1
    sr, sw = await asyncio.open_connection(host, int(port))
    for w in (cw, sw):
        w.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    await asyncio.gather(relay(cr, sw, "req", conns), relay(sr, cw, "resp", conns),
                         return_exceptions=True)
async def main():
    server = await asyncio.start_server(serve, "127.0.0.1", listen)
    print(json.dumps({"url": f"http://127.0.0.1:{listen}"}), flush=True)
    await server.serve_forever()
uvloop.run(main())
"""


FORWARDER = r"""
import sys
import aiohttp, uvicorn
target, port = sys.argv[1], int(sys.argv[2])
state = {}
async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                state["http"] = aiohttp.ClientSession()
                await send({"type": "lifespan.startup.complete"})
                print('{"url": "http://127.0.0.1:%d"}' % port, flush=True)
            else:
                await state["http"].close()
                await send({"type": "lifespan.shutdown.complete"})
                return
    chunks, more = [], True
    while more:
        msg = await receive()
        chunks.append(msg.get("body", b""))
        more = msg.get("more_body", False)
    async with state["http"].request(scope["method"], target + scope["path"],
                                     data=b"".join(chunks),
                                     headers={"content-type": "application/json"}) as r:
        kind = r.headers.get("content-type", "application/json").encode()
        await send({"type": "http.response.start", "status": r.status,
                    "headers": [(b"content-type", kind)]})
        async for data in r.content.iter_any():
            await send({"type": "http.response.body", "body": data, "more_body": True})
    await send({"type": "http.response.body", "body": b""})
uvicorn.run(app, host="127.0.0.1", port=port, http="httptools", loop="uvloop",
            log_level="warning")
"""
REFERENCES = ("direct", "forwarder")


async def _play(
    url: str, tokens: int, n: int, max_tokens: int, name: str, first_turns: int | None = None
) -> list[Any]:
    """The conversation through `url`, with the bench's client (`send_turn`); the records of
    the turns after the first two. `first_turns` (the unmeasured ones): new sessions instead."""
    import httpx
    from beamserve.router.bench.agentic import NODELAY, send_turn
    from beamserve.router.bench.agentic_workload import PromptBuilder, Turn, synthetic_prompt

    builder = PromptBuilder(64)
    messages = synthetic_prompt(builder, tokens, name)
    records = []
    transport = httpx.AsyncHTTPTransport(socket_options=NODELAY)
    async with httpx.AsyncClient(transport=transport, timeout=120) as client:
        if first_turns is not None:
            first = Turn(0, (), 0, 0, max_tokens, 0.0)
            for i in range(-first_turns, n + 2):
                sid = f"{name}-new-{i}"  # a session of its own, its prompt cold at the worker
                prompt = synthetic_prompt(builder, tokens, sid)
                rec = await send_turn(client, url, sid, first, prompt, session_header=sid)
                if not rec.ok:
                    raise RuntimeError(f"{url}: {sid}: {rec.status} {rec.detail}")
                if i >= 0:  # past the warm-up
                    records.append(rec)
                await asyncio.sleep(0.03)
            return records[2:]
        for i in range(n + 2):
            reply = {"role": "assistant", "content": f"done with step {i}"}
            ask = {"role": "user", "content": f"now step {i + 1}, and run the tests"}
            messages = [*messages, reply, ask]
            turn = Turn(i, (), 0, 0, max_tokens, 0.0)
            rec = await send_turn(client, url, name, turn, messages, session_header=name)
            if not rec.ok:
                raise RuntimeError(f"{url}: turn {i}: {rec.status} {rec.detail}")
            records.append(rec)
            await asyncio.sleep(0.03)
    return records[2:]


def _requests(log_path: Path) -> list[dict[str, float]]:
    """The tap's POSTs in order: the read of their last request byte (`last`) and the read
    with their `[DONE]` (`done`). Other requests on a connection (the router's scrapes) end
    the POST before them."""
    posts: list[dict[str, float]] = []
    current: dict[int, dict[str, float] | None] = {}  # connection → its POST now, if any
    for line in log_path.read_text().splitlines():
        conn, tag, t, _n, head, done = json.loads(line)
        if tag == "req":
            if head.split(" ")[0] in ("GET", "POST", "PUT", "HEAD", "DELETE"):
                current[conn] = req = {"last": t} if head.startswith("POST") else None
                if req is not None:
                    posts.append(req)
            elif (req := current.get(conn)) is not None:
                req["last"] = t
        elif done and (req := current.get(conn)) is not None and "done" not in req:
            req["done"] = t
    return [r for r in posts if "done" in r]


def _measure(
    name: str, tokens: int, n: int, max_tokens: int, first_turns: int | None = None
) -> dict[str, Any]:
    from beamserve.router.bench.agentic_procs import (
        ROUTERS,
        Procs,
        free_port,
        start_router,
        start_workers,
    )

    with Procs() as procs:
        worker = start_workers(procs, 1, "h200-bf16-tp8")[0]
        port = free_port()
        log_path = procs.log_dir / "tap.jsonl"
        tap = procs.start("tap", [sys.executable, "-c", TAP, str(port),
                                  worker.url.split("://", 1)[1], str(log_path)])  # fmt: skip
        tap.ready_line(30)
        tapped = dataclasses.replace(worker, url=f"http://127.0.0.1:{port}")
        if name == "direct":
            url = tapped.url
        elif name == "forwarder":
            fwd = procs.start("forwarder", [sys.executable, "-c", FORWARDER, tapped.url,
                                            str(free_port())])  # fmt: skip
            url = str(fwd.ready_line(30)["url"])
        else:
            url = start_router(procs, ROUTERS[name], [tapped]).url
        turns = asyncio.run(_play(url, tokens, n, max_tokens, f"tap-{name}", first_turns))
        reqs = _requests(log_path)[-len(turns) :]
    to_worker = [(r["last"] - t.sent) * 1e3 for t, r in zip(turns, reqs, strict=True)]
    worker_ms = [(r["done"] - r["last"]) * 1e3 for r in reqs]
    back = [(t.end - r["done"]) * 1e3 for t, r in zip(turns, reqs, strict=True)]
    turn = [(t.end - t.sent) * 1e3 for t in turns]
    med = statistics.median
    return {"router": name, "n": len(turns), "to_worker_ms": round(med(to_worker), 3),
            "worker_ms": round(med(worker_ms), 3), "back_ms": round(med(back), 3),
            "turn_ms": round(med(turn), 3)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--routers", default="direct,forwarder,beamserve-adaptive-spill,"
                   "vllm-router-sticky_least_loaded,sglang-router-cache_aware",
                   help="`bench agentic --routers` names, `direct`, `forwarder`")  # fmt: skip
    p.add_argument("--tokens", type=int, default=20_000, help="the conversation's first prompt")
    p.add_argument("-n", type=int, default=30, help="continuing turns measured")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1, help="the routers in turn, this many times")
    p.add_argument("--first-turns", action="store_true",
                   help="each turn a new session's first turn of --tokens tokens")  # fmt: skip
    p.add_argument("--warm", type=int, default=10,
                   help="with --first-turns: first turns sent before those measured")  # fmt: skip
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    from beamserve.router.bench.agentic_procs import ROUTERS
    from rich.console import Console
    from rich.table import Table

    names = [r for r in args.routers.split(",") if r]
    unknown = [r for r in names if r not in REFERENCES and r not in ROUTERS]
    if args.warm < 0:
        p.error(f"--warm: must be ≥ 0, got {args.warm}")
    if unknown:
        p.error(f"--routers: unknown {unknown}; use `direct`, `forwarder` or one of "
                f"{', '.join(ROUTERS)}")  # fmt: skip
    rows = []
    warm = args.warm if args.first_turns else None
    for rnd in range(args.rounds):
        for name in names:
            row = _measure(name, args.tokens, args.n, args.max_tokens, warm)
            rows.append({**row, "round": rnd})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    what = (f"{args.n} new sessions' {args.tokens:,}-token first turns" if args.first_turns
            else f"{args.tokens:,}-token chat + {args.n} continuing turns")  # fmt: skip
    table = Table(title=f"one agent, {what}, max_tokens {args.max_tokens}: median ms")
    for col in ("router", "round", "to worker", "worker", "back", "turn"):
        table.add_column(col, justify="left" if col == "router" else "right")
    for r in rows:
        ms = (r[k] for k in ("to_worker_ms", "worker_ms", "back_ms", "turn_ms"))
        table.add_row(r["router"], str(r["round"]), *(f"{x:.2f}" for x in ms))
    Console().print(table)
    if args.json is not None:
        report = {"command": sys.argv, "tokens": args.tokens, "n": args.n,
                  "max_tokens": args.max_tokens, "first_turns": args.first_turns,
                  "warm": warm, "rows": rows}  # fmt: skip
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
