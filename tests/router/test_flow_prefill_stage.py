"""The flow controller's prefill stage (P/D pools): new sessions' long prompts are held while
every prefill worker is busy and go shortest first when one has room; short prompts,
continuing turns and colocated pools are untouched; nothing leaks."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from beamserve.router.flow import FlowConfig, FlowController, PrefillStage, Ticket
from beamserve.router.types import WorkerLoad
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Open:
    """A saturation signal that never saturates."""

    def saturated(self, now: float) -> bool:
        return False


class Pool:
    """Prefill workers' in-flight prefill tokens, as the router's books would say."""

    def __init__(self, *tokens: int) -> None:
        self.tokens = list(tokens)
        self.heads = [0] * len(tokens)  # of those, the prompt each computes now

    def loads(self) -> list[WorkerLoad]:
        return [
            WorkerLoad(prefill_tokens=t, head_prefill_tokens=h)
            for t, h in zip(self.tokens, self.heads, strict=True)
        ]


class Saturated:
    """A saturation signal that always saturates (the decode workers look full)."""

    def saturated(self, now: float) -> bool:
        return True


def make(
    pool: Pool | None, min_tokens: int = 2048, saturation: Any = None, **config: Any
) -> FlowController:
    c = FlowController(FlowConfig(**config), saturation=saturation or Open(), clock=FakeClock())
    if pool is not None:
        c.prefill_stage = PrefillStage(pool.loads, min_tokens)
    return c


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def later(c: FlowController, seconds: float) -> None:
    """`seconds` pass on `c`'s fake clock; the controller looks again and settles."""
    clock: FakeClock = c._clock  # type: ignore[assignment]
    clock.t += seconds
    c.poll()
    await settle()


def test_long_first_prompts_wait_while_every_prefill_worker_is_busy() -> None:
    async def main() -> None:
        pool = Pool(33000, 40000)  # both over the 32,768 default
        c = make(pool)
        held = asyncio.ensure_future(c.admit("new", "s1", 30000))
        await settle()
        assert not held.done() and c.stats().queued["new"] == 1
        pool.tokens[0] = 100  # that prefill finished
        c.poll()
        await settle()
        assert held.done()
        held.result().release()

    asyncio.run(main())


@pytest.mark.parametrize("lead", [True, False])
def test_the_prompt_a_prefill_worker_computes_does_not_hold_its_next(lead: bool) -> None:
    """`prefill_gate_lead` (off by default): a prefill worker computing one long prompt, with
    nothing queued behind it, takes the next now (it would idle for the router's round trip
    between its answer and the next dispatch); once one waits behind the prompt it computes, the
    stage is closed. Without the lead, the prompt being computed counts and the next waits."""

    async def main() -> None:
        pool = Pool(40000)
        pool.heads[0] = 40000  # one long prompt, being computed
        c = make(pool, prefill_gate_lead=lead)
        nxt = asyncio.ensure_future(c.admit("new", "s1", 30000))
        await settle()
        assert nxt.done() is lead
        if lead:
            ticket: Ticket = nxt.result()
            ticket.routed()
            pool.tokens[0] = 70000  # it queues behind the head: 30,000 waiting, under the gate
            after = asyncio.ensure_future(c.admit("new", "s2", 5000))
            await settle()
            assert after.done()  # 30,000 queued < 32,768
            after.result().routed()
            pool.tokens[0] = 75000  # 35,000 queued now
            third = asyncio.ensure_future(c.admit("new", "s3", 5000))
            await settle()
            assert not third.done()
            pool.tokens[0], pool.heads[0] = 35000, 30000  # the head answered; the next computes
            c.poll()
            await settle()
            assert third.done()
            for t in (ticket, after.result(), third.result()):
                t.release()
        else:
            pool.tokens[0] = pool.heads[0] = 0  # that prefill finished
            c.poll()
            await settle()
            assert nxt.done()
            nxt.result().release()
        assert c.stats().in_flight == 0

    asyncio.run(main())


