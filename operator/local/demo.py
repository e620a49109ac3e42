"""`beamserve demo`: the product on one machine — a tiny real Beam, disaggregated, on agent traffic.

Brings up `manifests/examples/local-ref.yaml` with `LocalStack` (prefill TP2 → decode TP1 over
NIXL, the router in front; the checkpoint is made first when missing), replays a few
claude-code sessions (`data/traces/claude-code`) through the router's OpenAI API with the
openai SDK, streaming, and prints per turn:

* **TTFT**: first streamed content byte after the request was sent (the ref engine computes a
  request's tokens before it streams them, so this includes its whole decode);
* **cached**: prompt tokens some worker found in its prefix cache this turn — the response's
  `usage.prompt_tokens_details.cached_tokens`, or, when the worker that answered reports none
  (a decode worker fed by a prefill worker), the growth of the workers'
  `vllm:prefix_cache_hits_total`;
* **route**: the router's decision from its `x-beamserve-route` header — `P/D` (the prompt
  was prefilled on a prefill worker and its KV moved), `warm` (sent to a worker the router
  expects to hold the prefix), `local` (the decode worker prefills it itself) — with the
  router's reason;
* **KV moved**: the growth of the decode workers' `beamserve_worker_kv_transfer_bytes_total`.

Then a summary, and everything is shut down. Exit 0 when every turn was answered.

Scaling. A trace turn is `len(hash_ids)` 64-token blocks (15K–30K tokens); the tiny Beam holds
4,096. Each block becomes a short text of corpus words derived from (session, hash id) — equal
ids, equal text, so a turn that extends an earlier one extends its text — and the words per
block are chosen so the longest replayed turn fits `PROMPT_BUDGET` tokens under the model's
own tokenizer (`scale_blocks`). A session is a conversation (`Conversation`): a turn that
extends the previous one is sent as the history, the previous answer, and a user message with
the new blocks; each prompt is padded to whole KV pages (`pad_to_page`) so that the next
turn's prefix can be served from the prefill worker's cache (sliding-window pages are
resident only near a prompt's end). No session header is sent: the router derives each
session from the conversation's opening, as it does for any client that names none.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from beamserve.log import progress_bar

PROMPT_BUDGET = 3000
"""Tokens the longest replayed prompt may have (the tiny Beam's context is 4,096)."""
DEFAULT_SESSIONS = ("trace_0002", "trace_0024", "trace_0028")
DEFAULT_TURNS = 4
MAX_TOKENS = 8


def repo_file(relative: str) -> Path:
    """A file of the source tree (the editable install's), else relative to the cwd."""
    import beamserve.operator as op

    here = Path(op.__file__).resolve().parents[1] / relative
    return here if here.exists() else Path(relative)


# -- the workload (pure) ----------------------------------------------------------------------


@dataclass(frozen=True)
class DemoTurn:
    session: str
    turn: int
    hash_ids: tuple[int, ...]


def load_turns(trace_dir: Path, sessions: Sequence[str], turns: int) -> list[DemoTurn]:
    """The first `turns` requests of each named session file, in session order."""
    import json

    out: list[DemoTurn] = []
    for name in sessions:
        path = trace_dir / f"{name}.json"
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise SystemExit(f"{path}: cannot read the session ({exc}); see data/traces") from None
        for k, r in enumerate(data["requests"][:turns]):
            out.append(DemoTurn(name, k + 1, tuple(int(h) for h in r["hash_ids"])))
    return out


_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]{2,}")


def vocabulary() -> list[str]:
    """Distinct words of the corpus the tiny BPE was trained on (so they tokenize short)."""
    from beamserve.workers.ref.corpus import CORPUS

    return sorted(set(_WORD.findall(CORPUS)))


def block_text(session: str, hash_id: int, words: int, vocab: Sequence[str]) -> str:
    """`words` corpus words derived from (session, hash id), one line."""
    digest = hashlib.shake_256(f"{session}|{hash_id}".encode()).digest(2 * words)
    picks = [vocab[int.from_bytes(digest[2 * i : 2 * i + 2], "big") % len(vocab)]
             for i in range(words)]  # fmt: skip
    return " ".join(picks) + "\n"


def prompt_text(turn: DemoTurn, words: int, vocab: Sequence[str]) -> str:
    return "".join(block_text(turn.session, h, words, vocab) for h in turn.hash_ids)


