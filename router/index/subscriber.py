"""KV-event subscribers: each worker's ZMQ event stream, in order, into the `PrefixIndex`.

Contract
--------
`KVEventSubscriber` owns one worker's stream: a SUB socket on the worker's PUB endpoint
(frames ``[topic, seq as 8-byte big-endian, msgpack payload]``, decoded with
``beamserve.kvwire.events.decode_batch`` in the worker's wire format, ``"vllm"`` or
``"sglang"``: `Endpoint.hash_scheme`, its reported geometry's event format), applying each
typed batch to the index exactly once, in ``seq`` order. The ZMQ framing ends here: the index
takes `KVEventBatch`es only.

- **Base.** The first batch seen is the base: its ``seq`` is accepted whatever it is. With
  ``replay_from_start`` the subscriber first asks the replay socket for everything from seq 0
  (what the ring still holds; earlier history is unknowable, which can only make the index
  under-report).
- **Gaps.** Live ``seq`` ``n`` after ``m`` with ``n > m + 1``: one replay request for ``m + 1``
  on a fresh DEALER (vLLM's protocol: send ``[b"", start_seq (8 bytes)]``, receive
  ``[b"", topic, seq, payload]`` per buffered batch ``>= start``, then the end marker
  ``[b"", b"", seq -1, b""]``); the batches ``m+1 .. n-1`` are applied in order, then ``n``.
  When the replay cannot supply all of them (no replay endpoint, timeout, the ring no longer
  reaches back to ``m + 1``, an undecodable payload), the worker's entries are cleared (the
  safe choice: the index may only under-report), ``resyncs`` counts it, whatever contiguous
  tail the replay did return is applied, and the stream continues from ``n``.
- **Tail loss.** A dropped *last* batch shows no gap until the next one; after ``idle_probe_s``
  without traffic the subscriber asks the replay socket for ``last + 1`` onwards (an empty
  answer is the common case).
- **Restarts and reconnects.** A ``seq`` below the last one means the publisher restarted: the
  worker's entries are cleared (``restarts``) and the batch becomes the new base. After the SUB
  reconnects (socket monitor ``EVENT_CONNECTED`` after the first), events may have been lost or
  the engine may be a new process: the entries are cleared (``reconnects``) and the next batch
  is the new base.
- **Undecodable live batch**: counted in ``decode_errors``; its events are lost, so the worker
  is cleared (``resyncs``). A message that is not three frames is skipped (the next seq then
  shows the gap).
- **Leaving.** `close` (or `KVEventHub.remove`) removes the worker from the index at once;
  the socket task is cancelled and closes its sockets (linger 0); `aclose` awaits that.

Everything runs on the asyncio loop that called `start` (``zmq.asyncio``); index writes happen
between awaits, so the index's readers on that loop never see half a batch. Long replays yield
to the loop every ``yield_every`` batches.

Metrics are plain attributes (`SubscriberStats` via `stats()`): ``batches_applied``,
``events_applied``, ``gaps``, ``replay_requests``, ``replayed_batches``, ``replay_failures``,
``resyncs``, ``decode_errors``, ``duplicates``, ``restarts``, ``reconnects``, ``last_seq``.

Parameters (`SubscriberConfig`, strict `from_mapping`)
------------------------------------------------------
| parameter         | default | meaning                                                       |
|-------------------|---------|---------------------------------------------------------------|
| topic             | ""      | SUB topic prefix (vLLM's default topic is "")                  |
| replay_timeout_s  | 2.0     | seconds one replay request may take before it counts as failed |
| replay_from_start | false   | on start, replay the worker's ring from seq 0 first           |
| idle_probe_s      | 10.0    | ask the replay socket for missed tail batches after this much  |
|                   |         | silence; null disables                                        |
| yield_every       | 256     | batches applied between yields to the event loop              |
| rcvhwm            | 100000  | SUB receive high-water mark (messages)                        |

Config example (YAML)::

    kv_events:
      topic: kv-events
      replay_timeout_s: 2.0
      replay_from_start: true
      idle_probe_s: 5.0
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any

import structlog
import zmq
import zmq.asyncio
from beamserve.kvwire.events import (
    END_SEQ,
    KVEventBatch,
    KVEventDecodeError,
    WireFormat,
    decode_batch,
)
from beamserve.router.index.prefix_index import PrefixIndex
from beamserve.router.types import Endpoint
from zmq.utils.monitor import parse_monitor_message

__all__ = [
    "KVEventHub",
    "KVEventSubscriber",
    "KVEventsConfigError",
    "SubscriberConfig",
    "SubscriberStats",
]

_log = structlog.get_logger(__name__)


class KVEventsConfigError(ValueError):
    """A KV-events subscriber setting that is unknown or out of range (the message says which
    keys and values are valid)."""


@dataclass(frozen=True, slots=True)
class SubscriberConfig:
    """How subscribers read their workers' streams; see the module docstring's table."""

    topic: str = ""
    replay_timeout_s: float = 2.0
    replay_from_start: bool = False
    idle_probe_s: float | None = 10.0
    yield_every: int = 256
    rcvhwm: int = 100_000

    def __post_init__(self) -> None:
        if self.replay_timeout_s <= 0:
            raise KVEventsConfigError(
                f"replay_timeout_s must be positive, got {self.replay_timeout_s}; e.g. 2.0"
            )
        if self.idle_probe_s is not None and self.idle_probe_s <= 0:
            raise KVEventsConfigError(
                f"idle_probe_s must be positive or null (off), got {self.idle_probe_s}"
            )
        if self.yield_every <= 0 or self.rcvhwm <= 0:
            raise KVEventsConfigError(
                f"yield_every and rcvhwm must be positive, got {self.yield_every}, {self.rcvhwm}"
            )

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> SubscriberConfig:
        """Parse a config mapping; unknown keys and wrong types are errors naming the fix."""
        valid = {f.name: f for f in fields(cls)}
        unknown = sorted(set(raw) - set(valid))
        if unknown:
            raise KVEventsConfigError(
                f"unknown kv_events key(s) {unknown}; valid keys: {sorted(valid)}"
            )
        types: dict[str, tuple[type, ...]] = {
            "topic": (str,),
            "replay_timeout_s": (int, float),
            "replay_from_start": (bool,),
            "idle_probe_s": (int, float, type(None)),
            "yield_every": (int,),
            "rcvhwm": (int,),
        }
        for key, value in raw.items():
            ok = isinstance(value, types[key])
            if ok and key not in ("replay_from_start",) and isinstance(value, bool):
                ok = False
            if not ok:
                want = " or ".join(t.__name__ for t in types[key])
                raise KVEventsConfigError(
                    f"kv_events.{key} must be {want}, got {type(value).__name__} {value!r}"
                )
        return cls(**dict(raw))


@dataclass(frozen=True, slots=True)
class SubscriberStats:
    """Counters of one subscriber (or their sum over a hub; ``last_seq`` then is -1)."""

    batches_applied: int = 0
    events_applied: int = 0
    gaps: int = 0
    replay_requests: int = 0
    replayed_batches: int = 0
    replay_failures: int = 0
    resyncs: int = 0
    decode_errors: int = 0
    duplicates: int = 0
    restarts: int = 0
    reconnects: int = 0
    last_seq: int = -1


_COUNTERS = tuple(f.name for f in fields(SubscriberStats) if f.name != "last_seq")


class KVEventSubscriber:
    """One worker's event stream into the index. Create, then `start()` on a running loop."""

    def __init__(
        self,
        worker_id: str,
        endpoint: str,
        index: PrefixIndex,
        *,
        replay_endpoint: str | None = None,
        wire_format: WireFormat = "vllm",
        config: SubscriberConfig | None = None,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        if wire_format not in ("vllm", "sglang"):
            raise KVEventsConfigError(
                f"unknown wire format {wire_format!r}; choose 'vllm' or 'sglang'"
            )
        self.worker_id = worker_id
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.wire_format: WireFormat = wire_format
        self.index = index
        self.config = config or SubscriberConfig()
        self._ctx = context
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.connected = asyncio.Event()
        self.error: BaseException | None = None
        self.last_seq: int | None = None
        self._dup_until: int | None = None
        self._rebase = False
        self._connections = 0
        self.batches_applied = 0
        self.events_applied = 0
        self.gaps = 0
        self.replay_requests = 0
        self.replayed_batches = 0
        self.replay_failures = 0
        self.resyncs = 0
        self.decode_errors = 0
        self.duplicates = 0
        self.restarts = 0
        self.reconnects = 0
        self._log = _log.bind(worker=worker_id, endpoint=endpoint)

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> KVEventSubscriber:
        """Start reading on the running loop. Returns self."""
        if self._task is not None or self._closed:
            raise RuntimeError(f"subscriber for {self.worker_id} already started or closed")
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context.instance()
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"kv-events[{self.worker_id}]"
        )
        return self

    def close(self, *, drop_entries: bool = True) -> None:
        """Stop reading and (by default) remove the worker from the index. Idempotent; the
        socket task finishes in the background (await `aclose` to wait for it)."""
        if not self._closed:
            self._closed = True
            if self._task is not None:
                self._task.cancel()
        if drop_entries:
            self.index.remove_worker(self.worker_id)

    async def aclose(self, *, drop_entries: bool = True) -> None:
        """`close`, then wait until the sockets are closed."""
        self.close(drop_entries=drop_entries)
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def stats(self) -> SubscriberStats:
        counts = {name: getattr(self, name) for name in _COUNTERS}
        return SubscriberStats(**counts, last_seq=-1 if self.last_seq is None else self.last_seq)

    # -- the socket task -------------------------------------------------------------------

    async def _run(self) -> None:
        assert self._ctx is not None
        sub = self._ctx.socket(zmq.SUB)
        monitor: zmq.asyncio.Socket | None = None
        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, self.config.rcvhwm)
            sub.setsockopt(zmq.SUBSCRIBE, self.config.topic.encode("utf-8"))
            monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED)
            sub.connect(self.endpoint)
            if self.config.replay_from_start and self.replay_endpoint is not None:
                await self._replay_from(0)
            poller = zmq.asyncio.Poller()
            poller.register(sub, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            probe = self.config.idle_probe_s
            timeout_ms = None if probe is None else int(probe * 1000)
            while True:
                ready = dict(await poller.poll(timeout_ms))
                if not ready:
                    await self._probe()
                    continue
                if monitor in ready:
                    await self._drain_monitor(monitor)
                if sub in ready:
                    for _ in range(self.config.yield_every):
                        try:
                            frames = await sub.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        await self._on_message(frames)
                    await asyncio.sleep(0)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.error = exc
            self._log.exception("kv event subscriber failed; worker entries cleared")
            self.index.clear_worker(self.worker_id)
        finally:
            if monitor is not None:
                with contextlib.suppress(zmq.ZMQError):
                    sub.disable_monitor()
                monitor.close(linger=0)
            sub.close(linger=0)

    async def _drain_monitor(self, monitor: zmq.asyncio.Socket) -> None:
        while True:
            try:
                raw = await monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            event = parse_monitor_message(raw)
            if event["event"] != zmq.EVENT_CONNECTED:
                continue
            self._connections += 1
            if self._connections > 1:
                self._rebase = True
            self.connected.set()

    # -- sequencing ------------------------------------------------------------------------

    async def _on_message(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.decode_errors += 1
            self._log.warning("kv event message malformed", frames=len(frames))
            return
        seq = int.from_bytes(frames[1], "big")
        payload = frames[2]
        if self._rebase:
            self._rebase = False
            self.reconnects += 1
            self._reset("reconnect")
        if self._dup_until is not None:
            if seq <= self._dup_until:
                self.duplicates += 1
                return
            self._dup_until = None
        last = self.last_seq
        if last is not None and seq <= last:
            if seq == last:
                self.duplicates += 1
                return
            self.restarts += 1
            self._reset("publisher restarted", seq=seq, last_seq=last)
            last = None
        if last is None:
            if self.config.replay_from_start and self.replay_endpoint is not None and seq > 0:
                await self._replay_from(0, stop=seq)
        elif seq > last + 1:
            self.gaps += 1
            await self._recover(last + 1, seq)
        self._apply(seq, payload)

    def _reset(self, why: str, **details: Any) -> None:
        self._log.info("kv events rebase; worker entries cleared", why=why, **details)
        self.index.clear_worker(self.worker_id)
        self.last_seq = None
        self._dup_until = None

    def _resync(self, why: str, **details: Any) -> None:
        self.resyncs += 1
        self._log.warning("kv events lost; worker entries cleared", why=why, **details)
        self.index.clear_worker(self.worker_id)

    def _apply(self, seq: int, payload: bytes) -> bool:
        """Decode and apply one batch; an undecodable one loses events: resync."""
        self.last_seq = seq
        try:
            batch: KVEventBatch = decode_batch(payload, self.wire_format)
        except KVEventDecodeError as exc:
            self.decode_errors += 1
            self._resync("undecodable batch", seq=seq, error=str(exc))
            return False
        self.index.apply(self.worker_id, batch)
        self.batches_applied += 1
        self.events_applied += len(batch.events)
        return True

    async def _apply_replayed(self, batches: list[tuple[int, bytes]]) -> None:
        for i, (seq, payload) in enumerate(batches, 1):
            if self._apply(seq, payload):
                self.replayed_batches += 1
            if i % self.config.yield_every == 0:
                await asyncio.sleep(0)

    async def _recover(self, start: int, stop: int) -> None:
        """Fill the gap [start, stop) from the replay socket, or resync."""
        got = await self._request_replay(start, stop)
        if got is None:
            self._resync("replay unavailable", start=start, stop=stop)
            return
        tail = _contiguous_tail(got, stop)
        if not tail or tail[0][0] != start:
            self._resync(
                "replay ring no longer holds the gap",
                start=start,
                stop=stop,
                first=tail[0][0] if tail else None,
            )
        await self._apply_replayed(tail)

    async def _replay_from(self, start: int, stop: int | None = None) -> None:
        """Initial catch-up: apply what the ring still holds from ``start`` (before ``stop``)."""
        got = await self._request_replay(start, stop)
        if not got:
            return
        tail = _contiguous_tail(got, stop)
        await self._apply_replayed(tail)
        if stop is None and tail:
            self._dup_until = tail[-1][0]

    async def _probe(self) -> None:
        """Idle: ask for batches after the last one, in case the stream's tail was dropped."""
        if self.replay_endpoint is None or self.last_seq is None:
            return
        start = self.last_seq + 1
        got = await self._request_replay(start, None)
        if not got:
            return
        tail = _contiguous_tail(got, None)
        if not tail or tail[0][0] != start:
            self._resync("replay ring no longer holds the missed tail", start=start)
        elif tail:
            self.gaps += 1
        await self._apply_replayed(tail)
        if tail:
            self._dup_until = tail[-1][0]

    async def _request_replay(self, start: int, stop: int | None) -> list[tuple[int, bytes]] | None:
        """vLLM's replay protocol on a fresh DEALER: batches with seq in [start, stop) (all
        buffered ones when ``stop`` is None), in order. None: no endpoint, timeout or a
        malformed answer."""
        if self.replay_endpoint is None:
            return None
        assert self._ctx is not None
        self.replay_requests += 1
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        got: list[tuple[int, bytes]] = []
        try:
            dealer.connect(self.replay_endpoint)
            async with asyncio.timeout(self.config.replay_timeout_s):
                await dealer.send_multipart((b"", start.to_bytes(8, "big")))
                while True:
                    frames = await dealer.recv_multipart()
                    if len(frames) != 4 or frames[0] != b"" or len(frames[2]) != 8:
                        self.replay_failures += 1
                        self._log.warning("malformed replay answer", frames=len(frames))
                        return None
                    if frames[2] == END_SEQ and frames[1] == b"" and frames[3] == b"":
                        break
                    seq = int.from_bytes(frames[2], "big")
                    if seq < start:
                        continue
                    if stop is not None and seq >= stop:
                        break
                    got.append((seq, frames[3]))
                    if stop is not None and seq == stop - 1:
                        break
        except TimeoutError:
            self.replay_failures += 1
            self._log.warning(
                "replay request timed out",
                replay=self.replay_endpoint,
                start=start,
                timeout_s=self.config.replay_timeout_s,
            )
            return None
        except zmq.ZMQError as exc:
            self.replay_failures += 1
            self._log.warning("replay request failed", replay=self.replay_endpoint, error=str(exc))
            return None
        finally:
            dealer.close(linger=0)
        return got


def _contiguous_tail(got: list[tuple[int, bytes]], stop: int | None) -> list[tuple[int, bytes]]:
    """The longest run of consecutive seqs at the end of ``got`` (ending at ``stop - 1`` when
    ``stop`` is given; empty if it does not reach it)."""
    if not got or (stop is not None and got[-1][0] != stop - 1):
        return []
    i = len(got) - 1
    while i > 0 and got[i - 1][0] == got[i][0] - 1:
        i -= 1
    return got[i:]


class KVEventHub:
    """The subscribers of every worker that publishes KV events, kept in step with discovery.

    `add(endpoint)` subscribes to ``endpoint.kv_events`` (replay ``endpoint.kv_replay``, wire
    format ``endpoint.hash_scheme``); `remove(worker_id)` unsubscribes and drops the worker
    from the index; `sync(endpoints)` does both to match a discovery snapshot (an endpoint whose
    event endpoints or format changed is re-subscribed from scratch). Call from the loop.
    """

    def __init__(
        self,
        index: PrefixIndex,
        config: SubscriberConfig | None = None,
        *,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.index = index
        self.config = config or SubscriberConfig()
        self._ctx = context
        self._subs: dict[str, KVEventSubscriber] = {}
        self._keys: dict[str, tuple[str | None, str | None, str]] = {}
        self._closing: set[KVEventSubscriber] = set()
        self._retired = SubscriberStats()

    @property
    def subscribers(self) -> Mapping[str, KVEventSubscriber]:
        return dict(self._subs)

    def add(self, endpoint: Endpoint) -> KVEventSubscriber | None:
        """Subscribe to one worker (None when it publishes no events). Re-adding an unchanged
        endpoint keeps the running subscriber; a changed one is replaced."""
        key = (endpoint.kv_events, endpoint.kv_replay, endpoint.hash_scheme)
        current = self._subs.get(endpoint.id)
        if current is not None:
            if self._keys[endpoint.id] == key:
                return current
            self.remove(endpoint.id)
        if endpoint.kv_events is None:
            return None
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context.instance()
        sub = KVEventSubscriber(
            endpoint.id,
            endpoint.kv_events,
            self.index,
            replay_endpoint=endpoint.kv_replay,
            wire_format=endpoint.hash_scheme,
            config=self.config,
            context=self._ctx,
        ).start()
        self._subs[endpoint.id] = sub
        self._keys[endpoint.id] = key
        return sub

    def remove(self, worker_id: str) -> bool:
        """Unsubscribe a worker and drop its index entries. False if it had no subscriber."""
        sub = self._subs.pop(worker_id, None)
        self._keys.pop(worker_id, None)
        self.index.remove_worker(worker_id)
        if sub is None:
            return False
        sub.close()
        self._closing = {s for s in self._closing if s.running}
        self._closing.add(sub)
        self._retired = _add_stats(self._retired, sub.stats())
        return True

    def sync(self, endpoints: Iterable[Endpoint]) -> None:
        """Match a discovery snapshot: subscribe new workers, drop departed ones (their index
        entries too, predictions included), re-subscribe changed ones."""
        wanted = {e.id: e for e in endpoints}
        for worker_id in list(self._subs):
            if worker_id not in wanted:
                self.remove(worker_id)
        for worker_id in self.index.workers:
            if worker_id not in wanted:
                self.index.remove_worker(worker_id)
        for endpoint in wanted.values():
            self.add(endpoint)

    async def aclose(self) -> None:
        """Close every subscriber (dropping their entries) and wait for their sockets."""
        for worker_id in list(self._subs):
            self.remove(worker_id)
        closing, self._closing = self._closing, set()
        for sub in closing:
            await sub.aclose()

    def stats(self) -> dict[str, SubscriberStats]:
        """Per-worker counters of the current subscribers."""
        return {worker_id: sub.stats() for worker_id, sub in self._subs.items()}

    def totals(self) -> SubscriberStats:
        """Counters summed over every subscriber this hub ever ran (monotonic, for
        Prometheus counters); ``last_seq`` is -1."""
        total = self._retired
        for sub in self._subs.values():
            total = _add_stats(total, sub.stats())
        return total


def _add_stats(a: SubscriberStats, b: SubscriberStats) -> SubscriberStats:
    return SubscriberStats(**{name: getattr(a, name) + getattr(b, name) for name in _COUNTERS})
