"""The gate of a launch queued ahead (`kv_transfer/gate.py`) on the CPU.

On the GPU a `CudaDoorbell` holds a CUDA stream behind a wait on pinned host memory and the
queued work is a graph replay (test_gpu.py). Here the stream is a list of queued work that runs
when the doorbell is rung, and the queued work plays what the graph does: it uploads the table
*as the host buffer holds it when the work runs* (the graph's upload node comes after the
gate), then `NumpyEngine` plays the kernel's table over host regions. What is tested is the
gate's contract: nothing copies before `open`; a disarmed launch copies nothing; the watchdog
disarms a launch held too long; at most one is queued and none is left blocked.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from beamserve.kv_transfer import gate
from beamserve.kv_transfer.compact import KernelTables
from beamserve.kv_transfer.host_local import NumpyEngine
from beamserve.kv_transfer.memory import Buffer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.kv_transfer.test_host_local import Pools, make_pools


class FakeStream:
    """Queued work in order; a wait blocks everything behind it until the word reaches it."""

    def __init__(self) -> None:
        self.items: list[Any] = []
        self.word = 0
        self.lock = threading.Lock()

    def run(self) -> None:
        with self.lock:
            while self.items:
                head = self.items[0]
                if isinstance(head, int):
                    if ((self.word - head) & 0xFFFFFFFF) >= 1 << 31:  # (int32)(word - v) < 0
                        return
                    self.items.pop(0)
                    continue
                self.items.pop(0)
                head()

    @property
    def blocked(self) -> bool:
        return bool(self.items)


class FakeBell:
    def __init__(self, *streams: FakeStream) -> None:
        self.streams, self.waits = list(streams), 0

    def wait_on(self, stream: FakeStream, value: int) -> None:
        self.waits += 1
        stream.items.append(value)
        stream.run()

    def ring(self, value: int) -> None:
        for s in self.streams:
            s.word = value
            s.run()


class Rig:
    """One request's regions, its bound table in a host 'upload buffer', a gate over it."""

    def __init__(self, pools: Pools, hold_s: float = 10.0) -> None:
        self.pools = pools
        self.t: KernelTables = pools.tables()
        self.regions: list[Buffer] = pools.src_bufs + pools.dst_bufs
        self.base = min(self.regions, key=lambda b: b.addr)
        self.host = np.zeros(len(self.t.table) + 64, dtype=np.int64)
        self.stream = FakeStream()
        self.bell = FakeBell(self.stream)
        self.keeper = gate.GateKeeper(self.bell, lambda: self.host, hold_s)
        self.copies = 0
        self.dst_before = [b.data.copy() for b in pools.dst_bufs]

    def bind(self) -> Any:
        view = self.host[: len(self.t.table)]
        return self.t.bind(
            [b.addr for b in self.pools.src_bufs],
            [b.addr for b in self.pools.dst_bufs],
            self.base.addr,
            out=view,
        )

    def arm(self, on_run: Callable[[], None] | None = None) -> int:
        self.keeper.disarm()  # as the engine's `upload_buffer`: before the table is rebound
        table = self.bind()
        lengths = (int(table[4]), len(table))

        def work() -> None:  # what the graph does once the gate opens: upload, then copy
            uploaded = self.host[: len(self.t.table)].copy()
            NumpyEngine().launch(self.t, uploaded, self.regions, self.base)
            self.copies += 1
            if on_run is not None:
                on_run()

        def enqueue() -> None:
            self.stream.items.append(work)

        return self.keeper.arm(self.stream, lengths, enqueue, self.finished)

    def finished(self) -> None:
        assert not self.stream.blocked, "a released launch did not run"

    def untouched(self) -> bool:
        return all(
            np.array_equal(b.data, before)
            for b, before in zip(self.pools.dst_bufs, self.dst_before, strict=True)
        )


def test_nothing_is_copied_before_the_gate_opens_and_the_request_after() -> None:
    rig = Rig(make_pools(seed=3))
    value = rig.arm()
    assert rig.stream.blocked and rig.keeper.armed is not None
    assert rig.untouched()  # queued, not run: no KV read before the pull
    assert rig.keeper.open(value) is not None
    assert not rig.stream.blocked and rig.copies == 1
    assert rig.pools.verify()
    assert rig.keeper.armed is None and rig.keeper.opened == 1
    rig.keeper.close()


def test_a_disarmed_launch_runs_and_copies_nothing() -> None:
    rig = Rig(make_pools(seed=4))
    value = rig.arm()
    assert rig.keeper.disarm()
    assert rig.copies == 1 and not rig.stream.blocked  # released: nothing stays held
    assert rig.untouched()
    lo = int(rig.t.table[4])
    assert not rig.host[lo : len(rig.t.table)].any()  # its run lengths were zeroed
    assert rig.keeper.open(value) is None  # the pull finds it gone and launches by itself
    assert not rig.keeper.disarm()  # nothing queued any more
    rig.keeper.close()


