"""Flow control with the real `SaturationDetector`: between snapshots it projects the work
admitted since, so a backlog drains at the pool's pace; during a saturated spell freed room goes
to continuing turns only, and new work waits in the router's queue."""

from __future__ import annotations

import asyncio

from beamserve.router.flow import FlowConfig, FlowController, SaturationConfig, SaturationDetector
from beamserve.router.types import WorkerLoad

CAP = 1000  # max_prefill_tokens of the one worker: level = prefill tokens / 1000


def loads(prefill_tokens: int) -> list[WorkerLoad]:
    return [WorkerLoad(prefill_tokens=prefill_tokens)]


def test_projection_counts_admitted_work_until_the_next_snapshot() -> None:
    d = SaturationDetector(SaturationConfig(max_prefill_tokens=CAP))
    d.observe(loads(500), now=0.0)
    assert d.admits(900)  # the first admission after a snapshot always passes
    d.admitted(400)
    assert abs(d.projected() - 0.9) < 1e-9
    assert not d.admits(200)  # 0.9 + 0.2 ≥ 1
    assert d.admits(50)
    d.released(400)
    assert abs(d.projected() - 0.5) < 1e-9
    d.admitted(300)
    d.observe(loads(100), now=1.0)  # a snapshot resets the projection
    assert d.projected() == 0.1


def test_backlog_drains_one_snapshot_at_a_time() -> None:
    async def main() -> None:
        d = SaturationDetector(SaturationConfig(max_prefill_tokens=CAP))
        c = FlowController(FlowConfig(hold_continuing=True), saturation=d)
        c.observe_pool(loads(2000))  # saturated: everything queues
        waiting = [asyncio.ensure_future(c.admit("new", f"t{i}", 600)) for i in range(4)]
        await asyncio.sleep(0)
        assert c.stats().queued["new"] == 4
        c.observe_pool(loads(0))  # below the threshold: only what the projection admits
        await asyncio.sleep(0)
        assert sum(t.done() for t in waiting) == 1  # 600 admitted; +600 would reach 1.2
        c.observe_pool(loads(0))
        await asyncio.sleep(0)
        assert sum(t.done() for t in waiting) == 2
        for t in waiting:
            if t.done():
                t.result().release()
        for t in waiting:
            t.cancel()

    asyncio.run(main())


def test_saturated_room_goes_to_continuing_turns_only() -> None:
    async def main() -> None:
        d = SaturationDetector(SaturationConfig(max_prefill_tokens=CAP))
        c = FlowController(FlowConfig(hold_continuing=True), saturation=d)
        running = [await c.admit("new", f"r{i}", 300) for i in range(2)]
        c.observe_pool(loads(5000))  # the pool is saturated from here on
        new = asyncio.ensure_future(c.admit("new", "n", 100))
        cont = asyncio.ensure_future(c.admit("continuing", "c", 100))
        await asyncio.sleep(0)
        assert not new.done() and not cont.done()
        running[0].release()  # frees 300 tokens of room
        await asyncio.sleep(0)
        assert cont.done() and not new.done()  # the continuing turn takes the room
        cont.result().release()
        running[1].release()
        await asyncio.sleep(0)
        # nothing of ours is in flight any more: the queued new turn may use the room (else it
        # could wait forever on a pool busy with other routers' work)
        assert new.done()
        new.result().release()
        assert c.stats().in_flight == 0

    asyncio.run(main())
