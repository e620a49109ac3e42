"""Per-worker load and health as the router sees it (`LoadBook`).

Router-tracked load (the replica's *own book*): for every request it sends, the router adds the
request's uncached prompt tokens to the worker's *prefill* tokens until the first token arrives,
then moves its context (prompt + max output) to *decode* tokens until the request ends. These
counts are exact for this router replica and never stale — but behind a plain L4 load balancer
with N replicas each replica sends only its share, so its book alone undercounts by about N.

Scraped load: `queue_len` (waiting requests), `running`, `kv_usage` and, where the engine
exports it, queued prefill tokens, from the engine's `/metrics` (vLLM or SGLang names, plus
`beamserve_worker_queued_prefill_tokens` of the sim engine: neither vLLM nor SGLang exports
such a gauge), stamped with the scrape time. The scrape sees every replica's requests, but lags.

Effective load (`effective_load`, pure): the scrape tells what the engine held at the scrape
instant; the replica's book at that same instant (`own₀`, recorded with the scrape) tells which
part of it was its own; the rest is *foreign* (other replicas'). The replica's book now (`own`)
replaces its own part, so its bookings since the scrape add on top of the scrape, once::

    fresh      = scraped and 0 ≤ age ≤ stale_after_s          (a stale scrape counts for nothing)
    n₀         = own₀.prefilling + own₀.decoding              (own requests at the scrape)
    foreign_n  = max(W + R − n₀, 0)                           (engine's requests not sent by us)
    foreign_w  = min(max(W − own₀.prefilling, 0), foreign_n)  (… of them waiting)
    foreign_p  = max(Q − own₀.prefill_tokens, 0)              when the engine exports Q
               = foreign_w · prefill_per_request              otherwise
    foreign_d  = (foreign_n − foreign_w) · context_per_request
    prefill    = own.prefill_tokens + (foreign_p if fresh else 0)
    decode     = own.decode_tokens  + (foreign_d if fresh else 0)
    queue_len  = max(W + own.prefilling − own₀.prefilling, 0)  if fresh, else W as scraped
    running    = max(R + own.decoding − own₀.decoding, 0)      if fresh, else R as scraped

W, R, Q: the scrape's waiting requests, running requests and queued prefill tokens.

Between scrapes the foreign part is extrapolated from this replica's own changes since the
scrape (the *herd* term): every replica routes the same traffic mix with the same policy on the
same (stale) view, so while this one books x more tokens onto a worker, the other ``k − 1``
replicas most likely book about ``(k − 1)·x`` onto it too — and when its own requests there
finish, theirs do as well. ``k`` is the replica count as the scrapes show it (`replicas`)::

    Δp, Δd     = own.prefill_tokens − own₀.prefill_tokens,  own.decode_tokens − own₀.decode_tokens
    Δw, Δr     = own.prefilling − own₀.prefilling,           own.decoding − own₀.decoding
    foreign_p ← max(foreign_p + (k − 1)·Δp, 0);   foreign_d ← max(foreign_d + (k − 1)·Δd, 0)
    queue_len  = max(W + k·Δw, 0);                running    = max(R + k·Δr, 0)

    k (`LoadBook.replicas`) = Σ_w (W + R) / Σ_w n₀ over every worker's latest scrape, when
                              Σ_w n₀ ≥ `replicas_min_requests`, clamped to [1, `replicas_max`],
                              smoothed (EWMA, weight `replicas_weight` per scrape); 1 before.

Without the term a burst of bookings by N replicas onto the worker that looks best (every
replica sees the same prefix index and the same scrape) stays invisible to each of them until
the next scrape, and a burst of completions leaves the other replicas' part looking high until
then (which holds the saturation gate closed for no reason). With one replica ``k`` stays at 1
(the engine's requests are all its own) and nothing changes.

Off by default (`LoadParams.extrapolate`), as measured (`beamserve bench route
--router-replicas 4`, docs/bench/route.md): on the Mooncake trace's first 3,000 lines it moved
max/mean load from 1.38 to 1.33 (the goal is 1.15), and on claude-code at load 128 it made TTFT
p90 worse (2.12 s against 1.41 s; one replica 0.81 s). Sticky traffic does not herd: the other
replicas book onto *their* sessions' workers, so multiplying this replica's changes on one
worker by ``k − 1`` mostly multiplies noise — one cold 25K-token booking looks like 100K — and
the saturation gate reads it.
``prefill_per_request`` / ``context_per_request``: the replica's own running means (EWMA,
weight `LoadParams.mean_weight`) of a booking's uncached prompt tokens and context; other
replicas' requests come from the same balancer-spread traffic, so they look alike on average.

Other replicas' books (replica sync, `beamserve.router.sync`). With sync on, every replica
publishes its own book per worker and keeps its peers' latest books (`peers`; a peer unheard
for `peer_stale_after_s` counts for nothing). They are *known* load — exact, only a flush
interval plus delivery (milliseconds) old — so they join the own book in the formulas above::

    own  ← own + peers        (now)
    own₀ ← own₀ + peers₀      (the peers' books at the scrape, recorded with it)

and the scrape's foreign residual (``Q − own₀.prefill_tokens``, …) is only load no replica
reported (a replica without sync). `WorkerLoad.prefill_tokens` / `decode_tokens` / `in_flight`
stay this replica's own; ``foreign_* = peers + residual``. No peers (sync off, Redis down, one
replica): nothing changes. Bias: a peer booking that reached the engine before its message
reached this replica is in the scrape's residual and, once the message is in, in ``peers`` as
well — counted twice until the next scrape (only bookings of the last few milliseconds before
a scrape). With sync the replica count ``k`` of the herd term tends to 1 (``n₀`` includes the
peers), so the herd term extrapolates only unreported load.

Properties (tested with hypothesis): with a stale or missing scrape the result is the own book
(the behaviour before replicas were considered); it is never below the own book; each own
booking after the scrape adds exactly its tokens (nothing double counted: the scrape's own part
is replaced, not added; nothing lost: bookings the scrape missed are in the book); at the
scrape instant, N replicas whose books sum to what an exact engine reports each see the whole
engine (prefill = Q), not their 1/N.

Known biases, both corrected by the next scrape: a request booked while the `/metrics`
response was in flight counts in `own₀` but not in Q, hiding that much foreign work; a request
whose prefill the engine had partly computed at the scrape releases its whole booking when its
first token arrives, so the foreign part looks smaller by what had been computed. Without Q,
``foreign_w`` is a lower bound (own requests being prefilled count against the waiting ones).

| parameter (`LoadParams`) | default | meaning |
|---|---|---|
| `stale_after_s` | ``2.0`` | scrapes older than this add nothing (own book only) |
| `mean_weight` | ``0.05`` | EWMA weight of one booking in the per-request means |
| `combine_scrape` | ``True`` | False: own book only, scrapes as raw as before (for comparison) |
| `extrapolate` | ``False`` | the herd term between scrapes (off: measured worse, below) |
| `replicas_weight` | ``0.2`` | EWMA weight of one scrape in the replica-count estimate ``k`` |
| `replicas_min_requests` | ``4`` | own requests (latest scrapes) needed to update ``k`` |
| `replicas_max` | ``64.0`` | upper clamp of ``k`` |
| `rest_gap_factor` | ``3.0`` | rest window = this × the mean gap from a turn's end to the next |
| `rest_min_s` / `rest_max_s` | ``1.0`` / ``120.0`` | clamps of the rest window (s) |
| `rest_initial_s` | ``30.0`` | rest window before any gap was seen (s) |
| `rest_gap_weight` | ``0.05`` | EWMA weight of one gap in the mean |
| `itl_weight` | ``0.05`` | EWMA weight of one finished request in a worker's decode pace |

Decode pace (`LoadBook.decoded`). For each streamed request that ends with two or more output
tokens, the router knows how long its decode took on its decode worker: from the first output
chunk to the end, over the tokens after the first. The book keeps a running geometric mean of
that seconds-per-token per worker (an EWMA of its logarithm, weight `itl_weight`: one stall
moves it by a factor, not by its size) and reports it as `WorkerLoad.decode_itl_s` while it is
recent (a request finished there within `stale_after_s`) and the worker still decodes requests
of this replica; otherwise None — a pace measured on work that has left says nothing about the
next request. It is what the engine's batch size and the
prefill chunks beside the decodes cost each user now, measured where the user sees it, on any
engine and without a scrape; the saturation detector can gate new sessions on it
(`SaturationConfig.max_decode_itl_s`). The book also keeps the same mean over the requests that
finished with nothing else of this replica decoding on the worker (`decode_itl_alone_s`): what
the engine manages without company. An engine too slow for the limit even alone (a CPU
reference engine, a large model on few GPUs) is one whose pace a limit cannot steer: holding
new sessions there would only serialise them, so the detector leaves such a worker's pace out.

Resting sessions (`LoadBook.rest` / `wake`). An agent's session is a chain of turns with a
think time (a tool call, the user) between them: between turns it is in flight nowhere, yet its
next turn comes back to the same warm worker within seconds and decodes beside everything
placed there meanwhile. The book keeps each session whose turn ended (successfully) within the
*rest window* on the worker it ended on, until its next turn arrives, and reports their context
as `WorkerLoad.resting_tokens`; with `resting_weight` > 0 (off by default, as measured: see
`beamserve.router.policy.ttft`) the TTFT estimate prices it like decoding context, so among
workers that are otherwise alike a new session goes where fewer sessions will be back, instead
of piling onto a worker whose sessions all happen to be thinking (what a count of in-flight
requests sees at low concurrency). The window adapts to the traffic: `rest_gap_factor` × the
running mean of the observed gaps, so a session that ended for good stops counting after a few
think times. This replica's own sessions only (replica sync does not share them): each replica
sees the sessions it served, which with session affinity across replicas is its share of
them.

Health: a circuit breaker per worker. `failure_threshold` consecutive failures (connection
errors, 5xx before the first byte, failed health checks) open it for `open_s` seconds; then one
probe is let through (half-open); a success closes it, a failure re-opens it. Active health
checks (`/health`) feed the same breaker.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Protocol

from beamserve.router.flow.pace_hold import Decoding, pushed_under
from beamserve.router.types import WorkerLoad

# Engine metric names → what they mean (REFERENCE.md, "Metrics names engines expose").
QUEUE_METRICS = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
RUNNING_METRICS = ("vllm:num_requests_running", "sglang:num_running_reqs")
KV_USAGE_METRICS = ("vllm:kv_cache_usage_perc", "sglang:token_usage")
# Exported by the sim engine under beamserve's name; vLLM and SGLang have no such gauge.
QUEUED_PREFILL_METRICS = ("beamserve_worker_queued_prefill_tokens",)
LOAD_METRICS = QUEUE_METRICS + RUNNING_METRICS + KV_USAGE_METRICS + QUEUED_PREFILL_METRICS


@dataclass(frozen=True, slots=True)
class BookCounts:
    """One replica's book for one worker: tokens and requests in prefill and in decode, and
    its requests in flight there (`in_flight`: as decode worker or as prefill worker)."""

    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefilling: int = 0
    decoding: int = 0
    in_flight: int = 0

    def __add__(self, other: BookCounts) -> BookCounts:
        return BookCounts(
            self.prefill_tokens + other.prefill_tokens,
            self.decode_tokens + other.decode_tokens,
            self.prefilling + other.prefilling,
            self.decoding + other.decoding,
            self.in_flight + other.in_flight,
        )

    def __bool__(self) -> bool:
        """False when the book holds nothing (every count 0)."""
        return bool(
            self.prefill_tokens
            or self.decode_tokens
            or self.prefilling
            or self.decoding
            or self.in_flight
        )


NO_BOOKING = BookCounts()


class PeerBooks(Protocol):
    """The other router replicas' books as this replica last heard them (`router.sync`)."""

    replica_id: str  # this replica's own id (the peers are ranked with it)

    def counts(self, worker: str, now: float) -> BookCounts:
        """The sum of the fresh peers' books for `worker` (`NO_BOOKING`: none)."""
        ...

    def fresh(self, now: float) -> list[str]:
        """The peers heard from recently enough to count."""
        ...


