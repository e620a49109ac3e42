"""The router's HTTP front door: what agent harnesses talk to.

One request, end to end (`Router.handle`):

1. body size limit, API key (bearer; per-key token-bucket rate limit and priority class),
   validation in the API's own error shape (`router.api`);
2. the worker call (`to_upstream`), the session id (headers, else a hash of the conversation's
   opening) scoped to the caller's tenant (`tenant_and_session`), the prompt's token ids and
   block hashes (`PromptHasher`: precise or approximate); a long prompt that starts a
   session is routed on its head (`HEAD_CHARS`, `_Tail`) and finished after the call went out;
3. flow control (`band_of`): band = `sheddable` (key class or `x-beamserve-priority:
   sheddable`), `continuing` (the prompt extends the session's last turn), or `new`; tenant =
   the key's, or the anonymous caller's address; `FlowController.admit` queues, gates on pool
   saturation, sheds with 429/503 and `Retry-After`; a client that disconnects while queued
   leaves the queue;
4. the routing step (`RoutingCore.decide`: prefix index, load, breaker health, the session's
   warm worker from the session store; policy; conditional disaggregation);
5. P/D orchestration (`router.pd`) — vLLM's two legs or SGLang's concurrent legs; a failed
   prefill leg is retried on another prefill worker or prefilled on the decode worker; failures
   before the first byte are retried on another worker; after it, the stream ends with an error
   event in the client API's format;
6. the answer translated into the client's API (JSON or SSE), the session bound to its worker,
   load and flow tickets released; a client disconnect closes the upstream stream (the worker
   aborts the request).

Debug header `x-beamserve-route` explains each decision (reason, workers, expected hit).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

import structlog
from beamserve.router.api import errors as api_errors
from beamserve.router.api.convert import (
    UpstreamCall,
    model_list,
    to_anthropic_message,
    to_responses_object,
    to_upstream,
    with_model,
)
from beamserve.router.api.errors import APIError
from beamserve.router.api.models import API_PATHS, ApiName, ParsedRequest, parse_request
from beamserve.router.api.session import is_continuing_turn, session_id_from
from beamserve.router.api.sse import (
    DONE_FRAME,
    UpstreamStreamError,
    raw_passthrough_ok,
    translator_for,
)
from beamserve.router.core import Dispatch, RoutingCore
from beamserve.router.flow import FlowController, Shed, Ticket
from beamserve.router.flow.pace_hold import PaceHold
from beamserve.router.flow.pieces import (
    PrefillPieces,
    first_piece_size,
    piece_cuts,
    wants_first_pieces,
    wants_pieces,
)
from beamserve.router.flow.saturation import SaturationDetector, worker_saturation
from beamserve.router.load import Flight
from beamserve.router.metrics import RouterMetrics
from beamserve.router.pd import UpstreamError, Upstreams
from beamserve.router.policy import NoCandidates
from beamserve.router.policy.pool_roles import PoolRoles
from beamserve.router.policy.sticky import KIND as STICKY_KIND
from beamserve.router.prompt import PromptHasher, PromptKey, PromptTooLong
from beamserve.router.sessions import SessionRecord, SessionStore, extends_tip, tip_blocks
from beamserve.router.types import Band, Endpoint, RouteDecision, RouteRequest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

log = structlog.get_logger(__name__)
T = TypeVar("T")

PRIORITY_HEADER = "x-beamserve-priority"
ROUTE_HEADER = "x-beamserve-route"
SESSION_HEADER = "x-beamserve-session"


@dataclass(frozen=True)
class KeyPolicy:
    """One API key: its tenant, priority class and rate limit (requests/s with a burst)."""

    tenant: str
    priority: Band = "new"
    rate_per_s: float | None = None
    burst: int = 10


ANONYMOUS = KeyPolicy(tenant="anonymous")


@dataclass
class _Bucket:
    tokens: float
    at: float


@dataclass
class RouterSettings:
    """`served_models`: names accepted in `model` (empty: any). `api_keys`: bearer key → policy
    (empty: no authentication). `max_body_bytes`: larger bodies get 413. `max_retries`: retries
    on other workers before the first byte. `debug_header`: send `x-beamserve-route`.
    `speculate`: send a calm session's next turn to its worker before deciding
    (`Router._speculate`)."""

    served_models: tuple[str, ...] = ("beam",)
    api_keys: dict[str, KeyPolicy] = field(default_factory=dict)
    max_body_bytes: int = 32 * 1024 * 1024
    max_retries: int = 2
    debug_header: bool = True
    default_max_tokens: int = 4096
    speculate: bool = True


@dataclass(eq=False)
class _Tail:
    """A request routed on its prompt's head key (`PromptKey.partial`): the prompt's rest is
    tokenized and hashed once the request is on its way to the worker (`Router._settle`)."""

    key: PromptKey
    body_bytes: int
    task: asyncio.Future[None] | None = None


@dataclass(eq=False)
class _Speculation:
    """A continuing turn's body, sent as it came to its session's worker before the router
    parsed it or decided (`Router._speculate`). The answer is the request's when the router's
    decision is that worker with nothing else to do first (`Router._adoptable`); otherwise
    the call is called off (`Router._call_off`) and the request goes as decided."""

    worker: str
    call: asyncio.Future[Any]
    record: SessionRecord  # the session's record it was sent on (`route_request` reuses it)
    state: str = "pending"  # → "adopted" or "called off"


class _Turn(NamedTuple):
    """One client request on its way through `Router._dispatch`."""

    api: ApiName
    dialect: api_errors.ErrorDialect
    parsed: ParsedRequest
    call: UpstreamCall
    dispatch: Dispatch
    tail: _Tail | None = None
    spec: _Speculation | None = None


class ClosingStream(StreamingResponse):
    """A streaming answer that runs `on_close` however it ends: finished, failed, or the
    client gone before or while the body streamed (Starlette never starts the body iterator
    of a response whose client already left, so its own `finally` cannot be relied on)."""

    def __init__(
        self, content: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]], **kw: Any
    ) -> None:
        super().__init__(content, **kw)
        self._on_close: Callable[[], Awaitable[None]] | None = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.close()

    async def close(self) -> None:
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            await on_close()


# Bodies at least this large are parsed and hashed in a worker thread, so that the event loop
# (health checks, every other request's stream) keeps running meanwhile. Smaller ones take a
# few ms inline (prompt keys are incremental), less than the thread's GIL hand-offs would
# cost every other stream (the interpreter switches threads every 5 ms).
OFF_LOOP_BYTES = 2 * 1024 * 1024
# Approximate mode over-counts (whitespace runs are pseudo-tokens): the length check halves it.
APPROX_LENGTH_SLACK = 2
# A prompt that starts a session and has more than twice this many characters is routed on
# its first segments of this many (a *head* key, `PromptKey.partial`) when that decides every
# worker's hit: the first block no worker holds ends every hit. Its rest is tokenized and
# hashed while the worker starts on it (`Router._settle`) — for a new 144K-token prompt,
# 45–100 ms that were between the client and the worker.
HEAD_CHARS = 8_192
# How often a prefill in pieces looks again whether the short turns it lets go first have their
# first token (`Router._yield_to_short_turns`).
_YIELD_POLL_S = 0.002


async def _off_loop(size: int, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)`, in a worker thread when the input (`size` bytes) is large."""
    if size < OFF_LOOP_BYTES:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


