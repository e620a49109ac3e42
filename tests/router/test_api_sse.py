"""Streaming: the worker's SSE decoded in any chunking, re-emitted in each client API's events,
accepted by the official SDKs (event models and their stream accumulators)."""

from __future__ import annotations

import importlib.util
import itertools
import json
import sys
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from beamserve.router.api.errors import overloaded, upstream_failed
from beamserve.router.api.models import ResponsesRequest, parse_request
from beamserve.router.api.sse import (
    DONE_FRAME,
    AnthropicStream,
    OpenAIPassthrough,
    ResponsesStream,
    SSEScanner,
    UpstreamSSEDecoder,
    UpstreamStreamError,
    error_event,
    sse_frame,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

_path = Path(__file__).resolve().parent / "_api_worker.py"
_spec = importlib.util.spec_from_file_location("_api_worker", _path)
assert _spec is not None and _spec.loader is not None
w = sys.modules.setdefault("_api_worker", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(w)

ANTHROPIC_EVENT = TypeAdapter(RawMessageStreamEvent)
RESPONSES_EVENT = TypeAdapter(ResponseStreamEvent)
USER = [{"role": "user", "content": "hi"}]

# ---------------------------------------------------------------------------- strategies

pieces = st.lists(st.text(min_size=1, max_size=6), max_size=4).map(tuple)
names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=8)
arg_objects = st.dictionaries(
    st.text(max_size=5), st.one_of(st.integers(), st.text(max_size=6), st.booleans()), max_size=3
)


@st.composite
def tool_scripts(draw: st.DrawFn, index: int) -> Any:
    text = json.dumps(draw(arg_objects), ensure_ascii=False)
    cuts = sorted(draw(st.sets(st.integers(0, len(text)), max_size=3)) | {0, len(text)})
    parts = tuple(text[a:b] for a, b in itertools.pairwise(cuts) if b > a)
    return w.ToolCallScript(f"call_{index}", draw(names), parts)


@st.composite
def worker_scripts(draw: st.DrawFn) -> Any:
    n_tools = draw(st.integers(0, 2))
    tools = tuple(draw(tool_scripts(i)) for i in range(n_tools))
    finish = "tool_calls" if tools else draw(st.sampled_from(["stop", "length"]))
    prompt = draw(st.integers(1, 5000))
    return w.WorkerScript(
        reasoning=draw(pieces),
        text=draw(pieces),
        tools=tools,
        finish_reason=finish,
        prompt_tokens=prompt,
        cached_tokens=draw(st.integers(0, prompt)),
        completion_tokens=draw(st.integers(0, 500)),
        reasoning_key=draw(st.sampled_from(["reasoning", "reasoning_content"])),
    )


splits = st.lists(st.floats(0, 1), max_size=6)


# ---------------------------------------------------------------------------- upstream decoder


@settings(max_examples=100, deadline=None)
@given(
    script=worker_scripts(), cuts=st.lists(st.integers(0, 4000), max_size=12), crlf=st.booleans()
)
def test_decoder_yields_the_same_chunks_for_any_chunking(
    script: Any, cuts: list[int], crlf: bool
) -> None:
    wire = script.wire()
    if crlf:
        wire = wire.replace(b"\n", b"\r\n")
    points = sorted({c % (len(wire) + 1) for c in cuts} | {0, len(wire)})
    decoder = UpstreamSSEDecoder()
    got: list[dict[str, Any]] = []
    for a, b in itertools.pairwise(points):
        got += decoder.feed(wire[a:b])
    got += decoder.close()
    assert got == script.chunks()
    assert decoder.done


def test_decoder_handles_comments_events_multiline_data_and_a_missing_final_blank_line() -> None:
    d = UpstreamSSEDecoder()
    out = d.feed(b': keepalive\n\nevent: x\nid: 3\ndata: {"a":\ndata: 1}\n\nretry: 5\r')
    assert out == [{"a": 1}]
    assert d.feed(b'\ndata: {"b": 2}') == []
    assert d.close() == [{"b": 2}]
    assert not d.done
    assert UpstreamSSEDecoder().feed(b"data:[DONE]\n\n") == []


def test_decoder_rejects_non_json_data() -> None:
    with pytest.raises(UpstreamStreamError, match="non-JSON"):
        UpstreamSSEDecoder().feed(b"data: hello\n\n")
    with pytest.raises(UpstreamStreamError, match="non-object"):
        UpstreamSSEDecoder().feed(b"data: [1]\n\n")


# ---------------------------------------------------------------------------- Anthropic


def _expected_blocks(script: Any) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    if script.reasoning:
        out.append(("thinking", "".join(script.reasoning)))
    if script.text:
        out.append(("text", "".join(script.text)))
    out += [("tool_use", (t.call_id, t.name, json.loads(t.arguments))) for t in script.tools]
    return out


def _anthropic_blocks(message: Any) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for b in message.content:
        if b.type == "thinking":
            out.append(("thinking", b.thinking))
        elif b.type == "text":
            out.append(("text", b.text))
        else:
            out.append(("tool_use", (b.id, b.name, b.input)))
    return out


@settings(max_examples=60, deadline=None)
@given(script=worker_scripts(), cuts=splits)
def test_anthropic_stream_is_accepted_by_the_sdk(script: Any, cuts: list[float]) -> None:
    door = w.FrontDoor(script, splits=cuts)
    client = w.anthropic_client(door.handle)
    with client.messages.stream(model="beam", max_tokens=64, messages=USER) as stream:
        final = stream.get_final_message()
    events = w.parse_frames(b"".join(door.frames))
    # every frame is a known event with matching `event:` name; all but pings validate
    for name, data in events:
        payload = json.loads(data)
        assert name == payload["type"]
        if name != "ping":
            ANTHROPIC_EVENT.validate_python(payload)
    kinds = [n for n, _ in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert (
        kinds.count("content_block_start")
        == kinds.count("content_block_stop")
        == len(_expected_blocks(script))
    )
    assert _anthropic_blocks(final) == _expected_blocks(script)
    expected_stop = {"tool_calls": "tool_use", "stop": "end_turn", "length": "max_tokens"}[
        script.finish_reason
    ]
    assert final.stop_reason == expected_stop
    assert final.usage.input_tokens == script.prompt_tokens - script.cached_tokens
    assert final.usage.cache_read_input_tokens == script.cached_tokens
    assert final.usage.output_tokens == script.completion_tokens
    Message.model_validate(final.model_dump())


def test_anthropic_stream_reports_the_matched_stop_sequence() -> None:
    script = w.WorkerScript(text=("a",), matched_stop="END")
    door = w.FrontDoor(script)
    client = w.anthropic_client(door.handle)
    with client.messages.stream(
        model="m", max_tokens=4, messages=USER, stop_sequences=["END"]
    ) as s:
        final = s.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "END")
    assert door.upstream_bodies[0]["stop"] == ["END"]


def test_anthropic_stream_failure_raises_in_the_sdk() -> None:
    door = w.FrontDoor(w.WorkerScript(text=("partial",)), worker_done=False)
    client = w.anthropic_client(door.handle)
    with (
        pytest.raises(anthropic.APIStatusError) as info,
        client.messages.stream(model="m", max_tokens=4, messages=USER) as s,
    ):
        s.get_final_message()
    assert "upstream worker failed" in str(info.value)
    assert w.parse_frames(b"".join(door.frames))[-1][0] == "error"


def test_anthropic_error_event_and_worker_error_chunk() -> None:
    frame = error_event("messages", overloaded(1))
    name, data = w.parse_frames(frame)[0]
    assert name == "error"
    assert json.loads(data) == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": overloaded(1).message},
    }
    stream = AnthropicStream(model="m")
    frames = stream.feed(
        {"error": {"message": "engine died", "type": "InternalServerError", "code": 500}}
    )
    assert [n for n, _ in w.parse_frames(b"".join(frames))] == ["message_start", "ping", "error"]
    assert stream.finish() == [] and stream.feed({"choices": []}) == []


