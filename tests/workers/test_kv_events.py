"""KV events: byte-exact payloads, real ZMQ PUB + replay ROUTER on loopback, faults.

Every frame is read back by ``IndependentDecoder`` below: plain ``msgpack``, written from the
wire description in docs/kv-events.md, sharing no code with beamserve's encoder.

Goldens (tests/workers/golden/kv_goldens.json, written by make_kv_goldens.py next to it) are
bytes produced by the engines' own code: vLLM 0.33.0 ``vllm/distributed/kv_events.py`` and
SGLang 0.5.23 ``sglang/srt/disaggregation/kv_events.py`` loaded from the wheels with their
few package imports stubbed; their msgspec structs encoded the payloads, and their real
``ZmqEventPublisher`` ran on loopback to record live frames and a replay transcript.

Hypothesis-generated payloads are also decoded with the engines' own ``msgspec`` decoders, read
from the launchers' contract venvs (``.venv-vllm``, ``.venv-sglang``; ``make install`` builds
both) or from BEAMSERVE_ENGINE_SRC, a folder holding ``vllm/distributed/kv_events.py`` and
``sglang/srt/disaggregation/kv_events.py`` (unzipped from the wheels).
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import socket
import sys
import threading
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from beamserve.kvwire import events as kv_events
from beamserve.kvwire.events import (
    END_SEQ,
    SPEC_KIND_FULL_ATTENTION,
    SPEC_KIND_SLIDING_WINDOW,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    KVEventDecodeError,
    KVEventEncodeError,
    WireFormat,
    decode_batch,
    encode_batch,
)
from beamserve.workers.kv_events import (
    FaultAction,
    KVEventPublisher,
    KVEventPublisherError,
    RandomEventFaults,
    offset_endpoint_port,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.timeout(60)

GOLDENS: dict[str, Any] = json.loads(
    (Path(__file__).parent / "golden" / "kv_goldens.json").read_text()
)
RECV_TIMEOUT_MS = 3000
LOOPBACK = "tcp://127.0.0.1:0"


# --- the independent decoder -----------------------------------------------------------------


@dataclass
class Frame:
    topic: bytes
    seq: int
    ts: float
    events: list[dict[str, Any]]
    dp_rank: int | None
    payload: bytes


class IndependentDecoder:
    """Decodes [topic, seq, payload] frames with plain msgpack; checks the shape as it goes."""

    EVENT_TYPES = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})

    @staticmethod
    def frame(frames: list[bytes]) -> Frame:
        assert len(frames) == 3, f"want [topic, seq, payload], got {len(frames)} frames"
        topic, seq_bytes, payload = frames
        assert len(seq_bytes) == 8
        seq = int.from_bytes(seq_bytes, "big", signed=True)
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        assert isinstance(batch, list) and len(batch) == 3, batch
        ts, events, dp_rank = batch
        assert isinstance(ts, float)
        assert isinstance(events, list)
        for event in events:
            assert isinstance(event, dict) and event.get("type") in IndependentDecoder.EVENT_TYPES
            assert next(iter(event)) == "type", "the tag must be the first key"
        return Frame(topic, seq, ts, events, dp_rank, payload)


# --- helpers ---------------------------------------------------------------------------------


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def make_sub(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, topic: bytes = b"") -> Any:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(endpoint)
    return sub


def make_connected_sub(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, topic: bytes = b""
) -> Any:
    """A SUB that finished its ZMTP handshake with the PUB, plus a moment for the
    subscription to land (bounded; used only where seq must start at 0, without probes)."""
    from zmq.utils.monitor import recv_monitor_message

    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    mon = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        sub.connect(endpoint)
        assert mon.poll(5000), "SUB never completed its handshake"
        recv_monitor_message(mon)
    finally:
        sub.disable_monitor()
        mon.close(linger=0)
    time.sleep(0.1)
    return sub


def sync_subscriber(pub: KVEventPublisher, sub: Any) -> int:
    """Publish empty probe batches until the SUB gets one (PUB/SUB slow joiner), drain the
    rest, and return the seq the next real batch will get."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        pub.publish_events([])
        if sub.poll(50):
            break
    else:
        raise AssertionError("subscriber never connected")
    assert pub.flush(5)
    while sub.poll(100):
        sub.recv_multipart()
    return pub.next_seq


