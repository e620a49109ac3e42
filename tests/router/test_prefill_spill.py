"""The prefill stage's spill (`FlowConfig.prefill_spill_after_s`): a new session held while the
prefill workers are busy may be prefilled on a decode worker that has room for it. The flow
controller's side is in test_flow_prefill_stage.py; here the books' room test, the routing
core following the ticket, and one run through the router in front of real sim workers."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from beamserve.router.core import Dispatch, RoutingCore
from beamserve.router.discovery import StaticDiscovery, parse_endpoint_specs
from beamserve.router.facts import WorkerFacts
from beamserve.router.flow import FlowConfig, FlowConfigError
from beamserve.router.load import LoadBook
from beamserve.router.policy import build_policy
from beamserve.router.policy.disagg import ConditionalDisaggregation
from beamserve.router.server import RouterRuntime, RuntimeConfig
from beamserve.router.types import Endpoint, RouteRequest
from hypothesis import given
from hypothesis import strategies as st

from tests.conftest import SpawnWorker
from tests.router.test_pace_hold import metric, nothing_booked
from tests.router.test_router_flow import serving

ROOM = {"max_tokens": 50_000, "margin_s": 0.5, "user_tok_s": 20.0, "prefill_tok_s": 38_000.0}


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class SpillTicket:
    """What the flow gate hands over for a spilled item (`Ticket.spill_to`)."""

    def __init__(self, spill_to: str | None) -> None:
        self.spill_to = spill_to
        self.routed_calls = 0

    def routed(self) -> None:
        self.routed_calls += 1

    def release(self, service_tokens: int | None = None) -> None:
        pass


def pd_pool() -> list[Endpoint]:
    return parse_endpoint_specs(
        [
            {"url": "http://p:1", "role": "prefill"},
            {"url": "http://d1:1", "role": "decode"},
            {"url": "http://d2:1", "role": "decode"},
        ]
    )


# --- the books: room on a decode worker ------------------------------------------------------


def test_room_is_the_queue_with_the_item_and_none_over_the_limit() -> None:
    clock = Clock()
    book = LoadBook(clock=clock)
    assert book.spill_room("d1", 30_000, **ROOM) == 30_000  # unknown worker: idle
    assert book.spill_room("d1", 60_000, **ROOM) is None  # over max_tokens alone


def one_user(max_tokens: int, after_s: float, tokens: int) -> tuple[Clock, RoutingCore, Dispatch]:
    """A core whose decode worker d1 streams one user: `tokens` of its `max_tokens` relayed
    `after_s` after its first token."""
    clock = Clock()
    core = RoutingCore(build_policy("least-load"), loads=LoadBook(clock=clock), clock=clock)
    d = core.open(RouteRequest("u", prompt_tokens=100, max_tokens=max_tokens, session_id="u"))
    core.route(d, [pd_pool()[1]])
    core.first_token(d)
    assert d.flight is not None
    clock.t += after_s
    d.flight.tokens = tokens
    return clock, core, d


def test_a_user_streaming_without_slack_leaves_no_room() -> None:
    # 100 tokens at 20 tok/s: 5 s to the deadline; 50 relayed in 2.5 s = on pace, no slack
    clock, core, d = one_user(100, 2.5, 50)
    assert d.flight is not None
    worker = d.flight.worker
    assert core.loads.spill_room(worker, 10_000, **ROOM) is None
    # a fast user (90 of 100 in 1 s) keeps seconds of slack: a 10K-token prefill fits
    clock.t -= 1.5
    d.flight.tokens = 90
    assert core.loads.spill_room(worker, 10_000, **ROOM) == 10_000  # its prompt is decode load now
    core.finish(d)


@given(cost=st.integers(0, 80_000), margin=st.floats(0, 3), extra=st.integers(0, 40_000))
def test_room_shrinks_with_more_prefill_and_more_margin(
    cost: int, margin: float, extra: int
) -> None:
    _, core, d = one_user(200, 1.0, 60)  # 60 tok/s: slack ≈ 10 s − 140/60 s
    assert d.flight is not None
    w = d.flight.worker
    base = {**ROOM, "margin_s": margin}
    more = {**ROOM, "margin_s": margin + 0.5}
    if core.loads.spill_room(w, cost + extra, **base) is not None:
        assert core.loads.spill_room(w, cost, **base) is not None
    if core.loads.spill_room(w, cost, **more) is not None:
        assert core.loads.spill_room(w, cost, **base) is not None


def test_a_slower_protected_speed_leaves_room_where_the_pace_hold_s_would_not() -> None:
    # 100 tokens in 5 s at 20 tok/s; 50 relayed in 2.5 s: on pace at 20, seconds ahead at 12
    _, core, d = one_user(100, 2.5, 50)
    assert d.flight is not None
    w = d.flight.worker
    assert core.loads.spill_room(w, 10_000, **ROOM) is None
    assert core.loads.spill_room(w, 10_000, **{**ROOM, "user_tok_s": 12.0}) == 10_000
    core.finish(d)


def test_in_a_lull_the_router_finds_room_at_the_lull_s_speed_and_bound() -> None:
    """`RouterRuntime`'s spill target, in a lull and not, over the same books: a user on pace
    at 20 tokens/s leaves no room by the spill's rule and room by the lull's (10 tokens/s);
    the lull's own bound on queued prefill holds."""
    flow = {
        "prefill_spill_after_s": 0.3,
        "prefill_spill_margin_s": 0.0,
        "prefill_spill_lull_s": 2.0,
        "prefill_spill_lull_max_tokens": 20_000,
    }
    rt = RouterRuntime(StaticDiscovery(pd_pool()), RuntimeConfig(scrape_interval_s=3600, flow=flow))
    rt._discovered = pd_pool()  # what discovery and the workers' reports would have given
    for ep in rt._discovered:
        rt.facts.learned(ep, WorkerFacts(api="vllm"))
    clock = Clock()
    rt.loads.clock = clock
    rt.core.clock = clock
    d = rt.core.open(RouteRequest("u", prompt_tokens=100, max_tokens=100, session_id="u"))
    rt.core.route(d, [pd_pool()[1]])
    rt.core.first_token(d)
    assert d.flight is not None
    clock.t += 2.5
    d.flight.tokens = 50  # on pace at 20 tokens/s: no slack; seconds ahead at 10
    d1, d2 = pd_pool()[1].id, pd_pool()[2].id
    assert rt._spill_target(10_000, {d2: 10**6}) is None
    assert rt._spill_target(10_000, {d2: 10**6}, True) == d1  # in a lull
    assert rt._spill_target(25_000, {d2: 10**6}, True) is None  # over the lull's 20,000
    rt.core.finish(d)


