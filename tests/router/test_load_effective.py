"""`effective_load`: a replica's own book combined with the engine's scrape (several router
replicas behind a plain balancer). Properties of the formula in `beamserve.router.load`, the
`LoadBook` wiring, and the sim engine's `queued_prefill_tokens` gauge it reads."""

from __future__ import annotations

from beamserve.router.load import (
    BookCounts,
    LoadBook,
    LoadParams,
    ScrapedCounts,
    effective_load,
)
from beamserve.router.server import load_samples
from beamserve.workers.server.backend import WorkerStats
from beamserve.workers.server.metrics import QUEUED_PREFILL_TOKENS, WorkerMetrics
from beamserve.workers.sim import EngineConfig, SimEngine, SimRequest, VirtualClock, get_profile
from hypothesis import given
from hypothesis import strategies as st

STALE = 2.0
tokens = st.integers(0, 10**6)
counts = st.integers(0, 64)
books = st.builds(BookCounts, tokens, tokens, counts, counts)
scrapes = st.builds(
    ScrapedCounts,
    counts,
    counts,
    st.floats(0, 1),
    st.one_of(st.none(), tokens),
)
means = st.floats(0, 10**5)


def eff(
    own: BookCounts,
    scraped: ScrapedCounts | None,
    at: BookCounts,
    age: float | None,
    p: float = 0.0,
    c: float = 0.0,
) -> tuple[int, int, int, int]:
    e = effective_load(
        own, scraped, at, age, stale_after_s=STALE, prefill_per_request=p, context_per_request=c
    )
    return e.prefill_tokens, e.decode_tokens, e.queue_len, e.running


@given(books, st.one_of(st.none(), scrapes), books, st.floats(STALE + 1e-6, 1e6), means, means)
def test_a_stale_or_missing_scrape_adds_nothing(
    own: BookCounts, scraped: ScrapedCounts | None, at: BookCounts, age: float, p: float, c: float
) -> None:
    for a in (age, None):
        e = effective_load(
            own, scraped, at, a, stale_after_s=STALE, prefill_per_request=p, context_per_request=c
        )
        assert (e.prefill_tokens, e.decode_tokens) == (own.prefill_tokens, own.decode_tokens)
        assert e.foreign_prefill_tokens == e.foreign_decode_tokens == 0


@given(books, scrapes, books, st.floats(0, STALE), means, means)
def test_never_below_the_own_book(
    own: BookCounts, scraped: ScrapedCounts, at: BookCounts, age: float, p: float, c: float
) -> None:
    e = effective_load(
        own, scraped, at, age, stale_after_s=STALE, prefill_per_request=p, context_per_request=c
    )
    assert e.prefill_tokens == own.prefill_tokens + e.foreign_prefill_tokens
    assert e.decode_tokens == own.decode_tokens + e.foreign_decode_tokens
    assert e.foreign_prefill_tokens >= 0 and e.foreign_decode_tokens >= 0
    assert e.queue_len >= 0 and e.running >= 0


@given(books, scrapes, books, st.floats(0, STALE), means, means, tokens, tokens)
def test_own_bookings_after_the_scrape_add_exactly_once(
    own: BookCounts,
    scraped: ScrapedCounts,
    at: BookCounts,
    age: float,
    p: float,
    c: float,
    x: int,
    y: int,
) -> None:
    """A new own request (x uncached tokens) adds x to prefill and one to the queue; one that
    reached decode since (context y) adds y to decode — neither lost nor counted twice."""
    p0, d0, _, _ = eff(own, scraped, at, age, p, c)
    more = BookCounts(own.prefill_tokens + x, own.decode_tokens, own.prefilling + 1, own.decoding)
    p1, d1, q1, _ = eff(more, scraped, at, age, p, c)
    assert (p1 - p0, d1 - d0) == (x, 0)
    assert q1 == max(scraped.queue_len + more.prefilling - at.prefilling, 0)
    dec = BookCounts(own.prefill_tokens, own.decode_tokens + y, own.prefilling, own.decoding + 1)
    p2, d2, _, r2 = eff(dec, scraped, at, age, p, c)
    assert (p2 - p0, d2 - d0) == (0, y)
    assert r2 == max(scraped.running + dec.decoding - at.decoding, 0)


