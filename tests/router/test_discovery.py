"""Discovery: static config, the local runtime file, and the Services × EndpointSlices mapping."""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path
from typing import Any

import pytest
from beamserve.router.discovery import (
    DiscoveryConfigError,
    KubeAccess,
    LocalRuntimeDiscovery,
    StaticDiscovery,
    endpoints_from,
    parse_endpoint_specs,
    write_local_endpoints,
)
from beamserve.router.types import Endpoint
from hypothesis import given, settings
from hypothesis import strategies as st

# -- specs and static ---------------------------------------------------------------------------


def test_spec_parsing_fills_defaults_and_kv_ports() -> None:
    (ep,) = parse_endpoint_specs(
        [{"url": "http://10.0.0.7:8000", "role": "decode", "kv_events": 5557, "labels": {"z": "a"}}]
    )
    assert ep == Endpoint(
        id="10.0.0.7:8000",
        url="http://10.0.0.7:8000",
        role="decode",
        kv_events="tcp://10.0.0.7:5557",
        labels=(("z", "a"),),
    )
    (v6,) = parse_endpoint_specs([{"url": "http://[fd00::1]:81", "kv_replay": "tcp://h:9"}])
    assert v6.id == "[fd00::1]:81" and v6.kv_replay == "tcp://h:9"


@pytest.mark.parametrize(
    ("specs", "needle"),
    [
        ([{"url": "http://h:1", "rol": "decode"}], "unknown key 'rol'; valid keys: engine, id"),
        ([{"url": "http://h:1", "role": "decoder"}], "[0]: role"),
        ([{"url": "h:1"}], "http(s)://host:port"),
        ([{"url": "http://h"}], "port included"),
        # the KV geometry is the worker's to report, not discovery's
        ([{"url": "http://h:1", "block_size": 64}], "unknown key 'block_size'"),
        ([{"url": "http://h:1", "kv_events": 70000}], "out of range"),
        ({"url": "http://h:1"}, "expected a list"),
        (["http://h:1"], "expected an object"),
    ],
)
def test_spec_errors_name_the_problem(specs: Any, needle: str) -> None:
    with pytest.raises(DiscoveryConfigError) as err:
        parse_endpoint_specs(specs, "cfg")
    assert needle in str(err.value)


def test_static_discovery_publishes_and_notifies() -> None:
    async def main() -> None:
        d = StaticDiscovery.from_config(
            [{"url": "http://b:1", "id": "b"}, {"url": "http://a:1", "id": "a"}]
        )
        seen: list[list[str]] = []
        d.on_change(lambda eps: seen.append([e.id for e in eps]))
        async with d:
            await d.wait_synced(5)
            assert [e.id for e in d.endpoints] == ["a", "b"]
            changes = d.changes()
            assert [e.id for e in await anext(changes)] == ["a", "b"]
            d.set([Endpoint(id="c", url="http://c:1")])
            assert [e.id for e in await asyncio.wait_for(anext(changes), 5)] == ["c"]
            d.set([Endpoint(id="c", url="http://c:1")])  # no change, no notification
        assert seen == [["a", "b"], ["c"]]

    asyncio.run(main())


# -- local runtime file -------------------------------------------------------------------------


def test_local_runtime_file_round_trip_and_reload(tmp_path: Path) -> None:
    path = tmp_path / "run" / "endpoints.json"
    first = [
        Endpoint(id="prefill-0", url="http://127.0.0.1:8100", role="prefill", revision="r1"),
        Endpoint(
            id="decode-0",
            url="http://127.0.0.1:8200",
            role="decode",
            kv_events="tcp://127.0.0.1:5557",
            labels=(("gpu", "h200"),),
        ),
    ]

    async def main() -> None:
        d = LocalRuntimeDiscovery(path, poll_interval_s=0.02)
        async with d:
            changes = d.changes()
            assert await asyncio.wait_for(anext(changes), 5) == []  # no file yet
            write_local_endpoints(path, first)
            got = await asyncio.wait_for(anext(changes), 5)
            assert got == sorted(first, key=lambda e: e.id)
            path.write_text("[{")  # a broken write keeps the last good list
            await asyncio.sleep(0.1)
            assert d.endpoints == got
            write_local_endpoints(path, first[:1])
            assert await asyncio.wait_for(anext(changes), 5) == first[:1]
            path.unlink()
            assert await asyncio.wait_for(anext(changes), 5) == []

    asyncio.run(main())
    assert not list((tmp_path / "run").glob(".endpoints.json.*"))  # no temporary files left


