"""Replica sync: router replicas behind a plain L4 balancer share their bookings and their
routing-time predictions, so each one sees the others' load without waiting for a scrape.

Without it each replica knows its own book (`beamserve.router.load.LoadBook`) and learns the
other replicas' load only from the workers' `/metrics` (up to one scrape interval old), and its
predictions (`RoutingCore.dispatched` → `PrefixIndex.predict`) reach only its own index, so the
others see a request's prefix once the engine has stored it (seconds, for a long prefill).

What a replica publishes (one `SyncMessage` per flush, `encode_message`)::

    (a) its own book per worker, as absolute state: prefill tokens, decode tokens, prefilling,
        decoding, in flight (`BookCounts`), stamped with a per-replica sequence number;
        only the workers changed since the last flush, and every `heartbeat_s` all of them
        (a *full* message: a worker it leaves out holds nothing of this replica's);
    (b) the routing-time predictions it wrote since the last flush: (worker, block hashes, ttl);
    (c) how many ``continuing`` turns wait in its flow-control queue (absolute, every message),
        and the flow-control *room* it hands to peers since the last flush: (peer, tokens) —
        room freed by a completion while the pool is saturated that nothing queued at this
        replica can use goes to the peers with continuing turns queued, split evenly
        (`ReplicaSync.offer_room`; `beamserve.router.flow.controller`, "Several replicas");
    (d) its *banked* room (room freed here during the saturated spell and not yet used,
        absolute), and per peer two running totals: the room it has *claimed* from that peer
        (borrowed, to dispatch a turn its own room did not cover) and the peer's claims it has
        *applied* (taken out of its own room). A replica may borrow what a peer reported
        banked minus its own claims the peer has not yet applied (`SyncState.borrowable`), so
        the pool's room serves a turn wherever it arrives, as one router's room would;
    (e) how long the item it would dispatch next in the ``new`` and ``sheddable`` bands has
        waited (ms, as of the flush), so that when the pool has room for one more session the
        replica holding the one that has waited longest takes it, as one router's queue would
        (`SyncState.older_heads`; `beamserve.router.flow.controller`, "Several replicas").

State-based and idempotent: a message carries absolute counts, never increments, and per
(peer, worker) the highest sequence number wins (a full message counts as naming every
worker), so a duplicate or late message changes nothing and a lost one heals with the next
message naming that worker, at the latest the next heartbeat. Flushes are coalesced: at most
one per `flush_interval_s` (the first change after a quiet spell flushes at once; changes and
predictions meanwhile merge), so a busy replica does not publish three messages per request.

What a receiver keeps (`SyncState`): each peer's latest book per worker and the local
monotonic time it last heard from the peer (any message). A peer unheard for
`peer_stale_after_s` counts for nothing — a crashed replica's load never leaks — and is
forgotten after `forget_after_s`. Its own messages (the pub/sub channel echoes them) are
ignored. `SyncState.counts(worker, now)`: the fresh peers' books summed, which `LoadBook`
treats as known load beside its own book (`beamserve.router.load`, "Other replicas' books").
Predictions received go into the replica's `PrefixIndex.predict` with their ttl.

Wire format (`encode_message` / `decode_message`, little-endian; a heartbeat of 8 workers is
≈ 250 bytes, a 30K-token prompt's prediction ≈ 3.8 KB: 8 bytes per block)::

    b"BSY2" | u8 flags (1: full) | u64 seq | str replica
    u16 n × (str worker | 5 × u32 prefill_tokens, decode_tokens, prefilling, decoding, in_flight)
    u16 n × (str worker | u32 ttl_ms | u32 k | k × u64 block hash (its low 64 bits))
    u32 continuing turns queued | u16 n × (str peer replica | u32 room tokens)
    u32 banked room | u16 n × (str peer | u64 claimed total)
    u16 n × (str peer | u64 applied total)
    u8 n × (u8 band index in BANDS | u32 waited ms)
    str = u16 length + UTF-8

A ``BSY1`` message (a replica of the release before, which has no (d) and (e)) is still
read: it banks nothing, claims nothing and has nothing queued ahead, so during a rolling
update the two versions share books, predictions and grants (a replica of the release before
refuses ``BSY2``, logged once: it routes on its own book and the scrapes until it is
replaced).

Room grants are the one part that is not state: a lost message loses its room (the pool
keeps its pace a little lower until the next completions), and room resets with every
saturated spell anyway. Claims are state: running totals, so a lost or repeated message
neither loses nor doubles a claim (the next one carries the total). Two replicas may borrow
the same banked room before either claim arrives (a sync delay apart); the lender's room then
goes below zero and its next releases repay it, so the pool's room is kept, late.

Transport (`RedisSyncTransport`): Redis pub/sub on the Redis the replicas already share for
sessions (channel ``{session key prefix without ':'}-sync``, `sync_channel`), publishing from a
bounded outbox in a background task; never blocks or fails serving — Redis down: the outbox is
dropped, each side logs once, reconnects with backoff, and every replica falls back to its own
book plus scrapes (what the peers last said is dropped at once: the messages that would
correct it are lost). `ReplicaSync` wires
one replica's `LoadBook`, `RoutingCore` and `PrefixIndex` to a transport; the benchmark replay
(`beamserve.router.bench.replay`) connects its replicas through an in-process bus instead.

| parameter (`SyncParams`) | default | meaning |
|---|---|---|
| `flush_interval_s` | ``0.005`` | least time between two messages of one replica (s) |
| `heartbeat_s` | ``1.0`` | a full message at least this often (s) |
| `peer_stale_after_s` | ``3.0`` | a peer unheard this long counts for nothing (s) |
| `forget_after_s` | ``60.0`` | a peer unheard this long is dropped from memory (s) |

Config example (router flags)::

    beamserve router --redis redis://redis:6379/0 ...           # sync on (the default)
    beamserve router --redis redis://redis:6379/0 --no-replica-sync
    beamserve router --redis ... --sync-channel beamserve:prod-sync
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import secrets
import socket
import struct
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import redis.asyncio as aioredis
import structlog
from beamserve.router.index.prefix_index import PrefixIndex
from beamserve.router.load import NO_BOOKING, BookCounts, LoadBook
from beamserve.router.types import BANDS, Band
from redis.exceptions import RedisError

if TYPE_CHECKING:
    from beamserve.router.flow.controller import FlowController

log = structlog.get_logger(__name__)

# Each step of closing the transport: a shutdown never hangs on Redis.
CLOSE_TIMEOUT_S = 5.0

MAGIC = b"BSY2"
MAGIC_V1 = b"BSY1"  # the release before: no banked room, no claims (module docstring)
_U32_MAX = (1 << 32) - 1
_U64_MASK = (1 << 64) - 1
_HEAD = struct.Struct("<4sBQ")
_U16 = struct.Struct("<H")
_BOOK = struct.Struct("<5I")
_PRED = struct.Struct("<II")
_U32S = struct.Struct("<I")
_U64S = struct.Struct("<Q")
_HEAD_AGE = struct.Struct("<BI")


class SyncError(ValueError):
    """Replica sync configured wrongly, or a message that cannot be decoded."""


@dataclass(frozen=True)
class SyncParams:
    """See the module docstring's parameter table."""

    flush_interval_s: float = 0.005
    heartbeat_s: float = 1.0
    peer_stale_after_s: float = 3.0
    forget_after_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("flush_interval_s", "heartbeat_s", "peer_stale_after_s", "forget_after_s"):
            if not getattr(self, name) >= 0:
                raise SyncError(f"{name}: must be ≥ 0, got {getattr(self, name)}")
        if self.peer_stale_after_s <= self.heartbeat_s:
            raise SyncError(
                f"peer_stale_after_s ({self.peer_stale_after_s}) must exceed heartbeat_s "
                f"({self.heartbeat_s}), e.g. 3 × heartbeat_s, or live peers go stale"
            )


