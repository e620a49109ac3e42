"""`LocalStack`: a `BeamDeployment` running as local processes (what `beamserve up` holds).

    async with LocalStack("manifests/examples/local-sim.yaml") as stack:
        stack.router_url   # "http://127.0.0.1:PORT"
        stack.workers      # [("prefill", "http://127.0.0.1:…"), ("decode", …), …]

`start()` validates the spec (the admission rules, `beamserve validate`'s messages), plans it
(`plan.local_plan` over the operator's `desired_objects`, then `assign_ports`), writes the
router's config, starts every worker, waits for their readiness paths, writes the endpoints
file the router's `--local-runtime` discovery reads (ready workers only, as an EndpointSlice
lists ready pods), then starts the router and waits for it. `stop()` stops the router, then the
workers: SIGTERM to each process group, SIGKILL after `grace_s`.

Supervision, as a Deployment's kubelet would: a process that exits without being asked to, or
fails its pod's HTTP liveness probe (`plan.Liveness`: period, timeout, failures in a row; it is
then killed), is taken out of the endpoints file, restarted after a backoff (`Backoff`: 1 s,
doubling, at most 30 s; reset once it has run `reset_after_s`) and put back once ready.
`apply(spec)` rolls a changed spec (`plan.diff_plans`): new processes (a new revision's pools,
added replicas) start first, beside the old; then gone ones leave the endpoints file and stop,
and processes whose pod template changed restart in place (stop, then start on the same ports:
one machine has no room for a surge on one port); the rest keep running. If a new process does
not come up, the new ones are stopped and the old spec stays.

Files under `state_dir` (default `~/.cache/beamserve/up/<name>/`): `logs/<process>.log`
(stdout and stderr, JSON log lines), `endpoints.json`, `router.yaml`, `spec.yaml` (the spec
running) and `state.json` (`snapshot()`: pids, process groups, ports, readiness, restarts;
what `beamserve down` and `beamserve status` read).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import structlog
import yaml
from beamserve.operator.api import BeamDeployment
from beamserve.operator.local.plan import (
    Liveness,
    LocalPlan,
    LocalPlanError,
    LocalProcess,
    PlanDiff,
    assign_ports,
    diff_plans,
    endpoint_specs,
    local_plan,
)

log = structlog.get_logger("beamserve.up")

STATE_FILE = "state.json"
SPEC_FILE = "spec.yaml"
Event = Callable[[str, dict[str, Any]], None]


class StackError(RuntimeError):
    """The stack could not start or change; the message says what failed and where to look."""


class SpecError(StackError):
    """The spec is invalid (one line per violation, as `beamserve validate` prints them)."""


@dataclass(frozen=True)
class Backoff:
    """Restart delays of a crashed process: `base_s · 2^(n-1)` for the n-th crash in a row,
    at most `max_s`; the count resets once a process has run `reset_after_s`."""

    base_s: float = 1.0
    max_s: float = 30.0
    reset_after_s: float = 60.0

    def delay(self, crashes: int) -> float:
        return float(min(self.max_s, self.base_s * 2 ** max(0, crashes - 1)))


def default_state_dir(name: str) -> Path:
    return (
        Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "beamserve" / "up" / name
    )


def load_spec(source: str | os.PathLike[str] | BeamDeployment) -> BeamDeployment:
    """The one BeamDeployment in a YAML file, checked by the admission rules first.

    Raises `SpecError` with `beamserve validate`'s lines (`FILE#N name: field: problem; fix`)."""
    from beamserve.operator.admission import validate
    from beamserve.operator.desired import parse_deployment

    if isinstance(source, BeamDeployment):
        doc: Any = source.model_dump(mode="json", by_alias=True, exclude_none=True)
        label = str(source.metadata.name or "BeamDeployment")
    else:
        path = Path(source)
        try:
            docs = [d for d in yaml.safe_load_all(path.read_text()) if isinstance(d, dict)]
        except (OSError, yaml.YAMLError) as exc:
            raise SpecError(f"{path}: cannot read: {exc}") from None
        found = [
            (i, d)
            for i, d in enumerate(docs, 1)
            if str(d.get("apiVersion", "beamserve.io/")).startswith("beamserve.io/")
        ]
        if len(found) != 1:
            raise SpecError(
                f"{path}: {len(found)} BeamDeployments; `beamserve up` runs exactly one per "
                "file — split the file"
            )
        i, doc = found[0]
        name = (doc.get("metadata") or {}).get("name") or ""
        label = f"{path}#{i}" + (f" {name}" if name else "")
    problems = validate(doc)
    if problems:
        raise SpecError("\n".join(f"{label}: {v}" for v in problems))
    return parse_deployment(doc)


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PORT = 10000


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (the source ports of outgoing
    connections; 32768 when it cannot be read)."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_loopback_ports(rng: random.Random | None = None) -> Iterator[int]:
    """Ports free on 127.0.0.1 now, below the kernel's ephemeral range, in random order.

    A port the kernel picks for `bind(0)` is an ephemeral one, and between choosing it and the
    process binding it any outgoing connection (the stack's own HTTP and ZMQ clients start then)
    may take it as its source port: a worker then fails with EADDRINUSE (seen once in `make
    test-slow`). Below the ephemeral range only an explicit bind takes a port, and each one
    handed out here was free a moment ago. Raises `StackError` when none is left."""
    rng = rng or random.Random()
    high = max(ephemeral_low(), LOWEST_PORT + 1)
    ports = list(range(LOWEST_PORT, high))
    rng.shuffle(ports)
    for port in ports:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        yield port
    raise StackError(f"no free port on 127.0.0.1 in {LOWEST_PORT}–{high - 1}")


