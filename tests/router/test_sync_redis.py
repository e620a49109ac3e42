"""Replica sync over a real `redis-server`: two `RouterRuntime`s sharing a Redis (as two router
replicas behind a plain balancer do) see each other's bookings and predictions within a bound,
the bookings go when the flight ends, a killed replica's load disappears after
`peer_stale_after_s`, and Redis going away never fails serving (own book + scrapes)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from beamserve.router.discovery import StaticDiscovery, parse_endpoint_specs
from beamserve.router.load import NO_BOOKING
from beamserve.router.server import RouterRuntime, RuntimeConfig
from beamserve.router.sync import SyncParams, decode_message
from beamserve.router.types import RouteRequest

_path = Path(__file__).resolve().parent / "redis_server.py"
_spec = importlib.util.spec_from_file_location("redis_server", _path)
assert _spec is not None and _spec.loader is not None
_rs = sys.modules.setdefault("redis_server", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(_rs)
RedisServer = _rs.RedisServer
redis_server = _rs.redis_server  # the fixture
free_port = _rs.free_port

T = TypeVar("T")
# Short heartbeats so the staleness bound is quick to test; the flush interval as by default.
PARAMS = SyncParams(heartbeat_s=0.2, peer_stale_after_s=0.6)
# Publish → peer's load: flush interval + two Redis hops on loopback, plus scheduling slack on
# a shared 2-core test machine.
VISIBLE_WITHIN_S = 1.0


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def runtime(url: str, *, port: int, **config: Any) -> RouterRuntime:
    # A worker nobody listens on: scrapes fail (and are not needed: 1 h interval).
    eps = parse_endpoint_specs([{"url": f"http://127.0.0.1:{port}"}])
    cfg = RuntimeConfig(
        redis_url=url, scrape_interval_s=3600, freeze_gc=False, sync_params=PARAMS, **config
    )
    return RouterRuntime(StaticDiscovery(eps), cfg)


async def until(cond: Callable[[], bool], within_s: float, what: str) -> float:
    """Seconds until `cond()` held; fails after `within_s`."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < within_s, f"not within {within_s} s: {what}"
        await asyncio.sleep(0.005)
    return time.monotonic() - t0


def test_two_runtimes_see_each_others_bookings_and_a_killed_one_goes_stale(
    redis_server: RedisServer,
) -> None:
    port = free_port()

    async def main() -> None:
        a, b = runtime(redis_server.url, port=port), runtime(redis_server.url, port=port)
        assert a.sync is not None and b.sync is not None
        assert a.sync.replica_id != b.sync.replica_id
        await a.start()
        await b.start()
        try:
            (ep,) = a.endpoints()
            await until(
                lambda: a.sync is not None and a.sync.transport.subscribed, 5, "a subscribed"
            )
            await until(lambda: b.sync is not None and b.sync.transport.subscribed, 5, "b sub")
            # a routes a request: b sees the booking and the prediction
            req = RouteRequest("r1", 6400, block_hashes=tuple(range(100, 200)))
            d = a.core.open(req)
            a.core.route(d, [ep])
            took = await until(
                lambda: b.loads.load(ep.id).foreign_prefill_tokens == 6400,
                VISIBLE_WITHIN_S,
                "a's booking in b's load",
            )
            assert took < VISIBLE_WITHIN_S
            ld = b.loads.load(ep.id)
            assert (ld.prefill_tokens, ld.in_flight) == (0, 0)  # b's own book stays its own
            assert a.loads.load(ep.id).foreign_prefill_tokens == 0  # a ignores its own echo
            hit = b.index.match(req.block_hashes, [ep.id], block_size=64, sliding_window=512)
            assert hit[ep.id].full_blocks == 100 and hit[ep.id].predicted_blocks == 100
            # the first token moves it to decode, the end removes it
            a.core.first_token(d)
            await until(
                lambda: b.loads.load(ep.id).foreign_decode_tokens == 6400 + 256,
                VISIBLE_WITHIN_S,
                "decode",
            )
            a.core.finish(d)
            await until(
                lambda: b.loads.load(ep.id).effective_decode_tokens == 0,
                VISIBLE_WITHIN_S,
                "a's flight ended",
            )
            # a books again, then dies without a word (its tasks killed, no goodbye)
            a.core.route(a.core.open(RouteRequest("r2", 3000)), [ep])
            await until(
                lambda: b.loads.load(ep.id).foreign_prefill_tokens == 3000,
                VISIBLE_WITHIN_S,
                "r2",
            )
            for t in [*a.sync.transport._tasks, a.sync._heartbeat]:
                assert t is not None
                t.cancel()
            t0 = time.monotonic()
            # heartbeats kept it alive so far; now it goes stale after peer_stale_after_s
            gone = await until(
                lambda: b.loads.load(ep.id).foreign_prefill_tokens == 0, 3.0, "a's load gone"
            )
            assert gone + 0.05 >= PARAMS.peer_stale_after_s - PARAMS.heartbeat_s
            assert time.monotonic() - t0 <= PARAMS.peer_stale_after_s + 1.0
            assert b.sync.state.fresh(time.monotonic()) == []
        finally:
            await b.stop()
            await a.stop()

    run(main())


