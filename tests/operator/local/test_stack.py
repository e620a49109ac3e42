"""The local runtime end to end: real sim workers and a real router as processes.

`beamserve up` → a request through the router → `beamserve status` → `beamserve down` (no
process left); a killed worker restarts and the router drops and re-adds it; a changed pool
rolls alone.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from beamserve.operator.local import stack as stack_mod
from beamserve.operator.local.stack import (
    Backoff,
    LocalStack,
    StackError,
    ephemeral_low,
    free_loopback_ports,
    read_state,
)


def _spec(model: Path, **over: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"source": {"hostPath": {"path": str(model)}}},
        "engine": {"name": "sim", "simProfile": "tiny-cpu"},
        "prefill": {"replicas": 1},
        "decode": {"replicas": 1},
        "router": {"disaggregation": {"minUncachedTokens": 256}},
    }
    spec.update(over)
    return {
        "apiVersion": "beamserve.io/v1alpha1",
        "kind": "BeamDeployment",
        "metadata": {"name": "t-up"},
        "spec": spec,
    }


def _write(path: Path, doc: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(doc))
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead too
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


CHAT = {"model": "beam", "max_tokens": 4, "messages": [{"role": "user", "content": "hi " * 400}]}


def test_up_request_status_roll_down(tmp_path: Path, tiny_checkpoint: Path) -> None:
    exe = str(Path(sys.executable).parent / "beamserve")
    spec = _write(tmp_path / "beam.yaml", _spec(tiny_checkpoint))
    state_dir = tmp_path / "state"
    up = subprocess.Popen(
        [exe, "up", str(spec), "--state-dir", str(state_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 180
        state = None
        while time.monotonic() < deadline and up.poll() is None:
            state = read_state(state_dir)
            if state is not None:
                break
            time.sleep(0.3)
        assert state is not None, up.stdout.read() if up.stdout else ""
        assert state["supervisor_pid"] == up.pid
        r = httpx.post(state["router_url"] + "/v1/chat/completions", json=CHAT, timeout=60)
        assert r.status_code == 200, r.text
        route = r.headers["x-beamserve-route"]
        assert "decode=t-up-decode-" in route and "prefill=t-up-prefill-" in route  # P/D
        status = subprocess.run(
            [exe, "status", "--state-dir", str(state_dir), "--json"],
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        rows = {row["name"]: row for row in json.loads(status.stdout)}
        assert set(rows) == {p["name"] for p in state["processes"]}
        assert all(row["healthy"] for row in rows.values())
        decode = next(row for row in rows.values() if row["component"] == "decode")
        assert decode["worker"]["kv_transfers"] == 1  # the request's KV came from prefill
        router = rows["t-up-router"]["router"]
        assert router["requests"] == 1 and router["disaggregated"] == 1
        # `up` again with one pool changed: the running `up` rolls that pool only
        changed = _spec(tiny_checkpoint, decode={"replicas": 1, "extraArgs": ["--speed", "2"]})
        roll = subprocess.run(
            [exe, "up", str(_write(tmp_path / "b.yaml", changed)), "--state-dir", str(state_dir)],
            capture_output=True, text=True, timeout=120, check=True,
        )  # fmt: skip
        decode_name = next(p["name"] for p in state["processes"] if p["component"] == "decode")
        assert f"restart: {decode_name}" in roll.stdout, roll.stdout + roll.stderr
        rolled = read_state(state_dir)
        assert rolled is not None and rolled["generation"] == state["generation"] + 1
        before = {p["name"]: p["pid"] for p in state["processes"]}
        after = {p["name"]: p["pid"] for p in rolled["processes"]}
        assert {n for n in before if before[n] != after[n]} == {decode_name}
        state = rolled
        pids = [p["pid"] for p in state["processes"]]
        down = subprocess.run(
            [exe, "down", "--state-dir", str(state_dir)],
            capture_output=True, text=True, timeout=90, check=True,
        )  # fmt: skip
        assert "stopped (3 processes)" in down.stdout
        assert up.wait(timeout=30) == 0
        assert not any(_alive(pid) for pid in pids), "orphans left behind"
        assert read_state(state_dir) is None
        logs = sorted(p.name for p in (state_dir / "logs").iterdir())
        assert logs == sorted([*(f"{p['name']}.log" for p in state["processes"]), "up.log"])
        events = [json.loads(line)["event"] for line in (state_dir / "logs" / "up.log").open()]
        assert events.count("up.spawn") == 4  # three, then the rolled decode worker
        assert {"up.ready", "up.roll", "up.stopped"} <= set(events)
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)


async def _router_workers(url: str) -> set[str]:
    async with httpx.AsyncClient(timeout=5) as c:
        return {w["id"] for w in (await c.get(url + "/debug/workers")).json()}


async def _until(check: Any, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.2)


def test_a_killed_worker_restarts_and_the_router_drops_and_re_adds_it(
    tmp_path: Path, tiny_checkpoint: Path
) -> None:
    async def run() -> None:
        spec = _write(tmp_path / "beam.yaml", _spec(tiny_checkpoint, decode={"replicas": 2}))
        events: list[tuple[str, dict[str, Any]]] = []
        stack = LocalStack(
            spec,
            tmp_path / "state",
            backoff=Backoff(base_s=2.0),
            on_event=lambda e, d: events.append((e, d)),
        )
        async with stack:
            victim = next(p.name for p in stack.plan.workers if p.component == "decode")
            await _until(lambda: _has(stack.router_url, victim))
            old_pid = stack.pid_of(victim)
            assert old_pid is not None
            os.killpg(old_pid, signal.SIGKILL)
            # dropped: from the endpoints file, and so from the router
            await _until(lambda: _lacks(stack.router_url, victim), 30)
            entries = json.loads(stack.plan.endpoints_file.read_text())
            assert victim not in {e["id"] for e in entries}
            # back, as a new process on the same port, after the backoff
            await _until(lambda: _has(stack.router_url, victim), 60)
            assert stack.pid_of(victim) not in (None, old_pid)
            assert stack.restarts_of(victim) == 1
            crashed = [d for e, d in events if e == "crashed"]
            assert crashed == [{"name": victim, "code": -9, "restart_in_s": 2.0}]
            async with httpx.AsyncClient(timeout=60) as c:
                r = await c.post(stack.router_url + "/v1/chat/completions", json=CHAT)
                assert r.status_code == 200, r.text

    asyncio.run(run())


async def _has(url: str, name: str) -> bool:
    return name in await _router_workers(url)


async def _lacks(url: str, name: str) -> bool:
    return name not in await _router_workers(url)


def test_a_changed_pool_rolls_alone(tmp_path: Path, tiny_checkpoint: Path) -> None:
    async def run() -> None:
        doc = _spec(tiny_checkpoint)
        async with LocalStack(_write(tmp_path / "a.yaml", doc), tmp_path / "state") as stack:
            before = {p.name: stack.pid_of(p.name) for p in stack.plan.processes}
            ports = stack.plan.host_ports()
            doc["spec"]["decode"]["extraArgs"] = ["--speed", "2"]
            diff = await stack.apply(_write(tmp_path / "b.yaml", doc))
            decode = [p.name for p in stack.plan.workers if p.component == "decode"]
            assert diff.restart == tuple(decode) and not diff.start and not diff.stop
            after = {p.name: stack.pid_of(p.name) for p in stack.plan.processes}
            for name in before:
                changed = after[name] != before[name]
                assert changed == (name in decode), name
            assert stack.plan.host_ports() == ports
            assert "--speed" in stack.plan.by_name()[decode[0]].argv
            state = read_state(stack.state_dir)
            assert state is not None and state["generation"] == 2
            await _until(lambda: _has(stack.router_url, decode[0]))
            async with httpx.AsyncClient(timeout=60) as c:
                r = await c.post(stack.router_url + "/v1/chat/completions", json=CHAT)
                assert r.status_code == 200, r.text
            again = await stack.apply(tmp_path / "b.yaml")
            assert again.empty

    asyncio.run(run())


def test_an_invalid_spec_is_refused_with_validates_messages(
    tmp_path: Path, tiny_checkpoint: Path
) -> None:
    doc = _spec(tiny_checkpoint, decode={"tp": 3})
    doc["spec"]["engine"]["name"] = "ref"
    spec = _write(tmp_path / "bad.yaml", doc)
    exe = str(Path(sys.executable).parent / "beamserve")
    up = subprocess.run([exe, "up", str(spec), "--state-dir", str(tmp_path / "s")],
                        capture_output=True, text=True, timeout=60)  # fmt: skip
    validate = subprocess.run([exe, "validate", str(spec)], capture_output=True, text=True)
    assert up.returncode == 1 and validate.returncode == 1
    problems = [line for line in validate.stdout.splitlines() if line.startswith(str(spec))]
    assert problems and all(line in up.stderr for line in problems)
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("missing", ["no-such-dir"])
def test_a_missing_checkpoint_says_how_to_make_one(tmp_path: Path, missing: str) -> None:
    spec = _write(tmp_path / "beam.yaml", _spec(tmp_path / missing))

    async def run() -> None:
        await LocalStack(spec, tmp_path / "state").start()

    with pytest.raises(Exception, match="beamserve model make-tiny"):
        asyncio.run(run())


@pytest.mark.parametrize("how", ["ctrl-c", "supervisor-killed-then-down"])
def test_nothing_outlives_the_stack(tmp_path: Path, tiny_checkpoint: Path, how: str) -> None:
    """Ctrl-C stops every process; a supervisor killed outright leaves its process groups to
    `beamserve down`, which kills them from the state file."""
    exe = str(Path(sys.executable).parent / "beamserve")
    spec = _write(tmp_path / "beam.yaml", _spec(tiny_checkpoint))
    state_dir = tmp_path / "state"
    up = subprocess.Popen([exe, "up", str(spec), "--state-dir", str(state_dir)],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                          cwd=tmp_path, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while (state := read_state(state_dir)) is None:
            assert time.monotonic() < deadline and up.poll() is None
            time.sleep(0.3)
        pids = [p["pid"] for p in state["processes"]]
        assert len(pids) == 3 and all(_alive(pid) for pid in pids)
        if how == "ctrl-c":
            up.send_signal(signal.SIGINT)  # what a terminal's Ctrl-C delivers to `up` alone
            assert up.wait(timeout=60) == 0
        else:
            up.kill()
            up.wait(timeout=10)
            assert all(_alive(pid) for pid in pids)  # orphans, until…
            down = subprocess.run(
                [exe, "down", "--state-dir", str(state_dir)],
                capture_output=True, text=True, timeout=60, check=True,
            )  # fmt: skip
            assert "3 left-over process group(s) killed" in down.stdout
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in pids)
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)


def test_a_new_revision_comes_up_beside_the_old_then_the_old_stops(
    tmp_path: Path, tiny_checkpoint: Path
) -> None:
    async def run() -> None:
        doc = _spec(tiny_checkpoint, decode={"replicas": 1})
        async with LocalStack(_write(tmp_path / "a.yaml", doc), tmp_path / "state") as stack:
            old = {p.name for p in stack.plan.workers}
            router_pid = stack.pid_of(stack.plan.router.name)
            doc["spec"]["kv"] = {"pageSize": 16}  # KV-incompatible: a new revision
            diff = await stack.apply(_write(tmp_path / "b.yaml", doc))
            new = {p.name for p in stack.plan.workers}
            assert set(diff.stop) == old and set(diff.start) == new and not old & new
            assert all(stack.pid_of(n) is None for n in old)
            assert stack.pid_of(stack.plan.router.name) == router_pid
            await _until(lambda: _only(stack.router_url, new))
            entries = json.loads(stack.plan.endpoints_file.read_text())
            assert {e["id"] for e in entries} == new
            async with httpx.AsyncClient(timeout=60) as c:
                r = await c.post(stack.router_url + "/v1/chat/completions", json=CHAT)
                assert r.status_code == 200, r.text

    asyncio.run(run())


async def _only(url: str, names: set[str]) -> bool:
    return await _router_workers(url) == names


def test_ports_are_free_and_below_the_ephemeral_range() -> None:
    """The stack's ports are never ones the kernel hands out as outgoing connections' source
    ports (a worker bound late would find one taken: EADDRINUSE), each is free when handed out,
    and none twice."""
    low = ephemeral_low()
    ports = free_loopback_ports(random.Random(7))
    got = [next(ports) for _ in range(50)]
    assert len(set(got)) == 50
    assert all(stack_mod.LOWEST_PORT <= p < low for p in got)
    for p in got[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # free


def test_a_taken_port_is_never_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """A port in use is skipped, and when none is left the stack is told so."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        monkeypatch.setattr(stack_mod, "LOWEST_PORT", taken)
        monkeypatch.setattr(stack_mod, "ephemeral_low", lambda: taken + 3)
        got: list[int] = []
        with pytest.raises(StackError, match="no free port"):
            for p in free_loopback_ports(random.Random(3)):
                got.append(p)
        assert taken not in got and set(got) <= {taken + 1, taken + 2}
