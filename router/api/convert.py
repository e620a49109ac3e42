"""Convert client requests to the workers' OpenAI API and worker answers back.

Workers speak only OpenAI `/v1/chat/completions` and `/v1/completions` (vLLM/SGLang flavour).
`to_upstream(parsed)` builds the worker call for any client API; `to_anthropic_message` and
`to_responses_object` turn a non-streaming chat completion back into the client's shape
(streams: `sse.py`). Everything here is pure.

Anthropic `/v1/messages` → chat:

- `system` (str or text blocks) → a leading `system` message (blocks joined by a blank line);
- user text blocks → a `user` message (one block: a string; several: text parts);
- user `tool_result` blocks → one `tool` message each (`tool_call_id` = `tool_use_id`), in
  order; `is_error` prefixes the content with "Error: ";
- assistant `text` → `content` (blocks concatenated); `tool_use` → `tool_calls` (`arguments` =
  the JSON string of `input`); `thinking` → `reasoning_content`; `redacted_thinking` dropped;
- `tools[].input_schema` → `tools[].function.parameters`;
- `tool_choice` auto / any / tool / none → "auto" / "required" / the named function / "none";
  `disable_parallel_tool_use` → `parallel_tool_calls: false`;
- `stop_sequences` → `stop`; `max_tokens`, `temperature`, `top_p` as is; `top_k` (a vLLM/SGLang
  extra) as is; `metadata.user_id` → `user`; other fields (`thinking`, ...) are not forwarded.

Responses `/v1/responses` → chat: `instructions` → system message; a string `input` → one user
message; `message` items keep their role (`developer` → `system`); consecutive `function_call`
items become one assistant message's `tool_calls` (joined to a preceding assistant message);
`function_call_output` → `tool` messages; `reasoning` items → `reasoning_content` of the next
assistant message; `max_output_tokens` → `max_tokens`; `reasoning.effort` → `reasoning_effort`;
`text.format` → `response_format`; unknown (non-Responses) fields pass through.

Streaming requests always ask the worker for usage (`stream_options.include_usage`), so the
router can account tokens; `UpstreamCall.client_wants_usage` says whether the client asked.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from beamserve.router.api.models import (
    AnthropicTextBlock,
    AnthropicThinkingBlock,
    AnthropicToolResultBlock,
    AnthropicToolUseBlock,
    ApiName,
    ChatCompletionRequest,
    CompletionRequest,
    MessagesRequest,
    ParsedRequest,
    ResponsesFunctionCallItem,
    ResponsesFunctionCallOutputItem,
    ResponsesMessageItem,
    ResponsesReasoningItem,
    ResponsesRequest,
)

UpstreamPath = Literal["/v1/chat/completions", "/v1/completions"]
ChatMessageDict = dict[str, Any]


def new_id(prefix: str) -> str:
    """A fresh object id in the APIs' style: `msg_…`, `resp_…`, `fc_…`, `rs_…`."""
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True, slots=True)
class UpstreamCall:
    """What to send to a worker for one client request.

    `path`/`body`: the worker request (`body` is JSON-ready). `stream`: the client asked for a
    stream (so does the worker call). `messages_for_session`: the conversation in chat shape
    (system first, as the worker sees it; empty for completions) — feed it to
    `session.session_id_from`, `is_continuing_turn`, `turn_index`. `prompt`: the completions
    prompt (None for chat-shaped calls). `max_tokens`: the output limit the client set, if any.
    `stop_sequences`: the client's stop strings (Anthropic reports which one matched).
    `client_wants_usage`: the client asked for usage in its stream (OpenAI `include_usage`).
    """

    path: UpstreamPath
    body: dict[str, Any]
    stream: bool
    client_api: ApiName
    model: str | None
    messages_for_session: list[ChatMessageDict] = field(default_factory=list)
    prompt: str | list[int] | None = None
    max_tokens: int | None = None
    stop_sequences: tuple[str, ...] = ()
    client_wants_usage: bool = False

    @property
    def prompt_text_or_messages(self) -> str | list[int] | list[ChatMessageDict]:
        return self.prompt if self.prompt is not None else self.messages_for_session


