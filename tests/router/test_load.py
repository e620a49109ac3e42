"""`LoadBook`: router-tracked load moves from prefill to decode and back to zero; the circuit
breaker opens after repeated failures, half-opens for one probe, and closes on success."""

from __future__ import annotations

from beamserve.router.load import BreakerParams, LoadBook
from hypothesis import given
from hypothesis import strategies as st


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
