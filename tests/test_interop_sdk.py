"""Interop: a local disaggregated stack — manifests/examples/local-sim.yaml brought up by
`LocalStack` (what `beamserve up` runs): the router, one prefill and two decode `sim` workers,
real processes over real HTTP — driven by the official OpenAI and Anthropic SDKs the way an agent
harness drives it: tools declared, the model's tool calls and the tool results sent back in the
history, streaming and not, several turns of one session.

The simulated engine never decides to call a tool, so each turn's tool call is the one a harness
would have received and executed; what is checked is that every SDK shape of it reaches the
worker (prompt tokens grow by the rendered tools and results), that the SDKs parse every answer
(streamed events included), and that the session keeps its decode worker after a disaggregated
first turn.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import yaml
from beamserve.router.bench.agentic_procs import SpecStack

REPO = Path(__file__).resolve().parents[1]

SYSTEM = "You are a coding agent in a large repository. " + " ".join(
    f"rule {i}: keep edits small." for i in range(120)
)
READ_FILE = {
    "type": "function",
    "function": {
        "name": "read_file",
        "description": "Read a file of the repository.",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string", "description": "path from the root"}},
            "required": ["path"],
        },
    },
}
READ_FILE_ANTHROPIC = {
    "name": "read_file",
    "description": "Read a file of the repository.",
    "input_schema": READ_FILE["function"]["parameters"],  # type: ignore[index]
}
FILE_TEXT = "def main() -> None:\n    print('hello')\n" * 20


@dataclass(frozen=True)
class Stack:
    """What the tests need of a running stack: LocalStack's `router_url` and `workers`."""

    router_url: str
    workers: list[tuple[str, str]]


def prompt_of(usage: anthropic.types.Usage) -> int:
    """Anthropic's `input_tokens` counts only what was not read from the cache."""
    return usage.input_tokens + (usage.cache_read_input_tokens or 0)


def route_of(headers: httpx.Headers) -> dict[str, str]:
    raw = headers.get("x-beamserve-route", "")
    return dict(part.strip().split("=", 1) for part in raw.split(";") if "=" in part)


