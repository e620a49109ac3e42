"""The prefill in pieces (`beamserve.router.flow.pieces`): the cut points, which requests get
them, and runs through the router in front of a real sim worker — the pieces are cached
where the request then finds them, a failing piece only ends the pieces, nothing leaks."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from beamserve.router.flow import FlowConfig, FlowConfigError
from beamserve.router.flow.pieces import (
    DECODE_ROOM,
    DECODE_TOKENS,
    PrefillPieces,
    first_piece_size,
    piece_cuts,
    wants_first_pieces,
    wants_pieces,
)
from beamserve.router.load import LoadBook
from beamserve.router.pd import UpstreamError
from beamserve.router.server import RouterRuntime
from hypothesis import given
from hypothesis import strategies as st

from tests.conftest import SpawnWorker
from tests.router.test_pace_hold import metric, nothing_booked, router_over
from tests.router.test_router_flow import serving

# --- the pure steps --------------------------------------------------------------------------


def test_cuts_start_at_the_cached_part_and_stop_short_of_the_prompt() -> None:
    assert piece_cuts(10_000, 4_000, 1_024, 16) == [7_024, 8_048, 9_072]
    assert piece_cuts(10_000, 4_000, 1_000, 64) == [6_976, 8_000, 8_960]
    assert piece_cuts(10_000, 500, 1_024, 16) == []  # one piece or less: nothing first
    assert piece_cuts(10_000, 0, 1_024, 16) == []
    assert piece_cuts(3_000, 9_999, 1_024, 16) == [1_024, 2_048]  # uncached > prompt: all


@given(
    prompt=st.integers(1, 200_000),
    uncached=st.integers(0, 200_000),
    piece=st.integers(1, 20_000),
    block=st.sampled_from([1, 16, 32, 64, 256]),
)
def test_cuts_grow_in_whole_blocks_of_at_most_a_piece(
    prompt: int, uncached: int, piece: int, block: int
) -> None:
    cuts = piece_cuts(prompt, uncached, piece, block)
    cached = max(prompt - uncached, 0)
    prev = cached
    for c in cuts:
        assert c % block == 0 and prev < c < prompt
        assert c - prev <= piece + block  # rounding down moves a cut back by under a block
        prev = c
    if cuts:
        assert prompt - cuts[-1] <= piece + block  # what is left for the request itself
    if uncached > 0 and block <= piece and prompt - cached >= piece + block:
        assert cuts  # a new part of more than a piece is always cut


def test_only_long_continuing_turns_prefilled_on_their_worker_get_pieces() -> None:
    rule = PrefillPieces(4096, 1024)
    assert wants_pieces(rule, "continuing", False, 4096)
    assert not wants_pieces(rule, "continuing", False, 4095)
    assert not wants_pieces(rule, "continuing", True, 50_000)  # split: the prefill worker's
    assert not wants_pieces(rule, "new", False, 50_000)
    # a first turn the prefill stage spilled to its decode worker is prefilled there in pieces
    assert wants_pieces(rule, "new", False, 50_000, spilled=True)
    assert not wants_pieces(rule, "new", False, 4095, spilled=True)


def test_config_is_off_by_default_and_checked() -> None:
    assert FlowConfig().prefill_pieces() is None
    rule = FlowConfig.from_mapping({"prefill_piece_min_tokens": 2048}).prefill_pieces()
    assert rule == PrefillPieces(2048, 1024)
    with pytest.raises(FlowConfigError, match="prefill_piece_tokens"):
        FlowConfig.from_mapping({"prefill_piece_min_tokens": 2048, "prefill_piece_tokens": 0})


def test_a_first_turn_goes_in_pieces_only_beside_live_sessions() -> None:
    assert wants_first_pieces(8192, "new", False, False, 20_000, True)
    assert not wants_first_pieces(8192, "new", False, False, 20_000, False)  # nobody to spare
    assert not wants_first_pieces(None, "new", False, False, 20_000, True)  # off
    assert not wants_first_pieces(8192, "continuing", False, False, 20_000, True)
    assert not wants_first_pieces(8192, "new", True, False, 20_000, True)  # split
    assert not wants_first_pieces(8192, "new", False, True, 20_000, True)  # spilled: that rule's
    assert not wants_first_pieces(8192, "new", False, False, 8192, True)  # one piece: whole
    assert wants_first_pieces(8192, "new", False, False, 8193, True)


@given(
    budget=st.none() | st.integers(min_value=1, max_value=70_000),
    block=st.sampled_from([1, 16, 32, 64, 128]),
)
def test_a_first_turn_piece_is_the_step_budget_less_room_for_decodes(
    budget: int | None, block: int
) -> None:
    """Unset, a first turn's piece fits one engine step beside `DECODE_ROOM` decode tokens, in
    whole blocks, as large as that allows; no budget reported, or none left: no pieces."""
    piece = first_piece_size(None, budget, block)
    if budget is None or budget - DECODE_ROOM < block:
        assert piece is None
        return
    assert piece is not None and piece % block == 0
    assert budget - DECODE_ROOM - block < piece <= budget - DECODE_ROOM
    assert first_piece_size(1000, budget, block) == 1000  # a size set wins


@given(
    budget=st.integers(min_value=1, max_value=70_000),
    block=st.sampled_from([1, 16, 32, 64, 128]),
    decodes=st.integers(min_value=0, max_value=100),
)
def test_a_first_turn_piece_leaves_room_for_the_decodes_that_may_share_its_steps(
    budget: int, block: int, decodes: int
) -> None:
    """Where the decodes beside it are known, a piece leaves `DECODE_TOKENS` each, in whole
    blocks, never more than `DECODE_ROOM`: one more decode never makes it larger, and it is
    never smaller than with the decodes unknown."""
    piece = first_piece_size(None, budget, block, decodes)
    unknown = first_piece_size(None, budget, block)
    more = first_piece_size(None, budget, block, decodes + 1)
    if piece is None:
        assert unknown is None and more is None
        return
    assert piece % block == 0
    room = min(DECODE_ROOM, decodes * DECODE_TOKENS)
    assert piece + room <= budget  # the decodes fit beside it (up to `DECODE_ROOM` tokens)
    assert budget - piece < room + 2 * block
    assert unknown is None or unknown <= piece
    assert more is None or more <= piece


def test_first_turn_pieces_are_on_by_default_and_checked() -> None:
    assert FlowConfig().prefill_first_pieces is True
    assert FlowConfig().prefill_first_piece_tokens is None  # the worker's budget
    assert first_piece_size(None, 8192, 16) == 8192 - 256  # the sim's h200 profile
    assert first_piece_size(None, 8192, 16, 1) == 8192 - 16  # beside one session
    assert FlowConfig.from_mapping({"prefill_first_piece_tokens": 8192}).prefill_pieces() is None
    with pytest.raises(FlowConfigError, match="prefill_first_piece_tokens"):
        FlowConfig.from_mapping({"prefill_first_piece_tokens": 0})


# --- through the router ----------------------------------------------------------------------

FIRST = [{"role": "user", "content": "look at the repository"}]
LATER = [*FIRST, {"role": "assistant", "content": "ok"},
         {"role": "user", "content": "the tool said " + "line of output " * 400}]  # fmt: skip
URL = "/v1/chat/completions"
SID = {"x-session-id": "c"}


async def pieced_once(c: httpx.AsyncClient, worker_url: str, served_before: int) -> float:
    """After one pieced request: at least 4 pieces were sent, that request's pieces all done
    and none missed, and the worker served them besides `served_before` requests (the pieced
    one among them). Returns the number of pieces."""
    text = (await c.get("/metrics")).text
    pieces = metric(text, "beamserve_router_prefill_pieces_total")
    assert pieces >= 4, text
    assert metric(text, 'beamserve_router_pieced_prefills_total{outcome="done"}') == 1
    assert metric(text, "beamserve_router_prefill_pieces_missed_total") == 0
    async with httpx.AsyncClient() as direct:
        served = (await direct.get(worker_url + "/metrics")).text
    assert metric(served, "vllm:request_success_total") == served_before + pieces
    return pieces


@pytest.mark.parametrize("stream", [False, True])
def test_through_the_router_the_pieces_are_what_the_request_finds_cached(
    spawn_worker: SpawnWorker, stream: bool
) -> None:
    """A continuing turn with ~1,600 new tokens in 256-token pieces: the pieces reach the
    worker (its request count), the request's answer reports them cached, none missed; a
    short turn gets none; nothing stays booked."""
    w = spawn_worker("--engine", "sim", "--profile", "h200-bf16-tp8")
    rt, worker = router_over(w.url, prefill_piece_min_tokens=512, prefill_piece_tokens=256)

    async def main() -> None:
        async with serving(rt) as c:
            r = await c.post(URL, json={"model": "beam", "messages": FIRST, "max_tokens": 2},
                             headers=SID)  # fmt: skip
            assert r.status_code == 200, r.text
            body = {"model": "beam", "messages": LATER, "max_tokens": 2, "stream": stream}
            if stream:
                body["stream_options"] = {"include_usage": True}
            r = await c.post(URL, json=body, headers=SID)
            assert r.status_code == 200, r.text
            pieces = await pieced_once(c, w.url, served_before=2)
            # a short continuing turn: no pieces
            short = [*LATER, {"role": "assistant", "content": "ok"},
                     {"role": "user", "content": "thanks"}]  # fmt: skip
            r = await c.post(URL, json={"model": "beam", "messages": short, "max_tokens": 2},
                             headers=SID)  # fmt: skip
            assert r.status_code == 200
            text = (await c.get("/metrics")).text
            assert metric(text, "beamserve_router_prefill_pieces_total") == pieces
            nothing_booked(rt, worker)

    asyncio.run(main())


def _pieced_turn(
    spawn_worker: SpawnWorker, on_piece: Callable[[RouterRuntime, Any, dict[str, Any]], None]
) -> tuple[RouterRuntime, str, str]:
    """A router over one sim worker, 256-token pieces from 512 new tokens; session `c`'s first
    turn, then its next one (~1,600 new tokens, so in pieces), each piece passing through
    `on_piece(router, endpoint, body)` before it goes (which may raise, as the upstream call would).
    Returns the router, its worker's id and its `/metrics` after both turns were served."""
    w = spawn_worker("--engine", "sim", "--profile", "h200-bf16-tp8")
    rt, worker = router_over(w.url, prefill_piece_min_tokens=512, prefill_piece_tokens=256)
    post = rt.router.upstreams.post

    async def watched(ep: Any, path: str, body: dict[str, Any], timeout: float, **kw: Any) -> Any:
        if path == "/v1/completions":
            on_piece(rt, ep, body)
        return await post(ep, path, body, timeout, **kw)

    rt.router.upstreams.post = watched  # type: ignore[method-assign]

    async def main() -> str:
        async with serving(rt) as c:
            for messages in (FIRST, LATER):
                r = await c.post(URL, json={"model": "beam", "messages": messages,
                                            "max_tokens": 2}, headers=SID)  # fmt: skip
                assert r.status_code == 200, r.text
            return (await c.get("/metrics")).text

    return rt, worker, asyncio.run(main())


