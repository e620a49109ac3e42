"""What goes into the simulated engine and what comes out of it.

A `SimRequest` carries its prompt either as token ids (block hashes are then computed with the
vLLM-compatible `beamserve.kvwire.hashing.block_hashes`) or as precomputed block hashes plus a
token count (trace replays: one hash id per 64-token block). Listeners receive a
`RequestUpdate` whenever the request emits tokens or ends; the last update carries the request's
`RequestMetrics`. All times are seconds on the engine's clock.
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort", "error"]


class SimRequestError(ValueError):
    """A request the engine cannot take; the message names the field and the fix."""


class EngineDeadError(RuntimeError):
    """The engine has died (fault injection) and takes no requests until revived."""


@dataclass(frozen=True)
class RemotePrefill:
    """The prompt's KV comes from a remote prefill engine (P/D disaggregation).

    The decode engine reserves pages for the prompt, waits for the transfer (bytes from
    `kv_transfer`'s math over the profile's link), then decodes. `prefill_tp` is the prefill
    pool's TP size (None = same as this engine); `transfer_seconds` overrides the computed time.
    """

    prefill_tp: int | None = None
    transfer_seconds: float | None = None


@dataclass(frozen=True)
class SimRequest:
    """One generation request.

    - `prompt_tokens`: prompt length in tokens (taken from `token_ids` when those are given);
    - `token_ids`: the prompt's tokens, or None for hash-only (trace) requests;
    - `block_hashes`: chained hashes of the prompt's full `page_size`-token blocks, in order
      (computed from `token_ids` when omitted; trace ids must be namespaced per session);
      at most `prompt_tokens // page_size` of them are used;
    - `max_output_tokens`: the most tokens to generate (finish reason `length`);
    - `output_tokens`: where the simulated model "stops" (finish reason `stop`), None = never;
    - `arrival_time`: when the request reaches the engine (None = at submit);
    - `remote_prefill`: the prompt's KV arrives by P/D transfer instead of being computed.
    """

    request_id: str
    prompt_tokens: int = 0
    max_output_tokens: int = 16
    token_ids: tuple[int, ...] | None = None
    block_hashes: tuple[int, ...] | None = None
    output_tokens: int | None = None
    arrival_time: float | None = None
    remote_prefill: RemotePrefill | None = None

    def __post_init__(self) -> None:
        if not self.request_id:
            raise SimRequestError("request_id: must be a non-empty string")
        if self.token_ids is not None:
            object.__setattr__(self, "token_ids", tuple(self.token_ids))
            object.__setattr__(self, "prompt_tokens", len(self.token_ids))
        if self.block_hashes is not None:
            object.__setattr__(self, "block_hashes", tuple(self.block_hashes))
        if self.prompt_tokens < 1:
            raise SimRequestError(
                f"{self.request_id}: prompt_tokens must be ≥ 1 (give token_ids or prompt_tokens)"
            )
        if self.max_output_tokens < 1:
            raise SimRequestError(f"{self.request_id}: max_output_tokens must be ≥ 1")
        if self.output_tokens is not None and self.output_tokens < 1:
            raise SimRequestError(f"{self.request_id}: output_tokens must be ≥ 1 or None")

    def hashes(self, page_size: int) -> tuple[int, ...]:
        """The block hashes the cache keys on: the given ones (trimmed to full blocks), or
        `beamserve.kvwire.hashing.block_hashes(token_ids, page_size)`, or () for neither."""
        full = self.prompt_tokens // page_size
        if self.block_hashes is not None:
            return self.block_hashes[:full]
        if self.token_ids is None:
            return ()
        from beamserve.kvwire.hashing import block_hashes

        return tuple(block_hashes(list(self.token_ids), block_size=page_size))[:full]

    @property
    def output_limit(self) -> int:
        """Tokens this request will generate if nothing goes wrong."""
        if self.output_tokens is None:
            return self.max_output_tokens
        return min(self.output_tokens, self.max_output_tokens)


@dataclass(frozen=True)
class RequestMetrics:
    """What happened to one request (all times in clock seconds).

    `token_times[i]` is when output token i was emitted (speculative decoding emits several at
    one time). `device_cached_tokens` / `host_cached_tokens` are prompt tokens whose
    full-attention KV came from the device cache / the host tier; `window_recompute_tokens` were
    recomputed to rebuild an evicted window tail (partial hit).
    """

    request_id: str
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finish_time: float
    token_times: tuple[float, ...]
    prompt_tokens: int
    device_cached_tokens: int
    host_cached_tokens: int
    window_recompute_tokens: int
    host_load_seconds: float
    kv_transfer_seconds: float
    preemptions: int
    finish_reason: FinishReason
    error: str | None = None

    @property
    def output_tokens(self) -> int:
        return len(self.token_times)

    @property
    def cached_tokens(self) -> int:
        return self.device_cached_tokens + self.host_cached_tokens

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first output token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float:
        return self.finish_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean seconds per output token after the first (None below 2 tokens)."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens per second one user sees after the first token (1 / tpot)."""
        t = self.tpot
        return None if t is None or t <= 0 else 1.0 / t

    @property
    def inter_token_gaps(self) -> list[float]:
        tt = self.token_times
        return [b - a for a, b in itertools.pairwise(tt)]


def sim_token_ids(seed: int, start: int, count: int, vocab_size: int) -> tuple[int, ...]:
    """The simulated model's output tokens `start .. start+count-1` for a request whose token
    seed is `seed` (a pure function: the same request always "generates" the same tokens)."""
    return tuple(
        (seed * 2_654_435_761 + (start + i) * 40_503 + 17) % vocab_size for i in range(count)
    )


def token_seed(request_id: str) -> int:
    """A request's token seed: CRC-32 of its id (stable across processes, unlike hash())."""
    return zlib.crc32(request_id.encode())


@dataclass(frozen=True, slots=True)
class RequestUpdate:
    """`num_new_tokens` tokens emitted at `time` (speculative decoding emits several per step),
    and whether the request ended (then `metrics` is set). `num_output_tokens` counts all
    tokens emitted so far; `token_ids` are the new tokens (computed on access)."""

    request_id: str
    time: float
    num_new_tokens: int
    num_output_tokens: int
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    metrics: RequestMetrics | None = field(default=None, repr=False)
    token_seed: int = field(default=0, repr=False)
    vocab_size: int = field(default=151_936, repr=False)

    @property
    def token_ids(self) -> tuple[int, ...]:
        start = self.num_output_tokens - self.num_new_tokens
        return sim_token_ids(self.token_seed, start, self.num_new_tokens, self.vocab_size)


RequestListener = Callable[[RequestUpdate], None]


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated `q`-th percentile (0–100) of `values` (like numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
