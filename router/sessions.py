"""Session store: which worker holds a session's KV, and how much service the session received.

The router asks `get(session_id)` before routing (the record's `worker` becomes the warm worker,
`WorkerView.warm`) and calls `bind(session_id, worker, turn_tokens=...)` once it dispatched a
turn. Two implementations share one contract (`SessionStore`):

* `MemorySessionStore` — one router replica; bounded (LRU over `max_sessions`) and expiring
  (`ttl_s` after the last `bind`).
* `RedisSessionStore` — every router replica sees every binding (session affinity across
  replicas). One Redis hash per session, ``{key_prefix}{session_id}`` with fields ``worker``
  (``""`` = unbound), ``turns``, ``attained``, ``updated`` (epoch s), ``tenant``, ``tip`` (where
  the last turn's prompt reached: `session_tip`); its TTL is
  refreshed by every `bind`. A set ``{key_prefix without ':'}-worker:{worker}`` indexes the
  sessions bound to a worker (for `forget_worker`). `bind` is one Lua script (atomic:
  ``HSET worker/updated``, ``HINCRBY turns 1``, ``HINCRBYFLOAT attained``, ``PEXPIRE``).

Availability contract of `RedisSessionStore` (Redis is an optimisation of affinity, never a
dependency of serving):

* Every operation goes to Redis under ``op_timeout_s``; results are written through to a local
  `MemorySessionStore`.
* When an operation fails (connection refused or reset, timeout, any Redis error) the store
  turns *degraded*: it logs once, answers from the local cache (reads) or applies the change
  locally and marks the session dirty (writes), and skips Redis entirely until
  ``retry_after_s`` has passed. So only the operation that discovers an outage waits (at most
  ``op_timeout_s``); no operation ever raises because Redis is down.
* After ``retry_after_s`` the next operation starts one background recovery: ``PING``, then
  every dirty session is merged into Redis — the fields ``worker``/``updated``/``tenant`` by
  last-writer-wins on ``updated``, ``turns`` and ``attained`` by maximum (idempotent, so an
  operation that timed out but did run on Redis is never counted twice) — and `forget_worker`
  calls made while down are replayed. When nothing is left dirty, ``degraded`` clears. On
  failure it waits ``retry_after_s`` again.
* Limits: increments made by two replicas to the same session while one of them was cut off
  merge by maximum, not by sum; a dirty entry evicted from the bounded local cache before
  recovery is not re-synced; a Redis restarted empty gets back only the dirty sessions (clean
  ones return as their sessions bind again).

Parameters (`RedisSessionStore`):

| parameter | default | meaning |
|---|---|---|
| `ttl_s` | ``3600`` | a session expires this long after its last `bind` (s) |
| `key_prefix` | ``"beamserve:session:"`` | Redis key prefix; must end with ``":"`` |
| `op_timeout_s` | ``0.25`` | budget of one Redis operation, event-loop lag included (s) |
| `retry_after_s` | ``1.0`` | least time between reconnection attempts while degraded (s) |
| `local_max_sessions` | ``100000`` | bound of the local write-through cache |
| `resync_timeout_s` | ``1.0`` | budget of one background re-sync batch / `forget_worker` (s) |

The operation budget is measured on the router's event loop, so it includes the loop's lag (a
router tokenizing a burst of cold 25K-token prompts spends ≈ 35 ms of loop time on each; a busy
host adds more). At the earlier 0.05 s a healthy Redis was declared down in the middle of a run
(two replicas behind HAProxy on a loaded 2-core machine, `bench agentic --routers
beamserve-x2`), and each replica then routed from its local state alone for ``retry_after_s``.
A Redis operation itself takes well under a millisecond on a LAN.

Config example (router)::

    session_store: redis://redis.beamserve.svc:6379/0   # omitted → in-memory, one replica

    store = make_session_store("redis://localhost:6379/0", ttl_s=1800)
    rec = await store.get(session_id)               # rec.worker → warm worker
    await store.bind(session_id, decision.decode.id, turn_tokens=prompt + completion)
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol, TypeVar, runtime_checkable

import redis.asyncio as aioredis
import structlog
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

log = structlog.get_logger(__name__)

T = TypeVar("T")

Backend = Literal["memory", "redis"]
OP_TIMEOUT_S = 0.25  # `op_timeout_s`'s default (module docstring)
# Each step of `close()`: a shutdown never hangs on Redis (a dead socket, a stuck reconnect).
CLOSE_TIMEOUT_S = 5.0
MEMORY_SCHEMES = ("memory",)
REDIS_SCHEMES = ("redis", "rediss", "unix")


class SessionStoreError(ValueError):
    """A session store was configured or called wrongly; the message says how to fix it."""


@dataclass(frozen=True, slots=True)
class SessionRecord:
    """One session as the store knows it.

    `worker`: the endpoint id the session is bound to (None: unbound, e.g. its worker left).
    `turns`: how many times it was bound (one per routed turn). `attained_tokens`: the service
    it received, summed over turns (whatever the caller counts per turn, usually prompt plus
    completion tokens). `updated`: epoch seconds of the last change. `tenant`: optional owner
    (API key or user) for fairness accounting. `tip`: where the last bound turn's prompt
    reached, as `session_tip` wrote it (None: unknown) — the evidence a next request must
    extend to count as the session's continuation (`extends_tip`).
    """

    worker: str | None
    turns: int
    attained_tokens: float
    updated: float
    tenant: str | None = None
    tip: str | None = None


def session_tip(block_hashes: Sequence[int]) -> str:
    """The tip of a turn's prompt: ``"n:h"`` with ``h`` its ``n``-th block hash, ``n`` one
    less than its full blocks (the last full block may straddle the end of the prompt, which
    the next turn's text can re-tokenize differently). ``""`` when the prompt is too short to
    leave one (fewer than two full blocks)."""
    n = len(block_hashes) - 1
    return f"{n}:{block_hashes[n - 1]}" if n >= 1 else ""


def tip_blocks(tip: str | None) -> int:
    """How many blocks a tip (`session_tip`) says the previous turn's prompt reached; 0 when
    there is none or it cannot be read."""
    n_text, _, _h = (tip or "").partition(":")
    return int(n_text) if n_text.isdigit() else 0


def extends_tip(tip: str | None, block_hashes: Sequence[int]) -> bool:
    """True iff a request's block hashes carry the previous turn's tip at the same position:
    the request's prompt starts with the previous turn's prompt (block hashes are chained, so
    one equal hash at block ``n`` means the first ``n`` blocks are equal)."""
    if not tip:
        return False
    n_text, _, h_text = tip.partition(":")
    try:
        n, h = int(n_text), int(h_text)
    except ValueError:
        return False
    return 1 <= n <= len(block_hashes) and block_hashes[n - 1] == h


@dataclass(frozen=True, slots=True)
class SessionStoreStats:
    """Counters for Prometheus (`beamserve_session_store_*`); monotonic except the gauges
    `degraded`, `dirty_sessions` and `local_sessions`."""

    backend: Backend
    redis_ops: int = 0  # operations sent to Redis (attempted)
    redis_errors: int = 0  # of those, failed (plus failed recovery attempts)
    degraded: bool = False
    fallbacks: int = 0  # operations answered from local state instead of Redis
    resyncs: int = 0  # completed recoveries (degraded → healthy)
    resynced_sessions: int = 0  # dirty sessions merged into Redis by recoveries
    dirty_sessions: int = 0
    local_sessions: int = 0
    evictions: int = 0  # local entries dropped by the LRU bound


@runtime_checkable
class SessionStore(Protocol):
    """Where sessions are bound to workers. No method raises because a backend is down."""

    async def get(self, session_id: str) -> SessionRecord | None:
        """The session's record, or None when unknown or expired."""
        ...

    async def bind(
        self,
        session_id: str,
        worker: str,
        *,
        turn_tokens: float = 0,
        tenant: str | None = None,
        tip: str | None = None,
    ) -> SessionRecord:
        """Atomically: bind to `worker`, ``turns += 1``, ``attained_tokens += turn_tokens``,
        ``updated = now``, refresh the TTL (and set `tenant` and `tip` when given; ``tip=""``
        clears it). Returns the result."""
        ...

    async def unbind(self, session_id: str, worker: str) -> bool:
        """Unbind the session only if it is still bound to `worker`; True when it was."""
        ...

    async def forget_worker(self, worker: str) -> int:
        """Unbind every session bound to `worker` (it left); returns how many were."""
        ...

    async def close(self) -> None: ...

    def health(self) -> dict[str, object]:
        """``backend``, ``connected``, ``degraded``, ``errors`` (plus backend details)."""
        ...

    def stats(self) -> SessionStoreStats: ...


def _check_tokens(turn_tokens: float) -> float:
    value = float(turn_tokens)
    if not math.isfinite(value) or value < 0:
        raise SessionStoreError(
            f"turn_tokens must be a finite number >= 0, got {turn_tokens!r}; pass the tokens "
            "this turn consumed (prompt + completion), or 0"
        )
    return value


def _check_positive(name: str, value: float) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise SessionStoreError(f"{name} must be a positive number, got {value!r}")


class MemorySessionStore:
    """In-process session store: an LRU map bounded by `max_sessions`, entries expiring `ttl_s`
    after their last `bind` (a `get` keeps an entry from LRU eviction but does not extend its
    TTL; `unbind` does neither).

    Memory: O(`max_sessions`). Expired entries are dropped when touched and swept from the LRU
    end on inserts; when full, the least recently used entry is evicted.

    | parameter | default | meaning |
    |---|---|---|
    | `ttl_s` | ``3600`` | lifetime after the last bind (s) |
    | `max_sessions` | ``1000000`` | most entries kept |
    | `clock` | `time.time` | epoch seconds; `updated` and expiry use it |

    The ``*_now`` methods are the same operations, synchronous; `RedisSessionStore` uses them
    for its write-through cache.
    """

    backend: Backend = "memory"

    def __init__(
        self,
        ttl_s: float = 3600.0,
        max_sessions: int = 1_000_000,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        _check_positive("ttl_s", ttl_s)
        if not isinstance(max_sessions, int) or max_sessions < 1:
            raise SessionStoreError(f"max_sessions must be an integer >= 1, got {max_sessions!r}")
        self.ttl_s = float(ttl_s)
        self.max_sessions = max_sessions
        self.clock = clock
        self._entries: OrderedDict[str, tuple[SessionRecord, float]] = OrderedDict()
        self.evictions = 0
        self.expirations = 0

    def __len__(self) -> int:
        return len(self._entries)

    # -- synchronous core ------------------------------------------------------------------

    def peek(self, session_id: str) -> tuple[SessionRecord, float] | None:
        """(record, expires_at) without touching LRU order; None when absent or expired."""
        entry = self._entries.get(session_id)
        if entry is None or entry[1] <= self.clock():
            return None
        return entry

    def get_now(self, session_id: str) -> SessionRecord | None:
        entry = self._entries.get(session_id)
        if entry is None:
            return None
        if entry[1] <= self.clock():
            del self._entries[session_id]
            self.expirations += 1
            return None
        self._entries.move_to_end(session_id)
        return entry[0]

    def bind_now(
        self,
        session_id: str,
        worker: str,
        *,
        turn_tokens: float = 0,
        tenant: str | None = None,
        tip: str | None = None,
        now: float | None = None,
    ) -> SessionRecord:
        tokens = _check_tokens(turn_tokens)
        now = self.clock() if now is None else now
        old = self.get_now(session_id)
        if tip is None:
            tip = old.tip if old else None
        record = SessionRecord(
            worker=worker,
            turns=(old.turns if old else 0) + 1,
            attained_tokens=(old.attained_tokens if old else 0.0) + tokens,
            updated=now,
            tenant=tenant if tenant is not None else (old.tenant if old else None),
            tip=tip or None,
        )
        self.put(session_id, record, now + self.ttl_s)
        return record

    def unbind_now(
        self, session_id: str, worker: str, *, now: float | None = None
    ) -> SessionRecord | None:
        """The unbound record when the session was bound to `worker`, else None."""
        entry = self.peek(session_id)
        if entry is None or entry[0].worker != worker:
            return None
        record = replace(entry[0], worker=None, updated=self.clock() if now is None else now)
        self._entries[session_id] = (record, entry[1])  # keeps its LRU position
        return record

    def forget_worker_now(self, worker: str, *, now: float | None = None) -> list[str]:
        """Unbind every live session bound to `worker`; returns their ids."""
        now = self.clock() if now is None else now
        ids = [sid for sid, (rec, exp) in self._entries.items() if rec.worker == worker]
        return [sid for sid in ids if self.unbind_now(sid, worker, now=now) is not None]

    def put(self, session_id: str, record: SessionRecord, expires_at: float | None = None) -> None:
        """Store `record` as most recently used; expires at `expires_at` (default
        ``record.updated + ttl_s``)."""
        expires = record.updated + self.ttl_s if expires_at is None else expires_at
        if session_id in self._entries:
            self._entries[session_id] = (record, expires)
            self._entries.move_to_end(session_id)
            return
        self._sweep(self.clock())
        while len(self._entries) >= self.max_sessions:
            self._entries.popitem(last=False)
            self.evictions += 1
        self._entries[session_id] = (record, expires)

    def discard(self, session_id: str) -> None:
        self._entries.pop(session_id, None)

    def items(self) -> Iterator[tuple[str, SessionRecord]]:
        """Live entries, least recently used first."""
        now = self.clock()
        for sid, (rec, exp) in list(self._entries.items()):
            if exp > now:
                yield sid, rec

    def _sweep(self, now: float, limit: int = 64) -> None:
        # Amortised: drop expired entries from the LRU end, a few per insert.
        for _ in range(limit):
            if not self._entries:
                return
            sid, (_, exp) = next(iter(self._entries.items()))
            if exp > now:
                return
            del self._entries[sid]
            self.expirations += 1

    # -- SessionStore ----------------------------------------------------------------------

    async def get(self, session_id: str) -> SessionRecord | None:
        return self.get_now(session_id)

    async def bind(
        self,
        session_id: str,
        worker: str,
        *,
        turn_tokens: float = 0,
        tenant: str | None = None,
        tip: str | None = None,
    ) -> SessionRecord:
        return self.bind_now(session_id, worker, turn_tokens=turn_tokens, tenant=tenant, tip=tip)

    async def unbind(self, session_id: str, worker: str) -> bool:
        return self.unbind_now(session_id, worker) is not None

    async def forget_worker(self, worker: str) -> int:
        return len(self.forget_worker_now(worker))

    async def close(self) -> None:
        self._entries.clear()

    def health(self) -> dict[str, object]:
        return {
            "backend": "memory",
            "connected": True,
            "degraded": False,
            "errors": 0,
            "sessions": len(self._entries),
        }

    def stats(self) -> SessionStoreStats:
        return SessionStoreStats(
            backend="memory", local_sessions=len(self._entries), evictions=self.evictions
        )


# -- Redis ---------------------------------------------------------------------------------

# KEYS: session, worker index. ARGV: worker, turn_tokens, now, ttl_ms, tenant ('' = keep), sid,
# tip ('-' = keep, '' = clear).
_BIND_LUA = """
redis.call('HSET', KEYS[1], 'worker', ARGV[1], 'updated', ARGV[3])
redis.call('HINCRBY', KEYS[1], 'turns', 1)
redis.call('HINCRBYFLOAT', KEYS[1], 'attained', ARGV[2])
if ARGV[5] ~= '' then redis.call('HSET', KEYS[1], 'tenant', ARGV[5]) end
if ARGV[7] ~= '-' then redis.call('HSET', KEYS[1], 'tip', ARGV[7]) end
redis.call('PEXPIRE', KEYS[1], ARGV[4])
redis.call('SADD', KEYS[2], ARGV[6])
redis.call('PEXPIRE', KEYS[2], ARGV[4])
return redis.call('HGETALL', KEYS[1])
"""

# KEYS: session. Returns {} or {pttl_ms, {field, value, ...}}.
_GET_LUA = """
local h = redis.call('HGETALL', KEYS[1])
if #h == 0 then return {} end
return {redis.call('PTTL', KEYS[1]), h}
"""

# KEYS: session, worker index. ARGV: worker, now, not_after ('' = any), sid.
# Unbinds only when still bound to ARGV[1] (and, with not_after, not re-bound since).
_UNBIND_LUA = """
if redis.call('HGET', KEYS[1], 'worker') ~= ARGV[1] then return 0 end
if ARGV[3] ~= '' then
  local u = tonumber(redis.call('HGET', KEYS[1], 'updated') or '0') or 0
  if u > tonumber(ARGV[3]) then return 0 end
end
redis.call('HSET', KEYS[1], 'worker', '', 'updated', ARGV[2])
redis.call('SREM', KEYS[2], ARGV[4])
return 1
"""

# KEYS: session, worker index of the local worker. ARGV: worker ('' = unbound), turns,
# attained, updated, tenant ('' = none), ttl_ms, sid, tip. Last-writer-wins on `updated` for
# worker/updated/tenant/tip, maximum for turns/attained, TTL never shortened.
_MERGE_LUA = """
local cur = redis.call('HMGET', KEYS[1], 'updated', 'turns', 'attained')
local cu = tonumber(cur[1] or '-1') or -1
local ct = tonumber(cur[2] or '0') or 0
local ca = tonumber(cur[3] or '0') or 0
if tonumber(ARGV[4]) > cu then
  redis.call('HSET', KEYS[1], 'worker', ARGV[1], 'updated', ARGV[4])
  if ARGV[5] ~= '' then redis.call('HSET', KEYS[1], 'tenant', ARGV[5]) end
  redis.call('HSET', KEYS[1], 'tip', ARGV[8])
  if ARGV[1] ~= '' then
    redis.call('SADD', KEYS[2], ARGV[7])
    if redis.call('PTTL', KEYS[2]) < tonumber(ARGV[6]) then
      redis.call('PEXPIRE', KEYS[2], ARGV[6])
    end
  end
end
if tonumber(ARGV[2]) > ct then redis.call('HSET', KEYS[1], 'turns', ARGV[2]) end
if tonumber(ARGV[3]) > ca then redis.call('HSET', KEYS[1], 'attained', ARGV[3]) end
if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[6]) then
  redis.call('PEXPIRE', KEYS[1], ARGV[6])
end
return redis.call('HGETALL', KEYS[1])
"""


def _num(x: float) -> str:
    return format(float(x), ".17g")


def _decode_hash(flat: Sequence[Any]) -> SessionRecord | None:
    """A session record from HGETALL's flat ``[field, value, ...]`` reply."""
    if not flat:
        return None
    h = {str(flat[i]): str(flat[i + 1]) for i in range(0, len(flat) - 1, 2)}
    worker = h.get("worker", "")
    tenant = h.get("tenant", "")
    return SessionRecord(
        worker=worker or None,
        turns=int(h.get("turns", "0")),
        attained_tokens=float(h.get("attained", "0")),
        updated=float(h.get("updated", "0")),
        tenant=tenant or None,
        tip=h.get("tip") or None,
    )


class _RedisDown(Exception):
    """Internal: the Redis operation failed; the caller falls back to local state."""


class RedisSessionStore:
    """Session store shared by router replicas through Redis, with a local write-through
    cache that keeps serving while Redis is unreachable (see the module docstring for the
    key layout, the degraded mode and the re-sync merge rule)."""

    backend: Backend = "redis"

    def __init__(
        self,
        url: str,
        *,
        ttl_s: float = 3600.0,
        key_prefix: str = "beamserve:session:",
        op_timeout_s: float = OP_TIMEOUT_S,
        retry_after_s: float = 1.0,
        local_max_sessions: int = 100_000,
        resync_timeout_s: float = 1.0,
        resync_batch: int = 256,
        clock: Callable[[], float] = time.time,
    ) -> None:
        _check_positive("ttl_s", ttl_s)
        _check_positive("op_timeout_s", op_timeout_s)
        _check_positive("retry_after_s", retry_after_s)
        _check_positive("resync_timeout_s", resync_timeout_s)
        if not key_prefix.endswith(":"):
            raise SessionStoreError(
                f"key_prefix must end with ':' (got {key_prefix!r}), e.g. 'beamserve:session:'"
            )
        self.ttl_s = float(ttl_s)
        self.key_prefix = key_prefix
        self.worker_key_prefix = key_prefix.rstrip(":") + "-worker:"
        self.op_timeout_s = float(op_timeout_s)
        self.retry_after_s = float(retry_after_s)
        self.resync_timeout_s = float(resync_timeout_s)
        self.resync_batch = resync_batch
        self.clock = clock
        self.local = MemorySessionStore(ttl_s, local_max_sessions, clock=clock)
        # One immediate retry on a connection error re-dials a pooled connection that died
        # with a restarted server; `asyncio.timeout` bounds the whole operation either way.
        self._redis: aioredis.Redis = aioredis.from_url(
            url, decode_responses=True, retry=Retry(NoBackoff(), 1), health_check_interval=0
        )
        self._bind = self._redis.register_script(_BIND_LUA)
        self._get = self._redis.register_script(_GET_LUA)
        self._unbind = self._redis.register_script(_UNBIND_LUA)
        self._merge = self._redis.register_script(_MERGE_LUA)
        self._degraded = False
        self._retry_at = 0.0  # time.monotonic()
        self._dirty: dict[str, None] = {}  # ordered set of session ids to merge into Redis
        self._pending_forget: dict[str, float] = {}  # worker → epoch s of forget_worker
        self._recovery: asyncio.Task[None] | None = None
        self._closed = False
        # Called once per outage (healthy → degraded): the runtime points it at replica sync,
        # which shares this Redis and so lost its channel too (`RedisReplicaSync.redis_lost`).
        self.on_down: Callable[[], None] | None = None
        self.redis_ops = 0
        self.redis_errors = 0
        self.fallbacks = 0
        self.resyncs = 0
        self.resynced_sessions = 0

    # -- keys ----------------------------------------------------------------------------

    def session_key(self, session_id: str) -> str:
        return f"{self.key_prefix}{session_id}"

    def worker_key(self, worker: str) -> str:
        return f"{self.worker_key_prefix}{worker}"

    @property
    def degraded(self) -> bool:
        return self._degraded

    # -- the degraded-mode gate ------------------------------------------------------------

    def _usable(self) -> bool:
        """True when operations should go to Redis; while degraded, starts at most one
        background recovery per `retry_after_s` and answers False."""
        if self._closed:
            return False
        if not self._degraded:
            return True
        if self._recovery is None and time.monotonic() >= self._retry_at:
            self._retry_at = time.monotonic() + self.retry_after_s
            self._recovery = asyncio.get_running_loop().create_task(self._recover())
        return False

    async def _call(self, make: Callable[[], Awaitable[T]], timeout_s: float | None = None) -> T:
        """Run one Redis operation under the budget; on any failure turn degraded and raise
        `_RedisDown`."""
        self.redis_ops += 1
        try:
            async with asyncio.timeout(timeout_s or self.op_timeout_s):
                return await make()
        except (RedisError, OSError, TimeoutError) as exc:
            self._went_down(exc)
            raise _RedisDown from exc

    def _went_down(self, exc: BaseException) -> None:
        self.redis_errors += 1
        if not self._degraded:
            self._degraded = True
            self._retry_at = time.monotonic() + self.retry_after_s
            log.warning(
                "session_store_degraded",
                error=f"{type(exc).__name__}: {exc}",
                retry_after_s=self.retry_after_s,
                note="serving sessions from local state until Redis answers again",
            )
            if self.on_down is not None:
                self.on_down()

    # -- SessionStore ----------------------------------------------------------------------

    async def get(self, session_id: str) -> SessionRecord | None:
        if self._usable():
            key = self.session_key(session_id)
            try:
                reply = await self._call(lambda: self._get(keys=[key]))
            except _RedisDown:
                pass
            else:
                if not reply:
                    self.local.discard(session_id)
                    return None
                record = _decode_hash(reply[1])
                if record is None:  # pragma: no cover - the script returns {} instead
                    return None
                pttl_s = max(int(reply[0]), 0) / 1000 if int(reply[0]) >= 0 else self.ttl_s
                self.local.put(session_id, record, self.clock() + pttl_s)
                return record
        self.fallbacks += 1
        return self.local.get_now(session_id)

    async def bind(
        self,
        session_id: str,
        worker: str,
        *,
        turn_tokens: float = 0,
        tenant: str | None = None,
        tip: str | None = None,
    ) -> SessionRecord:
        tokens = _check_tokens(turn_tokens)
        now = self.clock()
        if self._usable():
            keys = [self.session_key(session_id), self.worker_key(worker)]
            args: list[str | int] = [worker, _num(tokens), _num(now), int(self.ttl_s * 1000)]
            args += [tenant or "", session_id, "-" if tip is None else tip]
            try:
                reply = await self._call(lambda: self._bind(keys=keys, args=args))
            except _RedisDown:
                pass
            else:
                record = _decode_hash(reply)
                if record is not None:
                    self.local.put(session_id, record, now + self.ttl_s)
                    return record
        self.fallbacks += 1
        record = self.local.bind_now(
            session_id, worker, turn_tokens=tokens, tenant=tenant, tip=tip, now=now
        )
        self._dirty[session_id] = None
        return record

    async def unbind(self, session_id: str, worker: str) -> bool:
        now = self.clock()
        if self._usable():
            keys = [self.session_key(session_id), self.worker_key(worker)]
            args = [worker, _num(now), "", session_id]
            try:
                done = await self._call(lambda: self._unbind(keys=keys, args=args))
            except _RedisDown:
                pass
            else:
                if done:
                    self.local.unbind_now(session_id, worker, now=now)
                return bool(done)
        self.fallbacks += 1
        if self.local.unbind_now(session_id, worker, now=now) is None:
            return False
        self._dirty[session_id] = None
        return True

    async def forget_worker(self, worker: str) -> int:
        now = self.clock()
        if self._usable():
            try:
                count = await self._call(
                    lambda: self._forget_in_redis(worker, now, not_after=None),
                    self.resync_timeout_s,
                )
            except _RedisDown:
                pass
            else:
                self.local.forget_worker_now(worker, now=now)
                return count
        self.fallbacks += 1
        ids = self.local.forget_worker_now(worker, now=now)
        for sid in ids:
            self._dirty[sid] = None
        self._pending_forget[worker] = now
        return len(ids)

    async def _forget_in_redis(self, worker: str, now: float, not_after: float | None) -> int:
        wkey = self.worker_key(worker)
        members = sorted(str(m) for m in await self._redis.smembers(wkey))
        if not members:
            return 0
        pipe = self._redis.pipeline(transaction=False)
        limit = "" if not_after is None else _num(not_after)
        for sid in members:
            await self._unbind(
                keys=[self.session_key(sid), wkey],
                args=[worker, _num(now), limit, sid],
                client=pipe,
            )
        results = await pipe.execute()
        return sum(1 for r in results if r)

    async def close(self) -> None:
        self._closed = True
        task, self._recovery = self._recovery, None
        if task is not None:
            task.cancel()
            await asyncio.wait([task], timeout=CLOSE_TIMEOUT_S)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._redis.aclose(), CLOSE_TIMEOUT_S)

    def health(self) -> dict[str, object]:
        return {
            "backend": "redis",
            "connected": not self._degraded and not self._closed,
            "degraded": self._degraded,
            "errors": self.redis_errors,
            "dirty_sessions": len(self._dirty),
            "pending_forgets": len(self._pending_forget),
        }

    def stats(self) -> SessionStoreStats:
        return SessionStoreStats(
            backend="redis",
            redis_ops=self.redis_ops,
            redis_errors=self.redis_errors,
            degraded=self._degraded,
            fallbacks=self.fallbacks,
            resyncs=self.resyncs,
            resynced_sessions=self.resynced_sessions,
            dirty_sessions=len(self._dirty),
            local_sessions=len(self.local),
            evictions=self.local.evictions,
        )

    # -- recovery --------------------------------------------------------------------------

    async def resync(self) -> bool:
        """Try to reach Redis now (ignoring `retry_after_s`) and merge all dirty state;
        True when the store is healthy afterwards. For a maintenance loop or shutdown hook;
        request paths never need it (recovery starts by itself)."""
        if not self._degraded:
            return True
        if self._recovery is None:
            self._retry_at = time.monotonic() + self.retry_after_s
            self._recovery = asyncio.get_running_loop().create_task(self._recover())
        task = self._recovery
        await asyncio.shield(task)
        return not self._degraded

    async def _recover(self) -> None:
        try:
            await self._call(self._redis.ping, self.resync_timeout_s)
            while self._dirty or self._pending_forget:
                await self._replay_forgets()
                await self._merge_batch()
            # Nothing dirty and Redis answered: back to normal (no await since the check).
            self._degraded = False
            self.resyncs += 1
            log.info("session_store_recovered", resynced_sessions=self.resynced_sessions)
        except _RedisDown:
            self._retry_at = time.monotonic() + self.retry_after_s
        finally:
            self._recovery = None

    async def _replay_forgets(self) -> None:
        for worker, when in list(self._pending_forget.items()):

            def replay(w: str = worker, t: float = when) -> Awaitable[int]:
                return self._forget_in_redis(w, t, not_after=t)

            await self._call(replay, self.resync_timeout_s)
            if self._pending_forget.get(worker) == when:
                del self._pending_forget[worker]

    async def _merge_batch(self) -> None:
        batch: list[tuple[str, SessionRecord]] = []
        for sid in list(self._dirty)[: self.resync_batch]:
            entry = self.local.peek(sid)
            if entry is None:  # expired or evicted locally: nothing left to push
                self._dirty.pop(sid, None)
                continue
            batch.append((sid, entry[0]))
        if not batch:
            return
        now = self.clock()
        pipe = self._redis.pipeline(transaction=False)
        for sid, rec in batch:
            entry = self.local.peek(sid)
            ttl_ms = max(1, int(((entry[1] if entry else now) - now) * 1000))
            args: list[str | int] = [rec.worker or "", rec.turns, _num(rec.attained_tokens)]
            args += [_num(rec.updated), rec.tenant or "", ttl_ms, sid, rec.tip or ""]
            keys = [self.session_key(sid), self.worker_key(rec.worker or "")]
            await self._merge(keys=keys, args=args, client=pipe)
        replies = await self._call(pipe.execute, self.resync_timeout_s)
        for (sid, sent), reply in zip(batch, replies, strict=True):
            entry = self.local.peek(sid)
            if entry is None or entry[0] is not sent:
                continue  # changed locally meanwhile: stays dirty, merged next round
            merged = _decode_hash(reply)
            if merged is not None:
                self.local.put(sid, merged, entry[1])
            del self._dirty[sid]
            self.resynced_sessions += 1


def make_session_store(
    url: str | None,
    *,
    ttl_s: float = 3600.0,
    max_sessions: int = 1_000_000,
    key_prefix: str = "beamserve:session:",
    op_timeout_s: float = OP_TIMEOUT_S,
    retry_after_s: float = 1.0,
) -> SessionStore:
    """The store for a configured URL: None, ``""`` or ``memory://`` → `MemorySessionStore`
    (`max_sessions` bounds it); ``redis://``, ``rediss://`` or ``unix://`` →
    `RedisSessionStore` (`max_sessions` bounds its local cache)."""
    if not url:
        return MemorySessionStore(ttl_s, max_sessions)
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme in MEMORY_SCHEMES:
        return MemorySessionStore(ttl_s, max_sessions)
    if scheme in REDIS_SCHEMES:
        return RedisSessionStore(
            url,
            ttl_s=ttl_s,
            key_prefix=key_prefix,
            op_timeout_s=op_timeout_s,
            retry_after_s=retry_after_s,
            local_max_sessions=max_sessions,
        )
    valid = ", ".join(f"{s}://" for s in (*MEMORY_SCHEMES, *REDIS_SCHEMES))
    raise SessionStoreError(
        f"session store URL {url!r} has no known scheme; use one of {valid} "
        "(or leave it unset for an in-memory store)"
    )
