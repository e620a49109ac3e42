"""Admission: every rule a `BeamDeployment` must satisfy, as pure functions.

* `validate(obj)` — a whole object (`apiVersion`, `kind`, `metadata`, `spec`) or a bare spec;
  returns every `Violation` (empty: admitted). Unknown fields, wrong types and out-of-range
  values come from the models (`beamserve.operator.api`); the cross-field rules below need the
  parsed spec, so they run once the structure is valid.
* `validate_update(old, new)` — `validate(new)` plus the changes that cannot be made in place.

`beamserve validate FILE` and the operator's validating webhook both call these; the CRD's CEL
rules (`beamserve.operator.crd.CEL_RULES`) are a subset, enforced by servers ≥ 1.25 even when
the webhook is down. Each violation names the field (`spec.decode.tp`) and the fix.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from beamserve.kv_transfer.model import BeamModelConfig, beam_1_0
from beamserve.operator.api import (
    API_VERSION,
    GPU_ENGINES,
    KIND,
    BeamDeploymentSpec,
    EngineSpec,
    KVSpec,
    PoolRole,
    PoolSpec,
    RouterConfig,
)
from beamserve.operator.naming import name_problems
from beamserve.operator.pools import (
    LEADER_ADDRESS_ENV,
    POD_IP_ENV,
    WORKER_INDEX_ENV,
    NodeRole,
    flag_name,
    launch_path,
    launch_spec,
    pool_command,
    rendered_flags,
)
from beamserve.workers.launch import LaunchError, PoolSpecError, check_pair_compat
from beamserve.workers.launch import Parallelism as LaunchParallelism
from beamserve.workers.launch.hardware import GENERATION
from pydantic import BaseModel, ValidationError


@dataclass(frozen=True, order=True)
class Violation:
    """One broken rule: `path` is the field (`spec.decode.tp`), `message` what is wrong and
    the fix."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


_LABEL_NAME = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_IMAGE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:@-]*$")
_RESOURCE_NAME = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
_TOLERATION_KEYS = {"key", "operator", "value", "effect", "tolerationSeconds"}
_SPREAD_KEYS = {
    "maxSkew",
    "topologyKey",
    "whenUnsatisfiable",
    "labelSelector",
    "minDomains",
    "matchLabelKeys",
    "nodeAffinityPolicy",
    "nodeTaintsPolicy",
}
_AFFINITY_KEYS = {"nodeAffinity", "podAffinity", "podAntiAffinity"}
_RESOURCE_KEYS = {"limits", "requests", "claims"}
_POD_TEMPLATE_KEYS = {"metadata", "spec"}
# Environment the pods get from beamserve (the downward API and LeaderWorkerSet variables).
_RESERVED_ENV = {POD_IP_ENV, LEADER_ADDRESS_ENV, WORKER_INDEX_ENV}


def validate(obj: Any) -> list[Violation]:
    """Every rule `obj` (a whole BeamDeployment or its spec, as parsed YAML/JSON) breaks."""
    if not isinstance(obj, Mapping):
        return [
            Violation(
                "spec",
                f"expected a mapping, got {type(obj).__name__}; write YAML "
                "keys (model, engine, prefill, decode …)",
            )
        ]
    out: list[Violation] = []
    if _is_object(obj):
        out += _object_problems(obj)
        raw_spec = obj.get("spec")
        if not isinstance(raw_spec, Mapping):
            return [*out, Violation("spec", "required: a mapping; add the spec")]
    else:
        raw_spec = obj
    spec, structural = parse_spec(raw_spec)
    out += structural
    if spec is not None:
        out += _spec_problems(spec)
    return sorted(set(out), key=out.index)


def validate_update(old: Any, new: Any) -> list[Violation]:
    """`validate(new)`, plus what cannot change in place between `old` and `new`."""
    out = validate(new)
    old_spec, _ = parse_spec(old.get("spec") if _is_object(old) else old)
    new_spec, _ = parse_spec(new.get("spec") if _is_object(new) else new)
    if old_spec is None or new_spec is None:
        return out
    return out + _update_problems(old_spec, new_spec)


def parse_spec(raw: Any) -> tuple[BeamDeploymentSpec | None, list[Violation]]:
    """The spec, or None and a violation per structural problem (path, what, fix)."""
    try:
        # JSON names only (what the API server keeps): `attention_dp` is an unknown field here
        return BeamDeploymentSpec.model_validate(raw, by_alias=True, by_name=False), []
    except ValidationError as exc:
        return None, _explain(exc)


def _default(model: type[BaseModel], field: str) -> Any:
    """A field's default: rules about "set" fields compare with it, as the API server stores
    every default (a webhook sees them all)."""
    return model.model_fields[field].default


def _is_object(obj: Mapping[str, Any]) -> bool:
    return any(k in obj for k in ("apiVersion", "kind", "metadata", "spec"))


def _object_problems(obj: Mapping[str, Any]) -> list[Violation]:
    out: list[Violation] = []
    for key in obj:
        if key not in ("apiVersion", "kind", "metadata", "spec", "status"):
            out.append(
                Violation(
                    str(key),
                    "unknown top-level field; valid: apiVersion, kind, metadata, spec, status",
                )
            )
    if obj.get("apiVersion") != API_VERSION:
        out.append(Violation("apiVersion", f"is {obj.get('apiVersion')!r}; set {API_VERSION}"))
    if obj.get("kind") != KIND:
        out.append(Violation("kind", f"is {obj.get('kind')!r}; set {KIND}"))
    meta = obj.get("metadata")
    if not isinstance(meta, Mapping):
        out.append(Violation("metadata", "required: a mapping with a name; add metadata.name"))
        return out
    name = meta.get("name")
    if name is None and meta.get("generateName"):
        out.append(
            Violation(
                "metadata.generateName",
                "child names derive from the name; set metadata.name instead",
            )
        )
    elif not isinstance(name, str) or not name:
        out.append(Violation("metadata.name", "required; name the deployment, e.g. beam-prod"))
    else:
        out += [Violation("metadata.name", p) for p in name_problems(name)]
    return out


