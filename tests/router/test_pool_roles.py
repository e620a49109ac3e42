"""Pool roles that follow the load (`beamserve.router.policy.pool_roles`): the overlay, the
mode switch, the active-session count, and runs through the router in front of real `kv_both`
sim workers — colocated while idle, split once busy, and a session on a worker that became a
prefill worker moves by a KV handoff from that worker, not by computing its context again."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from beamserve.router.discovery import StaticDiscovery, parse_endpoint_specs
from beamserve.router.load import LoadBook
from beamserve.router.policy import ConditionalDisaggregation, PolicyConfigError, pairs_with
from beamserve.router.policy.pool_roles import (
    ModeSwitch,
    PoolRoles,
    PoolRolesParams,
    overlay,
    swings,
)
from beamserve.router.server import RouterRuntime, RuntimeConfig
from beamserve.router.types import Endpoint
from hypothesis import example, given
from hypothesis import strategies as st

from tests.conftest import SpawnWorker
from tests.router.test_pace_hold import metric as metric_in
from tests.router.test_pace_hold import nothing_booked
from tests.router.test_router_e2e import metric
from tests.router.test_router_flow import serving

KV_BOTH = (("kv_role", "kv_both"),)


def swinging(n: int) -> list[Endpoint]:
    return [
        Endpoint(f"w{i}", f"http://w{i}", labels=KV_BOTH, api="vllm", kv_send=True, kv_receive=True)
        for i in (3, 1, 2, 0)[:n]
    ]


# --- the overlay -----------------------------------------------------------------------------


def test_colocated_every_swinging_worker_serves_whole_requests() -> None:
    fixed = Endpoint("p", "http://p", role="prefill", api="sglang", kv_send=True)
    out = overlay([*swinging(4), fixed], "colocated", 2)
    assert [e.role for e in out[:4]] == ["both"] * 4
    assert not any(e.sends_kv or e.receives_kv for e in out[:4])
    assert out[4] is fixed  # a worker of a fixed role keeps it


def test_split_the_lowest_ids_prefill_and_each_pairs_with_each_decode_worker() -> None:
    out = {e.id: e for e in overlay(swinging(4), "split", 2)}
    assert {i for i, e in out.items() if e.role == "prefill"} == {"w0", "w1"}
    assert {i for i, e in out.items() if e.role == "decode"} == {"w2", "w3"}
    for p in ("w0", "w1"):
        for d in ("w2", "w3"):
            assert pairs_with(out[p], out[d]) and not pairs_with(out[d], out[p])
    # never all prefill: one worker is always left to decode
    out3 = overlay(swinging(3), "split", 5)
    assert [e.role for e in sorted(out3, key=lambda e: e.id)] == ["prefill", "prefill", "decode"]
    # a lone swinging worker cannot split
    assert overlay(swinging(1), "split", 1)[0].role == "both"


def test_only_both_role_workers_that_send_and_receive_swing() -> None:
    assert swings(swinging(1)[0])
    assert not swings(Endpoint("a", "http://a", api="vllm", kv_send=False, kv_receive=False))
    assert not swings(Endpoint("b", "http://b", role="decode", kv_send=True, kv_receive=True))
    # an SGLang worker in `null` mode is never kv_both, whatever its label
    assert not swings(Endpoint("c", "http://c", labels=KV_BOTH, api="sglang", kv_send=False,
                               kv_receive=False))  # fmt: skip


# --- the mode switch -------------------------------------------------------------------------


def test_splits_at_once_and_colocates_only_after_settling() -> None:
    sw = ModeSwitch(PoolRolesParams(split_at_sessions_per_worker=3, settle_s=10))
    assert sw.observe(11, 4, 0.0) == "colocated"
    assert sw.observe(12, 4, 0.1) == "split"
    assert sw.observe(7, 4, 1.0) == "split"  # under 2 a worker: the settle clock starts
    assert sw.observe(8, 4, 5.0) == "split"  # back at 2 a worker: it stops
    assert sw.observe(7, 4, 6.0) == "split"
    assert sw.observe(7, 4, 15.9) == "split"
    assert sw.observe(7, 4, 16.0) == "colocated"
    assert sw.switches == 2
    assert sw.observe(99, 1, 17.0) == "colocated"  # one worker: nothing to split


@example(steps=[(10, 0.0), (0, 0.1), (0, 1.5)], split_at=1.0, gap=0.5, settle=1.0)
@given(
    steps=st.lists(st.tuples(st.integers(0, 40), st.floats(0.0, 5.0)), max_size=60),
    split_at=st.floats(0.5, 6.0),
    gap=st.floats(0.0, 1.0),
    settle=st.floats(0.0, 8.0),
)
def test_the_switch_follows_its_thresholds(
    steps: list[tuple[int, float]], split_at: float, gap: float, settle: float
) -> None:
    """Split whenever the sessions reach the split line; colocated again only after `settle`
    seconds all under the lower line; `switches` counts every change."""
    p = PoolRolesParams(split_at_sessions_per_worker=split_at,
                        colocate_below_sessions_per_worker=max(split_at * (1 - gap), 0.01),
                        settle_s=settle)  # fmt: skip
    sw, now, prev, changes = ModeSwitch(p), 0.0, "colocated", 0
    low_since: float | None = None
    for active, dt in steps:
        now += dt
        low = active < p.colocate_below * 4
        low_since = (low_since if low_since is not None else now) if low else None
        mode = sw.observe(active, 4, now)
        if active >= split_at * 4:
            assert mode == "split"
        if prev == "split" and mode == "colocated":
            assert low_since is not None and now - low_since >= settle
        if mode == "split" and low_since is not None:
            assert now - low_since < settle  # it stays split only while not settled low
        changes += mode != prev
        if mode == "colocated":
            low_since = None
        prev = mode
    assert sw.switches == changes


def test_params_are_checked_and_name_the_field() -> None:
    with pytest.raises(PolicyConfigError, match=r"pool_roles\.prefil_workers"):
        ConditionalDisaggregation.from_params({"pool_roles": {"prefil_workers": 2}})
    with pytest.raises(PolicyConfigError, match="colocate_below_sessions_per_worker"):
        ConditionalDisaggregation.from_params(
            {"pool_roles": {"colocate_below_sessions_per_worker": 11}}
        )
    with pytest.raises(PolicyConfigError, match=r"pool_roles\.prefill_workers"):
        ConditionalDisaggregation.from_params({"pool_roles": {"prefill_workers": 0}})
    assert ConditionalDisaggregation.from_params({}).params.pool_roles is None
    with pytest.raises(PolicyConfigError, match="spill_at_sessions_per_worker"):
        ConditionalDisaggregation.from_params(
            {"pool_roles": {"split_at_sessions_per_worker": 6, "spill_at_sessions_per_worker": 5}}
        )


def test_the_spill_acts_only_when_split_and_past_its_line() -> None:
    """`spilling` (what the router's spill target asks): never colocated; split, from
    `spill_at_sessions_per_worker` active sessions a worker until under half of that (null:
    whenever split)."""
    lined = PoolRoles(
        PoolRolesParams(split_at_sessions_per_worker=2, spill_at_sessions_per_worker=4)
    )
    plain = PoolRoles(PoolRolesParams(split_at_sessions_per_worker=2))
    eps = swinging(4)
    for active, mode, lined_spills, plain_spills in (
        (0, "colocated", False, False),
        (7, "colocated", False, False),
        (8, "split", False, True),
        (15, "split", False, True),
        (16, "split", True, True),
        (9, "split", True, True),  # under the spill line again: on until under half of it
        (8, "split", True, True),
        (7, "split", False, True),
        (9, "split", False, True),
    ):
        lined.apply(eps, active, 0.0)
        plain.apply(eps, active, 0.0)
        assert (lined.mode, lined.spilling) == (mode, lined_spills), active
        assert (plain.mode, plain.spilling) == (mode, plain_spills), active


def test_the_spill_stops_where_it_is_told() -> None:
    """`spill_stop_below_sessions_per_worker`: a spilling pool spills on down to that line (0:
    until the pool colocates), not half the spill line."""
    params = PoolRolesParams(
        split_at_sessions_per_worker=2,
        colocate_below_sessions_per_worker=1,
        settle_s=0.0,
        spill_at_sessions_per_worker=4,
        spill_stop_below_sessions_per_worker=0,
    )
    roles = PoolRoles(params)
    eps = swinging(4)
    for active, mode, spills in (
        (8, "split", False),
        (16, "split", True),
        (7, "split", True),  # under half the spill line: still on
        (4, "split", True),
        (3, "colocated", False),  # colocated: off whatever the stop
        (8, "split", False),  # split again: off until the spill line
    ):
        roles.apply(eps, active, 0.0)
        assert (roles.mode, roles.spilling) == (mode, spills), active


@pytest.mark.parametrize(
    "roles",
    [
        {"split_at_sessions_per_worker": 2, "spill_stop_below_sessions_per_worker": 1},
        {
            "split_at_sessions_per_worker": 2,
            "spill_at_sessions_per_worker": 4,
            "spill_stop_below_sessions_per_worker": 5,
        },
    ],
)
def test_a_spill_stop_without_a_line_or_above_it_is_refused(roles: dict[str, float]) -> None:
    with pytest.raises(PolicyConfigError, match="spill_stop_below_sessions_per_worker"):
        ConditionalDisaggregation.from_params({"pool_roles": roles})


def test_the_router_spills_only_where_the_pool_roles_let_it() -> None:
    """`RouterRuntime._spill_target` (the prefill stage's spill) answers None while the pool
    is colocated or under the spill line, and a decode worker once past it."""
    specs = [
        {"url": f"http://127.0.0.1:{9 + i}", "role": "both", "labels": dict(KV_BOTH)}
        for i in range(4)
    ]
    eps = parse_endpoint_specs(specs)
    disagg = {
        "pool_roles": {
            "prefill_workers": 2,
            "split_at_sessions_per_worker": 1,
            "spill_at_sessions_per_worker": 3,
        }
    }
    rt = RouterRuntime(
        StaticDiscovery(eps),
        RuntimeConfig(disaggregation=disagg, flow={"prefill_spill_after_s": 0.0}),
    )
    rt._discovered = [
        Endpoint(e.id, e.url, role=e.role, labels=e.labels, api="vllm", kv_send=True,
                 kv_receive=True)
        for e in eps
    ]  # fmt: skip
    rt.facts.endpoints = lambda found: list(found)  # type: ignore[method-assign] (as reported)
    count = [0]
    rt.loads.active_sessions = lambda own, now: count[0]  # type: ignore[method-assign]
    for active, spills in ((0, False), (4, False), (12, True)):
        count[0] = active  # the sessions the router's books would show
        assert (rt._spill_target(1000, {}) is not None) == spills, active


def test_the_flow_controller_reads_the_pools_active_sessions_for_its_lull() -> None:
    """The spill in a lull asks whether the pool is draining: the runtime gives the flow
    controller the same count the pool roles read (requests admitted or queued here, sessions
    resting)."""
    specs = [{"url": f"http://127.0.0.1:{9 + i}", "role": "both"} for i in range(2)]
    rt = RouterRuntime(StaticDiscovery(parse_endpoint_specs(specs)), RuntimeConfig())
    source = rt.flow.active_sessions
    assert source is not None and source() == 0
    rt.loads.rest("s1", "w0", 2000)
    rt.loads.rest("s2", "w1", 2000)
    assert source() == 2


def test_apply_rebuilds_only_on_a_change() -> None:
    roles = PoolRoles(PoolRolesParams(prefill_workers=1, split_at_sessions_per_worker=1))
    eps = swinging(2)
    a = roles.apply(eps, 0, 0.0)
    assert roles.apply(eps, 1, 0.1) is a and roles.mode == "colocated"
    b = roles.apply(eps, 2, 0.2)
    assert roles.mode == "split" and b is not a
    assert roles.apply(eps, 3, 0.3) is b


# --- active sessions -------------------------------------------------------------------------


def test_active_sessions_are_requests_and_sessions_resting() -> None:
    t = [0.0]
    book = LoadBook(clock=lambda: t[0])
    assert book.active_sessions(2) == 2
    book.rest("s1", "w0", 2000)
    book.rest("s2", "w1", 2000)
    book.rest("s1", "w1", 3000)  # rests again: once
    assert book.active_sessions(1) == 3
    book.wake("s1")
    assert book.active_sessions(1) == 2
    t[0] = 3600.0  # past the rest window: s2 no longer counts
    assert book.active_sessions(0) == 0


# --- through the router, real kv_both sim workers --------------------------------------------

URL = "/v1/chat/completions"
TOOL_OUTPUT = " ".join(f"line{i} of the tool's output" for i in range(900))  # ~6K tokens


def turn(history: list[dict[str, str]], text: str) -> list[dict[str, str]]:
    return [*history, {"role": "user", "content": text}]


def kv_both_router(
    spawn_worker: SpawnWorker, n: int, **roles: Any
) -> tuple[RouterRuntime, list[str], list[str]]:
    """An in-process router over `n` vLLM-surface sim workers that each send and receive KV,
    with pool roles `roles` and the pieces on (from 2,048 new tokens, 1,024 a piece); its
    worker ids and urls, sorted by id."""
    ws = [spawn_worker("--engine", "sim", "--profile", "h200-bf16-tp8", "--api", "vllm",
                       "--handshake-port", "0") for _ in range(n)]  # fmt: skip
    eps = parse_endpoint_specs([{"url": w.url, "labels": {"kv_role": "kv_both"}} for w in ws])
    disagg = {"min_uncached_tokens": 2048, "keep_warm_local": True, "pool_roles": roles}
    flow = {"prefill_piece_min_tokens": 2048, "prefill_piece_tokens": 1024}
    rt = RouterRuntime(
        StaticDiscovery(eps),
        RuntimeConfig(scrape_interval_s=3600, disaggregation=disagg, flow=flow),
    )
    pairs = sorted((e.id, w.url) for e, w in zip(eps, ws, strict=True))
    return rt, [p[0] for p in pairs], [p[1] for p in pairs]


def test_idle_pool_serves_colocated_and_splits_once_busy(spawn_worker: SpawnWorker) -> None:
    """Sessions opened one after another on an idle pool of two are each served whole on one
    worker, no KV moves, until one rests on the worker that will prefill. The next sessions
    bring the pool to its split line (3.5 a worker: sessions resting, one arriving): the one
    that crosses it is prefilled on the lower id and decoded on the other, and the session
    resting on the worker that now only prefills moves on its next turn — its prefill leg runs
    where its context is cached and its KV moves to the decode worker; its next long new part
    is prefilled there in pieces. Nothing stays booked."""
    rt, ids, urls = kv_both_router(spawn_worker, 2, prefill_workers=1,
                                   split_at_sessions_per_worker=3.5, settle_s=3600)  # fmt: skip
    roles = rt.pool_roles
    assert roles is not None

    async def open_session(c: httpx.AsyncClient, sid: str) -> tuple[list[Any], str]:
        msgs = turn([], f"session {sid}: " + TOOL_OUTPUT)
        r = await c.post(URL, json={"model": "beam", "messages": msgs, "max_tokens": 2},
                         headers={"x-session-id": sid})  # fmt: skip
        assert r.status_code == 200, r.text
        record = await rt.sessions.get(sid)
        assert record is not None
        return [*msgs, r.json()["choices"][0]["message"]], record.worker

    async def main() -> None:
        async with serving(rt) as c:
            history: dict[str, list[Any]] = {}
            moved = None
            for i in range(6):  # 6 resting: under the line (7)
                sid = f"s{i}"
                history[sid], home = await open_session(c, sid)
                assert roles.mode == "colocated"
                if home == ids[0]:
                    moved = sid
                    break
            assert moved is not None, "no session was placed on the lower id"
            assert metric(urls[0], "beamserve_worker_kv_transfers_total") == 0
            assert metric(urls[1], "beamserve_worker_kv_transfers_total") == 0
            assert "beamserve_router_pool_split 0.0" in (await c.get("/metrics")).text

            # more sessions until the pool splits; from then on ids[0] prefills, ids[1] decodes
            for j in range(7):
                sid = f"n{j}"
                _, home = await open_session(c, sid)
                if roles.mode == "split":
                    assert home == ids[1]
                    assert metric(urls[1], "beamserve_worker_kv_transfers_total") == 1
                    break
            else:
                pytest.fail("the pool never split")

            # the session resting on the prefill worker moves, its context not recomputed
            hits_before = metric(urls[0], "vllm:prefix_cache_hits_total")
            msgs = turn(history[moved], "now fix the bug")
            body = {"model": "beam", "messages": msgs, "max_tokens": 2, "stream": True}
            r = await c.post(URL, json=body, headers={"x-session-id": moved})
            assert r.status_code == 200 and "[DONE]" in r.text, r.text
            record = await rt.sessions.get(moved)
            assert record is not None and record.worker == ids[1]
            assert metric(urls[1], "beamserve_worker_kv_transfers_total") == 2
            assert metric(urls[0], "vllm:prefix_cache_hits_total") - hits_before > 5000
            # the decode worker took the KV it was handed: no recompute, no fallback
            assert metric(urls[1], "beamserve_worker_kv_recompute_fallbacks_total") == 0
            text = (await c.get("/metrics")).text
            assert "beamserve_router_pd_fallbacks_total" not in text or all(
                line.endswith(" 0.0")
                for line in text.splitlines()
                if line.startswith("beamserve_router_pd_fallbacks_total")
            )
            assert "beamserve_router_pool_split 1.0" in text
            assert "beamserve_router_pool_mode_switches_total 1.0" in text
            nothing_booked(rt, *ids)

    asyncio.run(main())


def test_a_colocated_pool_prefills_long_new_parts_whole(spawn_worker: SpawnWorker) -> None:
    """While the pool is colocated (under its line) the pieces wait: a continuing turn with a
    long new part is prefilled whole on its worker, and nothing moves."""
    rt, ids, urls = kv_both_router(spawn_worker, 2, split_at_sessions_per_worker=50)

    async def main() -> None:
        async with serving(rt) as c:
            msgs = turn([], "session s: " + TOOL_OUTPUT)
            r = await c.post(URL, json={"model": "beam", "messages": msgs, "max_tokens": 2},
                             headers={"x-session-id": "s"})  # fmt: skip
            assert r.status_code == 200, r.text
            msgs = turn([*msgs, r.json()["choices"][0]["message"]], "again: " + TOOL_OUTPUT)
            r = await c.post(URL, json={"model": "beam", "messages": msgs, "max_tokens": 2},
                             headers={"x-session-id": "s"})  # fmt: skip
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 5000
            text = (await c.get("/metrics")).text
            assert metric_in(text, "beamserve_router_prefill_pieces_total") == 0
            assert metric_in(text, "beamserve_router_disaggregated_total") == 0
            assert "beamserve_router_pool_split 0.0" in text
            assert sum(metric(u, "beamserve_worker_kv_transfers_total") for u in urls) == 0
            nothing_booked(rt, *ids)

    asyncio.run(main())


def test_a_pool_that_cannot_swing_serves_as_it_is(spawn_worker: SpawnWorker) -> None:
    """SGLang-surface workers in `null` mode cannot hand KV over: pool roles leave them
    colocated however busy the pool is, and nothing is split."""
    ws = [spawn_worker("--engine", "sim", "--profile", "h200-bf16-tp8", "--api", "sglang")
          for _ in range(2)]  # fmt: skip
    eps = parse_endpoint_specs([{"url": w.url, "labels": {"kv_role": "kv_both"}} for w in ws])
    disagg = {"pool_roles": {"split_at_sessions_per_worker": 0.5}}
    rt = RouterRuntime(
        StaticDiscovery(eps), RuntimeConfig(scrape_interval_s=3600, disaggregation=disagg)
    )

    async def main() -> None:
        async with serving(rt) as c:
            for sid in ("a", "b", "c"):
                msgs = turn([], f"session {sid}: " + TOOL_OUTPUT)
                r = await c.post(URL, json={"model": "beam", "messages": msgs, "max_tokens": 2},
                                 headers={"x-session-id": sid})  # fmt: skip
                assert r.status_code == 200, r.text
            text = (await c.get("/metrics")).text
            assert "beamserve_router_pool_split 0.0" in text
            assert "beamserve_router_disaggregated_total 0.0" in text
            assert all(e.role == "both" for e in rt.endpoints())

    asyncio.run(main())
