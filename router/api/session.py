"""Session identity and turn position of a client request.

`session_id_from(headers, conversation)` → `(session_id, source)`:

1. the first non-empty of the headers `x-session-id`, `x-claude-code-session-id`,
   `x-session-affinity`, `session-id` (names case-insensitive; value stripped; a value longer
   than 256 characters is replaced by `h-` + the first 32 hex digits of its SHA-256) →
   source `"header"`;
2. otherwise a hash of the conversation's opening → source `"hash"`: `c-` + the first 32 hex
   digits of SHA-256 over the canonical JSON of `[system, first_user]`, where
   - `system` is the text of every `system`/`developer` message *before the first user
     message*, in order, joined by `"\\n\\n"`;
   - `first_user` is the text of the first `user` message (text parts joined by `""`; a
     non-text part counts as `"<type>"`).
   Later messages, tool definitions and sampling parameters are left out, so every turn of one
   conversation maps to the same id. Text is normalised the same way for a string content, a
   list of OpenAI text parts and a list of Anthropic text blocks, so the same conversation
   sent as OpenAI chat or as Anthropic messages (after `convert.to_upstream`, whose
   `messages_for_session` has Anthropic's `system` as the leading system message; the raw
   Anthropic message list plus `system=` works too) gets the same id.
   For a completions prompt: `p-` + SHA-256 prefix of its first 2,048 characters (string) or
   first 512 token ids — a raw prompt has no message boundaries, so prompts sharing that much
   prefix share a session.

`is_continuing_turn(messages)`: the request carries an earlier assistant turn or a tool result
(it continues a live session: the router's "continuing" band). `turn_index(messages)`: how many
assistant turns precede this request (0 for the first request of a conversation).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, cast

SESSION_HEADERS: tuple[str, ...] = (
    "x-session-id",
    "x-claude-code-session-id",
    "x-session-affinity",
    "session-id",
)
MAX_HEADER_ID_CHARS = 256
PROMPT_PREFIX_CHARS = 2048
PROMPT_PREFIX_TOKENS = 512
SessionSource = Literal["header", "hash"]
Conversation = Sequence[Mapping[str, Any]] | str | Sequence[int]


def _digest(value: Any) -> str:
    data = json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()
    return hashlib.sha256(data).hexdigest()[:32]


def _header(headers: Mapping[str, str] | Iterable[tuple[str, str]], name: str) -> str | None:
    items = headers.items() if isinstance(headers, Mapping) else headers
    for key, value in items:
        if key.lower() == name and value.strip():
            return value.strip()
    return None


def content_text(content: Any) -> str:
    """The text of a message content: a string, OpenAI parts or Anthropic blocks."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts: list[str] = []
    for part in content if isinstance(content, list) else [content]:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, Mapping):
            kind = part.get("type", "text")
            if kind in ("text", "input_text", "output_text") and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                texts.append(f"<{kind}>")
    return "".join(texts)


def _opening(messages: Sequence[Mapping[str, Any]], system: Any) -> list[str]:
    system_texts: list[str] = []
    if isinstance(system, list):  # Anthropic system blocks: joined as convert.py joins them
        system_texts.append("\n\n".join(content_text([b]) for b in system))
    elif system:
        system_texts.append(content_text(system))
    first_user = ""
    for msg in messages:
        role = msg.get("role")
        if role in ("system", "developer"):
            system_texts.append(content_text(msg.get("content")))
        elif role == "user":
            first_user = content_text(msg.get("content"))
            break
    return ["\n\n".join(system_texts), first_user]


def session_id_from(
    headers: Mapping[str, str] | Iterable[tuple[str, str]],
    conversation: Conversation,
    *,
    system: Any = None,
) -> tuple[str, SessionSource]:
    """The request's session id and where it came from (rules in the module docstring).

    `headers`: the request headers (a mapping, or (name, value) pairs). `conversation`: chat
    messages (`UpstreamCall.messages_for_session`), or a completions prompt. `system`: an
    Anthropic `system` (str or text blocks) when passing raw Anthropic messages.
    """
    for name in SESSION_HEADERS:
        value = _header(headers, name)
        if value is not None:
            if len(value) > MAX_HEADER_ID_CHARS:
                return "h-" + hashlib.sha256(value.encode()).hexdigest()[:32], "header"
            return value, "header"
    messages = _messages(conversation)
    if messages is None:
        if isinstance(conversation, str):
            return "p-" + _digest(conversation[:PROMPT_PREFIX_CHARS]), "hash"
        tokens = [int(cast(int, t)) for t in conversation[:PROMPT_PREFIX_TOKENS]]
        return "p-" + _digest(tokens), "hash"
    return "c-" + _digest(_opening(messages, system)), "hash"


def _messages(conversation: Conversation) -> Sequence[Mapping[str, Any]] | None:
    """The conversation as messages, or None for a completions prompt (str or token ids)."""
    if isinstance(conversation, str):
        return None
    if conversation and not isinstance(conversation[0], Mapping):
        return None
    return cast(Sequence[Mapping[str, Any]], conversation)


def _is_tool_result(msg: Mapping[str, Any]) -> bool:
    if msg.get("role") in ("tool", "function"):
        return True
    content = msg.get("content")
    return isinstance(content, list) and any(
        isinstance(b, Mapping) and b.get("type") in ("tool_result", "function_call_output")
        for b in content
    )


def is_continuing_turn(conversation: Conversation) -> bool:
    """True when the request carries an earlier assistant turn or a tool result.

    A completions prompt (str or token ids) never counts as continuing: it has no turns.
    """
    messages = _messages(conversation)
    if messages is None:
        return False
    return any(m.get("role") == "assistant" or _is_tool_result(m) for m in messages)


def turn_index(conversation: Conversation) -> int:
    """How many assistant turns precede this request (0: the conversation's first request)."""
    messages = _messages(conversation)
    if messages is None:
        return 0
    return sum(1 for m in messages if m.get("role") == "assistant")