# --- the core: a spilled ticket goes where the gate found room, prefilled there ----------------


def test_the_core_routes_a_spilled_item_to_its_worker_without_a_split() -> None:
    core = RoutingCore(
        build_policy("least-load"),
        disaggregation=ConditionalDisaggregation.from_params({"min_uncached_tokens": 64}),
    )
    eps = pd_pool()
    req = RouteRequest("r", prompt_tokens=30_000, max_tokens=8, session_id="s")
    plain = core.open(req)
    decision = core.route(plain, eps)
    assert decision.prefill is not None and not plain.spilled  # split as usual
    core.finish(plain)
    for target in (eps[1].id, eps[2].id):
        t = SpillTicket(target)
        d = core.open(req, t)
        decision = core.route(d, eps)
        assert decision.decode.id == target and decision.prefill is None and d.spilled
        assert t.routed_calls == 1
        core.finish(d)
    # its worker gone (or excluded after a failed attempt): routed as any other request
    gone = core.open(req, SpillTicket("http://elsewhere:1"))
    decision = core.route(gone, eps)
    assert decision.prefill is not None and not gone.spilled
    core.finish(gone)
    assert core.open_dispatches == 0


def test_config_is_off_by_default_and_checked() -> None:
    assert FlowConfig().prefill_spill() is None
    rule = FlowConfig.from_mapping({"prefill_spill_after_s": 1.0}).prefill_spill()
    assert rule is not None and (rule.after_s, rule.max_tokens, rule.margin_s) == (1.0, 49152, 0.5)
    assert rule.prefill_tok_s == FlowConfig().pace_hold_prefill_tok_s  # the pace hold's price
    priced = FlowConfig.from_mapping({"prefill_spill_after_s": 1.0, "prefill_spill_tok_s": 9e4})
    assert (rule := priced.prefill_spill()) is not None and rule.prefill_tok_s == 9e4
    with pytest.raises(FlowConfigError, match="prefill_spill_tok_s"):
        FlowConfig.from_mapping({"prefill_spill_tok_s": 0})
    assert rule.user_tok_s == FlowConfig().pace_hold_user_tok_s  # the pace hold's speed
    slower = FlowConfig.from_mapping(
        {"prefill_spill_after_s": 1.0, "prefill_spill_user_tok_s": 12, "pace_hold_user_tok_s": 25}
    )
    assert (rule := slower.prefill_spill()) is not None and rule.user_tok_s == 12
    with pytest.raises(FlowConfigError, match="prefill_spill_user_tok_s"):
        FlowConfig.from_mapping({"prefill_spill_user_tok_s": -1})
    assert rule.lull_s is None  # the lull: off unless asked for
    lull = FlowConfig.from_mapping(
        {"prefill_spill_after_s": 1.0, "prefill_spill_max_tokens": 9000, "prefill_spill_lull_s": 2}
    ).prefill_spill()
    assert lull is not None and (lull.lull_s, lull.lull_user_tok_s) == (2.0, 10.0)
    assert lull.lull_max_tokens == 9000  # the spill's bound unless the lull has its own
    with pytest.raises(FlowConfigError, match="prefill_spill_lull_s"):
        FlowConfig.from_mapping({"prefill_spill_lull_s": 0})
    with pytest.raises(FlowConfigError, match="set 'prefill_spill_after_s' too"):
        FlowConfig.from_mapping({"prefill_spill_lull_s": 2})  # a lull of a spill that is off
    try:
        FlowConfig.from_mapping({"prefill_spill_max_tokens": 0})
    except FlowConfigError as e:
        assert "prefill_spill_max_tokens" in str(e)
    else:
        raise AssertionError("prefill_spill_max_tokens: 0 was accepted")


