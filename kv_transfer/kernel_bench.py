"""The host-local kernels alone, in one process on the GPU: variants against one device copy.

    python -m beamserve.kv_transfer.kernel_bench [--json PATH] [--env PATH] [--quick]

(run from outside the repository root, as every beamserve entry point: see docs/development.md).
For 8:4 at 80K tokens (Beam 1.0, bf16, scattered page tables; 12 separately allocated device
regions, no IPC) it times every launch shape of the flat kernel and of the loop kernel
(`kernels.launch_compact`, `kernels.launch_compact_loop`) with device events, beside one
`torch` copy of the same number of bytes between two flat buffers, timed at the start, in the
middle and at the end (the spread between them is the noise floor). Each variant's output is
checked against a reference written by the torch copy path (`copy_runs` with the torch engine)
after the destination was poisoned, before it is timed. Then, for the fastest loop shape, the
CPU cost of each step of a request's launch (bind, bind into the pinned buffer, the upload
call, Triton's launch call, a graph replay) and whole in-process driver pulls
(`HostLocalDriver` over its own regions) with graphs on and off and with the flat kernel; then
fp8 8:4 and bf16 1:1 with that shape and the flat kernel. Prints a table; `--json` writes every
number, `--env` the fastest shape as ``BEAMSERVE_KV_LOCAL_*`` assignments (a shell can source
it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
from beamserve.kv_transfer import kernels
from beamserve.kv_transfer.backends.base import AgentInfo
from beamserve.kv_transfer.bench import pool_for, scattered_pages
from beamserve.kv_transfer.compact import (
    KernelTables,
    compact_plan,
    kernel_tables,
    reorder_runs,
)
from beamserve.kv_transfer.host_local import HostLocalDriver, TritonEngine
from beamserve.kv_transfer.memory import Buffer, MemoryKind, copy_runs
from beamserve.kv_transfer.model import beam_1_0
from beamserve.kv_transfer.plan import TransferPlan, plan_transfer
from beamserve.kv_transfer.topology import KVDtype

POISON = 0x5A
# The shapes compared, spelled out (the defaults of `kernels.LocalShape` move with tuning).
FLAT = kernels.LocalShape(kernel="flat", warps=8, runs=1, order="plan")
LOOP16 = kernels.LocalShape(kernel="loop", per_sm=2, warps=16, maxnreg=0, order="plan")
LOOP8 = kernels.LocalShape(kernel="loop", per_sm=4, warps=8, maxnreg=64, order="plan")
DEV = {"name": "cuda"}  # "cpu" for a dry run under TRITON_INTERPRET=1 (no timings that matter)


def sync() -> None:
    import torch

    if DEV["name"] == "cuda":
        torch.cuda.synchronize()


@dataclass(frozen=True)
class Variant:
    name: str
    shape: kernels.LocalShape


def variants(quick: bool) -> list[Variant]:
    """The launch shapes timed at 8:4 bf16: the flat kernel and the loop kernel (register
    counts ptxas reports for sm_90: 8 warps 72, 62 under a cap of 64; 16 warps 56, so 3, 4
    and 2 programs fit per SM), each in the plan's piece order and sorted by source or
    destination offset (`compact.reorder_runs`)."""
    flat, loop16, loop8 = FLAT, LOOP16, LOOP8
    out = [Variant("default", kernels.LocalShape())]  # what the driver runs unless told
    for order in ("plan", "src", "dst"):
        out.append(Variant(f"flat r1 w8 {order}", replace(flat, order=order)))
        out.append(Variant(f"loop w16 x2 {order}", replace(loop16, order=order)))
        if not quick:
            out.append(Variant(f"loop w8 reg64 x4 {order}", replace(loop8, order=order)))
    if not quick:
        out.append(Variant("flat r2 w4 src", replace(flat, runs=2, warps=4, order="src")))
        out.append(Variant("flat r1 w4 src", replace(flat, warps=4, order="src")))
        out.append(Variant("flat r1 w16 src", replace(flat, warps=16, order="src")))
    return out


@dataclass
class Case:
    plan: TransferPlan
    tables: KernelTables
    src: list[Buffer]
    dst: list[Buffer]
    ref: list[Any]
    base: Buffer
    bound: Any  # the bound table on the device (plan order)
    bound_host: Any
    by_order: dict[str, tuple[KernelTables, Any]] = field(default_factory=dict)

    def for_order(self, order: str) -> tuple[KernelTables, Any]:
        """The tables in `order` and their bound device copy (made once)."""
        if order not in self.by_order:
            t = reorder_runs(self.tables, order)
            host = t.bind([b.addr for b in self.src], [b.addr for b in self.dst], self.base.addr)
            self.by_order[order] = (t, torch_from(host))
        return self.by_order[order]


def make_case(
    s_tp: int,
    d_tp: int,
    seq: int,
    dtype: KVDtype,
    seed: int,
    alloc: Callable[[list[int]], list[Buffer]] | None = None,
) -> Case:
    """The regions (separate device allocations, or `alloc`'s: IPC mappings), the plan, its
    kernel table bound to them, and the reference destination bytes."""
    import torch

    m = beam_1_0()
    src, dst = pool_for(m, s_tp, seq, kv_dtype=dtype), pool_for(m, d_tp, seq, kv_dtype=dtype)
    rng = np.random.default_rng(seed)
    sp, dp = scattered_pages(src, seq, rng), scattered_pages(dst, seq, rng)
    plan = plan_transfer(src, dst, seq, sp, dp)
    t = kernel_tables(compact_plan(src, dst, seq, sp, dp))
    dev = DEV["name"]
    gen = torch.Generator(device=dev).manual_seed(seed)

    def region(n: int) -> Buffer:
        return Buffer(
            MemoryKind.VRAM,
            torch.randint(0, 256, (n,), dtype=torch.uint8, device=dev, generator=gen),
        )

    sizes = [src.region_bytes] * s_tp + [dst.region_bytes] * d_tp
    if alloc is not None:
        bufs = alloc(sizes)
    elif dev == "cuda":
        bufs = [region(n) for n in sizes]
    else:  # the interpreter reads one tensor's memory: regions are slices of one arena
        at = np.cumsum([0] + [-(-n // 4096) * 4096 for n in sizes])
        arena = region(int(at[-1])).data
        bufs = [Buffer(MemoryKind.VRAM, arena[a : a + n]) for a, n in zip(at, sizes, strict=False)]
    s_bufs, d_bufs = bufs[:s_tp], bufs[s_tp:]
    refs = [torch.full_like(b.data, POISON) for b in d_bufs]  # what `check` leaves outside
    saved = kernels._state.get("engine")
    kernels._state["engine"] = "torch"  # the reference: the torch gather path, not a kernel here
    try:
        for p in plan.pairs:
            copy_runs(
                s_bufs[p.src_rank], p.src_offsets, Buffer(MemoryKind.VRAM, refs[p.dst_rank]),
                p.dst_offsets, p.lengths,
            )  # fmt: skip
    finally:
        if saved is None:
            kernels._state.pop("engine", None)
        else:
            kernels._state["engine"] = saved
    sync()
    base = min(s_bufs + d_bufs, key=lambda b: b.addr)
    host = t.bind([b.addr for b in s_bufs], [b.addr for b in d_bufs], base.addr)
    return Case(plan, t, s_bufs, d_bufs, refs, base, torch_from(host), host)


def torch_from(host: Any) -> Any:
    import torch

    return torch.from_numpy(host).to(DEV["name"])


def launcher(case: Case, shape: kernels.LocalShape, sms: int) -> Callable[[], None]:
    t, bound = case.for_order(shape.order)
    base = case.base.data
    if DEV["name"] != "cuda":  # the interpreter: the arena itself is the base
        base = base._base if base._base is not None else base
    if shape.kernel == "flat":
        return lambda: kernels.launch_compact(
            base, bound, t.log2, t.elem, t.align, t.steps, t.programs, shape.runs, shape.warps,
        )  # fmt: skip
    block = kernels.loop_block(t.elem, t.longest)
    return lambda: kernels.launch_compact_loop(
        base, bound, t.log2, t.elem, t.align, block, sms * shape.per_sm,
        shape.warps, shape.ahead, shape.evict, shape.maxnreg,
    )  # fmt: skip


def check(case: Case, launch: Callable[[], None]) -> bool:
    import torch

    for b in case.dst:
        b.data.fill_(POISON)
    launch()
    sync()
    return all(bool(torch.equal(b.data, r)) for b, r in zip(case.dst, case.ref, strict=True))


def device_ms(launch: Callable[[], None], repeats: int) -> list[float]:
    import torch

    launch()  # warm: compiled and loaded already by `check`
    out = []
    if DEV["name"] != "cuda":
        for _ in range(repeats):
            t0 = time.perf_counter()
            launch()
            out.append((time.perf_counter() - t0) * 1e3)
        return out
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    for _ in range(repeats):
        ev[0].record()
        launch()
        ev[1].record()
        ev[1].synchronize()
        out.append(float(ev[0].elapsed_time(ev[1])))
    return out


def copy_ms(nbytes: int, repeats: int, bufs: list[Any]) -> list[float]:
    a, b = bufs
    return device_ms(lambda: b[:nbytes].copy_(a[:nbytes]), repeats)


def cpu_us(fn: Callable[[], Any], repeats: int, sync: bool = True) -> float:
    """Median microseconds of the call itself (the device drained before each)."""
    import torch

    out = []
    for _ in range(repeats):
        if sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(out)


def med(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else 0.0


def pulls(case: Case, shape: kernels.LocalShape, n: int) -> dict[str, Any]:
    """Whole driver pulls in this process over its own regions (the caller's driver without
    IPC): seconds, the kernel's events and the phases, medians after two warm-up pulls."""
    s_agents = [
        AgentInfo("cuda_ipc", f"s{r}", b"{}", b.addr, b.nbytes, "vram", 0)
        for r, b in enumerate(case.src)
    ]
    d_agents = [
        AgentInfo("cuda_ipc", f"d{r}", b"{}", b.addr, b.nbytes, "vram", 0)
        for r, b in enumerate(case.dst)
    ]
    own = {a.name: b for a, b in zip(s_agents + d_agents, case.src + case.dst, strict=True)}
    engine = TritonEngine(0, shape)
    driver = HostLocalDriver(own, engine=engine)
    t = case.for_order(shape.order)[0]
    stats = [driver.pull(t, s_agents, d_agents, time.monotonic() + 60) for _ in range(n + 2)]
    stats = stats[2:]
    phases = {k: round(med([s.phases[k] * 1e3 for s in stats]), 4) for k in stats[0].phases}
    return {
        "pull_ms": round(med([s.seconds * 1e3 for s in stats]), 4),
        "pull_ms_all": [round(s.seconds * 1e3, 4) for s in stats],
        "kernel_ms": round(med([s.kernel_s * 1e3 for s in stats]), 4),
        "phases_ms": phases,
        "graph_replays": engine.replays,
        "launches": engine.launches,
    }


def _ipc_owner(conn: Any, sizes: list[int], seed: int) -> None:
    """A child process: allocates `sizes` random device regions, sends their IPC handles, keeps
    them alive until told."""
    import torch
    from beamserve.kv_transfer.backends.cuda_ipc import export_handle

    gen = torch.Generator(device="cuda").manual_seed(seed)
    bufs = [torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=gen)
            for n in sizes]  # fmt: skip
    torch.cuda.synchronize()
    conn.send([export_handle(b) for b in bufs])
    conn.recv()


