"""The pace hold (`beamserve.router.flow.pace_hold`): a continuing turn's long new part waits,
routed and booked, while its prefill would push a user streaming from its worker under the
speed it protects — never longer than `pace_hold_max_s`, never for new sessions, split
prompts or short new parts, and nothing it booked leaks."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import httpx
import pytest
from beamserve.router.api.sse import SSEScanner
from beamserve.router.core import Dispatch, RoutingCore
from beamserve.router.discovery import StaticDiscovery, parse_endpoint_specs
from beamserve.router.flow import FlowConfig, FlowConfigError
from beamserve.router.flow.pace_hold import (
    OWN_PACE_AFTER_S,
    Decoding,
    PaceHold,
    pushed_under,
    slack_s,
)
from beamserve.router.policy import build_policy
from beamserve.router.server import RouterRuntime, RuntimeConfig
from beamserve.router.types import Endpoint, RouteRequest
from hypothesis import assume, given
from hypothesis import strategies as st

from tests.conftest import SpawnWorker
from tests.router.test_router_flow import serving

W0 = [Endpoint("w0", "http://w0:8000")]
# with a prefill this dear, every stream whose pace is known counts as slowed
PACE_KNOWN = {"user_tok_s": 20.0, "prefill_tok_s": 1e-9}
RULE = PaceHold(min_tokens=1024, max_s=1.5, user_tok_s=20.0, prefill_tok_s=38000.0)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


# --- the pure rule ---------------------------------------------------------------------------


def test_slack_is_the_time_left_after_the_rest_of_the_answer_at_its_own_pace() -> None:
    d = Decoding(first_token_at=100.0, max_tokens=64, tokens=33)
    # 32 steps in 1 s: 1/32 s a token; it must end by 100 + 64/20 = 103.2 and needs 31 more
    assert slack_s(d, 101.0, 20.0, None) == pytest.approx(103.2 - 101.0 - 31 / 32)
    # its own pace wins over the worker's once it has streamed two tokens
    assert slack_s(d, 101.0, 20.0, 10.0) == pytest.approx(103.2 - 101.0 - 31 / 32)


def test_a_stream_with_no_known_pace_is_left_out() -> None:
    d = Decoding(first_token_at=100.0, max_tokens=64, tokens=1)
    assert slack_s(d, 100.5, 20.0, None) is None
    # a burst of tokens at the start is not a pace yet
    burst = Decoding(first_token_at=100.0, max_tokens=64, tokens=9)
    assert slack_s(burst, 100.0 + OWN_PACE_AFTER_S / 2, 20.0, None) is None
    assert pushed_under([d], 10**9, 100.5, user_tok_s=20.0, prefill_tok_s=1.0) == 0
    # the worker's recent pace stands in for it
    assert slack_s(d, 100.5, 20.0, 0.02) == pytest.approx(103.2 - 100.5 - 63 * 0.02)


decodings = st.lists(
    st.builds(
        Decoding,
        first_token_at=st.floats(0.0, 10.0),
        max_tokens=st.integers(1, 4096),
        tokens=st.integers(0, 4096),
    ),
    max_size=12,
)


@given(decodings, st.integers(0, 200_000), st.integers(0, 200_000), st.floats(10.0, 20.0))
def test_more_prefill_never_slows_fewer_users(
    ds: list[Decoding], a: int, b: int, now: float
) -> None:
    lo, hi = sorted((a, b))
    kw: dict[str, Any] = {"user_tok_s": 20.0, "prefill_tok_s": 38000.0, "worker_step_s": 0.03}
    assert pushed_under(ds, lo, now, **kw) <= pushed_under(ds, hi, now, **kw) <= len(ds)


@given(st.integers(2, 512), st.integers(2, 512), st.floats(0.001, 0.049))
def test_a_user_faster_than_the_speed_has_slack(m: int, n: int, step: float) -> None:
    n = min(n, m)
    d = Decoding(first_token_at=0.0, max_tokens=m, tokens=n)
    now = (n - 1) * step  # it streamed n tokens at `step` s each after the first
    assume(now >= OWN_PACE_AFTER_S)
    s = slack_s(d, now, 20.0, None)
    assert s is not None and s > 0


# --- the books and the core ------------------------------------------------------------------


def streaming(core: RoutingCore, clock: Clock, name: str, tokens: int, after_s: float) -> Dispatch:
    """A request streaming from w0: its first token now, `tokens` relayed `after_s` later."""
    d = core.open(RouteRequest(name, prompt_tokens=100, max_tokens=64, session_id=name))
    core.route(d, W0)
    core.first_token(d)
    clock.t += after_s
    assert d.flight is not None
    d.flight.tokens = tokens
    return d


def continuing(core: RoutingCore, tokens: int, band: str = "continuing") -> Dispatch:
    d = core.open(
        RouteRequest("c", prompt_tokens=tokens, max_tokens=64, session_id="c", band=band)  # type: ignore[arg-type]
    )
    core.route(d, W0)
    return d


def test_a_long_new_part_waits_while_a_user_beside_it_would_fall_under_the_speed() -> None:
    clock = Clock()
    core = RoutingCore(build_policy("sticky-until-saturated"), clock=clock)
    # 33 tokens in 1.6 s (0.05 s a token): it must end by 103.2, needs 31 × 0.05 = 1.55 s more
    # at 101.6: slack 0.05 s, less than 8,000 tokens' 0.21 s
    user = streaming(core, clock, "u", tokens=33, after_s=1.6)
    d = continuing(core, 8000)
    assert core.pace_holds(d, RULE)
    # a held turn's tokens do not count against another: 1,500 tokens (0.039 s) fit the slack
    rule = dataclasses.replace(RULE, min_tokens=1000)
    small = continuing(core, 1500)
    assert not core.pace_holds(small, rule)
    # ... but what was sent and waits to be prefilled does: 3,000 tokens (0.079 s) do not
    second = continuing(core, 1500)
    assert core.pace_holds(second, rule)
    assert core.pace_holds(d, RULE)
    core.finish(user, 64)
    assert not core.pace_holds(d, RULE)  # nobody streams there any more
    assert not core.pace_holds(second, rule)
    for x in (d, small, second):
        core.close(x)
    assert core.open_dispatches == 0
    assert core.loads.load("w0").prefill_tokens == 0 and core.loads.load("w0").in_flight == 0
    # nothing is left marked held: a sent 3,000-token turn counts in full beside a new user
    streaming(core, clock, "v", tokens=33, after_s=1.6)
    continuing(core, 3000)
    assert core.loads.pushed_under("w0", user_tok_s=20.0, prefill_tok_s=38000.0) == 1


def test_the_hold_ends_at_its_time_and_spares_new_sessions_short_parts_and_split_prompts() -> None:
    clock = Clock()
    core = RoutingCore(build_policy("sticky-until-saturated"), clock=clock)
    streaming(core, clock, "u", tokens=33, after_s=1.6)
    assert not core.pace_holds(continuing(core, 8000, band="new"), RULE)
    assert not core.pace_holds(continuing(core, 900), RULE)  # under min_tokens
    d = continuing(core, 8000)
    assert d.decision is not None
    to_p = dataclasses.replace(d.decision, prefill=Endpoint("p", "http://p"))
    split = Dispatch(
        d.request, phase="dispatched", flight=d.flight, opened_at=clock.t, decision=to_p
    )
    assert not core.pace_holds(split, RULE)
    assert core.pace_holds(d, RULE)
    clock.t += RULE.max_s
    assert not core.pace_holds(d, RULE)


def test_a_turn_cancelled_while_held_leaves_nothing_held() -> None:
    """A client that leaves during the hold: its flight is released, and with it the held
    mark — the next turn's check counts what was sent there in full."""
    clock = Clock()
    core = RoutingCore(build_policy("sticky-until-saturated"), clock=clock)
    streaming(core, clock, "u", tokens=33, after_s=1.6)  # slack 0.05 s
    held = continuing(core, 8000)
    assert core.pace_holds(held, RULE)
    core.cancel(held)
    sent = continuing(core, 3000)  # 0.079 s of prefill, sent: counts
    assert core.loads.pushed_under("w0", user_tok_s=20.0, prefill_tok_s=38000.0) == 1
    core.close(sent)