@dataclass(frozen=True, slots=True)
class Prediction:
    """A routing-time prediction: `worker` will hold these blocks for `ttl_s` seconds."""

    worker: str
    block_hashes: tuple[int, ...]
    ttl_s: float


@dataclass(frozen=True, slots=True)
class SyncMessage:
    """One flush of one replica (module docstring). `books`: (worker, absolute book); `full`:
    every worker the replica holds anything on is in `books` (the others hold nothing)."""

    replica: str
    seq: int
    full: bool
    books: tuple[tuple[str, BookCounts], ...] = ()
    predictions: tuple[Prediction, ...] = ()
    queued: int = 0  # continuing turns in this replica's flow-control queue
    grants: tuple[tuple[str, int], ...] = ()  # (peer replica, room tokens)
    room: int = 0  # banked flow-control room (tokens, ≥ 0)
    claims: tuple[tuple[str, int], ...] = ()  # (peer, total room claimed from it)
    applied: tuple[tuple[str, int], ...] = ()  # (peer, total of its claims taken from `room`)
    heads: tuple[tuple[Band, int], ...] = ()  # (band, ms its next queued item has waited)


# --- wire format ---------------------------------------------------------------------------------


def _put_str(out: list[bytes], text: str) -> None:
    raw = text.encode("utf-8")
    if len(raw) > 0xFFFF:
        raise SyncError(f"name of {len(raw)} bytes: at most 65535 (worker or replica id)")
    out.append(_U16.pack(len(raw)))
    out.append(raw)


def _u32(x: int) -> int:
    return 0 if x < 0 else (x if x < _U32_MAX else _U32_MAX)


def encode_message(msg: SyncMessage) -> bytes:
    """`msg` as bytes (module docstring, "Wire format"); counts clamp to [0, 2³² − 1]."""
    out: list[bytes] = [_HEAD.pack(MAGIC, 1 if msg.full else 0, msg.seq & _U64_MASK)]
    _put_str(out, msg.replica)
    out.append(_U16.pack(len(msg.books)))
    for worker, b in msg.books:
        _put_str(out, worker)
        out.append(
            _BOOK.pack(
                _u32(b.prefill_tokens),
                _u32(b.decode_tokens),
                _u32(b.prefilling),
                _u32(b.decoding),
                _u32(b.in_flight),
            )
        )
    out.append(_U16.pack(len(msg.predictions)))
    for p in msg.predictions:
        _put_str(out, p.worker)
        hashes = p.block_hashes
        out.append(_PRED.pack(_u32(round(p.ttl_s * 1000)), len(hashes)))
        out.append(struct.pack(f"<{len(hashes)}Q", *(h & _U64_MASK for h in hashes)))
    out.append(_U32S.pack(_u32(msg.queued)))
    out.append(_U16.pack(len(msg.grants)))
    for peer, tokens in msg.grants:
        _put_str(out, peer)
        out.append(_U32S.pack(_u32(tokens)))
    out.append(_U32S.pack(_u32(msg.room)))
    for totals in (msg.claims, msg.applied):
        out.append(_U16.pack(len(totals)))
        for peer, total in totals:
            _put_str(out, peer)
            out.append(_U64S.pack(max(total, 0) & _U64_MASK))
    out.append(bytes((len(msg.heads),)))
    for band, waited_ms in msg.heads:
        out.append(_HEAD_AGE.pack(BANDS.index(band), _u32(waited_ms)))
    return b"".join(out)


