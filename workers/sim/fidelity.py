"""`beamserve bench sim-fidelity`: the published Beam figures beside the simulator's values.

Each published point names a scenario (a session shape replayed closed-loop with some number
of concurrent sessions on one engine of a profile, on a `VirtualClock`) and a metric of that
replay. The report lists every point with its ratio (simulated / published) and the
simulator's speed. Goals: every ratio within `RATIO_GOAL`; speed ≥ `SPEEDUP_GOAL`.

Metrics (as the published figures define them):

- `total_tokens_per_gpu_s`: (prompt tokens, cached ones included, + output tokens) over the
  replay's span (first arrival → last completion), per GPU;
- `tokens_per_user_s@pNN`: per-user decode speed, 1 / (time per output token after the first)
  at the NN-th percentile of requests' time per output token (p50: median user; p90: the
  slowest tenth's boundary).

JSON (`write_json`): a list of objects `{name, published, simulated, ratio, unit, scenario}`,
one per published point, then one more entry named `sim_speedup` whose `simulated` is the
speed (simulated seconds per wall second) and whose `published` and `ratio` are null; its `goal`
field holds the goal.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from beamserve.workers.sim.clock import VirtualClock
from beamserve.workers.sim.config import EngineConfig
from beamserve.workers.sim.engine import SimEngine
from beamserve.workers.sim.profiles import GB300_NVFP4_TP4, HardwareProfile
from beamserve.workers.sim.workload import (
    AGENTX,
    OPENHANDS,
    ReplayResult,
    SessionShape,
    replay_sessions,
)

RATIO_GOAL = (0.85, 1.15)
SPEEDUP_GOAL = 200.0


@dataclass(frozen=True)
class Scenario:
    """`sessions` concurrent sessions of `shape`, all starting at time 0, on one engine."""

    name: str
    shape: SessionShape
    sessions: int


@dataclass(frozen=True)
class PublishedPoint:
    """One published figure: the scenario it comes from and the metric it reports."""

    name: str
    published: float
    unit: str
    scenario: str
    metric: Callable[[ReplayResult], float]
    source: str


def _throughput(r: ReplayResult) -> float:
    return r.total_tokens_per_gpu_s


def _per_user(pct: float) -> Callable[[ReplayResult], float]:
    def metric(r: ReplayResult) -> float:
        return r.per_user_tokens_per_s(pct)

    return metric


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("openhands-c32", OPENHANDS, 32),
    Scenario("agentx-c1", AGENTX, 1),
    Scenario("agentx-c96", AGENTX, 96),
)

_SEEDS = "REFERENCE.md, 'Published numbers worth beating' (Beam on 4 × GB300 NVFP4)"

PUBLISHED: tuple[PublishedPoint, ...] = (
    PublishedPoint(
        "openhands_c32_total_tok_s_per_gpu",
        127_600.0,
        "tok/s/GPU",
        "openhands-c32",
        _throughput,
        _SEEDS,
    ),
    PublishedPoint(
        "openhands_c32_tok_s_per_user_p50",
        185.87,
        "tok/s",
        "openhands-c32",
        _per_user(50),
        _SEEDS,
    ),
    PublishedPoint("agentx_c1_tok_s_per_user", 348.0, "tok/s", "agentx-c1", _per_user(50), _SEEDS),
    PublishedPoint(
        "agentx_c96_total_tok_s_per_gpu",
        83_504.0,
        "tok/s/GPU",
        "agentx-c96",
        _throughput,
        _SEEDS,
    ),
    PublishedPoint(
        "agentx_c96_tok_s_per_user_p90", 43.9, "tok/s", "agentx-c96", _per_user(90), _SEEDS
    ),
)


@dataclass(frozen=True)
class FidelityRow:
    name: str
    published: float
    simulated: float
    unit: str
    scenario: str

    @property
    def ratio(self) -> float:
        return self.simulated / self.published

    @property
    def within_goal(self) -> bool:
        return RATIO_GOAL[0] <= self.ratio <= RATIO_GOAL[1]


@dataclass(frozen=True)
class ScenarioRun:
    """One replay's summary (for the report's second table)."""

    name: str
    sessions: int
    requests: int
    sim_seconds: float
    wall_seconds: float
    cache_hit_ratio: float
    ttft_p50: float
    ttft_p90: float


@dataclass(frozen=True)
class FidelityReport:
    profile: str
    rows: tuple[FidelityRow, ...]
    runs: tuple[ScenarioRun, ...]

    @property
    def sim_seconds(self) -> float:
        return sum(r.sim_seconds for r in self.runs)

    @property
    def wall_seconds(self) -> float:
        return sum(r.wall_seconds for r in self.runs)

    @property
    def sim_speedup(self) -> float:
        """Simulated seconds per wall second over all replays."""
        return self.sim_seconds / self.wall_seconds if self.wall_seconds > 0 else float("inf")

    @property
    def ratios_met(self) -> bool:
        return all(r.within_goal for r in self.rows)

    @property
    def speed_met(self) -> bool:
        return self.sim_speedup >= SPEEDUP_GOAL


def run_scenario(profile: HardwareProfile, scenario: Scenario) -> ReplayResult:
    """Replay one scenario on a fresh engine and virtual clock."""
    clock = VirtualClock()
    engine = SimEngine(EngineConfig.from_profile(profile), clock)
    sessions = [scenario.shape.session(i) for i in range(scenario.sessions)]
    return replay_sessions(engine, clock, sessions)


def run_fidelity(
    profile: HardwareProfile = GB300_NVFP4_TP4,
    scenarios: Sequence[Scenario] = SCENARIOS,
    points: Sequence[PublishedPoint] = PUBLISHED,
    on_scenario: Callable[[ScenarioRun], None] | None = None,
) -> FidelityReport:
    """Replay every scenario once and evaluate every published point on it."""
    results: dict[str, ReplayResult] = {}
    runs: list[ScenarioRun] = []
    for sc in scenarios:
        wall0 = time.perf_counter()
        r = run_scenario(profile, sc)
        wall = time.perf_counter() - wall0  # includes building the engine and the sessions
        results[sc.name] = r
        run = ScenarioRun(
            sc.name,
            sc.sessions,
            len(r.requests),
            r.sim_seconds,
            wall,
            r.cache_hit_ratio,
            r.ttft(50),
            r.ttft(90),
        )
        runs.append(run)
        if on_scenario is not None:
            on_scenario(run)
    rows = tuple(
        FidelityRow(p.name, p.published, p.metric(results[p.scenario]), p.unit, p.scenario)
        for p in points
        if p.scenario in results
    )
    return FidelityReport(profile.name, rows, tuple(runs))


def to_json(report: FidelityReport) -> list[dict[str, Any]]:
    """The JSON document (see the module docstring for its shape)."""
    out: list[dict[str, Any]] = [
        {
            "name": r.name,
            "published": r.published,
            "simulated": r.simulated,
            "ratio": r.ratio,
            "unit": r.unit,
            "scenario": r.scenario,
        }
        for r in report.rows
    ]
    out.append(
        {
            "name": "sim_speedup",
            "published": None,
            "simulated": report.sim_speedup,
            "ratio": None,
            "unit": "simulated s / wall s",
            "goal": SPEEDUP_GOAL,
            "sim_seconds": report.sim_seconds,
            "wall_seconds": report.wall_seconds,
        }
    )
    return out


def write_json(report: FidelityReport, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_json(report), indent=2) + "\n")
