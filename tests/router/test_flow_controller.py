"""Flow control: band priority, least-attained-service fairness, TTL, shedding, cancellation,
the saturation gate — asyncio with a fake clock and a switchable saturation signal."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from beamserve.router.flow import (
    FlowConfig,
    FlowConfigError,
    FlowController,
    SaturationConfig,
    SaturationDetector,
    Shed,
    Ticket,
)
from beamserve.router.types import BANDS, Band, WorkerLoad
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


class Switch:
    """A saturation signal the test flips."""

    def __init__(self, on: bool = False) -> None:
        self.on = on

    def saturated(self, now: float) -> bool:
        return self.on


def make(**config: Any) -> tuple[FlowController, FakeClock, Switch]:
    """A controller on a fake clock and switch; continuing turns gated like every band unless
    `hold_continuing=False` is given (the gate's mechanics are what these tests are about)."""
    config.setdefault("hold_continuing", True)
    clock, switch = FakeClock(), Switch()
    return FlowController(FlowConfig(**config), saturation=switch, clock=clock), clock, switch


def run(main: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(main())  # type: ignore[arg-type]


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_admits_at_once_when_not_saturated() -> None:
    async def main() -> None:
        c, _, _ = make()
        ticket = await c.admit("new", "t1", 100)
        got = (ticket.band, ticket.tenant, ticket.cost_tokens, ticket.waited_s)
        assert got == ("new", "t1", 100, 0.0)
        s = c.stats()
        assert s.admitted["new"] == 1 and s.in_flight == 1 and s.in_flight_tokens == 100
        ticket.release()
        ticket.release()  # idempotent
        assert c.stats().in_flight == 0 and c.stats().in_flight_tokens == 0

    run(main)


def test_async_context_manager_releases() -> None:
    async def main() -> None:
        c, _, _ = make()
        async with await c.admit("new", "t1", 50) as ticket:
            assert isinstance(ticket, Ticket) and c.stats().in_flight == 1
        assert ticket.released and c.stats().in_flight == 0

    run(main)


async def _gate_order(
    c: FlowController, switch: Switch, submits: list[tuple[Band, str]]
) -> list[str]:
    """Hold one ticket, saturate, queue `submits` (cost 10 each), then free room one release at
    a time; returns the labels in dispatch order."""
    holder = await c.admit("new", "holder", 10)
    switch.on = True
    order: list[str] = []

    async def one(band: Band, tenant: str, label: str) -> None:
        t = await c.admit(band, tenant, 10)
        order.append(label)
        await asyncio.sleep(0)
        t.release()

    tasks = [asyncio.create_task(one(b, t, f"{b}:{t}:{i}")) for i, (b, t) in enumerate(submits)]
    await settle()
    assert order == [] and sum(c.stats().queued.values()) == len(submits)
    holder.release()  # frees 10 tokens of room; each admitted request frees its room in turn
    await asyncio.gather(*tasks)
    return order


def test_band_priority_order_under_saturation() -> None:
    async def main() -> None:
        c, _, switch = make()
        order = await _gate_order(
            c, switch, [("sheddable", "a"), ("new", "b"), ("continuing", "c"), ("new", "d")]
        )
        assert [o.split(":")[0] for o in order] == ["continuing", "new", "new", "sheddable"]

    run(main)


def test_ungated_continuing_turns_pass_a_saturated_gate_and_lower_bands_still_wait() -> None:
    async def main() -> None:
        c, _, switch = make(hold_continuing=False)
        holder = await c.admit("new", "holder", 10)
        switch.on = True
        waiting = asyncio.create_task(c.admit("new", "n", 10))
        await settle()
        turn = await asyncio.wait_for(c.admit("continuing", "s", 5000), 1.0)  # no room needed
        assert turn.waited_s == 0.0 and not waiting.done()
        s = c.stats()
        assert (s.queued["new"], s.admitted["continuing"], s.in_flight) == (1, 1, 2)
        turn.release()  # its room serves the queued new session as before
        holder.release()
        (await asyncio.wait_for(waiting, 1.0)).release()
        assert c.stats().in_flight == 0

        assert FlowConfig().hold_continuing is False  # the default: not gated
        held, _, switch = make(hold_continuing=True)  # gated like every band
        keep = await held.admit("new", "holder", 10)
        switch.on = True
        gated = asyncio.create_task(held.admit("continuing", "s", 5000))
        await settle()
        assert not gated.done() and held.stats().queued["continuing"] == 1
        keep.release()
        gated.cancel()

    run(main)


def test_least_attained_service_interleaves_tenants() -> None:
    async def main() -> None:
        c, _, switch = make()
        subs: list[tuple[Band, str]] = [("new", "A")] * 4 + [("new", "B")] * 4
        order = await _gate_order(c, switch, subs)
        assert [o.split(":")[1] for o in order] == ["A", "B", "A", "B", "A", "B", "A", "B"]

    run(main)


def test_tenant_with_more_recent_service_waits_and_decay_forgets() -> None:
    async def main() -> None:
        c, _, switch = make(las_half_life_s=60.0)
        (await c.admit("new", "heavy", 10)).release(50_000)  # heavy attained a lot
        (await c.admit("new", "light", 10)).release(100)
        order = await _gate_order(c, switch, [("new", "heavy"), ("new", "light")])
        assert [o.split(":")[1] for o in order] == ["light", "heavy"]

        c, clock, switch = make(las_half_life_s=1.0)
        (await c.admit("new", "heavy", 10)).release(50_000)
        clock.advance(20.0)  # 50,000 · 2^-20 ≈ 0.05 tokens left
        (await c.admit("new", "light", 10)).release(100)  # light's 100 tokens are recent
        order = await _gate_order(c, switch, [("new", "light"), ("new", "heavy")])
        assert [o.split(":")[1] for o in order] == ["heavy", "light"]

    run(main)


def test_ttl_expiry_sheds_with_retry_after() -> None:
    async def main() -> None:
        c, clock, switch = make(band_ttl_s={"sheddable": 2.0})
        switch.on = True
        short = asyncio.create_task(c.admit("sheddable", "a", 10))
        custom = asyncio.create_task(c.admit("new", "b", 10, ttl_s=5.0))
        default = asyncio.create_task(c.admit("new", "c", 10))  # ttl 60
        await settle()
        clock.advance(3.0)
        c.poll()
        await settle()
        with pytest.raises(Shed) as err:
            await short
        assert err.value.reason == "ttl" and err.value.http_status == 503
        assert isinstance(err.value.retry_after_s, int) and 1 <= err.value.retry_after_s <= 60
        assert not custom.done()
        clock.advance(3.0)
        c.poll()
        with pytest.raises(Shed):
            await custom
        assert not default.done()
        s = c.stats()
        assert s.shed[("sheddable", "ttl")] == 1 and s.shed[("new", "ttl")] == 1
        assert s.queued["new"] == 1
        default.cancel()
        await settle()
        assert c.stats().queued["new"] == 0 and c.stats().cancelled["new"] == 1

    run(main)


def test_ttl_fires_on_the_real_clock_too() -> None:
    async def main() -> None:
        c = FlowController(saturation=Switch(True))
        with pytest.raises(Shed) as err:
            await asyncio.wait_for(c.admit("new", "a", 1, ttl_s=0.05), timeout=2.0)
        assert err.value.reason == "ttl"
        c.close()

    run(main)


def test_overload_sheds_lowest_band_first_newest_first() -> None:
    async def main() -> None:
        c, _, switch = make(max_queued=3)
        switch.on = True
        s1 = asyncio.create_task(c.admit("sheddable", "a", 1))
        s2 = asyncio.create_task(c.admit("sheddable", "a", 1))
        n1 = asyncio.create_task(c.admit("new", "a", 1))
        await settle()
        c1 = asyncio.create_task(c.admit("continuing", "a", 1))
        await settle()
        assert s2.done() and not s1.done()  # newest of the lowest band goes first
        err = s2.exception()
        assert isinstance(err, Shed) and err.reason == "overload" and err.http_status == 429
        c2 = asyncio.create_task(c.admit("continuing", "a", 1))
        await settle()
        assert s1.done() and isinstance(s1.exception(), Shed)
        c3 = asyncio.create_task(c.admit("new", "a", 1))  # nothing below "new": refused
        await settle()
        assert isinstance(c3.exception(), Shed) and not n1.done()
        c4 = asyncio.create_task(c.admit("continuing", "a", 1))  # evicts n1
        await settle()
        assert isinstance(n1.exception(), Shed)
        c5 = asyncio.create_task(c.admit("continuing", "a", 1))  # only continuing queued
        await settle()
        assert isinstance(c5.exception(), Shed)
        s = c.stats()
        assert s.queued == {"continuing": 3, "new": 0, "sheddable": 0}
        assert s.shed[("sheddable", "overload")] == 2 and s.shed[("new", "overload")] == 2
        assert s.shed[("continuing", "overload")] == 1
        switch.on = False
        c.poll()
        for t in await asyncio.gather(c1, c2, c4):
            t.release()

    run(main)


def test_band_queue_limit_refuses_that_band_only() -> None:
    async def main() -> None:
        c, _, switch = make(band_max_queued={"sheddable": 1})
        switch.on = True
        first = asyncio.create_task(c.admit("sheddable", "a", 1))
        await settle()
        with pytest.raises(Shed) as err:
            await c.admit("sheddable", "b", 1)
        assert err.value.reason == "overload"
        other = asyncio.create_task(c.admit("new", "b", 1))
        await settle()
        assert not first.done() and not other.done()
        first.cancel()
        other.cancel()
        await settle()
        assert sum(c.stats().queued.values()) == 0

    run(main)


def test_retry_after_from_drain_rate() -> None:
    async def main() -> None:
        c, clock, switch = make(drain_window_s=10.0, retry_after_max_s=30)
        assert c.retry_after_s("new") == 30  # nothing drained yet: the bound
        for _ in range(20):  # 20 dispatches in the 10 s window: 2 per second
            (await c.admit("new", "a", 1)).release()
            clock.advance(0.25)
        switch.on = True
        waiting = [asyncio.create_task(c.admit("new", "a", 1)) for _ in range(7)]
        await settle()
        assert c.retry_after_s("new") == 4  # ceil((7 + 1) / 2)
        assert c.retry_after_s("continuing") == 1  # nothing queued ahead: ceil(1/2) → 1
        for t in waiting:
            t.cancel()
        await settle()

    run(main)


def test_saturation_gate_room_from_completions() -> None:
    async def main() -> None:
        c, _, switch = make()
        a = await c.admit("new", "a", 100)
        b = await c.admit("new", "b", 100)
        switch.on = True
        big = asyncio.create_task(c.admit("new", "c", 150))
        await settle()
        assert not big.done()
        a.release()  # room 100 < 150, and b still in flight → wait
        await settle()
        assert not big.done() and c.stats().room_tokens == 100
        b.release()  # room 200 ≥ 150 → dispatch
        await settle()
        t = big.result()
        assert c.stats().room_tokens == 50
        switch.on = False
        t.release()
        assert c.stats().in_flight == 0

    run(main)


def test_large_item_dispatches_when_nothing_else_in_flight() -> None:
    async def main() -> None:
        c, _, switch = make()
        a = await c.admit("new", "a", 10)
        switch.on = True
        big = asyncio.create_task(c.admit("new", "c", 1000))
        await settle()
        a.release()  # room 10 < 1000 but nothing left in flight
        await settle()
        big.result().release()

    run(main)


def test_cancelled_waiter_leaves_no_queued_item() -> None:
    async def main() -> None:
        c, _, switch = make()
        switch.on = True
        task = asyncio.create_task(c.admit("continuing", "a", 10))
        await settle()
        assert c.stats().queued["continuing"] == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        s = c.stats()
        assert s.queued["continuing"] == 0 and s.cancelled["continuing"] == 1
        switch.on = False
        c.poll()
        assert c.stats().in_flight == 0

    run(main)


def test_cancel_right_after_dispatch_releases_the_ticket() -> None:
    async def main() -> None:
        c, _, switch = make()
        holder = await c.admit("new", "h", 10)
        switch.on = True
        task = asyncio.create_task(c.admit("new", "a", 10))
        await settle()
        holder.release()  # dispatches the waiter synchronously ...
        task.cancel()  # ... but its caller is cancelled before it resumes
        with pytest.raises(asyncio.CancelledError):
            await task
        s = c.stats()
        assert s.admitted["new"] == 2 and s.in_flight == 0 and s.in_flight_tokens == 0

    run(main)


def test_saturation_detector_formula() -> None:
    det = SaturationDetector()
    assert not det.saturated(0.0)  # no snapshot yet
    # worker 1: 32768/65536 = 0.5 (stale scrape ignored); worker 2: max(0, 4/5, 0.72/0.8) = 0.9
    loads = [
        WorkerLoad(prefill_tokens=32768, queue_len=50, kv_usage=1.0, scraped_age_s=30.0),
        WorkerLoad(queue_len=4, kv_usage=0.72, scraped_age_s=0.5),
        WorkerLoad(prefill_tokens=10**9, healthy=False),  # unhealthy: not averaged
    ]
    assert det.observe(loads) == pytest.approx(0.7)
    assert not det.saturated(0.0)
    # a worker past full counts as full (the threshold) in the mean
    assert det.observe([WorkerLoad(queue_len=6, scraped_age_s=0.0)]) == pytest.approx(1.0)
    assert det.saturated(0.0)
    assert det.observe([WorkerLoad(healthy=False)]) == float("inf")


def test_one_worker_past_full_does_not_hide_another_ones_room() -> None:
    # a 144K-token prompt queued on one worker (2.2 × full) and an idle worker beside it: the
    # pool mean of the raw terms (1.1) would hold every new session while a worker idles
    loads = [WorkerLoad(prefill_tokens=144_000), WorkerLoad()]
    capped = SaturationDetector()
    assert capped.observe(loads) == pytest.approx(0.5)
    assert not capped.saturated(0.0)
    raw = SaturationDetector(SaturationConfig(cap_workers_at_threshold=False))
    assert raw.observe(loads) == pytest.approx(144_000 / 65536 / 2)
    assert raw.saturated(0.0)


@example([64365, 64365, 64365], 0.9821269952339919)  # a mean that rounded under the threshold
@given(
    st.lists(st.integers(0, 400_000), min_size=1, max_size=8),
    st.floats(0.5, 3.0),
)
def test_a_capped_pool_is_saturated_exactly_when_every_worker_is(
    prefill: list[int], threshold: float
) -> None:
    det = SaturationDetector(SaturationConfig(threshold=threshold))
    level = det.observe([WorkerLoad(prefill_tokens=p) for p in prefill])
    terms = [p / 65536 for p in prefill]
    assert level <= threshold + 1e-9
    assert det.saturated(0.0) == all(t >= threshold for t in terms)


def test_observe_pool_gates_and_reopens() -> None:
    async def main() -> None:
        clock = FakeClock()
        c = FlowController(clock=clock)
        c.observe_pool([WorkerLoad(queue_len=10, scraped_age_s=0.0)])
        task = asyncio.create_task(c.admit("new", "a", 1))
        await settle()
        assert not task.done() and c.stats().saturated
        c.observe_pool([WorkerLoad(queue_len=1, scraped_age_s=0.0)])
        await settle()
        task.result().release()

    run(main)


def test_config_errors_name_the_key() -> None:
    with pytest.raises(FlowConfigError, match="unknown key 'max_queue'; valid keys: band_max"):
        FlowConfig.from_mapping({"max_queue": 3})
    with pytest.raises(FlowConfigError, match="band_max_queued"):
        FlowConfig.from_mapping({"band_max_queued": {"urgent": 3}})
    assert FlowConfig.from_mapping({"band_ttl_s": {"sheddable": 5}}).band_ttl("sheddable") == 5

    async def main() -> None:
        c, _, _ = make()
        with pytest.raises(FlowConfigError, match="valid bands: continuing, new, sheddable"):
            await c.admit("urgent", "a", 1)  # type: ignore[arg-type]

    run(main)


# --- property: accounting never leaks ----------------------------------------------------------

_submit = st.tuples(
    st.just("submit"),
    st.sampled_from(BANDS),
    st.sampled_from(["a", "b", "c"]),
    st.integers(0, 100),
    st.sampled_from([None, None, 1.0, 5.0]),
)
op = st.one_of(
    _submit,
    _submit,
    _submit,  # arrivals dominate, so queues fill and overload shedding happens
    st.tuples(st.just("advance"), st.floats(0, 8)),
    st.tuples(st.just("saturate"), st.booleans()),
    st.tuples(st.just("release"), st.integers(0, 50), st.integers(0, 500)),
    st.tuples(st.just("cancel"), st.integers(0, 50)),
    st.tuples(st.just("release+cancel"), st.integers(0, 50)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op, min_size=4, max_size=50), st.integers(1, 4), st.booleans())
def test_accounting_invariant_and_no_leaks(
    ops: list[tuple[Any, ...]], max_queued: int, start_saturated: bool
) -> None:
    async def main() -> None:
        c, clock, switch = make(max_queued=max_queued)
        switch.on = start_saturated
        tasks: list[tuple[Band, asyncio.Task[Ticket]]] = []
        held: list[Ticket] = []
        seen: set[int] = set()

        def collect() -> None:
            for i, (_, t) in enumerate(tasks):
                if i in seen or not t.done():
                    continue
                seen.add(i)
                if not t.cancelled() and t.exception() is None:
                    held.append(t.result())

        def check() -> None:
            s = c.stats()
            for b in BANDS:
                assert s.submitted[b] == (
                    s.admitted[b] + s.shed_in(b) + s.cancelled[b] + s.queued[b]
                ), (b, s)
            assert sum(s.queued.values()) == sum(1 for _, t in tasks if not t.done())
            assert sum(s.queued.values()) <= max_queued
            assert s.in_flight == len([h for h in held if not h.released])

        for o in ops:
            before = c.stats()
            if o[0] == "submit":
                _, band, tenant, cost, ttl = o
                task = asyncio.create_task(c.admit(band, tenant, cost, ttl_s=ttl))
                tasks.append((band, task))
            elif o[0] == "release+cancel":  # a waiter is dispatched, then every caller leaves
                live = [h for h in held if not h.released]
                switch.on = True  # the release frees room for exactly what it returns
                if live:
                    live[o[1] % len(live)].release()
                for _, t in tasks:
                    t.cancel()
            elif o[0] == "advance":
                clock.advance(o[1])
                c.poll()
            elif o[0] == "saturate":
                switch.on = o[1]
                c.poll()
            elif o[0] == "release":
                live = [h for h in held if not h.released]
                if live:
                    live[o[1] % len(live)].release(o[2])
            elif o[0] == "cancel":
                pending = [t for _, t in tasks if not t.done()]
                if pending:
                    pending[o[1] % len(pending)].cancel()
            await settle()
            collect()
            check()
            # continuing work is shed for overload only when no lower-band work is queued
            after = c.stats()
            if after.shed[("continuing", "overload")] > before.shed[("continuing", "overload")]:
                for q in (before.queued, after.queued):
                    assert q["new"] == 0 and q["sheddable"] == 0

        switch.on = False
        c.poll()
        await settle()
        collect()
        for h in held:
            h.release()
        await asyncio.gather(*(t for _, t in tasks), return_exceptions=True)
        collect()
        check()
        s = c.stats()
        assert s.in_flight == 0 and s.in_flight_tokens == 0 and sum(s.queued.values()) == 0
        c.close()

    run(main)


# --- adaptive LIFO in the lower bands ------------------------------------------------------------


async def _drain_one_by_one(
    c: FlowController,
    clock: FakeClock,
    switch: Switch,
    arrivals: list[tuple[Band, str, float]],
    steps: list[float],
) -> list[int]:
    """Hold one ticket, saturate, queue one item per `arrivals` entry (band, tenant, seconds
    after the previous arrival; cost 10), then per step: advance the clock, release the ticket
    last dispatched (its room lets exactly one more through). The arrival indexes in dispatch
    order."""
    current = await c.admit("new", "holder", 10)
    switch.on = True
    tasks: list[asyncio.Task[Ticket]] = []
    for band, tenant, gap in arrivals:
        clock.advance(gap)
        tasks.append(asyncio.create_task(c.admit(band, tenant, 10)))
        await settle()
    order: list[int] = []
    for i in range(len(arrivals)):
        clock.advance(steps[i % len(steps)])
        current.release()
        await settle()
        done = [j for j, t in enumerate(tasks) if t.done() and j not in order]
        assert len(done) == 1, (order, done)
        order.append(done[0])
        current = tasks[done[0]].result()
    current.release()
    return order


def test_congested_new_band_goes_newest_first() -> None:
    async def main() -> None:
        # one tenant (an anonymous harness): 5 new sessions 0.4 s apart
        c, clock, switch = make()
        arrivals: list[tuple[Band, str, float]] = [("new", "anon", 0.4)] * 5
        # drained at once: the oldest has waited 1.6 s, less than lifo_after_s → oldest first
        assert await _drain_one_by_one(c, clock, switch, arrivals, [0.0]) == [0, 1, 2, 3, 4]

        c, clock, switch = make()
        # the oldest waited 2.1 s when the drain starts: congested, newest first
        order = await _drain_one_by_one(c, clock, switch, arrivals, [0.5, 0.0, 0.0, 0.0])
        assert order == [4, 3, 2, 1, 0]

        c, clock, switch = make(lifo_after_s=None)  # off: first-in first-out as before
        assert await _drain_one_by_one(c, clock, switch, arrivals, [5.0]) == [0, 1, 2, 3, 4]

    run(main)


def test_lifo_serves_the_oldest_again_before_they_expire() -> None:
    async def main() -> None:
        c, clock, switch = make(lifo_after_s=2.0, lifo_max_wait_s=30.0)
        arrivals: list[tuple[Band, str, float]] = [
            ("new", "anon", 0.0),
            ("new", "anon", 1.0),
            ("new", "anon", 25.0),  # 25 s after the first two
            ("new", "anon", 1.0),
        ]
        # first release at +5 s: the oldest waited 32 s ≥ 30 → the two old ones go first, then
        # the rest (waited 6 and 5 s) newest first
        order = await _drain_one_by_one(c, clock, switch, arrivals, [5.0, 0.0, 0.0, 0.0])
        assert order == [0, 1, 3, 2]
        assert c.stats().shed_in("new") == 0

        # a TTL shorter than twice lifo_max_wait_s: its half is the bound (here 5 s)
        c, clock, switch = make(band_ttl_s={"new": 10.0})
        arrivals = [("new", "anon", 0.0), ("new", "anon", 3.0), ("new", "anon", 0.5)]
        assert await _drain_one_by_one(c, clock, switch, arrivals, [2.5, 0.0]) == [0, 2, 1]
        assert c.stats().shed_in("new") == 0

    run(main)


def test_continuing_turns_stay_first_in_first_out_and_go_before_lifo() -> None:
    async def main() -> None:
        c, clock, switch = make()  # continuing turns held too (make's default)
        arrivals: list[tuple[Band, str, float]] = [
            ("continuing", "anon", 0.0),
            ("new", "anon", 0.5),
            ("continuing", "anon", 0.5),
            ("new", "anon", 0.5),
            ("sheddable", "anon", 0.5),
            ("sheddable", "anon", 0.5),
        ]
        order = await _drain_one_by_one(c, clock, switch, arrivals, [3.0, 0.0])
        assert order == [0, 2, 3, 1, 5, 4]

    run(main)


def test_lifo_picks_among_the_least_served_tenants() -> None:
    async def main() -> None:
        c, clock, switch = make()
        (await c.admit("new", "heavy", 10)).release(50_000)
        arrivals: list[tuple[Band, str, float]] = [
            ("new", "light", 0.0),
            ("new", "light", 0.5),
            ("new", "heavy", 0.5),  # the newest, but its tenant has attained the most
        ]
        order = await _drain_one_by_one(c, clock, switch, arrivals, [3.0, 0.0, 0.0])
        assert order == [1, 0, 2]

    run(main)


def test_lifo_config_errors_name_both_keys() -> None:
    with pytest.raises(FlowConfigError, match=r"'lifo_after_s' .* below 'lifo_max_wait_s'"):
        FlowConfig.from_mapping({"lifo_after_s": 30, "lifo_max_wait_s": 30})
    with pytest.raises(FlowConfigError, match="'lifo_max_wait_s'"):
        FlowConfig.from_mapping({"lifo_max_wait_s": 0})
    assert FlowConfig.from_mapping({"lifo_after_s": None}).lifo_after_s is None


def _lifo_reference(
    enqueued: list[float], dispatch_at: list[float], after: float, max_wait: float
) -> list[int]:
    """The order the module docstring gives, for one tenant of one lower band."""
    left = list(range(len(enqueued)))
    order: list[int] = []
    for now in dispatch_at:
        waited = now - enqueued[left[0]]
        pick = left[-1] if after <= waited < max_wait else left[0]
        order.append(pick)
        left.remove(pick)
    return order


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.floats(0.0, 12.0), min_size=1, max_size=8),
    st.lists(st.floats(0.0, 12.0), min_size=1, max_size=8),
    st.floats(0.5, 5.0),
    st.floats(6.0, 30.0),
)
def test_lifo_order_matches_the_reference(
    gaps: list[float], steps: list[float], after: float, max_wait: float
) -> None:
    async def main() -> None:
        c, clock, switch = make(lifo_after_s=after, lifo_max_wait_s=max_wait, ttl_s=1e6)
        start = clock.t
        enqueued = list(itertools.accumulate(gaps, initial=start))[1:]
        last = enqueued[-1]
        dispatch_at = list(
            itertools.accumulate((steps[i % len(steps)] for i in range(len(gaps))), initial=last)
        )[1:]
        arrivals: list[tuple[Band, str, float]] = [("new", "anon", g) for g in gaps]
        order = await _drain_one_by_one(c, clock, switch, arrivals, steps)
        assert order == _lifo_reference(enqueued, dispatch_at, after, max_wait)
        s = c.stats()
        assert s.admitted["new"] == len(gaps) + 1 and s.in_flight == 0

    run(main)