class _Reader:
    __slots__ = ("at", "data")

    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 0

    def take(self, n: int) -> bytes:
        end = self.at + n
        if end > len(self.data):
            raise SyncError(f"sync message truncated at byte {len(self.data)} (needs {end})")
        chunk = self.data[self.at : end]
        self.at = end
        return chunk

    def unpack(self, s: struct.Struct) -> tuple[Any, ...]:
        return s.unpack(self.take(s.size))

    def text(self) -> str:
        (n,) = self.unpack(_U16)
        try:
            return self.take(n).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SyncError(f"sync message: a name is not UTF-8 ({exc})") from None


def decode_message(data: bytes) -> SyncMessage:
    """The message `encode_message` wrote; raises `SyncError` for anything else."""
    r = _Reader(bytes(data))
    magic, flags, seq = r.unpack(_HEAD)
    if magic not in (MAGIC, MAGIC_V1):
        raise SyncError(f"not a replica sync message (starts {magic!r}, expected {MAGIC!r})")
    replica = r.text()
    (n,) = r.unpack(_U16)
    books = []
    for _ in range(n):
        worker = r.text()
        books.append((worker, BookCounts(*r.unpack(_BOOK))))
    (n,) = r.unpack(_U16)
    preds = []
    for _ in range(n):
        worker = r.text()
        ttl_ms, k = r.unpack(_PRED)
        hashes = struct.unpack(f"<{k}Q", r.take(8 * k))
        preds.append(Prediction(worker, hashes, ttl_ms / 1000.0))
    (queued,) = r.unpack(_U32S)
    (n,) = r.unpack(_U16)
    grants = []
    for _ in range(n):
        peer = r.text()
        grants.append((peer, r.unpack(_U32S)[0]))
    room = 0
    lists: list[tuple[tuple[str, int], ...]] = [(), ()]
    heads: list[tuple[Band, int]] = []
    if magic == MAGIC:
        (room,) = r.unpack(_U32S)
        for i in range(2):
            (n,) = r.unpack(_U16)
            lists[i] = tuple((r.text(), r.unpack(_U64S)[0]) for _ in range(n))
        for _ in range(r.take(1)[0]):
            band_at, waited_ms = r.unpack(_HEAD_AGE)
            if band_at >= len(BANDS):
                raise SyncError(f"sync message names band {band_at}; there are {len(BANDS)}")
            heads.append((BANDS[band_at], waited_ms))
    if r.at != len(r.data):
        raise SyncError(f"sync message has {len(r.data) - r.at} bytes after its end")
    return SyncMessage(
        replica,
        seq,
        bool(flags & 1),
        tuple(books),
        tuple(preds),
        queued,
        tuple(grants),
        room,
        lists[0],
        lists[1],
        tuple(heads),
    )


# --- state (pure) --------------------------------------------------------------------------------


@dataclass
class _Peer:
    heard: float  # local monotonic time of its last message
    full_seq: int = 0  # highest full message: the seq of every worker it does not name
    books: dict[str, tuple[int, BookCounts]] = field(default_factory=dict)  # worker → (seq, …)
    queued: int = 0  # its continuing turns queued, as of `queued_seq`
    queued_seq: int = 0
    room: int = 0  # its banked room, as of `queued_seq`
    applied: int = 0  # how much of this replica's claims on it it has applied, as of then
    heads: dict[Band, float] = field(default_factory=dict)  # band → since (local clock)