def beamserve_exe() -> str:
    """The `beamserve` console script of this interpreter's environment."""
    exe = Path(sys.executable).parent / "beamserve"
    return str(exe) if exe.exists() else shutil.which("beamserve") or "beamserve"


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def kill_group(pgid: int, sig: signal.Signals) -> bool:
    """Signal a process group; False when it is gone."""
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


class _Running:
    """One spawn of a process (a new object per restart, so a stale watcher knows it is)."""

    def __init__(self, spec: LocalProcess, proc: asyncio.subprocess.Process) -> None:
        self.spec = spec
        self.proc = proc
        self.started = time.monotonic()
        self.stopping = False
        self.ready = False
        self.prober: asyncio.Task[None] | None = None  # its liveness probe, once ready


@dataclass
class _Slot:
    """A process name's history: its current spawn, crashes in a row, restarts so far."""

    spec: LocalProcess
    running: _Running | None = None
    crashes: int = 0
    restarts: int = 0
    watcher: asyncio.Task[None] | None = None
    last_exit: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class LocalStack:
    """A BeamDeployment as local processes. See the module docstring."""

    def __init__(
        self,
        spec: str | os.PathLike[str] | BeamDeployment,
        state_dir: str | os.PathLike[str] | None = None,
        *,
        ready_timeout_s: float = 180.0,
        grace_s: float = 10.0,
        backoff: Backoff = Backoff(),
        on_event: Event | None = None,
        liveness: Liveness | None = None,
    ) -> None:
        self._source = spec
        self._state_dir = Path(state_dir) if state_dir is not None else None
        self.ready_timeout_s = ready_timeout_s
        self.grace_s = grace_s
        self.backoff = backoff
        # every process's liveness timing (its path stays the pod's); None: the pod's own
        self.liveness = liveness
        self._on_event = on_event
        self._plan: LocalPlan | None = None
        self._bd: BeamDeployment | None = None
        self._slots: dict[str, _Slot] = {}
        self._closing = False
        self._lock = asyncio.Lock()
        self.generation = 0

    # -- the public surface --

    @property
    def plan(self) -> LocalPlan:
        if self._plan is None:
            raise StackError("the stack is not started; await stack.start() first")
        return self._plan

    @property
    def state_dir(self) -> Path:
        return self.plan.state_dir

    @property
    def router_url(self) -> str:
        """`http://127.0.0.1:PORT`: where clients send requests."""
        return self.plan.router.url

    @property
    def workers(self) -> list[tuple[str, str]]:
        """(role, url) of every worker process, in plan order."""
        return [(p.component, p.url) for p in self.plan.workers]

    @property
    def deployment(self) -> BeamDeployment:
        if self._bd is None:
            raise StackError("the stack is not started; await stack.start() first")
        return self._bd

    def pid_of(self, name: str) -> int | None:
        slot = self._slots.get(name)
        return slot.running.proc.pid if slot and slot.running else None

    def restarts_of(self, name: str) -> int:
        slot = self._slots.get(name)
        return slot.restarts if slot else 0

    def is_ready(self, name: str) -> bool:
        slot = self._slots.get(name)
        return bool(slot and slot.running and slot.running.ready)

    async def __aenter__(self) -> LocalStack:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        """Validate, plan, start the workers, wait for them, then the router. On failure
        everything started is stopped again and `StackError` (or `SpecError`) raised."""
        bd = load_spec(self._source)
        state_dir = self._state_dir or default_state_dir(str(bd.metadata.name))
        plan = self._new_plan(bd, state_dir, previous={})
        self._check_model(bd)
        state_dir.mkdir(parents=True, exist_ok=True)
        (state_dir / "logs").mkdir(exist_ok=True)
        self._bd, self._plan = bd, plan
        _write_atomic(state_dir / SPEC_FILE, self._spec_yaml(bd))
        plan.endpoints_file.unlink(missing_ok=True)
        self._emit("planned", processes=[p.name for p in plan.processes])
        try:
            await self._start_all([p.name for p in plan.workers])
            self._write_endpoints()
            await self._start_all([plan.router.name])
        except BaseException:
            await self.stop()
            raise
        self.generation += 1
        self._write_state()
        log.info("up.ready", deployment=plan.name, router=self.router_url, state_dir=str(state_dir))

    async def stop(self) -> None:
        """Stop the router, then the workers (SIGTERM, SIGKILL after `grace_s`); idempotent."""
        self._closing = True
        if self._plan is None:
            return
        router = self._plan.router.name
        names = [n for n in self._slots if n == router]
        await asyncio.gather(*(self._stop_slot(n) for n in names))
        await asyncio.gather(*(self._stop_slot(n) for n in list(self._slots)))
        with contextlib.suppress(FileNotFoundError):
            (self._plan.state_dir / STATE_FILE).unlink()
        self._emit("stopped")
        log.info("up.stopped", deployment=self._plan.name)

    async def apply(self, spec: str | os.PathLike[str] | BeamDeployment) -> PlanDiff:
        """Roll to `spec` (same `metadata.name`): restart processes whose pod template
        changed, start new ones, stop gone ones; the others keep running, on their ports."""
        bd = load_spec(spec)
        async with self._lock:
            old = self.plan
            if bd.metadata.name != self.deployment.metadata.name:
                raise SpecError(
                    f"metadata.name: {bd.metadata.name!r} is not the running "
                    f"{self.deployment.metadata.name!r}; `beamserve down` first, or use "
                    "another --state-dir"
                )
            self._check_model(bd)
            new = self._new_plan(bd, old.state_dir, previous=old.host_ports())
            diff = diff_plans(old, new)
            self._emit("roll", start=diff.start, stop=diff.stop, restart=diff.restart)
            log.info("up.roll", start=diff.start, stop=diff.stop, restart=diff.restart)
            if diff.empty:
                return diff
            old_bd = self.deployment
            self._bd, self._plan = bd, new
            router = new.router.name
            # surge: new processes (a new revision's pools, more replicas) come up first
            fresh = [n for n in diff.start if n != router]
            try:
                await self._start_all(fresh)
            except BaseException:
                await asyncio.gather(*(self._stop_slot(n) for n in fresh))
                for name in fresh:
                    self._slots.pop(name, None)
                self._bd, self._plan = old_bd, old
                raise
            _write_atomic(old.state_dir / SPEC_FILE, self._spec_yaml(bd))
            # then the old and the changed ones leave the endpoints file (as terminating pods
            # leave their EndpointSlices) and stop; the changed ones start again on their ports
            changed = [n for n in diff.restart if n != router]
            for name in (*diff.stop, *changed):
                slot = self._slots.get(name)
                if slot and slot.running:
                    slot.running.ready = False
            self._write_endpoints()
            await asyncio.gather(*(self._stop_slot(n) for n in diff.stop))
            for name in diff.stop:
                self._slots.pop(name, None)
            await asyncio.gather(*(self._stop_slot(n) for n in changed))
            await self._start_all(changed)
            self._write_endpoints()
            if router in diff.restart:
                await self._stop_slot(router)
                await self._start_all([router])
            self.generation += 1
            self._write_state()
            return diff

    def snapshot(self) -> dict[str, Any]:
        """What `state.json` holds (`beamserve status` reads it)."""
        plan = self.plan
        procs = []
        for p in plan.processes:
            slot = self._slots.get(p.name)
            running = slot.running if slot else None
            pid = running.proc.pid if running and running.proc.returncode is None else None
            procs.append(
                {
                    "name": p.name,
                    "component": p.component,
                    "pool": p.pool,
                    "url": p.url,
                    "pid": pid,
                    "pgid": pid,
                    "ready": bool(running and running.ready),
                    "restarts": slot.restarts if slot else 0,
                    "last_exit": slot.last_exit if slot else None,
                    "ports": {port.name: port.host_port for port in p.ports},
                    "template_hash": p.template_hash,
                    "log": str(plan.state_dir / "logs" / f"{p.name}.log"),
                }
            )
        return {
            "name": plan.name,
            "supervisor_pid": os.getpid(),
            "router_url": self.router_url,
            "endpoints_file": str(plan.endpoints_file),
            "generation": self.generation,
            "processes": procs,
        }

    # -- planning --

    def _new_plan(self, bd: BeamDeployment, state_dir: Path, previous: dict[str, int]) -> LocalPlan:
        try:
            return assign_ports(local_plan(bd, state_dir), free_loopback_ports(), previous)
        except LocalPlanError as exc:
            raise SpecError(str(exc)) from None

    @staticmethod
    def _check_model(bd: BeamDeployment) -> None:
        host = bd.spec.model.source.host_path
        if host is not None and not Path(host.path).is_dir():
            raise SpecError(
                f"spec.model.source.hostPath.path: {host.path} is not a directory here; make "
                f"a tiny Beam there (`beamserve model make-tiny {host.path}`) or point it at "
                "a checkpoint"
            )

    @staticmethod
    def _spec_yaml(bd: BeamDeployment) -> str:
        doc = bd.model_dump(mode="json", by_alias=True, exclude_none=True)
        return str(yaml.safe_dump(doc, sort_keys=False))

    # -- processes --

    async def _start_all(self, names: list[str]) -> None:
        results = await asyncio.gather(*(self._start_one(n) for n in names), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]

    async def _start_one(self, name: str) -> None:
        spec = self.plan.by_name()[name]
        slot = self._slots.get(name)
        if slot is None:
            slot = self._slots[name] = _Slot(spec)
        slot.spec = spec
        running = await self._spawn(spec)
        slot.running = running
        slot.watcher = asyncio.create_task(self._watch(slot, running))
        await self._wait_ready(running)
        running.ready = True
        self._emit("ready", name=name, pid=running.proc.pid)
        probe = spec.liveness
        if probe is not None and self.liveness is not None:
            probe = replace(self.liveness, path=probe.path)
        if probe is not None:
            running.prober = asyncio.create_task(self._probe_liveness(running, probe))

    async def _probe_liveness(self, running: _Running, probe: Liveness) -> None:
        """The pod's liveness probe, as a kubelet runs it: `probe.failures` failed GETs in a row
        (no answer within its timeout, or an error status) kill the process group; `_watch`
        then restarts it with the crash backoff. A hung engine is restarted, not only a dead
        one."""
        url = f"{running.spec.url}{probe.path}"
        failed = 0
        async with httpx.AsyncClient(timeout=probe.timeout_s) as client:
            while running.proc.returncode is None and not running.stopping:
                await asyncio.sleep(probe.period_s)
                if running.proc.returncode is not None or running.stopping or self._closing:
                    return
                try:
                    ok = (await client.get(url)).status_code < 400
                except httpx.HTTPError:
                    ok = False
                failed = 0 if ok else failed + 1
                if failed >= probe.failures:
                    log.warning("up.unresponsive", process=running.spec.name, url=url,
                                failures=failed)  # fmt: skip
                    self._emit("unresponsive", name=running.spec.name, failures=failed)
                    kill_group(running.proc.pid, signal.SIGKILL)
                    return

    async def _spawn(self, spec: LocalProcess) -> _Running:
        for path, text in spec.files.items():
            _write_atomic(Path(path), text)
        log_path = self.plan.state_dir / "logs" / f"{spec.name}.log"
        argv = list(spec.argv)
        if argv and argv[0] == "beamserve":
            argv[0] = beamserve_exe()
        env = {**os.environ, "BEAMSERVE_LOG_JSON": "1", **spec.env}
        with log_path.open("ab") as out:
            out.write(f"--- {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} start: "
                      f"{' '.join(spec.argv)}\n".encode())  # fmt: skip
            out.flush()
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                env=env,
                cwd=str(self.plan.state_dir),  # never a repository root (./operator)
                start_new_session=True,  # its own process group: stopped as a whole
            )
        log.info("up.spawn", process=spec.name, pid=proc.pid, log=str(log_path))
        self._emit("spawn", name=spec.name, pid=proc.pid)
        return _Running(spec, proc)

    async def _wait_ready(self, running: _Running) -> None:
        spec = running.spec
        url = f"{spec.url}{spec.health_path}"
        deadline = time.monotonic() + self.ready_timeout_s
        async with httpx.AsyncClient(timeout=2.0) as client:
            while True:
                if running.proc.returncode is not None or running.stopping:
                    raise StackError(
                        f"{spec.name} exited ({running.proc.returncode}) before it was ready; "
                        f"its log: {self._log_path(spec.name)}\n{self._tail(spec.name)}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(url)).status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise StackError(
                        f"{spec.name} not ready at {url} after {self.ready_timeout_s:.0f} s; "
                        f"its log: {self._log_path(spec.name)}\n{self._tail(spec.name)}"
                    )
                await asyncio.sleep(0.2)

    async def _watch(self, slot: _Slot, running: _Running) -> None:
        """Restart `running` if it exits without being asked to (with backoff)."""
        code = await running.proc.wait()
        if running.stopping or self._closing or slot.running is not running:
            return
        slot.last_exit = code
        ran = time.monotonic() - running.started
        slot.crashes = 1 if ran >= self.backoff.reset_after_s else slot.crashes + 1
        delay = self.backoff.delay(slot.crashes)
        log.warning("up.crashed", process=running.spec.name, code=code, ran_s=round(ran, 1),
                    restart_in_s=delay)  # fmt: skip
        self._emit("crashed", name=running.spec.name, code=code, restart_in_s=delay)
        running.ready = False
        self._write_endpoints()
        self._write_state()
        await asyncio.sleep(delay)
        if self._closing or slot.running is not running:
            return
        slot.restarts += 1
        try:
            await self._start_one(running.spec.name)
        except StackError as exc:
            log.warning("up.restart_failed", process=running.spec.name, error=str(exc)[:500])
            return  # its watcher (started with the new spawn) restarts it again
        self._write_endpoints()
        self._write_state()

    async def _stop_slot(self, name: str) -> None:
        slot = self._slots.get(name)
        if slot is None or slot.running is None:
            return
        running = slot.running
        if running.stopping and running.proc.returncode is not None:
            return  # stopped already
        running.stopping = True
        running.ready = False
        if running.prober is not None:
            running.prober.cancel()
        await terminate_group(running.proc, self.grace_s)
        slot.last_exit = running.proc.returncode
        if slot.watcher is not None:
            slot.watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await slot.watcher
        log.info("up.stopped_process", process=name, code=running.proc.returncode)

    # -- files --

    def _write_endpoints(self) -> None:
        from beamserve.router.discovery import parse_endpoint_specs, write_local_endpoints

        ready = {n for n, s in self._slots.items() if s.running and s.running.ready}
        entries = endpoint_specs(self.plan, ready)
        write_local_endpoints(self.plan.endpoints_file, parse_endpoint_specs(entries))

    def _write_state(self) -> None:
        if self._closing:
            return
        _write_atomic(self.plan.state_dir / STATE_FILE, json.dumps(self.snapshot(), indent=2))

    def _log_path(self, name: str) -> Path:
        return self.plan.state_dir / "logs" / f"{name}.log"

    def _tail(self, name: str, n: int = 3000) -> str:
        try:
            return self._log_path(name).read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def _emit(self, event: str, **data: Any) -> None:
        if self._on_event is not None:
            self._on_event(event, data)


async def terminate_group(proc: asyncio.subprocess.Process, grace_s: float) -> None:
    """SIGTERM the process's group, SIGKILL it after `grace_s`; reap the leader."""
    if proc.returncode is None:
        kill_group(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), grace_s)
        except TimeoutError:
            kill_group(proc.pid, signal.SIGKILL)
            await proc.wait()
    # children the leader left behind (ref TP ranks) go with the group
    if group_alive(proc.pid):
        kill_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while group_alive(proc.pid) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        kill_group(proc.pid, signal.SIGKILL)


def read_state(state_dir: Path) -> dict[str, Any] | None:
    """`state.json` of a running `beamserve up` (None when absent or unreadable)."""
    try:
        data = json.loads((state_dir / STATE_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None
