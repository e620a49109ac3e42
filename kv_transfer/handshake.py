"""The prefill↔decode handshake over HTTP, and the decode-side pull.

Prefill serves (read-only for peers, one service per prefill worker):

    GET    /kv/v1/agents              KVPeerInfo: per-rank transfer metadata, layout, page size,
                                      KV dtype, pool shape, backend and model fingerprint
    GET    /kv/v1/requests/{id}       RequestKVInfo: seq_len, page tables, lease, checksums
    DELETE /kv/v1/requests/{id}       the decode side is done: free the pages (idempotent)
    POST   /kv/v1/requests/{id}/stage-plan   staged path: plan once now, keep it with the lease
    POST   /kv/v1/requests/{id}/stage    staged path: gather one round into staging buffers
    DELETE /kv/v1/requests/{id}/stage/{round}   give one round's staging buffers back

On `--path staged` decode sends `stage-plan` (on a helper thread) before it plans its own side,
so the two plans overlap and every stage call only gathers (`auto` lets the first stage call
plan, once per request, if it picks staged). Both sides check the same
`plan_digest`, a hash of the plan's inputs.

Decode READs (pulls). Why read rather than write: the decode side owns the destination pages
and knows when it has room, so it allocates first and pulls when ready; the prefill side stays
passive and only holds its pages on a lease, so a decode crash can never make prefill write
into freed memory, and a prefill crash surfaces on the side that must recover (decode
recomputes). This is vLLM NixlConnector's direction; SGLang pushes (WRITE) because its prefill
learns destination pages through the bootstrap server.
"""

from __future__ import annotations

import base64
import dataclasses
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import httpx
import uvicorn
from beamserve.kv_transfer import host_local, kernels
from beamserve.kv_transfer.backends.base import AgentInfo, ReadOp
from beamserve.kv_transfer.compact import CompactPlan, KernelTables, compact_plan, kernel_tables
from beamserve.kv_transfer.cost import (
    LinkModel,
    PathChoice,
    TransferPath,
    choose_host_local,
    choose_path,
    link_for,
    parse_path,
)
from beamserve.kv_transfer.errors import (
    ChecksumMismatchError,
    IncompatiblePeerError,
    KVTransferError,
    LeaseExpiredError,
    LeaseNotFoundError,
    PeerLostError,
    TransferFailedError,
    TransferPlanError,
    TransferTimeoutError,
)
from beamserve.kv_transfer.memory import MemoryKind
from beamserve.kv_transfer.model import BeamModelConfig
from beamserve.kv_transfer.plan import TransferPlan, check_pair, plan_transfer
from beamserve.kv_transfer.staging import (
    DEFAULT_CHUNK_BYTES,
    StagedPlan,
    plan_digest,
    stage_plan,
)
from beamserve.kv_transfer.topology import KVDtype, KVLayout, PoolLayout, PoolTopology, RequestPages
from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel

PROTOCOL = "beamserve-kv/1"


class KVShardGroup(Protocol):
    """A pool's TP shards as the decode side pulls into them: `RankGroup` (one process per
    rank) or an in-process group such as the ref engine's `ShardedKV`."""

    @property
    def layout(self) -> PoolLayout: ...

    @property
    def backend(self) -> str: ...

    @property
    def size(self) -> int: ...

    def read(self, ops_by_rank: dict[int, list[ReadOp]], deadline_s: float) -> list[Any]:
        """Run each rank's reads concurrently; raise the first failure (typed)."""
        ...

    def call_all(self, cmd: str, *args: Any, timeout_s: float = 600.0) -> list[Any]:
        """Run `cmd` (at least `checksums(seq_len, pages)`) on every rank, in rank order."""
        ...


class RankAgentModel(BaseModel):
    rank: int
    backend: str
    name: str
    metadata_b64: str
    base_addr: int
    region_bytes: int
    memory: str = MemoryKind.DRAM.value
    device: int = 0

    def to_info(self) -> AgentInfo:
        return AgentInfo(
            self.backend,
            self.name,
            base64.b64decode(self.metadata_b64),
            self.base_addr,
            self.region_bytes,
            self.memory,
            self.device,
        )


class ModelKVModel(BaseModel):
    num_hidden_layers: int
    layer_types: list[str]
    sliding_window: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    dtype: str


class KVPeerInfo(BaseModel):
    protocol: str = PROTOCOL
    engine_id: str
    backend: str
    model_fingerprint: str
    model: ModelKVModel
    tp_size: int
    page_size: int
    kv_dtype: KVDtype
    layout: KVLayout
    full_pages: int
    window_pages: int
    ranks: list[RankAgentModel]
    # The KV region's memory kind, and each rank's staging pool for the staged path (bytes;
    # 0: this prefill serves only direct reads).
    memory: str = MemoryKind.DRAM.value
    staging_bytes: int = 0


class RequestKVInfo(BaseModel):
    request_id: str
    seq_len: int
    full_pages: list[int]
    window_pages: list[int]
    lease_remaining_s: float
    checksums: dict[str, int] | None = None
    # Small results the decode side needs besides the KV (SGLang's "aux data"): the first
    # generated token, so decode continues exactly where prefill stopped.
    aux: dict[str, int] | None = None