def ipc_rows(args: Any, sms: int, reps: int, shapes: list[Variant]) -> dict[str, Any]:
    """8:4 bf16 over regions another process allocated (CUDA IPC mappings, as the driver in
    the caller sees them): the same variants, and a torch copy between two mapped buffers."""
    import multiprocessing as mp

    from beamserve.kv_transfer.backends.cuda_ipc import open_handle

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    m = beam_1_0()
    src, dst = pool_for(m, 8, args.tokens), pool_for(m, 4, args.tokens)
    nbytes = bytes_minimum_of(8, 4, args.tokens)
    sizes = [src.region_bytes] * 8 + [dst.region_bytes] * 4 + [nbytes, nbytes]
    from beamserve.kv_transfer import kernel_bench  # by module name: the child imports it

    proc = ctx.Process(target=kernel_bench._ipc_owner, args=(child, sizes, 5), daemon=True)
    proc.start()
    out: dict[str, Any] = {}
    try:
        if not parent.poll(120):
            return {"error": "the owner process sent no handles"}
        mapped = [Buffer(MemoryKind.VRAM, open_handle(b)) for b in parent.recv()]
        case = make_case(8, 4, args.tokens, KVDtype.BF16, 1, alloc=lambda _sizes: mapped[:12])
        a, b = mapped[12].data, mapped[13].data
        out["copy_ms"] = med(device_ms(lambda: b.copy_(a), reps))
        for v in shapes:
            lc = launcher(case, v.shape, sms)
            ok = check(case, lc)
            out[v.name] = {"ok": ok, "median_ms": med(device_ms(lc, reps)) if ok else 0.0}
        for held in (case.src, case.dst, mapped):  # unmap before the owner exits
            held.clear()
    finally:
        parent.send("done")
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return out


