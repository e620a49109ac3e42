"""The routing plugin contract: filters, scorers and pickers, and the `Policy` that chains them.

A routing step is **filter → score → pick** (the llm-d scheduler's lifecycle):

1. each `Filter` narrows the candidate `WorkerView`s (health, role, P/D compatibility);
2. each `Scorer` gives every remaining worker a score in [0, 1] (1 = best); the policy combines
   them as a weighted mean ``total(w) = Σ weight_i · score_i(w) / Σ weight_i``, so totals stay in
   [0, 1] whatever the weights;
3. the `Picker` turns the totals into one worker.

Every plugin carries its `type` string (the name used in configuration). Plugins are pure
functions of their inputs except where their docstring says otherwise (`round-robin` keeps a
counter). No plugin knows about HTTP, ZMQ or Redis: they read the frozen views of
`beamserve.router.types`.

Errors: `PolicyConfigError` for a bad configuration (names the bad key or type and the valid
ones); `NoCandidates` when filtering leaves nothing (the front door answers 503 with its
`reason`, ``"no-candidates"``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable

from beamserve.router.types import Endpoint, RouteDecision, RouteRequest, WorkerView
from pydantic import BaseModel, ConfigDict, ValidationError


class PolicyConfigError(ValueError):
    """A routing configuration that cannot be built; the message names the key and the fix."""


class NoCandidates(Exception):
    """Filtering left no worker for a request. `reason` is ``"no-candidates"``; `explain` says
    which filter removed the last candidates (for the debug header and the 503 body)."""

    reason = "no-candidates"

    def __init__(self, explain: str) -> None:
        super().__init__(explain)
        self.explain = explain


@runtime_checkable
class Filter(Protocol):
    """Narrows the candidates: returns the subset of `views` (order kept) the request may use."""

    type: str

    def filter(
        self, request: RouteRequest, views: Sequence[WorkerView]
    ) -> tuple[WorkerView, ...]: ...


@runtime_checkable
class Scorer(Protocol):
    """Scores every view in [0, 1] (1 = most preferred); returns ``{endpoint.id: score}``.

    `reason` is the machine-readable cause a decision reports when this scorer decided it
    (``"prefix"``, ``"load"``, ``"sticky"``).
    """

    type: str
    reason: str

    def score(self, request: RouteRequest, views: Sequence[WorkerView]) -> dict[str, float]: ...


@runtime_checkable
class Picker(Protocol):
    """Chooses one of `views` given the combined scores ``{endpoint.id: total}``.

    `reason` is what a decision reports when no scorer separated the candidates (``"tie"``,
    ``"round-robin"``, ``"random"``).
    """

    type: str
    reason: str

    def pick(
        self, request: RouteRequest, views: Sequence[WorkerView], totals: Mapping[str, float]
    ) -> WorkerView: ...


class RoutingPolicy(Protocol):
    """Anything that routes: the weighted `Policy`, `StickyUntilSaturated`, the baselines."""

    name: str

    def route(self, request: RouteRequest, views: Sequence[WorkerView]) -> RouteDecision: ...


# ---------------------------------------------------------------------------------------------
# Parameters: strict parsing shared by every plugin factory.


class PluginParams(BaseModel):
    """Base of every plugin's parameter model: frozen, unknown keys rejected."""

    model_config = ConfigDict(extra="forbid", frozen=True)


P = TypeVar("P", bound=PluginParams)


def parse_params(model: type[P], params: Mapping[str, Any] | None, where: str) -> P:
    """Validate `params` against `model`; unknown keys and bad values raise `PolicyConfigError`
    naming `where` (e.g. ``"scorer 'load'"``), the key, and the valid keys."""
    params = dict(params or {})
    valid = sorted(model.model_fields)
    unknown = sorted(set(params) - set(valid))
    if unknown:
        raise PolicyConfigError(
            f"{where}: unknown parameter {unknown[0]!r}; valid parameters: "
            f"{', '.join(valid) if valid else '(none)'}"
        )
    try:
        return model.model_validate(params)
    except ValidationError as exc:
        first = exc.errors()[0]
        key = ".".join(str(p) for p in first["loc"]) or "(params)"
        raise PolicyConfigError(f"{where}: parameter {key!r}: {first['msg']}") from exc


