"""The operator against a real kube-apiserver 1.20.2 + controller-manager (`make test-k8s`).

Setup (module fixture, in this order):
* a cluster of its own (tests/k8s_cluster.py) with the controller manager (garbage collector,
  Deployments, ReplicaSets) and the `ServiceAccount` admission plugin off: without the token
  controller that plugin refuses every pod whose ServiceAccount has no token Secret, and pods
  are what the tests mark ready (no kubelet runs: a fake below the part under test);
* the BeamDeployment CRD without CEL (`crd.crd_without_cel()`, installed as generated), the
  BeamPool CRD, and the third-party CRDs of tests/operator/crds (CEL and `default: ""`
  stripped: 1.20 refuses both), created by the admin;
* `helm install` of charts/beamserve with the real helm binary (`--skip-crds`: the chart's CRD
  carries CEL; `webhook.url` points the webhook at the operator on loopback);
* `beamserve operator` as a subprocess, authenticated with a token of the chart's own
  ServiceAccount (TokenRequest API), so the chart's RBAC is exactly what it has; the webhook
  is served by the operator with the self-signed certificate it generates at start and patches
  into the chart's ValidatingWebhookConfiguration.

Proven: create → every child, owned by the BeamDeployment; status from the children; zero
writes at rest and after an operator restart (resourceVersions unchanged, no duplicates); a
spec change rolls the pool in place; `kubectl scale`-style writes to a BeamPool's `/scale`
reach the pool; BeamPools of pools the spec lacks are pruned (only those the BeamDeployment
controls); a KV-incompatible change makes a second revision beside the first, which is
unrouted once the new one is ready and removed only when a real `beamserve router` (discovering
a slowed sim worker through this API server, reached through the router Service's
EndpointSlice) reports no request in flight on it — or at the drain timeout, with a
`DrainTimedOut` event; invalid specs are refused by the webhook with
the field and the fix; deletion garbage-collects every child; the chart's RBAC forbids what the
operator does not need.
"""

from __future__ import annotations

import datetime as dt
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from beamserve.operator import crd, scaler
from beamserve.operator.desired import revision

_path = Path(__file__).resolve().parents[1] / "k8s_cluster.py"
_spec = importlib.util.spec_from_file_location("k8s_cluster", _path)
assert _spec is not None and _spec.loader is not None
_kc = sys.modules.setdefault("k8s_cluster", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(_kc)

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "beamserve"
CRDS = Path(__file__).resolve().parent / "crds"
RELEASE, SYSTEM_NS = "beam", "beam-system"
OPERATOR_SA = f"{RELEASE}-operator"
WEBHOOK_CONFIG = f"{RELEASE}-webhook.beamserve.io"
BD = "/apis/beamserve.io/v1alpha1/namespaces/{ns}/beamdeployments"
STEP_S = 60.0


def _upstream_for_1_20(node: Any) -> Any:
    """The third-party CRDs of tests/operator/crds (upstream files, not generated here) without
    what 1.20 cannot take: CEL (refused under SSA), and `default: ""` (its CRD validation reads
    an empty string default as null and refuses it). A list-map key whose empty default goes is
    made required instead (1.20 wants one or the other). Our own CRDs install as generated."""
    if isinstance(node, dict):
        out = {
            k: _upstream_for_1_20(v)
            for k, v in node.items()
            if k != "x-kubernetes-validations" and not (k == "default" and v == "")
        }
        keys = node.get("x-kubernetes-list-map-keys")
        if keys and isinstance(out.get("items"), dict):
            items = out["items"]
            items["required"] = sorted(set(items.get("required", [])) | set(keys))
        return out
    if isinstance(node, list):
        return [_upstream_for_1_20(v) for v in node]
    return node


class Api:
    """The test's own calls (admin token unless `token` is given)."""

    def __init__(self, server: str, token: str) -> None:
        self.http = httpx.Client(
            base_url=server,
            headers={"Authorization": f"Bearer {token}"},
            verify=False,
            timeout=30,
        )

    def get(self, path: str) -> dict[str, Any]:
        resp = self.http.get(path)
        assert resp.status_code == 200, f"GET {path}: {resp.status_code} {resp.text}"
        body: dict[str, Any] = resp.json()
        return body

    def maybe(self, path: str) -> dict[str, Any] | None:
        resp = self.http.get(path)
        if resp.status_code == 404:
            return None
        assert resp.status_code == 200, resp.text
        body: dict[str, Any] = resp.json()
        return body

    def create(self, path: str, obj: dict[str, Any]) -> httpx.Response:
        return self.http.post(path, json=obj)

    def patch(self, path: str, patch: dict[str, Any]) -> dict[str, Any]:
        resp = self.http.patch(
            path, json=patch, headers={"Content-Type": "application/merge-patch+json"}
        )
        assert resp.status_code == 200, f"PATCH {path}: {resp.text}"
        body: dict[str, Any] = resp.json()
        return body

    def items(self, path: str, selector: str = "") -> list[dict[str, Any]]:
        sep = "&" if "?" in path else "?"
        query = f"{sep}labelSelector={selector}" if selector else ""
        got: list[dict[str, Any]] = self.get(path + query)["items"]
        return got


def wait_for(what: str, check: Callable[[], Any], timeout: float = STEP_S) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except AssertionError as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}: last {last!r}")


