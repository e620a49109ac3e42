"""Faults on the real transfer path: each ends with its typed error, promptly, and leaks nothing.

For both backends: a prefill rank killed mid-transfer, a missed deadline, an incompatible peer
(page size, KV dtype, layout, model, backend, TP sizes), an unknown or expired lease, and a
checksum mismatch. After each, the decode ranks are alive with no live transfer, the prefill
lease is released, and `close()` deregisters everything.

Long transfers come cheap from tiny rows: head_dim 4 (8-byte rows) and 16-token pages give
512-byte descriptors, so NIXL (one CMA system call per descriptor) and Mooncake (synchronous
batches of 512) take a few hundred ms for a few tens of MB.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from beamserve.kv_transfer.backends.base import BACKENDS, AgentInfo, AgentStats
from beamserve.kv_transfer.errors import (
    ChecksumMismatchError,
    IncompatiblePeerError,
    LeaseExpiredError,
    PeerLostError,
    TransferTimeoutError,
)
from beamserve.kv_transfer.handshake import (
    DecodeKVClient,
    HandshakeServer,
    PrefillKVRegistry,
    PullResult,
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


MODEL = beam_small()
PAGE = 16
TP = 2
# The long request: ~100 MB / ~200 ms over NIXL, ~25 MB / ~1 s over Mooncake, ~250 MB / ~60 ms
# over cma or shm on a small host.
BIG_SEQ_LEN = {"nixl": 400_000, "mooncake": 100_000, "cma": 1_000_000, "shm": 1_000_000}
SMALL_SEQ_LEN = 300
EXTRA_FULL, EXTRA_WINDOW = 24, 8  # pages past the long request's, for small requests
SEED, SENTINEL, GARBAGE = 7, 0x5E7, 0xBAD
DEADLINE_S = 20.0
GRACE_S = 1.0  # how late past its deadline a typed error may arrive
DETECT_S = 5.0  # how soon a dead peer must surface (well under DEADLINE_S)


def pages_for(seq_len: int, window: int = MODEL.sliding_window) -> tuple[int, int]:
    n_full = pages_needed(seq_len, PAGE)
    return n_full, n_full - first_window_page(seq_len, window, PAGE)


def pool_layout(backend: str) -> PoolLayout:
    n_full, n_win = pages_for(BIG_SEQ_LEN[backend])
    return PoolLayout(MODEL, PoolTopology(TP, PAGE), n_full + EXTRA_FULL, n_win + EXTRA_WINDOW)


def shuffled(rng: np.random.Generator, lo: int, hi: int, n: int) -> np.ndarray:
    return lo + rng.permutation(hi - lo)[:n]


def big_pages(rng: np.random.Generator, lay: PoolLayout, seq_len: int) -> RequestPages:
    """Random non-contiguous pages for the long request, below the small requests' pages."""
    n_full, n_win = pages_for(seq_len)
    return RequestPages.of(
        shuffled(rng, 0, lay.full_pages - EXTRA_FULL, n_full),
        shuffled(rng, 0, lay.window_pages - EXTRA_WINDOW, n_win),
    )


def small_pages(rng: np.random.Generator, lay: PoolLayout, seq_len: int) -> RequestPages:
    n_full, n_win = pages_for(seq_len)
    return RequestPages.of(
        shuffled(rng, lay.full_pages - EXTRA_FULL, lay.full_pages, n_full),
        shuffled(rng, lay.window_pages - EXTRA_WINDOW, lay.window_pages, n_win),
    )


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def assert_clean(stats: AgentStats | None, what: str) -> None:
    assert stats is not None, f"{what}: no answer to close"
    assert stats.registered_regions == 0, f"{what}: {stats}"
    assert stats.registered_bytes == 0, f"{what}: {stats}"
    assert stats.live_transfers == 0, f"{what}: {stats}"
    assert stats.peers == 0, f"{what}: {stats}"


def close_and_check(group: RankGroup, dead: frozenset[int] = frozenset()) -> None:
    """Close `group`; every rank not in `dead` must deregister everything and exit."""
    final = group.close()
    for r, stats in enumerate(final):
        if r in dead:
            assert stats is None
        else:
            assert_clean(stats, f"{group.group} rank {r}")
    assert not any(running(pid) for pid in group.pids)


