"""The dispatch lifecycle owned by `RoutingCore`: whatever happens to a request — success, an
upstream refusal, a 5xx, a timeout, a client disconnect, retries before the first byte, an
outcome reported twice — the books return to zero and each ticket is released exactly once."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
from beamserve.router.core import Dispatch, RoutingCore
from beamserve.router.policy import ConditionalDisaggregation, NoCandidates, build_policy
from beamserve.router.types import Endpoint, RouteRequest
from hypothesis import given, settings
from hypothesis import strategies as st

PREFILL = [Endpoint(f"p{i}", f"http://p{i}:8000", role="prefill") for i in range(2)]
DECODE = [Endpoint(f"d{i}", f"http://d{i}:8000", role="decode") for i in range(2)]
BOTH = [Endpoint(f"b{i}", f"http://b{i}:8000") for i in range(2)]


@dataclass
class CountingTicket:
    """Stands in for the flow controller's ticket (below the part under test)."""

    releases: int = 0
    service: int | None = None

    def release(self, service_tokens: int | None = None) -> None:
        self.releases += 1
        self.service = service_tokens


def make_core() -> RoutingCore:
    return RoutingCore(
        build_policy("sticky-until-saturated"),
        disaggregation=ConditionalDisaggregation.from_params({"min_uncached_tokens": 100}),
    )


def books_are_empty(core: RoutingCore, endpoints: list[Endpoint]) -> None:
    for e in endpoints:
        ld = core.loads.load(e.id)
        assert (ld.in_flight, ld.prefill_tokens, ld.decode_tokens) == (0, 0, 0), e.id
    assert core.open_dispatches == 0


def request(i: int, prompt: int) -> RouteRequest:
    return RouteRequest(f"r{i}", prompt_tokens=prompt, session_id=f"s{i}", max_tokens=16)


# One outcome step: what a path may report about one dispatch, in any order, any number of times.
STEP = st.sampled_from(
    ["first", "retry", "finish", "fail", "refused", "cancel", "close", "prefill", "stale", "amend"]
)


