"""Two router processes behind a (pretend) plain load balancer share sessions through a real
Redis: a session bound by one replica stays on its warm worker when its next turn lands on the
other. Redis killed: both keep serving from local state; restarted: they recover."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx

from tests.conftest import SpawnWorker, WorkerProc
from tests.router.redis_server import RedisServer, redis_server  # noqa: F401 (fixture)
from tests.router.test_router_e2e import metric, route_of


def turn(router: WorkerProc, sid: str, text: str, earlier: str | None = None) -> httpx.Response:
    """One turn; with `earlier`, the second turn of a conversation that opened with it."""
    msgs = [{"role": "user", "content": text}]
    if earlier is not None:
        msgs = [{"role": "user", "content": earlier}, {"role": "assistant", "content": "ok"}, *msgs]
    body: dict[str, Any] = {"model": "beam", "messages": msgs, "max_tokens": 2}
    r = httpx.post(
        router.url + "/v1/chat/completions", json=body, headers={"x-session-id": sid}, timeout=30
    )
    assert r.status_code == 200, r.text
    return r


def peers_settled(router: WorkerProc, within_s: float = 10.0) -> None:
    """Wait until `router` hears its one peer and none of the peer's requests is still booked
    (the peer's last completion has reached it: least-load breaks exact ties by session, so a
    booking in flight would move a tie)."""
    deadline = time.monotonic() + within_s
    while not (
        metric(router.url, "beamserve_router_replica_sync_peers") == 1
        and metric(router.url, "beamserve_router_worker_peer_in_flight") == 0
    ):
        assert time.monotonic() < deadline, "the peer's bookings did not settle"
        time.sleep(0.05)


def test_sessions_follow_their_worker_across_router_replicas(
    spawn_worker: SpawnWorker,
    redis_server: RedisServer,  # noqa: F811
) -> None:
    workers = [spawn_worker("--engine", "sim") for _ in range(3)]
    specs = json.dumps([{"url": w.url} for w in workers])
    # approximate mode and no KV events: replica B knows nothing of A's traffic but the store.
    # The session's warm worker outweighs any load (so a turn lands there only when the replica
    # knows the session: the decision's reason is then "sticky"); a session not yet known goes
    # by load, ties broken by the session id.
    # A Redis call over its budget sends a replica to local state (by design); on a loaded test
    # machine the default 0.25 s, event-loop lag included, is within reach, so a wider one here.
    scorers = [{"type": "session-affinity", "weight": 10}, {"type": "load", "weight": 1}]
    policy = {"name": "affine", "picker": {"type": "max-score"}, "scorers": scorers}
    common = ["--endpoints", specs, "--redis", redis_server.url, "--policy", json.dumps(policy),
              "--redis-op-timeout-s", "5"]  # fmt: skip
    a = spawn_worker(*common, command="router")
    b = spawn_worker(*common, command="router")
    # Open sessions on A until they sit on at least two workers (load with every worker idle is
    # a tie, broken by the session id: how many it takes must not decide the test).
    first: dict[str, str] = {}
    while len(first) < 6 or len(set(first.values())) < 2:
        assert len(first) < 30, f"least-load kept every session on one worker: {first}"
        sid = f"shared-{len(first)}"
        first[sid] = route_of(turn(a, sid, f"opening of {sid}").headers)["decode"]
    sessions = list(first)
    peers_settled(b)
    for replica in (a, b):  # every bind reached Redis: nothing is served from local state
        assert metric(replica.url, "beamserve_router_session_store_degraded") == 0
    for sid in sessions:
        # replica B knows the session only from the store: its warm worker, and (a record plus
        # an earlier turn in the body) the continuing band
        again = route_of(turn(b, sid, f"a second turn {sid}", f"opening of {sid}").headers)
        assert (again["decode"], again["reason"]) == (first[sid], "sticky"), (sid, again)
        assert again["band"] == "continuing"

    peers_settled(a)
    assert metric(a.url, "beamserve_router_replica_sync_messages_total", direction="received") > 0
    assert metric(a.url, "beamserve_router_replica_sync_room_tokens_total", kind="lent") == 0
    # Redis dies: both replicas keep serving, from what they know locally
    redis_server.kill()
    t0 = time.monotonic()
    for sid in sessions[:3]:
        # a continuing turn: its warm worker comes from A's local copy of the record
        during = route_of(turn(a, sid, "during the outage", f"opening of {sid}").headers)
        assert (during["decode"], during["reason"]) == (first[sid], "sticky"), (sid, during)
        assert during["band"] == "continuing"
    assert time.monotonic() - t0 < 10
    assert metric(a.url, "beamserve_router_session_store_degraded") == 1
    assert metric(a.url, "beamserve_router_replica_sync_peers") == 0  # forgotten with Redis
    # Redis returns (empty): the replicas recover and re-sync what they wrote meanwhile
    redis_server.restart()
    deadline = time.monotonic() + 15
    while metric(a.url, "beamserve_router_session_store_degraded") != 0:
        assert time.monotonic() < deadline, "router did not recover from the Redis outage"
        turn(a, sessions[0], "poke")
        time.sleep(0.5)
    for sid in sessions[:3]:
        after = route_of(turn(b, sid, "after recovery", f"opening of {sid}").headers)
        assert (after["decode"], after["reason"]) == (first[sid], "sticky"), (sid, after)
