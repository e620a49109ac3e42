"""Continuous batching through the engine on a virtual clock: batch limits, chunked prefill,
prefix reuse across turns, preemption, speculative decoding, P/D roles, abort."""

from __future__ import annotations

import itertools

import pytest
from beamserve.workers.sim import (
    EngineConfig,
    EngineStats,
    RemotePrefill,
    RequestMetrics,
    RequestUpdate,
    SimEngine,
    SimRequest,
    SimRequestError,
    SpecDecode,
    VirtualClock,
)
from beamserve.workers.sim.latency import LatencyModel
from beamserve.workers.sim.profiles import TINY_CPU, HardwareProfile

P = 64


def engine(
    profile: HardwareProfile = TINY_CPU, **overrides: object
) -> tuple[SimEngine, VirtualClock]:
    clock = VirtualClock()
    return SimEngine(EngineConfig.from_profile(profile, **overrides), clock), clock


def collect(eng: SimEngine, requests: list[SimRequest]) -> dict[str, RequestMetrics]:
    done: dict[str, RequestMetrics] = {}

    def keep(u: RequestUpdate) -> None:
        if u.metrics is not None:
            done[u.request_id] = u.metrics

    for r in requests:
        eng.submit(r, keep)
    return done


def sample(clock: VirtualClock, eng: SimEngine, every: float, until: float) -> list[EngineStats]:
    """Engine stats every `every` seconds of virtual time (a probe, like a metrics scrape)."""
    out: list[EngineStats] = []

    def probe() -> None:
        out.append(eng.stats())
        if clock.now() + every <= until:
            clock.call_later(every, probe)

    clock.call_at(0.0, probe)
    return out


def test_running_requests_never_exceed_max_running() -> None:
    eng, clock = engine(max_running=3)
    done = collect(
        eng, [SimRequest(f"r{i}", prompt_tokens=200, max_output_tokens=20) for i in range(10)]
    )
    stats = sample(clock, eng, 0.001, 10.0)
    clock.run()
    assert len(done) == 10 and all(m.output_tokens == 20 for m in done.values())
    assert max(s.running for s in stats) == 3
    assert max(s.waiting for s in stats) == 7
    eng.kv_cache.check()


def test_every_step_fits_the_token_budget() -> None:
    eng, clock = engine(max_batched_tokens=300, max_running=8)
    sched = eng._sched  # the step plans themselves
    seen: list[int] = []
    schedule = sched.schedule

    def spy(now: float):  # type: ignore[no-untyped-def]
        plan = schedule(now)
        if plan is not None:
            seen.append(plan.work.tokens)
        return plan

    sched.schedule = spy  # type: ignore[method-assign]
    collect(eng, [SimRequest(f"r{i}", prompt_tokens=700, max_output_tokens=10) for i in range(6)])
    clock.run()
    assert seen and max(seen) <= 300
    assert max(seen) == 300  # prefill chunks fill the budget


def test_chunked_prefill_splits_a_long_prompt_into_budget_sized_steps() -> None:
    eng, clock = engine(max_batched_tokens=512)
    done = collect(eng, [SimRequest("long", prompt_tokens=2000, max_output_tokens=1)])
    clock.run()
    m = done["long"]
    # 2000 tokens in chunks of 512, 512, 512, 464: the first token ends the 4th step
    assert eng.stats().steps_total == 4
    lat = LatencyModel(TINY_CPU)
    assert m.ttft is not None and m.ttft > lat.prefill_seconds(2000)  # chunking costs overheads
    assert m.output_tokens == 1 and m.finish_reason == "length"


def test_later_turns_hit_the_prefix_cache() -> None:
    eng, clock = engine()
    base = tuple(range(10_000, 10_000 + 20))
    done = collect(
        eng, [SimRequest("t0", prompt_tokens=20 * P + 10, block_hashes=base, max_output_tokens=4)]
    )
    clock.run()
    turn1 = SimRequest(
        "t1", prompt_tokens=24 * P, block_hashes=(*base, 1, 2, 3, 4), max_output_tokens=4
    )
    done1 = collect(eng, [turn1])
    clock.run()
    done.update(done1)
    assert done["t0"].cached_tokens == 0
    assert done["t1"].device_cached_tokens == 20 * P
    assert done["t1"].window_recompute_tokens == 0
    assert done["t1"].ttft is not None and done["t0"].ttft is not None
    assert done["t1"].ttft < done["t0"].ttft
    s = eng.stats()
    assert s.prefix_cache_hits_tokens == 20 * P
    assert s.prefix_cache_queries_tokens == 20 * P + 10 + 24 * P


