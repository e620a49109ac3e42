"""The ref engine in one process: exact prefill/decode split, TP shard layouts, prefix cache.

Real transformers compute, real transfer agents and a real HTTP handshake; the worker
processes and the cross-process runs are in test_ref_disagg.py / test_ref_faults.py.

Only Mooncake in this (the pytest) process: a process that has created a NIXL UCX agent
segfaults at exit (in the libnl-route bundled with nixl-cu12 1.5.1, `rtnl_tc_unregister`), and
one that loads both backends hangs there; NIXL runs in the worker-process tests.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from beamserve.kv_transfer.errors import KVTransferError
from beamserve.kv_transfer.handshake import KVShardGroup
from beamserve.kv_transfer.topology import first_window_page, window_start
from beamserve.workers.ref.checkpoint import make_tiny
from beamserve.workers.ref.engine import RefBeam, RefEngineError
from beamserve.workers.ref.kv import LayerKV, RequestKV
from beamserve.workers.ref.shards import KVPoolExhaustedError, PagePool, ShardedKV
from beamserve.workers.ref.worker import DecodeWorker, PoolSpec, PrefillWorker

BACKEND = "mooncake"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("ckpt") / "tiny", seed=0)


@pytest.fixture(scope="module")
def engine(tiny: Path) -> RefBeam:
    return RefBeam(tiny)


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 500, n).tolist()


# Around the window (32) and the page/chunk size (16): shorter than the window, exactly the
# window, one past it, page-aligned, and long enough that sliding layers drop most tokens.
LENGTHS = (20, 31, 32, 33, 48, 97)


@pytest.mark.parametrize("n", LENGTHS)
def test_prefill_then_decode_equals_the_uninterrupted_loop(engine: RefBeam, n: int) -> None:
    ids = prompt(n, n)
    out = engine.prefill(ids)
    assert out.kv.seq_len == n and out.computed_tokens == n
    assert all(layer.start == 0 for layer in out.kv.layers)  # nothing dropped at prefill
    assert engine.decode_from(out.kv, n, out.first_token, 8) == engine.generate(ids, 8)


def test_decode_needs_only_the_window(engine: RefBeam) -> None:
    """What the pools hold (full layers: all; sliding: the last `window` tokens) suffices."""
    n, w = 97, engine.window
    out = engine.prefill(prompt(n, 1))
    lo = window_start(n, w)
    cut = RequestKV(
        n,
        tuple(
            layer if full else LayerKV(lo, layer.keys[:, lo:], layer.values[:, lo:])
            for layer, full in zip(out.kv.layers, engine.full, strict=True)
        ),
    )
    assert engine.decode_from(cut, n, out.first_token, 8) == engine.generate(prompt(n, 1), 8)
    too_short = RequestKV(
        n,
        tuple(
            layer if full else LayerKV(n - 8, layer.keys[:, n - 8 :], layer.values[:, n - 8 :])
            for layer, full in zip(out.kv.layers, engine.full, strict=True)
        ),
    )
    with pytest.raises(RefEngineError, match="window − 1"):
        engine.decode_from(too_short, n, out.first_token, 2)


def test_unchunked_loop_matches_transformers_generate(tiny: Path) -> None:
    whole = RefBeam(tiny, prefill_chunk=None)
    ids = prompt(70, 7)
    assert whole.generate(ids, 12) == whole.hf_generate(ids, 12)
    out = whole.prefill(ids)
    assert whole.decode_from(out.kv, 70, out.first_token, 12) == whole.hf_generate(ids, 12)


def test_resuming_from_a_prefix_is_bitwise_identical(engine: RefBeam) -> None:
    ids = prompt(100, 3)
    fresh = engine.prefill(ids)
    k, w = 64, engine.window
    prefix = RequestKV(
        k,
        tuple(
            LayerKV(0, layer.keys[:, :k], layer.values[:, :k])
            if full
            else LayerKV(k - w, layer.keys[:, k - w : k], layer.values[:, k - w : k])
            for layer, full in zip(fresh.kv.layers, engine.full, strict=True)
        ),
    )
    resumed = engine.prefill(ids, prefix)
    assert resumed.computed_tokens == 36 and resumed.first_token == fresh.first_token
    assert resumed.kv.equals(fresh.kv)
    ten = RequestKV(
        10, tuple(LayerKV(0, x.keys[:, :10], x.values[:, :10]) for x in fresh.kv.layers)
    )
    with pytest.raises(RefEngineError, match="multiple of prefill_chunk"):
        engine.prefill(ids, ten)


def test_page_pool_counts_references() -> None:
    pool = PagePool("full", 4)
    a = pool.alloc(3)
    assert a.tolist() == [0, 1, 2] and pool.free == 1
    pool.incref(a[:1])
    pool.decref(a)
    assert pool.free == 3 and pool.refs(0) == 1
    with pytest.raises(KVPoolExhaustedError, match="full_pages"):
        pool.alloc(4)
    pool.decref(a[:1])
    assert pool.free == 4
    with pytest.raises(ValueError, match="freed more often"):
        pool.decref(a[:1])


@pytest.mark.parametrize(("tp", "layout"), [(1, "HND"), (2, "HND"), (4, "HND"), (2, "NHD")])
def test_shards_lay_out_and_read_back_exactly(engine: RefBeam, tp: int, layout: str) -> None:
    spec = PoolSpec(tp, BACKEND, full_pages=32, window_pages=16, layout=layout)
    shards = ShardedKV(f"t-{tp}-{layout}", spec.pool_layout(engine.kv_config), BACKEND)
    try:
        group: KVShardGroup = shards  # what DecodeKVClient takes
        assert group.size == tp
        assert len({s.info.name for s in shards.shards}) == tp  # one agent per shard
        n = 97
        out = engine.prefill(prompt(n, 5))
        shards.window.alloc(3)  # page tables that do not start at 0
        pages = shards.alloc(n)
        written = shards.write(out.kv, pages)
        back = shards.read_kv(pages, n)
        assert back.equals(out.kv)
        lo = window_start(n, engine.window)
        for layer, full in zip(back.layers, engine.full, strict=True):
            assert layer.start == (0 if full else lo)
        m = engine.kv_config
        heads = m.num_key_value_heads
        per_token = 2 * heads * m.head_dim * 2  # K and V, every head once, bf16
        window_tokens = n - first_window_page(n, m.sliding_window, 16) * 16  # whole pages
        full, sliding = len(m.full_layers), len(m.sliding_layers)
        assert written == per_token * (full * n + sliding * window_tokens)
        sums = shards.call_all("checksums", n, pages)
        assert len(sums) == tp and all(sums)
        shards.free(pages)
        assert shards.full.free == 32
    finally:
        final = shards.close()
    assert all(s.registered_regions == 0 and s.live_transfers == 0 for s in final)


def test_in_process_prefill_and_decode_share_nothing_but_the_wire(
    engine: RefBeam, tiny: Path
) -> None:
    """Two pools in one process, each shard with its own agent; HTTP handshake; 4:2."""
    pw = PrefillWorker(tiny, PoolSpec(4, BACKEND), engine=engine)
    dw = DecodeWorker(tiny, PoolSpec(2, BACKEND), engine=engine)
    try:
        ids = prompt(60, 11)
        pre = pw.prefill("r1", ids)
        got = dw.generate("r1", pw.url, ids, pre.first_token, 8, deadline_s=20)
        assert got.source == "transfer", got.error
        assert got.tokens == engine.generate(ids, 8)
        assert got.bytes_moved == got.bytes_minimum > 0
        assert dw.stats().transfers == 1 and dw.stats().recompute_fallbacks == 0
        stats = pw.stats()  # the lease was released: only the prefix cache holds pages
        assert stats.leases_held == 0 and stats.cached_blocks == 60 // 16
    finally:
        pw.close()
        dw.close()


def test_prefix_cache_reuses_evicts_and_returns_every_page(engine: RefBeam, tiny: Path) -> None:
    # 12 full / 6 window pages per rank: two 60-token prompts do not fit with their cache.
    pw = PrefillWorker(tiny, PoolSpec(2, BACKEND, full_pages=12, window_pages=6), engine=engine)
    try:
        a = prompt(60, 21)
        first = pw.prefill("a", a)
        assert first.cached_tokens == 0
        pw.registry.release("a")
        follow = [*a, *prompt(40, 22)]
        second = pw.prefill("a2", follow)
        assert second.cached_tokens == 48 and second.computed_tokens == 52
        assert second.first_token == engine.prefill(follow).first_token
        pw.registry.release("a2")
        third = pw.prefill("b", prompt(60, 23))  # needs pages: the cache gives its LRU up
        assert third.cached_tokens == 0
        pw.registry.release("b")
        assert pw.clear_prefix_cache() > 0
        s = pw.stats()
        assert (s.free_full_pages, s.free_window_pages) == (12, 6)
    finally:
        pw.close()


def test_a_process_runs_one_backend(engine: RefBeam) -> None:
    layout = PoolSpec(1, full_pages=4, window_pages=4).pool_layout(engine.kv_config)
    ShardedKV("one-backend", layout, BACKEND).close()
    with pytest.raises(KVTransferError, match="own worker process"):
        ShardedKV("other-backend", layout, "nixl")  # refused before NIXL is even imported
