"""The `cma` backend's own behaviour (its transfers between rank processes run in the shared
integration and fault tests, `BACKENDS`): batching 1024 descriptors a system call, chunked
polls, zero-length descriptors, and the refusals at `connect` (another host, unreadable
metadata, a process that is gone)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from beamserve.kv_transfer.backends.base import ReadOp, XferState, make_agent
from beamserve.kv_transfer.backends.cma import IOV_MAX, CmaAgent
from beamserve.kv_transfer.errors import PeerLostError, TransferPlanError
from hypothesis import given, settings
from hypothesis import strategies as st


def pair(src_bytes: int, dst_bytes: int, chunk_bytes: int = 64 << 20):
    rng = np.random.default_rng(1)
    src = rng.integers(0, 256, src_bytes, dtype=np.uint8)
    dst = np.zeros(dst_bytes, np.uint8)
    a, b = CmaAgent("src"), CmaAgent("dst", chunk_bytes=chunk_bytes)
    info = a.register(src)
    b.register(dst)
    return a, b, info, src, dst


def test_many_descriptors_go_1024_to_a_call_and_land_byte_for_byte() -> None:
    n, size = 3000, 256
    _a, b, info, src, dst = pair(n * size, n * size)
    perm = np.random.default_rng(2).permutation(n)
    op = ReadOp(info, np.arange(n) * size, perm * size, np.full(n, size))
    assert b.read_all([op], deadline=float("inf")) == n * size
    assert np.array_equal(dst.reshape(n, size), src.reshape(n, size)[perm])
    assert b.calls == -(-n // IOV_MAX)  # 3 calls, not 3,000
    assert b.stats().live_transfers == 0


def test_a_read_past_chunk_bytes_takes_several_polls_and_skips_empty_descriptors() -> None:
    _a, b, info, src, dst = pair(1 << 20, 1 << 20, chunk_bytes=64 << 10)
    lengths = np.array([0, 256 << 10, 0, 512 << 10, 256 << 10])
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    xid = b.post_read(ReadOp(info, starts, starts, lengths))
    states = []
    while (s := b.poll(xid)) is not XferState.DONE:
        assert s is XferState.PROC
        states.append(s)
    b.release(xid)
    # chunks of whole descriptors: one poll for each of the three, the last says DONE
    assert len(states) == 2 and b.calls == 3
    assert np.array_equal(dst, src)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4095), st.integers(0, 300)), max_size=40))
def test_any_descriptor_list_reads_what_a_numpy_copy_would(
    descs: list[tuple[int, int]],
) -> None:
    """Remote starts and lengths at random (zero-length ones included), destinations packed one
    after another, chunks far smaller than the read: the result is the numpy copy's."""
    _a, b, info, src, dst = pair(4096, 40 * 300, chunk_bytes=700)
    remote = np.array([r for r, _ in descs], np.int64)
    lengths = np.array([min(n, 4096 - r) for r, n in descs], np.int64)
    local = (np.cumsum(lengths) - lengths).astype(np.int64)
    want = dst.copy()
    for lo, r, n in zip(local, remote, lengths, strict=True):
        want[lo : lo + n] = src[r : r + n]
    b.read_all([ReadOp(info, local, remote, lengths)], deadline=float("inf"))
    assert np.array_equal(dst, want)


def test_a_peer_on_another_host_or_with_unreadable_metadata_is_refused() -> None:
    _a, b, info, _, _ = pair(4096, 4096)
    other = dataclasses.replace(
        info, metadata=json.dumps({"pid": os.getpid(), "boot_id": "another-boot"}).encode()
    )
    with pytest.raises(TransferPlanError, match=r"another host.*nixl"):
        b.connect(other)
    with pytest.raises(TransferPlanError, match="cma metadata"):
        b.connect(dataclasses.replace(info, name="x", metadata=b"{}"))
    with pytest.raises(TransferPlanError, match="speaks cma"):
        make_agent("nixl", "n").connect(info)


def test_a_process_that_is_gone_is_a_lost_peer() -> None:
    _a, b, info, _, _ = pair(4096, 4096)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    pid = int(gone.stdout)
    doc = json.loads(info.metadata)
    dead = dataclasses.replace(info, name="dead", metadata=json.dumps({**doc, "pid": pid}).encode())
    with pytest.raises(PeerLostError, match=f"pid {pid}"):
        b.connect(dead)
    assert b.stats().peers == 0
