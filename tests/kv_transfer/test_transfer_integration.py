"""End to end: real rank processes (one per TP rank) on both sides, the real HTTP handshake and
real NIXL (UCX) / Mooncake (TCP) reads, every destination byte compared afterwards.

Prefill regions start as seeded garbage, decode regions as a seeded sentinel; page tables are
random and non-contiguous. After a pull, `verify` on each decode rank checks that the bytes
the request needs equal the logical KV (an independent pure function of seed, layer, K/V, head
and token) and that every other byte still holds the sentinel.

Rank groups are expensive to spawn (~1 s each), so each backend keeps a small LRU of groups
across the module; groups leaving the cache, and all of them at the end, are closed and must
report nothing registered, no live transfer and no connected peer.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from beamserve.kv_transfer.backends.base import BACKENDS, AgentStats
from beamserve.kv_transfer.handshake import (
    DecodeKVClient,
    HandshakeServer,
    PrefillKVRegistry,
    build_handshake_app,
    published_checksums,
)
from beamserve.kv_transfer.plan import bytes_minimum
from beamserve.kv_transfer.rank import RankGroup
from beamserve.kv_transfer.topology import (
    KVDtype,
    KVLayout,
    PoolLayout,
    PoolTopology,
    RequestPages,
    first_window_page,
    pages_needed,
)

from tests.kv_transfer.small_model import beam_small

pytestmark = pytest.mark.integration

# Beam-shaped but small: 6 layers (full attention at 2 and 5), GQA 16/8, 32-byte rows.
MODEL = beam_small(head_dim=16)
WINDOW = MODEL.sliding_window
PAGE = 16
FULL_PAGES = 48  # room for two requests of up to 384 tokens
WINDOW_PAGES = 12  # a 48-token window spans at most 4 pages of 16
GARBAGE, SENTINEL = 0xBAD, 0x5E7
DEADLINE_S = 30.0
MAX_PROCS = 24  # rank processes the cache keeps alive at once (~65 MB each)

# (prefill TP, decode TP, verify checksums): both directions, equal sizes, and replication
# (TP 16 > 8 KV heads) on either side.
PAIRS = [
    (1, 1, True),
    (2, 1, False),
    (1, 2, True),
    (4, 2, True),
    (2, 4, False),
    (8, 2, True),
    (8, 8, False),
    (16, 4, True),
    (2, 16, True),
]
# Lengths around the sliding window (48) and page (16) boundaries.
BOUNDARY_SEQ_LENS = [0, 1, 15, 16, 17, 47, 48, 49, 63, 64, 65, 96, 97, 112, 113, 384]


def layout(
    tp: int,
    page_size: int = PAGE,
    kv_dtype: KVDtype = KVDtype.BF16,
    kv_layout: KVLayout = KVLayout.HND,
) -> PoolLayout:
    return PoolLayout(
        MODEL, PoolTopology(tp, page_size, kv_dtype, kv_layout), FULL_PAGES, WINDOW_PAGES
    )


def random_pages(
    rng: np.random.Generator,
    lay: PoolLayout,
    seq_len: int,
    avoid: RequestPages | None = None,
) -> RequestPages:
    """Random, non-contiguous page tables covering `seq_len` tokens (disjoint from `avoid`)."""
    P = lay.topology.page_size
    n_full = pages_needed(seq_len, P)
    n_win = 0 if seq_len == 0 else n_full - first_window_page(seq_len, WINDOW, P)
    full = np.setdiff1d(np.arange(lay.full_pages), [] if avoid is None else avoid.full)
    window = np.setdiff1d(np.arange(lay.window_pages), [] if avoid is None else avoid.window)
    assert n_full <= len(full) and n_win <= len(window), "test pool too small"
    return RequestPages.of(rng.permutation(full)[:n_full], rng.permutation(window)[:n_win])


def assert_closed_clean(group: RankGroup, final: list[AgentStats | None]) -> None:
    assert len(final) == group.size
    for r, stats in enumerate(final):
        assert stats is not None, f"{group.group} rank {r} did not answer close"
        assert stats.registered_regions == 0, f"{group.group} rank {r}: {stats}"
        assert stats.registered_bytes == 0, f"{group.group} rank {r}: {stats}"
        assert stats.live_transfers == 0, f"{group.group} rank {r}: {stats}"
        assert stats.peers == 0, f"{group.group} rank {r}: {stats}"
    for pid in group.pids:
        assert not _running(pid), f"{group.group}: rank process {pid} outlived close()"


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


class Pools:
    """One backend's rank groups by (role, layout), spawned on first use, kept in an LRU."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self._groups: OrderedDict[tuple[str, PoolLayout], RankGroup] = OrderedDict()

    def get(self, role: str, lay: PoolLayout) -> RankGroup:
        key = (role, lay)
        if key in self._groups:
            self._groups.move_to_end(key)
            return self._groups[key]
        need = lay.topology.tp_size
        while self._groups and self._procs() + need > MAX_PROCS:
            _, old = self._groups.popitem(last=False)
            assert_closed_clean(old, old.close())
        group = RankGroup(role, lay, self.backend)
        self._groups[key] = group
        return group

    def _procs(self) -> int:
        return sum(g.size for g in self._groups.values())

    def close_all(self) -> list[tuple[RankGroup, list[AgentStats | None]]]:
        out = []
        while self._groups:
            _, group = self._groups.popitem(last=False)
            out.append((group, group.close()))
        return out


