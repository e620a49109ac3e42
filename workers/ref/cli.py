"""The ref engine's CLI commands: `beamserve model make-tiny` and `beamserve check disagg`.

Parsers import nothing heavy (no torch), so `beamserve --help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from beamserve.kv_transfer.backends.names import BACKENDS
from rich.console import Console
from rich.table import Table

from beamserve.argtypes import positive_int, tp_pair

DEFAULT_PAIRS = "1:1,2:1,1:2,4:2,2:4"


def _pairs(text: str) -> list[tuple[int, int]]:
    return [tp_pair(part) for part in text.split(",")]


def add_make_tiny(model_sub: Any) -> None:
    tiny = model_sub.add_parser(
        "make-tiny",
        help="write a tiny Beam checkpoint (config, seeded safetensors, BPE tokenizer)",
        description="Writes a real checkpoint directory for a tiny Beam: config.json (Beam's "
        "layer-type pattern, GQA 6, window 32, MoE), seeded bf16 weights as safetensors, a "
        "byte-level BPE tokenizer trained here, and a ChatML-like chat template. It loads with "
        "transformers' AutoConfig / BeamForCausalLM / AutoTokenizer.from_pretrained(DIR).",
    )
    tiny.add_argument("dir", type=Path, metavar="DIR")
    tiny.add_argument("--seed", type=int, default=0, help="weight seed (default: %(default)s)")


def add_check_disagg(check_sub: Any) -> None:
    dis = check_sub.add_parser(
        "disagg",
        help="disaggregated greedy decoding == colocated, per TP pair, over real transfers",
        description="Runs each TP pair as a prefill worker process and a decode worker process "
        "(the decode side pulls the prompt's KV over NIXL or Mooncake into its own TP layout) "
        "and exits 0 only if every request's greedy tokens equal the colocated run's, with no "
        "recompute fallback and exactly the minimum bytes moved. A follow-up turn of the first "
        "prompt must be served from the prefill worker's prefix cache.",
    )
    dis.add_argument("--engine", choices=("ref",), default="ref")
    dis.add_argument(
        "--tp-pairs",
        type=_pairs,
        default=_pairs(DEFAULT_PAIRS),
        metavar="P:D,...",
        help=f"prefill:decode TP pairs (default: {DEFAULT_PAIRS})",
    )
    dis.add_argument("--backend", choices=BACKENDS, default="nixl")
    dis.add_argument(
        "--prompts", type=positive_int, default=3, help="prompts (default: %(default)s)"
    )
    dis.add_argument(
        "--tokens", type=positive_int, default=16, help="tokens per request (default: %(default)s)"
    )
    dis.add_argument(
        "--model", type=Path, default=None, metavar="DIR", help="checkpoint (default: make one)"
    )
    dis.add_argument("--seed", type=int, default=0, help="seed when making the checkpoint")
    dis.add_argument(
        "--deadline", type=float, default=30.0, help="per-request decode deadline, seconds"
    )
    dis.add_argument(
        "--reuse-workers",
        action="store_true",
        help="one prefill and one decode process for all pairs, re-sharded per pair (faster)",
    )
    dis.add_argument("--json", type=Path, default=None, metavar="PATH", help="results as JSON")


def make_tiny_main(args: argparse.Namespace, console: Console) -> int:
    from beamserve.kv_transfer.model import BeamModelConfig
    from beamserve.workers.ref.checkpoint import make_tiny

    with console.status(f"training the tokenizer and writing {args.dir}"):
        out = make_tiny(args.dir, args.seed)
    m = BeamModelConfig.from_checkpoint(out)
    console.print(
        f"wrote {out}: {m.num_hidden_layers} layers ({len(m.full_layers)} full, "
        f"{len(m.sliding_layers)} sliding, window {m.sliding_window}), "
        f"{m.num_attention_heads}/{m.num_key_value_heads} heads × {m.head_dim}, {m.dtype}"
    )
    for f in sorted(out.iterdir()):
        console.print(f"  {f.name:24} {f.stat().st_size:>10,} B")
    return 0


def check_disagg_main(args: argparse.Namespace, console: Console) -> int:
    """Run the check; a checkpoint made for the run is removed afterwards, and the worker
    logs are kept (and named) only when the check fails."""
    with tempfile.TemporaryDirectory(prefix="beamserve-check-") as tmp:
        model_dir = args.model
        if model_dir is None:
            from beamserve.workers.ref.checkpoint import make_tiny

            with console.status("making a tiny Beam checkpoint"):
                model_dir = make_tiny(Path(tmp) / "tiny-beam", args.seed)
        return _check_disagg(args, console, Path(model_dir))


def _check_disagg(args: argparse.Namespace, console: Console, model_dir: Path) -> int:
    from beamserve.kv_transfer.errors import KVTransferError
    from beamserve.workers.ref import check

    console.print(f"model: {model_dir}")
    try:
        check.check_pairs(model_dir, args.tp_pairs)
    except KVTransferError as exc:
        console.print(f"[red]--tp-pairs: {exc}[/red]", soft_wrap=True)
        return 2
    with console.status("colocated reference (one instance, uninterrupted greedy loop)"):
        cases = check.build_cases(model_dir, args.prompts, args.tokens)
    lengths = ", ".join(str(len(c.token_ids)) for c in cases)
    console.print(f"requests: {len(cases)} (prompt tokens {lengths}), {args.tokens} tokens each")
    log_dir = Path(tempfile.mkdtemp(prefix="beamserve-check-logs-"))
    results: list[check.PairResult] = []
    with console.status(f"{args.backend}: running {len(args.tp_pairs)} pairs") as status:

        def progress(r: check.PairResult) -> None:
            results.append(r)
            status.update(f"{args.backend}: {r.pair} {'ok' if r.ok else 'FAILED'}")

        check.run_check(
            model_dir,
            args.tp_pairs,
            args.backend,
            cases,
            args.tokens,
            reuse_workers=args.reuse_workers,
            deadline_s=args.deadline,
            log_dir=log_dir,
            on_result=progress,
        )
    console.print(_table(results))
    for r in results:
        for problem in r.problems[:5]:
            console.print(f"[red]{r.pair} {r.backend}: {problem}[/red]", soft_wrap=True)
    ok = bool(results) and all(r.ok for r in results)
    if ok:
        shutil.rmtree(log_dir, ignore_errors=True)
    else:
        console.print(f"worker logs: {log_dir}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        rows = [{**asdict(r), "pair": r.pair, "ok": r.ok} for r in results]
        args.json.write_text(json.dumps(rows, indent=2))
    console.print(
        f"disaggregated == colocated for every request: {'yes' if ok else 'NO'}", soft_wrap=True
    )
    return 0 if ok else 1


def _table(results: list[Any]) -> Table:
    table = Table(title="beamserve check disagg --engine ref")
    for col in (
        "pair",
        "backend",
        "requests",
        "tokens equal",
        "fallbacks",
        "prefix reused",
        "bytes moved",
        "= min",
        "start s",
        "seconds",
        "ok",
    ):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(
            r.pair,
            r.backend,
            str(r.requests),
            f"{r.equal}/{r.requests}",
            str(r.fallbacks),
            f"{r.reused_tokens}/{r.follow_up_tokens} tok",
            f"{r.bytes_moved:,}",
            "yes" if r.bytes_moved == r.bytes_minimum else "NO",
            f"{r.startup_s:.1f}",
            f"{r.seconds:.2f}",
            "yes" if r.ok else "NO",
        )
    return table
