"""Engine configuration: scheduler limits and the KV page budgets, derived from a profile.

Beam's two KV lifetimes get two page pools (as in the `kv_transfer` layout): `full_pages` for
the full-attention layers (one page per 64 tokens of every sequence) and `window_pages` for the
sliding layers (only the pages covering a sequence's last `sliding_window` tokens). A page of
each pool holds `page_size` tokens of all layers of its kind, on every GPU of the TP group.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

from beamserve.kv_transfer.model import BeamModelConfig
from beamserve.kv_transfer.topology import PAGE_SIZES
from beamserve.workers.sim.latency import LatencyModel
from beamserve.workers.sim.profiles import HardwareProfile, ProfileError

Role = Literal["both", "prefill", "decode"]
ROLES: tuple[Role, ...] = ("both", "prefill", "decode")


class EngineConfigError(ValueError):
    """An engine setting is invalid; the message names the field and the fix."""


@dataclass(frozen=True)
class PageBudget:
    """Pages of each pool (device) and of the optional host tier; bytes of one page of each."""

    full_pages: int
    window_pages: int
    full_page_bytes: int
    window_page_bytes: int
    host_full_pages: int = 0
    host_window_pages: int = 0


def page_budget(profile: HardwareProfile, page_size: int = 64) -> PageBudget:
    """Split the GPUs' free memory into full and window pages.

    KV memory = gpus × (hbm_capacity × gpu_memory_utilization − weights/gpus − activations);
    a share `window_pool_share` goes to window pages, the rest to full pages. A logical page
    occupies its bytes once per replica of a KV head (TP > KV heads replicates heads).
    Raises `ProfileError` when the weights leave no room for KV.
    """
    lat = LatencyModel(profile)
    g = profile.gpus
    weights = profile.moe.total_params * profile.weight_bytes_per_param
    free = (
        g
        * (profile.hbm_capacity * profile.gpu_memory_utilization - profile.activation_reserve_bytes)
        - weights
    )
    if free <= 0:
        raise ProfileError(
            f"{profile.name}: weights ({weights / 1e9:,.0f} GB) leave no KV memory on {g} GPUs; "
            "use more GPUs, a smaller weight precision, or a higher gpu_memory_utilization"
        )
    repl = max(1, g // profile.model.num_key_value_heads)
    full_bytes = page_size * lat.kv_full_per_token * repl
    window_bytes = page_size * lat.kv_window_per_token * repl
    share = profile.window_pool_share
    host = profile.host_memory_bytes
    return PageBudget(
        full_pages=math.floor(free * (1 - share) / full_bytes),
        window_pages=math.floor(free * share / window_bytes),
        full_page_bytes=full_bytes,
        window_page_bytes=window_bytes,
        host_full_pages=math.floor(host * (1 - share) / full_bytes),
        host_window_pages=math.floor(host * share / window_bytes),
    )


@dataclass(frozen=True)
class EngineConfig:
    """Everything one simulated engine needs besides its clock.

    - `max_running`: requests holding KV and scheduled each step (continuous batching);
    - `max_batched_tokens`: the per-step token budget; prefill is chunked to fit it, and each
      decode request uses `spec.block_size` (or 1) of it;
    - `full_pages` / `window_pages`: device page budgets (see `page_budget`);
    - `host_full_pages` / `host_window_pages`: the host offload tier (0 = off): evicted cached
      blocks move there, and a hit there costs a host→device transfer;
    - `role`: `prefill` engines answer with one token; `decode` engines expect the prompt's KV
      from a remote prefill (`SimRequest.remote_prefill`); `both` does everything;
    - `data_parallel_rank`: stamped on KV event batches.

    Invariants (checked): `window_pages` fits two windows of one request (the old and the new
    window of a step); `page_size` is one of 16, 32, 64.
    """

    profile: HardwareProfile
    full_pages: int
    window_pages: int
    max_running: int
    max_batched_tokens: int
    page_size: int = 64
    host_full_pages: int = 0
    host_window_pages: int = 0
    enable_prefix_cache: bool = True
    role: Role = "both"
    data_parallel_rank: int | None = None
    vocab_size: int = 151_936
    seed: int = 0

    def __post_init__(self) -> None:
        if self.page_size not in PAGE_SIZES:
            raise EngineConfigError(
                f"page_size: {self.page_size} unsupported; choose one of {list(PAGE_SIZES)}"
            )
        for name in ("full_pages", "max_running", "max_batched_tokens", "vocab_size"):
            if getattr(self, name) < 1:
                raise EngineConfigError(f"{name}: must be ≥ 1, got {getattr(self, name)}")
        for name in ("host_full_pages", "host_window_pages"):
            if getattr(self, name) < 0:
                raise EngineConfigError(f"{name}: must be ≥ 0")
        need = 2 * self.window_span_pages
        if self.window_pages < need:
            raise EngineConfigError(
                f"window_pages: {self.window_pages} cannot hold a request's window twice "
                f"({need} pages for sliding_window {self.model.sliding_window} at page_size "
                f"{self.page_size}); raise it to at least {need}"
            )
        q = self.profile.spec.block_size if self.profile.spec else 1
        if self.max_batched_tokens < self.max_running * q:
            raise EngineConfigError(
                f"max_batched_tokens: {self.max_batched_tokens} cannot hold a full decode batch "
                f"({self.max_running} requests × {q} tokens); raise it to at least "
                f"{self.max_running * q} or lower max_running"
            )
        if self.role not in ROLES:
            raise EngineConfigError(f"role: {self.role!r}; choose one of {list(ROLES)}")

    @property
    def model(self) -> BeamModelConfig:
        return self.profile.model

    @property
    def window_span_pages(self) -> int:
        """Most window pages one sequence holds at once: its last `sliding_window` tokens can
        straddle one more page than they fill."""
        return -(-self.model.sliding_window // self.page_size) + 1

    @classmethod
    def from_profile(cls, profile: HardwareProfile, **overrides: object) -> EngineConfig:
        """Limits from the profile, page budgets from its memory (`page_budget`); any field can
        be overridden by keyword (unknown names raise `EngineConfigError`)."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise EngineConfigError(f"unknown engine settings {unknown}; valid: {sorted(names)}")
        page_size = overrides.get("page_size", 64)
        if not isinstance(page_size, int):
            raise EngineConfigError("page_size: must be an integer")
        budget = page_budget(profile, page_size)
        values: dict[str, object] = {
            "profile": profile,
            "full_pages": budget.full_pages,
            "window_pages": budget.window_pages,
            "max_running": profile.max_running,
            "max_batched_tokens": profile.max_batched_tokens,
            "host_full_pages": budget.host_full_pages,
            "host_window_pages": budget.host_window_pages,
        }
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]
