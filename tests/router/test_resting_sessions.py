"""Resting sessions: a session between turns still weighs on the worker it will come back to.

`LoadBook.rest` / `wake` (the book), the TTFT estimate's `resting_weight` term (the policy), and
`RoutingCore`'s lifecycle (a finished turn rests its session, the next turn wakes it)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from beamserve.router.core import RoutingCore
from beamserve.router.load import LoadBook, LoadParams
from beamserve.router.policy import StickyParams, StickyUntilSaturated, estimate_ttft
from beamserve.router.types import Endpoint, RouteRequest, WorkerLoad
from hypothesis import given
from hypothesis import strategies as st

from tests.router._policy_views import request, view


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def book(**params: float) -> tuple[LoadBook, Clock]:
    clock = Clock()
    return LoadBook(clock=clock, params=LoadParams(**params)), clock  # type: ignore[arg-type]


def test_a_resting_session_counts_until_its_next_turn() -> None:
    b, _ = book()
    b.rest("s1", "w0", 20_000)
    b.rest("s2", "w0", 5_000)
    assert b.load("w0").resting_tokens == 25_000
    assert b.resting_sessions("w0") == 2
    assert b.load("w1").resting_tokens == 0
    b.wake("s1")
    assert b.load("w0").resting_tokens == 5_000
    b.wake("s1")  # waking twice, or a session never seen, changes nothing
    b.wake("never")
    b.wake(None)
    assert b.load("w0").resting_tokens == 5_000


def test_a_session_rests_only_where_its_last_turn_ended() -> None:
    b, _ = book()
    b.rest("s", "w0", 1_000)
    b.rest("s", "w1", 3_000)  # moved (rebalanced) and finished there
    assert (b.load("w0").resting_tokens, b.load("w1").resting_tokens) == (0, 3_000)


def test_the_rest_window_follows_the_observed_gaps() -> None:
    b, clock = book(rest_gap_factor=3.0, rest_min_s=1.0, rest_max_s=120.0, rest_initial_s=30.0)
    assert b.rest_window_s == 30.0  # nothing seen yet
    for _ in range(200):  # sessions come back 2 s after their turn ends
        b.rest("s", "w0", 100)
        clock.t += 2.0
        b.wake("s")
    assert abs(b.rest_window_s - 6.0) < 1e-6
    b.rest("gone", "w0", 7_000)  # a session that ended for good
    clock.t += 5.9
    assert b.load("w0").resting_tokens == 7_000
    clock.t += 0.2
    assert b.resting_sessions("w0") == 0  # the gauge's read expires it too, not only `load`
    assert b.load("w0").resting_tokens == 0


def test_the_rest_window_is_clamped() -> None:
    b, clock = book(rest_gap_factor=3.0, rest_min_s=1.0, rest_max_s=10.0)
    b.rest("s", "w0", 1)
    clock.t += 1000.0
    b.wake("s")
    assert b.rest_window_s == 10.0
    b2, _ = book(rest_gap_factor=3.0, rest_min_s=1.0, rest_max_s=10.0)
    b2.rest("s", "w0", 1)
    b2.wake("s")  # no gap at all
    assert b2.rest_window_s == 1.0


def test_forgetting_a_worker_forgets_its_resting_sessions() -> None:
    b, _ = book()
    b.rest("s1", "w0", 10)
    b.rest("s2", "w1", 20)
    b.forget(["w1"])
    assert b.load("w0").resting_tokens == 0
    b.wake("s1")  # its worker is gone: nothing to undo
    assert b.load("w1").resting_tokens == 20


ops = st.lists(
    st.tuples(
        st.sampled_from(["rest", "wake", "tick"]),
        st.sampled_from(["s0", "s1", "s2", "s3"]),
        st.sampled_from(["w0", "w1", "w2"]),
        st.integers(min_value=0, max_value=50_000),
        st.floats(min_value=0.0, max_value=5.0),
    ),
    max_size=60,
)


@given(ops)
def test_resting_tokens_are_the_sessions_resting_within_the_window(
    steps: list[tuple[str, str, str, int, float]],
) -> None:
    """Against a plain model: every session's latest rest, unless woken or older than the
    window (the window as the book states it at each step; it only changes on a wake)."""
    b, clock = book(rest_gap_factor=2.0, rest_min_s=1.0, rest_max_s=8.0, rest_initial_s=4.0)
    model: dict[str, tuple[str, float, int]] = {}
    for op, session, worker, tokens, dt in steps:
        if op == "rest":
            b.rest(session, worker, tokens)
            model[session] = (worker, clock.t, tokens)
        elif op == "wake":
            b.wake(session)
            model.pop(session, None)
        else:
            clock.t += dt
        horizon = clock.t - b.rest_window_s
        for s in [s for s, e in model.items() if e[1] <= horizon]:
            del model[s]
        for w in ("w0", "w1", "w2"):
            want = [e for e in model.values() if e[0] == w]
            assert b.load(w).resting_tokens == sum(e[2] for e in want)
            assert b.resting_sessions(w) == len(want)
            assert b.load(w).resting == len(want)


PARAMS = StickyParams(
    prefill_tok_s=10_000.0, decode_interference=0.002, tie_window_s=0.0, resting_weight=1.0
)


def test_the_estimate_prices_resting_context_like_decode_context() -> None:
    idle = view("a")
    resting = replace(idle, load=WorkerLoad(resting_tokens=20_000))
    decoding = replace(idle, load=WorkerLoad(decode_tokens=20_000))
    r = request(4_096)
    base = estimate_ttft(idle, r, PARAMS).seconds
    rest = estimate_ttft(resting, r, PARAMS)
    assert rest.seconds == estimate_ttft(decoding, r, PARAMS).seconds > base
    assert rest.resting_tokens == 20_000
    off = PARAMS.model_copy(update={"resting_weight": 0.0})
    assert estimate_ttft(resting, r, off).seconds == base


def test_a_new_session_avoids_the_worker_whose_sessions_are_thinking() -> None:
    # Both idle (nothing queued, nothing decoding); "a" has a session resting between turns.
    a = replace(view("a"), load=WorkerLoad(resting_tokens=20_000))
    b = view("b")
    policy = StickyUntilSaturated(params=PARAMS)
    for sid in (f"new-{i}" for i in range(20)):  # whatever the tie-break hash would say
        d = policy.route(replace(request(8_192), session_id=sid), [a, b])
        assert d.decode.id == "b"
    assert "resting=20000" in policy.route(request(8_192), [a, b]).explain


def test_resting_counts_for_nothing_by_default() -> None:
    a = replace(view("a"), load=WorkerLoad(resting_tokens=20_000))
    r = request(4_096)
    assert StickyParams().resting_weight == 0.0
    assert (
        estimate_ttft(a, r, StickyParams()).seconds
        == estimate_ttft(view("a"), r, StickyParams()).seconds
    )


def test_resting_does_not_move_a_warm_session() -> None:
    # The warm worker has other sessions resting; a cold idle one is far less than the margin
    # better: the session stays.
    warm = replace(
        view("a", blocks=128, window_ok=True, warm=True),
        load=WorkerLoad(resting_tokens=200_000),
    )
    d = StickyUntilSaturated(params=PARAMS).route(request(8_192), [warm, view("b")])
    assert (d.decode.id, d.reason) == ("a", "sticky")


def test_ties_go_to_the_worker_with_the_fewest_resting_sessions() -> None:
    # Default parameters: resting context is not priced, so the three idle workers' estimates
    # are equal; the tie goes to those with the fewest sessions resting, then by the hash.
    def resting(wid: str, n: int, **kw: int) -> object:
        v = view(wid, **kw)
        return replace(v, load=replace(v.load, resting=n, resting_tokens=10_000 * n))

    views = [resting("a", 2), resting("b", 1), resting("c", 1), resting("d", 0, prefill=4_000)]
    on = StickyUntilSaturated(params=StickyParams(prefill_tok_s=10_000.0))
    off = StickyUntilSaturated(params=StickyParams(prefill_tok_s=10_000.0, tie_by_resting=False))
    assert StickyParams().tie_by_resting

    def picks(policy: StickyUntilSaturated, vs: list) -> set[str]:  # type: ignore[type-arg]
        return {
            policy.route(replace(request(8_192), session_id=f"new-{i}"), vs).decode.id
            for i in range(40)
        }

    assert picks(on, views) == {"b", "c"}  # both: the hash still spreads equals
    assert picks(off, views) == {"a", "b", "c"}  # the hash alone

    # none resting on either: the one whose last turn ended longest ago (a session just past
    # the rest window may be back); never used counts as longest
    def quiet(wid: str, since: float) -> object:
        v = view(wid)
        return replace(v, load=replace(v.load, since_rest_s=since))

    assert picks(on, [quiet("a", 1.2), quiet("b", 9.0), quiet("c", 3.0)]) == {"b"}
    assert picks(on, [quiet("a", 1.2), view("b"), view("c")]) == {"b", "c"}
    assert picks(off, [quiet("a", 1.2), quiet("b", 9.0), quiet("c", 3.0)]) == {"a", "b", "c"}
    # where sessions rest, how long ago does not choose (a thinking session and one that
    # has just ended look alike): the hash does
    b1, c1 = (replace(v, load=replace(v.load, since_rest_s=t)) for v, t in
              ((resting("b", 1), 0.1), (resting("c", 1), 2.0)))  # fmt: skip
    assert picks(on, [resting("a", 2), b1, c1]) == {"b", "c"}
    # the count only breaks ties: a cheaper worker wins whatever rests on it
    assert picks(on, [resting("a", 3), resting("b", 0, prefill=500)]) == {"a"}
    # and a warm session's move goes to the fewest-resting of its tied alternatives
    warm = replace(view("w", warm=True, blocks=128, prefill=60_000))
    moved = {
        on.route(replace(request(8_192), session_id=f"s-{i}"), [warm, *views[:3]]).decode.id
        for i in range(20)
    }
    assert moved == {"b", "c"}


def core_with_turns(
    policy: StickyUntilSaturated,
) -> tuple[RoutingCore, Clock, Callable[[str], str]]:
    """A routing core over two workers on a test clock, and `turn(sid)`: one whole turn of
    session `sid` (routed, first token, finished), returning the worker it went to."""
    clock = Clock()
    core = RoutingCore(policy, clock=clock)
    eps = endpoints()

    def turn(sid: str) -> str:
        d = core.open(RouteRequest(request_id=f"{sid}-r", prompt_tokens=4_000, session_id=sid))
        decision = core.route(d, eps, None)
        core.first_token(d)
        core.finish(d, output_tokens=64)
        return decision.decode.id

    return core, clock, turn


def test_the_core_places_a_new_session_beside_fewer_resting_ones() -> None:
    # The default policy over the core's own book: a worker whose session is between turns
    # is not where a new session goes while another worker has none.
    core, clock, turn = core_with_turns(StickyUntilSaturated())
    eps = endpoints()
    first = turn("s1")
    assert core.loads.load(first).resting == 1
    for i in range(10):
        sid = f"s2-{i}"
        assert turn(sid) != first
        core.loads.wake(sid)
    # s1 rested past the window: nothing rests anywhere, and the worker quiet the longest wins
    clock.t += core.loads.rest_window_s + 0.1
    assert core.loads.load(first).resting == 0
    assert core.loads.load(first).since_rest_s > core.loads.rest_window_s
    for i in range(10):
        sid = f"s3-{i}"
        assert turn(sid) == first  # the other one's last turn ended just now
        core.loads.wake(sid)
        clock.t += core.loads.rest_window_s + 0.1
        first = next(e.id for e in eps if e.id != first)  # and now this one's has


def test_sessions_live_beside_where_they_rest_or_stream_not_where_they_prefill() -> None:
    # `LoadBook.lives_beside`, what the first-turn pieces ask: a request still in its prefill
    # does not count (it waits in the engine's order anyway); one streaming does, and so does
    # a session resting between turns, until the rest window passes.
    b, clock = book(rest_initial_s=1.0)
    assert b.lives_beside("w0") == 0  # never seen
    f = b.start("w0", 8_000, 8_064)
    assert b.lives_beside("w0") == 0  # prefilling
    b.first_token(f)
    assert b.lives_beside("w0") == 1  # streaming
    b.finish(f)
    assert b.lives_beside("w0") == 0
    b.rest("s1", "w0", 8_064)
    assert b.lives_beside("w0") == 1 and b.lives_beside("w1") == 0
    g = b.start("w0", 100, 8_200)
    b.first_token(g)
    assert b.lives_beside("w0") == 2  # one resting, one streaming
    b.finish(g)
    clock.t += 1.5  # past the window
    assert b.lives_beside("w0") == 0


def test_the_decodes_beside_a_prefill_are_those_living_there_or_seen_running() -> None:
    # `LoadBook.decodes_beside`, what sizes a first turn's piece: the sessions streaming or
    # resting there, and at least what the worker's last scrape saw running (another router's
    # requests, say), the resting sessions on top.
    b, _ = book(rest_initial_s=1.0)
    assert b.decodes_beside("w0") == 0
    f = b.start("w0", 8_000, 8_064)
    assert b.decodes_beside("w0") == 0  # still in its prefill
    b.first_token(f)
    b.rest("s1", "w0", 8_064)
    assert b.decodes_beside("w0") == 2
    b.scraped("w0", {"vllm:num_requests_running": 5.0, "vllm:num_requests_waiting": 0.0})
    assert b.decodes_beside("w0") == 6  # five running as scraped, and one resting
    assert b.decodes_beside("w1") == 0


def endpoints() -> list[Endpoint]:
    return [Endpoint(id=w, url=f"http://{w}:8000", role="both") for w in ("w0", "w1")]


def test_the_core_rests_a_finished_turn_and_wakes_the_next() -> None:
    core, _, turn = core_with_turns(StickyUntilSaturated(params=PARAMS))
    eps = endpoints()
    first = turn("s1")
    assert core.loads.load(first).resting_tokens == 4_064
    # a second session goes to the other worker, whatever its id hashes to
    for i in range(10):
        sid = f"s2-{i}"
        other = turn(sid)
        assert other != first
        core.loads.wake(sid)  # it leaves for good: only s1 rests
    # s1's next turn wakes it: while it is in flight it is not resting anywhere
    d = core.open(RouteRequest(request_id="s1-r2", prompt_tokens=4_100, session_id="s1"))
    assert core.loads.load(first).resting_tokens == 0
    core.route(d, eps, first)
    core.fail(d)  # a failed turn leaves nothing resting
    assert core.loads.load(first).resting_tokens == 0
    assert core.loads.load(first).in_flight == 0
