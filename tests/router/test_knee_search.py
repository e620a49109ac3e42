"""`scripts/knee-search.py`: the bench's closed loop on virtual time in front of sim engines —
every request served once, the workload's cache hits reached by every sticky strategy, and the
strategies doing what they say (held first turns go shortest first, P/D prefills on the
prefill workers, the ceiling row frees the workers of first turns' prefill)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "knee-search.py"


def _load():
    spec = importlib.util.spec_from_file_location("knee_search", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


ks = _load()


@pytest.fixture(scope="module")
def sessions():
    from beamserve.router.bench.agentic_workload import default_trace_dir, load_sessions

    return load_sessions(
        default_trace_dir(), sessions=12, max_turns=4, think_scale=0.02, max_think_s=2.0
    )


def _run(sessions, name: str, concurrency: int = 6, seed: int = 0):
    loop = ks.Loop(sessions, ks.strategies(4)[name](), concurrency=concurrency, seed=seed)
    return loop, loop.run()


@given(
    ids=st.lists(st.integers(0, 10**6), min_size=0, max_size=40),
    cut=st.integers(0, 40),
    per_page=st.sampled_from([1, 2, 4]),
)
@settings(max_examples=60, deadline=None)
def test_page_hashes_of_a_prefix_are_a_prefix(ids: list[int], cut: int, per_page: int) -> None:
    full = ks.page_hashes("s", ids, per_page)
    assert ks.page_hashes("s", ids[:cut], per_page) == full[: min(cut, len(ids)) // per_page]
    assert len(full) == len(ids) // per_page
    if full:
        assert ks.page_hashes("other", ids, per_page)[0] != full[0]  # sessions never share


@pytest.mark.parametrize(
    "name",
    ["least-queued", "round-robin", "pace-hold-1", "gate-lifo-32k", "prime-4k", "least-inflight",
     "harm-1-r0.5", "split-idle-8k-m1"],
)  # fmt: skip
def test_every_request_is_served_once_at_the_workload_s_hit_ratio(sessions, name: str) -> None:
    _, recs = _run(sessions, name)
    assert len(recs) == sum(s.requests for s in sessions)
    assert all(r.first is not None and r.end is not None and r.end >= r.first for r in recs)
    assert all(r.ntok == r.out for r in recs)
    summary = ks.summarize(recs)
    # every turn after the first finds its session's previous prompt on its worker
    later = [r for r in recs if r.turn > 0]
    assert sum(r.cached for r in later) > 0.8 * sum(r.prompt for r in later)
    assert summary["goodput_rps"] > 0 and summary["requests"] == len(recs)


def test_disaggregated_first_turns_are_prefilled_on_the_prefill_workers(sessions) -> None:
    loop, recs = _run(sessions, "pd-2p2d")
    stats = {w: e.stats() for w, e in loop.engines.items()}
    prefill_work = {
        w: st.prompt_tokens_total - st.prefix_cache_hits_tokens for w, st in stats.items()
    }
    first = sum(r.prompt for r in recs if r.turn == 0)
    assert prefill_work["w0"] + prefill_work["w1"] >= first  # every first prompt went there
    assert {r.worker for r in recs} <= {"w2", "w3"}  # and every answer came from a decode one


def test_held_first_turns_go_shortest_first(sessions) -> None:
    _, recs = _run(sessions, "pd-2p2d-sjf-0k", concurrency=12)
    first = sorted((r for r in recs if r.turn == 0), key=lambda r: r.dispatched or 0)
    # the sessions all start at once; the ones held go out smallest first
    held = [r for r in first if (r.dispatched or 0) > r.sent]
    assert len(held) >= 6
    assert [r.prompt for r in held] == sorted(r.prompt for r in held)


def test_split_idle_prefills_first_turns_away_from_home_only_past_its_margin(sessions) -> None:
    """With no margin to meet it is least-sessions exactly; with one, some first turns are
    prefilled on a worker that is not their session's, and every answer still comes from home."""
    _, plain = _run(sessions, "least-sessions", concurrency=12)
    never = ks.Loop(sessions, ks.SplitIdle(8192, margin=10**6), concurrency=12)
    same = never.run()
    assert [(r.worker, r.first, r.end) for r in same] == [(r.worker, r.first, r.end) for r in plain]
    loop = ks.Loop(sessions, ks.SplitIdle(1024, margin=0.5), concurrency=12)
    recs = loop.run()
    computed = {w: e.stats().prompt_tokens_total - e.stats().prefix_cache_hits_tokens
                for w, e in loop.engines.items()}  # fmt: skip
    homed = {w: sum(r.prompt - r.cached for r in recs if r.worker == w) for w in loop.engines}
    assert computed != homed  # some prefill ran where its session does not live
    assert len(recs) == sum(s.requests for s in sessions)
    homes: dict[str, set[str]] = {}
    for r in recs:
        homes.setdefault(r.session, set()).add(r.worker)
    assert all(len(ws) == 1 for ws in homes.values())  # every answer from the session's home