def bytes_minimum_of(s_tp: int, d_tp: int, seq: int) -> int:
    from beamserve.kv_transfer.plan import bytes_minimum

    return int(bytes_minimum(pool_for(beam_1_0(), d_tp, seq), seq))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kernel_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="")
    ap.add_argument("--env", default="")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--tokens", type=int, default=81920)
    ap.add_argument("--quick", action="store_true", help="two loop shapes, fewer repeats")
    ap.add_argument("--no-ipc", action="store_true", help="skip the IPC-mapped regions' case")
    ap.add_argument(
        "--cpu-dry-run", action="store_true",
        help="the kernels under TRITON_INTERPRET=1 on CPU tensors (checks only; no launch path)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    import torch

    if args.cpu_dry_run:
        DEV["name"] = "cpu"
        sms, name = 4, "cpu (Triton interpreter)"
    elif not torch.cuda.is_available():
        print("kernel_bench: needs a CUDA GPU (or --cpu-dry-run)", file=sys.stderr)
        return 2
    else:
        kernels.engine()  # compile the flat variants, check the loop kernel (as a rank does)
        props = torch.cuda.get_device_properties(0)
        sms, name = int(props.multi_processor_count), props.name
    dev = DEV["name"]
    reps = max(3, args.repeats if not args.quick else 3)
    case = make_case(8, 4, args.tokens, KVDtype.BF16, 1)
    nbytes = case.plan.bytes_moved
    flat_bufs = [torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=dev),
                 torch.empty(nbytes, dtype=torch.uint8, device=dev)]  # fmt: skip
    doc: dict[str, Any] = {
        "device": name, "sms": sms, "torch": torch.__version__, "bytes": nbytes,
        "pieces": case.tables.programs, "table_bytes": case.tables.nbytes, "variants": [],
    }  # fmt: skip
    copies = [copy_ms(nbytes, reps, flat_bufs)]
    rows = doc["variants"]
    vs = variants(args.quick)
    for i, v in enumerate(vs):
        launch = launcher(case, v.shape, sms)
        ok = check(case, launch)
        ms = device_ms(launch, reps) if ok else []
        rows.append(
            {"name": v.name, "shape": asdict(v.shape), "ok": ok, "ms": ms, "median_ms": med(ms)}
        )
        if i == len(vs) // 2:
            copies.append(copy_ms(nbytes, reps, flat_bufs))
    copies.append(copy_ms(nbytes, reps, flat_bufs))
    copy_med = [med(c) for c in copies]
    doc["copy_ms"] = copies
    doc["copy_median_ms"] = copy_med
    ref = med([x for c in copies for x in c])
    for r in rows:
        r["x_copy"] = round(ref / r["median_ms"], 4) if r["median_ms"] else 0.0
    ok_rows = [r for r in rows if r["ok"]]
    best = min(ok_rows, key=lambda r: r["median_ms"]) if ok_rows else None
    doc["best"] = best["name"] if best else ""
    if best is not None and dev == "cuda":
        shape = kernels.LocalShape(**best["shape"])
        t, bound = case.for_order(shape.order)
        pinned = torch.empty(len(t.table), dtype=torch.int64, pin_memory=True)
        pin_np = pinned.numpy()
        s_addrs = [b.addr for b in case.src]
        d_addrs = [b.addr for b in case.dst]
        launch = launcher(case, shape, sms)
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            graph.capture_begin(capture_error_mode="thread_local")
            launch()
            graph.capture_end()
        torch.cuda.synchronize()
        loop_launch = launcher(case, LOOP16, sms)
        flat_launch = launcher(case, FLAT, sms)
        doc["launch_path_us"] = {
            "bind (new array)": cpu_us(lambda: t.bind(s_addrs, d_addrs, case.base.addr), 50),
            "bind (into pinned)": cpu_us(
                lambda: t.bind(s_addrs, d_addrs, case.base.addr, out=pin_np), 50
            ),
            "upload call (pinned -> device)": cpu_us(
                lambda: bound.copy_(pinned, non_blocking=True), 50
            ),
            "triton launch call (loop)": cpu_us(loop_launch, 30),
            "triton launch call (flat)": cpu_us(flat_launch, 30),
            "graph replay call": cpu_us(graph.replay, 30),
        }
        for r in doc["launch_path_us"]:
            doc["launch_path_us"][r] = round(doc["launch_path_us"][r], 2)
        graph_ok = check(case, graph.replay)
        doc["graph_ok"] = graph_ok
        doc["graph_ms"] = med(device_ms(graph.replay, reps))
        doc["pulls"] = {
            "best + graph": pulls(case, shape, 20),
            "best, no graph": pulls(case, replace(shape, graph=False), 20),
        }
        doc["check_can_fail"] = not check(case, lambda: None)  # poison left: must fail
        doc["other_cases"] = {}
        del case, bound, launch, graph
        torch.cuda.empty_cache()
        flat, loop16 = FLAT, LOOP16
        others = [
            Variant("best", shape),
            Variant("flat plan", flat),
            Variant("flat src", replace(flat, order="src")),
            Variant("loop w16 x2 plan", loop16),
            Variant("loop w16 x2 src", replace(loop16, order="src")),
            Variant("loop w8 reg- x6 src", replace(LOOP8, per_sm=6, maxnreg=0, order="src")),
        ]
        for label, (s_tp, d_tp, dtype) in (("8:4 fp8", (8, 4, KVDtype.FP8_E4M3)),
                                           ("1:1 bf16", (1, 1, KVDtype.BF16))):  # fmt: skip
            c = make_case(s_tp, d_tp, args.tokens, dtype, 2)
            row: dict[str, Any] = {"bytes": c.plan.bytes_moved, "pieces": c.tables.programs}
            for v in others:
                lc = launcher(c, v.shape, sms)
                ok = check(c, lc)
                row[v.name] = {"ok": ok, "median_ms": med(device_ms(lc, reps)) if ok else 0.0}
            row["copy_ms"] = med(copy_ms(c.plan.bytes_moved, reps, flat_bufs))
            doc["other_cases"][label] = row
            del c
            torch.cuda.empty_cache()
        del flat_bufs
        torch.cuda.empty_cache()
        if not args.no_ipc:
            doc["ipc"] = ipc_rows(args, sms, reps, [Variant("best", shape), *others[1:5]])
    print_table(doc)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    if args.env and best is not None:
        sh = best["shape"]
        with open(args.env, "w") as f:
            values = {
                "KERNEL": sh["kernel"], "PER_SM": sh["per_sm"], "WARPS": sh["warps"],
                "MAXNREG": sh["maxnreg"], "RUNS": sh["runs"], "AHEAD": int(sh["ahead"]),
                "EVICT": int(sh["evict"]), "ORDER": sh["order"],
            }  # fmt: skip
            f.write("export " + " ".join(f"BEAMSERVE_KV_LOCAL_{k}={v}" for k, v in values.items()))
            f.write("\n")
    bad = [r["name"] for r in rows if not r["ok"]]
    if bad or not doc.get("graph_ok", True) or not doc.get("check_can_fail", True):
        print(f"kernel_bench: WRONG BYTES from {bad or 'the graph replay'}", file=sys.stderr)
        return 1
    return 0


