"""The prefill in pieces: a continuing turn's long new part is prefilled a piece at a time, so the
users decoding beside it on its worker keep their pace.

An engine with chunked prefill puts up to its step budget of prefill tokens (8,192 on the
sim's `h200-bf16-tp8` profile, vLLM's `max_num_batched_tokens`) into each step beside the
decodes. A continuing turn's new part of a few thousand tokens therefore makes one or two
steps several times longer than a decode step, for every user streaming from that worker:
long enough to take a user who was just keeping 20 tokens/s below it. Smaller steps would
spare them, but the budget is the engine's setting, for all traffic. The router can pace one
request itself, over the wire, with any engine that caches prefixes (vLLM's automatic prefix
caching, SGLang's radix cache, the `sim`):

    new      = the request's uncached tokens (what routing expects its worker to prefill)
    if new ≥ prefill_piece_min_tokens (and it prefills on its decode worker, not split):
        cached = prompt − new
        for n in cached + piece, cached + 2·piece, … (each rounded down to a whole block,
                                                        and below the prompt's length):
            send the prompt's first n tokens (max_tokens 1, not streamed), wait for the answer
        send the request itself (its prompt is cached up to the last piece)

A new session's first turn that the prefill stage spilled to a decode worker
(`FlowConfig.prefill_spill_after_s`) is prefilled there the same way, from its first token: it
is the same long prefill beside the same users. On virtual time (`scripts/knee-search.py`, 128
agents, spill after 0.3 s with the stage's bounds) the pool's run took 136.1 s with spilled
first turns in pieces against 141.0 s without, for 13.14 against 13.36 r/s of goodput (one seed;
the gateway-like `least-queued`: 133.1 s, 6.56 r/s).

Each piece adds at most `prefill_piece_tokens` of prefill to the worker's steps, the one-token
answers are dropped, and the request itself finds all but its last piece cached. Each answered
piece leaves the worker's books at once (`LoadBook.prefilled`): the rules that read them — the
spill's room, the pace hold, the saturation gate — see what still waits to be prefilled there,
not the whole new part until the request's first token. (Over HTTP at 128 agents this did not
move the throughput, nor the share of pace holds that run out: docs/bench/agentic.md, "Where the
128-agent gap is not".) The pieces go to `/v1/completions` as token ids
(`RouteRequest.token_ids`: the prompt as the router's codec renders and tokenizes it, which is
the engine's in precise mode — a `--tokenizer` checkpoint — and the `sim`'s own tokenizer-free
codec in approximate mode). If the router's tokens were not the engine's, the pieces would cost
their prefill and save nothing: the request's own answer says how much was cached, and the
router counts pieces that missed (`beamserve_router_prefill_pieces_missed_total`). A piece that
fails (an error, a timeout, a refusal) ends the pieces; the request itself goes on as it would
have without them.

It costs the request's TTFT a round trip and an engine step per piece (a 4,096-token new part
in 1,024-token pieces: four steps, ≈ 0.1–0.2 s at the knee), and the worker one request per
piece; the prompt's bytes go to the worker once per piece.

Measured on virtual time first (`scripts/knee-search.py --seeds 3`, the 2 prefill + 2 decode
pool at 64 agents): row `pd-2p2d-pieces-1k-4k` 15.97 r/s of goodput against 15.39 without the
pieces (`pd-2p2d-legbooks-window-2`), slow continuing turns 24 instead of 58 (seed 0); pieces
of 512 or 768 tokens, or from 1,024 or 2,048 new tokens on, did no better (one-off variants).
Then over HTTP beside the gateways on the same workers (docs/bench/agentic.md, "The prefill in
pieces"): in one run with and without it, 15.48 against 14.65 r/s, slow continuing turns 27
against 66; with it, the pool's goodput 1.25–1.28 × the best gateway's over four runs.
Off by default: it adds requests and TTFT to the long turns it paces, for the users beside
them; it pays where those users are many and the engine's step budget is large.

**First turns beside live sessions** (`prefill_first_pieces`, on). An engine schedules the
requests it is already running before those that wait: a long first turn being prefilled in
chunks takes each step's whole budget until its last chunk, and a continuing turn that arrives
on that worker meanwhile — a session that was thinking between turns there — waits for all of
it (a 75K-token prompt: 2.5 s on `h200-bf16-tp8`), though its own prefill is a few hundred
tokens. The pool's placement avoids this where it can (a new session goes to a worker where no
session rests); where it cannot, a first turn that prefills on its decode worker while other
sessions live there (a request of theirs past its first token, or a session resting between
turns: `LoadBook.lives_beside`) is sent in pieces, as above from its first token: a turn that
arrives meanwhile waits for one piece at most, and goes before the next. Other first turns
still in their prefill there do not count: in pieces beside them, the first turns of a burst
would share the worker turn by turn and all finish late, where the engine's order finishes
them one after the other (at 32 agents, counting them, the burst's first turns took 2.64 s on
average against the peers' 1.73–1.80; docs/bench/agentic.md). A worker with nobody else on it
gets the prompt whole.

The size of a piece (`first_piece_size`) is the worker's own step budget — what it reported
(`Endpoint.step_budget`: vLLM's `max_num_batched_tokens`, SGLang's `chunked_prefill_size`) —
less room for the decodes that share the step (an engine fills its budget with the running
decodes first: a piece of the whole budget beside eight streams would take a second step for
its last eight tokens), rounded down to a whole block. The room is `DECODE_TOKENS` for each
decode that may run there (`LoadBook.decodes_beside`: the sessions streaming or resting there,
the peers' bookings, at least what the last scrape saw running), rounded up to a block, and
`DECODE_ROOM` at most. A fixed `DECODE_ROOM` (256 tokens) made the pieces smaller than the
engine's own chunks: a 64K-token first turn beside one resting session took 9 steps where the
engine's chunks take 8, each step with its fixed cost (docs/bench/agentic.md, "Pieces as large
as the decodes beside them allow").
Each piece is then one engine step, and the first turn pays a request per piece plus the turns
it lets through: a 144K-token first turn in 18 pieces reached its first token 0.3–0.5 s later
than whole over HTTP in front of the sim (each piece's growing prompt is parsed again by the
worker).
`prefill_first_piece_tokens` sets the size instead; a worker that reported no budget, with no
size set, gets its first turns whole (the router does not guess an engine's budget).

What it moves (docs/bench/agentic.md, "First-turn pieces sized by the step budget"): the turns
it lets through start sooner but then decode beside the pieces, so the time is shifted, not
saved. Beside the gateways on the same workers, p90 TTFT was below every peer's at 4–16
agents in every round (0.34, 0.55, 0.62 s against the best peer's 0.36, 0.60, 0.85), for 0.5–2 %
of throughput at 4–8 agents against the same router without the pieces, and none at 16.

**Pieces yield to short turns** (`prefill_piece_yield_tokens`). A turn that reaches the worker
while a piece prefills waits for that piece, and then, without more, shares the next step with
the next piece: the router sends it the moment the last one is answered, so the short turn's
first token comes after a whole piece's step, not after its own short one (over HTTP at 4
agents, `trace_0048`'s eighth turn — 308 new tokens — took 0.39–0.44 s to its first token
beside a first turn in pieces, against 0.05 s through `sglang-router`). With the key set,
before each piece the router looks at its own requests on that worker
(`LoadBook.short_prefills`): while one with at most that many tokens of prefill left waits for
its first token, the piece waits too — and so does the request itself after its last piece,
whose remainder is one more piece — for `prefill_piece_yield_max_s` at most (the bound: a
turn whose first token never comes holds each piece that long, no more). Each wait is counted
(`beamserve_router_prefill_piece_yields_total`, `answered` or `bounded`). The pieced turn
pays the short turns' steps; a turn that comes from another router replica is not seen, and
its piece goes as before.

| key (`flow`) | default | meaning |
|---|---|---|
| `prefill_piece_min_tokens` | ``null`` | uncached tokens that make a turn one (null: off) |
| `prefill_piece_tokens` | ``1024`` | tokens of prefill per piece |
| `prefill_first_pieces` | ``true`` | a first turn beside live sessions goes in pieces |
| `prefill_first_piece_tokens` | ``null`` | … of this many tokens (null: the worker's step budget |
|  |  | less room for the decodes beside it) |
| `prefill_piece_yield_tokens` | ``null`` | a piece waits while a turn of at most this many |
|  |  | uncached tokens waits on its worker for a first token (null: off) … |
| `prefill_piece_yield_max_s` | ``0.5`` | … for this long at most |

Config example: ``flow: {prefill_piece_min_tokens: 4096, prefill_piece_tokens: 1024}``.
Only the HTTP front door sends pieces: the ext_proc picker sends nothing upstream itself.
"""