def scale_blocks(
    turns: Sequence[DemoTurn], count_tokens: Callable[[str], int], vocab: Sequence[str]
) -> int:
    """The most words per block (≤ 8) for which the longest turn fits `PROMPT_BUDGET`."""
    longest = max(turns, key=lambda t: len(t.hash_ids))
    for words in range(8, 0, -1):
        if count_tokens(prompt_text(longest, words, vocab)) <= PROMPT_BUDGET:
            return words
    raise SystemExit(
        f"{longest.session} turn {longest.turn}: {len(longest.hash_ids)} blocks do not fit "
        f"{PROMPT_BUDGET} tokens even at one word per block; pick shorter turns (--turns)"
    )


Messages = list[dict[str, str]]


class Conversation:
    """One agent session as chat messages: a turn whose trace blocks extend the previous
    turn's continues the conversation (history, the previous answer, then a user message with
    the new blocks); any other turn (a sub-agent, a compaction) starts a new one."""

    def __init__(self) -> None:
        self.history: Messages = []
        self.blocks: tuple[int, ...] = ()

    def next_messages(self, turn: DemoTurn, words: int, vocab: Sequence[str]) -> Messages:
        ids = turn.hash_ids
        if self.blocks and ids[: len(self.blocks)] == self.blocks:
            new = ids[len(self.blocks) :]
        else:
            self.history, new = [], ids
        self.blocks = ids
        text = "".join(block_text(turn.session, h, words, vocab) for h in new)
        return [*self.history, {"role": "user", "content": text or "continue\n"}]

    def answered(self, messages: Messages, answer: str) -> None:
        self.history = [*messages, {"role": "assistant", "content": answer}]


def pad_to_page(messages: Messages, count: Callable[[Messages], int], page: int) -> Messages:
    """`messages` with a filler of " ." and " ," appended to the last one so that the rendered
    prompt is a whole number of KV pages (unchanged if no filler of < `page` of each does).
    Why: a sliding-window prefix hit resumes only where the window's pages are resident, and
    the next turn's shared prefix is exactly this prompt; page-aligned, the prefill worker's
    cache can serve all of it."""
    for a in range(page):
        for b in range(page):
            out = [dict(m) for m in messages]
            out[-1]["content"] += " ." * a + " ," * b
            if count(out) % page == 0:
                return out
    return [dict(m) for m in messages]


@dataclass(frozen=True)
class RouteHeader:
    decode: str
    prefill: str | None
    reason: str
    hit_kind: str
    hit_blocks: int

    @property
    def decision(self) -> str:
        """`P/D`, `warm` or `local` (see the module docstring)."""
        if self.prefill:
            return "P/D"
        if self.hit_kind != "none" and self.hit_blocks > 0:
            return "warm"
        return "local"


def parse_route_header(value: str) -> RouteHeader:
    """`decode=A; prefill=B|-; reason=R; hit=KIND:N/M blocks; band=…` (router/app.py)."""
    fields = dict(part.strip().split("=", 1) for part in value.split(";") if "=" in part)
    kind, _, rest = fields.get("hit", "none:0/0").partition(":")
    blocks = int(rest.split("/", 1)[0] or 0)
    prefill = fields.get("prefill", "-")
    return RouteHeader(
        decode=fields.get("decode", "?"),
        prefill=None if prefill in ("-", "") else prefill,
        reason=fields.get("reason", ""),
        hit_kind=kind,
        hit_blocks=blocks,
    )


@dataclass(frozen=True)
class TurnResult:
    session: str
    turn: int
    prompt_tokens: int
    ttft_s: float
    cached_tokens: int
    route: RouteHeader
    kv_bytes: float
    text: str


# -- running it -------------------------------------------------------------------------------


async def _scrape(urls: Sequence[str]) -> dict[str, dict[str, float]]:
    import httpx
    from beamserve.operator.local.status import parse_metrics

    async with httpx.AsyncClient(timeout=5) as c:
        texts = await asyncio.gather(*(c.get(u + "/metrics") for u in urls))
    return {u: parse_metrics(r.text) for u, r in zip(urls, texts, strict=True)}


