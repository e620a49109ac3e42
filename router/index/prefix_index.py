"""The router's prefix index: which KV blocks each worker holds, per KV cache group.

Contract
--------
Writes flow one way, from the engines' KV events (`apply`) and from the worker set
(`remove_worker`, `clear_worker`); routing-time guesses enter through `predict`. Reads
(`match`, `match_detailed`) answer, per worker, how much of a prompt's block chain it holds.

Beam is hybrid, so every block has two KV lifetimes, published as two groups
(``beamserve.kvwire.events``): the full-attention group (``group_idx`` 0 /
``kv_cache_spec_kind`` ``"full_attention"``) and the sliding-window group (``group_idx`` 1 /
``"sliding_window"``, window 512 tokens). An event without a group (SGLang's format, or a vLLM
event whose ``group_idx`` is None) comes from an engine that keeps one lifetime, so it counts for
both groups. A ``BlockRemoved`` names only ``group_idx``; the index maps it through the kinds it
learnt from ``BlockStored`` (default 0 → full, 1 → window). Groups of any other kind are ignored
(counted in `IndexStats.ignored_events`).

Media: ``GPU`` (and None, SGLang's omitted default) is the cache the engine reuses directly.
Any other medium (vLLM ``CPU`` / ``STORAGE``, SGLang ``CPU_PINNED`` / ``DISK`` / ``EXTERNAL``)
is kept apart as a *lower tier*, full-attention group only: it never counts for `match`, and
`match_detailed` reports it as `PrefixMatch.lower_blocks` (leading blocks on the GPU *or* a
lower tier — what a KV-offloading engine could load instead of recomputing).

Query, for block size ``B``, window ``W`` and a worker::

    k          = max { j : blocks 0..j-1 are resident in the full group }          (full_blocks)
    window_ok  = k > 0 and blocks ⌊max(0, k·B − W) / B⌋ .. k−1 are resident in the
                 window group (they cover the last W tokens of the k·B-token prefix)
    k_window   = max { j ≤ k : j = 0 or the window blocks of the j-block prefix are resident }

``k_window`` (`PrefixMatch.window_blocks`) is the best *full* hit when the longest one is only
partial: vLLM's hybrid cache manager reuses exactly that many blocks. Predicted entries
(`predict`) count as resident in both groups until a real ``BlockStored`` / ``BlockRemoved`` of
the full group for that block and worker replaces them, or until they expire;
``predicted_blocks`` counts the blocks of ``0..k-1`` that are only predicted.

Layout and cost
---------------
Worker ids are interned to bit positions ``b``; one ``dict[int, int]`` maps each block key to a
mask holding bit ``2b`` (full group resident on worker b) and bit ``2b+1`` (window group).
Block keys are the event integers folded to their low 60 bits (a 32-byte digest is first
reduced to its last 8 bytes, as vLLM does), which keeps every key a two-digit CPython int
(32 bytes); the chance of two of ten million blocks colliding is ~4·10⁻⁵. Equal masks are shared
through a small intern table. Measured with `measure_index_memory`: ~75–85 MB per million
(block, worker) entries when every block sits on one worker (the worst case), less with
replication. A match walks the prompt's blocks, ANDs masks and stops when no candidate is left:
~0.1 µs per block plus one dict lookup.

Clearing a worker (``AllBlocksCleared``, a resync, `remove_worker`) is O(1): the worker's bit is
retired and it gets a fresh one; retired bits are swept out of the masks later, a bounded number
of entries per `apply` (``sweep_budget``) or all at once with `sweep`, and only then reused.

Threading: not thread-safe. Use it from one thread (the router's asyncio loop); every method
runs to completion without awaiting, so a read never sees half a write. From another thread, go
through ``loop.call_soon_threadsafe``.

Parameters
----------
| parameter      | default          | meaning                                                   |
|----------------|------------------|-----------------------------------------------------------|
| clock          | time.monotonic   | seconds; stamps predictions when `now` is not passed      |
| sweep_budget   | 4096             | entries swept per `apply` while retired bits are pending  |
| intern_limit   | 65536            | distinct masks kept in the intern table before it resets  |

Example::

    index = PrefixIndex()
    index.apply("w0", decode_batch(payload, "vllm"))
    hits = index.match(hashes, ["w0", "w1"], block_size=64, sliding_window=512)
    hits["w0"].full_blocks, hits["w0"].window_ok
"""