@given(
    st.lists(st.tuples(counts, counts), min_size=1, max_size=8),
    st.integers(1, 50_000),
    st.integers(1, 200_000),
    st.booleans(),
    st.floats(0, STALE),
)
def test_every_replica_sees_the_whole_engine_not_its_share(
    shares: list[tuple[int, int]], t: int, ctx: int, exports_q: bool, age: float
) -> None:
    """N replicas; replica i has `np_i` requests waiting for prefill (t uncached tokens each) and
    `nd_i` decoding (ctx context each) on one worker, which reports exactly their sum. At the
    scrape each replica's effective load is the worker's whole load."""
    books_ = [BookCounts(n_p * t, n_d * ctx, n_p, n_d) for n_p, n_d in shares]
    q_total = sum(b.prefill_tokens for b in books_)
    scraped = ScrapedCounts(
        queue_len=sum(b.prefilling for b in books_),
        running=sum(b.decoding for b in books_),
        queued_prefill_tokens=q_total if exports_q else None,
    )
    for b in books_:
        p, d, q, r = eff(b, scraped, b, age, float(t), float(ctx))
        assert p == q_total
        assert d == sum(x.decode_tokens for x in books_)
        assert (q, r) == (scraped.queue_len, scraped.running)


@given(books, scrapes, books, st.floats(0, STALE), means, means, st.floats(1, 64))
def test_the_herd_term_never_goes_below_the_own_book(
    own: BookCounts,
    scraped: ScrapedCounts,
    at: BookCounts,
    age: float,
    p: float,
    c: float,
    k: float,
) -> None:
    e = effective_load(
        own, scraped, at, age, stale_after_s=STALE, prefill_per_request=p, context_per_request=c,
        replicas=k,
    )  # fmt: skip
    assert e.prefill_tokens == own.prefill_tokens + e.foreign_prefill_tokens
    assert e.decode_tokens == own.decode_tokens + e.foreign_decode_tokens
    assert min(e.foreign_prefill_tokens, e.foreign_decode_tokens, e.queue_len, e.running) >= 0


@given(
    st.integers(2, 8),
    st.tuples(counts, counts),
    st.integers(1, 50_000),
    st.integers(1, 200_000),
    st.integers(-8, 8),
    st.integers(-8, 8),
    st.floats(0, STALE),
)
def test_the_herd_term_tracks_replicas_that_all_do_what_this_one_does(
    n: int, share: tuple[int, int], t: int, ctx: int, dp: int, dd: int, age: float
) -> None:
    """N replicas with the same book on one worker, which reports their sum; since the scrape
    each booked (dp > 0) or finished (dp < 0) the same requests. With k = N every replica's
    effective load is the worker's true load now; with k = 1 only its own change shows."""
    n_p, n_d = share
    dp, dd = max(dp, -n_p), max(dd, -n_d)
    at = BookCounts(n_p * t, n_d * ctx, n_p, n_d)
    now = BookCounts((n_p + dp) * t, (n_d + dd) * ctx, n_p + dp, n_d + dd)
    scraped = ScrapedCounts(n * n_p, n * n_d, 0.0, n * n_p * t)
    kw = {"stale_after_s": STALE, "prefill_per_request": t, "context_per_request": ctx}
    e = effective_load(now, scraped, at, age, replicas=float(n), **kw)
    assert e.prefill_tokens == n * now.prefill_tokens
    assert e.decode_tokens == n * now.decode_tokens
    assert (e.queue_len, e.running) == (n * now.prefilling, n * now.decoding)
    one = effective_load(now, scraped, at, age, **kw)
    assert one.prefill_tokens == (n - 1) * at.prefill_tokens + now.prefill_tokens


def test_the_book_learns_the_replica_count_from_its_scrapes() -> None:
    """Engine requests = N × this replica's at every scrape → `replicas` approaches N; one
    replica (the engine's requests are all its own) stays at 1; too few requests: unchanged."""
    on = LoadParams(extrapolate=True)
    for n in (1, 4):
        book = LoadBook(clock=lambda: 0.0, params=on)
        flights = [book.start(f"w{i % 2}", 100, 1000) for i in range(6)]
        assert book.replicas == 1.0
        for _ in range(30):
            for w in ("w0", "w1"):
                book.scraped(w, {"sglang:num_queue_reqs": 3 * n, "sglang:num_running_reqs": 0})
        assert abs(book.replicas - n) < 0.05
        for f in flights:
            book.finish(f)
        if n == 4:  # the load it now reports for a new booking counts the herd
            book.scraped("w0", {"sglang:num_queue_reqs": 0, "sglang:num_running_reqs": 0})
            book.start("w0", 1000, 2000)
            got = book.load("w0")
            assert got.foreign_prefill_tokens == round((book.replicas - 1) * 1000)
    few = LoadBook(clock=lambda: 0.0, params=on)
    few.start("w0", 100, 1000)
    few.scraped("w0", {"sglang:num_queue_reqs": 40, "sglang:num_running_reqs": 0})
    assert few.replicas == 1.0
    off = LoadBook(clock=lambda: 0.0)  # the default: no herd term
    off.replicas = 4.0
    off.scraped("w0", {"sglang:num_queue_reqs": 0, "sglang:num_running_reqs": 0})
    off.start("w0", 1000, 2000)
    assert off.load("w0").foreign_prefill_tokens == 0