class Operator:
    """`beamserve operator` as a subprocess (its log in the cluster's temp dir)."""

    def __init__(self, kubeconfig: Path, port: int, log: Path) -> None:
        self.args = [
            str(Path(sys.executable).parent / "beamserve"),
            "operator",
            "--kubeconfig",
            str(kubeconfig),
            "--webhook-port",
            str(port),
            "--webhook-host",
            "127.0.0.1",
            "--webhook-addr",
            "127.0.0.1",
            "--webhook-config-name",
            WEBHOOK_CONFIG,
            "--image",
            "example.com/beamserve:test",
            "--drain-poll-s",
            "1",
        ]
        self.log = log
        self.port = port
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.args,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={
                    **os.environ,
                    "BEAMSERVE_LOG_JSON": "1",
                    "PYTHONWARNINGS": "ignore",
                    "PYTHONUNBUFFERED": "1",
                },
            )

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def wait_serving(self) -> None:
        """Until the webhook port accepts connections (the operator has started)."""

        def up() -> bool:
            assert self.proc is not None and self.proc.poll() is None, self.text()[-3000:]
            with socket.socket() as s:
                s.settimeout(1)
                return s.connect_ex(("127.0.0.1", self.port)) == 0

        wait_for("the operator's webhook", up)

    def text(self) -> str:
        return self.log.read_text(errors="replace")


class Env:
    def __init__(self, cluster: Any, admin: Api, operator: Operator, sa_token: str) -> None:
        self.cluster = cluster
        self.admin = admin
        self.operator = operator
        self.sa_token = sa_token


def _helm() -> str:
    done = subprocess.run(
        [str(REPO / "scripts" / "helm.sh")], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"scripts/helm.sh failed (needs npm):\n{done.stderr}"
    return done.stdout.strip()


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    missing = _kc.missing_binaries()
    if missing:
        pytest.fail(f"the k8s tests need {', '.join(missing)}: {_kc.FIX}", pytrace=False)
    cluster = _kc.KubeCluster(
        controller_manager=True,
        extra_apiserver_args=("--disable-admission-plugins=ServiceAccount",),
    )
    operator: Operator | None = None
    try:
        cluster.start()
        admin = Api(cluster.server, cluster.token)
        crds = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
        bodies = [crd.crd_without_cel(), scaler.scaler_crd()]  # as generated
        for f in sorted(CRDS.glob("*.yaml")):
            bodies.append(_upstream_for_1_20(yaml.safe_load(f.read_text())))
        for body in bodies:
            resp = admin.create(crds, body)
            assert resp.status_code == 201, resp.text
        for body in bodies:
            name = body["metadata"]["name"]
            wait_for(
                f"CRD {name} established",
                lambda name=name: any(
                    c["type"] == "Established" and c["status"] == "True"
                    for c in (admin.get(f"{crds}/{name}").get("status") or {}).get("conditions")
                    or []
                ),
            )
        port = _kc.free_port()
        done = subprocess.run(
            [
                _helm(),
                "install",
                RELEASE,
                str(CHART),
                "--namespace",
                SYSTEM_NS,
                "--create-namespace",
                "--skip-crds",
                "--kubeconfig",
                str(cluster.kubeconfig),
                "--set",
                f"webhook.url=https://127.0.0.1:{port}",
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        resp = admin.create(
            f"/api/v1/namespaces/{SYSTEM_NS}/serviceaccounts/{OPERATOR_SA}/token",
            {
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenRequest",
                "spec": {"expirationSeconds": 7200},
            },
        )
        assert resp.status_code == 201, resp.text
        token = resp.json()["status"]["token"]
        kubeconfig = cluster.dir / "kubeconfig-operator"
        kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [
                        {
                            "name": "test",
                            "cluster": {"server": cluster.server, "insecure-skip-tls-verify": True},
                        }
                    ],
                    "users": [{"name": "operator", "user": {"token": token}}],
                    "contexts": [
                        {"name": "test", "context": {"cluster": "test", "user": "operator"}}
                    ],
                    "current-context": "test",
                }
            )
        )
        log_dir = Path(tempfile.mkdtemp(prefix="beamserve-operator-"))
        operator = Operator(kubeconfig, port, log_dir / "operator.log")
        operator.start()
        operator.wait_serving()
        vwc = "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/"
        vwc += WEBHOOK_CONFIG
        wait_for(
            "the operator's CA in the webhook configuration",
            lambda: admin.get(vwc)["webhooks"][0]["clientConfig"].get("caBundle"),
        )
        yield Env(cluster, admin, operator, token)
    finally:
        if operator is not None:
            operator.stop()
        cluster.stop()


