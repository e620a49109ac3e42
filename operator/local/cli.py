"""`beamserve up FILE`, `beamserve down`, `beamserve status` (parsers, and what they run).

`up` runs in the foreground and holds the processes (`LocalStack`) until Ctrl-C, SIGTERM or
`beamserve down`; its own structured log goes to `<state_dir>/logs/up.log` (to stderr when
`--log-level` is given). `up` again with the same deployment name while one is running hands the new
spec to the running one (SIGHUP; `<state_dir>/apply.yaml`, the answer in `apply.result.json`),
which rolls the changed pools only, and prints what changed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console

APPLY_FILE = "apply.yaml"
APPLY_RESULT = "apply.result.json"


def add_local_commands(sub: Any) -> None:
    """Register `up`, `down` and `status` on the top-level subparsers."""
    up = sub.add_parser(
        "up",
        help="run a BeamDeployment as local processes (router + sim/ref worker pools)",
        description="Validates FILE (the admission rules), maps the operator's desired objects "
        "onto local processes on free loopback ports, starts the worker pools, waits for "
        "them, starts the router (discovering the workers through an endpoints file), prints "
        "a status table and the endpoint, then supervises: a crashed process restarts with "
        "exponential backoff. Ctrl-C or `beamserve down` stops everything. Run `up` again "
        "with a changed FILE to roll the changed pools only.",
    )
    up.add_argument("file", type=Path, metavar="FILE", help="a BeamDeployment (YAML)")
    up.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="logs, endpoints and state (default ~/.cache/beamserve/up/NAME)",
    )
    up.add_argument("--ready-timeout-s", type=float, default=300.0)
    for name, text in (
        ("down", "stop a `beamserve up` (its processes and their process groups)"),
        ("status", "pools, health, load, cache hits and KV transfers of a `beamserve up`"),
    ):
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument(
            "name", nargs="?", default=None, help="the BeamDeployment (default: the only one up)"
        )
        p.add_argument("--state-dir", type=Path, default=None)
        if name == "status":
            p.add_argument("--json", action="store_true", help="print the scrape as JSON")


def local_main(args: argparse.Namespace, console: Console) -> int:
    if args.command == "up":
        return up_main(args, console)
    try:
        state_dir = _find_state_dir(args.name, args.state_dir)
    except LookupError as exc:
        console.print(f"beamserve {args.command}: {exc}")
        return 1
    if args.command == "down":
        return down_main(state_dir, console)
    return status_main(state_dir, console, as_json=args.json)


# -- up ---------------------------------------------------------------------------------------


def up_main(args: argparse.Namespace, console: Console) -> int:
    from beamserve.operator.local.stack import (
        LocalStack,
        SpecError,
        StackError,
        default_state_dir,
        load_spec,
        read_state,
    )

    try:
        bd = load_spec(args.file)
    except SpecError as exc:
        print(exc, file=sys.stderr)
        return 1
    state_dir = args.state_dir or default_state_dir(str(bd.metadata.name))
    state = read_state(state_dir)
    if state is not None and _alive(int(state.get("supervisor_pid", 0))):
        return _roll_running(args.file, state_dir, state, console)
    if state is not None:  # a supervisor that died without cleaning up
        _kill_leftovers(state)
    if args.log_level is None:  # the terminal gets the table and events; the log, a file
        _log_to(state_dir / "logs" / "up.log")

    def on_event(event: str, data: dict[str, Any]) -> None:
        if event in ("spawn", "ready", "crashed", "roll"):
            detail = " ".join(f"{k}={v}" for k, v in data.items())
            console.print(f"[dim]{time.strftime('%H:%M:%S')}[/] {event} {detail}")

    stack = LocalStack(bd, state_dir, ready_timeout_s=args.ready_timeout_s, on_event=on_event)

    async def serve() -> int:
        loop = asyncio.get_running_loop()
        done = asyncio.Event()
        hup = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, done.set)
        loop.add_signal_handler(signal.SIGHUP, hup.set)
        started = asyncio.create_task(stack.start())
        stopper = asyncio.create_task(done.wait())
        await asyncio.wait({started, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if not started.done():
            started.cancel()
            with contextlib.suppress(asyncio.CancelledError, StackError):
                await started
            await stack.stop()
            return 130
        try:
            started.result()
        except StackError as exc:
            print(exc, file=sys.stderr)
            return 1
        await _print_status(stack.snapshot(), console)
        console.print(f"[bold]endpoint:[/] {stack.router_url}  (OpenAI and Anthropic APIs; "
                      f"Ctrl-C or `beamserve down {bd.metadata.name}` stops it)")  # fmt: skip
        try:
            while not done.is_set():
                waiter = asyncio.create_task(hup.wait())
                await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                if hup.is_set():
                    hup.clear()
                    await _apply_request(stack, console)
        finally:
            console.print("stopping …")
            await stack.stop()
        return 0

    return asyncio.run(serve())


async def _apply_request(stack: Any, console: Console) -> None:
    from beamserve.operator.local.stack import StackError

    path = stack.state_dir / APPLY_FILE
    result: dict[str, Any]
    try:
        diff = await stack.apply(path)
        result = {"ok": True, "generation": stack.generation, "start": diff.start,
                  "stop": diff.stop, "restart": diff.restart}  # fmt: skip
    except (StackError, OSError) as exc:
        result = {"ok": False, "generation": stack.generation, "error": str(exc)}
        console.print(f"[red]roll failed:[/] {exc}")
    result["request"] = path.stat().st_mtime_ns if path.exists() else 0
    (stack.state_dir / APPLY_RESULT).write_text(json.dumps(result))


def _roll_running(file: Path, state_dir: Path, state: dict[str, Any], console: Console) -> int:
    """Hand `file` to the running `up` and wait for its answer."""
    request = state_dir / APPLY_FILE
    tmp = request.with_name(f".{APPLY_FILE}.{os.getpid()}")
    tmp.write_text(file.read_text())
    os.replace(tmp, request)
    stamp = request.stat().st_mtime_ns
    answer = state_dir / APPLY_RESULT
    os.kill(int(state["supervisor_pid"]), signal.SIGHUP)
    console.print(f"{state['name']} is up (pid {state['supervisor_pid']}); rolling to {file} …")
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, json.JSONDecodeError):
            result = json.loads(answer.read_text())
            if result.get("request") == stamp:
                if not result["ok"]:
                    print(result["error"], file=sys.stderr)
                    return 1
                for key in ("restart", "start", "stop"):
                    if result[key]:
                        console.print(f"{key}: {', '.join(result[key])}")
                if not (result["restart"] or result["start"] or result["stop"]):
                    console.print("no change")
                from beamserve.operator.local.stack import read_state

                asyncio.run(_print_status(read_state(state_dir) or state, console))
                return 0
        if not _alive(int(state["supervisor_pid"])):
            print(f"the running `beamserve up` (pid {state['supervisor_pid']}) exited",
                  file=sys.stderr)  # fmt: skip
            return 1
        time.sleep(0.3)
    print("no answer from the running `beamserve up` in 600 s", file=sys.stderr)
    return 1


def _log_to(path: Path) -> None:
    """Structured (JSON) log lines of this process into `path` (`beamserve.log`'s format)."""
    import logging

    import structlog

    path.parent.mkdir(parents=True, exist_ok=True)
    sink = path.open("a", buffering=1)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        logger_factory=structlog.PrintLoggerFactory(file=sink),
        cache_logger_on_first_use=True,
    )