def test_short_prompts_and_continuing_turns_pass_a_busy_stage() -> None:
    async def main() -> None:
        c = make(Pool(50000, 50000))
        short = await asyncio.wait_for(c.admit("new", "s1", 1000), 1)  # not split by P/D
        cont = await asyncio.wait_for(c.admit("continuing", "s2", 30000), 1)
        short.release()
        cont.release()

    asyncio.run(main())


async def split_went_local_waits(
    split: asyncio.Future[Ticket], blocker: Ticket, local: asyncio.Future[Ticket]
) -> None:
    """The split prompt went and the local one waits; once the split one and the blocker are
    released, the room they free lets the local one through."""
    assert split.done() and not local.done()
    split.result().release()
    blocker.release()
    await settle()
    assert local.done()  # room freed by the releases
    local.result().release()


def test_split_prompts_pass_the_saturation_gate_when_the_stage_has_room() -> None:
    """With the pool saturated, a new session's prompt the P/D rule splits goes as soon as a
    prefill worker has room (its prefill does not run on the saturated decode workers), while
    one it does not split (local prefill) waits for the saturation gate's room."""

    async def main() -> None:
        c = make(Pool(0, 50000), saturation=Saturated())
        blocker = await asyncio.wait_for(c.admit("continuing", "s0", 100), 1)  # one in flight
        split = asyncio.ensure_future(c.admit("new", "s1", 30000))
        local = asyncio.ensure_future(c.admit("new", "s2", 1000))
        await settle()
        await split_went_local_waits(split, blocker, local)

    asyncio.run(main())


def test_a_local_prompt_held_for_the_decode_workers_does_not_hold_the_stage() -> None:
    """Shortest first puts a short (local) first turn at the head; held by the saturation
    gate, it must not keep a split one behind it from a prefill worker that has room (the
    stage is that one's only gate)."""

    async def main() -> None:
        pool = Pool(50000, 50000)
        c = make(pool, saturation=Saturated())
        blocker = await asyncio.wait_for(c.admit("continuing", "s0", 100), 1)  # one in flight
        local = asyncio.ensure_future(c.admit("new", "s1", 1000))
        split = asyncio.ensure_future(c.admit("new", "s2", 30000))
        await settle()
        assert not local.done() and not split.done()  # both gates shut
        pool.tokens[0] = 0  # a prefill worker has room; the decode workers still have none
        c.poll()
        await settle()
        await split_went_local_waits(split, blocker, local)
        assert c.stats().in_flight == 0

    asyncio.run(main())


def test_a_split_prompt_held_by_the_stage_does_not_hold_the_local_ones() -> None:
    """The other way round: an overdue split first turn heads the band (overdue items go
    first), the prefill workers are busy, and a short first turn behind it passes the open
    saturation gate at once."""

    async def main() -> None:
        c = make(Pool(50000), lifo_after_s=2.0, lifo_max_wait_s=30.0)
        clock: FakeClock = c._clock  # type: ignore[assignment]
        split = asyncio.ensure_future(c.admit("new", "big", 60000))
        await settle()
        clock.t += 31  # overdue: the head of the band from now on
        local = await asyncio.wait_for(c.admit("new", "small", 1000), 1)
        assert not split.done()
        local.release()
        split.cancel()
        await settle()
        assert c.stats().in_flight == 0 and c.stats().queued["new"] == 0

    asyncio.run(main())


def test_held_prompts_go_shortest_first() -> None:
    async def main() -> None:
        pool = Pool(50000)
        c = make(pool)
        sizes = [40000, 5000, 22000, 3000, 61000]
        futs = {n: asyncio.ensure_future(c.admit("new", f"s{n}", n)) for n in sizes}
        await settle()
        order: list[int] = []
        pool.tokens[0] = 0
        for _ in sizes:
            c.poll()
            await settle()
            done = [n for n, f in futs.items() if f.done() and n not in order]
            assert len(done) == 1, done  # one at a time: the routed one fills the worker
            order.append(done[0])
            ticket: Ticket = futs[done[0]].result()
            ticket.routed()  # booked: the worker shows it …
            pool.tokens[0] = done[0]
            ticket.release()
            pool.tokens[0] = 0  # … and finishes it
        assert order == sorted(sizes)

    asyncio.run(main())