class ErrorBody(BaseModel):
    error: str
    detail: str


class StageRequest(BaseModel):
    """Decode asks prefill to gather one round of the staged plan (or, at `/stage-plan`, only
    to plan it). Prefill plans once per request from the destination's shape and page tables
    (plans are pure), after checking that `digest` is `plan_digest` of the same inputs, and
    keeps the staged plan with the lease: later rounds only gather."""

    dst_tp: int
    dst_full_pages: int
    dst_window_pages: int
    full_pages: list[int]
    window_pages: list[int]
    chunk_bytes: int
    dst_capacity: int
    round: int
    digest: str


class StagedChunkModel(BaseModel):
    chunk_id: int
    src_rank: int
    offset: int  # in the source rank's registered buffer


class StagePlanResponse(BaseModel):
    rounds: int
    digest: str
    plan_s: float  # 0 when the plan was already held


class StageResponse(BaseModel):
    round: int
    rounds: int
    chunks: list[StagedChunkModel]
    gather_s: float


class StagingGroup(Protocol):
    """What the prefill registry needs to run gathers: `RankGroup.call`."""

    def call(self, ranks: Sequence[int], cmd: str, args: Any, timeout_s: float) -> list[Any]: ...

    def call_all(self, cmd: str, *args: Any, timeout_s: float = 600.0) -> list[Any]: ...


@dataclass
class _Lease:
    seq_len: int
    pages: RequestPages
    expires: float
    checksums: dict[str, int] | None
    aux: dict[str, int] | None = None
    staged: dict[str, StagedPlan] = field(default_factory=dict)  # by digest, once per request
    held_tags: set[str] = field(default_factory=set)
    plan_lock: threading.Lock = field(default_factory=threading.Lock)  # one plan per request


