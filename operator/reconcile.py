"""Reconcile one BeamDeployment: apply `desired_objects`, scale, retire old revisions, status.

`Reconciler(client, facts).reconcile(body)` is level-triggered and idempotent: it reads the live
children, writes only what differs (a child whose live state already holds every desired field
is not sent at all), and returns how many writes it made. The kopf handlers (`operator/main.py`)
call it on every event of a BeamDeployment, its BeamPools and its workloads.

* **Apply**: server-side apply, field manager `beamserve`, `force=True` (beamserve owns what it
  renders; fields others set and beamserve does not render — an HPA-free `replicas` of a
  BeamPool, annotations by other tools — stay theirs).
* **Scale**: one `BeamPool` per pool (`operator/scaler.py`); its `spec.replicas` is the pool's
  size, pushed from `spec.<role>.replicas` only when that changes.
* **Retire**: pool objects of another revision than the spec's stay while the new revision is
  not ready. Once every pool of the new revision is ready, the old workloads are stamped
  `beamserve.io/retiring-since` and the old Services deleted: router discovery drops those
  workers, so they get no new requests, while their pods keep running the ones they have. Each
  reconcile then asks every ready router replica (`operator/drain.py`, `GET /admin/workers`);
  the revision is **drained** when all answer, none still lists its workers and nothing is in
  flight on them (or no router replica is ready), or **timed out** when
  `rollout.drainTimeoutSeconds` passed since the stamp (a `DrainTimedOut` Warning event says
  what was left). Then its workloads and PDBs are deleted (pods still get
  `terminationGracePeriodSeconds` = the drain timeout) and a `RevisionRetired` event is posted.
  While it waits, `Progressing` (`RetiringRevision`) says what the routers reported.
* **Prune**: any other child (same owner, not desired any more) is deleted, BeamPools of pools
  the spec no longer has included (`scaler.stale_pools`).
* **Status**: `observedGeneration`, conditions Ready / Progressing / Degraded, per pool
  replicas / readyReplicas / updatedReplicas / selector, current and update revision, router
  endpoint — written to `/status` only when it changed.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog
from beamserve.operator import drain, scaler
from beamserve.operator.api import API_VERSION
from beamserve.operator.desired import (
    FIELD_MANAGER,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    LABEL_REVISION,
    LABEL_ROLE,
    MANAGED_BY,
    ClusterFacts,
    Object,
    RenderError,
    desired_objects,
    parse_deployment,
    pool_plans,
    revision,
    router_endpoint,
)
from beamserve.operator.naming import child_name
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import NotFoundError, ResourceNotFoundError

log = structlog.get_logger(__name__)

ANNOTATION_RETIRING = "beamserve.io/retiring-since"
WORKLOAD_KINDS = ("Deployment", "LeaderWorkerSet")


def discover_facts(client: DynamicClient, operator_image: str | None = None) -> ClusterFacts:
    """What the API server serves (API groups and kinds), for `desired_objects`."""

    def has(api_version: str, kind: str) -> bool:
        try:
            client.resources.get(api_version=api_version, kind=kind)
        except ResourceNotFoundError:
            return False
        return True

    kw: dict[str, Any] = {
        "pdb_api_version": (
            "policy/v1" if has("policy/v1", "PodDisruptionBudget") else "policy/v1beta1"
        ),
        "leader_worker_set": has("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"),
        "service_monitor": has("monitoring.coreos.com/v1", "ServiceMonitor"),
        "pod_monitor": has("monitoring.coreos.com/v1", "PodMonitor"),
        "inference_pool": has("inference.networking.k8s.io/v1", "InferencePool"),
    }
    if operator_image:
        kw["operator_image"] = operator_image
    return ClusterFacts(**kw)


def managed_kinds(facts: ClusterFacts) -> list[tuple[str, str]]:
    """(apiVersion, kind) of every child kind `desired_objects` may produce on this cluster."""
    out = [
        ("v1", "ServiceAccount"),
        ("rbac.authorization.k8s.io/v1", "Role"),
        ("rbac.authorization.k8s.io/v1", "RoleBinding"),
        ("v1", "ConfigMap"),
        ("v1", "PersistentVolumeClaim"),
        ("apps/v1", "Deployment"),
        ("v1", "Service"),
        (facts.pdb_api_version, "PodDisruptionBudget"),
        ("networking.k8s.io/v1", "NetworkPolicy"),
    ]
    if facts.leader_worker_set:
        out.append(("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"))
    if facts.service_monitor:
        out.append(("monitoring.coreos.com/v1", "ServiceMonitor"))
    if facts.pod_monitor:
        out.append(("monitoring.coreos.com/v1", "PodMonitor"))
    if facts.inference_pool:
        out.append(("inference.networking.k8s.io/v1", "InferencePool"))
    return out


@dataclass
class Result:
    writes: int = 0
    status: dict[str, Any] | None = None
    draining: list[str] = field(default_factory=list)  # "<rev>: what the routers said"


class Reconciler:
    """Reconciles BeamDeployments through `client` (one instance per operator process)."""

    def __init__(
        self,
        client: DynamicClient,
        facts: ClusterFacts,
        *,
        clock: Callable[[], float] = time.time,
        router_get: Callable[[str], Mapping[str, Any]] | None = None,
    ) -> None:
        self.client = client
        self.facts = facts
        self.clock = clock
        self.router_get = router_get or drain.http_get_json()
        self._slices: str | None = None  # the EndpointSlice apiVersion served
        self._locks: dict[tuple[str, str], threading.Lock] = {}
        self._guard = threading.Lock()

    def _lock(self, namespace: str, name: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault((namespace, name), threading.Lock())

    def _res(self, api_version: str, kind: str) -> Any:
        return self.client.resources.get(api_version=api_version, kind=kind)

    # -- the entry point --

    def reconcile_named(self, namespace: str, name: str) -> Result:
        """Reconcile the BeamDeployment `namespace/name` as it is now (gone: nothing)."""
        with self._lock(namespace, name):
            try:
                body = self._res(API_VERSION, "BeamDeployment").get(name=name, namespace=namespace)
            except NotFoundError:
                return Result()
            try:
                return self._reconcile(body.to_dict())
            except NotFoundError:
                try:  # deleted while being reconciled: its children go with it
                    self._res(API_VERSION, "BeamDeployment").get(name=name, namespace=namespace)
                except NotFoundError:
                    return Result()
                raise

    def _reconcile(self, body: Mapping[str, Any]) -> Result:
        meta = body["metadata"]
        if meta.get("deletionTimestamp"):
            return Result()  # children go with it (owner references, garbage collector)
        namespace = meta["namespace"]
        bd = parse_deployment(body)
        result = Result()
        facts = ClusterFacts(**{**self.facts.__dict__, "namespace": namespace})
        try:
            replicas = self._scale(bd, body, result)
            objects = desired_objects(bd, facts, replicas=replicas)
        except RenderError as exc:
            status = self._status(body, bd, namespace, problem=str(exc))
            self._write_status(body, status, result)
            return result
        for obj in objects:
            self._apply(obj, result)
        self._retire_and_prune(body, bd, namespace, objects, result)
        status = self._status(body, bd, namespace, problem=None, draining=result.draining)
        self._sync_scalers(bd, namespace, status, result)
        self._write_status(body, status, result)
        if result.writes:
            log.info(
                "reconciled", deployment=meta["name"], namespace=namespace, writes=result.writes
            )
        return result

    # -- apply --

    def _apply(self, obj: Object, result: Result) -> None:
        res = self._res(obj["apiVersion"], obj["kind"])
        meta = obj["metadata"]
        try:
            live = res.get(name=meta["name"], namespace=meta.get("namespace")).to_dict()
        except NotFoundError:
            live = None
        if live is not None and contains(live, obj):
            return
        log.debug("apply", kind=obj["kind"], name=meta["name"], created=live is None)
        res.server_side_apply(
            body=obj,
            name=meta["name"],
            namespace=meta.get("namespace"),
            field_manager=FIELD_MANAGER,
            force_conflicts=True,
        )
        result.writes += 1

    # -- scaling --

    def _scale(self, bd: Any, body: Mapping[str, Any], result: Result) -> dict[str, int]:
        """Each pool's size from its BeamPool (created, or updated when the spec's changed)."""
        res = self._res(API_VERSION, scaler.KIND)
        namespace = body["metadata"]["namespace"]
        out: dict[str, int] = {}
        for role, pool in bd.spec.pools().items():
            name = child_name(bd.metadata.name, role)
            try:
                live = res.get(name=name, namespace=namespace).to_dict()
            except NotFoundError:
                live = None
            wanted = str(pool.replicas)
            if live is None:
                res.create(
                    body={
                        "apiVersion": API_VERSION,
                        "kind": scaler.KIND,
                        "metadata": {
                            "name": name,
                            "namespace": namespace,
                            "labels": {
                                LABEL_INSTANCE: bd.metadata.name,
                                LABEL_MANAGED_BY: MANAGED_BY,
                                LABEL_ROLE: role,
                            },
                            "annotations": {scaler.ANNOTATION_SPEC_REPLICAS: wanted},
                            "ownerReferences": [_owner(body)],
                        },
                        "spec": {
                            "deployment": bd.metadata.name,
                            "role": role,
                            "replicas": pool.replicas,
                        },
                    },
                    namespace=namespace,
                )
                result.writes += 1
                out[role] = pool.replicas
                continue
            pushed = (live["metadata"].get("annotations") or {}).get(
                scaler.ANNOTATION_SPEC_REPLICAS
            )
            current = live.get("spec", {}).get("replicas")
            if pushed != wanted:  # the BeamDeployment's number changed: it wins this once
                res.patch(
                    body={
                        "metadata": {"annotations": {scaler.ANNOTATION_SPEC_REPLICAS: wanted}},
                        "spec": {"replicas": pool.replicas},
                    },
                    name=name,
                    namespace=namespace,
                    content_type="application/merge-patch+json",
                )
                result.writes += 1
                current = pool.replicas
            out[role] = int(current if current is not None else pool.replicas)
        self._prune_scalers(bd, body, result)
        return out

    def _prune_scalers(self, bd: Any, body: Mapping[str, Any], result: Result) -> None:
        """Delete the BeamPools of pools the spec no longer has (`scaler.stale_pools`)."""
        res = self._res(API_VERSION, scaler.KIND)
        meta = body["metadata"]
        selector = f"{LABEL_INSTANCE}={meta['name']},{LABEL_MANAGED_BY}={MANAGED_BY}"
        live = res.get(namespace=meta["namespace"], label_selector=selector).to_dict()
        wanted = [child_name(bd.metadata.name, role) for role in bd.spec.pools()]
        for name in scaler.stale_pools(live.get("items", []), meta["uid"], wanted):
            log.info("prune_beampool", deployment=meta["name"], beampool=name)
            ref = {"name": name, "namespace": meta["namespace"]}
            self._delete({"apiVersion": API_VERSION, "kind": scaler.KIND, "metadata": ref}, result)

    def _sync_scalers(
        self, bd: Any, namespace: str, status: Mapping[str, Any], result: Result
    ) -> None:
        res = self._res(API_VERSION, scaler.KIND)
        for role in bd.spec.pools():
            pool_status = status.get(role) or {}
            wanted = {
                "replicas": pool_status.get("replicas", 0),
                "readyReplicas": pool_status.get("readyReplicas", 0),
                "selector": pool_status.get("selector") or "-",
                "revision": status.get("updateRevision") or "-",
            }
            name = child_name(bd.metadata.name, role)
            try:
                live = res.get(name=name, namespace=namespace).to_dict()
            except NotFoundError:
                continue
            if live.get("status") == wanted:
                continue
            log.debug("scaler_status", name=name, old=live.get("status"), new=wanted)
            res.status.patch(
                body={"status": wanted},
                name=name,
                namespace=namespace,
                content_type="application/merge-patch+json",
            )
            result.writes += 1

    # -- retire, prune --

    def _children(self, body: Mapping[str, Any], namespace: str) -> list[Object]:
        uid = body["metadata"]["uid"]
        selector = f"{LABEL_INSTANCE}={body['metadata']['name']},{LABEL_MANAGED_BY}={MANAGED_BY}"
        out: list[Object] = []
        for api_version, kind in managed_kinds(self.facts):
            items = self._res(api_version, kind).get(namespace=namespace, label_selector=selector)
            for item in items.to_dict().get("items", []):
                refs = item["metadata"].get("ownerReferences") or []
                if any(r.get("uid") == uid for r in refs):
                    item.setdefault("apiVersion", api_version)
                    item.setdefault("kind", kind)
                    out.append(item)
        return out

    def _retire_and_prune(
        self,
        body: Mapping[str, Any],
        bd: Any,
        namespace: str,
        desired: list[Object],
        result: Result,
    ) -> None:
        wanted = {(o["kind"], o["metadata"]["name"]) for o in desired}
        rev = revision(bd.spec)
        old: dict[str, list[Object]] = {}
        for child in self._children(body, namespace):
            key = (child["kind"], child["metadata"]["name"])
            if key in wanted:
                continue
            child_rev = (child["metadata"].get("labels") or {}).get(LABEL_REVISION)
            if child_rev and child_rev != rev:
                old.setdefault(child_rev, []).append(child)
            else:
                self._delete(child, result)
        if not old:
            return
        if not self._pools_ready(bd, namespace):
            return  # the old revision serves until the new one can
        drain_s = bd.spec.rollout.drain_timeout_seconds
        for old_rev, objs in sorted(old.items()):
            self._retire(body, namespace, old_rev, objs, drain_s, result)

    def _retire(
        self,
        body: Mapping[str, Any],
        namespace: str,
        old_rev: str,
        objs: list[Object],
        drain_s: int,
        result: Result,
    ) -> None:
        """Unroute `old_rev` (stamp its workloads, delete its Services), then remove its
        workloads and PDBs once the routers report it drained or the timeout ran out."""
        workloads = [o for o in objs if o["kind"] in WORKLOAD_KINDS]
        stamps = []
        for w in workloads:
            since = (w["metadata"].get("annotations") or {}).get(ANNOTATION_RETIRING)
            if since is None:
                since = _rfc3339(self.clock())
                self._res(w["apiVersion"], w["kind"]).patch(
                    body={"metadata": {"annotations": {ANNOTATION_RETIRING: since}}},
                    name=w["metadata"]["name"],
                    namespace=namespace,
                    content_type="application/merge-patch+json",
                )
                result.writes += 1
            stamps.append(_parse_rfc3339(since))
        for svc in [o for o in objs if o["kind"] == "Service"]:
            self._delete(svc, result)  # router discovery drops the workers: no new requests
        report = self.ask_routers(body, namespace, old_rev)
        since_s = min(stamps) if stamps else self.clock()
        verdict = drain.drain_verdict(report, since_s, self.clock(), drain_s)
        log.info(
            "retiring_revision",
            deployment=body["metadata"]["name"],
            revision=old_rev,
            verdict=verdict,
            detail=report.describe(),
        )
        if verdict == "wait":
            result.draining.append(f"{old_rev}: {report.describe()}")
            return
        if verdict == "timed_out":
            self._event(
                body,
                "Warning",
                "DrainTimedOut",
                f"revision {old_rev}: rollout.drainTimeoutSeconds={drain_s} passed with "
                f"{report.describe()}; removing it anyway",
                result,
            )
        else:
            message = f"revision {old_rev} drained ({report.describe()}); removing it"
            self._event(body, "Normal", "RevisionRetired", message, result)
        for o in objs:
            if o["kind"] != "Service":
                self._delete(o, result)

    def ask_routers(
        self, body: Mapping[str, Any], namespace: str, revision: str
    ) -> drain.DrainReport:
        """What every ready router replica says about `revision` (`operator/drain.py`)."""
        version = self._slice_api_version()
        selector = f"kubernetes.io/service-name={child_name(body['metadata']['name'], 'router')}"
        items = self._res(version, "EndpointSlice").get(
            namespace=namespace, label_selector=selector
        )
        addresses = drain.router_addresses(items.to_dict().get("items", []))
        return drain.ask_routers(addresses, revision, self.router_get)

    def _slice_api_version(self) -> str:
        if self._slices is None:
            try:
                self.client.resources.get(api_version="discovery.k8s.io/v1", kind="EndpointSlice")
                self._slices = "discovery.k8s.io/v1"
            except ResourceNotFoundError:
                self._slices = "discovery.k8s.io/v1beta1"
        return self._slices

    def _event(
        self, body: Mapping[str, Any], kind: str, reason: str, message: str, result: Result
    ) -> None:
        """A core/v1 Event on the BeamDeployment (`kubectl describe bd` shows it)."""
        meta = body["metadata"]
        now = _rfc3339(self.clock())
        self._res("v1", "Event").create(
            body={
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
                "involvedObject": {
                    "apiVersion": API_VERSION,
                    "kind": "BeamDeployment",
                    "name": meta["name"],
                    "namespace": meta["namespace"],
                    "uid": meta["uid"],
                },
                "type": kind,
                "reason": reason,
                "message": message,
                "source": {"component": "beamserve-operator"},
                "firstTimestamp": now,
                "lastTimestamp": now,
                "count": 1,
            },
            namespace=meta["namespace"],
        )
        result.writes += 1
        log.info("event", deployment=meta["name"], type=kind, reason=reason, message=message)

    def _delete(self, obj: Object, result: Result) -> None:
        try:
            self._res(obj["apiVersion"], obj["kind"]).delete(
                name=obj["metadata"]["name"],
                namespace=obj["metadata"].get("namespace"),
                body={"propagationPolicy": "Background"},
            )
        except NotFoundError:
            return
        result.writes += 1

    # -- status --

    def _workload(self, namespace: str, kind: str, name: str) -> Object | None:
        api_version = "apps/v1" if kind == "Deployment" else "leaderworkerset.x-k8s.io/v1"
        try:
            got: Object = self._res(api_version, kind).get(name=name, namespace=namespace).to_dict()
        except NotFoundError:
            return None
        return got

    def _pools_ready(self, bd: Any, namespace: str) -> bool:
        for plan in pool_plans(bd, self.facts):
            if not _ready(self._workload(namespace, plan.workload_kind, plan.name)):
                return False
        return True

    def _status(
        self,
        body: Mapping[str, Any],
        bd: Any,
        namespace: str,
        *,
        problem: str | None,
        draining: list[str] | None = None,
    ) -> dict[str, Any]:
        previous = dict(body.get("status") or {})
        rev = revision(bd.spec)
        status: dict[str, Any] = {"observedGeneration": body["metadata"].get("generation", 0)}
        not_ready: list[str] = []
        failing: list[str] = []
        updating = False
        if problem is None:
            for plan in pool_plans(bd, self.facts):
                w = self._workload(namespace, plan.workload_kind, plan.name)
                st = (w or {}).get("status") or {}
                want = ((w or {}).get("spec") or {}).get("replicas", 0)
                ready_n = st.get("readyReplicas", 0)
                status[plan.role] = {
                    "replicas": st.get("replicas", 0),
                    "readyReplicas": ready_n,
                    "updatedReplicas": st.get("updatedReplicas", 0),
                    "selector": ",".join(f"{k}={v}" for k, v in sorted(plan.selector.items())),
                }
                if not _ready(w):
                    updated_n = st.get("updatedReplicas", 0)
                    not_ready.append(f"{plan.role} {ready_n}/{want} ready, {updated_n} updated")
                    updating = True
                if _deadline_exceeded(w):
                    failing.append(
                        f"{plan.role}: {plan.workload_kind} {plan.name} made no progress"
                    )
            router = self._workload(namespace, "Deployment", child_name(bd.metadata.name, "router"))
            if not _ready(router):
                r_st = (router or {}).get("status") or {}
                want = ((router or {}).get("spec") or {}).get("replicas", 0)
                not_ready.append(f"router {r_st.get('readyReplicas', 0)}/{want} ready")
            status["routerEndpoint"] = router_endpoint(bd, namespace)
        status["updateRevision"] = rev
        old_present = self._old_revisions(body, namespace, rev)
        if problem is None and not not_ready and not updating:
            status["currentRevision"] = rev
        elif previous.get("currentRevision") in old_present | {rev}:
            # still the revision that last served in full (an in-place roll keeps it)
            status["currentRevision"] = previous["currentRevision"]
        elif old_present:
            status["currentRevision"] = sorted(old_present)[0]
        conditions: list[tuple[str, bool, str, str]] = []
        if problem is not None:
            conditions += [
                ("Ready", False, "InvalidForCluster", problem),
                ("Progressing", False, "InvalidForCluster", problem),
                ("Degraded", True, "InvalidForCluster", problem),
            ]
        else:
            ready_msg = "; ".join(not_ready) or "every pool and the router are ready"
            conditions.append(
                ("Ready", not not_ready, "PoolsNotReady" if not_ready else "AllReady", ready_msg)
            )
            if updating:
                progressing = (True, "RollingOut", f"revision {rev}: " + "; ".join(not_ready))
            elif old_present:
                detail = f": {'; '.join(draining)}" if draining else ""
                progressing = (
                    True,
                    "RetiringRevision",
                    f"draining revision(s) {', '.join(sorted(old_present))}{detail}",
                )
            else:
                progressing = (False, "Converged", f"revision {rev} serves")
            conditions.append(("Progressing", *progressing))
            conditions.append(
                (
                    "Degraded",
                    bool(failing),
                    "ProgressDeadlineExceeded" if failing else "AsExpected",
                    "; ".join(failing) or "no pool is failing",
                )
            )
        prev_conditions = {c.get("type"): c for c in previous.get("conditions") or []}
        now = _rfc3339(self.clock())
        status["conditions"] = []
        for ctype, ok, reason, message in conditions:
            value = "True" if ok else "False"
            prev = prev_conditions.get(ctype) or {}
            since = prev.get("lastTransitionTime") if prev.get("status") == value else None
            status["conditions"].append(
                {
                    "type": ctype,
                    "status": value,
                    "reason": reason,
                    "message": message,
                    "lastTransitionTime": since or now,
                }
            )
        return status

    def _old_revisions(self, body: Mapping[str, Any], namespace: str, rev: str) -> set[str]:
        out: set[str] = set()
        selector = f"{LABEL_INSTANCE}={body['metadata']['name']},{LABEL_MANAGED_BY}={MANAGED_BY}"
        kinds = [k for k in managed_kinds(self.facts) if k[1] in WORKLOAD_KINDS]
        for api_version, kind in kinds:
            items = self._res(api_version, kind).get(namespace=namespace, label_selector=selector)
            for item in items.to_dict().get("items", []):
                r = (item["metadata"].get("labels") or {}).get(LABEL_REVISION)
                if r and r != rev:
                    out.add(r)
        return out

    def _write_status(
        self, body: Mapping[str, Any], status: dict[str, Any], result: Result
    ) -> None:
        result.status = status
        if body.get("status") == status:
            return
        log.debug("status", name=body["metadata"]["name"], old=body.get("status"), new=status)
        gone = {k: None for k in body.get("status") or {} if k not in status}
        self._res(API_VERSION, "BeamDeployment").status.patch(
            body={"status": {**status, **gone}},  # merge patch: null removes a key
            name=body["metadata"]["name"],
            namespace=body["metadata"]["namespace"],
            content_type="application/merge-patch+json",
        )
        result.writes += 1


# -- pure helpers -----------------------------------------------------------------------------


def contains(live: Any, want: Any) -> bool:
    """Whether `live` (the server's object) already holds every field of `want` (what we
    apply): maps by key, lists item by item; `1` and `"1"` match (quantities come back as
    strings). Fields the server added (defaults, status, managedFields) do not matter."""
    if isinstance(want, Mapping):
        if not isinstance(live, Mapping):
            return False
        # a zero value the server leaves out (`omitempty`) is there
        return all(contains(live[k], v) if k in live else _is_zero(v) for k, v in want.items()) or (
            not want and not live
        )
    if isinstance(want, list):
        return (
            isinstance(live, list)
            and len(live) == len(want)
            and all(contains(a, b) for a, b in zip(live, want, strict=True))
        )
    if isinstance(want, bool) or isinstance(live, bool):
        return live is want
    if (isinstance(want, int | float) and isinstance(live, str)) or (
        isinstance(live, int | float) and isinstance(want, str)
    ):
        return str(live) == str(want)
    return bool(live == want)


def _is_zero(value: Any) -> bool:
    return value is False or value == 0 or value in ("", [], {})


def _ready(w: Object | None) -> bool:
    """Every wanted replica of the workload's current template is ready, and no pod of an
    older template is left (a zero-replica workload is ready)."""
    if w is None:
        return False
    spec, st = w.get("spec") or {}, w.get("status") or {}
    want = int(spec.get("replicas", 0))
    if st.get("observedGeneration", 0) < w["metadata"].get("generation", 0):
        return False
    if want == 0:
        return True
    return bool(
        st.get("readyReplicas", 0) >= want
        and st.get("updatedReplicas", 0) >= want
        and st.get("replicas", 0) <= want
    )


def _deadline_exceeded(w: Object | None) -> bool:
    for c in ((w or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == "Progressing" and c.get("reason") == "ProgressDeadlineExceeded":
            return True
        if c.get("type") == "ReplicaFailure" and c.get("status") == "True":
            return True
    return False


def _owner(body: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": "BeamDeployment",
        "name": body["metadata"]["name"],
        "uid": body["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _rfc3339(t: float) -> str:
    return dt.datetime.fromtimestamp(int(t), dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_rfc3339(s: str) -> float:
    return dt.datetime.strptime(s, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC).timestamp()


def owner_deployment(obj: Mapping[str, Any]) -> str | None:
    """The BeamDeployment owning `obj` (a child or a BeamPool), by its owner reference."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("kind") == "BeamDeployment" and str(ref.get("apiVersion", "")).startswith(
            "beamserve.io/"
        ):
            return str(ref["name"])
    return None
