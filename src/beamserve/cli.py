"""The `beamserve` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from beamserve import __version__, log
from beamserve.argtypes import positive_int, tp_pair
from beamserve.kv_transfer.backends.names import ALL_BACKENDS, BACKENDS

if TYPE_CHECKING:
    from beamserve.kv_transfer.bench import TransferResult

console = Console(width=None if sys.stdout.isatty() else 150)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="beamserve",
        description="Disaggregated serving for Beam: KV transfer, workers, router, operator.",
    )
    parser.add_argument("--version", action="version", version=f"beamserve {__version__}")
    parser.add_argument("--log-level", default=None, help="debug, info (default), warning")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser(
        "demo",
        help="the product on this machine: a tiny real Beam, disaggregated, on agent traces",
        description="`beamserve demo`: brings up manifests/examples/local-ref.yaml (prefill "
        "TP2 → decode TP1 over NIXL, the router in front; makes the tiny checkpoint if "
        "missing), replays claude-code sessions through the router with the openai SDK and "
        "prints per turn the TTFT, cached tokens, the router's decision and the KV moved, then "
        "a summary. `beamserve demo kv`: moves an 80K-token Beam KV from a TP8 prefill group "
        "to a TP4 decode group (one process per rank) and verifies it byte for byte.",
    )
    demo.add_argument("what", nargs="?", choices=("agents", "kv"), default="agents")
    demo.add_argument("--spec", type=Path, default=None, help="agents: a sim/ref BeamDeployment")
    demo.add_argument("--trace", type=Path, default=None, help="agents: claude-code directory")
    demo.add_argument("--sessions", nargs="+", default=["trace_0002", "trace_0024", "trace_0028"])
    demo.add_argument("--turns", type=positive_int, default=4, help="agents: turns per session")
    demo.add_argument("--state-dir", type=Path, default=None)
    demo.add_argument("--tokens", type=positive_int, default=81920)
    demo.add_argument("--pair", type=tp_pair, default=(8, 4), metavar="P:D")
    demo.add_argument("--backend", choices=BACKENDS, default="nixl")

    bench = sub.add_parser("bench", help="benchmarks (results as a table, JSON and a plot)")
    bsub = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    kv = bsub.add_parser(
        "kv-transfer",
        help="real NIXL/Mooncake/CMA transfers of Beam-shaped KV between rank processes",
        description="For each backend, TP pair and token count: plan, pull and verify one "
        "request's KV (Beam 1.0 shape: 52 layers, 8 KV heads, head_dim 128, bf16, page 64), "
        "beside a plain memcpy of the same bytes. Goals: bytes_moved == bytes_minimum; NIXL "
        "at 80K tokens 8:4 >= 0.8 x memcpy_gbps; plan_ms <= 20 at 80K tokens.",
    )
    kv.add_argument("--tokens", type=positive_int, nargs="+", default=[2048, 32768, 81920])
    kv.add_argument(
        "--pairs",
        type=tp_pair,
        nargs="+",
        default=[(8, 4), (4, 8), (2, 8), (8, 8), (1, 1)],
        metavar="P:D",
    )
    kv.add_argument(
        "--backend",
        nargs="+",
        choices=ALL_BACKENDS,
        default=["nixl", "mooncake", "cma", "shm"],
        help="default: nixl mooncake cma shm (dram), cuda_ipc (vram); cma: batched cross-memory "
        "attach between processes of one host; shm: regions in shared memory that one process "
        "maps and copies (one host)",
    )
    kv.add_argument("--memory", choices=("dram", "vram"), default="dram", help="KV regions in")
    kv.add_argument(
        "--path",
        nargs="+",
        choices=("direct", "staged", "auto"),
        default=["direct"],
        help="direct, staged (gather/one descriptor per chunk/scatter), auto (cost model)",
    )
    kv.add_argument(
        "--driver",
        choices=("auto", "ranks", "host_local"),
        default=None,
        help="who drives a pull's reads: ranks (each decode rank its own), host_local (one "
        "process maps every rank's region and copies the whole request: one launch over CUDA "
        "IPC-mapped VRAM, or copy threads over shm DRAM; one host), auto (the cost model; "
        "default, or BEAMSERVE_KV_DRIVER)",
    )
    kv.add_argument(
        "--kv-dtype", nargs="+", choices=("bf16", "fp8_e4m3"), default=["bf16"], metavar="DTYPE"
    )
    kv.add_argument(
        "--staging-bytes",
        type=int,
        default=None,
        metavar="N",
        help="staging pool per rank (default 512 MiB dram, 4 GiB vram; 0: no staged path)",
    )
    kv.add_argument("--chunk-bytes", type=int, default=None, metavar="N", help="per wire chunk")
    kv.add_argument(
        "--repeats",
        type=positive_int,
        default=1,
        metavar="N",
        help="pulls per row, each a fresh request: the row is the median pull against the "
        "median of its same-run baselines (default %(default)s)",
    )
    kv.add_argument(
        "--json",
        type=Path,
        default=Path("bench-results/kv-transfer.json"),
        metavar="PATH",
        help="results as a JSON list (default: %(default)s)",
    )
    kv.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="PATH",
        help="throughput plot (PNG); default: next to --json",
    )

    from beamserve.kv_transfer.bench_cli import add_bench_kv_plan

    add_bench_kv_plan(bsub)

    from beamserve.workers.sim import cli as sim_cli  # parser only: loads no simulator

    sim_cli.add_sim_fidelity(bsub)

    from beamserve.router.bench import cli as route_bench_cli  # parsers only

    route_bench_cli.add_bench_route(bsub)
    route_bench_cli.add_bench_route_overhead(bsub)
    route_bench_cli.add_bench_agentic(bsub)
    route_bench_cli.add_bench_wire_overhead(bsub)

    from beamserve.workers.ref import cli as ref_cli  # parsers only: imports no torch

    model = sub.add_parser("model", help="make model checkpoints (a tiny Beam for CPU runs)")
    msub = model.add_subparsers(dest="model", required=True, metavar="ACTION")
    ref_cli.add_make_tiny(msub)
    check = sub.add_parser("check", help="end-to-end correctness checks")
    csub = check.add_subparsers(dest="check", required=True, metavar="CHECK")
    ref_cli.add_check_disagg(csub)

    from beamserve.workers.server import cli as worker_cli  # parser only

    worker_cli.add_worker(sub)

    from beamserve.router import cli as router_cli  # parser only

    router_cli.add_router(sub)
    _add_sidecar(sub)

    from beamserve.operator import cli as operator_cli  # parsers only

    operator_cli.add_operator_commands(sub)
    from beamserve.operator import commands as operator_commands  # parsers only

    operator_commands.add_runtime_commands(sub)
    from beamserve.operator.local import cli as local_cli  # parsers only

    local_cli.add_local_commands(sub)
    return parser


def _add_sidecar(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`beamserve sidecar` (parser only: the proxy's modules load when it runs)."""
    p = sub.add_parser(
        "sidecar",
        help="decode-side proxy: runs the prefill leg a gateway names in x-prefiller-host-port",
        description="Runs beside a decode worker (same pod), in front of it. A request carrying "
        "x-prefiller-host-port: host:port (set by the router's ext_proc endpoint picker when it "
        "disaggregates) gets its prefill run on that prefill worker and its decode on the local "
        "one, the KV handed over in the style both report (vLLM kv_transfer_params or SGLang "
        "bootstrap); when they cannot pair, or the prefill leg fails, it is served colocated "
        "and counted on the sidecar's /metrics. Requests without the header pass through "
        'unchanged. Prints one JSON line {"event": "sidecar_ready", ...} on stdout once it '
        "serves.",
    )
    p.add_argument("--decode", required=True, metavar="URL", help="the local decode worker")
    p.add_argument("--host", default="127.0.0.1", help="0.0.0.0 in a pod (the gateway calls it)")
    p.add_argument("--port", type=int, default=8000, help="0 = any free port")
    p.add_argument(
        "--prefill-timeout-s",
        type=float,
        default=30.0,
        help="longest wait for the prefill leg before the decode worker prefills locally",
    )
    p.add_argument(
        "--first-byte-timeout-s",
        type=float,
        default=120.0,
        help="longest wait for the decode worker's first byte (and between its bytes)",
    )
    p.add_argument("--max-body-bytes", type=positive_int, default=32 * 1024 * 1024)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    log.setup(args.log_level)
    if args.command == "demo" and args.what == "agents":
        from beamserve.operator.local.demo import demo_main

        return demo_main(args, console)
    if args.command == "demo":
        return _demo(args)
    if args.command == "bench" and args.bench == "kv-transfer":
        return _bench_kv(args)
    if args.command == "bench" and args.bench == "kv-plan":
        from beamserve.kv_transfer.bench_cli import bench_kv_plan_main

        return bench_kv_plan_main(args, console)
    if args.command == "bench" and args.bench == "sim-fidelity":
        from beamserve.workers.sim.cli import sim_fidelity_main

        return sim_fidelity_main(args, console)
    if args.command == "model" and args.model == "make-tiny":
        from beamserve.workers.ref.cli import make_tiny_main

        return make_tiny_main(args, console)
    if args.command == "bench" and args.bench == "route":
        from beamserve.router.bench.cli import route_main

        return route_main(args, console)
    if args.command == "bench" and args.bench == "route-overhead":
        from beamserve.router.bench.cli import route_overhead_main

        return route_overhead_main(args, console)
    if args.command == "bench" and args.bench == "agentic":
        from beamserve.router.bench.cli import agentic_main

        return agentic_main(args, console)
    if args.command == "bench" and args.bench == "wire-overhead":
        from beamserve.router.bench.cli import wire_overhead_main

        return wire_overhead_main(args, console)
    if args.command == "router":
        from beamserve.router.cli import router_main

        return router_main(args)
    if args.command == "sidecar":
        from beamserve.router.sidecar import sidecar_main

        return sidecar_main(args)
    if args.command == "worker":
        from beamserve.workers.server.cli import worker_main

        return worker_main(args)
    if args.command in ("render", "operator"):
        from beamserve.operator.commands import runtime_main

        return runtime_main(args)
    if args.command in ("validate", "crd"):
        from beamserve.operator.cli import operator_main

        return operator_main(args)
    if args.command in ("up", "down", "status"):
        from beamserve.operator.local.cli import local_main

        return local_main(args, console)
    if args.command == "check" and args.check == "disagg":
        from beamserve.workers.ref.cli import check_disagg_main

        return check_disagg_main(args, console)
    return 2