async def _drain_one_at_a_time(c: FlowController, pool: Pool, futs: dict[int, Any]) -> list[int]:
    """Free the one prefill worker for one item at a time; the order the items went in."""
    order: list[int] = []
    pool.tokens[0] = 0
    for _ in range(len(futs)):
        c.poll()
        await settle()
        done = [n for n, f in futs.items() if f.done() and n not in order]
        assert len(done) == 1, done
        order.append(done[0])
        ticket: Ticket = futs[done[0]].result()
        ticket.routed()
        pool.tokens[0] = done[0]
        ticket.release()
        pool.tokens[0] = 0
    return order


@pytest.mark.parametrize(
    ("window", "expected"),
    [
        # those that can still be in time shortest first, then the late ones oldest first
        (2.0, [20000, 30000, 40000, 5000]),
        # shortest first among all: the long late one waits for every shorter one
        (None, [5000, 20000, 30000, 40000]),
    ],
)
def test_items_that_waited_past_the_window_go_after_the_others_oldest_first(
    window: float | None, expected: list[int]
) -> None:
    async def main() -> list[int]:
        pool = Pool(50000)
        c = make(pool, prefill_sjf_window_s=window)
        clock: FakeClock = c._clock  # type: ignore[assignment]
        futs: dict[int, Any] = {}
        for n in (40000, 5000):  # waiting since before the window
            futs[n] = asyncio.ensure_future(c.admit("new", f"s{n}", n))
            await settle()
            clock.t += 0.1
        clock.t += 3.0
        for n in (30000, 20000):  # just came
            futs[n] = asyncio.ensure_future(c.admit("new", f"s{n}", n))
        await settle()
        return await _drain_one_at_a_time(c, pool, futs)

    assert asyncio.run(main()) == expected


def test_an_item_let_through_holds_its_worker_until_routed() -> None:
    async def main() -> None:
        c = make(Pool(0))  # one idle prefill worker
        first = await asyncio.wait_for(c.admit("new", "a", 30000), 1)
        second = asyncio.ensure_future(c.admit("new", "b", 30000))
        await settle()
        assert not second.done()  # the first is not in the books yet, but counts
        first.release()  # gone without being routed (a refusal): its room is back
        c.poll()
        await settle()
        assert second.done()
        second.result().release()

    asyncio.run(main())


def test_overdue_items_go_first_whatever_their_size() -> None:
    async def main() -> None:
        pool = Pool(50000)
        c = make(pool, lifo_after_s=2.0, lifo_max_wait_s=30.0)
        clock: FakeClock = c._clock  # type: ignore[assignment]
        big = asyncio.ensure_future(c.admit("new", "big", 60000))
        await settle()
        clock.t += 31
        small = asyncio.ensure_future(c.admit("new", "small", 3000))
        await settle()
        pool.tokens[0] = 0
        c.poll()
        await settle()
        assert big.done() and not small.done()
        big.result().release()
        small.cancel()
        await settle()

    asyncio.run(main())


def test_a_colocated_pool_or_a_gate_turned_off_changes_nothing() -> None:
    async def main() -> None:
        for c in (make(Pool()), make(None), make(Pool(90000), prefill_gate_tokens=None)):
            t = await asyncio.wait_for(c.admit("new", "s", 60000), 1)
            t.release()
            assert c.stats().in_flight == 0

    asyncio.run(main())


