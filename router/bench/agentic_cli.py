"""`beamserve bench agentic` and `beamserve bench wire-overhead`: parsers and entry points.

Importing this module is cheap (argparse only); `router/bench/cli.py` re-exports the four
functions and `beamserve.cli` hooks them in.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from beamserve.argtypes import positive_int

if TYPE_CHECKING:
    from rich.console import Console

DEFAULT_CONCURRENCY = "1,4,8,16,32,64"


def _positive(value: str) -> float:
    x = float(value)
    if not x > 0:
        raise argparse.ArgumentTypeError(f"{value}: must be a positive number")
    return x


def _nonneg(value: str) -> float:
    x = float(value)
    if not x >= 0:
        raise argparse.ArgumentTypeError(f"{value}: must be ≥ 0")
    return x


def _int_list(value: str) -> list[int]:
    try:
        out = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value}: give integers separated by commas") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"{value}: give positive integers, e.g. 1,4,8")
    return out


def _named_url(value: str) -> tuple[str, str]:
    name, sep, url = value.partition("=")
    if not sep or not name or not url.startswith("http"):
        raise argparse.ArgumentTypeError(f"{value}: give NAME=URL, e.g. smg=http://host:30000")
    return name, url


def _routers_help() -> str:
    from .agentic_procs import DEFAULT_ROUTERS, ROUTERS

    return (
        f"comma-separated, of {', '.join(ROUTERS)} (default: {','.join(DEFAULT_ROUTERS)}; "
        "a router not installed is skipped with a message)"
    )


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--routers", default=None, metavar="LIST", help=_routers_help())
    p.add_argument(
        "--target",
        default=None,
        metavar="URL|FILE",
        help="a running router to measure (workers are yours; no process is started), or, for "
        "`bench agentic`, a BeamDeployment FILE.yaml brought up as local processes (as "
        "`beamserve up` does) for each concurrency level and taken down after it",
    )
    p.add_argument("--target-name", default="target", metavar="NAME")
    p.add_argument(
        "--peer",
        type=_named_url,
        action="append",
        default=[],
        metavar="NAME=URL",
        help="another running router to measure beside --target (repeatable)",
    )
    p.add_argument("--profile", default="h200-bf16-tp8", help="sim profile of every worker")
    p.add_argument("--json", type=Path, default=None, metavar="PATH")  # fmt: skip


def add_bench_agentic(bench_sub: Any) -> argparse.ArgumentParser:
    """Add `agentic` to the `bench` subparsers."""
    p: argparse.ArgumentParser = bench_sub.add_parser(
        "agentic",
        help="routers side by side over real HTTP on simulated workers (claude-code sessions)",
        description="Closed-loop replay of claude-code sessions over HTTP through each router "
        "under test, in front of fresh sim workers (default) or routers already running "
        "(--target/--peer). Per router and concurrency: tok/s (per GPU), TTFT p50/p90/p99, "
        "per-user tok/s, cache-hit ratio, errors by status, goodput, router CPU per request; "
        "then, per level, each beamserve router against the best peer router (the goals "
        "table; --repeat N averages N rounds). docs/bench/agentic.md.",
    )
    _common(p)
    from .agentic_workload import default_trace_dir

    p.add_argument(
        "--trace",
        type=Path,
        default=default_trace_dir(),
        metavar="DIR",
        help="claude-code session directory (default: %(default)s)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=4,
        metavar="N",
        help="sim workers per run (with --target: how many stand behind it)",
    )
    p.add_argument(
        "--sessions",
        type=int,
        default=None,
        metavar="N",
        help="a held-out, evenly spread subset of N session files (default: all)",
    )
    p.add_argument(
        "--max-turns",
        type=int,
        default=None,
        metavar="N",
        help="play only the first N requests of each session",
    )
    p.add_argument(
        "--token-scale",
        type=_positive,
        default=0.25,
        metavar="X",
        help="scale input (64-token blocks) and output token counts",
    )
    p.add_argument(
        "--output-tokens", type=int, default=64, metavar="N", help="cap on max_tokens after scaling"
    )
    p.add_argument(
        "--think-scale",
        type=_nonneg,
        default=1.0,
        metavar="X",
        help="scale the trace's think times (1: as recorded, 0: none)",
    )
    p.add_argument(
        "--max-think-s",
        type=_nonneg,
        default=60.0,
        metavar="S",
        help="cap on one pause after scaling",
    )
    p.add_argument(
        "--concurrency",
        type=_int_list,
        default=_int_list(DEFAULT_CONCURRENCY),
        metavar="LIST",
        help=f"active sessions per level (default {DEFAULT_CONCURRENCY})",
    )
    p.add_argument(
        "--worker-max-model-len",
        type=int,
        default=262_144,
        metavar="N",
        help="--max-model-len of the started workers (the longest scaled prompts of the set "
        "exceed the sim's default 131,072)",
    )
    p.add_argument(
        "--worker-catch-up-s",
        type=float,
        default=None,
        metavar="S",
        help="--catch-up-s of the started workers (default theirs, 0.25: a busy host's late "
        "step timers do not slow the simulated GPUs; 0 = they do)",
    )
    p.add_argument(
        "--worker-max-num-batched-tokens",
        type=positive_int,
        default=None,
        metavar="N",
        help="--max-num-batched-tokens of the started workers: the tokens one engine step "
        "carries, prefill chunks and decodes together (default theirs: the profile's, 8,192 "
        "for h200-bf16-tp8); the same for every router of the run",
    )
    p.add_argument(
        "--repeat",
        type=positive_int,
        default=1,
        metavar="N",
        help="run every level N times (round k runs the routers in their order rotated by k); "
        "the goals table averages the rounds and shows how far one round's ratio strays",
    )
    p.add_argument("--slo-ttft-s", type=_positive, default=2.0, metavar="S")
    p.add_argument("--slo-tok-s", type=_positive, default=20.0, metavar="X")
    p.add_argument("--request-timeout-s", type=_positive, default=600.0, metavar="S")
    p.add_argument(
        "--plot", type=Path, default=None, metavar="PATH", help="PNG (default: next to --json)"
    )
    p.add_argument(
        "--markdown", type=Path, default=None, metavar="PATH", help="the tables as Markdown too"
    )
    p.add_argument(
        "--from-json",
        type=Path,
        default=None,
        metavar="PATH",
        help="run nothing: print (and --markdown / --plot) the results of an earlier --json",
    )
    p.add_argument("--logs", type=Path, default=None, metavar="DIR",
                   help="keep every started process's stdout/stderr here, and every request's "
                        "record (RUN/requests.jsonl)")  # fmt: skip
    return p


def add_bench_wire_overhead(bench_sub: Any) -> argparse.ArgumentParser:
    """Add `wire-overhead` to the `bench` subparsers."""
    p: argparse.ArgumentParser = bench_sub.add_parser(
        "wire-overhead",
        help="TTFT each router adds over a direct worker call (warm ~30K-token chat prompt)",
        description="Warm one ~30K-token chat prompt, then N streamed 1-token requests through "
        "the router and N directly to the same worker, interleaved; p50/p90 of each and the "
        "difference in ms. docs/bench/agentic.md.",
    )
    _common(p)
    p.add_argument(
        "--worker",
        default=None,
        metavar="URL",
        help="with --target: the worker behind it, called directly",
    )
    p.add_argument("--tokens", type=int, default=30_000, metavar="N")
    p.add_argument("-n", type=int, default=30, metavar="N", help="requests per path")  # fmt: skip
    return p


def _router_names(value: str | None, console: Console) -> list[str] | None:
    from .agentic_procs import DEFAULT_ROUTERS, ROUTERS

    names = [r.strip() for r in (value or ",".join(DEFAULT_ROUTERS)).split(",") if r.strip()]
    unknown = [r for r in names if r not in ROUTERS]
    if unknown:
        console.print(f"[red]unknown router {unknown[0]!r}; valid: {', '.join(ROUTERS)}")
        return None
    return names


def _targets(args: argparse.Namespace) -> list[tuple[str, str]]:
    out = [(args.target_name, args.target)] if args.target else []
    return out + list(args.peer)


def _is_spec(target: str | None) -> bool:
    """`--target` names a BeamDeployment file rather than a running router's URL."""
    return target is not None and not target.startswith(("http://", "https://"))


