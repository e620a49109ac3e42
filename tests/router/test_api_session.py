"""Session identity: header precedence, a stable conversation hash across API shapes, turns."""

from __future__ import annotations

import json
from typing import Any

import pytest
from beamserve.router.api.convert import to_upstream
from beamserve.router.api.models import ApiName, parse_request
from beamserve.router.api.session import (
    SESSION_HEADERS,
    is_continuing_turn,
    session_id_from,
    turn_index,
)
from hypothesis import given, settings
from hypothesis import strategies as st

CONV = [{"role": "system", "content": "You are Beam."}, {"role": "user", "content": "fix the bug"}]


def _messages(api: ApiName, body: dict[str, Any]) -> list[dict[str, Any]]:
    return to_upstream(parse_request(api, json.dumps(body).encode(), 1 << 20)).messages_for_session


def test_headers_win_in_the_documented_order() -> None:
    headers = {name: f"id-{i}" for i, name in enumerate(SESSION_HEADERS)}
    for i, name in enumerate(SESSION_HEADERS):
        assert session_id_from(headers, CONV) == (f"id-{i}", "header")
        del headers[name]
    assert session_id_from(headers, CONV)[1] == "hash"
    assert SESSION_HEADERS == (
        "x-session-id",
        "x-claude-code-session-id",
        "x-session-affinity",
        "session-id",
    )


def test_header_names_are_case_insensitive_and_blank_values_skipped() -> None:
    assert session_id_from({"X-Claude-Code-Session-Id": " abc "}, CONV) == ("abc", "header")
    assert session_id_from([("X-Session-ID", ""), ("Session-Id", "codex-1")], CONV) == (
        "codex-1",
        "header",
    )
    long_id, source = session_id_from({"x-session-id": "x" * 1000}, CONV)
    assert source == "header" and long_id.startswith("h-") and len(long_id) == 34


def test_hash_is_stable_across_turns_and_differs_between_conversations() -> None:
    first, source = session_id_from({}, CONV)
    assert source == "hash" and first.startswith("c-") and len(first) == 34
    later = [*CONV, {"role": "assistant", "content": "done"}, {"role": "user", "content": "thanks"}]
    assert session_id_from({}, later)[0] == first
    other = [CONV[0], {"role": "user", "content": "write tests"}]
    assert session_id_from({}, other)[0] != first
    other_system = [{"role": "system", "content": "You are Other."}, CONV[1]]
    assert session_id_from({}, other_system)[0] != first


def test_same_conversation_in_every_api_shape_gets_the_same_id() -> None:
    chat = _messages("chat", {"model": "m", "messages": CONV})
    chat_parts = _messages(
        "chat",
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": [{"type": "text", "text": "You are Beam."}]},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "fix the "},
                        {"type": "text", "text": "bug"},
                    ],
                },
            ],
        },
    )
    anthropic_body = {
        "model": "m",
        "max_tokens": 4,
        "system": [{"type": "text", "text": "You are Beam."}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "fix the bug"}]}],
    }
    anthropic_msgs = _messages("messages", anthropic_body)
    responses = _messages(
        "responses", {"model": "m", "instructions": "You are Beam.", "input": "fix the bug"}
    )
    ids = {
        session_id_from({}, chat)[0],
        session_id_from({}, chat_parts)[0],
        session_id_from({}, anthropic_msgs)[0],
        session_id_from({}, responses)[0],
        session_id_from({}, anthropic_body["messages"], system=anthropic_body["system"])[0],
    }
    assert len(ids) == 1


def test_completions_prompts_hash_their_prefix() -> None:
    prefix = "x" * 2048
    a, source = session_id_from({}, prefix + "turn one")
    assert source == "hash" and a.startswith("p-")
    assert session_id_from({}, prefix + "turn two, longer")[0] == a
    assert session_id_from({}, "short prompt")[0] != a
    tokens = list(range(600))
    assert session_id_from({}, tokens)[0] == session_id_from({}, [*tokens, 1, 2])[0]
    assert session_id_from({}, tokens[:10])[0] != session_id_from({}, tokens[:11])[0]


@pytest.mark.parametrize(
    ("messages", "continuing", "turn"),
    [
        (CONV, False, 0),
        (
            [*CONV, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}],
            True,
            1,
        ),
        ([*CONV, {"role": "tool", "tool_call_id": "c", "content": "r"}], True, 0),
        (
            [
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "t", "content": "r"}],
                }
            ],
            True,
            0,
        ),
        ("a prompt", False, 0),
        ([1, 2, 3], False, 0),
        ([], False, 0),
    ],
)
def test_continuing_turn_and_turn_index(messages: Any, continuing: bool, turn: int) -> None:
    assert is_continuing_turn(messages) is continuing
    assert turn_index(messages) == turn


words = st.text(max_size=30)


@settings(max_examples=100, deadline=None)
@given(system=words, first=words, rest=st.lists(st.tuples(words, words), max_size=4))
def test_anthropic_and_openai_shapes_agree_on_id_and_turns(
    system: str, first: str, rest: list[tuple[str, str]]
) -> None:
    openai_msgs: list[dict[str, Any]] = (
        [{"role": "system", "content": system}] if system else []
    ) + [{"role": "user", "content": first}]
    anthropic_msgs: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": first}]}
    ]
    for reply, follow in rest:
        openai_msgs += [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": follow},
        ]
        anthropic_msgs += [
            {"role": "assistant", "content": [{"type": "text", "text": reply}]},
            {"role": "user", "content": follow},
        ]
    body: dict[str, Any] = {"model": "m", "max_tokens": 1, "messages": anthropic_msgs}
    if system:
        body["system"] = system
    converted = _messages("messages", body)
    assert session_id_from({}, converted) == session_id_from({}, openai_msgs)
    assert turn_index(converted) == turn_index(openai_msgs) == len(rest)
    assert is_continuing_turn(converted) is is_continuing_turn(openai_msgs) is bool(rest)
