"""The staged path for real: rank processes, staging pools, the HTTP stage calls, NIXL/Mooncake.

Each pull is checked byte for byte on the decode ranks (`verify`), its wire bytes against
`bytes_minimum`, its wire descriptors against the staged plan, and afterwards every staging
pool on both sides must be empty again: on success, and when a peer is killed while a staging
buffer is held (the pull ends with `PeerLostError`, never a hang or a leak).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from beamserve.kv_transfer.backends.base import BACKENDS
from beamserve.kv_transfer.cost import TransferPath
from beamserve.kv_transfer.errors import IncompatiblePeerError, PeerLostError
from beamserve.kv_transfer.handshake import (
    DecodeKVClient,
    HandshakeServer,
    PrefillKVRegistry,
    StageRequest,
    StageResponse,
    build_handshake_app,
)
from beamserve.kv_transfer.plan import bytes_minimum
from beamserve.kv_transfer.rank import RankGroup
from beamserve.kv_transfer.staging import stage_plan
from beamserve.kv_transfer.topology import (
    PoolLayout,
    PoolTopology,
    RequestPages,
    first_window_page,
    pages_needed,
)

from tests.kv_transfer.small_model import beam_small

pytestmark = pytest.mark.integration

MODEL = beam_small(head_dim=8)
PAGE = 16
SEQ_LEN = 1500
STAGING = 256 << 10  # per rank: small, so a pull takes several rounds
CHUNK = 64 << 10
SEED, SENTINEL, GARBAGE = 3, 0x51, 0xBAD
DEADLINE_S = 30.0


def layout(tp: int) -> PoolLayout:
    n_full = pages_needed(SEQ_LEN, PAGE)
    return PoolLayout(MODEL, PoolTopology(tp, PAGE), n_full + 20, 8)


def pages(lay: PoolLayout, rng: np.random.Generator, seq_len: int = SEQ_LEN) -> RequestPages:
    n_full = pages_needed(seq_len, PAGE)
    n_win = n_full - first_window_page(seq_len, MODEL.sliding_window, PAGE)
    return RequestPages.of(
        rng.permutation(lay.full_pages)[:n_full], rng.permutation(lay.window_pages)[:n_win]
    )


def pools_empty(group: RankGroup, dead: frozenset[int] = frozenset()) -> None:
    ranks = [r for r in range(group.size) if r not in dead]
    for r, s in zip(ranks, group.call(ranks, "pool_stats", lambda _r: (), 10.0), strict=True):
        assert s.in_use_bytes == 0 and s.buffers_in_use == 0, f"{group.group} rank {r}: {s}"
        assert s.allocations == s.releases, f"{group.group} rank {r}: {s}"


class Rig:
    def __init__(
        self,
        backend: str,
        src_tp: int,
        dst_tp: int,
        client_cls: type[DecodeKVClient] = DecodeKVClient,
        staging: tuple[int, int] = (STAGING, STAGING),
    ) -> None:
        self.backend = backend
        self.src, self.dst = layout(src_tp), layout(dst_tp)
        self.prefill = RankGroup("prefill", self.src, backend, staging_bytes=staging[0])
        self.decode = RankGroup("decode", self.dst, backend, staging_bytes=staging[1])
        self.registry = PrefillKVRegistry(
            "prefill-0",
            self.src,
            backend,
            self.prefill.infos,
            stager=self.prefill if staging[0] else None,
            staging_bytes=staging[0],
        )
        self.server = HandshakeServer(build_handshake_app(self.registry))
        # Through the ranks: these tests are of the staged and direct paths (the host-local
        # driver, where shm would take it, has its own: test_shm.py).
        self.client = client_cls(self.decode, chunk_bytes=CHUNK, driver="ranks")
        self.prefill.call_all("fill_random", GARBAGE)
        self.rng = np.random.default_rng([src_tp, dst_tp])
        self.n = 0

    def request(self) -> tuple[str, int, RequestPages, RequestPages]:
        self.n += 1
        rid, seed = f"req-{self.n}", SEED + self.n
        sp, dp = pages(self.src, self.rng), pages(self.dst, self.rng)
        self.prefill.call_all("write_request", SEQ_LEN, sp, seed)
        self.decode.call_all("fill_random", SENTINEL)
        self.registry.publish(rid, SEQ_LEN, sp)
        return rid, seed, sp, dp

    def close(self, dead_prefill: frozenset[int] = frozenset()) -> None:
        self.client.close()
        self.server.stop()
        for group in (self.decode, self.prefill):
            group.close(timeout_s=10)
        assert self.registry.held() == []


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def rig_4_2(backend: str) -> Iterator[Rig]:
    rig = Rig(backend, 4, 2)
    yield rig
    rig.close()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("path", [TransferPath.STAGED, TransferPath.DIRECT, TransferPath.AUTO])
def test_pull_by_each_path_moves_exact_bytes(rig_4_2: Rig, path: TransferPath) -> None:
    rig = rig_4_2
    rid, seed, _sp, dp = rig.request()
    res = rig.client.pull(rig.server.url, rid, dp, DEADLINE_S, path=path)

    assert res.bytes_moved == bytes_minimum(rig.dst, SEQ_LEN) == res.plan.bytes_moved
    staged = stage_plan(res.plan, CHUNK, STAGING, STAGING)
    if path is TransferPath.AUTO:
        assert res.choice is not None and res.choice.path is res.path
    if res.path is TransferPath.STAGED:
        assert res.descriptors_on_wire == len(staged.chunks) < res.plan.descriptors
        assert res.rounds == staged.rounds > 1  # the small pools force several rounds
        assert res.staging_bytes == staged.staging_bytes > 0
        assert res.gather_ms > 0 and res.transfer_ms > 0 and res.scatter_ms > 0
    else:
        assert res.descriptors_on_wire == res.plan.descriptors
        assert res.staging_bytes == 0
    for r, v in enumerate(rig.decode.call_all("verify", SEQ_LEN, dp, seed, SENTINEL)):
        assert v.ok, f"{path} decode rank {r}: {v}"
    assert rig.registry.held() == []
    pools_empty(rig.prefill)
    pools_empty(rig.decode)


@pytest.mark.timeout(180)
def test_fewer_source_ranks_than_destination(backend: str) -> None:
    rig = Rig(backend, 1, 2)
    try:
        rid, seed, _sp, dp = rig.request()
        res = rig.client.pull(rig.server.url, rid, dp, DEADLINE_S, path=TransferPath.STAGED)
        assert res.path is TransferPath.STAGED
        assert res.bytes_moved == bytes_minimum(rig.dst, SEQ_LEN)
        for r, v in enumerate(rig.decode.call_all("verify", SEQ_LEN, dp, seed, SENTINEL)):
            assert v.ok, f"decode rank {r}: {v}"
        pools_empty(rig.prefill)
        pools_empty(rig.decode)
    finally:
        rig.close()


@pytest.mark.timeout(120)
def test_staged_needs_pools_on_both_sides(backend: str) -> None:
    rig = Rig(backend, 2, 1, staging=(0, STAGING))
    try:
        rid, seed, _sp, dp = rig.request()
        with pytest.raises(IncompatiblePeerError, match="--staging-bytes"):
            rig.client.pull(rig.server.url, rid, dp, DEADLINE_S, path=TransferPath.STAGED)
        assert rig.registry.held() == []
        rid, seed, _sp, dp = rig.request()
        res = rig.client.pull(rig.server.url, rid, dp, DEADLINE_S, path=TransferPath.AUTO)
        assert res.path is TransferPath.DIRECT
        assert all(v.ok for v in rig.decode.call_all("verify", SEQ_LEN, dp, seed, SENTINEL))
    finally:
        rig.close()


class KillAfterStage(DecodeKVClient):
    """Kills a rank right after prefill has gathered a round into its staging buffers (the
    buffers are held), before decode reads them."""

    victim: tuple[RankGroup, int] | None = None
    watch: RankGroup | None = None  # whose staging pools to sample just before the kill
    held_at_kill: tuple[Any, ...] = ()

    def _stage(self, url: str, request_id: str, body: StageRequest, end: float) -> StageResponse:
        resp = super()._stage(url, request_id, body, end)
        if self.victim is not None:
            group, rank = self.victim
            if self.watch is not None:
                self.held_at_kill = tuple(self.watch.call_all("pool_stats", timeout_s=10.0))
            group.kill(rank)
            self.victim = None
        return resp


@pytest.mark.timeout(180)
def test_prefill_rank_killed_while_its_staging_is_held(backend: str) -> None:
    rig = Rig(backend, 2, 1, client_cls=KillAfterStage)
    try:
        rid, _seed, _sp, dp = rig.request()
        assert isinstance(rig.client, KillAfterStage)
        rig.client.victim, rig.client.watch = (rig.prefill, 0), rig.prefill
        with pytest.raises(PeerLostError):
            rig.client.pull(rig.server.url, rid, dp, DEADLINE_S, path=TransferPath.STAGED)
        # The victim held staging when it died; decode's own staging buffers went back to its
        # pool; prefill's live rank gave its back; the lease is gone.
        assert rig.client.held_at_kill[0].in_use_bytes > 0
        pools_empty(rig.decode)
        assert rig.decode.call_all("pool_stats")[0].allocations > 0  # decode did stage
        pools_empty(rig.prefill, dead=frozenset({0}))
        assert rig.registry.held() == []
        assert rig.decode.call_all("stats")[0].live_transfers == 0
    finally:
        rig.close()


@pytest.mark.timeout(180)
def test_decode_rank_killed_while_prefill_staging_is_held(backend: str) -> None:
    rig = Rig(backend, 2, 2, client_cls=KillAfterStage)
    try:
        rid, _seed, _sp, dp = rig.request()
        assert isinstance(rig.client, KillAfterStage)
        rig.client.victim, rig.client.watch = (rig.decode, 1), rig.prefill
        with pytest.raises(PeerLostError):
            rig.client.pull(rig.server.url, rid, dp, DEADLINE_S, path=TransferPath.STAGED)
        # Prefill held staging buffers when the decode rank died, and has them all back.
        assert sum(s.in_use_bytes for s in rig.client.held_at_kill) > 0
        pools_empty(rig.prefill)
        pools_empty(rig.decode, dead=frozenset({1}))
        assert rig.registry.held() == []
    finally:
        rig.close()


@pytest.mark.timeout(180)
def test_prefill_plans_once_per_request_and_stage_calls_only_gather(
    rig_4_2: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The decode side's stage-plan request makes prefill plan (once); the stage calls of the
    later rounds find the plan with the lease and only gather."""
    import threading

    from beamserve.kv_transfer import handshake

    rig = rig_4_2
    calls: list[str] = []
    real = handshake.plan_transfer

    def counting(*args: Any, **kw: Any) -> Any:
        calls.append(threading.current_thread().name)
        return real(*args, **kw)

    monkeypatch.setattr(handshake, "plan_transfer", counting)
    prepared: list[float] = []
    real_prepare = rig.registry.prepare

    def prepare(request_id: str, req: StageRequest) -> Any:
        out = real_prepare(request_id, req)
        prepared.append(out.plan_s)
        return out

    monkeypatch.setattr(rig.registry, "prepare", prepare)
    rid, seed, _sp, dp = rig.request()
    res = rig.client.pull(rig.server.url, rid, dp, DEADLINE_S, path=TransferPath.STAGED)
    assert res.path is TransferPath.STAGED and res.rounds > 1
    # One plan here (the pull's thread) and one on prefill, made by stage-plan, not by a stage.
    assert len(calls) == 2, calls
    assert len(prepared) == 1 and prepared[0] > 0
    for v in rig.decode.call_all("verify", SEQ_LEN, dp, seed, SENTINEL):
        assert v.ok
    # `auto` sends no stage-plan (the cost model mostly picks direct): prefill plans only if a
    # stage call comes, once.
    rid, seed, _sp, dp = rig.request()
    res = rig.client.pull(rig.server.url, rid, dp, DEADLINE_S, path=TransferPath.AUTO)
    assert len(prepared) == 1
    assert len(calls) == (4 if res.path is TransferPath.STAGED else 3), calls
    for v in rig.decode.call_all("verify", SEQ_LEN, dp, seed, SENTINEL):
        assert v.ok
    pools_empty(rig.prefill)
    pools_empty(rig.decode)


@pytest.mark.timeout(60)
def test_stage_with_another_digest_is_refused_before_planning(
    rig_4_2: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    import httpx
    from beamserve.kv_transfer import handshake

    rig = rig_4_2
    rid, _seed, _sp, dp = rig.request()
    monkeypatch.setattr(
        handshake, "plan_transfer", lambda *a, **k: pytest.fail("planned for a wrong digest")
    )
    body = rig.client._stage_body(dp, "0" * 16, 0).model_dump()
    for path in ("stage-plan", "stage"):
        r = httpx.post(f"{rig.server.url}/kv/v1/requests/{rid}/{path}", json=body, timeout=10)
        assert r.status_code == 409 and "staged plans differ" in r.json()["detail"], r.text
    rig.registry.release(rid)
    pools_empty(rig.prefill)