def _spec_runs(
    cfg: Any, spec_path: Path, args: argparse.Namespace, console: Console, progress: Any
) -> list[Any]:
    """`--target FILE.yaml`: for each concurrency level, bring the spec up (`SpecStack`, i.e.
    `LocalStack`), replay against its router, take it down; every level starts cold, as the
    self-contained mode's fresh workers do."""
    import dataclasses
    import tempfile

    from . import agentic
    from .agentic_procs import SpecStack

    results: list[Any] = []
    name = cfg.targets[0][0]
    bd = cfg.extra["_deployment"]
    cfg = dataclasses.replace(cfg, extra={k: v for k, v in cfg.extra.items() if k != "_deployment"})
    rounds = max(1, cfg.repeat)
    for level, rnd in ((c, k) for c in cfg.concurrency for k in range(rounds)):
        suffix = agentic.round_suffix(rnd, rounds)
        run_dir = args.logs / f"{name}-c{level}{suffix}-stack" if args.logs is not None else None
        state = (
            Path(tempfile.mkdtemp(prefix=f"beamserve-bench-{name}-"))
            if run_dir is None
            else run_dir
        )
        with SpecStack(bd, state) as stack:
            console.print(
                f"{name} @ C={level}: {spec_path} up, router {stack.router_url}, "
                + ", ".join(f"{role} {url}" for role, url in stack.workers)
            )
            one = dataclasses.replace(
                cfg, targets=[(name, stack.router_url)], concurrency=[level], repeat=1
            )
            got = agentic.run_agentic(one, say=console.print, progress=progress)
        for r in got:  # each round on a stack of its own
            r.data |= {"round": rnd, "rounds": rounds}
        results += got
        if args.json is not None:
            agentic.write_json(results, args.json)
    return results