async def drain(c: FlowController, futs: list[Any]) -> None:
    """With the prefill workers free: every item left goes through (routed, then released)
    or was cancelled, each once, and nothing stays counted."""
    for _ in range(len(futs) + 1):
        c.poll()
        await settle()
        for f in futs:
            if f.done() and not f.cancelled():
                t = f.result()
                t.routed()
                t.release()
    assert all(f.done() for f in futs)
    s = c.stats()
    assert s.queued["new"] == 0 and s.in_flight == 0 and s.in_flight_tokens == 0
    assert s.admitted["new"] + s.cancelled["new"] == len(futs)
    assert not c._unrouted and not c._spilling


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.integers(0, 80000), min_size=1, max_size=12),
    busy=st.lists(st.integers(0, 40000), min_size=1, max_size=3),
    cancel=st.sets(st.integers(0, 11)),
)
def test_every_item_is_admitted_or_cancelled_and_the_books_return_to_zero(
    sizes: list[int], busy: list[int], cancel: set[int]
) -> None:
    """Whatever the sizes, the stage's load and cancellations: once the prefill workers are
    free every item left goes through, each exactly once, and nothing stays counted."""

    async def main() -> None:
        pool = Pool(*busy)
        c = make(pool)
        futs = [asyncio.ensure_future(c.admit("new", f"s{i}", n)) for i, n in enumerate(sizes)]
        await settle()
        for i in cancel:
            if i < len(futs) and not futs[i].done():
                futs[i].cancel()
        await settle()
        pool.tokens = [0] * len(busy)
        await drain(c, futs)

    asyncio.run(main())


# --- the spill: a held new session prefilled on a decode worker with room (FlowConfig) -------


class Decoders:
    """Decode workers' room for a spilled prefill, as `RouterRuntime._spill_target` would find
    it: `room[w]` tokens each (a worker is picked while the item, with what was spilled to
    it and not routed yet, fits); records every question asked."""

    def __init__(self, **room: int) -> None:
        self.room = room
        self.asked: list[tuple[int, dict[str, int]]] = []

    def __call__(self, cost: int, pending: Any, lull: bool = False) -> str | None:
        self.asked.append((cost, dict(pending)))
        fits = [w for w, r in self.room.items() if cost + pending.get(w, 0) <= r]
        return max(fits, key=lambda w: self.room[w] - pending.get(w, 0)) if fits else None


def spilling(pool: Pool, decoders: Decoders, **config: Any) -> FlowController:
    c = make(pool, prefill_spill_after_s=1.0, **config)
    c.prefill_stage = PrefillStage(pool.loads, 2048, decoders)
    return c


def test_a_held_item_spills_to_a_decode_worker_with_room_once_it_waited_long_enough() -> None:
    async def main() -> None:
        pool, dec = Pool(50000, 50000), Decoders(d1=40000, d2=0)
        c = spilling(pool, dec)
        fut = asyncio.ensure_future(c.admit("new", "s", 30000))
        await settle()
        assert not fut.done() and not dec.asked  # not waited 1 s yet: not even asked
        await later(c, 1.0)
        assert fut.done()
        t: Ticket = fut.result()
        assert t.spill_to == "d1" and c.spilled == 1 and not t.spill_lull
        assert not c._unrouted  # it takes no prefill worker's room
        t.routed()
        t.release()
        assert c.stats().in_flight == 0 and not c._spilling

    asyncio.run(main())


def test_the_spill_yields_to_a_short_new_session_overdue_at_the_saturation_gate() -> None:
    """A short first turn (not staged) held by the saturation gate for `lifo_max_wait_s` stops
    the spill: it would take the decode workers' room past that gate. Once that turn has gone,
    the spill goes on."""

    async def main() -> None:
        pool, dec = Pool(50000), Decoders(d1=100000)
        c = spilling(pool, dec, saturation=Saturated(), lifo_max_wait_s=5.0)
        clock: FakeClock = c._clock  # type: ignore[assignment]
        blocker = await asyncio.wait_for(c.admit("continuing", "s0", 100), 1)  # one in flight
        short = asyncio.ensure_future(c.admit("new", "a", 1000))
        first = asyncio.ensure_future(c.admit("new", "b", 30000))
        await settle()
        await later(c, 1.5)
        assert first.done() and first.result().spill_to == "d1"  # short waited 1.5 s: spills
        late = asyncio.ensure_future(c.admit("new", "c", 30000))
        await settle()
        await later(c, 4.0)  # the short one has waited 5.5 s, the new long one 4 s
        assert not short.done() and not late.done() and c.spill_yields >= 1
        assert c._spill_check_at <= clock.t + 0.05  # it looks again while it yields
        first.result().release()  # the decode workers' room comes back: the short one goes
        blocker.release()
        await settle()
        assert short.done()
        c.poll()
        await settle()
        assert late.done() and late.result().spill_to == "d1"  # then the spill goes on
        for f in (short, late):
            f.result().release()
        assert c.stats().in_flight == 0 and not c._spilling

    asyncio.run(main())


