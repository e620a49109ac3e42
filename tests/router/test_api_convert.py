"""Conversions to the workers' chat API and back, checked against the official SDK models."""

from __future__ import annotations

import json
from typing import Any

import anthropic.types
import openai.types.responses
from beamserve.router.api.convert import (
    anthropic_stop_reason,
    model_list,
    parse_tool_input,
    to_anthropic_message,
    to_responses_object,
    to_upstream,
)
from beamserve.router.api.models import ApiName, ResponsesRequest, parse_request
from hypothesis import given, settings
from hypothesis import strategies as st


def _call(api: ApiName, body: dict[str, Any]) -> Any:
    return to_upstream(parse_request(api, json.dumps(body).encode(), 1 << 22))


# ---------------------------------------------------------------------------- to upstream


def test_chat_passes_through_with_extras_and_forces_usage_in_streams() -> None:
    body = {
        "model": "beam",
        "messages": [{"role": "user", "content": "x"}],
        "top_k": 5,
        "stream": True,
    }
    call = _call("chat", body)
    assert call.path == "/v1/chat/completions" and call.stream
    assert call.body["top_k"] == 5
    assert call.body["stream_options"] == {"include_usage": True}
    assert call.client_wants_usage is False
    assert call.messages_for_session == body["messages"]
    unstreamed = _call("chat", {**body, "stream": False, "stream_options": {"include_usage": True}})
    assert "stream_options" not in unstreamed.body


def test_completions_keep_the_prompt_and_extras() -> None:
    call = _call(
        "completions", {"model": "m", "prompt": [[1, 2, 3]], "max_tokens": 4, "echo": False}
    )
    assert call.path == "/v1/completions"
    assert call.prompt == [1, 2, 3] and call.max_tokens == 4
    assert call.prompt_text_or_messages == [1, 2, 3]
    assert call.body["prompt"] == [[1, 2, 3]]


def test_anthropic_request_maps_every_field() -> None:
    body = {
        "model": "beam",
        "max_tokens": 64,
        "system": [
            {"type": "text", "text": "A"},
            {"type": "text", "text": "B", "cache_control": {"type": "ephemeral"}},
        ],
        "messages": [
            {"role": "user", "content": "read x"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "need x", "signature": "sig"},
                    {"type": "redacted_thinking", "data": "opaque"},
                    {"type": "text", "text": "Reading."},
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "read",
                        "input": {"path": "x", "n": 1},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [{"type": "text", "text": "42"}],
                    },
                    {"type": "text", "text": "thanks"},
                    {"type": "text", "text": "more"},
                ],
            },
        ],
        "tools": [
            {"name": "read", "description": "read a file", "input_schema": {"type": "object"}}
        ],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "stop_sequences": ["END"],
        "temperature": 0.2,
        "top_k": 40,
        "metadata": {"user_id": "u1"},
        "stream": True,
    }
    call = _call("messages", body)
    b = call.body
    assert b["messages"] == [
        {"role": "system", "content": "A\n\nB"},
        {"role": "user", "content": "read x"},
        {
            "role": "assistant",
            "content": "Reading.",
            "reasoning_content": "need x",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "read", "arguments": '{"path": "x", "n": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "42"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "thanks"}, {"type": "text", "text": "more"}],
        },
    ]
    assert b["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "read",
                "description": "read a file",
                "parameters": {"type": "object"},
            },
        }
    ]
    assert b["tool_choice"] == "required" and b["parallel_tool_calls"] is False
    assert b["stop"] == ["END"] and b["max_tokens"] == 64 and b["top_k"] == 40
    assert b["user"] == "u1" and b["temperature"] == 0.2
    assert b["stream"] is True and b["stream_options"] == {"include_usage": True}
    assert call.stop_sequences == ("END",) and call.max_tokens == 64
    named = _call("messages", {**body, "tool_choice": {"type": "tool", "name": "read"}}).body
    assert named["tool_choice"] == {"type": "function", "function": {"name": "read"}}


