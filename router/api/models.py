"""Request bodies of the client APIs, validated at the router's front door.

`parse_request(api, body, max_bytes)` turns raw bytes into a `ParsedRequest` or raises
`APIError` in the API's own error shape (never anything else):

| api           | path                        | model                  | error shape |
|---------------|-----------------------------|------------------------|-------------|
| `chat`        | POST /v1/chat/completions   | `ChatCompletionRequest`| OpenAI      |
| `completions` | POST /v1/completions        | `CompletionRequest`    | OpenAI      |
| `responses`   | POST /v1/responses          | `ResponsesRequest`     | OpenAI      |
| `messages`    | POST /v1/messages           | `MessagesRequest`      | Anthropic   |

Rules: a body over `max_bytes` → 413 (`request_too_large`); not JSON or not a JSON object → 400;
a known field of the wrong type or value → 400 whose message and `param` name the field as a
dotted path into the body (`messages.0.role: Input should be 'system', ...`). Types are checked
strictly (no `"1"` → 1, no `0` → false). Unknown fields are allowed everywhere: for chat and
completions they pass through to the worker unchanged (vLLM and SGLang accept many extras such as
`top_k`, `chat_template_kwargs`); for responses the unknown ones pass through too, the known
Responses-only ones (`store`, `include`, `truncation`, ...) do not; for messages they are ignored.

Not supported, each with a clear 400: `n` ≠ 1, several prompts in one completions request,
`previous_response_id` / `item_reference` (the router keeps no response store: send the full
input), image/document input on `/v1/messages` and `/v1/responses` (Beam is text-only), and
non-function tools on `/v1/responses` and `/v1/messages`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal, cast

import orjson
from beamserve.router.api.errors import APIError, ErrorDialect, invalid_request, too_large
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

ApiName = Literal["chat", "completions", "responses", "messages"]
API_PATHS: dict[ApiName, str] = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "responses": "/v1/responses",
    "messages": "/v1/messages",
}


def dialect_of(api: ApiName) -> ErrorDialect:
    """Which error/stream dialect an API speaks."""
    return "anthropic" if api == "messages" else "openai"


def _unsupported(message: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported", message)


class _Open(BaseModel):
    """Known fields typed; unknown fields kept (`model_extra`)."""

    model_config = ConfigDict(extra="allow")


NonNegInt = Annotated[int, Field(ge=0)]
PositiveInt = Annotated[int, Field(ge=1)]
Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
Probability = Annotated[float, Field(ge=0.0, le=1.0)]
Stop = str | list[str]


# --------------------------------------------------------------------------- OpenAI chat


class FunctionDefinition(_Open):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Open):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Open):
    name: str


class ChatNamedToolChoice(_Open):
    type: Literal["function"]
    function: NamedFunction


class ChatToolCallFunction(_Open):
    name: str
    arguments: str


class ChatToolCall(_Open):
    id: str
    type: Literal["function"] = "function"
    function: ChatToolCallFunction


class ChatContentPart(_Open):
    """One part of a content list (`text`, `image_url`, ...); passed to the worker as sent."""

    type: str
    text: str | None = None


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ChatContentPart] | None = None
    name: str | None = None
    tool_calls: list[ChatToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class StreamOptions(_Open):
    include_usage: bool | None = None


class ResponseFormat(_Open):
    type: Literal["text", "json_object", "json_schema", "structural_tag", "regex", "grammar"]
    json_schema: dict[str, Any] | None = None


class _SingleChoice(_Open):
    n: int | None = None

    @field_validator("n")
    @classmethod
    def _only_one(cls, v: int | None) -> int | None:
        if v is not None and v != 1:
            raise _unsupported(
                f"only n=1 is supported (got {v}): send {v} separate requests instead"
            )
        return v


class ChatCompletionRequest(_SingleChoice):
    """POST /v1/chat/completions (OpenAI; vLLM extras pass through)."""

    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ChatNamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: Probability | None = None
    stop: Stop | None = None
    seed: int | None = None
    user: str | None = None
    reasoning_effort: str | None = None

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


# --------------------------------------------------------------------------- OpenAI completions


def _one_prompt(v: Any) -> Any:
    if isinstance(v, list) and len(v) == 0:
        raise _unsupported("must not be empty")
    if isinstance(v, list) and all(isinstance(x, str | list) for x in v) and len(v) != 1:
        raise _unsupported(
            f"send one prompt per request (got {len(v)}): the router routes each prompt "
            "to its own worker"
        )
    return v


class CompletionRequest(_SingleChoice):
    """POST /v1/completions (OpenAI legacy; vLLM extras pass through).

    `prompt`: a string, a token-id list, or a one-element list of either.
    """

    model: str | None = None
    prompt: Annotated[str | list[int] | list[str] | list[list[int]], BeforeValidator(_one_prompt)]
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: Probability | None = None
    stop: Stop | None = None
    seed: int | None = None
    user: str | None = None
    echo: bool | None = None

    @property
    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            return p[0]
        return cast("str | list[int]", p)


# --------------------------------------------------------------------------- OpenAI responses


class ResponsesContentPart(_Open):
    type: Literal["input_text", "output_text", "text", "refusal", "summary_text", "reasoning_text"]
    text: str | None = None
    refusal: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_media(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") in (
            "input_image",
            "input_file",
            "input_audio",
        ):
            raise _unsupported(
                f"{data.get('type')} is not supported: Beam is a text-only model; send text parts"
            )
        return data

    @property
    def as_text(self) -> str:
        return self.text if self.text is not None else (self.refusal or "")


def _str_to_parts(v: Any) -> Any:
    return [{"type": "input_text", "text": v}] if isinstance(v, str) else v


class ResponsesMessageItem(_Open):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Annotated[list[ResponsesContentPart], BeforeValidator(_str_to_parts)]
    id: str | None = None


class ResponsesFunctionCallItem(_Open):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None


class ResponsesFunctionCallOutputItem(_Open):
    type: Literal["function_call_output"]
    call_id: str
    output: Annotated[list[ResponsesContentPart], BeforeValidator(_str_to_parts)]


class ResponsesReasoningItem(_Open):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ResponsesContentPart] = Field(default_factory=list)
    content: list[ResponsesContentPart] | None = None
    encrypted_content: str | None = None


_INPUT_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


def _input_item_tag(v: Any) -> str:
    kind = v.get("type", "message") if isinstance(v, dict) else getattr(v, "type", "message")
    return str(kind) if kind in _INPUT_ITEM_TYPES else "unsupported"


class _UnsupportedItem(_Open):
    @model_validator(mode="before")
    @classmethod
    def _reject(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else type(data).__name__
        if kind == "item_reference":
            raise _unsupported(
                "not supported: send full input (item_reference needs a stored response)"
            )
        raise _unsupported(
            f"input item type {kind!r} is not supported: use message, function_call, "
            "function_call_output or reasoning"
        )


ResponsesInputItem = Annotated[
    Annotated[ResponsesMessageItem, Tag("message")]
    | Annotated[ResponsesFunctionCallItem, Tag("function_call")]
    | Annotated[ResponsesFunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ResponsesReasoningItem, Tag("reasoning")]
    | Annotated[_UnsupportedItem, Tag("unsupported")],
    Discriminator(_input_item_tag),
]


class ResponsesFunctionTool(_Open):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesNamedToolChoice(_Open):
    type: Literal["function"]
    name: str


class ResponsesReasoning(_Open):
    effort: str | None = None
    summary: str | None = None


class ResponsesTextFormat(_Open):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponsesText(_Open):
    format: ResponsesTextFormat | None = None


class ResponsesRequest(_Open):
    """POST /v1/responses (stateless: no `previous_response_id`, no stored items)."""

    model: str | None = None
    input: Annotated[str | list[ResponsesInputItem], Field(union_mode="left_to_right")]
    instructions: str | None = None
    tools: list[ResponsesFunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesNamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    max_output_tokens: PositiveInt | None = None
    stream: bool = False
    temperature: Temperature | None = None
    top_p: Probability | None = None
    reasoning: ResponsesReasoning | None = None
    text: ResponsesText | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    conversation: Any = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    background: bool | None = None

    @field_validator("previous_response_id")
    @classmethod
    def _stateless(cls, v: str | None) -> str | None:
        if v is not None:
            raise _unsupported(
                "not supported: send full input (this router keeps no stored responses)"
            )
        return v

    @field_validator("conversation")
    @classmethod
    def _no_conversation(cls, v: Any) -> Any:
        if v is not None:
            raise _unsupported("not supported: send full input (no stored conversations)")
        return v

    @field_validator("background")
    @classmethod
    def _no_background(cls, v: bool | None) -> bool | None:
        if v:
            raise _unsupported("background responses are not supported: send background=false")
        return v


# --------------------------------------------------------------------------- Anthropic messages


class AnthropicTextBlock(_Open):
    type: Literal["text"]
    text: str


class AnthropicToolUseBlock(_Open):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class _MediaBlock(_Open):
    """An image/document block: rejected with a clear message (Beam is text-only)."""

    @model_validator(mode="before")
    @classmethod
    def _reject(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else "media"
        raise _unsupported(
            f"{kind} input is not supported: Beam is a text-only model; send text blocks"
        )


class AnthropicImageBlock(_MediaBlock):
    type: Literal["image"]


class AnthropicDocumentBlock(_MediaBlock):
    type: Literal["document"]


ToolResultPart = Annotated[
    AnthropicTextBlock | AnthropicImageBlock | AnthropicDocumentBlock,
    Field(discriminator="type"),
]


def _str_to_text_blocks(v: Any) -> Any:
    return [{"type": "text", "text": v}] if isinstance(v, str) else v


class AnthropicToolResultBlock(_Open):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Annotated[list[ToolResultPart], BeforeValidator(_str_to_text_blocks)] = Field(
        default_factory=list
    )
    is_error: bool | None = None

    @property
    def text(self) -> str:
        return "\n".join(p.text for p in self.content if isinstance(p, AnthropicTextBlock))


class AnthropicThinkingBlock(_Open):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class AnthropicRedactedThinkingBlock(_Open):
    type: Literal["redacted_thinking"]
    data: str


AnthropicBlock = Annotated[
    AnthropicTextBlock
    | AnthropicImageBlock
    | AnthropicDocumentBlock
    | AnthropicToolUseBlock
    | AnthropicToolResultBlock
    | AnthropicThinkingBlock
    | AnthropicRedactedThinkingBlock,
    Field(discriminator="type"),
]


class AnthropicMessage(_Open):
    role: Literal["user", "assistant"]
    content: Annotated[list[AnthropicBlock], BeforeValidator(_str_to_text_blocks)]


class AnthropicTool(_Open):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _client_tools_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") not in (None, "custom"):
            raise _unsupported(
                f"server tool {data.get('type')!r} is not supported: define client tools "
                "(name, description, input_schema)"
            )
        return data


class AnthropicToolChoice(_Open):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named(self) -> AnthropicToolChoice:
        if self.type == "tool" and not self.name:
            raise _unsupported("tool_choice of type 'tool' needs the tool's name")
        return self


class AnthropicMetadata(_Open):
    user_id: str | None = None


class MessagesRequest(_Open):
    """POST /v1/messages (Anthropic)."""

    model: str
    max_tokens: PositiveInt
    messages: list[AnthropicMessage]
    system: Annotated[list[AnthropicTextBlock], BeforeValidator(_str_to_text_blocks)] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: Probability | None = None
    top_p: Probability | None = None
    top_k: NonNegInt | None = None
    metadata: AnthropicMetadata | None = None
    thinking: dict[str, Any] | None = None


# --------------------------------------------------------------------------- parsing

ClientRequest = ChatCompletionRequest | CompletionRequest | ResponsesRequest | MessagesRequest
_MODELS: dict[ApiName, type[BaseModel]] = {
    "chat": ChatCompletionRequest,
    "completions": CompletionRequest,
    "responses": ResponsesRequest,
    "messages": MessagesRequest,
}


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A validated client request: which API, the typed body, and the decoded JSON as sent."""

    api: ApiName
    request: ClientRequest
    raw: dict[str, Any]

    @property
    def dialect(self) -> ErrorDialect:
        return dialect_of(self.api)

    @property
    def stream(self) -> bool:
        return self.request.stream

    @property
    def model(self) -> str | None:
        return self.request.model


