"""Disaggregated greedy decoding == colocated, exactly, across TP pairs and both backends.

A prefill worker process and a decode worker process (each with one NIXL or Mooncake agent per
TP shard) serve every request through the real HTTP handshake; the colocated reference is one
model instance in this process, one uninterrupted greedy loop. The worker processes are reused
across pairs (re-sharded per pair: fresh regions, agents and handshake server) to keep the
test fast; `beamserve check disagg` (test_ref_cli.py) runs fresh processes per pair.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from beamserve.kv_transfer.backends.base import BACKENDS
from beamserve.workers.ref.check import Case, build_cases, run_check
from beamserve.workers.ref.checkpoint import make_tiny

pytestmark = pytest.mark.integration

PAIRS = [(1, 1), (2, 1), (1, 2), (4, 2), (2, 4)]
TOKENS = 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("ckpt") / "tiny", seed=0)


@pytest.fixture(scope="module")
def cases(tiny: Path) -> list[Case]:
    # Two chat prompts (~70–105 tokens, longer than the 32-token window) and a follow-up turn.
    return build_cases(tiny, 2, TOKENS, system_prompt=None)


def test_cases_exercise_both_kv_lifetimes(cases: list[Case]) -> None:
    assert [c.follow_up for c in cases] == [False, False, True]
    assert all(40 <= len(c.token_ids) <= 130 for c in cases)
    assert all(len(c.expected) == TOKENS for c in cases)
    turn2 = cases[-1]
    assert turn2.token_ids[: len(cases[0].token_ids)] == cases[0].token_ids


@pytest.mark.parametrize("backend", BACKENDS)
def test_disaggregated_equals_colocated(tiny: Path, cases: list[Case], backend: str) -> None:
    results = run_check(tiny, PAIRS, backend, cases, TOKENS, reuse_workers=True)
    assert [(r.prefill_tp, r.decode_tp) for r in results] == PAIRS
    for r in results:
        assert not r.problems, (r.pair, r.problems)
        assert r.equal == r.requests == len(cases), r.pair
        assert r.fallbacks == 0, r.pair
        assert r.bytes_moved == r.bytes_minimum > 0, r.pair
        # the follow-up turn resumed the first prompt's full blocks from the prefix cache
        assert r.reused_tokens == len(cases[0].token_ids) // 16 * 16, r.pair
        assert r.ok
