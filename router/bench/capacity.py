"""Capacity search: the highest load at which a policy still meets its TTFT SLO.

Rule (per policy, loads ``L`` > 0, assuming TTFT p90 and shed rate grow with load)::

    meets(L)  ⇔  ttft_p90(L) ≤ slo_s  AND  shed_rate(L) ≤ max_shed_rate
    capacity  = the largest probed L with meets(L)

Search: probe ``start``; while it meets, double (up to ``max_load``: then the capacity is only
a lower bound, ``bounded`` False); while it fails, halve (down to ``min_load``: then the
capacity is 0, the SLO is out of reach at any load). Then bisect geometrically between the last
meeting and the first failing load ``refine_steps`` times (each step halves the ratio between
them: 5 steps from a factor 2 leave ≈ 2 %). The shed-rate bound keeps flow control from
"meeting" the SLO by refusing the traffic. `capacity_tok_s` is the throughput measured at the
capacity load.

| parameter | default | meaning |
|---|---|---|
| `slo_s` | ``2.0`` | TTFT p90 bound (s), `--slo-ttft-p90` |
| `start` | ``1.0`` | first load probed |
| `min_load` / `max_load` | ``1/64`` / ``1024`` | search range |
| `refine_steps` | ``5`` | geometric bisection steps |
| `max_shed_rate` | ``0.01`` | a load shedding more than this does not meet the SLO |
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

R = TypeVar("R")


@dataclass(frozen=True)
class Probe(Generic[R]):
    """One replay at `load`: what the search needs from it, and the full `result`."""

    load: float
    ttft_p90_s: float
    shed_rate: float
    result: R


@dataclass(frozen=True)
class CapacitySearch(Generic[R]):
    """`load`: the capacity load (0: the SLO is met at no probed load); `best`: the probe there;
    `bounded`: False when even `max_load` met the SLO (the capacity is at least `load`);
    `probes`: every probe in the order run."""

    load: float
    best: Probe[R] | None
    bounded: bool
    probes: tuple[Probe[R], ...]


def meets(probe: Probe[R], slo_s: float, max_shed_rate: float = 0.01) -> bool:
    """True when the probe's TTFT p90 is within the SLO and it shed at most `max_shed_rate`."""
    return (
        not math.isnan(probe.ttft_p90_s)
        and probe.ttft_p90_s <= slo_s
        and probe.shed_rate <= max_shed_rate
    )


def search_capacity(
    run_at: Callable[[float], Probe[R]],
    slo_s: float = 2.0,
    *,
    start: float = 1.0,
    min_load: float = 1.0 / 64,
    max_load: float = 1024.0,
    refine_steps: int = 5,
    max_shed_rate: float = 0.01,
) -> CapacitySearch[R]:
    """Search the capacity load with `run_at(load)` (rule in the module docstring)."""
    if not 0 < min_load <= start <= max_load:
        raise ValueError(
            f"need 0 < min_load ≤ start ≤ max_load, got {min_load}, {start}, {max_load}"
        )
    probes: list[Probe[R]] = []

    def probe(load: float) -> Probe[R]:
        p = run_at(load)
        probes.append(p)
        return p

    good: Probe[R] | None = None
    bad: Probe[R] | None = None
    p = probe(start)
    if meets(p, slo_s, max_shed_rate):
        good = p
        while good.load < max_load:
            p = probe(min(good.load * 2, max_load))
            if not meets(p, slo_s, max_shed_rate):
                bad = p
                break
            good = p
        if bad is None:
            return CapacitySearch(good.load, good, False, tuple(probes))
    else:
        bad = p
        while bad.load > min_load:
            p = probe(max(bad.load / 2, min_load))
            if meets(p, slo_s, max_shed_rate):
                good = p
                break
            bad = p
        if good is None:
            return CapacitySearch(0.0, None, True, tuple(probes))
    for _ in range(refine_steps):
        mid = math.sqrt(good.load * bad.load)
        p = probe(mid)
        if meets(p, slo_s, max_shed_rate):
            good = p
        else:
            bad = p
    return CapacitySearch(good.load, good, True, tuple(probes))