def _delta(after: dict[str, dict[str, float]], before: dict[str, dict[str, float]],
           name: str, urls: Sequence[str]) -> float:  # fmt: skip
    return sum(after[u].get(name, 0.0) - before[u].get(name, 0.0) for u in urls)


async def _turn(client: Any, stack: Any, turn: DemoTurn, messages: Messages) -> TurnResult:
    workers = [url for _, url in stack.workers]
    decoders = [url for role, url in stack.workers if role in ("decode", "both")]
    before = await _scrape(workers)
    t0 = time.perf_counter()
    ttft = None
    usage = None
    pieces: list[str] = []
    async with client.chat.completions.with_streaming_response.create(
        model="beam",
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ) as response:
        route = parse_route_header(response.headers.get("x-beamserve-route", ""))
        async for chunk in await response.parse():
            if chunk.choices and chunk.choices[0].delta.content:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                pieces.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
    after = await _scrape(workers)
    reported = 0
    prompt = 0
    if usage is not None:
        prompt = usage.prompt_tokens
        details = usage.prompt_tokens_details
        reported = int(details.cached_tokens or 0) if details is not None else 0
    hits = _delta(after, before, "vllm:prefix_cache_hits_total", workers)
    return TurnResult(
        session=turn.session,
        turn=turn.turn,
        prompt_tokens=prompt,
        ttft_s=ttft if ttft is not None else time.perf_counter() - t0,
        cached_tokens=max(reported, int(hits)),
        route=route,
        kv_bytes=_delta(after, before, "beamserve_worker_kv_transfer_bytes_total", decoders),
        text="".join(pieces),
    )


def _short(worker: str) -> str:
    """`local-ref-decode-9107cfb2-0` → `decode-0`."""
    m = re.search(r"(prefill|decode|both)-[0-9a-f]{8}-(\d+)$", worker)
    return f"{m.group(1)}-{m.group(2)}" if m else worker


def _route_cell(r: RouteHeader) -> str:
    where = f"{_short(r.prefill)} → {_short(r.decode)}" if r.prefill else _short(r.decode)
    colour = {"P/D": "magenta", "warm": "green", "local": "yellow"}[r.decision]
    return f"[{colour}]{r.decision}[/] {where} ({r.reason})"


def turn_table(results: Sequence[TurnResult]) -> Table:
    table = Table(title="turns", title_justify="left")
    for col in ("session", "turn", "prompt tok", "TTFT", "cached tok", "route", "KV moved"):
        table.add_column(col, justify="left" if col in ("session", "route") else "right")
    for r in results:
        table.add_row(
            r.session,
            str(r.turn),
            f"{r.prompt_tokens:,}",
            f"{r.ttft_s * 1000:,.0f} ms",
            f"{r.cached_tokens:,}",
            _route_cell(r.route),
            f"{r.kv_bytes / 1e6:.2f} MB" if r.kv_bytes else "-",
        )
    return table


def summary_lines(results: Sequence[TurnResult]) -> list[str]:
    by: dict[str, list[TurnResult]] = {}
    for r in results:
        by.setdefault(r.route.decision, []).append(r)
    prompt = sum(r.prompt_tokens for r in results)
    cached = sum(r.cached_tokens for r in results)
    lines = [
        f"turns:        {len(results)} in {len({r.session for r in results})} sessions",
        "decisions:    "
        + ", ".join(
            f"{k} {len(v)} (mean TTFT {1000 * sum(x.ttft_s for x in v) / len(v):,.0f} ms)"
            for k, v in sorted(by.items())
        ),
        f"cached:       {cached:,} of {prompt:,} prompt tokens "
        f"({100 * cached / prompt if prompt else 0:.0f}%)",
        f"KV moved:     {sum(r.kv_bytes for r in results) / 1e6:.2f} MB over "
        f"{sum(1 for r in results if r.kv_bytes)} transfers (prefill TP2 → decode TP1)",
    ]
    return lines


