"""The local runtime's plan: BeamDeployment → processes, ports, endpoints file, rolls (pure)."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path
from typing import Any

import pytest
import yaml
from beamserve.operator.api import BeamDeployment
from beamserve.operator.desired import (
    LABEL_ENGINE,
    LABEL_POOL,
    LABEL_REVISION,
    LABEL_ROLE,
    desired_objects,
    parse_deployment,
)
from beamserve.operator.local.plan import (
    LOOPBACK,
    Liveness,
    LocalPlan,
    LocalPlanError,
    assign_ports,
    diff_plans,
    endpoint_specs,
    liveness_of,
    local_plan,
    map_path,
    rewrite_ports,
)
from beamserve.operator.pools import pool_command
from beamserve.operator.router_config import load_router_config
from beamserve.router.discovery import parse_endpoint_specs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parents[3]
STATE = Path("/state/up/x")


def _bd(spec: dict[str, Any], name: str = "beam") -> BeamDeployment:
    return parse_deployment(
        {
            "apiVersion": "beamserve.io/v1alpha1",
            "kind": "BeamDeployment",
            "metadata": {"name": name},
            "spec": spec,
        }
    )


def _sim(**over: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"source": {"hostPath": {"path": "/data/beam-tiny"}}},
        "engine": {"name": "sim", "simProfile": "tiny-cpu"},
        "prefill": {"replicas": 1},
        "decode": {"replicas": 2},
    }
    spec.update(over)
    return spec


def _ports(plan: LocalPlan, start: int = 20000) -> LocalPlan:
    return assign_ports(plan, itertools.count(start))


def _flag(argv: tuple[str, ...], flag: str) -> str:
    return argv[argv.index(flag) + 1]


# -- specs with structure ---------------------------------------------------------------------

ports = st.integers(min_value=1024, max_value=65000)


@st.composite
def local_specs(draw: st.DrawFn) -> dict[str, Any]:
    engine = draw(st.sampled_from(["sim", "ref"]))
    spec: dict[str, Any] = {
        "model": {
            "source": {"hostPath": {"path": draw(st.sampled_from(["/tmp/beam", "/m/x y"]))}},
            "kvHeads": 2,
        },
        "engine": {"name": engine},
        "kv": {"pageSize": 16 if engine == "ref" else 64},
    }
    if draw(st.booleans()):
        spec["model"]["contextLength"] = draw(st.sampled_from([2048, 8000]))
    roles = draw(st.sampled_from([("prefill", "decode"), ("both",)]))
    for role in roles:
        pool: dict[str, Any] = {"replicas": draw(st.integers(min_value=0, max_value=3))}
        if engine == "ref":
            pool["tp"] = draw(st.sampled_from([1, 2]))
        if draw(st.booleans()):
            names = ["http", "kvEvents", "kvReplay", "bootstrap", "sideChannel"]
            values = draw(st.lists(ports, min_size=5, max_size=5, unique=True))
            pool["ports"] = dict(zip(names, values, strict=True))
        spec[role] = pool
    if draw(st.booleans()):
        spec["router"] = {"port": draw(ports)}
    return spec


SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(local_specs())
def test_every_pod_is_one_process_and_the_router_comes_last(spec: dict[str, Any]) -> None:
    bd = _bd(spec)
    plan = local_plan(bd, STATE)
    deployments = {
        o["metadata"]["name"]: o["spec"]["replicas"]
        for o in desired_objects(bd)
        if o["kind"] == "Deployment" and o["metadata"]["labels"].get(LABEL_ROLE)
    }
    assert len(plan.workers) == sum(deployments.values())
    for pool, replicas in deployments.items():
        names = [p.name for p in plan.workers if p.pool == pool]
        assert names == [f"{pool}-{i}" for i in range(replicas)]
    assert plan.processes[-1] is plan.router
    assert plan.router.name == "beam-router"
    assert len({p.name for p in plan.processes}) == len(plan.processes)


@SETTINGS
@given(local_specs())
def test_every_worker_carries_its_pods_liveness_probe(spec: dict[str, Any]) -> None:
    bd = _bd(spec)
    plan = local_plan(bd, STATE)
    pods = {
        o["metadata"]["name"]: o["spec"]["template"]["spec"]["containers"][0]
        for o in desired_objects(bd)
        if o["kind"] == "Deployment" and o["metadata"]["labels"].get(LABEL_ROLE)
    }
    for w in plan.workers:
        probe = pods[w.pool]["livenessProbe"]
        assert w.liveness == Liveness(
            probe["httpGet"]["path"],
            probe["periodSeconds"],
            probe["timeoutSeconds"],
            probe["failureThreshold"],
        )


def test_liveness_of_reads_http_probes_with_kubernetes_defaults() -> None:
    assert liveness_of({"livenessProbe": {"httpGet": {"path": "/health"}}}) == Liveness(
        "/health", 10.0, 1.0, 3
    )
    assert liveness_of({"livenessProbe": {"tcpSocket": {"port": "http"}}}) is None
    assert liveness_of({}) is None


@SETTINGS
@given(local_specs(), st.integers(min_value=1024, max_value=60000))
def test_ports_are_distinct_loopback_and_the_argv_listens_on_them(
    spec: dict[str, Any], start: int
) -> None:
    plan = _ports(local_plan(_bd(spec), STATE), start)
    every = [port.host_port for p in plan.processes for port in p.ports]
    assert len(every) == len(set(every))
    for p in plan.processes:
        argv = p.argv
        assert _flag(argv, "--port") == str(p.port("http"))
        assert _flag(argv, "--host") == LOOPBACK
        assert "0.0.0.0" not in argv and not any("$(" in a for a in argv)
        assert not any(a.startswith("/models/") for a in argv)
        if p.is_worker:
            assert _flag(argv, "--advertise-host") == LOOPBACK
            assert _flag(argv, "--kv-events-endpoint") == f"tcp://{LOOPBACK}:{p.port('kv-events')}"
            assert _flag(argv, "--kv-replay-endpoint") == f"tcp://{LOOPBACK}:{p.port('kv-replay')}"
            assert _flag(argv, "--model") == spec["model"]["source"]["hostPath"]["path"]
            if p.component == "prefill":
                assert _flag(argv, "--handshake-port") == str(p.port("bootstrap"))
            if "contextLength" in spec["model"]:  # a number that is no port stays
                assert _flag(argv, "--max-model-len") == str(spec["model"]["contextLength"])


@SETTINGS
@given(local_specs())
def test_a_worker_runs_the_operators_pool_command(spec: dict[str, Any]) -> None:
    """Same command as the pod's container, up to the local rewrites (ports, host, paths)."""
    bd = _bd(spec)
    plan = _ports(local_plan(bd, STATE))
    for p in plan.workers:
        want = list(pool_command(bd.spec, p.component).argv)  # type: ignore[arg-type]
        got = list(p.argv)
        assert len(got) == len(want)
        differ = {w for w, g in zip(want, got, strict=True) if w != g}
        ports_of = {str(port.container_port) for port in p.ports}
        for w in differ:
            assert (
                w in ports_of
                or w in ("0.0.0.0", "$(POD_IP)", bd.spec.model.mount_path)
                or w.startswith("tcp://*:")
            ), w


