"""What a `BeamDeployment` becomes in Kubernetes: `desired_objects(bd, facts)` (pure).

The operator applies the result with server-side apply; `beamserve render FILE` prints it; the
local runtime (`beamserve up`) reads the same pool commands. Nothing here talks to a server:
what the cluster serves comes in as `ClusterFacts` (built by `discover_facts` at the edge,
`beamserve.operator.reconcile`), what the autoscalers chose as `replicas` (per role).

Objects, in apply order (names from `naming.child_name`):

| object | name | when |
|---|---|---|
| ServiceAccount, Role, RoleBinding (router discovery) | `<bd>-router` | always |
| ConfigMap (`router.yaml`: the `RouterConfig`) | `<bd>-router-config` | always |
| Deployment + Service (+ PVC) of managed Redis | `<bd>-redis` | `sessionStore.type: redis` |
| per pool: Deployment, or LeaderWorkerSet (`nodesPerReplica > 1`) | `<bd>-<role>-<rev>` | always |
| per pool: headless Service (discovery labels, named ports) | `<bd>-<role>-<rev>` | always |
| per pool: PodDisruptionBudget | `<bd>-<role>-<rev>` | always |
| router Deployment, Service, PodDisruptionBudget | `<bd>-router` | always |
| NetworkPolicy (who may reach the workers) | `<bd>-workers` | always |
| ServiceMonitor or PodMonitor per role | `<bd>-<role>`, `<bd>-router` | monitoring on, API served |
| InferencePool (router as endpoint picker) | `<bd>-workers` | `router.grpcPort` set, API served |

**Revisions.** `revision(spec)` hashes the fields that decide whether two workers can exchange
KV or share a prefix index (engine name, image and API surface; the model's source, format and
fingerprint; every pool's page size and KV dtype; the transfer backend). Pool objects carry it
in their names and in the label `beamserve.io/revision`, so a KV-incompatible change creates a
second set of pools beside the first, and the router — which only pairs workers of the same
revision — never mixes them. Every other change (replicas, tuning, resources …) rolls the
existing pools in place. Retiring the old revision is the reconciler's job (it sees the pods).

**Labels.** Worker Services carry the discovery labels `router/discovery.py` watches
(`beamserve.io/deployment`, `role`, `pool`, `revision`, `engine`); nothing else does, so the
router never discovers itself or Redis. Every child carries `app.kubernetes.io/instance=<bd>`
and `app.kubernetes.io/managed-by=beamserve` (what the reconciler lists by).
"""

from __future__ import annotations

import copy
import hashlib
import json
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml
from beamserve.operator.api import (
    API_VERSION,
    GPU_ENGINES,
    KIND,
    BeamDeployment,
    BeamDeploymentSpec,
    ManagedRedisSpec,
    ModelSourceSpec,
    PoolRole,
    PoolSpec,
)
from beamserve.operator.naming import REVISION_LENGTH, child_name, pool_part
from beamserve.operator.pools import POD_IP_ENV, pool_command

Object = dict[str, Any]

FIELD_MANAGER = "beamserve"
DEFAULT_IMAGE = "ghcr.io/beamserve/beamserve:0.1.0"
LABEL_DEPLOYMENT = "beamserve.io/deployment"
LABEL_ROLE = "beamserve.io/role"
LABEL_POOL = "beamserve.io/pool"
LABEL_REVISION = "beamserve.io/revision"
LABEL_ENGINE = "beamserve.io/engine"
# vLLM's `kv_transfer_config.kv_role`, as the router reads it (`Endpoint.label("kv_role")`)
LABEL_KV_ROLE = "kv_role"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "beamserve"
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
ROUTER_CONFIG_FILE = "router.yaml"
ROUTER_CONFIG_DIR = "/etc/beamserve/router"
REDIS_PORT = 6379
# Prometheus pods (any namespace) may scrape the workers' http port (`/metrics` lives there).
PROMETHEUS_POD_LABELS = {"app.kubernetes.io/name": "prometheus"}

# Slow model loads: a 501B checkpoint takes many minutes to load and warm up; the startup probe
# holds liveness off for up to `STARTUP_BUDGET_S` before the kubelet may restart the pod.
STARTUP_BUDGET_S = {"gpu": 3600, "cpu": 600}
STARTUP_PERIOD_S = 10