@dataclass(frozen=True, slots=True)
class ScrapedCounts:
    """One `/metrics` scrape of one worker. `queued_prefill_tokens`: None when the engine does
    not export it (vLLM, SGLang)."""

    queue_len: int = 0
    running: int = 0
    kv_usage: float = 0.0
    queued_prefill_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class EffectiveLoad:
    """`effective_load`'s result: own + foreign tokens, and the engine's request counts."""

    prefill_tokens: int
    decode_tokens: int
    foreign_prefill_tokens: int
    foreign_decode_tokens: int
    queue_len: int
    running: int


def effective_load(
    own: BookCounts,
    scraped: ScrapedCounts | None,
    own_at_scrape: BookCounts,
    age_s: float | None,
    *,
    stale_after_s: float,
    prefill_per_request: float = 0.0,
    context_per_request: float = 0.0,
    replicas: float = 1.0,
) -> EffectiveLoad:
    """One worker's load from this replica's book now (`own`), its last scrape (`scraped`,
    `age_s` seconds ago) and the book at that scrape (`own_at_scrape`); `replicas` is ``k`` of
    the herd term (1: none). Formula in the module docstring. Tokens and counts ≥ 0."""
    p_own, d_own = max(own.prefill_tokens, 0), max(own.decode_tokens, 0)
    if scraped is None:
        return EffectiveLoad(p_own, d_own, 0, 0, 0, 0)
    w, r = max(scraped.queue_len, 0), max(scraped.running, 0)
    if age_s is None or not 0.0 <= age_s <= stale_after_s:
        return EffectiveLoad(p_own, d_own, 0, 0, w, r)
    at = own_at_scrape
    n0 = max(at.prefilling, 0) + max(at.decoding, 0)
    foreign_n = max(w + r - n0, 0)
    foreign_w = min(max(w - max(at.prefilling, 0), 0), foreign_n)
    q = scraped.queued_prefill_tokens
    if q is not None:
        foreign_p = max(q - max(at.prefill_tokens, 0), 0)
    else:
        foreign_p = round(foreign_w * max(prefill_per_request, 0.0))
    foreign_d = round((foreign_n - foreign_w) * max(context_per_request, 0.0))
    k = replicas if replicas > 1.0 else 1.0
    dw, dr = own.prefilling - at.prefilling, own.decoding - at.decoding
    if k > 1.0:
        herd = k - 1.0
        foreign_p = max(round(foreign_p + herd * (own.prefill_tokens - at.prefill_tokens)), 0)
        foreign_d = max(round(foreign_d + herd * (own.decode_tokens - at.decode_tokens)), 0)
        queue_len, running = max(round(w + k * dw), 0), max(round(r + k * dr), 0)
    else:
        queue_len, running = max(w + dw, 0), max(r + dr, 0)
    return EffectiveLoad(
        p_own + foreign_p, d_own + foreign_d, foreign_p, foreign_d, queue_len, running
    )


