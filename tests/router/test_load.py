"""`LoadBook`: router-tracked load moves from prefill to decode and back to zero; the circuit
breaker opens after repeated failures, half-opens for one probe, and closes on success."""

from __future__ import annotations

from beamserve.router.load import LOAD_METRICS, BreakerParams, LoadBook
from beamserve.router.server import load_samples
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_flight_accounting_and_scrapes() -> None:
    clock = Clock()
    book = LoadBook(clock=clock)
    f = book.start("d1", uncached_tokens=1000, context_tokens=1300, prefill="p1")
    assert book.load("p1").prefill_tokens == 1000 and book.load("d1").decode_tokens == 0
    book.first_token(f)
    assert book.load("p1").prefill_tokens == 0 and book.load("d1").decode_tokens == 1300
    book.finish(f)
    book.finish(f)  # idempotent
    assert book.load("d1").decode_tokens == 0 and book.load("d1").in_flight == 0
    book.scraped("d1", {"vllm:num_requests_waiting": 3, "vllm:kv_cache_usage_perc": 0.5})
    clock.t = 4.0
    ld = book.load("d1")
    assert ld.queue_len == 3 and ld.kv_usage == 0.5 and ld.scraped_age_s == 4.0
    book.scraped("s1", {"sglang:num_queue_reqs": 2, "sglang:token_usage": 0.25})
    assert book.load("s1").queue_len == 2


def test_breaker_opens_half_opens_and_closes() -> None:
    clock = Clock()
    book = LoadBook(breaker=BreakerParams(failure_threshold=2, open_s=5.0), clock=clock)
    book.failed("w")
    assert book.healthy("w")
    book.failed("w")
    assert not book.healthy("w")
    clock.t = 5.1
    assert book.healthy("w")  # half-open
    f = book.start("w", 10, 20)  # the probe
    assert not book.healthy("w")  # nobody else while the probe is out
    book.finish(f)
    book.succeeded("w")
    assert book.healthy("w")


@given(st.lists(st.tuples(st.sampled_from(["a", "b"]), st.integers(0, 500), st.booleans()),
                max_size=30))  # fmt: skip
def test_load_returns_to_zero(ops: list[tuple[str, int, bool]]) -> None:
    book = LoadBook()
    flights = []
    for worker, tokens, first in ops:
        f = book.start(worker, tokens, tokens + 10)
        if first:
            book.first_token(f)
        flights.append(f)
    for f in flights:
        book.finish(f)
    for w in ("a", "b"):
        ld = book.load(w)
        assert (ld.prefill_tokens, ld.decode_tokens, ld.in_flight) == (0, 0, 0)


_LABEL = st.text("abcxyz", min_size=1, max_size=4)


@given(
    st.lists(
        st.tuples(
            st.sampled_from((*LOAD_METRICS, "vllm:num_requests_waiting_total", "other:metric")),
            st.dictionaries(_LABEL, st.text(max_size=6), max_size=2),
            st.floats(-1e6, 1e6, allow_nan=False),
        ),
        max_size=12,
    )
)
def test_load_samples_agree_with_the_exposition_parser(
    series: list[tuple[str, dict[str, str], float]],
) -> None:
    """The scrape's one-regex reader sums each load metric over its label sets exactly as a
    full Prometheus text parse does, and ignores every other metric."""
    registry = CollectorRegistry()
    gauges: dict[tuple[str, tuple[str, ...]], Gauge] = {}
    for name, labels, value in series:
        keys = tuple(sorted(labels))
        g = gauges.get((name, keys))
        if g is None:
            if any(n == name for n, _ in gauges):
                continue  # one label schema per metric name
            g = gauges[(name, keys)] = Gauge(name, "h", keys, registry=registry)
        (g.labels(**labels) if keys else g).set(value)
    text = generate_latest(registry).decode()
    want: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in LOAD_METRICS:
                want[s.name] = want.get(s.name, 0.0) + s.value
    got = load_samples(text)
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert abs(got[k] - v) <= 1e-9 * max(1.0, abs(v))