@SETTINGS
@given(local_specs())
def test_the_endpoints_file_says_what_the_worker_services_say(spec: dict[str, Any]) -> None:
    bd = _bd(spec)
    plan = _ports(local_plan(bd, STATE))
    services = {
        o["metadata"]["name"]: o["metadata"]["labels"]
        for o in desired_objects(bd)
        if o["kind"] == "Service" and LABEL_ROLE in o["metadata"]["labels"]
    }
    entries = endpoint_specs(plan)
    endpoints = {e.id: e for e in parse_endpoint_specs(entries, "endpoints.json")}
    assert set(endpoints) == {p.name for p in plan.workers}
    for p in plan.workers:
        e, labels = endpoints[p.name], services[p.pool]
        assert (e.role, e.pool, e.revision, e.engine) == (
            labels[LABEL_ROLE],
            labels[LABEL_POOL],
            labels[LABEL_REVISION],
            labels[LABEL_ENGINE],
        )
        assert e.url == f"http://127.0.0.1:{p.port('http')}"
        assert e.kv_events == f"tcp://127.0.0.1:{p.port('kv-events')}"
    assert endpoint_specs(plan, ready=set()) == []


@SETTINGS
@given(local_specs(), st.integers(min_value=1024, max_value=60000))
def test_previous_ports_are_kept_and_never_handed_out_again(
    spec: dict[str, Any], start: int
) -> None:
    plan = _ports(local_plan(_bd(spec), STATE), start)
    again = assign_ports(local_plan(_bd(spec), STATE), itertools.count(start), plan.host_ports())
    assert again == plan
    # a new process (one more decode replica) gets a port no running process holds
    more = copy.deepcopy(spec)
    role = "decode" if "decode" in more else "both"
    more[role]["replicas"] += 1
    grown = assign_ports(local_plan(_bd(more), STATE), itertools.count(start), plan.host_ports())
    every = [port.host_port for p in grown.processes for port in p.ports]
    assert len(every) == len(set(every))
    assert set(plan.host_ports().items()) <= set(grown.host_ports().items())


