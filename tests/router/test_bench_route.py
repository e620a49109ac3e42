"""`beamserve.router.bench`: oracle and unbounded hits, capacity search, replays on trace slices,
JSON and assignments, CLI smoke (small slices only; the real runs are `beamserve bench route`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from beamserve.router.bench import cli
from beamserve.router.bench.capacity import Probe, search_capacity
from beamserve.router.bench.oracle import block_hit_unbounded, oracle_hits
from beamserve.router.bench.replay import ReplayConfig, replay
from beamserve.router.bench.report import RouteResult, summarize
from beamserve.router.bench.traces import expand_mooncake_block, load_trace
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

TRACES = Path(__file__).resolve().parents[2] / "data" / "traces"  # bundled with the repository
CLAUDE = TRACES / "claude-code"
MOONCAKE = TRACES / "mooncake" / "conversation_trace.jsonl"

REQUIRED = {
    "policy",
    "load",
    "hit_ratio",
    "block_hit_unbounded",
    "throughput_tok_s",
    "capacity_tok_s",
    "ttft_p50_s",
    "ttft_p90_s",
    "ttft_p99_s",
    "max_mean_load",
    "sessions_split",
    "shed_rate",
    "continuing_ttft_p99_s",
    "first_turn_ttft_p99_s",
}


def test_oracle_hand_made() -> None:
    # r1 is cold; r2 shares [1,2]; r3 shares [1] only (its 2nd block differs); r4 repeats r2.
    reqs = [(1, 2, 3), (1, 2, 4), (1, 5), (1, 2, 4, 6)]
    hits = oracle_hits(reqs)
    assert (hits.hit_blocks, hits.total_blocks) == (0 + 2 + 1 + 3, 3 + 3 + 2 + 4)


def test_block_hit_unbounded_hand_made() -> None:
    reqs = [(1, 2, 3), (1, 2, 4), (1, 5), (1, 2, 4, 6)]
    same = block_hit_unbounded(zip(reqs, ["a", "a", "a", "a"], strict=True))
    assert same.ratio == oracle_hits(reqs).ratio
    # r2 on another worker misses all; r4 follows r2 to b: hit 3.
    split = block_hit_unbounded(zip(reqs, ["a", "b", "a", "b"], strict=True))
    assert (split.hit_blocks, split.total_blocks) == (0 + 0 + 1 + 3, 12)


@given(
    st.lists(st.lists(st.integers(0, 6), min_size=1, max_size=5), max_size=12),
    st.lists(st.sampled_from("abc"), min_size=12, max_size=12),
)
def test_unbounded_never_beats_oracle(reqs: list[list[int]], workers: list[str]) -> None:
    assert block_hit_unbounded(zip(reqs, workers, strict=False)).hit_blocks <= (
        oracle_hits(reqs).hit_blocks
    )


def _stub(threshold: float) -> list[float]:
    probed: list[float] = []

    def run_at(load: float) -> Probe[None]:
        probed.append(load)
        return Probe(load, 2.0 * load / threshold, 0.0, None)  # p90 = 2 s at threshold

    found = search_capacity(run_at, 2.0, refine_steps=6)
    return [found.load, float(found.bounded), *probed]


@settings(max_examples=30, deadline=None)
@given(st.floats(0.05, 500.0))
def test_capacity_search_brackets_threshold(threshold: float) -> None:
    load, bounded, *_ = _stub(threshold)
    assert bounded
    assert load <= threshold * 1.0000001
    assert load >= threshold / 2 ** (1 / 32)  # 6 geometric bisections of a factor 2


def test_capacity_search_edges() -> None:
    never = search_capacity(lambda x: Probe(x, 9.0, 0.0, None), 2.0)
    assert never.load == 0 and never.best is None
    always = search_capacity(lambda x: Probe(x, 0.1, 0.0, None), 2.0, max_load=64)
    assert always.load == 64 and not always.bounded
    shedding = search_capacity(lambda x: Probe(x, 0.1, 0.5 if x > 4 else 0.0, None), 2.0)
    assert 2 <= shedding.load <= 4


def test_loaders_namespace_and_expand() -> None:
    cc = load_trace(CLAUDE, sessions=3)
    assert cc.kind == "closed" and len(cc.sessions) == 3
    firsts = [set(s.requests[0].block_hashes) for s in cc.sessions]
    assert not firsts[0] & firsts[1]  # namespaced: no accidental sharing
    for r in cc.all_requests:
        assert len(r.block_hashes) == r.prompt_tokens // 64
    mc = load_trace(MOONCAKE, requests=50)
    r0 = mc.requests[0]
    assert r0.block_hashes[:8] == expand_mooncake_block(r0.trace_blocks[0])
    assert len(r0.block_hashes) == r0.prompt_tokens // 64
    assert all(r.block_hashes[:8] == r0.block_hashes[:8] for r in mc.requests)  # shared block 0


@pytest.fixture(scope="module")
def cc_slice_results() -> dict[str, RouteResult]:
    trace = load_trace(CLAUDE, sessions=4, requests=60)
    cfg = ReplayConfig(workers=4)
    return {p: summarize(replay(trace, p, 4.0, cfg)) for p in ("round-robin", "prefix-only")}


def test_prefix_only_beats_round_robin(cc_slice_results: dict[str, RouteResult]) -> None:
    rr, po = cc_slice_results["round-robin"], cc_slice_results["prefix-only"]
    assert po.block_hit_unbounded > rr.block_hit_unbounded
    assert po.hit_ratio is not None and rr.hit_ratio is not None and po.hit_ratio > rr.hit_ratio
    assert po.block_hit_unbounded == pytest.approx(po.oracle_block_hit)
    assert po.sessions_split == 0 and rr.sessions_split == rr.sessions


def test_result_has_every_field(cc_slice_results: dict[str, RouteResult]) -> None:
    row = cc_slice_results["prefix-only"].to_json()
    assert set(row) >= REQUIRED
    assert row["served"] == row["requests"] == 60


def _args(**kw: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="bench")
    cli.add_bench_route(sub)
    cli.add_bench_route_overhead(sub)
    argv = ["route"]
    for k, v in kw.items():
        flag = "--" + k.replace("_", "-")
        argv += [flag] if v is True else [flag, str(v)]
    return parser.parse_args(argv)


def test_cli_smoke_mooncake(tmp_path: Path) -> None:
    out, assign = tmp_path / "r.json", tmp_path / "a.jsonl"
    args = _args(
        trace=MOONCAKE,
        requests=120,
        workers=4,
        load=8,
        policies="round-robin,beamserve,oracle",
        json=out,
        assignments=assign,
    )
    assert cli.route_main(args, Console(width=200, quiet=True)) == 0
    rows = json.loads(out.read_text())
    assert [r["policy"] for r in rows] == ["round-robin", "beamserve", "oracle"]
    for r in rows:
        assert set(r) >= REQUIRED
    lines = [json.loads(x) for x in assign.read_text().splitlines()]
    assert len(lines) == 2 * 120  # one per dispatched request, per routed policy
    assert {x["policy"] for x in lines} == {"round-robin", "beamserve"}
    assert all(1 <= x["line"] <= 120 and x["worker"].startswith("w") for x in lines)
    assert (tmp_path / "r.png").stat().st_size > 0


def test_cli_rejects_unknown_policy(tmp_path: Path) -> None:
    args = _args(trace=tmp_path, policies="nope")
    assert cli.route_main(args, Console(quiet=True)) == 2