# -- structural errors (pydantic) -------------------------------------------------------------


def _explain(exc: ValidationError) -> list[Violation]:
    by_path: dict[str, list[dict[str, Any]]] = {}
    for err in exc.errors():
        path, model = _path_of(err["loc"])
        by_path.setdefault(path, []).append({**err, "_model": model})
    out: list[Violation] = []
    for path, errs in by_path.items():
        first = errs[0]
        kind = first["type"]
        if kind == "extra_forbidden":
            parent = first["_model"]
            valid = sorted(_aliases(parent)) if parent is not None else []
            out.append(Violation(path, f"unknown field; remove it (valid fields here: {valid})"))
        elif kind == "missing":
            out.append(Violation(path, "required; add it"))
        elif len(errs) > 1:
            got = first.get("input")
            wants = "; or ".join(dict.fromkeys(e["msg"] for e in errs))
            out.append(Violation(path, f"got {got!r}; {wants}"))
        else:
            got = first.get("input")
            out.append(Violation(path, f"{first['msg']} (got {got!r}); fix the value"))
    return out


def _path_of(loc: tuple[int | str, ...]) -> tuple[str, type[BaseModel] | None]:
    """`loc` as `spec.a.b[0]`, skipping pydantic's union tags; and the innermost model."""
    path = "spec"
    model: type[BaseModel] | None = BeamDeploymentSpec
    parent: type[BaseModel] | None = model
    container = False
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
            continue
        fields = _fields_by_alias(model) if model is not None else {}
        if part in fields:
            parent = model
            path += f".{part}"
            model = _model_of(fields[part].annotation)
            container = _is_container(fields[part].annotation)
        elif model is not None and not container and part not in fields:
            # an unknown key of a model (extra_forbidden) or a union tag
            if part in _TAGS or part.startswith(("function-", "constrained-", "literal[")):
                continue
            parent = model
            path += f".{part}"
            model = None
        elif container:
            path += f"[{part!r}]" if not part.isidentifier() else f".{part}"
    return path, parent


_TAGS = {"int", "str", "float", "bool", "list", "dict", "none", "is-instance", "json-or-python"}


def _fields_by_alias(model: type[BaseModel]) -> dict[str, Any]:
    out = {}
    for name, info in model.model_fields.items():
        out[info.alias or name] = info
        out[name] = info
    return out


def _aliases(model: type[BaseModel]) -> set[str]:
    return {info.alias or name for name, info in model.model_fields.items()}