def _results_table(title: str, rows: Sequence[TransferResult]) -> Table:
    table = Table(title=title)
    for col in (
        "backend",
        "P:D",
        "tokens",
        "MB moved",
        "= min",
        "descs",
        "plan ms",
        "s",
        "GB/s",
        "memcpy GB/s",
        "ratio",
        "verified",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r.backend,
            f"{r.src_tp}:{r.dst_tp}",
            f"{r.tokens:,}",
            f"{r.bytes_moved / 1e6:,.1f}",
            "yes" if r.bytes_moved == r.bytes_minimum else "NO",
            f"{r.descriptors:,}",
            f"{r.plan_ms:.1f}",
            f"{r.seconds:.3f}",
            f"{r.gbps:.2f}",
            f"{r.memcpy_gbps:.2f}",
            f"{r.gbps / r.memcpy_gbps:.2f}" if r.memcpy_gbps else "-",
            "yes" if r.verified else "NO",
        )
    return table


def _bench_kv(args: argparse.Namespace) -> int:
    from beamserve.kv_transfer.bench_cli import bench_kv_main

    return bench_kv_main(args, console)


def _demo(args: argparse.Namespace) -> int:
    from beamserve.kv_transfer import bench
    from beamserve.kv_transfer.model import beam_1_0

    src_tp, dst_tp = args.pair
    model = beam_1_0()
    console.rule(
        f"[bold]beamserve demo: Beam KV, prefill TP{src_tp} → decode TP{dst_tp} over {args.backend}"
    )
    console.print(
        f"model: Beam 1.0 KV shape — {model.num_hidden_layers} layers "
        f"({len(model.full_layers)} full, {len(model.sliding_layers)} sliding, "
        f"window {model.sliding_window}), {model.num_key_value_heads} KV heads × "
        f"{model.head_dim}, bf16, page 64"
    )
    with console.status(f"spawning {src_tp} prefill + {dst_tp} decode rank processes"):
        rig = bench.PairRig(model, src_tp, dst_tp, args.backend, args.tokens)
    try:
        with console.status("warming up the connections"):
            rig.warm_up()
        with console.status(f"prefill writes {args.tokens:,} tokens; decode pulls and verifies"):
            r = rig.run(args.tokens)
    finally:
        rig.close()
    console.print(_results_table("what moved", [r]))
    exact = "exactly the minimum" if r.bytes_moved == r.bytes_minimum else "NOT the minimum"
    for line in (
        f"moved:    {r.bytes_moved / 1e9:.2f} GB in {r.descriptors:,} descriptors ({exact})",
        f"speed:    {r.seconds:.3f} s = {r.gbps:.2f} GB/s "
        f"(memcpy in the same run: {r.memcpy_gbps:.2f} GB/s)",
        f"plan:     {r.plan_ms:.1f} ms",
        f"verified: byte for byte: {'yes' if r.verified else 'NO'}",
    ):
        console.print(line, soft_wrap=True)
    return 0 if r.verified and r.bytes_moved == r.bytes_minimum else 1


if __name__ == "__main__":
    sys.exit(main())
