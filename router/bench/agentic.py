"""`beamserve bench agentic`: routers side by side over real HTTP on the same simulated workers.

Two modes:

* self-contained (default): for every concurrency level and every router under test, start
  `--workers` fresh ``beamserve worker --engine sim --api sglang --profile P`` processes on free
  loopback ports (cold caches), the router in front of them, replay, and stop everything;
* ``--target URL [--peer NAME=URL ...]``: routers already running (workers are the user's
  business; `--workers` then only says how many stand behind them, for the per-GPU figures).
  Each (router, level) run salts its prompt texts and session ids, so a level never hits the
  cache a previous one left.

The workload (`agentic_workload`): claude-code sessions, closed loop — at most C sessions active
at once, each playing its turns in order, each turn sent once the previous answer has ended and
the turn's think time has passed. Requests: ``POST /v1/chat/completions`` with the session's
text so far as chat messages, ``max_tokens`` = the trace's output scaled and capped,
``stream: true`` with ``stream_options.include_usage``, header ``x-session-id``. Figures:
`agentic_stats`; the router's CPU time (self-started routers): utime + stime of its process
tree from ``/proc`` before and after the level, per request.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from . import agentic_goals
from .agentic_procs import (
    ROUTERS,
    BusySampler,
    ProcError,
    Procs,
    RouterSpec,
    busy_figures,
    package_version,
    router_counters,
    sigterm_as_exception,
    start_router,
    start_workers,
    worker_step_lag_s,
)
from .agentic_stats import SLO_TOK_S, SLO_TTFT_S, RequestRecord, is_token_chunk, summarize
from .agentic_workload import PromptBuilder, Session, Turn

MODEL = "beam"
# Headers and body leave in separate writes: without TCP_NODELAY, Nagle holds the body until
# the server's delayed ACK (≈ 40 ms on Linux), which would land on some requests and not others.
NODELAY = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]


@dataclass
class AgenticConfig:
    sessions: list[Session]
    block_tokens: int
    concurrency: list[int]
    routers: list[str] = field(default_factory=list)  # self-contained mode
    targets: list[tuple[str, str]] = field(default_factory=list)  # (name, url): target mode
    workers: int = 4
    profile: str = "h200-bf16-tp8"
    max_model_len: int | None = 262_144
    catch_up_s: float | None = None  # the started workers' --catch-up-s (None: theirs)
    # the started workers' --max-num-batched-tokens (None: the profile's step budget)
    max_batched_tokens: int | None = None
    request_timeout_s: float = 600.0
    slo_ttft_s: float = SLO_TTFT_S
    slo_tok_s: float = SLO_TOK_S
    logs: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # echoed into every JSON object
    # rounds per level: round k runs the routers in their order rotated by k, so that none is
    # always first or last (`agentic_goals` averages them)
    repeat: int = 1


def gpus_per_worker(profile: str) -> int:
    from beamserve.workers.sim.profiles import get_profile

    return int(get_profile(profile).gpus)


# --- one request, one level --------------------------------------------------------------------


async def send_turn(
    client: httpx.AsyncClient,
    url: str,
    session: str,
    turn: Turn,
    messages: list[dict[str, str]],
    *,
    session_header: str,
) -> RequestRecord:
    """One streamed chat request; the record says how it went (never raises for HTTP)."""
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": turn.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    rec = RequestRecord(session=session, turn=turn.index, sent=time.perf_counter(), end=0.0)
    chunks = 0
    done = False
    try:
        async with client.stream(
            "POST",
            url + "/v1/chat/completions",
            json=body,
            headers={"x-session-id": session_header},
        ) as resp:
            if resp.status_code != 200:
                rec.detail = (await resp.aread()).decode(errors="replace")[:300]
                rec.status = str(resp.status_code)
                rec.end = time.perf_counter()
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                try:
                    obj = json.loads(data)
                except json.JSONDecodeError:
                    continue
                if obj.get("error"):
                    rec.status, rec.detail = "stream", str(obj["error"])[:300]
                    break
                if is_token_chunk(obj):
                    chunks += 1
                    if rec.first_token is None:
                        rec.first_token = time.perf_counter()
                usage = obj.get("usage")
                if usage:
                    rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    rec.output_tokens = int(usage.get("completion_tokens") or 0)
                    details = usage.get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        rec.cached_tokens = int(details["cached_tokens"])
    except httpx.TimeoutException as exc:
        rec.status, rec.detail = "timeout", repr(exc)[:300]
    except httpx.ConnectError as exc:
        rec.status, rec.detail = "connect", repr(exc)[:300]
    except httpx.HTTPError as exc:
        rec.status, rec.detail = "stream", repr(exc)[:300]
    rec.end = time.perf_counter()
    if rec.ok and not done:
        rec.status = "stream"
        rec.detail = rec.detail or "the stream ended without [DONE]"
    if rec.ok and rec.output_tokens == 0:
        rec.output_tokens = chunks
    return rec


async def run_level(
    url: str,
    sessions: Sequence[Session],
    concurrency: int,
    builder: PromptBuilder,
    *,
    session_prefix: str = "",
    request_timeout_s: float = 600.0,
    on_request: Callable[[RequestRecord], None] | None = None,
) -> tuple[list[RequestRecord], float]:
    """The closed loop of the module docstring; (records, seconds from start to last answer)."""
    queue: asyncio.Queue[Session] = asyncio.Queue()
    for s in sessions:
        queue.put_nowait(s)
    records: list[RequestRecord] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=max(concurrency, 8))
    timeout = httpx.Timeout(request_timeout_s, connect=30.0)
    transport = httpx.AsyncHTTPTransport(limits=limits, socket_options=NODELAY)
    async with httpx.AsyncClient(transport=transport, timeout=timeout) as client:

        async def player() -> None:
            while True:
                try:
                    s = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                for turn in s.turns:
                    if turn.think_s > 0:
                        await asyncio.sleep(turn.think_s)
                    rec = await send_turn(
                        client,
                        url,
                        s.name,
                        turn,
                        builder.messages(s.name, turn.hash_ids),
                        session_header=session_prefix + s.name,
                    )
                    records.append(rec)
                    if on_request is not None:
                        on_request(rec)

        t0 = time.perf_counter()
        await asyncio.gather(*(player() for _ in range(max(1, concurrency))))
        t1 = time.perf_counter()
    return records, t1 - t0


# --- the whole comparison ----------------------------------------------------------------------


@dataclass
class LevelResult:
    router: str
    concurrency: int
    data: dict[str, Any]

    @property
    def skipped(self) -> str | None:
        s = self.data.get("skipped")
        return str(s) if s else None


def _versions(spec: RouterSpec | None) -> dict[str, str | None]:
    out = {"beamserve": package_version("beamserve", "beamserve")}
    if spec is not None:
        out[spec.package] = spec.version()
    return out


def run_agentic(
    cfg: AgenticConfig,
    *,
    say: Callable[[str], None] = print,
    progress: Any = None,
    on_result: Callable[[list[LevelResult]], None] | None = None,
) -> list[LevelResult]:
    """Every (level, router) run; routers that cannot run are skipped with a message.

    `progress`: a rich `Progress` (optional) that gets an overall task and one per run;
    `on_result`: called with the results so far after every run (to save partial results)."""
    gpw = gpus_per_worker(cfg.profile)
    n_requests = sum(s.requests for s in cfg.sessions)
    specs: list[RouterSpec] = []
    skipped: dict[str, str] = {}
    for name in cfg.routers:
        wanted = ROUTERS[name]
        why = wanted.unavailable()
        if why is not None:
            skipped[name] = why
            say(f"skipping {name}: {why}")
        else:
            specs.append(wanted)
    runs: list[tuple[str, RouterSpec | None, str | None]] = [(s.name, s, None) for s in specs]
    runs += [(name, None, url) for name, url in cfg.targets]
    # the first --target is the router under test, the others (--peer) its peers
    ours = {name for name, spec, _ in runs if spec is not None and spec.kind == "beamserve"}
    ours |= {cfg.targets[0][0]} if cfg.targets else set()
    rounds = max(1, cfg.repeat)
    overall = None
    if progress is not None:
        overall = progress.add_task("all runs", total=len(runs) * len(cfg.concurrency) * rounds)
    results: list[LevelResult] = []
    common = {
        "mode": "target" if cfg.targets else "self-contained",
        "workers": cfg.workers,
        "profile": cfg.profile,
        "gpus_per_worker": gpw,
        "gpus": cfg.workers * gpw,
        "sessions": len(cfg.sessions),
        "session_names": [s.name for s in cfg.sessions],
        "block_tokens": cfg.block_tokens,
        "worker_max_model_len": cfg.max_model_len,
        "worker_catch_up_s": cfg.catch_up_s,
        "worker_max_num_batched_tokens": cfg.max_batched_tokens,
        "command": " ".join(sys.argv),
        **cfg.extra,
    }
    with sigterm_as_exception():
        for level, rnd in ((c, k) for c in cfg.concurrency for k in range(rounds)):
            shift = rnd % len(runs) if runs else 0
            for name, spec, target_url in runs[shift:] + runs[:shift]:
                tag = f"{name} @ C={level}" + (f" #{rnd + 1}" if rounds > 1 else "")
                task = None
                if progress is not None:
                    task = progress.add_task(tag, total=n_requests)
                data: dict[str, Any] = {"router": name, "concurrency": level, **common}
                data |= {"side": "ours" if name in ours else "peer", "round": rnd, "rounds": rounds}
                data["versions"] = _versions(spec)
                if spec is not None:
                    data |= {"kind": spec.kind, "policy": spec.policy}
                suffix = round_suffix(rnd, rounds)
                try:
                    data |= _one_run(cfg, level, spec, target_url, progress, task, suffix)
                except ProcError as exc:
                    data["skipped"] = f"did not start: {str(exc).splitlines()[0]}"
                    say(f"[red]skipping {tag}: {exc}")
                if progress is not None and task is not None:
                    progress.remove_task(task)
                if progress is not None and overall is not None:
                    progress.advance(overall)
                results.append(LevelResult(name, level, data))
                if on_result is not None:
                    on_result(results)
    for name, why in skipped.items():
        for level in cfg.concurrency:
            results.append(
                LevelResult(
                    name,
                    level,
                    {"router": name, "concurrency": level, "skipped": why, **common},
                )
            )
    return results


def round_suffix(rnd: int, rounds: int) -> str:
    """What ends a round's logs folder (``-rK``, K from 1); nothing when a level runs once."""
    return f"-r{rnd + 1}" if rounds > 1 else ""


