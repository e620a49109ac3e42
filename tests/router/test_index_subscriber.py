"""KVEventSubscriber / KVEventHub on real ZMQ sockets (127.0.0.1, OS-chosen ports) against our
`KVEventPublisher`: ordered application, gap recovery through vLLM's replay protocol, resyncs
when replay cannot help, restarts, decode errors, worker removal."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import zmq
from beamserve.kvwire.events import (
    SPEC_KIND_FULL_ATTENTION,
    SPEC_KIND_SLIDING_WINDOW,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    WireFormat,
)
from beamserve.router.index.prefix_index import PrefixIndex
from beamserve.router.index.subscriber import (
    KVEventHub,
    KVEventsConfigError,
    KVEventSubscriber,
    SubscriberConfig,
)
from beamserve.router.types import Endpoint
from beamserve.workers.kv_events import FaultAction, KVEventPublisher, RandomEventFaults

LOOPBACK = "tcp://127.0.0.1:0"


def run(body: Callable[[], Coroutine[Any, Any, None]], timeout_s: float = 20.0) -> None:
    """Run an async test body with a hard timeout so a wedged socket fails instead of hangs."""
    asyncio.run(asyncio.wait_for(body(), timeout_s))


async def until(cond: Callable[[], bool], timeout_s: float = 8.0, what: str = "") -> None:
    async def poll() -> None:
        while not cond():
            await asyncio.sleep(0.01)

    try:
        await asyncio.wait_for(poll(), timeout_s)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what or cond}") from None


def random_batches(n: int, seed: int, hybrid: bool = True) -> list[tuple[KVEvent, ...]]:
    """Chains stored and evicted in both groups (or group-less for SGLang), some clears."""
    rng = random.Random(seed)
    pool = [rng.getrandbits(64) for _ in range(40)]
    out: list[tuple[KVEvent, ...]] = []
    for _ in range(n):
        events: list[KVEvent] = []
        for _ in range(rng.randint(1, 3)):
            start = rng.randrange(len(pool))
            hashes = pool[start : start + rng.randint(1, 6)]
            roll = rng.random()
            group = rng.choice([0, 1]) if hybrid else None
            if roll < 0.6:
                kind = {0: SPEC_KIND_FULL_ATTENTION, 1: SPEC_KIND_SLIDING_WINDOW, None: None}
                events.append(
                    BlockStored(
                        hashes, None, [], 16, group_idx=group, kv_cache_spec_kind=kind[group]
                    )
                )
            elif roll < 0.97:
                events.append(BlockRemoved(hashes, group_idx=group))
            else:
                events.append(AllBlocksCleared())
        out.append(tuple(events))
    return out


def reference(worker: str, batches: list[tuple[KVEvent, ...]]) -> dict[str, set[int]]:
    index = PrefixIndex()
    for events in batches:
        index.apply(worker, KVEventBatch(0.0, events))
    resident: dict[str, set[int]] = index.resident(worker)
    return resident


def publisher(**kwargs: Any) -> KVEventPublisher:
    return KVEventPublisher(LOOPBACK, kwargs.pop("replay", LOOPBACK), **kwargs).start()


async def subscribe(pub: KVEventPublisher, index: PrefixIndex, **kw: Any) -> KVEventSubscriber:
    """A started subscriber of worker "w" to `pub` and its replay socket."""
    return await started(
        KVEventSubscriber(
            "w", pub.bound_endpoint or "", index, replay_endpoint=pub.bound_replay_endpoint, **kw
        )
    )


async def started(sub: KVEventSubscriber) -> KVEventSubscriber:
    sub.start()
    await until(sub.connected.is_set, what="SUB connected")
    await asyncio.sleep(0.1)  # let the subscription reach the PUB socket
    return sub


@pytest.mark.parametrize("wire_format", ["vllm", "sglang"])
def test_dropped_batches_are_recovered_through_replay(wire_format: WireFormat) -> None:
    batches = random_batches(80, seed=11, hybrid=wire_format == "vllm")

    async def body() -> None:
        faults = RandomEventFaults(drop_rate=0.25, seed=5)
        # Never drop seq 0 so the first live batch is the base; the tail may be dropped
        # (the idle probe recovers it).
        hook: Callable[[int, Any], FaultAction] = lambda seq, b: (  # noqa: E731
            FaultAction() if seq == 0 else faults(seq, b)
        )
        with publisher(wire_format=wire_format, fault_hook=hook) as pub:
            index = PrefixIndex()
            sub = await subscribe(
                pub, index, wire_format=wire_format, config=SubscriberConfig(idle_probe_s=0.2)
            )
            for events in batches:
                pub.publish_events(events)
                await asyncio.sleep(0)
            assert pub.flush()
            await until(lambda: sub.last_seq == len(batches) - 1, what="all batches applied")
            dropped = pub.stats["dropped"]
            assert dropped > 5
            stats = sub.stats()
            assert stats.gaps > 0 and stats.replayed_batches == dropped
            assert stats.batches_applied == len(batches)
            assert stats.resyncs == 0 and stats.decode_errors == 0
            assert index.resident("w") == reference("w", batches)
            await sub.aclose()
            assert index.workers == []

    run(body)


def test_replay_ring_too_small_clears_the_worker_and_counts_a_resync() -> None:
    stored = [BlockStored([i + 1000], None, [], 64) for i in range(8)]

    async def body() -> None:
        drop = {2, 3, 4, 5}
        hook = lambda seq, b: FaultAction(drop=seq in drop)  # noqa: E731
        with publisher(buffer_steps=2, fault_hook=hook) as pub:
            index = PrefixIndex()
            sub = await subscribe(pub, index, config=SubscriberConfig(idle_probe_s=None))
            for event in stored[:6]:
                pub.publish_events([event])
            # Seq 6 reveals the gap 2..5; by then the ring of 2 holds only 5 and 6.
            await until(lambda: sub.last_seq == 1, what="base batches")
            pub.publish_events([stored[6]])
            await until(lambda: sub.last_seq == 6, what="gap handled")
            assert sub.gaps == 1 and sub.resyncs == 1
            # Cleared, then the tail the ring still had (5) and the live batch 6.
            assert index.resident("w")["full"] == {1005, 1006}
            pub.publish_events([stored[7]])
            await until(lambda: sub.last_seq == 7)
            assert index.resident("w")["full"] == {1005, 1006, 1007}
            await sub.aclose()

    run(body)


@pytest.mark.parametrize("replay", ["none", "down"])
def test_unavailable_replay_clears_the_worker(replay: str) -> None:
    async def body() -> None:
        hook = lambda seq, b: FaultAction(drop=seq == 1)  # noqa: E731
        with publisher(fault_hook=hook, replay=None) as pub:
            index = PrefixIndex()
            # "down": a replay address where nothing listens (a port we bind and release).
            ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
            probe = ctx.socket(zmq.ROUTER)
            port = probe.bind_to_random_port("tcp://127.0.0.1")
            probe.close(linger=0)
            sub = await started(
                KVEventSubscriber(
                    "w",
                    pub.bound_endpoint or "",
                    index,
                    replay_endpoint=None if replay == "none" else f"tcp://127.0.0.1:{port}",
                    config=SubscriberConfig(replay_timeout_s=0.3, idle_probe_s=None),
                )
            )
            pub.publish_events([BlockStored([1], None, [], 64)])
            await until(lambda: sub.last_seq == 0)
            pub.publish_events([BlockStored([2], None, [], 64)])  # dropped
            pub.publish_events([BlockStored([3], None, [], 64)])
            await until(lambda: sub.last_seq == 2, what="gap handled")
            assert (sub.gaps, sub.resyncs) == (1, 1)
            assert sub.replay_failures == (0 if replay == "none" else 1)
            assert index.resident("w")["full"] == {3}
            await sub.aclose()

    run(body)


def test_replay_from_start_catches_up_on_history_and_skips_duplicates() -> None:
    async def body() -> None:
        with publisher() as pub:
            for i in range(5):
                pub.publish_events([BlockStored([i], None, [], 64)])
            assert pub.flush()
            index = PrefixIndex()
            sub = await subscribe(
                pub, index, config=SubscriberConfig(replay_from_start=True, idle_probe_s=None)
            )
            await until(lambda: sub.last_seq == 4, what="history replayed")
            pub.publish_events([BlockRemoved([0])])
            await until(lambda: sub.last_seq == 5)
            assert index.resident("w")["full"] == {1, 2, 3, 4}
            assert sub.replayed_batches == 5 and sub.gaps == 0 and sub.resyncs == 0
            await sub.aclose()

    run(body)


def test_publisher_restart_resets_the_worker_and_rebases() -> None:
    async def body() -> None:
        index = PrefixIndex()
        first = publisher()
        endpoint = first.bound_endpoint or ""
        sub = await started(
            KVEventSubscriber("w", endpoint, index, config=SubscriberConfig(idle_probe_s=None))
        )
        for i in range(3):
            first.publish_events([BlockStored([i], None, [], 64)])
        await until(lambda: sub.last_seq == 2)
        first.close()
        second = KVEventPublisher(endpoint, None, bind=True).start()  # same port, seq from 0 again
        try:
            # Publish until the reconnected SUB sees the new stream.
            for _ in range(100):
                second.publish_events([BlockStored([7], None, [], 64)])
                await asyncio.sleep(0.05)
                if 7 in index.resident("w")["full"]:
                    break
            assert index.resident("w")["full"] == {7}
            assert sub.reconnects + sub.restarts >= 1 and sub.resyncs == 0
        finally:
            second.close()
            await sub.aclose()

    run(body)


async def raw_publisher_and_subscriber() -> tuple[Any, PrefixIndex, KVEventSubscriber]:
    """A bare ZMQ PUB (the test writes frames by hand) and a started subscriber of worker "w"."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    index = PrefixIndex()
    sub = await started(
        KVEventSubscriber(
            "w", f"tcp://127.0.0.1:{port}", index, config=SubscriberConfig(idle_probe_s=None)
        )
    )
    return pub, index, sub