def agentic_main(args: argparse.Namespace, console: Console) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from . import agentic
    from .agentic_procs import ProcError
    from .agentic_workload import WorkloadError, block_tokens_for, load_sessions

    if args.from_json is not None:
        results = agentic.read_json(args.from_json)
        for t in agentic.tables(results, f"beamserve bench agentic — {args.from_json}"):
            console.print(t)
        _outputs(results, args, str(args.from_json), console)
        return 0
    if args.peer and not args.target:
        console.print("[red]--peer needs --target (the routers already running)")
        return 2
    if args.target and args.worker_max_num_batched_tokens is not None:
        console.print(
            "[red]--worker-max-num-batched-tokens sets the workers the bench starts; with "
            "--target they are not the bench's (set the engines' own flag, or drop --target)"
        )
        return 2
    spec_extra: dict[str, Any] = {}
    if _is_spec(args.target):
        if args.peer:
            console.print("[red]--peer needs --target URL (a running router), not a spec file")
            return 2
        got_spec = _load_target_spec(Path(args.target), args, console)
        if got_spec is None:
            return 2
        spec_extra = got_spec
    targets = _targets(args)
    names: list[str] = []
    if not targets:
        got = _router_names(args.routers, console)
        if got is None:
            return 2
        names = got
    try:
        block_tokens = block_tokens_for(args.token_scale)
        sessions = load_sessions(
            args.trace,
            sessions=args.sessions,
            token_scale=args.token_scale,
            output_cap=args.output_tokens,
            think_scale=args.think_scale,
            max_think_s=args.max_think_s,
            max_turns=args.max_turns,
        )
    except WorkloadError as exc:
        console.print(f"[red]{exc}")
        return 2
    if not sessions:
        console.print(f"[red]{args.trace}: no sessions")
        return 2
    cfg = agentic.AgenticConfig(
        sessions=sessions,
        block_tokens=block_tokens,
        concurrency=args.concurrency,
        routers=names,
        targets=targets,
        workers=args.workers,
        profile=args.profile,
        max_model_len=args.worker_max_model_len,
        catch_up_s=args.worker_catch_up_s,
        max_batched_tokens=args.worker_max_num_batched_tokens,
        request_timeout_s=args.request_timeout_s,
        slo_ttft_s=args.slo_ttft_s,
        slo_tok_s=args.slo_tok_s,
        logs=args.logs,
        repeat=args.repeat,
        extra={
            "trace": str(args.trace),
            "token_scale": args.token_scale,
            "output_tokens": args.output_tokens,
            "think_scale": args.think_scale,
            "max_think_s": args.max_think_s,
            "max_turns": args.max_turns,
        },
    )
    if spec_extra:
        cfg.workers, cfg.profile = spec_extra.pop("_workers"), spec_extra.pop("_profile")
        cfg.targets = [(spec_extra.pop("_name"), "")]
        cfg.max_model_len = None  # the spec's workers run with the spec's command lines
        cfg.extra |= spec_extra
    n_req = sum(s.requests for s in sessions)
    console.print(
        f"beamserve bench agentic: {len(sessions)} sessions, {n_req} requests per run, "
        f"{cfg.workers} × {cfg.profile} workers, block {block_tokens} tokens, "
        f"concurrency {','.join(map(str, args.concurrency))}"
    )
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())  # fmt: skip
    try:
        with Progress(*columns, console=console, transient=True) as progress:
            if spec_extra:
                results = _spec_runs(cfg, Path(args.target), args, console, progress)
            else:
                results = agentic.run_agentic(
                    cfg,
                    say=console.print,
                    progress=progress,
                    on_result=(lambda rs: agentic.write_json(rs, args.json)) if args.json else None,
                )
    except ProcError as exc:
        console.print(f"[red]{exc}")
        return 1
    except KeyboardInterrupt:
        saved = f"; the runs finished so far are in {args.json}" if args.json else ""
        console.print(f"[yellow]interrupted: every started process was stopped{saved}")
        return 130
    title = (
        f"beamserve bench agentic — {len(sessions)} sessions, {cfg.workers} workers "
        f"({cfg.profile}), token scale {args.token_scale:g}, think scale {args.think_scale:g}"
    )
    for t in agentic.tables(results, title):
        console.print(t)
    if args.json is not None:
        agentic.write_json(results, args.json)
        console.print(f"wrote {args.json}")
    _outputs(results, args, title, console)
    ran = [r for r in results if not r.skipped]
    return 0 if ran else 1


