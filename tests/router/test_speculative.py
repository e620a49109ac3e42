"""Speculative dispatch (`Router._speculate`): a calm session's next turn goes to its worker,
body as it came, before the router parses, keys and routes it; the answer is the request's when
the decision is that worker, and the call is called off (the worker sees its client go) when
the router refuses the request or decides otherwise — the client gets what the router decided
either way, and nothing stays booked. In process, over real sim workers."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import httpx
import pytest
from beamserve.router import app as router_app
from beamserve.router.discovery import StaticDiscovery, parse_endpoint_specs
from beamserve.router.pd import Upstreams
from beamserve.router.server import RouterRuntime, RuntimeConfig

from tests.conftest import SpawnWorker
from tests.router.test_router_flow import serving

URL = "/v1/chat/completions"
FIRST = [{"role": "system", "content": "you are a coding agent " * 40},
         {"role": "user", "content": "read the repository and list the tests " * 30}]  # fmt: skip
LATER = [*FIRST, {"role": "assistant", "content": "there are 12 tests"},
         {"role": "user", "content": "run them"}]  # fmt: skip


def _body(messages: list[dict[str, str]], **extra: Any) -> dict[str, Any]:
    return {"model": "beam", "messages": messages, "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}, **extra}  # fmt: skip


def _runtime(urls: list[str], speculate: bool = True) -> RouterRuntime:
    eps = parse_endpoint_specs([{"url": u} for u in urls])
    config = RuntimeConfig(scrape_interval_s=3600)
    config = dataclasses.replace(
        config, settings=dataclasses.replace(config.settings, speculate=speculate)
    )
    return RouterRuntime(StaticDiscovery(eps), config)


def _count(text: str, outcome: str) -> float:
    name = "beamserve_router_speculative_dispatches_total"
    for line in text.splitlines():
        if line.startswith(f'{name}{{outcome="{outcome}"}}'):
            return float(line.split()[-1])
    return 0.0


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What happened, in order: a speculative call started, a body parsed."""
    out: list[str] = []
    parse, post_now = router_app.parse_request, Upstreams.post_now

    def parsed(*a: Any, **k: Any) -> Any:
        out.append("parsed")
        return parse(*a, **k)

    def posted(self: Upstreams, ep: Any, *a: Any, **k: Any) -> Any:
        out.append(f"speculative call to {ep.id}")
        return post_now(self, ep, *a, **k)

    monkeypatch.setattr(router_app, "parse_request", parsed)
    monkeypatch.setattr(Upstreams, "post_now", posted)
    return out