def default_replica_id() -> str:
    """Unique per process start: host, pid and a random suffix (a restarted replica is a new
    peer, so its sequence numbers starting over are never taken for old ones)."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


class SyncState:
    """One replica's side of replica sync, without I/O or timers (module docstring): what to
    publish next (`changed`, `predicted`, `flush`) and what its peers reported (`receive`,
    `counts`). Times are the caller's monotonic seconds. Single-threaded."""

    def __init__(self, replica_id: str, params: SyncParams | None = None) -> None:
        if not replica_id:
            raise SyncError("replica_id must not be empty; e.g. default_replica_id()")
        self.replica_id = replica_id
        self.params = params or SyncParams()
        self.seq = 0
        self._dirty: dict[str, None] = {}
        self._predictions: dict[tuple[str, tuple[int, ...]], float] = {}
        self.last_flush = -math.inf
        self.last_full = -math.inf
        self._peers: dict[str, _Peer] = {}
        self.queued = 0  # own continuing turns queued (in every message)
        self._queued_dirty = False
        self._grants: dict[str, int] = {}
        self.room = 0  # own banked flow-control room (in every message)
        self._claimed: dict[str, int] = {}  # peer → room claimed from it, running total
        self._applied: dict[str, int] = {}  # peer → its claims on this replica, applied
        self._debit = 0  # claims applied by `receive` and not yet taken (`take_debit`)
        self._ledger_heard: dict[str, float] = {}  # peer → last heard, for the two totals
        self._flow_dirty = False
        self._heads: dict[Band, float] = {}  # band → since when its next queued item waits
        self._totals: dict[str, BookCounts] | None = None
        self._totals_until = -math.inf  # the first instant a peer counted in `_totals` goes stale

    # --- outbound --------------------------------------------------------------------------------
    def changed(self, worker: str) -> None:
        """The own book for `worker` changed: it goes into the next message."""
        self._dirty[worker] = None

    def predicted(self, worker: str, block_hashes: Sequence[int], ttl_s: float) -> None:
        """A routing-time prediction to share (the same blocks twice: the longer ttl)."""
        key = (worker, tuple(block_hashes))
        if ttl_s > self._predictions.get(key, 0.0):
            self._predictions[key] = ttl_s

    def set_queued(self, n: int) -> None:
        """The own count of queued continuing turns (sent when it changed)."""
        if n != self.queued:
            self.queued = n
            self._queued_dirty = True

    def grant(self, peer: str, tokens: int) -> None:
        """Hand `tokens` of flow-control room to `peer` in the next message."""
        if tokens > 0:
            self._grants[peer] = self._grants.get(peer, 0) + tokens

    def set_room(self, tokens: int) -> None:
        """The own banked room (sent when it changed; below zero is sent as 0)."""
        tokens = max(tokens, 0)
        if tokens != self.room:
            self.room = tokens
            self._flow_dirty = True

    def claim(self, peer: str, tokens: int) -> None:
        """Borrow `tokens` of `peer`'s banked room (the claim's total goes out next)."""
        if tokens > 0:
            self._claimed[peer] = self._claimed.get(peer, 0) + tokens
            self._flow_dirty = True

    def borrowable(self, now: float) -> list[tuple[str, int]]:
        """Room each fresh peer could lend now, most first: what it last reported banked,
        less this replica's claims on it that it had not applied by then."""
        stale = self.params.peer_stale_after_s
        out = []
        for r, p in self._peers.items():
            if now - p.heard > stale or p.room <= 0:
                continue
            free = p.room - max(self._claimed.get(r, 0) - p.applied, 0)
            if free > 0:
                out.append((r, free))
        out.sort(key=lambda rt: (-rt[1], rt[0]))
        return out

    def set_head(self, band: Band, since: float | None) -> None:
        """When the item this replica would dispatch next in `band` was queued (None: none
        queued); sent when it changed, as the time waited by the flush."""
        if self._heads.get(band) != since:
            if since is None:
                self._heads.pop(band, None)
            else:
                self._heads[band] = since
            self._flow_dirty = True

    def older_heads(self, band: Band, since: float, now: float) -> int:
        """How many fresh peers have a `band` item queued since before `since`."""
        stale = self.params.peer_stale_after_s
        return sum(
            1
            for p in self._peers.values()
            if now - p.heard <= stale and p.heads.get(band, math.inf) < since
        )

    def take_debit(self) -> int:
        """Room the peers' claims took from this replica since the last call."""
        debit, self._debit = self._debit, 0
        return debit

    def waiting_peers(self, now: float) -> list[tuple[str, int]]:
        """Fresh peers with continuing turns queued: (replica, how many), by replica id."""
        stale = self.params.peer_stale_after_s
        return sorted(
            (r, p.queued) for r, p in self._peers.items() if p.queued > 0 and now - p.heard <= stale
        )

    @property
    def pending(self) -> bool:
        """Something changed since the last flush."""
        return bool(
            self._dirty
            or self._predictions
            or self._queued_dirty
            or self._grants
            or self._flow_dirty
        )

    def flush_at(self, now: float) -> float | None:
        """When the next (coalesced) flush is due; None: nothing pending."""
        if not self.pending:
            return None
        return max(now, self.last_flush + self.params.flush_interval_s)

    def heartbeat_due(self, now: float) -> bool:
        return now - self.last_full >= self.params.heartbeat_s

    def flush(
        self,
        now: float,
        book: Callable[[str], BookCounts],
        booked: Callable[[], Iterable[str]],
        *,
        full: bool = False,
    ) -> SyncMessage | None:
        """The message to publish now (None: nothing to say). `book(worker)`: the own book;
        `booked()`: the workers it holds anything on. Full when asked or a heartbeat is due."""
        full = full or self.heartbeat_due(now)
        if not full and not self.pending:
            return None
        self.seq += 1
        if full:
            books = tuple((w, b) for w in booked() if (b := book(w)))
            self.last_full = now
        else:
            books = tuple((w, book(w)) for w in self._dirty)
        preds = tuple(Prediction(w, h, ttl) for (w, h), ttl in self._predictions.items())
        grants = tuple(self._grants.items())
        self._dirty.clear()
        self._predictions.clear()
        self._grants.clear()
        self._queued_dirty = self._flow_dirty = False
        self.last_flush = now
        return SyncMessage(
            self.replica_id,
            self.seq,
            full,
            books,
            preds,
            self.queued,
            grants,
            self.room,
            tuple(sorted(self._claimed.items())),
            tuple(sorted(self._applied.items())),
            tuple((b, round((now - t) * 1000)) for b, t in self._heads.items()),
        )

    # --- inbound ---------------------------------------------------------------------------------
    def receive(self, msg: SyncMessage, now: float) -> tuple[Prediction, ...]:
        """Merge a peer's message (own messages: ignored); returns its predictions to apply."""
        if msg.replica == self.replica_id:
            return ()
        peer = self._peers.get(msg.replica)
        if peer is None:
            peer = self._peers[msg.replica] = _Peer(now)
        peer.heard = max(peer.heard, now)
        books = peer.books
        seq = msg.seq
        for worker, counts in msg.books:
            old = books.get(worker)
            if seq > (old[0] if old is not None else peer.full_seq):
                books[worker] = (seq, counts)
        self._ledger_heard[msg.replica] = now
        if seq > peer.queued_seq:
            peer.queued, peer.queued_seq, peer.room = msg.queued, seq, msg.room
            peer.heads = {b: now - ms / 1000.0 for b, ms in msg.heads}
            me = self.replica_id
            peer.applied = next((t for r, t in msg.applied if r == me), 0)
            total = next((t for r, t in msg.claims if r == me), 0)
            done = self._applied.get(msg.replica, 0)
            if total > done:  # its claims on this replica's room, applied once each
                self._debit += total - done
                self._applied[msg.replica] = total
                self._flow_dirty = True  # the peer learns it was applied
        if msg.full and seq > peer.full_seq:
            named = {w for w, _ in msg.books}
            for worker in [w for w, (s, _) in books.items() if w not in named and s < seq]:
                del books[worker]  # holds nothing now (as of `seq`)
            peer.full_seq = seq
        self._totals = None
        self._forget(now)
        return msg.predictions

    def _forget(self, now: float) -> None:
        limit = self.params.forget_after_s
        for rid in [r for r, p in self._peers.items() if now - p.heard > limit]:
            del self._peers[rid]
        # The claim totals outlive an outage (`forget_peers`): a peer that comes back re-sends
        # its totals, and only what is new in them applies. Forgotten with the peer: were it
        # to return after all, its old claims would apply again, as a debt that the next
        # saturated spell (room starts at 0) clears.
        for rid in [r for r, t in self._ledger_heard.items() if now - t > limit]:
            del self._ledger_heard[rid]
            self._claimed.pop(rid, None)
            self._applied.pop(rid, None)

    def forget_peers(self) -> None:
        """Drop everything heard from peers (the channel was lost; they re-announce
        themselves with their next message, a full heartbeat at the latest)."""
        self._peers.clear()
        self._totals = None

    def fresh(self, now: float) -> list[str]:
        """The peers heard from within `peer_stale_after_s`."""
        stale = self.params.peer_stale_after_s
        return [r for r, p in self._peers.items() if now - p.heard <= stale]

    def peer_books(self, now: float) -> dict[str, dict[str, BookCounts]]:
        """Each fresh peer's non-empty books (for inspection and tests)."""
        return {
            r: {w: b for w, (_, b) in self._peers[r].books.items() if b} for r in self.fresh(now)
        }

    def counts(self, worker: str, now: float) -> BookCounts:
        """The fresh peers' books for `worker`, summed (`beamserve.router.load.PeerBooks`)."""
        totals = self._totals
        if totals is None or now >= self._totals_until:
            totals = self._sum(now)
        return totals.get(worker, NO_BOOKING)

    def _sum(self, now: float) -> dict[str, BookCounts]:
        stale = self.params.peer_stale_after_s
        totals: dict[str, BookCounts] = {}
        until = math.inf
        for p in self._peers.values():
            if now - p.heard > stale:
                continue
            until = min(until, p.heard + stale)
            for worker, (_, b) in p.books.items():
                if b:
                    have = totals.get(worker)
                    totals[worker] = b if have is None else have + b
        # Recompute when the first counted peer goes stale (strictly after `heard + stale`).
        self._totals, self._totals_until = totals, math.nextafter(until, math.inf)
        return totals


