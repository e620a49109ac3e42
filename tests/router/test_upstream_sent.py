"""`Upstreams`' sent hook: the decode call's `on_sent` runs once the request's body went out to
the worker, before its answer starts (the HTTP door writes the index predictions and the
decision's record there, off the path from the decision to the worker), exactly once, and
never for a call that could not be sent. The worker here is a small aiohttp server in the test's
loop (below the part under test) that holds its answer until the test lets it go."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp import web
from beamserve.router.api.convert import to_upstream
from beamserve.router.api.models import parse_request
from beamserve.router.load import LoadBook
from beamserve.router.pd import UpstreamError, Upstreams
from beamserve.router.types import Endpoint, RouteDecision

PROMPT = "word " * 20_000  # a body of ≈ 100 KB: more than one socket buffer's worth


def _call(stream: bool) -> Any:
    body = {"model": "beam", "max_tokens": 2, "stream": stream,
            "messages": [{"role": "user", "content": PROMPT}]}  # fmt: skip
    return to_upstream(parse_request("chat", json.dumps(body).encode(), 1 << 22))


async def _worker(
    release: asyncio.Event, got: list[int], peers: list[int] | None = None
) -> tuple[web.AppRunner, str]:
    """`got`: each request's body size; `peers`: each request's client port (its connection)."""

    async def chat(request: web.Request) -> web.StreamResponse:
        if peers is not None:
            peers.append(request.transport.get_extra_info("peername")[1])  # type: ignore[union-attr]
        body = await request.read()
        got.append(len(body))
        await release.wait()
        chunk = {"choices": [{"index": 0, "delta": {"content": "hi"}}], "model": "beam"}
        usage = {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2}}
        if not json.loads(body)["stream"]:
            message = {"role": "assistant", "content": "hi"}
            choice = {"index": 0, "message": message, "finish_reason": "stop"}
            return web.json_response({**usage, "choices": [choice]})
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for frame in (chunk, usage):
            await resp.write(f"data: {json.dumps(frame)}\n\n".encode())
            await asyncio.sleep(0.02)  # a token at a time
        await resp.write(b"data: [DONE]\n\n")
        await asyncio.sleep(0.02)  # the body's end comes a moment after the stream's
        return resp

    app = web.Application(client_max_size=1 << 24)
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "unary"])
def test_on_sent_runs_once_after_the_body_went_out_and_before_the_answer(stream: bool) -> None:
    async def main() -> None:
        release, got, sent = asyncio.Event(), [], []
        runner, url = await _worker(release, got)
        ep = Endpoint("w", url)
        up = Upstreams(lambda: [ep], LoadBook())
        call = _call(stream)
        try:
            fn = up.stream if stream else up.unary
            task = asyncio.create_task(
                fn(RouteDecision(decode=ep), call, lambda r, w: None, None, lambda: sent.append(1))
            )
            for _ in range(500):  # the worker read the whole body, and holds its answer
                if got:
                    break
                await asyncio.sleep(0.01)
            assert got and got[0] > 100_000
            assert sent == [1] and not task.done()  # ran before the answer started
            release.set()
            out = await asyncio.wait_for(task, 10)
            if stream:
                first = await out.first()
                assert first and first[0]["choices"][0]["delta"]["content"] == "hi"
                await out.aclose()
            else:
                assert out["choices"][0]["message"]["content"] == "hi"
            assert sent == [1]  # once
        finally:
            await up.aclose()
            await runner.cleanup()

    asyncio.run(main())


def test_on_sent_does_not_run_for_a_call_that_never_went_out() -> None:
    async def main() -> None:
        sent: list[int] = []
        ep = Endpoint("gone", "http://127.0.0.1:9")  # discard port: connection refused
        up = Upstreams(lambda: [ep], LoadBook(), connect_timeout_s=1)
        try:
            with pytest.raises(UpstreamError):
                await up.stream(
                    RouteDecision(decode=ep), _call(True), lambda r, w: None, None,
                    lambda: sent.append(1),
                )  # fmt: skip
            await asyncio.sleep(0.05)
            assert sent == []
        finally:
            await up.aclose()

    asyncio.run(main())


def test_a_stream_read_to_its_end_leaves_its_connection_for_the_next_call() -> None:
    """The worker's body ends a moment after `[DONE]`: the connection is kept once that end
    is read (three calls, one connection), while a stream cut short closes its connection (how
    the worker learns to abort), so the call after it comes on a new one."""

    async def main() -> None:
        release = asyncio.Event()
        release.set()
        peers: list[int] = []
        runner, url = await _worker(release, [], peers)
        ep = Endpoint("w", url)
        up = Upstreams(lambda: [ep], LoadBook())
        try:
            for cut_short in (False, False, False, True, False):
                chunks = await up.stream(RouteDecision(decode=ep), _call(True), lambda r, w: None)
                await chunks.first()
                if not cut_short:
                    async for _ in chunks.raw():
                        pass
                await chunks.aclose()
            assert len(peers) == 5
            assert peers[0] == peers[1] == peers[2] == peers[3] != peers[4]
        finally:
            await up.aclose()
            await runner.cleanup()

    asyncio.run(main())
