"""KV-cache events: what an engine tells the router about the blocks it holds.

The narrow interface between engines (the simulator, the reference engine) and whatever
publishes their events (the ZMQ publisher in vLLM's wire format, a test recorder). Engines call
a `KVEventSink` with one `KVEventBatch` per engine step; publishers encode it. Field names and
meanings follow vLLM's `vllm/distributed/kv_events.py` (REFERENCE.md, "KV events"), so the
encoder is a field-for-field copy:

- `BlockStored`: blocks newly resident on `medium`; `block_hashes` are chained (each block's hash
  covers its parent's), `parent_block_hash` is the hash of the block before the first one, or
  `None` at the start of a sequence. `token_ids` holds `block_size` tokens per block, or is empty
  when the engine only knows hashes (trace replays).
- `BlockRemoved`: blocks no longer resident on `medium`.
- `AllBlocksCleared`: the engine dropped its whole cache (reset or restart).

Beam's hybrid attention gives every block two KV lifetimes, published as two groups:
`group_idx` `FULL_GROUP` (`kv_cache_spec_kind` `"full_attention"`) for the full-attention layers,
and `WINDOW_GROUP` (`"sliding_window"`, with `kv_cache_spec_sliding_window` set) for the
sliding-window layers, so a consumer can tell whether a hit's window tail is still resident.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

FULL_GROUP = 0
WINDOW_GROUP = 1
FULL_ATTENTION_KIND = "full_attention"
SLIDING_WINDOW_KIND = "sliding_window"
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks newly resident in one group on one medium (vLLM `BlockStored`)."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    group_idx: int
    kv_cache_spec_kind: str
    kv_cache_spec_sliding_window: int | None = None
    medium: str = MEDIUM_GPU
    lora_id: int | None = None
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks evicted from one group on one medium (vLLM `BlockRemoved`)."""

    block_hashes: tuple[int, ...]
    group_idx: int
    medium: str = MEDIUM_GPU


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every block on every medium is gone (vLLM `AllBlocksCleared`)."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    """The events of one engine step, in the order they happened.

    `ts` is the engine's clock time in seconds when the step ended (virtual seconds under a
    virtual clock); `data_parallel_rank` is the engine's DP rank, `None` without DP.
    """

    ts: float
    events: tuple[KVCacheEvent, ...]
    data_parallel_rank: int | None = None


class KVEventSink(Protocol):
    """Receives each batch once, in order; must not block (publishers queue internally)."""

    def __call__(self, batch: KVEventBatch, /) -> None: ...
