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

import enum
from dataclasses import dataclass

from beamserve.kv_transfer.errors import TransferPlanError
from beamserve.kv_transfer.memory import MemoryKind
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
    handshake round trip (a staging round's gather request)."""

    per_desc_s: float
    wire_Bps: float
    copy_Bps: float
    round_trip_s: float = 2e-3


LINKS: dict[tuple[MemoryKind, str], LinkModel] = {
    (MemoryKind.DRAM, "nixl"): LinkModel(3.5e-6, 12e9, 3e9),
    (MemoryKind.DRAM, "mooncake"): LinkModel(40e-6, 2e9, 3e9),
    # cma hands the kernel 1024 descriptors a call: the pages' walk is what a descriptor costs
    # (65,536 reads of 16 KiB at 4.1 GB/s against 4.9 GB/s for a memcpy here, 2026-12-01).
    (MemoryKind.DRAM, "cma"): LinkModel(0.2e-6, 4.5e9, 3e9),
    (MemoryKind.VRAM, "nixl"): LinkModel(6e-6, 1.5e12, 1.5e12),
    # cuda_ipc serves a read of many descriptors with one gather kernel per length class over
    # the peer's mapped memory: a descriptor costs an index, not a launch.
    (MemoryKind.VRAM, "cuda_ipc"): LinkModel(2e-9, 1.5e12, 1.5e12),
}


def link_for(memory: MemoryKind, backend: str) -> LinkModel:
    try:
        return LINKS[(memory, backend)]
    except KeyError:
        known = sorted(f"{m.value}/{b}" for m, b in LINKS)
        raise TransferPlanError(
            f"link: no cost model for {memory.value} over {backend}; known: {known}"
        ) from None


@dataclass(frozen=True)
class PathChoice:
    path: TransferPath  # DIRECT or STAGED, never AUTO
    direct_s: float
    staged_s: float
    reason: str


def estimate_direct(plan: TransferPlan, link: LinkModel) -> float:
    per_dst: dict[int, float] = {}
    for p in plan.pairs:
        per_dst[p.dst_rank] = (
            per_dst.get(p.dst_rank, 0.0) + p.count * link.per_desc_s + p.nbytes / link.wire_Bps
        )
    return max(per_dst.values(), default=0.0)


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
        + max(gather.values(), default=0.0)
        + max(pull.values(), default=0.0)
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