def to_upstream(parsed: ParsedRequest) -> UpstreamCall:
    """The worker call for a validated client request (see the module docstring's tables)."""
    req = parsed.request
    if isinstance(req, ChatCompletionRequest):
        return _chat_passthrough(parsed, req)
    if isinstance(req, CompletionRequest):
        return _completions_passthrough(parsed, req)
    if isinstance(req, MessagesRequest):
        return _from_anthropic(req)
    return _from_responses(req)


def _stream_fields(stream: bool, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    if not stream:
        return {"stream": False}
    return {"stream": True, "stream_options": {**(extra or {}), "include_usage": True}}


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def _chat_passthrough(parsed: ParsedRequest, req: ChatCompletionRequest) -> UpstreamCall:
    body = dict(parsed.raw)
    client_opts = parsed.raw.get("stream_options") or {}
    body.update(_stream_fields(req.stream, client_opts))
    if not req.stream:
        body.pop("stream_options", None)
    return UpstreamCall(
        path="/v1/chat/completions",
        body=body,
        stream=req.stream,
        client_api="chat",
        model=req.model,
        messages_for_session=list(parsed.raw["messages"]),
        max_tokens=req.output_limit,
        stop_sequences=_stops(req.stop),
        client_wants_usage=bool(req.stream_options and req.stream_options.include_usage),
    )


def _completions_passthrough(parsed: ParsedRequest, req: CompletionRequest) -> UpstreamCall:
    body = dict(parsed.raw)
    body.update(_stream_fields(req.stream, parsed.raw.get("stream_options") or {}))
    if not req.stream:
        body.pop("stream_options", None)
    return UpstreamCall(
        path="/v1/completions",
        body=body,
        stream=req.stream,
        client_api="completions",
        model=req.model,
        prompt=req.single_prompt,
        max_tokens=req.max_tokens,
        stop_sequences=_stops(req.stop),
        client_wants_usage=bool(req.stream_options and req.stream_options.include_usage),
    )


def _text_content(texts: Sequence[str]) -> str | list[dict[str, Any]]:
    if len(texts) == 1:
        return texts[0]
    return [{"type": "text", "text": t} for t in texts]


def tool_arguments(tool_input: Mapping[str, Any]) -> str:
    """A tool call's `arguments` string for an Anthropic `input` object."""
    return json.dumps(tool_input, ensure_ascii=False)


def anthropic_to_chat_messages(req: MessagesRequest) -> list[ChatMessageDict]:
    """Anthropic `system` + `messages` as a chat message list (table in the module docstring)."""
    out: list[ChatMessageDict] = []
    if req.system:
        out.append({"role": "system", "content": "\n\n".join(b.text for b in req.system)})
    for msg in req.messages:
        if msg.role == "user":
            texts: list[str] = []
            for block in msg.content:
                if isinstance(block, AnthropicToolResultBlock):
                    if texts:
                        out.append({"role": "user", "content": _text_content(texts)})
                        texts = []
                    content = block.text
                    if block.is_error:
                        content = f"Error: {content}"
                    out.append(
                        {"role": "tool", "tool_call_id": block.tool_use_id, "content": content}
                    )
                elif isinstance(block, AnthropicTextBlock):
                    texts.append(block.text)
                # other blocks in a user turn carry nothing for the model
            if texts:
                out.append({"role": "user", "content": _text_content(texts)})
        else:
            text = "".join(b.text for b in msg.content if isinstance(b, AnthropicTextBlock))
            calls = [
                {
                    "id": b.id,
                    "type": "function",
                    "function": {"name": b.name, "arguments": tool_arguments(b.input)},
                }
                for b in msg.content
                if isinstance(b, AnthropicToolUseBlock)
            ]
            thinking = "".join(
                b.thinking for b in msg.content if isinstance(b, AnthropicThinkingBlock)
            )
            assistant: ChatMessageDict = {
                "role": "assistant",
                "content": text if text or not calls else None,
            }
            if calls:
                assistant["tool_calls"] = calls
            if thinking:
                assistant["reasoning_content"] = thinking
            out.append(assistant)
    return out


def _from_anthropic(req: MessagesRequest) -> UpstreamCall:
    messages = anthropic_to_chat_messages(req)
    body: dict[str, Any] = {"model": req.model, "messages": messages, "max_tokens": req.max_tokens}
    body.update(_stream_fields(req.stream))
    if req.stop_sequences:
        body["stop"] = list(req.stop_sequences)
    for name in ("temperature", "top_p", "top_k"):
        value = getattr(req, name)
        if value is not None:
            body[name] = value
    if req.metadata and req.metadata.user_id:
        body["user"] = req.metadata.user_id
    if req.tools:
        body["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    **({"description": t.description} if t.description is not None else {}),
                    "parameters": t.input_schema,
                },
            }
            for t in req.tools
        ]
    if req.tool_choice is not None:
        choice = req.tool_choice
        if choice.type == "tool":
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        if choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    return UpstreamCall(
        path="/v1/chat/completions",
        body=body,
        stream=req.stream,
        client_api="messages",
        model=req.model,
        messages_for_session=messages,
        max_tokens=req.max_tokens,
        stop_sequences=tuple(req.stop_sequences or ()),
    )


