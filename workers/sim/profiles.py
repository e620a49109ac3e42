"""Hardware profiles: the constants behind the latency model, each with its source.

A profile describes one engine instance (one TP group): its GPUs, their datasheet limits, the
efficiencies real kernels reach on them, the fixed per-step costs, the scheduler limits and the
speculative-decoding setup. `docs/sim.md` lists every constant with its source and the
calibration that fixed the fitted ones.

Units: FLOP/s, bytes, bytes/s and seconds, per GPU unless the name says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from beamserve.kv_transfer.model import BeamModelConfig, beam_1_0, beam_layer_types
from beamserve.kv_transfer.topology import KVDtype


class ProfileError(ValueError):
    """A profile name or field is invalid; the message names the fix."""


@dataclass(frozen=True)
class MoEShape:
    """The compute side of the model (the KV side is `BeamModelConfig`).

    Beam 1.0 (DESIGN.md §1): 501B parameters, 23B active per token; sparse layers route each token
    to `experts_per_token` of `num_experts` experts. `expert_params` is what a full read of every
    expert costs; `dense_params` (attention, embeddings, dense MLPs, router) is read by every step.
    """

    total_params: float
    active_params: float
    num_experts: int
    experts_per_token: int
    hidden_size: int

    def __post_init__(self) -> None:
        if not 0 < self.active_params <= self.total_params:
            raise ProfileError("active_params: must lie in (0, total_params]")
        if not 0 < self.experts_per_token <= self.num_experts:
            raise ProfileError("experts_per_token: must lie in [1, num_experts]")

    @property
    def expert_params(self) -> float:
        """Parameters in all experts: solves dense + E·e = total, dense + k·e = active."""
        routed = self.experts_per_token / self.num_experts
        if routed >= 1:
            return 0.0
        return (self.total_params - self.active_params) / (1.0 - routed)

    @property
    def dense_params(self) -> float:
        return self.total_params - self.expert_params


def beam_1_0_moe(hidden_size: int = 48 * 128) -> MoEShape:
    """Beam 1.0: 501B total / 23B active, 256 experts top-8 (DESIGN.md §1).

    The hidden size is taken as heads × head_dim (48 × 128); it only sets the all-reduce size.
    """
    return MoEShape(
        total_params=501e9,
        active_params=23e9,
        num_experts=256,
        experts_per_token=8,
        hidden_size=hidden_size,
    )


@dataclass(frozen=True)
class SpecDecode:
    """DFlash2-style speculative decoding: the draft proposes `block_size` tokens in one pass,
    the target verifies the block in one forward and keeps `acceptance_length` tokens on average
    (tokens per step; fractional values alternate deterministically).

    `disable_by_batch_size`: a step whose decode batch is larger than this runs without
    speculation (1 token per request, no draft pass), as vLLM's
    `speculative_config.disable_by_batch_size` does; None = never disabled.
    """

    block_size: int = 8
    acceptance_length: float = 4.0
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ProfileError("spec.block_size: must be ≥ 1")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ProfileError("spec.disable_by_batch_size: must be ≥ 1 or None")
        if not 1.0 <= self.acceptance_length <= self.block_size:
            raise ProfileError(
                f"spec.acceptance_length: {self.acceptance_length} must lie in "
                f"[1, block_size={self.block_size}]"
            )


@dataclass(frozen=True)
class HardwareProfile:
    """One engine instance: `gpus` GPUs serving one model replica with TP = `gpus`.

    Datasheet fields (per GPU): `peak_flops` (dense, in the weights' precision: the linear
    layers), `attention_peak_flops` (dense, in the precision attention runs in; None = same as
    `peak_flops`), `hbm_bandwidth`,
    `hbm_capacity`, `interconnect_bandwidth` (GPU↔GPU, one direction), `host_bandwidth`
    (GPU↔host memory, one direction), `pd_link_bandwidth` (the NIC used for P/D KV transfer).
    Fitted fields: `compute_efficiency` and `bandwidth_efficiency` (fraction of peak reached),
    `step_overhead_s` (per forward: scheduling, launches, sampling), `draft_step_s` (the
    draft model's pass per decode step), `allreduce_latency_s`.
    """

    name: str
    description: str
    model: BeamModelConfig
    moe: MoEShape
    gpus: int
    peak_flops: float
    hbm_bandwidth: float
    hbm_capacity: float
    weight_bytes_per_param: float
    kv_dtype: KVDtype
    compute_efficiency: float
    bandwidth_efficiency: float
    step_overhead_s: float
    allreduce_latency_s: float
    interconnect_bandwidth: float
    host_bandwidth: float
    pd_link_bandwidth: float
    pd_link_latency_s: float
    max_running: int
    max_batched_tokens: int
    ep: int = 1
    attention_peak_flops: float | None = None
    spec: SpecDecode | None = None
    draft_step_s: float = 0.0
    gpu_memory_utilization: float = 0.9
    activation_reserve_bytes: float = 0.0
    window_pool_share: float = 0.1
    host_memory_bytes: float = 0.0
    calibrated: bool = False
    sources: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        for name in (
            "gpus",
            "peak_flops",
            "hbm_bandwidth",
            "hbm_capacity",
            "weight_bytes_per_param",
            "interconnect_bandwidth",
            "host_bandwidth",
            "pd_link_bandwidth",
            "max_running",
            "max_batched_tokens",
        ):
            if getattr(self, name) <= 0:
                raise ProfileError(f"{self.name}.{name}: must be > 0")
        for name in ("compute_efficiency", "bandwidth_efficiency", "gpu_memory_utilization"):
            if not 0 < getattr(self, name) <= 1:
                raise ProfileError(f"{self.name}.{name}: must lie in (0, 1]")
        if not 0 < self.window_pool_share < 1:
            raise ProfileError(f"{self.name}.window_pool_share: must lie in (0, 1)")
        if self.ep < 1 or self.gpus % self.ep:
            raise ProfileError(f"{self.name}.ep: {self.ep} must divide gpus={self.gpus}")
        try:
            object.__setattr__(self, "kv_dtype", KVDtype(self.kv_dtype))
        except ValueError:
            raise ProfileError(
                f"{self.name}.kv_dtype: {self.kv_dtype!r}; use one of {[d.value for d in KVDtype]}"
            ) from None

    def with_changes(self, **changes: object) -> HardwareProfile:
        """A copy with some fields replaced (validated again)."""
        return replace(self, **changes)  # type: ignore[arg-type]


# --- gb300-nvfp4-tp4 -------------------------------------------------------------------------
# Datasheet (NVIDIA GB300 NVL72, Blackwell Ultra): 1,080 PFLOPS dense FP4 and 360 PFLOPS dense
# FP8 over 72 GPUs (15 PF / 5 PF each); 288 GB HBM3e (279 GB usable) at 8 TB/s per GPU;
# NVLink 5 at 1.8 TB/s per GPU (900 GB/s each way); NVLink-C2C to Grace at 900 GB/s per Grace
# (2 GPUs: 225 GB/s each way per GPU); ConnectX-8 800 Gb/s (100 GB/s) per GPU. NVFP4 = 4-bit
# values + an FP8 scale per 16 → 4.5 bits/param. Attention runs in FP8 (FP8 KV cache), so at
# its 5 PF peak.
# Fitted (docs/sim.md, "Calibration"), to the published Beam replays on 4 × GB300:
#   step_overhead_s, draft_step_s, bandwidth_efficiency ← one-session and 32-session per-user
#   speeds (348 and 185.87 tok/s); the 96-session points then follow.
# Assumed: compute_efficiency 0.30 (prefill GEMMs + attention; the published points move ≤ 8%
#   for 0.2–0.4); spec.disable_by_batch_size 64 (speculation off for larger decode batches, as
#   vLLM's speculative_config.disable_by_batch_size does: what makes 96 sessions run at 1 token
#   per step — 43.9 ≈ 185.87 / 4); max_batched_tokens 16,384; window_pool_share 0.1.
GB300_NVFP4_TP4 = HardwareProfile(
    name="gb300-nvfp4-tp4",
    description="4 × GB300, TP4, NVFP4 weights, FP8 KV, DFlash2 block 8 (acceptance 4)",
    model=beam_1_0(),
    moe=beam_1_0_moe(),
    gpus=4,
    peak_flops=15e15,
    hbm_bandwidth=8e12,
    hbm_capacity=279e9,
    weight_bytes_per_param=4.5 / 8,
    kv_dtype=KVDtype.FP8_E4M3,
    attention_peak_flops=5e15,
    compute_efficiency=0.30,
    bandwidth_efficiency=0.80,
    step_overhead_s=5.0e-3,
    allreduce_latency_s=10e-6,
    interconnect_bandwidth=900e9,
    host_bandwidth=225e9,
    pd_link_bandwidth=100e9,
    pd_link_latency_s=1e-3,
    max_running=256,
    max_batched_tokens=16384,
    spec=SpecDecode(block_size=8, acceptance_length=4.0, disable_by_batch_size=64),
    draft_step_s=2.5e-3,
    gpu_memory_utilization=0.9,
    activation_reserve_bytes=16e9,
    window_pool_share=0.1,
    host_memory_bytes=0.0,
    calibrated=True,
    sources=(
        "NVIDIA GB300 NVL72: 1,080 PF dense FP4, 360 PF dense FP8 over 72 GPUs; 20.7 TB HBM3e",
        "GB300 per GPU (verda.com/blog/gb300-nvl72-architecture): 15 PF FP4, 5 PF FP8, "
        "2.5 PF BF16 dense; 279 GB HBM3E usable (288 GB nominal) at 8 TB/s",
        "NVLink 5: 1.8 TB/s per GPU; NVLink-C2C 900 GB/s per Grace (2 GPUs); CX-8 800 Gb/s",
        "NVFP4: 4-bit E2M1 + FP8 E4M3 scale per 16 values (NVIDIA Blackwell docs)",
        "fitted: step overhead, draft time, bandwidth efficiency (docs/sim.md, Calibration)",
    ),
)

# --- h200-bf16-tp8 ---------------------------------------------------------------------------
# Datasheet (NVIDIA H200 SXM): 989 TFLOPS dense BF16 (attention too), 141 GB HBM3e (143,771 MiB
# as nvidia-smi reports it) at 4.8 TB/s, NVLink 4 at 900 GB/s per GPU (450 GB/s each way),
# PCIe Gen5 x16 (64 GB/s each way, ~50 effective), ConnectX-7 400 Gb/s (50 GB/s) per GPU.
# MEASURED (prefill): workers/sim/calibration/h200_beam_layers.py timed transformers' Beam layers
# at the real dimensions (bf16, random weights) on one H200 (results beside it, docs/sim.md):
# sparse-MLP layers reach 0.21–0.29 of dense-bf16 peak on 8K–16K-token prefills (mean 0.26).
# ESTIMATE (decode): transformers' eager MoE is kernel-launch bound at decode (≈3 ms per layer
# whatever the batch), which says nothing about a production engine's bandwidth, so the
# bandwidth efficiency and per-step overhead stay borrowed from the GB300 calibration.
# No speculative decoding. bf16 Beam (1.0 TB of weights) on 8 × H200 leaves
# ≈14 GB per GPU for KV (≈2.7M tokens of full-attention KV), so prefix-cache eviction is real.
H200_BF16_TP8 = HardwareProfile(
    name="h200-bf16-tp8",
    description="8 × H200 SXM, TP8, BF16 weights and KV, no speculative decoding (estimate)",
    model=beam_1_0(),
    moe=beam_1_0_moe(),
    gpus=8,
    peak_flops=989e12,
    hbm_bandwidth=4.8e12,
    hbm_capacity=143_771 * 2**20,
    weight_bytes_per_param=2.0,
    kv_dtype=KVDtype.BF16,
    compute_efficiency=0.26,  # measured: calibration/h200_beam_layers.json
    bandwidth_efficiency=0.75,
    step_overhead_s=4.0e-3,
    allreduce_latency_s=15e-6,
    interconnect_bandwidth=450e9,
    host_bandwidth=50e9,
    pd_link_bandwidth=50e9,
    pd_link_latency_s=1e-3,
    max_running=128,
    max_batched_tokens=8192,
    spec=None,
    gpu_memory_utilization=0.95,
    activation_reserve_bytes=4e9,
    window_pool_share=0.1,
    host_memory_bytes=0.0,
    calibrated=False,
    sources=(
        "NVIDIA H200 SXM datasheet: 989 TFLOPS dense BF16, 141 GB HBM3e, 4.8 TB/s, NVLink 900 GB/s",
        "PCIe Gen5 x16: 64 GB/s per direction; ConnectX-7: 400 Gb/s",
        "compute efficiency 0.26: measured, workers/sim/calibration/h200_beam_layers.json",
        "bandwidth efficiency, step overhead: borrowed from gb300-nvfp4-tp4 (HF eager decode is "
        "launch-bound, not a bandwidth measurement)",
    ),
)


def tiny_beam() -> BeamModelConfig:
    """A tiny Beam-shaped KV (6 layers: 1 full, 5 sliding; window 128; 2 KV heads)."""
    return BeamModelConfig(
        num_hidden_layers=6,
        layer_types=beam_layer_types(6),
        sliding_window=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        dtype="float32",
    )


# --- tiny-cpu --------------------------------------------------------------------------------
# Not a real machine: a profile whose steps take about a millisecond so that tests, including
# real-time HTTP tests, finish fast. ~2 ms per decode step, ~20 µs per prefill token.
TINY_CPU = HardwareProfile(
    name="tiny-cpu",
    description="tiny Beam-shaped model on a fictitious fast device, for tests",
    model=tiny_beam(),
    moe=MoEShape(
        total_params=20e6, active_params=5e6, num_experts=8, experts_per_token=2, hidden_size=128
    ),
    gpus=1,
    peak_flops=1e12,
    hbm_bandwidth=40e9,
    hbm_capacity=2e9,
    weight_bytes_per_param=2.0,
    kv_dtype=KVDtype.BF16,
    compute_efficiency=0.5,
    bandwidth_efficiency=1.0,
    step_overhead_s=1e-3,
    allreduce_latency_s=0.0,
    interconnect_bandwidth=1e12,
    host_bandwidth=1e9,
    pd_link_bandwidth=1e9,
    pd_link_latency_s=1e-4,
    max_running=16,
    max_batched_tokens=512,
    spec=None,
    gpu_memory_utilization=0.5,
    activation_reserve_bytes=0.0,
    window_pool_share=0.25,
    calibrated=False,
    sources=("fictitious: sized for fast tests",),
)

PROFILES: dict[str, HardwareProfile] = {
    p.name: p for p in (GB300_NVFP4_TP4, H200_BF16_TP8, TINY_CPU)
}


def get_profile(name: str) -> HardwareProfile:
    """The named profile; `ProfileError` lists the valid names."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ProfileError(f"profile: unknown {name!r}; choose one of {sorted(PROFILES)}") from None