def decode_healthy(decode: RankGroup) -> list[AgentStats]:
    """Every decode rank is alive, answers, and holds its region with no live transfer."""
    assert all(running(pid) for pid in decode.pids)
    stats: list[AgentStats] = decode.call_all("stats", timeout_s=10)
    for r, s in enumerate(stats):
        assert s.live_transfers == 0, f"decode rank {r}: {s}"
        assert s.registered_regions == 1, f"decode rank {r}: {s}"
    return stats


def bytes_read(decode: RankGroup) -> list[int]:
    return [s.bytes_read for s in decode.call_all("stats", timeout_s=10)]


class Endpoint:
    """A prefill registry served over real HTTP on loopback, and a decode client."""

    def __init__(
        self,
        backend: str,
        prefill_agents: list[AgentInfo],
        decode: RankGroup,
        layout: PoolLayout,
        lease_s: float = 30.0,
    ) -> None:
        self.registry = PrefillKVRegistry("prefill-0", layout, backend, prefill_agents, lease_s)
        self.server = HandshakeServer(build_handshake_app(self.registry))
        self.client = DecodeKVClient(decode, driver="ranks")  # the agents, through the ranks
        self.url = self.server.url

    def close(self) -> None:
        self.client.close()
        self.server.stop()

    def lease_released(self, request_id: str) -> bool:
        return self.registry.held() == [] and request_id in self.registry.released


@dataclass
class Env:
    backend: str
    layout: PoolLayout
    decode: RankGroup
    prefill: RankGroup  # shared by every test that does not kill a rank
    seq_len: int
    src: RequestPages  # the long request, written on `prefill` with SEED
    dst: RequestPages
    pre_s: float  # a pull's time outside the reads (handshake, plan, release)
    xfer_s: float  # the long request's read time

    def needed_on_rank0(self) -> int:
        return bytes_minimum(self.layout, self.seq_len) // TP


def timed_pull(ep: Endpoint, env: Env, request_id: str, deadline_s: float) -> PullResult:
    ep.registry.publish(request_id, env.seq_len, env.src)
    t0 = time.perf_counter()
    result = ep.client.pull(ep.url, request_id, env.dst, deadline_s)
    total = time.perf_counter() - t0
    env.pre_s, env.xfer_s = total - result.seconds, result.seconds
    return result


@pytest.fixture(scope="module", params=BACKENDS)
def env(request: pytest.FixtureRequest) -> Iterator[Env]:
    backend = request.param
    lay = pool_layout(backend)
    decode = RankGroup("decode", lay, backend)
    prefill = None
    try:
        prefill = RankGroup("prefill", lay, backend)
        rng = np.random.default_rng(0)
        seq_len = BIG_SEQ_LEN[backend]
        e = Env(
            backend,
            lay,
            decode,
            prefill,
            seq_len,
            big_pages(rng, lay, seq_len),
            big_pages(rng, lay, seq_len),
            0.0,
            0.0,
        )
        prefill.call_all("fill_random", GARBAGE)
        prefill.call_all("write_request", seq_len, e.src, SEED)
        decode.call_all("fill_random", SENTINEL)
        ep = Endpoint(backend, prefill.infos, decode, lay)
        try:  # connect, then time the long request as the shared calibration
            timed_pull(ep, e, "warm-up", DEADLINE_S)
            timed_pull(ep, e, "calibrate", DEADLINE_S)
        finally:
            ep.close()
        yield e
    finally:
        try:
            close_and_check(decode)
        finally:
            if prefill is not None:
                close_and_check(prefill)


# --- a. a prefill rank dies mid-transfer -----------------------------------------------------


@dataclass
class KillOutcome:
    error: BaseException | None
    since_kill_s: float
    moved_fraction: float  # of decode rank 0's needed bytes (it reads from the killed rank)


