"""KubernetesDiscovery's list/watch I/O against a small in-test Kubernetes API.

The fake serves what discovery uses of the real API: `/apis` (group discovery), list and watch
(newline-delimited JSON events, resourceVersion, label selectors) of Services and EndpointSlices,
bearer-token auth, a 410 Gone for an expired resourceVersion (both as an HTTP status and as a
watch ERROR event), and connections that drop mid-watch. A real kube-apiserver test is separate.

The fake runs on the test's own event loop, the one discovery publishes on: a client that
blocked that loop could never get an answer, so every test here also shows that the
`kubernetes` client's blocking calls stay off it (in discovery's threads).
"""

from __future__ import annotations

import asyncio
import copy
import json
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
import uvicorn
from beamserve.router.discovery import (
    DiscoveryConfigError,
    KubeAccess,
    KubernetesDiscovery,
    WatchSettings,
)
from beamserve.router.types import Endpoint
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

TOKEN = "t0ken"
NS = "beam"


class FakeKube:
    def __init__(self, slice_versions: tuple[str, ...]) -> None:
        self.slice_versions = slice_versions
        self.rv = 100
        self.store: dict[str, dict[str, dict[str, Any]]] = {"services": {}, "endpointslices": {}}
        self.events: dict[str, list[tuple[int, str, dict[str, Any]]]] = {
            "services": [],
            "endpointslices": [],
        }
        self.compacted: dict[str, int] = {"services": 0, "endpointslices": 0}
        self.drop_watches: dict[str, int] = {"services": 0, "endpointslices": 0}
        self.gone_as_event = False
        self.lists: dict[str, int] = {"services": 0, "endpointslices": 0}
        self.watches: dict[str, int] = {"services": 0, "endpointslices": 0}
        self.wakeup = asyncio.Event()
        self.unauthorized = 0
        self.ready = True  # /readyz: 200, else 500 (a starting server)

    def put(self, kind: str, obj: dict[str, Any]) -> None:
        self.rv += 1
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(self.rv)
        name = obj["metadata"]["name"]
        event = "MODIFIED" if name in self.store[kind] else "ADDED"
        self.store[kind][name] = obj
        self.events[kind].append((self.rv, event, obj))
        self.wakeup.set()

    def delete(self, kind: str, name: str) -> None:
        self.rv += 1
        obj = copy.deepcopy(self.store[kind].pop(name))
        obj["metadata"]["resourceVersion"] = str(self.rv)
        self.events[kind].append((self.rv, "DELETED", obj))
        self.wakeup.set()

    def compact(self, kind: str) -> None:
        """Forget history: watches from older resourceVersions get 410 Gone."""
        self.compacted[kind] = self.rv + 1
        self.wakeup.set()

    def drop(self, kind: str) -> None:
        """The open watch on `kind` loses its connection at the next event or tick."""
        self.drop_watches[kind] += 1
        self.wakeup.set()


def matches(selector: str, labels: dict[str, str]) -> bool:
    for term in filter(None, selector.split(",")):
        if "=" in term:
            k, v = term.split("=", 1)
            if labels.get(k) != v:
                return False
        elif term not in labels:
            return False
    return True


def make_app(kube: FakeKube) -> FastAPI:
    app = FastAPI()

    @app.middleware("http")
    async def auth(request: Request, call_next: Any) -> Any:
        if request.headers.get("authorization") != f"Bearer {TOKEN}":
            kube.unauthorized += 1
            return JSONResponse({"kind": "Status", "code": 401}, status_code=401)
        return await call_next(request)

    @app.get("/readyz")
    async def readyz() -> Any:
        return JSONResponse("ok" if kube.ready else "starting", 200 if kube.ready else 500)

    @app.get("/apis")
    async def apis() -> dict[str, Any]:
        versions = [
            {"groupVersion": f"discovery.k8s.io/{v}", "version": v} for v in kube.slice_versions
        ]
        return {
            "kind": "APIGroupList",
            "groups": [
                {"name": "apps", "versions": [{"groupVersion": "apps/v1", "version": "v1"}]},
                {"name": "discovery.k8s.io", "versions": versions},
            ],
        }

    async def collection(kind: str, request: Request) -> Any:
        q = request.query_params
        selector = q.get("labelSelector", "")
        if q.get("watch") not in ("true", "1"):
            kube.lists[kind] += 1
            items = [
                o for o in kube.store[kind].values() if matches(selector, o["metadata"]["labels"])
            ]
            return {"kind": "List", "metadata": {"resourceVersion": str(kube.rv)}, "items": items}
        kube.watches[kind] += 1
        since = int(q["resourceVersion"])
        if since < kube.compacted[kind] and not kube.gone_as_event:
            return JSONResponse({"kind": "Status", "code": 410, "reason": "Expired"}, 410)
        drops_at_start = kube.drop_watches[kind]

        async def stream() -> AsyncIterator[bytes]:
            sent = since
            if since < kube.compacted[kind]:
                status = {  # what kube-apiserver sends
                    "kind": "Status",
                    "apiVersion": "v1",
                    "metadata": {},
                    "status": "Failure",
                    "message": f"too old resource version: {since} ({kube.rv})",
                    "reason": "Expired",
                    "code": 410,
                }
                yield (json.dumps({"type": "ERROR", "object": status}) + "\n").encode()
                return
            while True:
                if kube.drop_watches[kind] != drops_at_start:
                    raise ConnectionResetError("dropped by the test")
                if kube.compacted[kind] > sent:
                    return  # the server closes; the client re-watches and gets Gone
                for rv, event, obj in list(kube.events[kind]):
                    if rv > sent and matches(selector, obj["metadata"]["labels"]):
                        yield (json.dumps({"type": event, "object": obj}) + "\n").encode()
                    sent = max(sent, rv)
                kube.wakeup.clear()
                try:
                    await asyncio.wait_for(kube.wakeup.wait(), 0.2)
                except TimeoutError:
                    pass

        return StreamingResponse(stream(), media_type="application/json")

    @app.get("/api/v1/namespaces/{ns}/services")
    async def services(ns: str, request: Request) -> Any:
        assert ns == NS
        return await collection("services", request)

    @app.get("/apis/discovery.k8s.io/{version}/namespaces/{ns}/endpointslices")
    async def slices(version: str, ns: str, request: Request) -> Any:
        assert ns == NS and version in kube.slice_versions
        return await collection("endpointslices", request)

    return app