# -- helpers ------------------------------------------------------------------------------------

_COUNTER = [0]


def namespace(env: Env) -> str:
    _COUNTER[0] += 1
    name = f"t{_COUNTER[0]}"
    resp = env.admin.create("/api/v1/namespaces", {"metadata": {"name": name}})
    assert resp.status_code == 201, resp.text
    return name


def sim_spec(**over: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"source": {"hostPath": {"path": "/tmp/beam-tiny"}}},
        "engine": {"name": "sim"},
        "prefill": {"replicas": 1},
        "decode": {"replicas": 2},
        "router": {"replicas": 1},
        "monitoring": {"enabled": True},
        "rollout": {"drainTimeoutSeconds": 600},
    }
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(spec.get(key), dict):
            spec[key] = {**spec[key], **value}
        else:
            spec[key] = value
    return spec


def create_bd(env: Env, ns: str, spec: dict[str, Any], name: str = "beam") -> dict[str, Any]:
    resp = env.admin.create(
        BD.format(ns=ns),
        {
            "apiVersion": "beamserve.io/v1alpha1",
            "kind": "BeamDeployment",
            "metadata": {"name": name},
            "spec": spec,
        },
    )
    assert resp.status_code == 201, resp.text
    body: dict[str, Any] = resp.json()
    return body


KINDS = {
    "Deployment": "/apis/apps/v1/namespaces/{ns}/deployments",
    "Service": "/api/v1/namespaces/{ns}/services",
    "PodDisruptionBudget": "/apis/policy/v1beta1/namespaces/{ns}/poddisruptionbudgets",
    "ConfigMap": "/api/v1/namespaces/{ns}/configmaps",
    "ServiceAccount": "/api/v1/namespaces/{ns}/serviceaccounts",
    "Role": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles",
    "RoleBinding": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings",
    "NetworkPolicy": "/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies",
    "ServiceMonitor": "/apis/monitoring.coreos.com/v1/namespaces/{ns}/servicemonitors",
    "BeamPool": "/apis/beamserve.io/v1alpha1/namespaces/{ns}/beampools",
}
SELECTOR = "app.kubernetes.io/instance=beam"


def children(env: Env, ns: str) -> dict[tuple[str, str], dict[str, Any]]:
    out = {}
    for kind, path in KINDS.items():
        for item in env.admin.items(path.format(ns=ns), SELECTOR):
            out[(kind, item["metadata"]["name"])] = item
    return out


def versions(env: Env, ns: str) -> dict[tuple[str, str], str]:
    out = {k: v["metadata"]["resourceVersion"] for k, v in children(env, ns).items()}
    bd = env.admin.get(f"{BD.format(ns=ns)}/beam")
    out[("BeamDeployment", "beam")] = bd["metadata"]["resourceVersion"]
    return out


def mark_pods_ready(env: Env, ns: str) -> int:
    """What a kubelet would report for running, ready pods (status only)."""
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    marked = 0
    for i, pod in enumerate(env.admin.items(f"/api/v1/namespaces/{ns}/pods")):
        conds = (pod.get("status") or {}).get("conditions") or []
        if pod["metadata"].get("deletionTimestamp") or any(
            c["type"] == "Ready" and c["status"] == "True" for c in conds
        ):
            continue
        env.admin.patch(
            f"/api/v1/namespaces/{ns}/pods/{pod['metadata']['name']}/status",
            {
                "status": {
                    "phase": "Running",
                    "podIP": f"10.1.{i // 250}.{i % 250 + 1}",
                    "conditions": [
                        {"type": t, "status": "True", "lastTransitionTime": now}
                        for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")
                    ],
                }
            },
        )
        marked += 1
    return marked