def kill_during_pull(env: Env, kill_after_s: float) -> KillOutcome:
    """One attempt on a fresh prefill group: start the long pull, kill prefill rank 0 after
    `kill_after_s`, and check everything the fault must leave behind."""
    victim = RankGroup("victim", env.layout, env.backend)
    ep = Endpoint(env.backend, victim.infos, env.decode, env.layout)
    try:
        victim.call_all("write_request", env.seq_len, env.src, SEED)
        timed_pull(ep, env, "warm-up", DEADLINE_S)  # connected; times this very pair
        env.decode.call_all("fill_random", SENTINEL)
        ep.registry.publish("victim", env.seq_len, env.src)

        box: dict[str, object] = {}

        def pull() -> None:
            try:
                box["result"] = ep.client.pull(ep.url, "victim", env.dst, DEADLINE_S)
            except BaseException as exc:
                box["error"] = exc
            box["done"] = time.monotonic()

        thread = threading.Thread(target=pull, daemon=True)
        thread.start()
        time.sleep(kill_after_s)
        killed_at = time.monotonic()
        victim.kill(0)
        thread.join(DEADLINE_S + 10)
        assert not thread.is_alive(), "pull hung after its peer was killed"
        error = box.get("error")
        since_kill = float(box["done"]) - killed_at  # type: ignore[arg-type]

        assert not running(victim.pids[0]) and running(victim.pids[1])
        assert ep.lease_released("victim")
        decode_healthy(env.decode)
        checks = env.decode.call_all("verify", env.seq_len, env.dst, SEED, SENTINEL)
        for r, v in enumerate(checks):
            assert v.untouched_bytes_changed == 0, f"decode rank {r}: {v}"
        # Decode rank 0 read only from the killed rank; rank 1 from the live one.
        assert checks[1].ok, checks[1]
        expected_mismatch = env.needed_on_rank0() * 255 / 256  # sentinel ≠ data, per byte
        moved = 1.0 - checks[0].mismatched_bytes / expected_mismatch

        if error is not None:
            assert isinstance(error, PeerLostError), repr(error)
            assert since_kill < DETECT_S, f"{since_kill:.2f}s to notice the dead peer"
            # A fresh pull against the dead peer fails fast, typed, and leaks nothing.
            ep.registry.publish("after", env.seq_len, env.src)
            t0 = time.monotonic()
            with pytest.raises(PeerLostError):
                ep.client.pull(ep.url, "after", env.dst, DEADLINE_S)
            assert time.monotonic() - t0 < DETECT_S
            assert ep.lease_released("after")
            decode_healthy(env.decode)
        return KillOutcome(error, since_kill, moved)
    finally:
        ep.close()
        close_and_check(victim, dead=frozenset({0}))


@pytest.mark.timeout(180)
def test_peer_killed_mid_transfer(env: Env) -> None:
    """Kill prefill rank 0 partway through decode rank 0's reads. When the kill lands is a
    race, so each attempt aims at 40% of the reads as timed on the same pair just before,
    and the next attempt moves the aim if the kill came before the reads or after them; every
    attempt, whatever it hit, must end typed and clean."""
    aim, outcomes = 0.4, []
    for _ in range(4):
        outcome = kill_during_pull(env, env.pre_s * 0.8 + aim * env.xfer_s)
        outcomes.append(outcome)
        if outcome.error is None or outcome.moved_fraction > 0.99:  # reads finished first
            aim /= 2
        elif outcome.moved_fraction < 0.01:  # killed before the reads started
            aim = min(0.9, aim * 1.5 + 0.1)
        else:
            break
    summary = ", ".join(
        f"{type(o.error).__name__} moved={o.moved_fraction:.2f} after {o.since_kill_s:.3f}s"
        for o in outcomes
    )
    print(f"{env.backend}: {summary}")
    mid = [o for o in outcomes if o.error is not None and 0.01 <= o.moved_fraction <= 0.99]
    assert mid, f"no attempt killed the peer mid-transfer: {summary}"


# --- b. missed deadline ----------------------------------------------------------------------


def _pull_after_missed_deadline_works(env: Env, ep: Endpoint) -> None:
    decode_healthy(env.decode)
    env.decode.call_all("fill_random", SENTINEL)
    ep.registry.publish("retry", env.seq_len, env.src)
    result = ep.client.pull(ep.url, "retry", env.dst, DEADLINE_S)
    assert result.bytes_moved == bytes_minimum(env.layout, env.seq_len)
    for r, v in enumerate(env.decode.call_all("verify", env.seq_len, env.dst, SEED, SENTINEL)):
        assert v.ok, f"decode rank {r}: {v}"
    assert ep.lease_released("retry")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["tiny", "mid-read"])
