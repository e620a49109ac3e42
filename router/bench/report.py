"""Results of `beamserve bench route`: per-policy metrics, the table, JSON and a plot.

`summarize(run)` turns a `PolicyRun` into a `RouteResult` (one JSON object per policy);
`oracle_result(trace, load)` gives the `oracle` row. Metric definitions (served = admitted and
finished; shed requests count only in `shed_rate`):

| field | definition |
|---|---|
| `hit_ratio` | Σ prompt tokens served from the sim's bounded prefix caches / Σ prompt tokens |
| `block_hit_unbounded` | the run's assignments against unlimited per-worker caches (`oracle`) |
| `oracle_block_hit` | one shared unlimited cache over the trace (`oracle`) |
| `throughput_tok_s` | Σ (prompt + output) tokens served / (last completion − first arrival) |
| `capacity_tok_s` | `throughput_tok_s` at the capacity load (`--capacity`, `--overload`) |
| `ttft_p50_s` … | TTFT from router arrival (flow-control queueing included), served requests |
| `max_mean_load` | max over mean of prompt tokens served per worker |
| `sessions_split` | sessions whose served turns went to more than one worker |
| `sessions_split_unsaturated` | … with a move whose reason was not `rebalance` (saturation) |
| `shed_rate` | shed / submitted requests |
| `continuing_ttft_p99_s` | TTFT p99 of turns ≥ 2 of a session (band `continuing`) |
| `first_turn_ttft_p99_s` | TTFT p99 of first turns (band `new`) |
| `partial_hit_rate` | decisions whose expected hit was partial (window tail evicted) |
| `window_recompute_ratio` | tokens recomputed to rebuild an evicted window / Σ prompt |
| `router_replicas` | independent router replicas the requests were spread over |
| `sync_messages_per_request` | replica-sync messages published per request (N > 1, sync on) |
| `sync_bytes_per_request` | … their encoded bytes per request |

`replica_goals(results)` checks several replicas against one (`--router-replicas 1,4`), per
policy: block hit ∞ ≥ 0.99 × one replica's, TTFT p90 ≤ 1.1 × one replica's, no session split
while its worker was unsaturated, and (open-loop traces) max/mean load ≤ 1.15.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from beamserve.workers.sim.request import percentile

from .oracle import block_hit_unbounded, oracle_hits
from .replay import ORACLE, PolicyRun, RequestRecord
from .traces import Trace


@dataclass(frozen=True)
class RouteResult:
    """One policy's row (JSON object); see the module docstring. None: not applicable."""

    policy: str
    trace: str
    workers: int
    load: float
    requests: int
    served: int
    hit_ratio: float | None
    block_hit_unbounded: float
    oracle_block_hit: float
    throughput_tok_s: float | None
    capacity_tok_s: float | None
    capacity_load: float | None
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    max_mean_load: float | None
    sessions: int
    sessions_split: int | None
    sessions_split_unsaturated: int | None
    shed_rate: float | None
    continuing_ttft_p99_s: float | None
    first_turn_ttft_p99_s: float | None
    partial_hit_rate: float | None
    window_recompute_ratio: float | None
    sim_s: float | None
    wall_s: float | None
    capacity_continuing_ttft_p99_s: float | None = None
    capacity_bounded: bool | None = None
    router_replicas: int = 1
    sync_messages_per_request: float | None = None
    sync_bytes_per_request: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: _clean(v) for k, v in asdict(self).items()}


def _clean(v: Any) -> Any:
    if isinstance(v, float):
        return None if math.isnan(v) or math.isinf(v) else round(v, 6)
    return v


def _p(values: Sequence[float], q: float) -> float | None:
    return percentile(values, q) if values else None