def test_a_failed_piece_ends_the_pieces_and_the_request_goes_on(
    spawn_worker: SpawnWorker,
) -> None:
    """The second piece fails (the upstream call below the router raises, as an unreachable
    worker would): no more pieces, the request itself is served, `failed` is counted, and
    nothing stays booked."""
    calls: list[int] = []

    def flaky(_rt: RouterRuntime, ep: Any, body: dict[str, Any]) -> None:
        calls.append(len(body["prompt"]))
        if len(calls) == 2:
            raise UpstreamError(ep.id, "connect", "unreachable (test)")

    rt, worker, text = _pieced_turn(spawn_worker, flaky)
    assert len(calls) == 2
    assert metric(text, "beamserve_router_prefill_pieces_total") == 1
    assert metric(text, 'beamserve_router_pieced_prefills_total{outcome="failed"}') == 1
    assert metric(text, "beamserve_router_prefill_pieces_missed_total") == 0
    nothing_booked(rt, worker)


def test_pieces_the_engine_did_not_keep_are_counted_missed(spawn_worker: SpawnWorker) -> None:
    """Pieces the worker answers but the request then does not find cached (here: each piece's
    ids shifted by one, so they are other tokens than the prompt's) count as missed."""
    w = spawn_worker("--engine", "sim", "--profile", "h200-bf16-tp8")
    rt, _ = router_over(w.url, prefill_piece_min_tokens=512, prefill_piece_tokens=256)
    post = rt.router.upstreams.post

    async def shifted(ep: Any, path: str, body: dict[str, Any], timeout: float, **kw: Any) -> Any:
        if path == "/v1/completions":
            body = {**body, "prompt": [t + 1 for t in body["prompt"]]}
        return await post(ep, path, body, timeout, **kw)

    rt.router.upstreams.post = shifted  # type: ignore[method-assign]

    async def main() -> None:
        async with serving(rt) as c:
            for messages in (FIRST, LATER):
                r = await c.post(URL, json={"model": "beam", "messages": messages,
                                            "max_tokens": 2}, headers=SID)  # fmt: skip
                assert r.status_code == 200, r.text
            text = (await c.get("/metrics")).text
            assert metric(text, 'beamserve_router_pieced_prefills_total{outcome="done"}') == 1
            assert metric(text, "beamserve_router_prefill_pieces_missed_total") == 1

    asyncio.run(main())