def test_no_decode_worker_with_room_keeps_it_held_and_looks_again_soon() -> None:
    async def main() -> None:
        pool, dec = Pool(50000), Decoders(d1=10000)
        c = spilling(pool, dec)
        clock: FakeClock = c._clock  # type: ignore[assignment]
        fut = asyncio.ensure_future(c.admit("new", "s", 30000))
        await settle()
        await later(c, 2.0)
        assert not fut.done() and dec.asked
        assert c._spill_check_at <= clock.t + 0.05  # the timer looks again while it waits
        dec.room["d1"] = 30000  # the worker's users gained slack
        c._on_timer()
        await settle()
        assert fut.done() and fut.result().spill_to == "d1"
        fut.result().release()
        assert not c._spilling

    asyncio.run(main())


def test_spilled_items_not_routed_yet_count_against_their_worker() -> None:
    async def main() -> None:
        pool, dec = Pool(50000), Decoders(d1=50000)
        c = spilling(pool, dec)
        a = asyncio.ensure_future(c.admit("new", "a", 30000))
        b = asyncio.ensure_future(c.admit("new", "b", 30000))
        await settle()
        await later(c, 1.5)
        assert a.done() and not b.done()  # 30K + 30K would overfill d1
        assert dec.asked[-1] == (30000, {"d1": 30000})
        a.result().routed()  # now in the worker's books (here: not), no longer pending
        c.poll()
        await settle()
        assert b.done()
        a.result().release()
        b.result().release()

    asyncio.run(main())


def test_the_stage_with_room_or_no_spill_rule_never_spills() -> None:
    async def main() -> None:
        dec = Decoders(d1=10**6)
        c = spilling(Pool(0), dec)  # a prefill worker has room: the item goes there
        t = await asyncio.wait_for(c.admit("new", "s", 30000), 1)
        assert t.spill_to is None and not dec.asked
        t.release()
        off = make(Pool(50000))  # spill off (the default)
        off.prefill_stage = PrefillStage(Pool(50000).loads, 2048, dec)
        clock: FakeClock = off._clock  # type: ignore[assignment]
        fut = asyncio.ensure_future(off.admit("new", "s", 30000))
        await settle()
        clock.t += 10
        off.poll()
        await settle()
        assert not fut.done() and not dec.asked
        fut.cancel()
        await settle()

    asyncio.run(main())


# --- the spill in a lull of new sessions (FlowConfig.prefill_spill_lull_s) ---------------------


class ByLull:
    """The runtime's spill target, asked in a lull or not: `normal`'s room, or `lull`'s."""

    def __init__(self, normal: Decoders, lull: Decoders) -> None:
        self.normal, self.lull = normal, lull

    def __call__(self, cost: int, pending: Any, lull: bool) -> str | None:
        return (self.lull if lull else self.normal)(cost, pending)


def lulling(pool: Pool, normal: Decoders, lull: Decoders, **config: Any) -> FlowController:
    c = make(pool, prefill_spill_after_s=1.0, prefill_spill_lull_s=2.0, **config)
    c.prefill_stage = PrefillStage(pool.loads, 2048, ByLull(normal, lull))
    return c