def summarize(run: PolicyRun) -> RouteResult:
    """The metrics of one replay."""
    records = run.records
    served = [r for r in records if r.served]
    ttfts = [t for r in served if (t := r.ttft_s) is not None]
    cont = [t for r in served if r.band == "continuing" and (t := r.ttft_s) is not None]
    first = [t for r in served if r.band == "new" and (t := r.ttft_s) is not None]
    prompt = sum(r.request.prompt_tokens for r in served)
    per_worker: dict[str, int] = dict.fromkeys(run.workers, 0)
    for r in served:
        if r.worker is not None:
            per_worker[r.worker] += r.request.prompt_tokens
    mean = sum(per_worker.values()) / len(per_worker) if per_worker else 0.0
    tokens = sum(r.request.prompt_tokens + r.output_tokens for r in served)
    split, split_unsat = sessions_split(records)
    dispatched = sorted((r for r in records if r.worker is not None), key=lambda r: r.dispatch_seq)
    return RouteResult(
        policy=run.policy,
        trace=run.trace.name,
        workers=len(run.workers),
        load=run.load,
        requests=len(records),
        served=len(served),
        hit_ratio=sum(r.cached_tokens for r in served) / prompt if prompt else 0.0,
        block_hit_unbounded=block_hit_unbounded(
            (r.request.trace_blocks, r.worker) for r in dispatched
        ).ratio,
        oracle_block_hit=oracle_hits(t.trace_blocks for t in run.trace.all_requests).ratio,
        throughput_tok_s=tokens / run.sim_s if run.sim_s > 0 else 0.0,
        capacity_tok_s=None,
        capacity_load=None,
        ttft_p50_s=_p(ttfts, 50),
        ttft_p90_s=_p(ttfts, 90),
        ttft_p99_s=_p(ttfts, 99),
        max_mean_load=max(per_worker.values()) / mean if mean > 0 else None,
        sessions=len({r.request.session for r in records if r.request.session is not None}),
        sessions_split=split,
        sessions_split_unsaturated=split_unsat,
        shed_rate=sum(r.shed for r in records) / len(records) if records else 0.0,
        continuing_ttft_p99_s=_p(cont, 99),
        first_turn_ttft_p99_s=_p(first, 99),
        partial_hit_rate=(
            sum(r.hit_kind == "partial" for r in dispatched) / len(dispatched)
            if dispatched
            else 0.0
        ),
        window_recompute_ratio=(
            sum(r.window_recompute_tokens for r in served) / prompt if prompt else 0.0
        ),
        sim_s=run.sim_s,
        wall_s=run.wall_s,
        router_replicas=run.router_replicas,
        sync_messages_per_request=run.sync_messages / len(records) if run.sync_messages else None,
        sync_bytes_per_request=run.sync_bytes / len(records) if run.sync_messages else None,
    )


def sessions_split(records: Iterable[RequestRecord]) -> tuple[int, int]:
    """(sessions served by more than one worker, those with a move not caused by saturation).

    A move is a turn sent to a worker other than the session's previous turn's; it counts as
    caused by saturation when the policy said so (decision reason ``rebalance``)."""
    workers: dict[str, set[str]] = defaultdict(set)
    last: dict[str, str] = {}
    unsat: set[str] = set()
    for r in sorted(
        (r for r in records if r.worker is not None and r.request.session is not None),
        key=lambda r: r.dispatch_seq,
    ):
        s, w = r.request.session, r.worker
        assert s is not None and w is not None
        workers[s].add(w)
        if s in last and last[s] != w and r.reason != "rebalance":
            unsat.add(s)
        last[s] = w
    return sum(len(ws) > 1 for ws in workers.values()), len(unsat)


def oracle_result(trace: Trace, load: float, workers: int) -> RouteResult:
    """The `oracle` row: its hit (shared unlimited cache); timing fields are None (the oracle
    is a bound on hits, not a router that can be replayed)."""
    hit = oracle_hits(r.trace_blocks for r in trace.all_requests).ratio
    return RouteResult(
        policy=ORACLE,
        trace=trace.name,
        workers=workers,
        load=load,
        requests=len(trace.all_requests),
        served=len(trace.all_requests),
        hit_ratio=None,
        block_hit_unbounded=hit,
        oracle_block_hit=hit,
        throughput_tok_s=None,
        capacity_tok_s=None,
        capacity_load=None,
        ttft_p50_s=None,
        ttft_p90_s=None,
        ttft_p99_s=None,
        max_mean_load=None,
        sessions=len({r.session for r in trace.all_requests if r.session is not None}),
        sessions_split=None,
        sessions_split_unsaturated=None,
        shed_rate=None,
        continuing_ttft_p99_s=None,
        first_turn_ttft_p99_s=None,
        partial_hit_rate=None,
        window_recompute_ratio=None,
        sim_s=None,
        wall_s=None,
    )


