"""`beamserve render FILE` and `beamserve operator` (parsers, and what they run)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml


def add_runtime_commands(sub: Any) -> None:
    """Register `render` and `operator` on the top-level subparsers."""
    r = sub.add_parser(
        "render",
        help="print the Kubernetes objects the operator would create for a BeamDeployment",
        description="Runs the admission checks, then prints (YAML, one document per object) "
        "what the operator applies for every BeamDeployment in FILE. Without a cluster the "
        "optional APIs are assumed absent; --all-apis assumes LeaderWorkerSet, the Prometheus "
        "operator and the Gateway API Inference Extension are installed. Exit 1 on an invalid "
        "spec.",
    )
    r.add_argument("file", type=Path, metavar="FILE", help="YAML file, or - for stdin")
    r.add_argument("--namespace", default="default", help="for objects naming none")
    r.add_argument("--all-apis", action="store_true", help="assume every optional API")
    r.add_argument("--pdb-v1beta1", action="store_true", help="policy/v1beta1 (Kubernetes < 1.21)")
    r.add_argument("--image", default=None, help="the operator's image (sim/ref, router)")
    o = sub.add_parser(
        "operator",
        help="run the BeamDeployment operator (kopf) against a cluster",
        description="Reconciles BeamDeployments: applies their children with server-side "
        "apply (field manager beamserve), keeps status, retires drained revisions, and serves "
        "the validating admission webhook. In a pod it uses the ServiceAccount; elsewhere "
        "--kubeconfig (or $KUBECONFIG).",
    )
    o.add_argument("--kubeconfig", type=Path, default=None)
    o.add_argument("--namespace", default=None, help="watch one namespace (default: all)")
    o.add_argument("--image", default=None, help="default image of sim/ref workers and routers")
    o.add_argument("--webhook-port", type=int, default=None, help="serve the admission webhook")
    o.add_argument("--webhook-host", default=None, help="the name the webhook's cert is for")
    o.add_argument("--webhook-addr", default="0.0.0.0", help="listen address of the webhook")
    o.add_argument(
        "--webhook-cert-dir",
        type=Path,
        default=None,
        help="tls.crt + tls.key (e.g. from cert-manager); default: self-signed",
    )
    o.add_argument(
        "--webhook-config-name",
        default=None,
        help="patch this ValidatingWebhookConfiguration's caBundle at start",
    )
    o.add_argument("--drain-poll-s", type=float, default=10.0,
                   help="how often to look at retiring revisions")  # fmt: skip


def runtime_main(args: argparse.Namespace) -> int:
    if args.command == "render":
        return _render_main(args)
    from beamserve.operator.main import operator_main

    return operator_main(args)


def _render_main(args: argparse.Namespace) -> int:
    from beamserve.operator.admission import validate
    from beamserve.operator.desired import (
        ClusterFacts,
        RenderError,
        desired_objects,
        parse_deployment,
        render_yaml,
    )

    text = sys.stdin.read() if str(args.file) == "-" else args.file.read_text()
    docs = [d for d in yaml.safe_load_all(text) if isinstance(d, dict)]
    docs = [d for d in docs if str(d.get("apiVersion", "")).startswith("beamserve.io/")]
    if not docs:
        print(f"{args.file}: no BeamDeployment found", file=sys.stderr)
        return 1
    facts_kw: dict[str, Any] = {"namespace": args.namespace}
    if args.pdb_v1beta1:
        facts_kw["pdb_api_version"] = "policy/v1beta1"
    if args.image:
        facts_kw["operator_image"] = args.image
    facts = ClusterFacts.everything(**facts_kw) if args.all_apis else ClusterFacts(**facts_kw)
    out: list[dict[str, Any]] = []
    for i, doc in enumerate(docs, 1):
        problems = validate(doc)
        if problems:
            for v in problems:
                print(f"{args.file}#{i}: {v}", file=sys.stderr)
            return 1
        try:
            out += desired_objects(parse_deployment(doc), facts)
        except RenderError as exc:
            print(f"{args.file}#{i}: {exc}", file=sys.stderr)
            return 1
    sys.stdout.write(render_yaml(out))
    return 0
