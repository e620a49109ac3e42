"""Trace loaders for `beamserve bench route`: agentic sessions and open-loop request streams.

Two sets (bundled in ``data/traces/``, see its README):

* **claude-code** (a directory of ``trace_*.json``, one session per file, 64-token blocks, hash
  ids local to a file) → a *closed-loop* `Trace`: one `TraceSession` per file, its requests in
  order, each with the agent's `think_time_s` before the next one. Hash ids are namespaced per
  file: block id ``h`` of the file at sorted position ``i`` becomes ``base(i) + h`` with
  ``base`` the well-mixed 63-bit `session_hash_base` the simulator's workloads use, so two
  sessions never share a prefix by accident.
* **Mooncake** (``*.jsonl``, one request per line, 512-token blocks, ids global to the file) →
  an *open-loop* `Trace` of `TraceRequest`s at their timestamps (ms → s).

Block size. The router's index and the engines' prefix caches key on 64-token pages (Beam's page
size, `CoreConfig.geometry`), so every request carries its prompt as 64-token block hashes
(`TraceRequest.block_hashes`, ``prompt_tokens // 64`` of them). A Mooncake 512-token block id
``h`` is *expanded* into the 8 derived ids ``MOONCAKE_BASE + 8·h + j`` (j = 0..7) for its
64-token sub-blocks: equal 512-token ids give equal sub-block ids, so prefix sharing is kept
exactly, and a prompt's trailing partial 512-block contributes only its full 64-token pages.
The trace's own block ids are kept beside them (`TraceRequest.trace_blocks`) so that block-hit
metrics count in the trace's unit (512-token blocks for Mooncake), comparable with the figures
published for these traces (oracle 0.366, round-robin 0.136 on the conversation trace).

Session identity. claude-code sessions are the files (the harness sends a session header).
Mooncake lines carry no session; the router derives one from the conversation's opening
(DESIGN.md §3), which for a block trace is its first two blocks: every line shares block 0 (the
system prompt), block 1 starts the conversation. Lines of one block have no session.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from beamserve.workers.sim.workload import session_hash_base

INDEX_BLOCK_SIZE = 64  # Beam's KV page size: the block size of the index and the engines
MOONCAKE_BLOCK_SIZE = 512
MOONCAKE_BASE = 1 << 62  # derived 64-token ids live above every namespaced claude-code id range

TraceKind = Literal["closed", "open"]


class TraceError(ValueError):
    """A trace that cannot be loaded; the message names the file, the line and the fix."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace.

    `key`: how the assignments file names it (``trace_0002#3`` = session file, turn;
    ``conversation_trace.jsonl:17`` = Mooncake line, 1-based). `session`: the session id the
    router sees (None: none). `turn`: 1-based position in its session (1 = first turn).
    `block_hashes`: the prompt's 64-token block hashes (index and engine unit).
    `trace_blocks`: the trace's own (namespaced) block ids, for block-hit metrics.
    `arrival_s`: trace time of an open-loop request (s); `think_time_s`: the agent's pause after
    this request's answer before the session's next request (closed loop).
    """

    key: str
    session: str | None
    turn: int
    prompt_tokens: int
    output_tokens: int
    block_hashes: tuple[int, ...]
    trace_blocks: tuple[int, ...]
    arrival_s: float = 0.0
    think_time_s: float = 0.0


@dataclass(frozen=True, slots=True)
class TraceSession:
    """A closed-loop session: its requests in order."""

    name: str
    requests: tuple[TraceRequest, ...]


@dataclass(frozen=True)
class Trace:
    """A loaded trace: `sessions` (closed loop) or `requests` (open loop, by arrival)."""

    name: str
    kind: TraceKind
    trace_block_size: int
    sessions: tuple[TraceSession, ...] = ()
    requests: tuple[TraceRequest, ...] = ()

    @property
    def all_requests(self) -> tuple[TraceRequest, ...]:
        """Every request: sessions concatenated (closed) or by arrival (open)."""
        if self.kind == "open":
            return self.requests
        return tuple(r for s in self.sessions for r in s.requests)

    @property
    def span_s(self) -> float:
        """Trace time from the first to the last open-loop arrival (0 for closed loops)."""
        if self.kind != "open" or not self.requests:
            return 0.0
        return self.requests[-1].arrival_s - self.requests[0].arrival_s


def load_trace(path: Path, *, sessions: int | None = None, requests: int | None = None) -> Trace:
    """A claude-code directory (or one session file) or a Mooncake ``.jsonl`` file.

    `sessions`: keep the first N session files (sorted by name); `requests`: keep the first N
    requests (Mooncake lines, or requests in session order for claude-code: sessions are cut
    at the limit). Raises `TraceError`.
    """
    if path.is_dir() or path.suffix == ".json":
        return load_claude_code(path, sessions=sessions, requests=requests)
    if path.suffix == ".jsonl":
        return load_mooncake(path, requests=requests)
    raise TraceError(
        f"{path}: not a trace; give a claude-code directory (trace_*.json) or a Mooncake .jsonl"
    )


def _session_files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(path.glob("*.json"))
        if not files:
            raise TraceError(f"{path}: no *.json session files; point --trace at claude-code/")
        return files
    if not path.exists():
        raise TraceError(f"{path}: no such file or directory")
    return [path]


def load_claude_code(
    path: Path, *, sessions: int | None = None, requests: int | None = None
) -> Trace:
    """claude-code sessions (see the module docstring)."""
    files = _session_files(path)
    if sessions is not None:
        files = files[:sessions]
    out: list[TraceSession] = []
    left = requests
    for index, file in enumerate(files):
        if left is not None and left <= 0:
            break
        try:
            data = json.loads(file.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise TraceError(f"{file}: unreadable session file ({exc})") from exc
        block_size = int(data.get("block_size", INDEX_BLOCK_SIZE))
        if block_size != INDEX_BLOCK_SIZE:
            raise TraceError(
                f"{file}: block_size {block_size}; this loader expects {INDEX_BLOCK_SIZE}-token "
                "blocks (the engines' page size)"
            )
        base = session_hash_base(index)
        name = file.stem
        reqs: list[TraceRequest] = []
        raw = data.get("requests", [])
        for k, r in enumerate(raw):
            if left is not None and len(reqs) >= left:
                break
            try:
                prompt = int(r["in"])
                ids = [base + int(h) for h in r["hash_ids"]]
            except (KeyError, TypeError, ValueError) as exc:
                raise TraceError(f"{file}: request {k}: missing or bad field ({exc})") from exc
            full = ids[: prompt // INDEX_BLOCK_SIZE]
            reqs.append(
                TraceRequest(
                    key=f"{name}#{k + 1}",
                    session=name,
                    turn=k + 1,
                    prompt_tokens=max(prompt, 1),
                    output_tokens=max(int(r.get("out", 1)), 1),
                    block_hashes=_distinct(full),
                    trace_blocks=tuple(ids),
                    think_time_s=max(float(r.get("think_time", 0.0) or 0.0), 0.0),
                )
            )
        if left is not None:
            left -= len(reqs)
        if reqs:
            out.append(TraceSession(name, tuple(reqs)))
    return Trace(path.name or str(path), "closed", INDEX_BLOCK_SIZE, sessions=tuple(out))


def expand_mooncake_block(block_id: int) -> tuple[int, ...]:
    """The 8 derived 64-token ids of one 512-token Mooncake block id."""
    first = MOONCAKE_BASE + 8 * block_id
    return tuple(range(first, first + MOONCAKE_BLOCK_SIZE // INDEX_BLOCK_SIZE))


def load_mooncake(path: Path, *, requests: int | None = None) -> Trace:
    """Mooncake JSONL (see the module docstring); arrivals in seconds from the first line."""
    if not path.exists():
        raise TraceError(f"{path}: no such file")
    out: list[TraceRequest] = []
    t0: float | None = None
    with path.open() as fh:
        for lineno, line in enumerate(fh, start=1):
            if requests is not None and len(out) >= requests:
                break
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                ts = float(r["timestamp"]) / 1000.0
                prompt = int(r["input_length"])
                ids = tuple(int(h) for h in r["hash_ids"])
                output = int(r["output_length"])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                raise TraceError(f"{path}:{lineno}: bad Mooncake line ({exc})") from exc
            t0 = ts if t0 is None else t0
            expanded: list[int] = []
            for h in ids:
                expanded.extend(expand_mooncake_block(h))
            out.append(
                TraceRequest(
                    key=f"{path.name}:{lineno}",
                    session=f"m{ids[0]}-{ids[1]}" if len(ids) >= 2 else None,
                    turn=0,  # filled below
                    prompt_tokens=max(prompt, 1),
                    output_tokens=max(output, 1),
                    block_hashes=_distinct(expanded[: prompt // INDEX_BLOCK_SIZE]),
                    trace_blocks=ids,
                    arrival_s=ts - t0,
                )
            )
    out.sort(key=lambda r: r.arrival_s)  # stable: equal timestamps keep file order
    turns: dict[str, int] = {}
    numbered = []
    for r in out:
        turn = 1
        if r.session is not None:
            turn = turns.get(r.session, 0) + 1
            turns[r.session] = turn
        numbered.append(_with_turn(r, turn))
    return Trace(path.name, "open", MOONCAKE_BLOCK_SIZE, requests=tuple(numbered))


def _with_turn(r: TraceRequest, turn: int) -> TraceRequest:
    return TraceRequest(
        r.key,
        r.session,
        turn,
        r.prompt_tokens,
        r.output_tokens,
        r.block_hashes,
        r.trace_blocks,
        r.arrival_s,
        r.think_time_s,
    )


def _distinct(ids: Sequence[int]) -> tuple[int, ...]:
    """The leading run of distinct ids: an engine keys one page per id, so a repeated id (never
    seen in these traces, but a malformed slice could have one) ends the cacheable chain."""
    seen: set[int] = set()
    for i, h in enumerate(ids):
        if h in seen:
            return tuple(ids[:i])
        seen.add(h)
    return tuple(ids)
