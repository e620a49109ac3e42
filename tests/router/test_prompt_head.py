"""A long prompt that starts a session goes to its worker on its head key (the first segments,
which decide every worker's hit) and is tokenized and hashed whole while the worker starts on
it (`router/app.py`, `HEAD_CHARS`). Over real HTTP, `beamserve router` in approximate mode in
front of a sim worker that publishes no KV events, so every hit the router sees comes from its
own predictions: the next turn must find the *whole* first prompt predicted, the session bound,
and the books back at zero — as when the prompt was hashed whole before the call."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.conftest import SpawnWorker, WorkerProc
from tests.router.test_router_e2e import metric, route_of

BLOCK = 64  # the router's default block size (approximate mode)


def _text(session: str, words: int) -> str:
    return "".join(f"{session}{i:05d} " for i in range(words))  # 2 pseudo-tokens a word


@pytest.fixture
def router(spawn_worker: SpawnWorker) -> WorkerProc:
    w = spawn_worker("--engine", "sim", "--profile", "h200-bf16-tp8")
    spec = [{"url": w.url, "role": "both", "engine": "sim"}]
    return spawn_worker("--endpoints", json.dumps(spec), command="router")


def _turn(router: WorkerProc, session: str, msgs: list[dict[str, Any]], stream: bool) -> dict:
    body = {"model": "beam", "messages": msgs, "max_tokens": 3, "stream": stream}
    with httpx.stream(
        "POST", router.url + "/v1/chat/completions", json=body,
        headers={"x-session-id": session}, timeout=60,
    ) as r:  # fmt: skip
        text = r.read().decode()
        assert r.status_code == 200, text
        return route_of(r.headers)


def _hit_blocks(route: dict[str, str]) -> tuple[int, int]:
    _kind, _, rest = route["hit"].partition(":")  # "full:250/260 blocks"
    held, _, of = rest.split()[0].partition("/")
    return int(held), int(of)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "unary"])
def test_a_new_long_prompt_routed_on_its_head_is_predicted_and_bound_whole(
    router: WorkerProc, stream: bool
) -> None:
    words = 6_000  # 6,000 × 8 characters ≈ 48K: more than twice `HEAD_CHARS`
    msgs: list[dict[str, Any]] = [{"role": "user", "content": _text("a", words)}]
    first = _turn(router, "s-head", msgs, stream)
    assert first["band"] == "new"
    _, first_blocks = _hit_blocks(first)  # the whole prompt's blocks, amended before the answer
    assert first_blocks >= 2 * words // BLOCK
    assert metric(router.url, "beamserve_router_prompt_heads_total") == 1
    msgs += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "next"}]
    second = _turn(router, "s-head", msgs, stream)
    held, _ = _hit_blocks(second)
    assert second["band"] == "continuing"
    # Only the router's predictions can give this hit: the whole first prompt, not its head.
    assert held >= first_blocks - 1, (first, second)
    assert metric(router.url, "beamserve_router_prompt_heads_total") == 1  # on record: whole
    for name in ("worker_in_flight", "worker_prefill_tokens", "worker_decode_tokens"):
        assert metric(router.url, f"beamserve_router_{name}") == 0, name
    # Short prompts are hashed whole before the call, as always.
    _turn(router, "s-short", [{"role": "user", "content": _text("b", 500)}], stream)
    assert metric(router.url, "beamserve_router_prompt_heads_total") == 1


def test_a_turn_of_a_session_on_record_is_keyed_whole_without_a_head(
    spawn_worker: SpawnWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The session's record is read before the prompt is keyed: a long prompt of a session on
    record is hashed whole at once (its tip is matched whole), with no head computed first;
    a long prompt that starts a session gets its head."""
    import asyncio

    from beamserve.router.api.convert import to_upstream
    from beamserve.router.api.models import parse_request
    from beamserve.router.prompt import PromptHasher

    from tests.router.test_pace_hold import router_over
    from tests.router.test_router_flow import serving

    heads: list[int] = []
    head_key = PromptHasher.head_key

    def counted(self: PromptHasher, segs: list[str], head_chars: int) -> Any:
        heads.append(head_chars)
        return head_key(self, segs, head_chars)

    monkeypatch.setattr(PromptHasher, "head_key", counted)
    w = spawn_worker("--engine", "sim", "--profile", "h200-bf16-tp8")
    rt, _ = router_over(w.url)
    first = [{"role": "user", "content": _text("r", 6_000)}]
    later = [*first, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go"}]

    def call(msgs: list[dict[str, Any]]) -> Any:
        body = json.dumps({"model": "beam", "messages": msgs, "max_tokens": 2}).encode()
        return to_upstream(parse_request("chat", body, 1 << 24))

    async def main() -> None:
        async with serving(rt) as c:
            body = {"model": "beam", "messages": first, "max_tokens": 2}
            r = await c.post("/v1/chat/completions", headers={"x-session-id": "rec"}, json=body)
            assert r.status_code == 200, r.text
            assert heads == [8_192]  # the session's first turn went on its head
            rreq, record, key = await rt.router.route_request(
                call(later), {"x-session-id": "rec"}, head=True
            )
            assert record is not None and rreq.band == "continuing"
            assert heads == [8_192] and not key.partial  # whole at once: no head
            fresh = [{"role": "user", "content": _text("n", 6_000)}]  # held nowhere
            _, none, key = await rt.router.route_request(
                call(fresh), {"x-session-id": "new"}, head=True
            )
            assert none is None and key.partial and heads == [8_192, 8_192]

    asyncio.run(main())


@pytest.mark.parametrize(
    "flow",
    [{}, {"pace_hold_tokens": 1024, "prefill_piece_min_tokens": 4096}],
    ids=["plain", "turn-rules"],
)
def test_a_new_sessions_head_goes_before_its_rest_under_the_turn_rules(
    spawn_worker: SpawnWorker, monkeypatch: pytest.MonkeyPatch, flow: dict[str, Any]
) -> None:
    """The pace hold and the prefill in pieces weigh a continuing turn's (or a spilled first
    turn's) uncached tokens, never a new session's: with them configured too, a long prompt
    that starts a session goes to its worker on its head, and its rest is tokenized and hashed
    after the upstream call."""
    import asyncio

    from beamserve.router.pd import Upstreams
    from beamserve.router.prompt import PromptKey

    from tests.router.test_pace_hold import router_over
    from tests.router.test_router_flow import serving

    events: list[str] = []
    complete, stream = PromptKey.complete, Upstreams.stream

    def completed(self: PromptKey) -> PromptKey:
        if self.partial:
            events.append("rest hashed")
        return complete(self)

    async def streamed(self: Upstreams, *a: Any, **k: Any) -> Any:
        events.append("upstream call")
        return await stream(self, *a, **k)

    monkeypatch.setattr(PromptKey, "complete", completed)
    monkeypatch.setattr(Upstreams, "stream", streamed)
    w = spawn_worker("--engine", "sim", "--profile", "h200-bf16-tp8")
    rt, _ = router_over(w.url, **flow)
    msgs = [{"role": "user", "content": _text("h", 6_000)}]

    async def main() -> None:
        async with serving(rt) as c:
            body = {"model": "beam", "messages": msgs, "max_tokens": 2, "stream": True}
            r = await c.post("/v1/chat/completions", headers={"x-session-id": "new"}, json=body)
            assert r.status_code == 200, r.text
            assert rt.core.open_dispatches == 0

    asyncio.run(main())
    assert events == ["upstream call", "rest hashed"]
