"""PrefixIndex through its public interface: groups, window edges, formats, media, predictions,
worker removal, sweeping and accounting."""

from __future__ import annotations

import random

import pytest
from beamserve.kvwire import events as cache_events
from beamserve.kvwire.events import (
    SPEC_KIND_FULL_ATTENTION,
    SPEC_KIND_SLIDING_WINDOW,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from beamserve.router.index.prefix_index import (
    PrefixIndex,
    PrefixIndexError,
    PrefixMatch,
    block_key,
    measure_index_memory,
)
from beamserve.router.types import PrefixHit

_RNG = random.Random(7)
HASHES = [_RNG.getrandbits(64) for _ in range(64)]


def stored(hashes: list[int], group: int | None, medium: str | None = "GPU") -> BlockStored:
    kind = {0: SPEC_KIND_FULL_ATTENTION, 1: SPEC_KIND_SLIDING_WINDOW, None: None}[group]
    window = 512 if group == 1 else None
    return BlockStored(
        hashes,
        None,
        [],
        64,
        medium=medium,
        group_idx=group,
        kv_cache_spec_kind=kind,
        kv_cache_spec_sliding_window=window,
    )


def batch(*events: object) -> KVEventBatch:
    return KVEventBatch(0.0, events)


def hybrid_worker(index: PrefixIndex, worker: str, full: int, window: range) -> None:
    """Full group holds blocks [0, full); window group holds the blocks in `window`."""
    index.apply(
        worker,
        batch(stored(HASHES[:full], 0), stored([HASHES[j] for j in window], 1)),
    )


@pytest.mark.parametrize(
    ("block_size", "full", "window", "query", "want_k", "want_ok"),
    [
        # B=64, W=512: the window tail of a k-block prefix is blocks [max(0, k-8), k).
        (64, 20, range(12, 20), 20, 20, True),
        (64, 20, range(13, 20), 20, 20, False),  # block 12 holds tokens 768..831: needed
        (64, 20, range(11, 20), 19, 19, True),  # a 19-block prefix needs blocks 11..18
        (64, 20, range(12, 20), 19, 19, False),
        (64, 8, range(0, 8), 8, 8, True),  # exactly 512 tokens: every block is in the window
        (64, 8, range(1, 8), 8, 8, False),
        (64, 7, range(0, 7), 7, 7, True),  # 448 tokens < W: all of them
        (64, 9, range(1, 9), 9, 9, True),  # 576 tokens: tokens 64..575 → blocks 1..8
        (64, 9, range(2, 9), 9, 9, False),
        # B=16, W=512: 32 window blocks.
        (16, 40, range(8, 40), 40, 40, True),
        (16, 40, range(9, 40), 40, 40, False),
        (16, 32, range(0, 32), 32, 32, True),
        (16, 33, range(1, 33), 33, 33, True),
        (16, 33, range(2, 33), 33, 33, False),
        (16, 31, range(0, 31), 31, 31, True),
        (16, 31, range(1, 31), 31, 31, False),
    ],
)
def test_window_ok_at_window_edges(
    block_size: int, full: int, window: range, query: int, want_k: int, want_ok: bool
) -> None:
    index = PrefixIndex()
    hybrid_worker(index, "w", full, window)
    hit = index.match(HASHES[:query], ["w"], block_size=block_size, sliding_window=512)["w"]
    assert hit == PrefixHit(want_k, want_ok, 0)
    assert hit.kind == ("full" if want_ok else "partial")


def test_window_start_uses_floor_for_block_sizes_not_dividing_the_window() -> None:
    index = PrefixIndex()
    # B=48, k=11: tokens [528-512, 528) = [16, 528) start inside block 0 → blocks 0..10.
    hybrid_worker(index, "a", 11, range(1, 11))
    hybrid_worker(index, "b", 11, range(0, 11))
    hits = index.match(HASHES[:11], block_size=48, sliding_window=512)
    assert hits["a"] == PrefixHit(11, False, 0)
    assert hits["b"] == PrefixHit(11, True, 0)


def test_full_run_stops_at_first_missing_block_and_window_tail_is_checked_there() -> None:
    index = PrefixIndex()
    index.apply("w", batch(stored(HASHES[:5] + HASHES[6:12], 0), stored(HASHES[:12], 1)))
    hit = index.match(HASHES[:12], block_size=64, sliding_window=512)["w"]
    assert hit == PrefixHit(5, True, 0)


def test_window_blocks_is_the_longest_prefix_with_a_resident_window_tail() -> None:
    index = PrefixIndex()
    # Full blocks 0..29; window group holds 0..9 and 20..25 (a hole at 10..19, then 26..29).
    index.apply("w", batch(stored(HASHES[:30], 0), stored(HASHES[:10] + HASHES[20:26], 1)))
    detail = index.match_detailed(HASHES[:30], block_size=64, sliding_window=512)["w"]
    # A k-prefix needs blocks k-8..k-1: k=10 → 2..9 all resident; k=26 would need 18..25.
    assert detail == PrefixMatch(30, False, 0, 10, 30)
    assert detail.hit == PrefixHit(30, False, 0)
    only_window_tail = PrefixIndex()
    only_window_tail.apply("w", batch(stored(HASHES[:30], 0), stored(HASHES[22:30], 1)))
    assert (
        only_window_tail.match_detailed(HASHES[:30], block_size=64, sliding_window=512)[
            "w"
        ].window_blocks
        == 30
    )
    no_window = PrefixIndex()
    no_window.apply("w", batch(stored(HASHES[:30], 0)))
    assert no_window.match_detailed(HASHES[:30], block_size=64, sliding_window=512)[
        "w"
    ] == PrefixMatch(30, False, 0, 0, 30)


def test_events_without_group_count_for_both_groups_in_sglang_format() -> None:
    events = (
        BlockStored(HASHES[:12], None, list(range(12 * 16)), 16),
        BlockRemoved(HASHES[10:12]),
    )
    payload = encode_batch(KVEventBatch(1.0, events), "sglang")
    decoded = decode_batch(payload, "sglang")
    assert all(getattr(e, "group_idx", None) is None for e in decoded.events)
    index = PrefixIndex()
    index.apply("sg", decoded)
    hit = index.match(HASHES[:12], block_size=16, sliding_window=512)["sg"]
    assert hit == PrefixHit(10, True, 0)
    assert index.stats().full_entries == 10 and index.stats().window_entries == 10


def test_sglang_signed_and_vllm_unsigned_hashes_fold_to_the_same_key() -> None:
    unsigned = (1 << 64) - 5
    signed = unsigned - (1 << 64)
    assert block_key(unsigned) == block_key(signed) == block_key(unsigned.to_bytes(32, "big"))
    index = PrefixIndex()
    index.apply(
        "sg",
        decode_batch(encode_batch(batch(BlockStored([signed], None, [], 16)), "sglang"), "sglang"),
    )
    assert index.match([unsigned], block_size=16, sliding_window=0)["sg"].full_blocks == 1


def test_vllm_events_with_group_none_and_digest_hashes_count_for_both_groups() -> None:
    digests = [h.to_bytes(32, "big") for h in HASHES[:4]]
    payload = encode_batch(batch(BlockStored(digests, None, [], 64)), "vllm")
    index = PrefixIndex()
    index.apply("v", decode_batch(payload, "vllm"))
    assert index.match(HASHES[:4], block_size=64, sliding_window=512)["v"] == PrefixHit(4, True)


def test_block_removed_group_idx_uses_kinds_learnt_from_block_stored() -> None:
    index = PrefixIndex()
    # An engine whose window group is index 0 and full group index 1.
    index.apply(
        "x",
        batch(
            BlockStored(
                HASHES[:4], None, [], 64, group_idx=1, kv_cache_spec_kind=SPEC_KIND_FULL_ATTENTION
            ),
            BlockStored(
                HASHES[:4], None, [], 64, group_idx=0, kv_cache_spec_kind=SPEC_KIND_SLIDING_WINDOW
            ),
            BlockRemoved(HASHES[3:4], group_idx=0),
        ),
    )
    assert index.match(HASHES[:4], block_size=64, sliding_window=512)["x"] == PrefixHit(4, False)
    assert index.resident("x")["full"] == {block_key(h) for h in HASHES[:4]}


def test_unknown_group_kinds_are_ignored_and_counted() -> None:
    index = PrefixIndex()
    index.apply(
        "m",
        batch(BlockStored(HASHES[:2], None, [], 64, group_idx=2, kv_cache_spec_kind="mamba")),
    )
    assert index.match(HASHES[:2], block_size=64, sliding_window=512)["m"] == PrefixHit()
    assert index.stats().ignored_events == 1 and index.stats().events_applied == 0


def test_engine_batches_with_keyword_groups_apply() -> None:
    index = PrefixIndex()
    index.apply(
        "sim",
        cache_events.KVEventBatch(
            0.0,
            (
                cache_events.BlockStored(
                    tuple(HASHES[:3]),
                    None,
                    (),
                    64,
                    group_idx=0,
                    kv_cache_spec_kind="full_attention",
                ),
                cache_events.BlockStored(
                    tuple(HASHES[:3]),
                    None,
                    (),
                    64,
                    group_idx=1,
                    kv_cache_spec_kind="sliding_window",
                    kv_cache_spec_sliding_window=512,
                ),
                cache_events.BlockRemoved(tuple(HASHES[2:3]), group_idx=1),
            ),
        ),
    )
    assert index.match(HASHES[:3], block_size=64, sliding_window=64)["sim"] == PrefixHit(3, False)
    assert index.match(HASHES[:2], block_size=64, sliding_window=64)["sim"] == PrefixHit(2, True)


def test_cpu_medium_is_a_lower_tier_that_never_counts_as_a_gpu_hit() -> None:
    index = PrefixIndex()
    index.apply("w", batch(stored(HASHES[:3], None), stored(HASHES[3:8], 0, medium="CPU")))
    index.apply("w", batch(stored(HASHES[8:9], None, medium="CPU_PINNED")))
    detail = index.match_detailed(HASHES[:12], block_size=64, sliding_window=512)["w"]
    assert (detail.full_blocks, detail.lower_blocks) == (3, 9)
    index.apply("w", batch(BlockRemoved(HASHES[5:6], medium="CPU", group_idx=0)))
    assert (
        index.match_detailed(HASHES[:12], block_size=64, sliding_window=512)["w"].lower_blocks == 5
    )
    assert index.stats().lower_entries == 5
    index.apply("w", batch(AllBlocksCleared()))
    assert (
        index.match_detailed(HASHES[:12], block_size=64, sliding_window=512)["w"] == PrefixMatch()
    )


def test_all_blocks_cleared_drops_only_that_worker_and_later_events_count_again() -> None:
    index = PrefixIndex()
    index.apply("a", batch(stored(HASHES[:6], None)))
    index.apply("b", batch(stored(HASHES[:6], None)))
    index.apply("a", batch(AllBlocksCleared(), stored(HASHES[:2], None)))
    hits = index.match(HASHES[:6], block_size=64, sliding_window=512)
    assert hits == {"a": PrefixHit(2, True), "b": PrefixHit(6, True)}
    assert index.worker_entries("a") == 2 and index.worker_entries("b") == 6


def test_remove_worker_drops_entries_and_unknown_workers_get_empty_hits() -> None:
    index = PrefixIndex()
    index.apply("a", batch(stored(HASHES[:6], None)))
    index.apply("b", batch(stored(HASHES[:4], None)))
    assert index.remove_worker("a") is True
    assert index.remove_worker("a") is False
    hits = index.match(HASHES[:6], ["a", "b", "nobody"], block_size=64, sliding_window=512)
    assert hits == {"a": PrefixHit(), "b": PrefixHit(4, True), "nobody": PrefixHit()}
    assert index.workers == ["b"]
    assert index.stats().entries == 4


def test_retired_bits_are_swept_then_reused_without_resurrecting_entries() -> None:
    index = PrefixIndex(sweep_budget=3)
    for i in range(4):
        index.apply(f"w{i}", batch(stored(HASHES[:20], None)))
    index.remove_worker("w1")
    index.remove_worker("w2")
    assert index.stats().retired_bits == 2
    assert index.stats().blocks == 20
    # Each apply sweeps 3 entries; a sweep in progress must never be visible to reads.
    for step in range(30):
        index.apply("w0", batch(stored(HASHES[20 + step : 21 + step], 0)))
        assert index.match(HASHES[:20], ["w3"], block_size=64, sliding_window=512)["w3"] == (
            PrefixHit(20, True)
        )
    assert index.stats().retired_bits == 0
    index.apply("new1", batch(stored(HASHES[:1], None)))
    index.apply("new2", batch(stored(HASHES[:2], None)))
    hits = index.match(HASHES[:20], block_size=64, sliding_window=512)
    assert hits["new1"] == PrefixHit(1, True) and hits["new2"] == PrefixHit(2, True)
    index.remove_worker("w0")
    index.remove_worker("w3")
    index.remove_worker("new1")
    index.remove_worker("new2")
    assert index.sweep() is True
    assert index.stats().blocks == 0 and index.stats().retired_bits == 0


def test_predictions_count_until_confirmed_or_expired() -> None:
    now = [100.0]
    index = PrefixIndex(clock=lambda: now[0])
    index.apply("w", batch(stored(HASHES[:3], None)))
    index.predict("w", HASHES[:8], ttl_s=5.0)
    assert index.match(HASHES[:10], block_size=64, sliding_window=512)["w"] == PrefixHit(8, True, 5)
    # The engine confirms blocks 3..5 in the full group only: no longer predicted, and
    # their window entries are now what the events say (absent).
    index.apply("w", batch(stored(HASHES[3:6], 0)))
    assert index.match(HASHES[:10], block_size=64, sliding_window=512)["w"] == PrefixHit(
        8, False, 2
    )
    now[0] = 104.9
    assert index.match(HASHES[:10], block_size=64, sliding_window=512)["w"].full_blocks == 8
    now[0] = 105.0
    assert index.match(HASHES[:10], block_size=64, sliding_window=512)["w"] == PrefixHit(
        6, False, 0
    )
    assert index.stats().predicted_entries == 0


def test_prediction_refresh_extends_expiry_and_explicit_now_is_honoured() -> None:
    index = PrefixIndex(clock=lambda: 0.0)
    index.predict("w", HASHES[:2], ttl_s=1.0, now=10.0)
    index.predict("w", HASHES[:2], ttl_s=5.0, now=10.5)
    assert index.match(HASHES[:2], block_size=64, sliding_window=512, now=12.0)["w"] == PrefixHit(
        2, True, 2
    )
    assert index.match(HASHES[:2], block_size=64, sliding_window=512, now=15.5)["w"] == PrefixHit()


def test_removal_event_and_clear_drop_predictions() -> None:
    index = PrefixIndex(clock=lambda: 0.0)
    index.predict("w", HASHES[:4], ttl_s=10.0)
    index.apply("w", batch(BlockRemoved(HASHES[2:3], group_idx=0)))
    assert index.match(HASHES[:4], block_size=64, sliding_window=512)["w"] == PrefixHit(2, True, 2)
    index.clear_worker("w")
    assert index.match(HASHES[:4], block_size=64, sliding_window=512)["w"] == PrefixHit()
    assert index.workers == ["w"]


def test_bad_queries_raise_typed_errors_naming_the_fix() -> None:
    index = PrefixIndex()
    with pytest.raises(PrefixIndexError, match="block_size"):
        index.match(HASHES, block_size=0, sliding_window=512)
    with pytest.raises(PrefixIndexError, match="512"):
        index.match(HASHES, block_size=64, sliding_window=-1)
    with pytest.raises(PrefixIndexError, match="ttl_s"):
        index.predict("w", HASHES, ttl_s=0.0)


def test_a_128k_prompt_on_64_workers_matches_each_workers_resident_prefix() -> None:
    """Each worker holds a different prefix of one 2,000-block prompt (its window tail
    resident): every hit is that prefix, window ok. (Speed is the route bench's business,
    `beamserve bench route`, not a timed assert here.)"""
    rng = random.Random(3)
    prompt = [rng.getrandbits(64) for _ in range(2000)]
    index = PrefixIndex()
    held = {}
    for w in range(64):
        n = held[f"w{w}"] = rng.randrange(0, 2001)
        index.apply(f"w{w}", batch(stored(prompt[:n], 0), stored(prompt[max(0, n - 8) : n], 1)))
    hits = index.match(prompt, block_size=64, sliding_window=512)
    assert {w: h.full_blocks for w, h in hits.items()} == held
    assert all(h.window_ok for h in hits.values() if h.full_blocks)


def test_stats_and_memory_estimate_track_entries() -> None:
    index = PrefixIndex()
    empty = index.memory_bytes()
    index.apply("a", batch(stored(HASHES[:10], 0), stored(HASHES[:4], 1)))
    index.apply("b", batch(stored(HASHES[:10], None)))
    stats = index.stats()
    assert (stats.workers, stats.blocks, stats.entries) == (2, 10, 20)
    assert (stats.full_entries, stats.window_entries) == (20, 14)
    assert stats.memory_bytes == index.memory_bytes() > empty


def test_measure_index_memory_meets_the_budget_on_a_small_sample() -> None:
    per_million = measure_index_memory(20_000, 64)
    assert 10 < per_million <= 128
    assert measure_index_memory(5_000, 8, replication=4) < per_million
