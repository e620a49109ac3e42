"""Request validation at the front door: good bodies parse, bad ones are 4xx in the API's shape."""

from __future__ import annotations

import json
from typing import Any

import pytest
from beamserve.router.api.errors import APIError
from beamserve.router.api.models import (
    ApiName,
    ChatCompletionRequest,
    CompletionRequest,
    MessagesRequest,
    ResponsesRequest,
    parse_request,
)
from hypothesis import given, settings
from hypothesis import strategies as st

USER = [{"role": "user", "content": "hi"}]
GOOD: dict[ApiName, dict[str, Any]] = {
    "chat": {"model": "beam", "messages": USER},
    "completions": {"model": "beam", "prompt": "def f():"},
    "responses": {"model": "beam", "input": "hi"},
    "messages": {"model": "beam", "max_tokens": 16, "messages": USER},
}
APIS: list[ApiName] = ["chat", "completions", "responses", "messages"]


def _parse(api: ApiName, body: Any, max_bytes: int = 1 << 20) -> Any:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return parse_request(api, raw, max_bytes)


def _error(api: ApiName, body: Any, max_bytes: int = 1 << 20) -> APIError:
    with pytest.raises(APIError) as info:
        _parse(api, body, max_bytes)
    err = info.value
    expected = "anthropic" if api == "messages" else "openai"
    assert err.api == expected
    return err


def test_minimal_bodies_parse_to_their_models() -> None:
    kinds = {
        "chat": ChatCompletionRequest,
        "completions": CompletionRequest,
        "responses": ResponsesRequest,
        "messages": MessagesRequest,
    }
    for api in APIS:
        parsed = _parse(api, GOOD[api])
        assert isinstance(parsed.request, kinds[api])
        assert parsed.api == api and parsed.raw == GOOD[api]
        assert parsed.model == "beam" and parsed.stream is False


