"""Streaming: decode the worker's OpenAI SSE, re-emit it in the client API's event format.

Upstream (worker) side: `UpstreamSSEDecoder.feed(bytes)` takes the response body in arbitrary
pieces and returns the decoded `data:` JSON objects (chat/completion chunks); it sets `done` on
`data: [DONE]`. Lines may end in `\\n`, `\\r\\n` or `\\r`; comments (`:`) and `event:`/`id:`
fields are ignored; a multi-line `data` is joined with `\\n`. A `data` that is not JSON raises
`UpstreamStreamError`.

Client side: one translator per stream, fed every decoded chunk in order, then `finish()` once
the worker sent `[DONE]` — or `fail(error)` when the worker broke off (an error chunk
`{"error": …}` from the worker is turned into `fail` automatically). Each call returns the SSE
frames (bytes) to write. After `finish`/`fail`, further calls return nothing.

- `OpenAIPassthrough` (chat, completions): `data: <chunk>` … `data: [DONE]`; the usage-only
  chunk only if the client asked for it; `model` rewritten to the client's name.
- Byte passthrough (`SSEScanner`): when the client speaks the worker's API, asked for usage and
  named the worker's model, the worker's bytes go to the client untouched; the scanner only
  watches them — `[DONE]`, an error event, the usage chunk (the only events it decodes).
- `AnthropicStream` (messages): `event: message_start` (+ `ping`), then per thinking / text /
  tool_use block `content_block_start`, `content_block_delta` (`thinking_delta`, `text_delta`,
  `input_json_delta`), `content_block_stop`; then `message_delta` (stop_reason, usage) and
  `message_stop`.
- `ResponsesStream` (responses): `response.created`, `response.in_progress`; per output item
  `response.output_item.added`, `response.content_part.added`, `response.reasoning_text.delta`
  / `response.output_text.delta` (or `response.function_call_arguments.delta`), the matching
  `.done` events, `response.output_item.done`; then `response.completed` (or
  `response.incomplete` at the token limit). Every event carries `sequence_number` (0, 1, …).

Mid-stream failures (`error_event`): OpenAI chat/completions `data: {"error": {...}}`;
Anthropic `event: error` with the Anthropic error body; Responses `event: error`
(`{"type": "error", "code", "message", "param", "sequence_number"}`) then `response.failed`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from beamserve.router.api.convert import (
    anthropic_stop_reason,
    anthropic_usage,
    function_call_item,
    message_item,
    new_id,
    output_text_part,
    reasoning_item,
    reasoning_of,
    responses_envelope,
    responses_usage,
)
from beamserve.router.api.errors import APIError, upstream_failed
from beamserve.router.api.models import ApiName, ResponsesRequest

Chunk = Mapping[str, Any]


def _json(data: Any) -> str:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


def sse_frame(data: Any, event: str | None = None) -> bytes:
    """One SSE event: optional `event:` line, one `data:` line (JSON unless `data` is a str)."""
    payload = data if isinstance(data, str) else _json(data)
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n".encode()


DONE_FRAME = b"data: [DONE]\n\n"
ANTHROPIC_PING = sse_frame({"type": "ping"}, "ping")


class UpstreamStreamError(ValueError):
    """The worker's stream broke the SSE/JSON protocol."""