def service(name: str, role: str, deployment: str = "beam") -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "namespace": NS,
            "labels": {
                "beamserve.io/deployment": deployment,
                "beamserve.io/role": role,
                "beamserve.io/revision": "r1",
                "beamserve.io/engine": "sglang",
            },
        },
        "spec": {"ports": [{"name": "http", "port": 80}, {"name": "kv-events", "port": 5557}]},
    }


def endpoint_slice(svc: str, ready: dict[str, bool], name: str | None = None) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name or f"{svc}-x1",
            "namespace": NS,
            "labels": {"kubernetes.io/service-name": svc},
        },
        "addressType": "IPv4",
        "endpoints": [
            {
                "addresses": [ip],
                "conditions": {"ready": r},
                "targetRef": {"kind": "Pod", "name": f"{svc}-{ip.rsplit('.', 1)[1]}"},
            }
            for ip, r in ready.items()
        ],
        "ports": [{"name": "http", "port": 8000}, {"name": "kv-events", "port": 5557}],
    }


async def run_with_fake(slice_versions: tuple[str, ...], scenario: Any) -> None:
    kube = FakeKube(slice_versions)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(make_app(kube), log_level="warning", lifespan="off"))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        access = KubeAccess.for_server(f"http://127.0.0.1:{port}", token=TOKEN, namespace=NS)
        settings = WatchSettings(watch_timeout_s=30, backoff_initial_s=0.02, backoff_max_s=0.1)
        await scenario(kube, KubernetesDiscovery("beam", access, settings=settings))
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 10)
        sock.close()


async def next_where(changes: AsyncIterator[list[Endpoint]], want: Any) -> list[Endpoint]:
    """The first published list satisfying `want` (lists may coalesce), within 5 s."""

    async def scan() -> list[Endpoint]:
        async for eps in changes:
            if want(eps):
                return eps
        raise AssertionError("changes ended")

    return await asyncio.wait_for(scan(), 5)


def ids(eps: list[Endpoint]) -> list[str]:
    return [e.id for e in eps]


