"""The two-group paged KV cache: LRU eviction, pinning, the sliding window, partial hits, the
host tier and the KV events it reports."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from beamserve.kv_transfer.model import BeamModelConfig, beam_layer_types
from beamserve.kvwire.events import (
    FULL_GROUP,
    WINDOW_GROUP,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)
from beamserve.workers.sim.kv_cache import KVCacheManager, PageAccountingError, SeqKV

P = 64
W = 128  # two pages of window


def model() -> BeamModelConfig:
    return BeamModelConfig(6, beam_layer_types(6), W, 4, 2, 32, dtype="float32")


def cache(
    full: int = 32, window: int = 12, host_full: int = 0, host_window: int = 0
) -> KVCacheManager:
    return KVCacheManager(
        model(),
        page_size=P,
        full_pages=full,
        window_pages=window,
        host_full_pages=host_full,
        host_window_pages=host_window,
    )


def run_prefill(kv: KVCacheManager, hashes: Sequence[int], tokens: int) -> SeqKV:
    """Admit a sequence and compute its whole prompt in one chunk."""
    m = kv.match(hashes, tokens)
    assert kv.can_open(hashes, m, tokens)
    seq = kv.open(hashes, None, m)
    assert kv.grow(seq, tokens)
    kv.commit(seq, m.start, tokens)
    kv.check()
    return seq


def chain(tag: int, n: int) -> tuple[int, ...]:
    return tuple(tag * 1000 + i for i in range(n))


def removed(events: Sequence[KVEvent], group: int, medium: str = "GPU") -> list[int]:
    return [
        h
        for e in events
        if isinstance(e, BlockRemoved) and e.group_idx == group and e.medium == medium
        for h in e.block_hashes
    ]


def test_completed_blocks_are_registered_in_both_groups_with_chained_events() -> None:
    kv = cache()
    h = chain(1, 4)
    seq = run_prefill(kv, h, 4 * P + 10)
    events = kv.take_events()
    full = [e for e in events if isinstance(e, BlockStored) and e.group_idx == FULL_GROUP]
    assert len(full) == 1 and full[0].block_hashes == h and full[0].parent_block_hash is None
    assert full[0].kv_cache_spec_kind == "full_attention"
    assert full[0].kv_cache_spec_sliding_window is None
    # the window at 4·64+10 tokens covers pages 2..4: blocks 2 and 3 are complete and hashed
    win = [e for e in events if isinstance(e, BlockStored) and e.group_idx == WINDOW_GROUP]
    assert [x for e in win for x in e.block_hashes] == [h[2], h[3]]
    assert win[0].kv_cache_spec_kind == "sliding_window"
    assert win[0].kv_cache_spec_sliding_window == W and win[0].parent_block_hash == h[1]
    assert seq.full_pages == 5 and sorted(seq.window) == [2, 3, 4]
    kv.close(seq)
    kv.check()
    assert kv.used(FULL_GROUP) == kv.cached_blocks(FULL_GROUP) == 4
    assert kv.evictable(FULL_GROUP) == 4


def test_a_later_request_hits_the_prefix_and_pins_it() -> None:
    kv = cache()
    h = chain(1, 6)
    kv.close(run_prefill(kv, h[:4], 4 * P + 10))
    m = kv.match(h, 6 * P + 5)
    assert (m.blocks, m.cached_tokens, m.window_complete, m.start) == (4, 4 * P, True, 4 * P)
    seq = kv.open(h, None, m)
    assert kv.evictable(FULL_GROUP) == 0  # pinned: no longer evictable
    kv.check()
    kv.close(seq)
    kv.check()


def test_at_least_one_token_is_always_computed() -> None:
    kv = cache()
    h = chain(1, 4)
    kv.close(run_prefill(kv, h, 4 * P))
    assert kv.match(h, 4 * P).blocks == 3  # the last block is recomputed for its last token
    assert kv.match(h, 4 * P + 1).blocks == 4


def test_lru_evicts_least_recently_released_and_a_prefix_tail_first() -> None:
    kv = cache(full=8, window=12)
    a, b = chain(1, 3), chain(2, 3)
    kv.close(run_prefill(kv, a, 3 * P))
    kv.close(run_prefill(kv, b, 3 * P))
    # a's tail first (released last-block-first), then b's
    assert kv.lru_order(FULL_GROUP) == [a[2], a[1], a[0], b[2], b[1], b[0]]
    kv.take_events()
    seq = run_prefill(kv, chain(3, 4), 4 * P + 1)  # 5 pages: 2 free + 3 evicted
    assert removed(kv.take_events(), FULL_GROUP) == [a[2], a[1], a[0]]
    assert kv.is_cached(FULL_GROUP, b[0]) and not kv.is_cached(FULL_GROUP, a[0])
    kv.close(seq)
    kv.check()


def test_never_evicts_blocks_of_running_requests() -> None:
    kv = cache(full=6, window=12)
    held = run_prefill(kv, chain(1, 3), 3 * P + 1)  # 4 pages, 3 cached blocks, pinned
    other = chain(2, 1)
    kv.close(run_prefill(kv, other, P + 1))  # 2 pages; its block stays cached (evictable)
    seq = kv.open(chain(3, 0), None, kv.match((), 1))
    assert kv.grow(seq, 2 * P)  # needs 2: 0 free → evicts only the unpinned block... and fails?
    kv.check()
    assert not kv.is_cached(FULL_GROUP, other[0])
    for h in chain(1, 3):
        assert kv.is_cached(FULL_GROUP, h)
    assert not kv.grow(seq, 3 * P)  # nothing left but pinned blocks: refused, nothing changed
    kv.check()
    kv.close(seq)
    kv.close(held)
    kv.check()


def test_window_pages_are_freed_as_the_window_slides() -> None:
    kv = cache(full=40, window=8)
    seq = run_prefill(kv, chain(1, 2), 2 * P + 1)
    length = 2 * P + 1
    most = 0
    while length < 20 * P:
        assert kv.grow(seq, length + 7)
        most = max(most, len(seq.window))
        kv.commit(seq, length, length + 7)
        length += 7
        kv.check()
        first = max(0, length - W) // P
        assert min(seq.window) == first  # nothing below the window is held
        assert len(seq.window) <= -(-W // P) + 1
    assert most <= -(-W // P) + 2  # during a step the old window page is still held
    # the prompt's window blocks that slid out stay cached (evictable), unpinned
    assert kv.is_cached(WINDOW_GROUP, chain(1, 2)[1])
    assert kv.evictable(WINDOW_GROUP) >= 1
    kv.close(seq)
    kv.check()


def test_window_blocks_evict_separately_and_a_hit_becomes_partial() -> None:
    kv = cache(full=40, window=6)
    h = chain(1, 8)
    kv.close(run_prefill(kv, h, 8 * P + 1))
    assert kv.is_cached(WINDOW_GROUP, h[7]) and kv.is_cached(WINDOW_GROUP, h[6])
    # another request's window pressure evicts h's window blocks but not its full blocks
    kv.close(run_prefill(kv, chain(2, 6), 6 * P + 1))
    kv.close(run_prefill(kv, chain(3, 6), 6 * P + 1))
    assert all(kv.is_cached(FULL_GROUP, x) for x in h)
    assert not kv.is_cached(WINDOW_GROUP, h[7])
    m = kv.match((*h, 9999), 9 * P + 5)
    assert m.blocks == 8 and not m.window_complete
    assert m.start == 8 * P - W and m.recompute_tokens == W
    # the sequence holds its full pages up to p but recomputes the window tail from m.start
    seq = kv.open((*h, 9999), None, m)
    assert seq.full_pages == 8 and seq.window == {}
    assert kv.grow(seq, 9 * P + 5)
    assert min(seq.window) == (9 * P + 5 - W) // P
    kv.commit(seq, m.start, 9 * P + 5)
    kv.check()
    kv.close(seq)
    kv.check()


def test_a_complete_hit_reuses_window_blocks() -> None:
    kv = cache(full=40, window=12)
    h = chain(1, 8)
    kv.close(run_prefill(kv, h, 8 * P + 1))
    m = kv.match(h, 8 * P + 1)
    assert m.window_complete and m.recompute_tokens == 0 and m.window_first == 6
    seq = kv.open(h, None, m)
    assert sorted(seq.window) == [6, 7] and all(shared for _, shared in seq.window.values())
    kv.close(seq)
    kv.check()


def test_host_tier_keeps_evicted_blocks_and_serves_hits() -> None:
    kv = cache(full=6, window=12, host_full=8, host_window=4)
    a = chain(1, 3)
    kv.close(run_prefill(kv, a, 3 * P + 1))
    kv.take_events()
    kv.close(run_prefill(kv, chain(2, 4), 4 * P + 1))  # 5 pages: 3 free + 2 of a's, to host
    ev = kv.take_events()
    assert removed(ev, FULL_GROUP) == [a[2], a[1]]
    cpu = [e for e in ev if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert [h for e in cpu if e.group_idx == FULL_GROUP for h in e.block_hashes] == [a[2], a[1]]
    m = kv.match(a, 3 * P + 10)
    assert (m.blocks, m.host_full) == (3, 2)  # block 0 on the device, 1 and 2 on the host
    seq = kv.open(a, None, m)
    assert all(kv.is_cached(FULL_GROUP, x) for x in a)  # loaded back to the device
    gpu = [e for e in kv.take_events() if isinstance(e, BlockStored) and e.medium == "GPU"]
    assert {a[1], a[2]} <= {h for e in gpu if e.group_idx == FULL_GROUP for h in e.block_hashes}
    kv.check()
    kv.close(seq)
    kv.check()


def test_a_duplicate_block_switches_to_the_cached_copy() -> None:
    kv = cache()
    h = chain(1, 3)
    m = kv.match(h, 3 * P + 1)
    s1 = kv.open(h, None, m)
    s2 = kv.open(h, None, m)  # both started before either cached anything
    for s in (s1, s2):
        assert kv.grow(s, 3 * P + 1)
    kv.commit(s1, 0, 3 * P + 1)
    used = kv.used(FULL_GROUP)
    kv.commit(s2, 0, 3 * P + 1)
    assert kv.used(FULL_GROUP) == used - 3  # s2 freed its copies and shares s1's blocks
    assert s2.full_shared == s1.full_shared
    kv.check()
    kv.close(s1)
    kv.close(s2)
    kv.check()


def test_clear_drops_unpinned_blocks_and_reports_it() -> None:
    kv = cache(host_full=4, host_window=4)
    held = run_prefill(kv, chain(1, 2), 2 * P + 1)
    kv.close(run_prefill(kv, chain(2, 2), 2 * P + 1))
    kv.take_events()
    assert kv.clear() > 0
    assert isinstance(kv.take_events()[-1], AllBlocksCleared)
    assert kv.is_cached(FULL_GROUP, chain(1, 2)[0]) and not kv.is_cached(FULL_GROUP, 2000)
    kv.check()
    kv.close(held)


def test_accounting_errors_are_loud() -> None:
    kv = cache()
    seq = run_prefill(kv, chain(1, 1), P + 1)
    kv.close(seq)
    with pytest.raises(PageAccountingError, match="not open"):
        kv.close(seq)
    g = kv.groups[FULL_GROUP]
    page = g.take_free()
    g.release(page)
    with pytest.raises(PageAccountingError, match="freed twice"):
        g.release(page)


def test_events_carry_token_ids_when_the_sequence_has_them() -> None:
    kv = cache()
    tokens = list(range(100, 100 + 2 * P + 3))
    h = chain(1, 2)
    m = kv.match(h, len(tokens))
    seq = kv.open(h, tokens, m)
    assert kv.grow(seq, len(tokens))
    kv.commit(seq, 0, len(tokens))
    full = [e for e in kv.take_events() if isinstance(e, BlockStored) and e.group_idx == 0]
    assert full[0].token_ids == tuple(tokens[: 2 * P])
    assert full[0].block_size == P
    kv.close(seq)