def test_each_answered_piece_leaves_the_worker_s_books(spawn_worker: SpawnWorker) -> None:
    """While a turn is prefilled in pieces, the worker's booked prefill is what is still to
    compute: each piece sent finds the books lower by the pieces answered before it (the spill's
    room, the pace hold and the saturation gate read those books), and the request itself is
    booked for its last part only; nothing stays booked after."""
    booked: list[tuple[int, int]] = []  # (prefix tokens sent, booked prefill at that moment)

    def watching(rt: RouterRuntime, ep: Any, body: dict[str, Any]) -> None:
        booked.append((len(body["prompt"]), rt.core.loads.load(ep.id).prefill_tokens))

    rt, worker, _ = _pieced_turn(spawn_worker, watching)
    assert len(booked) >= 4, booked
    for (cut, was), (next_cut, now) in itertools.pairwise(booked):
        # the piece up to `cut` was answered before the next one went
        assert was - now == next_cut - cut, booked
    # the first piece went with the whole new part booked; the last with only what is left
    assert booked[0][1] > booked[-1][1] > 0
    nothing_booked(rt, worker)


@pytest.mark.parametrize("repeat", [400, 1500])  # keyed whole; routed on its head (HEAD_CHARS)
def test_a_first_turn_beside_a_resting_session_goes_in_pieces(
    spawn_worker: SpawnWorker, repeat: int
) -> None:
    """256-token first-turn pieces: a long first turn with the worker to itself goes whole; the
    next session's long first turn, while the first one rests there between turns, goes in
    pieces that its answer finds cached; a short one goes whole; nothing stays booked."""
    w = spawn_worker("--engine", "sim", "--profile", "h200-bf16-tp8")
    rt, worker = router_over(w.url, prefill_first_piece_tokens=256)

    def first(text: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": text + " line of output" * repeat}]

    async def main() -> None:
        async with serving(rt) as c:
            body = {"model": "beam", "messages": first("alone"), "max_tokens": 2}
            r = await c.post(URL, json=body, headers={"x-session-id": "a"})
            assert r.status_code == 200, r.text
            text = (await c.get("/metrics")).text
            assert metric(text, "beamserve_router_prefill_pieces_total") == 0
            assert rt.core.loads.load(worker).resting == 1  # session a, between turns
            r = await c.post(URL, json={"model": "beam", "messages": first("beside"),
                                        "max_tokens": 2, "stream": True,
                                        "stream_options": {"include_usage": True}},
                             headers={"x-session-id": "b"})  # fmt: skip
            assert r.status_code == 200, r.text
            pieces = await pieced_once(c, w.url, served_before=2)
            r = await c.post(URL, json={"model": "beam", "messages": FIRST, "max_tokens": 2},
                             headers={"x-session-id": "c"})  # fmt: skip
            assert r.status_code == 200
            text = (await c.get("/metrics")).text
            assert metric(text, "beamserve_router_prefill_pieces_total") == pieces
            nothing_booked(rt, worker)

    asyncio.run(main())


@pytest.mark.parametrize("fail_first", [False, True])
def test_a_first_turn_on_its_head_sends_its_first_piece_before_it_is_keyed_whole(
    spawn_worker: SpawnWorker, fail_first: bool
) -> None:
    """A long first turn routed on its head (`HEAD_CHARS`), beside a resting session, in
    4,096-token pieces: the first piece is cut from the head, grown to cover it, and goes out
    before the prompt is tokenized whole; the later pieces are cut from the exact length; the
    answer finds the last piece cached; nothing stays booked. When that first piece fails
    (unreachable), the request is keyed whole all the same and served."""
    w = spawn_worker("--engine", "sim", "--profile", "h200-bf16-tp8")
    rt, worker = router_over(w.url, prefill_first_piece_tokens=4096)
    hasher = rt.router.hasher
    events: list[tuple[str, int]] = []
    whole_key, post = hasher.whole_key, rt.router.upstreams.post

    def keyed_whole(segs: Any) -> Any:
        key = whole_key(segs)
        events.append(("whole", key.prompt_tokens))
        return key

    async def watched(ep: Any, path: str, body: dict[str, Any], timeout: float, **kw: Any) -> Any:
        if path == "/v1/completions" and body.get("max_tokens") == 1:
            events.append(("piece", len(body["prompt"])))
            if fail_first:
                raise UpstreamError(ep.id, "connect", "unreachable (test)")
        return await post(ep, path, body, timeout, **kw)

    hasher.whole_key = keyed_whole  # type: ignore[method-assign]
    rt.router.upstreams.post = watched  # type: ignore[method-assign]
    prompt = "the tool said " + "line of output " * 3000  # ≈ 45K characters: a head key

    async def main() -> None:
        async with serving(rt) as c:
            r = await c.post(URL, json={"model": "beam", "messages": FIRST, "max_tokens": 2},
                             headers={"x-session-id": "a"})  # fmt: skip
            assert r.status_code == 200, r.text
            events.clear()
            body = {"model": "beam", "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": 2}  # fmt: skip
            r = await c.post(URL, json=body, headers={"x-session-id": "b"})
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            nothing_booked(rt, worker)
            pieces = [n for kind, n in events if kind == "piece"]
            wholes = [i for i, (kind, _) in enumerate(events) if kind == "whole"]
            assert events[0] == ("piece", 4096), events  # before any whole key
            assert len(wholes) == 1 and events[wholes[0]][1] == usage["prompt_tokens"], events
            text = (await c.get("/metrics")).text
            if fail_first:
                assert events == [("piece", 4096), ("whole", usage["prompt_tokens"])]
                assert metric(text, 'beamserve_router_pieced_prefills_total{outcome="failed"}') == 1
                return
            assert metric(text, "beamserve_router_prefill_pieces_total") == len(pieces)
            total = usage["prompt_tokens"]
            assert pieces == [4096 * (i + 1) for i in range(len(pieces))], pieces
            assert pieces[-1] < total <= pieces[-1] + 4096  # cut from the exact length
            assert usage["prompt_tokens_details"]["cached_tokens"] == pieces[-1]

    asyncio.run(main())


def _first_turns_beside_a_rest(
    spawn_worker: SpawnWorker, **flow: Any
) -> tuple[list[int], RouterRuntime, str]:
    """Over a sim worker with a 512-token step budget: session `a`'s long first turn, then,
    while `a` rests there, session `b`'s; returns the prompt lengths of the pieces the router
    sent (in order), the router and the worker's id."""
    w = spawn_worker(
        "--engine", "sim", "--profile", "h200-bf16-tp8", "--max-num-batched-tokens", "512"
    )
    rt, worker = router_over(w.url, **flow)
    cuts: list[int] = []
    post = rt.router.upstreams.post

    async def watched(ep: Any, path: str, body: dict[str, Any], timeout: float, **kw: Any) -> Any:
        if path == "/v1/completions" and body.get("max_tokens") == 1:
            cuts.append(len(body["prompt"]))
        return await post(ep, path, body, timeout, **kw)

    rt.router.upstreams.post = watched  # type: ignore[method-assign]

    async def main() -> None:
        async with serving(rt) as c:
            for sid in ("a", "b"):
                text = f"session {sid} " + " line of output" * 400
                body = {"model": "beam", "messages": [{"role": "user", "content": text}],
                        "max_tokens": 2}  # fmt: skip
                r = await c.post(URL, json=body, headers={"x-session-id": sid})
                assert r.status_code == 200, r.text
                assert not cuts or sid == "b"  # `a` had the worker to itself: whole
            nothing_booked(rt, worker)

    asyncio.run(main())
    return cuts, rt, worker


def test_first_turn_pieces_by_default_are_the_worker_s_step_budget_less_room(
    spawn_worker: SpawnWorker,
) -> None:
    """With the router's defaults, the worker's reported budget (512) sizes the pieces: each
    adds 512 − 64 tokens — room for the one session resting there (`a`) to decode beside it, 8
    tokens rounded up to a 64-token block — so each fits one step; the first starts at 0."""
    cuts, rt, worker = _first_turns_beside_a_rest(spawn_worker)
    assert [e.step_budget for e in rt.endpoints() if e.id == worker] == [512]
    assert rt.router.hasher.block_size == 64
    assert len(cuts) >= 4, cuts
    assert cuts == [448 * (i + 1) for i in range(len(cuts))], cuts


def test_first_turn_pieces_switched_off_send_the_prompt_whole(spawn_worker: SpawnWorker) -> None:
    cuts, _, _ = _first_turns_beside_a_rest(spawn_worker, prefill_first_pieces=False)
    assert cuts == []


# --- pieces yield to short turns -------------------------------------------------------------


def test_short_prefills_count_the_short_turns_booked_and_not_held() -> None:
    """`LoadBook.short_prefills`: this replica's requests waiting on the worker for their first
    token with at most so many tokens of prefill — not the pieced one itself, not one the pace
    hold keeps back, not one past its first token, not one on another worker."""
    book = LoadBook(clock=lambda: 0.0)
    pieced = book.start("w0", 20_000, 20_000)
    short = book.start("w0", 300, 12_000)
    book.start("w1", 300, 12_000)
    long_ = book.start("w0", 5_000, 30_000)
    assert book.short_prefills("w0", 2048, exclude=pieced) == 1
    assert book.short_prefills("w0", 2048) == 1
    assert book.short_prefills("w0", 5_000, exclude=pieced) == 2
    assert book.short_prefills("w9", 2048) == 0
    book.hold(short, True)
    assert book.short_prefills("w0", 2048, exclude=pieced) == 0
    book.hold(short, False)
    book.first_token(short)
    assert book.short_prefills("w0", 2048, exclude=pieced) == 0
    book.finish(long_)
    assert book.short_prefills("w0", 5_000, exclude=pieced) == 0


def test_piece_yield_is_off_by_default_and_checked() -> None:
    assert FlowConfig().prefill_piece_yield_tokens is None
    assert FlowConfig().prefill_piece_yield_max_s == 0.5
    with pytest.raises(FlowConfigError, match="prefill_piece_yield_tokens"):
        FlowConfig.from_mapping({"prefill_piece_yield_tokens": 0})
    with pytest.raises(FlowConfigError, match="prefill_piece_yield_max_s"):
        FlowConfig.from_mapping({"prefill_piece_yield_max_s": 0})


def _short_turn_during_pieces(
    spawn_worker: SpawnWorker, b_lines: int = 800, **flow: Any
) -> tuple[list[int], str, RouterRuntime, str]:
    """Session `a`'s first turn; then session `b`'s long first turn (`b_lines` lines) goes in
    256-token pieces beside it, and as `b`'s second piece goes out, `a`'s short next turn
    arrives. Returns, for each piece as it went out and then for `b`'s request itself, how many
    short turns (≤ 200 tokens) waited on the worker for their first token; the router's
    `/metrics`; the router and the worker's id."""
    # a tenth of the speed: `a`'s own step (≈ 0.1 s) outlasts the router's turnaround between
    # two pieces, so without the yield the next piece reaches the engine before `a`'s first token
    w = spawn_worker("--engine", "sim", "--profile", "h200-bf16-tp8", "--speed", "0.1")
    rt, worker = router_over(w.url, prefill_first_piece_tokens=256, **flow)
    waiting: list[int] = []
    post = rt.router.upstreams.post
    later: list[asyncio.Task[httpx.Response]] = []
    a_first = [{"role": "user", "content": "session a " + " line of output" * 200}]
    a_next = [*a_first, {"role": "assistant", "content": "ok"},
              {"role": "user", "content": "and the tests?"}]  # fmt: skip

    async def watched(ep: Any, path: str, body: dict[str, Any], timeout: float, **kw: Any) -> Any:
        if path == "/v1/completions" and body.get("max_tokens") == 1:
            waiting.append(rt.core.loads.short_prefills(worker, 200))  # not `b`'s own rest
            if len(waiting) == 2:  # `a` comes back while this piece prefills (≈ 0.4 s a step)
                piece = asyncio.ensure_future(post(ep, path, body, timeout, **kw))
                await asyncio.sleep(0.1)  # the piece is in the engine's step first
                later.append(asyncio.ensure_future(client.post(
                    URL, json={"model": "beam", "messages": a_next, "max_tokens": 2},
                    headers={"x-session-id": "a"})))  # fmt: skip
                return await piece
        elif "session b" in str(body.get("messages")):  # `b`'s request itself, after them
            waiting.append(rt.core.loads.short_prefills(worker, 200))
        return await post(ep, path, body, timeout, **kw)

    rt.router.upstreams.post = watched  # type: ignore[method-assign]
    client: httpx.AsyncClient

    async def main() -> str:
        nonlocal client
        async with serving(rt) as c:
            client = c
            r = await c.post(URL, json={"model": "beam", "messages": a_first, "max_tokens": 2},
                             headers={"x-session-id": "a"})  # fmt: skip
            assert r.status_code == 200, r.text
            text = "session b " + " line of output" * b_lines
            r = await c.post(URL, json={"model": "beam", "max_tokens": 2,
                                        "messages": [{"role": "user", "content": text}]},
                             headers={"x-session-id": "b"})  # fmt: skip
            assert r.status_code == 200, r.text
            (a_turn,) = later
            assert (await a_turn).status_code == 200
            nothing_booked(rt, worker)
            return (await c.get("/metrics")).text

    metrics = asyncio.run(main())
    return waiting, metrics, rt, worker


def test_pieces_wait_for_a_short_turn_s_first_token(spawn_worker: SpawnWorker) -> None:
    """With `prefill_piece_yield_tokens`, no piece after `a`'s short turn arrived goes out while
    that turn still waits for its first token: the pieces held once and the turn answered."""
    waiting, metrics, _, _ = _short_turn_during_pieces(
        spawn_worker, prefill_piece_yield_tokens=2048, prefill_piece_yield_max_s=10
    )
    assert len(waiting) >= 4, waiting
    assert waiting == [0] * len(waiting), waiting
    yields = 'beamserve_router_prefill_piece_yields_total{outcome="answered"}'
    assert metric(metrics, yields) == 1, metrics
    assert metric(metrics, 'beamserve_router_pieced_prefills_total{outcome="done"}') == 1


def test_after_its_last_piece_the_request_itself_waits_for_a_short_turn(
    spawn_worker: SpawnWorker,
) -> None:
    """`b` in two pieces, `a`'s short turn arriving during the second (the last): the request
    itself, whose remainder is one more piece, waits for `a`'s first token as a piece would.
    (`b`: ≈ 740 tokens, so its own remainder, ≈ 230, is not counted a short turn.)"""
    waiting, metrics, _, _ = _short_turn_during_pieces(
        spawn_worker, b_lines=120, prefill_piece_yield_tokens=2048, prefill_piece_yield_max_s=10
    )
    assert waiting == [0, 0, 0], waiting  # two pieces, then the request itself
    yields = 'beamserve_router_prefill_piece_yields_total{outcome="answered"}'
    assert metric(metrics, yields) == 1, metrics


def test_without_the_yield_the_next_piece_goes_beside_the_short_turn(
    spawn_worker: SpawnWorker,
) -> None:
    """The control: off (the default), a piece goes out while `a`'s turn still waits for its
    first token (the next one after it arrived), so both share the worker's next step."""
    waiting, metrics, _, _ = _short_turn_during_pieces(spawn_worker)
    assert waiting[:2] == [0, 0] and 1 in waiting, waiting
    assert "prefill_piece_yields_total{" not in metrics


def test_a_yield_is_bounded_and_the_pieces_go_on(spawn_worker: SpawnWorker) -> None:
    """A short turn that never gets its first token (booked by hand, never answered) holds
    each piece `prefill_piece_yield_max_s` at most: the pieced turn is answered, every yield
    is counted bounded, and nothing else stays booked."""
    w = spawn_worker("--engine", "sim", "--profile", "h200-bf16-tp8")
    rt, worker = router_over(
        w.url,
        prefill_first_piece_tokens=256,
        prefill_piece_yield_tokens=2048,
        prefill_piece_yield_max_s=0.05,
    )

    async def main() -> str:
        async with serving(rt) as c:
            a = [{"role": "user", "content": "session a " + " line of output" * 200}]
            r = await c.post(URL, json={"model": "beam", "messages": a, "max_tokens": 2},
                             headers={"x-session-id": "a"})  # fmt: skip
            assert r.status_code == 200, r.text
            stuck = rt.core.loads.start(worker, 100, 100)
            b = [{"role": "user", "content": "session b " + " line of output" * 800}]
            r = await c.post(URL, json={"model": "beam", "messages": b, "max_tokens": 2},
                             headers={"x-session-id": "b"})  # fmt: skip
            assert r.status_code == 200, r.text
            rt.core.loads.finish(stuck)
            nothing_booked(rt, worker)
            return (await c.get("/metrics")).text

    text = asyncio.run(main())
    pieces = metric(text, "beamserve_router_prefill_pieces_total")
    assert pieces >= 4, text
    # before each piece, and before the request itself after the last
    bounded = 'beamserve_router_prefill_piece_yields_total{outcome="bounded"}'
    assert metric(text, bounded) == pieces + 1
    assert metric(text, 'beamserve_router_prefill_piece_yields_total{outcome="answered"}') == 0
