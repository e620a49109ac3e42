"""The prefill↔decode handshake over HTTP, and the decode-side pull.

Prefill serves (read-only for peers, one service per prefill worker):

    GET    /kv/v1/agents              KVPeerInfo: per-rank transfer metadata, layout, page size,
                                      KV dtype, pool shape, backend and model fingerprint
    GET    /kv/v1/requests/{id}       RequestKVInfo: seq_len, page tables, lease, checksums
    DELETE /kv/v1/requests/{id}       the decode side is done: free the pages (idempotent)

Decode READs (pulls). Why read rather than write: the decode side owns the destination pages
and knows when it has room, so it allocates first and pulls when ready; the prefill side stays
passive and only holds its pages on a lease, so a decode crash can never make prefill write
into freed memory, and a prefill crash surfaces on the side that must recover (decode
recomputes). This is vLLM NixlConnector's direction; SGLang pushes (WRITE) because its prefill
learns destination pages through the bootstrap server.
"""

from __future__ import annotations

import base64
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
import uvicorn
from beamserve.kv_transfer.backends.base import AgentInfo, ReadOp
from beamserve.kv_transfer.errors import (
    ChecksumMismatchError,
    IncompatiblePeerError,
    KVTransferError,
    LeaseExpiredError,
    LeaseNotFoundError,
    PeerLostError,
    TransferPlanError,
    TransferTimeoutError,
)
from beamserve.kv_transfer.model import BeamModelConfig
from beamserve.kv_transfer.plan import TransferPlan, check_pair, plan_transfer
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

    def to_info(self) -> AgentInfo:
        return AgentInfo(
            self.backend,
            self.name,
            base64.b64decode(self.metadata_b64),
            self.base_addr,
            self.region_bytes,
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


@dataclass
class _Lease:
    seq_len: int
    pages: RequestPages
    expires: float
    checksums: dict[str, int] | None
    aux: dict[str, int] | None = None


class PrefillKVRegistry:
    """What a prefill worker exposes: its ranks' agents and the requests whose KV it holds."""

    def __init__(
        self,
        engine_id: str,
        layout: PoolLayout,
        backend: str,
        agents: Sequence[AgentInfo],
        lease_s: float = 30.0,
    ) -> None:
        self.engine_id, self.layout, self.backend = engine_id, layout, backend
        self.agents, self.lease_s = list(agents), lease_s
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
                )
                for r, a in enumerate(self.agents)
            ],
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
            found = self._leases.pop(request_id, None) is not None
            if found:
                self.released.append(request_id)
                self._end(request_id)
            return found

    def held(self) -> list[str]:
        with self._lock:
            self._expire()
            return sorted(self._leases)

    def _expire(self) -> None:
        now = time.monotonic()
        for rid in [r for r, lease in self._leases.items() if lease.expires < now]:
            del self._leases[rid]
            self._end(rid)

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

    return app


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
    plan: TransferPlan
    plan_ms: float
    seconds: float
    bytes_moved: int
    checksums_verified: bool


class DecodeKVClient:
    """Decode side: fetch a prefill peer's metadata and page table, plan, pull, release."""

    def __init__(self, group: KVShardGroup, http_timeout_s: float = 5.0) -> None:
        self.group = group
        self._http = httpx.Client(timeout=http_timeout_s)
        self._peers: dict[str, tuple[KVPeerInfo, PoolLayout]] = {}

    def close(self) -> None:
        self._http.close()

    def peer(self, url: str, refresh: bool = False) -> tuple[KVPeerInfo, PoolLayout]:
        if refresh or url not in self._peers:
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
    ) -> PullResult:
        """Move one request's KV into `dst_pages` of this decode group, or fail typed within
        `deadline_s`. The prefill lease is released in every case."""
        end = time.monotonic() + deadline_s
        try:
            info, src = self.peer(url)
            req = RequestKVInfo.model_validate(self._get(url, f"/kv/v1/requests/{request_id}"))
            t0 = time.perf_counter()
            plan = plan_transfer(
                src,
                self.group.layout,
                req.seq_len,
                RequestPages.of(req.full_pages, req.window_pages),
                dst_pages,
            )
            plan_ms = (time.perf_counter() - t0) * 1e3
            agents = [r.to_info() for r in info.ranks]
            ops = {d: ops_for_rank(plan, d, agents) for d in range(self.group.size)}
            remaining = end - time.monotonic()
            if remaining <= 0:
                raise TransferTimeoutError(f"request {request_id}: deadline spent before reads")
            t1 = time.perf_counter()
            self.group.read(ops, remaining)
            seconds = time.perf_counter() - t1
            verified = False
            if verify_checksums:
                self._verify(req, dst_pages, end)
                verified = True
            return PullResult(plan, plan_ms, seconds, plan.bytes_moved, verified)
        except PeerLostError:
            self._peers.pop(url, None)  # its metadata is stale once a rank is gone
            raise
        finally:
            self._release(url, request_id)

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