def test_arming_again_disarms_the_launch_still_queued() -> None:
    """One upload buffer: a new prepare may not leave the old launch to read the new table."""
    rig = Rig(make_pools(seed=5))
    first = rig.arm()
    second = rig.arm()
    assert first != second and rig.keeper.disarmed == 1 and rig.untouched()
    assert rig.keeper.open(first) is None
    assert rig.keeper.open(second) is not None
    assert rig.pools.verify()
    rig.keeper.close()


def test_a_launch_held_past_the_hold_is_disarmed_by_the_watchdog() -> None:
    rig = Rig(make_pools(seed=6), hold_s=0.02)
    value = rig.arm()
    deadline = time.monotonic() + 5.0
    while rig.keeper.armed is not None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert rig.keeper.armed is None and rig.keeper.expired == 1
    assert not rig.stream.blocked and rig.untouched()
    assert rig.keeper.open(value) is None
    rig.keeper.close()


def test_a_failing_enqueue_leaves_nothing_held() -> None:
    rig = Rig(make_pools(seed=7))

    def broken() -> None:
        raise RuntimeError("capture failed")

    with pytest.raises(RuntimeError, match="capture failed"):
        rig.keeper.arm(rig.stream, (0, 0), broken, rig.finished)
    assert rig.keeper.armed is None and not rig.stream.blocked
    rig.keeper.close()
    with pytest.raises(gate.GateError, match="closed"):
        rig.arm()


def test_values_wrap_around_the_32_bit_word() -> None:
    rig = Rig(make_pools(seed=8))
    rig.keeper._value = 0xFFFFFFFF - 1
    rig.stream.word = 0xFFFFFFFF - 1
    v1 = rig.arm()
    assert rig.keeper.open(v1) is not None
    v2 = rig.arm()
    assert v2 == 0 and rig.stream.blocked  # 0 after 0xFFFFFFFF: still "not reached"
    assert rig.keeper.open(v2) is not None and not rig.stream.blocked
    assert rig.pools.verify()
    rig.keeper.close()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(["arm", "open", "open-stale", "disarm"]), max_size=12))
def test_random_sequences_keep_the_gates_books(ops: list[str]) -> None:
    """Whatever the order of prepares, pulls and disarms: at most one launch queued, the
    stream blocked exactly while one is, every opened launch copies its request, every
    disarmed one copies nothing, and closing leaves nothing held."""
    rig = Rig(make_pools(seed=9))
    values: list[int] = []
    opened = 0
    for op in ops:
        if op == "arm":
            values.append(rig.arm())
        elif op == "open" and values:
            if rig.keeper.open(values[-1]) is not None:
                opened += 1
        elif op == "open-stale" and len(values) > 1:
            assert rig.keeper.open(values[-2]) is None  # replaced long ago
        elif op == "disarm":
            rig.keeper.disarm()
        assert rig.stream.blocked == (rig.keeper.armed is not None)
    rig.keeper.close()
    assert not rig.stream.blocked and rig.keeper.armed is None
    assert rig.keeper.opened == opened
    assert rig.copies == rig.keeper.opened + rig.keeper.disarmed == len(values)
    assert rig.pools.verify() == (opened > 0)


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"BEAMSERVE_KV_LOCAL_GATE": "yes"}, "BEAMSERVE_KV_LOCAL_GATE.*choose 0 or 1"),
        ({"BEAMSERVE_KV_LOCAL_GATE_HOLD_MS": "0"}, "BEAMSERVE_KV_LOCAL_GATE_HOLD_MS.*milliseconds"),
        ({"BEAMSERVE_KV_LOCAL_GATE_HOLD_MS": "soon"}, "BEAMSERVE_KV_LOCAL_GATE_HOLD_MS"),
    ],
)
def test_bad_gate_settings_name_the_variable(
    env: dict[str, str], match: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=match):
        gate.gate_settings()


def test_gate_settings_default_and_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BEAMSERVE_KV_LOCAL_GATE", raising=False)
    monkeypatch.delenv("BEAMSERVE_KV_LOCAL_GATE_HOLD_MS", raising=False)
    assert gate.gate_settings() == (True, gate.HOLD_S)
    monkeypatch.setenv("BEAMSERVE_KV_LOCAL_GATE", "0")
    monkeypatch.setenv("BEAMSERVE_KV_LOCAL_GATE_HOLD_MS", "250")
    assert gate.gate_settings() == (False, 0.25)
