"""`beamserve bench agentic`: the processes it starts — sim workers and the routers under test.

Every process runs in its own session (process group), with stdout and stderr in files of a
temporary log folder; `Procs` stops them all — SIGTERM to the group, SIGKILL after a grace
period — when its ``with`` block ends, on an exception or Ctrl-C alike, and an ``atexit`` hook
catches whatever a crash leaves behind. The bench turns SIGTERM into an exception so that the
same path runs.

Routers (`ROUTERS`): ``beamserve`` (``beamserve router``, KV events wired from every worker);
``beamserve-x2`` (two of them sharing one ``redis-server``, behind Debian's ``haproxy`` in
``mode tcp`` with ``balance random``: several replicas as a plain L4 balancer spreads them);
``beamserve-baseline`` and ``beamserve-baseline-x2``, the same with the ``beamserve``
executable of another build (`BEAMSERVE_BASELINE`), to measure a change side by side;
the SGLang Model Gateway ``smg`` 1.13 and ``sglang-router`` 0.3.2, each with ``cache_aware`` and
``round_robin``; ``vllm-router`` 0.1.17 with ``sticky_least_loaded`` (its session policy: the
best it offers here, as its ``kv_aware`` policy needs the checkpoint's tokenizer to hash
prompts and the sim workers run without one) and ``cache_aware``. ``sglang-router`` runs from
this venv (a test dependency); ``smg`` and ``vllm-router`` from ``.venv-peers``
(``make peers``, pins in ``router/bench/peers.txt``), or the venv `BEAMSERVE_PEERS_VENV` names.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SIM_ARGS = ("--engine", "sim", "--api", "sglang")
# A `kv_both` pool's workers (`RouterSpec.kv_both`): vLLM's surface, whose NIXL-style handoff
# any worker can send or receive (SGLang's `--disaggregation-mode` fixes each worker's part).
SIM_ARGS_KV_BOTH = ("--engine", "sim", "--api", "vllm", "--handshake-port", "0")
_LIVE: set[ManagedProc] = set()


class ProcError(RuntimeError):
    """A process that did not start or become ready; the message carries its log's tail."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def beamserve_exe() -> str:
    exe = Path(sys.executable).parent / "beamserve"
    return str(exe) if exe.exists() else shutil.which("beamserve") or "beamserve"


def peers_venv() -> Path:
    env = os.environ.get("BEAMSERVE_PEERS_VENV")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / ".venv-peers"


