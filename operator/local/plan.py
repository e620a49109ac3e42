"""What a `BeamDeployment` becomes on one machine: `local_plan(bd, state_dir)` (pure).

The local runtime (`beamserve up`) does not compute its own picture of a deployment: it takes
the objects the operator would apply (`desired_objects`) and maps each pod onto a process.

| Kubernetes | local |
|---|---|
| a pool Deployment with `replicas: n` | n processes `<pool>-<i>` (the pod names' stand-in) |
| the router Deployment | one process `<bd>-router` (`replicas` ignored: one is enough here) |
| the container's `command` and `env` | argv and environment (on top of ours) |
| `$(POD_IP)` (downward API) | `127.0.0.1` |
| `--host 0.0.0.0` | `--host 127.0.0.1` (nothing listens beyond loopback) |
| a `hostPath` volume mounted at M | argv paths under M rewritten to the host path |
| the router ConfigMap (`router.yaml`) | `<state_dir>/router.yaml`, `discovery` left out |
| `--kubernetes <bd> --namespace …` | `--local-runtime <state_dir>/endpoints.json` |
| named container ports | free loopback ports (`assign_ports`), argv rewritten to them |
| the worker Services' discovery labels | the endpoints file's entries (`endpoint_specs`) |

Two steps, both pure: `local_plan` keeps the pods' container ports; `assign_ports` gives each
(process, port name) a host port — the previous one when the process existed before, else the
next from the iterator it is handed — and rewrites the argv. Processes sharing a container port
(replicas of a pool) each get their own.

**Rolls.** Every process carries `template_hash`: SHA-256 over its Deployment's pod template
(and, for the router, the ConfigMap's data). `diff_plans(old, new)` names the processes to
start, stop and restart: a changed template restarts that pool's processes only; a new revision
(a KV-incompatible change) renames the pool, so the old pool's processes stop and the new ones
start; a replica count change starts or stops processes at the end of the pool.

Local limits (`LocalPlanError`, naming the field and the fix): engines `sim` and `ref` only
(SGLang and vLLM need GPUs and their images); model sources `hostPath` only; one node per
replica; no managed Redis (`sessionStore.type: memory`, or `external` with a `url`).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml
from beamserve.operator.api import POOL_ROLES, BeamDeployment
from beamserve.operator.desired import (
    LABEL_COMPONENT,
    LABEL_ENGINE,
    LABEL_POOL,
    LABEL_REVISION,
    LABEL_ROLE,
    ROUTER_CONFIG_FILE,
    ClusterFacts,
    Object,
    desired_objects,
)
from beamserve.operator.naming import child_name
from beamserve.operator.pools import POD_IP_ENV

LOOPBACK = "127.0.0.1"
ENDPOINTS_FILE = "endpoints.json"
LOCAL_NAMESPACE = "local"
# Flags whose value is a port the process listens on (`--flag N` or `--flag=N`).
PORT_FLAGS = frozenset({"--port", "--handshake-port", "--grpc-port", "--bootstrap-port"})
_ZMQ_BIND = re.compile(r"^tcp://(\*|0\.0\.0\.0|127\.0\.0\.1):(\d+)$")
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


class LocalPlanError(ValueError):
    """The spec cannot run as local processes; the message names the field and the fix."""


@dataclass(frozen=True)
class LocalPort:
    """One named port of a process: the pod's `container_port`, and the loopback `host_port`
    it listens on here (None until `assign_ports`)."""

    name: str
    container_port: int
    host_port: int | None = None


@dataclass(frozen=True)
class Liveness:
    """An HTTP liveness probe as the pod states it: GET `path` every `period_s`, each answer
    due within `timeout_s`; `failures` in a row (no answer, or not 2xx/3xx) kill the process,
    which then restarts as a crashed one does."""

    path: str
    period_s: float = 10.0
    timeout_s: float = 1.0
    failures: int = 3


def liveness_of(container: Mapping[str, Any]) -> Liveness | None:
    """`container`'s `livenessProbe` when it is an HTTP GET (Kubernetes' defaults otherwise:
    period 10 s, timeout 1 s, 3 failures); None for none or another kind (TCP, exec)."""
    probe = container.get("livenessProbe") or {}
    get = probe.get("httpGet")
    if not isinstance(get, Mapping) or not get.get("path"):
        return None
    return Liveness(
        path=str(get["path"]),
        period_s=float(probe.get("periodSeconds", 10)),
        timeout_s=float(probe.get("timeoutSeconds", 1)),
        failures=int(probe.get("failureThreshold", 3)),
    )


@dataclass(frozen=True)
class LocalProcess:
    """One pod of the desired state, as a process.

    `component`: `router`, `prefill`, `decode` or `both`. `pool`: the workload's name (a pool
    Deployment `<bd>-<role>-<rev>`, or `<bd>-router`). `health_path`: answers 200 once the
    process serves (its readiness probe). `template_hash`: changes exactly when the workload's
    pod template (or the router's configuration) does.
    """

    name: str
    component: str
    pool: str
    argv: tuple[str, ...]
    env: Mapping[str, str]
    ports: tuple[LocalPort, ...]
    labels: Mapping[str, str]
    health_path: str
    template_hash: str
    revision: str = ""
    engine: str = ""
    files: Mapping[str, str] = field(default_factory=dict)
    """Files to write before starting (absolute path → content): the router's config."""
    liveness: Liveness | None = None
    """The pod's HTTP liveness probe, which `LocalStack` runs as a kubelet would (None: none)."""

    @property
    def is_worker(self) -> bool:
        return self.component in POOL_ROLES

    def port(self, name: str) -> int:
        """The host port of `name` (after `assign_ports`); KeyError when unknown or unset."""
        for p in self.ports:
            if p.name == name and p.host_port is not None:
                return p.host_port
        raise KeyError(f"{self.name}: no assigned port {name!r}")

    @property
    def url(self) -> str:
        """`http://127.0.0.1:<http port>`."""
        return f"http://{LOOPBACK}:{self.port('http')}"


@dataclass(frozen=True)
class LocalPlan:
    """Every process of one BeamDeployment, workers first (in pool order), the router last."""

    name: str
    state_dir: Path
    processes: tuple[LocalProcess, ...]

    @property
    def endpoints_file(self) -> Path:
        return self.state_dir / ENDPOINTS_FILE

    @property
    def workers(self) -> tuple[LocalProcess, ...]:
        return tuple(p for p in self.processes if p.is_worker)

    @property
    def router(self) -> LocalProcess:
        return next(p for p in self.processes if p.component == "router")

    def by_name(self) -> dict[str, LocalProcess]:
        return {p.name: p for p in self.processes}

    def host_ports(self) -> dict[str, int]:
        """`<process>/<port name>` → host port (what `assign_ports` takes as `previous`)."""
        return {
            f"{p.name}/{port.name}": port.host_port
            for p in self.processes
            for port in p.ports
            if port.host_port is not None
        }


@dataclass(frozen=True)
class PlanDiff:
    """What turns `old` into `new`: process names, each list in `new`'s (or `old`'s) order."""

    start: tuple[str, ...]
    stop: tuple[str, ...]
    restart: tuple[str, ...]
    keep: tuple[str, ...]

    @property
    def empty(self) -> bool:
        return not (self.start or self.stop or self.restart)


# -- step 1: the desired objects as processes -------------------------------------------------


def local_plan(bd: BeamDeployment, state_dir: Path) -> LocalPlan:
    """The processes `bd` runs as here (container ports, not yet host ports).

    Raises `LocalPlanError` for what the local runtime cannot run (module docstring)."""
    _check_local(bd)
    name = str(bd.metadata.name or "")
    objects = desired_objects(bd, ClusterFacts(namespace=LOCAL_NAMESPACE))
    config_maps = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ConfigMap"}
    deployments = [o for o in objects if o["kind"] == "Deployment"]
    router_name = child_name(name, "router")
    out: list[LocalProcess] = []
    for dep in deployments:
        labels = dep["metadata"]["labels"]
        if labels.get(LABEL_COMPONENT) not in POOL_ROLES:
            continue
        for i in range(int(dep["spec"]["replicas"])):
            out.append(_worker(dep, i, state_dir))
    router_dep = next(d for d in deployments if d["metadata"]["name"] == router_name)
    out.append(_router(router_dep, config_maps, state_dir))
    return LocalPlan(name=name, state_dir=state_dir, processes=tuple(out))


def _check_local(bd: BeamDeployment) -> None:
    spec = bd.spec
    if spec.engine.name not in ("sim", "ref"):
        raise LocalPlanError(
            f"spec.engine.name: {spec.engine.name} needs GPUs and its engine image, which "
            "`beamserve up` does not run; use engine sim (simulated Beam) or ref (a tiny real "
            "Beam on CPU) locally, or deploy to Kubernetes"
        )
    if spec.model.source.host_path is None:
        raise LocalPlanError(
            "spec.model.source: `beamserve up` reads the checkpoint from this machine; set "
            "hostPath.path to its directory (e.g. `beamserve model make-tiny /tmp/beam-tiny`)"
        )
    for role, pool in spec.pools().items():
        if pool.nodes_per_replica > 1:
            raise LocalPlanError(
                f"spec.{role}.nodesPerReplica: {pool.nodes_per_replica}; a local pool runs one "
                "process per replica, so set nodesPerReplica: 1"
            )
    store = spec.router.session_store
    if store.type == "redis" or (store.type == "external" and store.url is None):
        raise LocalPlanError(
            f"spec.router.sessionStore.type: {store.type} needs a Redis the local runtime does "
            "not start; use type: memory, or type: external with url: redis://HOST:PORT/0"
        )
    if spec.router.api_keys_secret_ref is not None:
        raise LocalPlanError(
            "spec.router.apiKeysSecretRef: Secrets do not exist locally; leave it out "
            "(the local router then asks for no key)"
        )


def _container(dep: Object) -> tuple[Object, Object]:
    pod = dep["spec"]["template"]["spec"]
    return pod, pod["containers"][0]


def _template_hash(*parts: Any) -> str:
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _mounts(pod: Object, container: Object, proc_dir: Path) -> dict[str, str]:
    """Mount path → local path: hostPath volumes as themselves, others under `proc_dir`."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    out: dict[str, str] = {}
    for m in container.get("volumeMounts", []):
        vol = volumes.get(m["name"], {})
        if "hostPath" in vol:
            out[m["mountPath"]] = vol["hostPath"]["path"]
        else:
            out[m["mountPath"]] = str(proc_dir / m["name"])
    return out


def map_path(arg: str, mounts: Mapping[str, str]) -> str:
    """`arg` with its longest mount-path prefix (whole path components) replaced."""
    best = ""
    for mount in mounts:
        if (arg == mount or arg.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best):
            best = mount
    if not best:
        return arg
    return mounts[best] + arg[len(best) :]


def _env(container: Object) -> dict[str, str]:
    """The container's env with the downward API's pod IP as loopback."""
    out: dict[str, str] = {}
    for e in container.get("env", []):
        if "value" in e:
            out[e["name"]] = str(e["value"])
        elif e["name"] == POD_IP_ENV:
            out[e["name"]] = LOOPBACK
    return out


def expand_vars(arg: str, env: Mapping[str, str]) -> str:
    """Kubernetes' `$(NAME)` references, as the kubelet expands them (unknown ones stay)."""
    return _VAR.sub(lambda m: env.get(m.group(1), m.group(0)), arg)


def _loopback(argv: Sequence[str]) -> list[str]:
    out = list(argv)
    for i in range(len(out) - 1):
        if out[i] == "--host" and out[i + 1] in ("0.0.0.0", "::"):
            out[i + 1] = LOOPBACK
    return out


def _ports(container: Object) -> tuple[LocalPort, ...]:
    return tuple(LocalPort(p["name"], int(p["containerPort"])) for p in container["ports"])


def _worker(dep: Object, index: int, state_dir: Path) -> LocalProcess:
    pod, c = _container(dep)
    labels = dep["metadata"]["labels"]
    name = f"{dep['metadata']['name']}-{index}"
    env = _env(c)
    mounts = _mounts(pod, c, state_dir / "volumes" / name)
    argv = [map_path(expand_vars(a, env), mounts) for a in c["command"]]
    probe = c.get("readinessProbe", {}).get("httpGet", {})
    return LocalProcess(
        name=name,
        component=labels[LABEL_ROLE],
        pool=dep["metadata"]["name"],
        argv=tuple(_loopback(argv)),
        env=env,
        ports=_ports(c),
        labels=dict(labels),
        health_path=str(probe.get("path", "/health")),
        template_hash=_template_hash(dep["spec"]["template"]),
        revision=labels.get(LABEL_REVISION, ""),
        engine=labels.get(LABEL_ENGINE, ""),
        liveness=liveness_of(c),
    )


def _router(dep: Object, config_maps: Mapping[str, Object], state_dir: Path) -> LocalProcess:
    pod, c = _container(dep)
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    files: dict[str, str] = {}
    mounts = _mounts(pod, c, state_dir / "volumes" / dep["metadata"]["name"])
    for m in c.get("volumeMounts", []):
        cm_ref = volumes.get(m["name"], {}).get("configMap")
        if cm_ref is None:
            continue
        mounts[m["mountPath"]] = str(state_dir)
        for key, text in config_maps[cm_ref["name"]]["data"].items():
            if key == ROUTER_CONFIG_FILE:
                cfg = yaml.safe_load(text) or {}
                cfg.pop("discovery", None)  # the Kubernetes watch; here: the endpoints file
                text = yaml.safe_dump(cfg, sort_keys=False)
            files[str(state_dir / key)] = text
    env = _env(c)
    argv: list[str] = []
    raw = [map_path(expand_vars(a, env), mounts) for a in c["command"]]
    i = 0
    while i < len(raw):
        if raw[i] == "--kubernetes":
            argv += ["--local-runtime", str(state_dir / ENDPOINTS_FILE)]
            i += 2
        elif raw[i] in ("--namespace", "--kubeconfig"):
            i += 2
        else:
            argv.append(raw[i])
            i += 1
    ports = _ports(c)
    if "--port" not in argv:  # the ConfigMap holds the port; the flag overrides it here
        argv += ["--port", str(next(p.container_port for p in ports if p.name == "http"))]
    if "--grpc-port" not in argv:
        grpc = [p for p in ports if p.name == "grpc"]
        if grpc:
            argv += ["--grpc-port", str(grpc[0].container_port)]
    labels = dep["metadata"]["labels"]
    return LocalProcess(
        name=dep["metadata"]["name"],
        component="router",
        pool=dep["metadata"]["name"],
        argv=tuple(_loopback(argv)),
        env=env,
        ports=ports,
        labels=dict(labels),
        health_path="/v1/models",  # /health is 503 until a worker is ready; this is liveness
        template_hash=_template_hash(dep["spec"]["template"], files),
        files=files,
    )


# -- step 2: host ports -----------------------------------------------------------------------


def rewrite_ports(argv: Sequence[str], mapping: Mapping[int, int]) -> tuple[str, ...]:
    """`argv` with every listening port in `mapping` replaced: values of `PORT_FLAGS`
    (`--port 8000`, `--port=8000`) and ZMQ binds (`tcp://*:5557`, bound to loopback).
    Other numbers — a `--max-model-len 8000` — are left alone."""
    out = list(argv)
    for i, arg in enumerate(out):
        prev = out[i - 1] if i else ""
        if prev in PORT_FLAGS and arg.isdigit() and int(arg) in mapping:
            out[i] = str(mapping[int(arg)])
            continue
        flag, eq, value = arg.partition("=")
        if eq and flag in PORT_FLAGS and value.isdigit() and int(value) in mapping:
            out[i] = f"{flag}={mapping[int(value)]}"
            continue
        m = _ZMQ_BIND.match(arg)
        if m and int(m.group(2)) in mapping:
            out[i] = f"tcp://{LOOPBACK}:{mapping[int(m.group(2))]}"
    return tuple(out)


def assign_ports(
    plan: LocalPlan, free: Iterator[int], previous: Mapping[str, int] = {}
) -> LocalPlan:
    """`plan` with a host port for every (process, port name): `previous[<proc>/<port>]` when
    given (a process that keeps running, or restarts, keeps its ports), else `next(free)`.
    Ports in `previous` are never handed out again from `free` to another process.

    Raises `LocalPlanError` if `free` runs dry."""
    taken = set(previous.values())
    procs: list[LocalProcess] = []
    for proc in plan.processes:
        ports: list[LocalPort] = []
        for p in proc.ports:
            key = f"{proc.name}/{p.name}"
            host = previous.get(key)
            if host is None:
                host = _next_free(free, taken)
                taken.add(host)
            ports.append(replace(p, host_port=host))
        mapping = {p.container_port: p.host_port for p in ports if p.host_port is not None}
        procs.append(replace(proc, ports=tuple(ports), argv=rewrite_ports(proc.argv, mapping)))
    return replace(plan, processes=tuple(procs))


def _next_free(free: Iterator[int], taken: set[int]) -> int:
    for port in free:
        if port not in taken:
            return port
    raise LocalPlanError("no free loopback port left; stop other services or widen the range")


# -- the endpoints file -----------------------------------------------------------------------


def endpoint_spec_of(proc: LocalProcess) -> dict[str, Any]:
    """The endpoints-file entry (`beamserve.router.discovery.EndpointSpec`) of a worker: what
    the router's Kubernetes discovery reads off the worker Service's labels and named ports."""
    if not proc.is_worker:
        raise ValueError(f"{proc.name}: only workers are endpoints")
    return {
        "url": proc.url,
        "id": proc.name,
        "role": proc.component,
        "pool": proc.labels.get(LABEL_POOL, proc.component),
        "revision": proc.revision,
        "engine": proc.engine,
        "kv_events": proc.port("kv-events"),
        "kv_replay": proc.port("kv-replay"),
    }


def endpoint_specs(plan: LocalPlan, ready: set[str] | None = None) -> list[dict[str, Any]]:
    """Entries of the workers in `ready` (names; None: all), sorted by id."""
    return sorted(
        (endpoint_spec_of(p) for p in plan.workers if ready is None or p.name in ready),
        key=lambda e: str(e["id"]),
    )


# -- rolls ------------------------------------------------------------------------------------


def diff_plans(old: LocalPlan, new: LocalPlan) -> PlanDiff:
    """Processes to start (new names), stop (gone names), restart (same name, other
    template) and keep, comparing `template_hash` per process name."""
    before, after = old.by_name(), new.by_name()
    return PlanDiff(
        start=tuple(n for n in after if n not in before),
        stop=tuple(n for n in before if n not in after),
        restart=tuple(
            n for n in after if n in before and before[n].template_hash != after[n].template_hash
        ),
        keep=tuple(
            n for n in after if n in before and before[n].template_hash == after[n].template_hash
        ),
    )
