"""In-process replay of a trace through the real router on simulated Beam engines.

One `VirtualClock` drives ``workers`` `SimEngine`s (colocated: every worker prefills and
decodes, so conditional disaggregation does not apply) and one router made of the production
parts: `RoutingCore` (prefix index → views → policy), `PrefixIndex` fed by the engines' own KV
events, `LoadBook` (router-tracked prefill/decode tokens plus scraped engine metrics),
`MemorySessionStore` (the session's warm worker) and `FlowController` (priority bands, saturation
gate, bounded queues). Nothing is re-implemented: the bench only moves requests between them.

Time and load (``L`` = ``load``):

* **closed loop** (claude-code): session ``i`` starts at ``i · session_interval_s / L``; a
  session's next request is sent ``think_time_s / L`` after its previous answer completed.
  ``L`` compresses the trace's own time (session starts *and* the agents' pauses) as Mooncake's
  ``L`` does: with only 64 recorded sessions, scaling the start rate alone cannot load 8
  workers (64 sessions at their recorded pace keep a prefix-aware cluster mostly idle), so the
  pauses shrink with it; the service times never do. At ``L = 1`` sessions start once a minute
  and agents pause as recorded.
* **open loop** (Mooncake): each line arrives at ``timestamp / L``.

Per request: arrival (router time) → admission by the flow controller (band ``continuing``
for turn ≥ 2 of a session, ``new`` for a first turn) → ``core.decide`` with the session's
bound worker as warm → ``core.dispatched`` (predictions, load booking) → session bound →
``SimEngine.submit``. The first output token moves the request's load from prefill to decode
(``loads.first_token``); the last ends it (``loads.finish``, ticket released). TTFT is measured
from the router arrival, so queueing in the flow controller counts.

KV events reach the index ``kv_event_lag_s`` after the engine step that produced them (event
transport latency); until then the routing-time predictions (``predict_ttl_s``) bridge the
gap. Engine metrics (queue length, running, KV usage) are scraped every
``scrape_interval_s`` while requests are active.

Several router replicas (``router_replicas`` N > 1), as behind a plain L4 load balancer: N
independent routers — each its own `PrefixIndex` (subscribed to every engine's KV events, with
the same lag), `LoadBook`, `FlowController` and `RoutingCore` — and one shared session store
(the Redis store in production: every replica sees every binding at once). Each request goes to
a replica drawn at random (``seed``), as a balancer spreading connections does; a replica only
ever books its own requests. Each replica scrapes every engine's true state (waiting, running,
KV usage, `queued_prefill_tokens`) every ``scrape_interval_s``, replica ``k`` shifted by
``k · scrape_interval_s / N`` (replicas do not scrape in step), and combines it with its own
book (`beamserve.router.load.effective_load`). ``N = 1`` is the single router above.

Replica sync (``replica_sync``, on by default for N > 1; `beamserve.router.sync`): each
replica's `ReplicaSync` publishes its bookings and predictions, encoded as on the wire, on an
in-process bus that delivers every message to every other replica ``sync_lag_s`` later (default
2 ms: a LAN Redis round trip plus the event loop's turn), as the Redis channel does in
production; heartbeats every ``SyncParams.heartbeat_s`` while requests are active. A peer's
change re-observes the receiving replica's pool saturation, as its own arrivals and
completions do.

Flow control on a virtual clock. `FlowController.admit` is a coroutine (it waits on an
asyncio future until dispatched). The replay runs the virtual clock inside an asyncio event
loop: each arrival creates an ``admit`` task; after any clock event that touched the controller
(arrival, release, saturation snapshot) the driver yields to the loop until the controller's
futures have resolved, so admission happens at the same virtual instant, before time moves
on. The controller reads the virtual clock; its TTLs are enforced by `poll` on every scrape
tick. A shed request (HTTP 429/503) is counted in ``shed_rate``; in the closed loop its
session ends there (the harness gives up), in the open loop the line is dropped.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import itertools
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from beamserve.kvwire.events import KVEventBatch
from beamserve.kvwire.geometry import KVGeometry
from beamserve.router.core import CoreConfig, Dispatch, RoutingCore
from beamserve.router.flow import (
    FlowConfig,
    FlowController,
    SaturationConfig,
    SaturationDetector,
    Shed,
    Ticket,
)
from beamserve.router.index.prefix_index import PrefixIndex
from beamserve.router.load import QUEUED_PREFILL_METRICS, LoadBook, LoadParams
from beamserve.router.policy import RoutingPolicy, build_policy
from beamserve.router.sessions import MemorySessionStore, extends_tip, session_tip, tip_blocks
from beamserve.router.sync import ReplicaSync, SyncParams, SyncState
from beamserve.router.types import Band, Endpoint, RouteRequest, admission_tokens
from beamserve.workers.sim import (
    EngineConfig,
    RequestUpdate,
    SimEngine,
    SimRequest,
    SimRequestError,
    VirtualClock,
    get_profile,
)

from .traces import INDEX_BLOCK_SIZE, Trace, TraceRequest

ROUTED_POLICIES = ("round-robin", "least-load", "prefix-only", "beamserve")
ORACLE = "oracle"
POLICIES = (*ROUTED_POLICIES, ORACLE)
DEFAULT_PROFILE = "h200-bf16-tp8"


class ReplayError(ValueError):
    """A replay that cannot run as asked; the message names the setting and the fix."""


@dataclass(frozen=True)
class ReplayConfig:
    """Replay settings.

    | field | default | meaning |
    |---|---|---|
    | `workers` | ``8`` | colocated simulated workers |
    | `profile` | ``h200-bf16-tp8`` | sim hardware profile of every worker |
    | `kv_event_lag_s` | ``0.01`` | engine step → index delay of KV events (s) |
    | `session_interval_s` | ``60`` | closed loop: seconds between session starts at load 1 |
    | `scrape_interval_s` | ``0.5`` | engine metrics scrape period while busy (s) |
    | `predict_ttl_s` | ``10`` | lifetime of routing-time index predictions (s) |
    | `session_ttl_s` | ``3600`` | session store: binding lifetime after the last turn (s) |
    | `flow` | ``True`` | admit through the `FlowController` (False: dispatch at once) |
    | `router_replicas` | ``1`` | independent router replicas, requests spread at random |
    | `seed` | ``0`` | seed of the replica draw |
    | `combine_scrape` | ``True`` | False: each replica routes on its own book only (ablation) |
    | `herd` | ``False`` | True: the herd term between scrapes (`LoadParams.extrapolate`) |
    | `replica_sync` | ``True`` | N > 1: replicas share bookings and predictions (`router.sync`) |
    | `sync_lag_s` | ``0.002`` | replica sync: publish → peer delivery delay (s) |
    | `sync` | `SyncParams()` | replica sync: flush interval, heartbeat, peer staleness |
    | `flow_config` | `FlowConfig()` | bands, queue bounds, TTLs |
    | `saturation` | `SaturationConfig()` | the pool saturation detector |
    """

    workers: int = 8
    profile: str = DEFAULT_PROFILE
    kv_event_lag_s: float = 0.01
    session_interval_s: float = 60.0
    scrape_interval_s: float = 0.5
    predict_ttl_s: float = 10.0
    session_ttl_s: float = 3600.0
    flow: bool = True
    flow_config: FlowConfig = field(default_factory=FlowConfig)
    saturation: SaturationConfig = field(default_factory=SaturationConfig)
    router_replicas: int = 1
    seed: int = 0
    combine_scrape: bool = True
    herd: bool = False
    replica_sync: bool = True
    sync_lag_s: float = 0.002
    sync: SyncParams = field(default_factory=SyncParams)

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ReplayError(f"workers: {self.workers}; give at least 1")
        if self.router_replicas < 1:
            raise ReplayError(f"router_replicas: {self.router_replicas}; give at least 1")
        for name in ("kv_event_lag_s", "session_interval_s", "scrape_interval_s", "sync_lag_s"):
            if getattr(self, name) < 0:
                raise ReplayError(f"{name}: must be ≥ 0, got {getattr(self, name)}")


@dataclass(slots=True)
class RequestRecord:
    """What happened to one trace request in one replay (times in virtual seconds)."""

    request: TraceRequest
    band: Band
    arrival_s: float
    replica: int = 0
    worker: str | None = None
    reason: str = ""
    hit_kind: str = "none"
    dispatch_seq: int = -1
    dispatch_s: float | None = None  # left flow control's queue (the gate wait ends)
    first_token_s: float | None = None
    finish_s: float | None = None
    shed: bool = False
    failed: bool = False
    cached_tokens: int = 0
    window_recompute_tokens: int = 0
    output_tokens: int = 0

    @property
    def served(self) -> bool:
        return self.finish_s is not None and not self.failed

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s


@dataclass(frozen=True)
class PolicyRun:
    """One replay of one policy at one load: every request's record, in arrival order."""

    policy: str
    load: float
    trace: Trace
    workers: tuple[str, ...]
    records: tuple[RequestRecord, ...]
    sim_s: float
    wall_s: float
    router_replicas: int = 1
    sync_messages: int = 0  # replica-sync messages published, all replicas together
    sync_bytes: int = 0  # … their encoded size