def responses_to_chat_messages(req: ResponsesRequest) -> list[ChatMessageDict]:
    """Responses `instructions` + `input` as a chat message list (module docstring)."""
    out: list[ChatMessageDict] = []
    if req.instructions:
        out.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        out.append({"role": "user", "content": req.input})
        return out
    pending_reasoning: list[str] = []

    def open_assistant() -> ChatMessageDict:
        """The assistant message tool calls join: the last one, unless a tool result followed."""
        last = out[-1] if out else None
        if last is not None and last["role"] == "assistant" and not pending_reasoning:
            return last
        msg: ChatMessageDict = {"role": "assistant", "content": None}
        if pending_reasoning:
            msg["reasoning_content"] = "".join(pending_reasoning)
            pending_reasoning.clear()
        out.append(msg)
        return msg

    for item in req.input:
        if isinstance(item, ResponsesMessageItem):
            texts = [p.as_text for p in item.content]
            if item.role == "assistant":
                msg: ChatMessageDict = {"role": "assistant", "content": "".join(texts)}
                if pending_reasoning:
                    msg["reasoning_content"] = "".join(pending_reasoning)
                    pending_reasoning.clear()
                out.append(msg)
            else:
                role = "system" if item.role == "developer" else item.role
                out.append({"role": role, "content": _text_content(texts)})
        elif isinstance(item, ResponsesFunctionCallItem):
            assistant = open_assistant()
            assistant.setdefault("tool_calls", []).append(
                {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments},
                }
            )
        elif isinstance(item, ResponsesFunctionCallOutputItem):
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": item.call_id,
                    "content": "".join(p.as_text for p in item.output),
                }
            )
        elif isinstance(item, ResponsesReasoningItem):
            parts = item.content if item.content else item.summary
            pending_reasoning.append("".join(p.as_text for p in parts))
    return out


def _from_responses(req: ResponsesRequest) -> UpstreamCall:
    messages = responses_to_chat_messages(req)
    body: dict[str, Any] = dict(req.model_extra or {})
    body["messages"] = messages
    if req.model is not None:
        body["model"] = req.model
    body.update(_stream_fields(req.stream))
    if req.max_output_tokens is not None:
        body["max_tokens"] = req.max_output_tokens
    for name in ("temperature", "top_p", "user", "parallel_tool_calls"):
        value = getattr(req, name)
        if value is not None:
            body[name] = value
    if req.reasoning and req.reasoning.effort:
        body["reasoning_effort"] = req.reasoning.effort
    if req.tools:
        body["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    **({"description": t.description} if t.description is not None else {}),
                    **({"parameters": t.parameters} if t.parameters is not None else {}),
                    **({"strict": t.strict} if t.strict is not None else {}),
                },
            }
            for t in req.tools
        ]
    if req.tool_choice is not None:
        tc = req.tool_choice
        body["tool_choice"] = (
            tc if isinstance(tc, str) else {"type": "function", "function": {"name": tc.name}}
        )
    fmt = req.text.format if req.text else None
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        schema: dict[str, Any] = {"name": fmt.name or "response", "schema": fmt.schema_ or {}}
        if fmt.strict is not None:
            schema["strict"] = fmt.strict
        if fmt.description is not None:
            schema["description"] = fmt.description
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    return UpstreamCall(
        path="/v1/chat/completions",
        body=body,
        stream=req.stream,
        client_api="responses",
        model=req.model,
        messages_for_session=messages,
        max_tokens=req.max_output_tokens,
    )


