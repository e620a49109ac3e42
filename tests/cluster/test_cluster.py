"""The real-cluster tier (`make test-cluster`, marker `cluster`): a BeamDeployment turned into
running pods that answer, on a single-node Kubernetes 1.20.2 from real parts
(tests/cluster/node.py) with the images scripts/build-image.sh builds.

In order (module fixtures, the tests share one cluster and build on each other):
`helm install` of charts/beamserve with its default image reference (the operator runs as a pod
under the chart's ServiceAccount and RBAC) → `kubectl apply` of a `sim` BeamDeployment with a
prefill and a decode pool → its pods scheduled, started, their startup and readiness probes
passed → the router pod discovers the workers through EndpointSlices → the openai and anthropic
SDKs, run inside the cluster's network namespace, get streamed answers through the router's
Service (ClusterIP, kube-proxy): a disaggregated first turn, a prefix hit on the second → a
decode pod killed: its Deployment replaces it, the router drops the old and adds the new one,
no request hangs → `kubectl scale` on the decode BeamPool changes its pods → delete:
every child garbage-collected. When a test fails, every component's and every pod's log is
copied to ${BEAMSERVE_CLUSTER_LOGS:-/tmp/beamserve-cluster-logs}/<time>/.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "beamserve_cluster_node", Path(__file__).with_name("node.py")
)
assert _spec is not None and _spec.loader is not None
node = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = node
_spec.loader.exec_module(node)

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(1800)]

SYSTEM_NS = "beamserve-system"
RELEASE = "beamserve"
NS = "serve"
BD_NAME = "beam"
PY = str(REPO / ".venv" / "bin" / "python")
CLIENT = str(Path(__file__).with_name("client.py"))


def _build(image: str) -> Path:
    archive = node.cache_root() / "images" / f"{image}.oci.tar"
    if os.environ.get("BEAMSERVE_CLUSTER_CACHED_IMAGES") == "1" and archive.exists():
        return archive  # whatever commit they were built from (iterating on the tests)
    done = subprocess.run(
        [str(REPO / "scripts" / "build-image.sh"), image],
        capture_output=True, text=True, timeout=3600,
    )  # fmt: skip
    assert done.returncode == 0, f"build-image.sh {image} failed:\n{done.stderr[-4000:]}"
    return archive


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest) -> Iterator[Any]:
    missing = node.missing_parts()
    if missing:
        pytest.fail(f"the cluster tier needs {', '.join(missing)}: {node.FIX}", pytrace=False)
    images = [_build("pause"), _build("beamserve")]
    c = node.NodeCluster(images)
    failed_before = request.session.testsfailed
    c.start()
    try:
        yield c
    finally:
        if request.session.testsfailed > failed_before:
            root = Path(os.environ.get("BEAMSERVE_CLUSTER_LOGS", "/tmp/beamserve-cluster-logs"))
            dest = c.collect_logs(root / time.strftime("%Y%m%dT%H%M%S"))
            print(f"\ncluster logs kept in {dest}", file=sys.stderr)
        c.stop()


def wait(what: str, cond: Any, timeout: float = 300, every: float = 2) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = cond()
        except (AssertionError, subprocess.SubprocessError, KeyError, ValueError) as e:
            last = e
        else:
            if last:
                return last
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; last: {last!r}")


def pods(c: Any, ns: str, selector: str = "") -> list[dict[str, Any]]:
    args = ["pods", "-n", ns] + (["-l", selector] if selector else [])
    return [p for p in c.get(*args)["items"] if not p["metadata"].get("deletionTimestamp")]


def ready(pod: dict[str, Any]) -> bool:
    conds = pod.get("status", {}).get("conditions") or []
    return any(x["type"] == "Ready" and x["status"] == "True" for x in conds)


def router_url(c: Any) -> str:
    svc = c.get("svc", "-n", NS, "-l", "app.kubernetes.io/component=router")["items"]
    assert len(svc) == 1, [s["metadata"]["name"] for s in svc]
    spec = svc[0]["spec"]
    return f"http://{spec['clusterIP']}:{spec['ports'][0]['port']}"


def http_get(c: Any, url: str) -> Any:
    code = f"import httpx,json;print(json.dumps(httpx.get({url!r},timeout=10).json()))"
    return json.loads(c.run([PY, "-c", code], timeout=60).stdout)


def workers(c: Any) -> list[dict[str, Any]]:
    return list(http_get(c, router_url(c) + "/admin/workers")["workers"])


@pytest.fixture(scope="module")
def installed(cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The CRDs (as 1.20 takes them: without CEL) and `helm install` of the chart with its
    defaults (but the webhook's cert, which the operator makes itself)."""
    from beamserve.operator import crd, scaler

    d = tmp_path_factory.mktemp("crds")
    (d / "crds.yaml").write_text(yaml.safe_dump_all([crd.crd_without_cel(), scaler.scaler_crd()]))
    cluster.kubectl("create", "-f", str(d / "crds.yaml"))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                    "crd/beamdeployments.beamserve.io", "crd/beampools.beamserve.io")  # fmt: skip
    helm = subprocess.run([str(REPO / "scripts" / "helm.sh")], capture_output=True, text=True,
                          timeout=600, check=True).stdout.strip()  # fmt: skip
    cluster.run([helm, "install", RELEASE, str(REPO / "charts" / "beamserve"), "--namespace",
                 SYSTEM_NS, "--create-namespace", "--skip-crds", "--wait", "--timeout", "10m",
                 "--kubeconfig", str(cluster.kubeconfig)], timeout=700)  # fmt: skip
    return cluster