def test_streams_leave_the_books_however_they_end() -> None:
    clock = Clock()
    core = RoutingCore(build_policy("sticky-until-saturated"), clock=clock)
    ended = [streaming(core, clock, f"u{i}", tokens=2, after_s=0.3) for i in range(3)]
    d = continuing(core, 8000)
    assert core.loads.pushed_under("w0", **PACE_KNOWN) == 3
    core.finish(ended[0], 2)
    core.fail(ended[1], worker="w0")
    core.cancel(ended[2])
    assert core.loads.pushed_under("w0", **PACE_KNOWN) == 0
    core.close(d)


# --- the relayed token count -----------------------------------------------------------------


@given(st.integers(0, 40), st.lists(st.integers(1, 50), max_size=20))
def test_the_scanner_counts_events_across_any_cuts(n: int, cuts: list[int]) -> None:
    events = b"".join(
        b"data: " + json.dumps({"choices": [{"delta": {"content": f"t{i} data: x\n"}}]}).encode()
        + b"\n\n"
        for i in range(n)
    ) + b"data: [DONE]\n\n"  # fmt: skip
    scanner, at = SSEScanner(), 0
    for c in cuts:
        scanner.feed(events[at : at + c])
        at += c
    scanner.feed(events[at:])
    scanner.flush()
    assert scanner.events == n + 1


