"""The latency model: how long one engine step takes, from what it computes. Pure functions.

One step is one forward of the target model over a batch that mixes prefill chunks and decode
requests (continuous batching with chunked prefill), plus the draft pass when speculative
decoding is on. Its time is a roofline over the whole TP group plus fixed and communication
costs (docs/sim.md gives the derivation and the constants' sources):

    t_step = step_overhead + draft (if speculating) + max(t_compute, t_memory) + t_comm

    t_compute = FLOPs_linear / F + FLOPs_attention / F_attn
    t_memory  = bytes / B
    F       = gpus × peak_flops × compute_efficiency         (GEMMs in the weights' precision)
    F_attn  = gpus × attention_peak_flops × compute_efficiency (attention: FP8 or BF16)
    B       = gpus × hbm_bandwidth × bandwidth_efficiency
    FLOPs_linear    = 2 · active_params · tokens
    FLOPs_attention = 4 · H_q · d · (L_full · keys_full + L_sliding · keys_window)
    bytes   = w · (dense_params + expert_params · coverage(tokens))         (weights)
            + kv_full · context_read + kv_window · window_read              (KV reads)
    coverage(n) = 1 − (1 − k/E)^n      expected share of experts hit by n tokens (top-k of E)
    t_comm  = per layer 2 all-reduces of tokens × hidden × 2 B (ring: 2(g−1)/g of it on the link)

`keys_*` counts, over every query token, the keys it attends to (causal: position + 1, capped
at the window for sliding layers). KV reads are divided over min(gpus, kv_heads) GPUs (heads
are replicated beyond that). With speculative decoding every decode request contributes
`spec.block_size` query tokens and emits `spec.acceptance_length` tokens per step.
"""

from __future__ import annotations

from typing import NamedTuple

from beamserve.kv_transfer.model import BeamModelConfig
from beamserve.kv_transfer.plan import bytes_minimum
from beamserve.kv_transfer.topology import KVDtype, PoolLayout, PoolTopology
from beamserve.workers.sim.profiles import HardwareProfile

ACTIVATION_BYTES = 2  # bf16 activations on the all-reduce


def causal_keys(context: int, tokens: int, window: int | None = None) -> int:
    """Σ over `tokens` new query tokens at positions context..context+tokens−1 of the keys each
    attends to: `pos + 1`, capped at `window` when given. Exact, O(1)."""
    if tokens <= 0:
        return 0
    lo, hi = context + 1, context + tokens  # keys attended by the first / last new token
    if window is None or hi <= window:
        return (lo + hi) * tokens // 2
    if lo >= window:
        return window * tokens
    below = window - lo  # tokens attending fewer than `window` keys: lo .. window-1
    return (lo + window - 1) * below // 2 + window * (tokens - below)


def expert_coverage(tokens: int, experts_per_token: int, num_experts: int) -> float:
    """Expected fraction of experts that at least one of `tokens` routes to (uniform routing)."""
    if tokens <= 0:
        return 0.0
    return 1.0 - (1.0 - experts_per_token / num_experts) ** tokens


class StepWork(NamedTuple):
    """What one forward computes.

    - `prefill_tokens`: new tokens computed by prefill chunks (recomputed ones included);
    - `prefill_keys_full` / `prefill_keys_window`: `causal_keys` summed over the chunks, without
      and with the sliding window;
    - `prefill_context`: cached tokens the chunks attend to (their KV is read once per step);
    - `decode_requests`: requests in their decode phase, each contributing `decode_query_tokens`
      query tokens (1, or the speculative block);
    - `decode_context`: Σ of those requests' context lengths; `decode_window`: Σ of
      min(context, sliding_window);
    - `draft`: the step runs the speculative draft pass (decode requests, speculation on).
    """

    prefill_tokens: int = 0
    prefill_keys_full: int = 0
    prefill_keys_window: int = 0
    prefill_context: int = 0
    decode_requests: int = 0
    decode_query_tokens: int = 1
    decode_context: int = 0
    decode_window: int = 0
    draft: bool = False

    @property
    def tokens(self) -> int:
        return self.prefill_tokens + self.decode_requests * self.decode_query_tokens


class StepCost(NamedTuple):
    """The parts of one step's time, in seconds (`total` is what the engine waits)."""

    overhead: float
    compute: float
    memory: float
    comm: float

    @property
    def total(self) -> float:
        return self.overhead + max(self.compute, self.memory) + self.comm