class Router:
    """The front door's state; `build_router_app(router)` serves it."""

    def __init__(
        self,
        core: RoutingCore,
        endpoints: Callable[[], list[Endpoint]],
        sessions: SessionStore,
        flow: FlowController,
        upstreams: Upstreams,
        hasher: PromptHasher,
        settings: RouterSettings | None = None,
        kv_event_totals: Callable[[], dict[str, float]] | None = None,
        replica_sync: Callable[[], dict[str, Any] | None] | None = None,
        pool_roles: PoolRoles | None = None,
    ) -> None:
        self.core, self.endpoints, self.sessions, self.flow = core, endpoints, sessions, flow
        # `RouterRuntime.sync_report`: replica sync's health and the peers' bookings (None: off)
        self._sync_report = replica_sync
        # A `kv_both` pool's roles by load (None: fixed), its mode set by `endpoints()`. While
        # it is not split it is lightly loaded by definition, so no user there needs the pace
        # hold or the pieces.
        self._pool_roles = pool_roles
        self.upstreams, self.hasher = upstreams, hasher
        self.settings = settings or RouterSettings()
        self._buckets: dict[str, _Bucket] = {}
        self._kv_totals = kv_event_totals or dict
        self.metrics = RouterMetrics(self._live)
        self._pace_hold = flow.config.pace_hold()
        self._pieces = flow.config.prefill_pieces()
        self._first_pieces = flow.config.prefill_first_pieces
        self._first_piece_tokens = flow.config.prefill_first_piece_tokens
        self._live_session_s = flow.config.live_session_s
        # open dispatches (by id), for `worker_report`; closed ones are swept as it grows
        self._dispatches: dict[int, Dispatch] = {}
        self._sweep_at = 64
        # session → (its last body's bytes, its prompt's tokens): `_speculate`'s size estimate
        self._last_sizes: OrderedDict[str, tuple[int, int]] = OrderedDict()

    # --- metrics ---------------------------------------------------------------------------------
    def _live(self) -> dict[str, Any]:
        stats = self.flow.stats()
        workers: dict[str, dict[str, float]] = {
            "worker_in_flight": {},
            "worker_prefill_tokens": {},
            "worker_decode_tokens": {},
            "worker_breaker_open": {},
            "worker_resting_sessions": {},
            "worker_saturation": {},
        }
        detector = self.flow.saturation
        builtin = detector if isinstance(detector, SaturationDetector) else None
        config = builtin.config if builtin is not None else None
        for e in self.endpoints():
            ld = self.core.loads.load(e.id)
            workers["worker_in_flight"][e.id] = ld.in_flight
            workers["worker_prefill_tokens"][e.id] = ld.prefill_tokens
            workers["worker_decode_tokens"][e.id] = ld.decode_tokens
            workers["worker_breaker_open"][e.id] = float(not ld.healthy)
            workers["worker_resting_sessions"][e.id] = self.core.loads.resting_sessions(e.id)
            if config is not None and e.can_decode and ld.healthy:  # the detector's workers
                workers["worker_saturation"][e.id] = worker_saturation(ld, config)
        return {
            "queue_depth": dict(stats.queued),
            "saturation": (
                (builtin.level(), float(stats.saturated)) if builtin is not None else None
            ),
            "in_flight": self.core.open_dispatches,
            "workers": workers,
            "session_degraded": bool(self.sessions.health().get("degraded", False)),
            "shed": dict(stats.shed),
            "kv_events": self._kv_totals(),
            "replica_sync": self._sync_report() if self._sync_report is not None else None,
            "pool": self._pool_state(),
        }

    def _pool_state(self) -> dict[str, Any] | None:
        """The pool's mode as of `_live`'s `endpoints()` call above (None: fixed roles)."""
        roles = self._pool_roles
        if roles is None:
            return None
        return {
            "split": roles.mode == "split",
            "draining": roles.mode == "drain",
            "switches": roles.switch.switches,
        }

    def _track(self, d: Dispatch) -> None:
        self._dispatches[id(d)] = d
        if len(self._dispatches) >= self._sweep_at:
            self._dispatches = {k: v for k, v in self._dispatches.items() if not v.closed}
            self._sweep_at = max(64, 2 * len(self._dispatches))

    def worker_report(self) -> dict[str, Any]:
        """`GET /admin/workers`: requests in flight per worker — every discovered worker, and
        workers that left discovery while requests sent to them are still running (a
        retiring revision draining: the operator removes it once these reach 0). A request
        counts on its decode worker until it ends, and on its prefill worker until the
        first token."""
        busy: dict[str, int] = {}
        seen: dict[str, Endpoint] = {}
        self._dispatches = {k: d for k, d in self._dispatches.items() if not d.closed}
        for d in self._dispatches.values():
            if d.decision is None or d.phase not in ("dispatched", "streaming"):
                continue
            workers = [d.decision.decode]
            if d.decision.prefill is not None and d.phase == "dispatched":
                workers.append(d.decision.prefill)
            for e in workers:
                busy[e.id] = busy.get(e.id, 0) + 1
                seen.setdefault(e.id, e)
        discovered = {e.id: e for e in self.endpoints()}
        out = []
        for wid, e in sorted({**seen, **discovered}.items()):
            out.append(
                {
                    "id": wid,
                    "url": e.url,
                    "role": e.role,
                    "pool": e.pool,
                    "revision": e.revision,
                    "engine": e.engine,
                    "in_flight": busy.get(wid, 0),
                    "discovered": wid in discovered,
                }
            )
        return {"workers": out, "in_flight": self.core.open_dispatches}

    # --- admission -------------------------------------------------------------------------------
    def _authenticate(self, request: Request, dialect: api_errors.ErrorDialect) -> KeyPolicy:
        return self.authenticate(request.headers, dialect)

    def authenticate(
        self, headers: Mapping[str, str], dialect: api_errors.ErrorDialect = "openai"
    ) -> KeyPolicy:
        """The caller's key policy from its headers (bearer token or ``x-api-key``; lower-case
        or case-insensitive names); raises 401 / 429 (its rate limit) as `APIError`."""
        keys = self.settings.api_keys
        if not keys:
            return ANONYMOUS
        auth = headers.get("authorization", "")
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        key = key or headers.get("x-api-key", "")
        policy = keys.get(key)
        if policy is None:
            raise api_errors.unauthorized(api=dialect)
        if policy.rate_per_s is not None:
            now = time.monotonic()
            b = self._buckets.get(key) or _Bucket(float(policy.burst), now)
            b.tokens = min(float(policy.burst), b.tokens + (now - b.at) * policy.rate_per_s)
            b.at = now
            self._buckets[key] = b
            if b.tokens < 1.0:
                raise api_errors.rate_limited((1.0 - b.tokens) / policy.rate_per_s, api=dialect)
            b.tokens -= 1.0
        return policy

    async def _read_body(self, request: Request, dialect: api_errors.ErrorDialect) -> bytes:
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise api_errors.too_large(limit, int(declared), api=dialect)
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise api_errors.too_large(limit, size, api=dialect)
            chunks.append(chunk)
        return b"".join(chunks)

    # --- one request -----------------------------------------------------------------------------
    async def handle(self, api: ApiName, request: Request) -> Response:
        dialect: api_errors.ErrorDialect = "anthropic" if api == "messages" else "openai"
        try:
            response = await self._handle(api, dialect, request)
        except APIError as err:
            response = _error_response(err.for_api(dialect))
        except Exception as exc:  # never a bare 500 with a stack trace
            log.exception("router.internal_error", api=api)
            response = _error_response(api_errors.upstream_failed(str(exc), api=dialect))
        self.metrics.requests.labels(api, str(response.status_code)).inc()
        return response

    async def _handle(
        self, api: ApiName, dialect: api_errors.ErrorDialect, request: Request
    ) -> Response:
        key = self._authenticate(request, dialect)
        raw = await self._read_body(request, dialect)
        headers = {k.lower(): v for k, v in request.headers.items()}
        client = request.client.host if request.client else None
        spec = await self._speculate(api, headers, key, raw, client)
        try:
            return await self._handle_parsed(api, dialect, request, raw, headers, key, spec)
        finally:
            if spec is not None:
                self._call_off(spec)  # (taken, or called off already: nothing to do)

    async def _handle_parsed(
        self,
        api: ApiName,
        dialect: api_errors.ErrorDialect,
        request: Request,
        raw: bytes,
        headers: dict[str, str],
        key: KeyPolicy,
        spec: _Speculation | None,
    ) -> Response:
        limit = self.settings.max_body_bytes
        parsed = await _off_loop(len(raw), parse_request, api, raw, limit)
        served = self.settings.served_models
        if served and parsed.model is not None and parsed.model not in served:
            raise api_errors.not_found(
                f"model {parsed.model!r}",
                f"use one of {list(served)} (GET /v1/models)",
                api=dialect,
            )
        call = to_upstream(parsed)
        t0 = time.perf_counter()
        rreq, record, prompt = await self.route_request(
            call,
            headers,
            key,
            parsed.model or "",
            body_bytes=len(raw),
            client=request.client.host if request.client else None,
            head=True,
            record=spec.record if spec is not None else None,
        )
        hashing_s = time.perf_counter() - t0
        if rreq.session_id and not prompt.partial:
            self._remember_size(rreq.session_id, len(raw), prompt.prompt_tokens)
        self.check_length(rreq, call, dialect)
        ticket = await self._admit(request, rreq.band, rreq.tenant, rreq.admission_tokens, dialect)
        if ticket.waited_s > ADMITTED_AT_ONCE_S:
            self._call_off(spec)  # it waited its turn at the gate: it goes when admitted
        d = self.core.open(rreq, ticket)
        self._track(d)
        try:
            tail = _Tail(prompt, len(raw)) if prompt.partial else None
            if tail is not None:
                self.metrics.prompt_heads.inc()
            turn = _Turn(api, dialect, parsed, call, d, tail, spec)
            # Until the answer starts, a client that goes away cancels the upstream call (the
            # worker aborts the request); once streaming, the response itself watches.
            return await unless_disconnected(
                request, self._dispatch(turn, record.worker if record else None, hashing_s)
            )
        except BaseException:
            self.core.close(d)  # a no-op when the outcome was already recorded
            raise

    async def _speculate(
        self,
        api: ApiName,
        headers: Mapping[str, str],
        key: KeyPolicy,
        raw: bytes,
        client: str | None,
    ) -> _Speculation | None:
        """Send a calm session's next turn to its worker now, body as it came, before it is
        parsed, keyed and routed — what the router would decide anyway, most of the time
        (docs/router.md, "Speculative dispatch"). Only a streamed chat or completions call that
        asks for usage (its body is what the worker gets, unchanged) of a session named by a
        header, on record and live (`FlowConfig.live_session_s`: the ``continuing`` band), whose
        worker is healthy with nothing in flight, with nothing queued at the flow gate, the pool
        not split or draining, under the default policy, and whose body grew since the last turn
        by fewer tokens (at the last turn's tokens per byte) than any rule that weighs them
        (`_growth_cap`). `_adoptable` decides later whether the answer is the request's."""
        if not self.settings.speculate or api not in ("chat", "completions"):
            return None
        if getattr(self.core.policy, "kind", None) != STICKY_KIND or self.flow.waiting:
            return None
        if self._pool_roles is not None and self._pool_roles.mode != "colocated":
            return None
        raw_id, source = session_id_from(headers, "")
        if source != "header" or not _asks_usage(raw):
            return None
        session = tenant_and_session(key, raw_id, client)[1]
        last = self._last_sizes.get(session)
        if last is None or len(raw) < last[0]:
            return None
        bytes_, tokens = last
        grown = (len(raw) - bytes_) * tokens / max(bytes_, 1)
        if 1.25 * grown + 2 * self.hasher.block_size >= self._growth_cap():
            return None
        record = await self.sessions.get(session)
        live = self._live_session_s
        if record is None or not record.worker or live is None:
            return None
        if time.time() - record.updated > live:
            return None
        ep = next((e for e in self.endpoints() if e.id == record.worker), None)
        if ep is None or not ep.can_decode:
            return None
        load = self.core.loads.load(ep.id)
        if not load.healthy or load.in_flight:
            return None
        written = asyncio.get_running_loop().create_future()

        def sent() -> None:
            if not written.done():
                written.set_result(None)

        call = self.upstreams.post_now(ep, API_PATHS[api], raw, sent)
        # the body goes out before the parse (or the call fails first: `open_stream` says so)
        await asyncio.wait([written, call], return_when=asyncio.FIRST_COMPLETED)
        return _Speculation(ep.id, call, record)

    def _growth_cap(self) -> int:
        """The fewest uncached tokens that some rule weighs: the prefill in pieces (where it
        applies), a disaggregation split of a turn on its own worker, and the policy's margin
        for leaving an idle warm worker (`prefill_tok_s` × `margin_s`: an idle warm worker's
        estimated TTFT within the margin is never left)."""
        sticky = getattr(self.core.policy, "params", None)
        cap = int(sticky.prefill_tok_s * sticky.margin_s) if sticky is not None else 0
        protect = self._pool_roles is None or self._pool_roles.mode != "colocated"
        if self._pieces is not None and protect:
            cap = min(cap, self._pieces.min_tokens)
        disagg = self.core.disaggregation
        params = getattr(disagg, "params", None)
        if params is not None and params.enabled and not params.keep_warm_local:
            cap = min(cap, params.min_uncached_tokens)
        return cap

    def _remember_size(self, session: str, body_bytes: int, tokens: int) -> None:
        sizes = self._last_sizes
        sizes[session] = (body_bytes, tokens)
        sizes.move_to_end(session)
        if len(sizes) > LAST_SIZES:
            sizes.popitem(last=False)

    def _adoptable(self, turn: _Turn, d: RouteDecision) -> bool:
        """Is the speculative call's answer this request's: the decision is that worker, on
        the first attempt, with no prefill leg, and the body the router would send is the
        client's (a streamed call that asked for usage)? `_dispatch` asks once per attempt
        and calls off what is not; the pace hold and the pieces call it off when they act, and
        `_stream` takes what is still pending."""
        spec, disp = turn.spec, turn.dispatch
        return (
            spec is not None
            and spec.state == "pending"
            and d.decode.id == spec.worker
            and d.prefill is None
            and disp.attempts == 0
            and not disp.spilled
            and turn.call.stream
            and _unchanged(turn.call.body, turn.parsed.raw)
        )

    def _call_off(self, spec: _Speculation | None) -> None:
        """Abort a speculative call not taken (the worker sees its client go)."""
        if spec is None or spec.state != "pending":
            return
        spec.state = "called off"
        self.metrics.speculations.labels("called_off").inc()
        call = spec.call
        if not call.done():
            call.cancel()
        elif not call.cancelled() and call.exception() is None:
            call.result().close()

    def check_length(
        self, rreq: RouteRequest, call: UpstreamCall, dialect: api_errors.ErrorDialect = "openai"
    ) -> None:
        """Refuse, before any upstream call, a prompt that no candidate worker can hold."""
        limit = self.max_model_len()
        if limit is None:
            return
        prompt = rreq.prompt_tokens
        if not self.hasher.precise and not isinstance(call.prompt, list):
            # Approximate mode counts pseudo-tokens: refuse only what is over even at half.
            prompt = prompt // APPROX_LENGTH_SLACK
        if prompt + (call.max_tokens or 1) > limit:
            raise _too_long(rreq.prompt_tokens, call, limit).for_api(dialect)

    def max_model_len(self) -> int | None:
        """The smallest `max_model_len` among the decode-capable workers that report one."""
        lens = [e.max_model_len for e in self.endpoints() if e.can_decode and e.max_model_len]
        return min(lens) if lens else None

    async def route_request(
        self,
        call: UpstreamCall,
        headers: Mapping[str, str],
        key: KeyPolicy = ANONYMOUS,
        model: str = "",
        body_bytes: int = 0,
        client: str | None = None,
        head: bool = False,
        record: SessionRecord | None = None,
    ) -> tuple[RouteRequest, SessionRecord | None, PromptKey]:
        """What routing sees of a client request (the HTTP door and the ext_proc picker alike):
        its tenant and session (`tenant_and_session`), the prompt's token count and block
        hashes, its band, and the session's record; and the prompt's key. `headers` have
        lower-case names. `body_bytes`: the request body's size (large ones are hashed off the
        event loop). `client`: the caller's address (the fairness tenant of anonymous callers).
        `head`: the key may be a head key (`HEAD_CHARS`; the caller finishes it, `_settle`) —
        for a prompt that starts a session (none on record), in one KV geometry, provably
        within the length limit. `record`: the session's record when the caller read it
        already (a speculative call's), not read again."""
        limit = self.max_model_len()  # on the loop: the endpoint list is not shared with threads
        raw_id = await _off_loop(body_bytes, _session_of, call, headers)
        tenant, session_id = tenant_and_session(key, raw_id, client)
        if record is None:
            record = await self.sessions.get(session_id)
        # The record first: a session on record has its tip matched whole, and so do prompts
        # in a pool of several geometries — no head to compute and throw away.
        head = head and record is None and self._one_geometry()
        head_chars, max_chars = self._head_limits(call, limit) if head else (0, None)
        prompt = await _off_loop(
            body_bytes, self._prompt_key, call, limit, head_chars, max_chars, session_id
        )
        while prompt.partial and not self._head_decides(prompt):
            prompt = await _off_loop(body_bytes, prompt.grow)
        band = band_of(key, headers, record, call, prompt.block_hashes, self._live_session_s)
        resumed = 0
        if (
            band == "continuing"
            and record is not None
            and extends_tip(record.tip, prompt.block_hashes)
        ):  # the tip is this prompt's prefix (a live session's other calls: no resume)
            resumed = min(tip_blocks(record.tip) * self.hasher.block_size, prompt.prompt_tokens)
        rreq = RouteRequest(
            request_id=headers.get("x-request-id") or f"req-{uuid.uuid4().hex[:20]}",
            prompt_tokens=prompt.prompt_tokens,
            block_hashes=prompt.block_hashes,
            hashes_for=prompt.hashes_for,  # workers of another KV geometry
            token_ids=lambda: prompt.token_ids,  # the prefill in pieces (`flow.prefill_piece_*`)
            session_id=session_id,
            turn=(record.turns if record is not None else 0),
            band=band,
            resumed_tokens=resumed,
            max_tokens=call.max_tokens or self.settings.default_max_tokens,
            model=model,
            tenant=tenant,
        )
        return rreq, record, prompt

    def _prompt_key(
        self,
        call: UpstreamCall,
        limit: int | None,
        head_chars: int = 0,
        max_chars: int | None = None,
        session: str | None = None,
    ) -> PromptKey:
        """The prompt's key (`PromptHasher.key`); a session's turn is keyed from its last
        (`session`: the scoped session id)."""
        try:
            return self.hasher.key(
                call, limit, head_chars=head_chars, max_chars=max_chars, session=session
            )
        except PromptTooLong as exc:  # refused without tokenizing all of it
            raise _too_long(exc.floor, call, limit or 0, at_least=True) from exc

    def _head_limits(self, call: UpstreamCall, limit: int | None) -> tuple[int, int | None]:
        """`head_chars` and `max_chars` of `PromptHasher.key`: a head key only for a prompt
        that `check_length` passes whatever its count (approximate tokens: one character or
        more each)."""
        if limit is None:
            return HEAD_CHARS, None
        room = limit - (call.max_tokens or 1)
        return (HEAD_CHARS, room * APPROX_LENGTH_SLACK) if room > 0 else (0, None)

    def _one_geometry(self) -> bool:
        g = self.core.config.geometry
        return all((e.geometry or g) is g for e in self.endpoints())

    def _head_decides(self, prompt: PromptKey) -> bool:
        """Does the head key decide every worker's hit? It does when no worker holds all of
        its blocks (engine events or predictions): a hit is a run from the first block."""
        hashes = prompt.block_hashes
        if not hashes:
            return False
        g = self.core.config.geometry
        hits = self.core.index.match(
            hashes, None, block_size=g.block_size, sliding_window=g.sliding_window
        )
        return max((h.full_blocks for h in hits.values()), default=0) < len(hashes)

    async def _settle(self, turn: _Turn) -> None:
        """The prompt's whole key, when the request went on its head (`_Tail`): tokenize and
        hash the rest off the loop (once), then rebook the dispatch with the exact numbers
        (`RoutingCore.amend`). A failure leaves the head's numbers in place."""
        tail = turn.tail
        if tail is None:
            return
        if tail.task is None:
            tail.task = asyncio.ensure_future(self._whole_key(turn.dispatch, tail))
        try:
            await asyncio.shield(tail.task)
        except Exception:  # logged by `_whole_key`
            pass

    def _start_settle(self, turn: _Turn) -> None:
        """Start keying the prompt whole (`_settle`) without waiting for it: a piece of a prompt
        that went on its head is on its way, and the worker prefills it meanwhile."""
        tail = turn.tail
        if tail is not None and tail.task is None:
            tail.task = asyncio.ensure_future(self._whole_key(turn.dispatch, tail))

    async def _whole_key(self, d: Dispatch, tail: _Tail) -> None:
        try:
            full = await _off_loop(tail.body_bytes, tail.key.complete)
        except Exception:
            log.exception("router.prompt_rest_failed", request_id=d.request.request_id)
            raise
        self.core.amend(
            d,
            dataclasses.replace(
                d.request,
                prompt_tokens=full.prompt_tokens,
                block_hashes=full.block_hashes,
                hashes_for=full.hashes_for,
                token_ids=lambda: full.token_ids,
            ),
        )

    async def _admit(
        self,
        request: Request,
        band: Band,
        tenant: str,
        cost: int,
        dialect: api_errors.ErrorDialect,
    ) -> Ticket:
        try:
            return await unless_disconnected(request, self.flow.admit(band, tenant, cost))
        except Shed as shed:
            if shed.http_status == 429:
                raise api_errors.rate_limited(shed.retry_after_s, api=dialect) from shed
            raise api_errors.overloaded(shed.retry_after_s, api=dialect) from shed

    def _route(self, d: Dispatch, warm: str | None, dialect: Any) -> RouteDecision:
        eps = self.endpoints()
        live = {e.id for e in eps}
        try:
            # predictions once the request is on its way (`_sent`): not before the call
            return self.core.route(d, eps, warm if warm in live else None, predict=False)
        except NoCandidates as exc:
            err = api_errors.overloaded(5.0, api=dialect)
            raise dataclasses.replace(
                err, message=f"no worker can serve this request now ({exc}); retry in 5 s"
            ) from exc

    async def _dispatch(self, turn: _Turn, warm: str | None, hashing_s: float) -> Response:
        d = turn.dispatch
        rreq = d.request
        while True:
            t0 = time.perf_counter()
            decision = self._route(d, warm, turn.dialect)
            if not self._adoptable(turn, decision):
                self._call_off(turn.spec)
            self.metrics.decision_seconds.observe(time.perf_counter() - t0 + hashing_s)
            hashing_s = 0.0
            sent = self._sent(d, decision, turn)
            protect = self._pool_roles is None or self._pool_roles.mode != "colocated"
            beside = self._first_beside_others(d, decision)
            if turn.tail is not None and (
                decision.prefill is not None or (protect and self._sized_by_turn_rules(d))
            ):
                await self._settle(turn)  # a prefill leg, a hold or pieces go on the whole prompt
            if decision.prefill is not None:
                self.core.predict(d)  # the prefill leg comes first, and may take seconds
            if d.spilled:
                self.metrics.prefill_spills.inc()
                if getattr(d.ticket, "spill_lull", False):
                    self.metrics.prefill_lull_spills.inc()
            try:
                if self._pace_hold is not None and protect:
                    await self._hold_for_pace(d, self._pace_hold, turn.spec)
                if self._pieces is not None and protect:
                    await self._prefill_in_pieces(turn, decision, self._pieces)
                if beside:
                    await self._prefill_first_in_pieces(turn, decision)
                if turn.call.stream:
                    return await self._stream(turn, decision, sent)
                return await self._unary(turn, decision, sent)
            except UpstreamError as err:
                self.core.retry(d, err.worker)
                if d.attempts > self.settings.max_retries:
                    self.core.fail(d)
                    raise api_errors.upstream_failed(str(err), api=turn.dialect) from err
                self.metrics.retries.labels(err.reason).inc()
                log.warning(
                    "router.retry", request_id=rreq.request_id, worker=err.worker, error=str(err)
                )
            except APIError:
                self.core.fail(d, answered=True)  # the worker refused it: the client's fault
                raise
            finally:
                sent()

    def _sized_by_turn_rules(self, d: Dispatch) -> bool:
        """Could the pace hold (continuing turns) or the prefill in pieces (continuing turns,
        and first turns spilled to their decode worker) weigh this request's uncached tokens?
        Then a prompt routed on its head is keyed whole before the call; a new session's,
        never weighed by either, goes on its head."""
        band = d.request.band
        return (self._pace_hold is not None and band == "continuing") or (
            self._pieces is not None and (band == "continuing" or d.spilled)
        )

    def _sent(self, d: Dispatch, decision: RouteDecision, turn: _Turn) -> Callable[[], None]:
        """What follows an attempt's decision once its request is on its way to the worker
        (or the attempt ended before that), once: the prompt's whole key when it went on its
        head (`_settle`), the index predictions and the decision's metrics and log line. Off
        the path from the decision to the upstream call, where a 100K-token prompt's
        predictions took 0.3–0.4 ms."""
        pending = True

        def record() -> None:
            if d.decision is decision:
                self.core.predict(d)
            self._record_decision(decision, d.request)

        async def settle_then_record() -> None:
            await self._settle(turn)
            record()

        def done() -> None:
            nonlocal pending
            if pending:
                pending = False
                tail = turn.tail
                if tail is None or (tail.task is not None and tail.task.done()):
                    record()
                else:
                    task = asyncio.ensure_future(settle_then_record())
                    task.add_done_callback(_discard_result)

        return done

    async def _hold_for_pace(
        self, d: Dispatch, rule: PaceHold, spec: _Speculation | None = None
    ) -> None:
        """Wait while the pace hold says so (`beamserve.router.flow.pace_hold`); the request
        stays routed and booked meanwhile (a client that leaves cancels it, as before any
        upstream call)."""
        if not self.core.pace_holds(d, rule):
            return
        self._call_off(spec)  # it waits: the speculative call goes back
        self.core.predict(d)  # routed and booked while it waits
        t0 = self.core.clock()
        while True:
            await asyncio.sleep(rule.poll_s)
            if not self.core.pace_holds(d, rule):
                break
        held = self.core.clock() - t0
        expired = self.core.pace_hold_left(d, rule) <= 0
        self.metrics.pace_holds.labels("expired" if expired else "released").inc()
        self.metrics.pace_hold_seconds.inc(held)
        log.info(
            "router.pace_hold",
            request_id=d.request.request_id,
            worker=d.decision.decode.id if d.decision else None,
            held_s=round(held, 3),
            expired=expired,
        )

    def _first_piece(self, ep: Endpoint) -> int | None:
        """A first turn's piece on `ep` (`first_piece_size`): `flow.prefill_first_piece_tokens`,
        else the worker's reported step budget less room for the decodes that may share its
        steps (`LoadBook.decodes_beside`); None: off."""
        if not self._first_pieces:
            return None
        sized = self._first_piece_tokens is None and ep.step_budget is not None
        decodes = self.core.loads.decodes_beside(ep.id) if sized else None
        return first_piece_size(
            self._first_piece_tokens, ep.step_budget, self.hasher.block_size, decodes
        )

    def _first_beside_others(self, d: Dispatch, decision: RouteDecision) -> bool:
        """Is this a new session's first turn that prefills on its decode worker while other
        sessions live there, as this replica sees them (one streaming there, or one resting
        between turns: `LoadBook.lives_beside`)? With `flow.prefill_first_pieces` on, it goes
        in pieces (`beamserve.router.flow.pieces`, "First turns beside live sessions")."""
        if not self._first_pieces or d.request.band != "new" or d.flight is None:
            return False  # before reading the book: this runs for every attempt
        return wants_first_pieces(
            self._first_piece(decision.decode),
            d.request.band,
            decision.prefill is not None,
            d.spilled,
            d.flight.prefill_tokens,
            self.core.loads.lives_beside(decision.decode.id),
        )

    async def _prefill_in_pieces(
        self, turn: _Turn, decision: RouteDecision, rule: PrefillPieces
    ) -> None:
        """Send the prompt's growing prefixes to its decode worker first, when the rule says so
        (`beamserve.router.flow.pieces`); any failure just ends the pieces."""
        d = turn.dispatch
        rreq, f = d.request, d.flight
        if f is None or rreq.token_ids is None:
            return
        split = decision.prefill is not None
        if not wants_pieces(rule, rreq.band, split, f.prefill_tokens, spilled=d.spilled):
            return
        await self._send_pieces(turn, decision, rule.piece_tokens)

    async def _prefill_first_in_pieces(self, turn: _Turn, decision: RouteDecision) -> None:
        """A first turn beside live sessions (`_first_beside_others`): its prefixes in pieces
        (`_first_piece`), when it still has more than one piece uncached. One that went on its
        head (`_Tail`) is keyed whole while its first piece prefills (`_send_pieces`)."""
        d, piece = turn.dispatch, self._first_piece(decision.decode)
        f = d.flight
        if piece is None or f is None or d.request.token_ids is None:
            return
        if f.prefill_tokens > piece:
            await self._send_pieces(turn, decision, piece)

    @staticmethod
    def _keyed_whole(turn: _Turn) -> bool:
        """Is the request's key its whole prompt's (not routed on its head, or settled)?"""
        tail = turn.tail
        return tail is None or (tail.task is not None and tail.task.done())

    async def _head_for(self, turn: _Turn, tokens: int) -> Sequence[int]:
        """At least the prompt's first `tokens` token ids (all of them if it has fewer): from
        the request's key, or, when it went on its head (`_Tail`) and the whole key is not
        there yet, from its head grown until it covers them — not the whole prompt's."""
        tail = turn.tail
        if tail is None or self._keyed_whole(turn):
            token_ids = turn.dispatch.request.token_ids
            assert token_ids is not None
            return token_ids()
        head = tail.key
        while head.partial and len(head.token_ids) < tokens:
            head = await _off_loop(tail.body_bytes, head.grow, 2)
        return head.token_ids

    async def _send_pieces(self, turn: _Turn, decision: RouteDecision, piece_tokens: int) -> None:
        """The prompt's prefixes, `piece_tokens` more each, to the decode worker, one after
        the other (`piece_cuts`); any failure just ends them. A prompt that went on its head
        sends its first piece from the head (`_head_for`) and is keyed whole (`_settle`) once
        that piece is on its way: the rest is tokenized while the worker prefills the piece,
        and the next pieces are cut from the exact length."""
        d = turn.dispatch
        rreq, f = d.request, d.flight
        assert f is not None and rreq.token_ids is not None
        block = self.hasher.block_size
        cuts = piece_cuts(rreq.prompt_tokens, f.prefill_tokens, piece_tokens, block)
        if not cuts:
            return
        cached = rreq.prompt_tokens - f.prefill_tokens  # the head decides the hit: exact
        ids = await self._head_for(turn, cuts[0])
        whole = self._keyed_whole(turn)
        self._call_off(turn.spec)  # the pieces go first
        if whole:
            self.core.predict(d)  # (else once the prompt is keyed whole: the whole prompt's)
        model = turn.call.body.get("model") or rreq.model or self.settings.served_models[0]
        ep, sent, t0 = decision.decode, 0, self.core.clock()
        outcome = "done"
        primed = cached  # the prompt's tokens the worker holds so far
        while cuts and cuts[0] < len(ids):
            n = cuts.pop(0)
            await self._yield_to_short_turns(ep.id, f)
            body = {"model": model, "prompt": ids[:n], "max_tokens": 1, "stream": False}
            try:
                await self.upstreams.post(
                    ep,
                    "/v1/completions",
                    body,
                    self.upstreams.first_byte_timeout_s,
                    on_sent=None if whole else lambda: self._start_settle(turn),
                )
            except (UpstreamError, APIError) as exc:
                outcome = "failed"
                log.warning(
                    "router.prefill_piece_failed",
                    request_id=rreq.request_id,
                    worker=ep.id,
                    tokens=n,
                    error=str(exc),
                )
                break
            sent += 1
            if not whole:  # keyed whole while the worker prefilled this piece (`amend`)
                await self._settle(turn)
                whole = True
                self.core.predict(d)
                ids = await self._head_for(turn, 0)
                cuts = [c for c in piece_cuts(len(ids), len(ids) - cached, piece_tokens, block)
                        if c > n]  # fmt: skip
            # that piece is prefilled: it waits on the worker no longer (`LoadBook.prefilled`)
            self.core.loads.prefilled(f, n - primed)
            primed = n
        await self._settle(turn)  # the request itself goes on the whole prompt
        if outcome == "done":  # the request's own remainder is a piece too
            await self._yield_to_short_turns(ep.id, f)
        self.metrics.prefill_pieces.inc(sent)
        self.metrics.pieced_prefills.labels(outcome).inc()
        d.pieced_tokens = primed if sent else 0
        log.debug(
            "router.prefill_pieces",
            request_id=rreq.request_id,
            worker=ep.id,
            pieces=sent,
            primed_tokens=d.pieced_tokens,
            seconds=round(self.core.clock() - t0, 3),
        )

    async def _yield_to_short_turns(self, worker: str, f: Flight) -> None:
        """Before a piece, and before the request itself after its last piece: while a short
        turn of this replica waits on `worker` for its first token (`LoadBook.short_prefills`,
        `flow.prefill_piece_yield_tokens`), hold it, for `prefill_piece_yield_max_s` at most —
        the turn's prefill then takes a short step of its own, not one beside a whole piece
        (`beamserve.router.flow.pieces`, "Pieces yield to short turns")."""
        cfg = self.flow.config
        limit, loads = cfg.prefill_piece_yield_tokens, self.core.loads
        if limit is None:
            return
        deadline, waited = time.monotonic() + cfg.prefill_piece_yield_max_s, False
        while loads.short_prefills(worker, limit, exclude=f):
            if time.monotonic() >= deadline:
                self.metrics.piece_yields.labels("bounded").inc()
                return
            waited = True
            await asyncio.sleep(_YIELD_POLL_S)
        if waited:
            self.metrics.piece_yields.labels("answered").inc()

    def _check_pieces(self, d: Dispatch, usage: Mapping[str, Any]) -> None:
        """Count a prefill in pieces whose request found less cached than its pieces sent
        (the router's tokens are not the engine's, or the cache dropped them)."""
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
        if not isinstance(cached, int) or cached >= d.pieced_tokens:
            return
        self.metrics.prefill_pieces_missed.inc()
        log.warning(
            "router.prefill_pieces_missed",
            request_id=d.request.request_id,
            primed_tokens=d.pieced_tokens,
            cached_tokens=cached,
        )

    def _record_decision(self, d: RouteDecision, rreq: RouteRequest) -> None:
        self.metrics.decisions.labels(d.reason or "unknown").inc()
        kind = d.expected_hit.kind
        self.metrics.hits.labels(kind).inc()
        self.metrics.hit_tokens.labels(kind).inc(self.core.hit_tokens(rreq, d))
        if d.prefill is not None:
            self.metrics.disaggregated.inc()
        log.info(
            "router.decision",
            request_id=rreq.request_id,
            session_id=rreq.session_id,
            band=rreq.band,
            decode=d.decode.id,
            prefill=d.prefill.id if d.prefill else None,
            reason=d.reason,
            hit=kind,
            hit_blocks=d.expected_hit.full_blocks,
            prompt_tokens=rreq.prompt_tokens,
        )

    def _headers(self, d: RouteDecision, rreq: RouteRequest) -> dict[str, str]:
        out = {SESSION_HEADER: rreq.session_id or ""}
        if self.settings.debug_header:
            hit = d.expected_hit
            out[ROUTE_HEADER] = (
                f"decode={d.decode.id}; prefill={d.prefill.id if d.prefill else '-'}; "
                f"reason={d.reason}; hit={hit.kind}:{hit.full_blocks}/"
                f"{len(rreq.block_hashes)} blocks; band={rreq.band}"
            )
        return out

    async def _finish(
        self, d: Dispatch, usage: Mapping[str, Any], *, streamed: bool = True
    ) -> None:
        """The answer ended well: its `usage` (the worker's, OpenAI-shaped) closes the books."""
        if d.pieced_tokens:
            self._check_pieces(d, usage)
        binding = self.core.finish(d, int(usage.get("completion_tokens", 0)), streamed=streamed)
        if binding is not None:
            await self.sessions.bind(
                binding.session_id,
                binding.worker,
                turn_tokens=binding.turn_tokens,
                tenant=binding.tenant,
                tip=binding.tip,
            )

    async def _unary(self, turn: _Turn, d: RouteDecision, sent: Callable[[], None]) -> Response:
        api, _dialect, parsed, call, dispatch, _tail, _spec = turn  # (called off: not streamed)
        upstream = await self.upstreams.unary(
            d, call, self._on_pd_fallback, self.core.prefill_hook(dispatch), sent
        )
        await self._settle(turn)  # the books take the whole prompt before the first token
        self.core.first_token(dispatch)
        upstream.pop("kv_transfer_params", None)
        await self._finish(dispatch, upstream.get("usage") or {}, streamed=False)
        model = parsed.model or self.settings.served_models[0]
        if api == "messages":
            body = to_anthropic_message(upstream, model=model, stop_sequences=call.stop_sequences)
        elif api == "responses":
            body = to_responses_object(upstream, request=parsed.request, model=model)  # type: ignore[arg-type]
        else:
            body = with_model(upstream, parsed.model)
        return JSONResponse(body, headers=self._headers(d, dispatch.request))

    async def _stream(self, turn: _Turn, d: RouteDecision, sent: Callable[[], None]) -> Response:
        api, dialect, parsed, call, dispatch, _tail, spec = turn
        rreq = dispatch.request
        if spec is not None and spec.state == "pending":  # adoptable (`_dispatch` checked)
            spec.state = "adopted"  # the body went out before the decision: its answer is ours
            self.metrics.speculations.labels("adopted").inc()
            sent()
            chunks = await self.upstreams.open_stream(d.decode, spec.call)
        else:
            chunks = await self.upstreams.stream(
                d, call, self._on_pd_fallback, self.core.prefill_hook(dispatch), sent
            )
        model = parsed.model or self.settings.served_models[0]
        translator = translator_for(
            api,
            model=model,
            request=parsed.request if api == "responses" else None,  # type: ignore[arg-type]
            stop_sequences=call.stop_sequences,
            include_usage=call.client_wants_usage,
        )
        try:
            first = await chunks.first()  # UpstreamError before the first byte → retry
            await self._settle(turn)  # the books take the whole prompt before the first token
        except BaseException:
            await chunks.aclose()
            raise
        self.core.first_token(dispatch)

        raw = raw_passthrough_ok(
            api, client_model=parsed.model, worker_model=first[0].get("model") if first else None
        )

        flight = dispatch.flight  # its `tokens`: what was relayed so far (the pace hold's)

        async def body() -> AsyncIterator[bytes]:
            try:
                if raw:  # the worker's bytes, untouched (`SSEScanner` watches them)
                    scanner = chunks.scanner
                    async for data in chunks.raw(strip_usage=not call.client_wants_usage):
                        if flight is not None:
                            flight.tokens = scanner.events
                        yield data
                    usage = chunks.scanner.usage or {}
                else:
                    for c in first:
                        for frame in translator.feed(c):
                            yield frame
                    async for c in chunks:
                        if flight is not None:
                            flight.tokens += 1
                        for frame in translator.feed(c):
                            yield frame
                    for frame in translator.finish():
                        yield frame
                    usage = translator.usage or {}
            except (UpstreamError, UpstreamStreamError) as exc:
                log.warning("router.stream_failed", request_id=rreq.request_id, error=str(exc))
                self.core.fail(dispatch, worker=d.decode.id)
                if raw and chunks.scanner.error is not None:  # the worker's own error event
                    yield DONE_FRAME
                    return
                for frame in translator.fail(api_errors.upstream_failed(str(exc), api=dialect)):
                    yield frame
                return
            await self._finish(dispatch, usage)

        async def closed() -> None:
            # Runs however the response ends, even if the body never started (client gone).
            await chunks.aclose()
            self.core.close(dispatch)

        return ClosingStream(
            body(),
            closed,
            media_type="text/event-stream",
            headers=self._headers(d, dispatch.request),
        )

    def _on_pd_fallback(self, reason: str, worker: str) -> None:
        self.metrics.pd_fallbacks.labels(reason).inc()
        self.core.loads.failed(worker)


