"""Replica sync, pure parts (`beamserve.router.sync`): the wire format, merging peers' state by
sequence number, staleness, own-message ignore, coalescing — and its integration into
`LoadBook` (peers' bookings are known load, never counted twice against a scrape) and into the
prefix index (peers' predictions)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from beamserve.router.core import CoreConfig, RoutingCore
from beamserve.router.flow import FlowConfig, FlowController, Ticket
from beamserve.router.index.prefix_index import PrefixIndex
from beamserve.router.load import NO_BOOKING, BookCounts, Flight, LoadBook
from beamserve.router.policy import build_policy
from beamserve.router.sync import (
    Prediction,
    ReplicaSync,
    SyncError,
    SyncMessage,
    SyncParams,
    SyncState,
    decode_message,
    encode_message,
    sync_channel,
)
from beamserve.router.types import BANDS, Endpoint, RouteRequest
from hypothesis import given, settings
from hypothesis import strategies as st

PARAMS = SyncParams(flush_interval_s=0.005, heartbeat_s=1.0, peer_stale_after_s=3.0)
QUEUED = "beamserve_worker_queued_prefill_tokens"

u32 = st.integers(0, 2**32 - 1)
names = st.text(min_size=1, max_size=12)
book_counts = st.builds(BookCounts, u32, u32, u32, u32, u32)
predictions = st.builds(
    Prediction,
    names,
    st.lists(st.integers(0, 2**64 - 1), max_size=40).map(tuple),
    st.integers(1, 60_000).map(lambda ms: ms / 1000),
)
messages = st.builds(
    SyncMessage,
    names,
    st.integers(1, 2**63),
    st.booleans(),
    st.lists(st.tuples(names, book_counts), max_size=8).map(tuple),
    st.lists(predictions, max_size=4).map(tuple),
    u32,
    st.lists(st.tuples(names, u32), max_size=4).map(tuple),
    u32,
    st.lists(st.tuples(names, st.integers(0, 2**64 - 1)), max_size=4).map(tuple),
    st.lists(st.tuples(names, st.integers(0, 2**64 - 1)), max_size=4).map(tuple),
    st.lists(st.tuples(st.sampled_from(BANDS), u32), max_size=3).map(tuple),
)


# --- wire format ---------------------------------------------------------------------------------


@given(messages)
def test_messages_round_trip_through_the_wire_format(msg: SyncMessage) -> None:
    assert decode_message(encode_message(msg)) == msg


def test_block_hashes_travel_as_eight_bytes_each_and_bad_input_is_refused() -> None:
    hashes = tuple(range(1000, 1500))
    small = encode_message(SyncMessage("r", 1, False, (), (Prediction("w0", (), 10.0),)))
    big = encode_message(SyncMessage("r", 1, False, (), (Prediction("w0", hashes, 10.0),)))
    assert len(big) - len(small) == 8 * len(hashes)
    heartbeat = encode_message(
        SyncMessage(
            "host:1:abc", 7, True, tuple((f"w{i}", BookCounts(9, 9, 1, 1, 2)) for i in range(8))
        )
    )
    assert len(heartbeat) < 250  # a heartbeat of 8 workers
    # a negative count (never booked, but clamped on the wire) and a sglang-style signed hash
    odd = SyncMessage("r", 2, False, (("w", BookCounts(-5, 1)),), (Prediction("w", (-3,), 1.0),))
    back = decode_message(encode_message(odd))
    assert back.books[0][1] == BookCounts(0, 1)
    assert back.predictions[0].block_hashes[0] & (2**60 - 1) == -3 & (2**60 - 1)  # same index key
    with pytest.raises(SyncError, match="truncated"):
        decode_message(big[:-3])
    with pytest.raises(SyncError, match="not a replica sync message"):
        decode_message(b"HELLO" + big)
    with pytest.raises(SyncError, match="after its end"):
        decode_message(big + b"x")


def test_a_message_of_the_release_before_is_still_read() -> None:
    # BSY1 ends after the grants: no banked room, no claims, no queue heads
    old = SyncMessage("r", 3, True, (("w0", BookCounts(5, 1, 1, 0, 1)),), (), 2, (("a", 7),))
    new = encode_message(old)
    v1 = b"BSY1" + new[4 : len(new) - (4 + 2 + 2 + 1)]
    assert decode_message(v1) == old
    with pytest.raises(SyncError, match="names band 7"):
        decode_message(new[:-1] + bytes((1, 7)) + (0).to_bytes(4, "little"))


def test_the_channel_derives_from_the_session_key_prefix() -> None:
    assert sync_channel("beamserve:session:") == "beamserve:session-sync"
    assert sync_channel("prod:sessions:") == "prod:sessions-sync"


# --- merging peers' state ------------------------------------------------------------------------


def msg(seq: int, *books: tuple[str, int], full: bool = False, replica: str = "b") -> SyncMessage:
    return SyncMessage(replica, seq, full, tuple((w, BookCounts(p, 0, 1, 0, 1)) for w, p in books))


def test_the_highest_sequence_number_wins_per_worker_and_own_messages_are_ignored() -> None:
    a = SyncState("a", PARAMS)
    a.receive(msg(2, ("w0", 200)), 0.0)
    a.receive(msg(1, ("w0", 100), ("w1", 10)), 0.0)  # late: w0 is older, w1 is new
    assert a.counts("w0", 0.0).prefill_tokens == 200
    assert a.counts("w1", 0.0).prefill_tokens == 10
    a.receive(msg(2, ("w0", 200)), 0.0)  # a duplicate changes nothing
    assert a.counts("w0", 0.0).prefill_tokens == 200
    a.receive(msg(9, ("w0", 999), replica="a"), 0.0)  # its own echo from the channel
    assert a.counts("w0", 0.0).prefill_tokens == 200
    a.receive(msg(1, ("w0", 50), replica="c"), 0.0)  # another peer: sums
    assert a.counts("w0", 0.0) == BookCounts(250, 0, 2, 0, 2)
    assert sorted(a.fresh(0.0)) == ["b", "c"]


def test_a_full_message_empties_the_workers_it_does_not_name_even_against_late_deltas() -> None:
    a = SyncState("a", PARAMS)
    a.receive(msg(3, ("w0", 30), ("w1", 31)), 0.0)
    a.receive(msg(6, ("w1", 60), full=True), 0.0)  # w0 holds nothing as of 6
    assert a.counts("w0", 0.0) == NO_BOOKING
    a.receive(msg(5, ("w0", 50), ("w2", 52)), 0.0)  # older than the heartbeat: ignored
    assert a.counts("w0", 0.0) == NO_BOOKING and a.counts("w2", 0.0) == NO_BOOKING
    a.receive(msg(4, ("w1", 40), full=True), 0.0)  # an older heartbeat: ignored
    assert a.counts("w1", 0.0).prefill_tokens == 60
    a.receive(msg(7, ("w2", 70)), 0.0)
    assert a.counts("w2", 0.0).prefill_tokens == 70


def test_a_peer_unheard_for_peer_stale_after_s_counts_for_nothing() -> None:
    a = SyncState("a", PARAMS)
    a.receive(msg(1, ("w0", 100)), 10.0)
    assert a.counts("w0", 12.9).prefill_tokens == 100
    assert a.counts("w0", 13.0).prefill_tokens == 100  # exactly stale_after: still counts
    assert a.counts("w0", 13.001) == NO_BOOKING  # crashed: its load never leaks
    assert a.fresh(13.001) == []
    a.receive(msg(2), 14.0)  # back (a delta naming nothing): its last state counts again
    assert a.counts("w0", 14.0).prefill_tokens == 100
    a.receive(msg(1, replica="c"), 100.0)  # b is forgotten after forget_after_s
    assert a.peer_books(100.0) == {"c": {}}


def test_params_refuse_a_staleness_that_live_peers_would_reach() -> None:
    with pytest.raises(SyncError, match="must exceed heartbeat_s"):
        SyncParams(heartbeat_s=1.0, peer_stale_after_s=1.0)
    with pytest.raises(SyncError, match="flush_interval_s"):
        SyncParams(flush_interval_s=-1)
    with pytest.raises(SyncError, match="replica_id"):
        SyncState("")


# --- publishing: coalescing, heartbeats ---------------------------------------------------------


def test_flushes_are_coalesced_and_carry_only_changed_workers_until_a_heartbeat() -> None:
    s = SyncState("a", PARAMS)
    book = {"w0": BookCounts(10, 0, 1, 0, 1), "w1": BookCounts(0, 5, 0, 1, 1)}
    get, booked = (lambda w: book.get(w, NO_BOOKING)), (lambda: list(book))
    assert s.flush_at(0.0) is None  # nothing pending
    first = s.flush(0.0, get, booked)  # the first flush is a heartbeat (never sent one)
    assert first is not None and first.full and dict(first.books) == book
    s.changed("w0")
    s.predicted("w0", (1, 2, 3), 10.0)
    s.changed("w0")
    s.predicted("w0", (1, 2, 3), 5.0)  # the same blocks: the longer ttl stays
    assert s.flush_at(0.001) == pytest.approx(0.005)  # at most one flush per interval
    m = s.flush(0.005, get, booked)
    assert m is not None and not m.full and m.seq == first.seq + 1
    assert m.books == (("w0", book["w0"]),)
    assert m.predictions == (Prediction("w0", (1, 2, 3), 10.0),)
    assert s.flush(0.006, get, booked) is None  # nothing changed, no heartbeat due
    assert s.flush_at(0.5) is None
    s.changed("w1")
    assert s.flush_at(0.5) == 0.5  # after a quiet spell: at once
    book.pop("w0")
    beat = s.flush(1.005, get, booked)
    assert beat is not None and beat.full and beat.books == (("w1", book["w1"]),)


def flight_ops(draw: st.DrawFn, n: int) -> list[tuple[str, int, int]]:
    """(op, worker, tokens) with op one of start / first / finish."""
    ops = st.tuples(st.sampled_from(["start", "first", "finish"]), st.integers(0, 3), u32)
    return draw(st.lists(ops, min_size=1, max_size=n))


@st.composite
def histories(draw: st.DrawFn) -> tuple[list[tuple[str, int, int]], list[bool], random.Random]:
    ops = flight_ops(draw, 40)
    flush_after = draw(st.lists(st.booleans(), min_size=len(ops), max_size=len(ops)))
    return ops, flush_after, random.Random(draw(st.integers(0, 2**32)))


def _deliver_mangled(msgs: list[bytes], rng: random.Random) -> list[bytes]:
    """Any loss, duplication and order."""
    out = [m for m in msgs for _ in range(rng.choice((0, 0, 1, 1, 2)))]
    rng.shuffle(out)
    return out


@settings(max_examples=150, deadline=None)
@given(histories())
def test_any_loss_duplication_or_order_converges_to_the_last_state_at_a_heartbeat(
    history: tuple[list[tuple[str, int, int]], list[bool], random.Random],
) -> None:
    ops, flush_after, rng = history
    now = [0.0]
    clock = lambda: now[0]  # noqa: E731
    book = LoadBook(clock=clock)
    sender = SyncState("a", PARAMS)
    book.on_change = sender.changed
    receiver = SyncState("b", PARAMS)
    sent: list[bytes] = []

    def flush(full: bool = False) -> None:
        m = sender.flush(now[0], book.book, book.booked, full=full)
        if m is not None:
            sent.append(encode_message(m))

    flights: list[Flight] = []
    for (op, w, tokens), do_flush in zip(ops, flush_after, strict=True):
        now[0] += 0.01
        live = [f for f in flights if not f.done]
        if op == "start" or not live:
            flights.append(book.start(f"w{w}", tokens % 100_000, tokens % 7_000 + 1))
        elif op == "first":
            book.first_token(live[w % len(live)])
        else:
            book.finish(live[w % len(live)])
        if do_flush:
            flush()
    # (1) whatever happened to the messages, once a heartbeat arrives the receiver holds the
    # sender's book; older messages arriving after it change nothing
    early, late = _deliver_mangled(sent, rng), _deliver_mangled(sent, rng)
    sent.clear()
    flush(full=True)
    for data in [*early, *sent, *late]:
        receiver.receive(decode_message(data), now[0])
    for w in range(4):
        assert receiver.counts(f"w{w}", now[0]) == book.book(f"w{w}")
    # (2) every flight ends: the books return to zero (the deltas may be lost; the heartbeat heals)
    sent.clear()
    for f in flights:
        book.finish(f)
    flush()
    lost = _deliver_mangled(sent, rng)
    now[0] += PARAMS.heartbeat_s + 0.001
    sent.clear()
    flush()  # a heartbeat is due
    assert len(sent) == 1 and decode_message(sent[0]).full
    for data in [*lost, *sent]:
        receiver.receive(decode_message(data), now[0])
    assert book.booked() == []
    for w in range(4):
        assert receiver.counts(f"w{w}", now[0]) == NO_BOOKING


# --- LoadBook: peers' bookings are known load ---------------------------------------------------


class Peers:
    def __init__(self) -> None:
        self.books: dict[str, BookCounts] = {}

    def counts(self, worker: str, now: float) -> BookCounts:
        return self.books.get(worker, NO_BOOKING)


def scrape(book: LoadBook, worker: str, waiting: int, running: int, queued: int, t: float) -> None:
    book.scraped(
        worker,
        {
            "vllm:num_requests_waiting": waiting,
            "vllm:num_requests_running": running,
            QUEUED: queued,
        },
        t,
    )


def test_peers_bookings_count_as_foreign_load_at_once_without_a_scrape() -> None:
    peers = Peers()
    book = LoadBook(clock=lambda: 0.0, peers=peers)
    book.start("w0", 1000, 3000)
    peers.books["w0"] = BookCounts(5000, 40_000, 2, 3, 5)
    ld = book.load("w0", 0.0)
    assert (ld.prefill_tokens, ld.decode_tokens, ld.in_flight) == (1000, 0, 1)  # own only
    assert (ld.foreign_prefill_tokens, ld.foreign_decode_tokens) == (5000, 40_000)
    assert ld.effective_prefill_tokens == 6000
    assert book.load("w1", 0.0) == book.load("w-never-seen", 0.0)  # nothing booked anywhere


@given(
    own=st.integers(0, 10**6),
    peer=st.integers(0, 10**6),
    unreported=st.integers(0, 10**6),
    peer_later=st.integers(0, 10**6),
)
def test_a_scrape_that_includes_the_peers_bookings_does_not_count_them_twice(
    own: int, peer: int, unreported: int, peer_later: int
) -> None:
    peers = Peers()
    book = LoadBook(clock=lambda: 0.0, peers=peers)
    book.start("w0", own, 10)
    peers.books["w0"] = BookCounts(peer, 0, 1, 0, 1)
    # the engine holds all of it, and work no replica reported (one without sync)
    scrape(book, "w0", 3, 0, own + peer + unreported, 0.0)
    ld = book.load("w0", 0.1)
    assert ld.effective_prefill_tokens == own + peer + unreported
    assert ld.foreign_prefill_tokens == peer + unreported
    # the peer's booking changes after the scrape: the change shows at once, once
    peers.books["w0"] = BookCounts(peer_later, 0, 1, 0, 1)
    ld = book.load("w0", 0.2)
    assert ld.effective_prefill_tokens == own + peer_later + unreported
    assert ld.prefill_tokens == own


def test_queue_length_follows_the_peers_changes_since_the_scrape() -> None:
    peers = Peers()
    book = LoadBook(clock=lambda: 0.0, peers=peers)
    peers.books["w0"] = BookCounts(100, 0, 1, 0, 1)
    scrape(book, "w0", 1, 0, 100, 0.0)  # the engine's one waiting request is the peer's
    assert book.load("w0", 0.1).queue_len == 1
    peers.books["w0"] = BookCounts(300, 0, 3, 0, 3)  # two more since
    assert book.load("w0", 0.1).queue_len == 3
    peers.books["w0"] = NO_BOOKING  # the peer went stale (or finished)
    assert book.load("w0", 0.1).queue_len == 0


def test_the_load_book_reports_each_change_of_its_own_book() -> None:
    changed: list[str] = []
    book = LoadBook(on_change=changed.append)
    f = book.start("d0", 100, 200, prefill="p0")
    book.first_token(f)
    book.finish(f)
    book.finish(f)  # twice: nothing changes, nothing reported
    assert changed == ["d0", "p0"] * 3
    assert book.booked() == [] and book.book("d0") == NO_BOOKING


# --- ReplicaSync: one replica's book and predictions reach the other ----------------------------


class Bus:
    """Two or more replicas on a manual clock: publish → every other member, `lag` later."""

    def __init__(self, lag: float = 0.002) -> None:
        self.now = 0.0
        self.lag = lag
        self.timers: list[tuple[float, int, Callable[[], None]]] = []
        self.members: list[ReplicaSync] = []
        self._n = 0

    def call_later(self, delay: float, fn: Callable[[], None]) -> None:
        self._n += 1
        self.timers.append((self.now + max(delay, 0.0), self._n, fn))

    def advance(self, dt: float) -> None:
        end = self.now + dt
        while True:
            due = sorted(t for t in self.timers if t[0] <= end)
            if not due:
                break
            self.timers.remove(due[0])
            self.now = due[0][0]
            due[0][2]()
        self.now = end

    def add(self, name: str, policy: str = "least-load") -> tuple[ReplicaSync, RoutingCore]:
        clock = lambda: self.now  # noqa: E731
        core = RoutingCore(build_policy(policy), clock=clock, config=CoreConfig())
        k = len(self.members)
        bus = self

        class T:
            def publish(self, data: bytes) -> None:
                for j, m in enumerate(bus.members):
                    if j != k:
                        bus.call_later(bus.lag, lambda m=m: m.deliver(data))

        sync = ReplicaSync(
            SyncState(name, PARAMS), core.loads, core.index, T(), self.call_later, clock
        )
        core.on_predict = sync.predicted
        self.members.append(sync)
        return sync, core


def test_a_replicas_booking_and_prediction_reach_its_peer_within_flush_plus_lag() -> None:
    bus = Bus()
    a, core_a = bus.add("a")
    b, core_b = bus.add("b")
    ep = Endpoint("w0", "sim://w0")
    req = RouteRequest("r1", 640, block_hashes=tuple(range(1, 11)))
    d = core_a.open(req)
    core_a.route(d, [ep])
    core_a.loads.start("w0", 50, 60)  # a second booking in the same instant: one message
    assert core_b.loads.load("w0").foreign_prefill_tokens == 0  # not yet delivered
    bus.advance(0.0021)
    ld = core_b.loads.load("w0")
    assert ld.foreign_prefill_tokens == 640 + 50 and ld.prefill_tokens == 0
    assert a.stats.published == 1 and b.stats.received == 1
    hit = core_b.index.match(req.block_hashes, ["w0"], block_size=64, sliding_window=512)["w0"]
    assert hit.full_blocks == 10 and hit.predicted_blocks == 10  # a's prediction, in b's index
    core_a.first_token(d)
    core_a.finish(d)
    bus.advance(0.001)  # within the flush interval: coalesced, not yet sent
    assert a.stats.published == 1
    bus.advance(0.01)
    ld = core_b.loads.load("w0")
    assert (ld.foreign_prefill_tokens, ld.foreign_decode_tokens) == (50, 0)
    assert a.stats.published == 2
    # a heartbeat keeps a quiet replica's state alive; without one it goes stale
    for _ in range(4):
        bus.advance(0.9)
        a.tick()
    assert core_b.loads.load("w0").foreign_prefill_tokens == 50
    bus.advance(3.1)
    assert core_b.loads.load("w0").foreign_prefill_tokens == 0


def test_replicas_deciding_one_burst_on_the_same_view_spread_it_by_their_rank() -> None:
    # Four synced replicas (the default policy) each get three new requests at the same
    # instant, before any booking can travel. A replica's first pick is no burst yet (its
    # previous decision is long past): all four take the least-loaded worker. From its second
    # pick on, the replica is in a burst and takes the worker at its own rank among the near-
    # best, so the four second picks land on four workers, where the least estimate alone
    # would herd them onto one again.
    bus = Bus()
    members = [bus.add(n, "sticky-until-saturated") for n in "abcd"]
    eps = [Endpoint(f"w{i}", f"sim://w{i}") for i in range(8)]
    for i, ep in enumerate(eps):  # w0 least loaded, then w1, …: one least, no exact tie
        members[0][1].loads.start(ep.id, 100 * i, 100 * i)
    for sync, _ in members:
        sync.tick()  # a heartbeat: every replica hears the other three
    bus.advance(0.1)
    picks: list[list[str]] = []
    for k, (_, core) in enumerate(members):
        picks.append([])
        for j in range(3):
            d = core.open(RouteRequest(f"r{k}-{j}", 4096, block_hashes=(1000 * k + j,)))
            picks[k].append(core.route(d, eps).decode.id)
    assert {p[0] for p in picks} == {"w0"}
    assert len({p[1] for p in picks}) == 4, picks
    assert len({p[2] for p in picks}) == 4, picks


def test_a_garbled_message_is_counted_and_skipped() -> None:
    bus = Bus()
    a, _ = bus.add("a")
    a.deliver(b"garbage")
    a.deliver(b"BSY1")
    assert a.stats.decode_errors == 2 and a.stats.received == 0


# --- flow-control room between replicas ------------------------------------------------------


class Switch:
    def __init__(self) -> None:
        self.on = False

    def saturated(self, now: float) -> bool:
        return self.on


def flow_replica(bus: Bus, name: str) -> tuple[ReplicaSync, FlowController, Switch]:
    """A replica whose flow controller is wired to its sync as `RouterRuntime` wires it."""
    sync, _core = bus.add(name)
    switch = Switch()
    held = FlowConfig(hold_continuing=True)  # the room rules serve gated continuing turns
    flow = FlowController(held, saturation=switch, clock=lambda: bus.now)
    flow.on_spare_room = sync.offer_room
    flow.on_continuing_queued = sync.queue_changed
    sync.on_grant = flow.grant_room
    return sync, flow, switch


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_room_a_saturated_replica_cannot_use_goes_to_the_peer_whose_continuing_turns_wait() -> None:
    async def main() -> None:
        bus = Bus()
        a, fa, sa = flow_replica(bus, "a")
        b, fb, sb = flow_replica(bus, "b")
        held_a = await fa.admit("new", "s0", 100)
        held_b = await fb.admit("new", "s1", 300)
        sa.on = sb.on = True
        waiting = asyncio.create_task(fa.admit("continuing", "s2", 250))
        await _settle()
        bus.advance(0.01)  # a's queued continuing turn reaches b
        assert b.state.waiting_peers(bus.now) == [("a", 1)] and not waiting.done()
        held_b.release()  # nothing queued at b: its 300 tokens of room go to a
        assert fb.stats().room_tokens == 0 and b.stats.room_granted == 300
        bus.advance(0.01)
        await _settle()
        assert waiting.done() and a.stats.room_received == 300
        assert fa.stats().room_tokens == 50  # 300 granted − 250 dispatched
        bus.advance(0.01)
        assert b.state.waiting_peers(bus.now) == []  # a's queue is empty again
        waiting.result().release()
        held_a.release()

    asyncio.run(main())


def test_room_stays_when_no_peer_waits_and_goes_round_when_both_wait() -> None:
    async def main() -> None:
        bus = Bus()
        _a, fa, sa = flow_replica(bus, "a")
        b, fb, sb = flow_replica(bus, "b")
        t1 = await fb.admit("new", "s0", 100)
        t2 = await fb.admit("new", "s1", 100)
        t3 = await fb.admit("new", "s4", 100)  # stays in flight: no empty-pool dispatch
        sa.on = sb.on = True
        t1.release()  # no peer has anything queued: the room stays at b
        assert fb.stats().room_tokens == 100 and b.stats.room_granted == 0
        mine = asyncio.create_task(fb.admit("continuing", "s2", 500))
        theirs = asyncio.create_task(fa.admit("continuing", "s3", 50))
        await _settle()
        bus.advance(0.01)
        # b's own continuing turn waits too, but every replica hands its room on alike: the
        # 100 tokens t2 frees go to a, whose 50-token turn then fits
        t2.release()
        assert fb.stats().room_tokens == 100 and b.stats.room_granted == 100
        bus.advance(0.01)
        await _settle()
        assert theirs.done() and not mine.done()
        theirs.result().release()  # a's release: b's turn waits there, so the room goes to b
        assert fa.stats().room_tokens == 50
        bus.advance(0.01)
        await _settle()
        assert fb.stats().room_tokens == 150 and not mine.done()  # 100 kept + a's 50
        mine.cancel()
        await _settle()
        t3.release()

    asyncio.run(main())


def test_offered_room_splits_evenly_over_the_waiting_peers_and_a_grant_to_an_open_gate_drops() -> (
    None
):
    async def main() -> None:
        bus = Bus()
        _a, fa, sa = flow_replica(bus, "a")
        _b, fb, sb = flow_replica(bus, "b")
        c, _fc, sc = flow_replica(bus, "c")
        hold = [await f.admit("new", f"h{i}", 10) for i, f in enumerate((fa, fb))]
        sa.on = sb.on = sc.on = True
        qa = asyncio.create_task(fa.admit("continuing", "x", 1000))
        qb = asyncio.create_task(fb.admit("continuing", "y", 1000))
        await _settle()
        bus.advance(0.01)
        assert c.offer_room(101) and c.stats.room_granted == 101
        bus.advance(0.01)
        await _settle()
        assert (fa.stats().room_tokens, fb.stats().room_tokens) == (51, 50)
        assert not c.offer_room(0)
        sa.on = False  # a's gate is open: a grant changes nothing there
        fa.grant_room(500)
        assert fa.stats().room_tokens == 51
        for t in (qa, qb):
            t.cancel()
        await _settle()
        for t in hold:
            t.release()

    asyncio.run(main())


def test_an_outage_drops_what_the_peers_last_said_at_once() -> None:
    # A peer's last message may still book requests that ended while Redis was down (the
    # messages saying so are lost): the replica must not keep routing around them for
    # `peer_stale_after_s`.
    from beamserve.router.sync import RedisReplicaSync

    book = LoadBook()
    rs = RedisReplicaSync("redis://127.0.0.1:1/0", "ch", book, PrefixIndex(), replica_id="a")
    changed: list[int] = []
    rs.sync.on_peers_changed = lambda: changed.append(1)
    rs.state.receive(msg(1, ("w0", 900), replica="b", full=True), 0.0)
    assert rs.state.counts("w0", 0.1) != NO_BOOKING
    rs.transport._went_down("subscribe", ConnectionError("reset"))
    assert rs.state.counts("w0", 0.1) == NO_BOOKING and rs.state.fresh(0.1) == []
    assert changed == [1]
    rs.transport._went_down("publish", ConnectionError("reset"))  # same outage: once
    assert changed == [1]


# --- banked room borrowed across replicas; new sessions in the pool's order -----------------


def attached_replica(bus: Bus, name: str, signal: object) -> tuple[ReplicaSync, FlowController]:
    """A replica whose flow controller is wired through `ReplicaSync.attach_flow`, as
    `RouterRuntime` and the replay wire it."""
    sync, _core = bus.add(name)
    held = FlowConfig(hold_continuing=True)  # the room rules serve gated continuing turns
    flow = FlowController(held, saturation=signal, clock=lambda: bus.now)  # type: ignore[arg-type]
    sync.attach_flow(flow)
    return sync, flow


def test_a_turn_borrows_the_room_a_peer_banked_and_the_lender_gives_it_up() -> None:
    async def main() -> None:
        bus = Bus()
        sa, sb = Switch(), Switch()
        a, fa = attached_replica(bus, "a", sa)
        b, fb = attached_replica(bus, "b", sb)
        held_a = [await fa.admit("new", f"s{i}", 100) for i in range(2)]
        held_b = await fb.admit("new", "t", 100)
        sa.on = sb.on = True
        held_a[0].release()  # nothing waits anywhere: a banks the 100 tokens and says so
        assert fa.stats().room_tokens == 100 and a.state.room == 100
        bus.advance(0.01)
        assert b.state.borrowable(bus.now) == [("a", 100)]
        # b has no room of its own; one router would have had a's 100 for this turn
        turn = asyncio.create_task(fb.admit("continuing", "u", 80))
        await _settle()
        assert turn.done() and b.stats.room_borrowed == 80
        assert b.state.borrowable(bus.now) == [("a", 20)]  # its own claim is counted at once
        bus.advance(0.01)
        assert fa.stats().room_tokens == 20 and a.stats.room_lent == 80
        bus.advance(0.01)
        assert b.state.borrowable(bus.now) == [("a", 20)]  # a's report, the claim applied
        # a turn the pool's room does not cover waits, and takes nothing
        big = asyncio.create_task(fb.admit("continuing", "v", 500))
        await _settle()
        assert not big.done() and b.stats.room_borrowed == 80
        big.cancel()
        await _settle()
        for t in (turn.result(), held_a[1], held_b):
            t.release()

    asyncio.run(main())


def test_two_replicas_borrowing_the_same_room_leave_a_debt_the_lenders_releases_repay() -> None:
    async def main() -> None:
        bus = Bus()
        sw = [Switch() for _ in range(3)]
        a, fa = attached_replica(bus, "a", sw[0])
        _b, fb = attached_replica(bus, "b", sw[1])
        _c, fc = attached_replica(bus, "c", sw[2])
        held = [await fa.admit("new", f"s{i}", 100) for i in range(4)]
        for s in sw:
            s.on = True
        held[0].release()
        bus.advance(0.01)
        # b and c borrow a's 100 in the same instant, before either claim reaches a
        tb = asyncio.create_task(fb.admit("continuing", "x", 100))
        tc = asyncio.create_task(fc.admit("continuing", "y", 100))
        await _settle()
        assert tb.done() and tc.done()
        bus.advance(0.01)
        assert fa.stats().room_tokens == -100 and a.stats.room_lent == 200
        assert a.state.room == 0  # a debt is nothing to lend
        mine = asyncio.create_task(fa.admit("continuing", "z", 50))
        await _settle()
        held[1].release()  # repays the debt: a's own turn still waits
        await _settle()
        assert fa.stats().room_tokens == 0 and not mine.done()
        held[2].release()
        await _settle()
        assert mine.done() and fa.stats().room_tokens == 50
        for t in (tb.result(), tc.result(), mine.result(), held[3]):
            t.release()

    asyncio.run(main())


def test_claims_are_running_totals_so_a_lost_or_repeated_message_applies_once() -> None:
    a, b = SyncState("a", PARAMS), SyncState("b", PARAMS)
    no_book: Callable[[str], BookCounts] = lambda w: NO_BOOKING  # noqa: E731
    b.set_room(100)
    a.receive(b.flush(0.0, no_book, list), 0.0)
    assert a.borrowable(0.0) == [("b", 100)]
    a.claim("b", 30)
    m1 = a.flush(0.01, no_book, list)
    assert m1 is not None and m1.claims == (("b", 30),)
    b.receive(m1, 0.01)
    b.receive(m1, 0.01)  # repeated
    assert b.take_debit() == 30
    a.claim("b", 20)
    assert a.borrowable(0.02) == [("b", 50)]  # 100 reported, 50 claimed, none applied yet
    a.flush(0.02, no_book, list)  # lost
    a.claim("b", 5)
    b.receive(a.flush(0.03, no_book, list), 0.03)
    assert b.take_debit() == 25  # the lost 20 with the 5
    b.set_room(45)
    a.receive(b.flush(0.04, no_book, list), 0.04)
    assert a.borrowable(0.04) == [("b", 45)]  # every claim applied: b's report is the truth
    assert a.borrowable(0.04 + PARAMS.peer_stale_after_s + 1) == []  # a stale peer lends nothing


class Headroom:
    """A saturation signal with `headroom` tokens below the threshold (≤ 0: saturated), whose
    first admission after a snapshot passes as `SaturationDetector.admits` does."""

    def __init__(self) -> None:
        self.headroom = 0
        self.pending = 0

    def saturated(self, now: float) -> bool:
        return self.headroom <= 0

    def admits(self, cost: int, *, exempt_first: bool = True) -> bool:
        if exempt_first and self.pending == 0:
            return True
        return self.pending + cost < self.headroom

    def admitted(self, cost: int) -> None:
        self.pending += cost

    def snapshot(self, headroom: int) -> None:
        self.headroom, self.pending = headroom, 0


@dataclass
class TwoQueues:
    """Replicas `a` and `b` on one bus, saturated with work in flight; a new session queued
    at `b` (`old`), then one at `a` a second later (`young`); both heard by the peer."""

    bus: Bus
    b: ReplicaSync
    fa: FlowController
    fb: FlowController
    ga: Headroom
    gb: Headroom
    held: list[Ticket]
    old: asyncio.Task[Ticket]
    young: asyncio.Task[Ticket]


async def two_queued_sessions() -> TwoQueues:
    bus = Bus()
    ga, gb = Headroom(), Headroom()
    _a, fa = attached_replica(bus, "a", ga)
    b, fb = attached_replica(bus, "b", gb)
    ga.snapshot(10**6)
    gb.snapshot(10**6)
    held = [await f.admit("new", f"h{i}", 10) for i, f in enumerate((fa, fb))]
    ga.snapshot(0)
    gb.snapshot(0)  # saturated, with work in flight: new sessions wait
    old = asyncio.create_task(fb.admit("new", "old", 100))
    await _settle()
    bus.advance(1.0)
    young = asyncio.create_task(fa.admit("new", "young", 100))
    await _settle()
    bus.advance(0.01)
    assert not old.done() and not young.done()
    return TwoQueues(bus, b, fa, fb, ga, gb, held, old, young)


def test_when_the_gate_opens_the_session_queued_longest_across_replicas_goes_first() -> None:
    async def main() -> None:
        q = await two_queued_sessions()
        # the pool has room for one session, and each replica would take its own first
        q.ga.snapshot(150)
        q.fa.poll()
        await _settle()
        assert not q.young.done()  # b's session has waited longer
        q.gb.snapshot(150)
        q.fb.poll()
        await _settle()
        assert q.old.done()
        q.bus.advance(0.01)  # b's queue is empty now, and a hears it
        q.ga.snapshot(150)
        q.fa.poll()
        await _settle()
        assert q.young.done()
        for t in (*q.held, q.old.result(), q.young.result()):
            t.release()
        q.bus.advance(0.01)
        assert q.b.state.older_heads("new", q.bus.now, q.bus.now) == 0  # a's is empty too

    asyncio.run(main())


def test_room_for_both_lets_the_younger_session_go_at_once() -> None:
    async def main() -> None:
        q = await two_queued_sessions()
        q.ga.snapshot(250)  # room for this one and the older one at b
        q.fa.poll()
        await _settle()
        assert q.young.done() and not q.old.done()
        for t in (*q.held, q.young.result()):
            t.release()
        q.old.cancel()
        await _settle()

    asyncio.run(main())