def _model_of(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def _is_container(annotation: Any) -> bool:
    origin = getattr(annotation, "__origin__", None)
    if origin in (list, dict):
        return True
    return any(_is_container(a) for a in getattr(annotation, "__args__", ()))


# -- cross-field rules ------------------------------------------------------------------------


def _spec_problems(spec: BeamDeploymentSpec) -> list[Violation]:
    out = _pool_set_problems(spec)
    out += _model_problems(spec)
    out += _engine_problems(spec)
    for role, pool in spec.pools().items():
        out += _pool_problems(spec, role, pool)
    if spec.prefill is not None and spec.decode is not None:
        out += _pair_problems(spec, spec.prefill, spec.decode)
    out += _router_problems(spec)
    out += _reference_problems(spec)
    out += _cpu_engine_problems(spec)
    out += _rollout_problems(spec)
    out += _labels("spec.monitoring.labels", spec.monitoring.labels)
    taken = {v.path for v in out}
    out += [v for v in _render_problems(spec) if v.path not in taken]
    return out


def _pool_set_problems(spec: BeamDeploymentSpec) -> list[Violation]:
    has_p, has_d, has_b = spec.prefill is not None, spec.decode is not None, spec.both is not None
    if has_b and (has_p or has_d):
        return [
            Violation(
                "spec.both",
                "set either `both` (aggregated serving) or `prefill` and "
                "`decode` (disaggregated), not both; remove one",
            )
        ]
    if not (has_p or has_d or has_b):
        return [
            Violation(
                "spec", "no pool: add `prefill` and `decode` (disaggregated) or `both` (aggregated)"
            )
        ]
    if has_p and not has_d:
        return [
            Violation(
                "spec.decode",
                "a prefill pool needs a decode pool to hand KV to; add "
                "`decode`, or rename `prefill` to `both` for aggregated serving",
            )
        ]
    if has_d and not has_p:
        return [
            Violation(
                "spec.prefill",
                "a decode pool needs a prefill pool; add `prefill`, or "
                "rename `decode` to `both` for aggregated serving",
            )
        ]
    return []


def _source_problems(path: str, source: Any) -> list[Violation]:
    n = sum(x is not None for x in (source.host_path, source.pvc, source.download))
    if n != 1:
        return [Violation(path, f"sets {n} sources; set exactly one of hostPath, pvc, download")]
    return []


def _model_problems(spec: BeamDeploymentSpec) -> list[Violation]:
    m = spec.model
    out = _source_problems("spec.model.source", m.source)
    if m.draft is not None:
        out += _source_problems("spec.model.draft.source", m.draft.source)
        if spec.engine.name not in GPU_ENGINES:
            out.append(
                Violation(
                    "spec.model.draft",
                    f"engine {spec.engine.name} runs no draft "
                    "model; remove it or use engine sglang or vllm",
                )
            )
        if m.draft.mount_path.rstrip("/") == m.mount_path.rstrip("/"):
            out.append(
                Violation(
                    "spec.model.draft.mountPath",
                    f"{m.draft.mount_path} is also "
                    "spec.model.mountPath; mount the draft elsewhere, e.g. "
                    "/models/draft",
                )
            )
        if (
            m.source.host_path
            and m.draft.source.host_path
            and (m.source.host_path.path == m.draft.source.host_path.path)
        ):
            out.append(
                Violation(
                    "spec.model.draft.source.hostPath.path",
                    "is the target model's path; point it at the draft checkpoint",
                )
            )
    page = min(spec.page_size(r) for r in spec.pools()) if spec.pools() else spec.kv.page_size
    if m.context_length is not None and m.context_length < page:
        out.append(
            Violation(
                "spec.model.contextLength",
                f"{m.context_length} is shorter than one KV page ({page} tokens); raise it",
            )
        )
    return out


def _engine_problems(spec: BeamDeploymentSpec) -> list[Violation]:
    e = spec.engine
    out: list[Violation] = []
    gpu = e.name in GPU_ENGINES
    if gpu and e.image is None:
        out.append(
            Violation(
                "spec.engine.image",
                f"required for engine {e.name}; set the "
                f"{e.name} image (e.g. lmsysorg/sglang:v0.5.23 or "
                "vllm/vllm-openai:v0.33.0)",
            )
        )
    if e.name == "vllm" and e.api != "vllm":
        out.append(
            Violation(
                "spec.engine.api",
                "vLLM serves its own HTTP surface; remove api (it picks the surface of the "
                "sim and ref engines)",
            )
        )
    if e.name != "sim" and e.sim_profile != _default(EngineSpec, "sim_profile"):
        out.append(
            Violation(
                "spec.engine.simProfile",
                f"only the sim engine takes a profile; remove it for engine {e.name}",
            )
        )
    if spec.kv.ib_device is not None and e.name != "sglang":
        out.append(
            Violation(
                "spec.kv.ibDevice",
                "only SGLang takes RDMA devices on its command "
                "line; remove it and set UCX_NET_DEVICES in engine.extraEnv",
            )
        )
    if spec.kv.on_load_failure != _default(KVSpec, "on_load_failure") and e.name != "vllm":
        out.append(
            Violation(
                "spec.kv.onLoadFailure",
                f"only vLLM has a KV load-failure policy; remove it for engine {e.name}",
            )
        )
    seen: dict[str, int] = {}
    for i, env in enumerate(e.extra_env):
        path = f"spec.engine.extraEnv[{i}].name"
        if env.name in seen:
            out.append(
                Violation(
                    path, f"{env.name} is already set by extraEnv[{seen[env.name]}]; keep one"
                )
            )
        seen.setdefault(env.name, i)
        if env.name in _RESERVED_ENV:
            out.append(
                Violation(
                    path, f"{env.name} is set by beamserve (the pod's address or rank); remove it"
                )
            )
    for role in spec.pools():
        try:
            rendered = pool_command(_without_extras(spec), role).env
        except (LaunchError, ValueError):
            continue
        for i, env in enumerate(e.extra_env):
            if env.name in rendered:
                out.append(
                    Violation(
                        f"spec.engine.extraEnv[{i}].name",
                        f"{env.name} is set by "
                        f"the {role} pool's launcher ({rendered[env.name]!r}); "
                        "remove it",
                    )
                )
    return out


def _without_extras(spec: BeamDeploymentSpec) -> BeamDeploymentSpec:
    return spec.model_copy(
        update={"engine": spec.engine.model_copy(update={"extra_env": [], "extra_args": []})}
    )


def _attention_tp_problem(path: str, t: int, kv_heads: int) -> Violation | None:
    if (t <= kv_heads and kv_heads % t) or (t > kv_heads and t % kv_heads):
        ok = [d for d in range(1, kv_heads + 1) if kv_heads % d == 0]
        ok += [kv_heads * 2**i for i in range(1, 4) if kv_heads * 2**i <= 64]
        return Violation(
            path,
            f"attention TP {t} cannot shard the model's {kv_heads} KV heads "
            f"(spec.model.kvHeads); choose tp ÷ attentionDp from {ok}",
        )
    return None


def _pool_problems(spec: BeamDeploymentSpec, role: PoolRole, pool: PoolSpec) -> list[Violation]:
    p = f"spec.{role}"
    engine = spec.engine.name
    gpu = engine in GPU_ENGINES
    out: list[Violation] = []
    if pool.tp % pool.attention_dp:
        out.append(
            Violation(
                f"{p}.attentionDp",
                f"{pool.attention_dp} does not divide tp "
                f"{pool.tp}; choose one of {_divisors(pool.tp)}",
            )
        )
    else:
        bad = _attention_tp_problem(f"{p}.tp", pool.tp // pool.attention_dp, spec.model.kv_heads)
        if bad is not None:
            out.append(bad)
    if engine == "sglang" and pool.tp % pool.ep:
        out.append(
            Violation(
                f"{p}.ep",
                f"{pool.ep} does not divide tp {pool.tp}; choose one of {_divisors(pool.tp)}",
            )
        )
    if engine == "vllm" and pool.ep not in (1, pool.tp):
        out.append(
            Violation(
                f"{p}.ep",
                f"vLLM's expert parallelism spans all {pool.tp} GPUs "
                f"(TP × DP); set ep to 1 or {pool.tp}",
            )
        )
    if not gpu:
        for field, alias in (("ep", "ep"), ("attention_dp", "attentionDp"), ("pp", "pp")):
            if getattr(pool, field) != 1:
                out.append(
                    Violation(
                        f"{p}.{alias}",
                        f"engine {engine} has no {alias}; set it to 1 (or remove it)",
                    )
                )
        if pool.nodes_per_replica != 1:
            out.append(
                Violation(
                    f"{p}.nodesPerReplica", f"engine {engine} runs one process per pod; set it to 1"
                )
            )
        if pool.gpus_per_node:
            out.append(
                Violation(f"{p}.gpusPerNode", f"engine {engine} runs on CPU; remove it (or set 0)")
            )
        for name, value in pool.tuning.model_dump(exclude_none=True, by_alias=True).items():
            if engine == "sim" and name == "chunkedPrefillSize":
                continue  # the sim's per-step token budget (`beamserve worker` flag)
            knobs = "only chunkedPrefillSize" if engine == "sim" else "no engine knobs"
            out.append(
                Violation(
                    f"{p}.tuning.{name}",
                    f"engine {engine} has {knobs}; remove it (value {value!r})",
                )
            )
        if spec.host_cache_gb(role) > 0:
            out.append(
                Violation(
                    _host_cache_path(spec, role),
                    f"engine {engine} has no host KV cache; set hostCacheGb to 0",
                )
            )
    else:
        if pool.pp != 1 and "pp_size" not in LaunchParallelism.model_fields:
            out.append(
                Violation(
                    f"{p}.pp",
                    f"the {engine} launcher does not render pipeline "
                    "parallelism in this release; set pp to 1 and raise tp or "
                    "nodesPerReplica instead",
                )
            )
        ranks = pool.tp * pool.pp
        if ranks % pool.nodes_per_replica:
            out.append(
                Violation(
                    f"{p}.nodesPerReplica",
                    f"{pool.nodes_per_replica} nodes cannot "
                    f"split tp × pp = {ranks} GPUs evenly; choose one of "
                    f"{_divisors(ranks)}",
                )
            )
        elif pool.gpus_per_node is not None:
            want = ranks // pool.nodes_per_replica
            if pool.gpus_per_node != want:
                out.append(
                    Violation(
                        f"{p}.gpusPerNode",
                        f"{pool.gpus_per_node} GPUs × "
                        f"{pool.nodes_per_replica} node(s) ≠ tp × pp = {ranks}; set "
                        f"gpusPerNode to {want} (or change tp/nodesPerReplica)",
                    )
                )
        if engine == "sglang" and role == "decode" and spec.host_cache_gb(role) > 0:
            out.append(
                Violation(
                    _host_cache_path(spec, role),
                    "SGLang refuses a hierarchical "
                    "cache on a decode pool; set the decode pool's "
                    "kv.hostCacheGb to 0",
                )
            )
    chunk = pool.tuning.chunked_prefill_size
    page = spec.page_size(role)
    if chunk is not None and chunk % page:
        out.append(
            Violation(
                f"{p}.tuning.chunkedPrefillSize",
                f"{chunk} is not a multiple of "
                f"the page size {page}; use {max(page, round(chunk / page) * page)}",
            )
        )
    out += _port_problems(spec, role, pool)
    out += _passthrough_problems(p, pool)
    out += _extra_arg_problems(spec, role, pool)
    return out


def _host_cache_path(spec: BeamDeploymentSpec, role: PoolRole) -> str:
    pool = getattr(spec, role)
    if pool is not None and pool.kv.host_cache_gb is not None:
        return f"spec.{role}.kv.hostCacheGb"
    return "spec.kv.hostCacheGb"


def _port_problems(spec: BeamDeploymentSpec, role: PoolRole, pool: PoolSpec) -> list[Violation]:
    """Ports of one pod; vLLM offsets KV-event and NIXL ports by the attention-DP rank."""
    engine, ports, p = spec.engine.name, pool.ports, f"spec.{role}.ports"
    span = pool.attention_dp if engine == "vllm" else 1
    used: list[tuple[str, int, int]] = [("http", ports.http, 1)]
    used += [("kvEvents", ports.kv_events, span), ("kvReplay", ports.kv_replay, span)]
    if role != "both" or spec.swings(role):
        if engine == "vllm" and spec.kv.transfer_backend == "nixl":
            used.append(("sideChannel", ports.side_channel, span))
        elif (engine == "vllm" and spec.kv.transfer_backend == "mooncake") or role == "prefill":
            used.append(("bootstrap", ports.bootstrap, 1))
    if pool.nodes_per_replica > 1:
        used.append(("distInit", ports.dist_init, 1))
    out: list[Violation] = []
    for i, (name, lo, n) in enumerate(used):
        if lo + n - 1 > 65535:
            out.append(
                Violation(
                    f"{p}.{name}",
                    f"{lo}..{lo + n - 1} (one per attention-DP rank) passes 65535; lower it",
                )
            )
        for other, olo, on in used[:i]:
            if lo < olo + on and olo < lo + n:
                what = f"{lo}" if n == 1 and on == 1 else f"{lo}..{lo + n - 1}"
                out.append(
                    Violation(
                        f"{p}.{name}",
                        f"port {what} collides with {p}.{other} "
                        f"({olo}..{olo + on - 1}); pick another port",
                    )
                )
    return out


def _passthrough_problems(p: str, pool: PoolSpec) -> list[Violation]:
    out: list[Violation] = []
    for key, value in pool.node_selector.items():
        out += _label_problems(f"{p}.nodeSelector", key, value)
    for i, tol in enumerate(pool.tolerations):
        for k in set(tol) - _TOLERATION_KEYS:
            out.append(
                Violation(
                    f"{p}.tolerations[{i}].{k}",
                    f"unknown toleration field; valid: {sorted(_TOLERATION_KEYS)}",
                )
            )
        op = tol.get("operator", "Equal")
        if op not in ("Equal", "Exists"):
            out.append(Violation(f"{p}.tolerations[{i}].operator", f"{op!r}; use Equal or Exists"))
        if op == "Exists" and tol.get("value"):
            out.append(
                Violation(
                    f"{p}.tolerations[{i}].value", "must be empty with operator Exists; remove it"
                )
            )
        effect = tol.get("effect")
        if effect not in (None, "", "NoSchedule", "PreferNoSchedule", "NoExecute"):
            out.append(
                Violation(
                    f"{p}.tolerations[{i}].effect",
                    f"{effect!r}; use NoSchedule, PreferNoSchedule or NoExecute",
                )
            )
    for i, tsc in enumerate(pool.topology_spread_constraints):
        q = f"{p}.topologySpreadConstraints[{i}]"
        for k in set(tsc) - _SPREAD_KEYS:
            out.append(Violation(f"{q}.{k}", f"unknown field; valid: {sorted(_SPREAD_KEYS)}"))
        for k in ("maxSkew", "topologyKey", "whenUnsatisfiable"):
            if k not in tsc:
                out.append(Violation(f"{q}.{k}", "required; add it"))
        skew = tsc.get("maxSkew")
        if skew is not None and (not isinstance(skew, int) or isinstance(skew, bool) or skew < 1):
            out.append(Violation(f"{q}.maxSkew", f"{skew!r}; use an integer ≥ 1"))
        when = tsc.get("whenUnsatisfiable")
        if when is not None and when not in ("DoNotSchedule", "ScheduleAnyway"):
            out.append(
                Violation(
                    f"{q}.whenUnsatisfiable", f"{when!r}; use DoNotSchedule or ScheduleAnyway"
                )
            )
    for name, free, keys in (
        ("affinity", pool.affinity, _AFFINITY_KEYS),
        ("resources", pool.resources, _RESOURCE_KEYS),
        ("podTemplate", pool.pod_template, _POD_TEMPLATE_KEYS),
    ):
        for k in set(free or {}) - keys:
            out.append(Violation(f"{p}.{name}.{k}", f"unknown field; valid: {sorted(keys)}"))
    out += _resource_problems(f"{p}.resources", pool.resources)
    limits = (pool.resources or {}).get("limits") or {}
    if isinstance(limits, Mapping) and pool.gpu_resource in limits:
        out.append(
            Violation(
                f"{p}.resources.limits",
                f"{pool.gpu_resource} is set from gpusPerNode; remove it here and set gpusPerNode",
            )
        )
    if pool.priority_class_name is not None and not _DNS_SUBDOMAIN.match(pool.priority_class_name):
        out.append(
            Violation(
                f"{p}.priorityClassName",
                f"{pool.priority_class_name!r} is not a "
                "PriorityClass name (lowercase DNS subdomain); fix it",
            )
        )
    return out


def _resource_problems(path: str, resources: Mapping[str, Any] | None) -> list[Violation]:
    """`requests` / `limits`: maps of quantities, each request at most its limit."""
    out: list[Violation] = []
    parsed: dict[str, dict[str, float]] = {}
    for section in ("requests", "limits"):
        values = (resources or {}).get(section)
        if values is None:
            continue
        if not isinstance(values, Mapping):
            out.append(Violation(f"{path}.{section}", "must map resource names to quantities"))
            continue
        parsed[section] = {}
        for name, q in values.items():
            number = _quantity(q)
            if number is None:
                out.append(Violation(f"{path}.{section}[{name!r}]", f"{q!r} is not a quantity "
                                     "(e.g. 8, 500m, 64Gi); fix it"))  # fmt: skip
            else:
                parsed[section][str(name)] = number
    raw = resources or {}
    for name, req in parsed.get("requests", {}).items():
        lim = parsed.get("limits", {}).get(name)
        if lim is not None and req > lim:
            out.append(
                Violation(
                    f"{path}.requests[{name!r}]",
                    f"request {raw['requests'][name]!r} exceeds its limit "
                    f"{raw['limits'][name]!r}; lower the request or raise the limit",
                )
            )
    return out


_QUANTITY = re.compile(r"^([+-]?[0-9]+(?:\.[0-9]+)?)(m|k|Ki|Mi|Gi|Ti|Pi|Ei|M|G|T|P|E|[eE][0-9]+)?$")


def _quantity(q: Any) -> float | None:
    """A Kubernetes quantity as a number (None: not one)."""
    if isinstance(q, bool):
        return None
    if isinstance(q, int | float):
        return float(q)
    m = _QUANTITY.match(q) if isinstance(q, str) else None
    if m is None:
        return None
    unit = m.group(2) or ""
    if unit[:1] in ("e", "E"):
        return float(m.group(1)) * 10.0 ** int(unit[1:])
    return float(m.group(1)) * _UNITS[unit]


def _extra_arg_problems(
    spec: BeamDeploymentSpec, role: PoolRole, pool: PoolSpec
) -> list[Violation]:
    try:
        rendered = rendered_flags(spec, role)
    except (LaunchError, ValueError):
        return []  # reported by _render_problems
    out: list[Violation] = []
    for path, args in (
        ("spec.engine.extraArgs", spec.engine.extra_args),
        (f"spec.{role}.extraArgs", pool.extra_args),
    ):
        for i, arg in enumerate(args):
            flag = flag_name(arg)
            if arg.startswith("--") and flag in rendered:
                out.append(
                    Violation(
                        f"{path}[{i}]",
                        f"{flag} is rendered by beamserve for the "
                        f"{role} pool from the spec; set the spec field instead of "
                        "repeating the flag",
                    )
                )
    return out


def _pair_problems(spec: BeamDeploymentSpec, pre: PoolSpec, dec: PoolSpec) -> list[Violation]:
    out: list[Violation] = []
    for what, get, fix in (
        ("page size", spec.page_size, "64 recommended"),
        ("KV dtype", spec.kv_dtype, "bf16 or fp8_e4m3"),
    ):
        a, b = get("prefill"), get("decode")
        if a != b:
            field = "pageSize" if what == "page size" else "dtype"
            path = (
                f"spec.decode.kv.{field}"
                if getattr(dec.kv, _snake(field))
                else (f"spec.prefill.kv.{field}")
            )
            out.append(
                Violation(
                    path,
                    f"prefill uses {what} {a}, decode {b}; KV moves only "
                    f"between equal {what}s — set both pools alike ({fix})",
                )
            )
    if pre.tp % pre.attention_dp or dec.tp % dec.attention_dp:
        return out  # reported per pool (attentionDp must divide tp)
    a, b = pre.tp // pre.attention_dp, dec.tp // dec.attention_dp
    if max(a, b) % min(a, b):
        out.append(
            Violation(
                "spec.decode.tp",
                f"prefill attention TP {a} and decode attention "
                f"TP {b} do not divide one another; choose decode tp ÷ attentionDp "
                f"from {_dividing(a)}",
            )
        )
    if out or spec.engine.name not in GPU_ENGINES:
        return out
    try:
        check_pair_compat(
            launch_spec(spec, "prefill"), launch_spec(spec, "decode"), _model_config(spec)
        )
    except LaunchError as exc:
        lines = [ln.strip() for ln in str(exc).splitlines()[1:] if ln.strip()]
        out += [_launcher_violation(ln, "decode", spec.engine.name) for ln in lines]
    return out


def _snake(alias: str) -> str:
    return {"pageSize": "page_size", "dtype": "dtype"}[alias]


def _model_config(spec: BeamDeploymentSpec) -> BeamModelConfig:
    """Beam 1.0's shape with the spec's KV-head count (all the pair check reads of it)."""
    base = beam_1_0()
    k = spec.model.kv_heads
    return dataclasses.replace(base, num_key_value_heads=k, num_attention_heads=k * 6)


def _pool_roles_problems(spec: BeamDeploymentSpec) -> list[Violation]:
    """`router.disaggregation.poolRoles` needs one aggregated pool whose engines can each send
    and receive KV: vLLM over NIXL (`kv_role: kv_both`), or the sim / ref engine on vLLM's
    surface."""
    roles = spec.router.disaggregation.pool_roles
    if roles is None:
        return []
    path = "spec.router.disaggregation.poolRoles"
    if spec.both is None:
        return [
            Violation(
                path,
                "needs aggregated serving (spec.both); a prefill and a decode pool keep fixed "
                "parts — remove poolRoles or serve with one `both` pool",
            )
        ]
    e = spec.engine
    if e.name == "sglang" or (e.name in ("sim", "ref") and e.api == "sglang"):
        return [
            Violation(
                path,
                "SGLang fixes each server's part (--disaggregation-mode prefill or decode), so "
                "its servers cannot swing; run engine vllm (or engine.api vllm) or remove it",
            )
        ]
    if e.name == "vllm" and spec.kv.transfer_backend != "nixl":
        return [
            Violation(
                "spec.kv.transferBackend",
                f"poolRoles needs engines that both send and receive KV; vLLM's "
                f"{spec.kv.transfer_backend} connector is a producer or a consumer — set nixl",
            )
        ]
    if spec.both.replicas < 2:
        return [
            Violation(
                "spec.both.replicas",
                f"{spec.both.replicas} worker cannot split into prefill and decode; set 2 or "
                "more, or remove poolRoles",
            )
        ]
    flow = spec.router.flow_control
    if roles.spill_at_sessions_per_worker is not None and flow.prefill_spill_after_seconds is None:
        return [
            Violation(
                f"{path}.spillAtSessionsPerWorker",
                "gates the prefill stage's spill, which is off; set "
                "router.flowControl.prefillSpillAfterSeconds, or remove it",
            )
        ]
    return []


def _router_problems(spec: BeamDeploymentSpec) -> list[Violation]:
    r, s = spec.router, spec.router.session_store
    out: list[Violation] = []
    if r.replicas > 1 and s.type == "memory":
        out.append(
            Violation(
                "spec.router.sessionStore.type",
                f"{r.replicas} routers with "
                "sessionStore memory keep separate sessions (a session's turns "
                "scatter); set type redis or external, or router.replicas 1",
            )
        )
    if r.replica_sync.channel is not None and s.type == "memory":
        out.append(
            Violation(
                "spec.router.replicaSync.channel",
                "replica sync runs over the Redis session store, and sessionStore is memory; "
                "set sessionStore.type redis or external, or remove the channel",
            )
        )
    if s.type == "external" and (s.url is None) == (s.url_secret_ref is None):
        out.append(
            Violation(
                "spec.router.sessionStore.url",
                "type external needs exactly one of url or urlSecretRef; set one",
            )
        )
    if s.type != "external":
        for field, alias in (("url", "url"), ("url_secret_ref", "urlSecretRef")):
            if getattr(s, field) is not None:
                out.append(
                    Violation(
                        f"spec.router.sessionStore.{alias}",
                        f"only for type external (type is {s.type}); remove it",
                    )
                )
    if s.type != "redis" and s.redis is not None:
        out.append(
            Violation(
                "spec.router.sessionStore.redis",
                f"only for type redis (type is {s.type}); remove it or set type redis",
            )
        )
    out += _pool_roles_problems(spec)
    f = r.flow_control
    if f.prefill_spill_lull_seconds is not None and f.prefill_spill_after_seconds is None:
        out.append(
            Violation(
                "spec.router.flowControl.prefillSpillLullSeconds",
                "changes the prefill stage's spill in a lull, and the spill is off; set "
                "prefillSpillAfterSeconds too, or remove it",
            )
        )
    if f.lifo_after_seconds is not None and f.lifo_after_seconds >= f.lifo_max_wait_seconds:
        out.append(
            Violation(
                "spec.router.flowControl.lifoAfterSeconds",
                f"{f.lifo_after_seconds:g} is not below lifoMaxWaitSeconds "
                f"({f.lifo_max_wait_seconds:g}); lower it, raise lifoMaxWaitSeconds, or set it "
                "null to turn adaptive LIFO off",
            )
        )
    if r.grpc_port is not None and r.grpc_port == r.port:
        out.append(
            Violation(
                "spec.router.grpcPort", f"port {r.port} is also spec.router.port; pick another"
            )
        )
    if r.policy_config is not None:
        if r.policy != _default(RouterConfig, "policy"):
            out.append(
                Violation(
                    "spec.router.policyConfig",
                    "set either policy (a preset) or policyConfig, not both; remove one",
                )
            )
        from beamserve.router.policy import build_policy

        try:
            build_policy(r.policy_config)
        except (ValueError, TypeError) as exc:
            out.append(Violation("spec.router.policyConfig", f"{exc}"))
    for key, value in r.node_selector.items():
        out += _label_problems("spec.router.nodeSelector", key, value)
    out += _resource_problems("spec.router.resources", r.resources)
    for k in set(r.resources or {}) - _RESOURCE_KEYS:
        out.append(
            Violation(f"spec.router.resources.{k}", f"unknown; valid: {sorted(_RESOURCE_KEYS)}")
        )
    return out


def _reference_problems(spec: BeamDeploymentSpec) -> list[Violation]:
    """Names of the objects the spec refers to, images, resource names, GPU generations."""
    refs: list[tuple[str, str | None]] = []
    for base, src in (("spec.model.source", spec.model.source),) + (
        (("spec.model.draft.source", spec.model.draft.source),) if spec.model.draft else ()
    ):
        if src.pvc is not None:
            refs.append((f"{base}.pvc.claimName", src.pvc.claim_name))
        if src.download is not None:
            refs.append((f"{base}.download.storageClassName", src.download.storage_class_name))
            refs.append((f"{base}.download.credentialsSecret", src.download.credentials_secret))
    store, router = spec.router.session_store, spec.router
    if store.url_secret_ref is not None:
        refs.append(("spec.router.sessionStore.urlSecretRef.name", store.url_secret_ref.name))
    if router.api_keys_secret_ref is not None:
        refs.append(("spec.router.apiKeysSecretRef.name", router.api_keys_secret_ref.name))
    out = [
        Violation(path, f"{name!r} is not an object name (lowercase DNS subdomain: a-z, 0-9, "
                  "'-', '.'); fix it")
        for path, name in refs
        if name is not None and (len(name) > 253 or not _DNS_SUBDOMAIN.match(name))
    ]  # fmt: skip
    images = [("spec.engine.image", spec.engine.image), ("spec.router.image", router.image)]
    if store.redis is not None:
        images.append(("spec.router.sessionStore.redis.image", store.redis.image))
    for src_path, src in (("spec.model.source", spec.model.source),):
        if src.download is not None:
            images.append((f"{src_path}.download.image", src.download.image))
    for path, image in images:
        if image is not None and not _IMAGE.match(image):
            out.append(Violation(path, f"{image!r} is not an image reference "
                                 "(registry/name[:tag][@digest], no spaces); fix it"))  # fmt: skip
    for role, pool in spec.pools().items():
        if not _RESOURCE_NAME.match(pool.gpu_resource):
            out.append(Violation(f"spec.{role}.gpuResource", f"{pool.gpu_resource!r} is not a "
                                 "resource name (e.g. nvidia.com/gpu); fix it"))  # fmt: skip
        gpu = pool.tuning.gpu
        if spec.model.format == "nvfp4" and gpu is not None and GENERATION[gpu] != "blackwell":
            out.append(Violation(f"spec.{role}.tuning.gpu", f"{gpu} is a {GENERATION[gpu]} GPU "
                                 "and cannot run NVFP4 weights (Blackwell only); use fp8 or "
                                 "bf16 weights, or Blackwell GPUs"))  # fmt: skip
    if not any(c in "123456789" for c in spec.monitoring.interval):
        out.append(Violation("spec.monitoring.interval", "must be longer than 0; e.g. 15s"))
    return out


def _cpu_engine_problems(spec: BeamDeploymentSpec) -> list[Violation]:
    """What the sim and ref engines (`beamserve worker`) have no setting for."""
    e = spec.engine.name
    if e in GPU_ENGINES:
        return []
    out: list[Violation] = []
    if spec.model.format != "bf16":
        out.append(Violation("spec.model.format", f"engine {e} loads bf16 checkpoints only; set "
                             "format bf16"))  # fmt: skip
    for role in spec.pools():
        if spec.kv_dtype(role) != "bf16":
            pool = getattr(spec, role)
            path = f"spec.{role}.kv.dtype" if pool.kv.dtype is not None else "spec.kv.dtype"
            out.append(Violation(path, f"engine {e} keeps its KV in bf16; set dtype bf16"))
            break
    if not spec.kv.prefix_caching:
        out.append(Violation("spec.kv.prefixCaching", f"engine {e} always caches prefixes; "
                             "remove prefixCaching"))  # fmt: skip
    return out


def _rollout_problems(spec: BeamDeploymentSpec) -> list[Violation]:
    r = spec.rollout
    out: list[Violation] = []
    for alias, value in (("maxUnavailable", r.max_unavailable), ("maxSurge", r.max_surge)):
        if isinstance(value, str) and int(value[:-1]) > 100:
            out.append(Violation(f"spec.rollout.{alias}", f"{value} is over 100%; lower it"))
    if _zero(r.max_unavailable) and _zero(r.max_surge):
        out.append(
            Violation(
                "spec.rollout.maxSurge",
                "maxSurge and maxUnavailable are both 0, "
                "so a rollout can never make progress; set maxSurge to 1",
            )
        )
    return out


def _zero(v: int | str) -> bool:
    return v == 0 or v == "0%"


def _labels(path: str, labels: Mapping[str, str]) -> list[Violation]:
    out: list[Violation] = []
    for k, v in labels.items():
        out += _label_problems(path, k, v)
    return out


def _label_problems(path: str, key: str, value: str) -> list[Violation]:
    out: list[Violation] = []
    prefix, _, name = key.rpartition("/")
    if (prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix))) or (
        len(name) > 63 or not _LABEL_NAME.match(name)
    ):
        out.append(
            Violation(
                f"{path}[{key!r}]",
                "not a label key ([prefix/]name, name ≤ 63 "
                "alphanumerics, '-', '_', '.'); fix the key",
            )
        )
    if value and (len(value) > 63 or not _LABEL_NAME.match(value)):
        out.append(
            Violation(
                f"{path}[{key!r}]",
                f"{value!r} is not a label value (≤ 63 "
                "alphanumerics, '-', '_', '.', alphanumeric at both ends)",
            )
        )
    return out


