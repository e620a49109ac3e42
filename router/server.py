"""Running a router: wire discovery, the KV-event hub, scraping, health checks, sessions, flow
control and the HTTP app together (`RouterRuntime`), for `beamserve router` and for tests.

Background loops (all on the serving event loop):
- discovery → the endpoint list; the KV-event hub subscribes to new workers and drops the index
  entries of workers that left; their load records are forgotten;
- every `scrape_interval_s`: each worker's `/metrics` (queue length, running, KV usage, under
  vLLM's or SGLang's names) and `/health`; failures feed the circuit breaker; the pool snapshot
  feeds the flow controller's saturation detector;
- replica sync (`beamserve.router.sync`; on when the session store is Redis, unless
  `replica_sync` is False): this replica's bookings, routing-time predictions, queued
  continuing turns and spare flow-control room published on
  the Redis channel (`sync_channel`, default from the session key prefix), the other
  replicas' merged into the load book and the prefix index; a peer's change re-observes the
  pool's saturation (at most every `SYNC_OBSERVE_S`). Redis down: own book plus scrapes.

Once started, the runtime calls ``gc.collect(); gc.freeze()`` (`RuntimeConfig.freeze_gc`):
startup's long-lived objects leave the garbage collector's generations, so full collections
while serving stay short (routing decisions wait on the same event loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import structlog
from beamserve.kvwire.geometry import DEFAULT_GEOMETRY, KVGeometry, window_of_config
from beamserve.router.api.convert import to_upstream
from beamserve.router.api.errors import APIError
from beamserve.router.api.models import API_PATHS, ApiName, parse_request
from beamserve.router.app import Router, RouterSettings, build_router_app
from beamserve.router.core import CoreConfig, RoutingCore
from beamserve.router.discovery import Discovery
from beamserve.router.facts import FactsBook
from beamserve.router.flow import (
    FlowConfig,
    FlowController,
    PrefillStage,
    SaturationConfig,
    SaturationDetector,
    Shed,
)
from beamserve.router.grpc_api import PickResult, RouteQuery
from beamserve.router.grpc_api.ext_proc import ResponseEvent
from beamserve.router.index import KVEventHub, PrefixIndex
from beamserve.router.load import LOAD_METRICS, LoadBook
from beamserve.router.pd import Upstreams
from beamserve.router.policy import ConditionalDisaggregation, NoCandidates, build_policy
from beamserve.router.policy.pool_roles import Drain, PoolRoles, drain_move
from beamserve.router.prompt import PromptHasher
from beamserve.router.sessions import (
    OP_TIMEOUT_S,
    RedisSessionStore,
    make_session_store,
    session_tip,
)
from beamserve.router.sync import RedisReplicaSync, SyncParams, sync_channel
from beamserve.router.types import Endpoint, RouteDecision, RouteRequest, WorkerLoad, WorkerView

log = structlog.get_logger(__name__)

SYNC_OBSERVE_S = 0.02  # least time between two pool snapshots a peer's change triggers


@dataclass
class RuntimeConfig:
    """Everything `beamserve router` takes (see its --help)."""

    policy: str | dict[str, Any] = "sticky-until-saturated"
    disaggregation: dict[str, Any] | None = None
    flow: dict[str, Any] | None = None
    saturation: dict[str, Any] | None = None
    tokenizer: Path | None = None
    # The default KV geometry (`geometry()`), for workers that report none of their own.
    block_size: int = DEFAULT_GEOMETRY.block_size
    sliding_window: int | None = None  # None: config.json of `tokenizer`, else Beam's 512
    hash_scheme: str = DEFAULT_GEOMETRY.hash_scheme
    redis_url: str | None = None
    # Budget of one Redis operation, event-loop lag included (`RedisSessionStore.op_timeout_s`).
    redis_op_timeout_s: float = OP_TIMEOUT_S
    # Replica sync (`beamserve.router.sync`): on when the session store is Redis.
    replica_sync: bool = True
    sync_channel: str | None = None  # None: from the session store's key prefix
    sync_params: SyncParams = field(default_factory=SyncParams)
    scrape_interval_s: float = 1.0
    predict_ttl_s: float = 10.0
    prefill_timeout_s: float = 30.0
    first_byte_timeout_s: float = 120.0
    settings: RouterSettings = field(default_factory=RouterSettings)
    # gc.freeze() once started: see `RouterRuntime.start`.
    freeze_gc: bool = True

    def geometry(self) -> KVGeometry:
        """The router's default KV geometry: `block_size`, `sliding_window` (else the
        checkpoint's config.json, else 512), `hash_scheme` (events in the same format).
        Raises `KVGeometryError` naming the bad field."""
        window = self.sliding_window
        if window is None:
            window = window_of_config(self.tokenizer)
        if window is None:
            window = DEFAULT_GEOMETRY.sliding_window
        return KVGeometry.of(self.block_size, window, self.hash_scheme)


class RouterRuntime:
    def __init__(self, discovery: Discovery, config: RuntimeConfig | None = None) -> None:
        self.discovery = discovery
        self.config = c = config or RuntimeConfig()
        self.index = PrefixIndex()
        self.loads = LoadBook()
        # One default geometry for the index match, the hasher, the policy and the
        # disaggregation decider; each worker's own report replaces it for that worker.
        self.geometry = geometry = c.geometry()
        disagg = ConditionalDisaggregation.from_params(c.disaggregation or {})
        self.core = RoutingCore(
            build_policy(c.policy),
            self.index,
            self.loads,
            disagg,
            CoreConfig(geometry, c.predict_ttl_s),
        )
        self.flow = FlowController(
            FlowConfig.from_mapping(c.flow or {}),
            saturation=SaturationDetector(SaturationConfig.from_mapping(c.saturation or {})),
        )
        # The flow controller's own clock and signal (a test may swap the signal).
        self.core.pool_saturated = lambda: self.flow.saturation.saturated(time.monotonic())
        # P/D pools: new sessions' long prompts queue here, shortest first, while the prefill
        # workers are busy (`FlowController`, "The prefill stage"); a prefill done reopens it.
        self._spill_rule = self.flow.config.prefill_spill()
        self.flow.prefill_stage = PrefillStage(
            self._prefill_stage_loads,
            disagg.params.min_uncached_tokens,
            self._spill_target if self._spill_rule is not None else None,
        )
        self.core.on_prefill_done = self.flow.poll
        # The spill in a lull asks whether the pool is draining (`FlowController`).
        self.flow.active_sessions = self.active_sessions
        self.sessions = make_session_store(c.redis_url, op_timeout_s=c.redis_op_timeout_s)
        self.facts = FactsBook(geometry)
        # A `kv_both` pool's roles by load (`beamserve.router.policy.pool_roles`; None: fixed).
        roles = disagg.params.pool_roles
        self.pool_roles = None if roles is None else PoolRoles(roles)
        if roles is not None and roles.drain_quiet_s is not None:
            # a draining pool moves continuing turns to its least busy workers (`drain_move`)
            self.flow.track_active_peak = roles.drain_below_peak is not None
            self.core.rebalance = self._drain_move
        self._discovered: list[Endpoint] = []
        self.hub = KVEventHub(self.index)
        self.upstreams = Upstreams(
            self.endpoints,
            self.loads,
            prefill_timeout_s=c.prefill_timeout_s,
            first_byte_timeout_s=c.first_byte_timeout_s,
        )
        hasher = PromptHasher(
            c.tokenizer, block_size=geometry.block_size, scheme=geometry.hash_scheme
        )
        self.router = Router(
            self.core,
            self.endpoints,
            self.sessions,
            self.flow,
            self.upstreams,
            hasher,
            c.settings,
            kv_event_totals=self._kv_totals,
            replica_sync=self.sync_report,
            pool_roles=self.pool_roles,
        )
        self.app = build_router_app(self.router)
        self._tasks: list[asyncio.Task[Any]] = []
        self._froze_gc = False
        self._worker_ids: frozenset[str] = frozenset()
        self._observe_due = False
        self.sync: RedisReplicaSync | None = None
        if c.replica_sync and c.redis_url and isinstance(self.sessions, RedisSessionStore):
            self.sync = RedisReplicaSync(
                c.redis_url,
                c.sync_channel or sync_channel(self.sessions.key_prefix),
                self.loads,
                self.index,
                params=c.sync_params,
                accepts=self._known_worker,
                on_peers_changed=self._peers_changed,
            )
            self.core.on_predict = self.sync.predicted
            # Flow-control room moves between replicas (`FlowController`, "Several replicas").
            self.sync.sync.attach_flow(self.flow)
            self.sessions.on_down = self.sync.redis_lost

    def endpoints(self) -> list[Endpoint]:
        """The discovered workers with what each reported about itself (`router.facts`), and
        in a pool whose roles follow its load, the roles of its mode now (`pool_roles`)."""
        eps = self.facts.endpoints(self._discovered)
        roles = self.pool_roles
        if roles is None:
            return eps
        now = self.loads.clock()
        return roles.apply(eps, self.active_sessions(now), now, self._drain_state)

    def _drain_state(self) -> Drain:
        """May the split pool drain now (`pool_roles`, "The drain"): the flow controller's
        word (no new session for `drain_quiet_s`, none held, the pool's sessions falling),
        and one of the prefill workers idle — nothing of this replica's in flight there and no
        prefill queued by any."""
        roles = self.pool_roles
        quiet_s = roles.params.drain_quiet_s if roles is not None else None
        if roles is None or quiet_s is None:
            return "hold"
        state = self.flow.drain_state(quiet_s, roles.params.drain_below_peak)
        if state != "ready" or roles.mode != "split":
            return state
        now = self.loads.clock()
        for e in roles.prefill_endpoints():
            ld = self.loads.load(e.id, now)
            if ld.healthy and ld.in_flight == 0 and ld.effective_prefill_tokens == 0:
                return "ready"
        return "hold"

    def _drain_move(
        self, request: RouteRequest, decision: RouteDecision, views: Sequence[WorkerView]
    ) -> RouteDecision:
        """`core.rebalance`: a draining pool's move (`pool_roles.drain_move`)."""
        roles = self.pool_roles
        if roles is None or roles.mode != "drain":
            return decision
        return drain_move(request, decision, views, roles.params)

    def active_sessions(self, now: float | None = None) -> int:
        """The pool's active sessions (`LoadBook.active_sessions`): this replica's requests
        dispatched or queued at the flow controller, sessions resting, the peers' bookings —
        what the pool roles and the spill in a lull read."""
        return self.loads.active_sessions(self.core.open_dispatches + self.flow.waiting, now)

    def sync_report(self) -> dict[str, Any] | None:
        """Replica sync's health and the fresh peers' bookings per worker, for `/metrics`
        (`router.metrics`); None when sync is off."""
        sync = self.sync
        if sync is None:
            return None
        now = sync.sync.clock()
        t, st = sync.transport, sync.sync.stats
        in_flight: dict[str, float] = {}
        prefill: dict[str, float] = {}
        for e in self.endpoints():
            b = sync.state.counts(e.id, now)
            in_flight[e.id], prefill[e.id] = b.in_flight, b.prefill_tokens
        return {
            "connected": t.connected,
            "peers": len(sync.state.fresh(now)),
            "messages_published": st.published,
            "messages_received": st.received,
            "bytes_published": st.published_bytes,
            "bytes_received": st.received_bytes,
            "dropped": t.dropped,
            "errors": t.errors,
            "decode_errors": st.decode_errors,
            "room_granted": st.room_granted,
            "room_received": st.room_received,
            "room_borrowed": st.room_borrowed,
            "room_lent": st.room_lent,
            "peer_in_flight": in_flight,
            "peer_prefill_tokens": prefill,
        }

    def _kv_totals(self) -> dict[str, float]:
        t = self.hub.totals()
        return {
            k: float(getattr(t, k))
            for k in ("batches_applied", "gaps", "replayed_batches", "resyncs", "decode_errors")
            if hasattr(t, k)
        }

    def _on_endpoints(self, endpoints: list[Endpoint]) -> None:
        self._discovered = list(endpoints)
        self._worker_ids = frozenset(e.id for e in endpoints)
        self.facts.forget(endpoints)
        self.hub.sync(self.endpoints())  # event formats as the workers reported them
        self.loads.forget(e.id for e in endpoints)
        log.info("router.endpoints", workers=[e.id for e in endpoints])

    async def start(self) -> None:
        self.discovery.on_change(self._on_endpoints)
        await self.discovery.start()
        with contextlib.suppress(asyncio.TimeoutError):
            await self.discovery.wait_synced(10.0)  # on_change has fired by then
        # Ask every worker what it is before the first request (P/D pairing, length limits);
        # the scrape loop asks those that did not answer yet.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.facts.probe(self.upstreams.http, self._discovered), 5.0)
        self._tasks.append(asyncio.create_task(self._scrape_loop(), name="router-scrape"))
        if self.sync is not None:
            self.sync.start()  # in the background: Redis down never delays serving
        if self.config.freeze_gc:
            # Everything built so far (modules, app, pydantic models, discovery state) lives as
            # long as the process: move it out of the collector's generations so that a full
            # collection during serving scans only what serving created, instead of pausing
            # the event loop (and every routing decision waiting on it) for all of startup's
            # objects. `beamserve bench route-overhead` measures decisions the same way.
            gc.collect()
            gc.freeze()
            self._froze_gc = True

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        await self.discovery.stop()
        await self.hub.aclose()
        await self.upstreams.aclose()
        if self.sync is not None:
            await self.sync.aclose()
        if self._froze_gc:
            gc.unfreeze()  # frozen objects become collectable again (tests start many runtimes)
            self._froze_gc = False
        await self.sessions.close()
        self.flow.close()

    def _known_worker(self, worker: str) -> bool:
        """A peer's prediction applies only to a worker this replica discovered."""
        return worker in self._worker_ids

    def _peers_changed(self) -> None:
        """A peer's books changed: a fresh pool snapshot for the saturation detector soon."""
        if self._observe_due:
            return
        self._observe_due = True
        asyncio.get_running_loop().call_later(SYNC_OBSERVE_S, self._observe_pool)

    def _prefill_stage_loads(self) -> list[WorkerLoad]:
        """The loads of the prefill-only workers (none in a colocated pool)."""
        return [
            self.loads.load(e.id) for e in self.endpoints() if e.can_prefill and not e.can_decode
        ]

    def _spill_target(
        self, cost: int, pending: Mapping[str, int], lull: bool = False
    ) -> str | None:
        """The decode worker (one that receives KV handoffs, healthy) that can prefill a held
        new session of `cost` tokens itself now, the roomiest first; `pending`: tokens
        spilled to each and not routed yet (`FlowConfig.prefill_spill`). In a lull of new
        sessions (`lull`, `FlowConfig.prefill_spill_lull_s`) the users are kept at the lull's
        speed and the queued prefill within the lull's bound."""
        rule = self._spill_rule
        if rule is None:
            return None
        eps = self.endpoints()  # (first: it updates the pool roles' mode and spill line)
        if self.pool_roles is not None and not self.pool_roles.spilling:
            return None
        max_tokens = rule.lull_max_tokens if lull else rule.max_tokens
        user_tok_s = rule.lull_user_tok_s if lull else rule.user_tok_s
        now = self.loads.clock()
        best: tuple[int, str] | None = None
        for e in eps:
            if not (e.can_decode and e.receives_kv) or not self.loads.load(e.id, now).healthy:
                continue
            queued = self.loads.spill_room(
                e.id,
                cost + pending.get(e.id, 0),
                now,
                max_tokens=max_tokens,
                margin_s=rule.margin_s,
                user_tok_s=user_tok_s,
                prefill_tok_s=rule.prefill_tok_s,
            )
            if queued is not None and (best is None or (queued, e.id) < best):
                best = (queued, e.id)
        return None if best is None else best[1]

    def _observe_pool(self) -> None:
        self._observe_due = False
        self.flow.observe_pool([self.loads.load(e.id) for e in self.endpoints() if e.can_decode])

    async def _get_text(self, url: str) -> tuple[int, str]:
        async with self.upstreams.http.get(url, timeout=SCRAPE_TIMEOUT) as r:
            return r.status, await r.text()

    async def _scrape_one(self, ep: Endpoint) -> None:
        # Over the workers' aiohttp keep-alive connections: every second, for every worker.
        try:
            status, _ = await self._get_text(ep.url + "/health")
            if status != 200:
                self.loads.failed(ep.id)
                return
            if self.facts.get(ep) is None:
                await self.facts.probe(self.upstreams.http, [ep])
            status, text = await self._get_text(ep.url + "/metrics")
            if status == 200:
                self.loads.scraped(ep.id, load_samples(text))
            self.loads.succeeded(ep.id)
        except (TimeoutError, aiohttp.ClientError, ValueError):
            self.loads.failed(ep.id)

    async def scrape_once(self) -> None:
        eps = self._discovered
        await asyncio.gather(*(self._scrape_one(e) for e in eps))
        # What the workers' events said about their windows, and their reported event format
        # (a changed format resubscribes that worker).
        self.facts.event_windows(self.index.reported_windows)
        self.hub.sync(self.endpoints())
        self.flow.observe_pool([self.loads.load(e.id) for e in self.endpoints() if e.can_decode])

    async def _scrape_loop(self) -> None:
        while True:
            try:
                await self.scrape_once()
            except Exception:
                log.exception("router.scrape_failed")
            await asyncio.sleep(self.config.scrape_interval_s)


# --- gRPC: the Envoy endpoint picker and the native Route service -------------------------------


class GrpcGlue:
    """The routing step behind `beamserve.router.grpc_api` (same core as the HTTP door)."""

    def __init__(self, runtime: RouterRuntime) -> None:
        self.rt = runtime

    async def pick(self, headers: Mapping[str, str], body: bytes) -> PickResult:
        """Envoy ext_proc: pick the decode worker for one request (nothing is proxied here)."""
        hdrs = {k.lower(): v for k, v in headers.items()}
        path = hdrs.get(":path", "/v1/chat/completions").split("?")[0]
        api = _API_OF_PATH.get(path)
        eps = self.rt.endpoints()
        if api is None:  # not an inference call: any decode worker
            ready = [e for e in eps if e.can_decode and self.rt.loads.healthy(e.id)]
            if not ready:
                return PickResult.unavailable("no worker is ready")
            return PickResult.picked(_address(ready[0]))
        try:
            call = to_upstream(parse_request(api, body, self.rt.router.settings.max_body_bytes))
        except APIError as err:
            return PickResult(endpoint=None, status=err.status, message=err.message)
        router = self.rt.router
        try:
            key = router.authenticate(hdrs)
            rreq, record, _key = await router.route_request(
                call, hdrs, key, body_bytes=len(body), client=gateway_client(hdrs)
            )
            router.check_length(rreq, call)
        except APIError as err:  # bad key, over its rate or the model's length: no upstream
            return PickResult(
                endpoint=None,
                status=err.status,
                message=err.message,
                retry_after_s=err.retry_after_s,
            )
        # The same flow control as the HTTP door: band, tenant fairness, saturation gate, shed.
        # Queued here, the pick waits (raise Envoy's ext_proc `message_timeout` to match); an
        # ext_proc stream that ends meanwhile cancels this task, which leaves the queue.
        try:
            ticket = await self.rt.flow.admit(rreq.band, rreq.tenant, rreq.admission_tokens)
        except Shed as shed:
            return PickResult(
                endpoint=None,
                status=shed.http_status,
                message=str(shed),
                retry_after_s=float(shed.retry_after_s),
            )
        core = self.rt.core
        dispatch = core.open(rreq, ticket)
        try:
            d = core.route(dispatch, eps, record.worker if record else None)
        except NoCandidates as exc:
            core.close(dispatch)
            return PickResult.unavailable(f"no worker fits: {exc}", retry_after_s=5.0)
        except BaseException:
            core.close(dispatch)
            raise
        if rreq.session_id:  # bound at pick time: the next turn may arrive before this one ends
            await self.rt.sessions.bind(
                rreq.session_id,
                d.decode.id,
                turn_tokens=rreq.prompt_tokens,
                tenant=rreq.tenant or None,
                tip=session_tip(rreq.block_hashes),
            )

        def on_response(event: ResponseEvent, status: int) -> None:
            # Envoy reports the upstream's answer: it closes the lifecycle the pick opened.
            if event == "headers":
                if status >= 500:
                    core.fail(dispatch, worker=d.decode.id)
                elif status >= 400:
                    core.fail(dispatch, answered=True)
                else:
                    core.first_token(dispatch)
            elif event == "end":
                core.finish(dispatch)  # the session was bound at pick time
            else:
                core.close(dispatch)

        headers_out: list[tuple[str, str]] = [("x-beamserve-route", f"reason={d.reason}")]
        if d.prefill is not None:
            headers_out.append(("x-prefiller-host-port", _address(d.prefill)))
        return PickResult.picked(
            _address(d.decode), set_headers=tuple(headers_out), on_response=on_response
        )

    async def route(self, query: RouteQuery) -> RouteDecision:
        """`beamserve.router.v1.Router/Route`: the decision only (nothing is sent)."""
        hasher = self.rt.router.hasher
        hashes = query.block_hashes
        n = query.prompt_tokens
        rehash: Callable[[KVGeometry], tuple[int, ...]] | None = None
        if hashes is None:
            ids = tuple(int(t) for t in (query.token_ids or ())) or tuple(
                hasher.codec.encode(query.prompt or "")
            )
            hashes, n = hasher.hashes(ids), n or len(ids)

            def rehash(g: KVGeometry) -> tuple[int, ...]:  # workers of another KV geometry
                return hasher.hashes_in([ids], None, g.block_size, g.hash_scheme)

        rreq = replace(
            query.to_route_request(block_hashes=tuple(hashes)), prompt_tokens=n, hashes_for=rehash
        )
        record = await self.rt.sessions.get(rreq.session_id) if rreq.session_id else None
        warm = record.worker if record else None
        return self.rt.core.decide(rreq, self.rt.endpoints(), warm)


SCRAPE_TIMEOUT = aiohttp.ClientTimeout(total=2.0)
_LOAD_SAMPLE = re.compile(
    r"^(" + "|".join(re.escape(n) for n in LOAD_METRICS) + r")"
    r'(?:\{(?:[^"}\n]|"(?:[^"\\\n]|\\.)*")*\})?[ \t]+(\S+)',
    re.MULTILINE,
)


def gateway_client(headers: Mapping[str, str]) -> str | None:
    """The caller's address as a gateway reports it: the last ``x-forwarded-for`` entry (the
    one the gateway itself appended; earlier entries are the client's own claims), else
    ``x-envoy-external-address``. None when neither is present."""
    xff = headers.get("x-forwarded-for", "")
    if xff.strip():
        return xff.split(",")[-1].strip() or None
    return headers.get("x-envoy-external-address") or None


def load_samples(text: str) -> dict[str, float]:
    """The load metrics (`LOAD_METRICS`) in a Prometheus text exposition, each summed over its
    label sets. One regular-expression pass: the scrape runs every second for every worker,
    and a full exposition parse of everything else the engine exports was most of its cost."""
    out: dict[str, float] = {}
    for name, value in _LOAD_SAMPLE.findall(text):
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


_API_OF_PATH: dict[str, ApiName] = {path: api for api, path in API_PATHS.items()}


def _address(ep: Endpoint) -> str:
    parts = urlsplit(ep.url)
    return f"{parts.hostname}:{parts.port}"