async def run_demo(
    console: Console,
    *,
    spec: Path,
    trace_dir: Path,
    sessions: Sequence[str] = DEFAULT_SESSIONS,
    turns: int = DEFAULT_TURNS,
    state_dir: Path | None = None,
) -> int:
    from beamserve.operator.local.stack import LocalStack, load_spec
    from openai import AsyncOpenAI

    started = time.perf_counter()
    bd = load_spec(spec)
    host = bd.spec.model.source.host_path
    if host is not None and not Path(host.path, "config.json").exists():
        with console.status(f"making the tiny Beam checkpoint in {host.path}"):
            await asyncio.to_thread(_make_tiny, Path(host.path))
        console.print(f"made the tiny Beam checkpoint: {host.path}")
    model_dir = Path(host.path) if host is not None else None
    workload = load_turns(trace_dir, sessions, turns)
    vocab = vocabulary()
    count, count_messages = _token_counters(model_dir)
    words = scale_blocks(workload, count, vocab)
    page = bd.spec.kv.page_size
    console.print(
        f"workload: {len(workload)} turns of {len(sessions)} claude-code sessions "
        f"({', '.join(sessions)}) from {trace_dir}; each 64-token trace block becomes "
        f"{words} word(s) of text, so the longest turn fits {PROMPT_BUDGET:,} of the tiny "
        "Beam's 4,096 tokens"
    )
    with progress_bar(console) as progress:
        n_procs = 3
        task = progress.add_task(f"starting {spec.name}", total=n_procs)

        def on_event(event: str, data: dict[str, Any]) -> None:
            if event == "ready":
                progress.advance(task)
                progress.update(task, description=f"ready: {_short(str(data['name']))}")

        stack = LocalStack(spec, state_dir, on_event=on_event)
        await stack.start()
        progress.update(task, completed=n_procs, description="stack up")
    try:
        from beamserve.operator.local.status import scrape, status_table

        state = stack.snapshot()
        console.print(status_table(str(state["name"]), await scrape(state), stack.router_url))
        client = AsyncOpenAI(base_url=stack.router_url + "/v1", api_key="local", max_retries=0)
        results: list[TurnResult] = []
        with progress_bar(console) as progress:
            task = progress.add_task("replaying", total=len(workload))
            talks: dict[str, Conversation] = {}
            for turn in workload:
                progress.update(task, description=f"{turn.session} turn {turn.turn}")
                talk = talks.setdefault(turn.session, Conversation())
                messages = pad_to_page(talk.next_messages(turn, words, vocab), count_messages, page)
                r = await _turn(client, stack, turn, messages)
                talk.answered(messages, r.text)
                results.append(r)
                progress.console.print(
                    f"  {r.session} #{r.turn}: {r.prompt_tokens:,} tok, TTFT "
                    f"{r.ttft_s * 1000:,.0f} ms, cached {r.cached_tokens:,}, "
                    f"{_route_cell(r.route)}, KV {r.kv_bytes / 1e6:.2f} MB"
                )
                progress.advance(task)
        await client.close()
        console.print(turn_table(results))
        console.rule("summary")
        for line in summary_lines(results):
            console.print(line, soft_wrap=True)
        state = stack.snapshot()
        console.print(status_table(str(state["name"]), await scrape(state), stack.router_url))
    finally:
        with console.status("shutting down"):
            await stack.stop()
    console.print(f"done in {time.perf_counter() - started:.0f} s; every process stopped")
    return 0


def _make_tiny(path: Path) -> None:
    from beamserve.workers.ref.checkpoint import make_tiny

    make_tiny(path, seed=0)


def _token_counters(
    model_dir: Path | None,
) -> tuple[Callable[[str], int], Callable[[Messages], int]]:
    """Token counts of a text and of rendered chat messages, as the workers count them."""
    from beamserve.kvwire.codec import load_codec

    codec = load_codec(model_dir)
    return (
        lambda text: len(codec.encode(text)),
        lambda messages: len(codec.encode(codec.render(messages))),
    )


def demo_main(args: Any, console: Console) -> int:
    from beamserve.operator.local.stack import StackError

    from beamserve import log

    if args.log_level is None:  # the tables tell the story; each process's log is in its file
        log.setup("warning")
    try:
        return asyncio.run(
            run_demo(
                console,
                spec=args.spec or repo_file("manifests/examples/local-ref.yaml"),
                trace_dir=args.trace or repo_file("data/traces/claude-code"),
                sessions=args.sessions,
                turns=args.turns,
                state_dir=args.state_dir,
            )
        )
    except StackError as exc:
        console.print(f"[red]beamserve demo:[/] {exc}")
        return 1
    except KeyboardInterrupt:
        return 130