@pytest.fixture(scope="module", params=BACKENDS)
def pools(request: pytest.FixtureRequest) -> Iterator[Pools]:
    p = Pools(request.param)
    yield p
    for group, final in p.close_all():
        assert_closed_clean(group, final)


class Endpoint:
    """A prefill registry served over real HTTP on loopback, and a decode client."""

    def __init__(self, backend: str, prefill: RankGroup, decode: RankGroup) -> None:
        self.prefill, self.decode = prefill, decode
        self.registry = PrefillKVRegistry(
            f"prefill-tp{prefill.size}", prefill.layout, backend, prefill.infos
        )
        self.server = HandshakeServer(build_handshake_app(self.registry))
        self.client = DecodeKVClient(decode, driver="ranks")  # the agents, through the ranks

    def close(self) -> None:
        self.client.close()
        self.server.stop()


def transfer_and_verify(
    ep: Endpoint,
    request_id: str,
    seq_len: int,
    src_pages: RequestPages,
    dst_pages: RequestPages,
    seed: int,
    checksums: bool,
) -> None:
    """Write the request on prefill, publish it, pull it, and check every destination byte."""
    ep.prefill.call_all("write_request", seq_len, src_pages, seed)
    sums = published_checksums(ep.prefill, seq_len, src_pages) if checksums else None
    ep.registry.publish(request_id, seq_len, src_pages, sums)
    assert ep.registry.held() == [request_id]

    result = ep.client.pull(
        ep.server.url, request_id, dst_pages, DEADLINE_S, verify_checksums=checksums
    )

    assert result.bytes_moved == bytes_minimum(ep.decode.layout, seq_len)
    assert result.plan.bytes_moved == result.bytes_moved
    assert result.checksums_verified is checksums
    for r, v in enumerate(ep.decode.call_all("verify", seq_len, dst_pages, seed, SENTINEL)):
        assert v.ok, f"decode rank {r}, seq_len {seq_len}: {v}"
    assert ep.registry.held() == []
    assert ep.registry.released[-1] == request_id


def fresh_regions(ep: Endpoint) -> None:
    ep.prefill.call_all("fill_random", GARBAGE)
    ep.decode.call_all("fill_random", SENTINEL)


def live_transfers(group: RankGroup) -> list[int]:
    return [s.live_transfers for s in group.call_all("stats")]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("src_tp", "dst_tp", "checksums"), PAIRS, ids=lambda v: str(v))
def test_pull_moves_exact_bytes(pools: Pools, src_tp: int, dst_tp: int, checksums: bool) -> None:
    src, dst = layout(src_tp), layout(dst_tp)
    ep = Endpoint(pools.backend, pools.get("prefill", src), pools.get("decode", dst))
    try:
        fresh_regions(ep)
        rng = np.random.default_rng([src_tp, dst_tp])
        seq_len = int(rng.integers(200, 384))
        transfer_and_verify(
            ep,
            f"req-{src_tp}-{dst_tp}",
            seq_len,
            random_pages(rng, src, seq_len),
            random_pages(rng, dst, seq_len),
            seed=1000 + 17 * src_tp + dst_tp,
            checksums=checksums,
        )
        assert live_transfers(ep.decode) == [0] * dst_tp
    finally:
        ep.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("src_tp", "dst_tp", "page_size", "kv_dtype", "kv_layout"),
    [
        (2, 2, 32, KVDtype.FP8_E4M3, KVLayout.NHD),
        (4, 1, 64, KVDtype.FP8_E4M3, KVLayout.HND),
    ],
    ids=["2-2-NHD-fp8-p32", "4-1-HND-fp8-p64"],
)
def test_pull_other_layouts(
    pools: Pools,
    src_tp: int,
    dst_tp: int,
    page_size: int,
    kv_dtype: KVDtype,
    kv_layout: KVLayout,
) -> None:
    src = layout(src_tp, page_size, kv_dtype, kv_layout)
    dst = layout(dst_tp, page_size, kv_dtype, kv_layout)
    ep = Endpoint(pools.backend, pools.get("prefill", src), pools.get("decode", dst))
    try:
        fresh_regions(ep)
        rng = np.random.default_rng(page_size)
        for i, seq_len in enumerate((333, 49)):
            ep.decode.call_all("fill_random", SENTINEL)
            transfer_and_verify(
                ep,
                f"req-{i}",
                seq_len,
                random_pages(rng, src, seq_len),
                random_pages(rng, dst, seq_len),
                seed=77 + i,
                checksums=True,
            )
    finally:
        ep.close()