def test_helm_installs_the_operator_as_a_pod_under_its_service_account(installed: Any) -> None:
    c = installed
    values = yaml.safe_load((REPO / "charts" / "beamserve" / "values.yaml").read_text())
    chart = yaml.safe_load((REPO / "charts" / "beamserve" / "Chart.yaml").read_text())
    default_image = (
        f"{values['image']['repository']}:{values['image']['tag'] or chart['appVersion']}"
    )
    ops = pods(c, SYSTEM_NS)
    assert len(ops) == 1 and ready(ops[0]), [p["status"] for p in ops]
    spec = ops[0]["spec"]
    assert spec["serviceAccountName"] == f"{RELEASE}-operator" or spec["serviceAccountName"]
    assert spec["containers"][0]["image"] == default_image
    # the image it runs is the one scripts/build-image.sh built and the node imported
    # (the CRI reports a locally imported image by its config digest, the image ID)
    built = node.image_ids(node.cache_root() / "images" / "beamserve.oci.tar")
    status = ops[0]["status"]["containerStatuses"][0]
    assert status["imageID"].split("@")[-1] in built, (status["imageID"], built)
    # it runs as the chart says, under the ServiceAccount's token (mounted by the kubelet)
    mounts = {m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
    assert "/var/run/secrets/kubernetes.io/serviceaccount" in mounts


BD = {
    "apiVersion": "beamserve.io/v1alpha1",
    "kind": "BeamDeployment",
    "metadata": {"name": BD_NAME, "namespace": NS},
    "spec": {
        "model": {"source": {"hostPath": {"path": "PLACEHOLDER"}}},
        "engine": {"name": "sim", "simProfile": "tiny-cpu"},
        "prefill": {"replicas": 1},
        "decode": {"replicas": 2},
        "router": {"replicas": 1, "disaggregation": {"minUncachedTokens": 256}},
        "rollout": {"drainTimeoutSeconds": 60},
        "monitoring": {"enabled": False},
    },
}


@pytest.fixture(scope="module")
def served(installed: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The sim BeamDeployment applied with kubectl; every pod Ready."""
    from beamserve.workers.ref.checkpoint import make_tiny

    c = installed
    model = make_tiny(c.dir / "model" / "tiny", seed=0)
    for p in [model, *model.parents][:3]:
        p.chmod(0o755)  # the pods run as uid 65532
    for f in model.iterdir():
        f.chmod(0o644)
    body = json.loads(json.dumps(BD))
    body["spec"]["model"]["source"]["hostPath"]["path"] = str(model)
    f = tmp_path_factory.mktemp("bd") / "beam.yaml"
    f.write_text(yaml.safe_dump(body))
    c.kubectl("create", "namespace", NS)
    c.kubectl("apply", "-f", str(f))
    wait(
        "4 pods Ready (1 prefill, 2 decode, 1 router)",
        lambda: len(ps := pods(c, NS)) == 4 and all(ready(p) for p in ps),
        timeout=600,
    )
    return c


def test_pods_are_scheduled_started_and_pass_their_probes(served: Any) -> None:
    c = served
    ps = pods(c, NS)
    roles = sorted(p["metadata"]["labels"].get("app.kubernetes.io/component", "") for p in ps)
    assert roles == ["decode", "decode", "prefill", "router"], roles
    for p in ps:
        assert p["spec"]["nodeName"] == node.NODE_NAME
        assert p["status"]["podIP"].startswith("10.244.0."), p["status"]
        (st,) = p["status"]["containerStatuses"]
        assert st["ready"] and st["started"] and "running" in st["state"], st
        probes = p["spec"]["containers"][0]
        assert "startupProbe" in probes and "readinessProbe" in probes
        assert st["restartCount"] == 0, (p["metadata"]["name"], st)


def test_router_discovers_the_workers_through_endpointslices(served: Any) -> None:
    c = served
    slices = c.get("endpointslices.v1beta1.discovery.k8s.io", "-n", NS)["items"]
    worker_ips = {p["status"]["podIP"] for p in pods(c, NS, "beamserve.io/worker=true")}
    sliced = {a for s in slices for e in s.get("endpoints") or [] for a in e["addresses"]}
    assert worker_ips <= sliced, (worker_ips, sliced)
    got = wait(
        "the router's /admin/workers listing 3 workers", lambda: len(w := workers(c)) == 3 and w
    )
    assert sorted(w["role"] for w in got) == ["decode", "decode", "prefill"], got
    assert {w["url"].split("//")[1].split(":")[0] for w in got} == worker_ips, got


def test_sdks_stream_through_the_router_service(served: Any) -> None:
    c = served
    out = json.loads(c.run([PY, CLIENT, "turns", router_url(c), "sess-1"], timeout=300).stdout)
    first, second = out["openai"]
    assert first["chunks"] > 2 and first["completion_tokens"] == 6, first
    assert first["route"]["prefill"] != "-", first  # the long first turn: prefill → decode
    assert second["route"]["decode"] == first["route"]["decode"], out
    assert second["cached_tokens"] and second["cached_tokens"] > 0, second  # prefix hit
    assert second["prompt_tokens"] > first["prompt_tokens"]
    ant = out["anthropic"]
    assert ant["events"][0] == "message_start" and "content_block_delta" in ant["events"], ant
    assert ant["output_tokens"] == 5 and ant["text"], ant


def test_a_killed_worker_pod_is_replaced_and_no_request_hangs(served: Any) -> None:
    c = served
    url = router_url(c)
    before = {w["url"] for w in workers(c) if w["role"] == "decode"}
    loop = subprocess.Popen(
        c.ns([PY, CLIENT, "loop", url, "60"]), stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    time.sleep(10)
    victim = next(p for p in pods(c, NS, "app.kubernetes.io/component=decode"))
    name, ip = victim["metadata"]["name"], victim["status"]["podIP"]
    c.kubectl("delete", "pod", "-n", NS, name, "--grace-period=0", "--force", "--wait=false")
    wait("the decode Deployment's replacement Ready",
         lambda: len(ps := pods(c, NS, "app.kubernetes.io/component=decode")) == 2
         and all(ready(p) for p in ps) and name not in {p["metadata"]["name"] for p in ps},
         timeout=300)  # fmt: skip
    after = wait(
        "the router to drop the killed pod and add the new one",
        lambda: (
            (d := {w["url"] for w in workers(c) if w["role"] == "decode"}) != before
            and len(d) == 2
            and not any(ip + ":" in u for u in d)
            and d
        ),
        timeout=120,
    )
    assert len(after & before) == 1, (before, after)
    stdout, _ = loop.communicate(timeout=120)
    results = json.loads(stdout)["results"]
    assert len(results) > 20, results
    assert max(r["s"] for r in results) < 30, [r for r in results if r["s"] >= 30]  # no hang
    oks = [r for r in results if r["ok"]]
    assert oks and results[-1]["ok"], results[-5:]  # served again after the replacement


def test_kubectl_scale_on_the_decode_beampool_changes_its_pods(served: Any) -> None:
    c = served
    pools = c.get("beampools.beamserve.io", "-n", NS)["items"]
    decode = next(p["metadata"]["name"] for p in pools if "decode" in p["metadata"]["name"])
    c.kubectl("scale", "beampools.beamserve.io", decode, "-n", NS, "--replicas=3")
    wait("3 decode pods Ready",
         lambda: len(ps := pods(c, NS, "app.kubernetes.io/component=decode")) == 3
         and all(ready(p) for p in ps), timeout=300)  # fmt: skip
    wait("the router listing 3 decode workers",
         lambda: sum(w["role"] == "decode" for w in workers(c)) == 3, timeout=120)  # fmt: skip
    c.kubectl("scale", "beampools.beamserve.io", decode, "-n", NS, "--replicas=2")
    wait("2 decode pods", lambda: len(pods(c, NS, "app.kubernetes.io/component=decode")) == 2)


def test_a_kv_incompatible_change_rolls_a_new_revision_and_drains_the_old(served: Any) -> None:
    c = served
    rev = "beamserve.io/revision"
    old = {p["metadata"]["labels"][rev] for p in pods(c, NS, "beamserve.io/worker=true")}
    assert len(old) == 1, old
    (old_rev,) = old
    loop = subprocess.Popen(
        c.ns([PY, CLIENT, "loop", router_url(c), "90"]), stdout=subprocess.PIPE, text=True
    )
    time.sleep(5)
    c.kubectl("patch", "beamdeployments.beamserve.io", BD_NAME, "-n", NS, "--type=merge",
              "-p", json.dumps({"spec": {"kv": {"pageSize": 32}}}))  # fmt: skip

    def new_ready() -> str:
        ps = [
            p
            for p in pods(c, NS, "beamserve.io/worker=true")
            if p["metadata"]["labels"][rev] != old_rev
        ]
        return (
            ps[0]["metadata"]["labels"][rev] if len(ps) == 3 and all(ready(p) for p in ps) else ""
        )

    new_rev = wait("the new revision's 3 worker pods Ready", new_ready, timeout=400)
    wait(
        "the old revision's pods gone (drained)",
        lambda: (
            not [
                p
                for p in pods(c, NS, "beamserve.io/worker=true")
                if p["metadata"]["labels"][rev] == old_rev
            ]
        ),
        timeout=400,
    )
    got = wait(
        "the router routing only the new revision",
        lambda: {w["revision"] for w in workers(c)} == {new_rev},
    )
    assert got
    stdout, _ = loop.communicate(timeout=180)
    results = json.loads(stdout)["results"]
    assert max(r["s"] for r in results) < 30, [r for r in results if r["s"] >= 30]  # no hang
    assert all(r["ok"] for r in results), [r for r in results if not r["ok"]]
    # a disaggregated request never pairs a prefill of one revision with a decode of the other
    for r in results:
        if r["prefill"] not in (None, "-"):
            assert (old_rev in r["prefill"]) == (old_rev in r["decode"]), r
            assert (new_rev in r["prefill"]) == (new_rev in r["decode"]), r
    assert any(new_rev in (r["decode"] or "") for r in results), results[-3:]


def test_deleting_the_beamdeployment_garbage_collects_everything(served: Any) -> None:
    c = served
    c.kubectl("delete", "beamdeployments.beamserve.io", BD_NAME, "-n", NS, "--wait=true",
              timeout=300)  # fmt: skip

    def gone() -> bool:
        left = c.kubectl("get", "deploy,rs,pods,svc,cm,sa,roles,rolebindings,"
                         "beampools.beamserve.io", "-n", NS, "-o", "name").split()  # fmt: skip
        # what every namespace has
        return not set(left) - {"serviceaccount/default", "configmap/kube-root-ca.crt"}

    wait("every child of the BeamDeployment gone", gone, timeout=300)
