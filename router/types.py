"""The router's shared vocabulary: endpoints, per-worker views, and what a routing step decides.

These frozen dataclasses are the seams between the router's parts: discovery produces
`Endpoint`s, the prefix index produces `PrefixHit`s, load tracking produces `WorkerLoad`s, the
policies turn a `RouteRequest` plus `WorkerView`s into a `RouteDecision`. None of them knows
about HTTP, ZMQ or Redis.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from beamserve.kvwire.geometry import DEFAULT_GEOMETRY, KVGeometry

Role = Literal["prefill", "decode", "both"]
EngineKind = Literal["vllm", "sglang", "sim", "ref"]
HashScheme = Literal["vllm", "sglang"]
HandoffStyle = Literal["vllm", "sglang"]
# vLLM's `kv_transfer_config.kv_role` values, as a discovery label (`kv_role=kv_both`).
KV_SENDERS = frozenset({"kv_producer", "kv_both"})
KV_RECEIVERS = frozenset({"kv_consumer", "kv_both"})
Band = Literal["continuing", "new", "sheddable"]
BANDS: tuple[Band, ...] = ("continuing", "new", "sheddable")  # highest priority first


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One worker (one engine instance, one TP group) the router can send requests to.

    `id` is stable for the worker's life (the pod name, or `host:port`); `url` is its HTTP base
    (`http://10.0.0.7:8000`). `kv_events` / `kv_replay` are its ZMQ PUB and ROUTER endpoints
    (None: the worker publishes no events). `revision` and `kv_layout` gate P/D pairing: a
    prefill worker and a decode worker pair only when both are equal.

    What the worker says about itself (`beamserve.router.facts`, probed at discovery; None
    until learned): `api` — its HTTP surface and so its P/D handoff style; `kv_send` /
    `kv_receive` — whether it can be the prefill / decode side of a KV handoff (SGLang:
    `disaggregation_mode` from `/server_info`); `bootstrap_port` — SGLang's bootstrap server;
    `max_model_len` — the longest prompt + output it accepts (`/v1/models`); `geometry` — its KV
    geometry (block size, sliding window, hash scheme, event format: `beamserve.kvwire.geometry`)
    as it reported it; None: it reported none, so the router's default geometry (its flags)
    applies (`RoutingCore.geometry_of`); `prefix_caching` — False when it keeps no prompt's KV
    for later requests (SGLang's `disable_radix_cache`, a ref decode worker): the router then
    predicts no blocks there (None: not reported, assumed to cache); `step_budget` — the prompt
    and decode tokens its engine puts into one step (vLLM's `max_num_batched_tokens`, SGLang's
    `chunked_prefill_size`; None: not reported), which sizes a first turn's pieces
    (`beamserve.router.flow.pieces`).
    """

    id: str
    url: str
    role: Role = "both"
    pool: str = "default"
    revision: str = ""
    engine: EngineKind = "sim"
    kv_events: str | None = None
    kv_replay: str | None = None
    kv_layout: str = ""
    labels: tuple[tuple[str, str], ...] = ()
    api: HandoffStyle | None = None
    kv_send: bool | None = None
    kv_receive: bool | None = None
    bootstrap_port: int | None = None
    max_model_len: int | None = None
    geometry: KVGeometry | None = None
    prefix_caching: bool | None = None
    step_budget: int | None = None

    def label(self, name: str) -> str | None:
        for k, v in self.labels:
            if k == name:
                return v
        return None

    @property
    def handoff_style(self) -> HandoffStyle:
        """The P/D handoff this worker speaks: what it reported, else its engine or labels."""
        if self.api is not None:
            return self.api
        return "sglang" if self.engine == "sglang" or self.label("api") == "sglang" else "vllm"

    @property
    def sends_kv(self) -> bool:
        """Can serve the prefill leg of a handoff. Unless the worker said (SGLang's
        `disaggregation_mode`): a `prefill` role or a vLLM `kv_role` label that sends. A `both`
        worker is aggregated serving: it has no KV connector to hand KV over."""
        if self.kv_send is not None:
            return self.kv_send
        return self.role == "prefill" or self.label("kv_role") in KV_SENDERS

    @property
    def receives_kv(self) -> bool:
        """Can serve the decode leg of a handoff (pull the KV a prefill worker computed)."""
        if self.kv_receive is not None:
            return self.kv_receive
        return self.role == "decode" or self.label("kv_role") in KV_RECEIVERS

    @property
    def can_decode(self) -> bool:
        return self.role in ("decode", "both")

    @property
    def can_prefill(self) -> bool:
        return self.role in ("prefill", "both")

    @property
    def hash_scheme(self) -> HashScheme:
        """The KV-event wire format to decode: what the worker reported, else its engine."""
        if self.geometry is not None:
            return self.geometry.event_format
        return "sglang" if self.engine == "sglang" else "vllm"


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """How much of a request's prompt one worker holds, in blocks of that worker's block size
    (`WorkerView.geometry`).

    `full_blocks`: leading blocks whose full-attention KV is resident (a run from block 0).
    `window_ok`: the window blocks covering the last `sliding_window` tokens of those
    `full_blocks` are resident too, so the hit needs no recomputation at all (a *full* hit);
    otherwise the hit is *partial*: the window tail must be recomputed.
    `predicted_blocks`: how many of `full_blocks` come only from routing-time predictions
    (not yet confirmed by the engine's events).
    """

    full_blocks: int = 0
    window_ok: bool = False
    predicted_blocks: int = 0

    @property
    def kind(self) -> Literal["none", "partial", "full"]:
        if self.full_blocks == 0:
            return "none"
        return "full" if self.window_ok else "partial"


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """A worker's load as the router sees it.

    `prefill_tokens` / `decode_tokens`: uncached prompt tokens queued or in prefill, and context
    tokens of requests in decode, both tracked by this router replica for requests it sent.
    `foreign_prefill_tokens` / `foreign_decode_tokens`: the same work of requests the engine
    holds that this replica did not send (other replicas'), estimated from a fresh scrape (0
    when the scrape is stale); `effective_*` = own + foreign (`beamserve.router.load`).
    `queue_len` / `running`: the engine's waiting / running requests — while the scrape is fresh,
    plus this replica's own changes since it; `kv_usage` (fraction 0–1): as scraped;
    `scraped_age_s` seconds ago (None: never scraped); consumers discount stale scrapes.
    `resting_tokens`: context of the sessions resting here — their last turn ended on this
    worker less than the rest window ago and their next has not arrived (`LoadBook.rest`):
    decodes that will be back within a think time. `resting`: how many sessions that is;
    `since_rest_s`: seconds since a session's turn last ended here, resting now or not (None:
    none yet).
    `decode_itl_s`: seconds per output token of the requests that recently finished decoding
    here, as this replica timed them (`LoadBook.decoded`); None when there is no recent one or
    nothing of this replica decodes here now. `decode_itl_alone_s`: the same, of the requests
    that decoded with nothing else of this replica here (None: none yet).
    `head_prefill_tokens`: of `prefill_tokens`, those of this replica's oldest prefill still in
    flight here — the prompt a first-come first-served engine is computing now, not waiting
    (the prefill stage's gate, `FlowConfig.prefill_gate_lead`).
    """

    prefill_tokens: int = 0
    decode_tokens: int = 0
    in_flight: int = 0
    queue_len: int = 0
    running: int = 0
    kv_usage: float = 0.0
    scraped_age_s: float | None = None
    healthy: bool = True
    foreign_prefill_tokens: int = 0
    foreign_decode_tokens: int = 0
    resting_tokens: int = 0
    decode_itl_s: float | None = None
    decode_itl_alone_s: float | None = None
    head_prefill_tokens: int = 0
    resting: int = 0
    since_rest_s: float | None = None

    @property
    def effective_prefill_tokens(self) -> int:
        """Prefill work queued on the worker from every replica (own + foreign, ≥ 0)."""
        return max(self.prefill_tokens, 0) + max(self.foreign_prefill_tokens, 0)

    @property
    def effective_decode_tokens(self) -> int:
        """Decode context on the worker from every replica (own + foreign, ≥ 0)."""
        return max(self.decode_tokens, 0) + max(self.foreign_decode_tokens, 0)