# --- wiring: one replica's book, core and index to a transport -----------------------------------


class SyncTransport(Protocol):
    """Carries encoded messages between replicas; `publish` never blocks nor raises."""

    def publish(self, data: bytes) -> None: ...


CallLater = Callable[[float, Callable[[], None]], object]
"""`call_later(delay_s, fn)`: run `fn` after `delay_s` seconds (the event loop's, the replay's
virtual clock's)."""


@dataclass
class SyncStats:
    published: int = 0
    published_bytes: int = 0
    received: int = 0
    received_bytes: int = 0
    predictions_applied: int = 0
    decode_errors: int = 0
    room_granted: int = 0  # flow-control room tokens handed to peers
    room_received: int = 0
    room_borrowed: int = 0  # flow-control room tokens claimed from peers' banked room
    room_lent: int = 0  # … claimed from this replica's by peers (applied)


class ReplicaSync:
    """Replica sync for one replica: publishes its `LoadBook`'s changes and its core's
    predictions through `transport`, and merges what arrives (`deliver`) into its state, which
    the `LoadBook` reads as `peers`, and into its `PrefixIndex`. `accepts(worker)`: whether a
    peer's prediction for `worker` is applied (a worker this replica does not know: not).
    `on_peers_changed()`: after a message changed a peer's books (the caller may re-observe
    the pool's saturation). Call `tick` periodically (≤ `heartbeat_s`) for the heartbeat."""

    def __init__(
        self,
        state: SyncState,
        loads: LoadBook,
        index: PrefixIndex,
        transport: SyncTransport,
        call_later: CallLater,
        clock: Callable[[], float],
        *,
        accepts: Callable[[str], bool] | None = None,
        on_peers_changed: Callable[[], None] | None = None,
    ) -> None:
        self.state = state
        self.loads = loads
        self.index = index
        self.transport = transport
        self.call_later = call_later
        self.clock = clock
        self.accepts = accepts
        self.on_peers_changed = on_peers_changed
        # Flow-control room other replicas hand to this one (`FlowController.grant_room`),
        # and room their claims took from this one's bank (`FlowController.lend_room`).
        self.on_grant: Callable[[int], None] | None = None
        self.on_debit: Callable[[int], None] | None = None
        self.stats = SyncStats()
        self._scheduled = False
        self._gen = 0  # flushes so far: a timer set before the latest flush does nothing
        self._warned = False
        loads.peers = state
        loads.on_change = self.changed

    def changed(self, worker: str) -> None:
        """`LoadBook.on_change`."""
        self.state.changed(worker)
        self._schedule()

    def predicted(self, worker: str, block_hashes: tuple[int, ...], ttl_s: float) -> None:
        """`RoutingCore.on_predict`."""
        self.state.predicted(worker, block_hashes, ttl_s)
        self._schedule()

    def queue_changed(self, queued: int) -> None:
        """`FlowController.on_continuing_queued`: peers learn it with the next message."""
        self.state.set_queued(queued)
        self._schedule()

    def peers_busy(self) -> bool:
        """`FlowController.peers_busy`: a fresh peer has requests booked (in flight) or
        continuing turns queued."""
        now = self.clock()
        st = self.state
        if st.waiting_peers(now):
            return True
        return any(
            b.prefilling or b.decoding
            for books in st.peer_books(now).values()
            for b in books.values()
        )

    def attach_flow(self, flow: FlowController, *, then: Callable[[], None] | None = None) -> None:
        """Wire a `FlowController` to this replica's sync (room shared between replicas:
        `beamserve.router.flow.controller`, "Several replicas"). `then`: called after a grant
        or a debit changed the controller (the replay yields to its loop there)."""
        flow.on_spare_room = self.offer_room
        flow.on_continuing_queued = self.queue_changed
        flow.peers_busy = self.peers_busy
        flow.on_room = self.room_changed
        flow.peer_room = self.borrowable
        flow.on_borrow = self.borrow
        flow.on_head = self.head_changed
        flow.older_peers = self.older_heads

        def grant(tokens: int) -> None:
            flow.grant_room(tokens)
            if then is not None:
                then()

        def debit(tokens: int) -> None:
            flow.lend_room(tokens)
            if then is not None:
                then()

        self.on_grant, self.on_debit = grant, debit

    def room_changed(self, tokens: int) -> None:
        """`FlowController.on_room`: the own banked room; peers learn it with the next message."""
        self.state.set_room(tokens)
        if self.state.pending:
            self._schedule()

    def head_changed(self, band: Band, since: float | None) -> None:
        """`FlowController.on_head` (its clock must be this replica's: both monotonic)."""
        self.state.set_head(band, since)
        if self.state.pending:
            self._schedule()

    def older_heads(self, band: Band, since: float) -> int:
        """`FlowController.older_peers`: fresh peers whose next `band` item waits longer."""
        return self.state.older_heads(band, since, self.clock())

    def borrowable(self) -> list[tuple[str, int]]:
        """`FlowController.peer_room`: what each fresh peer could lend now, most first."""
        return self.state.borrowable(self.clock())

    def borrow(self, peer: str, tokens: int) -> None:
        """`FlowController.on_borrow`: claim `tokens` of `peer`'s banked room."""
        self.state.claim(peer, tokens)
        self.stats.room_borrowed += max(tokens, 0)
        self._schedule()

    def offer_room(self, tokens: int) -> int:
        """`FlowController.on_spare_room`: split `tokens` of room evenly among the fresh peers
        that have continuing turns queued (the remainder to the first in replica-id order) and
        return what was handed over (0: no peer waits, the room stays with the caller). Also
        when this replica's own continuing turns wait: every replica hands its room on alike,
        so room goes round to where turns wait (a share kept here measured worse: TTFT p90
        alike, 1.2 % shed against none, a quarter less throughput; docs/bench/route.md)."""
        peers = [p for p, _n in self.state.waiting_peers(self.clock())]
        if not peers or tokens <= 0:
            return 0
        share, extra = divmod(tokens, len(peers))
        given = 0
        for i, peer in enumerate(peers):
            part = share + (1 if i < extra else 0)
            if part > 0:
                self.state.grant(peer, part)
                given += part
        self.stats.room_granted += given
        self._schedule()
        return given

    def _schedule(self) -> None:
        if self._scheduled:
            return
        now = self.clock()
        at = self.state.flush_at(now)
        if at is None:
            return
        self._scheduled = True
        gen = self._gen

        def due() -> None:
            if gen == self._gen:  # else a heartbeat flushed meanwhile and rescheduled
                self._flush()

        self.call_later(at - now, due)

    def _flush(self, *, full: bool = False) -> None:
        self._scheduled = False
        self._gen += 1
        loads = self.loads
        msg = self.state.flush(self.clock(), loads.book, loads.booked, full=full)
        if msg is not None:
            data = encode_message(msg)
            self.stats.published += 1
            self.stats.published_bytes += len(data)
            self.transport.publish(data)

    def tick(self) -> None:
        """The heartbeat: a full message when one is due (call at least every `heartbeat_s`)."""
        if self.state.heartbeat_due(self.clock()):
            self._flush(full=True)
            self._schedule()  # changes made meanwhile (none: nothing is scheduled)

    def deliver(self, data: bytes) -> None:
        """A message from the channel (own ones included: the state ignores them)."""
        try:
            msg = decode_message(data)
        except SyncError as exc:
            self.stats.decode_errors += 1
            if not self._warned:
                self._warned = True
                log.warning("router.replica_sync_bad_message", error=str(exc), size=len(data))
            return
        if msg.replica == self.state.replica_id:
            return
        now = self.clock()
        self.stats.received += 1
        self.stats.received_bytes += len(data)
        accepts = self.accepts
        lendable = self.state.borrowable(now) if msg.room > 0 else None
        for p in self.state.receive(msg, now):
            if p.ttl_s > 0 and p.block_hashes and (accepts is None or accepts(p.worker)):
                self.index.predict(p.worker, p.block_hashes, p.ttl_s, now)
                self.stats.predictions_applied += 1
        # A peer's books changed, or it banks more room than before (a turn queued here may
        # borrow it): the pool is looked at again.
        more_room = lendable is not None and self.state.borrowable(now) != lendable
        if (msg.books or more_room) and self.on_peers_changed is not None:
            self.on_peers_changed()
        debit = self.state.take_debit()
        if debit:
            self.stats.room_lent += debit
            self._schedule()  # the peers learn the claims were applied
            if self.on_debit is not None:
                self.on_debit(debit)
        mine = sum(t for peer, t in msg.grants if peer == self.state.replica_id)
        if mine:
            self.stats.room_received += mine
            if self.on_grant is not None:
                self.on_grant(mine)


