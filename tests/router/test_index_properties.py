"""PrefixIndex against a plain reference model (sets per worker and group) under random
stores, removals, clears, worker removals, predictions and clock advances."""

from __future__ import annotations

from dataclasses import dataclass, field

from beamserve.kvwire.events import (
    SPEC_KIND_FULL_ATTENTION,
    SPEC_KIND_SLIDING_WINDOW,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from beamserve.router.index.prefix_index import PrefixIndex, PrefixMatch, block_key
from hypothesis import example, given, settings
from hypothesis import strategies as st

WORKERS = ["w0", "w1", "w2"]
# Few distinct blocks so that chains overlap; large values so the 60-bit fold matters
# (two of them differ only above bit 60 and must be the same key).
BLOCKS = [(i * 0x9E3779B97F4A7C15) & ((1 << 64) - 1) for i in range(1, 12)]
# The last one folds onto the first: a repeated block inside one chain.
BLOCKS.append(BLOCKS[0] ^ (1 << 62))
GROUPS = [0, 1, None]
KINDS = {0: SPEC_KIND_FULL_ATTENTION, 1: SPEC_KIND_SLIDING_WINDOW, None: None}


@dataclass
class Model:
    full: dict[str, set[int]] = field(default_factory=dict)
    window: dict[str, set[int]] = field(default_factory=dict)
    lower: dict[str, set[int]] = field(default_factory=dict)
    pred: dict[str, dict[int, float]] = field(default_factory=dict)

    def worker(self, w: str) -> None:
        for table in (self.full, self.window, self.lower):
            table.setdefault(w, set())
        self.pred.setdefault(w, {})

    def drop(self, w: str) -> None:
        for table in (self.full, self.window, self.lower, self.pred):
            table.pop(w, None)

    def active(self, w: str, key: int, now: float) -> bool:
        return self.pred.get(w, {}).get(key, -1.0) > now

    def match(
        self, keys: list[int], w: str, block_size: int, sliding_window: int, now: float
    ) -> PrefixMatch:
        if w not in self.full:
            return PrefixMatch()
        full, window = self.full[w], self.window[w]

        def in_full(key: int) -> bool:
            return key in full or self.active(w, key, now)

        def in_window(key: int) -> bool:
            return key in window or self.active(w, key, now)

        k = 0
        while k < len(keys) and in_full(keys[k]):
            k += 1

        def tail_ok(j: int) -> bool:
            start = max(0, j * block_size - sliding_window) // block_size
            return all(in_window(keys[i]) for i in range(start, j))

        window_ok = k > 0 and tail_ok(k)
        best = max(j for j in range(k + 1) if j == 0 or tail_ok(j))
        predicted = sum(1 for key in keys[:k] if key not in full)
        low = k
        while low < len(keys) and (keys[low] in self.lower[w] or keys[low] in full):
            low += 1
        return PrefixMatch(k, window_ok, predicted, best, low)


def chains() -> st.SearchStrategy[list[int]]:
    """Mostly runs of the shared chain (what engines store and prompts share), sometimes any
    blocks."""
    run = st.tuples(st.integers(0, len(BLOCKS) - 1), st.integers(0, len(BLOCKS))).map(
        lambda t: BLOCKS[t[0] : t[0] + t[1]]
    )
    return st.one_of(run, run, st.lists(st.sampled_from(BLOCKS), max_size=6))


MEDIA = st.sampled_from(["GPU", "GPU", None, "CPU"])
store = st.tuples(
    st.just("store"), st.sampled_from(WORKERS), st.sampled_from(GROUPS), chains(), MEDIA
)
remove = st.tuples(
    st.just("remove"), st.sampled_from(WORKERS), st.sampled_from(GROUPS), chains(), MEDIA
)
predict = st.tuples(
    st.just("predict"), st.sampled_from(WORKERS), chains(), st.sampled_from([0.5, 1.0, 3.0])
)
OPS: dict[str, st.SearchStrategy[tuple[object, ...]]] = {
    "store": store,
    "remove": remove,
    "predict": predict,
    "tick": st.tuples(st.just("tick"), st.sampled_from([0.25, 0.5, 1.0, 2.0])),
    "clear": st.tuples(st.just("clear"), st.sampled_from(WORKERS)),
    "clear_worker": st.tuples(st.just("clear_worker"), st.sampled_from(WORKERS)),
    "remove_worker": st.tuples(st.just("remove_worker"), st.sampled_from(WORKERS)),
    "sweep": st.tuples(st.just("sweep")),
}
# Weighted towards writes so that workers build up overlapping chains in both groups.
WEIGHTS = (
    ["store"] * 8
    + ["remove"] * 3
    + ["predict"] * 3
    + ["tick"] * 2
    + [
        "clear",
        "clear_worker",
        "remove_worker",
        "sweep",
    ]
)
ops = st.sampled_from(WEIGHTS).flatmap(lambda name: OPS[name])

# Prompts: a prefix of the shared chain, sometimes with one block replaced.
prompts = st.one_of(
    st.integers(0, len(BLOCKS)).map(lambda n: BLOCKS[:n]),
    st.tuples(
        st.integers(1, len(BLOCKS)), st.integers(0, len(BLOCKS) - 1), st.sampled_from(BLOCKS)
    ).map(lambda t: [*BLOCKS[: t[1] % t[0]], t[2], *BLOCKS[t[1] % t[0] + 1 : t[0]]]),
    st.lists(st.sampled_from(BLOCKS), max_size=12),
)
queries = st.lists(
    st.tuples(prompts, st.sampled_from([16, 64, 48]), st.sampled_from([0, 64, 100, 512])),
    min_size=1,
    max_size=3,
)


def apply_op(index: PrefixIndex, model: Model, op: tuple[object, ...], now: float) -> float:
    kind = op[0]
    if kind in ("store", "remove"):
        _, w, group, hashes, medium = op
        assert isinstance(w, str) and isinstance(hashes, list)
        keys = [block_key(h) for h in hashes]
        event: object
        if kind == "store":
            event = BlockStored(
                hashes,
                None,
                [],
                64,
                medium=medium,
                group_idx=group,
                kv_cache_spec_kind=KINDS[group],  # type: ignore[index]
            )
        else:
            event = BlockRemoved(hashes, medium=medium, group_idx=group)
        index.apply(w, KVEventBatch(now, (event,)))
        model.worker(w)
        if medium == "CPU":
            if group in (0, None):
                target = model.lower[w]
                if kind == "store":
                    target.update(keys)
                else:
                    target.difference_update(keys)
            return now
        tables = (
            [model.full[w]]
            if group == 0
            else [model.window[w]]
            if group == 1
            else [
                model.full[w],
                model.window[w],
            ]
        )
        for table in tables:
            if kind == "store":
                table.update(keys)
            else:
                table.difference_update(keys)
        if group in (0, None):
            for key in keys:
                model.pred[w].pop(key, None)
    elif kind == "clear":
        index.apply(str(op[1]), KVEventBatch(now, (AllBlocksCleared(),)))
        model.drop(str(op[1]))
        model.worker(str(op[1]))
    elif kind == "clear_worker":
        index.clear_worker(str(op[1]))
        model.drop(str(op[1]))
        model.worker(str(op[1]))
    elif kind == "remove_worker":
        index.remove_worker(str(op[1]))
        model.drop(str(op[1]))
    elif kind == "predict":
        _, w, hashes, ttl = op
        assert isinstance(w, str) and isinstance(hashes, list) and isinstance(ttl, float)
        added = index.predict(w, hashes, ttl_s=ttl, now=now)
        model.worker(w)
        moved = set()
        for key in (block_key(h) for h in hashes):
            if key in model.full[w] and key in model.window[w]:
                continue
            old = model.pred[w].get(key, -1.0)
            if old > now and old >= now + ttl:
                continue
            model.pred[w][key] = now + ttl
            moved.add(key)
        # what it returns: the blocks predicted or moved to the later expiry (replica sync's)
        assert set(added) == moved, (hashes, added)
    elif kind == "tick":
        assert isinstance(op[1], float)
        return now + op[1]
    elif kind == "sweep":
        index.sweep(2)
    return now


@settings(max_examples=300, deadline=None)
# A window tail that starts inside a block (64·3 − 100 = 92: block 1, not block 2).
@example(
    [("store", "w0", 0, BLOCKS[:3], "GPU"), ("store", "w0", 1, BLOCKS[2:3], "GPU")],
    [(BLOCKS[:3], 64, 100)],
    4096,
)
# A refreshed prediction outlives the record of its first, shorter one.
@example(
    [
        ("predict", "w0", BLOCKS[:2], 0.5),
        ("tick", 0.25),
        ("predict", "w0", BLOCKS[:2], 3.0),
        ("tick", 1.0),
    ],
    [(BLOCKS[:2], 64, 512)],
    4096,
)
@given(st.lists(ops, min_size=4, max_size=40), queries, st.sampled_from([1, 2, 4096]))
def test_index_matches_reference_model(
    program: list[tuple[object, ...]],
    probes: list[tuple[list[int], int, int]],
    sweep_budget: int,
) -> None:
    index = PrefixIndex(clock=lambda: 0.0, sweep_budget=sweep_budget)
    model = Model()
    now = 0.0
    for op in program:
        now = apply_op(index, model, op, now)
        for hashes, block_size, window in probes:
            keys = [block_key(h) for h in hashes]
            got = index.match_detailed(
                hashes, WORKERS, block_size=block_size, sliding_window=window, now=now
            )
            want = {w: model.match(keys, w, block_size, window, now) for w in WORKERS}
            assert got == want, (op, hashes, block_size, window)
            hits = index.match(
                hashes, WORKERS, block_size=block_size, sliding_window=window, now=now
            )
            assert hits == {w: m.hit for w, m in want.items()}
    # Real residency and counters agree with the model too.
    stats = index.stats()
    assert sorted(index.workers) == sorted(model.full)
    for w in model.full:
        resident = index.resident(w)
        assert resident["full"] == model.full[w]
        assert resident["window"] == model.window[w]
        assert resident["lower"] == model.lower[w]
        assert index.worker_entries(w) == len(model.full[w] | model.window[w])
    assert stats.full_entries == sum(len(s) for s in model.full.values())
    assert stats.window_entries == sum(len(s) for s in model.window.values())
    assert stats.lower_entries == sum(len(s) for s in model.lower.values())
    index.sweep()
    live = set().union(*model.full.values(), *model.window.values()) if model.full else set()
    assert index.stats().blocks == len(live)