@cache
def calibrated_prefill_tok_s(profile: str, prompt_tokens: int = 65_536) -> float:
    """Prefill throughput of one worker of `profile` (tokens/s): a cold `prompt_tokens` prompt
    over its simulated TTFT. The `beamserve` policy's TTFT estimator uses it (`prefill_tok_s`,
    "calibrate per pool")."""
    clock = VirtualClock()
    engine = SimEngine(EngineConfig.from_profile(get_profile(profile)), clock)
    out: list[float] = []

    def listener(u: RequestUpdate) -> None:
        if u.finished and u.metrics is not None and u.metrics.ttft is not None:
            out.append(u.metrics.ttft)

    engine.submit(
        SimRequest("calibrate", prompt_tokens=prompt_tokens, max_output_tokens=1),
        listener,
        stream=False,
    )
    clock.run()
    return prompt_tokens / out[0]


def make_policy(name: str, profile: str) -> RoutingPolicy:
    """The bench's policies: the `round-robin`, `least-load` and `prefix-only` presets, and
    `beamserve` = the default `sticky-until-saturated` with its TTFT estimator calibrated to the
    profile (`calibrated_prefill_tok_s`)."""
    if name == "beamserve":
        return build_policy(
            {
                "name": "beamserve",
                "strategy": "sticky-until-saturated",
                "params": {"prefill_tok_s": round(calibrated_prefill_tok_s(profile))},
            }
        )
    if name == ORACLE or name not in ROUTED_POLICIES:
        raise ReplayError(
            f"policy {name!r} cannot be replayed; routed policies: {', '.join(ROUTED_POLICIES)}"
        )
    return build_policy(name)