def tenant_and_session(key: KeyPolicy, session_id: str, client: str | None) -> tuple[str, str]:
    """(fairness tenant, session id scoped to its caller).

    A keyed caller: its key's tenant, and ``tenant/session`` — two API keys whose conversations
    open alike (one system prompt and first message, common for coding agents) are two
    sessions, never one warm worker and one `continuing` band. An anonymous caller: the tenant
    is its address (``anon:ADDRESS``; ``anon:-`` when unknown), never the session id, so a
    caller minting new session ids stays one tenant for least-attained-service fairness; its
    session ids stay unscoped (nothing tells two anonymous callers apart but the address,
    which a shared gateway or NAT would merge)."""
    if key.tenant == ANONYMOUS.tenant:
        return f"anon:{client or '-'}", session_id
    return key.tenant, f"{key.tenant}/{session_id}"


def band_of(
    key: KeyPolicy,
    headers: Mapping[str, str],
    record: SessionRecord | None,
    call: UpstreamCall,
    block_hashes: Sequence[int],
    live_session_s: float | None = None,
    now: float | None = None,
) -> Band:
    """The request's flow-control band.

    ``sheddable``: the key's class or ``x-beamserve-priority: sheddable``. ``continuing``: the
    session has a record whose tip (`sessions.session_tip`, where its last turn's prompt
    reached) this prompt extends — evidence that it is the next turn of that conversation, not
    a new conversation reusing the id, a sub-agent's fresh prompt, or a body that merely
    carries an assistant message. A record without a tip (the last prompt was under two
    blocks: a cheap prompt either way) counts when the request carries an earlier turn.
    With `live_session_s` (`FlowConfig.live_session_s`), a request of a session whose record
    changed within that many seconds (`now`, default the wall clock, against
    `SessionRecord.updated`) counts too, whatever its prompt: an agent that calls a sub-agent
    in the middle of its session, or compacts its history, is blocked on that call as on any
    turn, and in the ``new`` band it waits behind the held first turns of new sessions
    (docs/bench/agentic.md, "Where the 128-agent gap is not"). Everything else: ``new``."""
    if key.priority == "sheddable" or headers.get(PRIORITY_HEADER, "") == "sheddable":
        return "sheddable"
    if record is not None:
        if record.tip:
            if extends_tip(record.tip, block_hashes):
                return "continuing"
        elif is_continuing_turn(call.messages_for_session):
            return "continuing"
        if live_session_s is not None:
            at = time.time() if now is None else now
            if at - record.updated <= live_session_s:
                return "continuing"
    return "new"


