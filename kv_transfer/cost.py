"""Direct or staged: a small cost model, chosen per plan.

    direct_s = max over destination ranks of  (descriptors_d · per_desc_s + bytes_d / wire_Bps)
    staged_s = rounds · round_trip_s
             + max over source ranks of   gather_bytes_s / copy_Bps
             + max over destination ranks of (chunks_d · per_desc_s + bytes_d / wire_Bps
                                              + scatter_bytes_d / copy_Bps)

Destination ranks pull in parallel, source ranks gather in parallel (the max terms); the staged
path pays one handshake round trip per round and two local copies, and saves the per-descriptor
cost of every small descriptor. `auto` takes the smaller estimate; ties go to direct (no staging
memory held).

The link constants (`LinkModel`) depend on the memory kind and the transport. The defaults were
measured with `beamserve bench kv-transfer` (docs/kv-transfer.md): on one host NIXL/UCX serves a
DRAM descriptor with one `process_vm_readv` (≈ 3.5 µs each on the 2-core VM) and a rank process
copies 16 KiB rows at about 3 GB/s there; on the GPU a NIXL/UCX VRAM descriptor is one
`cudaMemcpyAsync` (≈ 6 µs) and copies run at device-to-device speed.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from beamserve.kv_transfer.compact import CompactPlan
from beamserve.kv_transfer.errors import TransferPlanError
from beamserve.kv_transfer.memory import MemoryKind, copy_threads, host_cores
from beamserve.kv_transfer.plan import TransferPlan
from beamserve.kv_transfer.staging import StagedPlan


class TransferPath(enum.StrEnum):
    DIRECT = "direct"
    STAGED = "staged"
    AUTO = "auto"


def parse_path(value: str) -> TransferPath:
    try:
        return TransferPath(value)
    except ValueError:
        raise TransferPlanError(
            f"path: {value!r} unknown; choose one of {[p.value for p in TransferPath]}"
        ) from None


@dataclass(frozen=True)
class LinkModel:
    """Costs of one link: per wire descriptor, wire bandwidth, local copy bandwidth, and one
    handshake round trip (a staging round's gather request); where measured, the fixed cost
    of a direct pull driven by the ranks (each rank's pipe round trip and table), and of one
    host-local pull (`local_fixed_s`; None: the link has no host-local driver)."""

    per_desc_s: float
    wire_Bps: float
    copy_Bps: float
    round_trip_s: float = 2e-3
    direct_fixed_s: float = 0.0
    local_fixed_s: float | None = None
    # Copies that can run at once (0: one per destination rank, as on NICs or a GPU; a
    # host's cores where the processes copy on the CPU), and the host-local driver's rate
    # (0: `wire_Bps`; its threads together where it copies on the CPU).
    lanes: int = 0
    local_Bps: float = 0.0


LINKS: dict[tuple[MemoryKind, str], LinkModel] = {
    (MemoryKind.DRAM, "nixl"): LinkModel(3.5e-6, 12e9, 3e9),
    (MemoryKind.DRAM, "mooncake"): LinkModel(40e-6, 2e9, 3e9),
    # cma hands the kernel 1024 descriptors a call: the pages' walk is what a descriptor costs
    # (65,536 reads of 16 KiB at 4.1 GB/s against 4.9 GB/s for a memcpy here, 2026-12-01).
    (MemoryKind.DRAM, "cma"): LinkModel(0.2e-6, 4.5e9, 3e9),
    # shm: mapped regions, copies in user space. A core copies scattered 16 KiB head slices
    # at ≈ 5 GB/s here (0.65 × a plain memcpy, 2026-12-02); through the ranks a descriptor
    # costs a row copy's interpreter overhead (≈ 1 µs, assumed) and the rank processes share
    # the host's cores; the host-local driver copies with `copy_threads()` threads.
    # (`link_for` sets its lanes and the driver's rate from this host's cores.)
    (MemoryKind.DRAM, "shm"): LinkModel(1e-6, 5e9, 5e9, direct_fixed_s=1e-3, local_fixed_s=1e-3),
    (MemoryKind.VRAM, "nixl"): LinkModel(6e-6, 1.5e12, 1.5e12),
    # cuda_ipc serves a read of many descriptors with one kernel over the peer's mapped
    # memory: a descriptor costs an index, not a launch. Fixed costs from the H200 runs of
    # 2026-12-01 (docs/kv-transfer.md): a direct pull through the four decode rank processes
    # took 6.8–11.9 ms for ≈ 1.5 ms of copies (≈ 5 ms fixed); a stage call 8.6–10 ms. The
    # host-local driver's fixed cost, measured 2026-12-02 as pull minus launch: 1.2–2.0 ms
    # driven from decode rank 0 (the pipe round trip is most of it), 0.5–0.8 ms from the caller.
    (MemoryKind.VRAM, "cuda_ipc"): LinkModel(
        2e-9, 1.5e12, 1.5e12, round_trip_s=8e-3, direct_fixed_s=5e-3, local_fixed_s=1.5e-3
    ),
}


def link_for(memory: MemoryKind, backend: str) -> LinkModel:
    try:
        link = LINKS[(memory, backend)]
    except KeyError:
        known = sorted(f"{m.value}/{b}" for m, b in LINKS)
        raise TransferPlanError(
            f"link: no cost model for {memory.value} over {backend}; known: {known}"
        ) from None
    if (memory, backend) == (MemoryKind.DRAM, "shm"):  # copies on this host's cores
        return dataclasses.replace(
            link, lanes=host_cores(), local_Bps=link.wire_Bps * copy_threads()
        )
    return link


@dataclass(frozen=True)
class PathChoice:
    path: TransferPath  # DIRECT or STAGED, never AUTO
    direct_s: float
    staged_s: float
    reason: str
    driver: str = "ranks"  # who copies: each decode rank ("ranks") or one "host_local" launch
    local_s: float = 0.0  # the host-local estimate, where one was made


def _parallel(per_rank: list[float], link: LinkModel) -> float:
    """Ranks work in parallel, at most `lanes` at a time where the link has lanes."""
    top = max(per_rank, default=0.0)
    return max(top, sum(per_rank) / link.lanes) if link.lanes else top


def _ranks_s(per_dst: list[float], link: LinkModel) -> float:
    return link.direct_fixed_s + _parallel(per_dst, link)


def estimate_direct(plan: TransferPlan, link: LinkModel) -> float:
    per_dst: dict[int, float] = {}
    for p in plan.pairs:
        per_dst[p.dst_rank] = (
            per_dst.get(p.dst_rank, 0.0) + p.count * link.per_desc_s + p.nbytes / link.wire_Bps
        )
    return _ranks_s(list(per_dst.values()), link)


def estimate_direct_compact(plan: CompactPlan, link: LinkModel) -> float:
    """`estimate_direct` from the compact plan (the same counts, without writing them out)."""
    per_dst = [c * link.per_desc_s + b / link.wire_Bps for c, b in plan.per_dst_rank().values()]
    return _ranks_s(per_dst, link)


def estimate_local(plan: CompactPlan, link: LinkModel) -> float:
    """One launch on one device (or one process's copy threads) moves every destination
    rank's bytes: local_s = local_fixed_s + bytes_moved / (local_Bps or wire_Bps)."""
    if link.local_fixed_s is None:
        raise TransferPlanError("link: this link has no host-local driver (local_fixed_s)")
    return link.local_fixed_s + plan.bytes_moved / (link.local_Bps or link.wire_Bps)


def estimate_staged_floor(plan: CompactPlan, link: LinkModel) -> float:
    """A lower bound of `estimate_staged` for any staging of `plan`: one round trip plus the
    slowest destination rank's bytes on the wire, or all of them over the link's lanes
    (staging never moves fewer)."""
    per_dst = [b / link.wire_Bps for _c, b in plan.per_dst_rank().values()]
    return link.round_trip_s + _parallel(per_dst, link)


def estimate_staged(staged: StagedPlan, link: LinkModel) -> float:
    gather: dict[int, float] = {}
    pull: dict[int, float] = {}
    for c in staged.chunks:
        gather[c.src_rank] = gather.get(c.src_rank, 0.0) + c.gather_bytes / link.copy_Bps
        pull[c.dst_rank] = pull.get(c.dst_rank, 0.0) + (
            link.per_desc_s + c.nbytes / link.wire_Bps + c.scatter_bytes / link.copy_Bps
        )
    return (
        staged.rounds * link.round_trip_s
        + _parallel(list(gather.values()), link)
        + _parallel(list(pull.values()), link)
    )


def choose_path(
    plan: TransferPlan, staged: StagedPlan, link: LinkModel, forced: TransferPath
) -> PathChoice:
    """Pick the path for one plan; `forced` DIRECT/STAGED wins over the estimates."""
    d, s = estimate_direct(plan, link), estimate_staged(staged, link)
    if forced is TransferPath.DIRECT:
        return PathChoice(TransferPath.DIRECT, d, s, "forced")
    if forced is TransferPath.STAGED:
        return PathChoice(TransferPath.STAGED, d, s, "forced")
    if s < d:
        why = f"staged {s * 1e3:.2f} ms < direct {d * 1e3:.2f} ms ({plan.descriptors} descriptors)"
        return PathChoice(TransferPath.STAGED, d, s, why)
    why = f"direct {d * 1e3:.2f} ms ≤ staged {s * 1e3:.2f} ms"
    return PathChoice(TransferPath.DIRECT, d, s, why)


def choose_host_local(
    plan: CompactPlan,
    link: LinkModel,
    want: TransferPath,
    forced: bool = False,
    staging: bool = False,
) -> PathChoice | None:
    """The host-local driver's choice for an eligible pull, or None (plan for the ranks).

    `want` STAGED never drives host-locally (staging is a per-rank pipeline). Otherwise the
    driver is taken where `forced` (BEAMSERVE_KV_DRIVER=host_local) or where its estimate is
    no larger than direct through the ranks and, for `auto` with staging pools on both sides,
    than the staged floor (`estimate_staged_floor`: if host-local is cheaper than the floor it
    is cheaper than any staging, so the staged plan need not be built)."""
    if want is TransferPath.STAGED:
        return None
    local, direct = estimate_local(plan, link), estimate_direct_compact(plan, link)
    floor = estimate_staged_floor(plan, link) if want is TransferPath.AUTO and staging else 0.0
    rivals = [direct] + ([floor] if floor else [])
    if forced:
        why = "forced (BEAMSERVE_KV_DRIVER=host_local)"
    elif local <= min(rivals):
        why = (
            f"host_local {local * 1e3:.2f} ms ≤ direct through the ranks {direct * 1e3:.2f} ms"
            + (f" and staged ≥ {floor * 1e3:.2f} ms" if floor else "")
        )
    else:
        return None
    return PathChoice(TransferPath.DIRECT, direct, floor, why, "host_local", local)
