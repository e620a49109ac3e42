"""`beamserve bench route --router-replicas`: replays through N independent router cores (own
index, load book and flow controller each; one shared session store), on small trace slices."""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from beamserve.router.bench import cli
from beamserve.router.bench.replay import Replay, ReplayConfig, ReplayError
from beamserve.router.bench.report import RouteResult, replica_goals, summarize
from beamserve.router.bench.traces import Trace, load_trace
from beamserve.router.load import NO_BOOKING
from beamserve.router.types import WorkerLoad
from rich.console import Console

TRACES = Path(__file__).resolve().parents[2] / "data" / "traces"
CLAUDE = TRACES / "claude-code"
MOONCAKE = TRACES / "mooncake" / "conversation_trace.jsonl"


def test_replicas_book_only_their_own_requests_and_see_the_others_through_scrapes() -> None:
    trace = load_trace(MOONCAKE, requests=300)
    rp = Replay(
        trace, "beamserve", 8.0, ReplayConfig(workers=4, router_replicas=3, replica_sync=False)
    )
    assert len({id(r.core.loads) for r in rp.replicas}) == 3
    assert len({id(r.index) for r in rp.replicas}) == 3
    foreign: list[int] = []
    for r in rp.replicas:
        book = r.core.loads
        plain = book.load

        def load(worker: str, now: float | None = None, plain: Any = plain) -> WorkerLoad:
            ld: WorkerLoad = plain(worker, now)
            foreign.append(ld.foreign_prefill_tokens)
            return ld

        book.load = load  # type: ignore[method-assign]
    run = rp.run()
    assert run.router_replicas == 3
    per_replica = [sum(1 for x in run.records if x.replica == k and x.served) for k in range(3)]
    assert all(n > 0 for n in per_replica)  # the random spread reached every replica
    for k, r in enumerate(rp.replicas):
        assert r.core.open_dispatches == 0
        served = sum(r.core.loads.served(w) for w in run.workers)
        assert served == per_replica[k]  # each book holds its own requests only
        for w in run.workers:
            ld = r.core.loads.load(w)
            assert (ld.prefill_tokens, ld.decode_tokens, ld.in_flight) == (0, 0, 0)
    assert max(foreign) > 0  # other replicas' work showed up through the scrapes


def test_one_replica_is_the_single_router_and_the_draw_is_seeded() -> None:
    trace = load_trace(CLAUDE, sessions=3)
    one = Replay(trace, "beamserve", 4.0, ReplayConfig(workers=4)).run()
    assert {r.replica for r in one.records} == {0} and one.router_replicas == 1
    a = Replay(trace, "beamserve", 4.0, ReplayConfig(workers=4, router_replicas=2)).run()
    b = Replay(trace, "beamserve", 4.0, ReplayConfig(workers=4, router_replicas=2)).run()
    assert [r.replica for r in a.records] == [r.replica for r in b.records]
    assert [r.worker for r in a.records] == [r.worker for r in b.records]
    assert summarize(a).router_replicas == 2
    with pytest.raises(ReplayError, match="router_replicas"):
        ReplayConfig(router_replicas=0)


def _row(n: int, hit: float, p90: float, unsat: int, max_mean: float) -> RouteResult:
    base = summarize_stub()
    return RouteResult(
        **{
            **base,
            "router_replicas": n,
            "block_hit_unbounded": hit,
            "ttft_p90_s": p90,
            "sessions_split_unsaturated": unsat,
            "max_mean_load": max_mean,
        }
    )


def summarize_stub() -> dict[str, Any]:
    fields = RouteResult.__dataclass_fields__
    row: dict[str, Any] = dict.fromkeys(fields)
    row.update(policy="beamserve", trace="t", workers=8, load=1.0, requests=10, served=10)
    row.update(oracle_block_hit=1.0, sessions=4, sessions_split=1)
    return row


def test_replica_goals_compare_n_against_one() -> None:
    one = _row(1, 0.90, 1.00, 0, 1.05)
    good = _row(4, 0.895, 1.09, 0, 1.10)
    bad = _row(4, 0.88, 1.20, 2, 1.30)
    assert all(g.met for g in replica_goals([one, good], open_loop=True))
    missed = {g.goal for g in replica_goals([one, bad], open_loop=True) if not g.met}
    assert len(missed) == 4
    assert not any("max/mean" in g.goal for g in replica_goals([one, bad], open_loop=False))
    assert replica_goals([good], open_loop=True) == []  # nothing to compare against


