"""Builders for routing-policy tests (frozen views from a few numbers)."""

from __future__ import annotations

from beamserve.kvwire.geometry import KVGeometry
from beamserve.router.types import Endpoint, PrefixHit, RouteRequest, WorkerLoad, WorkerView


def view(
    wid: str,
    *,
    blocks: int = 0,
    window_ok: bool = True,
    prefill: int = 0,
    decode: int = 0,
    warm: bool = False,
    healthy: bool = True,
    role: str = "both",
    revision: str = "r1",
    kv_layout: str = "L",
    queue_len: int = 0,
    kv_usage: float = 0.0,
    scraped_age_s: float | None = None,
    predicted: int = 0,
    block_size: int = 64,
    sliding_window: int = 512,
) -> WorkerView:
    return WorkerView(
        endpoint=Endpoint(
            id=wid,
            url=f"http://{wid}:8000",
            role=role,  # type: ignore[arg-type]
            revision=revision,
            kv_layout=kv_layout,
        ),
        load=WorkerLoad(
            prefill_tokens=prefill,
            decode_tokens=decode,
            queue_len=queue_len,
            kv_usage=kv_usage,
            scraped_age_s=scraped_age_s,
            healthy=healthy,
        ),
        hit=PrefixHit(full_blocks=blocks, window_ok=window_ok, predicted_blocks=predicted),
        warm=warm,
        geometry=KVGeometry.of(block_size, sliding_window),
    )


def request(
    prompt_tokens: int = 8192, *, rid: str = "req-1", session: str | None = "s-1"
) -> RouteRequest:
    return RouteRequest(request_id=rid, prompt_tokens=prompt_tokens, session_id=session)