class _FlowDriver:
    """Runs `FlowController.admit` tasks for callbacks on the virtual clock (see the module
    docstring). `dirty` says the controller may have resolved futures: yield to the loop."""

    def __init__(self, controller: FlowController) -> None:
        self.controller = controller
        self.dirty = False
        self.tasks: set[asyncio.Task[Ticket]] = set()

    def submit(
        self,
        band: Band,
        tenant: str,
        cost_tokens: int,
        on_admit: Callable[[Ticket], None],
        on_shed: Callable[[Shed], None],
    ) -> None:
        loop = asyncio.get_running_loop()
        task = loop.create_task(self.controller.admit(band, tenant, cost_tokens))
        self.tasks.add(task)

        def done(t: asyncio.Task[Ticket]) -> None:
            self.tasks.discard(t)
            exc = t.exception()
            if exc is None:
                on_admit(t.result())
            elif isinstance(exc, Shed):
                on_shed(exc)
            else:
                raise exc

        task.add_done_callback(done)
        self.dirty = True

    async def settle(self) -> None:
        while self.dirty:
            self.dirty = False
            for _ in range(3):
                await asyncio.sleep(0)


@dataclass
class _Replica:
    """One router replica of a replay: everything a `beamserve router` process owns alone."""

    index: PrefixIndex
    core: RoutingCore
    flow: _FlowDriver | None
    ticking: bool = False
    sync: ReplicaSync | None = None
    beating: bool = False  # its sync heartbeat is scheduled