# --- a prefill computed ahead, piece by piece (`LoadBook.prefilled`) --------------------------


@given(
    uncached=st.integers(1, 200_000),
    parts=st.lists(st.integers(-5, 60_000), max_size=12),
    hold=st.booleans(),
    end=st.sampled_from(["first_token", "finish"]),
)
def test_pieces_taken_off_the_books_leave_them_at_zero(
    uncached: int, parts: list[int], hold: bool, end: str
) -> None:
    """Whatever pieces are answered, the worker's booked prefill is the prompt less what they
    took off (never below zero), and once the request's prefill ends nothing stays booked."""
    book = LoadBook()
    f = book.start("w", uncached, uncached + 100, max_tokens=8)
    book.hold(f, hold)
    book.hold(f, False)
    left = uncached
    for n in parts:
        taken = book.prefilled(f, n)
        assert taken == min(max(n, 0), left)
        left -= taken
        assert book.load("w").prefill_tokens == left == f.prefill_tokens
    getattr(book, end)(f)
    if end == "first_token":
        book.finish(f)
    assert book.load("w").prefill_tokens == 0 and book.load("w").in_flight == 0
    assert book.prefilled(f, 10) == 0  # past its prefill: nothing to take


def test_a_split_flight_s_prefill_is_not_taken_off_by_pieces() -> None:
    """Pieces go only to a request prefilled on its decode worker; a split one's prefill is
    booked on its prefill worker and stays until the leg answers."""
    book = LoadBook()
    f = book.start("d", 30_000, 30_000, prefill="p", max_tokens=8)
    assert book.prefilled(f, 1_024) == 0
    assert book.load("p").prefill_tokens == 30_000


# --- the prompt a worker computes now (`WorkerLoad.head_prefill_tokens`) -------------------------


@given(
    st.lists(
        st.tuples(st.sampled_from(["start", "leg", "first", "finish"]), st.integers(0, 9),
                  st.integers(1, 90_000)),
        max_size=40,
    )
)  # fmt: skip
def test_the_head_is_the_oldest_prefill_still_booked(ops: list[tuple[str, int, int]]) -> None:
    """Whatever order split requests start, answer their prefill leg, get a first token or
    finish in, a prefill worker's head is the booked tokens of its oldest flight whose prefill
    has not ended (0 when none), never more than its whole booked prefill; at the end nothing
    is left."""
    book = LoadBook()
    flights: list[object] = []
    for op, i, tokens in ops:
        if op == "start":
            flights.append(book.start("d", tokens, tokens, prefill="p", max_tokens=8))
            continue
        if not flights:
            continue
        f = flights[i % len(flights)]
        if op == "leg":
            book.prefill_leg_done(f)  # type: ignore[arg-type]
        elif op == "first":
            book.first_token(f)  # type: ignore[arg-type]
        else:
            book.finish(f)  # type: ignore[arg-type]
        booked = [g for g in flights if not g.prefill_released]  # type: ignore[attr-defined]
        load = book.load("p")
        want = booked[0].prefill_tokens if booked else 0  # type: ignore[attr-defined]
        assert load.head_prefill_tokens == want <= load.prefill_tokens
    for f in flights:
        book.finish(f)  # type: ignore[arg-type]
    assert book.load("p").head_prefill_tokens == 0 == book.load("p").prefill_tokens


def test_a_local_prefill_s_head_follows_its_pieces() -> None:
    """On a worker prefilling locally the head is its oldest prompt, less the pieces already
    answered; the next in line becomes the head when it ends."""
    book = LoadBook()
    a = book.start("w", 20_000, 20_000, max_tokens=8)
    b = book.start("w", 7_000, 7_000, max_tokens=8)
    assert book.load("w").head_prefill_tokens == 20_000
    book.prefilled(a, 4_096)
    assert book.load("w").head_prefill_tokens == 15_904
    book.first_token(a)
    assert book.load("w").head_prefill_tokens == 7_000
    book.finish(b)
    assert book.load("w").head_prefill_tokens == 0