class PrefillKVRegistry:
    """What a prefill worker exposes: its ranks' agents and the requests whose KV it holds."""

    def __init__(
        self,
        engine_id: str,
        layout: PoolLayout,
        backend: str,
        agents: Sequence[AgentInfo],
        lease_s: float = 30.0,
        stager: StagingGroup | None = None,
        staging_bytes: int = 0,
        memory: MemoryKind = MemoryKind.DRAM,
    ) -> None:
        self.engine_id, self.layout, self.backend = engine_id, layout, backend
        self.agents, self.lease_s = list(agents), lease_s
        self.stager, self.memory = stager, MemoryKind(memory)
        self.staging_bytes = staging_bytes if stager is not None else 0
        self._stage_lock = threading.Lock()  # one gather at a time on the rank pipes
        self._leases: dict[str, _Lease] = {}
        self._lock = threading.Lock()
        # The most recent releases (bounded: a long-running worker must not grow without end).
        self.released: deque[str] = deque(maxlen=1024)
        self._ended: dict[str, None] = {}  # insertion-ordered, bounded (see _end)

    def peer_info(self) -> KVPeerInfo:
        m, t = self.layout.model, self.layout.topology
        return KVPeerInfo(
            engine_id=self.engine_id,
            backend=self.backend,
            model_fingerprint=m.fingerprint(),
            model=ModelKVModel(
                num_hidden_layers=m.num_hidden_layers,
                layer_types=list(m.layer_types),
                sliding_window=m.sliding_window,
                num_attention_heads=m.num_attention_heads,
                num_key_value_heads=m.num_key_value_heads,
                head_dim=m.head_dim,
                dtype=m.dtype,
            ),
            tp_size=t.tp_size,
            page_size=t.page_size,
            kv_dtype=t.kv_dtype,
            layout=t.layout,
            full_pages=self.layout.full_pages,
            window_pages=self.layout.window_pages,
            ranks=[
                RankAgentModel(
                    rank=r,
                    backend=a.backend,
                    name=a.name,
                    metadata_b64=base64.b64encode(a.metadata).decode(),
                    base_addr=a.base_addr,
                    region_bytes=a.region_bytes,
                    memory=a.memory,
                    device=a.device,
                )
                for r, a in enumerate(self.agents)
            ],
            memory=self.memory.value,
            staging_bytes=self.staging_bytes,
        )

    def publish(
        self,
        request_id: str,
        seq_len: int,
        pages: RequestPages,
        checksums: dict[str, int] | None = None,
        aux: dict[str, int] | None = None,
    ) -> None:
        """Hold a request's KV for `lease_s` seconds (until the decode side releases it)."""
        pages.check("src", self.layout, seq_len)
        with self._lock:
            self._leases[request_id] = _Lease(
                seq_len, pages, time.monotonic() + self.lease_s, checksums, aux
            )
            self._ended.pop(request_id, None)

    def lookup(self, request_id: str) -> RequestKVInfo:
        with self._lock:
            self._expire()
            lease = self._leases.get(request_id)
        if lease is None:
            if request_id in self._ended:
                raise LeaseExpiredError(f"request {request_id}: no KV held (expired or released)")
            raise LeaseNotFoundError(f"request {request_id}: no KV published (yet)")
        return RequestKVInfo(
            request_id=request_id,
            seq_len=lease.seq_len,
            full_pages=lease.pages.full.tolist(),
            window_pages=lease.pages.window.tolist(),
            lease_remaining_s=max(0.0, lease.expires - time.monotonic()),
            checksums=lease.checksums,
            aux=lease.aux,
        )

    def release(self, request_id: str) -> bool:
        with self._lock:
            lease = self._leases.pop(request_id, None)
            found = lease is not None
            if found:
                self.released.append(request_id)
                self._end(request_id)
        if lease is not None:
            self._free_staging(lease.held_tags)
        return found

    def held(self) -> list[str]:
        with self._lock:
            self._expire()
            return sorted(self._leases)

    def stage(self, request_id: str, req: StageRequest, timeout_s: float = 60.0) -> StageResponse:
        """Gather round `req.round` of the request's staged plan into the source ranks' staging
        pools; the buffers stay held until `unstage`, the lease's release, or its expiry."""
        lease, stager = self._staging_lease(request_id)
        staged, _secs = self._staged_plan(request_id, lease, req)
        if not 0 <= req.round < staged.rounds:
            raise TransferPlanError(f"round: {req.round} outside [0, {staged.rounds})")
        from beamserve.kv_transfer.rank import GatherJob

        chunks = staged.in_round(req.round)
        jobs: dict[int, list[GatherJob]] = {}
        for c in chunks:
            jobs.setdefault(c.src_rank, []).append(
                GatherJob(c.chunk_id, c.src_offsets, c.lengths, c.needs_gather)
            )
        tag = _stage_tag(request_id, req.round)
        ranks = sorted(jobs)
        lease.held_tags.add(tag)
        with self._stage_lock:
            results = stager.call(ranks, "gather", lambda r: (tag, jobs[r]), timeout_s)
        out = []
        for r, (offsets, _secs) in zip(ranks, results, strict=True):
            for job, off in zip(jobs[r], offsets, strict=True):
                out.append(StagedChunkModel(chunk_id=job.chunk_id, src_rank=r, offset=off))
        return StageResponse(
            round=req.round,
            rounds=staged.rounds,
            chunks=out,
            gather_s=max((secs for _o, secs in results), default=0.0),
        )

    def prepare(self, request_id: str, req: StageRequest) -> StagePlanResponse:
        """Plan the request's staged transfer now (decode asks while it plans its own side), so
        that its stage calls only gather."""
        lease, _stager = self._staging_lease(request_id)
        staged, secs = self._staged_plan(request_id, lease, req)
        return StagePlanResponse(rounds=staged.rounds, digest=req.digest, plan_s=secs)

    def _staging_lease(self, request_id: str) -> tuple[_Lease, StagingGroup]:
        """The lease a stage or stage-plan call works on, and the staging pool it gathers
        into; refused without a staging pool."""
        stager = self.stager
        if stager is None:
            raise IncompatiblePeerError(
                f"prefill {self.engine_id}: serves direct reads only (no staging pool); use "
                "--path direct, or start prefill with a staging pool"
            )
        with self._lock:
            self._expire()
            lease = self._leases.get(request_id)
        if lease is None:
            raise LeaseExpiredError(f"request {request_id}: no KV held (expired or released)")
        return lease, stager

    def _staged_plan(
        self, request_id: str, lease: _Lease, req: StageRequest
    ) -> tuple[StagedPlan, float]:
        """The lease's staged plan for `req` (planned on first use; seconds spent planning)."""
        with lease.plan_lock:
            staged = lease.staged.get(req.digest)
            if staged is not None:
                return staged, 0.0
            t0 = time.perf_counter()
            dst = PoolLayout(
                self.layout.model,
                PoolTopology(
                    req.dst_tp,
                    self.layout.topology.page_size,
                    self.layout.topology.kv_dtype,
                    self.layout.topology.layout,
                ),
                req.dst_full_pages,
                req.dst_window_pages,
            )
            dst_pages = RequestPages.of(req.full_pages, req.window_pages)
            mine = plan_digest(
                self.layout, dst, lease.seq_len, lease.pages, dst_pages,
                req.chunk_bytes, self.staging_bytes, req.dst_capacity,
            )  # fmt: skip
            if mine != req.digest:
                raise TransferPlanError(
                    f"request {request_id}: staged plans differ (prefill {mine}, decode "
                    f"{req.digest}); run the same beamserve release on both pools"
                )
            plan = plan_transfer(self.layout, dst, lease.seq_len, lease.pages, dst_pages)
            staged = stage_plan(plan, req.chunk_bytes, self.staging_bytes, req.dst_capacity)
            lease.staged[req.digest] = staged
            return staged, time.perf_counter() - t0

    def unstage(self, request_id: str, round_: int) -> None:
        """Return one round's staging buffers to the pools (idempotent)."""
        tag = _stage_tag(request_id, round_)
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is not None:
                lease.held_tags.discard(tag)
        self._free_staging({tag})

    def _free_staging(self, tags: set[str]) -> None:
        if self.stager is None or not tags:
            return
        with self._stage_lock:
            for tag in sorted(tags):
                try:
                    self.stager.call_all("release_staging", tag, timeout_s=10.0)
                except KVTransferError:
                    # A dead rank's pool went with it; the live ranks were released (call
                    # drains every rank before raising).
                    pass

    def _expire(self) -> None:
        now = time.monotonic()
        for rid in [r for r, lease in self._leases.items() if lease.expires < now]:
            lease = self._leases.pop(rid)
            self._end(rid)
            if lease.held_tags:
                # Freed on a helper thread: _expire runs under self._lock.
                threading.Thread(
                    target=self._free_staging, args=(set(lease.held_tags),), daemon=True
                ).start()

    def _end(self, request_id: str) -> None:
        """Remember a recent end, so a late lookup says 410 (gone) rather than 404 (not yet)."""
        self._ended[request_id] = None
        while len(self._ended) > 4096:
            self._ended.pop(next(iter(self._ended)))