# --------------------------------------------------------------------------- answers back


def reasoning_of(message_or_delta: Mapping[str, Any]) -> str | None:
    """The reasoning text of a chat message/delta (vLLM: `reasoning`; SGLang and older vLLM:
    `reasoning_content`)."""
    value = message_or_delta.get("reasoning_content")
    if value is None:
        value = message_or_delta.get("reasoning")
    return value if isinstance(value, str) else None


def parse_tool_input(arguments: str) -> dict[str, Any]:
    """A tool call's arguments as an Anthropic `input` object.

    Arguments that are not a JSON object (a model's malformed output) are kept verbatim under
    `_unparsed_arguments` rather than dropped.
    """
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return {"_unparsed_arguments": arguments}
    return value if isinstance(value, dict) else {"_unparsed_arguments": arguments}


def anthropic_stop_reason(
    finish_reason: str | None,
    matched_stop: Any,
    stop_sequences: Sequence[str],
    has_tool_calls: bool,
) -> tuple[str, str | None]:
    """(`stop_reason`, `stop_sequence`) for a worker's `finish_reason` and `stop_reason`.

    `tool_calls` (or tool calls present) → tool_use; `length` → max_tokens; `stop` with a
    matched client stop string → stop_sequence; `content_filter` → refusal; else end_turn.
    """
    if finish_reason == "tool_calls" or (has_tool_calls and finish_reason in (None, "stop")):
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "content_filter":
        return "refusal", None
    if isinstance(matched_stop, str) and matched_stop in stop_sequences:
        return "stop_sequence", matched_stop
    return "end_turn", None


def _cached_tokens(usage: Mapping[str, Any]) -> int:
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
    return int(cached or 0)


def anthropic_usage(usage: Mapping[str, Any] | None) -> dict[str, int]:
    """Anthropic usage from OpenAI usage: `input_tokens` excludes cache reads, as Anthropic's
    does (total input = input_tokens + cache_read_input_tokens)."""
    usage = usage or {}
    prompt = int(usage.get("prompt_tokens") or 0)
    cached = min(_cached_tokens(usage), prompt)
    return {
        "input_tokens": prompt - cached,
        "output_tokens": int(usage.get("completion_tokens") or 0),
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def responses_usage(usage: Mapping[str, Any] | None) -> dict[str, Any]:
    """Responses usage from OpenAI usage."""
    usage = usage or {}
    prompt = int(usage.get("prompt_tokens") or 0)
    completion = int(usage.get("completion_tokens") or 0)
    ctd = usage.get("completion_tokens_details") or {}
    reasoning = int(ctd.get("reasoning_tokens") or 0) if isinstance(ctd, Mapping) else 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": _cached_tokens(usage), "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": prompt + completion,
    }


def _first_choice(upstream: Mapping[str, Any]) -> Mapping[str, Any]:
    choices = upstream.get("choices") or [{}]
    first = choices[0]
    return first if isinstance(first, Mapping) else {}


def to_anthropic_message(
    upstream: Mapping[str, Any],
    *,
    model: str,
    stop_sequences: Sequence[str] = (),
    message_id: str | None = None,
) -> dict[str, Any]:
    """A non-streaming chat completion as an Anthropic `Message` object.

    Content order: thinking (from reasoning), text, tool_use blocks (input parsed from the
    arguments JSON).
    """
    choice = _first_choice(upstream)
    message = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    reasoning = reasoning_of(message)
    if reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    text = message.get("content")
    if isinstance(text, str) and text:
        content.append({"type": "text", "text": text})
    calls = message.get("tool_calls") or []
    for call in calls:
        fn = call.get("function") or {}
        content.append(
            {
                "type": "tool_use",
                "id": call.get("id") or new_id("toolu"),
                "name": fn.get("name", ""),
                "input": parse_tool_input(fn.get("arguments") or ""),
            }
        )
    stop_reason, stop_sequence = anthropic_stop_reason(
        choice.get("finish_reason"), choice.get("stop_reason"), stop_sequences, bool(calls)
    )
    return {
        "id": message_id or new_id("msg"),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": anthropic_usage(upstream.get("usage")),
    }