async def unless_disconnected(request: Request, aw: Awaitable[T]) -> T:
    """Await `aw` in this task, but cancel it (and raise a 499) if the client goes away
    meanwhile. A watcher task polls the connection every `DISCONNECT_POLL_S`; `aw` itself runs
    inline, so a request that goes straight through pays no hand-off to another task and back
    (two turns of the event loop each, on the way to the worker and on the way back)."""
    task = asyncio.current_task()
    assert task is not None
    gone = False

    async def watch() -> None:
        nonlocal gone
        while True:
            await asyncio.sleep(DISCONNECT_POLL_S)
            if await request.is_disconnected():
                gone = True
                task.cancel()  # lands at `aw`'s await: this task is suspended there
                return

    watcher = asyncio.ensure_future(watch())
    try:
        return await aw
    except asyncio.CancelledError:
        if gone and task.uncancel() == 0:  # the watcher's cancel, not the caller's
            raise api_errors.APIError(499, "client closed the request", "api_error") from None
        raise
    finally:
        watcher.cancel()


# How often `unless_disconnected` looks for a client that went away.
DISCONNECT_POLL_S = 0.25
# Sessions whose last sizes `Router._speculate` keeps (least recently used out).
LAST_SIZES = 65_536
# A request admitted by the flow gate within this long did not wait (a speculative call
# stands); one that waited longer is called off and goes when admitted.
ADMITTED_AT_ONCE_S = 0.001