@dataclass
class UpstreamSSEDecoder:
    """Incremental decoder for a worker's `text/event-stream` body (see module docstring)."""

    done: bool = False
    _buffer: bytes = b""
    _data: list[str] = field(default_factory=list)

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        """Decode the complete events in `data` (plus what earlier calls left over)."""
        self._buffer += data
        out: list[dict[str, Any]] = []
        while True:
            cut, skip = self._line_end()
            if cut < 0:
                break
            line = self._buffer[:cut]
            self._buffer = self._buffer[cut + skip :]
            self._line(line, out)
        return out

    def close(self) -> list[dict[str, Any]]:
        """End of body: dispatch a last event that lacked its blank line."""
        out: list[dict[str, Any]] = []
        if self._buffer:
            self._line(self._buffer, out)
            self._buffer = b""
        self._dispatch(out)
        return out

    def _line_end(self) -> tuple[int, int]:
        buf = self._buffer
        n, r = buf.find(b"\n"), buf.find(b"\r")
        if r < 0:
            return n, 1
        if r == len(buf) - 1:  # a lone trailing \r may be the first half of \r\n
            return (n, 1) if 0 <= n < r else (-1, 0)
        if 0 <= n < r:
            return n, 1
        return r, 2 if buf[r + 1 : r + 2] == b"\n" else 1

    def _line(self, raw: bytes, out: list[dict[str, Any]]) -> None:
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise UpstreamStreamError(f"worker stream is not UTF-8: {exc}") from None
        if line == "":
            self._dispatch(out)
        elif line.startswith(":"):
            return
        else:
            name, _, value = line.partition(":")
            if value.startswith(" "):
                value = value[1:]
            if name == "data":
                self._data.append(value)

    def _dispatch(self, out: list[dict[str, Any]]) -> None:
        if not self._data:
            return
        payload = "\n".join(self._data)
        self._data = []
        if payload.strip() == "[DONE]":
            self.done = True
            return
        try:
            value = json.loads(payload)
        except json.JSONDecodeError as exc:
            raise UpstreamStreamError(
                f"worker sent a non-JSON event: {payload[:200]!r} ({exc})"
            ) from None
        if not isinstance(value, dict):
            raise UpstreamStreamError(f"worker sent a non-object event: {payload[:200]!r}")
        out.append(value)


@dataclass
class SSEScanner:
    """Watches an OpenAI SSE byte stream forwarded to the client (see module docstring).

    `feed(data) -> bytes` takes the body in arbitrary pieces and returns what to forward: the
    complete lines received so far, unchanged — except, with `strip_usage` (the client did not
    ask for usage; the router always asks the worker), usage-only events are dropped and
    `usage` fields removed. `done` is set by `data: [DONE]`, `usage` by the usage chunk,
    `error` by an error event (its message), `events` counts the `data:` events seen (about
    one per token: the pace hold's count, `beamserve.router.flow.pace_hold`). Only `data:`
    lines that mention `"usage"` with a value or `"error"` are decoded, so the cost per token
    is a few byte searches."""

    strip_usage: bool = False
    done: bool = False
    usage: dict[str, Any] | None = None
    error: str | None = None
    events: int = 0
    _tail: bytes = b""

    def feed(self, data: bytes) -> bytes:
        buf = self._tail + data if self._tail else data
        if buf.endswith(b"\n"):  # the usual case: whole events, nothing to keep back
            self._tail, head = b"", buf
        else:
            cut = buf.rfind(b"\n")
            if cut < 0:
                self._tail = buf
                return b""
            self._tail = buf[cut + 1 :]
            head = buf[: cut + 1]
        # `head` starts at a line's start: every event's `data:` opens a line, and JSON text
        # escapes its newlines, so this counts events, not text that mentions "data:"
        self.events += head.count(b"\ndata:") + head.startswith(b"data:")
        if b'"usage"' not in head and b'"error"' not in head and b"[DONE]" not in head:
            return head
        out: list[bytes] = []
        skip_blank = False
        for line in head.splitlines(keepends=True):
            if skip_blank and line.strip() == b"":
                skip_blank = False
                continue
            skip_blank = False
            if line.startswith(b"data:"):
                kept = self._line(line)
                if kept is None:
                    skip_blank = True  # the event's blank line goes with it
                    continue
                line = kept
            out.append(line)
        return b"".join(out)

    def flush(self) -> bytes:
        """What is left at the end of the body (a last line without its newline)."""
        tail, self._tail = self._tail, b""
        return self.feed(tail + b"\n")[:-1] if tail else b""

    def _line(self, line: bytes) -> bytes | None:
        payload = line[5:].strip()
        if payload == b"[DONE]":
            self.done = True
            return line
        if b'"error"' not in payload and (
            b'"usage"' not in payload or b'"usage":null' in payload or b'"usage": null' in payload
        ):
            return line
        try:
            value = json.loads(payload)
        except ValueError as exc:
            raise UpstreamStreamError(f"worker sent a non-JSON event: {payload[:200]!r}") from exc
        if not isinstance(value, dict):
            return line
        if (err := _upstream_error(value)) is not None:
            self.error = err.message
        if not isinstance(value.get("usage"), Mapping):
            return line
        self.usage = dict(value["usage"])
        if not self.strip_usage:
            return line
        if not value.get("choices"):
            return None
        value.pop("usage")
        return sse_frame(value)[:-1]  # one newline: the event's blank line follows