def build_handshake_app(registry: PrefillKVRegistry) -> FastAPI:
    app = FastAPI(title="beamserve prefill KV handshake", version=PROTOCOL)

    @app.get("/kv/v1/agents", response_model=KVPeerInfo)
    def agents() -> KVPeerInfo:
        return registry.peer_info()

    @app.get(
        "/kv/v1/requests/{request_id}",
        response_model=RequestKVInfo,
        responses={404: {"model": ErrorBody}, 410: {"model": ErrorBody}},
    )
    def request(request_id: str) -> RequestKVInfo | JSONResponse:
        try:
            return registry.lookup(request_id)
        except LeaseNotFoundError as exc:
            return JSONResponse(status_code=404, content={"error": "not_found", "detail": str(exc)})
        except LeaseExpiredError as exc:
            return JSONResponse(
                status_code=410, content={"error": "lease_expired", "detail": str(exc)}
            )

    @app.delete("/kv/v1/requests/{request_id}", status_code=204)
    def release(request_id: str) -> Response:
        registry.release(request_id)
        return Response(status_code=204)

    @app.post(
        "/kv/v1/requests/{request_id}/stage",
        response_model=StageResponse,
        responses={409: {"model": ErrorBody}, 410: {"model": ErrorBody}, 501: {"model": ErrorBody}},
    )
    def stage(request_id: str, body: StageRequest) -> StageResponse | JSONResponse:
        try:
            return registry.stage(request_id, body)
        except Exception as exc:  # a rank's unexpected failure too: a JSON body for the client
            return _stage_error(exc)

    @app.post(
        "/kv/v1/requests/{request_id}/stage-plan",
        response_model=StagePlanResponse,
        responses={409: {"model": ErrorBody}, 410: {"model": ErrorBody}, 501: {"model": ErrorBody}},
    )
    def stage_plan_(request_id: str, body: StageRequest) -> StagePlanResponse | JSONResponse:
        try:
            return registry.prepare(request_id, body)
        except KVTransferError as exc:
            return _stage_error(exc)

    @app.delete("/kv/v1/requests/{request_id}/stage/{round_}", status_code=204)
    def unstage(request_id: str, round_: int) -> Response:
        registry.unstage(request_id, round_)
        return Response(status_code=204)

    return app


def _stage_tag(request_id: str, round_: int) -> str:
    return f"{request_id}#{round_}"


