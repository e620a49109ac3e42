"""`beamserve bench agentic`: the claude-code sessions as HTTP requests every router accepts.

Sessions. One JSON file per session (``data/traces/claude-code``, format in
docs/bench/agentic.md). `--sessions N` picks a *held-out*, deterministic subset: of the ``F``
files sorted by name, the ones at positions ``⌊(i + ½)·F / N⌋`` for ``i = 0 … N−1`` (evenly
spread over the set, so never simply the first N that `beamserve bench route --sessions N`
replays). Past ``F`` (to load the pool beyond what 64 agents can), every file plays
``N // F`` times plus the held-out subset of ``N mod F``; copy ``k ≥ 1`` of a file is the session
``<stem>~k``: another user's conversation of the same shape, with its own texts (they are derived
from the session name) and its own session id. Every request of a file is one turn, played in
file order (sub-agent calls included: they run serially inside their session here).

Think time. The pause before turn ``i`` is the trace's ``think_time`` of that request (the data
show it is the pause *before* the call: ``t[i] − t[i−1] − api_time[i−1]``, mean deviation 0.34 s
over the set), else that difference when the fields are there, else 0; times `think_scale`,
capped at `max_think_s` (the set holds pauses of up to 21 hours).

Prompts. Token-id arrays are refused by the SGLang gateway, so every turn is sent as chat
messages: one user message whose text is the concatenation of one *block text* per trace hash
id. A block text tokenizes to exactly `block_tokens` tokens under the sim worker's tokenizer
without a checkpoint (`beamserve.kvwire.codec.ApproxCodec`, one token per regex piece:
a word, one punctuation mark or a run of whitespace): ``k`` words each followed by one space
(``2k`` pieces), led by one ``.`` when `block_tokens` is odd. Blocks never merge pieces across
their boundary (each ends with whitespace, none starts with it). Words are derived from
``shake256(salt | session file | hash id)`` — each a ``w`` and 4 hex digits, a vocabulary of
65,536 words, 3 characters per token — so equal hash ids of one session give
equal text, hash ids of different sessions do not collide (they are local to a file; two
blocks' texts are equal with probability 2⁻¹²⁸ at the default scale), and a turn whose hash
ids extend an earlier turn's has a text that extends that turn's text. `block_tokens` is the
trace's 64 scaled by `--token-scale` (default 0.25 → 16). Rendered by the worker, a prompt is
``len(hash_ids) · block_tokens`` tokens plus the chat wrapper's 20.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TRACE_BLOCK_SIZE = 64
DEFAULT_TRACE_DIR = Path("data/traces/claude-code")


class WorkloadError(ValueError):
    """A trace or option that cannot make a workload; the message names the fix."""


def default_trace_dir() -> Path:
    """The bundled claude-code sessions: beside the source tree, else under the cwd."""
    here = Path(__file__).resolve().parents[2] / DEFAULT_TRACE_DIR
    return here if here.is_dir() else DEFAULT_TRACE_DIR


@dataclass(frozen=True, slots=True)
class Turn:
    """One request of a session: its trace hash ids, sizes, and the pause before it (s)."""

    index: int
    hash_ids: tuple[int, ...]
    trace_in: int
    trace_out: int
    max_tokens: int
    think_s: float
    kind: str = "n"


@dataclass(frozen=True, slots=True)
class Session:
    name: str
    turns: tuple[Turn, ...]

    @property
    def requests(self) -> int:
        return len(self.turns)


def held_out(files: Sequence[Path], n: int | None) -> list[Path]:
    """The subset of the module docstring (all files when `n` is None or ≥ their number)."""
    ordered = sorted(files)
    if n is None or n >= len(ordered):
        return ordered
    if n < 1:
        raise WorkloadError(f"--sessions {n}: give at least 1")
    f = len(ordered)
    return [ordered[(2 * i + 1) * f // (2 * n)] for i in range(n)]


def session_files(files: Sequence[Path], n: int | None) -> list[tuple[Path, str]]:
    """(file, session name) of `--sessions n` (module docstring): the held-out subset up to
    the number of files, whole copies of the set and a held-out remainder past it."""
    ordered = sorted(files)
    if n is None or n <= len(ordered):
        return [(f, f.stem) for f in held_out(ordered, n)]
    rounds, rest = divmod(n, len(ordered))
    out = [(f, f.stem if k == 0 else f"{f.stem}~{k}") for k in range(rounds) for f in ordered]
    out += [(f, f"{f.stem}~{rounds}") for f in held_out(ordered, rest)] if rest else []
    return out


def block_tokens_for(token_scale: float) -> int:
    """Tokens per trace block after scaling (at least 2: one word and its space)."""
    bt = round(TRACE_BLOCK_SIZE * token_scale)
    if bt < 2:
        raise WorkloadError(
            f"--token-scale {token_scale:g}: a 64-token block would be {bt} tokens; give ≥ 1/32"
        )
    return bt


def _pause(raw: list[dict[str, Any]], k: int) -> float:
    r = raw[k]
    if r.get("think_time") is not None:
        return max(float(r["think_time"]), 0.0)
    if k > 0 and "t" in r and "t" in raw[k - 1] and "api_time" in raw[k - 1]:
        return max(float(r["t"]) - float(raw[k - 1]["t"]) - float(raw[k - 1]["api_time"]), 0.0)
    return 0.0


def load_sessions(
    path: Path,
    *,
    sessions: int | None = None,
    token_scale: float = 0.25,
    output_cap: int = 64,
    think_scale: float = 1.0,
    max_think_s: float = 60.0,
    max_turns: int | None = None,
) -> list[Session]:
    """The sessions of a claude-code directory (or one file), scaled (module docstring)."""
    if path.is_dir():
        files = sorted(path.glob("*.json"))
        if not files:
            raise WorkloadError(f"{path}: no *.json session files; point --trace at claude-code/")
    elif path.is_file():
        files = [path]
    else:
        raise WorkloadError(f"{path}: no such file or directory (--trace)")
    out: list[Session] = []
    for file, name in session_files(files, sessions):
        try:
            data = json.loads(file.read_text())
            raw: list[dict[str, Any]] = list(data["requests"])
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise WorkloadError(f"{file}: not a claude-code session file ({exc})") from exc
        if int(data.get("block_size", TRACE_BLOCK_SIZE)) != TRACE_BLOCK_SIZE:
            raise WorkloadError(f"{file}: block_size {data.get('block_size')}; expected 64")
        if max_turns is not None:
            raw = raw[:max_turns]
        turns = []
        for k, r in enumerate(raw):
            try:
                ids = tuple(int(h) for h in r["hash_ids"])
                t_in, t_out = int(r["in"]), int(r["out"])
            except (KeyError, TypeError, ValueError) as exc:
                raise WorkloadError(f"{file}: request {k}: missing or bad field ({exc})") from exc
            turns.append(
                Turn(
                    index=k,
                    hash_ids=ids,
                    trace_in=t_in,
                    trace_out=t_out,
                    max_tokens=max(1, min(output_cap, round(t_out * token_scale))),
                    think_s=min(_pause(raw, k) * think_scale, max_think_s) if k else 0.0,
                    kind=str(r.get("type", "n")),
                )
            )
        if turns:
            out.append(Session(name, tuple(turns)))
    return out


class PromptBuilder:
    """Block texts and chat messages (module docstring). Block texts are cached."""

    def __init__(self, block_tokens: int, salt: str = "") -> None:
        if block_tokens < 2:
            raise WorkloadError(f"block_tokens {block_tokens}: must be at least 2")
        self.block_tokens = block_tokens
        self.salt = salt
        self._cache: dict[tuple[str, int], str] = {}

    def block_text(self, namespace: str, hash_id: int) -> str:
        key = (namespace, hash_id)
        text = self._cache.get(key)
        if text is None:
            words = self.block_tokens // 2
            seed = f"{self.salt}|{namespace}|{hash_id}".encode()
            hexes = hashlib.shake_256(seed).hexdigest(2 * words)
            lead = "." if self.block_tokens % 2 else ""
            text = lead + "".join(f"w{hexes[4 * j : 4 * j + 4]} " for j in range(words))
            self._cache[key] = text
        return text

    def text(self, namespace: str, hash_ids: Sequence[int]) -> str:
        return "".join(self.block_text(namespace, h) for h in hash_ids)

    def messages(self, namespace: str, hash_ids: Sequence[int]) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.text(namespace, hash_ids)}]

    def prompt_tokens(self, hash_ids: Sequence[int]) -> int:
        """Tokens of the text alone (the worker's chat wrapper adds a constant)."""
        return len(hash_ids) * self.block_tokens


def synthetic_prompt(builder: PromptBuilder, tokens: int, namespace: str) -> list[dict[str, str]]:
    """A single-message prompt of about `tokens` tokens (wire-overhead measurement)."""
    blocks = max(1, tokens // builder.block_tokens)
    return builder.messages(namespace, range(blocks))
