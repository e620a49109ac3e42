"""Draining a retiring revision: ask every router replica what is still in flight on it.

A KV-incompatible rollout leaves the old revision's pools beside the new ones until the new
ones are ready. Then the operator deletes the old revision's Services — router discovery drops
those workers, so no new request goes there — and keeps its workloads running while the
requests already on them finish. Each router replica answers `GET /admin/workers`
(`beamserve.router.app.Router.worker_report`): per worker its revision, whether discovery still
lists it, and the requests in flight on it (also for workers discovery has dropped).

A revision is **drained** when every ready router replica (the ready addresses of the router
Service's EndpointSlices) answered, none still lists a worker of the revision, and the in-flight
requests on its workers sum to 0 — or when no router replica is ready at all (nothing routed
through one can be in flight). **Timed out**: `rollout.drainTimeoutSeconds` passed since the
revision was stamped `beamserve.io/retiring-since` while some router had not answered or still
reported work; it is removed anyway, and a `DrainTimedOut` Warning event says what was left.
A router that cannot be reached (an operator outside the cluster network, a router without the
endpoint) therefore makes the drain last the whole timeout, never shorter.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

ROUTER_PORT_NAME = "http"
WORKER_REPORT_PATH = "/admin/workers"
Verdict = Literal["wait", "drained", "timed_out"]


@dataclass(frozen=True, slots=True)
class RouterAnswer:
    """One router replica's account of one revision (`in_flight` None: it did not answer)."""

    address: str
    in_flight: int | None
    listed: int = 0  # workers of the revision its discovery still lists (still routable)
    error: str = ""


@dataclass(frozen=True, slots=True)
class DrainReport:
    """What the router replicas said about one revision."""

    revision: str
    answers: tuple[RouterAnswer, ...]

    @property
    def in_flight(self) -> int:
        return sum(a.in_flight or 0 for a in self.answers)

    @property
    def unanswered(self) -> list[str]:
        return [a.address for a in self.answers if a.in_flight is None]

    @property
    def listed(self) -> int:
        return sum(a.listed for a in self.answers)

    @property
    def quiet(self) -> bool:
        """Every router answered, lists none of the revision's workers, and has nothing in
        flight on them (true as well when there is no router to ask)."""
        return not self.unanswered and self.listed == 0 and self.in_flight == 0

    def describe(self) -> str:
        if not self.answers:
            return "no router replica is ready"
        parts = [f"{self.in_flight} request(s) in flight on its workers"]
        if self.listed:
            parts.append(f"{self.listed} worker(s) still routable")
        if self.unanswered:
            parts.append(f"no answer from {', '.join(self.unanswered)}")
        return f"{'; '.join(parts)} ({len(self.answers)} router replica(s) asked)"


def router_addresses(slices: Iterable[Mapping[str, Any]]) -> list[str]:
    """`host:port` of every ready endpoint of the router Service's EndpointSlices (the port
    named `http`; `conditions.ready` true or unset, not terminating), sorted, unique."""
    out: set[str] = set()
    for sl in slices:
        ports = [p for p in sl.get("ports") or [] if p.get("name") == ROUTER_PORT_NAME]
        if not ports or ports[0].get("port") is None:
            continue
        port = int(ports[0]["port"])
        ipv6 = sl.get("addressType") == "IPv6"
        for ep in sl.get("endpoints") or []:
            cond = ep.get("conditions") or {}
            if cond.get("ready") is False or cond.get("terminating") or not ep.get("addresses"):
                continue
            host = str(ep["addresses"][0])
            out.add(f"[{host}]:{port}" if ipv6 or ":" in host else f"{host}:{port}")
    return sorted(out)


def summarize(address: str, answer: Mapping[str, Any], revision: str) -> RouterAnswer:
    """One router's `GET /admin/workers` answer, reduced to `revision`'s workers. Raises
    `ValueError` on an answer that is not a worker report."""
    workers = answer.get("workers")
    if not isinstance(workers, list):
        raise ValueError(f"{address}{WORKER_REPORT_PATH}: no 'workers' list in the answer")
    in_flight = listed = 0
    for w in workers:
        if not isinstance(w, Mapping) or w.get("revision") != revision:
            continue
        in_flight += int(w.get("in_flight", 0))
        listed += bool(w.get("discovered", False))
    return RouterAnswer(address, in_flight, listed)


def ask_routers(
    addresses: Iterable[str],
    revision: str,
    get: Callable[[str], Mapping[str, Any]],
) -> DrainReport:
    """Ask each router `get(url)` (its JSON answer; raising when there is none)."""
    answers = []
    for address in addresses:
        try:
            answer = get(f"http://{address}{WORKER_REPORT_PATH}")
            answers.append(summarize(address, answer, revision))
        except Exception as exc:  # unreachable, an error status, not a worker report
            answers.append(RouterAnswer(address, None, error=str(exc) or type(exc).__name__))
    return DrainReport(revision, tuple(answers))


def drain_verdict(report: DrainReport, since_s: float, now_s: float, timeout_s: float) -> Verdict:
    """`drained` when the routers are quiet about the revision, `timed_out` when they are not
    but `timeout_s` passed since `since_s` (both seconds since the epoch), else `wait`."""
    if report.quiet:
        return "drained"
    if now_s - since_s >= timeout_s:
        return "timed_out"
    return "wait"


def http_get_json(timeout_s: float = 2.0) -> Callable[[str], Mapping[str, Any]]:
    """`get` for `ask_routers`: an HTTP GET with a short timeout; error statuses raise."""
    import httpx

    def get(url: str) -> Mapping[str, Any]:
        resp = httpx.get(url, timeout=timeout_s)
        resp.raise_for_status()
        body: Mapping[str, Any] = resp.json()
        return body

    return get
