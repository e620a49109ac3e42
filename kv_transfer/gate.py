"""A launch queued ahead of its pull and released by one store to host memory.

The host-local driver's pull on the GPU is one graph replay (`host_local.TritonEngine`), but
the replay call itself, the first CUDA call after the driver's process idled, costs ≈ 0.1 ms
of a ≈ 1.9 ms pull. Everything in that graph is known once the pull is prepared, so
`prepare` can queue it then, on a stream of its own held behind a *gate*: a CUDA stream
memory wait (`cuStreamWaitValue32`) on one 32-bit word of pinned host memory. The pull then
opens the gate with one store to that word; the GPU's front end sees it and runs the graph
(the table upload, the copy kernel and its timing events) while the host does the rest.

Nothing is read before the gate opens, so a pull keeps its meaning: no KV is touched before
the pull. A queued launch that must not copy (the prepared pull was replaced, the driver
closes, the pull never came in time) is *disarmed*: the run lengths of its table in the
pinned upload buffer are zeroed, then the gate is opened, so the graph runs and moves
nothing (every kernel reads a piece's length from the table before its loads and stores:
`kernels.copy_compact`, `triton_loop`). A gate is never held longer than `hold_s`: a
watchdog thread disarms it, because anything in the process that waits for the whole device
(`torch.cuda.synchronize()`, a `cudaFree`) waits for the gated stream too.

`GateKeeper` is that logic, over a `Doorbell` (`CudaDoorbell` on the GPU; the CPU tests give
it one that runs queued work when it is rung).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import structlog

log = structlog.get_logger(__name__)

HOLD_S = 0.05  # the longest a queued launch waits for its pull before it is disarmed
GATE_ENV = "BEAMSERVE_KV_LOCAL_GATE"  # 0: no gate (a pull replays its graph itself)
HOLD_ENV = "BEAMSERVE_KV_LOCAL_GATE_HOLD_MS"
_MASK = 0xFFFFFFFF
_WAIT_VALUE_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: (int32)(*addr - value) >= 0, wrap-safe


class GateError(RuntimeError):
    """The gate could not be set up or queued (no stream memory operations here)."""


class Doorbell(Protocol):
    def wait_on(self, stream: Any, value: int) -> None:
        """Queue on `stream`: wait until the word reaches `value` (wrap-safe ≥)."""

    def ring(self, value: int) -> None:
        """Store `value` into the word."""


def gate_settings() -> tuple[bool, float]:
    """(gate on, hold seconds) from the environment; a bad value raises `ValueError` naming
    the variable and what it takes."""
    raw = os.environ.get(GATE_ENV, "1").strip()
    if raw not in ("0", "1"):
        raise ValueError(f"{GATE_ENV}: {raw!r} unsupported; choose 0 or 1")
    hold = os.environ.get(HOLD_ENV, "").strip()
    if not hold:
        return raw == "1", HOLD_S
    try:
        ms = float(hold)
    except ValueError:
        ms = -1.0
    if not 0 < ms <= 10_000:
        raise ValueError(f"{HOLD_ENV}: {hold!r}; give milliseconds, above 0 and at most 10000")
    return raw == "1", ms / 1e3


@dataclass
class Armed:
    """One queued launch: the gate value it waits for, the words of the upload buffer that
    hold its run lengths (`lengths`: [start, stop)), and how to wait for it to finish."""

    value: int
    lengths: tuple[int, int]
    finished: Callable[[], None]
    at: float  # time.monotonic() when queued


class GateKeeper:
    """At most one queued launch at a time, released by `open` or disarmed (see module).

    `host` returns the pinned upload buffer (as numpy words) at the time of a disarm. Thread
    safe: the pull's `open` and the watchdog's disarm race under one lock, and whichever comes
    second finds nothing armed (`open` then returns None: the pull launches by itself)."""

    def __init__(self, bell: Doorbell, host: Callable[[], Any], hold_s: float = HOLD_S) -> None:
        self._bell, self._host, self.hold_s = bell, host, hold_s
        self._value = 0
        self._lock = threading.Lock()
        self._armed: Armed | None = None
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self._watchdog: threading.Thread | None = None
        self.opened = self.disarmed = self.expired = 0
        ref = weakref.ref(self)
        atexit.register(_close_at_exit, ref)  # a stream must not stay held as the process ends

    @property
    def armed(self) -> Armed | None:
        return self._armed

    def arm(
        self,
        stream: Any,
        lengths: tuple[int, int],
        enqueue: Callable[[], None],
        finished: Callable[[], None],
    ) -> int:
        """Queue a wait on `stream`, then `enqueue()` (the launch, on that stream); returns
        the value that opens it. Disarms a launch still queued first."""
        self.disarm()
        with self._lock:
            if self._closed:
                raise GateError("gate: closed")
            value = (self._value + 1) & _MASK
            self._bell.wait_on(stream, value)
            self._value = value
            try:
                enqueue()
            except BaseException:
                self._bell.ring(value)  # nothing may stay queued behind a gate no one opens
                raise
            self._armed = Armed(value, lengths, finished, time.monotonic())
            self._ensure_watchdog()
            self._wake.notify_all()
        return value

    def open(self, value: int) -> Armed | None:
        """Release the launch queued under `value`; None if it is not the one queued (it was
        disarmed meanwhile, or another replaced it): the caller launches by itself."""
        with self._lock:
            a = self._armed
            if a is None or a.value != value:
                return None
            self.opened += 1
            self._armed = None
            self._bell.ring(a.value)
            return a

    def disarm(self, *, expired: bool = False) -> bool:
        """Make the queued launch (if any) copy nothing, release it and wait for it to end.
        Returns whether one was queued."""
        with self._lock:
            a = self._armed
            if a is None:
                return False
            host = self._host()
            lo, hi = a.lengths
            host[lo:hi] = 0  # before the ring: the graph uploads the table after the gate
            self.disarmed += 1
            self.expired += int(expired)
            self._armed = None
            self._bell.ring(a.value)
        a.finished()
        if expired:
            log.info("kv_local_gate_expired", held_ms=round((time.monotonic() - a.at) * 1e3, 2))
        return True

    def close(self) -> None:
        self.disarm()
        with self._lock:
            self._closed = True
            self._wake.notify_all()
        t = self._watchdog
        if t is not None and t is not threading.current_thread():
            t.join(timeout=5.0)

    def _ensure_watchdog(self) -> None:
        if self._watchdog is None or not self._watchdog.is_alive():
            self._watchdog = threading.Thread(target=self._watch, name="kv-gate", daemon=True)
            self._watchdog.start()

    def _watch(self) -> None:
        while True:
            with self._lock:
                while not self._closed and self._armed is None:
                    self._wake.wait()
                if self._closed:
                    return
                a = self._armed
                assert a is not None
                left = a.at + self.hold_s - time.monotonic()
                if left > 0:
                    self._wake.wait(left)
                    continue
            self.disarm(expired=True)


def _close_at_exit(ref: weakref.ReferenceType[GateKeeper]) -> None:
    keeper = ref()
    if keeper is not None:
        try:
            keeper.close()
        except Exception:  # the CUDA runtime may already be going away
            pass


class CudaDoorbell:
    """`cuStreamWaitValue32` on one word of pinned host memory (through the CUDA driver
    library; every CUDA 12 device supports 32-bit stream memory waits)."""

    def __init__(self, torch: Any, device: int) -> None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise GateError(f"gate: no CUDA driver library ({exc})") from exc
        fn = getattr(lib, "cuStreamWaitValue32_v2", None) or getattr(
            lib, "cuStreamWaitValue32", None
        )
        if fn is None:
            raise GateError("gate: this CUDA driver has no cuStreamWaitValue32")
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        fn.restype = ctypes.c_int
        self._wait = fn
        torch.cuda.set_device(device)
        self._word = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        self._np: Any = self._word.numpy().view(np.uint32)
        dptr = ctypes.c_uint64(0)
        get = getattr(lib, "cuMemHostGetDevicePointer_v2", None)
        rc = -1
        if get is not None:
            get.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
            get.restype = ctypes.c_int
            rc = get(ctypes.byref(dptr), ctypes.c_void_p(self._word.data_ptr()), 0)
        # Unified addressing: a pinned host pointer is also its device pointer.
        self._addr = int(dptr.value) if rc == 0 else int(self._word.data_ptr())

    def wait_on(self, stream: Any, value: int) -> None:
        rc = self._wait(
            ctypes.c_void_p(int(stream.cuda_stream)), self._addr, value, _WAIT_VALUE_GEQ
        )
        if rc != 0:
            raise GateError(f"gate: cuStreamWaitValue32 returned CUDA error {rc}")

    def ring(self, value: int) -> None:
        self._np[0] = value