from __future__ import annotations

import gc
import heapq
import itertools
import random
import sys
import time
import tracemalloc

# `operator.and_` is `_operator.and_`; imported from the C module so that the repo's `operator/`
# package (the Kubernetes operator) can never shadow it, whatever the working directory.
from _operator import and_
from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate, repeat
from typing import Protocol

from beamserve.kvwire.events import BlockStored, KVEventBatch
from beamserve.router.types import PrefixHit

__all__ = [
    "KEY_BITS",
    "IndexStats",
    "PrefixIndex",
    "PrefixIndexError",
    "PrefixMatch",
    "block_key",
    "measure_index_memory",
]

KEY_BITS = 60
_KEY_MASK = (1 << KEY_BITS) - 1

_FULL = "full"
_WINDOW = "window"
_FULL_KIND = "full_attention"
_WINDOW_KIND = "sliding_window"
_GPU_MEDIA = frozenset({"GPU", None})


class PrefixIndexError(ValueError):
    """A query or prediction the index cannot answer as asked (the message says the fix)."""


class _EventBatch(Protocol):
    @property
    def events(self) -> Sequence[object]: ...


def block_key(block_hash: int | bytes) -> int:
    """The index key of one block hash: its low 60 bits (a digest: its last 8 bytes first).

    vLLM's unsigned and SGLang's signed 64-bit event integers both fold to the same bits, so a
    router hashing prompts with ``beamserve.kvwire.hashing`` meets the engines' events.
    """
    if isinstance(block_hash, bytes):
        return int.from_bytes(block_hash[-8:], "big") & _KEY_MASK
    return block_hash & _KEY_MASK


def _keys(block_hashes: Iterable[int | bytes]) -> list[int]:
    try:
        return [h & _KEY_MASK for h in block_hashes]  # type: ignore[operator]
    except TypeError:
        return [block_key(h) for h in block_hashes]


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """One worker's hit with the detail `PrefixHit` leaves out (block counts, index block size).

    `full_blocks` / `window_ok` / `predicted_blocks`: as in `PrefixHit`. `window_blocks`: the
    longest prefix ≤ `full_blocks` whose window tail is resident (a full hit of that length;
    equals `full_blocks` when `window_ok`). `lower_blocks`: leading blocks resident in the full
    group on the GPU or a lower tier (CPU / disk), ≥ `full_blocks`.
    """

    full_blocks: int = 0
    window_ok: bool = False
    predicted_blocks: int = 0
    window_blocks: int = 0
    lower_blocks: int = 0

    @property
    def hit(self) -> PrefixHit:
        return PrefixHit(self.full_blocks, self.window_ok, self.predicted_blocks)


@dataclass(frozen=True, slots=True)
class IndexStats:
    """What the index holds. Entries count (block, worker) pairs of live workers.

    `blocks`: distinct block keys on any GPU group (live or awaiting a sweep).
    `entries`: (block, worker) pairs resident in either GPU group; `full_entries` /
    `window_entries` per group; `predicted_entries`: live predictions; `lower_entries`: lower
    tier. `retired_bits`: cleared workers' bits not yet swept. `memory_bytes`: estimate (see
    `PrefixIndex.memory_bytes`).
    """

    workers: int
    blocks: int
    entries: int
    full_entries: int
    window_entries: int
    predicted_entries: int
    lower_entries: int
    retired_bits: int
    events_applied: int
    ignored_events: int
    memory_bytes: int


