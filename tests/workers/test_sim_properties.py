"""Property tests: page accounting never breaks, and the prefix cache holds exactly what an
independent, deliberately plain model of it says, under random request sequences."""

from __future__ import annotations

from dataclasses import dataclass, field

from beamserve.kv_transfer.model import BeamModelConfig, beam_layer_types
from beamserve.kvwire.events import FULL_GROUP, WINDOW_GROUP
from beamserve.workers.sim import (
    EngineConfig,
    RequestMetrics,
    RequestUpdate,
    SimEngine,
    SimRequest,
    SpecDecode,
    VirtualClock,
)
from beamserve.workers.sim.kv_cache import KVCacheManager, SeqKV
from beamserve.workers.sim.profiles import TINY_CPU
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

P = 64
W = 128
BLOCKS = 12


def doc(branch: int, split: int) -> tuple[int, ...]:
    """Documents share their first `split` blocks (a common prefix), then diverge."""
    return tuple(j if j < split else branch * 1000 + j for j in range(BLOCKS))


# --- an independent model of the full-attention prefix cache ----------------------------------


@dataclass
class RefSeq:
    hashes: tuple[int, ...]
    shared: list[int] = field(default_factory=list)  # hashes of cached blocks held
    private: int = 0  # pages of its own
    computed: int = 0
    prompt: int = 0