def with_capacity(
    result: RouteResult,
    capacity: RouteResult | None,
    capacity_load: float,
    bounded: bool,
) -> RouteResult:
    """`result` with the capacity fields filled from the run at the capacity load."""
    return replace(
        result,
        capacity_tok_s=capacity.throughput_tok_s if capacity is not None else 0.0,
        capacity_load=capacity_load,
        capacity_continuing_ttft_p99_s=(
            capacity.continuing_ttft_p99_s if capacity is not None else None
        ),
        capacity_bounded=bounded,
    )


def write_json(results: Sequence[RouteResult], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([r.to_json() for r in results], indent=2) + "\n")


def write_assignments(runs: Iterable[PolicyRun], path: Path) -> int:
    """One JSON line per dispatched request: ``{policy, load, request, session, turn, line,
    worker, reason}`` (``line``: 1-based Mooncake line, None for sessions). Returns lines."""
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with path.open("w") as fh:
        for run in runs:
            for r in sorted(
                (r for r in run.records if r.worker is not None), key=lambda r: r.dispatch_seq
            ):
                req = r.request
                line = int(req.key.rsplit(":", 1)[1]) if run.trace.kind == "open" else None
                row = {
                    "policy": run.policy,
                    "load": run.load,
                    "request": req.key,
                    "session": req.session,
                    "turn": req.turn,
                    "line": line,
                    "worker": r.worker,
                    "reason": r.reason,
                }
                fh.write(json.dumps(row) + "\n")
                n += 1
    return n


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def results_table(title: str, results: Sequence[RouteResult]) -> Any:
    from rich.table import Table

    table = Table(title=title)
    cols: tuple[str, ...] = (
        "policy",
        "routers",
        "load",
        "hit",
        "block hit ∞",
        "tok/s",
        "capacity tok/s",
        "TTFT p50",
        "p90",
        "p99",
        "cont. p99",
        "first p99",
        "max/mean",
        "split",
        "shed",
        "partial",
    )
    synced = any(r.sync_bytes_per_request is not None for r in results)
    if synced:
        cols += ("sync msg/req", "sync KiB/req")
    for c in cols:
        table.add_column(c, justify="left" if c == "policy" else "right")
    for r in results:
        table.add_row(
            r.policy,
            str(r.router_replicas),
            f"{r.load:.3g}",
            _fmt(r.hit_ratio, ".3f"),
            f"{r.block_hit_unbounded:.3f}",
            _fmt(r.throughput_tok_s, ",.0f"),
            _fmt(r.capacity_tok_s, ",.0f"),
            _fmt(r.ttft_p50_s, ".3f"),
            _fmt(r.ttft_p90_s, ".3f"),
            _fmt(r.ttft_p99_s, ".3f"),
            _fmt(r.continuing_ttft_p99_s, ".3f"),
            _fmt(r.first_turn_ttft_p99_s, ".3f"),
            _fmt(r.max_mean_load, ".2f"),
            "-"
            if r.sessions_split is None
            else f"{r.sessions_split}/{r.sessions} ({r.sessions_split_unsaturated})",
            _fmt(r.shed_rate, ".1%"),
            _fmt(r.partial_hit_rate, ".1%"),
            *(
                (
                    _fmt(r.sync_messages_per_request, ".1f"),
                    _fmt(r.sync_bytes_per_request and r.sync_bytes_per_request / 1024, ".2f"),
                )
                if synced
                else ()
            ),
        )
    return table


MAX_MEAN_GOAL = 1.15


@dataclass(frozen=True)
class ReplicaGoal:
    """One goal of several replicas against one (`replica_goals`)."""

    policy: str
    router_replicas: int
    goal: str
    value: str
    met: bool