def apply(core: RoutingCore, d: Dispatch, step: str, hooks: list) -> None:
    """`hooks`: the prefill-done hooks of `d`'s attempts so far (`prefill`: the latest one
    fires; `stale`: the first attempt's fires, perhaps late)."""
    worker = d.decision.decode.id if d.decision else "x"
    if step == "prefill":
        hooks[-1]()
    elif step == "stale":
        hooks[0]()
    elif step == "first":
        core.first_token(d)
    elif step == "retry":
        core.retry(d, worker)
    elif step == "finish":
        core.finish(d, 5)
    elif step == "fail":
        core.fail(d, worker=worker)
    elif step == "refused":
        core.fail(d, answered=True)
    elif step == "amend":  # the whole prompt turned out another length than its head's estimate
        core.amend(d, replace(d.request, prompt_tokens=d.request.prompt_tokens * 3 // 2 + 7))
    else:
        getattr(core, step)(d)  # cancel, close


@settings(max_examples=300, deadline=None)
@given(
    pools=st.sampled_from(["pd", "both", "mixed"]),
    plans=st.lists(
        st.tuples(st.integers(1, 20_000), st.lists(STEP, min_size=1, max_size=8)),
        min_size=1,
        max_size=12,
    ),
    interleave=st.randoms(use_true_random=False),
)
def test_any_outcome_sequence_returns_the_books_to_zero(
    pools: str, plans: list[tuple[int, list[str]]], interleave: object
) -> None:
    endpoints = {"pd": PREFILL + DECODE, "both": BOTH, "mixed": PREFILL + DECODE + BOTH}[pools]
    core = make_core()
    tickets = [CountingTicket() for _ in plans]
    pairs = enumerate(zip(plans, tickets, strict=True))
    dispatches = [core.open(request(i, p), t) for i, ((p, _), t) in pairs]
    steps = [(i, s) for i, (_, ss) in enumerate(plans) for s in ss]
    interleave.shuffle(steps)  # type: ignore[attr-defined]
    hooks: list[list] = []
    for d in dispatches:
        core.route(d, endpoints)
        hooks.append([core.prefill_hook(d)])
    for i, step in steps:
        d = dispatches[i]
        if d.phase == "admitted":  # after a retry: route again, as the HTTP door does
            try:
                core.route(d, endpoints)
                hooks[i].append(core.prefill_hook(d))
            except NoCandidates:  # every worker excluded: the door answers 503 and closes
                core.close(d)
        apply(core, d, step, hooks[i])
    for d in dispatches:
        core.close(d)  # what every path's `finally` does
    books_are_empty(core, endpoints)
    assert all(t.releases == 1 for t in tickets)


def open_routed(core: RoutingCore, endpoints: list[Endpoint], prompt: int = 5_000) -> Dispatch:
    d = core.open(request(0, prompt), CountingTicket())
    core.route(d, endpoints)
    return d


def test_success_binds_the_session_and_credits_service() -> None:
    core = make_core()
    d = open_routed(core, PREFILL + DECODE)
    assert d.decision is not None and d.decision.prefill is not None  # disaggregated
    assert core.loads.load(d.decision.prefill.id).prefill_tokens == 5_000
    core.first_token(d)
    assert core.loads.load(d.decision.decode.id).decode_tokens == 5_016
    binding = core.finish(d, output_tokens=10)
    assert binding is not None and binding.worker == d.decision.decode.id
    assert binding.turn_tokens == 5_010
    assert d.ticket is not None and d.ticket.service == 5_000 + 2 * 10  # type: ignore[attr-defined]
    assert core.finish(d, 10) is None  # already closed: nothing twice
    books_are_empty(core, PREFILL + DECODE)


def test_prefill_leg_answer_frees_the_prefill_worker_before_the_first_token() -> None:
    """The prefill leg answered: the prefill worker's booking ends then (the flow gate's
    prefill stage hears of it), and the decode worker takes the context at the first token.
    A hook of an attempt that was retried does nothing to the next attempt's books."""
    core = make_core()
    heard: list[int] = []
    core.on_prefill_done = lambda: heard.append(1)
    d = open_routed(core, PREFILL + DECODE)
    assert d.decision is not None and d.decision.prefill is not None
    p, dec = d.decision.prefill.id, d.decision.decode.id
    stale = core.prefill_hook(d)
    core.retry(d, dec, worker_failed=False)
    core.route(d, PREFILL + DECODE)
    assert d.decision is not None and d.decision.prefill is not None
    p = d.decision.prefill.id
    stale()
    assert core.loads.load(p).prefill_tokens == 5_000 and heard == []
    core.prefill_hook(d)()
    assert core.loads.load(p).prefill_tokens == 0 and core.loads.load(p).in_flight == 0
    assert heard == [1]
    assert core.loads.load(d.decision.decode.id).decode_tokens == 0
    core.first_token(d)
    assert core.loads.load(d.decision.decode.id).decode_tokens == 5_016
    assert core.loads.load(p).prefill_tokens == 0  # not released twice
    core.finish(d, 10)
    books_are_empty(core, PREFILL + DECODE)


def test_upstream_refusal_releases_and_does_not_trip_the_breaker() -> None:
    core = make_core()
    for _ in range(5):
        d = open_routed(core, BOTH)
        core.fail(d, answered=True)
    assert all(core.loads.healthy(e.id) for e in BOTH)
    books_are_empty(core, BOTH)


def test_upstream_failure_counts_against_the_worker() -> None:
    core = make_core()
    for _ in range(3):
        d = core.open(request(0, 10))
        core.route(d, BOTH[:1])
        core.fail(d, worker="b0")
    assert not core.loads.healthy("b0")
    books_are_empty(core, BOTH)


@pytest.mark.parametrize("end", ["cancel", "close"])
def test_client_gone_mid_stream_releases(end: str) -> None:
    core = make_core()
    d = open_routed(core, BOTH)
    core.first_token(d)
    getattr(core, end)(d)
    assert d.phase == "cancelled"
    books_are_empty(core, BOTH)


def test_retry_excludes_the_failed_worker_and_keeps_the_ticket() -> None:
    core = make_core()
    d = open_routed(core, BOTH, prompt=10)
    first = d.decision.decode.id if d.decision else ""
    core.retry(d, first)
    assert d.phase == "admitted" and d.ticket is not None and d.ticket.releases == 0  # type: ignore[attr-defined]
    second = core.route(d, BOTH)
    assert second.decode.id != first
    core.finish(d)
    books_are_empty(core, BOTH)


def test_route_twice_without_an_outcome_is_a_bug() -> None:
    core = make_core()
    d = open_routed(core, BOTH)
    with pytest.raises(RuntimeError, match="dispatched"):
        core.route(d, BOTH)
    core.close(d)


def _predicted(core: RoutingCore, worker: str, hashes: tuple[int, ...]) -> int:
    hit = core.index.match(hashes, [worker], block_size=16, sliding_window=512)[worker]
    return hit.predicted_blocks


@pytest.mark.parametrize("end", ["predict", "first", "retry", "fail", "cancel", "close"])
def test_predictions_put_off_at_routing_are_written_once_by_whatever_comes_next(
    end: str,
) -> None:
    """`route(..., predict=False)` books the load but leaves the index alone until `predict`
    (the HTTP door: once the request went out) or any later step of the lifecycle, whichever
    comes first; they are written once."""
    calls: list[tuple[str, tuple[int, ...]]] = []
    core = RoutingCore(build_policy("sticky-until-saturated"))
    core.on_predict = lambda worker, keys, _ttl: calls.append((worker, keys))
    hashes = (11, 12, 13)
    req = RouteRequest("r", prompt_tokens=48, block_hashes=hashes, session_id="s", max_tokens=4)
    d = core.open(req, CountingTicket())
    decision = core.route(d, BOTH, predict=False)
    worker = decision.decode.id
    assert core.loads.load(worker).in_flight == 1  # booked
    assert _predicted(core, worker, hashes) == 0 and calls == []
    step = {"predict": core.predict, "first": core.first_token, "cancel": core.cancel,
            "close": core.close, "retry": lambda d: core.retry(d, worker),
            "fail": lambda d: core.fail(d, worker=worker)}[end]  # fmt: skip
    step(d)
    assert _predicted(core, worker, hashes) == 3
    assert calls == [(worker, hashes)]
    core.predict(d)
    core.close(d)
    assert len(calls) == 1  # once
    books_are_empty(core, BOTH)


def test_amend_rebooks_a_prefilling_attempt_and_nothing_after() -> None:
    """A request routed on its prompt's head (an estimated length) gets its exact numbers
    booked while it prefills; after its first token, or once closed, the books stay."""
    core = make_core()
    d = open_routed(core, BOTH, prompt=5_000)
    worker = d.decision.decode.id if d.decision else ""
    assert core.loads.load(worker).prefill_tokens == 5_000
    core.amend(d, replace(d.request, prompt_tokens=8_000))
    assert d.request.prompt_tokens == 8_000
    assert core.loads.load(worker).prefill_tokens == 8_000
    core.first_token(d)
    decode = core.loads.load(worker).decode_tokens
    assert decode == 8_000 + d.request.max_tokens
    core.amend(d, replace(d.request, prompt_tokens=9_000))
    assert core.loads.load(worker).decode_tokens == decode
    core.finish(d, 3)
    core.amend(d, replace(d.request, prompt_tokens=1))
    assert d.request.prompt_tokens == 9_000  # closed: kept
    books_are_empty(core, BOTH)
