"""A split pool's drain (`beamserve.router.policy.pool_roles`, "The drain"): once new sessions
stop and the prefill workers run dry, every `kv_both` worker decodes, and continuing turns move
by KV handoff from their busy worker to an idle one. The overlay, the mode switch, the move rule
(by example and by property), the flow controller's word on it, the runtime's wiring, and a run
through the router in front of real sim workers: the moved turn's context is handed over, not
computed again, and nothing stays booked."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from beamserve.router.discovery import StaticDiscovery, parse_endpoint_specs
from beamserve.router.flow import FlowConfig, FlowController
from beamserve.router.policy import PolicyConfigError, pairs_with
from beamserve.router.policy.pool_roles import (
    Drain,
    ModeSwitch,
    PoolRolesParams,
    drain_move,
    overlay,
)
from beamserve.router.server import RouterRuntime, RuntimeConfig
from beamserve.router.types import (
    Endpoint,
    PrefixHit,
    RouteDecision,
    RouteRequest,
    WorkerLoad,
    WorkerView,
)
from hypothesis import given
from hypothesis import strategies as st

from tests.conftest import SpawnWorker
from tests.router.test_flow_prefill_stage import FakeClock, Open, Pool, later, make, settle
from tests.router.test_pace_hold import nothing_booked
from tests.router.test_pool_roles import TOOL_OUTPUT, URL, kv_both_router, swinging, turn
from tests.router.test_router_e2e import metric
from tests.router.test_router_flow import serving

# --- the overlay -----------------------------------------------------------------------------


def test_draining_every_swinging_worker_decodes_and_hands_kv_either_way() -> None:
    fixed = Endpoint("p", "http://p", role="prefill", api="sglang", kv_send=True)
    out = {e.id: e for e in overlay([*swinging(4), fixed], "drain", 2)}
    assert out["p"] is fixed  # a worker of a fixed role keeps it
    assert all(out[f"w{i}"].role == "both" for i in range(4))
    for a in range(4):
        for b in range(4):
            assert pairs_with(out[f"w{a}"], out[f"w{b}"]) == (a != b)
    assert overlay(swinging(1), "drain", 1)[0].role == "both"  # one worker: as colocated
    assert not overlay(swinging(1), "drain", 1)[0].sends_kv


# --- the mode switch -------------------------------------------------------------------------


class Word:
    """What the router says of the drain, and how often it was asked."""

    def __init__(self, state: Drain = "hold") -> None:
        self.state: Drain = state
        self.asked = 0

    def __call__(self) -> Drain:
        self.asked += 1
        return self.state


def test_a_split_pool_drains_when_ready_and_splits_again_when_busy() -> None:
    sw = ModeSwitch(PoolRolesParams(split_at_sessions_per_worker=3, settle_s=10, drain_quiet_s=2))
    word = Word("ready")
    assert sw.observe(11, 4, 0.0, word) == "colocated"
    assert word.asked == 0  # a colocated pool has nothing to drain
    word.state = "hold"
    assert sw.observe(12, 4, 0.1, word) == "split"
    assert sw.observe(12, 4, 0.2, word) == "split"  # held: stays split
    word.state = "ready"
    assert sw.observe(12, 4, 0.3, word) == "drain"
    word.state = "hold"
    assert sw.observe(12, 4, 0.4, word) == "drain"  # held: stays draining
    word.state = "busy"
    assert sw.observe(12, 4, 0.5, word) == "split"
    word.state = "ready"
    assert sw.observe(12, 4, 0.6, word) == "drain"
    # draining, the sessions fall under the lower line: colocated after settling, as from split
    assert sw.observe(7, 4, 1.0, word) == "drain"
    assert sw.observe(7, 4, 11.0, word) == "colocated"
    assert sw.switches == 5


def test_without_drain_quiet_s_the_pool_never_drains() -> None:
    sw = ModeSwitch(PoolRolesParams(split_at_sessions_per_worker=3, drain_quiet_s=None))
    word = Word("ready")
    assert sw.observe(12, 4, 0.0, word) == "split"
    assert sw.observe(12, 4, 1.0, word) == "split"
    assert word.asked == 0


@given(
    steps=st.lists(
        st.tuples(
            st.integers(0, 30), st.floats(0.0, 3.0), st.sampled_from(["ready", "busy", "hold"])
        ),
        max_size=50,
    )
)
def test_the_drain_follows_the_routers_word(steps: list[tuple[int, float, Drain]]) -> None:
    """Only a split pool starts to drain, only on ``ready``; ``busy`` always ends a drain;
    the split and colocate lines act as without a drain (a drain counts as split)."""
    p = PoolRolesParams(split_at_sessions_per_worker=3, settle_s=2, drain_quiet_s=1)
    sw, plain, now = ModeSwitch(p), ModeSwitch(p), 0.0
    for active, dt, state in steps:
        now += dt
        before = sw.mode
        mode = sw.observe(active, 4, now, Word(state))
        ref = plain.observe(active, 4, now)  # the same switch with no drain at all
        assert (mode == "colocated") == (ref == "colocated")
        if mode == "drain":
            assert state != "busy" and (before == "drain" or state == "ready")
            assert before in ("split", "drain")
        if before == "drain" and state == "busy":
            assert mode != "drain"


# --- the move rule ---------------------------------------------------------------------------


def views(in_flight: list[int], warm: int, prefill: list[int] | None = None) -> list[WorkerView]:
    """Views of a draining pool's workers w0, w1, … with these requests in flight and prefill
    tokens queued; `warm`'s index holds the session's context."""
    eps = [
        Endpoint(f"w{i}", f"http://w{i}", api="vllm", kv_send=True, kv_receive=True)
        for i in range(len(in_flight))
    ]
    pre = prefill or [0] * len(in_flight)
    return [
        WorkerView(
            e,
            WorkerLoad(in_flight=n, prefill_tokens=t),
            PrefixHit(full_blocks=100 if i == warm else 0, window_ok=i == warm),
            warm=i == warm,
        )
        for i, (e, n, t) in enumerate(zip(eps, in_flight, pre, strict=True))
    ]


def staying(vs: list[WorkerView], warm: int) -> RouteDecision:
    return RouteDecision(decode=vs[warm].endpoint, expected_hit=vs[warm].hit, reason="sticky")


CONT = RouteRequest("r", 4096, session_id="s", turn=3, band="continuing")
PARAMS = PoolRolesParams(drain_quiet_s=2)


def test_a_continuing_turn_moves_from_its_busy_worker_to_the_least_busy() -> None:
    vs = views([1, 0, 9, 8], warm=2)
    out = drain_move(CONT, staying(vs, 2), vs, PARAMS)
    assert out.reason == "drain-move"
    assert out.decode.id == "w1" and out.prefill is not None and out.prefill.id == "w2"
    assert out.expected_hit == vs[2].hit  # prefilled where its context is


def test_a_turn_stays_unless_the_move_gains_the_margin() -> None:
    vs = views([1, 1, 2, 8], warm=2)
    assert drain_move(CONT, staying(vs, 2), vs, PARAMS).decode.id == "w2"  # 1 + 2 > 2: stays
    one = PoolRolesParams(drain_quiet_s=2, drain_move_margin=1)
    assert drain_move(CONT, staying(vs, 2), vs, one).decode.id == "w0"  # 1 + 1 ≤ 2 (ties: id)
    vs = views([1, 0, 2, 8], warm=2)
    assert drain_move(CONT, staying(vs, 2), vs, PARAMS).decode.id == "w1"  # 0 + 2 ≤ 2


def test_only_continuing_turns_on_their_warm_worker_move() -> None:
    vs = views([0, 0, 9, 9], warm=2)
    first = RouteRequest("r", 4096, session_id="s", band="new")
    assert drain_move(first, staying(vs, 2), vs, PARAMS).reason == "sticky"
    cold = [WorkerView(v.endpoint, v.load, v.hit, warm=False) for v in vs]
    assert drain_move(CONT, staying(cold, 2), cold, PARAMS).reason == "sticky"
    split = RouteDecision(decode=vs[2].endpoint, prefill=vs[0].endpoint, reason="sticky")
    assert drain_move(CONT, split, vs, PARAMS) is split


def test_a_worker_with_prefill_queued_takes_no_move() -> None:
    vs = views([0, 1, 9, 9], warm=2, prefill=[20000, 0, 0, 0])
    assert drain_move(CONT, staying(vs, 2), vs, PARAMS).decode.id == "w1"
    vs = views([0, 5, 9, 9], warm=2, prefill=[20000, 9000, 0, 0])
    assert drain_move(CONT, staying(vs, 2), vs, PARAMS).decode.id == "w2"


def test_no_move_outside_a_pool_that_hands_kv_both_ways() -> None:
    split = {e.id: e for e in overlay(swinging(4), "split", 2)}
    eps = [split[f"w{i}"] for i in range(4)]
    vs = [
        WorkerView(e, WorkerLoad(in_flight=n), warm=i == 2)
        for i, (e, n) in enumerate(zip(eps, [0, 0, 9, 0], strict=True))
    ]
    # w2 decodes only (sends no KV): it cannot be a move's prefill leg
    assert drain_move(CONT, staying(vs, 2), vs, PARAMS).reason == "sticky"


@given(
    in_flight=st.lists(st.integers(0, 20), min_size=2, max_size=6),
    prefill=st.lists(st.integers(0, 20000), min_size=6, max_size=6),
    warm=st.integers(0, 5),
    margin=st.integers(1, 4),
)
def test_a_move_goes_to_the_least_busy_roomy_worker_by_at_least_the_margin(
    in_flight: list[int], prefill: list[int], warm: int, margin: int
) -> None:
    n = len(in_flight)
    warm %= n
    vs = views(in_flight, warm, prefill[:n])
    params = PoolRolesParams(drain_quiet_s=2, drain_move_margin=margin)
    out = drain_move(CONT, staying(vs, warm), vs, params)
    roomy = [i for i in range(n) if i != warm and prefill[i] <= params.drain_max_prefill_tokens]
    least = min((in_flight[i] for i in roomy), default=None)
    should = least is not None and least + margin <= in_flight[warm]
    assert (out.reason == "drain-move") == should
    if should:
        to = int(out.decode.id[1:])
        assert to in roomy and in_flight[to] == least
        assert out.prefill is not None and out.prefill.id == f"w{warm}"
    else:
        assert out.decode.id == f"w{warm}" and out.prefill is None


def test_drain_params_are_checked_and_name_the_field() -> None:
    from beamserve.router.policy import ConditionalDisaggregation

    with pytest.raises(PolicyConfigError, match=r"drain_quiet_s"):
        ConditionalDisaggregation.from_params({"pool_roles": {"drain_quiet_s": 0}})
    with pytest.raises(PolicyConfigError, match=r"drain_move_margin"):
        ConditionalDisaggregation.from_params({"pool_roles": {"drain_move_margin": 0}})


# --- the flow controller's word --------------------------------------------------------------


def test_the_controller_says_busy_then_ready_once_quiet_and_falling() -> None:
    async def main() -> None:
        c = FlowController(FlowConfig(), saturation=Open(), clock=FakeClock())
        c.track_active_peak = True
        active = [40]
        c.active_sessions = lambda: active[0]
        t = await c.admit("new", "a", 30000)  # the peak, 40, sampled now
        t.release()
        assert c.drain_state(2.0, 0.9) == "busy"  # a new session just came
        await later(c, 2.5)
        assert c.drain_state(2.0, 0.9) == "hold"  # quiet, but 40 of a peak of 40
        active[0] = 35
        assert c.drain_state(2.0, 0.9) == "ready"
        assert c.drain_state(2.0, None) == "ready"
        active[0] = 40
        assert c.drain_state(2.0, None) == "ready"  # no share: any quiet spell

    asyncio.run(main())


def test_the_controller_holds_while_new_sessions_wait() -> None:
    async def main() -> None:
        c = make(Pool(50000))  # the prefill worker is full: a long first prompt is held
        a = asyncio.ensure_future(c.admit("new", "a", 30000))
        await settle()
        assert not a.done()
        await later(c, 5.0)
        assert c.drain_state(2.0, None) == "hold"  # quiet, but a new session is held
        a.cancel()
        await settle()
        assert c.drain_state(2.0, None) == "ready"

    asyncio.run(main())


# --- the runtime's wiring --------------------------------------------------------------------


def runtime(**roles: Any) -> tuple[RouterRuntime, list[int]]:
    """A router over 4 `kv_both` workers (not started) whose pool roles are `roles`; set
    `[0]` of the list returned to the pool's active sessions."""
    specs = [{"url": f"http://127.0.0.1:{9 + i}", "role": "both"} for i in range(4)]
    eps = parse_endpoint_specs(specs)
    rt = RouterRuntime(
        StaticDiscovery(eps),
        RuntimeConfig(disaggregation={"pool_roles": {"prefill_workers": 2, **roles}}),
    )
    rt._discovered = [
        Endpoint(e.id, e.url, role="both", api="vllm", kv_send=True, kv_receive=True) for e in eps
    ]
    rt.facts.endpoints = lambda found: list(found)  # type: ignore[method-assign] (as reported)
    count = [0]
    rt.loads.active_sessions = lambda own, now: count[0]  # type: ignore[method-assign]
    return rt, count