class LatencyModel:
    """The latency formulas for one profile, with its per-token constants precomputed.

    Immutable after construction; every method is a pure function of its arguments.
    """

    def __init__(self, profile: HardwareProfile) -> None:
        self.profile = p = profile
        m, moe = p.model, p.moe
        g = p.gpus
        self.full_layers = len(m.full_layers)
        self.sliding_layers = len(m.sliding_layers)
        self.window = m.sliding_window
        kv_row = 2 * m.num_key_value_heads * m.head_dim * p.kv_dtype.nbytes  # K+V, one layer
        #: KV bytes of one token in all full-attention layers / all sliding layers (whole model)
        self.kv_full_per_token = self.full_layers * kv_row
        self.kv_window_per_token = self.sliding_layers * kv_row
        self._flops_per_token = 2.0 * moe.active_params
        self._attn_flops_per_key = 4.0 * m.num_attention_heads * m.head_dim
        self._dense_bytes = moe.dense_params * p.weight_bytes_per_param
        self._expert_bytes = moe.expert_params * p.weight_bytes_per_param
        self._miss = 1.0 - moe.experts_per_token / moe.num_experts
        self._flops_rate = g * p.peak_flops * p.compute_efficiency
        attn_peak = p.attention_peak_flops or p.peak_flops
        self._attn_rate = g * attn_peak * p.compute_efficiency
        self._weight_rate = g * p.hbm_bandwidth * p.bandwidth_efficiency
        self._kv_rate = min(g, m.num_key_value_heads) * p.hbm_bandwidth * p.bandwidth_efficiency
        self._spec_q = p.spec.block_size if p.spec else 1
        # Communication: TP all-reduces after attention and after the MLP of every layer; with
        # EP > 1 the sparse MLPs use an all-to-all dispatch + combine instead.
        layers = m.num_hidden_layers
        if g == 1:
            self._comm_fixed, self._comm_per_token = 0.0, 0.0
        else:
            ring = 2.0 * (g - 1) / g * moe.hidden_size * ACTIVATION_BYTES
            link = p.interconnect_bandwidth
            n_ar = 2 * layers if p.ep == 1 else layers
            a2a_per_token = 0.0
            n_a2a = 0
            if p.ep > 1:
                n_a2a = 2 * layers
                a2a_per_token = (
                    moe.experts_per_token * moe.hidden_size * ACTIVATION_BYTES * (p.ep - 1) / p.ep
                ) / p.ep
            self._comm_fixed = (n_ar + n_a2a) * p.allreduce_latency_s
            self._comm_per_token = (n_ar * ring + n_a2a * a2a_per_token) / link

    # --- one step -------------------------------------------------------------------------

    @property
    def decode_query_tokens(self) -> int:
        """Query tokens each decode request adds to a speculative step (the block, or 1)."""
        return self._spec_q

    def cost(self, work: StepWork) -> StepCost:
        """The parts of one step's time for `work` (all seconds)."""
        p = self.profile
        tokens = work.prefill_tokens + work.decode_requests * work.decode_query_tokens
        if tokens <= 0:
            return StepCost(0.0, 0.0, 0.0, 0.0)
        q = work.decode_query_tokens
        keys_full = work.prefill_keys_full + q * work.decode_context
        keys_window = work.prefill_keys_window + q * work.decode_window
        linear = tokens * self._flops_per_token
        attention = self._attn_flops_per_key * (
            self.full_layers * keys_full + self.sliding_layers * keys_window
        )
        weights = self._dense_bytes + self._expert_bytes * (1.0 - self._miss**tokens)
        kv = (
            self.kv_full_per_token * (work.decode_context + work.prefill_context)
            + self.kv_window_per_token * work.decode_window
        )
        overhead = p.step_overhead_s + (p.draft_step_s if work.draft else 0.0)
        return StepCost(
            overhead=overhead,
            compute=linear / self._flops_rate + attention / self._attn_rate,
            memory=weights / self._weight_rate + kv / self._kv_rate,
            comm=self._comm_fixed + tokens * self._comm_per_token,
        )

    def step_seconds(self, work: StepWork) -> float:
        """Seconds one step of `work` takes (0 for an empty step)."""
        return self.cost(work).total

    # --- conveniences over one step -------------------------------------------------------

    def prefill_seconds(self, uncached_tokens: int, cached_tokens: int = 0) -> float:
        """One prefill of `uncached_tokens` after `cached_tokens` of reused context, alone in a
        step (no chunking, no decode). Attention cost grows with the context."""
        w = self.window
        return self.step_seconds(
            StepWork(
                prefill_tokens=uncached_tokens,
                prefill_keys_full=causal_keys(cached_tokens, uncached_tokens),
                prefill_keys_window=causal_keys(cached_tokens, uncached_tokens, w),
                prefill_context=cached_tokens,
            )
        )

    def decode_step_seconds(self, batch: int, total_context: int) -> float:
        """One decode step of `batch` requests holding `total_context` tokens together."""
        if batch <= 0:
            return 0.0
        per = total_context / batch
        spec = self.speculates(batch)
        return self.step_seconds(
            StepWork(
                decode_requests=batch,
                decode_query_tokens=self._spec_q if spec else 1,
                decode_context=total_context,
                decode_window=round(batch * min(per, self.window)),
                draft=spec,
            )
        )

    def speculates(self, decode_batch: int) -> bool:
        """Whether a step with `decode_batch` decode requests runs speculative decoding."""
        spec = self.profile.spec
        if spec is None:
            return False
        limit = spec.disable_by_batch_size
        return limit is None or decode_batch <= limit

    def tokens_per_step(self, decode_batch: int = 1) -> float:
        """Tokens a decode request emits per step (the acceptance length, or 1)."""
        spec = self.profile.spec
        return spec.acceptance_length if spec and self.speculates(decode_batch) else 1.0

    # --- KV movement ----------------------------------------------------------------------

    def kv_bytes(self, full_tokens: int, window_tokens: int) -> int:
        """Bytes of KV for `full_tokens` tokens of full-attention layers plus `window_tokens`
        tokens of sliding layers (whole model, every KV head once)."""
        return self.kv_full_per_token * full_tokens + self.kv_window_per_token * window_tokens

    def host_transfer_seconds(self, nbytes: int) -> float:
        """Moving `nbytes` of KV between host memory and the GPUs (all GPUs in parallel)."""
        if nbytes <= 0:
            return 0.0
        return nbytes / (self.profile.gpus * self.profile.host_bandwidth)

    def pd_transfer_seconds(
        self, seq_len: int, prefill_gpus: int | None = None, cached_tokens: int = 0
    ) -> float:
        """P/D handoff of one request's KV to this (decode) engine; see `pd_transfer_seconds`."""
        p = self.profile
        return pd_transfer_seconds(
            p.model,
            seq_len,
            dst_tp=p.gpus,
            src_tp=prefill_gpus or p.gpus,
            kv_dtype=p.kv_dtype,
            link_bandwidth=p.pd_link_bandwidth,
            link_latency_s=p.pd_link_latency_s,
            cached_tokens=cached_tokens,
        )


