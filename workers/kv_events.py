"""The workers' KV-event publisher: ZMQ PUB + replay ROUTER in vLLM 0.33's framing.

A router built for vLLM or SGLang subscribes to our workers unchanged. The event types and
their msgpack payloads are `beamserve.kvwire.events` (shared with the router); this module owns
the sockets, every byte of framing following the engines (``vllm/distributed/kv_events.py``):

- PUB frames ``[topic, seq as 8-byte big-endian unsigned, payload]``; one frame set per batch;
  ``seq`` counts batches from 0 per publisher.
- replay: a ROUTER socket; a client (DEALER) sends ``[b"", start_seq as 8 bytes]`` and gets one
  ``[b"", topic, seq, payload]`` per buffered batch with ``seq >= start_seq`` (ring of the last
  ``buffer_steps`` batches), then the end marker ``[b"", b"", seq -1 (8 bytes signed), b""]``.
- faults for tests: a `FaultHook` drops (replay still has the batch) or delays batches.
"""

from __future__ import annotations

import logging
import os
import queue
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeAlias

import zmq
from beamserve.kvwire.events import (
    END_SEQ,
    EventBatchLike,
    KVEvent,
    KVEventBatch,
    WireFormat,
    encode_batch,
)

__all__ = [
    "END_SEQ",
    "FaultAction",
    "FaultHook",
    "KVEventPublisher",
    "KVEventPublisherError",
    "RandomEventFaults",
    "offset_endpoint_port",
]

_log = logging.getLogger(__name__)


class KVEventPublisherError(RuntimeError):
    """The publisher is closed, not started, or its queue stayed full."""


# --- faults ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FaultAction:
    """What the publisher does with one batch: ``drop`` it from the live stream (it still
    enters the replay buffer, so the subscriber sees a seq gap it can recover), or send it
    ``delay_s`` seconds late (later batches queue behind it; order is kept)."""

    drop: bool = False
    delay_s: float = 0.0


DELIVER = FaultAction()

# Called on the publisher thread with (seq, batch) before a batch goes out.
FaultHook: TypeAlias = Callable[[int, EventBatchLike], FaultAction]


@dataclass
class RandomEventFaults:
    """A seeded ``FaultHook``: drop a batch with ``drop_rate``, else delay it ``delay_s``
    with ``delay_rate``. Deterministic for a given seed and batch order."""

    drop_rate: float = 0.0
    delay_rate: float = 0.0
    delay_s: float = 0.0
    seed: int | None = None
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("drop_rate", "delay_rate"):
            rate = getattr(self, name)
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"{name} must lie in [0, 1], got {rate}")
        if self.delay_s < 0:
            raise ValueError(f"delay_s must be ≥ 0, got {self.delay_s}")
        self._rng = random.Random(self.seed)

    def __call__(self, seq: int, batch: EventBatchLike) -> FaultAction:
        if self._rng.random() < self.drop_rate:
            return FaultAction(drop=True)
        if self._rng.random() < self.delay_rate:
            return FaultAction(delay_s=self.delay_s)
        return DELIVER


# --- publisher -------------------------------------------------------------------------------


def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """The engines' per-DP-rank endpoint: tcp port + rank (port 0 stays 0), inproc/ipc
    ``_dp{rank}`` suffix; rank 0 unchanged."""
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{data_parallel_rank}"
    if "tcp" in endpoint:
        base, _, port = endpoint.rpartition(":")
        if not base or int(port) == 0:
            return endpoint
        return f"{base}:{int(port) + data_parallel_rank}"
    raise ValueError(f"invalid endpoint {endpoint!r}: must be tcp:// or inproc://")


def _should_bind(endpoint: str) -> bool:
    # The engines bind wildcard hosts and ipc/inproc and connect elsewhere; a port of 0 can
    # only mean "bind and let the OS choose".
    return (
        "*" in endpoint
        or "::" in endpoint
        or "0.0.0.0" in endpoint
        or endpoint.startswith(("ipc://", "inproc://"))
        or endpoint.endswith(":0")
    )


