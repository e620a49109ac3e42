"""KubernetesDiscovery against a real kube-apiserver 1.20.2 (`make test-k8s`).

The test-side writes go through the API with httpx and the admin token: a namespace per test,
Services (no selector, so no controller would manage their slices) carrying the beamserve labels
and named ports, and `discovery.k8s.io/v1beta1` EndpointSlices (1.20 serves no v1). Discovery
reads with `KubeAccess.from_kubeconfig(path)`. Covered: the initial sync and its mapping, watch
updates (new and not-ready addresses, added and deleted slices, a Service deleted or relabelled
away, another deployment's objects, server-side watch timeouts), the RBAC the module docstring
asks for, and an API server crash while etcd changes behind it (dropped watches, then 410 Gone
on a compacted store, then a re-list).
"""

from __future__ import annotations

import asyncio
import importlib.util
import re
import secrets
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from beamserve.router.discovery import KubeAccess, KubernetesDiscovery, WatchSettings
from beamserve.router.types import Endpoint

_path = Path(__file__).resolve().parents[1] / "k8s_cluster.py"
_spec = importlib.util.spec_from_file_location("k8s_cluster", _path)
assert _spec is not None and _spec.loader is not None
_kc = sys.modules.setdefault("k8s_cluster", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(_kc)
KubeCluster = _kc.KubeCluster
kube_cluster = _kc.kube_cluster  # the fixture

# The session's first test also waits for the cluster to start (≈ 20 s, more on a busy machine).
pytestmark = [pytest.mark.k8s, pytest.mark.timeout(240)]

SLICES = "/apis/discovery.k8s.io/v1beta1/namespaces/{ns}/endpointslices"
SERVICES = "/api/v1/namespaces/{ns}/services"
FAST = WatchSettings(watch_timeout_s=30, backoff_initial_s=0.05, backoff_max_s=0.5)
STEP_S = 20.0  # the longest any single expected change may take to show up


class Api:
    """The test's own writes to the API server (admin token), each bounded by a timeout."""

    def __init__(self, cluster: Any) -> None:
        self.client = httpx.AsyncClient(
            base_url=cluster.server,
            headers={"Authorization": f"Bearer {cluster.token}"},
            verify=False,
            timeout=15,
        )

    async def __aenter__(self) -> Api:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.aclose()

    async def create(self, path: str, obj: dict[str, Any]) -> dict[str, Any]:
        resp = await self.client.post(path, json=obj)
        assert resp.status_code == 201, resp.text
        body: dict[str, Any] = resp.json()
        return body

    async def patch(self, path: str, patch: dict[str, Any]) -> None:
        headers = {"Content-Type": "application/merge-patch+json"}
        resp = await self.client.patch(path, json=patch, headers=headers)
        assert resp.status_code == 200, resp.text

    async def delete(self, path: str) -> None:
        resp = await self.client.delete(path)
        assert resp.status_code in (200, 202), resp.text

    async def namespace(self) -> str:
        name = f"beam-{secrets.token_hex(4)}"
        await self.create("/api/v1/namespaces", {"metadata": {"name": name}})
        return name

    async def service(self, ns: str, name: str, **kw: Any) -> None:
        await self.create(SERVICES.format(ns=ns), service(name, **kw))

    async def endpoint_slice(self, ns: str, name: str, svc: str, *eps: Any, **kw: Any) -> None:
        await self.create(SLICES.format(ns=ns), endpoint_slice(ns, name, svc, *eps, **kw))

    async def set_endpoints(self, ns: str, name: str, *eps: Any) -> None:
        """Replace a slice's endpoints (a merge patch replaces lists whole)."""
        patch = {"endpoints": [slice_endpoint(ns, *ep) for ep in eps]}
        await self.patch(f"{SLICES.format(ns=ns)}/{name}", patch)


def service(
    name: str,
    *,
    deployment: str = "beam",
    ports: tuple[str, ...] = ("http", "kv-events", "kv-replay"),
    annotations: dict[str, str] | None = None,
    **labels: str,
) -> dict[str, Any]:
    """A Service without selector; `labels` are `beamserve.io/<key>` values (role, pool, …)."""
    numbers = {"http": 80, "kv-events": 5557, "kv-replay": 5558, "metrics": 9090}
    return {
        "metadata": {
            "name": name,
            "labels": {
                "beamserve.io/deployment": deployment,
                **{f"beamserve.io/{k}": v for k, v in labels.items()},
            },
            "annotations": annotations or {},
        },
        "spec": {"ports": [{"name": p, "port": numbers[p], "protocol": "TCP"} for p in ports]},
    }


SliceEndpoint = tuple[str, bool | None, str | None]  # (address, ready, pod name)


def slice_endpoint(ns: str, address: str, ready: bool | None, pod: str | None) -> dict[str, Any]:
    ep: dict[str, Any] = {
        "addresses": [address],
        "conditions": {} if ready is None else {"ready": ready},
        "topology": {"topology.kubernetes.io/zone": "zone-a"},
    }
    if pod is not None:
        ep["targetRef"] = {"kind": "Pod", "name": pod, "namespace": ns}
    return ep


def endpoint_slice(
    ns: str,
    name: str,
    svc: str,
    *eps: SliceEndpoint,
    ports: tuple[str, ...] = ("http", "kv-events", "kv-replay"),
) -> dict[str, Any]:
    numbers = {"http": 8000, "kv-events": 5557, "kv-replay": 5558, "metrics": 9090}
    return {
        "apiVersion": "discovery.k8s.io/v1beta1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "labels": {"kubernetes.io/service-name": svc}},
        "addressType": "IPv4",
        "endpoints": [slice_endpoint(ns, *ep) for ep in eps],
        "ports": [{"name": p, "port": numbers[p], "protocol": "TCP"} for p in ports],
    }


def discovery(kubeconfig: Path, ns: str, settings: WatchSettings = FAST) -> KubernetesDiscovery:
    return KubernetesDiscovery(
        "beam", KubeAccess.from_kubeconfig(kubeconfig), namespace=ns, settings=settings
    )


async def next_where(
    changes: AsyncIterator[list[Endpoint]],
    want: Callable[[list[Endpoint]], bool],
    timeout: float = STEP_S,
) -> list[Endpoint]:
    """The first published list satisfying `want` (lists may coalesce), within `timeout`."""

    async def scan() -> list[Endpoint]:
        async for eps in changes:
            if want(eps):
                return eps
        raise AssertionError("changes ended")

    return await asyncio.wait_for(scan(), timeout)


def ids(eps: list[Endpoint]) -> list[str]:
    return [e.id for e in eps]


def test_initial_sync_maps_services_and_ready_addresses(kube_cluster: Any) -> None:
    async def scenario() -> None:
        async with Api(kube_cluster) as api:
            ns = await api.namespace()
            await api.service(
                ns,
                "beam-decode",
                role="decode",
                pool="main",
                revision="r7",
                engine="vllm",
                annotations={"beamserve.io/kv-layout": "hma-v1"},
            )
            await api.service(
                ns, "beam-prefill", role="prefill", revision="r7", engine="sglang", ports=("http",)
            )
            await api.service(ns, "beam-metrics", ports=("metrics",))  # no `http`: skipped
            await api.service(ns, "other-decode", deployment="other", role="decode")
            await api.endpoint_slice(
                ns,
                "beam-decode-a",
                "beam-decode",
                ("10.0.0.1", True, "decode-0"),
                ("10.0.0.2", False, "decode-1"),
                ("10.0.0.3", None, "decode-2"),  # unset: ready by the API's definition
            )
            await api.endpoint_slice(ns, "beam-decode-b", "beam-decode", ("10.0.0.4", True, None))
            await api.endpoint_slice(
                ns,
                "beam-prefill-a",
                "beam-prefill",
                ("10.0.1.1", True, "prefill-0"),
                ports=("http",),
            )
            await api.endpoint_slice(ns, "beam-metrics-a", "beam-metrics", ("10.0.2.1", True, "m"))
            await api.endpoint_slice(ns, "other-a", "other-decode", ("10.0.9.1", True, "o-0"))
            await api.endpoint_slice(ns, "ghost-a", "ghost", ("10.0.9.2", True, "g-0"))

            disco = discovery(kube_cluster.kubeconfig, ns)
            async with disco:
                await disco.wait_synced(STEP_S)
                eps = disco.endpoints
            assert disco.slice_version == "v1beta1"  # 1.20 serves no discovery.k8s.io/v1

        decode_labels = {
            "beamserve.io/deployment": "beam",
            "beamserve.io/engine": "vllm",
            "beamserve.io/pool": "main",
            "beamserve.io/revision": "r7",
            "beamserve.io/role": "decode",
            "kubernetes.io/service-name": "beam-decode",
            "topology.kubernetes.io/zone": "zone-a",
        }

        def decode(id_: str, ip: str) -> Endpoint:
            return Endpoint(
                id=id_,
                url=f"http://{ip}:8000",
                role="decode",
                pool="main",
                revision="r7",
                engine="vllm",
                kv_events=f"tcp://{ip}:5557",
                kv_replay=f"tcp://{ip}:5558",
                kv_layout="hma-v1",
                labels=tuple(sorted(decode_labels.items())),
            )

        prefill_labels = {
            "beamserve.io/deployment": "beam",
            "beamserve.io/engine": "sglang",
            "beamserve.io/revision": "r7",
            "beamserve.io/role": "prefill",
            "kubernetes.io/service-name": "beam-prefill",
            "topology.kubernetes.io/zone": "zone-a",
        }
        assert eps == [
            decode("10.0.0.4:8000", "10.0.0.4"),  # no targetRef: host:port
            decode("decode-0", "10.0.0.1"),
            decode("decode-2", "10.0.0.3"),
            Endpoint(
                id="prefill-0",
                url="http://10.0.1.1:8000",
                role="prefill",
                pool="default",
                revision="r7",
                engine="sglang",
                labels=tuple(sorted(prefill_labels.items())),
            ),
        ]

    asyncio.run(scenario())


def test_watch_follows_addresses_slices_and_services(kube_cluster: Any) -> None:
    # Server-side watch timeouts of 2 s: the watches are renewed (from their resourceVersion)
    # several times during the test, and no change may be lost across a renewal.
    settings = WatchSettings(watch_timeout_s=2, backoff_initial_s=0.05, backoff_max_s=0.5)

    async def scenario() -> None:
        async with Api(kube_cluster) as api:
            ns = await api.namespace()
            await api.service(ns, "beam-decode", role="decode")
            await api.endpoint_slice(ns, "dec-a", "beam-decode", ("10.0.0.1", True, "d-0"))
            disco = discovery(kube_cluster.kubeconfig, ns, settings)
            async with disco:
                await disco.wait_synced(STEP_S)
                assert ids(disco.endpoints) == ["d-0"]
                changes = disco.changes()

                # a new ready address, then one turning not ready
                await api.set_endpoints(
                    ns, "dec-a", ("10.0.0.1", True, "d-0"), ("10.0.0.2", True, "d-1")
                )
                await next_where(changes, lambda e: ids(e) == ["d-0", "d-1"])
                await api.set_endpoints(
                    ns, "dec-a", ("10.0.0.1", False, "d-0"), ("10.0.0.2", True, "d-1")
                )
                eps = await next_where(changes, lambda e: ids(e) == ["d-1"])
                assert eps[0].url == "http://10.0.0.2:8000"

                # across renewed watches: a second slice for the Service, and a Service of
                # another deployment with a ready slice (ignored)
                await asyncio.sleep(settings.watch_timeout_s * 1.5)
                await api.service(ns, "other-decode", deployment="other", role="decode")
                await api.endpoint_slice(ns, "other-a", "other-decode", ("10.0.9.1", True, "o-0"))
                await api.endpoint_slice(ns, "dec-b", "beam-decode", ("10.0.0.3", True, "d-2"))
                await next_where(changes, lambda e: ids(e) == ["d-1", "d-2"])

                # a new Service of this deployment, and its slice
                await api.service(ns, "beam-prefill", role="prefill")
                await api.endpoint_slice(ns, "pre-a", "beam-prefill", ("10.0.1.1", True, "p-0"))
                eps = await next_where(changes, lambda e: ids(e) == ["d-1", "d-2", "p-0"])
                assert [e.role for e in eps] == ["decode", "decode", "prefill"]

                # deleting a slice removes its addresses
                await api.delete(f"{SLICES.format(ns=ns)}/dec-a")
                await next_where(changes, lambda e: ids(e) == ["d-2", "p-0"])

                # a Service relabelled to another deployment leaves the selected set (the watch
                # reports it as DELETED); deleting a Service removes it while its slice remains
                await api.patch(
                    f"{SERVICES.format(ns=ns)}/beam-prefill",
                    {"metadata": {"labels": {"beamserve.io/deployment": "other"}}},
                )
                await next_where(changes, lambda e: ids(e) == ["d-2"])
                await api.delete(f"{SERVICES.format(ns=ns)}/beam-decode")
                await next_where(changes, lambda e: e == [])
                assert disco.endpoints == []

                # the other deployment's Service coming back as ours shows its endpoints
                await api.patch(
                    f"{SERVICES.format(ns=ns)}/other-decode",
                    {"metadata": {"labels": {"beamserve.io/deployment": "beam"}}},
                )
                await next_where(changes, lambda e: ids(e) == ["o-0"])

    asyncio.run(scenario())


def test_needs_list_and_watch_on_services_and_endpointslices(kube_cluster: Any) -> None:
    """The RBAC the module docstring names is enough, and both resources are needed."""

    async def scenario() -> None:
        async with Api(kube_cluster) as api:
            ns = await api.namespace()
            await api.service(ns, "beam-decode", role="decode")
            await api.endpoint_slice(ns, "dec-a", "beam-decode", ("10.0.0.1", True, "d-0"))
            disco = discovery(kube_cluster.write_kubeconfig("router"), ns)
            role_path = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles"
            services_rule = {
                "apiGroups": [""],
                "resources": ["services"],
                "verbs": ["list", "watch"],
            }
            slices_rule = {
                "apiGroups": ["discovery.k8s.io"],
                "resources": ["endpointslices"],
                "verbs": ["list", "watch"],
            }
            async with disco:
                with pytest.raises(TimeoutError):  # no permissions: 403, retried
                    await disco.wait_synced(1.5)
                await api.create(
                    role_path, {"metadata": {"name": "router"}, "rules": [services_rule]}
                )
                await api.create(
                    f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings",
                    {
                        "metadata": {"name": "router"},
                        "roleRef": {
                            "apiGroup": "rbac.authorization.k8s.io",
                            "kind": "Role",
                            "name": "router",
                        },
                        "subjects": [
                            {
                                "apiGroup": "rbac.authorization.k8s.io",
                                "kind": "User",
                                "name": "router",
                            }
                        ],
                    },
                )
                with pytest.raises(TimeoutError):  # services only: still no EndpointSlices
                    await disco.wait_synced(2.0)
                await api.patch(f"{role_path}/router", {"rules": [services_rule, slices_rule]})
                await disco.wait_synced(STEP_S)
                assert ids(disco.endpoints) == ["d-0"]

    asyncio.run(scenario())


def test_kubeconfig_with_certificate_authority_verifies_the_server(
    kube_cluster: Any, tmp_path: Path
) -> None:
    """`certificate-authority-data` is trusted (and only it): the server's own CA syncs, a
    stranger's CA never does (TLS failures are retried, not fatal)."""
    stranger = tmp_path / "stranger.crt"
    make_cert = ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
    subprocess.run(
        [
            *make_cert,
            "-subj",
            "/CN=stranger",
            "-keyout",
            str(tmp_path / "k"),
            "-out",
            str(stranger),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    trusted = kube_cluster.write_kubeconfig(path=tmp_path / "ok", ca=kube_cluster.ca_file)
    untrusted = kube_cluster.write_kubeconfig(path=tmp_path / "bad", ca=stranger)

    async def scenario() -> None:
        async with Api(kube_cluster) as api:
            ns = await api.namespace()
            await api.service(ns, "beam-decode", role="decode")
            await api.endpoint_slice(ns, "dec-a", "beam-decode", ("10.0.0.1", True, "d-0"))
        assert not KubeAccess.from_kubeconfig(trusted).insecure
        async with discovery(trusted, ns) as good, discovery(untrusted, ns) as bad:
            await good.wait_synced(STEP_S)
            assert ids(good.endpoints) == ["d-0"]
            with pytest.raises(TimeoutError):
                await bad.wait_synced(1.0)

    asyncio.run(scenario())


def list_requests(metrics: str, resource: str) -> float:
    """Sum of `apiserver_request_total` LIST requests on `resource` since the server started."""
    total = 0.0
    for line in metrics.splitlines():
        if (
            line.startswith("apiserver_request_total{")
            and 'verb="LIST"' in line
            and f'resource="{resource}"' in line
        ):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_watch_survives_apiserver_crash_and_compacted_history(kube_cluster: Any) -> None:
    """SIGKILL the API server (watches drop), delete a slice in etcd and compact etcd while it
    is down, start it again: its fresh watch cache answers the old resourceVersion with 410
    Gone, discovery lists again, sees the deletion, and keeps watching."""

    async def scenario() -> None:
        async with Api(kube_cluster) as api:
            ns = await api.namespace()
            await api.service(ns, "beam-decode", role="decode")
            await api.endpoint_slice(ns, "dec-a", "beam-decode", ("10.0.0.1", True, "d-0"))
            await api.endpoint_slice(ns, "dec-b", "beam-decode", ("10.0.0.2", True, "d-1"))
            disco = discovery(kube_cluster.kubeconfig, ns)
            async with disco:
                await disco.wait_synced(STEP_S)
                changes = disco.changes()
                await next_where(changes, lambda e: ids(e) == ["d-0", "d-1"])

                await asyncio.to_thread(kube_cluster.stop_apiserver)
                key = f"/registry/endpointslices/{ns}/dec-b"
                assert await asyncio.to_thread(kube_cluster.etcd_delete, key) == 1
                await asyncio.to_thread(kube_cluster.etcd_compact)
                # a router starting while the API server is down waits for it
                late = discovery(kube_cluster.kubeconfig, ns)
                await late.start()
                await asyncio.sleep(1.0)  # both retry against a closed port meanwhile
                assert ids(disco.endpoints) == ["d-0", "d-1"]  # last known view is kept
                assert not late.synced
                await asyncio.wait_for(asyncio.to_thread(kube_cluster.start_apiserver), 150)

                await next_where(changes, lambda e: ids(e) == ["d-0"], timeout=60)
                await late.wait_synced(60)
                assert ids(late.endpoints) == ["d-0"]
                await late.stop()
                resp = await api.client.get("/metrics")
                assert list_requests(resp.text, "endpointslices") >= 1  # re-listed after 410

                # and the new watch delivers changes
                await api.set_endpoints(
                    ns, "dec-a", ("10.0.0.1", True, "d-0"), ("10.0.0.3", True, "d-2")
                )
                await next_where(changes, lambda e: ids(e) == ["d-0", "d-2"])

    asyncio.run(scenario())


def test_missing_binaries_fail_with_the_fix(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Without the cached binaries the fixture fails (never skips) and names `make k8s-testenv`."""
    monkeypatch.setenv("BEAMSERVE_CACHE", str(tmp_path))
    assert any(re.search(r"k8s-1\.20\.2/bin/kube-apiserver$", m) for m in _kc.missing_binaries())
    gen = _kc._cluster()
    with pytest.raises(pytest.fail.Exception, match=r"make k8s-testenv"):
        next(gen)
