"""Time-to-first-token estimate for sending one request to one worker (the routing cost).

Formula (seconds)::

    uncached = P − effective_cached_tokens(hit)          (a partial hit recomputes its window tail;
                                                          block size and window: the worker's
                                                          `WorkerView.geometry`)
    ttft     = overhead_s
             + (queued_prefill + uncached
                + decode_interference · (decode_tokens + resting_weight · resting_tokens))
               / prefill_tok_s

``queued_prefill`` is `WorkerLoad.effective_prefill_tokens`: uncached prompt tokens this
replica already sent there and that are not yet prefilled, plus, while the engine's scrape is
fresh, the other replicas' (`beamserve.router.load.effective_load`); ``decode_tokens``
(`effective_decode_tokens`, likewise) the context of requests decoding there, which slows every
prefill chunk a little (each step also reads their KV). This is
Dynamo's ``cost = overlap_weight × prefill_blocks + decode_blocks`` priced in seconds, with the
hybrid-attention correction for partial hits, so a cost can be compared against a margin in
seconds (`sticky-until-saturated`) and reported in the explain string.

``resting_tokens`` (`WorkerLoad.resting_tokens`, `beamserve.router.load` "Resting sessions"):
the context of sessions whose last turn ended there a think time ago and whose next turn will
come back there; priced as decode context (`resting_weight` 1), it is small beside any queued
prefill and only separates workers that are otherwise alike — an idle worker whose sessions are
thinking from one that has none. **Off by default** (`resting_weight` 0), as measured over HTTP
(docs/bench/agentic.md, "Resting sessions"): throughput 0.97 × and 0.99 × the same build's
without it at concurrency 8 and 16. A session that has ended for good rests like one that is
thinking, and a new session usually starts because one ended: the term steers it away from the
very worker that just freed up.

| parameter | default | meaning |
|---|---|---|
| `prefill_tok_s` | ``40000`` | prefill throughput, tokens/s (calibrate per pool) |
| `decode_interference` | ``0.002`` | prefill-token cost of one decode-context token |
| `overhead_s` | ``0.0`` | fixed per-request cost (scheduling, first decode step) |
| `predicted_credit` | ``1.0`` | share of a predicted (unconfirmed) hit block that counts |
| `resting_weight` | ``0.0`` | share of resting sessions' context priced as decode context |
"""

from __future__ import annotations

from dataclasses import dataclass

from beamserve.router.policy.base import PluginParams
from beamserve.router.types import RouteRequest, WorkerView
from pydantic import Field

DEFAULT_PREFILL_TOK_S = 40000.0
DEFAULT_DECODE_INTERFERENCE = 0.002


class TTFTParams(PluginParams):
    """The estimator's parameters as they appear in policy configuration."""

    prefill_tok_s: float = Field(default=DEFAULT_PREFILL_TOK_S, gt=0)
    decode_interference: float = Field(default=DEFAULT_DECODE_INTERFERENCE, ge=0)
    overhead_s: float = Field(default=0.0, ge=0)
    predicted_credit: float = Field(default=1.0, ge=0.0, le=1.0)
    resting_weight: float = Field(default=0.0, ge=0.0)


@dataclass(frozen=True, slots=True)
class TTFTEstimate:
    """One estimate with its terms (tokens), for explain strings."""

    seconds: float
    cached_tokens: float
    uncached_tokens: float
    queued_prefill_tokens: int
    decode_tokens: int
    resting_tokens: int = 0


def estimate_ttft(view: WorkerView, request: RouteRequest, params: TTFTParams) -> TTFTEstimate:
    """The estimate and its terms (formula in the module docstring)."""
    # `effective_cached_tokens`, inlined (the router runs this per worker on every request);
    # the same operations in the same order, so the same floats.
    hit = view.hit
    prompt = request.prompt_tokens
    full = hit.full_blocks
    if prompt <= 0 or full <= 0:
        cached = 0.0
    else:
        predicted = min(max(hit.predicted_blocks, 0), full)
        blocks = full - (1.0 - params.predicted_credit) * predicted
        g = view.geometry  # the worker's own block size and window
        cached = min(blocks * g.block_size, float(prompt))
        if not hit.window_ok:
            cached = max(0.0, cached - g.sliding_window)
    uncached = max(prompt - cached, 0.0)
    load = view.load
    queued = max(load.prefill_tokens, 0) + max(load.foreign_prefill_tokens, 0)
    decode = max(load.decode_tokens, 0) + max(load.foreign_decode_tokens, 0)
    resting = load.resting_tokens
    context = decode + params.resting_weight * resting if resting > 0 else decode
    work = queued + uncached + params.decode_interference * context
    return TTFTEstimate(
        seconds=params.overhead_s + work / params.prefill_tok_s,
        cached_tokens=cached,
        uncached_tokens=uncached,
        queued_prefill_tokens=queued,
        decode_tokens=decode,
        resting_tokens=resting,
    )


def estimate_ttft_s(
    view: WorkerView,
    request: RouteRequest,
    *,
    prefill_tok_s: float = DEFAULT_PREFILL_TOK_S,
    decode_interference: float = DEFAULT_DECODE_INTERFERENCE,
    overhead_s: float = 0.0,
    predicted_credit: float = 1.0,
) -> float:
    """Estimated seconds to the first token if `request` goes to `view`'s worker."""
    params = TTFTParams(
        prefill_tok_s=prefill_tok_s,
        decode_interference=decode_interference,
        overhead_s=overhead_s,
        predicted_credit=predicted_credit,
    )
    return estimate_ttft(view, request, params).seconds
