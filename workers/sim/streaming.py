"""Asyncio bridge: a request's updates as an async iterator, for an HTTP server on `RealClock`.

    async for update in stream(engine, request):
        send_sse(update.token_ids)          # update.finished on the last one

The engine calls listeners on the event loop's thread, so an `asyncio.Queue` carries updates
without locks. If the consumer stops early (client disconnect: the generator is closed or its
task cancelled), the request is aborted so its pages return to the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from beamserve.workers.sim.engine import SimEngine
from beamserve.workers.sim.request import RequestUpdate, SimRequest


async def stream(engine: SimEngine, request: SimRequest) -> AsyncIterator[RequestUpdate]:
    """Submit `request` and yield its updates until the final one (inclusive).

    Raises what `SimEngine.submit` raises (`SimRequestError`, `EngineDeadError`) before the
    first update. The engine must run on a `RealClock` of the running loop.
    """
    queue: asyncio.Queue[RequestUpdate] = asyncio.Queue()
    engine.submit(request, queue.put_nowait, stream=True)
    finished = False
    try:
        while True:
            update = await queue.get()
            if update.finished:
                finished = True
            yield update
            if finished:
                return
    finally:
        if not finished:
            engine.abort(request.request_id)
