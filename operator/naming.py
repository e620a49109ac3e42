"""Names of the objects a `BeamDeployment` owns, and the longest name it may therefore carry.

Every child is named `child_name(bd_name, part)` = `<bd_name>-<part>`. The parts:

| part | object(s) |
|---|---|
| `prefill-<rev>`, `decode-<rev>`, `both-<rev>` | one revision of a pool: Deployment or
  LeaderWorkerSet, headless Service, PodDisruptionBudget (`pool_part(role, revision)`; `<rev>`:
  `REVISION_LENGTH` hex digits) |
| `router` | router Deployment, Service, PodDisruptionBudget |
| `router-config` | the router's ConfigMap (`RouterConfig` as YAML) |
| `redis` | managed Redis Deployment, Service, claim |
| `model` / `draft` | the download claims (`model.source.download` with a storage class) |
| `workers` | the NetworkPolicy, monitors, InferencePool |

Kubernetes adds to some names: a LeaderWorkerSet's worker StatefulSet is `<lws>-<group>` and its
pods carry the label `controller-revision-hash=<lws>-<group>-<hash>` (a label value: ≤ 63
characters); a Deployment's ReplicaSet is `<deploy>-<hash>`. `CONTROLLER_SUFFIX` reserves room
for the longest of these (`-` + 5 group digits + `-` + a 10-character hash), so every child's
name, and every name or label value derived from it, stays a DNS label of at most 63 characters.
Services need RFC 1035 labels (a letter first), so deployment names must be one too.
"""

from __future__ import annotations

import re

from beamserve.operator.api import POOL_ROLES, PoolRole

DNS_LABEL_MAX = 63
REVISION_LENGTH = 8
CONTROLLER_SUFFIX = len("-99999-") + 10
PARTS: tuple[str, ...] = (
    *(f"{role}-{'0' * REVISION_LENGTH}" for role in POOL_ROLES),
    "router",
    "router-config",
    "redis",
    "model",
    "draft",
    "workers",
)
LONGEST_PART = max(len(p) for p in PARTS)
MAX_NAME_LENGTH = DNS_LABEL_MAX - 1 - LONGEST_PART - CONTROLLER_SUFFIX
"""The longest `metadata.name` a BeamDeployment may have (29)."""
DNS_1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_REVISION = re.compile(rf"^[0-9a-f]{{{REVISION_LENGTH}}}$")


def pool_part(role: PoolRole, revision: str) -> str:
    """The part naming `role`'s pool objects of `revision` (`REVISION_LENGTH` hex digits)."""
    if role not in POOL_ROLES:
        raise ValueError(f"role: {role!r} is not one of {POOL_ROLES}")
    if not _REVISION.match(revision):
        raise ValueError(
            f"revision: {revision!r} is not {REVISION_LENGTH} lowercase hex digits; "
            "take it from the spec's revision hash"
        )
    return f"{role}-{revision}"


def child_name(bd_name: str, part: str) -> str:
    """`<bd_name>-<part>`; raises `ValueError` if the result could outgrow a DNS label."""
    name = f"{bd_name}-{part}"
    if len(name) + CONTROLLER_SUFFIX > DNS_LABEL_MAX or not DNS_1035_LABEL.match(name):
        raise ValueError(
            f"child name {name!r}: not a DNS label of at most "
            f"{DNS_LABEL_MAX - CONTROLLER_SUFFIX} characters; shorten the BeamDeployment's "
            f"name to at most {MAX_NAME_LENGTH} characters"
        )
    return name


def name_problems(bd_name: str) -> list[str]:
    """Why `bd_name` cannot name a BeamDeployment (empty: it can), each with the fix."""
    out: list[str] = []
    if len(bd_name) > MAX_NAME_LENGTH:
        out.append(
            f"is {len(bd_name)} characters; at most {MAX_NAME_LENGTH} keep every child's name "
            f"(e.g. {bd_name}-{PARTS[0]}) and the names Kubernetes derives from it within "
            f"{DNS_LABEL_MAX} characters — shorten it"
        )
    if not DNS_1035_LABEL.match(bd_name):
        out.append(
            f"{bd_name!r} is not an RFC 1035 label (lowercase letters, digits and '-', a letter "
            "first, no '-' last), which Service names need; rename it, e.g. 'beam-prod'"
        )
    return out