@dataclass(frozen=True)
class ClusterFacts:
    """What the API server serves (discovered once per operator start; `discover_facts`).

    The defaults describe a current cluster without optional add-ons (`beamserve render`
    without `--facts`): `policy/v1`, no LeaderWorkerSet, no Prometheus operator, no Gateway API
    Inference Extension.
    """

    pdb_api_version: str = "policy/v1"
    """`policy/v1` (≥ 1.21) or `policy/v1beta1`."""
    leader_worker_set: bool = False
    service_monitor: bool = False
    pod_monitor: bool = False
    inference_pool: bool = False
    operator_image: str = DEFAULT_IMAGE
    """Image of `sim`/`ref` workers, the router and the download init container by default."""
    namespace: str = "default"
    """Namespace of objects whose BeamDeployment names none (render only)."""

    @classmethod
    def everything(cls, **over: Any) -> ClusterFacts:
        """A cluster serving every optional API (tests, `beamserve render --all-apis`)."""
        base: dict[str, Any] = {
            "leader_worker_set": True,
            "service_monitor": True,
            "pod_monitor": True,
            "inference_pool": True,
        }
        return cls(**{**base, **over})


class RenderError(ValueError):
    """The spec cannot become objects on this cluster; the message says what to change."""


@dataclass(frozen=True)
class PoolPlan:
    """One pool of the update revision, as the reconciler needs to find it again."""

    role: PoolRole
    name: str
    workload_kind: str
    """`Deployment` or `LeaderWorkerSet`."""
    selector: dict[str, str] = field(default_factory=dict)


# -- revisions --------------------------------------------------------------------------------


def kv_identity(spec: BeamDeploymentSpec) -> dict[str, Any]:
    """The fields two workers must share to exchange KV and share a prefix index."""
    pools = spec.pools()
    return {
        "engine": {
            "name": spec.engine.name,
            "image": spec.engine.image,
            "api": spec.engine.api if spec.engine.name not in GPU_ENGINES else None,
        },
        "model": {
            "source": spec.model.source.to_json_dict(),
            "format": spec.model.format,
            "fingerprint": spec.model.fingerprint,
        },
        "kv": {
            "transferBackend": spec.kv.transfer_backend,
            "pageSize": {role: spec.page_size(role) for role in pools},
            "dtype": {role: spec.kv_dtype(role) for role in pools},
        },
    }


def revision(spec: BeamDeploymentSpec) -> str:
    """`REVISION_LENGTH` hex digits of SHA-256 over `kv_identity(spec)` (canonical JSON)."""
    blob = json.dumps(kv_identity(spec), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:REVISION_LENGTH]


# -- entry points -----------------------------------------------------------------------------


def parse_deployment(obj: Mapping[str, Any]) -> BeamDeployment:
    """A BeamDeployment object (as the API server returns it) as the model (status ignored)."""
    body = {k: v for k, v in obj.items() if k in ("apiVersion", "kind", "metadata", "spec")}
    return BeamDeployment.model_validate(body, by_alias=True, by_name=False)


def desired_objects(
    bd: BeamDeployment,
    facts: ClusterFacts = ClusterFacts(),
    *,
    replicas: Mapping[str, int] | None = None,
) -> list[Object]:
    """Every object `bd` should own on a cluster described by `facts`, in apply order.

    `replicas` overrides a pool's `spec.<role>.replicas` (what its scaler, `BeamPool`, holds
    now). Raises `RenderError` when the spec needs an API the cluster lacks (a multi-node pool
    without LeaderWorkerSet).
    """
    ctx = _Context(bd, facts, dict(replicas or {}))
    out: list[Object] = []
    out += ctx.router_access()
    out.append(ctx.router_config_map())
    out += ctx.redis()
    for role, pool in bd.spec.pools().items():
        out += ctx.pool_objects(role, pool)
    out += ctx.router()
    out.append(ctx.network_policy())
    out += ctx.monitors()
    out += ctx.inference_pool()
    return out


def pool_plans(bd: BeamDeployment, facts: ClusterFacts = ClusterFacts()) -> list[PoolPlan]:
    """The pools of the update revision (names, workload kinds, pod selectors)."""
    ctx = _Context(bd, facts, {})
    out = []
    for role, pool in bd.spec.pools().items():
        kind = "LeaderWorkerSet" if pool.nodes_per_replica > 1 else "Deployment"
        out.append(PoolPlan(role, ctx.pool_name(role), kind, ctx.pool_selector(role)))
    return out


def router_endpoint(bd: BeamDeployment, namespace: str) -> str:
    """Where clients send requests: the router Service's cluster DNS name and port."""
    name = child_name(_name(bd), "router")
    return f"http://{name}.{namespace}.svc:{bd.spec.router.port}"


def render_yaml(objects: list[Object]) -> str:
    """The objects as one multi-document YAML stream (`beamserve render`)."""
    return str(yaml.safe_dump_all(objects, sort_keys=False, width=100, allow_unicode=True))


