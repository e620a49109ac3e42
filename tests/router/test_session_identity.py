"""Session identity per caller, and the evidence behind the `continuing` band (issue: router at
scale): two API keys whose conversations open alike are two sessions; an anonymous caller is
one fairness tenant however many session ids it mints; `continuing` needs a prompt that extends
the session's last turn; the gateway path (ext_proc) admits through the same flow control."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import httpx
import pytest
from beamserve.router.api.convert import to_upstream
from beamserve.router.api.models import parse_request
from beamserve.router.app import ANONYMOUS, KeyPolicy, RouterSettings, band_of, tenant_and_session
from beamserve.router.grpc_api import build_server
from beamserve.router.server import GrpcGlue, RouterRuntime, gateway_client
from beamserve.router.sessions import (
    MemorySessionStore,
    SessionRecord,
    extends_tip,
    session_tip,
    tip_blocks,
)
from beamserve.router.types import RouteRequest, admission_tokens
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from hypothesis import given
from hypothesis import strategies as st

from tests.conftest import SpawnWorker
from tests.router.test_grpc import envoy_request, envoy_response
from tests.router.test_router_flow import Gate, runtime

OPENING = [
    {"role": "system", "content": "You are a coding agent. " * 40},
    {"role": "user", "content": "Fix the failing test in tests/test_io.py. " * 20},
]


def chat(messages: list[dict[str, str]], max_tokens: int = 2) -> dict[str, Any]:
    return {"model": "beam", "messages": messages, "max_tokens": max_tokens}


# --- the pure rules --------------------------------------------------------------------------


hashes = st.lists(st.integers(0, 2**63 - 1), min_size=0, max_size=40, unique=True)


@given(prev=hashes, more=hashes)
def test_a_prompt_that_extends_the_last_turn_carries_its_tip(
    prev: list[int], more: list[int]
) -> None:
    tip = session_tip(prev)
    if len(prev) < 2:
        assert tip == "" and not extends_tip(tip, prev + more)
        return
    assert extends_tip(tip, prev + more)  # the next turn: the old prompt, then more
    assert extends_tip(tip, prev[:-1])  # the last full block may re-tokenize: not needed
    assert not extends_tip(tip, prev[: len(prev) - 2])  # shorter than the tip
    other = [h ^ 1 for h in prev] + more  # another conversation (chained hashes all differ)
    assert not extends_tip(tip, other)


@given(prev=hashes, more=hashes)
def test_a_tip_says_how_many_blocks_the_last_turn_reached(prev: list[int], more: list[int]) -> None:
    n = tip_blocks(session_tip(prev))
    assert n == max(len(prev) - 1, 0) if len(prev) >= 2 else n == 0
    assert prev[:n] == (prev + more)[:n]  # what a continuing turn shares with the last one


@given(prompt=st.integers(0, 1 << 20), resumed=st.integers(0, 1 << 20))
def test_admission_cost_is_the_prompt_past_the_resumed_prefix(prompt: int, resumed: int) -> None:
    cost = RouteRequest("r", prompt_tokens=prompt, resumed_tokens=resumed).admission_tokens
    assert cost == admission_tokens(prompt, resumed) == max(prompt - resumed, 1)
    assert RouteRequest("r", prompt_tokens=prompt).admission_tokens == max(prompt, 1)


def test_malformed_tips_are_no_evidence() -> None:
    for tip in (None, "", "x:1", "3", "0:5", "-1:5", "2:y"):
        assert not extends_tip(tip, [5, 5, 5])


def _call(messages: list[dict[str, str]]) -> Any:
    return to_upstream(parse_request("chat", json.dumps(chat(messages)).encode(), 1 << 20))


def test_band_needs_evidence_of_the_previous_turn() -> None:
    later = [*OPENING, {"role": "assistant", "content": "done"}, {"role": "user", "content": "ok"}]
    rec = SessionRecord("w0", 1, 100.0, 0.0, tip=session_tip([1, 2, 3, 4]))
    call = _call(later)
    assert band_of(ANONYMOUS, {}, rec, call, (1, 2, 3, 4, 5, 6)) == "continuing"
    # an assistant message alone, or a record whose last turn this prompt does not extend
    # (a sub-agent's fresh prompt under the same session id): new
    assert band_of(ANONYMOUS, {}, None, call, (1, 2, 3, 4, 5, 6)) == "new"
    assert band_of(ANONYMOUS, {}, rec, call, (9, 8, 7, 6, 5)) == "new"
    # a record without a tip (its last prompt under two blocks): an earlier turn suffices
    tiny = SessionRecord("w0", 1, 10.0, 0.0)
    assert band_of(ANONYMOUS, {}, tiny, call, (1,)) == "continuing"
    assert band_of(ANONYMOUS, {}, tiny, _call(OPENING), (1,)) == "new"
    low = {"x-beamserve-priority": "sheddable"}
    assert band_of(ANONYMOUS, low, rec, call, (1, 2, 3, 4, 5)) == "sheddable"
    assert band_of(KeyPolicy("b", priority="sheddable"), {}, rec, call, (1, 2, 3, 4)) == "sheddable"


def test_tenants_scope_sessions_and_anonymous_callers_are_their_address() -> None:
    a, b = KeyPolicy("team-a"), KeyPolicy("team-b")
    assert tenant_and_session(a, "c-1", "10.0.0.1") == ("team-a", "team-a/c-1")
    assert tenant_and_session(b, "c-1", "10.0.0.1") == ("team-b", "team-b/c-1")
    # anonymous: one tenant per address, whatever session id the caller sends
    assert tenant_and_session(ANONYMOUS, "s-1", "10.0.0.9") == ("anon:10.0.0.9", "s-1")
    assert tenant_and_session(ANONYMOUS, "s-2", "10.0.0.9")[0] == "anon:10.0.0.9"
    assert tenant_and_session(ANONYMOUS, "s-2", None)[0] == "anon:-"


def test_gateway_client_is_the_address_the_gateway_appended() -> None:
    assert gateway_client({"x-forwarded-for": "1.2.3.4, 10.1.0.7"}) == "10.1.0.7"
    assert gateway_client({"x-envoy-external-address": "10.1.0.8"}) == "10.1.0.8"
    assert gateway_client({}) is None


def test_session_tips_are_stored_kept_and_cleared() -> None:
    store = MemorySessionStore()
    r = store.bind_now("s", "w0", turn_tokens=10, tenant="t", tip="3:42")
    assert (r.tip, r.tenant) == ("3:42", "t")
    assert store.bind_now("s", "w1").tip == "3:42"  # not given: kept
    assert store.bind_now("s", "w1", tip="").tip is None  # "": cleared


# --- through the HTTP door -------------------------------------------------------------------


@contextlib.asynccontextmanager
async def serving(rt: RouterRuntime) -> AsyncIterator[httpx.AsyncClient]:
    """As `test_router_flow.serving`, from one fixed client address (the anonymous tenant)."""
    await rt.start()
    try:
        t = httpx.ASGITransport(app=rt.app, client=("10.0.0.5", 40000))
        async with httpx.AsyncClient(transport=t, base_url="http://router", timeout=30) as c:
            yield c
    finally:
        await rt.stop()


def test_the_same_opening_under_two_api_keys_is_two_sessions(spawn_worker: SpawnWorker) -> None:
    w = spawn_worker("--engine", "sim")
    keys = {"k-a": KeyPolicy("team-a"), "k-b": KeyPolicy("team-b")}
    rt = runtime([w.url], settings=RouterSettings(api_keys=keys))

    async def main() -> None:
        async with serving(rt) as c:
            ids = []
            for k in ("k-a", "k-b", "k-a"):
                r = await c.post("/v1/chat/completions", json=chat(OPENING),
                                 headers={"authorization": f"Bearer {k}"})  # fmt: skip
                assert r.status_code == 200, r.text
                ids.append(r.headers["x-beamserve-session"])
            assert ids[0] == ids[2] != ids[1]
            assert ids[0].startswith("team-a/") and ids[1].startswith("team-b/")
            store = rt.sessions
            assert isinstance(store, MemorySessionStore)
            recs = {sid: rec for sid, rec in store.items()}
            assert recs[ids[0]].turns == 2 and recs[ids[1]].turns == 1
            assert recs[ids[0]].tenant == "team-a" and recs[ids[1]].tenant == "team-b"

    asyncio.run(main())


def test_continuing_band_over_http_needs_the_previous_turn(spawn_worker: SpawnWorker) -> None:
    """With `flow.live_session_s` off, only a prompt that extends the session's last one is
    `continuing` (with it on, any request of a live session is: tested below)."""
    w = spawn_worker("--engine", "sim")
    rt = runtime([w.url], flow={"live_session_s": None})

    async def main() -> None:
        async with serving(rt) as c:
            sid = {"x-session-id": "agent-1"}
            url = "/v1/chat/completions"
            first = await c.post(url, json=chat(OPENING), headers=sid)
            assert "band=new" in first.headers["x-beamserve-route"]
            answer = first.json()["choices"][0]["message"]["content"]
            nxt = [*OPENING, {"role": "assistant", "content": answer},
                   {"role": "user", "content": "now run it"}]  # fmt: skip
            r = await c.post(url, json=chat(nxt), headers=sid)
            assert "band=continuing" in r.headers["x-beamserve-route"], r.headers
            # same session id, a fresh prompt that carries an assistant turn (a sub-agent, or a
            # client replaying someone else's history): no evidence, so not `continuing`
            forged = [
                {"role": "user", "content": "unrelated " * 200},
                {"role": "assistant", "content": "sure"},
                {"role": "user", "content": "go"},
            ]
            r = await c.post(url, json=chat(forged), headers=sid)
            assert "band=new" in r.headers["x-beamserve-route"], r.headers

    asyncio.run(main())


def test_a_continuing_turn_is_admitted_at_the_cost_of_its_new_part(
    spawn_worker: SpawnWorker,
) -> None:
    """The flow controller weighs a request's cost against a level of uncached prefill tokens:
    a new session pays its whole prompt, a continuing turn only what its previous turn's
    prompt did not reach (the door reads that from the session's tip)."""
    w = spawn_worker("--engine", "sim")
    rt = runtime([w.url])
    costs: list[tuple[str, int]] = []
    admit = rt.flow.admit

    async def record(band: Any, tenant: str, cost: int, ttl_s: float | None = None) -> Any:
        costs.append((band, cost))
        return await admit(band, tenant, cost, ttl_s)

    rt.flow.admit = record  # type: ignore[method-assign]
    seen: list[RouteRequest] = []
    dispatched = rt.core.dispatched

    def book(req: Any, d: Any, **kw: Any) -> Any:
        seen.append(req)
        return dispatched(req, d, **kw)

    rt.core.dispatched = book  # type: ignore[method-assign]

    async def main() -> None:
        async with serving(rt) as c:
            sid = {"x-session-id": "agent-7"}
            url = "/v1/chat/completions"
            first = await c.post(url, json=chat(OPENING), headers=sid)
            assert first.status_code == 200, first.text
            answer = first.json()["choices"][0]["message"]["content"]
            nxt = [*OPENING, {"role": "assistant", "content": answer},
                   {"role": "user", "content": "now run it"}]  # fmt: skip
            r = await c.post(url, json=chat(nxt), headers=sid)
            assert "band=continuing" in r.headers["x-beamserve-route"], r.headers

    asyncio.run(main())
    (b0, c0), (b1, c1) = costs
    r0, r1 = seen
    assert (b0, c0, r0.resumed_tokens) == ("new", r0.prompt_tokens, 0)
    block = rt.router.hasher.block_size
    # the previous prompt less its last (possibly straddling) full block and its partial one
    assert r0.prompt_tokens - 2 * block < r1.resumed_tokens <= r0.prompt_tokens
    assert b1 == "continuing" and c1 == r1.prompt_tokens - r1.resumed_tokens
    assert c1 < r1.prompt_tokens - r0.prompt_tokens + 2 * block


def test_a_caller_minting_session_ids_does_not_starve_another_tenant(
    spawn_worker: SpawnWorker,
) -> None:
    """An anonymous caller sends many requests under fresh session ids; a keyed tenant's one
    request, queued behind them while the pool is saturated, goes first once room frees (least
    attained service): the anonymous caller is one tenant with all its service, not one new
    tenant per session id."""
    w = spawn_worker("--engine", "sim")
    keys = {"k-b": KeyPolicy("team-b"), "": ANONYMOUS}
    rt = runtime([w.url], settings=RouterSettings(api_keys=keys))
    gate = Gate()
    rt.flow.saturation = gate
    order: list[str] = []
    dispatched = rt.core.dispatched

    def record(req: Any, d: Any, **kw: Any) -> Any:
        order.append(req.tenant)
        return dispatched(req, d, **kw)

    rt.core.dispatched = record  # type: ignore[method-assign]

    def mint(i: int) -> dict[str, Any]:
        return chat([{"role": "user", "content": f"job {i} " * 50}])

    async def main() -> None:
        async with serving(rt) as c:
            url = "/v1/chat/completions"
            for i in range(3):  # service attained by the anonymous caller, 3 session ids
                r = await c.post(url, json=mint(i), headers={"x-session-id": f"s{i}"})
                assert r.status_code == 200, r.text
            gate.closed = True
            queued = [asyncio.create_task(c.post(url, json=mint(10 + i),
                      headers={"x-session-id": f"fresh-{i}"})) for i in range(3)]  # fmt: skip
            await asyncio.sleep(0.2)
            other = asyncio.create_task(c.post(url, json=mint(99),
                                        headers={"authorization": "Bearer k-b"}))  # fmt: skip
            await asyncio.sleep(0.2)
            assert sum(rt.flow.stats().queued.values()) == 4
            order.clear()
            gate.closed = False
            rt.flow.poll()
            answers = await asyncio.gather(other, *queued)
            assert [a.status_code for a in answers] == [200] * 4
            assert order[0] == "team-b", order
            assert set(order[1:]) == {"anon:10.0.0.5"}

    asyncio.run(main())


# --- the gateway path: ext_proc under flow control ------------------------------------------


def test_ext_proc_admits_through_flow_control(spawn_worker: SpawnWorker) -> None:
    """Envoy's message sequence against the picker: while the pool is saturated a pick waits
    in the queue and is answered when room frees; a full queue sheds with an immediate 429;
    after N requests the books are back to zero."""
    w = spawn_worker("--engine", "sim")
    # one session id for every call (Envoy's headers): with `live_session_s` each would be
    # that live session's `continuing` turn, which the saturation gate does not hold
    rt = runtime([w.url], flow={"max_queued": 1, "live_session_s": None})
    gate = Gate()
    rt.flow.saturation = gate

    def body(i: int) -> bytes:
        return json.dumps(chat([{"role": "user", "content": f"task {i} " * 40}])).encode()

    async def main() -> None:
        await rt.start()
        server, port, _ = build_server(0, GrpcGlue(rt).pick, GrpcGlue(rt).route, host="127.0.0.1")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.ExternalProcessorStub(channel)

                async def envoy(i: int, respond: bool = True) -> list[Any]:
                    msgs = envoy_request(body(i))
                    if respond:
                        msgs += envoy_response([b'data: {"choices": []}\n\n', b"data: [DONE]\n\n"])
                    return [m async for m in stub.Process(iter(msgs), timeout=20)]

                done = await envoy(0)  # not saturated: picked at once
                assert done[0].HasField("request_headers")
                gate.closed = True
                waiting = asyncio.create_task(envoy(1))
                await asyncio.sleep(0.3)
                assert not waiting.done() and rt.flow.stats().queued["new"] == 1
                # the queue (1) is full: refused at once (after an immediate response Envoy
                # sends no more, so neither does this client: a stream it kept writing to
                # after the picker closed it ends INTERNAL on a busy machine)
                shed = await envoy(2, respond=False)
                imm = shed[-1].immediate_response
                assert imm.status.code == 429, shed
                assert any(h.header.key == "retry-after" for h in imm.headers.set_headers)
                assert b"error" in imm.body
                gate.closed = False
                rt.flow.poll()
                answered = await waiting
                assert answered[0].HasField("request_headers")
                for i in range(3, 7):
                    await envoy(i)
            s = rt.flow.stats()
            assert sum(s.queued.values()) == 0 and s.in_flight == 0
            assert rt.core.open_dispatches == 0
            assert all(rt.loads.load(e.id).in_flight == 0 for e in rt.endpoints())
        finally:
            await server.stop(None)
            await rt.stop()

    asyncio.run(main())


def test_a_live_session_s_fresh_prompt_is_continuing_with_live_session_s() -> None:
    """`flow.live_session_s`: a request of a session whose record changed within that long
    counts as ``continuing`` even when its prompt does not extend the tip (a sub-agent's call
    the agent is blocked on); an older record, no record, or no setting: ``new``."""
    rec = SessionRecord("w0", 3, 100.0, 1_000.0, tip=session_tip([1, 2, 3, 4]))
    sub = _call(OPENING)
    fresh = (9, 8, 7, 6, 5)
    assert band_of(ANONYMOUS, {}, rec, sub, fresh) == "new"
    assert band_of(ANONYMOUS, {}, rec, sub, fresh, 60.0, now=1_030.0) == "continuing"
    assert band_of(ANONYMOUS, {}, rec, sub, fresh, 60.0, now=1_061.0) == "new"
    assert band_of(ANONYMOUS, {}, None, sub, fresh, 60.0, now=1_030.0) == "new"
    low = {"x-beamserve-priority": "sheddable"}
    assert band_of(ANONYMOUS, low, rec, sub, fresh, 60.0, now=1_030.0) == "sheddable"


@pytest.mark.parametrize(
    ("live_s", "band"), [(None, "new"), (60.0, "continuing"), ("default", "continuing")]
)
def test_through_the_router_a_sub_agent_call_of_a_live_session(
    spawn_worker: SpawnWorker, live_s: float | str | None, band: str
) -> None:
    """A session's first turn is served over HTTP (its record and tip are bound); then a
    request under the same session id whose prompt does not extend that turn's (a sub-agent's
    call) is ``continuing`` with `flow.live_session_s` (by default 60 s) and ``new`` with it
    off."""
    from tests.router.test_pace_hold import router_over
    from tests.router.test_router_flow import serving

    w = spawn_worker("--engine", "sim", "--profile", "h200-bf16-tp8")
    flow = {} if live_s == "default" else {"live_session_s": live_s}
    rt, _ = router_over(w.url, **flow)
    sid = {"x-session-id": "agent-1"}
    main_turn = [{"role": "user", "content": "review the repository " * 200}]
    sub_call = [{"role": "user", "content": "summarise this file for the caller " * 200}]

    async def main() -> str:
        async with serving(rt) as c:
            body = {"model": "beam", "messages": main_turn, "max_tokens": 2}
            r = await c.post("/v1/chat/completions", headers=sid, json=body)
            assert r.status_code == 200, r.text
            rreq, record, _key = await rt.router.route_request(_call(sub_call), sid)
            assert record is not None and record.tip  # the first turn was bound
            return rreq.band

    assert asyncio.run(main()) == band