@dataclass(frozen=True)
class LoadParams:
    """See the module docstring's parameter table."""

    stale_after_s: float = 2.0
    mean_weight: float = 0.05
    combine_scrape: bool = True
    extrapolate: bool = False
    replicas_weight: float = 0.2
    replicas_min_requests: int = 4
    replicas_max: float = 64.0
    rest_gap_factor: float = 3.0
    rest_min_s: float = 1.0
    rest_max_s: float = 120.0
    rest_initial_s: float = 30.0
    rest_gap_weight: float = 0.05
    itl_weight: float = 0.05


@dataclass
class _Worker:
    prefill_tokens: int = 0
    decode_tokens: int = 0
    in_flight: int = 0
    queue_len: int = 0
    running: int = 0
    kv_usage: float = 0.0
    queued_prefill_tokens: int | None = None
    scraped_at: float | None = None
    scrape: ScrapedCounts | None = None  # the above, as `effective_load` takes them
    at_scrape: BookCounts = BookCounts()
    counted_engine: int = 0  # W + R and n₀ of this scrape, as in `LoadBook`'s replica sums
    counted_own: int = 0
    failures: int = 0
    open_until: float = 0.0
    probing: bool = False
    served: int = 0
    resting_tokens: int = 0  # context of the sessions resting here (`LoadBook.rest`)
    resting: int = 0
    rested_at: float | None = None  # when a session's turn last ended here
    # this replica's requests decoding here (`first_token` to `finish`): id(flight) → flight,
    # read by the pace hold (`beamserve.router.flow.pace_hold`)
    streaming: dict[int, Flight] = field(default_factory=dict)
    held_tokens: int = 0  # prefill tokens of the flights the pace hold keeps back (`hold`)
    # own requests booked here (as decode or prefill worker) before their prefill ended
    # (`start` to `_release_prefill`), oldest first: the first is the prompt the engine
    # computes now (`WorkerLoad.head_prefill_tokens`)
    prefills: dict[int, Flight] = field(default_factory=dict)
    # log of the running geometric mean of finished requests' s/token (`decoded`), and of
    # those that decoded with no company here
    log_itl: float | None = None
    log_itl_alone: float | None = None
    decoded_at: float = float("-inf")

    @property
    def prefilling(self) -> int:
        """Own requests booked here before their prefill ended."""
        return len(self.prefills)

    @property
    def decoding(self) -> int:
        """Own requests decoding here."""
        return len(self.streaming)