def stored_frames(seq: int, block_hash: int) -> list[bytes]:
    """One message: a batch storing one 64-token block, with sequence number `seq`."""
    from beamserve.kvwire.events import encode_batch

    payload = encode_batch(KVEventBatch(0.0, (BlockStored([block_hash], None, [], 64),)))
    return [b"", seq.to_bytes(8, "big"), payload]


def test_undecodable_payloads_and_malformed_messages_are_counted() -> None:
    async def body() -> None:
        pub, index, sub = await raw_publisher_and_subscriber()
        good = stored_frames

        try:
            pub.send_multipart(good(0, 10))
            await until(lambda: sub.last_seq == 0)
            pub.send_multipart([b"", (1).to_bytes(8, "big"), b"\xc1not msgpack"])
            pub.send_multipart([b"", b"short"])
            pub.send_multipart(good(2, 12))
            await until(lambda: sub.last_seq == 2)
            assert sub.decode_errors == 2 and sub.resyncs == 1
            assert index.resident("w")["full"] == {12}
        finally:
            pub.close(linger=0)
            await sub.aclose()

    run(body)


def test_hub_follows_discovery_and_removal_drops_entries() -> None:
    async def body() -> None:
        with publisher() as vpub, publisher(wire_format="sglang") as spub:
            index = PrefixIndex()
            hub = KVEventHub(index, SubscriberConfig(replay_from_start=True, idle_probe_s=0.2))
            v = Endpoint(
                "v",
                "http://v",
                engine="vllm",
                kv_events=vpub.bound_endpoint,
                kv_replay=vpub.bound_replay_endpoint,
            )
            s = Endpoint(
                "s",
                "http://s",
                engine="sglang",
                kv_events=spub.bound_endpoint,
                kv_replay=spub.bound_replay_endpoint,
            )
            quiet = Endpoint("q", "http://q")
            hub.sync([v, s, quiet])
            assert sorted(hub.subscribers) == ["s", "v"]
            index.predict("q", [1, 2], ttl_s=60.0)
            vpub.publish_events(
                [
                    BlockStored(
                        [1, 2],
                        None,
                        [],
                        64,
                        group_idx=0,
                        kv_cache_spec_kind=SPEC_KIND_FULL_ATTENTION,
                    )
                ]
            )
            spub.publish_events([BlockStored([1, 2, 3], None, [], 16)])
            await until(
                lambda: index.worker_entries("v") == 2 and index.worker_entries("s") == 3,
                what="both streams applied",
            )
            hits = index.match([1, 2, 3], block_size=64, sliding_window=512)
            assert (hits["v"].full_blocks, hits["v"].window_ok) == (2, False)
            assert (hits["s"].full_blocks, hits["s"].window_ok) == (3, True)
            assert hits["q"].predicted_blocks == 2
            assert hub.add(v) is hub.subscribers["v"]  # unchanged: kept
            hub.sync([s])  # v and q left
            assert sorted(hub.subscribers) == ["s"]
            assert sorted(index.workers) == ["s"]
            assert index.match([1], block_size=64, sliding_window=512).keys() == {"s"}
            totals = hub.totals()
            assert totals.batches_applied == 2 and totals.events_applied == 2
            await hub.aclose()
            assert hub.subscribers == {} and index.workers == []

    run(body)