@pytest.mark.timeout(120)
def test_second_request_reuses_connections(pools: Pools) -> None:
    """Two requests back to back on the same groups and client: the peer metadata and the
    backend connections made for the first serve the second, and the second lands in other
    pages without disturbing the first."""
    src, dst = layout(4), layout(2)
    ep = Endpoint(pools.backend, pools.get("prefill", src), pools.get("decode", dst))
    try:
        fresh_regions(ep)
        rng = np.random.default_rng(2)
        len_a, len_b = 301, 170
        src_a, dst_a = random_pages(rng, src, len_a), random_pages(rng, dst, len_a)
        transfer_and_verify(ep, "req-a", len_a, src_a, dst_a, seed=11, checksums=True)
        sums_a = published_checksums(ep.prefill, len_a, src_a)
        peer_info = ep.client.peer(ep.server.url)[0]
        peers_after_a = [s.peers for s in ep.decode.call_all("stats")]
        assert all(n >= 1 for n in peers_after_a)

        src_b = random_pages(rng, src, len_b, avoid=src_a)
        dst_b = random_pages(rng, dst, len_b, avoid=dst_a)
        ep.prefill.call_all("write_request", len_b, src_b, 12)
        ep.registry.publish("req-b", len_b, src_b, published_checksums(ep.prefill, len_b, src_b))
        t0 = time.monotonic()
        result = ep.client.pull(ep.server.url, "req-b", dst_b, DEADLINE_S, verify_checksums=True)
        assert time.monotonic() - t0 < DEADLINE_S
        assert result.bytes_moved == bytes_minimum(dst, len_b)
        assert result.checksums_verified

        # The cached peer served the second pull: no metadata refetch, no new connections.
        assert ep.client.peer(ep.server.url)[0] is peer_info
        assert [s.peers for s in ep.decode.call_all("stats")] == peers_after_a
        assert live_transfers(ep.decode) == [0] * dst.topology.tp_size
        # B is exact; A, in other pages, is untouched by B.
        for r, v in enumerate(ep.decode.call_all("verify", len_b, dst_b, 12, SENTINEL)):
            assert v.mismatched_bytes == 0, f"decode rank {r}: {v}"
        got_a = {
            f"{k[0]}:{k[1]}:{k[2]}": v
            for per_rank in ep.decode.call_all("checksums", len_a, dst_a)
            for k, v in per_rank.items()
        }
        assert got_a == sums_a
        assert ep.registry.held() == []
        assert list(ep.registry.released)[-2:] == ["req-a", "req-b"]
    finally:
        ep.close()


@pytest.mark.timeout(120)
def test_seq_len_at_window_and_page_boundaries(pools: Pools) -> None:
    src, dst = layout(2), layout(4)
    ep = Endpoint(pools.backend, pools.get("prefill", src), pools.get("decode", dst))
    try:
        fresh_regions(ep)
        rng = np.random.default_rng(3)
        for seq_len in BOUNDARY_SEQ_LENS:
            ep.decode.call_all("fill_random", SENTINEL)
            transfer_and_verify(
                ep,
                f"req-len-{seq_len}",
                seq_len,
                random_pages(rng, src, seq_len),
                random_pages(rng, dst, seq_len),
                seed=500 + seq_len,
                checksums=seq_len % 2 == 1,
            )
    finally:
        ep.close()


@pytest.mark.timeout(120)
def test_close_deregisters_everything(pools: Pools) -> None:
    """Closing every group (the module's last test per backend) leaves nothing registered,
    no live transfer and no connected peer, and ends every rank process."""
    closed = pools.close_all()
    assert closed, "expected the earlier cases to have left groups in the cache"
    for group, final in closed:
        assert_closed_clean(group, final)
