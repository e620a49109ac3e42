"""MemorySessionStore and make_session_store: the contract without Redis."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest
from beamserve.router.sessions import (
    MemorySessionStore,
    RedisSessionStore,
    SessionRecord,
    SessionStore,
    SessionStoreError,
    make_session_store,
)
from hypothesis import given, settings
from hypothesis import strategies as st

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


class FakeClock:
    def __init__(self, t: float = 1_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_bind_get_roundtrip_counts_turns_and_service() -> None:
    clock = FakeClock()
    store = MemorySessionStore(clock=clock)

    async def main() -> None:
        assert await store.get("s") is None
        r1 = await store.bind("s", "w1", turn_tokens=100, tenant="acme")
        assert r1 == SessionRecord("w1", 1, 100.0, 1_000.0, "acme")
        clock.t += 5
        r2 = await store.bind("s", "w2", turn_tokens=50.5)
        assert r2 == SessionRecord("w2", 2, 150.5, 1_005.0, "acme")  # tenant kept
        assert await store.get("s") == r2

    run(main())


def test_ttl_counts_from_last_bind_and_get_does_not_extend_it() -> None:
    clock = FakeClock()
    store = MemorySessionStore(ttl_s=10, clock=clock)
    store.bind_now("s", "w")
    clock.t += 9
    assert store.get_now("s") is not None
    clock.t += 1  # 10 s after the bind: expired, the get above did not refresh it
    assert store.get_now("s") is None
    store.bind_now("t", "w")
    clock.t += 9
    store.bind_now("t", "w")
    clock.t += 9
    assert store.get_now("t") is not None  # 18 s after the first bind, 9 after the second
    assert len(store) == 1  # "s" was dropped when touched expired


def test_lru_bound_evicts_least_recently_used() -> None:
    store = MemorySessionStore(max_sessions=2, clock=FakeClock())
    store.bind_now("a", "w")
    store.bind_now("b", "w")
    assert store.get_now("a") is not None  # a is now more recent than b
    store.bind_now("c", "w")
    assert store.get_now("b") is None
    assert store.get_now("a") is not None and store.get_now("c") is not None
    assert len(store) == 2 and store.evictions == 1


def test_expired_entries_make_room_before_live_ones_are_evicted() -> None:
    clock = FakeClock()
    store = MemorySessionStore(ttl_s=10, max_sessions=2, clock=clock)
    store.bind_now("old", "w")
    clock.t += 5
    store.bind_now("live", "w")
    clock.t += 6  # "old" expired, "live" not
    store.bind_now("new", "w")
    assert store.get_now("live") is not None
    assert store.evictions == 0


def test_unbind_only_when_still_bound_and_forget_worker() -> None:
    store = MemorySessionStore(clock=FakeClock())

    async def main() -> None:
        await store.bind("s1", "w1")
        await store.bind("s2", "w1")
        await store.bind("s3", "w2")
        assert await store.unbind("s1", "w2") is False
        assert (await store.get("s1")) == SessionRecord("w1", 1, 0.0, 1_000.0)
        assert await store.unbind("s1", "w1") is True
        rec = await store.get("s1")
        assert rec is not None and rec.worker is None and rec.turns == 1
        assert await store.unbind("s1", "w1") is False
        assert await store.unbind("nope", "w1") is False
        assert await store.forget_worker("w1") == 1  # only s2 is still on w1
        s2, s3 = await store.get("s2"), await store.get("s3")
        assert s2 is not None and s2.worker is None
        assert s3 is not None and s3.worker == "w2"

    run(main())


@pytest.mark.parametrize("tokens", [-1, float("nan"), float("inf")])
def test_bad_turn_tokens_are_refused(tokens: float) -> None:
    with pytest.raises(SessionStoreError, match="turn_tokens"):
        MemorySessionStore().bind_now("s", "w", turn_tokens=tokens)


def test_health_and_stats() -> None:
    store = MemorySessionStore()
    store.bind_now("s", "w")
    assert store.health() == {
        "backend": "memory",
        "connected": True,
        "degraded": False,
        "errors": 0,
        "sessions": 1,
    }
    assert store.stats().local_sessions == 1 and store.stats().backend == "memory"


def test_make_session_store_by_url() -> None:
    async def main() -> None:
        for url in (None, "", "memory://"):
            s = make_session_store(url)
            assert isinstance(s, MemorySessionStore) and isinstance(s, SessionStore)
        r = make_session_store("redis://127.0.0.1:1/0", ttl_s=60)
        assert isinstance(r, RedisSessionStore) and isinstance(r, SessionStore)
        assert r.ttl_s == 60
        await r.close()

    run(main())
    with pytest.raises(SessionStoreError, match=r"redis://"):
        make_session_store("http://localhost:6379")
    with pytest.raises(SessionStoreError, match="key_prefix"):
        RedisSessionStore("redis://127.0.0.1:1/0", key_prefix="nocolon")
    with pytest.raises(SessionStoreError, match="ttl_s"):
        MemorySessionStore(ttl_s=0)


# -- property: the store against a dict model -------------------------------------------------

SIDS = ["a", "b", "c", "d", "e"]
WORKERS = ["w1", "w2", "w3"]
TTL = 10.0
CAP = 3

bind_op = st.tuples(
    st.just("bind"),
    st.sampled_from(SIDS),
    st.sampled_from(WORKERS),
    st.integers(0, 1000).map(float),
)
get_op = st.tuples(st.just("get"), st.sampled_from(SIDS))
# Weighted towards bind/get so that LRU eviction and expiry both happen often.
op = st.one_of(
    bind_op,
    bind_op,
    bind_op,
    get_op,
    get_op,
    st.tuples(st.just("unbind"), st.sampled_from(SIDS), st.sampled_from(WORKERS)),
    st.tuples(st.just("forget"), st.sampled_from(WORKERS)),
    st.tuples(st.just("advance"), st.floats(0, 4)),
)


@dataclass
class Model:
    """Every session ever bound, plus touch order; the store may only have lost a live session
    that is not among the `CAP` most recently touched ones."""

    now: float
    sessions: dict[str, tuple[str | None, int, float, float]] = field(default_factory=dict)
    touched: list[str] = field(default_factory=list)

    def live(self, sid: str) -> tuple[str | None, int, float, float] | None:
        s = self.sessions.get(sid)
        return s if s is not None and s[3] > self.now else None

    def guaranteed(self, sid: str) -> bool:
        recent: list[str] = []
        for k in reversed(self.touched):
            if k not in recent:
                recent.append(k)
            if len(recent) == CAP:
                break
        return self.live(sid) is not None and sid in recent

    def touch(self, sid: str) -> None:
        self.touched.append(sid)


def key(rec: SessionRecord | None) -> tuple[str | None, int, float] | None:
    return None if rec is None else (rec.worker, rec.turns, rec.attained_tokens)


@settings(max_examples=200, deadline=None)
@given(st.lists(op, min_size=10, max_size=80))
def test_memory_store_matches_dict_model(ops: list[tuple[Any, ...]]) -> None:
    clock = FakeClock(0.0)
    store = MemorySessionStore(ttl_s=TTL, max_sessions=CAP, clock=clock)
    model = Model(now=0.0)

    async def main() -> None:
        for o in ops:
            kind = o[0]
            if kind == "advance":
                clock.t += o[1]
                model.now = clock.t
            elif kind == "bind":
                _, sid, worker, tokens = o
                live = model.live(sid)
                must_continue = model.guaranteed(sid)
                rec = await store.bind(sid, worker, turn_tokens=tokens)
                fresh = (worker, 1, tokens)
                cont = None if live is None else (worker, live[1] + 1, live[2] + tokens)
                if must_continue:
                    assert key(rec) == cont
                else:
                    assert key(rec) in (fresh, cont)
                assert rec.updated == clock.t
                model.sessions[sid] = (rec.worker, rec.turns, rec.attained_tokens, clock.t + TTL)
                model.touch(sid)
            elif kind == "get":
                sid = o[1]
                live = model.live(sid)
                got = await store.get(sid)
                expect = None if live is None else (live[0], live[1], live[2])
                if model.guaranteed(sid):
                    assert key(got) == expect
                else:
                    assert key(got) in (None, expect)
                if got is None:
                    model.sessions.pop(sid, None)
                else:
                    model.touch(sid)
            elif kind == "unbind":
                _, sid, worker = o
                live = model.live(sid)
                was_bound = live is not None and live[0] == worker
                done = await store.unbind(sid, worker)
                if model.guaranteed(sid):
                    assert done == was_bound
                else:
                    assert done in (False, was_bound)
                if done:
                    assert live is not None
                    model.sessions[sid] = (None, live[1], live[2], live[3])
                elif was_bound:  # the store had lost it (evicted)
                    model.sessions.pop(sid, None)
            else:
                worker = o[1]
                bound = [s for s in SIDS if (lv := model.live(s)) and lv[0] == worker]
                sure = [s for s in bound if model.guaranteed(s)]
                n = await store.forget_worker(worker)
                assert len(sure) <= n <= len(bound)
                for s in bound:
                    lv = model.live(s)
                    assert lv is not None
                    model.sessions[s] = (None, lv[1], lv[2], lv[3])
            assert len(store) <= CAP

    run(main())