def test_subscriber_config_is_parsed_strictly() -> None:
    config = SubscriberConfig.from_mapping({"topic": "kv-events", "idle_probe_s": None})
    assert config.topic == "kv-events" and config.idle_probe_s is None
    with pytest.raises(KVEventsConfigError, match=r"unknown kv_events key\(s\) \['replay'\]"):
        SubscriberConfig.from_mapping({"replay": True})
    with pytest.raises(KVEventsConfigError, match="valid keys"):
        SubscriberConfig.from_mapping({"topik": ""})
    with pytest.raises(KVEventsConfigError, match="replay_timeout_s must be int or float"):
        SubscriberConfig.from_mapping({"replay_timeout_s": "2"})
    with pytest.raises(KVEventsConfigError, match="replay_timeout_s must be positive"):
        SubscriberConfig.from_mapping({"replay_timeout_s": 0})


def test_seq_going_backwards_means_the_publisher_restarted() -> None:
    async def body() -> None:
        pub, index, sub = await raw_publisher_and_subscriber()
        frames = stored_frames

        try:
            for seq in range(4):
                pub.send_multipart(frames(seq, 100 + seq))
            await until(lambda: sub.last_seq == 3)
            pub.send_multipart(frames(3, 999))  # a duplicate: ignored
            pub.send_multipart(frames(1, 200))  # a new process counting again
            await until(lambda: sub.last_seq == 1)
            assert (sub.restarts, sub.duplicates, sub.resyncs) == (1, 1, 0)
            assert index.resident("w")["full"] == {200}
        finally:
            pub.close(linger=0)
            await sub.aclose()

    run(body)