def raw_passthrough_ok(api: ApiName, *, client_model: str | None, worker_model: Any) -> bool:
    """Whether the worker's SSE bytes can go to the client as they are: an OpenAI API (the
    worker's own) and the same model name."""
    return api in ("chat", "completions") and (client_model is None or client_model == worker_model)


class StreamTranslator(Protocol):
    """Turns a worker's chat/completion chunks into one client API's SSE frames."""

    @property
    def usage(self) -> dict[str, Any] | None:
        """The worker's (OpenAI-shaped) usage, once seen."""
        ...

    def feed(self, chunk: Chunk) -> list[bytes]: ...

    def finish(self) -> list[bytes]: ...

    def fail(self, error: APIError) -> list[bytes]: ...


def _responses_error_code(error: APIError) -> str:
    return "rate_limit_exceeded" if error.type == "rate_limit_error" else "server_error"


def error_event(api: ApiName, error: APIError, sequence_number: int = 0) -> bytes:
    """One SSE frame reporting a mid-stream failure in `api`'s own format."""
    if api == "messages":
        return sse_frame(error.for_api("anthropic").body(), "error")
    if api == "responses":
        body = {
            "type": "error",
            "code": _responses_error_code(error),
            "message": error.message,
            "param": error.param,
            "sequence_number": sequence_number,
        }
        return sse_frame(body, "error")
    return sse_frame(error.for_api("openai").body())


def _upstream_error(chunk: Chunk) -> APIError | None:
    err = chunk.get("error")
    if err is None:
        return None
    message = err.get("message") if isinstance(err, Mapping) else str(err)
    return upstream_failed(str(message or "error event in the stream"))


def _begin_chunk(
    t: AnthropicStream | ResponsesStream, chunk: Chunk
) -> tuple[list[bytes], Mapping[str, Any] | None]:
    """The prologue both translating streams share: the opening frames, a worker's error
    chunk turned into the API's failure frames, usage noted; then the chunk's first choice
    (None: nothing more to translate)."""
    frames = t._start()
    if (err := _upstream_error(chunk)) is not None:
        return frames + t.fail(err), None
    if isinstance(chunk.get("usage"), Mapping):
        t.usage = dict(chunk["usage"])
    return frames, _first_choice(chunk)


def _first_choice(chunk: Chunk) -> Mapping[str, Any] | None:
    for choice in chunk.get("choices") or ():
        if isinstance(choice, Mapping) and choice.get("index", 0) == 0:
            return choice
    return None


# --------------------------------------------------------------------------- OpenAI


@dataclass
class OpenAIPassthrough:
    """Chat/completions chunks to an OpenAI client, nearly as the worker sent them.

    `model`: the name to report (None: leave the worker's). `include_usage`: the client asked
    for `stream_options.include_usage` (the router always asks the worker; without the client's
    request the usage-only chunk and `usage` fields are removed). `api` picks the error format.
    """

    model: str | None = None
    include_usage: bool = False
    api: ApiName = "chat"
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    closed: bool = False

    def feed(self, chunk: Chunk) -> list[bytes]:
        if self.closed:
            return []
        if (err := _upstream_error(chunk)) is not None:
            return self.fail(err)
        out = dict(chunk)
        if isinstance(out.get("usage"), Mapping):
            self.usage = dict(out["usage"])
        choice = _first_choice(out)
        if choice is not None and choice.get("finish_reason"):
            self.finish_reason = str(choice["finish_reason"])
        if not self.include_usage:
            if not out.get("choices") and "usage" in out:
                return []
            out.pop("usage", None)
        if self.model is not None and "model" in out:
            out["model"] = self.model
        return [sse_frame(out)]

    def finish(self) -> list[bytes]:
        if self.closed:
            return []
        self.closed = True
        return [DONE_FRAME]

    def fail(self, error: APIError) -> list[bytes]:
        if self.closed:
            return []
        self.closed = True
        return [error_event(self.api, error), DONE_FRAME]