def stable_hash(*parts: str) -> int:
    """A process-independent 64-bit hash (Python's `hash` is salted per process): identical
    inputs give identical tie-breaks on every router replica."""
    digest = hashlib.blake2b("\x1f".join(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def affinity_key(request: RouteRequest) -> str:
    """What tie-breaks hash on: the session when there is one (a session's ties break the same
    way every turn), else the request id (independent requests spread over tied workers)."""
    return request.session_id or request.request_id


def break_tie(request: RouteRequest, tied: Sequence[WorkerView]) -> WorkerView:
    """Deterministic, request-dependent choice among equally good workers: the lowest
    ``stable_hash(affinity_key, endpoint.id)``. Not always the first worker, so misses spread."""
    key = affinity_key(request)
    return min(tied, key=lambda v: stable_hash(key, v.endpoint.id))


def clamp01(x: float) -> float:
    if x != x:  # NaN: treat as the worst score rather than poisoning the sum
        return 0.0
    return 0.0 if x < 0.0 else 1.0 if x > 1.0 else x


# ---------------------------------------------------------------------------------------------
# The weighted policy.


@dataclass(frozen=True, slots=True)
class WeightedScorer:
    scorer: Scorer
    weight: float


@dataclass(frozen=True, slots=True)
class ScoreTable:
    """Per-scorer scores and the combined totals of one routing step (for explain strings and
    tests)."""

    per_scorer: tuple[tuple[str, float, dict[str, float]], ...]  # (type, weight, scores)
    totals: dict[str, float]


class Policy:
    """Filters + weighted scorers + picker (see the module docstring for the formula).

    `route` raises `NoCandidates` when the filters leave nothing. The decision's `reason` is the
    `reason` of the scorer whose weighted score most favours the picked worker over the mean
    of the others; ``"only-candidate"`` when one worker was left; otherwise (no scorer
    separated them) the picker's `reason` (``"tie"``, ``"round-robin"``, ``"random"``).
    """

    kind: ClassVar[str] = "weighted"

    def __init__(
        self,
        name: str,
        filters: Sequence[Filter],
        scorers: Sequence[WeightedScorer],
        picker: Picker,
    ) -> None:
        for ws in scorers:
            if ws.weight < 0:
                raise PolicyConfigError(
                    f"policy {name!r}: scorer {ws.scorer.type!r} has weight {ws.weight}; "
                    "weights must be ≥ 0"
                )
        self.name = name
        self.filters = tuple(filters)
        self.scorers = tuple(scorers)
        self.picker = picker

    def candidates(
        self, request: RouteRequest, views: Sequence[WorkerView]
    ) -> tuple[WorkerView, ...]:
        """Apply the filters in order; raise `NoCandidates` naming the filter that emptied it."""
        return apply_filters(self.filters, request, views)

    def score(self, request: RouteRequest, views: Sequence[WorkerView]) -> ScoreTable:
        ids = [v.endpoint.id for v in views]
        per: list[tuple[str, float, dict[str, float]]] = []
        totals = dict.fromkeys(ids, 0.0)
        weight_sum = sum(ws.weight for ws in self.scorers)
        for ws in self.scorers:
            raw = ws.scorer.score(request, views)
            scores = {i: clamp01(raw.get(i, 0.0)) for i in ids}
            per.append((ws.scorer.type, ws.weight, scores))
            if weight_sum > 0:
                for i in ids:
                    totals[i] += ws.weight * scores[i] / weight_sum
        return ScoreTable(tuple(per), totals)

    def route(self, request: RouteRequest, views: Sequence[WorkerView]) -> RouteDecision:
        cands = self.candidates(request, views)
        table = self.score(request, cands)
        chosen = self.picker.pick(request, cands, table.totals)
        reason = self._reason(chosen, cands, table)
        decision = RouteDecision(
            decode=chosen.endpoint,
            expected_hit=chosen.hit,
            reason=reason,
            explain=explain_scores(self.name, chosen.endpoint, table),
            scores=tuple(sorted(table.totals.items())),
        )
        return decision

    def _reason(self, chosen: WorkerView, cands: Sequence[WorkerView], table: ScoreTable) -> str:
        others = [v.endpoint.id for v in cands if v.endpoint.id != chosen.endpoint.id]
        if not others:
            return "only-candidate"
        best_reason, best_margin = self.picker.reason, 1e-12
        reasons = {ws.scorer.type: ws.scorer.reason for ws in self.scorers}
        for type_, weight, scores in table.per_scorer:
            mean_others = sum(scores[i] for i in others) / len(others)
            margin = weight * (scores[chosen.endpoint.id] - mean_others)
            if margin > best_margin:
                best_reason, best_margin = reasons[type_], margin
        return best_reason


def apply_filters(
    filters: Sequence[Filter], request: RouteRequest, views: Sequence[WorkerView]
) -> tuple[WorkerView, ...]:
    """Run `filters` in order; raise `NoCandidates` naming the filter that left nothing."""
    current = tuple(views)
    if not current:
        raise NoCandidates("no workers known for this model")
    for f in filters:
        current = f.filter(request, current)
        if not current:
            raise NoCandidates(f"filter {f.type!r} removed every worker")
    return current


def explain_scores(policy: str, chosen: Endpoint, table: ScoreTable) -> str:
    """``policy=NAME pick=ID | ID total=0.812 [prefix-affinity=0.900×3 load=0.700×2] | …``,
    workers sorted by total, best first."""
    parts = [f"policy={policy} pick={chosen.id}"]
    for wid, total in sorted(table.totals.items(), key=lambda kv: (-kv[1], kv[0])):
        terms = " ".join(f"{t}={s[wid]:.3f}×{w:g}" for t, w, s in table.per_scorer)
        parts.append(f"{wid} total={total:.3f} [{terms}]")
    return " | ".join(parts)