def _field_path(raw: Any, loc: tuple[int | str, ...], missing: bool = False) -> str:
    """The dotted path into the body for a pydantic error location.

    Pydantic puts union-branch and tag labels into locations (`str`, `list[...]`, `image`);
    walking the body along the location keeps only the steps that exist in the data, plus the
    name of a missing field (`missing`: the error is pydantic's `missing`).
    """
    parts: list[str] = []
    node: Any = raw
    for i, step in enumerate(loc):
        if isinstance(node, dict) and isinstance(step, str) and step in node:
            node = node[step]
            parts.append(step)
        elif isinstance(node, list) and isinstance(step, int) and 0 <= step < len(node):
            node = node[step]
            parts.append(str(step))
        elif missing and i == len(loc) - 1 and isinstance(node, dict):
            parts.append(str(step))
    return ".".join(parts)


def _validation_error(api: ApiName, raw: Any, err: ValidationError) -> APIError:
    problems = [
        (_field_path(raw, tuple(p["loc"]), p["type"] == "missing"), p["msg"])
        for p in err.errors(include_url=False, include_context=False, include_input=False)
    ]
    # The deepest location is the most specific: union branches add shallow type errors
    # ("input: Input should be a valid string") that only restate the outer alternative.
    problems.sort(key=lambda p: -len(p[0].split(".")))
    path, message = problems[0]
    rest = [(q, m) for q, m in problems[1:] if not (path == q or path.startswith(q + ".")) or not q]
    if rest:
        shown = "; ".join(f"{q or 'body'}: {m}" for q, m in rest[:2])
        more = f" (and {len(rest) - 2} more)" if len(rest) > 2 else ""
        message = f"{message}; {shown}{more}"
    return invalid_request(path or None, message, api=dialect_of(api))


