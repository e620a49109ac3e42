"""Scorer `prefix-affinity`: prefer the worker that already holds most of the prompt's KV,
counting a hybrid-attention hit only for what it really saves.

Formula (hybrid-aware)::

    k      = hit.full_blocks − (1 − predicted_credit) · hit.predicted_blocks
    cached = min(k · B, P)                      if the hit is full (window_ok)
           = max(0, min(k · B, P) − W)          if the hit is partial (window tail not resident)
    score  = cached / P                         (0 when P = 0)

with ``B`` the worker's block size (tokens), ``P = request.prompt_tokens`` and ``W`` its
sliding window — both from the worker's KV geometry (`WorkerView.geometry`: what the worker
reported, else the router's `--block-size` / `--sliding-window`).
Why the partial penalty: Beam's sliding-window layers need the KV of the last
``W`` tokens before the first uncached position. When those window blocks were evicted
(`PrefixHit.window_ok` False) the engine must recompute tokens ``[k·B − W, k·B)`` before it can
continue, so a partial hit saves only ``k·B − W`` tokens of prefill. Peers that index only the
full-attention groups (llm-d, Dynamo) count the whole ``k·B`` and overrate such hits.

`effective_cached_tokens` is the same computation, shared with the TTFT estimator and the
disaggregation decider so every part of the router agrees on what a hit is worth.

Intent: affinity — send the prompt where its prefix is resident (long agentic contexts make a
miss cost seconds of prefill). Balance against load with the `load` scorer or use the
`sticky-until-saturated` policy, which prices both in seconds.

Data: `WorkerView.hit` (from the prefix index), `WorkerView.geometry` (block size, sliding
window), `RouteRequest.prompt_tokens`.

| parameter | default | meaning |
|---|---|---|
| `predicted_credit` | ``1.0`` | share of a predicted (unconfirmed) block that counts |

Config example::

    scorers:
      - type: prefix-affinity
        weight: 3
        params: {predicted_credit: 0.8}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from beamserve.kvwire.geometry import DEFAULT_GEOMETRY
from beamserve.router.policy.base import PluginParams, clamp01, parse_params
from beamserve.router.types import PrefixHit, RouteRequest, WorkerView
from pydantic import Field

TYPE = "prefix-affinity"
DEFAULT_SLIDING_WINDOW = DEFAULT_GEOMETRY.sliding_window


def effective_cached_tokens(
    hit: PrefixHit,
    prompt_tokens: int,
    *,
    block_size: int,
    sliding_window: int = DEFAULT_SLIDING_WINDOW,
    predicted_credit: float = 1.0,
) -> float:
    """Prompt tokens a worker need not prefill, given its hit (formula in the module docstring).

    Always in ``[0, prompt_tokens]``. A partial hit is charged the recomputation of its
    window tail (`sliding_window` tokens).
    """
    if prompt_tokens <= 0 or hit.full_blocks <= 0:
        return 0.0
    predicted = min(max(hit.predicted_blocks, 0), hit.full_blocks)
    blocks = hit.full_blocks - (1.0 - predicted_credit) * predicted
    cached = min(blocks * block_size, float(prompt_tokens))
    if not hit.window_ok:
        cached = max(0.0, cached - sliding_window)
    return cached


class PrefixAffinityParams(PluginParams):
    predicted_credit: float = Field(default=1.0, ge=0.0, le=1.0)


class PrefixAffinityScorer:
    """Score = effective cached tokens / prompt tokens."""

    type = TYPE
    reason = "prefix"

    def __init__(self, predicted_credit: float = 1.0) -> None:
        self.predicted_credit = predicted_credit

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None = None) -> PrefixAffinityScorer:
        p = parse_params(PrefixAffinityParams, params, f"scorer {TYPE!r}")
        return cls(p.predicted_credit)

    def cached_tokens(self, request: RouteRequest, view: WorkerView) -> float:
        g = view.geometry
        return effective_cached_tokens(
            view.hit,
            request.prompt_tokens,
            block_size=g.block_size,
            sliding_window=g.sliding_window,
            predicted_credit=self.predicted_credit,
        )

    def score(self, request: RouteRequest, views: Sequence[WorkerView]) -> dict[str, float]:
        if request.prompt_tokens <= 0:
            return {v.endpoint.id: 0.0 for v in views}
        return {
            v.endpoint.id: clamp01(self.cached_tokens(request, v) / request.prompt_tokens)
            for v in views
        }