def pd_transfer_seconds(
    model: BeamModelConfig,
    seq_len: int,
    *,
    dst_tp: int,
    src_tp: int,
    kv_dtype: KVDtype,
    link_bandwidth: float,
    link_latency_s: float = 0.0,
    cached_tokens: int = 0,
) -> float:
    """Seconds to move one request's KV from a prefill pool (TP `src_tp`) to a decode pool (TP
    `dst_tp`): the decode side's minimum bytes (`kv_transfer.plan.bytes_minimum`: full-attention
    KV of every token plus the window's KV) over min(src_tp, dst_tp) NICs of `link_bandwidth`
    bytes/s each, plus one link latency. Replicated heads (TP > KV heads) count once per replica.
    `cached_tokens` of leading full-attention KV the decode side already holds are not moved.
    """
    if seq_len <= 0:
        return 0.0
    layout = PoolLayout(model, PoolTopology(dst_tp, kv_dtype=kv_dtype), 1, 1)
    nbytes = bytes_minimum(layout, seq_len)
    if cached_tokens > 0:
        # Past the window the sliding part is constant, so this difference is exactly the
        # full-attention bytes of `cached_tokens` tokens.
        w = model.sliding_window
        nbytes -= bytes_minimum(layout, cached_tokens + w) - bytes_minimum(layout, w)
    return link_latency_s + nbytes / (min(src_tp, dst_tp) * link_bandwidth)


def prefill_seconds(
    profile: HardwareProfile, uncached_tokens: int, cached_tokens: int = 0
) -> float:
    """Module-level form of `LatencyModel.prefill_seconds`."""
    return LatencyModel(profile).prefill_seconds(uncached_tokens, cached_tokens)


def decode_step_seconds(profile: HardwareProfile, batch: int, total_context: int) -> float:
    """Module-level form of `LatencyModel.decode_step_seconds`."""
    return LatencyModel(profile).decode_step_seconds(batch, total_context)