def _one_run(
    cfg: AgenticConfig,
    level: int,
    spec: RouterSpec | None,
    target_url: str | None,
    progress: Any,
    task: Any,
    suffix: str = "",
) -> dict[str, Any]:
    """One (router, level) run; `suffix` ends its logs' folder name (a round's ``-rK``)."""
    gpus = cfg.workers * gpus_per_worker(cfg.profile)

    def tick(_: RequestRecord) -> None:
        if progress is not None and task is not None:
            progress.advance(task)

    if target_url is not None:
        salt = f"{target_url}|c{level}|{time.time_ns()}"
        builder = PromptBuilder(cfg.block_tokens, salt=salt)
        records, dur = asyncio.run(
            run_level(
                target_url.rstrip("/"),
                cfg.sessions,
                level,
                builder,
                session_prefix=f"{time.time_ns() % 10**9}-",
                request_timeout_s=cfg.request_timeout_s,
                on_request=tick,
            )
        )
        out = _figures(records, dur, gpus, cfg)
        run = target_url.split("//")[-1].replace(":", "_").strip("/")
        _write_records(cfg, f"{run}-c{level}{suffix}", records)
        out |= {"url": target_url, "router_cpu_s": None, "router_cpu_s_per_request": None}
        return out
    assert spec is not None
    logs = cfg.logs / f"{spec.name}-c{level}{suffix}" if cfg.logs is not None else None
    with Procs(keep_logs=logs) as procs:
        workers = start_workers(
            procs,
            cfg.workers,
            cfg.profile,
            max_model_len=cfg.max_model_len,
            catch_up_s=cfg.catch_up_s,
            max_batched_tokens=cfg.max_batched_tokens,
            prefill=spec.prefill_workers(cfg.workers),
            kv_both=spec.kv_both,
        )
        router = start_router(procs, spec, workers)
        builder = PromptBuilder(cfg.block_tokens)
        cpu0 = router.cpu_seconds()
        sampler = BusySampler([w.url for w in workers]).start()
        try:
            records, dur = asyncio.run(
                run_level(
                    router.url,
                    cfg.sessions,
                    level,
                    builder,
                    request_timeout_s=cfg.request_timeout_s,
                    on_request=tick,
                )
            )
        finally:
            samples = sampler.stop()
        cpu1 = router.cpu_seconds()
        alive = router.alive()
        beam = spec.kind == "beamserve" and spec.replicas == 1  # xN: behind HAProxy
        counters = router_counters(router.url) if beam else None
        lag = sum(worker_step_lag_s(w.url) for w in workers)
    out = _figures(records, dur, gpus, cfg)
    _write_records(cfg, f"{spec.name}-c{level}{suffix}", records)
    cpu = cpu1 - cpu0
    out |= {
        "url": router.url,
        "router_command": router.argv,
        "router_cpu_s": cpu,
        "router_cpu_s_per_request": cpu / len(records) if records else None,
        "router_alive_at_end": alive,
        "router_counters": counters,
        # engine time the sim workers lost to a busy host, as a share of the run's
        # worker-seconds (`beamserve.workers.sim.engine`, "Host lateness")
        "worker_step_lag_s": lag,
        "worker_step_lag_share": lag / (dur * len(workers)) if dur > 0 and workers else None,
        # the sim engines' busy seconds, sampled over the run (`busy_figures`)
        **busy_figures(samples),
    }
    return out