def condition(bd: dict[str, Any], ctype: str) -> dict[str, Any]:
    for c in (bd.get("status") or {}).get("conditions") or []:
        if c["type"] == ctype:
            return dict(c)
    return {}


def wait_ready(env: Env, ns: str) -> dict[str, Any]:
    def ready() -> dict[str, Any] | None:
        mark_pods_ready(env, ns)
        bd = env.admin.get(f"{BD.format(ns=ns)}/beam")
        return bd if condition(bd, "Ready").get("status") == "True" else None

    result: dict[str, Any] = wait_for("Ready=True", ready)
    return result


def pool_deployments(env: Env, ns: str, role: str) -> list[dict[str, Any]]:
    return env.admin.items(
        KINDS["Deployment"].format(ns=ns), f"{SELECTOR},beamserve.io/role={role}"
    )


# -- the tests ----------------------------------------------------------------------------------


def test_create_makes_owned_children_and_status(env: Env) -> None:
    ns = namespace(env)
    bd = create_bd(env, ns, sim_spec())
    uid = bd["metadata"]["uid"]
    rev = revision(_spec_model(bd))
    expected = {
        ("Deployment", f"beam-prefill-{rev}"),
        ("Deployment", f"beam-decode-{rev}"),
        ("Deployment", "beam-router"),
        ("Service", f"beam-prefill-{rev}"),
        ("Service", f"beam-decode-{rev}"),
        ("Service", "beam-router"),
        ("PodDisruptionBudget", f"beam-prefill-{rev}"),
        ("PodDisruptionBudget", f"beam-decode-{rev}"),
        ("PodDisruptionBudget", "beam-router"),
        ("ConfigMap", "beam-router-config"),
        ("ServiceAccount", "beam-router"),
        ("Role", "beam-router"),
        ("RoleBinding", "beam-router"),
        ("NetworkPolicy", "beam-workers"),
        ("ServiceMonitor", "beam-prefill"),
        ("ServiceMonitor", "beam-decode"),
        ("ServiceMonitor", "beam-router"),
        ("BeamPool", "beam-prefill"),
        ("BeamPool", "beam-decode"),
    }
    got = wait_for("every child", lambda: expected <= set(children(env, ns)) and children(env, ns))
    assert set(got) == expected
    for key, obj in got.items():
        refs = obj["metadata"].get("ownerReferences") or []
        assert [(r["kind"], r["uid"], r.get("controller")) for r in refs] == [
            ("BeamDeployment", uid, True)
        ], key
    svc = got[("Service", f"beam-decode-{rev}")]
    assert svc["metadata"]["labels"]["beamserve.io/deployment"] == "beam"
    assert {p["name"] for p in svc["spec"]["ports"]} >= {"http", "kv-events", "kv-replay"}
    status = wait_for("status", lambda: env.admin.get(f"{BD.format(ns=ns)}/beam").get("status"))
    assert status["observedGeneration"] == 1
    assert status["updateRevision"] == rev
    assert condition({"status": status}, "Ready")["status"] == "False"
    ready = wait_ready(env, ns)["status"]
    assert ready["currentRevision"] == rev
    assert ready["decode"]["readyReplicas"] == 2
    assert ready["decode"]["selector"].endswith("beamserve.io/role=decode")
    assert ready["routerEndpoint"] == f"http://beam-router.{ns}.svc:8080"
    assert condition({"status": ready}, "Progressing")["reason"] == "Converged"
    assert condition({"status": ready}, "Degraded")["status"] == "False"


def _spec_model(bd: dict[str, Any]) -> Any:
    from beamserve.operator.desired import parse_deployment

    return parse_deployment(bd).spec


def test_no_writes_at_rest_nor_after_a_restart(env: Env) -> None:
    ns = namespace(env)
    create_bd(env, ns, sim_spec())
    wait_ready(env, ns)
    time.sleep(3)
    before = versions(env, ns)
    time.sleep(5)
    assert versions(env, ns) == before, "writes while nothing changed"
    env.operator.stop()
    env.operator.start()
    env.operator.wait_serving()
    time.sleep(10)  # it has listed (and reconciled) every BeamDeployment and workload by now
    after = versions(env, ns)
    assert after == before, {k: (before.get(k), v) for k, v in after.items() if before.get(k) != v}
    assert len(pool_deployments(env, ns, "decode")) == 1


