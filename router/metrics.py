"""The router's Prometheus metrics (`beamserve_router_*`, units in the names).

Counters: `requests_total{api,status}`, `decisions_total{reason}`, `prefix_hits_total{kind}`
(kind = full | partial | none: hybrid-aware — *partial* means the full-attention blocks were
resident but the window tail was not), `prefix_hit_tokens_total{kind}`, `shed_total{band,reason}`,
`pd_fallbacks_total{reason}` (prefill leg failed → another prefill worker or local prefill),
`retries_total{reason}`, `disaggregated_total`, `prompt_heads_total` (long new prompts sent
on their head key, the rest tokenized and hashed after the upstream call: `router/app.py`).
Gauges: `queue_depth{band}`, `in_flight`,
`worker_in_flight{worker}`, `worker_prefill_tokens{worker}`, `worker_decode_tokens{worker}`,
`worker_breaker_open{worker}`, `worker_resting_sessions{worker}` (sessions between turns whose
next turn is expected back there: `router/load.py`, "Resting sessions"),
`worker_saturation{worker}` (each decode-capable worker's term of the saturation detector,
`router/flow/saturation.py`, now), `saturation_level` (the pool's level at the last snapshot:
the mean of those terms, each capped at the threshold),
`saturated` (1 while new sessions are held for it), `session_store_degraded`, `kv_event_*`
(subscriber totals).
With replica sync on: gauges `replica_sync_connected`, `replica_sync_peers` (fresh peers),
`worker_peer_in_flight{worker}` and `worker_peer_prefill_tokens{worker}` (what the fresh peers
book there); counters `replica_sync_messages_total{direction}` (published | received),
`replica_sync_bytes_total{direction}`, `replica_sync_dropped_total` (not sent: Redis down or
the outbox full), `replica_sync_errors_total`, `replica_sync_decode_errors_total`,
`replica_sync_room_tokens_total{kind}` (flow-control room moved between replicas: granted |
received | borrowed | lent; `router/flow/controller.py`, "Several replicas").
With pool roles by load (`router/policy/pool_roles.py`): gauges `pool_split` (1 while split)
and `pool_draining` (1 while draining), counter `pool_mode_switches_total`.
Histogram: `decision_seconds` (routing step: tokenize + hash + match + policy).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class _Live(Collector):
    def __init__(self, read: Callable[[], dict[str, Any]]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        s = self._read()
        depth = GaugeMetricFamily(
            "beamserve_router_queue_depth", "Requests queued per band.", labels=["band"]
        )
        for band, n in s["queue_depth"].items():
            depth.add_metric([band], n)
        yield depth
        yield GaugeMetricFamily(
            "beamserve_router_in_flight", "Requests dispatched and not done.", value=s["in_flight"]
        )
        per = {
            "worker_in_flight": "Router-tracked requests in flight per worker.",
            "worker_prefill_tokens": "Router-tracked uncached prompt tokens in prefill.",
            "worker_decode_tokens": "Router-tracked context tokens in decode.",
            "worker_breaker_open": "1 while the worker's circuit breaker is open.",
            "worker_resting_sessions": "Sessions between turns whose next turn is due here.",
            "worker_saturation": "The saturation detector's share of this decode-capable "
            "worker in use (0 idle, 1 full: the largest of its terms).",
        }
        for name, doc in per.items():
            fam = GaugeMetricFamily(f"beamserve_router_{name}", doc, labels=["worker"])
            for worker, v in s["workers"].get(name, {}).items():
                fam.add_metric([worker], v)
            yield fam
        sat = s.get("saturation")
        if sat is not None:
            yield GaugeMetricFamily(
                "beamserve_router_saturation_level",
                "The pool's saturation level at the last snapshot (the mean of the workers' "
                "terms, each capped at the threshold; new sessions wait at or above it).",
                value=sat[0],
            )
            yield GaugeMetricFamily(
                "beamserve_router_saturated",
                "1 while the pool counts as saturated (new sessions held in the router).",
                value=sat[1],
            )
        yield GaugeMetricFamily(
            "beamserve_router_session_store_degraded",
            "1 while the shared session store is unreachable (serving from local state).",
            value=float(s["session_degraded"]),
        )
        shed = CounterMetricFamily(
            "beamserve_router_shed", "Requests shed by flow control.", labels=["band", "reason"]
        )
        for (band, reason), n in s["shed"].items():
            shed.add_metric([band, reason], n)
        yield shed
        for name, value in s["kv_events"].items():
            yield CounterMetricFamily(
                f"beamserve_router_kv_event_{name}", f"KV-event subscribers: {name}.", value=value
            )
        sync = s.get("replica_sync")
        if sync is not None:
            yield from _sync_families(sync)
        pool = s.get("pool")
        if pool is not None:
            yield GaugeMetricFamily(
                "beamserve_router_pool_split",
                "1 while the kv_both pool is split into prefill and decode workers.",
                value=float(pool["split"]),
            )
            yield GaugeMetricFamily(
                "beamserve_router_pool_draining",
                "1 while the kv_both pool drains: every worker decodes, and continuing turns "
                "move by KV handoff to the least busy.",
                value=float(pool.get("draining", False)),
            )
            yield CounterMetricFamily(
                "beamserve_router_pool_mode_switches",
                "Times the kv_both pool switched between colocated, split and draining.",
                value=pool["switches"],
            )


def _sync_families(sync: dict[str, Any]) -> Iterator[Metric]:
    """Replica sync's families from `RouterRuntime.sync_report`."""
    p = "beamserve_router_replica_sync"
    yield GaugeMetricFamily(
        f"{p}_connected",
        "1 while replica sync is subscribed and publishing to Redis.",
        value=float(sync["connected"]),
    )
    yield GaugeMetricFamily(
        f"{p}_peers", "Router replicas heard from recently enough to count.", value=sync["peers"]
    )
    for kind in ("messages", "bytes"):
        fam = CounterMetricFamily(
            f"{p}_{kind}", f"Replica-sync {kind}, by direction.", labels=["direction"]
        )
        for direction in ("published", "received"):
            fam.add_metric([direction], sync[f"{kind}_{direction}"])
        yield fam
    for name, doc in (
        ("dropped", "Sync messages not sent (Redis down or the outbox full)."),
        ("errors", "Redis errors seen by replica sync."),
        ("decode_errors", "Sync messages that could not be decoded (dropped)."),
    ):
        yield CounterMetricFamily(f"{p}_{name}", doc, value=sync[name])
    room = CounterMetricFamily(
        f"{p}_room_tokens",
        "Flow-control room moved between replicas while saturated (tokens), by kind: granted "
        "to / received from peers whose turns waited, borrowed from / lent to peers' banks.",
        labels=["kind"],
    )
    for kind in ("granted", "received", "borrowed", "lent"):
        room.add_metric([kind], sync[f"room_{kind}"])
    yield room
    for name, doc in (
        ("in_flight", "Requests in flight per worker booked by the fresh peer replicas."),
        ("prefill_tokens", "Uncached prompt tokens in prefill booked by the fresh peers."),
    ):
        gauge = GaugeMetricFamily(f"beamserve_router_worker_peer_{name}", doc, labels=["worker"])
        for worker, v in sync[f"peer_{name}"].items():
            gauge.add_metric([worker], v)
        yield gauge