class PrefixIndex:
    """Per-worker block residency in two KV groups, with predictions; see the module docstring."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        sweep_budget: int = 4096,
        intern_limit: int = 65536,
    ) -> None:
        if sweep_budget <= 0:
            raise PrefixIndexError(f"sweep_budget must be positive, got {sweep_budget}")
        self._clock = clock
        self._sweep_budget = sweep_budget
        self._intern_limit = intern_limit
        # key -> mask: bit 2b full group, bit 2b+1 window group, for worker bit b.
        self._blocks: dict[int, int] = {}
        # key -> mask of worker bits b: full group on a lower tier.
        self._lower: dict[int, int] = {}
        self._canon: dict[int, int] = {}
        self._bit_of: dict[str, int] = {}
        self._worker_of: dict[int, str] = {}
        self._free_bits: list[int] = []
        self._next_bit = 0
        # Per live bit: [full, window, pair, lower] entry counts.
        self._counts: dict[int, list[int]] = {}
        # Retired bits: waiting for a sweep, and the ones the running sweep removes.
        self._retired: set[int] = set()
        self._sweeping: set[int] = set()
        self._sweep_todo: list[tuple[dict[int, int], list[int], int]] = []
        # Predictions: per worker bit, key -> expiry; a mask (bits 2b|2b+1) for the walk.
        self._pred_by_bit: dict[int, dict[int, float]] = {}
        self._pred_mask: dict[int, int] = {}
        self._pred_heap: list[tuple[float, int, int, tuple[int, ...]]] = []
        self._pred_seq = itertools.count()
        self._group_kind: dict[int, str] = {0: _FULL, 1: _WINDOW}
        # The last tuple of hashes folded, and its keys (`match` then `predict` of one prompt).
        self._memo: tuple[tuple[int | bytes, ...], list[int]] = ((), [])
        self.events_applied = 0
        self.ignored_events = 0
        # worker id -> the last `kv_cache_spec_sliding_window` its BlockStored events carried:
        # the window the engine really runs (the router lays it over that worker's geometry).
        self.reported_windows: dict[str, int] = {}

    # -- workers ---------------------------------------------------------------------------

    @property
    def workers(self) -> list[str]:
        """Worker ids the index knows (seen in events or predictions, not removed)."""
        return list(self._bit_of)

    def _bit(self, worker_id: str) -> int:
        bit = self._bit_of.get(worker_id)
        if bit is None:
            if self._free_bits:
                bit = heapq.heappop(self._free_bits)
            else:
                bit = self._next_bit
                self._next_bit += 1
            self._bit_of[worker_id] = bit
            self._worker_of[bit] = worker_id
            self._counts[bit] = [0, 0, 0, 0]
        return bit

    def _retire(self, worker_id: str) -> bool:
        bit = self._bit_of.pop(worker_id, None)
        if bit is None:
            return False
        del self._worker_of[bit]
        del self._counts[bit]
        preds = self._pred_by_bit.pop(bit, None)
        if preds:
            clear = ~(3 << (2 * bit))
            for key in preds:
                self._clear_pred_bits(key, clear)
        self._retired.add(bit)
        return True

    def remove_worker(self, worker_id: str) -> bool:
        """Forget a worker and every entry and prediction it had (O(1)). False if unknown."""
        self.reported_windows.pop(worker_id, None)
        return self._retire(worker_id)

    def clear_worker(self, worker_id: str) -> None:
        """Drop every entry and prediction of a worker but keep it known (AllBlocksCleared,
        resync after lost events)."""
        self._retire(worker_id)
        self._bit(worker_id)

    # -- writes ----------------------------------------------------------------------------

    def _intern(self, mask: int) -> int:
        canon = self._canon
        shared = canon.get(mask)
        if shared is not None:
            return shared
        if len(canon) >= self._intern_limit:
            canon.clear()
        canon[mask] = mask
        return mask

    def _group_bits(self, group_idx: int | None, kind: str | None) -> int | None:
        """Bits within a worker's pair (1 full, 2 window, 3 both); None: not a tracked group."""
        if group_idx is None:
            return 3
        if kind is not None:
            learnt = _FULL if kind == _FULL_KIND else _WINDOW if kind == _WINDOW_KIND else kind
            self._group_kind[group_idx] = learnt
        learnt_kind = self._group_kind.get(group_idx)
        if learnt_kind == _FULL:
            return 1
        if learnt_kind == _WINDOW:
            return 2
        return None

    def apply(self, worker_id: str, batch: _EventBatch) -> None:
        """Apply one batch of a worker's KV events, in order.

        Events are recognised by class name (``BlockStored`` / ``BlockRemoved`` /
        ``AllBlocksCleared``) with vLLM field names: ``beamserve.kvwire.events`` batches (as
        the subscriber's `decode_batch` returns them, vLLM or SGLang format) or an engine's own
        classes of those names. Unknown event types and groups are counted and skipped. A
        ``kv_cache_spec_sliding_window`` is remembered per worker (`reported_windows`).
        """
        bit = self._bit(worker_id)
        for event in batch.events:
            name = type(event).__name__
            if name == "BlockStored":
                known = self._stored(bit, event)
                window = getattr(event, "kv_cache_spec_sliding_window", None)
                if window is not None:
                    self.reported_windows[worker_id] = window
            elif name == "BlockRemoved":
                known = self._removed(bit, event)
            elif name == "AllBlocksCleared":
                self.clear_worker(worker_id)
                bit = self._bit_of[worker_id]
                known = True
            else:
                known = False
            if known:
                self.events_applied += 1
            else:
                self.ignored_events += 1
        if self._retired or self._sweep_todo:
            self._sweep_step(self._sweep_budget)

    def _stored(self, bit: int, event: object) -> bool:
        group = self._group_bits(
            getattr(event, "group_idx", None), getattr(event, "kv_cache_spec_kind", None)
        )
        if group is None:
            return False
        keys = _keys(getattr(event, "block_hashes", ()))
        counts = self._counts[bit]
        if getattr(event, "medium", None) not in _GPU_MEDIA:
            if group & 1:
                self._set_lower(bit, keys, counts)
            return True
        shift = 2 * bit
        add = group << shift
        pair = 3 << shift
        blocks = self._blocks
        intern = self._intern
        for key in keys:
            old = blocks.get(key, 0)
            new = old | add
            if new != old:
                blocks[key] = intern(new)
                gained = (new ^ old) >> shift
                if gained & 1:
                    counts[0] += 1
                if gained & 2:
                    counts[1] += 1
                if not old & pair:
                    counts[2] += 1
        if group & 1:
            self._confirm(bit, keys)
        return True

    def _set_lower(self, bit: int, keys: list[int], counts: list[int]) -> None:
        lower = self._lower
        flag = 1 << bit
        for key in keys:
            old = lower.get(key, 0)
            if not old & flag:
                lower[key] = self._intern(old | flag)
                counts[3] += 1

    def _removed(self, bit: int, event: object) -> bool:
        group = self._group_bits(getattr(event, "group_idx", None), None)
        if group is None:
            return False
        keys = _keys(getattr(event, "block_hashes", ()))
        counts = self._counts[bit]
        if getattr(event, "medium", None) not in _GPU_MEDIA:
            if group & 1:
                lower = self._lower
                flag = 1 << bit
                for key in keys:
                    old = lower.get(key, 0)
                    if old & flag:
                        counts[3] -= 1
                        if old == flag:
                            del lower[key]
                        else:
                            lower[key] = self._intern(old & ~flag)
            return True
        shift = 2 * bit
        drop = group << shift
        pair = 3 << shift
        blocks = self._blocks
        for key in keys:
            old = blocks.get(key, 0)
            if not old & drop:
                continue
            new = old & ~drop
            if new:
                blocks[key] = self._intern(new)
            else:
                del blocks[key]
            lost = (old ^ new) >> shift
            if lost & 1:
                counts[0] -= 1
            if lost & 2:
                counts[1] -= 1
            if not new & pair:
                counts[2] -= 1
        if group & 1:
            self._confirm(bit, keys)
        return True

    # -- predictions -----------------------------------------------------------------------

    def predict(
        self,
        worker_id: str,
        block_hashes: Iterable[int | bytes],
        ttl_s: float,
        now: float | None = None,
    ) -> tuple[int, ...]:
        """Count these blocks as resident on the worker (both groups) for ``ttl_s`` seconds,
        or until a real full-group event for the block on that worker arrives.

        The router calls this when it sends a request: the engine will hold the prompt's blocks
        soon, before its events say so. Blocks already resident in both groups are skipped.
        Returns the keys (`block_key`) of the blocks predicted or moved to the later expiry:
        what a peer index fed the same events lacks (replica sync sends only these).
        """
        if ttl_s <= 0:
            raise PrefixIndexError(f"ttl_s must be positive, got {ttl_s}; use e.g. 10.0")
        now = self._clock() if now is None else now
        self.expire(now)
        bit = self._bit(worker_id)
        shift = 2 * bit
        pair = 3 << shift
        expiry = now + ttl_s
        preds = self._pred_by_bit.setdefault(bit, {})
        blocks = self._blocks
        pred_mask = self._pred_mask
        intern = self._intern
        added: list[int] = []
        keys = self._keys_of(block_hashes)
        for key, real in zip(keys, map(blocks.get, keys, repeat(0)), strict=True):
            if real & pair == pair:
                continue
            old = preds.get(key)
            if old is None:
                pred_mask[key] = intern(pred_mask.get(key, 0) | pair)
            elif old >= expiry:
                continue
            # A live prediction already has its bits in pred_mask (every path that drops a
            # prediction clears them): a refresh only moves the expiry.
            preds[key] = expiry
            added.append(key)
        if not added:
            return ()
        out = tuple(added)
        heapq.heappush(self._pred_heap, (expiry, next(self._pred_seq), bit, out))
        return out

    def _clear_pred_bits(self, key: int, keep: int) -> None:
        mask = self._pred_mask.get(key, 0) & keep
        if mask:
            self._pred_mask[key] = self._intern(mask)
        else:
            self._pred_mask.pop(key, None)

    def _confirm(self, bit: int, keys: list[int]) -> None:
        preds = self._pred_by_bit.get(bit)
        if not preds:
            return
        keep = ~(3 << (2 * bit))
        for key in keys:
            if preds.pop(key, None) is not None:
                self._clear_pred_bits(key, keep)

    def expire(self, now: float | None = None) -> int:
        """Drop predictions whose expiry is ≤ ``now`` (default: the clock). Returns how many."""
        now = self._clock() if now is None else now
        heap = self._pred_heap
        dropped = 0
        while heap and heap[0][0] <= now:
            _, _, bit, keys = heapq.heappop(heap)
            preds = self._pred_by_bit.get(bit)
            if preds is None:
                continue
            keep = ~(3 << (2 * bit))
            for key in keys:
                expiry = preds.get(key)
                if expiry is not None and expiry <= now:
                    del preds[key]
                    self._clear_pred_bits(key, keep)
                    dropped += 1
        return dropped

    # -- reads -----------------------------------------------------------------------------

    def _keys_of(self, block_hashes: Iterable[int | bytes]) -> list[int]:
        """`_keys`, remembered for the last tuple (immutable: safe to reuse by identity)."""
        memo_hashes, memo_keys = self._memo
        if block_hashes is memo_hashes:
            return memo_keys
        keys = _keys(block_hashes)
        if type(block_hashes) is tuple:
            self._memo = (block_hashes, keys)
        return keys

    def _candidates(self, workers: Iterable[str] | None) -> tuple[list[str], int]:
        ids = list(self._bit_of) if workers is None else list(workers)
        cand = 0
        bit_of = self._bit_of
        for worker_id in ids:
            bit = bit_of.get(worker_id)
            if bit is not None:
                cand |= 1 << (2 * bit)
        return ids, cand

    def _walk(self, keys: list[int], cand: int) -> dict[int, tuple[int, int]]:
        """Leading full-group run per candidate: {full bit position: (k, blocks of 0..k-1
        only predicted)}.

        Two passes. (1) The real (event-fed) runs at C speed: masks from ``map(dict.get)``,
        their running AND from `itertools.accumulate` (``acc[i]``: candidates holding blocks
        ``0..i-1``, shrinking as ``i`` grows), and each point where candidates drop out from a
        bisection of ``acc`` (at most one per candidate) — no Python-level loop over the
        blocks. (2) Predictions can only extend a real run: a candidate whose real run stops
        at block ``k`` continues while block ``k`` is real or predicted for it. Most runs stop
        at a block nobody predicted, one lookup (shared by candidates stopping at the same
        block); only a run that predictions really extend is walked block by block.
        """
        n = len(keys)
        reals = list(map(self._blocks.get, keys, repeat(0, n)))
        acc = list(accumulate(reals, and_, initial=cand))  # acc[i]: holders of blocks 0..i-1
        real_runs: dict[int, int] = {}
        alive, pos = cand, 0
        while alive:
            current = alive
            end = bisect_left(acc, True, pos + 1, n + 1, key=current.__ne__)
            alive = acc[end] if end <= n else 0
            gone = current & ~alive
            while gone:
                low = gone & -gone
                real_runs[low.bit_length() - 1] = end - 1
                gone ^= low
            pos = end
        pred_mask = self._pred_mask
        if not pred_mask:
            return {b: (k, 0) for b, k in real_runs.items()}
        runs: dict[int, tuple[int, int]] = {}
        guess_at: dict[int, int] = {}
        for b, k in real_runs.items():
            fflag = 1 << b
            guessed = 0
            while k < n:
                if not reals[k] & fflag:
                    guess = guess_at.get(k)
                    if guess is None:
                        guess = guess_at[k] = pred_mask.get(keys[k], 0)
                    if not guess & fflag:
                        break
                    guessed += 1
                k += 1
            runs[b] = (k, guessed)
        return runs

    def _window_and(self, keys: list[int], start: int, k: int) -> int:
        """AND over blocks ``start..k-1`` of their masks, predictions included (-1: none)."""
        blocks = self._blocks
        pred_mask = self._pred_mask
        out = -1
        for key in keys[start:k]:
            out &= blocks.get(key, 0) | pred_mask.get(key, 0)
        return out

    @staticmethod
    def _window_start(k: int, block_size: int, sliding_window: int) -> int:
        return max(0, k * block_size - sliding_window) // block_size

    def _check_query(self, block_size: int, sliding_window: int) -> None:
        if block_size <= 0:
            raise PrefixIndexError(f"block_size must be positive, got {block_size}")
        if sliding_window < 0:
            raise PrefixIndexError(
                f"sliding_window must be ≥ 0 tokens, got {sliding_window}; Beam's is 512"
            )

    def match(
        self,
        block_hashes: Sequence[int | bytes],
        workers: Iterable[str] | None = None,
        *,
        block_size: int,
        sliding_window: int,
        now: float | None = None,
    ) -> dict[str, PrefixHit]:
        """Each worker's hit for a prompt's block chain (block size ``block_size`` tokens).

        ``workers``: the candidates (None: every known worker); unknown ids get an empty
        `PrefixHit`. Predictions expired at ``now`` (default: the clock) do not count.
        """
        self._check_query(block_size, sliding_window)
        ids, cand = self._candidates(workers)
        if self._pred_heap:
            self.expire(now)
        empty = PrefixHit()
        if not cand:
            return dict.fromkeys(ids, empty)
        keys = self._keys_of(block_hashes)
        runs = self._walk(keys, cand)
        out: dict[str, PrefixHit] = {}
        bit_of = self._bit_of
        window_of: dict[int, int] = {}  # k → AND of the masks of k's window blocks
        hits: dict[tuple[int, bool, int], PrefixHit] = {}  # equal hits share one (frozen) object
        for worker_id in ids:
            bit = bit_of.get(worker_id)
            run = None if bit is None else runs.get(2 * bit)
            if bit is None or run is None or run[0] == 0:
                out[worker_id] = empty
                continue
            k, guessed = run
            window = window_of.get(k)
            if window is None:
                start = self._window_start(k, block_size, sliding_window)
                window = window_of[k] = self._window_and(keys, start, k)
            shape = (k, bool(window >> (2 * bit + 1) & 1), guessed)
            hit = hits.get(shape)
            if hit is None:
                hit = hits[shape] = PrefixHit(*shape)
            out[worker_id] = hit
        return out

    def match_detailed(
        self,
        block_hashes: Sequence[int | bytes],
        workers: Iterable[str] | None = None,
        *,
        block_size: int,
        sliding_window: int,
        now: float | None = None,
    ) -> dict[str, PrefixMatch]:
        """`match` plus `PrefixMatch.window_blocks` (longest full hit) and `lower_blocks`."""
        hits = self.match(
            block_hashes, workers, block_size=block_size, sliding_window=sliding_window, now=now
        )
        keys = _keys(block_hashes)
        out: dict[str, PrefixMatch] = {}
        for worker_id, hit in hits.items():
            bit = self._bit_of.get(worker_id)
            if bit is None:
                out[worker_id] = PrefixMatch()
                continue
            k = hit.full_blocks
            window_blocks = (
                k if hit.window_ok else self._best_window(keys, bit, k, block_size, sliding_window)
            )
            out[worker_id] = PrefixMatch(
                k,
                hit.window_ok,
                hit.predicted_blocks,
                window_blocks,
                self._lower_run(keys, bit, k),
            )
        return out

    def _best_window(
        self, keys: list[int], bit: int, k: int, block_size: int, sliding_window: int
    ) -> int:
        wflag = 1 << (2 * bit + 1)
        blocks = self._blocks
        pred_mask = self._pred_mask
        missing = [
            j for j in range(k) if not (blocks.get(keys[j], 0) | pred_mask.get(keys[j], 0)) & wflag
        ]
        # Candidates are k itself and each missing block's index: a prefix ending right
        # before a hole is the longest one that might avoid it.
        candidate = k
        while candidate > 0:
            last = next((j for j in reversed(missing) if j < candidate), None)
            if last is None or last < self._window_start(candidate, block_size, sliding_window):
                return candidate
            candidate = last
        return 0

    def _lower_run(self, keys: list[int], bit: int, k: int) -> int:
        flag = 1 << bit
        lower = self._lower
        full = 1 << (2 * bit)
        blocks = self._blocks
        n = k
        while n < len(keys) and (lower.get(keys[n], 0) & flag or blocks.get(keys[n], 0) & full):
            n += 1
        return n

    # -- sweeping retired bits -------------------------------------------------------------

    def sweep(self, budget: int | None = None) -> bool:
        """Remove retired workers' bits from the masks, at most ``budget`` entries (None: all).
        Returns True when nothing is left to sweep. `apply` calls it with ``sweep_budget``."""
        return self._sweep_step(budget)

    def _sweep_step(self, budget: int | None) -> bool:
        if not self._sweep_todo:
            if not self._retired:
                return True
            self._sweeping, self._retired = self._retired, set()
            pair_dead = 0
            flat_dead = 0
            for bit in self._sweeping:
                pair_dead |= 3 << (2 * bit)
                flat_dead |= 1 << bit
            self._sweep_todo = [
                (self._blocks, list(self._blocks), pair_dead),
                (self._lower, list(self._lower), flat_dead),
            ]
        left = budget
        while self._sweep_todo:
            table, keys, dead = self._sweep_todo[-1]
            take = len(keys) if left is None else min(left, len(keys))
            keep = ~dead
            for _ in range(take):
                key = keys.pop()
                mask = table.get(key)
                if mask is not None and mask & dead:
                    mask &= keep
                    if mask:
                        table[key] = self._intern(mask)
                    else:
                        del table[key]
            if not keys:
                self._sweep_todo.pop()
            if left is not None:
                left -= take
                if left <= 0 and self._sweep_todo:
                    return False
        for bit in self._sweeping:
            heapq.heappush(self._free_bits, bit)
        self._sweeping = set()
        return not self._retired if budget is not None else self._sweep_step(None)

    # -- accounting ------------------------------------------------------------------------

    def memory_bytes(self) -> int:
        """Estimated bytes held: hash tables (``sys.getsizeof``), 32 bytes per key int, the
        interned masks, predictions at ~100 bytes each. Masks made while the intern table was
        reset and not yet re-shared are not counted; `measure_index_memory` measures for real."""
        size = sys.getsizeof(self._blocks) + sys.getsizeof(self._lower)
        size += 32 * (len(self._blocks) + len(self._lower))
        size += sys.getsizeof(self._canon) + sum(sys.getsizeof(m) for m in self._canon)
        size += sys.getsizeof(self._pred_mask) + 32 * len(self._pred_mask)
        size += sum(100 * len(p) for p in self._pred_by_bit.values())
        return size

    def stats(self) -> IndexStats:
        full = window = pairs = lower = 0
        for counts in self._counts.values():
            full += counts[0]
            window += counts[1]
            pairs += counts[2]
            lower += counts[3]
        return IndexStats(
            workers=len(self._bit_of),
            blocks=len(self._blocks),
            entries=pairs,
            full_entries=full,
            window_entries=window,
            predicted_entries=sum(len(p) for p in self._pred_by_bit.values()),
            lower_entries=lower,
            retired_bits=len(self._retired) + len(self._sweeping),
            events_applied=self.events_applied,
            ignored_events=self.ignored_events,
            memory_bytes=self.memory_bytes(),
        )

    def worker_entries(self, worker_id: str) -> int:
        """(block, worker) entries of one worker in either GPU group (0 if unknown)."""
        bit = self._bit_of.get(worker_id)
        return 0 if bit is None else self._counts[bit][2]

    def resident(self, worker_id: str) -> dict[str, set[int]]:
        """The block keys a worker holds per tier: ``{"full", "window", "lower"}`` (real
        events only, no predictions). O(index size): for tests and debugging."""
        out: dict[str, set[int]] = {_FULL: set(), _WINDOW: set(), "lower": set()}
        bit = self._bit_of.get(worker_id)
        if bit is None:
            return out
        full, window = 1 << (2 * bit), 1 << (2 * bit + 1)
        for key, mask in self._blocks.items():
            if mask & full:
                out[_FULL].add(key)
            if mask & window:
                out[_WINDOW].add(key)
        flag = 1 << bit
        out["lower"] = {key for key, mask in self._lower.items() if mask & flag}
        return out