def test_anthropic_stream_with_no_chunks_still_forms_a_message() -> None:
    stream = AnthropicStream(model="m", ping=False, input_tokens=5)
    names = [n for n, _ in w.parse_frames(b"".join(stream.finish()))]
    assert names == ["message_start", "message_delta", "message_stop"]
    start = json.loads(
        w.parse_frames(b"".join(AnthropicStream(model="m", input_tokens=5).feed({})))[0][1]
    )
    assert start["message"]["usage"]["input_tokens"] == 5


# ---------------------------------------------------------------------------- Responses


def _responses_request(**extra: Any) -> ResponsesRequest:
    body = json.dumps({"model": "beam", "input": "hi", "stream": True, **extra}).encode()
    req = parse_request("responses", body, 1 << 20).request
    assert isinstance(req, ResponsesRequest)
    return req


@settings(max_examples=60, deadline=None)
@given(script=worker_scripts(), cuts=splits)
def test_responses_stream_is_accepted_by_the_sdk(script: Any, cuts: list[float]) -> None:
    door = w.FrontDoor(script, splits=cuts)
    client = w.openai_client(door.handle)
    with client.responses.stream(model="beam", input="hi") as stream:
        seen = list(stream)
        if script.finish_reason == "length":
            # the SDK's helper only finalises on response.completed; incomplete ends differently
            assert seen[-1].type == "response.incomplete"
            final: Any = seen[-1].response
        else:
            final = stream.get_final_response()
    events = [json.loads(d) for _, d in w.parse_frames(b"".join(door.frames))]
    for name_data, payload in zip(w.parse_frames(b"".join(door.frames)), events, strict=True):
        assert name_data[0] == payload["type"]
        RESPONSES_EVENT.validate_python(payload)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created" and events[1]["type"] == "response.in_progress"
    last = "response.incomplete" if script.finish_reason == "length" else "response.completed"
    assert events[-1]["type"] == last
    expected: list[tuple[str, Any]] = []
    if script.reasoning:
        expected.append(("reasoning", "".join(script.reasoning)))
    if script.text:
        expected.append(("message", "".join(script.text)))
    expected += [("function_call", (t.call_id, t.name, t.arguments)) for t in script.tools]
    got: list[tuple[str, Any]] = []
    for item in final.output:
        if item.type == "reasoning":
            got.append(("reasoning", "".join(c.text for c in item.content or [])))
        elif item.type == "message":
            got.append(
                ("message", "".join(c.text for c in item.content if c.type == "output_text"))
            )
        elif item.type == "function_call":
            got.append(("function_call", (item.call_id, item.name, item.arguments)))
    assert got == expected
    assert final.usage is not None
    assert final.usage.input_tokens == script.prompt_tokens
    assert final.usage.input_tokens_details.cached_tokens == script.cached_tokens
    Response.model_validate(final.model_dump())