def replica_goals(results: Sequence[RouteResult], open_loop: bool) -> list[ReplicaGoal]:
    """For every policy replayed with one replica and with more: the goals of the module
    docstring (max/mean only for `open_loop` traces, where it is the issue's goal)."""
    single = {r.policy: r for r in results if r.router_replicas == 1}
    out: list[ReplicaGoal] = []
    for r in results:
        base = single.get(r.policy)
        if r.router_replicas == 1 or base is None:
            continue
        n = r.router_replicas
        hit, hit1 = r.block_hit_unbounded, base.block_hit_unbounded
        out.append(
            ReplicaGoal(
                r.policy,
                n,
                "block hit ∞ ≥ 0.99 × 1 replica's",
                f"{hit:.3f} vs {hit1:.3f} ({hit / hit1 if hit1 else math.nan:.3f} ×)",
                hit >= 0.99 * hit1,
            )
        )
        p90, p90_1 = r.ttft_p90_s, base.ttft_p90_s
        if p90 is not None and p90_1 is not None:
            out.append(
                ReplicaGoal(
                    r.policy,
                    n,
                    "TTFT p90 ≤ 1.1 × 1 replica's",
                    f"{p90:.3f} s vs {p90_1:.3f} s ({p90 / p90_1 if p90_1 else math.nan:.2f} ×)",
                    p90 <= 1.1 * p90_1,
                )
            )
        if r.sessions_split_unsaturated is not None:
            out.append(
                ReplicaGoal(
                    r.policy,
                    n,
                    "no session split while its worker is unsaturated",
                    f"{r.sessions_split_unsaturated} of {r.sessions} "
                    f"({r.sessions_split} split in all)",
                    r.sessions_split_unsaturated == 0,
                )
            )
        if open_loop and r.max_mean_load is not None:
            out.append(
                ReplicaGoal(
                    r.policy,
                    n,
                    f"max/mean load ≤ {MAX_MEAN_GOAL}",
                    f"{r.max_mean_load:.3f} (1 replica: {_fmt(base.max_mean_load, '.3f')})",
                    r.max_mean_load <= MAX_MEAN_GOAL,
                )
            )
    return out


def goals_table(title: str, goals: Sequence[ReplicaGoal]) -> Any:
    from rich.table import Table

    table = Table(title=title)
    for c in ("policy", "routers", "goal", "result", ""):
        table.add_column(c, justify="left")
    for g in goals:
        table.add_row(
            g.policy,
            str(g.router_replicas),
            g.goal,
            g.value,
            "[green]met" if g.met else "[red]MISSED",
        )
    return table


def plot(
    curves: Mapping[str, Sequence[tuple[float, float]]],
    results: Sequence[RouteResult],
    path: Path,
    *,
    slo_s: float | None = None,
) -> None:
    """PNG: TTFT p90 vs load per policy (`curves`: policy → [(load, ttft_p90)]) when there are
    several loads, beside block hit (unbounded) per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for policy, points in curves.items():
        pts = sorted(p for p in points if not math.isnan(p[1]))
        if pts:
            ax1.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=policy)
    if slo_s is not None:
        ax1.axhline(slo_s, color="grey", linestyle="--", label=f"SLO {slo_s:g} s")
    ax1.set_xscale("log")
    ax1.set_yscale("log")
    ax1.set_xlabel("load (× trace pace)")
    ax1.set_ylabel("TTFT p90 (s)")
    ax1.set_title("TTFT p90 vs load")
    ax1.legend(fontsize=8)
    names = [r.policy for r in results]
    ax2.bar(names, [r.block_hit_unbounded for r in results], color="tab:blue", label="unbounded")
    ax2.bar(
        names,
        [r.hit_ratio or 0.0 for r in results],
        color="tab:orange",
        alpha=0.6,
        width=0.5,
        label="sim (bounded, tokens)",
    )
    ax2.set_ylim(0, 1)
    ax2.set_ylabel("hit ratio")
    ax2.set_title("prefix hits")
    ax2.legend(fontsize=8)
    fig.suptitle(results[0].trace if results else "")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