# --- Redis pub/sub transport ---------------------------------------------------------------------


def sync_channel(session_key_prefix: str) -> str:
    """The default channel for a session store's key prefix: ``beamserve:session:`` →
    ``beamserve:session-sync`` (as its worker sets are ``beamserve:session-worker:…``)."""
    return session_key_prefix.rstrip(":") + "-sync"


class RedisSyncTransport:
    """Redis pub/sub for replica sync (module docstring, "Transport").

    `publish` appends to a bounded outbox (the oldest dropped when full: messages are state,
    the next one heals) that a background task publishes under `op_timeout_s` each; a second
    task subscribes and hands every message to `on_message`. Any Redis error: logged once per
    outage (`router.replica_sync_down`, then `router.replica_sync_up`), the outbox dropped, and
    both tasks retry with exponential backoff from `backoff_min_s` to `backoff_max_s`."""

    def __init__(
        self,
        url: str,
        channel: str,
        *,
        op_timeout_s: float = 0.25,
        backoff_min_s: float = 0.1,
        backoff_max_s: float = 5.0,
        outbox_max: int = 256,
    ) -> None:
        if not channel:
            raise SyncError("sync channel must not be empty; e.g. 'beamserve:session-sync'")
        self.url = url
        self.channel = channel
        self.op_timeout_s = op_timeout_s
        self.backoff_min_s = backoff_min_s
        self.backoff_max_s = backoff_max_s
        self._redis: aioredis.Redis = aioredis.from_url(url, health_check_interval=0)
        self._outbox: deque[bytes] = deque(maxlen=outbox_max)
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._down = False
        self.subscribed = False
        # Called once per outage: what the peers last said can no longer be corrected (their
        # messages sent since are lost), so the caller forgets it (`SyncState.forget_peers`).
        self.on_down: Callable[[], None] | None = None
        self.dropped = 0
        self.errors = 0

    @property
    def connected(self) -> bool:
        """Subscribed and the last publish succeeded."""
        return self.subscribed and not self._down

    def publish(self, data: bytes) -> None:
        if self._down:
            self.dropped += 1
            return
        if len(self._outbox) == self._outbox.maxlen:
            self.dropped += 1
        self._outbox.append(data)
        self._wake.set()

    def start(self, on_message: Callable[[bytes], None]) -> None:
        """Start publishing and subscribing (in the background: returns at once)."""
        self._tasks = [
            asyncio.create_task(self._publisher(), name="router-sync-publish"),
            asyncio.create_task(self._subscriber(on_message), name="router-sync-subscribe"),
        ]

    def _went_down(self, where: str, exc: BaseException) -> None:
        self.errors += 1
        if not self._down:
            self._down = True
            if self.on_down is not None:
                self.on_down()
            log.warning(
                "router.replica_sync_down",
                where=where,
                error=repr(exc),
                detail="routing on the own book and scrapes until Redis answers again",
            )
        self._outbox.clear()

    def _came_up(self) -> None:
        if self._down:
            self._down = False
            log.info("router.replica_sync_up", channel=self.channel)

    async def _publisher(self) -> None:
        delay = self.backoff_min_s
        while True:
            if self._down:
                await asyncio.sleep(delay)
                try:
                    await asyncio.wait_for(self._redis.ping(), self.op_timeout_s)
                except (RedisError, OSError, TimeoutError) as exc:
                    self._went_down("publish", exc)
                    delay = min(delay * 2, self.backoff_max_s)
                    continue
                self._came_up()
                delay = self.backoff_min_s
            if not self._outbox:
                self._wake.clear()
                await self._wake.wait()
                continue
            data = self._outbox.popleft()
            try:
                await asyncio.wait_for(self._redis.publish(self.channel, data), self.op_timeout_s)
            except (RedisError, OSError, TimeoutError) as exc:
                self._went_down("publish", exc)

    async def _subscriber(self, on_message: Callable[[bytes], None]) -> None:
        delay = self.backoff_min_s
        while True:
            pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
            try:
                await asyncio.wait_for(pubsub.subscribe(self.channel), self.op_timeout_s)
                self.subscribed = True
                self._came_up()
                delay = self.backoff_min_s
                while True:
                    msg = await pubsub.get_message(timeout=1.0)
                    if msg is not None and msg.get("type") == "message":
                        data = msg.get("data")
                        if isinstance(data, bytes):
                            on_message(data)
            except (RedisError, OSError, TimeoutError) as exc:
                self._went_down("subscribe", exc)
            finally:
                self.subscribed = False
                # bounded: a close must not hold the task (and a shutdown) on a dead socket
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(pubsub.aclose(), CLOSE_TIMEOUT_S)  # type: ignore[no-untyped-call]
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.backoff_max_s)

    async def aclose(self) -> None:
        """Stop both tasks and close the client, each step bounded by `CLOSE_TIMEOUT_S`: a
        shutdown never hangs on Redis (a task still stuck then is left to the loop's end)."""
        for t in self._tasks:
            t.cancel()
        if self._tasks:
            _, stuck = await asyncio.wait(self._tasks, timeout=CLOSE_TIMEOUT_S)
            if stuck:
                names = sorted(t.get_name() for t in stuck)
                log.warning("router.replica_sync_close_stuck", tasks=names)
        self._tasks = []
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._redis.aclose(), CLOSE_TIMEOUT_S)