# --- configuration ---------------------------------------------------------------------------


def test_config_is_off_by_default_and_checked() -> None:
    assert FlowConfig().pace_hold() is None
    rule = FlowConfig.from_mapping({"pace_hold_tokens": 2048, "pace_hold_max_s": 1}).pace_hold()
    assert rule is not None and (rule.min_tokens, rule.max_s) == (2048, 1.0)
    with pytest.raises(FlowConfigError, match="pace_hold_tokens"):
        FlowConfig.from_mapping({"pace_hold_tokens": 0})
    with pytest.raises(FlowConfigError, match="pace_hold_prefill_tok_s"):
        FlowConfig.from_mapping({"pace_hold_tokens": 1024, "pace_hold_prefill_tok_s": -1})


# --- through the router, in front of a real sim worker ---------------------------------------


def nothing_booked(rt: RouterRuntime, *workers: str) -> None:
    """No dispatch left open, and nothing left on these workers' books."""
    assert rt.core.open_dispatches == 0
    for w in workers:
        load = rt.core.loads.load(w)
        assert (load.in_flight, load.prefill_tokens, load.decode_tokens) == (0, 0, 0), w


def metric(text: str, name: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and not line.startswith("#")
    )


FIRST = [{"role": "user", "content": "look at the repository"}]
LATER = [*FIRST, {"role": "assistant", "content": "ok"},
         {"role": "user", "content": "the tool said " + "line of output " * 200}]  # fmt: skip
URL = "/v1/chat/completions"
SID = {"x-session-id": "c"}


def router_on(spawn_worker: SpawnWorker, **flow: Any) -> tuple[RouterRuntime, str]:
    """A router over one sim worker (H200 timings) whose pace hold keeps 1,000 tokens/s — more
    than the sim decodes, so any user streaming there can only fall short."""
    w = spawn_worker("--engine", "sim", "--profile", "h200-bf16-tp8")
    return router_over(w.url, pace_hold_tokens=8, pace_hold_user_tok_s=1000, **flow)


