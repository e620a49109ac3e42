"""The drain decision's pure parts (`operator/drain.py`): which router replicas are asked, what
their worker reports say about one revision, and when a retiring revision may go. The API
server behaviour (old Services deleted, workloads kept until the routers are quiet or the
timeout ran out, the events) is in test_operator_k8s.py."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
from beamserve.operator.drain import (
    DrainReport,
    RouterAnswer,
    ask_routers,
    drain_verdict,
    router_addresses,
    summarize,
)


def _slice(*eps: tuple[str, bool | None, bool], port: int = 8080, v6: bool = False) -> Any:
    return {
        "addressType": "IPv6" if v6 else "IPv4",
        "ports": [{"name": "grpc", "port": 9002}, {"name": "http", "port": port}],
        "endpoints": [
            {
                "addresses": [a],
                "conditions": ({} if ready is None else {"ready": ready})
                | ({"terminating": True} if term else {}),
            }
            for a, ready, term in eps
        ],
    }


def test_router_addresses_are_the_ready_http_endpoints() -> None:
    slices = [
        _slice(("10.0.0.1", True, False), ("10.0.0.2", False, False), ("10.0.0.3", None, False)),
        _slice(("10.0.0.4", True, True), ("10.0.0.1", True, False)),  # terminating; a duplicate
        _slice(("fd00::5", True, False), v6=True),
        {"ports": [{"name": "grpc", "port": 9002}], "endpoints": [{"addresses": ["10.0.0.9"]}]},
    ]
    assert router_addresses(slices) == ["10.0.0.1:8080", "10.0.0.3:8080", "[fd00::5]:8080"]
    assert router_addresses([]) == []


def _report(*workers: tuple[str, str, int, bool]) -> dict[str, Any]:
    return {
        "workers": [
            {"id": i, "revision": r, "in_flight": n, "discovered": d} for i, r, n, d in workers
        ],
        "in_flight": sum(n for _, _, n, _ in workers),
    }


def test_summarize_counts_only_the_revisions_workers() -> None:
    answer = _report(("old-0", "r1", 2, False), ("old-1", "r1", 1, True), ("new-0", "r2", 5, True))
    assert summarize("a:1", answer, "r1") == RouterAnswer("a:1", 3, listed=1)
    assert summarize("a:1", answer, "r3") == RouterAnswer("a:1", 0, listed=0)
    with pytest.raises(ValueError, match="no 'workers' list"):
        summarize("a:1", {"detail": "Not Found"}, "r1")


def test_ask_routers_records_who_did_not_answer() -> None:
    answers = {
        "http://10.0.0.1:8080/admin/workers": _report(("old-0", "r1", 1, False)),
        "http://10.0.0.2:8080/admin/workers": _report(("new-0", "r2", 4, True)),
    }

    def get(url: str) -> Mapping[str, Any]:
        if url not in answers:
            raise ConnectionError("connection refused")
        return answers[url]

    report = ask_routers(["10.0.0.1:8080", "10.0.0.2:8080", "10.0.0.3:8080"], "r1", get)
    assert report.in_flight == 1 and report.unanswered == ["10.0.0.3:8080"]
    assert report.answers[2].error == "connection refused"
    assert not report.quiet
    assert report.describe() == (
        "1 request(s) in flight on its workers; no answer from 10.0.0.3:8080 "
        "(3 router replica(s) asked)"
    )


@pytest.mark.parametrize(
    ("answers", "elapsed", "verdict"),
    [
        ((), 0, "drained"),  # no router replica is ready: nothing routed through one is running
        ((RouterAnswer("a", 0), RouterAnswer("b", 0)), 0, "drained"),
        ((RouterAnswer("a", 0), RouterAnswer("b", 1)), 10, "wait"),  # b has a request left
        ((RouterAnswer("a", 0, listed=1),), 10, "wait"),  # a still routes to it
        ((RouterAnswer("a", 0), RouterAnswer("b", None)), 10, "wait"),  # b did not answer
        ((RouterAnswer("a", 0), RouterAnswer("b", None)), 600, "timed_out"),
        ((RouterAnswer("a", 3),), 601, "timed_out"),
        ((RouterAnswer("a", 0),), 601, "drained"),  # quiet wins over the deadline
    ],
)
def test_drain_verdict(answers: tuple[RouterAnswer, ...], elapsed: float, verdict: str) -> None:
    report = DrainReport("r1", answers)
    assert drain_verdict(report, 1000.0, 1000.0 + elapsed, 600) == verdict
