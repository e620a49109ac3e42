"""A prefill worker killed mid-transfer: the decode worker recomputes, counts it, still answers.

The prefill worker process is armed to SIGKILL itself 50 ms after serving the request's page
table (the decode side then holds the page table and has begun the transfer); the decode
side's reads are held back 0.5 s (an injected slow link), so they always reach a dead peer.
A second request, published before the death, finds the prefill worker gone at the handshake.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from beamserve.kv_transfer.backends.base import BACKENDS
from beamserve.workers.ref.check import build_cases, worker_pair
from beamserve.workers.ref.checkpoint import make_tiny
from beamserve.workers.ref.worker import DecodeResult, DecodeStats, PoolSpec

pytestmark = pytest.mark.integration

TOKENS = 8
DEADLINE_S = 20.0
DETECT_S = 6.0  # a dead peer must surface well inside the deadline


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("ckpt") / "tiny", seed=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_killed_mid_transfer_decode_recomputes(tiny: Path, backend: str) -> None:
    a, b, c = build_cases(tiny, 3, TOKENS, system_prompt=None)[:3]
    with worker_pair(tiny, PoolSpec(2, backend), PoolSpec(1, backend)) as (pw, dw):
        url = pw.info["url"]
        pa = pw.call("prefill", "a", list(a.token_ids))
        pc = pw.call("prefill", "c", list(c.token_ids))
        da: DecodeResult = dw.call(
            "generate", "a", url, list(a.token_ids), pa.first_token, TOKENS, DEADLINE_S
        )
        assert da.source == "transfer" and da.tokens == list(a.expected)

        pb = pw.call("prefill", "b", list(b.token_ids), 0.05)  # dies after b's page table
        db: DecodeResult = dw.call(
            "generate", "b", url, list(b.token_ids), pb.first_token, TOKENS, DEADLINE_S, 0.5
        )
        assert db.source == "recompute", db
        assert db.error and db.error.split(":")[0] in ("PeerLostError", "TransferTimeoutError")
        assert db.tokens == list(b.expected)
        assert db.deadline_met and db.seconds < 0.5 + DETECT_S, db.seconds
        end = time.monotonic() + 5
        while pw.alive and time.monotonic() < end:
            time.sleep(0.05)
        assert pw.exitcode == -signal.SIGKILL

        dc: DecodeResult = dw.call(
            "generate", "c", url, list(c.token_ids), pc.first_token, TOKENS, DEADLINE_S
        )
        assert dc.source == "recompute" and dc.error and dc.error.startswith("PeerLostError")
        assert dc.tokens == list(c.expected) and dc.seconds < DETECT_S

        stats: DecodeStats = dw.call("stats")
        assert (stats.requests, stats.transfers, stats.recompute_fallbacks) == (3, 1, 2)
        assert dw.alive