def router_over(url: str, **flow: Any) -> tuple[RouterRuntime, str]:
    """An in-process router over the one worker at `url` with these `flow` keys, and that
    worker's id."""
    eps = parse_endpoint_specs([{"url": url}])
    rt = RouterRuntime(StaticDiscovery(eps), RuntimeConfig(scrape_interval_s=3600, flow=flow))
    return rt, eps[0].id


async def turn_beside_a_stream(
    rt: RouterRuntime, worker: str, c: httpx.AsyncClient, user_tokens: int
) -> tuple[httpx.Response, asyncio.Task[httpx.Response]]:
    """Session `c`'s first turn; then user `u` streams `user_tokens` tokens, and once its pace
    is known (`OWN_PACE_AFTER_S`, three tokens), `c`'s next turn with a long new part."""
    r = await c.post(URL, json={"model": "beam", "messages": FIRST, "max_tokens": 2}, headers=SID)
    assert r.status_code == 200, r.text
    body = {"model": "beam", "stream": True, "max_tokens": user_tokens,
            "messages": [{"role": "user", "content": "write a long answer"}]}  # fmt: skip
    user = asyncio.create_task(c.post(URL, json=body, headers={"x-session-id": "u"}))
    for _ in range(400):
        now = rt.core.clock()
        if any(x.tokens >= 3 and now - x.first_token_at >= OWN_PACE_AFTER_S
               for x in rt.core.loads.decodings(worker)):  # fmt: skip
            break
        await asyncio.sleep(0.01)
    else:
        pytest.fail("the user's stream never showed up in the books")
    held = await c.post(
        URL, json={"model": "beam", "messages": LATER, "max_tokens": 2}, headers=SID
    )
    assert held.status_code == 200, held.text
    return held, user


def test_through_the_router_a_held_turn_waits_for_the_stream_beside_it(
    spawn_worker: SpawnWorker,
) -> None:
    """Session `c`'s next turn waits until `u`'s stream ends (released), then is served; with
    `u` gone a turn like it goes at once, and nothing stays booked."""
    rt, worker = router_on(spawn_worker, pace_hold_max_s=30)

    async def main() -> None:
        async with serving(rt) as c:
            _, user = await turn_beside_a_stream(rt, worker, c, 150)
            assert (await user).status_code == 200
            text = (await c.get("/metrics")).text
            # released (not expired: 30 s) once u's stream left the books, ≈ 2 s of 150 tokens
            assert metric(text, 'beamserve_router_pace_holds_total{outcome="released"}') == 1
            assert metric(text, "beamserve_router_pace_holds_total") == 1
            assert metric(text, "beamserve_router_pace_hold_seconds_total") >= 0.5
            # nobody streams now: the same kind of turn is not held
            again = [*LATER, {"role": "assistant", "content": "ok"},
                     {"role": "user", "content": "and now " + "more output " * 200}]  # fmt: skip
            r = await c.post(URL, json={"model": "beam", "messages": again, "max_tokens": 2},
                             headers=SID)  # fmt: skip
            assert r.status_code == 200
            text = (await c.get("/metrics")).text
            assert metric(text, "beamserve_router_pace_holds_total") == 1
            nothing_booked(rt, worker)

    asyncio.run(main())


def test_through_the_router_the_hold_expires(spawn_worker: SpawnWorker) -> None:
    """With `pace_hold_max_s` shorter than the stream, the turn goes when its time is up,
    while the stream beside it still runs."""
    rt, worker = router_on(spawn_worker, pace_hold_max_s=0.5)

    async def main() -> None:
        async with serving(rt) as c:
            _, user = await turn_beside_a_stream(rt, worker, c, 400)
            assert not user.done()  # it went before the stream ended
            text = (await c.get("/metrics")).text
            assert metric(text, 'beamserve_router_pace_holds_total{outcome="expired"}') == 1
            assert metric(text, "beamserve_router_pace_hold_seconds_total") >= 0.4
            assert (await user).status_code == 200
            assert rt.core.open_dispatches == 0

    asyncio.run(main())