# --------------------------------------------------------------------------- Anthropic

BlockKind = Literal["thinking", "text", "tool_use"]


@dataclass
class AnthropicStream:
    """Chat chunks to Anthropic Messages stream events.

    `model`: reported model name. `stop_sequences`: the client's, to report which one matched.
    `input_tokens`: the prompt's token count if the router knows it before the worker answers
    (message_start carries it; the final message_delta carries the worker's counts anyway).
    `ping`: send a `ping` event after message_start, as Anthropic does.
    """

    model: str
    stop_sequences: Sequence[str] = ()
    message_id: str = field(default_factory=lambda: new_id("msg"))
    input_tokens: int | None = None
    ping: bool = True
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    closed: bool = False
    _started: bool = False
    _index: int = -1
    _open: BlockKind | None = None
    _tool_blocks: dict[int, int] = field(default_factory=dict)
    _matched_stop: Any = None

    def _frame(self, event: dict[str, Any]) -> bytes:
        return sse_frame(event, str(event["type"]))

    def _start(self) -> list[bytes]:
        if self._started:
            return []
        self._started = True
        message: dict[str, Any] = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.input_tokens or 0, "output_tokens": 0},
        }
        frames = [self._frame({"type": "message_start", "message": message})]
        if self.ping:
            frames.append(ANTHROPIC_PING)
        return frames

    def _close_block(self) -> list[bytes]:
        if self._open is None:
            return []
        self._open = None
        return [self._frame({"type": "content_block_stop", "index": self._index})]

    def _open_block(self, kind: BlockKind, block: dict[str, Any]) -> list[bytes]:
        frames = self._close_block()
        self._index += 1
        self._open = kind
        frames.append(
            self._frame(
                {"type": "content_block_start", "index": self._index, "content_block": block}
            )
        )
        return frames

    def _delta(self, index: int, delta: dict[str, Any]) -> bytes:
        return self._frame({"type": "content_block_delta", "index": index, "delta": delta})

    def feed(self, chunk: Chunk) -> list[bytes]:
        if self.closed:
            return []
        frames, choice = _begin_chunk(self, chunk)
        if choice is None:
            return frames
        delta = choice.get("delta") or {}
        reasoning = reasoning_of(delta)
        if reasoning:
            if self._open != "thinking":
                frames += self._open_block(
                    "thinking", {"type": "thinking", "thinking": "", "signature": ""}
                )
            frames.append(
                self._delta(self._index, {"type": "thinking_delta", "thinking": reasoning})
            )
        text = delta.get("content")
        if isinstance(text, str) and text:
            if self._open != "text":
                frames += self._open_block("text", {"type": "text", "text": ""})
            frames.append(self._delta(self._index, {"type": "text_delta", "text": text}))
        for call in delta.get("tool_calls") or ():
            position = int(call.get("index", 0))
            fn = call.get("function") or {}
            if position not in self._tool_blocks:
                block: dict[str, Any] = {
                    "type": "tool_use",
                    "id": call.get("id") or new_id("toolu"),
                    "name": fn.get("name") or "",
                    "input": {},
                }
                frames += self._open_block("tool_use", block)
                self._tool_blocks[position] = self._index
            arguments = fn.get("arguments")
            if arguments:
                frames.append(
                    self._delta(
                        self._tool_blocks[position],
                        {"type": "input_json_delta", "partial_json": arguments},
                    )
                )
        if choice.get("finish_reason"):
            self.finish_reason = str(choice["finish_reason"])
            self._matched_stop = choice.get("stop_reason")
        return frames

    def finish(self) -> list[bytes]:
        if self.closed:
            return []
        frames = self._start() + self._close_block()
        self.closed = True
        stop_reason, stop_sequence = anthropic_stop_reason(
            self.finish_reason, self._matched_stop, self.stop_sequences, bool(self._tool_blocks)
        )
        usage = anthropic_usage(self.usage)
        delta_usage: dict[str, int] = {"output_tokens": usage["output_tokens"]}
        if self.usage is not None:
            delta_usage["input_tokens"] = usage["input_tokens"]
            delta_usage["cache_read_input_tokens"] = usage["cache_read_input_tokens"]
        frames.append(
            self._frame(
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                    "usage": delta_usage,
                }
            )
        )
        frames.append(self._frame({"type": "message_stop"}))
        return frames

    def fail(self, error: APIError) -> list[bytes]:
        if self.closed:
            return []
        self.closed = True
        return [error_event("messages", error)]