# -- down, status -----------------------------------------------------------------------------


def _find_state_dir(name: str | None, state_dir: Path | None) -> Path:
    from beamserve.operator.local.stack import STATE_FILE, default_state_dir

    if state_dir is not None:
        return state_dir
    if name is not None:
        return default_state_dir(name)
    root = default_state_dir("x").parent
    running = sorted(p.parent for p in root.glob(f"*/{STATE_FILE}"))
    if len(running) == 1:
        return running[0]
    if not running:
        raise LookupError(
            f"nothing is up (no {root}/*/{STATE_FILE}); start one with `beamserve up FILE`"
        )
    names = ", ".join(p.name for p in running)
    raise LookupError(f"several are up ({names}); name one")


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_leftovers(state: dict[str, Any]) -> int:
    from beamserve.operator.local.stack import group_alive, kill_group

    n = 0
    for p in state.get("processes", []):
        pgid = p.get("pgid")
        if pgid and group_alive(int(pgid)):
            kill_group(int(pgid), signal.SIGKILL)
            n += 1
    return n


def down_main(state_dir: Path, console: Console) -> int:
    from beamserve.operator.local.stack import STATE_FILE, read_state

    state = read_state(state_dir)
    if state is None:
        console.print(f"nothing is up in {state_dir}")
        return 0
    pid = int(state.get("supervisor_pid", 0))
    if _alive(pid):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 60
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
    killed = _kill_leftovers(state)  # whatever a killed supervisor left behind
    with contextlib.suppress(FileNotFoundError):
        (state_dir / STATE_FILE).unlink()
    procs = len(state.get("processes", []))
    extra = f"; {killed} left-over process group(s) killed" if killed else ""
    console.print(f"{state['name']}: stopped ({procs} processes){extra}")
    return 0


async def _print_status(state: dict[str, Any], console: Console) -> None:
    from beamserve.operator.local.status import scrape, status_table

    rows = await scrape(state)
    console.print(status_table(str(state["name"]), rows, str(state["router_url"])))


def status_main(state_dir: Path, console: Console, *, as_json: bool = False) -> int:
    import dataclasses

    from beamserve.operator.local.stack import read_state
    from beamserve.operator.local.status import scrape

    state = read_state(state_dir)
    if state is None or not _alive(int(state.get("supervisor_pid", 0))):
        console.print(f"nothing is up in {state_dir}")
        return 1
    if as_json:
        rows = asyncio.run(scrape(state))
        print(json.dumps([dataclasses.asdict(r) for r in rows], indent=2))
        return 0
    asyncio.run(_print_status(state, console))
    return 0
