"""Two `beamserve router` processes behind a real HAProxy (plain L4, round-robin), sharing
sessions through a real Redis, in front of the same sim workers: every session stays on one
worker although its turns alternate between the replicas."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.router import replicas
from tests.router.redis_server import redis_server  # noqa: F401 (fixture)
from tests.router.replicas import ReplicaCluster, replica_cluster  # noqa: F401 (fixture)
from tests.router.test_router_e2e import metric, route_of

SESSIONS = 6
TURNS = 4


def served(cluster: ReplicaCluster) -> list[float]:
    """Requests each router replica answered (asked directly, not through the balancer)."""
    return [metric(r.url, "beamserve_router_requests_total") for r in cluster.routers]


def test_every_session_stays_on_one_worker_across_both_replicas(
    replica_cluster: Callable[..., ReplicaCluster],  # noqa: F811
) -> None:
    cluster = replica_cluster(routers=2, workers=3)
    worker_of: dict[str, set[str]] = {}
    replicas_of: dict[str, set[int]] = {}
    history: dict[str, list[dict[str, str]]] = {}
    for s in range(SESSIONS):
        sid = f"lb-session-{s}"
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": f"You are agent {s}."},
            {"role": "user", "content": f"task {s}: read the repository"},
        ]
        for t in range(TURNS):
            before = served(cluster)
            # A fresh connection per turn, as an agent harness reconnecting does: HAProxy
            # (TCP mode, round-robin) hands each connection to the next replica.
            r = httpx.post(
                cluster.lb.url + "/v1/chat/completions",
                json={"model": "beam", "messages": messages, "max_tokens": 4},
                headers={"x-session-id": sid},
                timeout=60,
            )
            assert r.status_code == 200, r.text
            after = served(cluster)
            replica = [i for i, (a, b) in enumerate(zip(after, before, strict=True)) if a > b]
            assert len(replica) == 1, (before, after)
            route = route_of(r.headers)
            worker_of.setdefault(sid, set()).add(route["decode"])
            replicas_of.setdefault(sid, set()).add(replica[0])
            history.setdefault(sid, []).append({**route, "replica": str(replica[0])})
            messages += [
                {"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                {"role": "user", "content": f"turn {t + 1}: go on"},
            ]
    assert all(len(rs) == 2 for rs in replicas_of.values()), replicas_of  # both replicas served
    for sid, workers in worker_of.items():
        assert len(workers) == 1, (sid, history[sid])  # never split across workers
    assert len({next(iter(w)) for w in worker_of.values()}) > 1  # sessions were spread out
    # the workers' own counters agree: every turn was served once, somewhere
    done = sum(metric(w.url, "vllm:request_success_total") for w in cluster.workers)
    assert done == SESSIONS * TURNS


def test_a_missing_haproxy_fails_naming_make_debs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(replicas.shutil, "which", lambda _name: None)
    monkeypatch.setattr(replicas, "HAPROXY_FALLBACK", "/nonexistent/haproxy")
    with pytest.raises(pytest.fail.Exception, match="make debs"):
        replicas.haproxy_binary()