def recv(sub: Any) -> Frame:
    return IndependentDecoder.frame(sub.recv_multipart())


def request_replay(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, start_seq: int
) -> list[Frame]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
        out: list[Frame] = []
        while True:
            frames = dealer.recv_multipart()
            assert frames[0] == b"", "ROUTER replies start with the empty delimiter"
            if frames[2] == END_SEQ:
                assert frames[1:] == [b"", END_SEQ, b""]
                return out
            out.append(IndependentDecoder.frame(frames[1:]))
    finally:
        dealer.close(linger=0)


def stored(i: int, group: int = 0, window: int | None = None) -> BlockStored:
    return BlockStored(
        block_hashes=[1000 + i, 2000 + i],
        parent_block_hash=None if i == 0 else 999 + i,
        token_ids=list(range(8)),
        block_size=4,
        group_idx=group,
        kv_cache_spec_kind=SPEC_KIND_SLIDING_WINDOW if window else SPEC_KIND_FULL_ATTENTION,
        kv_cache_spec_sliding_window=window,
    )


def from_json(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"__bytes__"}:
        return bytes.fromhex(value["__bytes__"])
    if isinstance(value, list):
        return [from_json(v) for v in value]
    return value


EVENT_CLASSES: dict[str, Any] = {
    "BlockStored": BlockStored,
    "BlockRemoved": BlockRemoved,
    "AllBlocksCleared": AllBlocksCleared,
}


def golden_batch(case: dict[str, Any]) -> KVEventBatch:
    events: list[KVEvent] = []
    for ev in case["events"]:
        fields = {k: from_json(v) for k, v in ev.items() if k != "type"}
        if ev["type"] != "AllBlocksCleared":
            fields.setdefault("medium", None)  # absent in the golden means None
        if fields.get("extra_keys"):
            fields["extra_keys"] = [
                None if k is None else tuple(tuple(x) if isinstance(x, list) else x for x in k)
                for k in fields["extra_keys"]
            ]
        events.append(EVENT_CLASSES[ev["type"]](**fields))
    return KVEventBatch(case["ts"], tuple(events), case["dp_rank"])


# --- byte-exact against the engines ----------------------------------------------------------


@pytest.mark.parametrize("case", GOLDENS["vllm_payloads"], ids=lambda c: c["name"])
def test_vllm_payload_bytes_match_vllm_msgspec(case: dict[str, Any]) -> None:
    assert encode_batch(golden_batch(case), "vllm").hex() == case["payload_hex"]


@pytest.mark.parametrize("case", GOLDENS["sglang_payloads"], ids=lambda c: c["name"])
def test_sglang_payload_bytes_match_sglang_msgspec(case: dict[str, Any]) -> None:
    assert encode_batch(golden_batch(case), "sglang").hex() == case["payload_hex"]