def test_local_runtime_file_format_is_a_list_of_specs(tmp_path: Path) -> None:
    path = tmp_path / "e.json"
    write_local_endpoints(path, [Endpoint(id="w", url="http://h:9", engine="ref")])
    data = json.loads(path.read_text())
    assert isinstance(data, list) and data[0]["url"] == "http://h:9"
    assert parse_endpoint_specs(data) == [Endpoint(id="w", url="http://h:9", engine="ref")]


# -- Kubernetes objects -> endpoints ------------------------------------------------------------


def service(
    name: str,
    labels: dict[str, str] | None = None,
    ports: tuple[str, ...] = ("http", "kv-events"),
    namespace: str = "ns",
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"beamserve.io/deployment": "beam", **(labels or {})},
            "annotations": annotations or {},
        },
        "spec": {"ports": [{"name": p, "port": 8000 + i} for i, p in enumerate(ports)]},
    }


def endpoint_slice(
    svc: str,
    endpoints: list[dict[str, Any]],
    *,
    name: str | None = None,
    ports: dict[str, int] | None = None,
    address_type: str = "IPv4",
    namespace: str = "ns",
) -> dict[str, Any]:
    ports = {"http": 8000, "kv-events": 5557} if ports is None else ports
    return {
        "metadata": {
            "name": name or f"{svc}-abc",
            "namespace": namespace,
            "labels": {"kubernetes.io/service-name": svc},
        },
        "addressType": address_type,
        "endpoints": endpoints,
        "ports": [{"name": n, "port": p, "protocol": "TCP"} for n, p in ports.items()],
    }


def ep(
    address: str, ready: bool | None = True, pod: str | None = None, **extra: Any
) -> dict[str, Any]:
    out: dict[str, Any] = {"addresses": [address], "conditions": {}, **extra}
    if ready is not None:
        out["conditions"]["ready"] = ready
    if pod:
        out["targetRef"] = {"kind": "Pod", "name": pod, "namespace": "ns"}
    return out


def test_endpoints_from_maps_labels_ports_and_readiness() -> None:
    svcs = [
        service(
            "beam-decode",
            {
                "beamserve.io/role": "decode",
                "beamserve.io/pool": "main",
                "beamserve.io/revision": "r7",
                "beamserve.io/engine": "vllm",
            },
            annotations={"beamserve.io/kv-layout": "nhd-bf16"},
        )
    ]
    slices = [
        endpoint_slice(
            "beam-decode",
            [
                ep("10.0.0.1", pod="dec-0", nodeName="node-a", zone="z1"),
                ep("10.0.0.2", ready=False, pod="dec-1"),
                ep("10.0.0.3", ready=None),  # unknown: the API says treat as ready
                {**ep("10.0.0.4", pod="dec-3"), "conditions": {"ready": True, "terminating": True}},
            ],
        ),
        endpoint_slice("unrelated", [ep("10.9.9.9")]),
    ]
    eps = endpoints_from(svcs, slices)
    assert [e.id for e in eps] == ["10.0.0.3:8000", "dec-0"]
    dec0 = eps[1]
    assert dec0.url == "http://10.0.0.1:8000"
    assert dec0.kv_events == "tcp://10.0.0.1:5557" and dec0.kv_replay is None
    assert (dec0.role, dec0.pool, dec0.revision, dec0.engine) == ("decode", "main", "r7", "vllm")
    assert (dec0.kv_layout, dec0.geometry) == ("nhd-bf16", None)
    labels = dict(dec0.labels)
    assert labels["kubernetes.io/service-name"] == "beam-decode"
    assert labels["kubernetes.io/hostname"] == "node-a"
    assert labels["topology.kubernetes.io/zone"] == "z1"