def _write_records(cfg: AgenticConfig, run: str, records: list[RequestRecord]) -> None:
    """With `--logs DIR`: every request of the run, one JSON object a line, in
    ``DIR/RUN/requests.jsonl`` (times in seconds from the run's first request)."""
    if cfg.logs is None or not records:
        return
    t0 = min(r.sent for r in records)
    path = cfg.logs / run / "requests.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in records:
            row = {
                "session": r.session,
                "turn": r.turn,
                "status": r.status,
                "sent_s": round(r.sent - t0, 6),
                "ttft_s": None if r.ttft_s is None else round(r.ttft_s, 6),
                "end_s": round(r.end - t0, 6),
                "user_tok_s": r.user_tok_s,
                "prompt_tokens": r.prompt_tokens,
                "cached_tokens": r.cached_tokens,
                "output_tokens": r.output_tokens,
            }
            f.write(json.dumps(row) + "\n")


def _figures(
    records: list[RequestRecord], dur: float, gpus: int, cfg: AgenticConfig
) -> dict[str, Any]:
    stats = summarize(
        records, gpus=gpus, duration_s=dur, slo_ttft_s=cfg.slo_ttft_s, slo_tok_s=cfg.slo_tok_s
    )
    out = stats.to_json()
    out["last_session"] = last_session(records)
    samples = [f"{r.status}: {r.detail}" for r in records if not r.ok][:3]
    if samples:
        out["error_samples"] = samples
    return out


