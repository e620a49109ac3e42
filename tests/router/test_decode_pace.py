"""Decode pace: the router times each streamed request's decode on its worker
(`RoutingCore.finish` → `LoadBook.decoded`), reports the running mean as
`WorkerLoad.decode_itl_s` while it is recent and the worker decodes, and the saturation detector
counts a worker whose users decode slower than `max_decode_itl_s` as full — so new sessions
wait in the flow controller while continuing turns pass."""

from __future__ import annotations

import asyncio
import math

import pytest
from beamserve.router.core import RoutingCore
from beamserve.router.flow import (
    FlowConfig,
    FlowConfigError,
    FlowController,
    SaturationConfig,
    SaturationDetector,
)
from beamserve.router.flow.saturation import worker_saturation
from beamserve.router.load import LoadBook, LoadParams
from beamserve.router.policy import build_policy
from beamserve.router.types import Endpoint, RouteRequest, WorkerLoad
from hypothesis import given
from hypothesis import strategies as st

WORKERS = [Endpoint("w0", "http://w0:8000")]


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def core_on(clock: Clock) -> RoutingCore:
    return RoutingCore(build_policy("sticky-until-saturated"), clock=clock)


def geo(prev: float, new: float, weight: float = LoadParams().itl_weight) -> float:
    """One step of the running geometric mean (`LoadBook.decoded`)."""
    return math.exp(math.log(prev) + weight * (math.log(new) - math.log(prev)))


def stream(
    core: RoutingCore, clock: Clock, i: int, tokens: int, decode_s: float, **kw: bool
) -> None:
    d = core.open(RouteRequest(f"r{i}", prompt_tokens=100, max_tokens=64))
    core.route(d, WORKERS)
    clock.t += 0.05  # prefill
    core.first_token(d)
    clock.t += decode_s
    core.finish(d, tokens, **kw)


def keep_decoding(core: RoutingCore) -> None:
    """One request left decoding on w0, so its pace is reported."""
    d = core.open(RouteRequest("long", prompt_tokens=100, max_tokens=64))
    core.route(d, WORKERS)
    core.first_token(d)


def test_finish_times_the_decode_after_the_first_token() -> None:
    clock = Clock()
    core = core_on(clock)
    keep_decoding(core)
    assert core.loads.load("w0").decode_itl_s is None  # nothing finished yet
    stream(core, clock, 1, tokens=11, decode_s=0.5)  # 10 tokens after the first in 0.5 s
    assert core.loads.load("w0").decode_itl_s == pytest.approx(0.05)
    # the running (geometric) mean moves toward the next one by `itl_weight`
    stream(core, clock, 2, tokens=11, decode_s=1.5)
    assert core.loads.load("w0").decode_itl_s == pytest.approx(geo(0.05, 0.15))


def test_what_carries_no_pace_is_not_counted() -> None:
    clock = Clock()
    core = core_on(clock)
    keep_decoding(core)
    stream(core, clock, 1, tokens=1, decode_s=0.5)  # one token: no interval
    stream(core, clock, 2, tokens=50, decode_s=0.0)  # no time passed
    stream(core, clock, 3, tokens=50, decode_s=0.5, streamed=False)  # a whole answer
    d = core.open(RouteRequest("r4", prompt_tokens=100, max_tokens=64))
    core.route(d, WORKERS)
    clock.t += 1.0
    core.finish(d, 50)  # never streamed a first token
    assert core.loads.load("w0").decode_itl_s is None
    f = core.open(RouteRequest("r5", prompt_tokens=100, max_tokens=64))
    core.route(f, WORKERS)
    core.first_token(f)
    clock.t += 1.0
    core.fail(f, worker="w0")  # a failure says nothing about the pace
    assert core.loads.load("w0").decode_itl_s is None


def test_pace_is_reported_only_while_recent_and_decoding() -> None:
    clock = Clock()
    book = LoadBook(clock=clock, params=LoadParams(stale_after_s=2.0, itl_weight=0.5))
    book.decoded("w0", 0.08)
    assert book.load("w0").decode_itl_s is None  # nothing of ours decodes there
    f = book.start("w0", uncached_tokens=10, context_tokens=100)
    assert book.load("w0").decode_itl_s is None  # still prefilling
    book.first_token(f)
    assert book.load("w0").decode_itl_s == pytest.approx(0.08)
    clock.t += 2.5
    assert book.load("w0").decode_itl_s is None  # stale: no request finished lately
    book.decoded("w0", 0.02)
    assert book.load("w0").decode_itl_s == pytest.approx(0.04)  # √(0.08 · 0.02)
    for bad in (math.nan, math.inf, -1.0, 0.0):
        book.decoded("w0", bad)
    assert book.load("w0").decode_itl_s == pytest.approx(0.04)
    book.finish(f)
    assert book.load("w0").decode_itl_s is None