@dataclass
class RefCache:
    """Plain refcounts and a list in eviction order: no arrays, no lazy LRU, no page ids."""

    capacity: int
    refs: dict[int, int] = field(default_factory=dict)
    lru: list[int] = field(default_factory=list)
    private: int = 0

    def free(self) -> int:
        return self.capacity - self.private - len(self.refs)

    def available(self) -> int:
        return self.free() + len(self.lru)

    def take(self, n: int) -> None:
        for _ in range(n):
            if self.free() == 0:
                victim = self.lru.pop(0)
                del self.refs[victim]
            self.private += 1

    def pin(self, h: int) -> None:
        if self.refs[h] == 0:
            self.lru.remove(h)
        self.refs[h] += 1

    def hit(self, hashes: tuple[int, ...], prompt: int) -> int:
        n = 0
        for h in hashes[: max(0, (prompt - 1) // P)]:
            if h not in self.refs:
                break
            n += 1
        return n

    def open_need(self, hashes: tuple[int, ...], blocks: int, target: int) -> int:
        pinned = sum(1 for h in hashes[:blocks] if self.refs[h] == 0)
        return max(0, -(-target // P) - blocks) + pinned

    def open(self, hashes: tuple[int, ...], blocks: int, prompt: int) -> RefSeq:
        s = RefSeq(hashes, prompt=prompt)
        for h in hashes[:blocks]:
            self.pin(h)
            s.shared.append(h)
        return s

    def grow(self, s: RefSeq, target: int) -> bool:
        need = -(-target // P) - len(s.shared) - s.private
        if need > self.available():
            return False
        if need > 0:
            self.take(need)
            s.private += need
        return True

    def commit(self, s: RefSeq, new: int) -> None:
        for i in range(len(s.shared), min(new // P, len(s.hashes))):
            h = s.hashes[i]
            s.private -= 1
            if h in self.refs:
                self.private -= 1
                self.pin(h)
            else:
                self.private -= 1
                self.refs[h] = 1
            s.shared.append(h)

    def close(self, s: RefSeq) -> None:
        self.private -= s.private
        for h in reversed(s.shared):
            self.refs[h] -= 1
            if self.refs[h] == 0:
                self.lru.append(h)


def beam_tiny() -> BeamModelConfig:
    return BeamModelConfig(6, beam_layer_types(6), W, 4, 2, 32, dtype="float32")


@dataclass(frozen=True)
class Start:
    branch: int
    split: int
    prompt: int
    chunk: int


@dataclass(frozen=True)
class Advance:
    which: int
    tokens: int


@dataclass(frozen=True)
class Finish:
    which: int


Op = Start | Advance | Finish
op: st.SearchStrategy[Op] = st.one_of(
    st.builds(
        Start,
        st.integers(0, 5),
        st.integers(0, 8),
        st.integers(1, BLOCKS * P),
        st.integers(1, 6 * P),
    ),
    st.builds(Advance, st.integers(0, 7), st.integers(1, 5 * P)),
    st.builds(Finish, st.integers(0, 7)),
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, min_size=1, max_size=40), capacity=st.integers(12, 40))
def test_full_attention_cache_matches_an_independent_model(ops: list[Op], capacity: int) -> None:
    kv = KVCacheManager(beam_tiny(), page_size=P, full_pages=capacity, window_pages=400)
    ref = RefCache(capacity)
    live: list[tuple[SeqKV, RefSeq, int]] = []  # (seq, model, computed)
    for o in ops:
        if isinstance(o, Start):
            prompt = o.prompt
            hashes = doc(o.branch, o.split)[: prompt // P]
            m = kv.match(hashes, prompt)
            assert m.blocks == ref.hit(hashes, prompt)
            target = min(prompt, m.start + o.chunk)
            ok = kv.can_open(hashes, m, target)
            assert ok == (ref.open_need(hashes, m.blocks, target) <= ref.available())
            if ok:
                seq = kv.open(hashes, None, m)
                assert kv.grow(seq, target)
                kv.commit(seq, m.start, target)
                r = ref.open(hashes, m.blocks, prompt)
                assert ref.grow(r, target)
                ref.commit(r, target)
                live.append((seq, r, target))
        elif isinstance(o, Advance) and live:
            i = o.which % len(live)
            seq, r, computed = live[i]
            new = computed + o.tokens
            ok = kv.grow(seq, new)
            assert ok == ref.grow(r, new)
            if ok:
                kv.commit(seq, computed, new)
                ref.commit(r, new)
                live[i] = (seq, r, new)
        elif isinstance(o, Finish) and live:
            seq, r, _ = live.pop(o.which % len(live))
            kv.close(seq)
            ref.close(r)
        kv.check()
        assert {h for h in ref.refs} == set(kv.groups[FULL_GROUP].by_hash)
        assert kv.lru_order(FULL_GROUP) == ref.lru
        assert kv.used(FULL_GROUP) == ref.private + len(ref.refs) <= capacity
    for seq, r, _ in live:
        kv.close(seq)
        ref.close(r)
    kv.check()
    assert kv.used(FULL_GROUP) == len(ref.refs) == kv.evictable(FULL_GROUP)


@settings(max_examples=80, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.integers(0, 3), st.integers(0, 8), st.integers(1, 20 * P), st.integers(1, 3 * P)
        ),
        min_size=1,
        max_size=25,
    ),
    window_pages=st.integers(6, 14),
    host=st.booleans(),
)
def test_window_pool_and_host_tier_keep_their_invariants(
    ops: list[tuple[int, int, int, int]], window_pages: int, host: bool
) -> None:
    kv = KVCacheManager(
        beam_tiny(),
        page_size=P,
        full_pages=60,
        window_pages=window_pages,
        host_full_pages=10 if host else 0,
        host_window_pages=4 if host else 0,
    )
    live: list[tuple[SeqKV, int, int]] = []
    for branch, split, prompt, step in ops:
        hashes = doc(branch, split)[: prompt // P]
        m = kv.match(hashes, prompt)
        end = min(prompt, m.start + step)
        if kv.can_open(hashes, m, end):
            seq = kv.open(hashes, None, m)
            assert kv.grow(seq, end)
            kv.commit(seq, m.start, end)
            live.append((seq, end, prompt + 2 * P))
        # everyone advances a bit; whoever reaches its end (prompt + some decode) leaves
        for i, (seq, at, stop) in enumerate(list(live)):
            new = min(stop, at + step)
            if kv.grow(seq, new):
                kv.commit(seq, at, new)
                live[i] = (seq, new, stop)
                # a sequence holds only the pages of its window (plus none below it)
                first = max(0, new - W) // P
                assert all(idx >= first for idx in seq.window)
                assert len(seq.window) <= -(-W // P) + 1
        kv.check()
        assert kv.used(WINDOW_GROUP) <= window_pages
        for seq, at, stop in [x for x in live if x[1] >= x[2]]:
            kv.close(seq)
            live.remove((seq, at, stop))
        kv.check()
    for seq, _, _ in live:
        kv.close(seq)
    kv.check()
    assert kv.used(WINDOW_GROUP) == kv.evictable(WINDOW_GROUP)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=st.lists(
        st.tuples(
            st.integers(0, 4),
            st.integers(0, 10),
            st.integers(1, 12 * P),
            st.integers(1, 90),
            st.floats(0, 0.05),
        ),
        min_size=1,
        max_size=14,
    ),
    full_pages=st.integers(16, 48),
    spec=st.booleans(),
)
def test_engine_page_accounting_under_random_workloads(
    reqs: list[tuple[int, int, int, int, float]], full_pages: int, spec: bool
) -> None:
    profile = TINY_CPU.with_changes(spec=SpecDecode(4, 2.5) if spec else None)
    clock = VirtualClock()
    eng = SimEngine(
        EngineConfig.from_profile(
            profile, full_pages=full_pages, window_pages=8, max_running=5, max_batched_tokens=256
        ),
        clock,
    )
    done: dict[str, RequestMetrics] = {}
    checks = 0

    def keep(u: RequestUpdate) -> None:
        nonlocal checks
        eng.kv_cache.check()  # at every step end that emits tokens
        checks += 1
        if u.metrics is not None:
            done[u.request_id] = u.metrics

    want: dict[str, int] = {}
    for i, (branch, split, prompt, out, at) in enumerate(reqs):
        prompt = min(prompt, (full_pages - 2) * P - out)
        if prompt < 1:
            continue
        rid = f"r{i}"
        want[rid] = out
        eng.submit(
            SimRequest(
                rid,
                prompt_tokens=prompt,
                block_hashes=doc(branch, split)[: prompt // P],
                max_output_tokens=out,
                arrival_time=at,
            ),
            keep,
        )
    clock.run()
    assert {k: m.output_tokens for k, m in done.items()} == want
    assert all(m.finish_reason == "length" for m in done.values())
    kv = eng.kv_cache
    kv.check()
    # nothing leaked: every page still in use is an evictable cached block
    assert kv.used(FULL_GROUP) == kv.evictable(FULL_GROUP) <= full_pages
    assert kv.used(WINDOW_GROUP) == kv.evictable(WINDOW_GROUP)
    assert checks > 0