def test_responses_stream_failure_emits_error_then_failed() -> None:
    stream = ResponsesStream(request=_responses_request(), model="m")
    frames = stream.feed(w.WorkerScript(text=("x",)).chunks()[1])
    frames += stream.fail(upstream_failed("connection reset"))
    events = [json.loads(d) for _, d in w.parse_frames(b"".join(frames))]
    for e in events:
        RESPONSES_EVENT.validate_python(e)
    assert [e["type"] for e in events][-2:] == ["error", "response.failed"]
    assert events[-2]["code"] == "server_error" and "connection reset" in events[-2]["message"]
    assert events[-1]["response"]["status"] == "failed"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_responses_stream_failure_surfaces_in_the_sdk() -> None:
    door = w.FrontDoor(w.WorkerScript(text=("x",)), worker_done=False)
    client = w.openai_client(door.handle)
    with client.responses.stream(model="m", input="hi") as stream:
        types = [event.type for event in stream]
    assert types[-2:] == ["error", "response.failed"]


# ---------------------------------------------------------------------------- OpenAI passthrough


@settings(max_examples=40, deadline=None)
@given(script=worker_scripts(), include_usage=st.booleans(), cuts=splits)
def test_chat_stream_passthrough_reaches_the_sdk_intact(
    script: Any, include_usage: bool, cuts: list[float]
) -> None:
    door = w.FrontDoor(script, splits=cuts)
    client = w.openai_client(door.handle)
    kwargs: dict[str, Any] = {"stream_options": {"include_usage": True}} if include_usage else {}
    chunks = list(
        client.chat.completions.create(model="beam", messages=USER, stream=True, **kwargs)
    )
    assert all(c.model == "beam" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "".join(script.text)
    usage = [c.usage for c in chunks if c.usage is not None]
    if include_usage:
        assert len(usage) == 1 and usage[0].prompt_tokens == script.prompt_tokens
    else:
        assert usage == []
    assert door.upstream_bodies[0]["stream_options"]["include_usage"] is True
    assert door.frames[-1] == b"data: [DONE]\n\n"


def test_chat_stream_failure_raises_in_the_openai_sdk() -> None:
    door = w.FrontDoor(w.WorkerScript(text=("x",)), worker_done=False)
    client = w.openai_client(door.handle)
    with pytest.raises(openai.APIError, match="upstream worker failed"):
        list(client.chat.completions.create(model="m", messages=USER, stream=True))


def test_passthrough_tracks_usage_even_when_the_client_did_not_ask() -> None:
    script = w.WorkerScript(text=("a",))
    p = OpenAIPassthrough(model=None, include_usage=False)
    frames = [f for c in script.chunks() for f in p.feed(c)]
    assert p.usage == script.usage() and p.finish_reason == "stop"
    assert all(b'"usage"' not in f for f in frames)
    assert json.loads(frames[0][6:])["model"] == "w"  # model left as the worker's
    assert p.fail(upstream_failed("x")) == [
        error_event("chat", upstream_failed("x")),
        b"data: [DONE]\n\n",
    ]
    assert p.finish() == []


def test_completions_stream_passthrough() -> None:
    door = w.FrontDoor(w.WorkerScript(text=("a",)))
    client = w.openai_client(door.handle)
    chunks = list(client.completions.create(model="beam", prompt="x", stream=True))
    assert chunks and all(c.model == "beam" for c in chunks)
    assert door.upstream_bodies[0]["prompt"] == "x"


# --- byte passthrough ---------------------------------------------------------------------------

_TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=8)


