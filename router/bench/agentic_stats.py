"""`beamserve bench agentic`: per-request records → one level's figures.

Definitions (all times client-side, wall clock):

* TTFT — request sent → first SSE chunk carrying an output token (`is_token_chunk`);
* per-user tok/s — output tokens / (end − first token), for requests with ≥ 2 output tokens
  and a positive decode span;
* total / output tok/s — (prompt + output) / output tokens of the successful requests over the
  level's duration (first request sent → last answer ended); per GPU: divided by
  ``workers × gpus`` of the sim profile;
* cache-hit ratio — Σ usage ``prompt_tokens_details.cached_tokens`` / Σ prompt tokens (requests
  whose answer carried no usage count neither);
* goodput — successful requests with TTFT ≤ `slo_ttft_s` (2 s) and per-user tok/s ≥
  `slo_tok_s` (20; a 1-token answer meets it by definition), per second of the level's duration;
* errors — by HTTP status (a number as a string), or ``connect`` / ``timeout`` / ``stream``
  (transport failures, an answer that ended without ``[DONE]`` or with an error event);
* percentiles — linear interpolation between closest ranks (numpy's default).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

SLO_TTFT_S = 2.0
SLO_TOK_S = 20.0


def is_token_chunk(chunk: dict[str, Any]) -> bool:
    """An OpenAI chat-completion chunk that carries output: non-empty text, or a content delta
    that is not the opening role chunk (a token may decode to no text), or a finish reason."""
    for ch in chunk.get("choices") or ():
        delta = ch.get("delta") or {}
        if delta.get("content") or delta.get("reasoning_content") or ch.get("finish_reason"):
            return True
        if "content" in delta and "role" not in delta:
            return True
    return False


@dataclass(slots=True)
class RequestRecord:
    session: str
    turn: int
    sent: float
    end: float
    status: str = "ok"  # "ok", an HTTP status, or connect / timeout / stream
    first_token: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int | None = None
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.sent

    @property
    def user_tok_s(self) -> float | None:
        if self.first_token is None or self.output_tokens < 2:
            return None
        span = self.end - self.first_token
        return self.output_tokens / span if span > 0 else None


def percentile(xs: Sequence[float], q: float) -> float | None:
    """The `q`-th percentile (0–100) by linear interpolation; None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def meets_slo(
    r: RequestRecord, slo_ttft_s: float = SLO_TTFT_S, slo_tok_s: float = SLO_TOK_S
) -> bool:
    if not r.ok or r.ttft_s is None or r.ttft_s > slo_ttft_s:
        return False
    rate = r.user_tok_s
    return rate is None or rate >= slo_tok_s


@dataclass
class LevelStats:
    requests: int
    ok: int
    errors: dict[str, int]
    duration_s: float
    prompt_tokens: int
    output_tokens: int
    total_tok_s: float
    output_tok_s: float
    total_tok_s_per_gpu: float
    output_tok_s_per_gpu: float
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    user_tok_s_p50: float | None
    user_tok_s_p90: float | None
    cache_hit_ratio: float | None
    goodput_rps: float
    goodput_fraction: float
    slo: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        from dataclasses import asdict

        return asdict(self)


def summarize(
    records: Sequence[RequestRecord],
    *,
    gpus: int,
    duration_s: float | None = None,
    slo_ttft_s: float = SLO_TTFT_S,
    slo_tok_s: float = SLO_TOK_S,
) -> LevelStats:
    """One level's figures (module docstring). `duration_s` defaults to the records' span."""
    ok = [r for r in records if r.ok]
    if duration_s is None:
        duration_s = max(r.end for r in records) - min(r.sent for r in records) if records else 0.0
    dur = duration_s if duration_s > 0 else float("nan")
    prompt = sum(r.prompt_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)
    with_usage = [r for r in ok if r.cached_tokens is not None]
    usage_prompt = sum(r.prompt_tokens for r in with_usage)
    cached = sum(r.cached_tokens or 0 for r in with_usage)
    ttfts = [t for r in ok if (t := r.ttft_s) is not None]
    rates = [x for r in ok if (x := r.user_tok_s) is not None]
    good = sum(1 for r in ok if meets_slo(r, slo_ttft_s, slo_tok_s))
    errors = Counter(r.status for r in records if not r.ok)
    total_rate = (prompt + output) / dur if records else 0.0
    out_rate = output / dur if records else 0.0
    g = max(gpus, 1)
    return LevelStats(
        requests=len(records),
        ok=len(ok),
        errors=dict(sorted(errors.items())),
        duration_s=duration_s,
        prompt_tokens=prompt,
        output_tokens=output,
        total_tok_s=total_rate,
        output_tok_s=out_rate,
        total_tok_s_per_gpu=total_rate / g,
        output_tok_s_per_gpu=out_rate / g,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p90_s=percentile(ttfts, 90),
        ttft_p99_s=percentile(ttfts, 99),
        user_tok_s_p50=percentile(rates, 50),
        user_tok_s_p90=percentile(rates, 90),
        cache_hit_ratio=cached / usage_prompt if usage_prompt else None,
        goodput_rps=good / dur if records else 0.0,
        goodput_fraction=good / len(records) if records else 0.0,
        slo={"ttft_s_max": slo_ttft_s, "user_tok_s_min": slo_tok_s},
    )
