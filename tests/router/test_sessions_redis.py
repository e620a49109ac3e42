"""RedisSessionStore against a real redis-server: sharing between router replicas, atomic
increments, TTL, and serving through Redis outages (killed, frozen, restarted empty)."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import redis.asyncio as aioredis
from beamserve.router.sessions import RedisSessionStore, SessionRecord

_path = Path(__file__).resolve().parent / "redis_server.py"
_spec = importlib.util.spec_from_file_location("redis_server", _path)
assert _spec is not None and _spec.loader is not None
_rs = sys.modules.setdefault("redis_server", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(_rs)
RedisServer = _rs.RedisServer
redis_server = _rs.redis_server  # the fixture
free_port = _rs.free_port

T = TypeVar("T")

OP_TIMEOUT = 0.25  # the default (`beamserve.router.sessions.OP_TIMEOUT_S`): loop lag counts
RETRY_AFTER = 0.2
# One operation's wall-time budget while Redis is down: the timeout plus scheduling slack on a
# shared 2-core test machine (0.15 s of slack failed under a load average of 6–15: other
# suites beside this one). Still well under what an unbounded wait on a dead Redis takes (the
# TCP connect and retry timeouts: seconds).
BUDGET_S = OP_TIMEOUT + 0.35


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def replicas(url: str, n: int = 2, **kw: Any) -> list[RedisSessionStore]:
    opts: dict[str, Any] = {"op_timeout_s": OP_TIMEOUT, "retry_after_s": RETRY_AFTER, **kw}
    return [RedisSessionStore(url, **opts) for _ in range(n)]


async def close_all(stores: list[RedisSessionStore]) -> None:
    for s in stores:
        await s.close()


async def timed(op: Awaitable[T]) -> tuple[T, float]:
    t0 = time.perf_counter()
    result = await op
    return result, time.perf_counter() - t0


async def until(cond: Callable[[], Awaitable[bool]], timeout_s: float = 5.0) -> None:
    end = time.monotonic() + timeout_s
    while not await cond():
        assert time.monotonic() < end, "condition not reached in time"
        await asyncio.sleep(0.02)


def test_bind_get_roundtrip_and_layout(redis_server: Any) -> None:
    async def main() -> None:
        (a,) = replicas(redis_server.url, 1, ttl_s=60)
        raw = aioredis.from_url(redis_server.url, decode_responses=True)
        try:
            assert await a.get("s1") is None
            rec = await a.bind("s1", "w1", turn_tokens=100, tenant="acme")
            assert (rec.worker, rec.turns, rec.attained_tokens, rec.tenant) == (
                "w1",
                1,
                100.0,
                "acme",
            )
            assert abs(rec.updated - time.time()) < 5
            assert await a.get("s1") == rec
            h = await raw.hgetall("beamserve:session:s1")
            assert h["worker"] == "w1" and h["turns"] == "1" and float(h["attained"]) == 100
            assert 0 < await raw.ttl("beamserve:session:s1") <= 60
            assert await raw.smembers("beamserve:session-worker:w1") == {"s1"}
            assert not a.degraded and a.stats().redis_errors == 0 and a.stats().redis_ops >= 3
            assert a.health() == {
                "backend": "redis",
                "connected": True,
                "degraded": False,
                "errors": 0,
                "dirty_sessions": 0,
                "pending_forgets": 0,
            }
        finally:
            await raw.aclose()
            await a.close()

    run(main())


def test_two_replicas_share_bindings(redis_server: Any) -> None:
    async def main() -> None:
        a, b = replicas(redis_server.url)
        try:
            await a.bind("s", "w1", turn_tokens=10)
            seen = await b.get("s")
            assert seen is not None and seen.worker == "w1" and seen.turns == 1
            await b.bind("s", "w2", turn_tokens=5)
            seen = await a.get("s")  # a's local cache said w1; Redis wins while healthy
            assert seen is not None
            assert (seen.worker, seen.turns, seen.attained_tokens) == ("w2", 2, 15.0)
        finally:
            await close_all([a, b])

    run(main())


def test_concurrent_binds_from_two_replicas_are_atomic(redis_server: Any) -> None:
    async def main() -> None:
        # A generous timeout: this test is about atomicity, not the outage path.
        a, b = replicas(redis_server.url, op_timeout_s=5.0)
        try:
            binds = [
                store.bind("s", f"w{i % 3}", turn_tokens=1.5)
                for i in range(100)
                for store in (a, b)
            ]
            await asyncio.gather(*binds)
            rec = await a.get("s")
            assert rec is not None
            assert rec.turns == 200 and rec.attained_tokens == 300.0
            assert a.stats().fallbacks == 0 and b.stats().fallbacks == 0
        finally:
            await close_all([a, b])

    run(main())


def test_sessions_expire_after_ttl_and_bind_refreshes_it(redis_server: Any) -> None:
    async def main() -> None:
        # margins of 0.5 s either side of the TTL: a busy machine's scheduling delays are
        # not expiry (at 0.4 s against 0.25 s sleeps this failed under load)
        a, b = replicas(redis_server.url, ttl_s=1.2)
        try:
            await a.bind("gone", "w1")
            await a.bind("kept", "w1")
            await asyncio.sleep(0.7)
            await b.bind("kept", "w2")  # refreshes the TTL
            await asyncio.sleep(0.7)
            assert await b.get("gone") is None
            assert await a.get("gone") is None
            kept = await a.get("kept")
            assert kept is not None and kept.turns == 2
        finally:
            await close_all([a, b])

    run(main())


def test_unbind_only_when_still_bound_and_forget_worker(redis_server: Any) -> None:
    async def main() -> None:
        a, b = replicas(redis_server.url)
        try:
            await a.bind("s1", "w1")
            await a.bind("s2", "w1")
            await a.bind("s3", "w2")
            await b.bind("s2", "w2")  # moved away from w1
            assert await a.unbind("s1", "w2") is False
            assert (r := await b.get("s1")) is not None and r.worker == "w1"
            assert await a.unbind("s1", "w1") is True
            assert (r := await b.get("s1")) is not None and r.worker is None and r.turns == 1
            assert await a.unbind("s1", "w1") is False
            await a.bind("s1", "w1")
            assert await b.forget_worker("w1") == 1  # s1 only: s2 moved to w2
            assert (r := await a.get("s1")) is not None and r.worker is None and r.turns == 2
            assert (r := await a.get("s2")) is not None and r.worker == "w2"
            assert await b.forget_worker("w1") == 0
        finally:
            await close_all([a, b])

    run(main())


def test_killed_redis_local_service_then_recovery_and_resync(redis_server: Any) -> None:
    async def main() -> None:
        a, b = replicas(redis_server.url)
        try:
            await a.bind("s1", "w1", turn_tokens=10)
            assert (await b.get("s1")) is not None
            redis_server.kill()

            worst = 0.0
            got, dt = await timed(a.get("s1"))  # served from a's cache
            worst = max(worst, dt)
            assert got is not None and got.worker == "w1"
            assert a.degraded and a.health()["connected"] is False
            rec, dt = await timed(a.bind("s1", "w2", turn_tokens=5))
            worst = max(worst, dt)
            assert (rec.worker, rec.turns, rec.attained_tokens) == ("w2", 2, 15.0)
            rec2, dt = await timed(a.bind("s2", "w3", turn_tokens=7))
            worst = max(worst, dt)
            assert rec2.turns == 1
            assert await a.unbind("s1", "w1") is False
            for _ in range(50):  # degraded: Redis is skipped between retries
                _, dt = await timed(a.get("s1"))
                worst = max(worst, dt)
            assert worst < BUDGET_S, worst
            st = a.stats()
            assert st.degraded and st.fallbacks >= 54 and st.redis_errors >= 1
            assert st.dirty_sessions == 2

            redis_server.restart()  # same port, empty
            assert await b.get("s1") is None  # b re-dials its dead connection: empty Redis

            async def a_recovered() -> bool:
                await a.get("s1")  # any operation after retry_after_s starts recovery
                return not a.degraded

            await until(a_recovered)
            st = a.stats()
            assert st.resyncs == 1 and st.resynced_sessions == 2 and st.dirty_sessions == 0
            s1, s2 = await b.get("s1"), await b.get("s2")
            assert s1 is not None and (s1.worker, s1.turns, s1.attained_tokens) == ("w2", 2, 15.0)
            assert s2 is not None and (s2.worker, s2.turns) == ("w3", 1)
            assert a.health()["connected"] is True
        finally:
            await close_all([a, b])

    run(main())


def test_frozen_redis_times_out_within_budget_and_merges_by_max(redis_server: Any) -> None:
    async def main() -> None:
        a, b = replicas(redis_server.url)
        try:
            await a.bind("s", "w1", turn_tokens=1)
            await b.get("s")
            redis_server.pause()  # connections hang: only the timeout saves us
            rec, first = await timed(a.bind("s", "w2", turn_tokens=1))
            assert first < BUDGET_S, first
            assert a.degraded and (rec.worker, rec.turns) == ("w2", 2)
            _, later = await timed(a.get("s"))
            assert later < 0.02, later  # degraded: no Redis round trip at all
            redis_server.resume()
            # The timed-out bind may still run on Redis once it wakes up; merging by maximum
            # counts that turn once either way.
            assert await a.resync() is True
            got = await b.get("s")
            assert got is not None and (got.worker, got.turns, got.attained_tokens) == (
                "w2",
                2,
                2.0,
            )
        finally:
            await close_all([a, b])

    run(main())


def test_forget_worker_while_down_is_replayed_without_undoing_newer_binds(
    redis_server: Any,
) -> None:
    async def main() -> None:
        a, b = replicas(redis_server.url, resync_timeout_s=0.3)
        try:
            await a.bind("s1", "w1")
            await a.bind("s2", "w1")
            redis_server.pause()
            assert await a.forget_worker("w1") == 2  # locally
            assert a.degraded and a.health()["pending_forgets"] == 1
            redis_server.resume()
            await asyncio.sleep(0.01)
            await b.bind("s2", "w1")  # after the forget: must survive the replay
            assert await a.resync() is True
            s1, s2 = await b.get("s1"), await b.get("s2")
            assert s1 is not None and s1.worker is None
            assert s2 is not None and (s2.worker, s2.turns) == ("w1", 2)
        finally:
            await close_all([a, b])

    run(main())


def test_unreachable_redis_never_raises() -> None:
    async def main() -> None:
        (a,) = replicas(f"redis://127.0.0.1:{free_port()}/0", 1)
        try:
            rec, dt = await timed(a.bind("s", "w1", turn_tokens=3))
            assert rec == SessionRecord("w1", 1, 3.0, rec.updated)
            assert dt < BUDGET_S
            assert (await a.get("s")) == rec
            assert await a.unbind("s", "w1") is True
            assert await a.forget_worker("w1") == 0
            assert a.degraded and a.health()["errors"] == 1
            await asyncio.sleep(RETRY_AFTER + 0.05)
            await a.get("s")  # starts a background retry, answered locally meanwhile
            await a.resync()
            assert a.degraded and a.stats().redis_errors >= 2
        finally:
            await a.close()

    run(main())


def test_server_fixture_restarts_on_the_same_port(redis_server: Any) -> None:
    port = redis_server.port
    redis_server.kill()
    assert not _rs.ping(port)
    redis_server.restart()
    assert redis_server.port == port and _rs.ping(port)
    redis_server.stop()
    assert not redis_server.running and not _rs.ping(port)


def test_the_operation_budget_is_a_router_flag(redis_server: RedisServer) -> None:
    """`--redis-op-timeout-s` reaches the runtime's store; a budget that is no budget is refused
    by name."""
    import pytest
    from beamserve.router.cli import runtime_config
    from beamserve.router.discovery import StaticDiscovery
    from beamserve.router.server import RouterRuntime

    from beamserve.cli import build_parser

    argv = ["router", "--endpoints", "[]", "--redis", redis_server.url]

    def store_of(*extra: str) -> Any:
        config = runtime_config(build_parser().parse_args([*argv, *extra]))
        return RouterRuntime(StaticDiscovery([]), config).sessions

    wide, default = store_of("--redis-op-timeout-s", "1.5"), store_of()
    assert isinstance(wide, RedisSessionStore) and wide.op_timeout_s == 1.5
    assert isinstance(default, RedisSessionStore) and default.op_timeout_s == OP_TIMEOUT
    for bad in ("0", "-1", "nan", "soon"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([*argv, "--redis-op-timeout-s", bad])
