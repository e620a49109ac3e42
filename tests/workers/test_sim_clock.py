"""Clocks: the virtual clock's event order, the real clock on asyncio, and the same engine code
running under both."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import pytest
from beamserve.workers.sim import (
    EngineConfig,
    RealClock,
    RequestMetrics,
    RequestUpdate,
    SimEngine,
    SimRequest,
    VirtualClock,
)
from beamserve.workers.sim.fidelity import SCENARIOS, run_scenario
from beamserve.workers.sim.profiles import GB300_NVFP4_TP4, TINY_CPU
from beamserve.workers.sim.streaming import stream


def test_virtual_clock_runs_timers_in_time_order_ties_in_scheduling_order() -> None:
    clock = VirtualClock()
    seen: list[tuple[float, str]] = []
    clock.call_at(2.0, lambda: seen.append((clock.now(), "b")))
    clock.call_at(1.0, lambda: seen.append((clock.now(), "a")))
    clock.call_at(2.0, lambda: seen.append((clock.now(), "c")))
    assert clock.run() == 3
    assert seen == [(1.0, "a"), (2.0, "b"), (2.0, "c")]
    assert clock.now() == 2.0


def test_virtual_clock_cancel_until_and_past_times() -> None:
    clock = VirtualClock()
    seen: list[str] = []
    handle = clock.call_at(1.0, lambda: seen.append("cancelled"))
    clock.call_at(3.0, lambda: seen.append("late"))
    handle.cancel()
    assert clock.next_time() == 3.0
    clock.run(until=2.0)
    assert seen == [] and clock.now() == 2.0
    # a timer in the past runs at "now", never moving time backwards
    clock.call_at(0.5, lambda: seen.append(f"past@{clock.now()}"))
    clock.run()
    assert seen == ["past@2.0", "late"]
    assert clock.now() == 3.0


def test_virtual_clock_callbacks_may_schedule_more() -> None:
    clock = VirtualClock()
    ticks: list[float] = []

    def tick() -> None:
        ticks.append(clock.now())
        if len(ticks) < 5:
            clock.call_later(0.25, tick)

    clock.call_at(0.0, tick)
    clock.run()
    assert ticks == [0.0, 0.25, 0.5, 0.75, 1.0]


def test_real_clock_fires_on_the_loop_with_speed() -> None:
    async def main() -> tuple[float, float]:
        clock = RealClock(speed=100.0)
        fired = asyncio.get_running_loop().create_future()
        start = time.perf_counter()
        clock.call_at(clock.now() + 1.0, lambda: fired.set_result(clock.now()))  # 10 ms wall
        at = await fired
        return at, time.perf_counter() - start

    at, wall = asyncio.run(main())
    assert at >= 1.0
    assert 0.005 < wall < 1.0


def test_real_clock_needs_a_positive_speed() -> None:
    async def main() -> None:
        RealClock(speed=0)

    with pytest.raises(ValueError, match="speed"):
        asyncio.run(main())


def _requests() -> list[SimRequest]:
    shared = list(range(1000, 1000 + 256))
    return [
        SimRequest(f"r{i}", token_ids=tuple(shared + [i] * (40 + 30 * i)), max_output_tokens=12)
        for i in range(6)
    ]


def _run_virtual(config: EngineConfig) -> list[RequestMetrics]:
    clock = VirtualClock()
    engine = SimEngine(config, clock)
    done: list[RequestMetrics] = []

    def keep(u: RequestUpdate) -> None:
        if u.metrics is not None:
            done.append(u.metrics)

    for r in _requests():
        engine.submit(r, keep)
    clock.run()
    return sorted(done, key=lambda m: m.request_id)


def test_same_engine_code_under_both_clocks() -> None:
    """The core is clock-agnostic: a real-clock run (time compressed 20×) produces the same
    tokens, cache hits and finish reasons as the virtual run, at about the same times."""
    config = EngineConfig.from_profile(TINY_CPU)
    virtual = _run_virtual(config)

    async def real() -> list[RequestMetrics]:
        clock = RealClock(speed=20.0)
        engine = SimEngine(config, clock)
        out: list[RequestMetrics] = []
        for r in _requests():
            async for u in stream(engine, r):
                if u.metrics is not None:
                    out.append(u.metrics)
        return sorted(out, key=lambda m: m.request_id)

    # sequential submissions differ from the virtual batch run: compare with a sequential one
    clock = VirtualClock()
    engine = SimEngine(config, clock)
    sequential: list[RequestMetrics] = []

    def chain(i: int) -> None:
        def keep(u: RequestUpdate) -> None:
            if u.metrics is not None:
                sequential.append(u.metrics)
                if i + 1 < len(_requests()):
                    chain(i + 1)

        engine.submit(_requests()[i], keep)

    chain(0)
    clock.run()
    realm = asyncio.run(real())
    assert len(virtual) == len(realm) == len(sequential) == 6
    for v, r in zip(sorted(sequential, key=lambda m: m.request_id), realm, strict=True):
        assert (v.request_id, v.output_tokens, v.device_cached_tokens, v.finish_reason) == (
            r.request_id,
            r.output_tokens,
            r.device_cached_tokens,
            r.finish_reason,
        )
        assert r.ttft is not None and v.ttft is not None
        assert r.ttft == pytest.approx(v.ttft, abs=0.5)  # 25 ms of wall jitter × speed 20


def test_streaming_updates_add_up_and_carry_deterministic_tokens() -> None:
    config = EngineConfig.from_profile(TINY_CPU)

    async def main() -> list[RequestUpdate]:
        engine = SimEngine(config, RealClock(speed=50.0))
        return [u async for u in stream(engine, SimRequest("s", prompt_tokens=300))]

    updates = asyncio.run(main())
    assert updates[-1].finished and updates[-1].finish_reason == "length"
    tokens = [t for u in updates for t in u.token_ids]
    assert len(tokens) == 16 == updates[-1].num_output_tokens
    assert updates[-1].metrics is not None
    assert updates[-1].metrics.output_tokens == 16
    again = asyncio.run(main())
    assert [t for u in again for t in u.token_ids] == tokens


def test_closing_a_stream_aborts_the_request() -> None:
    config = EngineConfig.from_profile(TINY_CPU)

    async def main() -> int:
        engine = SimEngine(config, RealClock(speed=10.0))
        gen = stream(engine, SimRequest("gone", prompt_tokens=100, max_output_tokens=500))
        async for _ in gen:
            break
        await gen.aclose()
        await asyncio.sleep(0.01)
        return engine.stats().running + engine.stats().waiting

    assert asyncio.run(main()) == 0


def test_virtual_replay_does_not_wait_out_simulated_time() -> None:
    """The replay runs on the virtual clock: a minute and more of simulated serving takes less
    wall time than it simulates. How much faster (the goal: ≥ 200×) is a speed claim, measured
    by `beamserve bench sim-fidelity`, not asserted here: machines differ 2–3× (one measured
    82× on this very code where another had measured well over 100×)."""
    sc = dataclasses.replace(SCENARIOS[2], sessions=24)
    r = run_scenario(GB300_NVFP4_TP4, sc)
    assert r.sim_seconds > 60
    assert r.wall_seconds < r.sim_seconds, f"{r.wall_seconds:.1f} s wall for {r.sim_seconds:.1f}"


class LateHostClock(VirtualClock):
    """A virtual clock whose step-end timers run `late` seconds after they were due, as on a
    busy host (stands below the engine under test)."""

    def __init__(self, late: float) -> None:
        super().__init__()
        self.late = late

    def call_at(self, when: float, callback: Any) -> Any:
        if getattr(callback, "__name__", "") == "_on_step_end":
            when += self.late
        return super().call_at(when, callback)


def _decode_run(late: float, catch_up_s: float) -> tuple[RequestMetrics, float]:
    config = EngineConfig.from_profile(TINY_CPU)
    clock = LateHostClock(late)
    engine = SimEngine(config, clock, catch_up_s=catch_up_s)
    done: list[RequestMetrics] = []
    engine.submit(
        SimRequest("r", token_ids=tuple(range(100, 164)), max_output_tokens=40),
        lambda u: done.append(u.metrics) if u.metrics is not None else None,
    )
    clock.run()
    return done[0], engine.stats().step_lag_seconds


@pytest.mark.parametrize("late", [0.0005, 0.002, 0.01])
def test_a_busy_host_does_not_slow_the_simulated_gpu(late: float) -> None:
    """Step timers that run late (a busy host) delay each token by at most that lateness when
    the engine catches up; without catching up every late step pushes all later ones back."""
    exact, lag0 = _decode_run(0.0, 0.25)
    caught, lag1 = _decode_run(late, 0.25)
    lost, lag2 = _decode_run(late, 0.0)
    steps = len(exact.token_times)
    assert lag0 == 0.0 and lag1 == 0.0
    for t_exact, t_caught in zip(exact.token_times, caught.token_times, strict=True):
        assert t_exact <= t_caught <= t_exact + late + 1e-9  # late by one timer, never more
    # the lost time is counted, and every later token comes that much later
    assert lag2 == pytest.approx(late * steps, rel=1e-6)
    assert lost.token_times[-1] - exact.token_times[-1] == pytest.approx(late * steps, rel=1e-6)


def test_a_long_stall_is_not_caught_up_and_catch_up_must_not_be_negative() -> None:
    m, lag = _decode_run(0.5, 0.25)  # each timer half a second late: beyond catching up
    exact, _ = _decode_run(0.0, 0.25)
    steps = len(exact.token_times)
    assert lag == pytest.approx(0.5 * steps, rel=1e-6)
    assert m.token_times[-1] > exact.token_times[-1] + 0.5 * (steps - 1)
    with pytest.raises(ValueError, match="catch_up_s"):
        SimEngine(EngineConfig.from_profile(TINY_CPU), VirtualClock(), catch_up_s=-1)