_DIGITS = bytes(0x30 if 0x30 <= b <= 0x39 else 0x20 for b in range(256))
_LONG_RUN = b"0" * 19
"""A body whose digits, mapped to ``0`` (everything else to a space), hold this run has a
number orjson may not hold exactly (≥ 19 digits). `bytes.translate` and `in` run in C (≈ 0.1 ms
for 100 KB, where a regex took 3.6 ms); a run inside a string only costs the standard parser."""
_INEXACT = float(2**63)


def _has_huge_float(raw: Any) -> bool:
    """Whether orjson's reading of a body holds a float of magnitude 2^63 or more: the only
    trace an integer it could not hold exactly leaves (it reads one outside [-2^63, 2^64) as a
    float). Walking the parsed values costs what the body's structure costs, not its text (a
    100K-token chat is a few nodes), so the byte scan (`_LONG_RUN`) runs only when one is there."""
    stack = [raw]
    pop, extend = stack.pop, stack.extend
    while stack:
        v = pop()
        t = type(v)
        if t is dict:
            extend(v.values())
        elif t is list:
            extend(v)
        elif t is float and not -_INEXACT < v < _INEXACT:
            return True
    return False


def parse_request(api: ApiName, body: bytes, max_bytes: int) -> ParsedRequest:
    """Validate a client request body.

    Raises `APIError` only: 413 over `max_bytes`, 400 for invalid JSON, a non-object body, or
    an invalid/unsupported field (named as a dotted path in `param` and the message).
    """
    dialect = dialect_of(api)
    if len(body) > max_bytes:
        raise too_large(max_bytes, len(body), api=dialect)
    try:
        # orjson for speed; what it refuses (NaN, bad escapes) goes through the standard
        # parser, so accepted bodies and error messages stay the same. It also reads an integer
        # outside 64 bits as a float (silently: a tool argument's big id would lose digits), so
        # a body with a 19-digit-or-longer number goes to the standard parser too.
        raw = orjson.loads(body)
        if _has_huge_float(raw) and _LONG_RUN in body.translate(_DIGITS):
            raw = None
    except orjson.JSONDecodeError:
        raw = None
    standard = raw is None
    try:
        if standard:
            raw = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise invalid_request(None, f"request body is not valid JSON: {exc}", api=dialect) from None
    except RecursionError:
        raise invalid_request(None, "request body is nested too deeply", api=dialect) from None
    # orjson refuses a lone surrogate escape; the standard parser reads one into a str that
    # cannot be encoded (so only a body it read is checked: a scan of every body cost 0.4 ms
    # at 100K tokens)
    if standard and (b"\\ud" in body or b"\\uD" in body):
        try:
            json.dumps(raw, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise invalid_request(
                None,
                "request body has a lone UTF-16 surrogate escape; send valid Unicode",
                api=dialect,
            ) from None
    if not isinstance(raw, dict):
        raise invalid_request(
            None, f"request body must be a JSON object, got {type(raw).__name__}", api=dialect
        )
    try:
        request = _MODELS[api].model_validate(raw, strict=True)
    except ValidationError as exc:
        raise _validation_error(api, raw, exc) from None
    except RecursionError:
        raise invalid_request(None, "request body is nested too deeply", api=dialect) from None
    return ParsedRequest(api=api, request=request, raw=raw)  # type: ignore[arg-type]