# --- through the router, in front of real sim workers ----------------------------------------

LONG = "line of output " * 2500
URL = "/v1/chat/completions"


@pytest.mark.parametrize("mode", ["whole", "pieces", "lull"])
def test_through_the_router_a_held_new_session_is_prefilled_on_a_decode_worker(
    spawn_worker: SpawnWorker, mode: str
) -> None:
    """Session a's long first prompt goes to the prefill worker; b's, arriving while that
    prefill runs (the stage closed: a gate of 1 token), spills to the decode worker and is
    prefilled there — with the prefill in pieces on, a piece at a time (a's, split, never);
    in `lull` mode the spill's own rule has no room (1 token) and b goes by the lull's, once
    no new session has come for 50 ms; both answers arrive and nothing stays booked."""
    pieces = mode == "pieces"
    p = spawn_worker("--engine", "sim", "--profile", "h200-bf16-tp8", "--role", "prefill")
    d = spawn_worker("--engine", "sim", "--profile", "h200-bf16-tp8", "--role", "decode")
    eps = parse_endpoint_specs(
        [{"url": p.url, "role": "prefill"}, {"url": d.url, "role": "decode"}]
    )
    flow: dict[str, Any] = {"prefill_gate_tokens": 1, "prefill_spill_after_s": 0.0}
    if pieces:
        flow |= {"prefill_piece_min_tokens": 2048, "prefill_piece_tokens": 1024}
    if mode == "lull":
        flow |= {
            "prefill_spill_max_tokens": 1,
            "prefill_spill_lull_s": 0.05,
            "prefill_spill_lull_max_tokens": 10**6,
            # two sessions, both still open: the pool is at its peak, not draining; this lull
            # is any quiet spell (the drain share is tested in test_flow_prefill_stage.py)
            "prefill_spill_lull_below_peak": None,
        }
    rt = RouterRuntime(
        StaticDiscovery(eps),
        RuntimeConfig(
            scrape_interval_s=3600, flow=flow, disaggregation={"min_uncached_tokens": 64}
        ),
    )

    def body(text: str) -> dict[str, Any]:
        return {"model": "beam", "max_tokens": 4, "messages": [{"role": "user", "content": text}]}

    async def main() -> None:
        async with serving(rt) as c:
            a = asyncio.create_task(
                c.post(URL, json=body("a " + LONG), headers={"x-session-id": "a"})
            )
            for _ in range(500):
                if rt.core.loads.load(eps[0].id).prefill_tokens > 0:
                    break
                await asyncio.sleep(0.005)
            else:
                raise AssertionError("a's prefill leg never showed up in the books")
            b = await c.post(URL, json=body("b " + LONG), headers={"x-session-id": "b"})
            ra = await a
            assert ra.status_code == 200 and b.status_code == 200, (ra.text, b.text)
            route_a, route_b = ra.headers["x-beamserve-route"], b.headers["x-beamserve-route"]
            assert f"prefill={eps[0].id}" in route_a, route_a
            assert "prefill=-" in route_b and f"decode={eps[1].id}" in route_b, route_b
            text = (await c.get("/metrics")).text
            assert metric(text, "beamserve_router_prefill_spills_total") == 1
            assert metric(text, "beamserve_router_prefill_lull_spills_total") == (mode == "lull")
            assert metric(text, "beamserve_router_disaggregated_total") == 1
            # b's prompt (≈ 10K tokens) in 1,024-token pieces: several, all found cached
            sent = metric(text, "beamserve_router_prefill_pieces_total")
            assert (sent >= 5) if pieces else (sent == 0), sent
            done = metric(text, 'beamserve_router_pieced_prefills_total{outcome="done"}')
            assert done == (1 if pieces else 0)
            assert metric(text, "beamserve_router_prefill_pieces_missed_total") == 0
            nothing_booked(rt, *(e.id for e in eps))

    asyncio.run(main())