class RedisReplicaSync:
    """`ReplicaSync` over `RedisSyncTransport` on the running event loop, with its heartbeat
    task: what `RouterRuntime` starts when the session store is Redis."""

    def __init__(
        self,
        url: str,
        channel: str,
        loads: LoadBook,
        index: PrefixIndex,
        *,
        params: SyncParams | None = None,
        replica_id: str | None = None,
        accepts: Callable[[str], bool] | None = None,
        on_peers_changed: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.transport = RedisSyncTransport(url, channel)
        self.state = SyncState(replica_id or default_replica_id(), params)
        self.transport.on_down = self.redis_lost
        self.sync = ReplicaSync(
            self.state,
            loads,
            index,
            self.transport,
            self._call_later,
            clock,
            accepts=accepts,
            on_peers_changed=on_peers_changed,
        )
        self._heartbeat: asyncio.Task[None] | None = None

    @property
    def replica_id(self) -> str:
        return self.state.replica_id

    def redis_lost(self) -> None:
        """Redis went away: the peers' last books may hold requests that have ended since (the
        messages saying so are lost), so they count for nothing until the peers are heard
        again; the replica routes on its own book plus scrapes. Called by the transport, and by
        the session store on the same Redis (whichever notices first: a request's store lookup
        usually fails before the subscriber reads the closed socket)."""
        self.state.forget_peers()
        if self.sync.on_peers_changed is not None:
            self.sync.on_peers_changed()

    def predicted(self, worker: str, block_hashes: tuple[int, ...], ttl_s: float) -> None:
        """`RoutingCore.on_predict`."""
        self.sync.predicted(worker, block_hashes, ttl_s)

    @staticmethod
    def _call_later(delay_s: float, fn: Callable[[], None]) -> object:
        return asyncio.get_running_loop().call_later(max(delay_s, 0.0), fn)

    def start(self) -> None:
        """Subscribe, publish and heartbeat in the background (call on the serving loop)."""
        self.transport.start(self.sync.deliver)
        self._heartbeat = asyncio.create_task(self._beat(), name="router-sync-heartbeat")
        log.info(
            "router.replica_sync",
            replica=self.state.replica_id,
            channel=self.transport.channel,
        )

    async def _beat(self) -> None:
        period = self.state.params.heartbeat_s / 2
        while True:
            try:
                self.sync.tick()
            except Exception:
                log.exception("router.replica_sync_heartbeat_failed")
            await asyncio.sleep(period)

    def health(self) -> dict[str, object]:
        now = self.sync.clock()
        return {
            "replica": self.state.replica_id,
            "connected": self.transport.connected,
            "peers": len(self.state.fresh(now)),
            "published": self.sync.stats.published,
            "received": self.sync.stats.received,
        }

    async def aclose(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._heartbeat
            self._heartbeat = None
        await self.transport.aclose()