def test_once_new_sessions_stop_arriving_the_held_ones_spill_by_the_lull_s_rule() -> None:
    """While new sessions keep arriving, a held one spills only where the spill's own rule finds
    room (here: nowhere); once none has arrived for `prefill_spill_lull_s`, the lull's rule
    (the users kept at a lower speed) is asked and the held ones go."""

    async def main() -> None:
        pool = Pool(50000, 50000)
        normal, lull = Decoders(d1=0), Decoders(d1=100000)
        c = lulling(pool, normal, lull)
        a = asyncio.ensure_future(c.admit("new", "a", 30000))
        await settle()
        await later(c, 1.5)  # held 1.5 s, the last arrival 1.5 s ago: no lull yet
        assert not a.done() and normal.asked and not lull.asked
        b = asyncio.ensure_future(c.admit("new", "b", 20000))  # another arrival
        await settle()
        await later(c, 1.5)  # 1.5 s since b: still no lull
        assert not a.done() and not b.done() and not lull.asked
        await later(c, 0.6)  # 2.1 s since b arrived: a lull
        assert a.done() and b.done(), "the lull's rule had room for both"
        assert a.result().spill_to == b.result().spill_to == "d1"
        assert a.result().spill_lull and b.result().spill_lull
        assert c.spilled == 2 and c.lull_spilled == 2
        for f in (a, b):
            f.result().routed()
            f.result().release()
        assert c.stats().in_flight == 0 and not c._spilling

    asyncio.run(main())


def test_a_new_arrival_ends_the_lull() -> None:
    async def main() -> None:
        pool = Pool(50000)
        normal, lull = Decoders(d1=0), Decoders(d1=30000)
        c = lulling(pool, normal, lull)
        a = asyncio.ensure_future(c.admit("new", "a", 30000))
        await settle()
        await later(c, 2.5)
        assert a.done() and c.lull_spilled == 1  # a lull: it went by the lull's rule
        b = asyncio.ensure_future(c.admit("new", "b", 10000))
        await settle()
        asked = len(lull.asked)
        await later(c, 1.2)  # b held 1.2 s, but it arrived 1.2 s ago: the spill's own rule
        assert not b.done() and len(lull.asked) == asked and normal.asked[-1][0] == 10000
        a.result().release()
        b.cancel()
        await settle()
        assert c.stats().in_flight == 0 and not c._spilling

    asyncio.run(main())


def draining(active: int, **config: Any) -> tuple[FlowController, Decoders, Decoders, list[int]]:
    """A lulling controller whose pool has `active` sessions now (`[0]` of the list returned:
    set it to change them), the spill's own rule without room and the lull's with plenty."""
    pool = Pool(50000)
    normal, lull = Decoders(d1=0), Decoders(d1=100000)
    c = lulling(pool, normal, lull, **config)
    count = [active]
    c.active_sessions = lambda: count[0]
    return c, normal, lull, count


def test_a_quiet_spell_at_the_pools_peak_is_no_lull_until_the_pool_drains() -> None:
    """Many sessions opened at once and none since (a closed-loop run's start): quiet, but the
    pool serves as many sessions as ever, so the spill keeps its own rule; once the active
    sessions fall under `prefill_spill_lull_below_peak` of their peak, the lull's rule goes."""

    async def main() -> None:
        c, normal, lull, active = draining(40)
        a = asyncio.ensure_future(c.admit("new", "a", 30000))
        await settle()
        await later(c, 3.0)  # quiet for 3 s, 40 sessions of a peak of 40
        assert not a.done() and normal.asked and not lull.asked
        active[0] = 37  # 0.925 of the peak: not yet under 0.9
        await later(c, 1.0)
        assert not a.done() and not lull.asked
        active[0] = 35  # 0.875 of the peak: draining
        await later(c, 0.1)
        assert a.done() and a.result().spill_lull and c.lull_spilled == 1
        a.result().release()

    asyncio.run(main())