@pytest.mark.parametrize(
    ("key", "fmt"), [("vllm_transcript", "vllm"), ("sglang_transcript", "sglang")]
)
def test_publisher_frames_match_real_engine_publisher(
    key: str, fmt: WireFormat, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    """Same batches into our publisher and the engine's ZmqEventPublisher: identical live
    frames (topic, seq from 0, payload) and an identical replay transcript, end marker included,
    with the same ring-buffer eviction (buffer_steps=2)."""
    t = GOLDENS[key]
    pub = KVEventPublisher(
        LOOPBACK, LOOPBACK, topic=t["topic"], buffer_steps=t["buffer_steps"], wire_format=fmt
    )
    # The engines' seq starts at 0, so no probe batches here: wait for the handshake instead.
    with pub:
        sub = make_connected_sub(ctx, pub.bound_endpoint or "", t["topic"].encode())
        for case in t["batches"]:
            pub.publish(golden_batch(case))
        live = [[f.hex() for f in sub.recv_multipart()] for _ in t["batches"]]
        assert live == t["live_frames_hex"]
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
        dealer.connect(pub.bound_replay_endpoint or "")
        dealer.send_multipart([b"", t["replay_from_seq"].to_bytes(8, "big")])
        replay = []
        while True:
            frames = dealer.recv_multipart()
            replay.append([f.hex() for f in frames])
            if frames[2] == END_SEQ:
                break
        assert replay == t["replay_frames_hex"]


# --- fields, groups, sequence numbers --------------------------------------------------------


def test_full_attention_and_window_blocks_are_distinguishable(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    with KVEventPublisher(LOOPBACK, topic="kv-events", data_parallel_rank=2) as pub:
        # rank 2 with port 0: the OS still chooses, the rank is stamped on batches
        sub = make_sub(ctx, pub.bound_endpoint or "", b"kv-events")
        base = sync_subscriber(pub, sub)
        pub.publish_events(
            [
                stored(0, group=0),
                stored(0, group=1, window=512),
                BlockRemoved([1000], group_idx=1),
                AllBlocksCleared(),
            ],
            ts=1764432000.5,
        )
        f = recv(sub)
    assert f.topic == b"kv-events" and f.seq == base and f.dp_rank == 2 and f.ts == 1764432000.5
    full, window, removed, cleared = f.events
    assert full == {
        "type": "BlockStored",
        "block_hashes": [1000, 2000],
        "parent_block_hash": None,
        "token_ids": list(range(8)),
        "block_size": 4,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }
    assert window["group_idx"] == 1
    assert window["kv_cache_spec_kind"] == "sliding_window"
    assert window["kv_cache_spec_sliding_window"] == 512
    assert "kv_cache_spec_sliding_window" not in full
    assert removed == {
        "type": "BlockRemoved",
        "block_hashes": [1000],
        "medium": "GPU",
        "group_idx": 1,
    }
    assert cleared == {"type": "AllBlocksCleared"}


def test_seq_numbers_are_consecutive(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    with KVEventPublisher(LOOPBACK) as pub:
        sub = make_sub(ctx, pub.bound_endpoint or "")
        base = sync_subscriber(pub, sub)
        for i in range(50):
            pub.publish_events([stored(i)])
        seqs = [recv(sub).seq for _ in range(50)]
    assert seqs == list(range(base, base + 50))


def test_gap_recovered_through_replay(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    with KVEventPublisher(LOOPBACK, LOOPBACK, buffer_steps=100) as pub:
        sub = make_sub(ctx, pub.bound_endpoint or "")
        base = sync_subscriber(pub, sub)
        lost = {base + 3, base + 4}
        pub.set_fault_hook(lambda seq, _b: FaultAction(drop=seq in lost))
        for i in range(10):
            pub.publish_events([stored(i)])
        got = [recv(sub) for _ in range(8)]
        assert not sub.poll(200)
        # The subscriber sees the gap in seq and asks for everything from its first miss.
        seqs = [f.seq for f in got]
        gap = next(s for s, t in itertools.pairwise(seqs) if t != s + 1) + 1
        assert gap == base + 3
        replayed = request_replay(ctx, pub.bound_replay_endpoint or "", gap)
        assert pub.stats["dropped"] == 2
    assert [f.seq for f in replayed] == list(range(base + 3, base + 10))
    merged = {f.seq: f for f in got} | {f.seq: f for f in replayed}
    assert sorted(merged) == list(range(base, base + 10))
    for i, seq in enumerate(range(base, base + 10)):
        assert merged[seq].events[0]["block_hashes"] == [1000 + i, 2000 + i]
    # Replayed frames are byte-identical to what the live stream would have carried.
    live_by_seq = {f.seq: f.payload for f in got}
    assert all(live_by_seq[f.seq] == f.payload for f in replayed if f.seq in live_by_seq)


def test_replay_ring_keeps_the_last_n(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    with KVEventPublisher(LOOPBACK, LOOPBACK, buffer_steps=3) as pub:
        for i in range(5):
            pub.publish_events([stored(i)])
        assert pub.flush(5)
        endpoint = pub.bound_replay_endpoint or ""
        assert [f.seq for f in request_replay(ctx, endpoint, 0)] == [2, 3, 4]
        assert [f.seq for f in request_replay(ctx, endpoint, 4)] == [4]
        assert request_replay(ctx, endpoint, 5) == []
        assert request_replay(ctx, endpoint, 2**63) == []


def test_replay_ignores_malformed_requests_and_serves_many_clients(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    with KVEventPublisher(LOOPBACK, LOOPBACK) as pub:
        for i in range(3):
            pub.publish_events([stored(i)])
        assert pub.flush(5)
        endpoint = pub.bound_replay_endpoint or ""
        bad = ctx.socket(zmq.DEALER)
        bad.setsockopt(zmq.LINGER, 0)
        bad.connect(endpoint)
        bad.send_multipart([b"", b"\x00" * 8, b"extra"])
        assert not bad.poll(200), "a malformed request gets no answer"
        bad.close(0)
        results: list[list[int]] = []

        def client(start: int) -> None:
            results.append([f.seq for f in request_replay(ctx, endpoint, start)])

        threads = [threading.Thread(target=client, args=(s,)) for s in (0, 1, 2, 0)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
    assert sorted(results) == [[0, 1, 2], [0, 1, 2], [1, 2], [2]]


def test_delay_fault_keeps_order(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    with KVEventPublisher(LOOPBACK) as pub:
        sub = make_sub(ctx, pub.bound_endpoint or "")
        base = sync_subscriber(pub, sub)
        pub.set_fault_hook(lambda seq, _b: FaultAction(delay_s=0.3 if seq == base else 0.0))
        t0 = time.monotonic()
        for i in range(3):
            pub.publish_events([stored(i)])
        assert not sub.poll(150), "the delayed batch holds back the ones behind it"
        seqs = [recv(sub).seq for _ in range(3)]
        assert time.monotonic() - t0 >= 0.3
    assert seqs == [base, base + 1, base + 2]


def test_random_faults_are_seeded() -> None:
    batch = KVEventBatch(0.0, ())
    a = RandomEventFaults(drop_rate=0.3, delay_rate=0.3, delay_s=0.01, seed=7)
    b = RandomEventFaults(drop_rate=0.3, delay_rate=0.3, delay_s=0.01, seed=7)
    seq_a = [a(i, batch) for i in range(200)]
    assert seq_a == [b(i, batch) for i in range(200)]
    assert 20 < sum(x.drop for x in seq_a) < 100
    assert any(x.delay_s == 0.01 for x in seq_a)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        RandomEventFaults(drop_rate=1.5)


def test_publish_from_many_threads(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    with KVEventPublisher(LOOPBACK) as pub:
        sub = make_sub(ctx, pub.bound_endpoint or "")
        base = sync_subscriber(pub, sub)

        def producer(tid: int) -> None:
            for i in range(50):
                pub.publish_events([BlockRemoved([tid * 1000 + i])])

        threads = [threading.Thread(target=producer, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        frames = [recv(sub) for _ in range(200)]
    assert [f.seq for f in frames] == list(range(base, base + 200))
    per_thread: dict[int, list[int]] = {}
    for f in frames:
        h = f.events[0]["block_hashes"][0]
        per_thread.setdefault(h // 1000, []).append(h % 1000)
    assert per_thread == {t: list(range(50)) for t in range(4)}


# --- lifecycle -------------------------------------------------------------------------------


def _port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def test_lifecycle_and_no_leaked_sockets() -> None:
    pub = KVEventPublisher(LOOPBACK, LOOPBACK)
    with pytest.raises(KVEventPublisherError, match="start"):
        pub.publish_events([])
    pub.start()
    with pytest.raises(KVEventPublisherError, match="already"):
        pub.start()
    pub.publish_events([stored(0)])
    ports = [_port(pub.bound_endpoint or ""), _port(pub.bound_replay_endpoint or "")]
    thread = pub._thread
    pub.close()
    pub.close()  # idempotent
    assert pub.closed and thread is not None and not thread.is_alive()
    assert pub._pub is not None and pub._pub.closed
    assert pub._replay is not None and pub._replay.closed
    with pytest.raises(KVEventPublisherError, match="closed"):
        pub.publish_events([])
    # Both ports are free again.
    for port in ports:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))


def test_bad_event_fails_at_publish_and_the_stream_goes_on(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    with KVEventPublisher(LOOPBACK, wire_format="sglang") as pub:
        sub = make_sub(ctx, pub.bound_endpoint or "")
        base = sync_subscriber(pub, sub)
        with pytest.raises(KVEventEncodeError, match="full-attention group"):
            pub.publish_events([stored(0, 1, 512)])  # SGLang cannot carry a window group

        def broken_hook(seq: int, batch: object) -> FaultAction:
            raise RuntimeError("hook bug")

        pub.set_fault_hook(broken_hook)
        pub.publish_events([BlockRemoved([1])])
        pub.set_fault_hook(None)
        pub.publish_events([BlockRemoved([2])])
        frames = [recv(sub), recv(sub)]
    assert [f.seq for f in frames] == [base, base + 1]
    assert [f.events[0]["block_hashes"] for f in frames] == [[1], [2]]


def test_busy_port_is_a_typed_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        pub = KVEventPublisher(f"tcp://127.0.0.1:{busy}", bind=True)
        with pytest.raises(KVEventPublisherError, match="choose a free port"):
            pub.start()
    pub.close()  # nothing to close, still fine


def test_close_flushes_queued_batches(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    pub = KVEventPublisher(LOOPBACK).start()
    sub = make_sub(ctx, pub.bound_endpoint or "")
    base = sync_subscriber(pub, sub)
    pub.set_fault_hook(lambda seq, _b: FaultAction(delay_s=30.0))
    for i in range(5):
        pub.publish_events([stored(i)])
    t0 = time.monotonic()
    pub.close()  # delays collapse on close: nothing queued is lost
    assert time.monotonic() - t0 < 2
    assert [recv(sub).seq for _ in range(5)] == list(range(base, base + 5))


def test_endpoint_offset_by_dp_rank() -> None:
    assert offset_endpoint_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint_port("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_endpoint_port("tcp://127.0.0.1:0", 3) == "tcp://127.0.0.1:0"
    assert offset_endpoint_port("inproc://cache", 1) == "inproc://cache_dp1"
    assert offset_endpoint_port(None, 1) is None
    with pytest.raises(ValueError, match="tcp"):
        offset_endpoint_port("udp://x:1", 1)


def test_publisher_binds_offset_port() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    with KVEventPublisher(f"tcp://127.0.0.1:{free - 1}", data_parallel_rank=1, bind=True) as pub:
        assert pub.bound_endpoint == f"tcp://127.0.0.1:{free}"


# --- format rules and errors -----------------------------------------------------------------


def test_engine_own_event_types_encode_by_name_and_fields(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """An engine may keep its own event classes (same class and field names, fewer fields):
    the publisher is its sink as-is, and the bytes equal those of our own classes."""

    @dataclass(frozen=True)
    class BlockStored:  # an engine's own class: subset of the fields
        block_hashes: tuple[int, ...]
        parent_block_hash: int | None
        token_ids: tuple[int, ...]
        block_size: int
        group_idx: int
        kv_cache_spec_kind: str
        kv_cache_spec_sliding_window: int | None = None
        medium: str = "GPU"

    @dataclass(frozen=True)
    class Batch:
        ts: float
        events: tuple[object, ...]
        data_parallel_rank: int | None = None

    theirs = Batch(5.0, (BlockStored((1,), None, (1, 2), 2, 1, SPEC_KIND_SLIDING_WINDOW, 512),))
    ours = KVEventBatch(
        5.0,
        (
            kv_events.BlockStored(
                (1,),
                None,
                (1, 2),
                2,
                group_idx=1,
                kv_cache_spec_kind="sliding_window",
                kv_cache_spec_sliding_window=512,
            ),
        ),
        7,
    )
    assert encode_batch(theirs, data_parallel_rank=7) == encode_batch(ours)
    with KVEventPublisher(LOOPBACK, data_parallel_rank=7) as pub:
        sub = make_sub(ctx, pub.bound_endpoint or "")
        sync_subscriber(pub, sub)
        pub(theirs)  # the publisher is a sink: callable with a batch
        assert recv(sub).payload == encode_batch(ours)
    with pytest.raises(KVEventEncodeError, match="cannot encode Batch"):
        encode_batch(KVEventBatch(0.0, (theirs,)))  # type: ignore[arg-type]


def test_format_specific_fields_are_refused() -> None:
    salted = BlockStored([1], None, [1], 1, cache_salt="s")
    with pytest.raises(KVEventEncodeError, match="folds the salt"):
        encode_batch(KVEventBatch(0.0, (salted,)), "vllm")
    assert (
        "cache_salt" in msgpack.unpackb(encode_batch(KVEventBatch(0.0, (salted,)), "sglang"))[1][0]
    )
    with pytest.raises(KVEventEncodeError, match="full-attention group"):
        encode_batch(KVEventBatch(0.0, (stored(0, 1, 512),)), "sglang")
    with pytest.raises(KVEventEncodeError, match="full-attention group"):
        encode_batch(KVEventBatch(0.0, (BlockRemoved([1], group_idx=0),)), "sglang")
    with pytest.raises(KVEventEncodeError, match="cannot encode"):
        encode_batch(KVEventBatch(0.0, (BlockRemoved([2**64]),)))
    with pytest.raises(KVEventEncodeError, match="unknown wire format"):
        encode_batch(KVEventBatch(0.0, (BlockRemoved([1]),)), "tgi")  # type: ignore[arg-type]


def test_decode_rejects_garbage() -> None:
    with pytest.raises(KVEventDecodeError):
        decode_batch(b"\xc1")
    with pytest.raises(KVEventDecodeError):
        decode_batch(msgpack.packb({"ts": 1}))
    with pytest.raises(KVEventDecodeError, match="unknown event type"):
        decode_batch(msgpack.packb([1.0, [{"type": "Nope"}], 0]))


# --- round trips (hypothesis) ----------------------------------------------------------------

u64 = st.integers(min_value=0, max_value=2**64 - 1)
i64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
opt_str = st.none() | st.text(max_size=12)
scalar = st.one_of(st.text(max_size=8), st.integers(0, 2**40), st.binary(max_size=8))


@st.composite
def vllm_events(draw: st.DrawFn) -> KVEvent:
    kind = draw(st.sampled_from(["stored", "removed", "cleared"]))
    hashes = draw(st.lists(st.one_of(u64, st.binary(min_size=32, max_size=32)), max_size=4))
    if kind == "cleared":
        return AllBlocksCleared()
    if kind == "removed":
        return BlockRemoved(
            hashes,
            medium=draw(st.sampled_from([None, "GPU", "CPU", "STORAGE"])),
            group_idx=draw(st.none() | st.integers(0, 8)),
            locality=draw(st.sampled_from([None, "LOCAL", "REMOTE"])),
            ownership=draw(opt_str),
        )
    window = draw(st.booleans())
    n = len(hashes)
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=draw(st.none() | u64),
        token_ids=draw(st.lists(st.integers(0, 2**32 - 1), max_size=3 * max(n, 1))),
        block_size=draw(st.integers(1, 1024)),
        lora_id=draw(st.none() | st.integers(0, 2**31)),
        medium=draw(st.sampled_from([None, "GPU", "CPU", "STORAGE"])),
        lora_name=draw(opt_str),
        extra_keys=draw(st.none() | st.lists(st.none() | st.tuples(scalar, scalar), max_size=n)),
        group_idx=draw(st.none() | st.integers(0, 8)),
        kv_cache_spec_kind=SPEC_KIND_SLIDING_WINDOW if window else SPEC_KIND_FULL_ATTENTION,
        kv_cache_spec_sliding_window=512 if window else None,
        locality=draw(st.sampled_from([None, "LOCAL", "REMOTE"])),
        ownership=draw(opt_str),
        session_id=draw(opt_str),
        lookahead_token_ids=draw(
            st.none() | st.lists(st.lists(st.integers(0, 2**20), max_size=2), max_size=n)
        ),
    )


@st.composite
def sglang_events(draw: st.DrawFn) -> KVEvent:
    kind = draw(st.sampled_from(["stored", "removed", "cleared"]))
    hashes = draw(st.lists(i64, max_size=4))
    medium = draw(st.sampled_from([None, "GPU", "CPU_PINNED", "DISK", "EXTERNAL"]))
    if kind == "cleared":
        return AllBlocksCleared()
    if kind == "removed":
        return BlockRemoved(hashes, medium=medium)
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=draw(st.none() | i64),
        token_ids=draw(st.lists(st.integers(0, 2**63 - 1), max_size=8)),
        block_size=draw(st.integers(1, 64)),
        lora_id=draw(st.none() | st.integers(0, 100)),
        medium=medium,
        cache_salt=draw(opt_str),
        session_id=draw(opt_str),
        lora_name=draw(opt_str),
    )


def batches(events: st.SearchStrategy[KVEvent]) -> st.SearchStrategy[KVEventBatch]:
    return st.builds(
        KVEventBatch,
        ts=st.floats(min_value=0, max_value=2e9, allow_nan=False),
        events=st.lists(events, max_size=5).map(tuple),
        data_parallel_rank=st.none() | st.integers(0, 64),
    )


def independent_view(event: KVEvent, fmt: WireFormat) -> dict[str, Any]:
    """What the wire must say for ``event``, written from the field lists in the docs."""
    if isinstance(event, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    if isinstance(event, BlockRemoved):
        required = ["block_hashes", "medium"] if fmt == "vllm" else ["block_hashes"]
        optional = ["group_idx", "locality", "ownership"] if fmt == "vllm" else ["medium"]
        name = "BlockRemoved"
    else:
        name = "BlockStored"
        required = ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id"]
        if fmt == "vllm":
            required += ["medium", "lora_name"]
            optional = [
                "extra_keys",
                "group_idx",
                "kv_cache_spec_kind",
                "kv_cache_spec_sliding_window",
                "locality",
                "ownership",
                "session_id",
                "lookahead_token_ids",
            ]
        else:
            optional = ["medium", "cache_salt", "session_id", "lora_name"]
    out: dict[str, Any] = {"type": name}

    def plain(v: Any) -> Any:
        return [plain(x) for x in v] if isinstance(v, tuple | list) else v

    for f in required:
        out[f] = plain(getattr(event, f))
    for f in optional:
        if getattr(event, f) is not None:
            out[f] = plain(getattr(event, f))
    return out


@settings(max_examples=150, deadline=None)
@given(batch=batches(vllm_events()))
def test_vllm_round_trip(batch: KVEventBatch) -> None:
    payload = encode_batch(batch, "vllm")
    f = IndependentDecoder.frame([b"", (0).to_bytes(8, "big"), payload])
    assert f.ts == batch.ts and f.dp_rank == batch.data_parallel_rank
    assert f.events == [independent_view(e, "vllm") for e in batch.events]
    # key order is the engines' declaration order too
    assert [list(e) for e in f.events] == [list(independent_view(e, "vllm")) for e in batch.events]
    assert decode_batch(payload, "vllm") == batch
    assert encode_batch(decode_batch(payload, "vllm"), "vllm") == payload


@settings(max_examples=150, deadline=None)
@given(batch=batches(sglang_events()))
def test_sglang_round_trip(batch: KVEventBatch) -> None:
    payload = encode_batch(batch, "sglang")
    f = IndependentDecoder.frame([b"", (0).to_bytes(8, "big"), payload])
    assert f.events == [independent_view(e, "sglang") for e in batch.events]
    assert [list(e) for e in f.events] == [
        list(independent_view(e, "sglang")) for e in batch.events
    ]
    assert encode_batch(decode_batch(payload, "sglang"), "sglang") == payload


# --- optional: the engines' own msgspec decoders ---------------------------------------------

ENGINE_SRC = os.environ.get("BEAMSERVE_ENGINE_SRC")
REPO = Path(__file__).resolve().parents[2]
ENGINE_FILES = {
    "vllm": ("vllm/distributed/kv_events.py", ".venv-vllm"),
    "sglang": ("sglang/srt/disaggregation/kv_events.py", ".venv-sglang"),
}


def _engine_root(tmp: Path) -> Path | None:
    """A folder laid out as the wheels are: BEAMSERVE_ENGINE_SRC, else the two engines'
    kv_events.py linked from the contract venvs that ``make install`` builds."""
    if ENGINE_SRC:
        return Path(ENGINE_SRC)
    for rel, venv in ENGINE_FILES.values():
        found = sorted((REPO / venv).glob(f"lib/python3*/site-packages/{rel}"))
        if not found:
            return None
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).symlink_to(found[0])
    return tmp


def _load_engine_module(kind: str, root: Path) -> types.ModuleType:
    """Load the engines' kv_events.py with their package imports stubbed, exactly as the
    golden script does (it is imported here, not copied)."""
    script = Path(__file__).parent / "golden" / "make_kv_goldens.py"
    spec = importlib.util.spec_from_file_location("make_kv_goldens", script)
    assert spec is not None and spec.loader is not None
    gold = importlib.util.module_from_spec(spec)
    sys.modules["make_kv_goldens"] = gold
    spec.loader.exec_module(gold)
    mod: types.ModuleType = (
        gold.load_vllm_kv_events(root) if kind == "vllm" else gold.load_sglang_kv_events(root)
    )
    return mod


@pytest.fixture(scope="module")
def engine_modules(tmp_path_factory: pytest.TempPathFactory) -> dict[str, types.ModuleType]:
    root = _engine_root(tmp_path_factory.mktemp("engine-src"))
    if root is None:
        # Right only outside `make test`: `make install` (which `make test` runs first) builds
        # both contract venvs, so a plain `make test` never takes this branch.
        pytest.skip("no .venv-vllm/.venv-sglang (make install) and no BEAMSERVE_ENGINE_SRC")
    saved = dict(sys.modules)
    try:
        return {k: _load_engine_module(k, root) for k in ("vllm", "sglang")}
    finally:
        # Drop the stub packages (vllm, sglang, …) so nothing else sees them.
        for name in set(sys.modules) - set(saved):
            if name.split(".")[0] in ("vllm", "sglang"):
                del sys.modules[name]


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(vb=batches(vllm_events()), sb=batches(sglang_events()))
def test_engine_msgspec_decoders_accept_our_payloads(
    engine_modules: dict[str, types.ModuleType], vb: KVEventBatch, sb: KVEventBatch
) -> None:
    import msgspec

    for fmt, batch in (("vllm", vb), ("sglang", sb)):
        mod = engine_modules[fmt]
        payload = encode_batch(batch, fmt)  # type: ignore[arg-type]
        decoded = msgspec.msgpack.Decoder(mod.KVEventBatch).decode(payload)
        assert msgspec.msgpack.Encoder().encode(decoded) == payload
        assert len(decoded.events) == len(batch.events)
        for ours, theirs in zip(batch.events, decoded.events, strict=True):
            assert type(theirs).__name__ == type(ours).__name__
            if isinstance(ours, BlockStored):
                assert list(theirs.block_hashes) == list(ours.block_hashes)
                assert theirs.token_ids == list(ours.token_ids)
                if fmt == "vllm":
                    assert theirs.group_idx == ours.group_idx
                    assert theirs.kv_cache_spec_kind == ours.kv_cache_spec_kind
                    assert theirs.kv_cache_spec_sliding_window == ours.kv_cache_spec_sliding_window