def test_the_router_reads_the_endpoints_file_and_its_config_map(tmp_path: Path) -> None:
    bd = _bd(_sim(router={"port": 9000, "policy": "least-load"}))
    plan = _ports(local_plan(bd, tmp_path))
    r = plan.router
    assert r.argv[:2] == ("beamserve", "router")
    assert _flag(r.argv, "--local-runtime") == str(tmp_path / "endpoints.json")
    assert "--kubernetes" not in r.argv and "--namespace" not in r.argv
    assert _flag(r.argv, "--tokenizer") == "/data/beam-tiny"
    config = tmp_path / "router.yaml"
    assert _flag(r.argv, "--config") == str(config)
    config.write_text(r.files[str(config)])
    loaded = load_router_config(config)  # what the router will read: valid, no discovery
    assert loaded.discovery is None and loaded.policy == "least-load"
    assert _flag(r.argv, "--port") == str(r.port("http"))  # the flag overrides the file's 9000


def test_rewrite_ports_touches_listening_ports_only() -> None:
    argv = ("x", "--port", "8000", "--max-model-len", "8000", "--port=8000",
            "--kv-events-endpoint", "tcp://*:5557", "tcp://10.0.0.1:5557", "8000")  # fmt: skip
    assert rewrite_ports(argv, {8000: 1, 5557: 2}) == (
        "x", "--port", "1", "--max-model-len", "8000", "--port=1",
        "--kv-events-endpoint", "tcp://127.0.0.1:2", "tcp://10.0.0.1:5557", "8000",
    )  # fmt: skip


def test_map_path_takes_the_longest_mount_and_whole_components() -> None:
    mounts = {"/models/beam": "/tmp/beam-tiny", "/models": "/srv", "/tmp": "/state/tmp"}
    assert map_path("/models/beam", mounts) == "/tmp/beam-tiny"
    assert map_path("/models/beam/tokenizer.json", mounts) == "/tmp/beam-tiny/tokenizer.json"
    assert map_path("/models/beamish", mounts) == "/srv/beamish"
    assert map_path("/modelsx", mounts) == "/modelsx"


# -- rolls ------------------------------------------------------------------------------------


def _plan(spec: dict[str, Any]) -> LocalPlan:
    return local_plan(_bd(spec), STATE)


def test_same_spec_no_change() -> None:
    assert diff_plans(_plan(_sim()), _plan(_sim())).empty


def test_a_changed_pool_restarts_that_pool_only() -> None:
    old, new = _plan(_sim()), _plan(_sim(decode={"replicas": 2, "extraArgs": ["--speed", "2"]}))
    d = diff_plans(old, new)
    assert set(d.restart) == {p.name for p in new.workers if p.component == "decode"}
    assert not d.start and not d.stop
    assert set(d.keep) == {p.name for p in old.processes} - set(d.restart)


def test_replicas_start_and_stop_at_the_end_of_the_pool() -> None:
    three, one = _plan(_sim(decode={"replicas": 3})), _plan(_sim(decode={"replicas": 1}))
    grow = diff_plans(_plan(_sim()), three)
    assert len(grow.start) == 1 and grow.start[0].endswith("-2") and not grow.restart
    shrink = diff_plans(_plan(_sim()), one)
    assert len(shrink.stop) == 1 and shrink.stop[0].endswith("-1") and not shrink.restart


def test_a_kv_incompatible_change_is_a_new_revision_beside_the_router() -> None:
    old, new = _plan(_sim()), _plan(_sim(kv={"pageSize": 16}))
    d = diff_plans(old, new)
    assert set(d.stop) == {p.name for p in old.workers}
    assert set(d.start) == {p.name for p in new.workers}
    assert d.keep == ("beam-router",)


def test_a_router_change_restarts_the_router_only() -> None:
    d = diff_plans(_plan(_sim()), _plan(_sim(router={"policy": "least-load"})))
    assert d.restart == ("beam-router",) and not d.start and not d.stop