def test_missed_deadline(env: Env, where: str) -> None:
    """`tiny`: 5 ms for the long request. `mid-read`: a deadline that falls partway into the
    reads (aimed from the calibrated timing, re-aimed if it fell before the reads or after
    them), so the ranks must cancel reads in flight."""
    ep = Endpoint(env.backend, env.prefill.infos, env.decode, env.layout)
    try:
        ep.client.peer(ep.url)  # handshake done, as for a warm decode worker
        before = decode_healthy(env.decode)
        aim, seen = 0.3, []
        # Aimed from the calibration pull at first; that pull did the handshake and touched
        # fresh pages, so it can overstate both parts: a pull that finishes re-aims from its own.
        pre_s, xfer_s = env.pre_s, env.xfer_s
        for attempt in range(4):
            deadline = 0.005 if where == "tiny" else pre_s + aim * xfer_s
            request_id = f"late-{attempt}"
            ep.registry.publish(request_id, env.seq_len, env.src)
            t0 = time.monotonic()
            try:
                done = ep.client.pull(ep.url, request_id, env.dst, deadline)
            except TransferTimeoutError as exc:
                error: TransferTimeoutError | None = exc
            else:
                error = None
            elapsed = time.monotonic() - t0
            if error is None:
                pre_s, xfer_s = max(elapsed - done.seconds, 0.0), done.seconds
            seen.append(f"{deadline:.3f}s: {elapsed:.3f}s, {error}")
            assert ep.lease_released(request_id)
            if where == "tiny":
                assert error is not None, "100+ MB moved within 5 ms?"
            if error is not None:
                assert elapsed < deadline + GRACE_S, seen[-1]
            if where == "tiny" or (error and "still running at the deadline" in str(error)):
                break  # mid-read: cancelled inside the ranks, not refused before the reads
            aim = aim / 2 if error is None else aim + 0.2  # finished first / fell before
        else:
            pytest.fail(f"the deadline never fell inside the reads: {seen}")
        print(f"{env.backend} {where}: {seen}")
        after = decode_healthy(env.decode)
        assert [s.peers for s in after] == [s.peers for s in before]
        # Cancelled reads wrote nowhere but the request's own pages.
        for r, v in enumerate(env.decode.call_all("verify", env.seq_len, env.dst, SEED, SENTINEL)):
            assert v.untouched_bytes_changed == 0, f"decode rank {r}: {v}"
        _pull_after_missed_deadline_works(env, ep)
    finally:
        ep.close()


# --- c. incompatible peers -------------------------------------------------------------------


def _other_backend(backend: str) -> str:
    return next(b for b in BACKENDS if b != backend)


MISMATCHES = ["page_size", "kv_dtype", "layout", "model_fingerprint", "backend"]


def _mismatched(env: Env, field: str) -> tuple[PoolLayout, str]:
    lay, backend = env.layout, env.backend
    full, win = lay.full_pages, lay.window_pages
    if field == "page_size":
        return PoolLayout(MODEL, PoolTopology(TP, 32), full, win), backend
    if field == "kv_dtype":
        return PoolLayout(MODEL, PoolTopology(TP, PAGE, KVDtype.FP8_E4M3), full, win), backend
    if field == "layout":
        topo = PoolTopology(TP, PAGE, KVDtype.BF16, KVLayout.NHD)
        return PoolLayout(MODEL, topo, full, win), backend
    if field == "model_fingerprint":
        return PoolLayout(beam_small(window=64), lay.topology, full, win), backend
    assert field == "backend"
    return lay, _other_backend(backend)


def _expect_refusal(ep: Endpoint, decode: RankGroup, field: str, dst: RequestPages) -> None:
    read_before = bytes_read(decode)
    t0 = time.monotonic()
    with pytest.raises(IncompatiblePeerError) as info:
        ep.client.pull(ep.url, "mismatch", dst, DEADLINE_S)
    assert time.monotonic() - t0 < GRACE_S
    assert f"{field}:" in str(info.value), str(info.value)
    assert bytes_read(decode) == read_before  # refused before any I/O
    assert ep.lease_released("mismatch")
    decode_healthy(decode)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("field", MISMATCHES)
def test_incompatible_peer_refused(env: Env, field: str) -> None:
    peer_layout, peer_backend = _mismatched(env, field)
    ep = Endpoint(peer_backend, env.prefill.infos, env.decode, peer_layout)
    try:
        rng = np.random.default_rng(1)
        seq_len = 100
        P = peer_layout.topology.page_size
        n_full = pages_needed(seq_len, P)
        n_win = n_full - first_window_page(seq_len, peer_layout.model.sliding_window, P)
        ep.registry.publish(
            "mismatch", seq_len, RequestPages.of(np.arange(n_full), np.arange(n_win))
        )
        _expect_refusal(ep, env.decode, field, small_pages(rng, env.layout, seq_len))
    finally:
        ep.close()


