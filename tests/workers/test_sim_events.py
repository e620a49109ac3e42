"""KV-cache events from the simulated engine: what they say, and that the vLLM-format encoder of
`beamserve.workers.kv_events` takes them as they are."""

from __future__ import annotations

import msgpack
from beamserve.kvwire.events import (
    FULL_GROUP,
    WINDOW_GROUP,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from beamserve.kvwire.hashing import block_hashes
from beamserve.workers.sim import EngineConfig, SimEngine, SimRequest, VirtualClock
from beamserve.workers.sim.profiles import TINY_CPU

P = 64


def run(tokens: list[tuple[int, ...]], **overrides: object) -> list[KVEventBatch]:
    clock = VirtualClock()
    batches: list[KVEventBatch] = []
    eng = SimEngine(
        EngineConfig.from_profile(TINY_CPU, data_parallel_rank=3, **overrides),
        clock,
        kv_events=batches.append,
    )
    for i, t in enumerate(tokens):
        eng.submit(SimRequest(f"r{i}", token_ids=t, max_output_tokens=4))
        clock.run()
    return batches


def test_stored_blocks_are_the_vllm_hashes_of_the_prompt() -> None:
    tokens = tuple(range(7, 7 + 5 * P + 9))
    batches = run([tokens])
    stored = [e for b in batches for e in b.events if isinstance(e, BlockStored)]
    full = [h for e in stored if e.group_idx == FULL_GROUP for h in e.block_hashes]
    want = block_hashes(list(tokens), P)
    assert full == want[:5]
    first = next(e for e in stored if e.group_idx == FULL_GROUP)
    assert (
        first.parent_block_hash is None and first.token_ids == tokens[: len(first.block_hashes) * P]
    )
    window = [e for e in stored if e.group_idx == WINDOW_GROUP]
    assert window and all(e.kv_cache_spec_sliding_window == 128 for e in window)
    assert all(e.kv_cache_spec_kind == "sliding_window" for e in window)
    # window blocks only for the pages covering the last 128 tokens of the prompt
    assert [h for e in window for h in e.block_hashes] == want[3:5]
    assert {b.data_parallel_rank for b in batches} == {3}
    ts = [b.ts for b in batches]
    assert ts == sorted(ts)


def test_evictions_are_reported_per_group() -> None:
    # a small pool: the second prompt evicts the first one's blocks
    a = tuple(range(1, 1 + 6 * P + 1))
    b = tuple(range(50_000, 50_000 + 6 * P + 1))
    batches = run([a, b], full_pages=8, window_pages=8)
    removed = [e for x in batches for e in x.events if isinstance(e, BlockRemoved)]
    gone = {h for e in removed if e.group_idx == FULL_GROUP for h in e.block_hashes}
    assert gone and gone <= set(block_hashes(list(a), P))
    assert all(e.medium == "GPU" for e in removed)


def test_the_vllm_encoder_takes_sim_batches() -> None:
    from beamserve.kvwire.events import encode_batch

    tokens = tuple(range(3, 3 + 3 * P + 1))
    batches = run([tokens])
    for batch in batches:
        ts, events, rank = msgpack.unpackb(encode_batch(batch), raw=False)
        assert ts == batch.ts and rank == 3
        assert [e["type"] for e in events] == [type(e).__name__ for e in batch.events]
        for wire, ev in zip(events, batch.events, strict=True):
            if isinstance(ev, BlockStored):
                assert wire["block_hashes"] == list(ev.block_hashes)
                assert wire["group_idx"] == ev.group_idx
                assert wire["kv_cache_spec_kind"] == ev.kv_cache_spec_kind
                assert wire["medium"] == "GPU" and wire["block_size"] == P