def test_full_chat_request_with_tools_and_extras() -> None:
    body = {
        "model": "beam",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "list files"}]},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "use ls",
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "a.py"},
        ],
        "tools": [
            {"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}
        ],
        "tool_choice": {"type": "function", "function": {"name": "ls"}},
        "response_format": {"type": "json_object"},
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "max_completion_tokens": 100,
        "temperature": 0,
        "top_p": 1,
        "stop": ["\n\n"],
        "n": 1,
        "seed": 7,
        "user": "u",
        "reasoning_effort": "high",
        "top_k": 20,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    req = _parse("chat", body).request
    assert isinstance(req, ChatCompletionRequest)
    assert req.output_limit == 100
    assert req.model_extra == {"top_k": 20, "chat_template_kwargs": {"enable_thinking": False}}


@pytest.mark.parametrize(
    ("api", "patch", "param", "words"),
    [
        (
            "chat",
            {"messages": [{"role": "usr", "content": "x"}]},
            "messages.0.role",
            "Input should be",
        ),
        ("chat", {"temperature": "0.5"}, "temperature", "valid number"),
        ("chat", {"temperature": 3}, "temperature", "less than or equal"),
        ("chat", {"stream": 1}, "stream", "boolean"),
        ("chat", {"n": 2}, "n", "only n=1"),
        ("chat", {"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
        ("chat", {"messages": []}, "messages", "at least 1"),
        (
            "chat",
            {"tools": [{"type": "function", "function": {}}]},
            "tools.0.function.name",
            "Field required",
        ),
        ("chat", {"tool_choice": {"type": "function"}}, "tool_choice.function", "Field required"),
        ("completions", {"prompt": ["a", "b"]}, "prompt", "one prompt per request"),
        ("completions", {"prompt": []}, "prompt", "must not be empty"),
        ("completions", {"n": 4}, "n", "only n=1"),
        (
            "responses",
            {"previous_response_id": "resp_1"},
            "previous_response_id",
            "not supported: send full input",
        ),
        (
            "responses",
            {"input": [{"type": "item_reference", "id": "x"}]},
            "input.0",
            "send full input",
        ),
        ("responses", {"input": [{"type": "web_search_call"}]}, "input.0", "not supported"),
        (
            "responses",
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            "input.0.content.0",
            "text-only",
        ),
        (
            "responses",
            {"input": [{"type": "function_call", "call_id": "c", "name": "f"}]},
            "input.0.arguments",
            "Field required",
        ),
        ("responses", {"tools": [{"type": "web_search"}]}, "tools.0.type", "'function'"),
        ("messages", {"max_tokens": None}, "max_tokens", "Field required"),
        ("messages", {"max_tokens": "9"}, "max_tokens", "valid integer"),
        (
            "messages",
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages.0.content.0",
            "image input is not supported",
        ),
        (
            "messages",
            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "messages.0.content.0.text",
            "Field required",
        ),
        (
            "messages",
            {"messages": [{"role": "system", "content": "x"}]},
            "messages.0.role",
            "'user' or 'assistant'",
        ),
        (
            "messages",
            {"tools": [{"type": "web_search_20250305", "name": "w"}]},
            "tools.0",
            "server tool",
        ),
        ("messages", {"tool_choice": {"type": "tool"}}, "tool_choice", "needs the tool's name"),
        ("messages", {"temperature": 1.5}, "temperature", "less than or equal to 1"),
    ],
)
def test_invalid_fields_are_named_in_the_error(
    api: ApiName, patch: dict[str, Any], param: str, words: str
) -> None:
    body = {**GOOD[api], **patch}
    body = {k: v for k, v in body.items() if v is not None}
    err = _error(api, body)
    assert err.status == 400
    assert err.param == param
    assert err.message.startswith(f"{param}: ")
    assert words in err.message
    shaped = err.body()
    if api == "messages":
        assert shaped["type"] == "error" and shaped["error"]["type"] == "invalid_request_error"
    else:
        assert shaped["error"]["param"] == param


@pytest.mark.parametrize("api", APIS)
def test_oversize_body_is_413_request_too_large(api: ApiName) -> None:
    raw = json.dumps(GOOD[api]).encode()
    err = _error(api, raw, max_bytes=len(raw) - 1)
    assert err.status == 413 and err.type == "request_too_large"
    assert str(len(raw) - 1) in err.message
    _parse(api, raw, max_bytes=len(raw))  # exactly at the limit is fine


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize(
    "raw",
    [b"", b"{", b"[1, 2]", b'"text"', b"null", b"\xff\xfe{}", b'{"a": NaN', b"[" * 100_000],
)
def test_malformed_bodies_are_400_in_the_api_shape(api: ApiName, raw: bytes) -> None:
    err = _error(api, raw)
    assert err.status == 400
    assert err.param is None


def test_lone_surrogates_are_rejected() -> None:
    raw = b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}'
    assert "surrogate" in _error("chat", raw).message
    ok = b'{"model": "m", "messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}'
    assert _parse("chat", ok).request.messages[0].content == "\U0001f600"


numbers = st.recursive(
    st.none()
    | st.integers()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.floats(min_value=1e18, max_value=1e22)
    | st.text(max_size=4),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=10,
)


@settings(max_examples=300, deadline=None)
@given(numbers)
def test_numbers_are_read_as_the_standard_parser_reads_them(value: Any) -> None:
    """Whichever parser reads a body, every number comes out as `json.loads` gives it, of the
    same type: an integer outside 64 bits stays an exact int, a float as large stays a float."""
    body = json.dumps({**GOOD["chat"], "metadata": value}).encode()
    raw = _parse("chat", body).raw
    want = json.loads(body)
    assert raw == want and repr(raw) == repr(want)


def test_content_shapes_normalise_in_anthropic_and_responses() -> None:
    msgs = _parse(
        "messages",
        {**GOOD["messages"], "system": "sys", "messages": [{"role": "user", "content": "x"}]},
    ).request
    assert msgs.system[0].text == "sys" and msgs.messages[0].content[0].text == "x"
    resp = _parse(
        "responses",
        {"model": "m", "input": [{"role": "user", "content": "hi"}], "instructions": "s"},
    ).request
    assert resp.input[0].content[0].text == "hi"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=12,
)


def _mutations(api: ApiName) -> st.SearchStrategy[dict[str, Any]]:
    """Good bodies with known fields replaced by arbitrary JSON, and junk fields added."""
    keys = st.sampled_from(
        [
            "model",
            "messages",
            "prompt",
            "input",
            "max_tokens",
            "stream",
            "tools",
            "tool_choice",
            "temperature",
            "system",
            "n",
            "stop",
            "stop_sequences",
            "instructions",
            "stream_options",
            "response_format",
            "text",
            "metadata",
            "previous_response_id",
            "junk",
        ]
    )
    return st.dictionaries(keys, json_values, max_size=4).map(lambda p: {**GOOD[api], **p})


@settings(max_examples=150, deadline=None)
@given(api=st.sampled_from(APIS), data=st.data())
def test_any_body_either_parses_or_is_a_4xx_api_error(api: ApiName, data: st.DataObject) -> None:
    body = data.draw(st.one_of(_mutations(api), json_values))
    try:
        parsed = _parse(api, body, max_bytes=4096)
    except APIError as err:
        assert 400 <= err.status < 500
        assert err.api == ("anthropic" if api == "messages" else "openai")
        assert err.message
    else:
        assert parsed.raw == body


@settings(max_examples=100, deadline=None)
@given(api=st.sampled_from(APIS), raw=st.binary(max_size=64))
def test_any_bytes_either_parse_or_raise_api_error(api: ApiName, raw: bytes) -> None:
    try:
        parse_request(api, raw, 32)
    except APIError as err:
        assert err.status in (400, 413)