def last_session(records: Sequence[RequestRecord]) -> dict[str, Any] | None:
    """What ends a closed-loop run: the session whose last request ended last — its name, its
    first send and its span (seconds from the run's first send), and when every other session
    was done. At low concurrency a run's length, and so its throughput, is mostly that one
    session's start and its own span."""
    if not records:
        return None
    t0 = min(r.sent for r in records)
    spans: dict[str, list[float]] = {}
    for r in records:
        span = spans.setdefault(r.session, [r.sent, r.end])
        span[0], span[1] = min(span[0], r.sent), max(span[1], r.end)
    name, (start, end) = max(spans.items(), key=lambda kv: (kv[1][1], kv[0]))
    others = [e for k, (_s, e) in spans.items() if k != name]
    return {
        "session": name,
        "start_s": round(start - t0, 3),
        "span_s": round(end - start, 3),
        "others_done_s": round(max(others) - t0, 3) if others else None,
    }


# --- output ------------------------------------------------------------------------------------


def _f(x: Any, fmt: str) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return format(x, fmt)


def tables(results: Sequence[LevelResult], title: str) -> list[Any]:
    """One rich table per concurrency level (a row per run), then the goals table
    (`agentic_goals`) when the results hold our routers and peers side by side."""
    from rich.table import Table

    out = []
    for level in sorted({r.concurrency for r in results}):
        t = Table(title=f"{title} — concurrency {level}")
        width = max((len(r.router) for r in results), default=6)
        t.add_column("router", no_wrap=True, min_width=width)
        for c in ("ok/req", "errors", "tok/s/GPU", "out/s/GPU", "TTFT p50", "p90", "p99",
                  "user tok/s p50", "p90", "hit", "goodput/s", "CPU ms/req", "busy"):  # fmt: skip
            t.add_column(c, justify="right")
        for r in results:
            if r.concurrency != level:
                continue
            d = r.data
            if r.skipped:
                t.add_row(_label(r), "skipped", r.skipped[:60], *[""] * 11)
                continue
            t.add_row(*_cells(_label(r), d))
        out.append(t)
    rows = agentic_goals.goals(r.data for r in results)
    if rows:
        out.append(agentic_goals.table(rows, f"{title} — against the best peer"))
    return out


def _label(r: LevelResult) -> str:
    """The router's name, and its round when the level ran several (``name #2``)."""
    if int(r.data.get("rounds", 1) or 1) > 1:
        return f"{r.router} #{int(r.data.get('round', 0)) + 1}"
    return r.router


def write_json(results: Sequence[LevelResult], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([r.data for r in results], indent=2) + "\n")