@pytest.mark.parametrize("versions", [("v1beta1",), ("v1beta1", "v1")])
def test_list_watch_gone_and_dropped_connections(versions: tuple[str, ...]) -> None:
    async def scenario(kube: FakeKube, disco: KubernetesDiscovery) -> None:
        kube.put("services", service("beam-decode", "decode"))
        kube.put("services", service("someone-else", "decode", deployment="other"))
        kube.put(
            "endpointslices", endpoint_slice("beam-decode", {"10.0.0.1": True, "10.0.0.2": False})
        )
        kube.put("endpointslices", endpoint_slice("someone-else", {"10.0.9.9": True}))

        async with disco:
            await disco.wait_synced(5)
            assert disco.slice_version == versions[-1]  # v1 when served, else v1beta1
            (dec,) = disco.endpoints
            assert dec == Endpoint(
                id="beam-decode-1",
                url="http://10.0.0.1:8000",
                role="decode",
                revision="r1",
                engine="sglang",
                kv_events="tcp://10.0.0.1:5557",
                labels=dec.labels,
            )
            changes = disco.changes()

            # watch: a pod turns ready
            kube.put(
                "endpointslices",
                endpoint_slice("beam-decode", {"10.0.0.1": True, "10.0.0.2": True}),
            )
            await next_where(changes, lambda e: ids(e) == ["beam-decode-1", "beam-decode-2"])

            # 410 Gone (HTTP status): history compacted while a new Service appears
            lists_before = dict(kube.lists)
            kube.compact("services")
            kube.put("services", service("beam-prefill", "prefill"))
            kube.put("endpointslices", endpoint_slice("beam-prefill", {"10.0.1.1": True}))
            eps = await next_where(changes, lambda e: "beam-prefill-1" in ids(e))
            assert {e.role for e in eps} == {"decode", "prefill"}
            assert kube.lists["services"] > lists_before["services"]  # it listed again

            # 410 Gone as a watch ERROR event
            kube.gone_as_event = True
            lists_before = dict(kube.lists)
            kube.compact("endpointslices")
            kube.put("endpointslices", endpoint_slice("beam-prefill", {"10.0.1.1": False}))
            await next_where(changes, lambda e: "beam-prefill-1" not in ids(e))
            assert kube.lists["endpointslices"] > lists_before["endpointslices"]

            # a dropped connection: reconnect from the last resourceVersion, no re-list
            lists_before, watches_before = dict(kube.lists), dict(kube.watches)
            kube.drop("endpointslices")
            await asyncio.sleep(0.3)
            kube.delete("endpointslices", "beam-decode-x1")
            await next_where(changes, lambda e: e == [])
            assert kube.watches["endpointslices"] > watches_before["endpointslices"]
            assert kube.lists["endpointslices"] == lists_before["endpointslices"]

            # deleting the Service removes its endpoints even while its slice remains
            kube.put("endpointslices", endpoint_slice("beam-prefill", {"10.0.1.1": True}))
            await next_where(changes, lambda e: ids(e) == ["beam-prefill-1"])
            kube.delete("services", "beam-prefill")
            await next_where(changes, lambda e: e == [])
        assert kube.unauthorized == 0

    asyncio.run(run_with_fake(versions, scenario))


def test_wrong_token_keeps_retrying_without_sync() -> None:
    async def scenario(kube: FakeKube, disco: KubernetesDiscovery) -> None:
        bad = KubernetesDiscovery(
            "beam",
            KubeAccess.for_server(disco.access.server, token="wrong", namespace=NS),
            settings=disco.settings,
        )
        async with bad:
            with pytest.raises(TimeoutError):
                await bad.wait_synced(0.5)
        assert kube.unauthorized >= 2  # it retried with backoff

    asyncio.run(run_with_fake(("v1",), scenario))


def test_server_without_endpointslices_is_a_clear_error() -> None:
    async def scenario(kube: FakeKube, disco: KubernetesDiscovery) -> None:
        with pytest.raises(DiscoveryConfigError, match=r"Kubernetes 1\.17 or newer"):
            await asyncio.wait_for(disco.run(), 5)

    asyncio.run(run_with_fake((), scenario))


def test_starting_server_without_the_group_yet_is_retried() -> None:
    """A starting API server lists /apis before registering all groups (≈ 0.1 s on 1.20, seen
    against the real server): not an error until /readyz says ready."""

    async def scenario(kube: FakeKube, disco: KubernetesDiscovery) -> None:
        kube.ready = False
        kube.put("services", service("beam-decode", "decode"))
        kube.put("endpointslices", endpoint_slice("beam-decode", {"10.0.0.1": True}))
        async with disco:
            await asyncio.sleep(0.3)  # several /apis answers without discovery.k8s.io
            assert not disco.synced
            kube.slice_versions, kube.ready = ("v1beta1",), True
            await disco.wait_synced(5)
            assert ids(disco.endpoints) == ["beam-decode-1"]

    asyncio.run(run_with_fake((), scenario))


def test_stop_ends_the_watch_threads_promptly() -> None:
    """`stop()` cuts the open watches short (their threads end within about a second, not at
    the server-side watch timeout), and the event loop keeps running meanwhile."""
    import threading
    import time

    async def scenario(kube: FakeKube, disco: KubernetesDiscovery) -> None:
        kube.put("services", service("beam-decode", "decode"))
        kube.put("endpointslices", endpoint_slice("beam-decode", {"10.0.0.1": True}))
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        ticker = asyncio.create_task(tick())
        await disco.start()
        await disco.wait_synced(30)  # a slow first call on a loaded machine
        while not (kube.watches["services"] and kube.watches["endpointslices"]):
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # both watches open, their threads blocked reading
        ticks_before = ticks
        await asyncio.sleep(0.5)
        assert ticks - ticks_before >= 10  # the loop runs meanwhile
        t0 = time.monotonic()
        await disco.stop()
        # the watches' server-side timeout is 30 s here: stop does not wait for it
        assert time.monotonic() - t0 < 10
        assert not [t for t in threading.enumerate() if t.name.startswith("kube-")]
        ticker.cancel()

    asyncio.run(run_with_fake(("v1",), scenario))