# -- what cannot run here ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"engine": {"name": "vllm", "image": "vllm/vllm-openai:v0.33.0"}}, "spec.engine.name"),
        ({"model": {"source": {"pvc": {"claimName": "beam"}}}}, "spec.model.source"),
        ({"decode": {"nodesPerReplica": 2}}, "spec.decode.nodesPerReplica"),
        ({"router": {"sessionStore": {"type": "redis"}}}, "spec.router.sessionStore.type"),
    ],
)
def test_what_the_local_runtime_refuses_names_the_field(over: dict[str, Any], field: str) -> None:
    with pytest.raises(LocalPlanError, match=field.replace(".", r"\.")) as exc:
        local_plan(_bd(_sim(**over)), STATE)
    assert ";" in str(exc.value)  # … and the fix


@pytest.mark.parametrize("name", ["local-sim.yaml", "local-ref.yaml"])
def test_the_local_examples_plan(name: str) -> None:
    doc = yaml.safe_load((REPO / "manifests" / "examples" / name).read_text())
    plan = _ports(local_plan(parse_deployment(doc), STATE))
    roles = sorted(p.component for p in plan.workers)
    assert roles == (["decode", "decode", "prefill"] if name == "local-sim.yaml" else
                     ["decode", "prefill"])  # fmt: skip
    if name == "local-ref.yaml":  # one KV shard set per TP rank, as the ref engine serves it
        tps = {p.component: _flag(p.argv, "--tp") for p in plan.workers}
        assert tps == {"prefill": "2", "decode": "1"}


# -- status (the scrape's parsing) ------------------------------------------------------------


def test_status_reads_worker_and_router_metrics() -> None:
    from beamserve.operator.local.status import parse_metrics, router_stats, worker_stats

    worker = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="beam",engine="0"} 2.0
vllm:num_requests_waiting{model_name="beam",engine="0"} 1.0
vllm:kv_cache_usage_perc{model_name="beam",engine="0"} 0.25
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{model_name="beam",engine="0"} 400.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{model_name="beam",engine="0"} 100.0
# TYPE beamserve_worker_kv_transfers counter
beamserve_worker_kv_transfers_total 3.0
# TYPE beamserve_worker_kv_transfer_bytes counter
beamserve_worker_kv_transfer_bytes_total 1.5e6
"""
    w = worker_stats(parse_metrics(worker))
    assert (w.running, w.waiting, w.kv_usage, w.cache_hit_rate) == (2, 1, 0.25, 0.25)
    assert (w.kv_transfers, w.kv_bytes_in) == (3, 1.5e6)
    sglang = "sglang:num_running_reqs 1.0\nsglang:cache_hit_rate 0.5\nsglang:token_usage 0.1\n"
    s = worker_stats(parse_metrics(sglang))
    assert (s.running, s.cache_hit_rate, s.kv_usage) == (1, 0.5, 0.1)
    router = """# TYPE beamserve_router_requests counter
beamserve_router_requests_total{api="chat",status="200"} 4.0
beamserve_router_requests_total{api="messages",status="200"} 1.0
# TYPE beamserve_router_decisions counter
beamserve_router_decisions_total{reason="sticky"} 3.0
beamserve_router_decisions_total{reason="load"} 2.0
# TYPE beamserve_router_prefix_hits counter
beamserve_router_prefix_hits_total{kind="full"} 3.0
beamserve_router_prefix_hits_total{kind="none"} 2.0
# TYPE beamserve_router_disaggregated counter
beamserve_router_disaggregated_total 2.0
"""
    r = router_stats(router)
    assert (r.requests, r.disaggregated) == (5, 2)
    assert r.decisions == {"sticky": 3, "load": 2} and r.hits == {"full": 3, "none": 2}


def test_load_spec_takes_a_file_or_a_model_and_validates(tmp_path: Path) -> None:
    from beamserve.operator.local.stack import SpecError, load_spec

    path = REPO / "manifests" / "examples" / "local-sim.yaml"
    bd = load_spec(path)
    assert load_spec(bd) == bd  # a BeamDeployment (what `bench agentic --target` may pass)
    bad = tmp_path / "bad.yaml"
    doc = yaml.safe_load(path.read_text())
    doc["spec"]["decode"]["replicas"] = -1
    bad.write_text(yaml.safe_dump(doc))
    with pytest.raises(SpecError, match=r"bad\.yaml#1 local-sim: spec\.decode\.replicas"):
        load_spec(bad)
    two = tmp_path / "two.yaml"
    two.write_text(path.read_text() + "\n---\n" + path.read_text())
    with pytest.raises(SpecError, match="exactly one per file"):
        load_spec(two)


def test_restart_backoff_doubles_to_its_cap() -> None:
    from beamserve.operator.local.stack import Backoff

    b = Backoff(base_s=1.0, max_s=30.0)
    assert [b.delay(n) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]