class ManagedProc:
    """One child process in its own process group, logging to files."""

    def __init__(
        self, name: str, argv: Sequence[str], log_dir: Path, *, cwd: str | None = None
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.out_path = log_dir / f"{name}.out"
        self.err_path = log_dir / f"{name}.err"
        with self.out_path.open("wb") as out, self.err_path.open("wb") as err:
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                cwd=cwd or "/",  # never the repository root: ./operator shadows the stdlib
                start_new_session=True,
                env={**os.environ, "BEAMSERVE_LOG_JSON": "1"},
            )
        self.pid = self.proc.pid
        _LIVE.add(self)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, n: int = 2000) -> str:
        parts = []
        for p in (self.err_path, self.out_path):
            with contextlib.suppress(OSError):
                parts.append(p.read_text(errors="replace")[-n:])
        return "\n".join(x for x in parts if x.strip())

    def ready_line(self, timeout_s: float) -> dict[str, Any]:
        """The first JSON object line on stdout (the `*_ready` line of beamserve processes)."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            with contextlib.suppress(OSError):
                for line in self.out_path.read_text(errors="replace").splitlines():
                    if line.startswith("{"):
                        with contextlib.suppress(json.JSONDecodeError):
                            info: dict[str, Any] = json.loads(line)
                            if "url" in info:
                                return info
            if not self.alive():
                break
            time.sleep(0.05)
        raise ProcError(f"{self.name} did not become ready: {' '.join(self.argv)}\n{self.tail()}")

    def stop(self, grace_s: float = 5.0) -> None:
        _LIVE.discard(self)
        if self.proc.poll() is not None:
            _reap_group(self.pid)
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
            self.proc.wait(10)
        _reap_group(self.pid)


def _reap_group(pgid: int) -> None:
    """SIGKILL what is left of a process group (a peer's forked children)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


@atexit.register
def _stop_all() -> None:
    for p in list(_LIVE):
        with contextlib.suppress(Exception):
            p.stop(grace_s=2.0)


class Procs(contextlib.AbstractContextManager["Procs"]):
    """The processes of one run; all stopped (in reverse order) when the block ends."""

    def __init__(self, keep_logs: Path | None = None) -> None:
        self.log_dir = Path(tempfile.mkdtemp(prefix="beamserve-agentic-"))
        self.keep_logs = keep_logs
        self.procs: list[ManagedProc] = []

    def start(self, name: str, argv: Sequence[str], *, cwd: str | None = None) -> ManagedProc:
        p = ManagedProc(name, argv, self.log_dir, cwd=cwd)
        self.procs.append(p)
        return p

    def __exit__(self, *exc: object) -> None:
        for p in reversed(self.procs):
            p.stop()
        if self.keep_logs is not None:
            self.keep_logs.mkdir(parents=True, exist_ok=True)
            for f in self.log_dir.iterdir():
                shutil.copy(f, self.keep_logs / f.name)
        shutil.rmtree(self.log_dir, ignore_errors=True)


# --- CPU time ----------------------------------------------------------------------------------


def _stat(pid: int) -> tuple[int, float] | None:
    """(ppid, utime + stime + cutime + cstime in clock ticks) of a live process."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()  # after "pid (comm) "
    ppid = int(fields[1])
    ticks = sum(float(fields[i]) for i in (11, 12, 13, 14))  # utime stime cutime cstime
    return ppid, ticks


def tree_cpu_seconds(root: int) -> float:
    """CPU seconds of `root` and every live descendant (children already reaped by their parent
    count in its cutime/cstime)."""
    stats: dict[int, tuple[int, float]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (s := _stat(int(entry.name))) is not None:
            stats[int(entry.name)] = s
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            total += stats[pid][1]
        todo.extend(children.get(pid, []))
    return total / os.sysconf("SC_CLK_TCK")


# --- workers -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Worker:
    url: str
    kv_events: str | None
    kv_replay: str | None
    pid: int
    role: str = "both"
    kv_both: bool = False  # sends and receives KV (vLLM kv_role kv_both)


def start_workers(
    procs: Procs,
    n: int,
    profile: str,
    *,
    max_model_len: int | None = None,
    catch_up_s: float | None = None,
    max_batched_tokens: int | None = None,
    ready_timeout_s: float = 120.0,
    tag: str = "w",
    prefill: int = 0,
    kv_both: bool = False,
) -> list[Worker]:
    """`n` fresh sim workers (SGLang surface, KV events on free loopback ports), in parallel.
    `prefill` > 0: the first `prefill` of them are started `--role prefill` (SGLang bootstrap
    on a free port) and the rest `--role decode`, a disaggregated pool of the same `n`.
    `kv_both`: all of them role `both` on vLLM's surface with a KV handshake server, each able
    to send and receive KV (the router chooses their parts: `pool_roles`)."""
    if not 0 <= prefill < n or (prefill and n < 2):
        raise ValueError(f"prefill workers: {prefill} of {n}; give 0 (colocated) or 1..{n - 1}")
    if prefill and kv_both:
        raise ValueError("kv_both: every worker is role both; give prefill=0")
    started = []
    roles = ["both"] * n if not prefill else ["prefill"] * prefill + ["decode"] * (n - prefill)
    for i in range(n):
        surface = SIM_ARGS_KV_BOTH if kv_both else SIM_ARGS
        argv = [beamserve_exe(), "worker", *surface, "--profile", profile,
                "--host", "127.0.0.1", "--port", "0",
                "--kv-events-endpoint", "tcp://127.0.0.1:0",
                "--kv-replay-endpoint", "tcp://127.0.0.1:0"]  # fmt: skip
        if roles[i] != "both":
            argv += ["--role", roles[i]]
        if roles[i] == "prefill":
            argv += ["--handshake-port", "0"]
        if max_model_len is not None:
            argv += ["--max-model-len", str(max_model_len)]
        if catch_up_s is not None:
            argv += ["--catch-up-s", str(catch_up_s)]
        if max_batched_tokens is not None:
            argv += ["--max-num-batched-tokens", str(max_batched_tokens)]
        started.append(procs.start(f"{tag}{i}", argv))
    out = []
    for p, role in zip(started, roles, strict=True):
        info = p.ready_line(ready_timeout_s)
        kv, replay = info.get("kv_events"), info.get("kv_replay")
        out.append(
            Worker(
                str(info["url"]),
                str(kv) if kv else None,
                str(replay) if replay else None,
                p.pid,
                role,
                kv_both,
            )
        )
    return out


def _metrics_text(url: str, timeout_s: float) -> str | None:
    """A process's Prometheus `/metrics` text; None when it cannot be read."""
    import urllib.request

    try:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout_s) as r:
            raw: bytes = r.read()
    except OSError:
        return None
    return raw.decode()


