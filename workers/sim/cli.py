"""`beamserve bench sim-fidelity`: parser and entry point (kept here; `beamserve.cli` hooks it in).

Importing this module is cheap (argparse only); the simulator loads when the command runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from beamserve.workers.sim.fidelity import FidelityReport
    from rich.console import Console


def add_sim_fidelity(bench_sub: Any) -> argparse.ArgumentParser:
    """Add `sim-fidelity` to the `bench` subparsers."""
    p: argparse.ArgumentParser = bench_sub.add_parser(
        "sim-fidelity",
        help="replay the published Beam scenarios through the simulator; compare",
        description="Replays the published Beam scenarios (OpenHands at 32 sessions, AgentX at "
        "1 and 96 sessions; 4 × GB300, TP4, NVFP4, DFlash2 block 8) through the simulated "
        "engine on a virtual clock and prints each published figure beside the simulated one. "
        "Goals: every ratio within 0.85-1.15; simulator speed >= 200x real time. Exit status "
        "1 when a ratio misses its goal (the speed depends on the machine and is reported). "
        "JSON: a list of {name, published, simulated, ratio, unit, scenario}, then an entry "
        "named sim_speedup (simulated seconds per wall second; published and ratio null).",
    )
    p.add_argument(
        "--json",
        type=Path,
        default=None,
        metavar="PATH",
        help="also write the results as JSON to PATH",
    )
    return p


def sim_fidelity_main(args: argparse.Namespace, console: Console) -> int:
    from beamserve.workers.sim import fidelity

    with console.status("replaying the published scenarios on the virtual clock") as status:

        def progress(run: fidelity.ScenarioRun) -> None:
            status.update(
                f"{run.name}: {run.sim_seconds:,.0f} simulated s in {run.wall_seconds:.2f} s"
            )

        report = fidelity.run_fidelity(on_scenario=progress)
    console.print(_points_table(report))
    console.print(_runs_table(report))
    lo, hi = fidelity.RATIO_GOAL
    console.print(f"goal every ratio within {lo}-{hi}: {'met' if report.ratios_met else 'MISSED'}")
    console.print(
        f"goal speed >= {fidelity.SPEEDUP_GOAL:.0f}x: {report.sim_speedup:,.0f}x "
        f"({report.sim_seconds:,.0f} simulated s in {report.wall_seconds:.2f} s) "
        f"({'met' if report.speed_met else 'MISSED'})"
    )
    if args.json is not None:
        fidelity.write_json(report, args.json)
        console.print(f"wrote {args.json}")
    return 0 if report.ratios_met else 1


def _points_table(report: FidelityReport) -> Any:
    from beamserve.workers.sim.fidelity import RATIO_GOAL
    from rich.table import Table

    table = Table(title=f"beamserve bench sim-fidelity ({report.profile})")
    table.add_column("published point")
    table.add_column("scenario")
    for col in ("published", "simulated", "unit", "ratio", "goal"):
        table.add_column(col, justify="right")
    for r in report.rows:
        table.add_row(
            r.name,
            r.scenario,
            _num(r.published),
            _num(r.simulated),
            r.unit,
            f"{r.ratio:.3f}",
            "met" if r.within_goal else f"MISSED ({RATIO_GOAL[0]}-{RATIO_GOAL[1]})",
        )
    return table


def _runs_table(report: FidelityReport) -> Any:
    from rich.table import Table

    table = Table(title="replays (virtual clock)")
    for col in (
        "scenario",
        "sessions",
        "requests",
        "simulated s",
        "wall s",
        "speed",
        "cache hit",
        "TTFT p50 s",
        "TTFT p90 s",
    ):
        table.add_column(col, justify="right")
    for run in report.runs:
        speed = run.sim_seconds / run.wall_seconds if run.wall_seconds > 0 else float("inf")
        table.add_row(
            run.name,
            str(run.sessions),
            f"{run.requests:,}",
            f"{run.sim_seconds:,.1f}",
            f"{run.wall_seconds:.2f}",
            f"{speed:,.0f}x",
            f"{run.cache_hit_ratio:.1%}",
            f"{run.ttft_p50:.3f}",
            f"{run.ttft_p90:.3f}",
        )
    return table


def _num(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:,.2f}"