def test_spec_update_rolls_the_pool_in_place(env: Env) -> None:
    ns = namespace(env)
    create_bd(env, ns, sim_spec())
    wait_ready(env, ns)
    (before,) = pool_deployments(env, ns, "decode")
    env.admin.patch(
        f"{BD.format(ns=ns)}/beam", {"spec": {"decode": {"nodeSelector": {"pool": "decode"}}}}
    )

    def rolled() -> dict[str, Any] | None:
        items = pool_deployments(env, ns, "decode")
        assert len(items) == 1
        spec = items[0]["spec"]["template"]["spec"]
        return items[0] if spec.get("nodeSelector") == {"pool": "decode"} else None

    after = wait_for("the decode pool rolled", rolled)
    assert after["metadata"]["name"] == before["metadata"]["name"]
    assert after["metadata"]["generation"] > before["metadata"]["generation"]
    bd = wait_for(
        "observedGeneration 2",
        lambda: (
            (b := env.admin.get(f"{BD.format(ns=ns)}/beam"))["status"]["observedGeneration"] == 2
            and b
        ),
    )
    assert bd["status"]["updateRevision"] == revision(_spec_model(bd))
    # the roll cannot finish (new pods are not marked ready): still no write loop meanwhile
    time.sleep(3)
    before = versions(env, ns)
    time.sleep(4)
    assert versions(env, ns) == before


def test_beampool_scale_reaches_the_pool_and_spec_changes_win_once(env: Env) -> None:
    ns = namespace(env)
    create_bd(env, ns, sim_spec())
    pool = f"{KINDS['BeamPool'].format(ns=ns)}/beam-decode"
    wait_for("BeamPool", lambda: env.admin.maybe(pool))
    scale = env.admin.get(f"{pool}/scale")
    assert scale["spec"]["replicas"] == 2
    env.admin.patch(f"{pool}/scale", {"spec": {"replicas": 4}})  # what an HPA writes
    wait_for(
        "decode at 4",
        lambda: [d["spec"]["replicas"] for d in pool_deployments(env, ns, "decode")] == [4],
    )
    wait_for("/scale status", lambda: env.admin.get(f"{pool}/scale")["status"].get("selector"))
    env.admin.patch(f"{BD.format(ns=ns)}/beam", {"spec": {"prefill": {"replicas": 2}}})
    wait_for(
        "prefill at 2",
        lambda: [d["spec"]["replicas"] for d in pool_deployments(env, ns, "prefill")] == [2],
    )  # a change of another pool leaves the autoscaler's number for decode alone
    assert [d["spec"]["replicas"] for d in pool_deployments(env, ns, "decode")] == [4]
    env.admin.patch(f"{BD.format(ns=ns)}/beam", {"spec": {"decode": {"replicas": 1}}})
    wait_for(
        "decode at 1",
        lambda: [d["spec"]["replicas"] for d in pool_deployments(env, ns, "decode")] == [1],
    )


def test_beampools_of_pools_the_spec_lacks_are_pruned(env: Env) -> None:
    """A BeamPool the BeamDeployment controls but whose pool the spec lacks (as after a switch
    between prefill + decode and `both`, which the webhook refuses in place) is deleted;
    one labelled alike that it does not control is left alone."""
    ns = namespace(env)
    bd = create_bd(env, ns, sim_spec())
    pools = KINDS["BeamPool"].format(ns=ns)
    wait_for("BeamPools", lambda: env.admin.maybe(f"{pools}/beam-decode"))
    labels = {
        "app.kubernetes.io/instance": "beam",
        "app.kubernetes.io/managed-by": "beamserve",
        "beamserve.io/role": "both",
    }
    owner = {
        "apiVersion": "beamserve.io/v1alpha1",
        "kind": "BeamDeployment",
        "name": "beam",
        "uid": bd["metadata"]["uid"],
        "controller": True,
    }
    for name, refs in (("beam-both", [owner]), ("beam-keep", [])):
        resp = env.admin.create(
            pools,
            {
                "apiVersion": "beamserve.io/v1alpha1",
                "kind": "BeamPool",
                "metadata": {"name": name, "labels": labels, "ownerReferences": refs},
                "spec": {"deployment": "beam", "role": "both", "replicas": 1},
            },
        )
        assert resp.status_code == 201, resp.text
    # its event re-runs the reconcile, which deletes the stale one
    wait_for("the stale BeamPool deleted", lambda: env.admin.maybe(f"{pools}/beam-both") is None)
    names = {p["metadata"]["name"] for p in env.admin.items(pools)}
    assert names == {"beam-prefill", "beam-decode", "beam-keep"}
    log = env.operator.text()
    assert "prune_beampool" in log and "forbidden" not in log.lower(), log[-3000:]