def test_the_runtime_drains_once_a_prefill_worker_is_idle() -> None:
    rt, count = runtime(split_at_sessions_per_worker=1, drain_quiet_s=1, drain_below_peak=None)
    roles = rt.pool_roles
    assert roles is not None and rt.core.rebalance is not None
    count[0] = 12
    rt.endpoints()
    assert roles.mode == "split"  # splits at once; the drain is asked from the next look on
    ids = sorted(e.id for e in rt._discovered)
    p0, p1 = ids[0], ids[1]
    # both prefill workers busy: no drain
    f0 = rt.loads.start(ids[2], 20000, 30000, p0)
    f1 = rt.loads.start(ids[3], 20000, 30000, p1)
    rt.endpoints()
    assert roles.mode == "split"
    rt.loads.finish(f0)  # one is idle now
    eps = {e.id: e for e in rt.endpoints()}
    assert roles.mode == "drain"
    assert all(e.role == "both" and e.sends_kv and e.receives_kv for e in eps.values())
    rt.loads.finish(f1)


def test_a_router_without_a_drain_never_moves() -> None:
    assert PoolRolesParams().drain_quiet_s == 2.0  # on by default
    rt, count = runtime(split_at_sessions_per_worker=1, drain_quiet_s=None)
    assert rt.core.rebalance is None
    count[0] = 12
    rt.endpoints()
    assert rt.pool_roles is not None and rt.pool_roles.mode == "split"