_IDLE = WorkerLoad()  # a worker the book has never seen: no load, never scraped, healthy


@dataclass(frozen=True)
class BreakerParams:
    failure_threshold: int = 3
    open_s: float = 10.0


@dataclass
class Flight:
    """One request's contribution to a worker's load (see `LoadBook.start`)."""

    worker: str
    prefill_tokens: int
    context_tokens: int
    prefilling: bool = True
    done: bool = False
    prefill_worker: str | None = None
    prefill_released: bool = False  # the prefill worker's part ended (`prefill_leg_done`)
    max_tokens: int = 0  # the output it asked for
    first_token_at: float | None = None
    tokens: int = 0  # output tokens relayed so far (the caller counts them)
    held: bool = False  # booked, but kept back by the pace hold (`LoadBook.hold`)


@dataclass
class LoadBook:
    """See the module docstring. Single-threaded (the router's event loop)."""

    breaker: BreakerParams = field(default_factory=BreakerParams)
    clock: Callable[[], float] = time.monotonic
    params: LoadParams = field(default_factory=LoadParams)
    _workers: dict[str, _Worker] = field(default_factory=dict)
    # Running means of one booking's uncached prompt tokens and context (module docstring).
    prefill_per_request: float = 0.0
    context_per_request: float = 0.0
    # `k` of the herd term (module docstring) and the sums it is the ratio of: per worker, the
    # engine's requests (W + R) and this replica's (n₀) at its latest scrape.
    replicas: float = 1.0
    _engine_requests: int = 0
    _own_requests: int = 0
    # Replica sync (`beamserve.router.sync`, module docstring "Other replicas' books"): the
    # peers' books, known load beside the own book; `on_change(worker)` after every change of
    # this replica's own book for `worker` (the sync publishes it).
    peers: PeerBooks | None = None
    on_change: Callable[[str], None] | None = None
    # Resting sessions (`rest`): session → (worker, rested at, context tokens), oldest first,
    # and the running mean of the gaps between a session's rest and its next turn.
    _rest: dict[str, tuple[str, float, int]] = field(default_factory=dict)
    rest_gap_s: float | None = None

    def _w(self, worker: str) -> _Worker:
        w = self._workers.get(worker)
        if w is None:
            w = self._workers[worker] = _Worker()
        return w

    def forget(self, keep: Iterable[str]) -> None:
        """Drop workers that left (discovery)."""
        keep = set(keep)
        for wid in [w for w in self._workers if w not in keep]:
            gone = self._workers.pop(wid)
            for session in [s for s, e in self._rest.items() if e[0] == wid]:
                del self._rest[session]
            self._engine_requests -= gone.counted_engine
            self._own_requests -= gone.counted_own

    # --- router-tracked load -------------------------------------------------------------------
    def start(
        self,
        decode: str,
        uncached_tokens: int,
        context_tokens: int,
        prefill: str | None = None,
        max_tokens: int = 0,
    ) -> Flight:
        """A request was sent: its uncached prompt counts as prefill work on `prefill` (or on
        `decode` when it prefills locally)."""
        f = Flight(
            decode, uncached_tokens, context_tokens, prefill_worker=prefill, max_tokens=max_tokens
        )
        for wid in (decode, prefill):
            if wid is not None:
                self.probing(wid)  # a half-open breaker lets only this request through
        target = self._w(prefill or decode)
        target.prefill_tokens += uncached_tokens
        target.prefills[id(f)] = f
        d = self._w(decode)
        d.in_flight += 1
        if prefill is not None:
            target.in_flight += 1
        a = self.params.mean_weight
        if self.prefill_per_request == 0.0 and self.context_per_request == 0.0:
            self.prefill_per_request, self.context_per_request = uncached_tokens, context_tokens
        else:
            self.prefill_per_request += a * (uncached_tokens - self.prefill_per_request)
            self.context_per_request += a * (context_tokens - self.context_per_request)
        self._changed(f)
        return f

    def _changed(self, f: Flight) -> None:
        changed = self.on_change
        if changed is not None:
            changed(f.worker)
            if f.prefill_worker is not None:
                changed(f.prefill_worker)

    def _release_prefill(self, f: Flight) -> None:
        if f.prefill_released:
            return
        self.hold(f, False)
        f.prefill_released = True
        p = self._w(f.prefill_worker or f.worker)
        p.prefill_tokens -= f.prefill_tokens
        p.prefills.pop(id(f), None)
        if f.prefill_worker is not None:
            p.in_flight -= 1

    def prefilled(self, f: Flight, tokens: int) -> int:
        """`tokens` of a local prefill were computed ahead of the request itself (a piece of
        the prefill in pieces, `beamserve.router.flow.pieces`, was answered): the engine holds
        them cached, so they no longer wait there, and they leave the worker's books now — else
        the spill's room, the pace hold and the saturation gate would read the whole prompt
        as queued until the request's first token, while the engine has a piece at most.
        Returns the tokens taken off (0 for a split flight or one past its prefill)."""
        if f.prefill_worker is not None or f.prefill_released or not f.prefilling or f.done:
            return 0
        tokens = min(max(tokens, 0), f.prefill_tokens)
        if tokens == 0:
            return 0
        f.prefill_tokens -= tokens
        w = self._w(f.worker)
        w.prefill_tokens -= tokens
        if f.held:
            w.held_tokens -= tokens
        self._changed(f)
        return tokens

    def prefill_leg_done(self, f: Flight) -> bool:
        """A split request's prefill leg answered: the prefill worker has computed the prompt,
        so its booking there ends now, before the decode worker's first token (which comes
        after the KV moved and the decode worker's next step). The decode worker's context is
        booked at `first_token` as usual. False (nothing changed) for a local prefill, a
        flight past its prefill, or one already released."""
        if f.prefill_worker is None or not f.prefilling or f.done or f.prefill_released:
            return False
        self._release_prefill(f)
        self._changed(f)
        return True

    def first_token(self, f: Flight, now: float | None = None) -> None:
        """The prefill part is done: its context now loads the decode worker."""
        if not f.prefilling or f.done:
            return
        f.prefilling = False
        f.first_token_at = self.clock() if now is None else now
        self._release_prefill(f)
        d = self._w(f.worker)
        d.decode_tokens += f.context_tokens
        d.streaming[id(f)] = f
        self._changed(f)

    def resize(self, f: Flight, prefill_tokens: int, context_tokens: int) -> None:
        """A flight still prefilling was booked on an estimate of its prompt (`RoutingCore.
        amend`): book `prefill_tokens` and `context_tokens` instead. Nothing changes for a
        flight past its prefill, or one already released."""
        if f.done or not f.prefilling or f.prefill_released:
            return
        p = self._w(f.prefill_worker or f.worker)
        p.prefill_tokens += prefill_tokens - f.prefill_tokens
        if f.held:
            p.held_tokens += prefill_tokens - f.prefill_tokens
        f.prefill_tokens, f.context_tokens = prefill_tokens, context_tokens
        self._changed(f)

    def finish(self, f: Flight) -> None:
        if f.done:
            return
        if f.prefilling:
            self._release_prefill(f)
        else:
            d = self._w(f.worker)
            d.decode_tokens -= f.context_tokens
            d.streaming.pop(id(f), None)
        d = self._w(f.worker)
        d.in_flight -= 1
        d.served += 1
        f.done = True
        self._changed(f)

    def book(self, worker: str) -> BookCounts:
        """This replica's own book for `worker` (what replica sync publishes)."""
        w = self._workers.get(worker)
        return NO_BOOKING if w is None else _counts(w)

    def booked(self) -> list[str]:
        """The workers this replica's own book holds anything on."""
        return [wid for wid, w in self._workers.items() if _counts(w)]

    # --- resting sessions ------------------------------------------------------------------------
    @property
    def rest_window_s(self) -> float:
        """How long a session counts as resting after its turn ended: `rest_gap_factor` × the
        mean gap between a turn's end and the session's next turn seen so far (clamped to
        [`rest_min_s`, `rest_max_s`]; `rest_initial_s` before any gap was seen)."""
        p = self.params
        if self.rest_gap_s is None:
            return p.rest_initial_s
        return min(max(p.rest_gap_factor * self.rest_gap_s, p.rest_min_s), p.rest_max_s)

    def rest(self, session: str | None, worker: str, context_tokens: int) -> None:
        """`session`'s turn ended on `worker` with `context_tokens` of context (prompt and
        output): until its next turn arrives (`wake`) or the rest window passes, that context
        counts as `WorkerLoad.resting_tokens` there — an agent's next turn comes back within a
        think time, and then decodes beside whatever was placed there meanwhile."""
        if not session:
            return
        now = self.clock()
        self._unrest(session)
        self._rest[session] = (worker, now, context_tokens)
        w = self._w(worker)
        w.resting_tokens += context_tokens
        w.resting += 1
        w.rested_at = now
        self._expire(now)

    def wake(self, session: str | None) -> None:
        """`session`'s next turn arrived: it no longer rests (its gap feeds the window)."""
        if not session:
            return
        entry = self._unrest(session)
        if entry is None:
            return
        gap = self.clock() - entry[1]
        a = self.params.rest_gap_weight
        self.rest_gap_s = (
            gap if self.rest_gap_s is None else self.rest_gap_s + a * (gap - self.rest_gap_s)
        )

    def active_sessions(self, own_requests: int, now: float | None = None) -> int:
        """Sessions the pool is serving now: `own_requests` (this replica's requests admitted
        or waiting to be, as its caller counts them), the sessions resting between turns here,
        and the bookings the peers' books hold (replica sync; a split request counts on both its
        workers there). `beamserve.router.policy.pool_roles` reads it."""
        now = self.clock() if now is None else now
        if self._rest:
            self._expire(now)
        n = own_requests + len(self._rest)
        peers = self.peers
        if peers is not None:
            for wid in self._workers:
                n += peers.counts(wid, now).in_flight
        return n

    def lives_beside(self, worker: str) -> int:
        """How many sessions live on `worker` whose next tokens a long prefill there would hold
        up: those resting between turns, and this replica's requests past their first token
        there (streaming). Requests still in their own prefill do not count: they wait in the
        engine's order either way."""
        w = self._workers.get(worker)
        if w is None:
            return 0
        if self._rest:
            self._expire(self.clock())
        return max(w.resting, 0) + len(w.streaming)

    def decodes_beside(self, worker: str) -> int:
        """How many decodes may share `worker`'s steps with a prefill there: the sessions that
        live there (`lives_beside`: streaming, or resting and soon back) and the requests the
        peers' books hold there; at least what its last scrape saw running, with the resting
        sessions on top."""
        w = self._workers.get(worker)
        if w is None:
            return 0
        now = self.clock()
        if self._rest:
            self._expire(now)
        peers = 0 if self.peers is None else self.peers.counts(worker, now).in_flight
        return max(len(w.streaming) + peers, w.running) + max(w.resting, 0)

    def short_prefills(self, worker: str, max_tokens: int, exclude: Flight | None = None) -> int:
        """How many of this replica's requests wait on `worker` for their first token (booked
        there, not held back by the pace hold) with at most `max_tokens` of prefill left:
        the short turns a prefill in pieces lets go first (`beamserve.router.flow.pieces`,
        "Pieces yield to short turns"). `exclude` is the pieced request itself."""
        w = self._workers.get(worker)
        if w is None or not w.prefills:
            return 0
        return sum(
            1
            for f in w.prefills.values()
            if f is not exclude and not f.held and f.prefill_tokens <= max_tokens
        )

    def resting_sessions(self, worker: str) -> int:
        """How many sessions rest on `worker` now (the `/metrics` gauge)."""
        if self._rest:
            self._expire(self.clock())
        w = self._workers.get(worker)
        return 0 if w is None else w.resting

    def _unrest(self, session: str) -> tuple[str, float, int] | None:
        entry = self._rest.pop(session, None)
        if entry is not None:
            w = self._workers.get(entry[0])
            if w is not None:
                w.resting_tokens -= entry[2]
                w.resting -= 1
        return entry

    def _expire(self, now: float) -> None:
        rest = self._rest
        horizon = now - self.rest_window_s
        while rest:
            session = next(iter(rest))
            if rest[session][1] > horizon:
                return
            self._unrest(session)

    # --- scraped load ----------------------------------------------------------------------------
    def scraped(self, worker: str, samples: dict[str, float], now: float | None = None) -> None:
        """Record an engine `/metrics` scrape (sample name → value, summed over labels), with
        this replica's book for the worker at this instant (the scrape's own part)."""
        w = self._w(worker)
        for names, attr in (
            (QUEUE_METRICS, "queue_len"),
            (RUNNING_METRICS, "running"),
            (KV_USAGE_METRICS, "kv_usage"),
        ):
            for n in names:
                if n in samples:
                    v = samples[n]
                    setattr(w, attr, v if attr == "kv_usage" else int(v))
                    break
        q = next((samples[n] for n in QUEUED_PREFILL_METRICS if n in samples), None)
        w.queued_prefill_tokens = None if q is None else int(q)
        w.scraped_at = at = self.clock() if now is None else now
        w.scrape = ScrapedCounts(w.queue_len, w.running, w.kv_usage, w.queued_prefill_tokens)
        # The known part of what the engine holds: the own book and the peers' (replica sync).
        w.at_scrape = (
            _counts(w) if self.peers is None else _counts(w) + self.peers.counts(worker, at)
        )
        # This worker's previous scrape leaves the sums of the replica count; this one enters.
        engine = max(w.queue_len, 0) + max(w.running, 0)
        own = max(w.at_scrape.prefilling, 0) + max(w.at_scrape.decoding, 0)
        self._engine_requests += engine - w.counted_engine
        self._own_requests += own - w.counted_own
        w.counted_engine, w.counted_own = engine, own
        self._update_replicas()

    def _update_replicas(self) -> None:
        """Move ``k`` toward Σ(W + R) / Σ n₀ (module docstring)."""
        p = self.params
        if self._own_requests < p.replicas_min_requests:
            return
        ratio = min(max(self._engine_requests / self._own_requests, 1.0), p.replicas_max)
        self.replicas += p.replicas_weight * (ratio - self.replicas)

    # --- decode pace ---------------------------------------------------------------------------
    def decoded(self, worker: str, itl_s: float, now: float | None = None) -> None:
        """A request decoded on `worker` at `itl_s` seconds per output token (module
        docstring, "Decode pace"), after its flight was released. Values that are not finite
        and positive are ignored."""
        if not (itl_s > 0.0 and math.isfinite(itl_s)):
            return
        w = self._w(worker)
        a, x = self.params.itl_weight, math.log(itl_s)
        prev = w.log_itl
        w.log_itl = x if prev is None else prev + a * (x - prev)
        w.decoded_at = self.clock() if now is None else now
        if w.decoding <= 0:  # (its own flight already released) nothing else of ours decodes
            alone = w.log_itl_alone
            w.log_itl_alone = x if alone is None else alone + a * (x - alone)

    def hold(self, f: Flight, held: bool) -> None:
        """Mark a flight that prefills locally as kept back by the pace hold (or sent after
        all): the other held flights' checks leave its tokens out (`pushed_under`)."""
        if f.held == held or f.prefill_worker is not None or f.prefill_released:
            return
        f.held = held
        self._w(f.worker).held_tokens += f.prefill_tokens if held else -f.prefill_tokens

    def decodings(self, worker: str) -> list[Decoding]:
        """This replica's requests streaming from `worker`, as relayed so far."""
        w = self._workers.get(worker)
        if w is None:
            return []
        return [
            Decoding(f.first_token_at, f.max_tokens, f.tokens)
            for f in w.streaming.values()
            if f.first_token_at is not None
        ]

    def pushed_under(
        self,
        worker: str,
        now: float | None = None,
        *,
        user_tok_s: float,
        prefill_tok_s: float,
        own: Flight | None = None,
    ) -> int:
        """How many of this replica's users streaming from `worker` the prefill booked there
        would push under `user_tok_s` (`beamserve.router.flow.pace_hold`): what was sent and
        waits to be prefilled, plus `own` (a held flight about to go), but not the other
        flights the hold keeps back (each is checked for itself when it may go)."""
        w = self._workers.get(worker)
        if w is None or not w.streaming:
            return 0
        now = self.clock() if now is None else now
        tokens = w.prefill_tokens - w.held_tokens
        if own is not None and own.held:
            tokens += own.prefill_tokens
        return self._pushed(worker, w, tokens, now, user_tok_s, prefill_tok_s)

    def _pushed(
        self,
        worker: str,
        w: _Worker,
        tokens: int,
        now: float,
        user_tok_s: float,
        prefill_tok_s: float,
    ) -> int:
        """How many of this replica's users streaming from `worker` a prefill of `tokens`
        there would push under `user_tok_s` (`beamserve.router.flow.pace_hold.pushed_under`)."""
        return pushed_under(
            self.decodings(worker),
            tokens,
            now,
            user_tok_s=user_tok_s,
            prefill_tok_s=prefill_tok_s,
            worker_step_s=self._pace(w, now),
        )

    def spill_room(
        self,
        worker: str,
        cost: int,
        now: float | None = None,
        *,
        max_tokens: int,
        margin_s: float,
        user_tok_s: float,
        prefill_tok_s: float,
    ) -> int | None:
        """Can `worker` prefill `cost` more tokens itself now (the flow gate's prefill spill,
        `FlowConfig.prefill_spill`)? Yes when the prefill queued there from every replica,
        with `cost`, stays within `max_tokens` and none of this replica's users streaming from
        it would be pushed under `user_tok_s` by that prefill plus `margin_s`. Returns the
        queued tokens with `cost` (lower is roomier), or None for no."""
        queued = self.load(worker, now).effective_prefill_tokens + max(cost, 0)
        if queued > max_tokens:
            return None
        w = self._workers.get(worker)
        if w is None or not w.streaming:
            return queued
        now = self.clock() if now is None else now
        margin = round(margin_s * prefill_tok_s)
        pushed = self._pushed(worker, w, queued + margin, now, user_tok_s, prefill_tok_s)
        return None if pushed else queued

    def _pace(self, w: _Worker, now: float) -> float | None:
        if w.log_itl is None or w.decoding <= 0:
            return None
        if now - w.decoded_at > self.params.stale_after_s:
            return None
        return math.exp(w.log_itl)

    # --- health ----------------------------------------------------------------------------------
    def succeeded(self, worker: str) -> None:
        w = self._w(worker)
        w.failures, w.open_until, w.probing = 0, 0.0, False

    def failed(self, worker: str) -> None:
        w = self._w(worker)
        w.failures += 1
        w.probing = False
        if w.failures >= self.breaker.failure_threshold:
            w.open_until = self.clock() + self.breaker.open_s

    def healthy(self, worker: str, now: float | None = None) -> bool:
        """False while the breaker is open; when it times out, one probe request passes."""
        w = self._workers.get(worker)
        if w is None or w.failures < self.breaker.failure_threshold:
            return True
        now = self.clock() if now is None else now
        if now < w.open_until:
            return False
        return not w.probing  # half-open: the caller that picks it is the probe

    def probing(self, worker: str) -> None:
        w = self._w(worker)
        if w.failures >= self.breaker.failure_threshold:
            w.probing = True

    def breaker_open(self, worker: str) -> bool:
        return not self.healthy(worker)

    # --- views -----------------------------------------------------------------------------------
    def load(self, worker: str, now: float | None = None) -> WorkerLoad:
        w = self._workers.get(worker)
        if w is None:
            if self.peers is None:
                return _IDLE
            now = self.clock() if now is None else now
            peer = self.peers.counts(worker, now)  # never scraped, booked by peers only
            return replace(
                _IDLE,
                foreign_prefill_tokens=peer.prefill_tokens,
                foreign_decode_tokens=peer.decode_tokens,
            )
        now = self.clock() if now is None else now
        if self._rest:
            self._expire(now)
        at = w.scraped_at
        age = None if at is None else (now - at if now > at else 0.0)
        own = _counts(w)
        peer = NO_BOOKING if self.peers is None else self.peers.counts(worker, now)
        eff = effective_load(
            own + peer if peer else own,
            w.scrape,
            w.at_scrape,
            age,
            # not combining: every scrape counts as stale here (consumers still read the raw
            # queue length and KV usage by their age, as before effective load existed)
            stale_after_s=self.params.stale_after_s if self.params.combine_scrape else -1.0,
            prefill_per_request=self.prefill_per_request,
            context_per_request=self.context_per_request,
            replicas=self.replicas if self.params.extrapolate else 1.0,
        )
        return WorkerLoad(
            w.prefill_tokens if w.prefill_tokens > 0 else 0,
            w.decode_tokens if w.decode_tokens > 0 else 0,
            w.in_flight if w.in_flight > 0 else 0,
            eff.queue_len,
            eff.running,
            w.kv_usage,
            age,
            # `healthy`, inlined for the common closed breaker (this runs per worker per route).
            w.failures < self.breaker.failure_threshold or self.healthy(worker, now),
            # foreign = the peers' reported bookings + what the scrape shows beyond all books
            max(peer.prefill_tokens, 0) + eff.foreign_prefill_tokens,
            max(peer.decode_tokens, 0) + eff.foreign_decode_tokens,
            w.resting_tokens if w.resting_tokens > 0 else 0,
            self._pace(w, now) if w.log_itl is not None else None,
            None if w.log_itl_alone is None else math.exp(w.log_itl_alone),
            _head_tokens(w),
            w.resting if w.resting > 0 else 0,
            None if w.rested_at is None else max(now - w.rested_at, 0.0),
        )

    def served(self, worker: str) -> int:
        w = self._workers.get(worker)
        return 0 if w is None else w.served


def _head_tokens(w: _Worker) -> int:
    """The prefill tokens still booked of `w`'s oldest prefill flight (0: none)."""
    for f in w.prefills.values():
        return f.prefill_tokens if f.prefill_tokens > 0 else 0
    return 0


def _counts(w: _Worker) -> BookCounts:
    return BookCounts(w.prefill_tokens, w.decode_tokens, w.prefilling, w.decoding, w.in_flight)