def test_tool_result_errors_are_marked() -> None:
    body = {
        "model": "m",
        "max_tokens": 5,
        "messages": [
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t", "content": "boom", "is_error": True}
                ],
            },
        ],
    }
    msgs = _call("messages", body).body["messages"]
    assert msgs[-1] == {"role": "tool", "tool_call_id": "t", "content": "Error: boom"}
    assert msgs[0]["content"] is None


def test_responses_input_items_become_chat_messages() -> None:
    body = {
        "model": "beam",
        "instructions": "be exact",
        "input": [
            {"role": "developer", "content": "no prose"},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "run ls"}],
            },
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "call ls"}],
            },
            {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "pwd", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "a.py"},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "/w"}],
            },
            {"role": "assistant", "content": [{"type": "output_text", "text": "a.py in /w"}]},
            {"role": "user", "content": "thanks"},
        ],
        "tools": [
            {"type": "function", "name": "ls", "parameters": {"type": "object"}, "strict": True}
        ],
        "tool_choice": {"type": "function", "name": "ls"},
        "max_output_tokens": 99,
        "reasoning": {"effort": "low"},
        "text": {
            "format": {
                "type": "json_schema",
                "name": "out",
                "schema": {"type": "object"},
                "strict": True,
            }
        },
        "store": False,
        "include": ["reasoning.encrypted_content"],
        "top_k": 3,
    }
    call = _call("responses", body)
    b = call.body
    assert b["messages"] == [
        {"role": "system", "content": "be exact"},
        {"role": "system", "content": "no prose"},
        {"role": "user", "content": "run ls"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "call ls",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}},
                {"id": "c2", "type": "function", "function": {"name": "pwd", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "a.py"},
        {"role": "tool", "tool_call_id": "c2", "content": "/w"},
        {"role": "assistant", "content": "a.py in /w"},
        {"role": "user", "content": "thanks"},
    ]
    assert b["tools"] == [
        {
            "type": "function",
            "function": {"name": "ls", "parameters": {"type": "object"}, "strict": True},
        }
    ]
    assert b["tool_choice"] == {"type": "function", "function": {"name": "ls"}}
    assert b["max_tokens"] == 99 and b["reasoning_effort"] == "low" and b["top_k"] == 3
    assert b["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "out", "schema": {"type": "object"}, "strict": True},
    }
    for responses_only in ("store", "include", "input", "instructions", "text", "reasoning"):
        assert responses_only not in b
    assert call.messages_for_session == b["messages"]


# ---------------------------------------------------------------------------- property: tool ids

ids = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_", min_size=1, max_size=10)
texts = st.text(max_size=20)
tool_inputs = st.dictionaries(
    st.text(max_size=6),
    st.one_of(st.integers(), st.text(max_size=8), st.booleans(), st.none()),
    max_size=3,
)