_USAGE_KEY = b'"include_usage"'


def _asks_usage(raw: bytes) -> bool:
    """Does a body's text say ``"include_usage": true`` (a speculation's first look: the
    parse confirms it, `Router._adoptable`)?"""
    at = raw.rfind(_USAGE_KEY) + len(_USAGE_KEY)
    return at >= len(_USAGE_KEY) and raw[at : at + 24].lstrip(b" \t\r\n:").startswith(b"true")


def _unchanged(body: Mapping[str, Any], raw: Mapping[str, Any]) -> bool:
    """Is the worker call's body the client's, field for field (`to_upstream` copies the
    client's fields and sets the stream's)?"""
    return body.keys() == raw.keys() and all(v is raw[k] or v == raw[k] for k, v in body.items())


def _session_of(call: UpstreamCall, headers: Mapping[str, str]) -> str:
    """The request's session id as the client gave it (a header) or as its conversation's
    opening gives it (`session_id_from`)."""
    return session_id_from(headers, call.messages_for_session or call.prompt or "")[0]


def _discard_result(task: asyncio.Future[Any]) -> None:
    """A cancelled call may still have produced its answer: close a stream nobody will send."""
    if task.cancelled() or task.exception() is not None:
        return
    result = task.result()
    if isinstance(result, ClosingStream):
        _BACKGROUND.add(t := asyncio.ensure_future(result.close()))
        t.add_done_callback(_BACKGROUND.discard)


