"""Clocks: the only place the simulator meets time.

The engine never sleeps and never reads a wall clock; it asks a `Clock` for `now()` and to run a
callback at a later time (`call_at`). Two implementations drive the same engine code:

- `VirtualClock`: a discrete-event scheduler. Time jumps straight to the next timer, so an
  in-process replay runs as fast as the Python that handles the events (hundreds to thousands of
  times faster than real time). Deterministic: timers due at the same time run in the order they
  were scheduled.
- `RealClock`: timers on a running asyncio loop, for serving behind HTTP. `speed` > 1 compresses
  time (a 10 ms simulated step takes 10/speed ms of wall time).

Times are seconds since the clock's start (virtual seconds for `VirtualClock`).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable
from typing import Protocol


class TimerHandle(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    """Time source and timer queue. Callbacks run one at a time, never concurrently."""

    def now(self) -> float:
        """Seconds since the clock started; never decreases."""
        ...

    def call_at(self, when: float, callback: Callable[[], None]) -> TimerHandle:
        """Run `callback` at time `when` (at once, in order, if `when` is already past)."""
        ...


class _VirtualTimer:
    __slots__ = ("callback", "cancelled", "when")

    def __init__(self, when: float, callback: Callable[[], None]) -> None:
        self.when = when
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class VirtualClock:
    """Discrete-event time: `run()` pops timers in time order and jumps `now` to each.

    Invariants: `now()` never decreases; timers with equal `when` run in scheduling order.
    """

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._heap: list[tuple[float, int, _VirtualTimer]] = []
        self._seq = itertools.count()

    def now(self) -> float:
        return self._now

    def call_at(self, when: float, callback: Callable[[], None]) -> _VirtualTimer:
        timer = _VirtualTimer(max(when, self._now), callback)
        heapq.heappush(self._heap, (timer.when, next(self._seq), timer))
        return timer

    def call_later(self, delay: float, callback: Callable[[], None]) -> _VirtualTimer:
        return self.call_at(self._now + delay, callback)

    def pending(self) -> int:
        """Timers scheduled and not yet run (cancelled ones included until popped)."""
        return len(self._heap)

    def next_time(self) -> float | None:
        """When the next live timer is due, or `None` when none is left."""
        while self._heap and self._heap[0][2].cancelled:
            heapq.heappop(self._heap)
        return self._heap[0][0] if self._heap else None

    def run(self, until: float | None = None, max_events: int | None = None) -> int:
        """Run timers in time order; return how many callbacks ran.

        Stops when no timer is left, when the next one is due after `until` (then `now`
        becomes `until`), or after `max_events` callbacks.
        """
        ran = 0
        heap = self._heap
        while heap and (max_events is None or ran < max_events):
            when, _, timer = heap[0]
            if until is not None and when > until:
                break
            heapq.heappop(heap)
            if timer.cancelled:
                continue
            self._now = when
            timer.callback()
            ran += 1
        if until is not None and until > self._now and (not heap or heap[0][0] > until):
            self._now = until
        return ran


class RealClock:
    """Wall-clock time on a running asyncio loop; create it from inside that loop.

    `speed` is simulated seconds per wall second (1.0 = real time).
    """

    def __init__(self, speed: float = 1.0, loop: asyncio.AbstractEventLoop | None = None) -> None:
        if speed <= 0:
            raise ValueError(f"speed: must be > 0, got {speed}")
        self._loop = loop or asyncio.get_running_loop()
        self._speed = speed
        self._t0 = self._loop.time()

    @property
    def speed(self) -> float:
        return self._speed

    def now(self) -> float:
        return (self._loop.time() - self._t0) * self._speed

    def call_at(self, when: float, callback: Callable[[], None]) -> asyncio.TimerHandle:
        return self._loop.call_at(self._t0 + when / self._speed, callback)