@st.composite
def anthropic_conversations(draw: st.DrawFn) -> dict[str, Any]:
    """A valid agent conversation: assistant tool_use turns answered by tool_result turns."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": draw(texts)}]
    used: set[str] = set()
    for _ in range(draw(st.integers(0, 4))):
        blocks: list[dict[str, Any]] = []
        if draw(st.booleans()):
            blocks.append({"type": "thinking", "thinking": draw(texts), "signature": "s"})
        if draw(st.booleans()):
            blocks.append({"type": "text", "text": draw(texts)})
        calls = []
        for _ in range(draw(st.integers(0, 3))):
            call_id = draw(ids.filter(lambda i: i not in used))
            used.add(call_id)
            calls.append(call_id)
            blocks.append(
                {"type": "tool_use", "id": call_id, "name": draw(ids), "input": draw(tool_inputs)}
            )
        messages.append(
            {"role": "assistant", "content": blocks or [{"type": "text", "text": "ok"}]}
        )
        results: list[dict[str, Any]] = [
            {"type": "tool_result", "tool_use_id": c, "content": draw(texts)}
            for c in draw(st.permutations(calls))
        ]
        if draw(st.booleans()) or not results:
            results.append({"type": "text", "text": draw(texts)})
        messages.append({"role": "user", "content": results})
    body: dict[str, Any] = {"model": "beam", "max_tokens": 8, "messages": messages}
    if draw(st.booleans()):
        body["system"] = draw(texts)
    return body


@settings(max_examples=120, deadline=None)
@given(anthropic_conversations())
def test_every_tool_use_maps_to_a_call_whose_result_follows_it(body: dict[str, Any]) -> None:
    chat = _call("messages", body).body["messages"]
    uses = {
        b["id"]: b["input"]
        for m in body["messages"]
        if m["role"] == "assistant"
        for b in m["content"]
        if b["type"] == "tool_use"
    }
    open_calls: set[str] = set()
    seen_calls: dict[str, Any] = {}
    for msg in chat:
        if msg["role"] == "assistant":
            assert not open_calls, "a tool call was not answered before the next assistant turn"
            for call in msg.get("tool_calls", []):
                assert call["type"] == "function"
                seen_calls[call["id"]] = json.loads(call["function"]["arguments"])
                open_calls.add(call["id"])
        elif msg["role"] == "tool":
            assert msg["tool_call_id"] in open_calls, "tool result without a preceding call"
            open_calls.remove(msg["tool_call_id"])
        elif msg["role"] == "user":
            assert not open_calls, "user text came between a call and its result"
    assert seen_calls == uses
    assert not open_calls
    if "system" in body:
        assert chat[0] == {"role": "system", "content": body["system"]}


# ---------------------------------------------------------------------------- back to the client


def _upstream(
    message: dict[str, Any], finish: str = "stop", stop_reason: Any = None
) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": "w",
        "choices": [
            {"index": 0, "message": message, "finish_reason": finish, "stop_reason": stop_reason}
        ],
        "usage": {
            "prompt_tokens": 100,
            "completion_tokens": 9,
            "total_tokens": 109,
            "prompt_tokens_details": {"cached_tokens": 64},
            "completion_tokens_details": {"reasoning_tokens": 3},
        },
    }


def test_anthropic_message_from_a_chat_completion_validates_in_the_sdk() -> None:
    up = _upstream(
        {
            "role": "assistant",
            "reasoning": "think",
            "content": "Done.",
            "tool_calls": [
                {
                    "id": "call_9",
                    "type": "function",
                    "function": {"name": "ls", "arguments": '{"dir": "."}'},
                },
                {
                    "id": "call_10",
                    "type": "function",
                    "function": {"name": "bad", "arguments": "{oops"},
                },
            ],
        },
        finish="tool_calls",
    )
    msg = to_anthropic_message(up, model="beam", message_id="msg_1")
    sdk = anthropic.types.Message.model_validate(msg)
    assert [b.type for b in sdk.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert sdk.content[2].input == {"dir": "."}  # type: ignore[union-attr]
    assert sdk.content[3].input == {"_unparsed_arguments": "{oops"}  # type: ignore[union-attr]
    assert sdk.stop_reason == "tool_use"
    assert (sdk.usage.input_tokens, sdk.usage.cache_read_input_tokens, sdk.usage.output_tokens) == (
        36,
        64,
        9,
    )
    assert sdk.id == "msg_1" and sdk.model == "beam"
    assert to_anthropic_message(up, model="beam")["id"].startswith("msg_")


def test_stop_reasons_map_to_anthropic() -> None:
    assert anthropic_stop_reason("stop", None, (), False) == ("end_turn", None)
    assert anthropic_stop_reason("length", None, (), False) == ("max_tokens", None)
    assert anthropic_stop_reason("stop", "END", ("END",), False) == ("stop_sequence", "END")
    assert anthropic_stop_reason("stop", 128009, ("END",), False) == (
        "end_turn",
        None,
    )  # EOS token id
    assert anthropic_stop_reason("tool_calls", None, (), True) == ("tool_use", None)
    assert anthropic_stop_reason("stop", None, (), True) == ("tool_use", None)
    msg = to_anthropic_message(
        _upstream({"content": "x END"}, "stop", "END"), model="m", stop_sequences=["END"]
    )
    assert (msg["stop_reason"], msg["stop_sequence"]) == ("stop_sequence", "END")


def test_parse_tool_input_keeps_non_objects() -> None:
    assert parse_tool_input("") == {}
    assert parse_tool_input('{"a": [1]}') == {"a": [1]}
    assert parse_tool_input("[1]") == {"_unparsed_arguments": "[1]"}


def _responses_request(**extra: Any) -> ResponsesRequest:
    req = parse_request(
        "responses", json.dumps({"model": "beam", "input": "hi", **extra}).encode(), 1 << 20
    ).request
    assert isinstance(req, ResponsesRequest)
    return req


def test_responses_object_from_a_chat_completion_validates_in_the_sdk() -> None:
    req = _responses_request(
        tools=[{"type": "function", "name": "ls", "parameters": {"type": "object"}}],
        instructions="sys",
        max_output_tokens=50,
    )
    up = _upstream(
        {
            "role": "assistant",
            "reasoning_content": "plan",
            "content": "Listing.",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}
            ],
        },
        finish="tool_calls",
    )
    obj = to_responses_object(up, request=req, model="beam", response_id="resp_1", created_at=5.0)
    sdk = openai.types.responses.Response.model_validate(obj)
    assert sdk.id == "resp_1" and sdk.status == "completed" and sdk.object == "response"
    assert [o.type for o in sdk.output] == ["reasoning", "message", "function_call"]
    assert sdk.output_text == "Listing."
    call = sdk.output[2]
    assert call.type == "function_call" and call.call_id == "call_1" and call.name == "ls"
    assert sdk.usage is not None
    assert (sdk.usage.input_tokens, sdk.usage.output_tokens, sdk.usage.total_tokens) == (
        100,
        9,
        109,
    )
    assert sdk.usage.input_tokens_details.cached_tokens == 64
    assert sdk.usage.output_tokens_details.reasoning_tokens == 3
    assert sdk.instructions == "sys" and sdk.max_output_tokens == 50
    assert sdk.tools[0].name == "ls"  # type: ignore[union-attr]


def test_responses_object_at_the_token_limit_is_incomplete() -> None:
    obj = to_responses_object(
        _upstream({"content": "trunc"}, "length"), request=_responses_request(), model="m"
    )
    sdk = openai.types.responses.Response.model_validate(obj)
    assert sdk.status == "incomplete"
    assert (
        sdk.incomplete_details is not None and sdk.incomplete_details.reason == "max_output_tokens"
    )


def test_model_list_validates_as_openai_models() -> None:
    body = model_list(["beam", "beam-fast"], created=7)
    assert body["object"] == "list"
    models = [openai.types.Model.model_validate(m) for m in body["data"]]
    assert [m.id for m in models] == ["beam", "beam-fast"] and models[0].created == 7


def test_integers_beyond_64_bits_keep_every_digit() -> None:
    """orjson reads an integer outside 64 bits as a float; the parser must not lose digits
    (a tool call's id or a seed): found by the property test above."""
    big, neg = 2**64 + 1, -(2**63) - 1
    use = {"type": "tool_use", "id": "t", "name": "f", "input": {"a": big, "b": neg}}
    result = {"type": "tool_result", "tool_use_id": "t", "content": ""}
    body = {
        "model": "beam",
        "max_tokens": 8,
        "messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": [use]},
            {"role": "user", "content": [result]},
        ],
    }
    chat = _call("messages", body).body["messages"]
    (call,) = [c for m in chat if m["role"] == "assistant" for c in m.get("tool_calls", [])]
    assert json.loads(call["function"]["arguments"]) == {"a": big, "b": neg}
    chat_body = {"model": "beam", "messages": [{"role": "user", "content": "x"}], "seed": big}
    raw = parse_request("chat", json.dumps(chat_body).encode(), 1 << 20).raw
    assert raw["seed"] == big and isinstance(raw["seed"], int)