class RouterMetrics:
    def __init__(self, live: Callable[[], dict[str, Any]]) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "beamserve_router_requests", "Client requests.", ["api", "status"], registry=r
        )
        self.decisions = Counter(
            "beamserve_router_decisions", "Routing decisions by reason.", ["reason"], registry=r
        )
        self.hits = Counter(
            "beamserve_router_prefix_hits",
            "Decisions by expected prefix hit (full: window tail resident too).",
            ["kind"],
            registry=r,
        )
        self.hit_tokens = Counter(
            "beamserve_router_prefix_hit_tokens",
            "Prompt tokens of the expected hit, by kind.",
            ["kind"],
            registry=r,
        )
        self.pd_fallbacks = Counter(
            "beamserve_router_pd_fallbacks",
            "Prefill legs that failed: retried elsewhere or prefilled on the decode worker.",
            ["reason"],
            registry=r,
        )
        self.retries = Counter(
            "beamserve_router_retries", "Retries before the first byte.", ["reason"], registry=r
        )
        self.pace_holds = Counter(
            "beamserve_router_pace_holds",
            "Continuing turns held before dispatch by the pace hold (flow.pace_hold), by how the "
            "hold ended: released (no user would be slowed any more) or expired (pace_hold_max_s).",
            ["outcome"],
            registry=r,
        )
        self.pace_hold_seconds = Counter(
            "beamserve_router_pace_hold_seconds",
            "Seconds continuing turns spent in the pace hold.",
            registry=r,
        )
        self.prefill_pieces = Counter(
            "beamserve_router_prefill_pieces",
            "Prompt prefixes sent ahead of continuing turns prefilled in pieces "
            "(flow.prefill_piece_min_tokens).",
            registry=r,
        )
        self.piece_yields = Counter(
            "beamserve_router_prefill_piece_yields",
            "Times a prefill in pieces waited before its next piece for a short turn's first "
            "token on the same worker (flow.prefill_piece_yield_tokens), by outcome: answered "
            "(the turn's first token came) or bounded (prefill_piece_yield_max_s ran out).",
            ["outcome"],
            registry=r,
        )
        self.pieced_prefills = Counter(
            "beamserve_router_pieced_prefills",
            "Continuing turns prefilled in pieces, by outcome: done (every piece answered) or "
            "failed (a piece failed; the request went on without the rest).",
            ["outcome"],
            registry=r,
        )
        self.prefill_pieces_missed = Counter(
            "beamserve_router_prefill_pieces_missed",
            "Requests prefilled in pieces whose worker reported fewer cached prompt tokens than "
            "the pieces sent (the router's tokens are not the engine's, or the cache dropped "
            "them).",
            registry=r,
        )
        self.prefill_spills = Counter(
            "beamserve_router_prefill_spills",
            "New sessions held at the prefill stage of a P/D pool and then prefilled on a decode "
            "worker that had room for them (flow.prefill_spill_after_s).",
            registry=r,
        )
        self.prefill_lull_spills = Counter(
            "beamserve_router_prefill_lull_spills",
            "Of those, the ones spilled in a lull of new sessions, by the lull's looser rule "
            "(flow.prefill_spill_lull_s).",
            registry=r,
        )
        self.speculations = Counter(
            "beamserve_router_speculative_dispatches",
            "Continuing turns sent to their session's worker before the router decided, by "
            "outcome: adopted (the decision was that worker) or called_off (aborted; the "
            "request went as decided).",
            ["outcome"],
            registry=r,
        )
        self.prompt_heads = Counter(
            "beamserve_router_prompt_heads",
            "Requests routed on their prompt's first segments (a long prompt that starts a "
            "session), the rest tokenized and hashed once the request was on its way.",
            registry=r,
        )
        self.disaggregated = Counter(
            "beamserve_router_disaggregated", "Requests prefilled on the prefill pool.", registry=r
        )
        self.decision_seconds = Histogram(
            "beamserve_router_decision_seconds",
            "Routing step latency (tokenize, hash, match, policy).",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0),
            registry=r,
        )
        r.register(_Live(live))

    def render(self) -> bytes:
        return generate_latest(self.registry)
