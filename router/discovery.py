"""Endpoint discovery: where the router learns which workers exist.

A `Discovery` source keeps the current `list[Endpoint]` and tells its consumers when it changes.
Three sources:

* `StaticDiscovery`: a fixed list (router config, tests).
* `LocalRuntimeDiscovery`: the JSON file `beamserve up` writes (format below), re-read on change.
* `KubernetesDiscovery`: Services labelled `beamserve.io/deployment=<name>` and their
  EndpointSlices, listed and watched through the API server.

Consumers read `discovery.endpoints`, or iterate `async for endpoints in discovery.changes()`
(the current list once synced, then every new list; a slow consumer skips to the newest), or
register `discovery.on_change(callback)`. Run a source with `async with discovery:` (or
`await discovery.start()` / `await discovery.stop()`); `await discovery.wait_synced()` waits
for the first complete view. Lists are sorted by `Endpoint.id`; ids are unique.

**Endpoint spec** (static config entries and the local runtime file; unknown keys are errors)::

    {"url": "http://127.0.0.1:8101", "id": "decode-0", "role": "decode", "pool": "main",
     "revision": "r1", "engine": "sim", "kv_events": 5557, "kv_replay": "tcp://127.0.0.1:5558",
     "kv_layout": "", "labels": {"zone": "a"}}

Only `url` is required; `id` defaults to the URL's `host:port`; `kv_events` / `kv_replay` take a
port (same host as `url`, `tcp://`) or a full ZMQ endpoint. The KV geometry (block size, window,
hash scheme) is no part of a spec: each worker reports its own (`beamserve.router.facts`), the
router's flags standing for workers that do not.

**Local runtime file**: a JSON array of endpoint specs, replaced atomically (write a temporary
file in the same folder, then rename; `write_local_endpoints` does this). A missing file means
no endpoints yet.

**Kubernetes** (what the operator sets): each worker pool gets a Service labelled
`beamserve.io/deployment=<deployment>`, `beamserve.io/role` (`prefill` | `decode` | `both`,
default `both`), `beamserve.io/pool` (default `default`), `beamserve.io/revision`,
`beamserve.io/engine` (`vllm` | `sglang` | `sim` | `ref`, default `sim`), optionally annotated
`beamserve.io/kv-layout`, with named ports `http` (required),
`kv-events` and `kv-replay`. Its EndpointSlices (label `kubernetes.io/service-name`) give the
addresses: one `Endpoint` per ready address per Service (`conditions.ready` true, or unset,
which the API defines as ready; terminating endpoints never count). `Endpoint.id` is the pod
name (`targetRef`), else `host:port`; `@<service>` is appended if the same pod backs two Services
(and `/<host:port>` if one pod name shows two addresses).
`discovery.k8s.io/v1` is used when the server has it, `v1beta1` otherwise (Kubernetes 1.17–1.20).
Needs RBAC `list` and `watch` on `services` and `endpointslices` in the namespace.
"""

from __future__ import annotations

import abc
import asyncio
import atexit
import base64
import contextlib
import json
import os
import random
import ssl
import tempfile
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast, get_args
from urllib.parse import urlsplit

import httpx
import structlog
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .types import Endpoint, EngineKind, Role

log = structlog.get_logger(__name__)

LABEL_DEPLOYMENT = "beamserve.io/deployment"
LABEL_ROLE = "beamserve.io/role"
LABEL_POOL = "beamserve.io/pool"
LABEL_REVISION = "beamserve.io/revision"
LABEL_ENGINE = "beamserve.io/engine"
ANNOTATION_KV_LAYOUT = "beamserve.io/kv-layout"
LABEL_SERVICE_NAME = "kubernetes.io/service-name"
LABEL_HOSTNAME = "kubernetes.io/hostname"
LABEL_ZONE = "topology.kubernetes.io/zone"
PORT_HTTP, PORT_KV_EVENTS, PORT_KV_REPLAY = "http", "kv-events", "kv-replay"

ROLES: tuple[str, ...] = get_args(Role)
ENGINES: tuple[str, ...] = get_args(EngineKind)


class DiscoveryConfigError(ValueError):
    """An endpoint spec or kubeconfig that cannot be used; the message says what to change."""