class HandshakeServer:
    """Serve the handshake app with uvicorn on a background thread (loopback by default)."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("handshake server did not start")
            time.sleep(0.01)
        sock = self._server.servers[0].sockets[0]
        self.host, self.port = sock.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)


def check_peer(peer: KVPeerInfo, local: PoolLayout, backend: str) -> PoolLayout:
    """Refuse an incompatible prefill peer before any I/O; return its pool layout."""

    def refuse(msg: str) -> IncompatiblePeerError:
        return IncompatiblePeerError(f"prefill {peer.engine_id}: {msg}")

    if peer.protocol != PROTOCOL:
        raise refuse(
            f"protocol: speaks {peer.protocol}, we speak {PROTOCOL}; upgrade the older "
            "side so both run the same beamserve release"
        )
    if peer.backend != backend:
        raise refuse(
            f"backend: uses {peer.backend}, decode uses {backend}; configure both "
            "pools with the same transfer backend"
        )
    if peer.model_fingerprint != local.model.fingerprint():
        raise refuse(
            "model_fingerprint: the prefill pool serves a different model "
            f"({peer.model_fingerprint[:12]} ≠ {local.model.fingerprint()[:12]}); "
            "deploy the same checkpoint on both pools"
        )
    if len(peer.ranks) != peer.tp_size:
        raise refuse(
            f"ranks: {len(peer.ranks)} agents published for TP {peer.tp_size}; "
            "wait until every prefill rank is up"
        )
    try:
        model = BeamModelConfig(
            **{**peer.model.model_dump(), "layer_types": tuple(peer.model.layer_types)}
        )
        src = PoolLayout(
            model,
            PoolTopology(peer.tp_size, peer.page_size, peer.kv_dtype, peer.layout),
            peer.full_pages,
            peer.window_pages,
        )
        check_pair(src, local)
    except (TransferPlanError, ValueError) as exc:
        raise refuse(str(exc)) from exc
    return src


def ops_for_rank(plan: TransferPlan, dst_rank: int, agents: Sequence[AgentInfo]) -> list[ReadOp]:
    """The reads destination rank `dst_rank` posts: one per source rank it needs."""
    return [
        ReadOp(agents[p.src_rank], p.dst_offsets, p.src_offsets, p.lengths)
        for p in plan.for_dst(dst_rank)
    ]


@dataclass(frozen=True)
class PullResult:
    plan: TransferPlan | CompactPlan  # compact where the host-local driver ran
    plan_ms: float
    seconds: float
    bytes_moved: int  # on the wire: equals plan.bytes_moved on both paths
    checksums_verified: bool
    path: TransferPath = TransferPath.DIRECT
    descriptors_on_wire: int = 0
    staging_bytes: int = 0  # local gather + scatter copies (not on the wire)
    gather_ms: float = 0.0
    transfer_ms: float = 0.0
    scatter_ms: float = 0.0
    rounds: int = 0
    choice: PathChoice | None = None
    gather_rank_ms: float = 0.0  # the gather copies alone, on the slowest source rank
    driver: str = host_local.RANKS  # who copied: each decode rank, or one host_local launch
    kernel_ms: float = 0.0  # host_local: the launch alone (device events)
    drive_ms: float = 0.0  # host_local: inside the driver (bind, upload, launch, wait)
    driver_in: str = ""  # host_local: the process that drove ("rank0" or "caller")
    phases_ms: dict[str, float] = field(default_factory=dict)  # host_local: see LocalPullStats


class DecodeKVClient:
    """Decode side: fetch a prefill peer's metadata and page table, plan, pull, release.

    `path` picks how: `direct` (the plan's descriptors on the wire), `staged` (gather on the
    prefill ranks, one descriptor per chunk, scatter here; both sides need staging pools) or
    `auto` (the cost model decides per plan; direct where either side has no staging pool).

    `driver` picks who copies a direct pull: `ranks` (each decode rank reads its descriptors),
    `host_local` (one process, one kernel launch for every rank, where every region is on
    this host's one GPU and the group offers `drive_local`; refused with the reason
    otherwise) or `auto` (default, or `BEAMSERVE_KV_DRIVER`): host-local where eligible and
    the cost model's estimate is the smallest.
    """

    def __init__(
        self,
        group: KVShardGroup,
        http_timeout_s: float = 5.0,
        path: TransferPath | str = TransferPath.AUTO,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        driver: str | None = None,
    ) -> None:
        self.group = group
        self.path = parse_path(str(path))
        self.driver = host_local.configured_driver() if driver is None else driver
        # The host-local table's piece order (BEAMSERVE_KV_LOCAL_ORDER, `kernels.local_shape`).
        self._local_order = kernels.local_shape().order
        if self.driver not in host_local.DRIVERS:
            raise TransferPlanError(
                f"driver: {self.driver!r} unknown; choose one of {list(host_local.DRIVERS)}"
            )
        self._local_why: dict[str, str | None] = {}  # per peer URL: why not host-local
        self.chunk_bytes = chunk_bytes
        self._http = httpx.Client(timeout=http_timeout_s)
        self._peers: dict[str, tuple[KVPeerInfo, PoolLayout]] = {}
        # Stage-plan requests run here, beside the local plan (their own HTTP client: one
        # thread uses each).
        self._prep_http = httpx.Client(timeout=http_timeout_s)
        self._prep = ThreadPoolExecutor(1, thread_name_prefix="kv-stage-plan")

    def close(self) -> None:
        self._prep.shutdown(wait=True)
        self._prep_http.close()
        self._http.close()

    def peer(self, url: str, refresh: bool = False) -> tuple[KVPeerInfo, PoolLayout]:
        if refresh or url not in self._peers:
            self._local_why.pop(url, None)
            info = KVPeerInfo.model_validate(self._get(url, "/kv/v1/agents"))
            self._peers[url] = (info, check_peer(info, self.group.layout, self.group.backend))
        return self._peers[url]

    def pull(
        self,
        url: str,
        request_id: str,
        dst_pages: RequestPages,
        deadline_s: float,
        verify_checksums: bool = False,
        path: TransferPath | str | None = None,
    ) -> PullResult:
        """Move one request's KV into `dst_pages` of this decode group, or fail typed within
        `deadline_s`. The prefill lease (and any staging it holds) is released in every case."""
        end = time.monotonic() + deadline_s
        want = self.path if path is None else parse_path(str(path))
        try:
            info, src = self.peer(url)
            req = RequestKVInfo.model_validate(self._get(url, f"/kv/v1/requests/{request_id}"))
            t0 = time.perf_counter()
            src_pages = RequestPages.of(req.full_pages, req.window_pages)
            local = self._host_local(url, info, src, req.seq_len, src_pages, dst_pages, want, end)
            if local is not None:
                result = self._pull_host_local(info, local, t0, end, request_id)
                if verify_checksums:
                    self._verify(req, dst_pages, end)
                    result = dataclasses.replace(result, checksums_verified=True)
                return result
            prepared = self._prepare(
                url, request_id, info, src, req.seq_len, src_pages, dst_pages, want
            )
            plan = plan_transfer(src, self.group.layout, req.seq_len, src_pages, dst_pages)
            staged, choice = self._choose(info, plan, want)
            plan_ms = (time.perf_counter() - t0) * 1e3
            agents = [r.to_info() for r in info.ranks]
            if time.monotonic() >= end:
                raise TransferTimeoutError(f"request {request_id}: deadline spent before reads")
            if staged is not None and choice.path is TransferPath.STAGED:
                result = self._pull_staged(
                    url, request_id, dst_pages, staged, agents, end, prepared
                )
                result = PullResult(
                    plan, plan_ms, result.seconds, result.bytes_moved, False,
                    TransferPath.STAGED, result.descriptors_on_wire, result.staging_bytes,
                    result.gather_ms, result.transfer_ms, result.scatter_ms, result.rounds,
                    choice, result.gather_rank_ms,
                )  # fmt: skip
            else:
                ops = {d: ops_for_rank(plan, d, agents) for d in range(self.group.size)}
                t1 = time.perf_counter()
                self.group.read(ops, end - time.monotonic())
                seconds = time.perf_counter() - t1
                result = PullResult(
                    plan, plan_ms, seconds, plan.bytes_moved, False, TransferPath.DIRECT,
                    plan.descriptors, 0, 0.0, seconds * 1e3, 0.0, 0, choice,
                )  # fmt: skip
            if verify_checksums:
                self._verify(req, dst_pages, end)
                result = dataclasses.replace(result, checksums_verified=True)
            return result
        except PeerLostError:
            self._peers.pop(url, None)  # its metadata is stale once a rank is gone
            self._local_why.pop(url, None)
            raise
        finally:
            self._release(url, request_id)

    def _host_local(
        self,
        url: str,
        info: KVPeerInfo,
        src: PoolLayout,
        seq_len: int,
        src_pages: RequestPages,
        dst_pages: RequestPages,
        want: TransferPath,
        end: float,
    ) -> tuple[CompactPlan, KernelTables, PathChoice, int | None] | None:
        """The compact plan, its kernel table, the choice and the driver's token for the pull
        made ready (`prepare_local`, where the group has it: part of the plan's time), where
        this pull goes through the host-local driver; None where it goes through the ranks."""
        if self.driver == host_local.RANKS or want is TransferPath.STAGED or not seq_len:
            return None
        forced = self.driver == host_local.DRIVER
        memory = MemoryKind(getattr(self.group, "memory", MemoryKind.DRAM))
        try:
            link: LinkModel | None = link_for(memory, self.group.backend)
        except TransferPlanError:
            link = None
        if url not in self._local_why:
            refusal = getattr(self.group, "host_local_refusal", None)
            if refusal is None or not hasattr(self.group, "drive_local"):
                why: str | None = "host_local: this decode group has no host-local driver"
            elif link is None or link.local_fixed_s is None:
                why = f"host_local: no host-local driver for {memory.value}/{self.group.backend}"
            else:
                why = refusal([r.to_info() for r in info.ranks])
            self._local_why[url] = why
        why = self._local_why[url]
        if why is not None:
            if forced:
                raise IncompatiblePeerError(f"prefill {info.engine_id}: {why}")
            return None
        assert link is not None  # no refusal: the link has a host-local model
        compact = compact_plan(src, self.group.layout, seq_len, src_pages, dst_pages)
        here = int(getattr(self.group, "staging_bytes", 0) or 0)
        staging = info.staging_bytes > 0 and here > 0
        choice = choose_host_local(compact, link, want, forced, staging)
        if choice is None:
            return None
        tables = kernel_tables(compact, order=self._local_order)
        token: int | None = None
        prepare = getattr(self.group, "prepare_local", None)
        if prepare is not None:
            left = end - time.monotonic()
            if left <= 0:
                raise TransferTimeoutError(f"prefill {info.engine_id}: deadline spent planning")
            token = prepare(tables, [r.to_info() for r in info.ranks], left)
        return compact, tables, choice, token

    def _pull_host_local(
        self,
        info: KVPeerInfo,
        local: tuple[CompactPlan, KernelTables, PathChoice, int | None],
        t0: float,
        end: float,
        request_id: str,
    ) -> PullResult:
        compact, tables, choice, token = local
        plan_ms = (time.perf_counter() - t0) * 1e3
        agents = [r.to_info() for r in info.ranks]
        remaining = end - time.monotonic()
        if remaining <= 0:
            raise TransferTimeoutError(f"request {request_id}: deadline spent before reads")
        t1 = time.perf_counter()
        group = cast(Any, self.group)
        if token is None:
            stats = group.drive_local(tables, agents, remaining)
        else:
            stats = group.drive_local(tables, agents, remaining, token=token)
        t2 = time.perf_counter()
        seconds = t2 - t1
        phases = {k: round(v * 1e3, 4) for k, v in stats.phases.items()}
        if stats.entered:  # perf_counter is one clock for the processes of a host
            phases["pipe_in"] = round((stats.entered - t1) * 1e3, 4)
            phases["pipe_out"] = round((t2 - stats.left) * 1e3, 4)
        return PullResult(
            compact, plan_ms, seconds, stats.bytes_moved, False, TransferPath.DIRECT,
            compact.descriptors, 0, 0.0, seconds * 1e3, 0.0, 0, choice, 0.0,
            host_local.DRIVER, stats.kernel_s * 1e3, stats.seconds * 1e3, stats.where, phases,
        )  # fmt: skip

    def _stage_body(self, dst_pages: RequestPages, digest: str, round_: int) -> StageRequest:
        layout = self.group.layout
        return StageRequest(
            dst_tp=layout.topology.tp_size,
            dst_full_pages=layout.full_pages,
            dst_window_pages=layout.window_pages,
            full_pages=dst_pages.full.tolist(),
            window_pages=dst_pages.window.tolist(),
            chunk_bytes=self.chunk_bytes,
            dst_capacity=int(getattr(self.group, "staging_bytes", 0)),
            round=round_,
            digest=digest,
        )

    def _prepare(
        self,
        url: str,
        request_id: str,
        info: KVPeerInfo,
        src: PoolLayout,
        seq_len: int,
        src_pages: RequestPages,
        dst_pages: RequestPages,
        want: TransferPath,
    ) -> Future[None] | None:
        """Ask prefill to plan its side of a staged pull now, on the helper thread, while this
        side plans (None unless the pull is `staged` and can be). Its errors surface at the
        first stage call, which plans on prefill if this request did not get through. Not for
        `auto`: the cost model picks direct for most plans, and prefill's wasted plan then
        competes with this one (in the bench both sides share one process: 5 → 10 ms)."""
        here = int(getattr(self.group, "staging_bytes", 0) or 0)
        if (
            want is not TransferPath.STAGED
            or not (info.staging_bytes > 0 and here > 0)
            or not seq_len
        ):
            return None
        digest = plan_digest(
            src, self.group.layout, seq_len, src_pages, dst_pages,
            self.chunk_bytes, info.staging_bytes, here,
        )  # fmt: skip
        body = self._stage_body(dst_pages, digest, 0).model_dump()

        def post() -> None:
            try:
                self._prep_http.post(f"{url}/kv/v1/requests/{request_id}/stage-plan", json=body)
            except httpx.HTTPError:
                pass

        return self._prep.submit(post)

    def _choose(
        self, info: KVPeerInfo, plan: TransferPlan, want: TransferPath
    ) -> tuple[StagedPlan | None, PathChoice]:
        here = int(getattr(self.group, "staging_bytes", 0) or 0)
        memory = MemoryKind(getattr(self.group, "memory", MemoryKind.DRAM))
        if not (info.staging_bytes > 0 and here > 0):
            if want is TransferPath.STAGED:
                side = "prefill" if info.staging_bytes <= 0 else "decode"
                raise IncompatiblePeerError(
                    f"path: staged needs a staging pool on both sides; the {side} side has "
                    "none (start it with --staging-bytes > 0) or use --path direct/auto"
                )
            return None, PathChoice(TransferPath.DIRECT, 0.0, 0.0, "no staging pool")
        staged = stage_plan(plan, self.chunk_bytes, info.staging_bytes, here)
        return staged, choose_path(plan, staged, link_for(memory, self.group.backend), want)

    def _pull_staged(
        self,
        url: str,
        request_id: str,
        dst_pages: RequestPages,
        staged: StagedPlan,
        agents: list[AgentInfo],
        end: float,
        prepared: Future[None] | None = None,
    ) -> PullResult:
        from beamserve.kv_transfer.rank import StagedRead

        digest = staged.digest()
        gather_s = transfer_s = scatter_s = rank_gather_s = 0.0
        moved = staging = 0
        t_all = time.perf_counter()
        for rnd in range(staged.rounds):
            body = self._stage_body(dst_pages, digest, rnd)
            try:
                tg = time.perf_counter()
                if prepared is not None:  # prefill's plan, if still under way, is on this clock
                    try:
                        prepared.result(timeout=max(0.0, end - time.monotonic()))
                    except FutureTimeoutError:
                        raise TransferTimeoutError(
                            f"request {request_id}: deadline spent while prefill planned"
                        ) from None
                    prepared = None
                resp = self._stage(url, request_id, body, end)
                gather_s += time.perf_counter() - tg
                rank_gather_s += resp.gather_s
                where = {c.chunk_id: c.offset for c in resp.chunks}
                reads: dict[int, list[StagedRead]] = {}
                for c in staged.in_round(rnd):
                    if c.chunk_id not in where:
                        raise TransferPlanError(
                            f"request {request_id}: prefill staged no chunk {c.chunk_id}"
                        )
                    reads.setdefault(c.dst_rank, []).append(
                        StagedRead(
                            agents[c.src_rank],
                            where[c.chunk_id],
                            c.dst_offsets,
                            c.lengths,
                            c.needs_scatter,
                        )
                    )
                remaining = end - time.monotonic()
                if remaining <= 0:
                    raise TransferTimeoutError(
                        f"request {request_id}: deadline spent in round {rnd} of {staged.rounds}"
                    )
                ranks = sorted(reads)
                got = cast(StagingGroup, self.group).call(
                    ranks,
                    "read_staged",
                    lambda r, reads=reads, remaining=remaining: (reads[r], remaining),
                    remaining + 5.0,
                )
                moved += sum(g.bytes_moved for g in got)
                staging += sum(g.staging_bytes for g in got)
                transfer_s += max(g.transfer_s for g in got)
                scatter_s += max(g.scatter_s for g in got)
            finally:
                self._unstage(url, request_id, rnd)
        seconds = time.perf_counter() - t_all
        return PullResult(
            staged.plan, 0.0, seconds, moved, False, TransferPath.STAGED,
            staged.descriptors_on_wire, staging + staged.gather_bytes, gather_s * 1e3,
            transfer_s * 1e3, scatter_s * 1e3, staged.rounds, None, rank_gather_s * 1e3,
        )  # fmt: skip

    def _stage(self, url: str, request_id: str, body: StageRequest, end: float) -> StageResponse:
        try:
            resp = self._http.post(
                f"{url}/kv/v1/requests/{request_id}/stage",
                json=body.model_dump(),
                timeout=max(1.0, end - time.monotonic()),
            )
        except httpx.HTTPError as exc:
            raise PeerLostError(f"prefill {url}: stage request failed ({exc})") from exc
        if resp.status_code == 200:
            return StageResponse.model_validate(resp.json())
        try:
            detail = str(resp.json().get("detail", f"HTTP {resp.status_code}"))
        except ValueError:
            detail = f"HTTP {resp.status_code}: {resp.text[:200]}"
        if resp.status_code == 410:
            raise LeaseExpiredError(detail)
        if resp.status_code == 501:
            raise IncompatiblePeerError(detail)
        if resp.status_code == 503:
            raise PeerLostError(detail)
        if resp.status_code >= 500:
            raise TransferFailedError(f"prefill {url}: staging failed ({detail})")
        raise TransferPlanError(f"prefill {url}: stage refused ({detail})")

    def _unstage(self, url: str, request_id: str, round_: int) -> None:
        try:
            self._http.delete(f"{url}/kv/v1/requests/{request_id}/stage/{round_}", timeout=5.0)
        except httpx.HTTPError:
            pass  # the lease's release (or expiry) frees it too

    def _verify(self, req: RequestKVInfo, dst_pages: RequestPages, end: float) -> None:
        if req.checksums is None:
            raise ChecksumMismatchError(
                f"request {req.request_id}: prefill published no "
                "checksums; publish with checksums to verify"
            )
        theirs = req.checksums
        got = self.group.call_all(
            "checksums", req.seq_len, dst_pages, timeout_s=max(1.0, end - time.monotonic())
        )
        bad = [
            k for per_rank in got for (k, v) in per_rank.items() if theirs.get(slice_key(k)) != v
        ]
        if bad:
            raise ChecksumMismatchError(
                f"request {req.request_id}: {len(bad)} slices differ, "
                f"first (layer, kv, head) = {bad[0]}"
            )

    def _get(self, url: str, path: str) -> object:
        try:
            resp = self._http.get(url + path)
        except httpx.HTTPError as exc:
            raise PeerLostError(f"prefill {url}: handshake failed ({exc})") from exc
        if resp.status_code == 410:
            raise LeaseExpiredError(resp.json().get("detail", f"{path}: lease expired"))
        if resp.status_code == 404 and path.startswith("/kv/v1/requests/"):
            raise LeaseNotFoundError(resp.json().get("detail", f"{path}: not published"))
        if resp.status_code != 200:
            raise KVTransferError(f"prefill {url}{path}: HTTP {resp.status_code}")
        return resp.json()

    def _release(self, url: str, request_id: str) -> None:
        try:
            self._http.delete(f"{url}/kv/v1/requests/{request_id}", timeout=1.0)
        except httpx.HTTPError:
            pass  # the prefill side's lease expires on its own


def slice_key(key: tuple[int, int, int]) -> str:
    return f"{key[0]}:{key[1]}:{key[2]}"


def published_checksums(
    group: KVShardGroup, seq_len: int, pages: RequestPages, timeout_s: float = 600.0
) -> dict[str, int]:
    """Every slice's CRC-32 on the prefill group (replicas agree; any one is kept)."""
    out: dict[str, int] = {}
    for per_rank in group.call_all("checksums", seq_len, pages, timeout_s=timeout_s):
        for k, v in per_rank.items():
            out[slice_key(k)] = v
    return out


def _stage_error(exc: Exception) -> JSONResponse:
    """The stage and stage-plan calls' error bodies: 410 lease gone, 501 no staging here, 503 a
    rank lost, 409 any other refusal, 500 a rank's unexpected failure."""
    if isinstance(exc, LeaseExpiredError):
        code, error, detail = 410, "lease_expired", str(exc)
    elif isinstance(exc, IncompatiblePeerError):
        code, error, detail = 501, "no_staging", str(exc)
    elif isinstance(exc, PeerLostError):
        code, error, detail = 503, "rank_lost", str(exc)
    elif isinstance(exc, KVTransferError):
        code, error, detail = 409, "stage", str(exc)
    else:
        code, error, detail = 500, "gather_failed", f"{type(exc).__name__}: {exc}"
    return JSONResponse(status_code=code, content={"error": error, "detail": detail})