def test_the_ceiling_row_beats_the_least_queued_baseline(sessions) -> None:
    base = ks.summarize(_run(sessions, "least-queued", concurrency=12)[1])
    ceiling = ks.summarize(_run(sessions, "ceiling-first-turns-elsewhere", concurrency=12)[1])
    assert ceiling["goodput_rps"] > base["goodput_rps"]
    assert ceiling["first"]["late"] <= base["first"]["late"]


def test_seeds_jitter_think_times_and_seed_zero_replays_the_trace(sessions) -> None:
    a = ks.summarize(_run(sessions, "least-queued", seed=0)[1])
    b = ks.summarize(_run(sessions, "least-queued", seed=0)[1])
    c = ks.summarize(_run(sessions, "least-queued", seed=1)[1])
    assert a == b
    assert c["run_s"] != a["run_s"]


def test_unknown_strategy_is_refused_with_the_valid_ones(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        ks.main(["--sessions", "2", "--strategies", "nope", "--seeds", "1"])
    assert "nope" in str(exc.value) and "least-queued" in str(exc.value)


@pytest.mark.parametrize(
    "name",
    [
        "pd-2p2d-legbooks-32k-local-8k",
        "pd-2p2d-legbooks-split-continuing-8k",
        "pd-2p2d-legbooks-cont-sticky-256",
    ],
)
def test_leg_books_serve_everything_and_return_to_zero(sessions, name: str) -> None:
    """The HTTP router's pool on virtual time: every request served once, every prefill leg's
    booking released when it answered, and the rows that split later turns send that work to
    the prefill workers (more prefill there than in the pool that keeps it local)."""
    loop, recs = _run(sessions, name, concurrency=12)
    assert len(recs) == sum(s.requests for s in sessions)
    assert all(r.end is not None for r in recs)
    assert all(not legs for legs in loop.strategy.legs.values())
    twin, _ = _run(sessions, "pd-2p2d-legbooks-32k-local-8k", concurrency=12)

    def prefill_work(lp) -> int:
        stats = [lp.engines[w].stats() for w in ("w0", "w1")]
        return sum(s.prompt_tokens_total - s.prefix_cache_hits_tokens for s in stats)

    if name == "pd-2p2d-legbooks-32k-local-8k":
        assert {r.worker for r in recs} <= {"w2", "w3"}
    else:
        assert prefill_work(loop) > prefill_work(twin)


@pytest.mark.parametrize("name", ["attribution-free-continuing", "attribution-free-small-first"])
def test_attribution_rows_take_their_prefills_off_the_decode_workers(sessions, name: str) -> None:
    """Freeing the decode workers of a kind of their own prefills makes the same run end
    sooner (seed 0 replays the trace: the comparison is deterministic)."""
    base = ks.summarize(_run(sessions, "pd-2p2d-legbooks-32k-local-8k", concurrency=12)[1])
    freed = ks.summarize(_run(sessions, name, concurrency=12)[1])
    assert freed["requests"] == base["requests"]
    assert freed["run_s"] < base["run_s"]


class _Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def now(self) -> float:
        return self.t


class _Pool:
    """What `Disaggregated.place` reads of the loop (a stand-in below the part under test):
    the session's decode worker `w2`, whose one decoding user has `slack` seconds to spare."""

    def __init__(self, now: float, slack: float) -> None:
        self.clock = _Clock(now)
        self.home = {"s": "w2"}
        self.s_per_prefill_token = 1e-4
        self.slack = slack

    def queued(self, worker: str) -> int:
        return 0

    def slacks(self, worker: str, now: float) -> list[float]:
        return [self.slack]


@pytest.mark.parametrize(
    ("new", "now", "slack", "placed"),
    [
        (2048, 0.1, 0.05, False),  # 0.2 s of prefill would push the user under pace: wait
        (2048, 1.6, 0.05, True),  # waited the 1.5 s it may: goes
        (2048, 1.4, 0.05, True),  # its own 0.2 s prefill would end past 1.5 s: goes
        (2048, 0.1, 0.5, True),  # the user can spare it
        (512, 0.1, 0.05, True),  # under 1,024 new tokens: never held
    ],
)
def test_pace_hold_keeps_a_long_later_turn_back_while_it_would_slow_a_user(
    new: int, now: float, slack: float, placed: bool
) -> None:
    strat = ks.strategies(4)["pd-2p2d-legbooks-cont-pace-hold-1024-1.5"]()
    strat.last["s"] = 10_000
    rec = ks.Rec("s", 1, 10_000 + new, 16, 0.0, None)
    assert (strat.place(_Pool(now, slack), rec) == "w2") is placed


def test_the_window_row_serves_late_first_turns_oldest_first_after_the_others() -> None:
    """`pd-2p2d-legbooks-window-2` (the router's `prefill_sjf_window_s`): held first turns that
    waited under 2 s go shortest first, the others after them oldest first; later turns ahead
    of all. Without the window (`…-cont-pace-hold-…`) all first turns go shortest first."""
    recs = [
        ks.Rec("a", 0, 40_000, 16, 7.0, None),
        ks.Rec("b", 0, 5_000, 16, 7.5, None),
        ks.Rec("c", 0, 30_000, 16, 9.5, None),
        ks.Rec("d", 0, 20_000, 16, 9.0, None),
        ks.Rec("e", 2, 3_000, 16, 9.9, None),
    ]
    window = ks.strategies(4)["pd-2p2d-legbooks-window-2"]()
    window.now = lambda: 10.0
    assert [r.session for r in window.order(recs)] == ["e", "d", "c", "a", "b"]
    plain = ks.strategies(4)["pd-2p2d-legbooks-cont-pace-hold-1024-1.5"]()
    assert [r.session for r in plain.order(recs)] == ["e", "b", "d", "c", "a"]


class _Decoders(_Pool):
    """Two prefill workers with a long queue, and the decode workers `w2`/`w3`: `queued[w]`
    tokens waiting there, each with one decoding user of `slack` seconds to spare."""

    def __init__(self, now: float, slack: float, queued: dict[str, int]) -> None:
        super().__init__(now, slack)
        self.home = {}
        self.q = {"w0": 60_000, "w1": 60_000, **queued}
        self.inflight: dict[str, list[Any]] = {w: [] for w in ("w0", "w1", "w2", "w3")}

    def queued(self, worker: str) -> int:
        return self.q[worker]


@pytest.mark.parametrize(
    ("now", "slack", "queued", "placed"),
    [
        (0.5, 9.0, {"w2": 0, "w3": 0}, None),  # waited under 1 s: held
        (1.2, 9.0, {"w2": 5_000, "w3": 0}, "w3"),  # the roomiest decode worker
        (1.2, 9.0, {"w2": 30_000, "w3": 30_000}, None),  # 30K + 30K over the 48K bound
        (1.2, 3.6, {"w2": 0, "w3": 0}, "w2"),  # 30K × 1e-4 = 3 s of prefill + 0.5 s ≤ 3.6 s
        (1.2, 3.4, {"w2": 0, "w3": 0}, None),  # … > 3.4 s: the user would fall behind
    ],
)
def test_the_spill_row_sends_a_held_first_turn_to_a_decode_worker_with_room(
    now: float, slack: float, queued: dict[str, int], placed: str | None
) -> None:
    """`pd-2p2d-spill` (the router's `flow.prefill_spill_after_s`): a first turn held 1 s at
    a busy prefill stage goes to a decode worker whose queue stays within 48K tokens with
    it and whose users keep 0.5 s of slack beyond its prefill; it is then prefilled there."""
    strat = ks.strategies(4)["pd-2p2d-spill"]()
    rec = ks.Rec("s", 0, 30_000, 16, 0.0, None)
    pool = _Decoders(now, slack, queued)
    pool.legs = {}
    strat.legs = {"w0": {1: 60_000}, "w1": {1: 60_000}}  # both prefill workers' legs booked
    assert strat.place(pool, rec) == placed
    assert (id(rec) in strat.spilled) is (placed is not None)


def test_the_pieces_row_prefills_long_later_turns_a_piece_at_a_time(sessions) -> None:
    """`pd-2p2d-pieces-1k-4k` (the router's `flow.prefill_piece_*`): every request is served
    once; the decode workers answer one extra request per piece, and each piece's prefix is
    cached for the next (their prefill is the turn's new part once, not again per piece)."""
    loop, recs = _run(sessions, "pd-2p2d-pieces-1k-4k", concurrency=12)
    twin, _ = _run(sessions, "pd-2p2d-legbooks-window-2", concurrency=12)
    assert len(recs) == sum(s.requests for s in sessions)
    assert all(r.end is not None for r in recs) and not any(loop.inflight.values())

    def decode_side(lp) -> tuple[int, int]:
        stats = [lp.engines[w].stats() for w in ("w2", "w3")]
        work = sum(s.prompt_tokens_total - s.prefix_cache_hits_tokens for s in stats)
        return sum(s.requests_finished_total for s in stats), work

    (n, work), (n0, work0) = decode_side(loop), decode_side(twin)
    assert n > n0  # the pieces
    assert work <= work0 * 1.05  # … cost no prefill twice


class _SpeedDecoders(_Decoders):
    """`_Decoders` whose one user per decode worker has `slack` seconds to spare at the SLO's
    speed and `slow_slack` at any slower speed asked for."""

    def __init__(self, now: float, slack: float, slow_slack: float) -> None:
        super().__init__(now, slack, {"w2": 0, "w3": 0})
        self.slow_slack = slow_slack

    def slacks(self, worker: str, now: float, tok_s: float = ks.SLO_TOK_S) -> list[float]:
        return [self.slack if tok_s >= ks.SLO_TOK_S else self.slow_slack]


@pytest.mark.parametrize(
    ("name", "slack", "slow_slack", "placed"),
    [
        # one loose decode worker (w3) whose users the spill does not protect: it takes a held
        # first turn that would push the other's user under the SLO's speed
        ("pd-2p2d-pieces-spill-loose1-32k-0-cap0", 0.1, 0.1, "w3"),
        ("pd-2p2d-pieces-spill-loose1-32k-0-cap0", 9.0, 9.0, "w2"),  # both roomy: least-queued
        # every decode worker loose at 15 tokens/s: room at that speed is enough …
        ("pd-2p2d-pieces-spill-all-96k-15", 0.1, 9.0, "w2"),
        # … and its want is not
        ("pd-2p2d-pieces-spill-all-96k-15", 9.0, 0.1, None),
    ],
)
def test_loose_decode_workers_take_spills_by_their_own_speed(
    name: str, slack: float, slow_slack: float, placed: str | None
) -> None:
    strat = ks.strategies(4)[name]()
    rec = ks.Rec("s", 0, 20_000, 16, 0.0, None)
    pool = _SpeedDecoders(1.0, slack, slow_slack)
    strat.legs = {"w0": {1: 60_000}, "w1": {1: 60_000}}  # both prefill workers' legs booked
    assert strat.place(pool, rec) == placed


def test_records_are_the_http_bench_s_request_lines(tmp_path: Path) -> None:
    """`--records DIR`: each strategy's seed-0 run as the HTTP bench's `requests.jsonl`, one
    line per request; `--engine-stats`: each engine's totals in the JSON rows."""
    out = tmp_path / "rows.json"
    ks.main(["--sessions", "6", "--max-turns", "3", "--concurrency", "6", "--seeds", "1",
             "--strategies", "least-queued,pd-2p2d-spill", "--records", str(tmp_path),
             "--engine-stats", "--json", str(out)])  # fmt: skip
    import json

    rows = json.loads(out.read_text())["rows"]
    for row in rows:
        lines = (tmp_path / f"{row['strategy']}-c6" / "requests.jsonl").read_text().splitlines()
        recs = [json.loads(x) for x in lines]
        assert len(recs) == row["runs"][0]["requests"]
        assert all(r["end_s"] >= r["sent_s"] + r["ttft_s"] for r in recs)
        engines = row["runs"][0]["engines"]
        assert set(engines) == {"w0", "w1", "w2", "w3"}
        assert sum(e["prompt_tokens"] for e in engines.values()) >= sum(
            r["prompt_tokens"] for r in recs
        )


def test_own_pace_reckons_a_user_s_slack_at_its_pace_so_far(sessions) -> None:
    """`--own-pace`: a user that streamed 11 tokens in its first second is reckoned at 0.1 s a
    token (as the HTTP router's pace hold does), not at an idle worker's decode step, so it has
    no slack left; the default reckoning leaves it some."""
    rec = ks.Rec("u", 0, 1_000, 50, 0.0, None, first=0.0, ntok=11)
    for own, positive in ((False, True), (True, False)):
        loop = ks.Loop(sessions, ks.LeastQueued(), concurrency=1, own_pace=own)
        loop.inflight["w0"] = [rec]
        (slack,) = loop.slacks("w0", 1.0)
        assert (slack > 0) is positive
        if own:
            assert slack == pytest.approx(50 / ks.SLO_TOK_S - 1.0 - 39 * 0.1)


def test_a_piece_s_round_trip_lengthens_the_pieced_turns(sessions) -> None:
    """`--piece-rtt-ms`: each piece reaches its engine that long after the one before was
    answered, so the turns prefilled in pieces take longer to their first token; every
    request is still served once."""

    def run(rtt: float) -> list[Any]:
        strat = ks.strategies(4)["pd-2p2d-pieces-1k-4k"]()
        loop = ks.Loop(sessions, strat, concurrency=12, piece_rtt_s=rtt)
        return loop.run()

    plain, slow = run(0.0), run(0.05)
    assert len(slow) == len(plain) == sum(s.requests for s in sessions)
    assert sum(r.ttft for r in slow) > sum(r.ttft for r in plain)


@pytest.mark.parametrize(
    ("live", "spilling_before", "placed"),
    [
        (95, False, None),  # under 24 live sessions a worker: not yet
        (96, False, "w2"),  # from 24 a worker on
        (50, True, "w2"),  # once on, until under 12 a worker
        (47, True, None),
    ],
)
def test_the_spill_line_counts_every_live_session(
    live: int, spilling_before: bool, placed: str | None
) -> None:
    """`…-line-24`: the spill acts from 24 live sessions a worker (the held first turns too, as
    the router's `LoadBook.active_sessions` counts them) until under 12."""
    strat = ks.strategies(4)["pd-2p2d-pieces-spill-0.3-96k-0.0-p1024-price-100k-line-24"]()
    strat.spilling = spilling_before
    pool = _SpeedDecoders(1.0, 9.0, 9.0)
    pool.engines = {w: None for w in ("w0", "w1", "w2", "w3")}
    pool.live = {f"s{i}" for i in range(live)}
    strat.legs = {"w0": {1: 60_000}, "w1": {1: 60_000}}
    rec = ks.Rec("s", 0, 20_000, 16, 0.0, None)
    assert strat.place(pool, rec) == placed