@given(books, scrapes, st.floats(0, STALE), means, means, tokens)
def test_the_next_scrape_does_not_count_own_work_twice(
    at: BookCounts, scraped: ScrapedCounts, age: float, p: float, c: float, x: int
) -> None:
    """Book x after a scrape; the next scrape sees x too: the load stays what it was."""
    own = BookCounts(at.prefill_tokens + x, at.decode_tokens, at.prefilling + 1, at.decoding)
    before = eff(own, scraped, at, age, p, c)
    q = scraped.queued_prefill_tokens
    rescraped = ScrapedCounts(
        scraped.queue_len + 1,
        scraped.running,
        scraped.kv_usage,
        None if q is None else q + x,
    )
    after = eff(own, rescraped, own, 0.0, p, c)
    assert after[0] == before[0] and after[2] == before[2]


def test_load_book_wires_the_scrape_and_its_own_part() -> None:
    now = [0.0]
    a = LoadBook(clock=lambda: now[0], params=LoadParams(stale_after_s=1.0))
    b = LoadBook(clock=lambda: now[0], params=LoadParams(stale_after_s=1.0))
    fa = a.start("w", uncached_tokens=1000, context_tokens=1200)
    b.start("w", uncached_tokens=3000, context_tokens=3100)
    engine = {"vllm:num_requests_waiting": 2.0, "beamserve_worker_queued_prefill_tokens": 4000.0}
    a.scraped("w", engine)
    b.scraped("w", engine)
    assert a.load("w").effective_prefill_tokens == b.load("w").effective_prefill_tokens == 4000
    a.start("w", uncached_tokens=500, context_tokens=600)  # after the scrape: adds on top
    assert a.load("w").effective_prefill_tokens == 4500 and a.load("w").queue_len == 3
    a.first_token(fa)  # its prefill ended: 1000 less, its context now decodes
    ld = a.load("w")
    assert (ld.effective_prefill_tokens, ld.decode_tokens, ld.queue_len) == (3500, 1200, 2)
    now[0] = 1.5  # the scrape went stale: own book only
    ld = a.load("w")
    assert (ld.effective_prefill_tokens, ld.foreign_prefill_tokens) == (500, 0)


def test_the_sim_exports_queued_prefill_tokens_and_the_scrape_reads_them() -> None:
    clock = VirtualClock()
    cfg = EngineConfig.from_profile(get_profile("h200-bf16-tp8"), page_size=64)
    engine = SimEngine(cfg, clock)
    assert engine.stats().queued_prefill_tokens == 0
    hashes = tuple(range(1, 65))
    engine.submit(SimRequest("a", prompt_tokens=4096, max_output_tokens=1, block_hashes=hashes))
    assert engine.stats().queued_prefill_tokens == 4096  # waiting, nothing cached yet
    clock.run()
    assert engine.stats().queued_prefill_tokens == 0
    # the same prompt again is a prefix hit: only what the cache lacks counts
    engine.submit(SimRequest("b", prompt_tokens=4096, max_output_tokens=1, block_hashes=hashes))
    assert 0 < engine.stats().queued_prefill_tokens < 4096
    metrics = WorkerMetrics("vllm", "beam", lambda: WorkerStats(queued_prefill_tokens=77), bool)
    text = metrics.render().decode()
    assert load_samples(text)[QUEUED_PREFILL_TOKENS] == 77.0
    none = WorkerMetrics("vllm", "beam", WorkerStats, bool).render().decode()
    assert QUEUED_PREFILL_TOKENS not in none  # an engine that cannot tell exports nothing


def test_without_combining_a_replica_routes_on_its_own_book() -> None:
    book = LoadBook(clock=lambda: 0.0, params=LoadParams(combine_scrape=False))
    book.start("w", uncached_tokens=1000, context_tokens=1200)
    book.scraped("w", {"vllm:num_requests_waiting": 4.0, QUEUED_PREFILL_TOKENS: 9000.0})
    ld = book.load("w")
    assert (ld.effective_prefill_tokens, ld.queue_len, ld.scraped_age_s) == (1000, 4, 0.0)