def plot(results: Sequence[LevelResult], path: Path, title: str) -> None:
    """Output tok/s per GPU (y) against per-user tok/s p50 (x), one curve per router, points
    labelled by concurrency (a level's rounds averaged)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    for name in dict.fromkeys(r.router for r in results):
        by_level: dict[int, list[tuple[float, float]]] = {}
        for r in results:
            if r.router == name and not r.skipped and r.data.get("user_tok_s_p50") is not None:
                xy = (r.data["user_tok_s_p50"], r.data["output_tok_s_per_gpu"])
                by_level.setdefault(r.concurrency, []).append(xy)
        pts = [
            (c, sum(x for x, _ in v) / len(v), sum(y for _, y in v) / len(v))
            for c, v in sorted(by_level.items())
        ]
        if not pts:
            continue
        ax.plot([p[1] for p in pts], [p[2] for p in pts], marker="o", label=name)
        for c, x, y in pts:
            ax.annotate(f"C={c}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel("per-user output tok/s (p50)")
    ax.set_ylabel("output tok/s per GPU")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_busy(results: Sequence[LevelResult], path: Path, title: str) -> bool:
    """The workers' busy share over each run (`worker_busy_timeline`, the mean of the pool's
    workers per interval), one panel per concurrency level, one curve per router; False (and
    no file) when no run recorded one (peers' engines, `--target`)."""
    rows = [r for r in results if not r.skipped and r.data.get("worker_busy_timeline")]
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = sorted({r.concurrency for r in rows})
    fig, axes = plt.subplots(len(levels), 1, figsize=(8, 3.2 * len(levels)), squeeze=False)
    for ax, level in zip(axes[:, 0], levels, strict=True):
        for r in rows:
            if r.concurrency != level:
                continue
            tl = r.data["worker_busy_timeline"]
            mean = [sum(b) / len(b) for b in tl["busy"]]
            share = r.data["worker_busy_share"]
            ax.plot(tl["t"], mean, label=f"{r.router} (busy {share:.3f})", lw=1.2)
        ax.set_title(f"{title} — concurrency {level}", fontsize=9)
        ax.set_xlabel("seconds into the run")
        ax.set_ylabel("workers busy (mean share)")
        ax.set_ylim(0, 1.05)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="lower left")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def markdown(results: Sequence[LevelResult]) -> str:
    """The tables as Markdown, one per concurrency level (for docs/bench/agentic.md)."""
    head = ("router", "ok/req", "errors", "tok/s/GPU", "out tok/s/GPU", "TTFT p50 s", "p90",
            "p99", "user tok/s p50", "p90", "hit", "goodput r/s", "router CPU ms/req",
            "workers busy")  # fmt: skip
    lines: list[str] = []
    for level in sorted({r.concurrency for r in results}):
        lines += [f"**Concurrency {level}**", "", "| " + " | ".join(head) + " |",
                  "|" + "---|" * len(head)]  # fmt: skip
        for r in results:
            if r.concurrency != level:
                continue
            d = r.data
            if r.skipped:
                lines.append(f"| {_label(r)} | skipped: {r.skipped} |" + " |" * (len(head) - 2))
                continue
            lines.append("| " + " | ".join(_cells(_label(r), d)) + " |")
        lines.append("")
    rows = agentic_goals.goals(r.data for r in results)
    if rows:
        lines += ["**Against the best peer**", "", agentic_goals.markdown(rows)]
    return "\n".join(lines)


def read_json(path: Path) -> list[LevelResult]:
    """Results written by `write_json`."""
    rows = json.loads(path.read_text())
    return [LevelResult(str(d["router"]), int(d["concurrency"]), d) for d in rows]


def _cells(router: str, d: dict[str, Any]) -> list[str]:
    """One result row, as the table and the Markdown print it."""
    errs = ", ".join(f"{k}×{v}" for k, v in d["errors"].items()) or "0"
    cpu = d.get("router_cpu_s_per_request")
    return [
        router,
        f"{d['ok']}/{d['requests']}",
        errs,
        _f(d["total_tok_s_per_gpu"], ",.0f"),
        _f(d["output_tok_s_per_gpu"], ",.1f"),
        _f(d["ttft_p50_s"], ".3f"),
        _f(d["ttft_p90_s"], ".3f"),
        _f(d["ttft_p99_s"], ".3f"),
        _f(d["user_tok_s_p50"], ".1f"),
        _f(d["user_tok_s_p90"], ".1f"),
        _f(d["cache_hit_ratio"], ".3f"),
        _f(d["goodput_rps"], ".3f"),
        _f(cpu * 1e3 if cpu is not None else None, ".1f"),
        _f(d.get("worker_busy_share"), ".3f"),
    ]