def print_table(doc: dict[str, Any]) -> None:
    cm = doc["copy_median_ms"]
    print(f"\n{doc['device']}, {doc['sms']} SMs; {doc['bytes']:,} B, {doc['pieces']:,} pieces, "
          f"table {doc['table_bytes']:,} B; torch copy medians (start, middle, end): "
          + ", ".join(f"{x:.3f}" for x in cm) + " ms")  # fmt: skip
    print(f"{'variant':34} {'ok':>3} {'median ms':>10} {'min':>7} {'max':>7} {'x copy':>7}")
    for r in doc["variants"]:
        ms = r["ms"] or [0.0]
        print(f"{r['name']:34} {'y' if r['ok'] else 'NO':>3} {r['median_ms']:10.3f} "
              f"{min(ms):7.3f} {max(ms):7.3f} {r['x_copy']:7.3f}")  # fmt: skip
    print(f"fastest shape: {doc['best']}")
    for k, v in doc.get("launch_path_us", {}).items():
        print(f"  {k:34} {v:9.1f} us")
    if "graph_ms" in doc:
        print(f"  graph replay: bytes ok {doc['graph_ok']}, kernel {doc['graph_ms']:.3f} ms")
    for k, v in doc.get("pulls", {}).items():
        ph = " ".join(f"{a} {b:.3f}" for a, b in v["phases_ms"].items())
        print(f"  pull [{k:15}] {v['pull_ms']:.3f} ms (kernel {v['kernel_ms']:.3f}; {ph}; "
              f"replays {v['graph_replays']}/{v['launches']})")  # fmt: skip
    for k, v in doc.get("other_cases", {}).items():
        cells = "; ".join(
            f"{n} {c['median_ms']:.3f}{'' if c['ok'] else ' WRONG'}"
            for n, c in v.items()
            if isinstance(c, dict)
        )
        print(f"  {k}: {v['pieces']:,} pieces, copy {v['copy_ms']:.3f} ms; {cells}")
    ipc = doc.get("ipc")
    if ipc:
        cells = "; ".join(
            f"{n} {c['median_ms']:.3f}{'' if c['ok'] else ' WRONG'}"
            for n, c in ipc.items()
            if isinstance(c, dict)
        )
        print(
            f"  IPC-mapped 8:4 bf16: copy {ipc.get('copy_ms', 0):.3f} ms; {cells} "
            + str(ipc.get("error", ""))
        )


if __name__ == "__main__":
    sys.exit(main())
