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

The API is reached through the `kubernetes` package (the operator's client too): its kubeconfig
and in-cluster loaders (`KubeAccess`), its typed list calls and its `Watch`. That client
blocks, so each collection is listed and watched in a daemon thread of its own (list with
paging, watch from the list's resourceVersion, re-watch at each server-side timeout, list
again on 410 Gone, backoff with jitter on errors); the event loop only maps and publishes the
views the threads hand it.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import functools
import json
import os
import random
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar, cast, get_args
from urllib.parse import urlsplit

import structlog
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .types import Endpoint, EngineKind, Role

log = structlog.get_logger(__name__)
T = TypeVar("T")

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


# -- Kubernetes: API access (the `kubernetes` package) -----------------------------------------

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


@dataclass(frozen=True, slots=True, eq=False)
class KubeAccess:
    """How to reach the API server: a `kubernetes.client.Configuration` (server, credentials,
    TLS trust; the `kubernetes` package loads and refreshes them) and the default namespace.

    Build it with `in_cluster()` (the service account's files; the token is re-read as it
    rotates), `from_kubeconfig(path, context)` (anything the `kubernetes` package's kubeconfig
    loader takes: tokens, token files, client certificates, exec plugins; a CA or
    `insecure-skip-tls-verify`), or `for_server(url, token=…)`.
    """

    configuration: Any  # kubernetes.client.Configuration
    namespace: str = "default"

    @property
    def server(self) -> str:
        return str(self.configuration.host).rstrip("/")

    @property
    def insecure(self) -> bool:
        return not self.configuration.verify_ssl

    @classmethod
    def for_server(
        cls,
        server: str,
        *,
        token: str | None = None,
        namespace: str = "default",
        ca_file: str | os.PathLike[str] | None = None,
        insecure: bool = False,
    ) -> KubeAccess:
        from kubernetes import client

        cfg = client.Configuration(host=server.rstrip("/"))
        if token:
            cfg.api_key = {"BearerToken": f"Bearer {token}"}
        cfg.verify_ssl = not insecure
        cfg.ssl_ca_cert = str(ca_file) if ca_file is not None else None
        return cls(cfg, namespace)

    @classmethod
    def in_cluster(
        cls, root: Path = SERVICE_ACCOUNT_DIR, env: Mapping[str, str] | None = None
    ) -> KubeAccess:
        from kubernetes import client
        from kubernetes.config.config_exception import ConfigException
        from kubernetes.config.incluster_config import InClusterConfigLoader

        env = os.environ if env is None else env
        if not env.get("KUBERNETES_SERVICE_HOST") or not (root / "token").exists():
            raise DiscoveryConfigError(
                "not running in a cluster (KUBERNETES_SERVICE_HOST or the service account token "
                f"in {root} is missing); pass a kubeconfig path instead"
            )
        cfg = client.Configuration()
        loader = InClusterConfigLoader(  # type: ignore[no-untyped-call]
            token_filename=str(root / "token"),
            cert_filename=str(root / "ca.crt"),
            try_refresh_token=True,
            environ=dict(env),
        )
        try:
            loader.load_and_set(cfg)  # type: ignore[no-untyped-call]
        except ConfigException as e:
            raise DiscoveryConfigError(
                f"in-cluster configuration from {root}: {e}; mount the service account token "
                "(automountServiceAccountToken) or pass a kubeconfig path"
            ) from None
        namespace_file = root / "namespace"
        namespace = namespace_file.read_text().strip() if namespace_file.exists() else "default"
        return cls(cfg, namespace)

    @classmethod
    def from_kubeconfig(
        cls, path: str | os.PathLike[str], context: str | None = None
    ) -> KubeAccess:
        from kubernetes import client, config
        from kubernetes.config.config_exception import ConfigException

        path = Path(path)
        if not path.is_file():
            raise DiscoveryConfigError(
                f"{path}: no such kubeconfig file; pass the path of an existing one, or run the "
                "router in the cluster without a kubeconfig (its service account)"
            )
        cfg = client.Configuration()
        try:
            contexts, current = config.list_kube_config_contexts(str(path))  # type: ignore[no-untyped-call]
            name = context or (current or {}).get("name")
            if not name:
                raise DiscoveryConfigError(f"{path}: no current-context; pass a context name")
            chosen = next((c for c in contexts or [] if c.get("name") == name), None)
            if chosen is None:
                known = ", ".join(sorted(str(c.get("name")) for c in contexts or []))
                raise DiscoveryConfigError(f"{path}: no context named {name!r}; have: {known}")
            config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=str(path), context=name, client_configuration=cfg, persist_config=False
            )
        except ConfigException as e:
            raise DiscoveryConfigError(f"{path}: {e}") from None
        except OSError as e:
            raise DiscoveryConfigError(f"{path}: cannot read the kubeconfig ({e})") from None
        namespace = (chosen.get("context") or {}).get("namespace") or "default"
        return cls(cfg, str(namespace))

    def api_client(self) -> Any:
        """A new `kubernetes.client.ApiClient` for this server (close it when done)."""
        from kubernetes import client

        return client.ApiClient(self.configuration)


