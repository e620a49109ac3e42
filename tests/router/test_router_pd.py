"""P/D orchestration (`router.pd.Upstreams`) against real worker processes: a prefill leg that
fails is retried on another prefill worker that pairs with the decode worker (same revision and
KV layout); a prefill worker of another revision is never used."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from beamserve.router.api.convert import to_upstream
from beamserve.router.api.models import parse_request
from beamserve.router.discovery import parse_endpoint_specs
from beamserve.router.load import LoadBook
from beamserve.router.pd import Upstreams
from beamserve.router.types import Endpoint, RouteDecision

from tests.conftest import SpawnWorker
from tests.router.test_router_e2e import SYSTEM, metric


def test_failed_prefill_leg_is_retried_on_a_pairing_prefill_worker(
    spawn_worker: SpawnWorker, tiny_checkpoint: Path
) -> None:
    m = str(tiny_checkpoint)
    dead = spawn_worker("--engine", "sim", "--role", "prefill", "--model", m)
    other_rev = spawn_worker("--engine", "sim", "--role", "prefill", "--model", m)
    alive = spawn_worker("--engine", "sim", "--role", "prefill", "--model", m)
    d = spawn_worker("--engine", "sim", "--role", "decode", "--model", m)
    eps = parse_endpoint_specs([
        {"url": dead.url, "id": "dead", "role": "prefill", "revision": "r1"},
        {"url": other_rev.url, "id": "other-rev", "role": "prefill", "revision": "r2"},
        {"url": alive.url, "id": "alive", "role": "prefill", "revision": "r1"},
        {"url": d.url, "id": "decode", "role": "decode", "revision": "r1"},
    ])  # fmt: skip
    by_id = {e.id: e for e in eps}
    dead.kill()
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "x"}]
    body = {"model": "beam", "max_tokens": 3, "messages": msgs}
    call = to_upstream(parse_request("chat", json.dumps(body).encode(), 1 << 20))
    fallbacks: list[tuple[str, str]] = []
    loads = LoadBook()
    # the revision-r2 worker is the least loaded: it must still not be chosen
    loads.start("alive", 50_000, 50_000)

    async def main() -> dict[str, object]:
        up = Upstreams(lambda: eps, loads, prefill_timeout_s=5)
        try:
            decision = RouteDecision(decode=by_id["decode"], prefill=by_id["dead"])
            return await up.unary(decision, call, lambda r, w: fallbacks.append((r, w)))
        finally:
            await up.aclose()

    answer = asyncio.run(main())
    assert answer["usage"]["completion_tokens"] == 3  # type: ignore[index]
    assert fallbacks == [("prefill_failed", "dead")]  # retried, not prefilled locally
    assert metric(d.url, "beamserve_worker_kv_transfers_total") == 1
    assert metric(alive.url, "vllm:prompt_tokens_total") > 0
    assert metric(other_rev.url, "vllm:prompt_tokens_total") == 0


@pytest.mark.parametrize("api", ["vllm", "sglang"])
def test_prefill_done_hook_fires_once_when_the_prefill_leg_answers(
    spawn_worker: SpawnWorker, api: str
) -> None:
    """`on_prefill_done` (what frees the prefill worker's booking for the flow gate) fires
    exactly once per split request: vLLM style before the decode leg is sent (the prefill leg
    is awaited first), SGLang style when the prefill leg started beside the decode leg answers;
    never when the prefill leg fails (its worker is gone)."""
    p = spawn_worker("--engine", "sim", "--role", "prefill", "--api", api)
    d = spawn_worker("--engine", "sim", "--role", "decode", "--api", api, "--kv-deadline-s", "1")
    boot = int(str(p.info["handshake_url"]).rsplit(":", 1)[1])
    prefill = Endpoint("p", p.url, role="prefill", api=api, bootstrap_port=boot)  # type: ignore[arg-type]
    decode = Endpoint("d", d.url, role="decode", api=api)  # type: ignore[arg-type]
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "x"}]
    body = {"model": "beam", "max_tokens": 3, "messages": msgs, "stream": True}
    call = to_upstream(parse_request("chat", json.dumps(body).encode(), 1 << 20))

    async def run() -> tuple[list[str], list[tuple[str, str]]]:
        up = Upstreams(lambda: [prefill, decode], LoadBook(), prefill_timeout_s=5)
        events: list[str] = []
        fallbacks: list[tuple[str, str]] = []
        try:
            decision = RouteDecision(decode=decode, prefill=prefill)
            chunks = await up.stream(
                decision,
                call,
                lambda r, w: fallbacks.append((r, w)),
                lambda: events.append("prefill_done"),
            )
            events.append("decode_sent")
            async for _ in chunks:
                pass
            await asyncio.sleep(0.3)  # an SGLang prefill leg's answer may trail the stream
        finally:
            await up.aclose()
        return events, fallbacks

    events, fallbacks = asyncio.run(run())
    assert fallbacks == []
    if api == "vllm":
        assert events == ["prefill_done", "decode_sent"]
    else:
        assert events.count("prefill_done") == 1
    p.kill()
    events, fallbacks = asyncio.run(run())
    assert "prefill_done" not in events and fallbacks