# --------------------------------------------------------------------------- Responses

ItemKind = Literal["reasoning", "message", "function_call"]


@dataclass
class _Item:
    kind: ItemKind
    id: str
    output_index: int
    text: str = ""
    call_id: str = ""
    name: str = ""

    def done(self) -> dict[str, Any]:
        if self.kind == "reasoning":
            return reasoning_item(self.id, self.text)
        if self.kind == "message":
            return message_item(self.id, self.text)
        return function_call_item(self.id, self.call_id, self.name, self.text)


@dataclass
class ResponsesStream:
    """Chat chunks to Responses API stream events (see module docstring).

    `request`: the client's request (echoed in the response envelope). `model`: reported model.
    """

    request: ResponsesRequest
    model: str
    response_id: str = field(default_factory=lambda: new_id("resp"))
    created_at: float = field(default_factory=time.time)
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    closed: bool = False
    _seq: int = 0
    _started: bool = False
    _items: list[_Item] = field(default_factory=list)
    _open: _Item | None = None
    _calls: dict[int, _Item] = field(default_factory=dict)

    def _frame(self, event: dict[str, Any]) -> bytes:
        event["sequence_number"] = self._seq
        self._seq += 1
        return sse_frame(event, str(event["type"]))

    def _envelope(self, status: str, **extra: Any) -> dict[str, Any]:
        return responses_envelope(
            self.request,
            model=self.model,
            response_id=self.response_id,
            created_at=self.created_at,
            status=status,
            **extra,
        )

    def _start(self) -> list[bytes]:
        if self._started:
            return []
        self._started = True
        return [
            self._frame(
                {"type": "response.created", "response": self._envelope("in_progress", output=[])}
            ),
            self._frame(
                {
                    "type": "response.in_progress",
                    "response": self._envelope("in_progress", output=[]),
                }
            ),
        ]

    def _open_item(self, kind: ItemKind, **fields: str) -> list[bytes]:
        frames = self._close_item()
        prefix = {"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind]
        item = _Item(kind, new_id(prefix), len(self._items), **fields)
        self._items.append(item)
        self._open = item
        where = {"output_index": item.output_index}
        if kind == "reasoning":
            added = {
                "id": item.id,
                "type": "reasoning",
                "summary": [],
                "content": [],
                "status": "in_progress",
            }
            part: dict[str, Any] | None = {"type": "reasoning_text", "text": ""}
        elif kind == "message":
            added = message_item(item.id, None, status="in_progress")
            part = output_text_part("")
        else:
            added = function_call_item(item.id, item.call_id, item.name, "", status="in_progress")
            part = None
        frames.append(self._frame({"type": "response.output_item.added", **where, "item": added}))
        if part is not None:
            frames.append(
                self._frame(
                    {
                        "type": "response.content_part.added",
                        **where,
                        "item_id": item.id,
                        "content_index": 0,
                        "part": part,
                    }
                )
            )
        return frames

    def _close_item(self) -> list[bytes]:
        item = self._open
        if item is None:
            return []
        self._open = None
        where = {"item_id": item.id, "output_index": item.output_index}
        frames: list[bytes] = []
        if item.kind == "function_call":
            frames.append(
                self._frame(
                    {
                        "type": "response.function_call_arguments.done",
                        **where,
                        "arguments": item.text,
                    }
                )
            )
        else:
            if item.kind == "reasoning":
                done: dict[str, Any] = {"type": "response.reasoning_text.done", "text": item.text}
                part: dict[str, Any] = {"type": "reasoning_text", "text": item.text}
            else:
                done = {"type": "response.output_text.done", "text": item.text, "logprobs": []}
                part = output_text_part(item.text)
            frames.append(self._frame({**done, **where, "content_index": 0}))
            frames.append(
                self._frame(
                    {
                        "type": "response.content_part.done",
                        **where,
                        "content_index": 0,
                        "part": part,
                    }
                )
            )
        frames.append(
            self._frame(
                {
                    "type": "response.output_item.done",
                    "output_index": item.output_index,
                    "item": item.done(),
                }
            )
        )
        return frames

    def feed(self, chunk: Chunk) -> list[bytes]:
        if self.closed:
            return []
        frames, choice = _begin_chunk(self, chunk)
        if choice is None:
            return frames
        delta = choice.get("delta") or {}
        reasoning = reasoning_of(delta)
        if reasoning:
            if self._open is None or self._open.kind != "reasoning":
                frames += self._open_item("reasoning")
            assert self._open is not None
            self._open.text += reasoning
            frames.append(self._text_delta("response.reasoning_text.delta", self._open, reasoning))
        text = delta.get("content")
        if isinstance(text, str) and text:
            if self._open is None or self._open.kind != "message":
                frames += self._open_item("message")
            assert self._open is not None
            self._open.text += text
            frames.append(
                self._text_delta("response.output_text.delta", self._open, text, logprobs=[])
            )
        for call in delta.get("tool_calls") or ():
            position = int(call.get("index", 0))
            fn = call.get("function") or {}
            if position not in self._calls:
                frames += self._open_item(
                    "function_call",
                    call_id=call.get("id") or new_id("call"),
                    name=fn.get("name") or "",
                )
                assert self._open is not None
                self._calls[position] = self._open
            item = self._calls[position]
            arguments = fn.get("arguments")
            if arguments:
                item.text += arguments
                frames.append(
                    self._frame(
                        {
                            "type": "response.function_call_arguments.delta",
                            "item_id": item.id,
                            "output_index": item.output_index,
                            "delta": arguments,
                        }
                    )
                )
        if choice.get("finish_reason"):
            self.finish_reason = str(choice["finish_reason"])
        return frames

    def _text_delta(self, kind: str, item: _Item, text: str, **extra: Any) -> bytes:
        return self._frame(
            {
                "type": kind,
                "item_id": item.id,
                "output_index": item.output_index,
                "content_index": 0,
                "delta": text,
                **extra,
            }
        )

    def finish(self) -> list[bytes]:
        if self.closed:
            return []
        frames = self._start() + self._close_item()
        self.closed = True
        incomplete = self.finish_reason == "length"
        response = self._envelope(
            "incomplete" if incomplete else "completed",
            output=[item.done() for item in self._items],
            usage=responses_usage(self.usage),
            incomplete_reason="max_output_tokens" if incomplete else None,
        )
        kind = "response.incomplete" if incomplete else "response.completed"
        frames.append(self._frame({"type": kind, "response": response}))
        return frames

    def fail(self, error: APIError) -> list[bytes]:
        if self.closed:
            return []
        frames = self._start()
        self.closed = True
        frames.append(error_event("responses", error, self._seq))
        self._seq += 1
        response = self._envelope(
            "failed",
            output=[item.done() for item in self._items if item is not self._open],
            usage=responses_usage(self.usage) if self.usage else None,
            error={"code": _responses_error_code(error), "message": error.message},
        )
        frames.append(self._frame({"type": "response.failed", "response": response}))
        return frames


def translator_for(
    api: ApiName,
    *,
    model: str,
    request: ResponsesRequest | None = None,
    stop_sequences: Sequence[str] = (),
    include_usage: bool = False,
    input_tokens: int | None = None,
) -> StreamTranslator:
    """The translator for a client API (`request` is required for `responses`)."""
    if api == "messages":
        return AnthropicStream(
            model=model, stop_sequences=stop_sequences, input_tokens=input_tokens
        )
    if api == "responses":
        if request is None:
            raise ValueError("translator_for('responses') needs the ResponsesRequest")
        return ResponsesStream(request=request, model=model)
    return OpenAIPassthrough(model=model, include_usage=include_usage, api=api)
