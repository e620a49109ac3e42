"""Beam KV topology: which heads a TP rank owns, and where every byte of its paged KV lives.

Per rank, the registered KV region is one contiguous buffer:

    [full-attention layers][sliding layers]
    each layer:  [K pages][V pages]
    each page:   HND  [local_heads, page_size, head_dim]   (default)
                 NHD  [page_size, local_heads, head_dim]

Full-attention layers have `full_pages` pages per rank and keep every token of a request;
sliding layers have `window_pages` pages per rank and keep only the pages that cover the last
`sliding_window` tokens (the engine frees the rest as the window slides).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import numpy.typing as npt
from beamserve.kv_transfer.errors import TopologyError, TransferPlanError
from beamserve.kv_transfer.model import BeamModelConfig

IntArray = npt.NDArray[np.int64]
PAGE_SIZES = (16, 32, 64)


class KVDtype(enum.StrEnum):
    BF16 = "bf16"
    FP8_E4M3 = "fp8_e4m3"

    @property
    def nbytes(self) -> int:
        return 2 if self is KVDtype.BF16 else 1


class KVLayout(enum.StrEnum):
    HND = "HND"
    NHD = "NHD"


@dataclass(frozen=True)
class PoolTopology:
    """One pool's parallel layout: TP size, page size, KV dtype and in-page memory layout."""

    tp_size: int
    page_size: int = 64
    kv_dtype: KVDtype = KVDtype.BF16
    layout: KVLayout = KVLayout.HND

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise TopologyError(f"tp_size: must be ≥ 1, got {self.tp_size}")
        if self.page_size not in PAGE_SIZES:
            raise TopologyError(
                f"page_size: {self.page_size} unsupported; choose one of {list(PAGE_SIZES)}"
            )
        for name, kind in (("kv_dtype", KVDtype), ("layout", KVLayout)):
            value = getattr(self, name)
            try:
                object.__setattr__(self, name, kind(value))
            except ValueError:
                raise TopologyError(
                    f"{name}: {value!r} unsupported; choose one of {[v.value for v in kind]}"
                ) from None

    def check_model(self, model: BeamModelConfig) -> None:
        """Raise `TopologyError` unless TP shards the model's KV heads evenly."""
        k, t = model.num_key_value_heads, self.tp_size
        if (t <= k and k % t) or (t > k and t % k):
            raise TopologyError(
                f"tp_size: {t} cannot shard {k} KV heads; choose a divisor of {k} "
                f"({_divisors(k)}) or a multiple of it"
            )

    def heads_per_rank(self, model: BeamModelConfig) -> int:
        return max(1, model.num_key_value_heads // self.tp_size)

    def replicas_per_head(self, model: BeamModelConfig) -> int:
        return max(1, self.tp_size // model.num_key_value_heads)

    def heads_of_rank(self, model: BeamModelConfig, rank: int) -> range:
        """Global KV heads owned by `rank`, in local order."""
        k, t = model.num_key_value_heads, self.tp_size
        if not 0 <= rank < t:
            raise TopologyError(f"rank: {rank} outside [0, {t})")
        if t <= k:
            per = k // t
            return range(rank * per, (rank + 1) * per)
        h = rank * k // t
        return range(h, h + 1)

    def ranks_of_head(self, model: BeamModelConfig, head: int) -> tuple[int, ...]:
        """All ranks that hold `head` (more than one when TP > KV heads)."""
        k, t = model.num_key_value_heads, self.tp_size
        if t <= k:
            return (head // (k // t),)
        reps = t // k
        return tuple(range(head * reps, (head + 1) * reps))


@dataclass(frozen=True)
class PoolLayout:
    """Byte layout of one rank's registered KV region (identical on every rank of a pool)."""

    model: BeamModelConfig
    topology: PoolTopology
    full_pages: int
    window_pages: int

    def __post_init__(self) -> None:
        self.topology.check_model(self.model)
        if self.full_pages < 1 or self.window_pages < 1:
            raise TopologyError("full_pages/window_pages: must be ≥ 1 page each")

    @property
    def local_heads(self) -> int:
        return self.topology.heads_per_rank(self.model)

    @property
    def row_bytes(self) -> int:
        """Bytes of one token of one head (head_dim × KV dtype)."""
        return self.model.head_dim * self.topology.kv_dtype.nbytes

    @property
    def page_bytes(self) -> int:
        return self.local_heads * self.topology.page_size * self.row_bytes

    @cached_property
    def layer_base(self) -> IntArray:
        """Byte offset of each layer's K buffer; its V buffer follows `kv_stride` later."""
        base = np.zeros(self.model.num_hidden_layers, dtype=np.int64)
        off = 0
        for group, pages in (
            (self.model.full_layers, self.full_pages),
            (self.model.sliding_layers, self.window_pages),
        ):
            for layer in group:
                base[layer] = off
                off += 2 * pages * self.page_bytes
        return base

    def kv_stride(self, layer: int) -> int:
        pages = (
            self.full_pages
            if self.model.layer_types[layer] == "full_attention"
            else (self.window_pages)
        )
        return pages * self.page_bytes

    @property
    def region_bytes(self) -> int:
        nf, ns = len(self.model.full_layers), len(self.model.sliding_layers)
        return 2 * self.page_bytes * (nf * self.full_pages + ns * self.window_pages)

    def token_offset(self, layer: int, kv: int, page: int, local_head: int, slot: int) -> int:
        """Byte offset of (layer, K=0/V=1, page, local head, token slot) in the region."""
        base = int(self.layer_base[layer]) + kv * self.kv_stride(layer) + page * self.page_bytes
        P, row, H = self.topology.page_size, self.row_bytes, self.local_heads
        if self.topology.layout is KVLayout.HND:
            return base + (local_head * P + slot) * row
        return base + (slot * H + local_head) * row


def window_start(seq_len: int, window: int) -> int:
    """First token a sliding layer still needs: the last `window` tokens are kept."""
    return max(0, seq_len - window)


def pages_needed(seq_len: int, page_size: int) -> int:
    return -(-seq_len // page_size)


def first_window_page(seq_len: int, window: int, page_size: int) -> int:
    return window_start(seq_len, window) // page_size


@dataclass(frozen=True)
class RequestPages:
    """A request's page tables on one pool (shared by all ranks of the pool).

    `full[i]` holds tokens `[i·P, (i+1)·P)` of every full-attention layer; `window[j]` holds
    tokens of logical page `first_window_page + j` of every sliding layer.
    """

    full: IntArray
    window: IntArray

    @classmethod
    def of(cls, full: npt.ArrayLike, window: npt.ArrayLike) -> RequestPages:
        return cls(
            np.asarray(full, dtype=np.int64).reshape(-1),
            np.asarray(window, dtype=np.int64).reshape(-1),
        )

    def check(self, side: str, layout: PoolLayout, seq_len: int) -> None:
        """Raise `TransferPlanError` unless these tables exactly cover `seq_len` tokens."""
        m, P = layout.model, layout.topology.page_size
        want_full = pages_needed(seq_len, P)
        want_win = (
            0
            if seq_len == 0
            else pages_needed(seq_len, P) - first_window_page(seq_len, m.sliding_window, P)
        )
        for name, pages, want, limit in (
            ("full", self.full, want_full, layout.full_pages),
            ("window", self.window, want_win, layout.window_pages),
        ):
            if len(pages) != want:
                raise TransferPlanError(
                    f"{side}_pages.{name}: {len(pages)} pages given, {want} needed for "
                    f"seq_len {seq_len} at page_size {P}"
                )
            if len(pages) and (pages.min() < 0 or pages.max() >= limit):
                raise TransferPlanError(
                    f"{side}_pages.{name}: page ids must lie in [0, {limit}); got "
                    f"[{pages.min()}, {pages.max()}]"
                )
            if len(pages) and np.bincount(pages, minlength=limit).max() > 1:
                raise TransferPlanError(f"{side}_pages.{name}: a page id appears twice")


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