@given(
    itl=st.floats(1e-4, 1.0),
    more=st.floats(0.0, 1.0),
    limit=st.floats(0.001, 1.0),
    prefill=st.integers(0, 200_000),
)
def test_the_pace_term_raises_the_level_monotonically_and_only_when_set(
    itl: float, more: float, limit: float, prefill: int
) -> None:
    off = SaturationConfig(max_decode_itl_s=None)
    on = SaturationConfig(max_decode_itl_s=limit)
    load = WorkerLoad(prefill_tokens=prefill, decode_itl_s=itl)
    base = worker_saturation(WorkerLoad(prefill_tokens=prefill), off)
    assert worker_saturation(load, off) == base  # off: the pace changes nothing
    s = worker_saturation(load, on)
    assert s == pytest.approx(max(base, itl / limit))
    slower = WorkerLoad(prefill_tokens=prefill, decode_itl_s=itl + more)
    assert worker_saturation(slower, on) >= s
    assert worker_saturation(WorkerLoad(prefill_tokens=prefill), on) == base  # no pace: no term


def test_max_decode_itl_must_be_positive() -> None:
    with pytest.raises(FlowConfigError, match="max_decode_itl_s"):
        SaturationConfig.from_mapping({"max_decode_itl_s": 0})


def test_slow_decoding_holds_new_sessions_and_lets_continuing_turns_through() -> None:
    async def main() -> None:
        clock = Clock()
        det = SaturationDetector(SaturationConfig(max_decode_itl_s=0.05))
        c = FlowController(FlowConfig(), saturation=det, clock=clock)
        slow = [WorkerLoad(decode_itl_s=0.08), WorkerLoad(decode_itl_s=0.06)]
        c.observe_pool(slow)
        assert c.stats().saturated
        new = asyncio.create_task(c.admit("new", "a", 20_000))
        turn = await asyncio.wait_for(c.admit("continuing", "s", 500), 1.0)
        for _ in range(5):
            await asyncio.sleep(0)
        assert not new.done() and c.stats().queued["new"] == 1
        turn.release()
        # the same pool without the term is not saturated: it is the pace that holds
        off = SaturationDetector(SaturationConfig(max_decode_itl_s=None))
        assert off.observe(slow) < 1.0
        assert SaturationConfig().max_decode_itl_s == 0.05  # on by default: 20 tokens/s
        c.observe_pool([WorkerLoad(decode_itl_s=0.03), WorkerLoad(decode_itl_s=0.04)])
        (await asyncio.wait_for(new, 1.0)).release()
        assert c.stats().in_flight == 0

    asyncio.run(main())


def test_a_worker_too_slow_alone_is_left_out_of_the_pace_term() -> None:
    clock = Clock()
    book = LoadBook(clock=clock)
    book.decoded("w0", 0.2)  # finished with nothing else of ours decoding: its pace alone
    f = book.start("w0", uncached_tokens=10, context_tokens=100)
    book.first_token(f)
    book.decoded("w0", 0.4)  # with company: the alone figure stays
    load = book.load("w0")
    assert load.decode_itl_alone_s == pytest.approx(0.2)
    assert load.decode_itl_s == pytest.approx(geo(0.2, 0.4))
    cfg = SaturationConfig()
    assert worker_saturation(load, cfg) == 0.0  # ≈ 0.21 s/token, 0.2 alone: no limit helps
    fast_alone = WorkerLoad(decode_itl_s=0.24, decode_itl_alone_s=0.01)
    assert worker_saturation(fast_alone, cfg) == pytest.approx(0.24 / 0.05)
    unknown = WorkerLoad(decode_itl_s=0.24)  # never seen alone: the term applies
    assert worker_saturation(unknown, cfg) == pytest.approx(0.24 / 0.05)


@given(st.lists(st.floats(1e-4, 10.0), min_size=1, max_size=40))
def test_the_running_pace_stays_within_what_was_seen(paces: list[float]) -> None:
    clock = Clock()
    book = LoadBook(clock=clock)
    f = book.start("w0", uncached_tokens=1, context_tokens=1)
    book.first_token(f)
    for p in paces:
        book.decoded("w0", p)
    got = book.load("w0").decode_itl_s
    assert got is not None and min(paces) * (1 - 1e-9) <= got <= max(paces) * (1 + 1e-9)
    # one stall (a request 100× slower) moves a geometric mean by a factor, not by its size
    before = got
    book.decoded("w0", before * 100)
    assert book.load("w0").decode_itl_s == pytest.approx(before * 100 ** LoadParams().itl_weight)