@dataclass(frozen=True, slots=True)
class WorkerView:
    """Everything a policy may look at for one candidate worker. `geometry`: the worker's KV
    geometry (its own report, else the router's default) — `hit` is in its blocks, and every
    part of the router prices the hit with its block size and sliding window."""

    endpoint: Endpoint
    load: WorkerLoad = field(default_factory=WorkerLoad)
    hit: PrefixHit = field(default_factory=PrefixHit)
    warm: bool = False  # the session's bound worker (session store)
    geometry: KVGeometry = DEFAULT_GEOMETRY


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """One request as routing sees it: the prompt's block hashes (index's block size), its
    length, its session and band. `tenant`: whom the request is accounted to for fairness (the API
    key's tenant, or the anonymous caller's address); `session_id` is already scoped to it."""

    request_id: str
    prompt_tokens: int
    block_hashes: tuple[int, ...] = ()
    session_id: str | None = None
    turn: int = 0
    band: Band = "new"
    max_tokens: int = 256
    model: str = ""
    tenant: str = ""
    # Of `prompt_tokens`, how many the session's previous turn already reached (its tip,
    # `sessions.session_tip`: the prefix the warm worker holds unless it evicted it); 0 for a
    # request that does not continue a session.
    resumed_tokens: int = 0
    # The flow controller's saturation signal when routing decided (`RoutingCore.decide` fills
    # it in from `RoutingCore.pool_saturated`): policies that would move work read it.
    pool_saturated: bool = False
    # KV geometry: `block_hashes` are in `geometry` (None: the router's default geometry);
    # `hashes_for(g)` gives the prompt's hashes in another geometry (a worker that reports its
    # own; cached per geometry), None when the prompt's tokens are not known (then a worker of
    # another geometry gets no hit).
    geometry: KVGeometry | None = None
    hashes_for: Callable[[KVGeometry], tuple[int, ...]] | None = field(
        default=None, compare=False, repr=False
    )
    # The prompt's token ids as the worker will see them (`PromptKey.token_ids`, assembled
    # when first called; None when not known): what the prefill in pieces sends.
    token_ids: Callable[[], Sequence[int]] | None = field(default=None, compare=False, repr=False)
    # Other router replicas this one hears through replica sync (`RoutingCore.decide` fills
    # these in): how many, this replica's place among them and itself (ordered by replica id),
    # and the seconds since this replica's previous routing decision. Policies that spread
    # near-ties across replicas read them (`tie_window_s`, `burst_window_s`).
    router_peers: int = 0
    router_rank: int = 0
    since_last_decision_s: float = float("inf")

    @property
    def admission_tokens(self) -> int:
        """The flow-control cost (`FlowController.admit`): the prefill this request is
        expected to add to the pool — the prompt past what its session's previous turn
        reached, at least 1. The saturation level it is weighed against counts uncached prompt
        tokens too, so a continuing turn whose 25K-token prompt is 24K cached costs 1K, not 25K
        (charging the whole prompt held continuing turns back at a pool that had room)."""
        return admission_tokens(self.prompt_tokens, self.resumed_tokens)


def admission_tokens(prompt_tokens: int, resumed_tokens: int = 0) -> int:
    """A request's flow-control cost (`RouteRequest.admission_tokens`): its prompt past the
    `resumed_tokens` its session's previous turn reached, at least 1."""
    return max(prompt_tokens - resumed_tokens, 1)


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """What the router decided for one request.

    `decode`: the worker that answers (and prefills, unless `prefill` is set: then the prompt is
    prefilled there and its KV moved to `decode`). `expected_hit`: the decode worker's (or the
    prefill worker's, when disaggregated) hit. `reason`: a short machine-readable cause
    (`sticky`, `prefix`, `load`, `rebalance`, `no-session`, …); `explain`: human-readable
    detail for the debug header.
    """

    decode: Endpoint
    prefill: Endpoint | None = None
    expected_hit: PrefixHit = field(default_factory=PrefixHit)
    reason: str = ""
    explain: str = ""
    scores: tuple[tuple[str, float], ...] = ()