# --- through the router, real kv_both sim workers --------------------------------------------


def test_a_draining_pool_moves_a_turn_by_kv_handoff(spawn_worker: SpawnWorker) -> None:
    """Two `kv_both` workers split 1 + 1; two sessions decode on the decode worker. No new
    session comes and the prefill worker is idle, so the pool drains: the next turn of one
    session, while the other still streams there, moves to the idle worker — its new part
    prefilled where its context is, the whole context handed over by KV transfer, no
    recompute. The session's next turn stays where it moved. Nothing stays booked."""
    rt, ids, urls = kv_both_router(
        spawn_worker, 2, prefill_workers=1, split_at_sessions_per_worker=0.5, settle_s=3600,
        drain_quiet_s=0.3, drain_below_peak=None, drain_move_margin=1,
    )  # fmt: skip
    roles = rt.pool_roles
    assert roles is not None
    p, d = ids  # the lower id prefills while split

    async def ask(c: httpx.AsyncClient, sid: str, msgs: list[Any], n: int = 2) -> Any:
        r = await c.post(URL, json={"model": "beam", "messages": msgs, "max_tokens": n},
                         headers={"x-session-id": sid})  # fmt: skip
        assert r.status_code == 200, r.text
        return r.json()

    async def main() -> None:
        async with serving(rt) as c:
            hist: dict[str, list[Any]] = {}
            for sid in ("a", "b"):
                msgs = turn([], f"session {sid}: " + TOOL_OUTPUT)
                out = await ask(c, sid, msgs)
                hist[sid] = [*msgs, out["choices"][0]["message"]]
                record = await rt.sessions.get(sid)
                assert record is not None and record.worker == d
            assert roles.mode == "split"
            await asyncio.sleep(0.5)  # quiet: no new session for longer than drain_quiet_s
            # b streams a long answer on d while a's next turn comes
            long_b = asyncio.ensure_future(ask(c, "b", turn(hist["b"], "explain"), n=400))
            await asyncio.sleep(0.3)
            sent_before = metric(urls[1], "beamserve_worker_kv_transfers_total")
            hits_before = metric(urls[1], "vllm:prefix_cache_hits_total")
            out = await ask(c, "a", turn(hist["a"], "now fix the bug"))
            assert roles.mode == "drain"
            record = await rt.sessions.get("a")
            assert record is not None and record.worker == p  # moved to the idle worker
            # its new part prefilled on d, where its context was; p took the KV handed over
            assert metric(urls[1], "vllm:prefix_cache_hits_total") - hits_before > 5000
            assert metric(urls[0], "beamserve_worker_kv_transfers_total") == 1
            assert metric(urls[1], "beamserve_worker_kv_transfers_total") == sent_before
            assert metric(urls[0], "beamserve_worker_kv_recompute_fallbacks_total") == 0
            await long_b
            # the next turn stays where the session moved, its context cached there
            msgs = turn([*turn(hist["a"], "now fix the bug"), out["choices"][0]["message"]], "ok")
            again = await ask(c, "a", msgs)
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 5000
            record = await rt.sessions.get("a")
            assert record is not None and record.worker == p
            text = (await c.get("/metrics")).text
            assert "beamserve_router_pool_draining 1.0" in text
            assert 'beamserve_router_decisions_total{reason="drain-move"} 1.0' in text
            nothing_booked(rt, *ids)

    asyncio.run(main())