@pytest.fixture(scope="module")
def stack(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """manifests/examples/local-sim.yaml (one prefill and two decode sim workers, the router)
    brought up as `beamserve up` does (`LocalStack`), with the tiny checkpoint and a P/D rule
    that disaggregates a turn with ≥ 256 uncached prompt tokens."""
    doc = yaml.safe_load((REPO / "manifests" / "examples" / "local-sim.yaml").read_text())
    doc["metadata"]["name"] = "interop"
    doc["spec"]["model"]["source"]["hostPath"]["path"] = str(tiny_checkpoint)
    doc["spec"]["router"]["disaggregation"] = {"minUncachedTokens": 256}
    tmp = tmp_path_factory.mktemp("interop")
    (tmp / "interop.yaml").write_text(yaml.safe_dump(doc))
    with SpecStack(tmp / "interop.yaml", tmp / "state") as up:
        roles = sorted(role for role, _ in up.workers)
        assert roles == ["decode", "decode", "prefill"], up.workers
        yield Stack(up.router_url, up.workers)


def test_openai_agent_loop_streams_with_tools(stack: Stack) -> None:
    oa = openai.OpenAI(base_url=stack.router_url + "/v1", api_key="x", max_retries=0)
    session = {"x-session-id": "interop-openai"}
    msgs: list[Any] = [{"role": "system", "content": SYSTEM},
                       {"role": "user", "content": "Why does main print twice?"}]  # fmt: skip
    routes, prompts = [], []
    for turn in range(3):
        raw = oa.chat.completions.with_raw_response.create(
            model="beam", messages=msgs, tools=[READ_FILE], max_tokens=5, stream=True,
            stream_options={"include_usage": True}, extra_headers=session,
        )  # fmt: skip
        routes.append(route_of(raw.headers))
        chunks = list(raw.parse())
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
        assert usage is not None and usage.completion_tokens == 5
        assert chunks[-2].choices[0].finish_reason == "length"
        prompts.append(usage.prompt_tokens)
        # the harness got a tool call, ran it, and sends the result with the next question
        call_id = f"call_{turn}"
        msgs += [
            {"role": "assistant", "content": text, "tool_calls": [{
                "id": call_id, "type": "function",
                "function": {"name": "read_file", "arguments": json.dumps({"path": "main.py"})},
            }]},
            {"role": "tool", "tool_call_id": call_id, "content": FILE_TEXT},
            {"role": "user", "content": f"and now step {turn + 1}?"},
        ]  # fmt: skip
    assert routes[0]["prefill"] != "-", routes[0]  # the long first turn: P/D
    assert {r["decode"] for r in routes} == {routes[0]["decode"]}, routes  # one decode worker
    assert all(r["band"] == "continuing" for r in routes[1:]), routes
    # each turn carries the previous one, its tool call and the file the tool returned
    assert prompts[0] < prompts[1] < prompts[2]
    assert prompts[1] - prompts[0] > len(FILE_TEXT) // 8, prompts


def test_openai_tools_reach_the_worker_unstreamed(stack: Stack) -> None:
    oa = openai.OpenAI(base_url=stack.router_url + "/v1", api_key="x", max_retries=0)
    msgs: list[Any] = [{"role": "user", "content": "list the files"}]
    bare = oa.chat.completions.create(model="beam", messages=msgs, max_tokens=3)
    tooled = oa.chat.completions.create(
        model="beam", messages=msgs, max_tokens=3, tools=[READ_FILE], tool_choice="auto",
        parallel_tool_calls=False,
    )  # fmt: skip
    assert bare.usage is not None and tooled.usage is not None
    assert tooled.choices[0].message.role == "assistant"
    assert tooled.choices[0].finish_reason == "length" and tooled.usage.completion_tokens == 3
    # the tool's JSON schema is rendered into the prompt by the worker's chat template
    assert tooled.usage.prompt_tokens - bare.usage.prompt_tokens > 20, (bare.usage, tooled.usage)


def test_anthropic_agent_loop_with_tool_use_blocks(stack: Stack) -> None:
    ac = anthropic.Anthropic(base_url=stack.router_url, api_key="x", max_retries=0)
    system = "An Anthropic-SDK harness. " + SYSTEM  # not the OpenAI test's cached prefix
    session = {"x-session-id": "interop-anthropic"}
    msgs: list[Any] = [{"role": "user", "content": "Why does main print twice?"}]
    raw = ac.messages.with_raw_response.create(
        model="beam", max_tokens=4, system=system, messages=msgs, tools=[READ_FILE_ANTHROPIC],
        extra_headers=session,
    )  # fmt: skip
    first_route = route_of(raw.headers)
    first = raw.parse()
    assert first.stop_reason == "max_tokens" and first.usage.output_tokens == 4
    assert first.content[0].type == "text"
    msgs += [
        {"role": "assistant", "content": [
            {"type": "text", "text": first.content[0].text},
            {"type": "tool_use", "id": "toolu_1", "name": "read_file",
             "input": {"path": "main.py"}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": FILE_TEXT},
            {"type": "text", "text": "and now?"},
        ]},
    ]  # fmt: skip
    with ac.messages.stream(
        model="beam", max_tokens=6, system=system, messages=msgs, tools=[READ_FILE_ANTHROPIC],
        extra_headers=session,
    ) as s:  # fmt: skip
        second_route = route_of(s.response.headers)
        kinds = [event.type for event in s]
        final = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
    assert "content_block_delta" in kinds
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 6
    assert prompt_of(final.usage) - prompt_of(first.usage) > len(FILE_TEXT) // 8
    # the first turn's prompt was served from the decode worker's cache
    assert (final.usage.cache_read_input_tokens or 0) >= prompt_of(first.usage) // 2, final.usage
    assert first_route["prefill"] != "-", first_route
    assert second_route["decode"] == first_route["decode"], (first_route, second_route)
    assert second_route["band"] == "continuing", second_route


def test_anthropic_tool_choice_and_errors(stack: Stack) -> None:
    ac = anthropic.Anthropic(base_url=stack.router_url, api_key="x", max_retries=0)
    msgs: list[Any] = [{"role": "user", "content": "read main.py"}]
    bare = ac.messages.create(model="beam", max_tokens=2, messages=msgs)
    tooled = ac.messages.create(
        model="beam", max_tokens=2, messages=msgs, tools=[READ_FILE_ANTHROPIC],
        tool_choice={"type": "auto", "disable_parallel_tool_use": True},
    )  # fmt: skip
    assert prompt_of(tooled.usage) - prompt_of(bare.usage) > 20, (bare.usage, tooled.usage)
    # an SDK raises its own typed error from the router's Anthropic-shaped error body
    with pytest.raises(anthropic.BadRequestError) as bad:
        ac.messages.create(model="beam", max_tokens=2, messages=[])
    assert bad.value.status_code == 400
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(
            base_url=stack.router_url + "/v1", api_key="x", max_retries=0
        ).models.retrieve("no-such-model")
