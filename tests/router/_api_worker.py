"""Test support for the client-API tests: a scripted worker answer and the front door as an
httpx2 transport handler, so the official OpenAI and Anthropic SDKs can talk to
`beamserve.router.api` without a server.

The worker is scripted below the part under test (it plays a vLLM worker's chat-completions
output); everything from request bytes to client SSE frames is the real package.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anthropic
import httpx2
import openai
from beamserve.router.api.convert import (
    to_anthropic_message,
    to_responses_object,
    to_upstream,
    with_model,
)
from beamserve.router.api.errors import APIError
from beamserve.router.api.models import ApiName, ResponsesRequest, parse_request
from beamserve.router.api.sse import UpstreamSSEDecoder, sse_frame, translator_for


@dataclass(frozen=True)
class ToolCallScript:
    call_id: str
    name: str
    argument_pieces: tuple[str, ...]

    @property
    def arguments(self) -> str:
        return "".join(self.argument_pieces)


@dataclass(frozen=True)
class WorkerScript:
    """What the scripted worker generates, as streamed pieces."""

    reasoning: tuple[str, ...] = ()
    text: tuple[str, ...] = ()
    tools: tuple[ToolCallScript, ...] = ()
    finish_reason: str = "stop"
    matched_stop: str | None = None
    prompt_tokens: int = 12
    cached_tokens: int = 0
    completion_tokens: int = 7
    reasoning_key: str = "reasoning"  # vLLM; SGLang says reasoning_content

    def usage(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    def chunks(self) -> list[dict[str, Any]]:
        base = {"id": "chatcmpl-w", "object": "chat.completion.chunk", "created": 1, "model": "w"}

        def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
            if finish is not None:
                choice["stop_reason"] = self.matched_stop
            return {**base, "choices": [choice]}

        out = [chunk({"role": "assistant", "content": ""})]
        out += [chunk({self.reasoning_key: p}) for p in self.reasoning]
        out += [chunk({"content": p}) for p in self.text]
        for i, tool in enumerate(self.tools):
            head = {"index": i, "id": tool.call_id, "type": "function"}
            out.append(
                chunk({"tool_calls": [{**head, "function": {"name": tool.name, "arguments": ""}}]})
            )
            out += [
                chunk({"tool_calls": [{"index": i, "function": {"arguments": p}}]})
                for p in tool.argument_pieces
            ]
        out.append(chunk({}, self.finish_reason))
        out.append({**base, "choices": [], "usage": self.usage()})
        return out

    def wire(self, done: bool = True) -> bytes:
        body = b"".join(sse_frame(c) for c in self.chunks())
        return body + (b"data: [DONE]\n\n" if done else b"")

    def completion(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.text) or None}
        if self.reasoning:
            message[self.reasoning_key] = "".join(self.reasoning)
        if self.tools:
            message["tool_calls"] = [
                {
                    "id": t.call_id,
                    "type": "function",
                    "function": {"name": t.name, "arguments": t.arguments},
                }
                for t in self.tools
            ]
        return {
            "id": "chatcmpl-w",
            "object": "chat.completion",
            "created": 1,
            "model": "w",
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "finish_reason": self.finish_reason,
                    "stop_reason": self.matched_stop,
                }
            ],
            "usage": self.usage(),
        }


@dataclass
class FrontDoor:
    """The router's front door as an httpx2 handler over a scripted worker.

    `splits`: cut points (fractions of the worker's body) at which its bytes arrive.
    `worker_done`: the worker ends with `[DONE]` (False: it breaks off).
    """

    script: WorkerScript
    max_bytes: int = 1 << 20
    splits: Sequence[float] = (0.5,)
    worker_done: bool = True
    upstream_bodies: list[dict[str, Any]] = field(default_factory=list)
    frames: list[bytes] = field(default_factory=list)

    def handle(self, request: httpx2.Request) -> httpx2.Response:
        path = request.url.path
        api: ApiName = {
            "/v1/chat/completions": "chat",
            "/v1/completions": "completions",
            "/v1/responses": "responses",
            "/v1/messages": "messages",
        }[path]  # type: ignore[assignment]
        try:
            parsed = parse_request(api, request.content, self.max_bytes)
        except APIError as err:
            return httpx2.Response(err.status, headers=err.headers(), json=err.body())
        call = to_upstream(parsed)
        self.upstream_bodies.append(call.body)
        model = parsed.model or "beam"
        request_model = parsed.request if isinstance(parsed.request, ResponsesRequest) else None
        if not call.stream:
            upstream = self.script.completion()
            if api == "messages":
                body = to_anthropic_message(
                    upstream, model=model, stop_sequences=call.stop_sequences
                )
            elif api == "responses":
                assert request_model is not None
                body = to_responses_object(upstream, request=request_model, model=model)
            else:
                body = with_model(upstream, model)
            return httpx2.Response(200, json=body)
        translator = translator_for(
            api,
            model=model,
            request=request_model,
            stop_sequences=call.stop_sequences,
            include_usage=call.client_wants_usage,
        )
        wire = self.script.wire(done=self.worker_done)
        cuts = sorted({int(f * len(wire)) for f in self.splits} | {0, len(wire)})
        decoder = UpstreamSSEDecoder()
        frames: list[bytes] = []
        for a, b in itertools.pairwise(cuts):
            for chunk in decoder.feed(wire[a:b]):
                frames += translator.feed(chunk)
        for chunk in decoder.close():
            frames += translator.feed(chunk)
        if decoder.done:
            frames += translator.finish()
        else:
            from beamserve.router.api.errors import upstream_failed

            frames += translator.fail(upstream_failed("stream ended before [DONE]"))
        self.frames = frames
        return httpx2.Response(
            200, headers={"content-type": "text/event-stream"}, content=b"".join(frames)
        )


def openai_client(handler: Callable[[httpx2.Request], httpx2.Response]) -> openai.OpenAI:
    return openai.OpenAI(
        api_key="test",
        base_url="http://router.test/v1",
        max_retries=0,
        http_client=httpx2.Client(transport=httpx2.MockTransport(handler)),
    )


def anthropic_client(handler: Callable[[httpx2.Request], httpx2.Response]) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        api_key="test",
        base_url="http://router.test",
        max_retries=0,
        http_client=httpx2.Client(transport=httpx2.MockTransport(handler)),
    )


def parse_frames(frames: bytes) -> list[tuple[str | None, str]]:
    """(event, data) pairs of an SSE body written by the translators."""
    out: list[tuple[str | None, str]] = []
    for block in frames.decode().split("\n\n"):
        if not block:
            continue
        event = None
        data: list[str] = []
        for line in block.split("\n"):
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                data.append(line[6:])
        out.append((event, "\n".join(data)))
    return out


def jsonl(frames: bytes) -> list[dict[str, Any]]:
    return [json.loads(d) for _, d in parse_frames(frames) if d != "[DONE]"]
