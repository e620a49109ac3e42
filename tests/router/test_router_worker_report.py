"""`GET /admin/workers` (what the operator asks before removing a retiring revision) through
the real router app in front of a real, slowed-down sim worker process: a streaming request
counts on its worker while it runs — also after the worker has left discovery, which is how
a retiring revision drains — and no longer once it ends."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import httpx
import uvicorn
from beamserve.router.discovery import StaticDiscovery, parse_endpoint_specs
from beamserve.router.server import RouterRuntime, RuntimeConfig

from tests.conftest import SpawnWorker


def test_in_flight_per_worker_outlives_discovery_until_the_request_ends(
    spawn_worker: SpawnWorker,
) -> None:
    w = spawn_worker("--engine", "sim", "--speed", "0.02")  # a token every few 100 ms
    eps = parse_endpoint_specs([{"url": w.url, "id": "old-0", "revision": "r1", "role": "both"}])
    discovery = StaticDiscovery(eps)
    rt = RouterRuntime(discovery, RuntimeConfig(scrape_interval_s=3600))

    def by_id(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
        return {x["id"]: x for x in report["workers"]}

    async def main() -> None:
        await rt.start()
        # over real HTTP (httpx's in-process ASGI transport would buffer the whole stream)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(rt.app, log_level="warning", lifespan="off"))
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        try:
            while not server.started:
                await asyncio.sleep(0.01)
            base = f"http://127.0.0.1:{sock.getsockname()[1]}"
            async with httpx.AsyncClient(base_url=base, timeout=60) as c:
                idle = by_id((await c.get("/admin/workers")).json())
                assert idle["old-0"]["in_flight"] == 0 and idle["old-0"]["discovered"]
                body = {
                    "model": "beam",
                    "messages": [{"role": "user", "content": "hello"}],
                    "max_tokens": 400,
                    "stream": True,
                }
                async with c.stream("POST", "/v1/chat/completions", json=body) as resp:
                    assert resp.status_code == 200
                    lines = resp.aiter_lines()
                    while not (await anext(lines)).startswith("data: {"):
                        pass  # the first token: the request is streaming from its worker
                    busy = by_id((await c.get("/admin/workers")).json())["old-0"]
                    assert busy == {
                        "id": "old-0",
                        "url": w.url,
                        "role": "both",
                        "pool": "default",
                        "revision": "r1",
                        "engine": "sim",
                        "in_flight": 1,
                        "discovered": True,
                    }
                    discovery.set([])  # the revision retires: its Service is gone
                    await asyncio.sleep(0.2)
                    report = (await c.get("/admin/workers")).json()
                    gone = by_id(report)["old-0"]
                    assert gone["in_flight"] == 1 and not gone["discovered"]
                    assert gone["revision"] == "r1" and report["in_flight"] == 1
                # the client went away: the request ended
                for _ in range(50):
                    report = (await c.get("/admin/workers")).json()
                    if report["in_flight"] == 0:
                        break
                    await asyncio.sleep(0.1)
                assert report == {"workers": [], "in_flight": 0}, json.dumps(report)
        finally:
            server.should_exit = True
            await asyncio.wait_for(serving, 10)
            sock.close()
            await rt.stop()

    asyncio.run(main())