def measure_index_memory(
    n_blocks: int, n_workers: int, *, replication: int = 1, seed: int = 0
) -> float:
    """Measured memory (tracemalloc) of an index, in MB (10⁶ bytes) per million (block,
    worker) entries.

    ``n_blocks`` distinct random 64-bit block hashes, each stored on ``replication`` of
    ``n_workers`` workers (random, distinct) in both GPU groups (Beam's worst case: window blocks
    never freed), in batches of 32-block chains. Entries = ``n_blocks · replication``.
    """
    if n_blocks <= 0 or n_workers <= 0 or not 1 <= replication <= n_workers:
        raise PrefixIndexError(
            "need n_blocks > 0, n_workers > 0 and 1 ≤ replication ≤ n_workers; got "
            f"{n_blocks}, {n_workers}, {replication}"
        )
    rng = random.Random(seed)
    workers = [f"worker-{i}" for i in range(n_workers)]
    chain = 32
    plan: list[tuple[list[str], tuple[int, ...]]] = []
    for start in range(0, n_blocks, chain):
        hashes = tuple(rng.getrandbits(64) for _ in range(min(chain, n_blocks - start)))
        plan.append((rng.sample(workers, replication), hashes))
    gc.collect()
    was_tracing = tracemalloc.is_tracing()
    if not was_tracing:
        tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = PrefixIndex()
        for owners, hashes in plan:
            batch = KVEventBatch(0.0, (BlockStored(hashes, None, (), 64),))
            for worker_id in owners:
                index.apply(worker_id, batch)
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        if not was_tracing:
            tracemalloc.stop()
    del index
    return used / 1e6 / (n_blocks * replication / 1e6)