def test_token_ids_are_hashed_with_the_vllm_compatible_hash() -> None:
    from beamserve.kvwire.hashing import block_hashes

    eng, clock = engine()
    tokens = tuple(range(5, 5 + 3 * P + 7))
    assert SimRequest("x", token_ids=tokens).hashes(P) == tuple(block_hashes(list(tokens), P))
    collect(eng, [SimRequest("a", token_ids=tokens, max_output_tokens=2)])
    clock.run()
    done = collect(eng, [SimRequest("b", token_ids=(*tokens, 1, 2, 3), max_output_tokens=2)])
    clock.run()
    assert done["b"].device_cached_tokens == 3 * P


def test_memory_pressure_preempts_the_newest_and_everyone_still_finishes() -> None:
    eng, clock = engine(full_pages=24, window_pages=12, max_running=6)
    reqs = [SimRequest(f"r{i}", prompt_tokens=5 * P, max_output_tokens=3 * P) for i in range(6)]
    done = collect(eng, reqs)
    clock.run()
    assert len(done) == 6
    assert all(m.output_tokens == 3 * P and m.finish_reason == "length" for m in done.values())
    assert eng.stats().preemptions_total > 0
    assert sum(m.preemptions for m in done.values()) == eng.stats().preemptions_total
    for m in done.values():
        tt = m.token_times
        assert all(a <= b for a, b in itertools.pairwise(tt))
    eng.kv_cache.check()
    assert eng.stats().full_usage == 0.0


def test_a_prompt_larger_than_the_budget_is_refused_up_front() -> None:
    eng, _ = engine(full_pages=8, window_pages=12)
    with pytest.raises(SimRequestError, match="full-attention pages"):
        eng.submit(SimRequest("big", prompt_tokens=9 * P))
    eng.submit(SimRequest("ok", prompt_tokens=P))
    with pytest.raises(SimRequestError, match="already"):
        eng.submit(SimRequest("ok", prompt_tokens=P))
    with pytest.raises(SimRequestError, match="repeat"):
        eng.submit(SimRequest("dup", prompt_tokens=3 * P, block_hashes=(1, 2, 1)))


def spec_profile(acceptance: float, disable: int | None = None) -> HardwareProfile:
    return TINY_CPU.with_changes(spec=SpecDecode(4, acceptance, disable), draft_step_s=1e-4)


def test_speculative_decoding_emits_the_acceptance_length_per_step() -> None:
    eng, clock = engine(spec_profile(2.5))
    updates: list[RequestUpdate] = []
    eng.submit(SimRequest("s", prompt_tokens=100, max_output_tokens=21), updates.append)
    clock.run()
    counts = [u.num_new_tokens for u in updates]
    assert counts[0] == 1  # the prefill's token
    assert counts[1:6] == [2, 3, 2, 3, 2]  # 2.5 per step: fractions carry over
    assert sum(counts) == 21 and updates[-1].finished
    m = updates[-1].metrics
    assert m is not None and len(set(m.token_times)) == len(counts)


def test_speculation_is_off_above_the_batch_limit() -> None:
    eng, clock = engine(spec_profile(3.0, disable=2), max_running=4, max_batched_tokens=64)
    steps: list[tuple[int, int, bool]] = []
    schedule = eng._sched.schedule

    def spy(now: float):  # type: ignore[no-untyped-def]
        plan = schedule(now)
        if plan is not None:
            w = plan.work
            steps.append((w.decode_requests, w.decode_query_tokens, w.draft))
        return plan

    eng._sched.schedule = spy  # type: ignore[method-assign]
    updates: list[RequestUpdate] = []
    for i in range(4):
        eng.submit(SimRequest(f"r{i}", prompt_tokens=60, max_output_tokens=13), updates.append)
    clock.run()
    assert {(q, d) for b, q, d in steps if b > 2} == {(1, False)}
    assert {(q, d) for b, q, d in steps if 0 < b <= 2} == {(4, True)}
    assert any(b > 2 for b, _, _ in steps) and any(0 < b <= 2 for b, _, _ in steps)
    assert {u.num_new_tokens for u in updates} == {1, 3}
    assert sum(u.num_new_tokens for u in updates) == 4 * 13