@contextlib.asynccontextmanager
async def two_subscribed(url: str, port: int) -> AsyncIterator[tuple[RouterRuntime, RouterRuntime]]:
    """Two started runtimes on one Redis, both subscribed to the sync channel; stopped after."""
    a, b = runtime(url, port=port), runtime(url, port=port)
    assert a.sync is not None and b.sync is not None
    await a.start()
    await b.start()
    try:
        await until(lambda: a.sync is not None and a.sync.transport.subscribed, 5, "a")
        await until(lambda: b.sync is not None and b.sync.transport.subscribed, 5, "b")
        yield a, b
    finally:
        await b.stop()
        await a.stop()


def test_redis_down_never_fails_serving_and_sync_returns_with_it(
    redis_server: RedisServer,
) -> None:
    port = free_port()

    async def main() -> None:
        async with two_subscribed(redis_server.url, port) as (a, b):
            assert a.sync is not None and b.sync is not None
            (ep,) = a.endpoints()
            redis_server.kill()
            t0 = time.monotonic()
            for i in range(50):  # routing and booking go on, none of it waits for Redis
                a.core.route(a.core.open(RouteRequest(f"d{i}", 100)), [ep])
            assert time.monotonic() - t0 < 0.5
            await asyncio.sleep(PARAMS.peer_stale_after_s + 0.3)
            assert not a.sync.transport.connected
            assert b.loads.load(ep.id).foreign_prefill_tokens == 0  # a's state went stale
            assert a.loads.load(ep.id).prefill_tokens == 5000  # a's own book is intact
            redis_server.restart()
            await until(
                lambda: b.loads.load(ep.id).foreign_prefill_tokens == 5000,
                10.0,
                "sync back after Redis returned (a heartbeat carries a's book)",
            )
            assert a.sync.transport.connected

    run(main())


def test_a_failed_session_store_call_drops_the_peers_state_at_once(
    redis_server: RedisServer,
) -> None:
    """The session store shares the sync's Redis: its first failed call (a request's lookup,
    usually before the subscriber reads the closed socket) drops what the peers last said, so
    a peer's booking whose end was lost with the channel never steers routing."""
    port = free_port()

    async def main() -> None:
        async with two_subscribed(redis_server.url, port) as (a, b):
            assert a.sync is not None and b.sync is not None
            (ep,) = a.endpoints()
            a.core.route(a.core.open(RouteRequest("held", 3000)), [ep])
            await until(
                lambda: b.loads.load(ep.id).foreign_prefill_tokens == 3000,
                VISIBLE_WITHIN_S,
                "a's booking in b's load",
            )
            # b's sync transport stops listening (it would notice the outage on its own; here
            # only the session store may tell it)
            for t in b.sync.transport._tasks:
                t.cancel()
            redis_server.kill()
            t0 = time.monotonic()
            assert await b.sessions.get("some-session") is None
            assert b.sessions.health()["degraded"]
            assert b.loads.load(ep.id).foreign_prefill_tokens == 0
            assert time.monotonic() - t0 < PARAMS.peer_stale_after_s  # not by going stale

    run(main())


def test_sync_is_off_without_redis_or_when_asked_and_the_channel_is_configurable(
    redis_server: RedisServer,
) -> None:
    port = free_port()
    off = runtime(redis_server.url, port=port, replica_sync=False)
    assert off.sync is None and off.sync_report() is None
    assert b"replica_sync" not in off.router.metrics.render()  # no families when off
    eps = parse_endpoint_specs([{"url": f"http://127.0.0.1:{port}"}])
    assert RouterRuntime(StaticDiscovery(eps), RuntimeConfig(freeze_gc=False)).sync is None

    async def main() -> None:
        import redis.asyncio as aioredis

        rt = runtime(redis_server.url, port=port, sync_channel="custom:sync")
        assert rt.sync is not None and rt.sync.transport.channel == "custom:sync"
        listener = aioredis.from_url(redis_server.url)
        pubsub = listener.pubsub(ignore_subscribe_messages=True)
        await pubsub.subscribe("custom:sync")
        await rt.start()
        try:
            msg = None
            for _ in range(100):  # the first heartbeat
                msg = await pubsub.get_message(timeout=0.1)
                if msg is not None:
                    break
            assert msg is not None
            beat = decode_message(msg["data"])
            assert beat.full and beat.replica == rt.sync.replica_id and beat.books == ()
            assert b"beamserve_router_replica_sync_connected" in rt.router.metrics.render()
            assert rt.loads.book("nowhere") == NO_BOOKING
        finally:
            await rt.stop()
            await pubsub.aclose()  # type: ignore[no-untyped-call]
            await listener.aclose()

    run(main())