class KVEventPublisher:
    """ZMQ PUB publisher with a replay ROUTER, speaking vLLM's (or SGLang's) protocol.

    ``publish`` may be called from any thread; one I/O thread owns both sockets, assigns
    ``seq`` (0, 1, 2, … per publisher), sends, keeps the last ``buffer_steps`` batches for
    replay and answers replay requests. ``start`` binds; ``close`` flushes what is queued
    (bounded by ``close_timeout_s``) and closes both sockets. Use as a context manager.

    ``endpoint`` / ``replay_endpoint`` follow ``--kv-events-config``: the tcp port is offset
    by ``data_parallel_rank``; ``tcp://127.0.0.1:0`` binds an OS-chosen port, read back from
    ``bound_endpoint`` / ``bound_replay_endpoint`` after ``start``. Without ``context`` the
    publisher makes its own and terminates it on ``close``, so the ports are free when
    ``close`` returns.
    """

    def __init__(
        self,
        endpoint: str = "tcp://*:5557",
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        data_parallel_rank: int = 0,
        wire_format: WireFormat = "vllm",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        bind: bool | None = None,
        clock: Callable[[], float] = time.time,
        fault_hook: FaultHook | None = None,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        publish_timeout_s: float = 5.0,
        close_timeout_s: float = 2.0,
    ) -> None:
        if wire_format not in ("vllm", "sglang"):
            raise ValueError(f"unknown wire format {wire_format!r}; choose 'vllm' or 'sglang'")
        if buffer_steps <= 0:
            raise ValueError(f"buffer_steps must be positive, got {buffer_steps}")
        self.topic = topic
        self.data_parallel_rank = data_parallel_rank
        self.wire_format: WireFormat = wire_format
        self.buffer_steps = buffer_steps
        self._endpoint = offset_endpoint_port(endpoint, data_parallel_rank) or endpoint
        self._replay_endpoint = offset_endpoint_port(replay_endpoint, data_parallel_rank)
        self._bind = bind
        self._hwm = hwm
        self._clock = clock
        self._fault_hook = fault_hook
        self._fault_lock = threading.Lock()
        # Our own context by default (made in start, terminated in close): libzmq closes
        # listeners asynchronously, and only term() waits until the ports are released.
        self._own_ctx = context is None
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = context
        self._publish_timeout_s = publish_timeout_s
        self._close_timeout_s = close_timeout_s
        self._topic_bytes = topic.encode("utf-8")
        # (batch, its payload) pairs; None asks the thread to stop.
        self._queue: queue.Queue[tuple[EventBatchLike, bytes] | None] = queue.Queue(
            maxsize=max_queue_size
        )
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._buffer_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._state: Literal["new", "running", "closed"] = "new"
        self._thread: threading.Thread | None = None
        self._pub: zmq.Socket[bytes] | None = None
        self._replay: zmq.Socket[bytes] | None = None
        self._wake_r = -1
        self._wake_w = -1
        self._next_seq = 0
        self._sent = 0
        self._dropped = 0
        self._thread_error: BaseException | None = None
        self.bound_endpoint: str | None = None
        self.bound_replay_endpoint: str | None = None

    # -- lifecycle --

    def start(self) -> KVEventPublisher:
        """Bind (or connect) the sockets and start the I/O thread. Returns self."""
        with self._state_lock:
            if self._state != "new":
                raise KVEventPublisherError(f"publisher already {self._state}; make a new one")
            if self._ctx is None:
                self._ctx = zmq.Context()
            pub = self._ctx.socket(zmq.PUB)
            replay: zmq.Socket[bytes] | None = None
            try:
                pub.setsockopt(zmq.LINGER, 0)
                pub.set_hwm(self._hwm)
                bind = self._bind if self._bind is not None else _should_bind(self._endpoint)
                if bind:
                    pub.bind(self._endpoint)
                    self.bound_endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
                else:
                    pub.connect(self._endpoint)
                    self.bound_endpoint = self._endpoint
                if self._replay_endpoint is not None:
                    replay = self._ctx.socket(zmq.ROUTER)
                    replay.setsockopt(zmq.LINGER, 0)
                    # Room for a whole replay plus its end marker, as the engines size it.
                    replay.setsockopt(zmq.SNDHWM, 2 * (self.buffer_steps + 1))
                    replay.bind(self._replay_endpoint)
                    self.bound_replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
            except Exception as exc:
                pub.close(linger=0)
                if replay is not None:
                    replay.close(linger=0)
                if self._own_ctx:
                    self._ctx.term()
                    self._ctx = None
                if isinstance(exc, zmq.ZMQError):
                    raise KVEventPublisherError(
                        f"cannot open KV events endpoints {self._endpoint!r} / "
                        f"{self._replay_endpoint!r}: {exc}; choose a free port (0 lets the OS "
                        "pick) or a distinct one per data-parallel rank"
                    ) from exc
                raise
            self._pub, self._replay = pub, replay
            self._wake_r, self._wake_w = os.pipe()
            os.set_blocking(self._wake_r, False)
            os.set_blocking(self._wake_w, False)  # a full pipe must never block publish()
            self._thread = threading.Thread(
                target=self._run, name=f"kv-events-pub[{self.bound_endpoint}]", daemon=True
            )
            self._state = "running"
            self._thread.start()
        return self

    def close(self) -> None:
        """Flush queued batches (bounded), stop the thread, close sockets. Idempotent."""
        with self._state_lock:
            if self._state == "closed":
                return
            was_running = self._state == "running"
            self._state = "closed"
        if not was_running:
            return
        try:
            self._queue.put(None, timeout=self._close_timeout_s)
        except queue.Full:
            pass
        self._wake()
        assert self._thread is not None
        self._thread.join(timeout=self._close_timeout_s)
        if self._thread.is_alive():  # pragma: no cover - only when zmq itself wedges
            # The thread still owns the sockets and the pipe; it closes the sockets on exit.
            _log.warning("KV event publisher thread did not stop within %ss", self._close_timeout_s)
            return
        self._close_sockets()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        if self._own_ctx and self._ctx is not None:
            self._ctx.term()

    def __enter__(self) -> KVEventPublisher:
        return self.start() if self._state == "new" else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._state == "closed"

    # -- publishing --

    def publish(self, batch: EventBatchLike) -> None:
        """Queue a batch; a None ``data_parallel_rank`` becomes the publisher's rank.

        Accepts ``KVEventBatch`` or any ``EventBatchLike`` (an engine's own batch type), so
        the publisher can be handed to an engine as its event sink (``publisher(batch)``).
        The batch is encoded here, on the caller's thread, so ``KVEventEncodeError`` reaches
        the caller. Raises ``KVEventPublisherError`` when not running or when the queue stays
        full for ``publish_timeout_s`` (a subscriber cannot slow us: PUB drops at its hwm).
        """
        if self._state != "running":
            raise KVEventPublisherError(f"publisher is {self._state}; call start() first")
        if self._thread is not None and not self._thread.is_alive():
            raise KVEventPublisherError(f"publisher thread died: {self._thread_error!r}")
        payload = encode_batch(batch, self.wire_format, data_parallel_rank=self.data_parallel_rank)
        try:
            self._queue.put((batch, payload), timeout=self._publish_timeout_s)
        except queue.Full as exc:
            raise KVEventPublisherError(
                f"KV event queue full for {self._publish_timeout_s}s; raise max_queue_size "
                "or publish fewer, larger batches"
            ) from exc
        self._wake()

    __call__ = publish

    def publish_events(self, events: Sequence[KVEvent], ts: float | None = None) -> None:
        """Publish one batch of ``events`` stamped ``ts`` (default: the publisher's clock)."""
        self.publish(KVEventBatch(self._clock() if ts is None else ts, tuple(events)))

    def set_fault_hook(self, hook: FaultHook | None) -> None:
        """Install (or clear) the hook deciding drop/delay per batch; takes effect next batch."""
        with self._fault_lock:
            self._fault_hook = hook

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every batch queued so far was sent or dropped; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._queue.unfinished_tasks == 0:
                return True
            if self._thread is None or not self._thread.is_alive():
                return self._queue.unfinished_tasks == 0
            time.sleep(0.002)
        return False

    @property
    def next_seq(self) -> int:
        """The seq the next batch will get (= batches handled so far)."""
        return self._next_seq

    @property
    def stats(self) -> dict[str, int]:
        """Counts of batches sent live, dropped by faults, and held for replay."""
        with self._buffer_lock:
            buffered = len(self._buffer)
        return {"sent": self._sent, "dropped": self._dropped, "buffered": buffered}

    def buffered(self, start_seq: int = 0) -> list[tuple[int, bytes]]:
        """A copy of the replay buffer from ``start_seq`` on: (seq, payload) pairs."""
        with self._buffer_lock:
            return [(s, p) for s, p in self._buffer if s >= start_seq]

    # -- I/O thread --

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):
            pass  # pipe full (the thread is awake anyway) or closing

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _run(self) -> None:
        assert self._pub is not None
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        # Batches held back by a delay fault: (due time, seq, payload), sent in order.
        held: deque[tuple[float, int, bytes]] = deque()
        stopping = False
        try:
            while True:
                timeout_ms: int | None = None
                if held:
                    timeout_ms = max(0, int((held[0][0] - time.monotonic()) * 1000) + 1)
                if not stopping and self._queue.empty():
                    events = dict(poller.poll(timeout_ms))
                    if self._wake_r in events:
                        self._drain_wake()
                    if self._replay is not None and self._replay in events:
                        self._serve_replay()
                elif self._replay is not None and self._replay.poll(0):
                    self._serve_replay()
                while held and (stopping or held[0][0] <= time.monotonic()):
                    _, seq, payload = held.popleft()
                    self._send(seq, payload)
                while True:
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if item is None:
                        stopping = True
                        self._queue.task_done()
                        continue
                    self._handle(*item, held, flush_delays=stopping)
                    self._queue.task_done()
                    if self._replay is not None and self._replay.poll(0):
                        self._serve_replay()
                if stopping and self._queue.empty():
                    while held:
                        _, seq, payload = held.popleft()
                        self._send(seq, payload)
                    return
        except BaseException as exc:  # pragma: no cover - surfaced through logs
            self._thread_error = exc
            _log.exception("KV event publisher thread failed")
        finally:
            self._close_sockets()

    def _handle(
        self,
        batch: EventBatchLike,
        payload: bytes,
        held: deque[tuple[float, int, bytes]],
        flush_delays: bool,
    ) -> None:
        seq = self._next_seq
        self._next_seq += 1
        with self._fault_lock:
            hook = self._fault_hook
        action = DELIVER
        if hook is not None:
            try:
                action = hook(seq, batch)
            except Exception:
                # A broken test hook must not stop the event stream.
                _log.exception("KV event fault hook failed for seq %d; delivering", seq)
        if action.drop:
            # Lost on the wire, not in the engine: replay still has it.
            self._dropped += 1
            self._remember(seq, payload)
            return
        if held or (action.delay_s > 0 and not flush_delays):
            due = time.monotonic() + action.delay_s
            if held:
                due = max(due, held[-1][0])
            held.append((due, seq, payload))
            return
        self._send(seq, payload)

    def _send(self, seq: int, payload: bytes) -> None:
        assert self._pub is not None
        self._pub.send_multipart((self._topic_bytes, seq.to_bytes(8, "big"), payload))
        self._sent += 1
        self._remember(seq, payload)

    def _remember(self, seq: int, payload: bytes) -> None:
        with self._buffer_lock:
            self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        assert self._replay is not None
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3:
                _log.warning("ignoring replay request with %d frames (want 3)", len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in self.buffered(start_seq):
                self._replay.send_multipart(
                    (client, b"", self._topic_bytes, seq.to_bytes(8, "big"), payload)
                )
            self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None and not sock.closed:
                sock.close(linger=0)