def test_endpoints_from_v1beta1_ipv6_and_skips() -> None:
    svcs = [
        service("p", {"beamserve.io/role": "prefill"}),
        service("bad-role", {"beamserve.io/role": "verifier"}),
        service("no-http", ports=("metrics",)),
        service("other-ns", namespace="elsewhere"),
    ]
    slices = [
        endpoint_slice(
            "p",
            [ep("fd00::7", pod="pre-0", topology={"kubernetes.io/hostname": "n1"})],
            address_type="IPv6",
            ports={"http": 8100, "kv-replay": 5558},
        ),
        endpoint_slice("bad-role", [ep("10.0.0.5")]),
        endpoint_slice("no-http", [ep("10.0.0.6")]),
        endpoint_slice("other-ns", [ep("10.0.0.8")]),  # slice in ns, service elsewhere
    ]
    (pre,) = endpoints_from(svcs, slices)
    assert pre.url == "http://[fd00::7]:8100" and pre.kv_replay == "tcp://[fd00::7]:5558"
    assert pre.role == "prefill" and dict(pre.labels)["kubernetes.io/hostname"] == "n1"


def test_one_pod_in_two_services_gets_distinct_ids() -> None:
    svcs = [service("a", {"beamserve.io/pool": "x"}), service("b", {"beamserve.io/pool": "y"})]
    slices = [
        endpoint_slice("a", [ep("10.0.0.1", pod="w")]),
        endpoint_slice("b", [ep("10.0.0.1", pod="w")]),
    ]
    assert [(e.id, e.pool) for e in endpoints_from(svcs, slices)] == [("w@a", "x"), ("w@b", "y")]


ROLES = ("prefill", "decode", "both")
ENGINES = ("vllm", "sglang", "sim", "ref")


@st.composite
def cluster(draw: st.DrawFn) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    n_svc = draw(st.integers(1, 3))
    svcs, slices = [], []
    for s in range(n_svc):
        labels = {
            "beamserve.io/role": draw(st.sampled_from(ROLES)),
            "beamserve.io/pool": draw(st.sampled_from(["default", "main", "long"])),
            "beamserve.io/revision": draw(st.sampled_from(["", "r1", "r2"])),
            "beamserve.io/engine": draw(st.sampled_from(ENGINES)),
        }
        svcs.append(service(f"svc{s}", labels))
        for k in range(draw(st.integers(0, 3))):
            eps = [
                ep(
                    f"10.0.{draw(st.integers(0, 3))}.{draw(st.integers(1, 6))}",
                    ready=draw(st.sampled_from([True, False, None])),
                    pod=draw(st.sampled_from([None, "p1", "p2", "p3", "p4"])),
                )
                for _ in range(draw(st.integers(0, 5)))
            ]
            slices.append(endpoint_slice(f"svc{s}", eps, name=f"svc{s}-{k}"))
    return svcs, slices


@settings(max_examples=150, deadline=None)
@given(cluster())
def test_endpoints_from_properties(
    objs: tuple[list[dict[str, Any]], list[dict[str, Any]]],
) -> None:
    svcs, slices = objs
    eps = endpoints_from(svcs, slices)

    # The oracle: (service, address) pairs with at least one ready (or unknown) occurrence.
    expected: set[tuple[str, str]] = set()
    for sl in slices:
        for e in sl["endpoints"]:
            if e["conditions"].get("ready", True) is not False:
                expected.add(
                    (sl["metadata"]["labels"]["kubernetes.io/service-name"], e["addresses"][0])
                )
    got = {
        (dict(e.labels)["kubernetes.io/service-name"], e.url.split("//")[1].split(":")[0])
        for e in eps
    }
    assert got == expected
    assert len(eps) == len(expected)  # one per ready address x service
    assert len({e.id for e in eps}) == len(eps)  # ids unique
    assert [e.id for e in eps] == sorted(e.id for e in eps)
    labels_of = {s["metadata"]["name"]: s["metadata"]["labels"] for s in svcs}
    for e in eps:
        svc_labels = labels_of[dict(e.labels)["kubernetes.io/service-name"]]
        assert e.role == svc_labels["beamserve.io/role"]
        assert e.pool == svc_labels["beamserve.io/pool"]
        assert e.revision == svc_labels["beamserve.io/revision"]
        assert e.engine == svc_labels["beamserve.io/engine"]
        assert set(svc_labels.items()) <= set(e.labels)