# -- Kubernetes: list + watch -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WatchSettings:
    """List/watch behaviour of `KubernetesDiscovery`.

    | parameter | default | meaning |
    |---|---|---|
    | `watch_timeout_s` | 300 | server-side timeout of one watch request (then re-watch) |
    | `backoff_initial_s` | 0.2 | first wait after a failed request |
    | `backoff_max_s` | 10 | longest wait (doubling, ±20 % jitter) |
    | `page_size` | 500 | items per list page |
    | `request_timeout_s` | 10 | connect timeout, and read timeout of a list or a discovery call |
    """

    watch_timeout_s: int = 300
    backoff_initial_s: float = 0.2
    backoff_max_s: float = 10.0
    page_size: int = 500
    request_timeout_s: float = 10.0


_Objects = dict[tuple[str, str], dict[str, Any]]


class _Collection:
    """One listed-and-watched collection, kept by a daemon thread through the `kubernetes`
    client (blocking; the router's event loop never waits on it): a paged list, then watches
    from the list's resourceVersion (each ends at the server-side timeout and is renewed from
    the last resourceVersion seen, bookmarks included); 410 Gone — as an HTTP status or a
    watch ERROR event — lists again; any other failure (transport, 401/403, 5xx) waits with
    backoff and retries. Every view after the first complete list is handed to `post` as a
    new dict (the thread never shares one it still changes)."""

    def __init__(
        self,
        name: str,
        list_call: Callable[..., Any],
        selector: str,
        settings: WatchSettings,
        post: Callable[[_Objects], None],
    ) -> None:
        self.name, self.list_call, self.selector = name, list_call, selector
        self.settings, self.post = settings, post
        self.objects: _Objects = {}
        self._stopping = threading.Event()
        self._watch: Any = None
        self._thread = threading.Thread(target=self._run, name=f"kube-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Ask the thread to end, and cut an open watch short (it does not wait: see
        `stopped`). Repeat it while the thread lives: a watch request that was being opened
        has its socket only afterwards."""
        self._stopping.set()
        w = self._watch
        if w is not None:
            w.stop()  # also shuts the open watch's socket down, waking the blocked read

    async def stopped(self, timeout_s: float = 2.0) -> None:
        """`stop()` until the thread has ended (at most `timeout_s`; it is a daemon thread, so
        one stuck past that never holds up the interpreter's exit)."""
        deadline = time.monotonic() + timeout_s
        while self._thread.is_alive() and time.monotonic() < deadline:
            self.stop()
            await asyncio.sleep(0.02)

    def _run(self) -> None:
        from kubernetes.client.exceptions import ApiException

        rv: str | None = None
        delay = self.settings.backoff_initial_s
        while not self._stopping.is_set():
            try:
                if rv is None:
                    rv = self._list()
                    delay = self.settings.backoff_initial_s
                rv = self._watch_once(rv)
                delay = self.settings.backoff_initial_s
            except ApiException as e:
                if self._stopping.is_set():
                    return
                if e.status == 410:
                    log.info("watch expired; listing again", resource=self.name)
                    rv = None
                    continue
                if e.status in (401, 403):
                    log.error(
                        "kubernetes API refused; grant list and watch on services and "
                        "endpointslices in the namespace",
                        resource=self.name,
                        status=e.status,
                    )
                else:
                    log.warning(
                        "kubernetes request failed; retrying",
                        resource=self.name,
                        status=e.status,
                        reason=e.reason,
                    )
                delay = self._backoff(delay)
            except Exception as e:  # transport errors (urllib3), malformed answers
                if self._stopping.is_set():
                    return
                log.warning("kubernetes request failed; retrying", resource=self.name, error=str(e))
                delay = self._backoff(delay)

    def _backoff(self, delay: float) -> float:
        self._stopping.wait(delay * random.uniform(0.8, 1.2))
        return min(delay * 2, self.settings.backoff_max_s)

    def _list(self) -> str:
        objects: _Objects = {}
        kw: dict[str, Any] = {"label_selector": self.selector, "limit": self.settings.page_size}
        timeout = self.settings.request_timeout_s
        while True:
            resp = self.list_call(**kw, _preload_content=False, _request_timeout=(timeout, 60))
            body = json.loads(resp.data)
            for item in body.get("items") or []:
                objects[_key(item)] = item
            meta = body.get("metadata") or {}
            if not meta.get("continue"):
                break
            kw["_continue"] = meta["continue"]
        self.objects = objects
        self.post(dict(objects))
        return str(meta.get("resourceVersion", ""))

    def _watch_once(self, rv: str) -> str:
        from kubernetes import watch

        # objects as the API's JSON (what `endpoints_from` maps), not the client's models
        self._watch = w = watch.Watch(return_type="object")  # type: ignore[no-untyped-call]
        timeout = self.settings.watch_timeout_s
        if self._stopping.is_set():
            return rv
        try:
            for event in w.stream(  # type: ignore[no-untyped-call]
                self.list_call,
                label_selector=self.selector,
                resource_version=rv,
                allow_watch_bookmarks=True,
                timeout_seconds=timeout,
                _request_timeout=(self.settings.request_timeout_s, timeout + 30),
            ):
                kind, obj = event.get("type"), event.get("object") or {}
                rv = str((obj.get("metadata") or {}).get("resourceVersion") or rv)
                if kind in ("ADDED", "MODIFIED"):
                    self.objects[_key(obj)] = obj
                elif kind == "DELETED":
                    self.objects.pop(_key(obj), None)
                else:
                    continue  # BOOKMARK: a newer resourceVersion, nothing changed
                self.post(dict(self.objects))
                if self._stopping.is_set():
                    break
        finally:
            self._watch = None
        return rv


def _key(obj: Mapping[str, Any]) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return (str(meta.get("namespace", "")), str(meta.get("name", "")))


async def _in_thread(fn: Callable[[], T]) -> T:
    """`fn()` in a daemon thread (a call blocked on an unanswering server never holds up the
    interpreter's exit, as the default executor's threads would)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def deliver(ok: bool, value: Any) -> None:
        if done.done():
            return
        if ok:
            done.set_result(value)
        else:
            done.set_exception(value)

    def call() -> None:
        try:
            result: tuple[bool, Any] = (True, fn())
        except BaseException as e:
            result = (False, e)
        with contextlib.suppress(RuntimeError):  # the loop has closed meanwhile
            loop.call_soon_threadsafe(deliver, *result)

    threading.Thread(target=call, name="kube-call", daemon=True).start()
    return await done


class KubernetesDiscovery(Discovery):
    """Endpoints of one BeamDeployment from its Services' EndpointSlices (module docstring).

    | parameter | default | meaning |
    |---|---|---|
    | `deployment` | — | value of the `beamserve.io/deployment` Service label |
    | `access` | — | `KubeAccess` (in-cluster or kubeconfig) |
    | `namespace` | `access.namespace` | where the Services live |
    | `settings` | `WatchSettings()` | timeouts and backoff |

    The `kubernetes` client is blocking: each collection's list/watch loop runs in a thread of
    its own and hands complete views to the event loop, which maps and publishes them.
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
        from kubernetes import client

        def build() -> tuple[Any, Any, Any, Any]:
            # the client's API modules are imported on first use, and CoreV1Api's takes
            # seconds: never on the event loop
            api = self.access.api_client()
            return api, client.CoreV1Api(api), client.CustomObjectsApi(api), client.ApisApi(api)

        api, core, custom, apis = await _in_thread(build)
        collections: list[_Collection] = []
        try:
            self.slice_version = await self._slice_version(api, apis)
            loop = asyncio.get_running_loop()
            views: dict[str, _Objects] = {}
            changed = asyncio.Event()

            def receive(kind: str, objects: _Objects) -> None:
                views[kind] = objects
                changed.set()

            def poster(kind: str) -> Callable[[_Objects], None]:
                def post(objects: _Objects) -> None:
                    with contextlib.suppress(RuntimeError):  # the loop has closed
                        loop.call_soon_threadsafe(receive, kind, objects)

                return post

            ns = self.namespace
            collections = [
                _Collection(
                    "services",
                    functools.partial(core.list_namespaced_service, ns),
                    f"{LABEL_DEPLOYMENT}={self.deployment}",
                    self.settings,
                    poster("services"),
                ),
                _Collection(
                    "endpointslices",
                    functools.partial(
                        custom.list_namespaced_custom_object,
                        "discovery.k8s.io",
                        self.slice_version,
                        ns,
                        "endpointslices",
                    ),
                    LABEL_SERVICE_NAME,
                    self.settings,
                    poster("endpointslices"),
                ),
            ]
            for c in collections:
                c.start()
            while True:
                await changed.wait()
                changed.clear()
                if len(views) == len(collections):
                    self._publish(
                        endpoints_from(views["services"].values(), views["endpointslices"].values())
                    )
        finally:
            for c in collections:
                c.stop()
            for c in collections:
                await c.stopped()
            api.close()

    async def _slice_version(self, api: Any, apis: Any) -> str:
        """`v1` when the server serves discovery.k8s.io/v1, else `v1beta1` (from `/apis`).

        A starting API server answers `/apis` before it has registered all its groups (for
        ≈ 0.1 s on 1.20), so a missing group is final only when a listing made *after* `/readyz`
        said the server is ready (or has no readiness endpoint to ask: 401/403/404) still lacks
        it — a server that turns ready between a listing and the readiness check is listed
        again, not refused; until then, retry."""
        timeout = self.settings.request_timeout_s
        delay = self.settings.backoff_initial_s
        ready_before = False  # /readyz said ready before the listing below was made
        while True:
            served: set[str] = set()
            try:
                # the raw answer (`_preload_content=False`), not the typed model
                resp: Any = await _in_thread(
                    lambda: apis.get_api_versions(_preload_content=False, _request_timeout=timeout)
                )
                for group in json.loads(resp.data).get("groups") or []:
                    if group.get("name") == "discovery.k8s.io":
                        served |= {str(v.get("version")) for v in group.get("versions") or []}
                listed = True
            except Exception as e:  # ApiException, transport errors, malformed answers
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
                ready_before = await _in_thread(lambda: _server_ready(api, timeout))
                if ready_before:
                    continue  # list again, now that the answer is final
                log.info("API server not ready; EndpointSlice group not listed yet; retrying")
            await asyncio.sleep(delay * random.uniform(0.8, 1.2))
            delay = min(delay * 2, self.settings.backoff_max_s)


def _server_ready(api: Any, timeout: float) -> bool:
    """Whether the API server's answers are final: `/readyz` is 200, or the server offers no
    readiness we may read (401/403/404: older servers, locked-down RBAC). 5xx and transport
    errors mean it is still starting (or stopping)."""
    try:
        request = api.param_serialize("GET", "/readyz", auth_settings=["BearerToken"])
        resp = api.call_api(*request, _request_timeout=timeout)
    except Exception:
        return False
    return int(resp.status) in (200, 401, 403, 404)