def test_kv_incompatible_change_makes_a_new_revision_and_drains_the_old(env: Env) -> None:
    ns = namespace(env)
    bd = create_bd(env, ns, sim_spec())
    old_rev = revision(_spec_model(bd))
    wait_ready(env, ns)
    env.admin.patch(f"{BD.format(ns=ns)}/beam", {"spec": {"kv": {"pageSize": 32}}})
    bd = env.admin.get(f"{BD.format(ns=ns)}/beam")
    new_rev = revision(_spec_model(bd))
    assert new_rev != old_rev

    def both_revisions() -> bool:
        names = {d["metadata"]["name"] for d in env.admin.items(KINDS["Deployment"].format(ns=ns))}
        return {f"beam-decode-{old_rev}", f"beam-decode-{new_rev}"} <= names

    wait_for("both revisions side by side", both_revisions)
    time.sleep(2)
    # the new revision is not ready: the old one keeps serving, untouched
    old = env.admin.get(f"{KINDS['Deployment'].format(ns=ns)}/beam-decode-{old_rev}")
    assert old["spec"]["replicas"] == 2
    status = env.admin.get(f"{BD.format(ns=ns)}/beam")["status"]
    assert status["currentRevision"] == old_rev and status["updateRevision"] == new_rev
    assert condition({"status": status}, "Progressing")["reason"] == "RollingOut"
    new_svc = env.admin.get(f"{KINDS['Service'].format(ns=ns)}/beam-decode-{new_rev}")
    assert new_svc["metadata"]["labels"]["beamserve.io/revision"] == new_rev

    def old_gone() -> bool:
        mark_pods_ready(env, ns)
        have = set(children(env, ns))
        return not any(name.endswith(old_rev) for _, name in have)

    wait_for("the old revision drained and removed", old_gone, timeout=120)
    have = set(children(env, ns))
    for kind in ("Deployment", "Service", "PodDisruptionBudget"):
        assert (kind, f"beam-decode-{new_rev}") in have
        assert (kind, f"beam-prefill-{new_rev}") in have
    final = wait_ready(env, ns)["status"]
    assert final["currentRevision"] == new_rev == final["updateRevision"]


SLICES = "/apis/discovery.k8s.io/v1beta1/namespaces/{ns}/endpointslices"


def add_slice(env: Env, ns: str, service: str, pod: str, port: int) -> None:
    """What the EndpointSlice controller (not run here) would publish for `service`: one ready
    endpoint, the process on loopback `port` standing for the pod's `http` port."""
    resp = env.admin.create(
        SLICES.format(ns=ns),
        {
            "apiVersion": "discovery.k8s.io/v1beta1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": f"{service}-test",
                "labels": {"kubernetes.io/service-name": service},
            },
            "addressType": "IPv4",
            "endpoints": [
                {
                    "addresses": ["127.0.0.1"],
                    "conditions": {"ready": True},
                    "targetRef": {"kind": "Pod", "name": pod, "namespace": ns},
                }
            ],
            "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
        },
    )
    assert resp.status_code == 201, resp.text


class HeldRequest:
    """A streaming chat request through the router, held open (first token read) until
    `release()` — a request in flight on its worker."""

    def __init__(self, router_url: str) -> None:
        import threading

        self.started, self.released = threading.Event(), threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(router_url,), daemon=True)
        self.thread.start()

    def _run(self, url: str) -> None:
        body = {
            "model": "beam",
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 4000,
            "stream": True,
        }
        try:
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
                assert r.status_code == 200, r.read()
                # keep reading (leaving the line iterator early would close the stream)
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        self.started.set()
                    if self.released.is_set():
                        break  # the client goes away: the request ends
        except BaseException as exc:
            self.error = exc
        finally:
            self.started.set()

    def release(self) -> None:
        self.released.set()
        self.thread.join(30)


def events(env: Env, ns: str, reason: str) -> list[dict[str, Any]]:
    items = env.admin.items(f"/api/v1/namespaces/{ns}/events")
    return [e for e in items if e.get("reason") == reason]


