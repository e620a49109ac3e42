"""`beamserve bench route` and `beamserve bench route-overhead`: parsers and entry points.

Importing this module is cheap (argparse only); the simulator and the router load when a
command runs. `beamserve.cli` hooks them in::

    router_bench.add_bench_route(bsub); router_bench.add_bench_route_overhead(bsub)
    ... route_main(args, console) / route_overhead_main(args, console)
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .agentic_cli import (  # `bench agentic` / `bench wire-overhead` (argparse only)
    add_bench_agentic,
    add_bench_wire_overhead,
    agentic_main,
    wire_overhead_main,
)

if TYPE_CHECKING:
    from rich.console import Console

__all__ = [
    "add_bench_agentic",
    "add_bench_route",
    "add_bench_route_overhead",
    "add_bench_wire_overhead",
    "agentic_main",
    "route_main",
    "route_overhead_main",
    "wire_overhead_main",
]

DEFAULT_POLICIES = "round-robin,least-load,prefix-only,beamserve,oracle"


def _positive(value: str) -> float:
    x = float(value)
    if not x > 0:
        raise argparse.ArgumentTypeError(f"{value}: must be a positive number")
    return x


def add_bench_route(bench_sub: Any) -> argparse.ArgumentParser:
    """Add `route` to the `bench` subparsers."""
    p: argparse.ArgumentParser = bench_sub.add_parser(
        "route",
        help="replay agentic traces through the real router on simulated engines",
        description="In-process replay (sim engines on a virtual clock, the real router code) "
        "of a claude-code session directory (closed loop) or a Mooncake .jsonl (open loop), "
        "one run per policy. JSON: one object per policy (policy, load, hit_ratio, "
        "block_hit_unbounded, throughput_tok_s, capacity_tok_s, ttft_p50_s/p90/p99, "
        "max_mean_load, sessions_split, shed_rate, continuing_ttft_p99_s, "
        "first_turn_ttft_p99_s, ...).",
    )
    p.add_argument("--trace", type=Path, required=True, metavar="PATH")
    p.add_argument("--workers", type=int, default=8, metavar="N")
    p.add_argument("--policies", default=DEFAULT_POLICIES, metavar="LIST")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--load", type=_positive, default=None, metavar="X")
    mode.add_argument("--capacity", action="store_true")
    mode.add_argument("--overload", type=_positive, default=None, metavar="X")
    p.add_argument("--slo-ttft-p90", type=_positive, default=2.0, metavar="S")
    p.add_argument("--assignments", type=Path, default=None, metavar="PATH")
    p.add_argument("--json", type=Path, default=None, metavar="PATH")
    p.add_argument(
        "--plot", type=Path, default=None, metavar="PATH", help="PNG (default: next to --json)"
    )
    p.add_argument("--profile", default="h200-bf16-tp8", help="sim profile of every worker")
    p.add_argument("--sessions", type=int, default=None, metavar="N", help="first N session files")
    p.add_argument("--requests", type=int, default=None, metavar="N", help="first N requests")
    p.add_argument("--kv-event-lag-s", type=float, default=0.01, metavar="S")
    p.add_argument("--no-flow", action="store_true", help="dispatch without flow control")
    p.add_argument(
        "--router-replicas",
        type=_replica_counts,
        default=(1,),
        metavar="N[,N...]",
        help="replay through N independent router replicas (requests spread at random, one "
        "shared session store), once per N; with 1 and more: goals of N against 1",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the replica draw")
    p.add_argument(
        "--scrape-interval-s",
        type=_positive,
        default=0.5,
        metavar="S",
        help="engine metrics scrape period of every router replica (virtual seconds)",
    )
    p.add_argument(
        "--own-book-only",
        action="store_true",
        help="replicas route on their own in-flight book only, ignoring what the scrapes say "
        "about the other replicas' work (the behaviour before effective load; for comparison)",
    )
    p.add_argument(
        "--herd",
        action="store_true",
        help="replicas extrapolate the other replicas' load between scrapes from their own "
        "changes (the herd term of router/load.py; off by default, as measured in "
        "docs/bench/route.md)",
    )
    p.add_argument(
        "--no-replica-sync",
        action="store_true",
        help="with N > 1 replicas: no replica sync (router/sync.py) — each replica learns the "
        "others' bookings from scrapes and their prefixes from the engines' KV events only",
    )
    p.add_argument(
        "--sync-lag-s",
        type=float,
        default=0.002,
        metavar="S",
        help="replica sync: delay from one replica's publish to the others' receipt (virtual "
        "seconds; default 2 ms, a LAN Redis)",
    )
    return p


def _replica_counts(value: str) -> tuple[int, ...]:
    try:
        ns = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        ns = ()
    if not ns or any(n < 1 for n in ns):
        raise argparse.ArgumentTypeError(f"{value}: give replica counts ≥ 1, e.g. 1,4")
    return ns


def add_bench_route_overhead(bench_sub: Any) -> argparse.ArgumentParser:
    """Add `route-overhead` to the `bench` subparsers."""
    p: argparse.ArgumentParser = bench_sub.add_parser(
        "route-overhead",
        help="routing decision latency (128K-token prompts, 64 workers) and index memory",
        description="Decision latency p50/p99 of the real RoutingCore for 128K-token prompts "
        "with 64 workers and a warm index (hashing reported separately), decisions per second, "
        "and the index's memory per million blocks. Goals: p99 <= 2 ms; <= 128 MB.",
    )
    p.add_argument("--json", type=Path, default=None, metavar="PATH")
    p.add_argument("--policy", default="beamserve")
    p.add_argument("--decisions", type=int, default=2000)
    p.add_argument("--memory-blocks", type=int, default=500_000)
    return p


def route_main(args: argparse.Namespace, console: Console) -> int:
    from dataclasses import replace

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from . import report
    from .capacity import Probe, search_capacity
    from .replay import ORACLE, POLICIES, PolicyRun, ReplayConfig, ReplayError, replay
    from .traces import TraceError, load_trace

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        console.print(f"[red]unknown policy {unknown[0]!r}; valid: {', '.join(POLICIES)}")
        return 2
    try:
        trace = load_trace(args.trace, sessions=args.sessions, requests=args.requests)
        config = ReplayConfig(
            workers=args.workers,
            profile=args.profile,
            kv_event_lag_s=args.kv_event_lag_s,
            flow=not args.no_flow,
            seed=args.seed,
            combine_scrape=not args.own_book_only,
            herd=args.herd,
            scrape_interval_s=args.scrape_interval_s,
            replica_sync=not args.no_replica_sync,
            sync_lag_s=args.sync_lag_s,
        )
    except (TraceError, ReplayError) as exc:
        console.print(f"[red]{exc}")
        return 2
    n_requests = len(trace.all_requests)
    load = args.load if args.load is not None else 1.0
    results: list[report.RouteResult] = []
    runs: list[PolicyRun] = []
    curves: dict[str, list[tuple[float, float]]] = {}
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=True) as progress:

        def run_once(policy: str, at: float, replicas: int = 1) -> PolicyRun:
            label = f"{policy} ×{replicas}" if replicas > 1 else policy
            task = progress.add_task(f"{label} @ load {at:.3g}", total=n_requests)
            done = lambda n: progress.update(task, completed=n) if n % 25 == 0 else None  # noqa: E731
            cfg = replace(config, router_replicas=replicas)
            run = replay(trace, policy, at, cfg, on_request_done=done)
            progress.remove_task(task)
            curves.setdefault(label, []).append(
                (at, report.summarize(run).ttft_p90_s or float("nan"))
            )
            return run

        for policy in policies:
            if policy == ORACLE:
                results.append(report.oracle_result(trace, load, args.workers))
                continue
            if not (args.capacity or args.overload):
                for n in args.router_replicas:
                    run = run_once(policy, load, n)
                    runs.append(run)
                    results.append(report.summarize(run))
                continue

            def probe(at: float, policy: str = policy) -> Probe[PolicyRun]:
                run = run_once(policy, at)
                s = report.summarize(run)
                return Probe(at, s.ttft_p90_s or float("nan"), s.shed_rate or 0.0, run)

            found = search_capacity(probe, args.slo_ttft_p90)
            cap_result = report.summarize(found.best.result) if found.best is not None else None
            if args.overload and found.load > 0:
                run = run_once(policy, found.load * args.overload)
            elif found.best is not None:
                run = found.best.result
            else:
                run = found.probes[-1].result
            runs.append(run)
            results.append(
                report.with_capacity(report.summarize(run), cap_result, found.load, found.bounded)
            )
    mode = (
        f"overload {args.overload:g}× capacity"
        if args.overload
        else f"capacity (TTFT p90 ≤ {args.slo_ttft_p90:g} s)"
        if args.capacity
        else f"load {load:g}"
    )
    console.print(
        report.results_table(
            f"beamserve bench route — {trace.name}, {args.workers} workers, {args.profile}, {mode}",
            results,
        )
    )
    goals = report.replica_goals(results, open_loop=trace.kind == "open")
    if goals:
        console.print(report.goals_table("router replicas: N against 1", goals))
    if args.assignments is not None:
        n = report.write_assignments(runs, args.assignments)
        console.print(f"wrote {n} assignments to {args.assignments}")
    if args.json is not None:
        report.write_json(results, args.json)
        console.print(f"wrote {args.json}")
        plot_path = args.plot or args.json.with_suffix(".png")
        report.plot(curves, results, plot_path, slo_s=args.slo_ttft_p90)
        console.print(f"wrote {plot_path}")
    elif args.plot is not None:
        report.plot(curves, results, args.plot, slo_s=args.slo_ttft_p90)
    return 0


def route_overhead_main(args: argparse.Namespace, console: Console) -> int:
    import json

    from rich.table import Table

    from .overhead import DECISION_P99_GOAL_MS, INDEX_MB_GOAL, measure_overhead

    with console.status("measuring routing decisions (64 workers, 128K-token prompts)"):
        r = measure_overhead(
            policy=args.policy, decisions=args.decisions, memory_blocks=args.memory_blocks
        )
    table = Table(title="beamserve bench route-overhead")
    for c in ("metric", "value", "goal"):
        table.add_column(c, justify="right")
    p99_ok = r.decision_p99_ms <= DECISION_P99_GOAL_MS
    table.add_row("decision p50 ms", f"{r.decision_p50_ms:.3f}", "")
    table.add_row(
        "decision p99 ms",
        f"{r.decision_p99_ms:.3f}",
        f"≤ {DECISION_P99_GOAL_MS} ({'met' if p99_ok else 'MISSED'})",
    )
    table.add_row("decision p99 ms (thread CPU time)", f"{r.decision_cpu_p99_ms:.3f}", "")
    table.add_row("dispatch p99 ms", f"{r.dispatch_p99_ms:.3f}", "")
    table.add_row("hashing ms (128K tokens)", f"{r.hashing_ms:.2f}", "")
    table.add_row("decisions/s", f"{r.decisions_per_s:,.0f}", "")
    ok = r.index_mb_per_million_blocks <= INDEX_MB_GOAL
    table.add_row(
        "index MB / M blocks",
        f"{r.index_mb_per_million_blocks:.1f}",
        f"≤ {INDEX_MB_GOAL:g} ({'met' if ok else 'MISSED'})",
    )
    console.print(table)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(r.to_json(), indent=2) + "\n")
        console.print(f"wrote {args.json}")
    return 0 if r.goals_met else 1