def _render_problems(spec: BeamDeploymentSpec) -> list[Violation]:
    """Whatever the launchers refuse (their own rules, mapped back to this API's fields): a
    spec admission admits always renders, even when a launcher learns a rule first."""
    out: list[Violation] = []
    if len(spec.pools()) > 1 and spec.both is not None:
        return out
    for role, pool in spec.pools().items():
        nodes: tuple[NodeRole, ...] = (
            ("leader", "worker") if pool.nodes_per_replica > 1 else ("leader",)
        )
        for node in nodes:
            try:
                pool_command(spec, role, node)
            except PoolSpecError as exc:
                out += [_launcher_violation(ln, role, spec.engine.name) for ln in exc.problems]
                break
            except (LaunchError, ValueError) as exc:
                out.append(
                    Violation(f"spec.{role}", f"the {spec.engine.name} launcher refuses it: {exc}")
                )
                break
    return out


def _launcher_violation(line: str, role: PoolRole, engine: str) -> Violation:
    field, sep, message = line.partition(": ")
    if not sep or " " in field:
        return Violation(f"spec.{role}", f"the {engine} launcher refuses it: {line}")
    return Violation(launch_path(field, role), f"{message} (the {engine} launcher's {field})")


def _update_problems(old: BeamDeploymentSpec, new: BeamDeploymentSpec) -> list[Violation]:
    out: list[Violation] = []
    if (old.both is None) != (new.both is None):
        was, now = ("aggregated", "disaggregated") if old.both else ("disaggregated", "aggregated")
        out.append(
            Violation(
                "spec.both",
                f"switching from {was} to {now} serving in place "
                "replaces every pool and the router's mode at once; create a new "
                "BeamDeployment, move traffic, then delete this one",
            )
        )
    for role in set(old.pools()) & set(new.pools()):
        a, b = old.pools()[role], new.pools()[role]
        if (a.nodes_per_replica == 1) != (b.nodes_per_replica == 1):
            out.append(
                Violation(
                    f"spec.{role}.nodesPerReplica",
                    f"{a.nodes_per_replica} → "
                    f"{b.nodes_per_replica} switches the pool between a Deployment "
                    "and a LeaderWorkerSet, which cannot roll in place; keep it on "
                    "the same side of 1, or create a new BeamDeployment",
                )
            )
    for path, a_src, b_src in (
        ("spec.model.source.download", old.model.source.download, new.model.source.download),
        (
            "spec.model.draft.source.download",
            old.model.draft.source.download if old.model.draft else None,
            new.model.draft.source.download if new.model.draft else None,
        ),
    ):
        if a_src is None or b_src is None or a_src.storage_class_name is None:
            continue
        if b_src.storage_class_name != a_src.storage_class_name:
            out.append(
                Violation(
                    f"{path}.storageClassName",
                    f"a claim's storage class is immutable; keep {a_src.storage_class_name}",
                )
            )
        if _bytes(b_src.storage_size) < _bytes(a_src.storage_size):
            out.append(
                Violation(
                    f"{path}.storageSize",
                    f"claims cannot shrink "
                    f"({a_src.storage_size} → {b_src.storage_size}); keep "
                    f"{a_src.storage_size} or more",
                )
            )
    a_redis, b_redis = old.router.session_store.redis, new.router.session_store.redis
    if (
        a_redis
        and b_redis
        and a_redis.storage_size
        and b_redis.storage_size
        and _bytes(b_redis.storage_size) < _bytes(a_redis.storage_size)
    ):
        out.append(
            Violation(
                "spec.router.sessionStore.redis.storageSize",
                f"claims cannot shrink; keep {a_redis.storage_size} or more",
            )
        )
    return out


_UNITS: dict[str, float] = {"": 1, "m": 1e-3, **{u: 1000**i for i, u in enumerate("kMGTPE", 1)}}
_UNITS |= {f"{u}i": 1024**i for i, u in enumerate("KMGTPE", 1)}


def _bytes(quantity: str) -> float:
    m = re.match(r"^([0-9.]+)([A-Za-z]*)$", quantity)
    assert m is not None
    return float(m.group(1)) * float(_UNITS[m.group(2)])


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _dividing(n: int) -> list[int]:
    out = _divisors(n)
    k = 2 * n
    while k <= 64:
        out.append(k)
        k *= 2
    return out