def _worker_stream(texts: list[str], usage: bool, error: bool) -> bytes:
    base = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "beam"}
    frames = [sse_frame({**base, "choices": [{"index": 0, "delta": {"role": "assistant"}}]})]
    for t in texts:
        frames.append(sse_frame({**base, "choices": [{"index": 0, "delta": {"content": t}}]}))
    if error:
        frames.append(sse_frame({"error": {"message": "engine failed", "code": 500}}))
        return b"".join(frames)
    if usage:
        frames.append(sse_frame({**base, "choices": [], "usage": {"completion_tokens": 7}}))
    frames.append(DONE_FRAME)
    return b"".join(frames)


@given(
    texts=st.lists(_TEXT, max_size=6),
    usage=st.booleans(),
    error=st.booleans(),
    strip=st.booleans(),
    cuts=st.lists(st.integers(0, 4000), max_size=8),
)
def test_scanner_forwards_the_bytes_and_sees_the_end(
    texts: list[str], usage: bool, error: bool, strip: bool, cuts: list[int]
) -> None:
    """Any split of a worker's stream: unchanged bytes out (usage events dropped only when
    stripping), `[DONE]`, usage and error events noticed — the same events the decoding
    passthrough would have sent."""
    body = _worker_stream(texts, usage, error)
    scanner = SSEScanner(strip_usage=strip)
    bounds = sorted({0, len(body), *(c for c in cuts if c < len(body))})
    out = b"".join(scanner.feed(body[a:b]) for a, b in itertools.pairwise(bounds))
    out += scanner.flush()
    assert scanner.done is not error
    assert (scanner.error is not None) is error
    assert scanner.usage == ({"completion_tokens": 7} if usage and not error else None)
    if not strip:
        assert out == body
    events = UpstreamSSEDecoder().feed(body)
    if strip:
        events = [e for e in events if e.get("choices") or "usage" not in e]
    again = UpstreamSSEDecoder()
    assert again.feed(out) == events
    assert again.done is not error