def drain_setup(env: Env, spawn_worker: Any, ns: str, drain_s: int) -> tuple[str, str, Any]:
    """A ready BeamDeployment; a slowed sim worker standing for its decode pod (the decode
    Service's slice); a real `beamserve router` discovering it through the API server, and
    standing for the router pod (the router Service's slice). Returns (old revision, new
    revision, the held request, in flight on the old revision's decode worker)."""
    bd = create_bd(env, ns, sim_spec(rollout={"drainTimeoutSeconds": drain_s}))
    old_rev = revision(_spec_model(bd))
    wait_ready(env, ns)
    worker = spawn_worker("--engine", "sim", "--speed", "0.01")
    add_slice(
        env, ns, f"beam-decode-{old_rev}", "beam-decode-old-0", int(worker.url.rsplit(":")[-1])
    )
    router = spawn_worker(
        "--kubernetes",
        "beam",
        "--namespace",
        ns,
        "--kubeconfig",
        str(env.cluster.kubeconfig),
        "--host",
        "127.0.0.1",
        command="router",
    )
    add_slice(env, ns, "beam-router", "beam-router-0", int(router.url.rsplit(":")[-1]))
    wait_for(
        "the router discovers the old decode worker",
        lambda: any(
            w["id"] == "beam-decode-old-0" and w["revision"] == old_rev
            for w in httpx.get(f"{router.url}/admin/workers", timeout=5).json()["workers"]
        ),
    )
    held = HeldRequest(router.url)
    assert held.started.wait(60) and held.error is None, held.error
    report = httpx.get(f"{router.url}/admin/workers", timeout=5).json()
    assert [(w["id"], w["in_flight"]) for w in report["workers"]] == [("beam-decode-old-0", 1)]
    env.admin.patch(f"{BD.format(ns=ns)}/beam", {"spec": {"kv": {"pageSize": 32}}})
    new_rev = revision(_spec_model(env.admin.get(f"{BD.format(ns=ns)}/beam")))
    assert new_rev != old_rev

    def unrouted() -> bool:
        mark_pods_ready(env, ns)  # the new revision's pods
        return env.admin.maybe(f"{KINDS['Service'].format(ns=ns)}/beam-decode-{old_rev}") is None

    wait_for("the old revision's Services deleted (unrouted)", unrouted, timeout=120)
    return old_rev, new_rev, held


def old_workloads(env: Env, ns: str, old_rev: str) -> set[tuple[str, str]]:
    return {k for k in children(env, ns) if k[1].endswith(old_rev)}


def test_retiring_revision_waits_for_the_routers_in_flight_requests(
    env: Env, spawn_worker: Any
) -> None:
    ns = namespace(env)
    old_rev, new_rev, held = drain_setup(env, spawn_worker, ns, drain_s=600)
    try:
        # the router no longer lists the old worker, but its request runs: the old pools stay
        time.sleep(5)  # several --drain-poll-s rechecks
        assert {k[0] for k in old_workloads(env, ns, old_rev)} == {
            "Deployment",
            "PodDisruptionBudget",
        }
        bd = env.admin.get(f"{BD.format(ns=ns)}/beam")
        progressing = condition(bd, "Progressing")
        assert progressing["reason"] == "RetiringRevision", progressing
        assert "1 request(s) in flight" in progressing["message"], progressing
        assert not events(env, ns, "RevisionRetired")
    finally:
        held.release()  # the request ends
    wait_for("the drained revision removed", lambda: not old_workloads(env, ns, old_rev))
    (event,) = wait_for("RevisionRetired", lambda: events(env, ns, "RevisionRetired"))
    assert old_rev in event["message"] and event["involvedObject"]["name"] == "beam"
    assert not events(env, ns, "DrainTimedOut")
    final = wait_ready(env, ns)["status"]
    assert final["currentRevision"] == new_rev


def test_retiring_revision_is_removed_at_the_drain_timeout(env: Env, spawn_worker: Any) -> None:
    ns = namespace(env)
    old_rev, _, held = drain_setup(env, spawn_worker, ns, drain_s=8)
    try:
        assert old_workloads(env, ns, old_rev)  # the request still runs
        wait_for("removed at the timeout", lambda: not old_workloads(env, ns, old_rev))
        (event,) = wait_for("DrainTimedOut", lambda: events(env, ns, "DrainTimedOut"))
        assert event["type"] == "Warning" and old_rev in event["message"]
        assert "1 request(s) in flight" in event["message"], event["message"]
    finally:
        held.release()