def router_config_dict(bd: BeamDeployment, namespace: str) -> dict[str, Any]:
    """The router's configuration file: `spec.router` (the `RouterConfig`) plus where the
    workers are (`discovery`), what `beamserve router --config FILE` reads."""
    cfg = bd.spec.router.to_json_dict()
    for key in ("replicas", "image", "resources", "nodeSelector"):
        cfg.pop(key, None)  # the Deployment's shape, not the process's configuration
    cfg["discovery"] = {"kubernetes": {"deployment": _name(bd), "namespace": namespace}}
    cfg["servedModelName"] = bd.spec.model.served_name
    return cfg


# -- the builder ------------------------------------------------------------------------------


def _name(bd: BeamDeployment) -> str:
    name = bd.metadata.name
    if not name:
        raise RenderError("metadata.name: required; name the BeamDeployment, e.g. 'beam-prod'")
    return str(name)


class _Context:
    def __init__(self, bd: BeamDeployment, facts: ClusterFacts, replicas: dict[str, int]) -> None:
        self.bd = bd
        self.spec = bd.spec
        self.facts = facts
        self.replicas = replicas
        self.name = _name(bd)
        self.namespace = bd.metadata.namespace or facts.namespace
        self.revision = revision(bd.spec)

    # -- shared pieces --

    def meta(self, name: str, component: str, labels: Mapping[str, str] = {}) -> Object:
        meta: Object = {
            "name": name,
            "namespace": self.namespace,
            "labels": {**self.common_labels(component), **labels},
        }
        uid = (self.bd.metadata.model_extra or {}).get("uid")
        if uid:
            meta["ownerReferences"] = [
                {
                    "apiVersion": API_VERSION,
                    "kind": KIND,
                    "name": self.name,
                    "uid": uid,
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ]
        return meta

    def common_labels(self, component: str) -> dict[str, str]:
        return {
            "app.kubernetes.io/name": "beamserve",
            LABEL_INSTANCE: self.name,
            LABEL_COMPONENT: component,
            LABEL_MANAGED_BY: MANAGED_BY,
            "app.kubernetes.io/part-of": "beamserve",
        }

    def pool_name(self, role: PoolRole) -> str:
        return child_name(self.name, pool_part(role, self.revision))

    def pool_selector(self, role: PoolRole) -> dict[str, str]:
        return {LABEL_INSTANCE: self.name, LABEL_ROLE: role, LABEL_REVISION: self.revision}

    def discovery_labels(self, role: PoolRole) -> dict[str, str]:
        labels = {
            LABEL_DEPLOYMENT: self.name,
            LABEL_ROLE: role,
            LABEL_POOL: role,
            LABEL_REVISION: self.revision,
            LABEL_ENGINE: self.spec.engine.name,
        }
        if self.spec.swings(role):
            # its engines send and receive KV: the router may choose their parts by load
            labels[LABEL_KV_ROLE] = "kv_both"
        return labels

    def router_labels(self) -> dict[str, str]:
        return {LABEL_INSTANCE: self.name, LABEL_COMPONENT: "router"}

    def worker_selector(self) -> dict[str, str]:
        return {LABEL_INSTANCE: self.name, "beamserve.io/worker": "true"}

    # -- model volumes --

    def model_volumes(
        self, with_draft: bool = True
    ) -> tuple[list[Object], list[Object], list[Object]]:
        """(volumes, mounts, init containers) for the checkpoint (and the draft's)."""
        volumes: list[Object] = []
        mounts: list[Object] = []
        inits: list[Object] = []
        sources: list[tuple[str, ModelSourceSpec, str]] = [
            ("model", self.spec.model.source, self.spec.model.mount_path)
        ]
        if with_draft and self.spec.model.draft is not None:
            draft = self.spec.model.draft
            sources.append(("draft", draft.source, draft.mount_path))
        for vol, source, path in sources:
            mount: Object = {"name": vol, "mountPath": path, "readOnly": True}
            if source.host_path is not None:
                volumes.append(
                    {"name": vol, "hostPath": {"path": source.host_path.path, "type": "Directory"}}
                )
            elif source.pvc is not None:
                volumes.append(
                    {
                        "name": vol,
                        "persistentVolumeClaim": {
                            "claimName": source.pvc.claim_name,
                            "readOnly": True,
                        },
                    }
                )
                if source.pvc.sub_path:
                    mount["subPath"] = source.pvc.sub_path
            elif source.download is not None:
                dl = source.download
                volumes.append({"name": vol, "emptyDir": {"sizeLimit": dl.storage_size}})
                init: Object = {
                    "name": f"download-{vol}",
                    "image": dl.image or self.facts.operator_image,
                    "command": ["sh", "-c", _download_script(dl.uri, path)],
                    "volumeMounts": [{"name": vol, "mountPath": path}],
                    "securityContext": _container_security(read_only_root=False),
                }
                if dl.credentials_secret:
                    init["envFrom"] = [{"secretRef": {"name": dl.credentials_secret}}]
                inits.append(init)
            mounts.append(mount)
        return volumes, mounts, inits

    # -- pools --

    def pool_objects(self, role: PoolRole, pool: PoolSpec) -> list[Object]:
        name = self.pool_name(role)
        multinode = pool.nodes_per_replica > 1
        if multinode and not self.facts.leader_worker_set:
            raise RenderError(
                f"spec.{role}.nodesPerReplica: {pool.nodes_per_replica} needs the "
                "LeaderWorkerSet API (leaderworkerset.x-k8s.io/v1), which this cluster does not "
                "serve; install LeaderWorkerSet, or set nodesPerReplica: 1"
            )
        template = self.pool_template(role, pool)
        replicas = self.replicas.get(role, pool.replicas)
        labels = self.discovery_labels(role)
        selector = self.pool_selector(role)
        out: list[Object] = []
        if multinode:
            out.append(self.leader_worker_set(role, pool, name, template, replicas, labels))
        else:
            out.append(
                {
                    "apiVersion": "apps/v1",
                    "kind": "Deployment",
                    "metadata": self.meta(name, role, labels),
                    "spec": {
                        "replicas": replicas,
                        "selector": {"matchLabels": selector},
                        "strategy": {
                            "type": "RollingUpdate",
                            "rollingUpdate": {
                                "maxUnavailable": self.spec.rollout.max_unavailable,
                                "maxSurge": self.spec.rollout.max_surge,
                            },
                        },
                        "revisionHistoryLimit": 3,
                        "progressDeadlineSeconds": self.startup_budget() + 600,
                        "template": template,
                    },
                }
            )
        svc_selector = dict(selector)
        if multinode:
            svc_selector[LWS_WORKER_INDEX_LABEL] = "0"  # only the leader serves HTTP
        out.append(
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": self.meta(name, role, labels),
                "spec": {
                    "clusterIP": "None",
                    "selector": svc_selector,
                    "ports": self.service_ports(pool),
                    "publishNotReadyAddresses": False,
                },
            }
        )
        out.append(self.pdb(name, role, selector, labels))
        return out

    def service_ports(self, pool: PoolSpec) -> list[Object]:
        p = pool.ports
        named = [
            ("http", p.http),
            ("kv-events", p.kv_events),
            ("kv-replay", p.kv_replay),
            ("bootstrap", p.bootstrap),
            ("side-channel", p.side_channel),
        ]
        return [
            {"name": n, "port": port, "targetPort": port, "protocol": "TCP"} for n, port in named
        ]

    def startup_budget(self) -> int:
        return STARTUP_BUDGET_S["gpu" if self.spec.engine.name in GPU_ENGINES else "cpu"]

    def pool_template(self, role: PoolRole, pool: PoolSpec) -> Object:
        cmd = pool_command(self.spec, role)
        gpus = self.spec.gpus_per_node(role)
        env: list[Object] = [
            {"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
        ]
        env += [{"name": k, "value": v} for k, v in sorted(cmd.env.items())]
        volumes, mounts, inits = self.model_volumes()
        if self.spec.engine.name in GPU_ENGINES:
            # NCCL and the engines' IPC need a large /dev/shm (the container default is 64 MiB).
            volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
            mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
        volumes.append({"name": "tmp", "emptyDir": {}})
        mounts.append({"name": "tmp", "mountPath": "/tmp"})
        resources = _quantities(pool.resources or {})
        if gpus > 0:
            resources.setdefault("limits", {})[pool.gpu_resource] = str(gpus)
            resources.setdefault("requests", {})[pool.gpu_resource] = str(gpus)
        budget = self.startup_budget()
        container: Object = {
            "name": "engine",
            "image": self.spec.engine.image or self.facts.operator_image,
            "imagePullPolicy": self.spec.engine.image_pull_policy,
            "command": list(cmd.argv),
            "env": env,
            "ports": [
                {"name": port["name"], "containerPort": port["port"], "protocol": "TCP"}
                for port in self.service_ports(pool)
            ],
            "volumeMounts": mounts,
            "startupProbe": {
                "httpGet": {"path": cmd.ready_path, "port": "http"},
                "periodSeconds": STARTUP_PERIOD_S,
                "timeoutSeconds": 5,
                "failureThreshold": budget // STARTUP_PERIOD_S,
            },
            "readinessProbe": {
                "httpGet": {"path": cmd.ready_path, "port": "http"},
                "periodSeconds": 5,
                "timeoutSeconds": 5,
                "failureThreshold": 3,
            },
            "livenessProbe": {
                "httpGet": {"path": cmd.live_path, "port": "http"},
                "periodSeconds": 10,
                "timeoutSeconds": 10,
                "failureThreshold": 6,
            },
            "securityContext": _container_security(
                read_only_root=self.spec.engine.name not in GPU_ENGINES
            ),
        }
        if pool.nodes_per_replica > 1:
            container["ports"].append(
                {"name": "dist-init", "containerPort": pool.ports.dist_init, "protocol": "TCP"}
            )
        if resources:
            container["resources"] = resources
        pod_spec: Object = {
            "containers": [container],
            "volumes": volumes,
            # in-flight requests finish before the kubelet kills the engine (drain)
            "terminationGracePeriodSeconds": min(self.spec.rollout.drain_timeout_seconds, 3600),
            "enableServiceLinks": False,
        }
        if inits:
            pod_spec["initContainers"] = inits
        if self.spec.engine.name not in GPU_ENGINES:
            pod_spec["securityContext"] = _pod_security()
        if pool.node_selector:
            pod_spec["nodeSelector"] = dict(pool.node_selector)
        if pool.tolerations:
            pod_spec["tolerations"] = copy.deepcopy(pool.tolerations)
        if pool.affinity:
            pod_spec["affinity"] = copy.deepcopy(pool.affinity)
        if pool.topology_spread_constraints:
            pod_spec["topologySpreadConstraints"] = copy.deepcopy(pool.topology_spread_constraints)
        if pool.priority_class_name:
            pod_spec["priorityClassName"] = pool.priority_class_name
        labels = {
            **self.common_labels(role),
            **self.pool_selector(role),
            LABEL_ENGINE: self.spec.engine.name,
            "beamserve.io/worker": "true",
        }
        template: Object = {"metadata": {"labels": labels}, "spec": pod_spec}
        if pool.pod_template:
            template = merge_pod_template(template, pool.pod_template)
            template["metadata"]["labels"].update(labels)  # selectors must keep matching
        return template

    def leader_worker_set(
        self,
        role: PoolRole,
        pool: PoolSpec,
        name: str,
        template: Object,
        replicas: int,
        labels: Mapping[str, str],
    ) -> Object:
        return {
            "apiVersion": "leaderworkerset.x-k8s.io/v1",
            "kind": "LeaderWorkerSet",
            "metadata": self.meta(name, role, labels),
            "spec": {
                "replicas": replicas,
                "startupPolicy": "LeaderCreated",
                "rolloutStrategy": {
                    "type": "RollingUpdate",
                    "rollingUpdateConfiguration": {
                        "maxUnavailable": self.spec.rollout.max_unavailable,
                        "maxSurge": self.spec.rollout.max_surge,
                    },
                },
                "leaderWorkerTemplate": {
                    "size": pool.nodes_per_replica,
                    "restartPolicy": "RecreateGroupOnPodRestart",
                    "workerTemplate": template,
                },
            },
        }

    def pdb(
        self, name: str, component: str, selector: Mapping[str, str], labels: Mapping[str, str]
    ) -> Object:
        return {
            "apiVersion": self.facts.pdb_api_version,
            "kind": "PodDisruptionBudget",
            "metadata": self.meta(name, component, labels),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": dict(selector)}},
        }

    # -- router --

    def router_access(self) -> list[Object]:
        """The router's identity: list/watch the worker Services and their EndpointSlices."""
        name = child_name(self.name, "router")
        return [
            {
                "apiVersion": "v1",
                "kind": "ServiceAccount",
                "metadata": self.meta(name, "router"),
                "automountServiceAccountToken": True,
            },
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "Role",
                "metadata": self.meta(name, "router"),
                "rules": [
                    {"apiGroups": [""], "resources": ["services"], "verbs": ["list", "watch"]},
                    {
                        "apiGroups": ["discovery.k8s.io"],
                        "resources": ["endpointslices"],
                        "verbs": ["list", "watch"],
                    },
                ],
            },
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "RoleBinding",
                "metadata": self.meta(name, "router"),
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "Role",
                    "name": name,
                },
                "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": self.namespace}],
            },
        ]

    def router_config_map(self) -> Object:
        cfg = router_config_dict(self.bd, self.namespace)
        return {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": self.meta(child_name(self.name, "router-config"), "router"),
            "data": {ROUTER_CONFIG_FILE: yaml.safe_dump(cfg, sort_keys=False)},
        }

    def router_args(self) -> tuple[list[str], list[Object]]:
        r = self.spec.router
        argv = ["beamserve", "router", "--kubernetes", self.name, "--namespace", self.namespace]
        argv += ["--host", "0.0.0.0"]
        if _router_takes_config():
            # the ConfigMap carries the rest (`RouterConfig`); flags only for what it cannot
            argv += ["--config", f"{ROUTER_CONFIG_DIR}/{ROUTER_CONFIG_FILE}"]
        else:
            argv += ["--port", str(r.port)]
            if r.grpc_port is not None:
                argv += ["--grpc-port", str(r.grpc_port)]
            policy: Any = r.policy_config if r.policy_config is not None else r.policy
            argv += ["--policy", policy if isinstance(policy, str) else json.dumps(policy)]
            argv += ["--disaggregation", json.dumps(r.disaggregation.model_dump(mode="json"))]
            argv += ["--flow", json.dumps(r.flow_control.model_dump(mode="json"))]
            argv += ["--served-model-name", self.spec.model.served_name]
            argv += ["--max-body-bytes", str(r.max_body_bytes)]
            argv += ["--scrape-interval-s", str(r.scrape_interval_seconds)]
            argv += ["--prefill-timeout-s", str(r.prefill_timeout_seconds)]
        if self.spec.model.source.download is None:
            argv += ["--tokenizer", self.spec.model.mount_path]
        env: list[Object] = []
        store = r.session_store
        if store.type == "redis":
            host = child_name(self.name, "redis")
            argv += ["--redis", f"redis://{host}.{self.namespace}.svc:{REDIS_PORT}/0"]
        elif store.type == "external":
            if store.url_secret_ref is not None:
                ref = store.url_secret_ref
                env.append(
                    {
                        "name": "BEAMSERVE_REDIS_URL",
                        "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}},
                    }
                )
                argv += ["--redis", "$(BEAMSERVE_REDIS_URL)"]
            elif store.url is not None:
                argv += ["--redis", store.url]
        if r.api_keys_secret_ref is not None:
            ref = r.api_keys_secret_ref
            env.append(
                {
                    "name": "BEAMSERVE_API_KEYS",
                    "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}},
                }
            )
            argv += ["--api-keys", "$(BEAMSERVE_API_KEYS)"]
        return argv, env

    def router(self) -> list[Object]:
        r = self.spec.router
        name = child_name(self.name, "router")
        labels = self.router_labels()
        argv, env = self.router_args()
        ports: list[Object] = [{"name": "http", "containerPort": r.port, "protocol": "TCP"}]
        if r.grpc_port is not None:
            ports.append({"name": "grpc", "containerPort": r.grpc_port, "protocol": "TCP"})
        volumes: list[Object] = [
            {"name": "config", "configMap": {"name": child_name(self.name, "router-config")}},
            {"name": "tmp", "emptyDir": {}},
        ]
        mounts: list[Object] = [
            {"name": "config", "mountPath": ROUTER_CONFIG_DIR, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
        ]
        if self.spec.model.source.download is None:
            model_vols, model_mounts, _ = self.model_volumes(with_draft=False)
            volumes += model_vols
            mounts += model_mounts
        container: Object = {
            "name": "router",
            "image": r.image or self.facts.operator_image,
            "command": argv,
            "ports": ports,
            "volumeMounts": mounts,
            "startupProbe": {
                "tcpSocket": {"port": "http"},
                "periodSeconds": 2,
                "failureThreshold": 60,
            },
            "readinessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": 5},
            "livenessProbe": {
                "tcpSocket": {"port": "http"},
                "periodSeconds": 10,
                "failureThreshold": 6,
            },
            "securityContext": _container_security(read_only_root=True),
        }
        if env:
            container["env"] = env
        if r.resources:
            container["resources"] = _quantities(r.resources)
        pod_spec: Object = {
            "serviceAccountName": name,
            "containers": [container],
            "volumes": volumes,
            "securityContext": _pod_security(),
            "enableServiceLinks": False,
        }
        if r.node_selector:
            pod_spec["nodeSelector"] = dict(r.node_selector)
        svc_ports: list[Object] = [
            {"name": "http", "port": r.port, "targetPort": "http", "protocol": "TCP"}
        ]
        if r.grpc_port is not None:
            svc_ports.append(
                {"name": "grpc", "port": r.grpc_port, "targetPort": "grpc", "protocol": "TCP"}
            )
        return [
            {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "metadata": self.meta(name, "router"),
                "spec": {
                    "replicas": r.replicas,
                    "selector": {"matchLabels": labels},
                    "strategy": {
                        "type": "RollingUpdate",
                        "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
                    },
                    "template": {
                        "metadata": {"labels": {**self.common_labels("router"), **labels}},
                        "spec": pod_spec,
                    },
                },
            },
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": self.meta(name, "router"),
                "spec": {"type": "ClusterIP", "selector": labels, "ports": svc_ports},
            },
            self.pdb(name, "router", labels, {}),
        ]

    # -- managed Redis --

    def redis(self) -> list[Object]:
        store = self.spec.router.session_store
        if store.type != "redis":
            return []
        managed = store.redis or ManagedRedisSpec()
        name = child_name(self.name, "redis")
        labels = {LABEL_INSTANCE: self.name, LABEL_COMPONENT: "redis"}
        out: list[Object] = []
        if managed.storage_size:
            data: Object = {"name": "data", "persistentVolumeClaim": {"claimName": name}}
            out.append(
                {
                    "apiVersion": "v1",
                    "kind": "PersistentVolumeClaim",
                    "metadata": self.meta(name, "redis"),
                    "spec": {
                        "accessModes": ["ReadWriteOnce"],
                        "resources": {"requests": {"storage": managed.storage_size}},
                    },
                }
            )
        else:
            data = {"name": "data", "emptyDir": {}}
        container: Object = {
            "name": "redis",
            "image": managed.image,
            "args": ["--save", "60", "1", "--appendonly", "no", "--dir", "/data"],
            "ports": [{"name": "redis", "containerPort": REDIS_PORT, "protocol": "TCP"}],
            "volumeMounts": [{"name": "data", "mountPath": "/data"}],
            "readinessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 5},
            "livenessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 10},
            "securityContext": _container_security(read_only_root=True),
        }
        if managed.resources:
            container["resources"] = _quantities(managed.resources)
        out += [
            {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "metadata": self.meta(name, "redis"),
                "spec": {
                    "replicas": 1,
                    "strategy": {"type": "Recreate"},
                    "selector": {"matchLabels": labels},
                    "template": {
                        "metadata": {"labels": {**self.common_labels("redis"), **labels}},
                        "spec": {
                            "containers": [container],
                            "volumes": [data],
                            "securityContext": _pod_security(),
                            "enableServiceLinks": False,
                        },
                    },
                },
            },
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": self.meta(name, "redis"),
                "spec": {
                    "selector": labels,
                    "ports": [
                        {"name": "redis", "port": REDIS_PORT, "targetPort": "redis"},
                    ],
                },
            },
        ]
        return out

    # -- policy, monitors, gateway --

    def network_policy(self) -> Object:
        """Workers accept: the router (every worker port); other workers of this deployment
        (prefill ↔ decode KV handshakes, and the transfer engines' data connections, whose TCP
        ports are ephemeral — NIXL/UCX, Mooncake); Prometheus on `http` (`/metrics`)."""
        router_peer = {"podSelector": {"matchLabels": self.router_labels()}}
        worker_peer = {"podSelector": {"matchLabels": self.worker_selector()}}
        http_ports = sorted({p.ports.http for p in self.spec.pools().values()})
        prometheus = {
            "namespaceSelector": {},
            "podSelector": {"matchLabels": dict(PROMETHEUS_POD_LABELS)},
        }
        return {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": self.meta(child_name(self.name, "workers"), "workers"),
            "spec": {
                "podSelector": {"matchLabels": self.worker_selector()},
                "policyTypes": ["Ingress"],
                "ingress": [
                    {"from": [router_peer]},
                    {"from": [worker_peer]},
                    {
                        "from": [prometheus],
                        "ports": [{"protocol": "TCP", "port": p} for p in http_ports],
                    },
                ],
            },
        }

    def monitors(self) -> list[Object]:
        mon = self.spec.monitoring
        if not mon.enabled:
            return []
        kind = mon.kind
        if kind == "ServiceMonitor" and not self.facts.service_monitor:
            return []
        if kind == "PodMonitor" and not self.facts.pod_monitor:
            return []
        out: list[Object] = []
        roles: list[str] = [*self.spec.pools(), "router"]
        for role in roles:
            if role == "router":
                selector: dict[str, str] = self.router_labels()
            else:
                selector = {LABEL_INSTANCE: self.name, LABEL_ROLE: role}
            endpoint = {"port": "http", "path": "/metrics", "interval": mon.interval}
            spec: Object = {
                "selector": {"matchLabels": selector},
                "namespaceSelector": {"matchNames": [self.namespace]},
            }
            if kind == "ServiceMonitor":
                spec["endpoints"] = [endpoint]
            else:
                spec["podMetricsEndpoints"] = [endpoint]
            out.append(
                {
                    "apiVersion": "monitoring.coreos.com/v1",
                    "kind": kind,
                    "metadata": self.meta(child_name(self.name, role), role, mon.labels),
                    "spec": spec,
                }
            )
        return out

    def inference_pool(self) -> list[Object]:
        """Gateway API Inference Extension: the pool of pods a gateway may send to, with the
        router (its ext_proc gRPC port) as the endpoint picker. The pods are the serving ones
        (decode, or both), of every revision: the picker knows which are ready."""
        r = self.spec.router
        if not self.facts.inference_pool or r.grpc_port is None:
            return []
        role: PoolRole = "both" if self.spec.both is not None else "decode"
        pool = self.spec.pools().get(role)
        if pool is None:
            return []
        return [
            {
                "apiVersion": "inference.networking.k8s.io/v1",
                "kind": "InferencePool",
                "metadata": self.meta(child_name(self.name, "workers"), "workers"),
                "spec": {
                    "selector": {"matchLabels": {LABEL_INSTANCE: self.name, LABEL_ROLE: role}},
                    "targetPorts": [{"number": pool.ports.http}],
                    "endpointPickerRef": {
                        "kind": "Service",
                        "name": child_name(self.name, "router"),
                        "port": {"number": r.grpc_port},
                        "failureMode": "FailClose",
                    },
                },
            }
        ]


