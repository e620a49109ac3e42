"""Simulator-independent hit metrics: the `oracle` and `block_hit_unbounded`.

Both count blocks in the trace's own unit (`TraceRequest.trace_blocks`: 64-token blocks for
claude-code, 512-token blocks for Mooncake) and look only at the order of requests, never at
timing or cache capacity, so they compare with any other router's numbers on the same traces.

``hit(r, C)`` — the longest run of leading blocks of request ``r`` present in the set ``C``.

* **oracle** — one cache of unlimited capacity shared by every worker::

      oracle = Σ_r hit(r, S_r) / Σ_r blocks(r),   S_r = blocks of every request before r

  The best any router could do without recomputation (8 workers or 800).
* **block_hit_unbounded** — a policy's request → worker assignments replayed against unlimited
  per-worker caches::

      block_hit_unbounded = Σ_r hit(r, C_{w(r)}) / Σ_r blocks(r)

  with ``C_w`` the blocks of every earlier request assigned to worker ``w``. Equals the oracle
  when every request sharing a prefix with an earlier one goes where that one went.

Requests are taken in the order given (the order the router dispatched them).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlockHits:
    """Hit blocks over all blocks (`ratio` is 0 when there are no blocks)."""

    hit_blocks: int
    total_blocks: int

    @property
    def ratio(self) -> float:
        return self.hit_blocks / self.total_blocks if self.total_blocks else 0.0


def leading_hit(blocks: Sequence[int], cache: set[int]) -> int:
    """How many leading `blocks` are in `cache`."""
    k = 0
    for b in blocks:
        if b not in cache:
            break
        k += 1
    return k


def oracle_hits(requests: Iterable[Sequence[int]]) -> BlockHits:
    """The shared-unbounded-cache oracle over requests' block ids, in order."""
    seen: set[int] = set()
    hit = total = 0
    for blocks in requests:
        hit += leading_hit(blocks, seen)
        total += len(blocks)
        seen.update(blocks)
    return BlockHits(hit, total)


def block_hit_unbounded(assignments: Iterable[tuple[Sequence[int], Hashable]]) -> BlockHits:
    """``(blocks, worker)`` pairs in dispatch order, against unlimited per-worker caches."""
    caches: dict[Hashable, set[int]] = {}
    hit = total = 0
    for blocks, worker in assignments:
        cache = caches.setdefault(worker, set())
        hit += leading_hit(blocks, cache)
        total += len(blocks)
        cache.update(blocks)
    return BlockHits(hit, total)
