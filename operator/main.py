"""`beamserve operator`: the kopf operator — handlers translate events into `Reconciler` calls.

Handlers are kopf *event* handlers (level-triggered: every event of a BeamDeployment, of a
BeamPool, or of a workload the operator manages re-runs `Reconciler.reconcile_named` for the
owning BeamDeployment, which writes only what differs). kopf's change-detecting handlers
(`on.create` / `on.update` / `on.resume`) would store kopf's own state in annotations on every
handling — writes when nothing changed, after every restart — so they are not used; creation,
update and resumption after a restart are all "an event arrived" here. No finalizers (children
go by owner references and the garbage collector), no peering (one replica, `Recreate`).

While a BeamDeployment has a retiring revision the operator re-checks it every
`--drain-poll-s` seconds (the drain timeout runs out without any event).

The validating webhook (`kopf.on.validate`, path `/validate-beamdeployment`) calls
`admission.validate` / `validate_update`. Its certificate: files in `--webhook-cert-dir`
(`tls.crt`, `tls.key`, e.g. from cert-manager), else a self-signed one generated at start for
`--webhook-host`, whose certificate is then patched into the `caBundle` of every webhook of
`--webhook-config-name` (the chart's ValidatingWebhookConfiguration).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import ipaddress
import logging
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

import kopf
import structlog
from beamserve.operator import scaler
from beamserve.operator.api import GROUP, PLURAL, VERSION
from beamserve.operator.desired import LABEL_MANAGED_BY, MANAGED_BY

log = structlog.get_logger(__name__)

WEBHOOK_ID = "validate-beamdeployment"
WEBHOOK_PATH = f"/{WEBHOOK_ID}"


def build_registry(reconciler: Any, *, drain_poll_s: float, webhook: bool) -> kopf.OperatorRegistry:
    """The kopf handlers, bound to `reconciler` (a `Reconciler`)."""
    registry = kopf.OperatorRegistry()
    rechecks: dict[tuple[str, str], threading.Timer] = {}
    guard = threading.Lock()

    def run(namespace: str | None, name: str | None) -> None:
        if not namespace or not name:
            return
        result = reconciler.reconcile_named(namespace, name)
        status = result.status or {}
        retiring = any(
            c.get("reason") == "RetiringRevision" or c.get("reason") == "RollingOut"
            for c in status.get("conditions", [])
        )
        if retiring:
            schedule(namespace, name)

    def schedule(namespace: str, name: str) -> None:
        with guard:
            key = (namespace, name)
            if key in rechecks and rechecks[key].is_alive():
                return
            timer = threading.Timer(drain_poll_s, _recheck, args=(namespace, name))
            timer.daemon = True
            rechecks[key] = timer
            timer.start()

    def _recheck(namespace: str, name: str) -> None:
        with guard:
            rechecks.pop((namespace, name), None)
        try:
            run(namespace, name)
        except Exception:  # a later event or recheck retries
            log.exception("recheck_failed", namespace=namespace, deployment=name)

    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)
    def on_deployment(**kw: Any) -> None:
        if kw["type"] != "DELETED":
            run(kw["namespace"], kw["name"])

    @kopf.on.event(GROUP, VERSION, scaler.PLURAL, registry=registry)
    def on_pool(**kw: Any) -> None:
        run(kw["namespace"], (kw["body"].get("spec") or {}).get("deployment"))

    @kopf.on.event(
        "apps", "v1", "deployments", labels={LABEL_MANAGED_BY: MANAGED_BY}, registry=registry
    )
    def on_workload(**kw: Any) -> None:
        from beamserve.operator.reconcile import owner_deployment

        run(kw["namespace"], owner_deployment(kw["body"]))

    @kopf.on.event(
        "leaderworkerset.x-k8s.io",
        "v1",
        "leaderworkersets",
        labels={LABEL_MANAGED_BY: MANAGED_BY},
        registry=registry,
    )
    def on_group_workload(**kw: Any) -> None:
        from beamserve.operator.reconcile import owner_deployment

        run(kw["namespace"], owner_deployment(kw["body"]))

    if webhook:

        @kopf.on.validate(
            GROUP,
            VERSION,
            PLURAL,
            id=WEBHOOK_ID,
            operations=["CREATE", "UPDATE"],
            registry=registry,
        )
        def admit(**kw: Any) -> None:
            from beamserve.operator.admission import validate, validate_update

            new, old, operation = dict(kw["body"]), kw.get("old"), kw.get("operation")
            new = without_defaults(new)
            old = without_defaults(dict(old)) if old else None
            problems = (
                validate_update(dict(old), new) if operation == "UPDATE" and old else validate(new)
            )
            if problems:
                raise kopf.AdmissionError("; ".join(str(p) for p in problems), code=422)

    return registry


def without_defaults(obj: dict[str, Any]) -> dict[str, Any]:
    """`obj` without the fields whose value is the CRD schema's default for them.

    The API server applies the schema's defaults before it calls the webhook, so a field the
    user never wrote arrives set; admission rules that refuse a field *set* where it does not
    apply (`spec.kv.onLoadFailure` for a non-vLLM engine …) would refuse every object. A field
    equal to its default means nothing more than the default, so dropping it loses nothing.
    """
    import copy

    from beamserve.operator import crd

    schema = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    out = copy.deepcopy(obj)
    spec = out.get("spec")
    if isinstance(spec, dict):
        _drop_defaults(spec, schema["properties"]["spec"])
    return out


def _drop_defaults(node: Any, schema: dict[str, Any]) -> None:
    if isinstance(node, dict):
        props = schema.get("properties") or {}
        for key in list(node):
            sub = props.get(key)
            if sub is None:
                continue
            if "default" in sub and node[key] == sub["default"]:
                del node[key]
                continue
            _drop_defaults(node[key], sub)
            if isinstance(node[key], dict) and not node[key] and sub.get("default") == {}:
                del node[key]
    elif isinstance(node, list) and isinstance(schema.get("items"), dict):
        for item in node:
            _drop_defaults(item, schema["items"])


def self_signed_cert(host: str, directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate (and key) for `host` and 127.0.0.1, valid for 10 years."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)])
    names: list[x509.GeneralName] = [x509.DNSName(host), x509.DNSName("localhost")]
    names.append(x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=3650))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    directory.mkdir(parents=True, exist_ok=True)
    certfile, keyfile = directory / "tls.crt", directory / "tls.key"
    certfile.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    keyfile.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    keyfile.chmod(0o600)
    return certfile, keyfile


def patch_ca_bundle(client: Any, config_name: str, ca_pem: bytes) -> None:
    """Set `caBundle` on every webhook of the ValidatingWebhookConfiguration `config_name`."""
    import base64

    res = client.resources.get(
        api_version="admissionregistration.k8s.io/v1", kind="ValidatingWebhookConfiguration"
    )
    live = res.get(name=config_name).to_dict()
    bundle = base64.b64encode(ca_pem).decode()
    webhooks = live.get("webhooks") or []
    if all((w.get("clientConfig") or {}).get("caBundle") == bundle for w in webhooks):
        return
    for w in webhooks:
        w.setdefault("clientConfig", {})["caBundle"] = bundle
    res.patch(
        body={"webhooks": webhooks},
        name=config_name,
        content_type="application/merge-patch+json",
    )


def operator_main(args: argparse.Namespace) -> int:
    from beamserve.operator.reconcile import Reconciler, discover_facts
    from kubernetes import client as k8s_client
    from kubernetes import config as k8s_config
    from kubernetes.dynamic import DynamicClient

    # kopf logs through the standard library (handler failures, API retries)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)  # not a line per event
    if args.kubeconfig is not None:
        os.environ["KUBECONFIG"] = str(args.kubeconfig)
        k8s_config.load_kube_config(config_file=str(args.kubeconfig))  # type: ignore[no-untyped-call]
    elif os.environ.get("KUBERNETES_SERVICE_HOST"):
        k8s_config.load_incluster_config()  # type: ignore[no-untyped-call]
    else:
        k8s_config.load_kube_config()  # type: ignore[no-untyped-call]
    # discovery cache in a writable place (the pod's root filesystem is read-only)
    cache = Path(tempfile.gettempdir()) / "beamserve-discovery.json"
    client = DynamicClient(k8s_client.ApiClient(), cache_file=str(cache))  # type: ignore[no-untyped-call]
    facts = discover_facts(client, args.image)
    log.info("cluster_facts", **facts.__dict__)
    reconciler = Reconciler(client, facts)
    webhook = args.webhook_port is not None
    registry = build_registry(reconciler, drain_poll_s=args.drain_poll_s, webhook=webhook)

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        # the kubernetes client's configuration, loaded above (its kubeconfig, in-cluster)
        cfg = k8s_client.Configuration.get_default_copy()
        keys: dict[str, str] = dict(cfg.api_key or {})
        auth = keys.get("authorization") or keys.get("BearerToken") or ""
        scheme, _sep, token = auth.partition(" ")
        return kopf.ConnectionInfo(
            server=cfg.host,
            scheme=scheme or None,
            token=token or None,
            insecure=not cfg.verify_ssl,
            ca_path=cfg.ssl_ca_cert,
            certificate_path=cfg.cert_file,
            private_key_path=cfg.key_file,
        )

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.posting.level = logging.WARNING
        settings.peering.standalone = True
        settings.watching.server_timeout = 300
        settings.watching.client_timeout = 330
        if not webhook:
            return
        host = args.webhook_host or "localhost"
        cert_dir: Path | None = args.webhook_cert_dir
        if cert_dir is not None and (cert_dir / "tls.crt").exists():
            certfile, keyfile = cert_dir / "tls.crt", cert_dir / "tls.key"
        else:
            certfile, keyfile = self_signed_cert(host, cert_dir or Path(tempfile.mkdtemp()))
            if args.webhook_config_name:
                patch_ca_bundle(client, args.webhook_config_name, certfile.read_bytes())
        settings.admission.server = kopf.WebhookServer(
            addr=args.webhook_addr,
            port=args.webhook_port,
            host=host,
            certfile=str(certfile),
            pkeyfile=str(keyfile),
        )

    namespaces = [args.namespace] if args.namespace else []
    asyncio.run(
        kopf.operator(
            registry=registry,
            standalone=True,
            clusterwide=not namespaces,
            namespaces=namespaces,
        )
    )
    return 0
