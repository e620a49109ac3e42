"""`scripts/prefill-budget.py`: the prefill a workload leaves after a perfect prefix cache, and
the prefill a worker can do beside its decodes while every user keeps the SLO's speed."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import pytest
from beamserve.workers.sim.latency import LatencyModel
from beamserve.workers.sim.profiles import get_profile
from hypothesis import given, settings
from hypothesis import strategies as st

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "prefill-budget.py"


def _load():
    spec = importlib.util.spec_from_file_location("prefill_budget", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pb = _load()
LAT = LatencyModel(get_profile("h200-bf16-tp8"))
BUDGET = get_profile("h200-bf16-tp8").max_batched_tokens


def _args(trace: Path, **over) -> argparse.Namespace:
    values = dict(trace=trace, sessions=None, max_turns=None, token_scale=0.25, output_tokens=64)
    values.update(over)
    return argparse.Namespace(**values)


def test_a_session_prefills_its_first_prompt_then_only_what_each_turn_adds(tmp_path: Path):
    # turn 1 extends turn 0 by two blocks; turn 2 rewrites the tail after block 1 (a compaction)
    requests = [
        {"hash_ids": [1, 2, 3], "in": 192, "out": 40},
        {"hash_ids": [1, 2, 3, 4, 5], "in": 320, "out": 40},
        {"hash_ids": [1, 9], "in": 128, "out": 40},
    ]
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"block_size": 64, "requests": requests}))
    first, later, total, n = pb.uncached_parts(_args(path))
    block, wrap = 16, pb.chat_wrapper_tokens()  # 64 × 0.25; the wrapper: 20 (bench docs)
    assert n == 3
    assert first == [3 * block + wrap]
    assert later == [2 * block + wrap, 1 * block + wrap]
    assert total == (3 + 5 + 2) * block + 3 * wrap


def test_the_bundled_workload_leaves_what_the_routers_measure():
    """At the benchmark's 64-agent workload the perfect-cache hit ratio is the one every router
    reached over HTTP (0.843–0.845, docs/bench/agentic.md): the routers are at the bound."""
    first, later, total, n = pb.uncached_parts(
        _args(pb.default_trace_dir(), sessions=192, max_turns=8)
    )
    assert n == 1419 and len(first) == 192 and len(later) == 1227
    hit = 1 - (sum(first) + sum(later)) / total
    assert hit == pytest.approx(0.845, abs=0.002)
    assert sum(first) > 3 * sum(later)  # first turns carry most of the prefill


@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(1, 96),
    context=st.integers(1_000, 120_000),
    slo=st.floats(5.0, 60.0),
)
def test_the_pace_cap_is_a_share_of_steps_and_never_beats_prefill_alone(batch, context, slo):
    t_d, t_c, x, rate = pb.pace_cap(LAT, BUDGET, batch, context, slo)
    assert t_c > t_d > 0
    assert 0.0 <= x <= 1.0
    assert 0.0 <= rate <= BUDGET / t_c + 1e-6  # at best every step carries a full chunk
    # exactly at the cap, a user gets the SLO's speed (or the worker cannot give it at all)
    step = (1 - x) * t_d + x * t_c
    if 0.0 < x < 1.0:
        assert 1.0 / step == pytest.approx(slo, rel=1e-9)
    elif x == 0.0:
        assert 1.0 / t_d <= slo * (1 + 1e-9)


@settings(max_examples=40, deadline=None)
@given(batch=st.integers(1, 64), slo=st.floats(5.0, 40.0), more=st.floats(1.0, 20.0))
def test_a_stricter_slo_or_more_users_leaves_less_room_for_prefill(batch, slo, more):
    _, _, _, base = pb.pace_cap(LAT, BUDGET, batch, 28_000, slo)
    assert pb.pace_cap(LAT, BUDGET, batch, 28_000, slo + more)[3] <= base + 1e-6
    assert pb.pace_cap(LAT, BUDGET, batch + 16, 28_000, slo)[3] <= base + 1e-6


def test_the_command_prints_demand_against_the_cap(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["prefill-budget", "--duration-s", "87"])
    pb.main()
    out = capsys.readouterr().out
    assert "perfect-cache hit ratio 0.845" in out
    assert "× the pace-keeping cap" in out