def worker_step_lag_s(url: str, timeout_s: float = 5.0) -> float:
    """A sim worker's `beamserve_worker_step_lag_seconds_total` (engine time lost to a busy
    host); 0 when it cannot be read."""
    import re

    text = _metrics_text(url, timeout_s)
    m = re.search(r"^beamserve_worker_step_lag_seconds_total\s+(\S+)", text or "", re.M)
    return float(m.group(1)) if m else 0.0


# A sim worker's engine counters the bench samples over a run (`workers/server/metrics.py`).
_BUSY_NAMES = (
    "beamserve_worker_busy_seconds_total",
    "beamserve_worker_prefill_busy_seconds_total",
    "beamserve_worker_prefill_computed_tokens_total",
)


def worker_busy(url: str, timeout_s: float = 5.0) -> tuple[float, float, float] | None:
    """A sim worker's engine seconds in steps, in steps with prefill, and prompt tokens
    computed; None when it cannot be read or does not export them (not a sim worker)."""
    import re

    text = _metrics_text(url, timeout_s) or ""
    got = [re.search(rf"^{n}\s+(\S+)", text, re.M) for n in _BUSY_NAMES]
    if not all(got):
        return None
    busy, prefill_busy, tokens = (float(m.group(1)) for m in got if m)
    return busy, prefill_busy, tokens