@pytest.mark.timeout(60)
def test_tp_sizes_that_do_not_divide_refused(env: Env) -> None:
    """Prefill TP 3 against decode TP 2 (a 6-KV-head model shards both ways). The prefill
    agents are placeholders nobody can reach: the refusal must come before any connection."""
    model = beam_small(kv_heads=6)
    dst_layout = PoolLayout(model, PoolTopology(2, PAGE), 32, 8)
    src_layout = PoolLayout(model, PoolTopology(3, PAGE), 32, 8)
    decode = RankGroup("decode6", dst_layout, env.backend)
    ep = None
    try:
        ghosts = [
            AgentInfo(env.backend, f"ghost-{r}", b"", 0, src_layout.region_bytes) for r in range(3)
        ]
        ep = Endpoint(env.backend, ghosts, decode, src_layout)
        seq_len = 100
        n_full, n_win = pages_for(seq_len)
        ep.registry.publish(
            "mismatch", seq_len, RequestPages.of(np.arange(n_full), np.arange(n_win))
        )
        dst = RequestPages.of(np.arange(n_full)[::-1], np.arange(n_win)[::-1])
        _expect_refusal(ep, decode, "tp_size", dst)
    finally:
        if ep is not None:
            ep.close()
        close_and_check(decode)


# --- d. leases -------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_unknown_request_is_lease_expired(env: Env) -> None:
    ep = Endpoint(env.backend, env.prefill.infos, env.decode, env.layout)
    try:
        read_before = bytes_read(env.decode)
        t0 = time.monotonic()
        with pytest.raises(LeaseExpiredError):
            ep.client.pull(ep.url, "never-published", env.dst, DEADLINE_S)
        assert time.monotonic() - t0 < GRACE_S
        assert bytes_read(env.decode) == read_before
        assert ep.registry.held() == []
        decode_healthy(env.decode)
    finally:
        ep.close()


@pytest.mark.timeout(60)
def test_expired_lease(env: Env) -> None:
    ep = Endpoint(env.backend, env.prefill.infos, env.decode, env.layout, lease_s=0.2)
    try:
        rng = np.random.default_rng(4)
        ep.registry.publish("short", SMALL_SEQ_LEN, small_pages(rng, env.layout, SMALL_SEQ_LEN))
        assert ep.registry.held() == ["short"]
        time.sleep(0.4)
        read_before = bytes_read(env.decode)
        t0 = time.monotonic()
        with pytest.raises(LeaseExpiredError):
            ep.client.pull(ep.url, "short", small_pages(rng, env.layout, SMALL_SEQ_LEN), DEADLINE_S)
        assert time.monotonic() - t0 < GRACE_S
        assert bytes_read(env.decode) == read_before
        assert ep.registry.held() == []
        decode_healthy(env.decode)
    finally:
        ep.close()


# --- e. checksum mismatch --------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_checksum_mismatch(env: Env) -> None:
    """Checksums published, then the prefill pages change (another seed) before the pull."""
    ep = Endpoint(env.backend, env.prefill.infos, env.decode, env.layout)
    try:
        rng = np.random.default_rng(5)
        src = small_pages(rng, env.layout, SMALL_SEQ_LEN)
        dst = small_pages(rng, env.layout, SMALL_SEQ_LEN)
        env.prefill.call_all("write_request", SMALL_SEQ_LEN, src, 21)
        sums = published_checksums(env.prefill, SMALL_SEQ_LEN, src)
        env.prefill.call_all("write_request", SMALL_SEQ_LEN, src, 22)  # corrupt after publish
        ep.registry.publish("corrupt", SMALL_SEQ_LEN, src, sums)
        t0 = time.monotonic()
        with pytest.raises(ChecksumMismatchError):
            ep.client.pull(ep.url, "corrupt", dst, DEADLINE_S, verify_checksums=True)
        assert time.monotonic() - t0 < DEADLINE_S
        assert ep.lease_released("corrupt")
        decode_healthy(env.decode)
        # The bytes did move (they are the corrupted seed's); only the end-to-end check failed.
        for r, per_rank in enumerate(env.decode.call_all("checksums", SMALL_SEQ_LEN, dst)):
            assert any(sums[f"{k[0]}:{k[1]}:{k[2]}"] != v for k, v in per_rank.items()), r
    finally:
        ep.close()
