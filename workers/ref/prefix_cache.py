"""The prefill worker's prefix cache: chained block hashes → the pages that hold those blocks.

Keys are chained hashes of full `page_size`-token blocks (block i's hash depends on blocks
0..i), so a lookup walks a prompt's hashes and stops at the first miss: the hit is always a
prefix. The hash is `beamserve.kvwire.hashing.block_hashes` — vLLM's `sha256` block hash, the
integer its KV events carry — so the blocks this cache holds are named as the router's index
names them.

Beam has two KV lifetimes, and so does an entry: its full-attention page always, and its
window page only while the block was inside some request's sliding window. A hit of k blocks
is resumable only if the window pages of the blocks covering tokens `[k·P − window, k·P)` are
cached too (a sliding layer needs them to continue); otherwise the hit is shortened to the
longest prefix whose window tail is resident (SGLang's SWA radix cache does the same).

The cache holds one reference on every page it names (`PagePool.incref`); eviction (LRU,
leaves first: a hit touches a chain from its last block back to its first) drops them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from beamserve.kvwire import hashing


@dataclass
class CachedBlock:
    full_page: int
    window_page: int | None


HASH_SOURCE = "beamserve.kvwire.hashing.block_hashes (vLLM sha256)"


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of the full blocks of `token_ids` (vLLM's `sha256` block hash: the
    integers a vLLM KV event carries for these blocks)."""
    return hashing.block_hashes(list(token_ids), block_size)


class PrefixCache:
    """LRU map from block hash to `CachedBlock`; page reference counting is the caller's."""

    def __init__(self) -> None:
        self._blocks: OrderedDict[int, CachedBlock] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, hashes: Sequence[int]) -> list[CachedBlock]:
        """The cached blocks of the longest cached prefix of `hashes` (touched for LRU)."""
        hit: list[CachedBlock] = []
        for h in hashes:
            block = self._blocks.get(h)
            if block is None:
                break
            hit.append(block)
        for h in reversed(hashes[: len(hit)]):  # first block most recent: leaves go first
            self._blocks.move_to_end(h)
        return hit

    def get(self, h: int) -> CachedBlock | None:
        return self._blocks.get(h)

    def put(self, h: int, block: CachedBlock) -> None:
        self._blocks[h] = block

    def touch_chain(self, hashes: Sequence[int]) -> None:
        """Mark a chain most recently used, its first block last (so leaves evict first)."""
        for h in reversed(hashes):
            if h in self._blocks:
                self._blocks.move_to_end(h)

    def pop_lru(self) -> tuple[int, CachedBlock] | None:
        if not self._blocks:
            return None
        return self._blocks.popitem(last=False)

    def items(self) -> list[tuple[int, CachedBlock]]:
        return list(self._blocks.items())