# -- helpers ----------------------------------------------------------------------------------


def _quantities(resources: Mapping[str, Any]) -> Object:
    """`resources` with every quantity a string: server-side apply's typed patch refuses a
    bare number where the schema says Quantity (`nvidia.com/gpu: 8` → `"8"`)."""
    out = copy.deepcopy(dict(resources))
    for key in ("limits", "requests"):
        if isinstance(out.get(key), dict):
            out[key] = {
                k: str(v) if isinstance(v, int | float) and not isinstance(v, bool) else v
                for k, v in out[key].items()
            }
    return out


def _container_security(*, read_only_root: bool) -> Object:
    """GPU engines (SGLang, vLLM) write caches (Triton, torch.compile, flashinfer) under their
    home and site-packages, so their root filesystem stays writable; the rest is read-only."""
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": read_only_root,
        "capabilities": {"drop": ["ALL"]},
    }


def _pod_security() -> Object:
    return {
        "runAsNonRoot": True,
        "runAsUser": 65532,
        "runAsGroup": 65532,
        "fsGroup": 65532,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _download_script(uri: str, dest: str) -> str:
    """A POSIX shell script that fetches `uri` into `dest` unless `config.json` is there
    (`hf` from huggingface_hub, `aws`, `gcloud`, or `curl` must be in the init image)."""
    q_uri, q_dest = shlex.quote(uri), shlex.quote(dest)
    return (
        f"set -eu; uri={q_uri}; dest={q_dest}; "
        '[ -f "$dest/config.json" ] && exit 0; '
        'case "$uri" in '
        'hf://*) repo="${uri#hf://}"; rev=main; '
        'case "$repo" in *@*) rev="${repo#*@}"; repo="${repo%@*}";; esac; '
        'hf download "$repo" --revision "$rev" --local-dir "$dest";; '
        's3://*) aws s3 sync "$uri" "$dest";; '
        'gs://*) gcloud storage cp -r "$uri/*" "$dest";; '
        '*) curl -fsSL "$uri" | tar -x -C "$dest";; '
        "esac"
    )


def merge_pod_template(base: Object, over: Mapping[str, Any]) -> Object:
    """`over` deep-merged into `base`; lists of named items (containers, volumes, env …) merge
    by `name` (a new name is appended), other lists are replaced."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        cur = out.get(key)
        if isinstance(value, Mapping) and isinstance(cur, dict):
            out[key] = merge_pod_template(cur, value)
        elif isinstance(value, list) and isinstance(cur, list) and _named(value) and _named(cur):
            merged = {item["name"]: item for item in cur}
            order = [item["name"] for item in cur]
            for item in value:
                if item["name"] in merged:
                    merged[item["name"]] = merge_pod_template(merged[item["name"]], item)
                else:
                    merged[item["name"]] = copy.deepcopy(item)
                    order.append(item["name"])
            out[key] = [merged[n] for n in order]
        else:
            out[key] = copy.deepcopy(value)
    return out


def _named(items: list[Any]) -> bool:
    return all(isinstance(i, Mapping) and isinstance(i.get("name"), str) for i in items)


_TAKES_CONFIG: bool | None = None


def _router_takes_config() -> bool:
    """Whether this release's `beamserve router` reads `--config FILE` (the ConfigMap)."""
    global _TAKES_CONFIG
    if _TAKES_CONFIG is None:
        import argparse

        from beamserve.router.cli import add_router

        parser = argparse.ArgumentParser()
        p = add_router(parser.add_subparsers())
        _TAKES_CONFIG = any("--config" in a.option_strings for a in p._actions)
    return _TAKES_CONFIG