def _stream_ok(r: httpx.Response) -> None:
    assert r.status_code == 200, r.text
    lines = [x for x in r.text.splitlines() if x.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    usage = [json.loads(x[6:]) for x in lines[:-1] if '"usage"' in x]
    assert usage and usage[-1]["usage"]["completion_tokens"] > 0


def _books_empty(rt: RouterRuntime) -> None:
    assert rt.core.open_dispatches == 0
    for e in rt.endpoints():
        assert rt.core.loads.load(e.id).in_flight == 0, e.id


def test_a_calm_sessions_next_turn_goes_out_before_it_is_parsed(
    spawn_worker: SpawnWorker, events: list[str]
) -> None:
    w = spawn_worker("--engine", "sim", "--profile", "h200-bf16-tp8")
    rt = _runtime([w.url])
    worker = parse_endpoint_specs([{"url": w.url}])[0].id

    async def main() -> None:
        async with serving(rt) as c:
            headers = {"x-session-id": "agent-1"}
            _stream_ok(await c.post(URL, json=_body(FIRST), headers=headers))
            assert events == ["parsed"]  # a first turn: nothing on record
            events.clear()
            reads = []
            get = rt.sessions.get

            async def counted(session: str) -> Any:
                reads.append(session)
                return await get(session)

            rt.sessions.get = counted  # type: ignore[method-assign]
            r = await c.post(URL, json=_body(LATER), headers=headers)
            rt.sessions.get = get  # type: ignore[method-assign]
            _stream_ok(r)
            assert events == [f"speculative call to {worker}", "parsed"]
            assert reads == ["agent-1"]  # the record the call went on, not read again
            assert f"decode={worker};" in r.headers["x-beamserve-route"]
            assert "band=continuing" in r.headers["x-beamserve-route"]
            text = (await c.get("/metrics")).text
            assert (_count(text, "adopted"), _count(text, "called_off")) == (1, 0)
            _books_empty(rt)
            record = await rt.sessions.get("agent-1")
            assert record is not None and record.turns == 2 and record.worker == worker

    asyncio.run(main())


def test_a_speculative_call_the_router_refuses_is_called_off(
    spawn_worker: SpawnWorker, events: list[str]
) -> None:
    """A model the router does not serve, a body it rejects: the router's own error, the
    worker's call aborted, the books empty — and the session's next turn goes out as before."""
    w = spawn_worker("--engine", "sim", "--profile", "h200-bf16-tp8")
    rt = _runtime([w.url])

    async def main() -> None:
        async with serving(rt) as c:
            headers = {"x-session-id": "agent-2"}
            _stream_ok(await c.post(URL, json=_body(FIRST), headers=headers))
            more = [*LATER, {"role": "user", "content": "and again"}]
            r = await c.post(URL, json=_body(more, model="nope"), headers=headers)
            assert r.status_code == 404 and "nope" in r.text
            r = await c.post(URL, json=_body(more, max_tokens=-3), headers=headers)
            assert r.status_code == 400 and "max_tokens" in r.text
            assert sum(e.startswith("speculative") for e in events) == 2
            text = (await c.get("/metrics")).text
            assert (_count(text, "adopted"), _count(text, "called_off")) == (0, 2)
            _books_empty(rt)
            _stream_ok(await c.post(URL, json=_body(more), headers=headers))
            text = (await c.get("/metrics")).text
            assert _count(text, "adopted") == 1
            _books_empty(rt)

    asyncio.run(main())


def test_a_speculative_call_to_another_worker_than_decided_is_called_off(
    spawn_worker: SpawnWorker, events: list[str]
) -> None:
    """The policy sends the session's next turn elsewhere: the call to its old worker is
    called off and the answer comes from the worker decided."""
    ws = [spawn_worker("--engine", "sim", "--profile", "h200-bf16-tp8") for _ in range(2)]
    rt = _runtime([w.url for w in ws])

    async def main() -> None:
        async with serving(rt) as c:
            headers = {"x-session-id": "agent-3"}
            _stream_ok(await c.post(URL, json=_body(FIRST), headers=headers))
            record = await rt.sessions.get("agent-3")
            assert record is not None
            home = record.worker
            other = next(e for e in rt.endpoints() if e.id != home)
            route = rt.core.policy.route

            def elsewhere(request: Any, views: Any) -> Any:
                return dataclasses.replace(route(request, views), decode=other, reason="test")

            rt.core.policy.route = elsewhere  # type: ignore[method-assign]
            events.clear()
            r = await c.post(URL, json=_body(LATER), headers=headers)
            _stream_ok(r)
            assert events == [f"speculative call to {home}", "parsed"]
            assert f"decode={other.id};" in r.headers["x-beamserve-route"]
            text = (await c.get("/metrics")).text
            assert (_count(text, "adopted"), _count(text, "called_off")) == (0, 1)
            _books_empty(rt)

    asyncio.run(main())


@pytest.mark.parametrize(
    "case", ["no session header", "no usage asked", "usage declined", "switched off", "worker busy"]
)
def test_no_speculation_where_the_body_or_the_pool_says_no(
    spawn_worker: SpawnWorker, events: list[str], case: str
) -> None:
    w = spawn_worker("--engine", "sim", "--profile", "h200-bf16-tp8")
    rt = _runtime([w.url], speculate=case != "switched off")

    async def main() -> None:
        async with serving(rt) as c:
            headers = {} if case == "no session header" else {"x-session-id": "agent-4"}
            _stream_ok(await c.post(URL, json=_body(FIRST), headers=headers))
            body = _body(LATER)
            if case == "no usage asked":
                body.pop("stream_options")
            if case == "usage declined":  # (the router asks the worker for it all the same)
                body["stream_options"] = {"include_usage": False}
            busy = None
            if case == "worker busy":  # another session streams from the same worker
                long = {**_body([{"role": "user", "content": "write a lot"}]), "max_tokens": 400}
                busy = asyncio.create_task(c.post(URL, json=long, headers={"x-session-id": "o"}))
                for _ in range(200):
                    if rt.core.open_dispatches:
                        break
                    await asyncio.sleep(0.01)
            r = await c.post(URL, json=body, headers=headers)
            assert r.status_code == 200, r.text
            if busy is not None:
                (await busy).raise_for_status()
            assert not any(e.startswith("speculative") for e in events), events
            _books_empty(rt)

    asyncio.run(main())


def _over_http(spawn_worker: SpawnWorker) -> tuple[Any, Any]:
    """A slowed sim worker (20× its H200 timings) behind a `beamserve router` process, and
    the session's first turn through it."""
    from tests.router.test_router_e2e import spec

    w = spawn_worker("--engine", "sim", "--faults", json.dumps({"slowdown": 20}))
    router = spawn_worker("--endpoints", json.dumps([spec(w)]), command="router")
    r = httpx.post(router.url + URL, json=_body(FIRST), headers={"x-session-id": "h"}, timeout=60)
    _stream_ok(r)
    return w, router


def _worker_idle(w: Any, most_tokens: float) -> None:
    import time

    from tests.router.test_router_e2e import metric

    deadline = time.monotonic() + 10
    while metric(w.url, "vllm:num_requests_running") != 0:
        assert time.monotonic() < deadline, "the worker kept generating for a gone client"
        time.sleep(0.2)
    assert metric(w.url, "vllm:generation_tokens_total") < most_tokens


def test_over_http_a_client_that_leaves_a_speculative_turn_stops_the_worker(
    spawn_worker: SpawnWorker,
) -> None:
    from tests.router.test_router_e2e import metric

    w, router = _over_http(spawn_worker)
    body = {**_body(LATER), "max_tokens": 2000}
    with httpx.stream("POST", router.url + URL, json=body, headers={"x-session-id": "h"},
                      timeout=30) as s:  # fmt: skip
        for line in s.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                break  # tokens are flowing; now walk away
    _worker_idle(w, 2000)
    name = "beamserve_router_speculative_dispatches_total"
    assert metric(router.url, name, outcome="adopted") == 1
    assert metric(router.url, "beamserve_router_in_flight") == 0


def test_over_http_a_called_off_call_is_aborted_at_the_worker(spawn_worker: SpawnWorker) -> None:
    """The router refuses the turn (a model it does not serve) after its body went out: the
    worker's request ends at once instead of generating its 2,000 tokens."""
    from tests.router.test_router_e2e import metric

    w, router = _over_http(spawn_worker)
    before = metric(w.url, "vllm:generation_tokens_total")
    body = {**_body(LATER), "max_tokens": 2000, "model": "nope"}
    r = httpx.post(router.url + URL, json=body, headers={"x-session-id": "h"}, timeout=30)
    assert r.status_code == 404, r.text
    _worker_idle(w, before + 2000)
    name = "beamserve_router_speculative_dispatches_total"
    assert metric(router.url, name, outcome="called_off") == 1
    assert metric(router.url, "beamserve_router_in_flight") == 0
