"""Beam's paged KV cache with a prefix cache: two page pools, LRU eviction, a host tier.

Beam's hybrid attention gives each token two KV lifetimes, kept in two groups of pages:

- `FULL_GROUP`: pages of the full-attention layers; a sequence holds one page per
  `page_size` tokens for its whole life.
- `WINDOW_GROUP`: pages of the sliding layers; a sequence holds only the pages that cover its
  last `sliding_window` tokens. Pages that fall out of the window are released as it slides.

Prefix cache. A full block (`page_size` tokens) whose chained hash is known is *registered*
when its KV is complete: the page becomes a shared, reference-counted cached block keyed by the
hash, separately in each group. (When another sequence registered the same hash first, the
sequence switches to that block and frees its own copy.) Released blocks stay cached with
reference 0 in an LRU order and are evicted least-recently-released first, only when a page is
needed; a block referenced by a live sequence is never evicted. A sequence releases its blocks
last-first, so the tail of a prefix is evicted before its head. Window blocks are evicted
independently of full blocks, so a prefix can keep its full-attention KV and lose its window.

A hit is the longest run of leading blocks present in the full group (on the device or the
host tier). Reusing `L` blocks (`p = L · page_size` tokens) also needs the window pages that
cover tokens `[p − sliding_window, p)`. When all of them are cached the hit is complete;
otherwise it is *partial*: the full-attention KV of the `L` blocks is reused and the window tail
(from the first page of that range to `p`) is recomputed: the sequence starts its prefill there
while already holding its full pages up to `p`.

Host tier (optional): a device block evicted from the cache is copied to host memory (LRU, a
fixed page count per group); a hit there is loaded into a fresh device page (the caller charges
the transfer time). Every change is reported as a KV-cache event (`take_events`).

Pages are real ids so accounting can be checked exactly (`check()`): a page is free, private to
one live sequence (incomplete, unhashed or not yet registered), or the page of one cached block.
A sequence's shared full-attention blocks are always a prefix of its blocks, so hits and
releases are bulk operations (reference counts live in an array indexed by page).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from beamserve.kv_transfer.model import BeamModelConfig
from beamserve.kvwire.events import (
    FULL_ATTENTION_KIND,
    FULL_GROUP,
    MEDIUM_CPU,
    MEDIUM_GPU,
    SLIDING_WINDOW_KIND,
    WINDOW_GROUP,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)

GROUPS = (FULL_GROUP, WINDOW_GROUP)


class PageAccountingError(RuntimeError):
    """An internal page-accounting invariant broke (a bug, never a user error)."""


@dataclass(frozen=True, slots=True)
class _HostBlock:
    parent: int | None
    tokens: tuple[int, ...]


class _Group:
    """The device pages of one group and the cached blocks living in them.

    `ref[page]` counts live sequences holding the cached block on `page`; cached blocks with
    ref 0 are evictable, in a lazy LRU: `lru` holds chunks `(pages, stamp)` in release order, and
    an entry is current only while its page is cached, unreferenced and still stamped `stamp`
    (a later release re-stamps it; older entries are skipped and compacted away in bulk).
    """

    __slots__ = (
        "allocated",
        "by_hash",
        "cached",
        "capacity",
        "evictable",
        "fresh",
        "gid",
        "head",
        "lru",
        "lru_len",
        "page_hash",
        "parent",
        "recycled",
        "ref",
        "stamp",
        "ticks",
        "tokens",
    )

    def __init__(self, gid: int, capacity: int) -> None:
        self.gid = gid
        self.capacity = capacity
        # Free pages: `recycled` (a stack) plus the never-used ids [fresh, capacity), so a pool
        # of half a million pages costs nothing to create.
        self.recycled: list[int] = []
        self.fresh = 0
        self.allocated = bytearray(capacity)
        self.by_hash: dict[int, int] = {}  # hash → page of every cached block
        self.page_hash: dict[int, int] = {}  # page → hash (inverse of by_hash)
        self.parent: dict[int, int | None] = {}  # hash → parent hash (for host copies/events)
        self.tokens: dict[int, tuple[int, ...]] = {}  # hash → tokens, when known
        self.cached = np.zeros(capacity, dtype=np.bool_)
        self.ref = np.zeros(capacity, dtype=np.int32)
        self.stamp = np.zeros(capacity, dtype=np.int64)
        self.lru: deque[tuple[npt.NDArray[np.int64], int]] = deque()
        self.head = 0  # entries of lru[0] already consumed
        self.lru_len = 0
        self.evictable = 0
        self.ticks = 0

    @property
    def free(self) -> int:
        return len(self.recycled) + self.capacity - self.fresh

    @property
    def used(self) -> int:
        return self.capacity - self.free

    @property
    def available(self) -> int:
        return self.free + self.evictable

    def take_free(self) -> int:
        if self.recycled:
            page = self.recycled.pop()
        else:
            page = self.fresh
            self.fresh += 1
        self.allocated[page] = 1
        return page

    def take_free_many(self, n: int) -> list[int]:
        """`n` free pages (the caller checked `free >= n`)."""
        rec = self.recycled
        k = min(n, len(rec))
        pages = rec[len(rec) - k :]
        del rec[len(rec) - k :]
        if k < n:
            pages.extend(range(self.fresh, self.fresh + n - k))
            self.fresh += n - k
        alloc = self.allocated
        for page in pages:
            alloc[page] = 1
        return pages

    def release(self, page: int) -> None:
        if not self.allocated[page]:
            raise PageAccountingError(f"group {self.gid}: page {page} freed twice")
        if self.cached[page]:
            raise PageAccountingError(f"group {self.gid}: page {page} freed while cached")
        self.allocated[page] = 0
        self.recycled.append(page)

    def free_pages(self) -> list[int]:
        """Every free page id (for checks)."""
        return self.recycled + list(range(self.fresh, self.capacity))

    def register(
        self,
        pages: list[int],
        hashes: Sequence[int],
        parents: Sequence[int | None],
        tokens: Sequence[tuple[int, ...]] | None,
    ) -> None:
        """Private pages become the cached blocks `hashes`, held by their sequence (ref 1)."""
        self.by_hash.update(zip(hashes, pages, strict=True))
        self.page_hash.update(zip(pages, hashes, strict=True))
        self.parent.update(zip(hashes, parents, strict=True))
        if tokens is not None:
            self.tokens.update(zip(hashes, tokens, strict=True))
        arr = np.asarray(pages, dtype=np.int64)
        self.cached[arr] = True
        self.ref[arr] = 1

    def meta(self, h: int) -> _HostBlock:
        return _HostBlock(self.parent.get(h), self.tokens.get(h, ()))

    def pin(self, pages: list[int]) -> None:
        if not pages:
            return
        arr = np.asarray(pages, dtype=np.int64)
        r = self.ref[arr]
        self.evictable -= int(np.count_nonzero(r == 0))
        self.ref[arr] = r + 1

    def pin1(self, page: int) -> None:
        if self.ref[page] == 0:
            self.evictable -= 1
        self.ref[page] += 1

    def unpin(self, pages: list[int]) -> None:
        """Drop one reference from each page; those reaching 0 join the LRU, the last page of
        `pages` first (evicted first)."""
        if not pages:
            return
        arr = np.asarray(pages, dtype=np.int64)
        r = self.ref[arr] - 1
        if r.min() < 0:
            raise PageAccountingError(f"group {self.gid}: block released more than held")
        self.ref[arr] = r
        zero = arr[r == 0][::-1]
        if zero.size:
            self._push(zero)

    def unpin1(self, page: int) -> None:
        r = int(self.ref[page]) - 1
        if r < 0:
            raise PageAccountingError(f"group {self.gid}: block released more than held")
        self.ref[page] = r
        if r == 0:
            self._push(np.array([page], dtype=np.int64))

    def _push(self, pages: npt.NDArray[np.int64]) -> None:
        self.ticks += 1
        self.stamp[pages] = self.ticks
        self.lru.append((pages, self.ticks))
        self.lru_len += int(pages.size)
        self.evictable += int(pages.size)
        if self.lru_len > 2 * self.evictable + 4096:
            self._compact()

    def evict(self) -> tuple[int, int]:
        """Remove the least recently released unreferenced block; returns (hash, page) with the
        page still allocated (the caller reuses or releases it)."""
        lru, cached, ref, stamp = self.lru, self.cached, self.ref, self.stamp
        while lru:
            pages, st = lru[0]
            n = len(pages)
            while self.head < n:
                page = int(pages[self.head])
                self.head += 1
                self.lru_len -= 1
                if cached[page] and ref[page] == 0 and stamp[page] == st:
                    h = self.page_hash.pop(page)
                    del self.by_hash[h]
                    cached[page] = False
                    self.evictable -= 1
                    return h, page
            lru.popleft()
            self.head = 0
        raise PageAccountingError(f"group {self.gid}: nothing to evict (capacity not checked)")

    def current_pages(self) -> list[int]:
        """Pages of the current LRU entries, next to be evicted first."""
        out: list[int] = []
        for k, (pages, st) in enumerate(self.lru):
            rest = pages[self.head :] if k == 0 else pages
            keep = rest[self.cached[rest] & (self.ref[rest] == 0) & (self.stamp[rest] == st)]
            out.extend(keep.tolist())
        return out

    def _compact(self) -> None:
        chunks: deque[tuple[npt.NDArray[np.int64], int]] = deque()
        total = 0
        for k, (pages, st) in enumerate(self.lru):
            rest = pages[self.head :] if k == 0 else pages
            keep = rest[self.cached[rest] & (self.ref[rest] == 0) & (self.stamp[rest] == st)]
            if keep.size:
                chunks.append((keep, st))
                total += int(keep.size)
        self.lru, self.head, self.lru_len = chunks, 0, total


class SeqKV:
    """One sequence's pages.

    Full group: `full_shared[i]` is the page of cached block i for i < S = len(full_shared);
    `full_private[j]` is the private page of block S + j. Window group: `window[i]` is
    `(page, shared)` for each page index i held.
    """

    __slots__ = (
        "block_hashes",
        "full_private",
        "full_shared",
        "origin_page",
        "token_ids",
        "window",
    )

    def __init__(
        self, block_hashes: Sequence[int], token_ids: Sequence[int] | None, origin_page: int = 0
    ) -> None:
        self.block_hashes: tuple[int, ...] = tuple(block_hashes)
        self.token_ids: tuple[int, ...] | None = tuple(token_ids) if token_ids is not None else None
        #: first page whose KV this sequence computes itself (its prefill starts there)
        self.origin_page = origin_page
        self.full_shared: list[int] = []
        self.full_private: list[int] = []
        self.window: dict[int, tuple[int, bool]] = {}

    @property
    def full_pages(self) -> int:
        return len(self.full_shared) + len(self.full_private)

    def parent_of(self, i: int) -> int | None:
        return self.block_hashes[i - 1] if i > 0 else None

    def tokens_of(self, i: int, page_size: int) -> tuple[int, ...]:
        if self.token_ids is None:
            return ()
        return self.token_ids[i * page_size : (i + 1) * page_size]


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """What the cache can give a new sequence.

    - `blocks`: leading blocks whose full-attention KV is cached; `cached_tokens` = p =
      `blocks · page_size`;
    - `host_full`: how many of those blocks are on the host tier only (they get loaded);
    - `window_complete`: the window pages for `[p − sliding_window, p)` are all cached;
    - `window_first`: the first page index of that window range;
    - `host_window`: window pages among them found on the host only (0 for a partial hit);
    - `start`: where prefill starts: `p` for a complete hit, the window range's first token
      for a partial one (that tail is recomputed).
    """

    blocks: int
    cached_tokens: int
    host_full: int
    window_complete: bool
    window_first: int
    host_window: int
    start: int

    @property
    def recompute_tokens(self) -> int:
        """Tokens of the window tail recomputed because of a partial hit."""
        return self.cached_tokens - self.start


NO_MATCH = PrefixMatch(0, 0, 0, True, 0, 0, 0)


class KVCacheManager:
    """The device page pools, the prefix cache in both groups and the host tier.

    Invariants (`check()`): per group, allocated pages = cached blocks' pages ⊎ private pages
    of live sequences; a cached block's reference count equals the live sequences holding it;
    the evictable blocks are exactly the unreferenced cached ones, each with one current LRU
    entry; host tiers hold at most their capacity; pages in use never exceed the budget.
    """

    def __init__(
        self,
        model: BeamModelConfig,
        *,
        page_size: int,
        full_pages: int,
        window_pages: int,
        host_full_pages: int = 0,
        host_window_pages: int = 0,
        enable_prefix_cache: bool = True,
    ) -> None:
        self.page_size = page_size
        self.window = model.sliding_window
        self.enable_prefix_cache = enable_prefix_cache
        self.groups = (_Group(FULL_GROUP, full_pages), _Group(WINDOW_GROUP, window_pages))
        self.host_capacity = (host_full_pages, host_window_pages)
        self.host: tuple[OrderedDict[int, _HostBlock], OrderedDict[int, _HostBlock]] = (
            OrderedDict(),
            OrderedDict(),
        )
        self._host_on = host_full_pages > 0 or host_window_pages > 0
        self._live: dict[int, SeqKV] = {}
        self._events: list[KVEvent] = []
        self._removed: tuple[int, str, list[int]] | None = None  # run of BlockRemoved

    # --- queries ---------------------------------------------------------------------------

    def first_window_page(self, seq_len: int) -> int:
        return max(0, seq_len - self.window) // self.page_size

    def pages_for(self, seq_len: int) -> int:
        return -(-seq_len // self.page_size)

    def available(self, group: int) -> int:
        """Pages obtainable now: free ones plus evictable cached ones."""
        return self.groups[group].available

    def evictable(self, group: int) -> int:
        return self.groups[group].evictable

    def used(self, group: int) -> int:
        return self.groups[group].used

    def capacity(self, group: int) -> int:
        return self.groups[group].capacity

    def cached_blocks(self, group: int) -> int:
        return len(self.groups[group].by_hash)

    def is_cached(self, group: int, block_hash: int) -> bool:
        return block_hash in self.groups[group].by_hash

    def match(self, block_hashes: Sequence[int], prompt_len: int) -> PrefixMatch:
        """The longest usable hit for a prompt of `prompt_len` tokens whose full blocks have
        `block_hashes` (at least one token is always left to compute). Does not change state."""
        P = self.page_size
        limit = min(len(block_hashes), (prompt_len - 1) // P) if prompt_len > 0 else 0
        if not self.enable_prefix_cache or limit <= 0:
            return NO_MATCH
        dev = self.groups[FULL_GROUP].by_hash
        head = block_hashes[:limit]
        blocks = len(list(itertools.takewhile(dev.__contains__, head)))
        host_full = 0
        if self._host_on and blocks < limit:
            host = self.host[FULL_GROUP]
            for h in head[blocks:]:
                if h in dev:
                    blocks += 1
                elif h in host:
                    blocks += 1
                    host_full += 1
                else:
                    break
        p = blocks * P
        first = self.first_window_page(p)
        wdev, whost = self.groups[WINDOW_GROUP].by_hash, self.host[WINDOW_GROUP]
        host_window = 0
        for i in range(first, blocks):
            h = block_hashes[i]
            if h in wdev:
                continue
            if h in whost:
                host_window += 1
                continue
            return PrefixMatch(blocks, p, host_full, False, first, 0, first * P)
        return PrefixMatch(blocks, p, host_full, True, first, host_window, p)

    def open_cost(
        self, block_hashes: Sequence[int], match: PrefixMatch, target: int
    ) -> tuple[int, int]:
        """(full, window) pages `open` + `grow(target)` would take from what is available:
        host loads, new pages up to `target`, and the evictable blocks the hit itself pins."""
        full_g, win_g = self.groups
        dev = full_g.by_hash
        hit = block_hashes[: match.blocks]
        if match.host_full:
            dev_pages = [dev[h] for h in hit if h in dev]
        else:
            dev_pages = list(map(dev.__getitem__, hit))
        pinned_full = (
            int(np.count_nonzero(full_g.ref[np.asarray(dev_pages, dtype=np.int64)] == 0))
            if dev_pages
            else 0
        )
        full = match.host_full + max(0, self.pages_for(target) - match.blocks) + pinned_full
        window = match.host_window
        have: set[int] = set()
        if match.window_complete:
            have = set(range(match.window_first, match.blocks))
            for i in have:
                page = win_g.by_hash.get(block_hashes[i])
                if page is not None and win_g.ref[page] == 0:
                    window += 1
        lo = max(self.first_window_page(target), match.start // self.page_size)
        window += sum(1 for i in range(lo, self.pages_for(target)) if i not in have)
        return full, window

    def can_open(self, block_hashes: Sequence[int], match: PrefixMatch, target: int) -> bool:
        full, window = self.open_cost(block_hashes, match, target)
        return full <= self.available(FULL_GROUP) and window <= self.available(WINDOW_GROUP)

    # --- sequence lifecycle ----------------------------------------------------------------

    def open(
        self,
        block_hashes: Sequence[int],
        token_ids: Sequence[int] | None,
        match: PrefixMatch,
    ) -> SeqKV:
        """Take the hit: pin its device blocks, load its host blocks into fresh pages. Call
        `can_open` first; raises `PageAccountingError` if the pages are not there."""
        P = self.page_size
        seq = SeqKV(block_hashes, token_ids, match.start // P)
        hashes = seq.block_hashes
        full_g, win_g = self.groups
        dev = full_g.by_hash
        hit = hashes[: match.blocks]
        if not match.host_full:
            seq.full_shared = list(map(dev.__getitem__, hit))
            full_g.pin(seq.full_shared)
            loads: list[int] = []
        else:
            seq.full_shared = [dev.get(h, -1) for h in hit]
            full_g.pin([p for p in seq.full_shared if p >= 0])
            loads = [i for i, p in enumerate(seq.full_shared) if p < 0]
        wloads: list[int] = []
        if match.window_complete:
            for i in range(match.window_first, match.blocks):
                page = win_g.by_hash.get(hashes[i])
                if page is None:
                    wloads.append(i)
                else:
                    win_g.pin1(page)
                    seq.window[i] = (page, True)
        # Read the host copies before allocating: an allocation may evict a device block to
        # the host tier, which may push one of these out of it.
        fl = [(i, self.host[FULL_GROUP][hashes[i]]) for i in loads]
        wl = [(i, self.host[WINDOW_GROUP][hashes[i]]) for i in wloads]
        for i, hb in fl:
            seq.full_shared[i] = self._load(FULL_GROUP, hashes[i], hb)
        for i, hb in wl:
            seq.window[i] = (self._load(WINDOW_GROUP, hashes[i], hb), True)
        self._live[id(seq)] = seq
        return seq

    def grow(self, seq: SeqKV, target: int) -> bool:
        """Give `seq` pages for `target` tokens: full pages up to `target`, window pages for
        the window at `target` (pages already held stay until `commit` slides them out).
        All-or-nothing: returns False and changes nothing when the pools cannot supply them."""
        hi = self.pages_for(target)
        need_full = hi - seq.full_pages
        lo = max(self.first_window_page(target), seq.origin_page)
        window = seq.window
        need_window = [i for i in range(lo, hi) if i not in window]
        full_g, win_g = self.groups
        if need_full > 0 and need_full > full_g.available:
            return False
        if need_window and len(need_window) > win_g.available:
            return False
        if need_full > 0:
            if full_g.free >= need_full:
                seq.full_private.extend(full_g.take_free_many(need_full))
            else:
                for _ in range(need_full):
                    seq.full_private.append(self._allocate(FULL_GROUP))
        for i in need_window:
            window[i] = (self._allocate(WINDOW_GROUP), False)
        return True

    def commit(self, seq: SeqKV, old_computed: int, new_computed: int) -> None:
        """KV of tokens `[old_computed, new_computed)` is complete: register the blocks that
        became full and hashed (both groups), then slide the window to `new_computed`."""
        P = self.page_size
        if self.enable_prefix_cache:
            hi = min(new_computed // P, len(seq.block_hashes))
            lo = old_computed // P
            if hi > len(seq.full_shared):
                self._register_full(seq, hi)
            if hi > lo:
                self._register_window(seq, lo, hi)
        if seq.window:
            self._slide(seq, self.first_window_page(new_computed))

    def close(self, seq: SeqKV) -> None:
        """Release every page of `seq` (finish, abort or preemption). Cached blocks join the
        LRU, the sequence's last block first (so a prefix's tail is evicted before its head)."""
        if self._live.pop(id(seq), None) is None:
            raise PageAccountingError("close of a sequence that is not open")
        full_g, win_g = self.groups
        for i in sorted(seq.window, reverse=True):
            page, shared = seq.window[i]
            if shared:
                win_g.unpin1(page)
            else:
                win_g.release(page)
        seq.window.clear()
        for page in reversed(seq.full_private):
            full_g.release(page)
        seq.full_private.clear()
        full_g.unpin(seq.full_shared)
        seq.full_shared.clear()

    def clear(self) -> int:
        """Drop every unreferenced cached block on the device and every host block
        (reset_prefix_cache); emits `AllBlocksCleared`. Returns the device pages freed."""
        freed = 0
        for g in self.groups:
            while g.evictable:
                h, page = g.evict()
                g.parent.pop(h, None)
                g.tokens.pop(h, None)
                g.release(page)
                freed += 1
            g.lru.clear()
            g.head = g.lru_len = 0
        for host in self.host:
            host.clear()
        self._emit(AllBlocksCleared())
        return freed

    def take_events(self) -> list[KVEvent]:
        """The events since the last call, in order."""
        self._flush_removed()
        events, self._events = self._events, []
        return events

    @property
    def live_sequences(self) -> int:
        return len(self._live)

    # --- internals -------------------------------------------------------------------------

    def _allocate(self, gid: int) -> int:
        g = self.groups[gid]
        if g.free > 0:
            return g.take_free()
        h, page = g.evict()
        meta = g.meta(h)
        g.parent.pop(h, None)
        g.tokens.pop(h, None)
        self._removed_event(gid, h, MEDIUM_GPU)
        if self.host_capacity[gid] > 0:
            self._host_store(gid, h, meta)
        return page  # still allocated: reused directly

    def _host_store(self, gid: int, h: int, meta: _HostBlock) -> None:
        host = self.host[gid]
        if h in host:
            host.move_to_end(h)
            return
        if len(host) >= self.host_capacity[gid]:
            old, _ = host.popitem(last=False)
            self._removed_event(gid, old, MEDIUM_CPU)
        host[h] = meta
        self._emit(self._stored(gid, (h,), meta.parent, meta.tokens, MEDIUM_CPU))

    def _load(self, gid: int, h: int, hb: _HostBlock) -> int:
        if h in self.host[gid]:
            self.host[gid].move_to_end(h)
        page = self._allocate(gid)
        self.groups[gid].register([page], (h,), (hb.parent,), (hb.tokens,) if hb.tokens else None)
        self._emit(self._stored(gid, (h,), hb.parent, hb.tokens, MEDIUM_GPU))
        return page

    def _register_full(self, seq: SeqKV, hi: int) -> None:
        """Blocks S..hi-1 are complete: each becomes a cached block (or, if another sequence
        cached the same hash first, the sequence switches to that block)."""
        g = self.groups[FULL_GROUP]
        S = len(seq.full_shared)
        k = hi - S
        pages = seq.full_private[:k]
        del seq.full_private[:k]
        hashes = seq.block_hashes[S:hi]
        if g.by_hash.keys().isdisjoint(hashes):
            # The common case: one run of new blocks, registered in bulk.
            self._register_run(seq, S, pages)
            seq.full_shared.extend(pages)
            return
        start = 0
        for j, h in enumerate(hashes):
            existing = g.by_hash.get(h)
            if existing is None:
                continue
            self._register_run(seq, S + start, pages[start:j])
            seq.full_shared.extend(pages[start:j])
            g.pin1(existing)
            g.release(pages[j])
            seq.full_shared.append(existing)
            start = j + 1
        self._register_run(seq, S + start, pages[start:])
        seq.full_shared.extend(pages[start:])

    def _register_run(self, seq: SeqKV, first: int, pages: list[int]) -> None:
        """Register full blocks first.. on `pages` (consecutive) and emit one event for them."""
        if not pages:
            return
        n = len(pages)
        hashes = seq.block_hashes[first : first + n]
        parent = seq.parent_of(first)
        parents = (parent, *hashes[:-1])
        P = self.page_size
        tokens = None
        if seq.token_ids is not None:
            tokens = [seq.tokens_of(i, P) for i in range(first, first + n)]
        self.groups[FULL_GROUP].register(pages, hashes, parents, tokens)
        flat: tuple[int, ...] = ()
        if seq.token_ids is not None:
            flat = seq.token_ids[first * P : (first + n) * P]
        self._emit(self._stored(FULL_GROUP, tuple(hashes), parent, flat))

    def _register_window(self, seq: SeqKV, lo: int, hi: int) -> None:
        g = self.groups[WINDOW_GROUP]
        P = self.page_size
        run: list[int] = []
        run_tokens: list[int] = []
        run_parent: int | None = None
        window = seq.window
        for i in range(lo, hi):
            held = window.get(i)
            if held is None or held[1]:
                continue
            h = seq.block_hashes[i]
            page = held[0]
            existing = g.by_hash.get(h)
            if existing is not None:
                g.pin1(existing)
                g.release(page)
                window[i] = (existing, True)
                if run:
                    self._emit(
                        self._stored(WINDOW_GROUP, tuple(run), run_parent, tuple(run_tokens))
                    )
                    run, run_tokens = [], []
                continue
            toks = seq.tokens_of(i, P)
            parent = seq.parent_of(i)
            g.register([page], (h,), (parent,), (toks,) if toks else None)
            window[i] = (page, True)
            if run and run[-1] != seq.block_hashes[i - 1]:
                self._emit(self._stored(WINDOW_GROUP, tuple(run), run_parent, tuple(run_tokens)))
                run, run_tokens = [], []
            if not run:
                run_parent = parent
            run.append(h)
            run_tokens.extend(toks)
        if run:
            self._emit(self._stored(WINDOW_GROUP, tuple(run), run_parent, tuple(run_tokens)))

    def _slide(self, seq: SeqKV, first: int) -> None:
        window = seq.window
        stale = [i for i in window if i < first]
        if not stale:
            return
        g = self.groups[WINDOW_GROUP]
        for i in sorted(stale, reverse=True):
            page, shared = window.pop(i)
            if shared:
                g.unpin1(page)
            else:
                g.release(page)

    def _emit(self, event: KVEvent) -> None:
        self._flush_removed()
        self._events.append(event)

    def _removed_event(self, gid: int, h: int, medium: str) -> None:
        run = self._removed
        if run is not None and run[0] == gid and run[1] == medium:
            run[2].append(h)
            return
        self._flush_removed()
        self._removed = (gid, medium, [h])

    def _flush_removed(self) -> None:
        if self._removed is not None:
            gid, medium, hashes = self._removed
            self._events.append(BlockRemoved(tuple(hashes), medium=medium, group_idx=gid))
            self._removed = None

    def _stored(
        self,
        gid: int,
        hashes: tuple[int, ...],
        parent: int | None,
        tokens: tuple[int, ...],
        medium: str = MEDIUM_GPU,
    ) -> BlockStored:
        full = gid == FULL_GROUP
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=tokens,
            block_size=self.page_size,
            group_idx=gid,
            kv_cache_spec_kind=FULL_ATTENTION_KIND if full else SLIDING_WINDOW_KIND,
            kv_cache_spec_sliding_window=None if full else self.window,
            medium=medium,
        )

    # --- invariants ------------------------------------------------------------------------

    def check(self) -> None:
        """Raise `PageAccountingError` unless every invariant in the class docstring holds."""
        for g in self.groups:
            gid = g.gid
            owners: dict[int, str] = {}

            def own(page: int, who: str, owners: dict[int, str] = owners, gid: int = gid) -> None:
                if page in owners:
                    raise PageAccountingError(
                        f"group {gid}: page {page} owned by {owners[page]} and {who}"
                    )
                owners[page] = who

            if len(g.page_hash) != len(g.by_hash) or int(g.cached.sum()) != len(g.by_hash):
                raise PageAccountingError(f"group {gid}: cache maps disagree")
            for h, page in g.by_hash.items():
                if g.page_hash.get(page) != h or not g.cached[page]:
                    raise PageAccountingError(f"group {gid}: block {h} / page {page} mismatch")
                own(page, f"block {h}")
            refs: dict[int, int] = {}
            for n, seq in enumerate(self._live.values()):
                if gid == FULL_GROUP:
                    shared = list(seq.full_shared)
                    private = list(seq.full_private)
                    for i, page in enumerate(shared):
                        if g.page_hash.get(page) != seq.block_hashes[i]:
                            raise PageAccountingError(f"seq {n}: shared block {i} is stale")
                else:
                    shared = [p for p, s in seq.window.values() if s]
                    private = [p for p, s in seq.window.values() if not s]
                for page in private:
                    own(page, f"seq {n}")
                for page in shared:
                    if page not in g.page_hash:
                        raise PageAccountingError(f"group {gid}: seq {n} holds an evicted block")
                    refs[page] = refs.get(page, 0) + 1
            for page in owners:
                if not g.allocated[page]:
                    raise PageAccountingError(f"group {gid}: page {page} in use but free")
            free = g.free_pages()
            if len(owners) != g.used or len(set(free)) != len(free) or set(free) & set(owners):
                raise PageAccountingError(
                    f"group {gid}: {g.used} pages allocated, {len(owners)} owned"
                )
            if g.used > g.capacity:
                raise PageAccountingError(f"group {gid}: over budget")
            zero = 0
            for page in g.by_hash.values():
                if int(g.ref[page]) != refs.get(page, 0):
                    raise PageAccountingError(
                        f"group {gid}: page {page} ref {int(g.ref[page])} ≠ {refs.get(page, 0)}"
                    )
                zero += g.ref[page] == 0
            if zero != g.evictable:
                raise PageAccountingError(f"group {gid}: evictable {g.evictable} ≠ {zero}")
            current = g.current_pages()
            if len(current) != zero or len(set(current)) != zero:
                raise PageAccountingError(f"group {gid}: LRU does not hold the evictable blocks")
            if len(self.host[gid]) > self.host_capacity[gid]:
                raise PageAccountingError(f"group {gid}: host tier over capacity")

    def lru_order(self, group: int) -> list[int]:
        """Hashes of the evictable blocks, next to be evicted first (for tests)."""
        g = self.groups[group]
        return [g.page_hash[p] for p in g.current_pages()]