from __future__ import annotations

from dataclasses import dataclass

DECODE_ROOM = 256
"""Tokens of a step's budget left to the decodes beside a first turn's piece, at most: 256
streams at one token a step, or 32 at an 8-token speculative block."""
DECODE_TOKENS = 8
"""Tokens of a step one decode beside a piece may take (an 8-token speculative block)."""


@dataclass(frozen=True, slots=True)
class PrefillPieces:
    """The rule's values, as `FlowConfig.prefill_pieces` gives them."""

    min_tokens: int
    piece_tokens: int


def piece_cuts(prompt_tokens: int, uncached: int, piece: int, block: int) -> list[int]:
    """The prefix lengths to send before the request itself (module docstring): from the cached
    part on, every `piece` tokens, each rounded down to a multiple of `block`, strictly growing,
    each shorter than the prompt."""
    if piece <= 0 or block <= 0 or uncached <= 0:
        return []
    cached = max(prompt_tokens - uncached, 0)
    cuts: list[int] = []
    n = cached + piece
    while n < prompt_tokens:
        cut = n // block * block
        if cut > (cuts[-1] if cuts else cached) and cut < prompt_tokens:
            cuts.append(cut)
        n += piece
    return cuts


def first_piece_size(
    configured: int | None, step_budget: int | None, block: int, decodes: int | None = None
) -> int | None:
    """The tokens of a first turn's piece (module docstring): `configured` when set, else the
    worker's `step_budget` less room for the decodes that may share its steps — `decodes` of
    them at `DECODE_TOKENS` each, rounded up to a whole `block`, `DECODE_ROOM` at most and when
    they are not known (None) — rounded down to a whole `block`; None (no pieces) when neither
    is known or the budget leaves less than a block."""
    if configured is not None:
        return configured
    if step_budget is None or block <= 0:
        return None
    room = DECODE_ROOM
    if decodes is not None:
        room = min(room, -(-max(decodes, 0) * DECODE_TOKENS // block) * block)
    piece = (step_budget - room) // block * block
    return piece if piece > 0 else None


def wants_first_pieces(
    piece_tokens: int | None,
    band: str,
    split: bool,
    spilled: bool,
    uncached: int,
    lives: int,
) -> bool:
    """Is this new session's first turn prefilled in pieces of `piece_tokens` (module
    docstring, "First turns beside live sessions"): prefilled on its decode worker (not split,
    not spilled — the continuing rule paces a spilled one), more than one piece of uncached
    tokens, and other sessions living on that worker (`lives` of them)."""
    return (
        piece_tokens is not None
        and band == "new"
        and not split
        and not spilled
        and uncached > piece_tokens
        and lives > 0
    )


def wants_pieces(
    rule: PrefillPieces, band: str, split: bool, uncached: int, spilled: bool = False
) -> bool:
    """Is this request prefilled in pieces: a continuing turn, or a first turn the prefill stage
    spilled to its decode worker (`spilled`), prefilled on its decode worker (not split), with
    `rule.min_tokens` or more uncached tokens."""
    return (band == "continuing" or spilled) and not split and uncached >= rule.min_tokens