# -- the common interface -----------------------------------------------------------------------


class Discovery(abc.ABC):
    """A source of the current endpoints with change notification (see the module docstring)."""

    def __init__(self) -> None:
        self._endpoints: tuple[Endpoint, ...] = ()
        self._version = 0
        self._synced: asyncio.Event | None = None
        self._changed: asyncio.Event | None = None
        self._callbacks: list[Callable[[list[Endpoint]], None]] = []
        self._task: asyncio.Task[None] | None = None

    @property
    def endpoints(self) -> list[Endpoint]:
        return list(self._endpoints)

    @property
    def synced(self) -> bool:
        return self._version > 0

    def on_change(self, callback: Callable[[list[Endpoint]], None]) -> Callable[[], None]:
        """Call `callback(endpoints)` after every change; returns the unsubscribe function."""
        self._callbacks.append(callback)
        return lambda: self._callbacks.remove(callback)

    async def wait_synced(self, timeout: float | None = None) -> None:
        if not self.synced:
            await asyncio.wait_for(self._synced_event().wait(), timeout)

    async def changes(self) -> AsyncIterator[list[Endpoint]]:
        """The current endpoints once synced, then each new list (latest wins)."""
        await self.wait_synced()
        seen = 0
        while True:
            changed = self._changed_event()
            if self._version != seen:
                seen = self._version
                yield list(self._endpoints)
                continue
            await changed.wait()

    async def run(self) -> None:
        """Keep the view current until cancelled (what `start` runs as a task); raises
        `DiscoveryConfigError` when the source cannot work at all."""
        try:
            await self._run()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("discovery stopped", source=type(self).__name__)
            raise

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self.run(), name=type(self).__name__)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def __aenter__(self) -> Discovery:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @abc.abstractmethod
    async def _run(self) -> None:
        """Keep the view current (calling `_publish`) until cancelled."""

    def _publish(self, endpoints: Iterable[Endpoint]) -> None:
        unique: dict[str, Endpoint] = {}
        for ep in endpoints:
            if ep.id in unique and unique[ep.id] != ep:
                log.warning("duplicate endpoint id; keeping the first", id=ep.id)
                continue
            unique.setdefault(ep.id, ep)
        current = tuple(sorted(unique.values(), key=lambda e: e.id))
        if self.synced and current == self._endpoints:
            return
        self._endpoints = current
        self._version += 1
        self._synced_event().set()
        changed, self._changed = self._changed_event(), asyncio.Event()
        changed.set()
        log.info("endpoints changed", source=type(self).__name__, count=len(current))
        for callback in list(self._callbacks):
            try:
                callback(list(current))
            except Exception:
                log.exception("discovery callback failed")

    def _synced_event(self) -> asyncio.Event:
        if self._synced is None:
            self._synced = asyncio.Event()
        return self._synced

    def _changed_event(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed


# -- endpoint specs (static config, local runtime file) ---------------------------------------


class EndpointSpec(BaseModel):
    """One endpoint as written in config or the local runtime file (see module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str
    id: str | None = None
    role: Role = "both"
    pool: str = "default"
    revision: str = ""
    engine: EngineKind = "sim"
    kv_events: int | str | None = None
    kv_replay: int | str | None = None
    kv_layout: str = ""
    labels: dict[str, str] = Field(default_factory=dict)

    def to_endpoint(self) -> Endpoint:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
            raise DiscoveryConfigError(
                f"endpoint url {self.url!r} must be http(s)://host:port (port included)"
            )
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        return Endpoint(
            id=self.id or f"{host}:{parts.port}",
            url=self.url.rstrip("/"),
            role=self.role,
            pool=self.pool,
            revision=self.revision,
            engine=self.engine,
            kv_events=_zmq_endpoint(self.kv_events, host),
            kv_replay=_zmq_endpoint(self.kv_replay, host),
            kv_layout=self.kv_layout,
            labels=tuple(sorted(self.labels.items())),
        )


def _zmq_endpoint(value: int | str | None, host: str) -> str | None:
    if value is None:
        return None
    if isinstance(value, int):
        if not 0 < value < 65536:
            raise DiscoveryConfigError(f"port {value} out of range 1-65535")
        return f"tcp://{host}:{value}"
    return value


def parse_endpoint_specs(data: object, source: str = "endpoints") -> list[Endpoint]:
    """Endpoints from a JSON-like list of specs; unknown keys and bad values raise
    `DiscoveryConfigError` naming the entry, the key and the valid keys."""
    if not isinstance(data, list):
        raise DiscoveryConfigError(
            f"{source}: expected a list of endpoint objects, got {type(data).__name__}"
        )
    valid = sorted(EndpointSpec.model_fields)
    endpoints = []
    for i, entry in enumerate(data):
        where = f"{source}[{i}]"
        if not isinstance(entry, Mapping):
            raise DiscoveryConfigError(f"{where}: expected an object, got {type(entry).__name__}")
        unknown = sorted(set(entry) - set(valid))
        if unknown:
            raise DiscoveryConfigError(
                f"{where}: unknown key {unknown[0]!r}; valid keys: {', '.join(valid)}"
            )
        try:
            endpoints.append(EndpointSpec.model_validate(entry).to_endpoint())
        except ValidationError as e:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors()
            )
            raise DiscoveryConfigError(f"{where}: {problems}") from None
        except DiscoveryConfigError as e:
            raise DiscoveryConfigError(f"{where}: {e}") from None
    return endpoints


def endpoint_spec(endpoint: Endpoint) -> dict[str, Any]:
    """The spec object for `endpoint` (inverse of `parse_endpoint_specs`)."""
    spec: dict[str, Any] = {
        "url": endpoint.url,
        "id": endpoint.id,
        "role": endpoint.role,
        "pool": endpoint.pool,
        "revision": endpoint.revision,
        "engine": endpoint.engine,
        "kv_events": endpoint.kv_events,
        "kv_replay": endpoint.kv_replay,
        "kv_layout": endpoint.kv_layout,
        "labels": dict(endpoint.labels),
    }
    return spec


class StaticDiscovery(Discovery):
    """A fixed list of endpoints (replace it with `set`)."""

    def __init__(self, endpoints: Sequence[Endpoint]) -> None:
        super().__init__()
        self._initial = list(endpoints)

    @classmethod
    def from_config(cls, specs: object) -> StaticDiscovery:
        return cls(parse_endpoint_specs(specs, "static endpoints"))

    def set(self, endpoints: Sequence[Endpoint]) -> None:
        self._initial = list(endpoints)
        self._publish(self._initial)

    async def _run(self) -> None:
        self._publish(self._initial)


# -- local runtime ------------------------------------------------------------------------------


def write_local_endpoints(path: str | os.PathLike[str], endpoints: Sequence[Endpoint]) -> None:
    """Write the local runtime file atomically (temporary file in the same folder, rename)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump([endpoint_spec(e) for e in endpoints], f, indent=2)
            f.write("\n")
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


class LocalRuntimeDiscovery(Discovery):
    """Endpoints from the file `beamserve up` writes, re-read when it changes.

    | parameter | default | meaning |
    |---|---|---|
    | `path` | — | the JSON array of endpoint specs |
    | `poll_interval_s` | 0.5 | how often the file's identity (inode, size, mtime) is checked |

    A missing file publishes no endpoints; a file that does not parse keeps the last good list
    (logged) until it is fixed.
    """

    def __init__(self, path: str | os.PathLike[str], *, poll_interval_s: float = 0.5) -> None:
        super().__init__()
        if poll_interval_s <= 0:
            raise ValueError("poll_interval_s must be positive")
        self.path = Path(path)
        self.poll_interval_s = poll_interval_s

    async def _run(self) -> None:
        seen: tuple[int, int, int] | Literal["unset"] | None = "unset"
        while True:
            try:
                st = self.path.stat()
                identity: tuple[int, int, int] | None = (st.st_ino, st.st_size, st.st_mtime_ns)
            except FileNotFoundError:
                identity = None
            if identity != seen:
                seen = identity
                self._reload(identity is not None)
            await asyncio.sleep(self.poll_interval_s)

    def _reload(self, exists: bool) -> None:
        if not exists:
            log.info("local runtime file absent; no endpoints", path=str(self.path))
            self._publish([])
            return
        try:
            data = json.loads(self.path.read_text())
            endpoints = parse_endpoint_specs(data, str(self.path))
        except (OSError, ValueError) as e:  # DiscoveryConfigError and JSON errors are ValueErrors
            log.warning("local runtime file unusable; keeping last list", error=str(e))
            return
        self._publish(endpoints)


# -- Kubernetes: the pure mapping ---------------------------------------------------------------


class _Meta(BaseModel):
    name: str
    namespace: str = ""
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None


class _ServicePort(BaseModel):
    name: str | None = None
    port: int


class _ServiceSpec(BaseModel):
    ports: list[_ServicePort] | None = None


class _Service(BaseModel):
    metadata: _Meta
    spec: _ServiceSpec = Field(default_factory=_ServiceSpec)


class _Conditions(BaseModel):
    ready: bool | None = None
    terminating: bool | None = None


class _TargetRef(BaseModel):
    kind: str = ""
    name: str = ""


class _SliceEndpoint(BaseModel):
    addresses: list[str]
    conditions: _Conditions = Field(default_factory=_Conditions)
    targetRef: _TargetRef | None = None
    nodeName: str | None = None
    zone: str | None = None
    topology: dict[str, str] | None = None  # v1beta1


class _SlicePort(BaseModel):
    name: str | None = None
    port: int | None = None


class _Slice(BaseModel):
    metadata: _Meta
    addressType: str = "IPv4"
    endpoints: list[_SliceEndpoint] | None = None
    ports: list[_SlicePort] | None = None


def endpoints_from(
    services: Iterable[Mapping[str, Any]], slices: Iterable[Mapping[str, Any]]
) -> list[Endpoint]:
    """The router's endpoints for the selected Services and (any) EndpointSlices, as the API
    returns them (JSON objects). Slices of other Services are ignored; Services whose labels
    hold an unknown role or engine, or without an `http` port, are skipped with a warning.
    One Endpoint per ready address per Service, sorted by id."""
    by_service: dict[tuple[str, str], list[_Slice]] = {}
    for raw in slices:
        sl = _Slice.model_validate(raw)
        owner = (sl.metadata.labels or {}).get(LABEL_SERVICE_NAME)
        if owner:
            by_service.setdefault((sl.metadata.namespace, owner), []).append(sl)

    found: list[tuple[str, str, Endpoint]] = []  # (base id, service, endpoint)
    for raw in services:
        svc = _Service.model_validate(raw)
        template = _template(svc)
        if template is None:
            continue
        # One entry per address (slices of one Service may overlap while they are rebalanced);
        # an endpoint's further addresses are the same endpoint.
        addresses: dict[str, tuple[_SliceEndpoint, _Slice]] = {}
        for sl in by_service.get((svc.metadata.namespace, svc.metadata.name), []):
            for slice_ep in sl.endpoints or []:
                ready = slice_ep.conditions.ready is not False
                if ready and not slice_ep.conditions.terminating and slice_ep.addresses:
                    addresses.setdefault(slice_ep.addresses[0], (slice_ep, sl))
        for address, (slice_ep, sl) in addresses.items():
            endpoint = _endpoint(svc, template, address, slice_ep, sl)
            if endpoint is not None:
                found.append((endpoint.id, svc.metadata.name, endpoint))

    # Ids must be unique: a pod backing two Services gets `pod@service`; two addresses under
    # one pod name (a recreated pod whose old address lingers) get `pod@service/address`.
    by_base: dict[str, int] = {}
    by_service_id: dict[tuple[str, str], int] = {}
    for base, service, _ in found:
        by_base[base] = by_base.get(base, 0) + 1
        by_service_id[(base, service)] = by_service_id.get((base, service), 0) + 1
    out: list[Endpoint] = []
    for base, service, endpoint in found:
        if by_base[base] == 1:
            out.append(endpoint)
        elif by_service_id[(base, service)] == 1:
            out.append(_with_id(endpoint, f"{base}@{service}"))
        else:
            out.append(_with_id(endpoint, f"{base}@{service}/{urlsplit(endpoint.url).netloc}"))
    return sorted(out, key=lambda e: e.id)


def _with_id(ep: Endpoint, new_id: str) -> Endpoint:
    return Endpoint(
        id=new_id,
        url=ep.url,
        role=ep.role,
        pool=ep.pool,
        revision=ep.revision,
        engine=ep.engine,
        kv_events=ep.kv_events,
        kv_replay=ep.kv_replay,
        kv_layout=ep.kv_layout,
        geometry=ep.geometry,
        labels=ep.labels,
    )


@dataclass(frozen=True, slots=True)
class _Template:
    role: Role
    pool: str
    revision: str
    engine: EngineKind
    kv_layout: str
    labels: tuple[tuple[str, str], ...]


def _template(svc: _Service) -> _Template | None:
    labels = svc.metadata.labels or {}
    annotations = svc.metadata.annotations or {}
    name = f"{svc.metadata.namespace}/{svc.metadata.name}"
    role = labels.get(LABEL_ROLE, "both")
    engine = labels.get(LABEL_ENGINE, "sim")
    if role not in ROLES:
        log.warning("service skipped: unknown role", service=name, role=role, valid=ROLES)
        return None
    if engine not in ENGINES:
        log.warning("service skipped: unknown engine", service=name, engine=engine, valid=ENGINES)
        return None
    if not any(p.name == PORT_HTTP for p in svc.spec.ports or []):
        log.warning("service skipped: no port named 'http'", service=name)
        return None
    return _Template(
        role=cast(Role, role),
        pool=labels.get(LABEL_POOL, "default"),
        revision=labels.get(LABEL_REVISION, ""),
        engine=cast(EngineKind, engine),
        kv_layout=annotations.get(ANNOTATION_KV_LAYOUT, ""),
        labels=tuple(sorted({**labels, LABEL_SERVICE_NAME: svc.metadata.name}.items())),
    )


def _endpoint(
    svc: _Service, t: _Template, address: str, ep: _SliceEndpoint, sl: _Slice
) -> Endpoint | None:
    ports = {p.name or "": p.port for p in sl.ports or [] if p.port is not None}
    http_port = ports.get(PORT_HTTP)
    if http_port is None:
        return None  # this slice does not carry the worker's HTTP port
    host = f"[{address}]" if sl.addressType == "IPv6" or ":" in address else address
    extra = dict(ep.topology or {})
    if ep.nodeName:
        extra[LABEL_HOSTNAME] = ep.nodeName
    if ep.zone:
        extra[LABEL_ZONE] = ep.zone
    pod = ep.targetRef.name if ep.targetRef is not None and ep.targetRef.kind == "Pod" else ""
    kv_events, kv_replay = ports.get(PORT_KV_EVENTS), ports.get(PORT_KV_REPLAY)
    return Endpoint(
        id=pod or f"{host}:{http_port}",
        url=f"http://{host}:{http_port}",
        role=t.role,
        pool=t.pool,
        revision=t.revision,
        engine=t.engine,
        kv_events=f"tcp://{host}:{kv_events}" if kv_events else None,
        kv_replay=f"tcp://{host}:{kv_replay}" if kv_replay else None,
        kv_layout=t.kv_layout,
        labels=tuple(sorted({**dict(t.labels), **extra}.items())),
    )


# -- Kubernetes: API access ---------------------------------------------------------------------

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class _TokenFileAuth(httpx.Auth):
    """Bearer token re-read from its file per request (projected tokens rotate)."""

    def __init__(self, path: Path) -> None:
        self._path = path

    def auth_flow(self, request: httpx.Request) -> Any:
        request.headers["Authorization"] = f"Bearer {self._path.read_text().strip()}"
        yield request


@dataclass(frozen=True, slots=True)
class KubeAccess:
    """How to reach the API server: base URL, credentials, TLS trust.

    Build it with `in_cluster()` (service account files) or `from_kubeconfig(path)` (token,
    token file or client certificate users; `insecure-skip-tls-verify` or a CA).
    """

    server: str
    token: str | None = None
    token_file: Path | None = None
    ca_file: Path | None = None
    insecure: bool = False
    client_cert: tuple[Path, Path] | None = None
    namespace: str = "default"

    @classmethod
    def in_cluster(
        cls, root: Path = SERVICE_ACCOUNT_DIR, env: Mapping[str, str] | None = None
    ) -> KubeAccess:
        env = os.environ if env is None else env
        host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT", "443")
        if not host or not (root / "token").exists():
            raise DiscoveryConfigError(
                "not running in a cluster (KUBERNETES_SERVICE_HOST or the service account token "
                f"in {root} is missing); pass a kubeconfig path instead"
            )
        namespace_file = root / "namespace"
        host = f"[{host}]" if ":" in host else host
        return cls(
            server=f"https://{host}:{port}",
            token_file=root / "token",
            ca_file=root / "ca.crt" if (root / "ca.crt").exists() else None,
            namespace=namespace_file.read_text().strip() if namespace_file.exists() else "default",
        )

    @classmethod
    def from_kubeconfig(
        cls, path: str | os.PathLike[str], context: str | None = None
    ) -> KubeAccess:
        path = Path(path)
        text = path.read_text()
        try:
            import yaml

            config = yaml.safe_load(text)
        except ImportError:  # kubeconfigs may be JSON, which is YAML too
            config = json.loads(text)
        if not isinstance(config, dict):
            raise DiscoveryConfigError(f"{path}: not a kubeconfig (expected a mapping)")

        def named(section: str, name: str) -> dict[str, Any]:
            for item in config.get(section) or []:
                if item.get("name") == name:
                    return dict(item.get(section[:-1]) or {})
            raise DiscoveryConfigError(f"{path}: no {section[:-1]} named {name!r}")

        context_name = context or config.get("current-context")
        if not context_name:
            raise DiscoveryConfigError(f"{path}: no current-context; pass context=")
        ctx = named("contexts", context_name)
        cluster = named("clusters", ctx.get("cluster", ""))
        user = named("users", ctx["user"]) if ctx.get("user") else {}
        if "server" not in cluster:
            raise DiscoveryConfigError(f"{path}: cluster {ctx.get('cluster')!r} has no server")
        if "exec" in user or "auth-provider" in user:
            raise DiscoveryConfigError(
                f"{path}: user {ctx.get('user')!r} authenticates with exec/auth-provider plugins, "
                "which beamserve does not run; use a token, token file or client certificate"
            )
        base = path.parent

        def file_or_data(section: Mapping[str, Any], key: str) -> Path | None:
            if f"{key}-data" in section:
                return _data_file(section[f"{key}-data"])
            return base / section[key] if key in section else None

        cert = file_or_data(user, "client-certificate")
        key = file_or_data(user, "client-key")
        token_file = user.get("tokenFile")
        return cls(
            server=str(cluster["server"]).rstrip("/"),
            token=user.get("token"),
            token_file=base / token_file if token_file else None,
            ca_file=file_or_data(cluster, "certificate-authority"),
            insecure=bool(cluster.get("insecure-skip-tls-verify", False)),
            client_cert=(cert, key) if cert and key else None,
            namespace=ctx.get("namespace") or "default",
        )

    def client(self, *, read_timeout_s: float = 330.0) -> httpx.AsyncClient:
        verify: ssl.SSLContext | bool
        if self.insecure:
            verify = False
        else:
            verify = ssl.create_default_context(cafile=str(self.ca_file) if self.ca_file else None)
        if self.client_cert is not None and isinstance(verify, ssl.SSLContext):
            verify.load_cert_chain(str(self.client_cert[0]), str(self.client_cert[1]))
        elif self.client_cert is not None:
            verify = ssl.create_default_context()
            verify.check_hostname = False
            verify.verify_mode = ssl.CERT_NONE
            verify.load_cert_chain(str(self.client_cert[0]), str(self.client_cert[1]))
        auth: httpx.Auth | None = None
        headers = {"Accept": "application/json", "User-Agent": "beamserve-router"}
        if self.token_file is not None:
            auth = _TokenFileAuth(self.token_file)
        elif self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        return httpx.AsyncClient(
            base_url=self.server,
            verify=verify,
            auth=auth,
            headers=headers,
            timeout=httpx.Timeout(10.0, read=read_timeout_s),
        )


def _data_file(b64: str) -> Path:
    """Base64 kubeconfig data as a private temporary file (ssl wants paths); removed when the
    interpreter exits (the client may reload it for every connection until then)."""
    fd, name = tempfile.mkstemp(prefix="beamserve-kube-")
    atexit.register(_remove_quietly, name)
    with os.fdopen(fd, "wb") as f:
        f.write(base64.b64decode(b64))
    return Path(name)


def _remove_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


# -- Kubernetes: list + watch -------------------------------------------------------------------


class _Gone(Exception):
    """The resourceVersion is too old (HTTP 410): list again."""


@dataclass(frozen=True, slots=True)
class WatchSettings:
    """List/watch behaviour of `KubernetesDiscovery`.

    | parameter | default | meaning |
    |---|---|---|
    | `watch_timeout_s` | 300 | server-side timeout of one watch request (then re-watch) |
    | `backoff_initial_s` | 0.2 | first wait after a failed request |
    | `backoff_max_s` | 10 | longest wait (doubling, ±20 % jitter) |
    | `page_size` | 500 | items per list page |
    """

    watch_timeout_s: int = 300
    backoff_initial_s: float = 0.2
    backoff_max_s: float = 10.0
    page_size: int = 500


class _Resource:
    """One listed-and-watched collection: its objects by (namespace, name)."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        path: str,
        selector: str,
        settings: WatchSettings,
        on_change: Callable[[], None],
    ) -> None:
        self.client, self.path, self.selector = client, path, selector
        self.settings, self.on_change = settings, on_change
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.synced = False

    async def run(self) -> None:
        rv: str | None = None
        delay = self.settings.backoff_initial_s
        while True:
            try:
                if rv is None:
                    rv = await self._list()
                    delay = self.settings.backoff_initial_s
                rv = await self._watch(rv)
                delay = self.settings.backoff_initial_s
            except _Gone:
                log.info("watch expired; listing again", path=self.path)
                rv = None
            except (httpx.HTTPError, ValueError) as e:
                log.warning("kubernetes request failed; retrying", path=self.path, error=str(e))
                await asyncio.sleep(delay * random.uniform(0.8, 1.2))
                delay = min(delay * 2, self.settings.backoff_max_s)

    async def _list(self) -> str:
        objects: dict[tuple[str, str], dict[str, Any]] = {}
        params: dict[str, Any] = {"labelSelector": self.selector, "limit": self.settings.page_size}
        while True:
            resp = await self.client.get(self.path, params=params)
            _raise_for_status(resp, self.path)
            body = resp.json()
            for item in body.get("items") or []:
                objects[_key(item)] = item
            cont = (body.get("metadata") or {}).get("continue")
            if not cont:
                break
            params["continue"] = cont
        self.objects = objects
        self.synced = True
        self.on_change()
        return str((body.get("metadata") or {}).get("resourceVersion", ""))

    async def _watch(self, rv: str) -> str:
        params = {
            "watch": "true",
            "labelSelector": self.selector,
            "resourceVersion": rv,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(self.settings.watch_timeout_s),
        }
        async with self.client.stream("GET", self.path, params=params) as resp:
            if resp.status_code >= 400:
                await resp.aread()
            _raise_for_status(resp, self.path)
            async for line in resp.aiter_lines():
                if not line.strip():
                    continue
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise _Gone()
                    raise ValueError(f"watch error: {obj.get('message', obj)}")
                rv = str((obj.get("metadata") or {}).get("resourceVersion", rv))
                if kind in ("ADDED", "MODIFIED"):
                    self.objects[_key(obj)] = obj
                    self.on_change()
                elif kind == "DELETED":
                    self.objects.pop(_key(obj), None)
                    self.on_change()
        return rv


def _key(obj: Mapping[str, Any]) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return (str(meta.get("namespace", "")), str(meta.get("name", "")))


def _raise_for_status(resp: httpx.Response, path: str) -> None:
    if resp.status_code == 410:
        raise _Gone()
    if resp.status_code in (401, 403):
        log.error(
            "kubernetes API refused; grant list and watch on services and endpointslices",
            path=path,
            status=resp.status_code,
        )
    resp.raise_for_status()


class KubernetesDiscovery(Discovery):
    """Endpoints of one BeamDeployment from its Services' EndpointSlices (module docstring).

    | parameter | default | meaning |
    |---|---|---|
    | `deployment` | — | value of the `beamserve.io/deployment` Service label |
    | `access` | — | `KubeAccess` (in-cluster or kubeconfig) |
    | `namespace` | `access.namespace` | where the Services live |
    | `settings` | `WatchSettings()` | timeouts and backoff |
    """

    def __init__(
        self,
        deployment: str,
        access: KubeAccess,
        *,
        namespace: str | None = None,
        settings: WatchSettings | None = None,
    ) -> None:
        super().__init__()
        self.deployment = deployment
        self.access = access
        self.namespace = namespace or access.namespace
        self.settings = settings or WatchSettings()
        self.slice_version: str | None = None

    async def _run(self) -> None:
        read_timeout = self.settings.watch_timeout_s + 30.0
        async with self.access.client(read_timeout_s=read_timeout) as client:
            self.slice_version = await self._slice_version(client)
            changed = asyncio.Event()
            ns = self.namespace
            services = _Resource(
                client,
                f"/api/v1/namespaces/{ns}/services",
                f"{LABEL_DEPLOYMENT}={self.deployment}",
                self.settings,
                changed.set,
            )
            slices = _Resource(
                client,
                f"/apis/discovery.k8s.io/{self.slice_version}/namespaces/{ns}/endpointslices",
                LABEL_SERVICE_NAME,
                self.settings,
                changed.set,
            )
            async with asyncio.TaskGroup() as group:
                group.create_task(services.run())
                group.create_task(slices.run())
                while True:
                    await changed.wait()
                    changed.clear()
                    if services.synced and slices.synced:
                        self._publish(
                            endpoints_from(services.objects.values(), slices.objects.values())
                        )

    async def _slice_version(self, client: httpx.AsyncClient) -> str:
        """`v1` when the server serves discovery.k8s.io/v1, else `v1beta1` (from /apis).

        A starting API server answers `/apis` before it has registered all its groups (for
        ≈ 0.1 s on 1.20), so a missing group is final only when a listing made *after* `/readyz`
        said the server is ready (or has no readiness endpoint to ask: 401/403/404) still lacks
        it — a server that turns ready between a listing and the readiness check is listed
        again, not refused; until then, retry."""
        delay = self.settings.backoff_initial_s
        ready_before = False  # /readyz said ready before the listing below was made
        while True:
            served: set[str] = set()
            try:
                resp = await client.get("/apis")
                _raise_for_status(resp, "/apis")
                for group in resp.json().get("groups") or []:
                    if group.get("name") == "discovery.k8s.io":
                        served |= {str(v.get("version")) for v in group.get("versions") or []}
                listed = True
            except (httpx.HTTPError, ValueError, _Gone) as e:
                log.warning("kubernetes /apis failed; retrying", error=str(e))
                listed = False
            for version in ("v1", "v1beta1"):
                if version in served:
                    return version
            if listed:
                if ready_before:
                    raise DiscoveryConfigError(
                        "the API server serves neither discovery.k8s.io/v1 nor v1beta1 "
                        "EndpointSlices; Kubernetes 1.17 or newer is needed"
                    )
                ready_before = await _server_ready(client)
                if ready_before:
                    continue  # list again, now that the answer is final
                log.info("API server not ready; EndpointSlice group not listed yet; retrying")
            await asyncio.sleep(delay * random.uniform(0.8, 1.2))
            delay = min(delay * 2, self.settings.backoff_max_s)


async def _server_ready(client: httpx.AsyncClient) -> bool:
    """Whether the API server's answers are final: `/readyz` is 200, or the server offers no
    readiness we may read (401/403/404: older servers, locked-down RBAC). 5xx and transport
    errors mean it is still starting (or stopping)."""
    try:
        resp = await client.get("/readyz")
    except httpx.HTTPError:
        return False
    return resp.status_code in (200, 401, 403, 404)