def test_multinode_pool_and_gateway_objects_pass_the_real_schemas(env: Env) -> None:
    """A LeaderWorkerSet and an InferencePool, validated by the API server against the
    upstream CRDs (no LeaderWorkerSet controller runs: the pool never becomes ready)."""
    ns = namespace(env)
    doc = yaml.safe_load((REPO / "manifests/examples/beam-multinode.yaml").read_text())
    spec = doc["spec"]
    spec["router"] = {**spec["router"], "grpcPort": 9002}
    bd = create_bd(env, ns, spec)
    rev = revision(_spec_model(bd))
    lws = f"/apis/leaderworkerset.x-k8s.io/v1/namespaces/{ns}/leaderworkersets/beam-prefill-{rev}"
    got = wait_for("the LeaderWorkerSet", lambda: env.admin.maybe(lws))
    assert got["spec"]["leaderWorkerTemplate"]["size"] == 2
    assert got["metadata"]["ownerReferences"][0]["uid"] == bd["metadata"]["uid"]
    pool = f"/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools/beam-workers"
    ip = wait_for("the InferencePool", lambda: env.admin.maybe(pool))
    assert ip["spec"]["endpointPickerRef"]["name"] == "beam-router"
    status = wait_for(
        "status", lambda: env.admin.get(f"{BD.format(ns=ns)}/beam").get("status") or None
    )
    assert condition({"status": status}, "Ready")["status"] == "False"
    assert "prefill 0/1 ready" in condition({"status": status}, "Ready")["message"]


INVALID = [
    (
        "both and prefill",
        sim_spec(both={"replicas": 1}),
        "spec.both",
    ),
    (
        "name too long",
        sim_spec(),
        "metadata.name",
    ),
]


@pytest.mark.parametrize(("case", "spec", "field"), INVALID, ids=[c[0] for c in INVALID])
def test_invalid_spec_is_refused_by_the_webhook(
    env: Env, case: str, spec: dict[str, Any], field: str
) -> None:
    ns = namespace(env)
    name = "b" * 40 if case == "name too long" else "beam"
    resp = env.admin.create(
        BD.format(ns=ns),
        {
            "apiVersion": "beamserve.io/v1alpha1",
            "kind": "BeamDeployment",
            "metadata": {"name": name},
            "spec": spec,
        },
    )
    assert resp.status_code in (400, 422), resp.text
    message = resp.json()["message"]
    assert "admission webhook" in message and field in message, message


def test_unsafe_update_is_refused_by_the_webhook(env: Env) -> None:
    ns = namespace(env)
    create_bd(env, ns, sim_spec())
    resp = env.admin.http.patch(
        f"{BD.format(ns=ns)}/beam",
        json={"spec": {"decode": {"tp": 3}}},
        headers={"Content-Type": "application/merge-patch+json"},
    )
    assert resp.status_code in (400, 422), resp.text
    assert "spec.decode" in resp.json()["message"]


def test_delete_garbage_collects_every_child(env: Env) -> None:
    ns = namespace(env)
    create_bd(env, ns, sim_spec())
    wait_for("children", lambda: len(children(env, ns)) >= 19)
    resp = env.admin.http.delete(f"{BD.format(ns=ns)}/beam")
    assert resp.status_code in (200, 202), resp.text
    wait_for("garbage collection", lambda: not children(env, ns), timeout=120)


def test_chart_rbac_is_enough_and_no_more(env: Env) -> None:
    sa = Api(env.cluster.server, env.sa_token)
    ns = namespace(env)
    create_bd(env, ns, sim_spec())
    wait_for("children", lambda: len(children(env, ns)) >= 19)
    log = env.operator.text()
    assert "forbidden" not in log.lower() and "(403)" not in log, log[-3000:]
    allowed = sa.http.get(f"{BD.format(ns=ns)}")
    assert allowed.status_code == 200
    for method, path in [
        ("DELETE", f"{BD.format(ns=ns)}/beam"),  # reads BeamDeployments, never deletes them
        ("GET", f"/api/v1/namespaces/{ns}/secrets"),
        ("GET", f"/api/v1/namespaces/{ns}/pods"),
        ("POST", f"/api/v1/namespaces/{ns}/pods"),
        ("PUT", f"{KINDS['Deployment'].format(ns=ns)}/beam-router"),
        ("PUT", f"{KINDS['BeamPool'].format(ns=ns)}/beam-decode"),  # patches, never updates
        ("DELETE", KINDS["BeamPool"].format(ns=ns)),  # deletes one by one, no collection
        ("GET", "/apis/rbac.authorization.k8s.io/v1/clusterroles"),
        ("PATCH", "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/other"),
    ]:
        body = None if method in ("GET", "DELETE") else {"metadata": {"name": "x"}}
        headers = {"Content-Type": "application/merge-patch+json"} if method == "PATCH" else {}
        resp = sa.http.request(method, path, json=body, headers=headers)
        assert resp.status_code == 403, (method, path, resp.status_code, resp.text)


def test_operator_log_is_clean(env: Env) -> None:
    text = env.operator.text()
    assert "Traceback" not in text, text[-4000:]