# -- API access config --------------------------------------------------------------------------


def _bearer(access: KubeAccess) -> str | None:
    """The Authorization header the `kubernetes` client will send."""
    auth = access.configuration.auth_settings().get("BearerToken")
    return None if auth is None else str(auth["value"])


def test_kubeconfig_token_insecure_and_namespace(tmp_path: Path) -> None:
    (tmp_path / "keys").mkdir()
    (tmp_path / "keys" / "client.key").write_text("KEY")
    cfg = tmp_path / "kubeconfig"
    cfg.write_text(
        """
apiVersion: v1
kind: Config
current-context: test
clusters:
- name: local
  cluster: {{server: "https://127.0.0.1:6443/", insecure-skip-tls-verify: true}}
contexts:
- name: test
  context: {{cluster: local, user: admin, namespace: beam}}
- name: other
  context: {{cluster: local, user: certs}}
users:
- name: admin
  user: {{token: s3cret}}
- name: certs
  user:
    client-certificate-data: {}
    client-key: keys/client.key
""".format(base64.b64encode(b"CERT").decode())
    )
    access = KubeAccess.from_kubeconfig(cfg)
    assert access.server == "https://127.0.0.1:6443"
    assert _bearer(access) == "Bearer s3cret" and access.insecure and access.namespace == "beam"
    other = KubeAccess.from_kubeconfig(cfg, context="other")
    assert Path(other.configuration.cert_file).read_bytes() == b"CERT"  # data → a file
    assert Path(other.configuration.key_file) == tmp_path / "keys" / "client.key"  # relative
    assert other.namespace == "default" and _bearer(other) is None
    with pytest.raises(DiscoveryConfigError, match="no context named 'nope'; have: other, test"):
        KubeAccess.from_kubeconfig(cfg, context="nope")
    with pytest.raises(DiscoveryConfigError, match="no such kubeconfig file"):
        KubeAccess.from_kubeconfig(tmp_path / "missing")


def test_kubeconfig_exec_users_run_their_plugin(tmp_path: Path) -> None:
    """Exec credential plugins (EKS, GKE, OIDC helpers) run as kubectl runs them: the
    `kubernetes` package's loader starts the command and sends the token it prints."""
    plugin = tmp_path / "plugin.sh"
    credential = {
        "apiVersion": "client.authentication.k8s.io/v1beta1",
        "kind": "ExecCredential",
        "status": {"token": "from-plugin"},
    }
    plugin.write_text(f"#!/bin/sh\necho '{json.dumps(credential)}'\n")
    plugin.chmod(0o755)
    cfg = tmp_path / "kc.json"  # JSON is YAML too
    exec_user = {
        "apiVersion": "client.authentication.k8s.io/v1beta1",
        "command": str(plugin),
        "interactiveMode": "Never",
    }
    cfg.write_text(
        json.dumps(
            {
                "current-context": "c",
                "clusters": [{"name": "k", "cluster": {"server": "https://k:443"}}],
                "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
                "users": [{"name": "u", "user": {"exec": exec_user}}],
            }
        )
    )
    assert _bearer(KubeAccess.from_kubeconfig(cfg)) == "Bearer from-plugin"


def test_in_cluster_reads_service_account_files(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("tok")
    (tmp_path / "ca.crt").write_text("CA")
    (tmp_path / "namespace").write_text("beam-system")
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    access = KubeAccess.in_cluster(tmp_path, env)
    assert access.server == "https://10.96.0.1:443"
    assert _bearer(access) == "bearer tok" and access.namespace == "beam-system"
    assert access.configuration.ssl_ca_cert == str(tmp_path / "ca.crt")
    # projected tokens rotate: the client re-reads the file (each minute) through this hook
    assert access.configuration.refresh_api_key_hook is not None
    with pytest.raises(DiscoveryConfigError, match="kubeconfig"):
        KubeAccess.in_cluster(tmp_path, {})
    (tmp_path / "ca.crt").unlink()
    with pytest.raises(DiscoveryConfigError, match="automountServiceAccountToken"):
        KubeAccess.in_cluster(tmp_path, env)
