"""`beamserve validate FILE` and `beamserve crd` (parsers, and what they run)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml


def add_operator_commands(sub: Any) -> None:
    """Register `validate` and `crd` on the top-level subparsers."""
    v = sub.add_parser(
        "validate",
        help="check BeamDeployment YAML offline (every admission rule); exit 1 on violations",
        description="Runs the admission webhook's validation on every BeamDeployment in FILE "
        "(one or more YAML documents; a bare spec works too) and prints each violation as "
        "'FILE#N name: field.path: what is wrong; the fix'. Documents of other API groups are "
        "skipped. Exit 0 when all are valid, 1 otherwise.",
    )
    v.add_argument("file", type=Path, metavar="FILE", help="YAML file, or - for stdin")
    v.add_argument(
        "--old",
        type=Path,
        default=None,
        metavar="FILE",
        help="the object as it is now: also check the change from it (unsafe in-place updates)",
    )
    sub.add_parser(
        "crd",
        help="print the BeamDeployment CustomResourceDefinition (YAML)",
        description="The CRD generated from the API models; `beamserve crd > manifests/crd.yaml`.",
    )
    c = sub.choices["crd"]
    c.add_argument("--no-cel", action="store_true", help="leave out the CEL rules (for ≤ 1.24)")
    c.add_argument("--update-docs", type=Path, default=None, metavar="MD",
                   help="rewrite the generated API reference blocks of this Markdown file "
                   "(docs/kubernetes.md) instead of printing the CRD")  # fmt: skip


def operator_main(args: argparse.Namespace) -> int:
    if args.command == "crd":
        from beamserve.operator import crd

        if args.update_docs is not None:
            path = args.update_docs
            path.write_text(crd.with_generated_docs(path.read_text()))
            return 0
        if args.no_cel:
            text = crd.HEADER + yaml.safe_dump(crd.crd_without_cel(), sort_keys=False, width=100)
        else:
            text = crd.crd_yaml()
        sys.stdout.write(text)
        return 0
    return _validate_main(args.file, args.old)


def _load(path: Path) -> list[Any]:
    text = sys.stdin.read() if str(path) == "-" else path.read_text()
    return [d for d in yaml.safe_load_all(text) if d is not None]


def _validate_main(path: Path, old_path: Path | None) -> int:
    from beamserve.operator.admission import Violation, validate, validate_update

    try:
        docs = _load(path)
        olds = {_name(d): d for d in _load(old_path)} if old_path is not None else {}
    except (OSError, yaml.YAMLError) as exc:
        print(f"{path}: cannot read: {exc}", file=sys.stderr)
        return 1
    checked = 0
    bad = 0
    for i, doc in enumerate(docs, 1):
        if (
            isinstance(doc, dict)
            and "apiVersion" in doc
            and not str(doc["apiVersion"]).startswith("beamserve.io/")
        ):
            print(f"{path}#{i}: skipped ({doc.get('kind')}, {doc['apiVersion']})", file=sys.stderr)
            continue
        checked += 1
        name = _name(doc)
        old = olds.get(name)
        found: list[Violation] = validate(doc) if old is None else validate_update(old, doc)
        label = f"{path}#{i}" + (f" {name}" if name else "")
        for v in found:
            print(f"{label}: {v}")
        bad += bool(found)
    if checked == 0:
        print(f"{path}: no BeamDeployment found", file=sys.stderr)
        return 1
    if bad:
        print(f"{bad} of {checked} document(s) invalid", file=sys.stderr)
        return 1
    print(f"{path}: {checked} BeamDeployment(s) valid")
    return 0


def _name(doc: Any) -> str:
    if isinstance(doc, dict) and isinstance(doc.get("metadata"), dict):
        return str(doc["metadata"].get("name") or "")
    return ""