def test_stop_and_length_finish_reasons() -> None:
    eng, clock = engine()
    done = collect(
        eng,
        [
            SimRequest("stop", prompt_tokens=50, max_output_tokens=30, output_tokens=7),
            SimRequest("len", prompt_tokens=50, max_output_tokens=5, output_tokens=7),
        ],
    )
    clock.run()
    assert (done["stop"].finish_reason, done["stop"].output_tokens) == ("stop", 7)
    assert (done["len"].finish_reason, done["len"].output_tokens) == ("length", 5)


def test_prefill_role_answers_with_one_token() -> None:
    eng, clock = engine(role="prefill")
    done = collect(eng, [SimRequest("p", prompt_tokens=300, max_output_tokens=50)])
    clock.run()
    assert done["p"].output_tokens == 1 and done["p"].finish_reason == "length"


def test_decode_role_waits_for_the_remote_kv_then_decodes() -> None:
    eng, clock = engine(role="decode")
    lat = LatencyModel(TINY_CPU)
    remote = SimRequest(
        "d", prompt_tokens=1000, max_output_tokens=8, remote_prefill=RemotePrefill(prefill_tp=1)
    )
    local = SimRequest("fallback", prompt_tokens=1000, max_output_tokens=8)  # no KV handed over
    done = collect(eng, [remote])
    clock.run()
    m = done["d"]
    xfer = lat.pd_transfer_seconds(1000, 1)
    assert m.kv_transfer_seconds == pytest.approx(xfer)
    assert m.ttft is not None and m.ttft >= xfer
    assert m.output_tokens == 8
    assert eng.stats().steps_total == 8  # decode steps only: no prefill computed here
    done = collect(eng, [local])
    clock.run()
    assert done["fallback"].kv_transfer_seconds == 0.0 and done["fallback"].output_tokens == 8


def test_a_fixed_transfer_time_can_be_imposed() -> None:
    eng, clock = engine(role="decode")
    done = collect(
        eng,
        [
            SimRequest(
                "d",
                prompt_tokens=100,
                max_output_tokens=2,
                remote_prefill=RemotePrefill(transfer_seconds=0.5),
            )
        ],
    )
    clock.run()
    ttft = done["d"].ttft
    assert ttft is not None and 0.5 < ttft < 0.6


def test_abort_releases_everything() -> None:
    eng, clock = engine()
    done = collect(
        eng,
        [
            SimRequest("a", prompt_tokens=500, max_output_tokens=1000),
            SimRequest("b", prompt_tokens=500, max_output_tokens=10),
        ],
    )
    clock.run(until=0.05)
    assert eng.abort("a")
    assert not eng.abort("a") and not eng.abort("nobody")
    clock.run()
    assert done["a"].finish_reason == "abort" and 0 < done["a"].output_tokens < 1000
    assert done["b"].finish_reason == "length"
    eng.kv_cache.check()
    assert eng.stats().full_usage == 0.0


def test_future_arrivals_wait_for_their_time() -> None:
    eng, clock = engine()
    done = collect(
        eng, [SimRequest("late", prompt_tokens=100, max_output_tokens=2, arrival_time=3.0)]
    )
    clock.run()
    m = done["late"]
    assert m.arrival_time == 3.0 and m.first_scheduled_time == 3.0
    assert m.ttft is not None and m.ttft < 0.1


def test_reset_prefix_cache() -> None:
    from beamserve.kvwire.events import AllBlocksCleared, KVEventBatch

    clock = VirtualClock()
    batches: list[KVEventBatch] = []
    eng = SimEngine(EngineConfig.from_profile(TINY_CPU), clock, kv_events=batches.append)
    collect(
        eng,
        [
            SimRequest(
                "a", prompt_tokens=5 * P, block_hashes=tuple(range(1, 6)), max_output_tokens=2
            )
        ],
    )
    clock.run()
    s = eng.stats()
    assert (s.full_cached_pages, s.window_cached_pages) == (5, 2)  # window 128: pages 3 and 4
    assert eng.reset_prefix_cache() == 7
    assert eng.stats().full_cached_pages == 0
    assert isinstance(batches[-1].events[-1], AllBlocksCleared)