class BusySampler:
    """Reads every worker's `worker_busy` counters every `every_s` seconds, on a thread, from
    `start` until `stop`; `samples` holds `(seconds since start, [counters per worker])`, a
    worker that could not be read once repeating its last value (0 before any)."""

    def __init__(self, urls: Sequence[str], every_s: float = 2.0) -> None:
        self.urls = list(urls)
        self.every_s = every_s
        self.samples: list[tuple[float, list[tuple[float, float, float]]]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    def _read(self) -> None:
        last = self.samples[-1][1] if self.samples else [(0.0, 0.0, 0.0)] * len(self.urls)
        pairs = zip(self.urls, last, strict=True)
        row = [worker_busy(u, timeout_s=1.0) or prev for u, prev in pairs]
        self.samples.append((time.monotonic() - self._t0, row))

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self._read()

    def start(self) -> BusySampler:
        self._t0 = time.monotonic()
        self._read()
        self._thread = threading.Thread(target=self._loop, name="busy-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> list[tuple[float, list[tuple[float, float, float]]]]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._read()
        return self.samples


def busy_figures(
    samples: Sequence[tuple[float, Sequence[tuple[float, float, float]]]],
) -> dict[str, Any]:
    """What a run's `BusySampler` samples say: each worker's engine seconds in steps over
    the sampled span (`worker_busy_s`; in steps with prefill: `worker_prefill_busy_s`), the
    prompt tokens it computed, the pool's busy share (Σ busy ÷ (span × workers)), and the
    busy share of each worker in each interval between samples (`worker_busy_timeline`:
    `t` the interval's end, seconds from the first sample). Empty when there are fewer than
    two samples or the workers export no such counters (all zero)."""
    if len(samples) < 2:
        return {}
    (t0, first), (t1, last) = samples[0], samples[-1]
    n = len(first)
    span = t1 - t0
    busy = [last[i][0] - first[i][0] for i in range(n)]
    if span <= 0 or n == 0 or not any(last[i][0] for i in range(n)):
        return {}
    timeline: dict[str, list[Any]] = {"t": [], "busy": []}
    for (ta, a), (tb, b) in itertools.pairwise(samples):
        if tb > ta:
            timeline["t"].append(round(tb - t0, 3))
            timeline["busy"].append(
                [round(min(1.0, max(0.0, (b[i][0] - a[i][0]) / (tb - ta))), 4) for i in range(n)]
            )
    return {
        "worker_busy_share": sum(busy) / (span * n),
        "worker_busy_s": busy,
        "worker_prefill_busy_s": [last[i][1] - first[i][1] for i in range(n)],
        "worker_prefill_computed_tokens": [int(last[i][2] - first[i][2]) for i in range(n)],
        "worker_busy_timeline": timeline,
    }


# The router's counters a run records (`router_counters`): what its flow rules and P/D did.
ROUTER_COUNTERS = (
    "beamserve_router_pace_holds_total",
    "beamserve_router_pace_hold_seconds_total",
    "beamserve_router_prefill_spills_total",
    "beamserve_router_prefill_pieces_total",
    "beamserve_router_pieced_prefills_total",
    "beamserve_router_prefill_pieces_missed_total",
    "beamserve_router_prefill_piece_yields_total",
    "beamserve_router_disaggregated_total",
    "beamserve_router_pd_fallbacks_total",
    "beamserve_router_retries_total",
    "beamserve_router_pool_mode_switches_total",
    "beamserve_router_speculative_dispatches_total",
)


def router_counters(url: str, timeout_s: float = 5.0) -> dict[str, float]:
    """A beamserve router's `ROUTER_COUNTERS` (each series by its labels, as exposed); empty
    when they cannot be read."""
    out: dict[str, float] = {}
    for line in (_metrics_text(url, timeout_s) or "").splitlines():
        if line.startswith(ROUTER_COUNTERS):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


# --- routers -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RouterSpec:
    """One router under test: how to find it, start it and name it. `prefill_share` > 0: the
    run's workers are started as a disaggregated pool (that share prefill, at least one, the
    rest decode) instead of colocated: the same processes and simulated GPUs, other roles."""

    name: str
    kind: str  # beamserve | smg | sglang-router | vllm-router
    policy: str
    package: str
    argv: Callable[[RouterSpec, Sequence[Worker], int], list[str]] = field(repr=False)
    exe: Callable[[], str | None] = field(repr=False)
    ready_json: bool = False  # prints a JSON ready line with its url (beamserve)
    replicas: int = 1  # > 1: that many processes, one Redis, HAProxy in front (beamserve-xN)
    prefill_share: float = 0.0  # > 0: that share of the workers started as prefill, rest decode
    extra_args: tuple[str, ...] = ()  # more router flags (beamserve)
    kv_both: bool = False  # its workers are a `kv_both` pool (`start_workers`)

    def prefill_workers(self, n: int) -> int:
        """How many of `n` workers this router's runs start as prefill (0: colocated)."""
        if self.prefill_share <= 0 or n < 2:
            return 0
        return min(n - 1, max(1, round(n * self.prefill_share)))

    def unavailable(self) -> str | None:
        """Why it cannot run here (None: it can)."""
        if self.exe() is None:
            if self.name.startswith("beamserve-baseline"):
                return "set BEAMSERVE_BASELINE to another build's beamserve executable"
            if self.kind == "sglang-router":
                return "sglang_router is not importable in this venv (pip install sglang-router)"
            return f"{self.package} is not installed in {peers_venv()} (run `make peers`)"
        return None

    def version(self) -> str | None:
        return package_version(self.kind, self.package)


def package_version(kind: str, package: str) -> str | None:
    import importlib.metadata as md

    if kind in ("beamserve", "sglang-router"):
        try:
            return md.version(package)
        except md.PackageNotFoundError:
            return None
    norm = package.replace("-", "_")
    for site in peers_venv().glob("lib/python*/site-packages"):
        for d in site.glob(f"{norm}-*.dist-info"):
            return d.name[len(norm) + 1 : -len(".dist-info")]
    return None


def _peer_exe(name: str) -> Callable[[], str | None]:
    def find() -> str | None:
        exe = peers_venv() / "bin" / name
        return str(exe) if exe.exists() else None

    return find


def _sglang_router_exe() -> str | None:
    import importlib.util

    return sys.executable if importlib.util.find_spec("sglang_router") is not None else None


def _beamserve_argv(spec: RouterSpec, workers: Sequence[Worker], port: int) -> list[str]:
    endpoints = []
    for w in workers:
        e: dict[str, Any] = {"url": w.url, "role": w.role, "engine": "sim"}
        if w.kv_both:
            e["labels"] = {"kv_role": "kv_both"}
        if w.kv_events:
            e["kv_events"] = w.kv_events
            e["kv_replay"] = w.kv_replay
        endpoints.append(e)
    exe = spec.exe()
    assert exe is not None
    # No --hash-scheme: each worker reports its own (the sim's surfaces hash and publish KV
    # events as vLLM does), and a flag that disagreed would only log a geometry mismatch.
    return [exe, "router", "--host", "127.0.0.1", "--port", "0",
            "--endpoints", json.dumps(endpoints), "--policy", spec.policy,
            *spec.extra_args]  # fmt: skip


# `beamserve-2p2d`'s P/D rule: only prompts with 8,192 or more uncached tokens go to the prefill
# workers (the default rule's 2,048 also sends mid-sized continuing parts and short first turns
# there, where they queue behind long cold prompts; docs/bench/agentic.md, "A disaggregated pool
# at the knee"), and a session's later turns stay on its decode worker whatever their size
# (`keep_warm_local`: that worker holds the context a prefill worker would compute again).
# A later turn with 1,024+ uncached tokens waits (up to 1.5 s) while its prefill would push a
# user decoding on its worker under 20 tokens/s (`FlowConfig.pace_hold_tokens`), and one with
# 4,096+ is prefilled there in 1,024-token pieces (`FlowConfig.prefill_piece_min_tokens`).
_SPLIT_RULE: dict[str, Any] = {"min_uncached_tokens": 8192, "keep_warm_local": True}
_FIRST_TURNS_FLOW: dict[str, Any] = {"pace_hold_tokens": 1024, "prefill_piece_min_tokens": 4096}
_PD_SPLIT = ("--disaggregation", json.dumps(_SPLIT_RULE))
PD_RULE_FIRST_TURNS = (*_PD_SPLIT, "--flow", json.dumps(_FIRST_TURNS_FLOW))


def pd_rule_adaptive(
    split_at: float, spill_after_s: float | None = None, spill_at: float | None = None, **spill: Any
) -> tuple[str, ...]:
    """`beamserve-adaptive`: `beamserve-2p2d`'s rules over a `kv_both` pool of the same 4
    workers whose roles follow the load (`beamserve.router.policy.pool_roles`): colocated below
    `split_at` active sessions a worker, 2 prefill + 2 decode from there (colocated again after
    10 s under ⅔ of it). `spill_after_s`: and the prefill stage's spill after that long, with
    `spill`'s other `prefill_spill_*` keys (`max_tokens=…` → `prefill_spill_max_tokens`), from
    `spill_at` active sessions a worker on (None: whenever split)."""
    roles: dict[str, Any] = {"prefill_workers": 2, "split_at_sessions_per_worker": split_at}
    if spill_at is not None:
        roles["spill_at_sessions_per_worker"] = spill_at
    disagg = {**_SPLIT_RULE, "pool_roles": roles}
    flow = dict(_FIRST_TURNS_FLOW)
    if spill_after_s is not None:
        flow["prefill_spill_after_s"] = spill_after_s
        flow |= {f"prefill_spill_{k}": v for k, v in spill.items()}
    return ("--disaggregation", json.dumps(disagg), "--flow", json.dumps(flow))


# `beamserve-2p2d-no-pieces`: the same without the pieces (the pool as built before them).
PD_RULE_NO_PIECES = (*_PD_SPLIT, "--flow", json.dumps({"pace_hold_tokens": 1024}))
# `beamserve-2p2d-spill`: with the pieces, and a new session held at the prefill stage 1 s or
# more may be prefilled on a decode worker instead, while that worker's queued prefill stays
# within 48K tokens and its streaming users keep 0.5 s of slack beyond it
# (`FlowConfig.prefill_spill_after_s`; not kept: docs/bench/agentic.md).
PD_RULE_SPILL = (
    *_PD_SPLIT,
    "--flow",
    json.dumps(
        {"pace_hold_tokens": 1024, "prefill_piece_min_tokens": 4096, "prefill_spill_after_s": 1.0}
    ),
)


def _baseline_exe() -> str | None:
    """`BEAMSERVE_BASELINE`: the `beamserve` executable of another build (an earlier commit,
    say), to run beside this one as router `beamserve-baseline`."""
    exe = os.environ.get("BEAMSERVE_BASELINE")
    return exe if exe and Path(exe).is_file() else None


def _sglang_argv(spec: RouterSpec, workers: Sequence[Worker], port: int) -> list[str]:
    exe = spec.exe()
    assert exe is not None
    head = [exe, "-m", "sglang_router.launch_router"] if spec.kind == "sglang-router" else [
        exe, "launch"]  # fmt: skip
    return [*head, "--worker-urls", *[w.url for w in workers], "--policy", spec.policy,
            "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-port", str(free_port()), "--log-level", "warn"]  # fmt: skip


def _vllm_router_argv(spec: RouterSpec, workers: Sequence[Worker], port: int) -> list[str]:
    exe = spec.exe()
    assert exe is not None
    return [exe, "--worker-urls", *[w.url for w in workers], "--policy", spec.policy,
            "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-port", str(free_port()), "--log-level", "warning",
            "--worker-startup-check-interval", "1"]  # fmt: skip


def _merged(args: tuple[str, ...], flow: dict[str, Any], roles: dict[str, Any]) -> tuple[str, ...]:
    """`pd_rule_adaptive`'s argv with `flow` merged into its `--flow` and `roles` into its
    disaggregation's `pool_roles`."""
    out = list(args)
    disagg = json.loads(out[1])
    disagg["pool_roles"] |= roles
    out[1] = json.dumps(disagg)
    out[3] = json.dumps(json.loads(out[3]) | flow)
    return tuple(out)


def _spill_x(var: str = "BS_SPILL_X") -> tuple[str, ...]:
    """`beamserve-adaptive-spill-wide`'s argv with the JSON in `var` merged into its `--flow`
    (the bench's `-spill-x` / `-spill-y` experiment routers)."""
    wide = pd_rule_adaptive(6.0, 0.3, max_tokens=98304, margin_s=0.0)
    return _merged(wide, json.loads(os.environ.get(var, "{}")), {})


# (with the router's defaults: a first turn beside live sessions goes in pieces of the worker's
# step budget, `flow.prefill_first_pieces`; docs/bench/agentic.md, "First-turn pieces sized by
# the step budget")
_SHIPPED_SPILL = pd_rule_adaptive(10.0, 0.3, 24.0, max_tokens=98304, margin_s=0.0, tok_s=100000)
# `beamserve-adaptive-lull`: that, and the spill in a lull of new sessions (none for 2 s: the
# users kept at 10 tokens/s, 160K tokens queued at most; docs/bench/agentic.md, "The end of a
# burst drained in a lull")
_LULL_SPILL = _merged(
    _SHIPPED_SPILL,
    {
        "prefill_spill_lull_s": 2.0,
        "prefill_spill_lull_user_tok_s": 10.0,
        "prefill_spill_lull_max_tokens": 163840,
    },
    {},
)


def _spill_z(var: str = "BS_SPILL_Z") -> tuple[str, ...]:
    """`beamserve-adaptive-spill`'s argv with the JSON in `var` (``{"flow": {...},
    "pool_roles": {...}, "saturation": {...}, "policy": {...}}``) merged into its `--flow` and
    its disaggregation's `pool_roles`, the third as its `--saturation` and the last as its
    `--policy` (the bench's `-spill-z` / `-spill-w` experiment routers)."""
    z = json.loads(os.environ.get(var, "{}"))
    args = _merged(_SHIPPED_SPILL, z.get("flow", {}), z.get("pool_roles", {}))
    for key in ("saturation", "policy"):
        if key in z:
            args += (f"--{key}", json.dumps(z[key]))
    return args


def _adaptive(
    name: str, args: tuple[str, ...], exe: Callable[[], str | None] = beamserve_exe
) -> RouterSpec:
    """A `beamserve-adaptive*` router: beamserve (`exe`) over `kv_both` workers with `args`."""
    return RouterSpec(name, "beamserve", "sticky-until-saturated", "beamserve", _beamserve_argv,
                      exe, ready_json=True, kv_both=True, extra_args=args)  # fmt: skip


def _router_specs() -> dict[str, RouterSpec]:
    specs = [
        RouterSpec("beamserve", "beamserve", "sticky-until-saturated", "beamserve",
                   _beamserve_argv, beamserve_exe, ready_json=True),
        RouterSpec("beamserve-2p2d", "beamserve", "sticky-until-saturated", "beamserve",
                   _beamserve_argv, beamserve_exe, ready_json=True, prefill_share=0.5,
                   extra_args=PD_RULE_FIRST_TURNS),
        _adaptive("beamserve-adaptive", pd_rule_adaptive(6.0)),
        _adaptive("beamserve-adaptive-3", pd_rule_adaptive(3.0)),
        _adaptive("beamserve-adaptive-10", pd_rule_adaptive(10.0)),
        _adaptive("beamserve-adaptive-spill", _SHIPPED_SPILL),
        _adaptive("beamserve-adaptive-spill-baseline", _SHIPPED_SPILL, _baseline_exe),
        _adaptive("beamserve-adaptive-lull", _LULL_SPILL),
        _adaptive("beamserve-adaptive-spill-unpriced", pd_rule_adaptive(6.0, spill_after_s=0.3)),
        _adaptive("beamserve-adaptive-spill-wide",
                  pd_rule_adaptive(6.0, 0.3, max_tokens=98304, margin_s=0.0)),
        _adaptive("beamserve-adaptive-spill-x", _spill_x()),
        _adaptive("beamserve-adaptive-spill-y", _spill_x("BS_SPILL_Y")),
        _adaptive("beamserve-adaptive-spill-z", _spill_z()),
        _adaptive("beamserve-adaptive-spill-w", _spill_z("BS_SPILL_W")),
        RouterSpec("beamserve-2p2d-no-pieces", "beamserve", "sticky-until-saturated",
                   "beamserve", _beamserve_argv, beamserve_exe, ready_json=True,
                   prefill_share=0.5, extra_args=PD_RULE_NO_PIECES),
        RouterSpec("beamserve-2p2d-spill", "beamserve", "sticky-until-saturated", "beamserve",
                   _beamserve_argv, beamserve_exe, ready_json=True, prefill_share=0.5,
                   extra_args=PD_RULE_SPILL),
        RouterSpec("beamserve-baseline", "beamserve", "sticky-until-saturated", "beamserve",
                   _beamserve_argv, _baseline_exe, ready_json=True),
        RouterSpec("beamserve-x2", "beamserve", "sticky-until-saturated", "beamserve",
                   _beamserve_argv, beamserve_exe, ready_json=True, replicas=2),
        RouterSpec("beamserve-baseline-x2", "beamserve", "sticky-until-saturated", "beamserve",
                   _beamserve_argv, _baseline_exe, ready_json=True, replicas=2),
        RouterSpec("smg-cache_aware", "smg", "cache_aware", "smg", _sglang_argv, _peer_exe("smg")),
        RouterSpec("smg-round_robin", "smg", "round_robin", "smg", _sglang_argv, _peer_exe("smg")),
        RouterSpec("sglang-router-cache_aware", "sglang-router", "cache_aware", "sglang-router",
                   _sglang_argv, _sglang_router_exe),
        RouterSpec("sglang-router-round_robin", "sglang-router", "round_robin", "sglang-router",
                   _sglang_argv, _sglang_router_exe),
        RouterSpec("vllm-router-sticky_least_loaded", "vllm-router", "sticky_least_loaded",
                   "vllm-router", _vllm_router_argv, _peer_exe("vllm-router")),
        RouterSpec("vllm-router-cache_aware", "vllm-router", "cache_aware", "vllm-router",
                   _vllm_router_argv, _peer_exe("vllm-router")),
    ]  # fmt: skip
    return {s.name: s for s in specs}


ROUTERS = _router_specs()
DEFAULT_ROUTERS = (
    "beamserve",
    "smg-cache_aware",
    "smg-round_robin",
    "sglang-router-cache_aware",
    "sglang-router-round_robin",
    "vllm-router-sticky_least_loaded",
)


@dataclass
class StartedRouter:
    spec: RouterSpec
    url: str
    proc: ManagedProc
    argv: list[str]
    replicas: list[ManagedProc] = field(default_factory=list)  # every router process

    def cpu_seconds(self) -> float:
        """CPU of every router process's tree (the balancer and Redis not counted)."""
        return sum(tree_cpu_seconds(p.pid) for p in self.replicas or [self.proc])

    def alive(self) -> bool:
        return all(p.alive() for p in self.replicas or [self.proc])


def probe_chat(url: str, timeout_s: float, alive: Callable[[], bool] = lambda: True) -> None:
    """Wait until `url` answers a 1-token chat with 200 (gateways activate workers after their
    own health checks)."""
    import httpx

    body = {"model": "beam", "messages": [{"role": "user", "content": "ready?"}],
            "max_tokens": 1}  # fmt: skip
    end = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < end:
        if not alive():
            raise ProcError(f"{url}: the router exited")
        try:
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=5)
            if r.status_code == 200:
                return
            last = f"HTTP {r.status_code}: {r.text[:200]}"
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(0.25)
    raise ProcError(f"{url}: no 200 to a chat request within {timeout_s:g} s ({last})")


def haproxy_exe() -> str | None:
    """Debian's `haproxy` (in /usr/sbin, off a non-root PATH)."""
    return shutil.which("haproxy") or next(
        (p for p in ("/usr/sbin/haproxy",) if Path(p).exists()), None
    )


def _wait_port(port: int, timeout_s: float, alive: Callable[[], bool]) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end and alive():
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise ProcError(f"nothing accepts on 127.0.0.1:{port}")


def start_replicas(
    procs: Procs, spec: RouterSpec, workers: Sequence[Worker], *, ready_timeout_s: float = 90.0
) -> StartedRouter:
    """`spec.replicas` beamserve routers sharing one `redis-server` (sessions, bindings,
    attained service), behind HAProxy (``mode tcp``, ``balance random``) as a plain L4 load
    balancer spreads connections; the url is HAProxy's."""
    redis_exe = shutil.which("redis-server") or "/usr/bin/redis-server"
    lb = haproxy_exe()
    if lb is None or not Path(redis_exe).exists():
        raise ProcError(f"{spec.name}: needs redis-server and haproxy (run `make debs`)")
    rport = free_port()
    redis = procs.start("redis", [redis_exe, "--port", str(rport), "--bind", "127.0.0.1",
                                  "--save", "", "--appendonly", "no"])  # fmt: skip
    _wait_port(rport, 10.0, redis.alive)
    routers, urls = [], []
    for i in range(spec.replicas):
        argv = [*spec.argv(spec, workers, 0), "--redis", f"redis://127.0.0.1:{rport}/0"]
        p = procs.start(f"{spec.name}-{i}", argv)
        routers.append(p)
        urls.append(str(p.ready_line(ready_timeout_s)["url"]))
    port = free_port()
    cfg = procs.log_dir / "haproxy.cfg"
    backends = "\n".join(f"    server r{i} {u.split('://', 1)[1]}" for i, u in enumerate(urls))
    cfg.write_text(
        "global\n    maxconn 4096\ndefaults\n    mode tcp\n    timeout connect 5s\n"
        "    timeout client 900s\n    timeout server 900s\n"
        f"frontend routers\n    bind 127.0.0.1:{port}\n    default_backend replicas\n"
        f"backend replicas\n    balance random\n{backends}\n"
    )
    proxy = procs.start("haproxy", [lb, "-f", str(cfg), "-db"])
    _wait_port(port, 10.0, proxy.alive)
    url = f"http://127.0.0.1:{port}"
    try:
        probe_chat(url, ready_timeout_s, proxy.alive)
    except ProcError as exc:
        raise ProcError(f"{spec.name}: {exc}\n{proxy.tail()}") from exc
    return StartedRouter(spec, url, routers[0], routers[0].argv, routers)


def start_router(
    procs: Procs, spec: RouterSpec, workers: Sequence[Worker], *, ready_timeout_s: float = 90.0
) -> StartedRouter:
    if spec.replicas > 1:
        return start_replicas(procs, spec, workers, ready_timeout_s=ready_timeout_s)
    port = free_port()
    argv = spec.argv(spec, workers, port)
    p = procs.start(spec.name, argv)
    if spec.ready_json:
        url = str(p.ready_line(ready_timeout_s)["url"])
    else:
        url = f"http://127.0.0.1:{port}"
    try:
        probe_chat(url, ready_timeout_s, p.alive)
    except ProcError as exc:
        raise ProcError(f"{spec.name}: {exc}\n{p.tail()}") from exc
    return StartedRouter(spec, url, p, argv)


@contextlib.contextmanager
def sigterm_as_exception() -> Iterator[None]:
    """SIGTERM raises SystemExit in the main thread, so teardown runs as for Ctrl-C."""

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    try:
        old = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


class SpecStack(contextlib.AbstractContextManager["SpecStack"]):
    """A `BeamDeployment` brought up as local processes (`LocalStack`, what `beamserve up`
    holds) for a caller without an event loop: `bench agentic --target FILE.yaml`, the tests.

    The stack's event loop runs on a thread of its own, since the replay's `asyncio.run` owns
    the calling thread. Leaving the block — normally, on an exception or on Ctrl-C — stops
    every process the stack started (`LocalStack.stop`). `ProcError` when it does not come up.
    """

    def __init__(
        self,
        spec: str | os.PathLike[str] | Any,
        state_dir: str | os.PathLike[str] | None = None,
        *,
        ready_timeout_s: float = 300.0,
    ) -> None:
        from beamserve.operator.local.stack import LocalStack

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="local-stack")
        self.stack = LocalStack(spec, state_dir, ready_timeout_s=ready_timeout_s)

    @property
    def router_url(self) -> str:
        return self.stack.router_url

    @property
    def workers(self) -> list[tuple[str, str]]:
        """(role, url) of every worker process."""
        return self.stack.workers

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def __enter__(self) -> SpecStack:
        from beamserve.operator.local.stack import StackError

        self._thread.start()
        try:
            self._call(self.stack.start())
        except StackError as exc:
            self._close()
            raise ProcError(f"the spec did not come up: {exc}") from exc
        except BaseException:
            self._close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._close()

    def _close(self) -> None:
        try:
            self._call(self.stack.stop())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)
            self._loop.close()