def _load_target_spec(
    path: Path, args: argparse.Namespace, console: Console
) -> dict[str, Any] | None:
    """The spec of `--target FILE.yaml`, validated as `beamserve up` validates it, and what the
    results record of it; None (after a message) when it cannot run."""
    from beamserve.operator.local.stack import StackError, load_spec

    if not path.is_file():
        console.print(f"[red]--target {path}: no such file (give a URL or a BeamDeployment YAML)")
        return None
    try:
        bd = load_spec(path)
    except StackError as exc:
        console.print(f"[red]--target {path}: {exc}")
        return None
    pools = bd.spec.pools()
    engine = bd.spec.engine
    name = args.target_name if args.target_name != "target" else str(bd.metadata.name)
    return {
        "_deployment": bd,
        "_name": name,
        "_workers": sum(pool.replicas for pool in pools.values()),
        "_profile": engine.sim_profile,
        "target_spec": str(path),
        "engine": engine.name,
        "pools": {role: {"replicas": pool.replicas, "tp": pool.tp} for role, pool in pools.items()},
        "disaggregation": bd.spec.router.disaggregation.model_dump(by_alias=True),
    }


def _outputs(results: Any, args: argparse.Namespace, title: str, console: Console) -> None:
    from . import agentic

    base = args.json if args.json is not None else None
    plot_path = args.plot or (base.with_suffix(".png") if base is not None else None)
    if plot_path is not None:
        agentic.plot(results, plot_path, title)
        console.print(f"wrote {plot_path}")
        busy_path = plot_path.with_name(plot_path.stem + "-busy.png")
        if agentic.plot_busy(results, busy_path, title):
            console.print(f"wrote {busy_path}")
    if args.markdown is not None:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(agentic.markdown(results))
        console.print(f"wrote {args.markdown}")


def wire_overhead_main(args: argparse.Namespace, console: Console) -> int:
    import json

    from . import wire_overhead

    targets = _targets(args)
    if args.peer and not args.target:
        console.print("[red]--peer needs --target (the routers already running)")
        return 2
    if _is_spec(args.target):
        console.print("[red]wire-overhead --target takes a running router's URL, not a spec file")
        return 2
    if targets and not args.worker:
        console.print("[red]--target needs --worker URL (the worker behind it, called directly)")
        return 2
    names: list[str] = []
    if not targets:
        got = _router_names(args.routers, console)
        if got is None:
            return 2
        names = got
    try:
        with console.status(f"measuring wire overhead ({args.tokens:,}-token prompt, n={args.n})"):
            results = wire_overhead.run_wire(
                names,
                tokens=args.tokens,
                n=args.n,
                profile=args.profile,
                targets=targets,
                worker_url=args.worker,
                say=console.print,
            )
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: every started process was stopped")
        return 130
    console.print(
        wire_overhead.table(
            results, f"beamserve bench wire-overhead — {args.tokens:,}-token chat, n={args.n}"
        )
    )
    if args.json is not None:
        import sys

        args.json.parent.mkdir(parents=True, exist_ok=True)
        doc = {"command": " ".join(sys.argv), "results": [r.to_json() for r in results]}
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        console.print(f"wrote {args.json}")
    return 0 if any(r.skipped is None for r in results) else 1