def _args(**kw: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_bench_route(parser.add_subparsers(dest="bench"))
    argv = ["route"]
    for k, v in kw.items():
        argv += ["--" + k.replace("_", "-"), str(v)]
    return parser.parse_args(argv)


def test_cli_runs_each_replica_count(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    args = _args(
        trace=MOONCAKE,
        requests=120,
        workers=4,
        load=8,
        policies="beamserve",
        router_replicas="1,2",
        json=out,
    )
    assert cli.route_main(args, Console(width=200, quiet=True)) == 0
    rows = json.loads(out.read_text())
    assert [(r["policy"], r["router_replicas"]) for r in rows] == [
        ("beamserve", 1),
        ("beamserve", 2),
    ]
    with pytest.raises(SystemExit):
        _args(trace=MOONCAKE, router_replicas="0")


def _spread_bursts(trace: Trace, over_s: float, seed: int = 1) -> Trace:
    """The trace with each arrival moved later by U(0, `over_s`): Mooncake's lines arrive in
    bursts at the very same instant (every 3 s), which no replica sync with a delay can order."""
    rng = random.Random(seed)
    moved = (replace(r, arrival_s=r.arrival_s + rng.uniform(0, over_s)) for r in trace.requests)
    return replace(trace, requests=tuple(sorted(moved, key=lambda r: r.arrival_s)))


def test_replica_sync_makes_four_replicas_route_like_one() -> None:
    trace = _spread_bursts(load_trace(MOONCAKE, requests=300), 0.5)
    one = summarize(Replay(trace, "beamserve", 1.0, ReplayConfig(router_replicas=1)).run())
    rp = Replay(trace, "beamserve", 1.0, ReplayConfig(router_replicas=4))
    synced = summarize(rp.run())
    alone = summarize(
        Replay(trace, "beamserve", 1.0, ReplayConfig(router_replicas=4, replica_sync=False)).run()
    )
    assert one.ttft_p90_s is not None and synced.ttft_p90_s is not None
    assert alone.ttft_p90_s is not None
    # with sync: the single router's TTFT and balance; without: visibly worse
    assert abs(synced.ttft_p90_s - one.ttft_p90_s) <= 0.1 * one.ttft_p90_s
    assert synced.ttft_p90_s < alone.ttft_p90_s - 0.2
    assert synced.max_mean_load is not None and alone.max_mean_load is not None
    assert one.max_mean_load is not None
    assert synced.max_mean_load <= one.max_mean_load + 0.05
    assert synced.max_mean_load < alone.max_mean_load - 0.2
    # the bus carried every replica's bookings and predictions; at the end nothing is booked
    # anywhere, as each replica knows it of its peers too
    assert rp.sync_bus is not None
    for r in rp.replicas:
        assert r.sync is not None and r.sync.stats.published > 0
        assert r.sync.stats.predictions_applied > 0
        end = rp.clock.now()
        for w in rp.endpoints:
            assert r.sync.state.counts(w.id, end) == r.core.loads.book(w.id) == NO_BOOKING


def test_replica_sync_is_on_for_several_replicas_unless_asked_not_to() -> None:
    trace = load_trace(CLAUDE, sessions=2)
    assert Replay(trace, "beamserve", 4.0, ReplayConfig(workers=4)).sync_bus is None
    assert Replay(trace, "beamserve", 4.0, ReplayConfig(router_replicas=2)).sync_bus is not None
    off = ReplayConfig(router_replicas=2, replica_sync=False)
    assert Replay(trace, "beamserve", 4.0, off).sync_bus is None
    args = _args(trace=MOONCAKE, router_replicas="1,4")
    assert not args.no_replica_sync and args.sync_lag_s == 0.002
    parser = argparse.ArgumentParser()
    cli.add_bench_route(parser.add_subparsers(dest="bench"))
    args = parser.parse_args(["route", "--trace", str(MOONCAKE), "--no-replica-sync"])
    assert args.no_replica_sync
    with pytest.raises(ReplayError, match="sync_lag_s"):
        ReplayConfig(sync_lag_s=-1)