class _SyncBus:
    """Replica sync's channel in the replay: every message reaches every other replica's
    `ReplicaSync.deliver` `lag_s` later on the virtual clock (the Redis channel in production)."""

    def __init__(self, clock: VirtualClock, lag_s: float) -> None:
        self.clock, self.lag_s = clock, lag_s
        self.members: list[ReplicaSync] = []

    def transport(self, k: int) -> _BusTransport:
        return _BusTransport(self, k)

    def publish(self, k: int, data: bytes) -> None:
        at = self.clock.now() + self.lag_s
        for j, member in enumerate(self.members):
            if j != k:  # Redis echoes it to the sender too; `SyncState` would ignore it
                self.clock.call_at(at, functools.partial(member.deliver, data))


@dataclass(frozen=True)
class _BusTransport:
    bus: _SyncBus
    k: int

    def publish(self, data: bytes) -> None:
        self.bus.publish(self.k, data)


class Replay:
    """One policy on one trace at one load; `run()` once."""

    def __init__(
        self,
        trace: Trace,
        policy: str,
        load: float,
        config: ReplayConfig | None = None,
        *,
        on_request_done: Callable[[int], None] | None = None,
    ) -> None:
        if load <= 0:
            raise ReplayError(f"load: {load}; give a positive number (1 = the trace's pace)")
        self.trace = trace
        self.policy_name = policy
        self.load = load
        self.config = cfg = config or ReplayConfig()
        self.clock = clock = VirtualClock()
        profile = get_profile(cfg.profile)
        now = clock.now
        self.endpoints = [
            Endpoint(id=f"w{i}", url=f"sim://w{i}", engine="sim") for i in range(cfg.workers)
        ]
        self.replicas = [
            self._replica(profile.model.sliding_window) for _ in range(cfg.router_replicas)
        ]
        self.sync_bus: _SyncBus | None = None
        if cfg.replica_sync and cfg.router_replicas > 1:
            self.sync_bus = self._connect_sync()
        # The first replica's parts (the only ones when N = 1).
        self.index, self.core, self.flow = (
            self.replicas[0].index,
            self.replicas[0].core,
            self.replicas[0].flow,
        )
        self._spread = random.Random(cfg.seed)
        engine_cfg = EngineConfig.from_profile(profile, page_size=INDEX_BLOCK_SIZE)
        self.engines = {
            e.id: SimEngine(engine_cfg, clock, kv_events=self._sink(e.id)) for e in self.endpoints
        }
        self.sessions = MemorySessionStore(ttl_s=cfg.session_ttl_s, clock=now)
        self.records: list[RequestRecord] = []
        self._tips: dict[str, str] = {}  # session → its last dispatched prompt's tip
        self._seq = itertools.count()
        self._active = 0  # queued or in flight
        self._done = 0
        self._on_request_done = on_request_done

    # --- wiring ---------------------------------------------------------------------------

    def _replica(self, sliding_window: int) -> _Replica:
        cfg, now = self.config, self.clock.now
        index = PrefixIndex(clock=now)
        core = RoutingCore(
            make_policy(self.policy_name, cfg.profile),
            index=index,
            loads=LoadBook(
                clock=now,
                params=LoadParams(combine_scrape=cfg.combine_scrape, extrapolate=cfg.herd),
            ),
            config=CoreConfig(
                geometry=KVGeometry.of(INDEX_BLOCK_SIZE, sliding_window),
                predict_ttl_s=cfg.predict_ttl_s,
            ),
            clock=now,
        )
        flow = None
        if cfg.flow:
            controller = FlowController(
                cfg.flow_config, saturation=SaturationDetector(cfg.saturation), clock=now
            )
            flow = _FlowDriver(controller)
            core.pool_saturated = lambda: controller.saturation.saturated(now())
        return _Replica(index, core, flow)

    def _connect_sync(self) -> _SyncBus:
        """One `ReplicaSync` per replica on one in-process bus (module docstring)."""
        cfg, clock = self.config, self.clock
        bus = _SyncBus(clock, cfg.sync_lag_s)
        for k, r in enumerate(self.replicas):
            sync = ReplicaSync(
                SyncState(f"replica-{k}", cfg.sync),
                r.core.loads,
                r.index,
                bus.transport(k),
                clock.call_later,
                clock.now,
                on_peers_changed=functools.partial(self._observe_pool, k),
            )
            r.core.on_predict = sync.predicted
            if r.flow is not None:
                sync.attach_flow(r.flow.controller, then=functools.partial(self._touched, r.flow))
            r.sync = sync
            bus.members.append(sync)
        return bus

    @staticmethod
    def _touched(flow: _FlowDriver) -> None:
        """A peer granted room or borrowed some (`ReplicaSync.attach_flow`): items the
        controller admitted meanwhile resolve before time moves on."""
        flow.dirty = True

    def _beat(self, k: int) -> None:
        """Replica `k`'s sync heartbeat, every ``heartbeat_s / 2`` while requests are active."""
        r = self.replicas[k]
        if r.sync is None:
            return
        r.sync.tick()
        if self._active > 0:
            self.clock.call_later(self.config.sync.heartbeat_s / 2, lambda: self._beat(k))
        else:
            r.beating = False

    def _sink(self, worker: str) -> Callable[[KVEventBatch], None]:
        """Every replica's index subscribes to every engine's events (same lag for all)."""
        indexes = [r.index for r in self.replicas]
        clock, lag = self.clock, self.config.kv_event_lag_s

        def apply(batch: KVEventBatch) -> None:
            for index in indexes:
                index.apply(worker, batch)

        def sink(batch: KVEventBatch) -> None:
            if lag > 0:
                clock.call_at(clock.now() + lag, lambda: apply(batch))
            else:
                apply(batch)

        return sink

    def _observe_pool(self, k: int) -> None:
        r = self.replicas[k]
        if r.flow is None:
            return
        loads = r.core.loads
        now = self.clock.now()
        r.flow.controller.observe_pool([loads.load(e.id, now) for e in self.endpoints])
        r.flow.dirty = True

    def _tick(self, k: int) -> None:
        """Replica `k` scrapes every engine's true state (what its `/metrics` would say)."""
        now = self.clock.now()
        loads = self.replicas[k].core.loads
        for wid, engine in self.engines.items():
            st = engine.stats()
            loads.scraped(
                wid,
                {
                    "vllm:num_requests_waiting": st.waiting,
                    "vllm:num_requests_running": st.running,
                    "vllm:kv_cache_usage_perc": st.full_usage,
                    QUEUED_PREFILL_METRICS[0]: st.queued_prefill_tokens,
                },
                now,
            )
        self._observe_pool(k)
        if self._active > 0 and self.config.scrape_interval_s > 0:
            self.clock.call_at(now + self.config.scrape_interval_s, lambda: self._tick(k))
        else:
            self.replicas[k].ticking = False

    def _ensure_tick(self) -> None:
        for k, r in enumerate(self.replicas):
            if r.sync is not None and not r.beating:
                r.beating = True
                self._beat(k)
        interval = self.config.scrape_interval_s
        if interval <= 0:
            return
        n = len(self.replicas)
        for k, r in enumerate(self.replicas):
            if not r.ticking:
                r.ticking = True
                self.clock.call_at(
                    self.clock.now() + k * interval / n, functools.partial(self._tick, k)
                )

    # --- request life ---------------------------------------------------------------------

    def _arrive(self, req: TraceRequest, next_in_session: int | None) -> None:
        k = self._spread.randrange(len(self.replicas)) if len(self.replicas) > 1 else 0
        rec = RequestRecord(
            req, "continuing" if req.turn >= 2 else "new", arrival_s=self.clock.now(), replica=k
        )
        self.records.append(rec)
        self._active += 1
        self._ensure_tick()
        flow = self.replicas[k].flow
        if flow is None:
            self._dispatch(rec, None, next_in_session)
            return
        self._observe_pool(k)
        resumed = 0  # what the router's door counts (`Router.route_request`)
        tip = self._tips.get(req.session) if req.session is not None else None
        if rec.band == "continuing" and extends_tip(tip, req.block_hashes):
            resumed = tip_blocks(tip) * INDEX_BLOCK_SIZE
        flow.submit(
            rec.band,
            req.session or req.key,
            admission_tokens(req.prompt_tokens, resumed),
            lambda ticket: self._dispatch(rec, ticket, next_in_session),
            lambda _exc: self._shed(rec),
        )

    def _shed(self, rec: RequestRecord) -> None:
        rec.shed = True
        self._active -= 1
        self._count_done()

    def _dispatch(self, rec: RequestRecord, ticket: Ticket | None, next_k: int | None) -> None:
        req = rec.request
        warm = None
        if req.session is not None:
            bound = self.sessions.get_now(req.session)
            warm = bound.worker if bound is not None else None
        route = RouteRequest(
            request_id=req.key,
            prompt_tokens=req.prompt_tokens,
            block_hashes=req.block_hashes,
            session_id=req.session,
            turn=req.turn,
            band=rec.band,
            max_tokens=req.output_tokens,
        )
        core = self.replicas[rec.replica].core
        flight = core.open(route, ticket)
        decision = core.route(flight, self.endpoints, warm=warm)
        worker = decision.decode.id
        if req.session is not None:
            self.sessions.bind_now(req.session, worker, turn_tokens=req.prompt_tokens)
            self._tips[req.session] = session_tip(req.block_hashes)
        rec.worker = worker
        rec.reason = decision.reason
        rec.hit_kind = decision.expected_hit.kind
        rec.dispatch_seq = next(self._seq)
        rec.dispatch_s = self.clock.now()
        sim = SimRequest(
            request_id=req.key,
            prompt_tokens=req.prompt_tokens,
            max_output_tokens=req.output_tokens,
            output_tokens=req.output_tokens,
            block_hashes=req.block_hashes,
        )
        try:
            self.engines[worker].submit(
                sim, lambda u: self._update(rec, flight, next_k, u), stream=True
            )
        except SimRequestError:
            rec.failed = True
            rec.finish_s = self.clock.now()
            self._end(rec, flight, next_k, rec.finish_s)

    def _update(
        self, rec: RequestRecord, flight: Dispatch, next_k: int | None, u: RequestUpdate
    ) -> None:
        if rec.first_token_s is None and u.num_output_tokens > 0:
            rec.first_token_s = u.time
            self.replicas[rec.replica].core.first_token(flight)
        if not u.finished:
            return
        rec.finish_s = u.time
        if u.metrics is not None:
            rec.cached_tokens = u.metrics.cached_tokens
            rec.window_recompute_tokens = u.metrics.window_recompute_tokens
            rec.output_tokens = u.metrics.output_tokens
        if u.finish_reason not in ("stop", "length"):
            rec.failed = True
        self._end(rec, flight, next_k, u.time)

    def _end(self, rec: RequestRecord, flight: Dispatch, next_k: int | None, at: float) -> None:
        core = self.replicas[rec.replica].core
        if rec.failed:
            core.fail(flight, worker=rec.worker)
        else:
            core.finish(flight, rec.output_tokens)  # the session was bound at dispatch
        self._active -= 1
        if flight.ticket is not None:
            self._observe_pool(rec.replica)
        self._count_done()
        if next_k is not None:
            self._schedule_turn(rec.request, next_k, at + rec.request.think_time_s / self.load)

    def _count_done(self) -> None:
        self._done += 1
        if self._on_request_done is not None:
            self._on_request_done(self._done)

    def _schedule_turn(self, prev: TraceRequest, k: int, at: float) -> None:
        session = self._session_of[prev.session or ""]
        nxt = k + 1 if k + 1 < len(session) else None
        self.clock.call_at(at, lambda: self._arrive(session[k], nxt))

    # --- run ------------------------------------------------------------------------------

    def run(self) -> PolicyRun:
        trace, clock, load = self.trace, self.clock, self.load
        self._session_of: dict[str, tuple[TraceRequest, ...]] = {}
        if trace.kind == "closed":
            for i, s in enumerate(trace.sessions):
                self._session_of[s.name] = s.requests
                nxt = 1 if len(s.requests) > 1 else None
                first = s.requests[0]
                at = i * self.config.session_interval_s / load
                clock.call_at(at, functools.partial(self._arrive, first, nxt))
        else:
            for r in trace.requests:
                clock.call_at(r.arrival_s / load, functools.partial(self._arrive, r, None))
        wall0 = time.perf_counter()
        gc_was_on = gc.isenabled()
        gc.disable()  # many small objects, no cycles worth chasing: markedly faster
        try:
            if self.flow is None:
                clock.run()
            else:
                loop = asyncio.new_event_loop()
                try:
                    loop.run_until_complete(self._drive())
                finally:
                    for replica in self.replicas:
                        if replica.flow is not None:
                            replica.flow.controller.close()
                    loop.close()
        finally:
            if gc_was_on:
                gc.enable()
        wall = time.perf_counter() - wall0
        records = tuple(self.records)
        t_first = min((rec.arrival_s for rec in records), default=0.0)
        t_last = max((rec.finish_s or rec.arrival_s for rec in records), default=0.0)
        return PolicyRun(
            self.policy_name,
            load,
            trace,
            tuple(e.id for e in self.endpoints),
            records,
            t_last - t_first,
            wall,
            len(self.replicas),
            sum(r.sync.stats.published for r in self.replicas if r.sync is not None),
            sum(r.sync.stats.published_bytes for r in self.replicas if r.sync is not None),
        )

    async def _settle(self) -> None:
        flows = [r.flow for r in self.replicas if r.flow is not None]
        while any(f.dirty for f in flows):
            for f in flows:
                await f.settle()

    async def _drive(self) -> None:
        clock = self.clock
        while True:
            await self._settle()
            if clock.run(max_events=1) == 0:
                await self._settle()
                if clock.pending() == 0:
                    break
        for r in self.replicas:  # left queued at the end (none unless misconfigured)
            for task in list(r.flow.tasks if r.flow is not None else ()):
                task.cancel()


def replay(
    trace: Trace,
    policy: str,
    load: float,
    config: ReplayConfig | None = None,
    *,
    on_request_done: Callable[[int], None] | None = None,
) -> PolicyRun:
    """Replay `trace` with one routed `policy` at `load` (see the module docstring)."""
    return Replay(trace, policy, load, config, on_request_done=on_request_done).run()


def describe(config: ReplayConfig) -> dict[str, Any]:
    """The settings worth printing beside results."""
    return {
        "workers": config.workers,
        "profile": config.profile,
        "kv_event_lag_s": config.kv_event_lag_s,
        "session_interval_s": config.session_interval_s,
        "flow": config.flow,
        "router_replicas": config.router_replicas,
        "combine_scrape": config.combine_scrape,
        "herd": config.herd,
        "replica_sync": config.replica_sync and config.router_replicas > 1,
        "sync_lag_s": config.sync_lag_s,
        "beamserve_prefill_tok_s": round(calibrated_prefill_tok_s(config.profile)),
    }
