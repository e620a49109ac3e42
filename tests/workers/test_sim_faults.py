"""Fault injection: slowdown, failed requests, death mid-stream, dropped and delayed KV events."""

from __future__ import annotations

import pytest
from beamserve.kvwire.events import AllBlocksCleared, KVEventBatch
from beamserve.workers.sim import (
    EngineConfig,
    EngineDeadError,
    FaultConfig,
    FaultConfigError,
    RequestMetrics,
    RequestUpdate,
    SimEngine,
    SimRequest,
    VirtualClock,
)
from beamserve.workers.sim.profiles import TINY_CPU

P = 64


def setup(
    faults: FaultConfig | None = None,
) -> tuple[SimEngine, VirtualClock, list[KVEventBatch]]:
    clock = VirtualClock()
    batches: list[KVEventBatch] = []
    eng = SimEngine(
        EngineConfig.from_profile(TINY_CPU), clock, kv_events=batches.append, faults=faults
    )
    return eng, clock, batches


def run(eng: SimEngine, clock: VirtualClock, reqs: list[SimRequest]) -> dict[str, RequestMetrics]:
    done: dict[str, RequestMetrics] = {}

    def keep(u: RequestUpdate) -> None:
        if u.metrics is not None:
            done[u.request_id] = u.metrics

    for r in reqs:
        eng.submit(r, keep)
    clock.run()
    return done


def req(i: int, out: int = 20) -> SimRequest:
    return SimRequest(
        f"r{i}",
        prompt_tokens=3 * P + 5,
        max_output_tokens=out,
        block_hashes=tuple(range(i * 100, i * 100 + 3)),
    )


def test_slowdown_stretches_every_step() -> None:
    base = run(*setup()[:2], [req(0)])["r0"]
    eng, clock, _ = setup(FaultConfig(slowdown=3.0))
    slow = run(eng, clock, [req(0)])["r0"]
    assert slow.ttft == pytest.approx(3 * base.ttft)  # type: ignore[operator]
    assert slow.e2e == pytest.approx(3 * base.e2e)
    assert eng.faults.slowdown == 3.0


def test_the_next_n_requests_fail_and_the_rest_succeed() -> None:
    eng, clock, _ = setup(FaultConfig(fail_next=2))
    done = run(eng, clock, [req(i) for i in range(4)])
    assert [done[f"r{i}"].finish_reason for i in range(4)] == ["error", "error", "length", "length"]
    assert done["r0"].error == "injected failure" and done["r0"].output_tokens == 0
    assert eng.stats().requests_failed_total == 2 and eng.faults.fail_next == 0


def test_probabilistic_failures_are_seeded() -> None:
    def outcome(seed: int) -> list[str]:
        eng, clock, _ = setup(FaultConfig(fail_probability=0.5, seed=seed))
        done = run(eng, clock, [req(i, out=2) for i in range(16)])
        return [done[f"r{i}"].finish_reason for i in range(16)]

    a = outcome(7)
    assert a == outcome(7)
    assert 0 < a.count("error") < 16


def test_engine_dies_mid_stream_after_k_tokens() -> None:
    eng, clock, batches = setup(FaultConfig(die_after_tokens=25))
    updates: list[RequestUpdate] = []
    for i in range(3):
        eng.submit(req(i, out=100), updates.append)
    clock.run()
    assert not eng.alive and not eng.ready
    assert sum(u.num_new_tokens for u in updates) == 25  # exactly K tokens left the engine
    finals = [u for u in updates if u.finished]
    assert len(finals) == 3
    assert all(u.finish_reason == "error" and "died" in (u.error or "") for u in finals)
    for u in finals:
        assert u.metrics is not None
        streamed = sum(x.num_new_tokens for x in updates if x.request_id == u.request_id)
        assert u.metrics.output_tokens == streamed
    with pytest.raises(EngineDeadError, match="revive"):
        eng.submit(req(9))
    before = len(batches)
    eng.revive()
    assert eng.alive
    assert isinstance(batches[before].events[0], AllBlocksCleared)
    eng.set_faults(FaultConfig())
    done = run(eng, clock, [req(0)])
    assert done["r0"].finish_reason == "length" and done["r0"].cached_tokens == 0


def test_kill_ends_running_and_waiting_requests() -> None:
    eng, clock, _ = setup()
    done: dict[str, RequestMetrics] = {}

    def keep(u: RequestUpdate) -> None:
        if u.metrics is not None:
            done[u.request_id] = u.metrics

    for i in range(20):
        eng.submit(req(i, out=500), keep)
    clock.run(until=0.01)
    eng.kill("test")
    clock.run()
    assert len(done) == 20 and all(m.finish_reason == "error" for m in done.values())


def test_dropping_the_next_kv_batches() -> None:
    eng, clock, batches = setup()
    run(eng, clock, [req(0)])
    normal = len(batches)
    eng2, clock2, batches2 = setup(FaultConfig(drop_next_kv_batches=1))
    run(eng2, clock2, [req(0)])
    assert len(batches2) == normal - 1
    assert eng2.stats().kv_event_batches_dropped == 1
    assert eng2.stats().kv_event_batches_total == normal


def test_dropping_kv_batches_by_probability() -> None:
    eng, clock, batches = setup(FaultConfig(drop_kv_events_probability=1.0))
    run(eng, clock, [req(i) for i in range(3)])
    assert batches == [] and eng.stats().kv_event_batches_dropped > 0


def test_delayed_kv_events_arrive_late_and_in_order() -> None:
    clock = VirtualClock()
    got: list[tuple[float, KVEventBatch]] = []
    eng = SimEngine(
        EngineConfig.from_profile(TINY_CPU),
        clock,
        kv_events=lambda b: got.append((clock.now(), b)),
        faults=FaultConfig(kv_event_delay_s=0.25),
    )
    run(eng, clock, [req(i) for i in range(3)])
    assert got
    for at, batch in got:
        assert at == pytest.approx(batch.ts + 0.25)
    assert [b.ts for _, b in got] == sorted(b.ts for _, b in got)


def test_fault_config_parsing_is_strict() -> None:
    cfg = FaultConfig.from_dict({"slowdown": 2.0, "fail_next": 3})
    assert cfg.slowdown == 2.0 and cfg.to_dict()["fail_next"] == 3
    with pytest.raises(FaultConfigError, match="unknown fault settings"):
        FaultConfig.from_dict({"slow_down": 2.0})
    with pytest.raises(FaultConfigError, match="slowdown"):
        FaultConfig(slowdown=0)
    with pytest.raises(FaultConfigError, match="fail_probability"):
        FaultConfig(fail_probability=1.5)