_BACKGROUND: set[asyncio.Future[Any]] = set()


def _too_long(prompt: int, call: UpstreamCall, limit: int, at_least: bool = False) -> APIError:
    wanted = call.max_tokens or 1
    count = f"at least {prompt}" if at_least else str(prompt)
    return APIError(
        400,
        f"this model's maximum context length is {limit} tokens, but the request asks for "
        f"{'more than ' if at_least else ''}{prompt + wanted} ({count} in the prompt, {wanted} "
        "to generate); shorten the prompt or lower max_tokens",
        "invalid_request_error",
        param="messages" if call.messages_for_session else "prompt",
        code="context_length_exceeded",
    )


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers())


class RouterASGI:
    """The router's ASGI app: the inference calls (`API_PATHS`, POST) go straight to
    `Router.handle` and their answer straight to the server's `send` — no framework middleware
    wraps each streamed chunk (`Router.handle` turns every error into an API-shaped answer
    itself). Everything else (`/v1/models`, `/health`, `/metrics`, `/debug/…`, other
    methods) is the FastAPI app `app`."""

    def __init__(self, router: Router, app: FastAPI) -> None:
        self.router, self.app = router, app
        self.state = app.state
        self._apis: dict[str, ApiName] = {path: api for api, path in API_PATHS.items()}

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            api = self._apis.get(scope["path"])
            if api is not None:
                response = await self.router.handle(api, Request(scope, receive))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_router_app(router: Router) -> RouterASGI:
    app = FastAPI(title="beamserve router")
    app.state.router = router

    for api, path in API_PATHS.items():

        async def endpoint(request: Request, _api: ApiName = api) -> Response:  # type: ignore[assignment]
            return await router.handle(_api, request)

        app.add_api_route(path, endpoint, methods=["POST"], response_model=None)

    @app.get("/v1/models")
    async def models() -> Response:
        body = model_list(list(router.settings.served_models))
        limit = router.max_model_len()
        if limit is not None:  # as vLLM reports it: what a request may ask for in all
            for m in body["data"]:
                m["max_model_len"] = limit
        return JSONResponse(body)

    @app.get("/health")
    async def health() -> Response:
        ok = any(e.can_decode for e in router.endpoints())
        return JSONResponse(
            {"status": "ok" if ok else "no-workers", "sessions": router.sessions.health()},
            status_code=200 if ok else 503,
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/admin/workers")
    async def worker_report() -> Response:
        return JSONResponse(router.worker_report())

    @app.get("/debug/workers")
    async def workers() -> Response:
        out = []
        for e in router.endpoints():
            ld = router.core.loads.load(e.id)
            out.append({"id": e.id, "url": e.url, "role": e.role, "load": dataclasses.asdict(ld)})
        return JSONResponse(out)

    return RouterASGI(router, app)