def responses_tools(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's tools as echoed in a Response object."""
    return [
        {
            "type": "function",
            "name": t.name,
            "description": t.description,
            "parameters": t.parameters,
            "strict": t.strict,
        }
        for t in req.tools or []
    ]


def responses_envelope(
    req: ResponsesRequest,
    *,
    model: str,
    response_id: str,
    created_at: float,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None = None,
    incomplete_reason: str | None = None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A Response object (shared by the non-streaming answer and the stream's lifecycle events)."""
    tc = req.tool_choice
    tool_choice: Any = (
        "auto"
        if tc is None
        else tc
        if isinstance(tc, str)
        else {"type": "function", "name": tc.name}
    )
    fmt = req.text.format if req.text and req.text.format else None
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "error": error,
        "incomplete_details": {"reason": incomplete_reason} if incomplete_reason else None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": model,
        "output": output,
        "parallel_tool_calls": req.parallel_tool_calls
        if req.parallel_tool_calls is not None
        else True,
        "previous_response_id": None,
        "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
        "store": False,
        "temperature": req.temperature,
        "text": {
            "format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}
        },
        "tool_choice": tool_choice,
        "tools": responses_tools(req),
        "top_p": req.top_p,
        "truncation": "disabled",
        "usage": usage,
        "user": req.user,
        "metadata": req.metadata or {},
    }


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": status,
    }


def output_text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str = "completed") -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [] if text is None else [output_text_part(text)],
    }


def function_call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str = "completed"
) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def to_responses_object(
    upstream: Mapping[str, Any],
    *,
    request: ResponsesRequest,
    model: str,
    response_id: str | None = None,
    created_at: float | None = None,
) -> dict[str, Any]:
    """A non-streaming chat completion as a Responses `Response` object.

    Output items, in order: reasoning (if any), message with one output_text part (if any
    text), one function_call per tool call. `length` → status `incomplete` with
    `incomplete_details.reason = "max_output_tokens"`.
    """
    choice = _first_choice(upstream)
    message = choice.get("message") or {}
    output: list[dict[str, Any]] = []
    reasoning = reasoning_of(message)
    if reasoning:
        output.append(reasoning_item(new_id("rs"), reasoning))
    text = message.get("content")
    if isinstance(text, str) and text:
        output.append(message_item(new_id("msg"), text))
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        output.append(
            function_call_item(
                new_id("fc"),
                call.get("id") or new_id("call"),
                fn.get("name", ""),
                fn.get("arguments") or "",
            )
        )
    incomplete = choice.get("finish_reason") == "length"
    return responses_envelope(
        request,
        model=model,
        response_id=response_id or new_id("resp"),
        created_at=created_at if created_at is not None else time.time(),
        status="incomplete" if incomplete else "completed",
        output=output,
        usage=responses_usage(upstream.get("usage")),
        incomplete_reason="max_output_tokens" if incomplete else None,
    )


def with_model(upstream: Mapping[str, Any], model: str | None) -> dict[str, Any]:
    """An OpenAI-shaped worker answer (or chunk) with `model` set to the name the client used."""
    out = dict(upstream)
    if model is not None and "model" in out:
        out["model"] = model
    return out


def model_list(
    model_ids: Sequence[str], *, created: int = 0, owned_by: str = "beamserve"
) -> dict[str, Any]:
    """The `GET /v1/models` body (OpenAI list of model objects) for the served model names."""
    return {
        "object": "list",
        "data": [
            {"id": name, "object": "model", "created": created, "owned_by": owned_by}
            for name in model_ids
        ],
    }