def test_the_peak_is_the_highest_count_within_its_window() -> None:
    """A pool that settled at a lower level long ago is not draining: a peak older than
    `prefill_spill_lull_peak_s` is forgotten."""

    async def main() -> None:
        c, _, lull, active = draining(40, prefill_spill_lull_peak_s=10.0)
        a = asyncio.ensure_future(c.admit("new", "a", 30000))  # the peak, 40, sampled at t=0
        await settle()
        active[0] = 30
        await later(c, 11.0)  # the peak is 11 s old: the window holds 30 alone
        assert not a.done() and not lull.asked
        active[0] = 26  # under 0.9 of 30
        await later(c, 0.1)
        assert a.done() and c.lull_spilled == 1
        a.result().release()

    asyncio.run(main())


def test_without_the_drain_share_any_quiet_spell_is_a_lull() -> None:
    async def main() -> None:
        c, _, _, _ = draining(40, prefill_spill_lull_below_peak=None)  # at its peak: no matter
        a = asyncio.ensure_future(c.admit("new", "a", 30000))
        await settle()
        await later(c, 2.5)
        assert a.done() and c.lull_spilled == 1
        a.result().release()

    asyncio.run(main())


def test_without_a_lull_rule_the_spill_never_asks_for_one() -> None:
    async def main() -> None:
        pool = Pool(50000)
        normal, lull = Decoders(d1=0), Decoders(d1=10**6)
        c = make(pool, prefill_spill_after_s=1.0)  # prefill_spill_lull_s: off (the default)
        c.prefill_stage = PrefillStage(pool.loads, 2048, ByLull(normal, lull))
        a = asyncio.ensure_future(c.admit("new", "a", 30000))
        await settle()
        await later(c, 30.0)
        assert not a.done() and normal.asked and not lull.asked
        a.cancel()
        await settle()

    asyncio.run(main())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.integers(2048, 80000), min_size=1, max_size=10),
    room=st.integers(0, 120000),
    waits=st.lists(st.floats(0, 3), min_size=1, max_size=10),
    cancel=st.sets(st.integers(0, 9)),
)
def test_spills_never_overfill_a_worker_and_the_books_return_to_zero(
    sizes: list[int], room: int, waits: list[float], cancel: set[int]
) -> None:
    """Whatever the sizes, arrival gaps and cancellations: no spill sends a worker more than
    its room before the items are routed; every item is admitted once or cancelled, and
    nothing stays counted."""

    async def main() -> None:
        pool, dec = Pool(90000), Decoders(d1=room)
        c = spilling(pool, dec)
        futs = []
        for i, n in enumerate(sizes):
            futs.append(asyncio.ensure_future(c.admit("new", f"s{i}", n)))
            await settle()
            await later(c, waits[i % len(waits)])
            spilled = [f.result() for f in futs if f.done() and not f.cancelled()]
            assert sum(t.cost_tokens for t in spilled) <= room
        for i in cancel:
            if i < len(futs) and not futs[i].done():
                futs[i].cancel()
        await settle()
        pool.tokens = [0]
        await drain(c, futs)

    asyncio.run(main())


# --- longest first in a lull of new sessions (FlowConfig.prefill_lull_longest_first_s) ----------


async def _arrive(c: FlowController, *sizes: int) -> dict[int, Any]:
    """New sessions of these prompt sizes, 0.1 s apart; their admissions by size."""
    clock: FakeClock = c._clock  # type: ignore[assignment]
    futs: dict[int, Any] = {}
    for n in sizes:
        futs[n] = asyncio.ensure_future(c.admit("new", f"s{n}", n))
        await settle()
        clock.t += 0.1
    return futs


async def _three_late(pool: Pool, lull: float | None) -> tuple[FlowController, dict[int, Any]]:
    """Three new sessions held at the stage (20K, 40K, 30K tokens), then 2.5 s on: every one
    waited past the 2 s window, so none can be in time."""
    c = make(pool, prefill_lull_longest_first_s=lull)
    futs = await _arrive(c, 20000, 40000, 30000)
    c._clock.t += 2.5  # type: ignore[attr-defined]
    return c, futs


