"""`beamserve status`: what a running `beamserve up` serves, from its `/metrics`.

`parse_metrics(text)` turns a Prometheus exposition into sums per sample name (pure);
`worker_stats` and `router_stats` read the names the workers (vLLM's or SGLang's, plus
beamserve's own) and the router export; `scrape(state)` fetches them all for a `state.json`;
`status_table` renders one row per process.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.table import Table


def parse_metrics(text: str) -> dict[str, float]:
    """Sample name → the sum over its label sets (counters keep their `_total`)."""
    out: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] += float(sample.value)
    return dict(out)


def labelled(text: str, name: str, label: str) -> dict[str, float]:
    """`name`'s samples summed per value of `label` (e.g. the router's decisions by reason)."""
    out: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                out[sample.labels.get(label, "")] += float(sample.value)
    return dict(out)


@dataclass(frozen=True)
class WorkerStats:
    """One worker's load and cache, from its `/metrics` (vLLM or SGLang names)."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    """Fraction 0–1 of its KV pages in use."""
    cache_hit_rate: float | None = None
    """Prefix-cache hit tokens / queried tokens (None before any query)."""
    kv_transfers: float = 0.0
    """Requests served from KV pulled from a prefill worker."""
    kv_bytes_in: float = 0.0
    recompute_fallbacks: float = 0.0


def worker_stats(m: Mapping[str, float]) -> WorkerStats:
    if "vllm:num_requests_running" in m:
        queries = m.get("vllm:prefix_cache_queries_total", 0.0)
        hits = m.get("vllm:prefix_cache_hits_total", 0.0)
        running, waiting = m["vllm:num_requests_running"], m.get("vllm:num_requests_waiting", 0)
        usage = m.get("vllm:kv_cache_usage_perc", 0.0)
        rate = hits / queries if queries else None
    else:
        running, waiting = m.get("sglang:num_running_reqs", 0.0), m.get("sglang:num_queue_reqs", 0)
        usage = m.get("sglang:token_usage", 0.0)
        rate = m.get("sglang:cache_hit_rate")
    return WorkerStats(
        running=running,
        waiting=float(waiting),
        kv_usage=usage,
        cache_hit_rate=rate,
        kv_transfers=m.get("beamserve_worker_kv_transfers_total", 0.0),
        kv_bytes_in=m.get("beamserve_worker_kv_transfer_bytes_total", 0.0),
        recompute_fallbacks=m.get("beamserve_worker_kv_recompute_fallbacks_total", 0.0),
    )


@dataclass(frozen=True)
class RouterStats:
    """The router's counters: requests, P/D decisions, decisions by reason, and the prefix
    hits it expected by kind (`full`, `partial`, `none`)."""

    requests: float = 0.0
    disaggregated: float = 0.0
    decisions: Mapping[str, float] = field(default_factory=dict)
    hits: Mapping[str, float] = field(default_factory=dict)


def router_stats(text: str) -> RouterStats:
    m = parse_metrics(text)
    return RouterStats(
        requests=m.get("beamserve_router_requests_total", 0.0),
        disaggregated=m.get("beamserve_router_disaggregated_total", 0.0),
        decisions=labelled(text, "beamserve_router_decisions_total", "reason"),
        hits=labelled(text, "beamserve_router_prefix_hits_total", "kind"),
    )


@dataclass(frozen=True)
class ProcessStatus:
    name: str
    component: str
    url: str
    pid: int | None
    restarts: int
    healthy: bool
    worker: WorkerStats | None = None
    router: RouterStats | None = None


async def _get(client: httpx.AsyncClient, url: str) -> tuple[int, str]:
    try:
        r = await client.get(url)
        return r.status_code, r.text
    except httpx.HTTPError:
        return 0, ""


async def scrape(state: Mapping[str, Any], timeout_s: float = 3.0) -> list[ProcessStatus]:
    """Health and `/metrics` of every process in a `state.json` (unreachable: unhealthy)."""
    procs: list[Mapping[str, Any]] = list(state.get("processes", []))
    async with httpx.AsyncClient(timeout=timeout_s) as client:

        async def one(p: Mapping[str, Any]) -> ProcessStatus:
            url = str(p["url"])
            is_router = p["component"] == "router"
            health = "/v1/models" if is_router else "/health"
            (code, _), (mcode, text) = await asyncio.gather(
                _get(client, url + health), _get(client, url + "/metrics")
            )
            ws = rs = None
            if mcode == 200:
                if is_router:
                    rs = router_stats(text)
                else:
                    ws = worker_stats(parse_metrics(text))
            return ProcessStatus(
                name=str(p["name"]),
                component=str(p["component"]),
                url=url,
                pid=p.get("pid"),
                restarts=int(p.get("restarts", 0)),
                healthy=code == 200,
                worker=ws,
                router=rs,
            )

        return list(await asyncio.gather(*(one(p) for p in procs)))


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def status_table(name: str, rows: list[ProcessStatus], router_url: str) -> Table:
    """One row per process: role, URL, pid, health, restarts, load, KV, cache hits, transfers."""
    table = Table(title=f"{name}: router {router_url}", title_justify="left")
    for col in ("process", "role", "url", "pid", "health", "restarts", "load (run/wait)",
                "KV used", "cache hits", "KV transfers"):  # fmt: skip
        table.add_column(col, justify="right" if col in ("pid", "restarts") else "left")
    for r in rows:
        load = kv = hits = moved = "-"
        if r.worker is not None:
            w = r.worker
            load = f"{w.running:.0f}/{w.waiting:.0f}"
            kv, hits = _pct(w.kv_usage), _pct(w.cache_hit_rate)
            if r.component == "decode":
                moved = f"{w.kv_transfers:.0f} ({w.kv_bytes_in / 1e6:.1f} MB)"
        elif r.router is not None:
            rs = r.router
            reasons = ", ".join(f"{k} {v:.0f}" for k, v in sorted(rs.decisions.items()) if v)
            load = f"{rs.requests:.0f} req" + (f" ({reasons})" if reasons else "")
            routed = sum(rs.hits.values())
            warm = routed - rs.hits.get("none", 0.0)
            hits = f"{warm:.0f}/{routed:.0f} expected" if routed else "-"
            moved = f"{rs.disaggregated:.0f} P/D"
        table.add_row(
            r.name,
            r.component,
            r.url,
            str(r.pid or "-"),
            "[green]ready[/]" if r.healthy else "[red]down[/]",
            str(r.restarts),
            load,
            kv,
            hits,
            moved,
        )
    return table