@pytest.mark.parametrize(
    ("lull", "expected"),
    [
        (None, [20000, 40000, 30000]),  # late: oldest first
        (2.0, [40000, 30000, 20000]),  # late, and none arrived for 2 s: longest first
        (5.0, [20000, 40000, 30000]),  # … but the last arrived only 2.8 s ago
    ],
)
def test_in_a_lull_the_late_ones_go_longest_first(lull: float | None, expected: list[int]) -> None:
    async def main() -> list[int]:
        pool = Pool(50000)
        c, futs = await _three_late(pool, lull)
        return await _drain_one_at_a_time(c, pool, futs)

    assert asyncio.run(main()) == expected


def test_an_arrival_ends_the_lull_and_goes_first_while_it_can_be_in_time() -> None:
    async def main() -> list[int]:
        pool = Pool(50000)
        c, futs = await _three_late(pool, 2.0)
        order = await _drain_one_at_a_time(c, pool, {40000: futs.pop(40000)})  # the lull's
        pool.tokens[0] = 50000
        futs[45000] = asyncio.ensure_future(c.admit("new", "late-comer", 45000))
        await settle()
        return order + await _drain_one_at_a_time(c, pool, futs)

    # the newcomer first (it can still be in time), then oldest first: no lull since it came
    assert asyncio.run(main()) == [40000, 45000, 20000, 30000]


@pytest.mark.parametrize(
    ("waited", "rescue", "ttl", "order"),
    [
        (32.0, 45.0, 60.0, [40000, 10000]),  # overdue, but in a lull nothing starves
        (46.0, 45.0, 60.0, [10000, 40000]),  # near its TTL: it goes first
        (32.0, 45.0, 40.0, [10000, 40000]),  # the lull's bound is at most ¾ of the TTL (30 s)
        (32.0, None, 60.0, [10000, 40000]),  # null: the overdue bound (30 s) as outside a lull
    ],
)
def test_in_a_lull_only_items_near_their_ttl_go_first(
    waited: float, rescue: float | None, ttl: float, order: list[int]
) -> None:
    """In a lull the late ones go longest first; before them only items that waited
    `prefill_lull_rescue_s` (at most ¾ of the band's TTL), oldest first, so none expires."""

    async def main() -> list[int]:
        pool = Pool(50000)
        c = make(pool, prefill_lull_longest_first_s=2.0, prefill_lull_rescue_s=rescue,
                 ttl_s=ttl)  # fmt: skip
        clock: FakeClock = c._clock  # type: ignore[assignment]
        futs = {10000: asyncio.ensure_future(c.admit("new", "old", 10000))}
        await settle()
        clock.t += waited - 3.0
        futs[40000] = asyncio.ensure_future(c.admit("new", "long", 40000))
        await settle()
        clock.t += 3.0  # the first waited `waited`, the second 3 s; a lull
        return await _drain_one_at_a_time(c, pool, futs)

    assert asyncio.run(main()) == order


@pytest.mark.parametrize(("lull", "first"), [(None, 30000), (2.0, 20000)])
def test_in_a_lull_the_spill_takes_the_shortest_late_one(lull: float | None, first: int) -> None:
    """The spill is the slower way to prefill a prompt (in pieces beside the decodes): in a lull
    it takes the shortest late item and leaves the longest to the prefill workers; otherwise
    the oldest."""

    async def main() -> int:
        pool, dec = Pool(50000, 50000), Decoders(d1=30000)
        c = spilling(pool, dec, prefill_lull_longest_first_s=lull)
        futs = await _arrive(c, 30000, 20000, 25000)
        await later(c, 2.5)  # all late; held past the spill's 1 s
        done = [n for n, f in futs.items() if f.done()]
        assert len(done) == 1, done  # d1 had room for one
        assert futs[done[0]].result().spill_to == "d1"
        for f in futs.values():
            if f.done():
                f.result().release()
            else:
                f.cancel()
        await settle()
        assert c.stats().in_flight == 0 and not c._spilling
        return done[0]

    assert asyncio.run(main()) == first
