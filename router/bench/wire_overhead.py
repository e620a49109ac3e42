"""`beamserve bench wire-overhead`: the TTFT a router adds over a direct call to its worker.

One warm ≈30K-token chat prompt (text built as in `agentic_workload`, 64 tokens per block
under the sim's tokenizer), sent once through the router to warm the worker's prefix cache,
then `n` times through the router and `n` times directly to the same worker, interleaved
(router, direct, router, …), each streamed with ``max_tokens`` 1. TTFT: request sent → first
SSE chunk carrying an output token; the client sets TCP_NODELAY and keeps its connections, as
the routers do upstream. Reported per router: p50 / p90 of each path and the p50 and p90
differences in milliseconds.

Caveat (seen on this machine, not explained yet): a sim worker answers a request on a reused
keep-alive connection up to ≈ 40 ms later than on a fresh one when requests follow each other
closely (a 1-token "hi" chat: 26 ms fresh, 68 ms reused; plain uvicorn + FastAPI in the same
venv shows nothing of the kind). Both paths reuse connections, so the stall can land on either;
with a ≈30K-token prompt it mostly hides behind the prefill, with short prompts it dominates.

Self-contained (default): one fresh sim worker per router, the router in front of it alone.
``--target URL --worker URL [--peer NAME=URL ...]``: routers already running in front of the
worker at ``--worker`` (only that one, or the router may pick another).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from .agentic import NODELAY
from .agentic_procs import ROUTERS, ProcError, Procs, sigterm_as_exception, start_router
from .agentic_procs import start_workers as _start_workers
from .agentic_stats import is_token_chunk, percentile
from .agentic_workload import PromptBuilder, synthetic_prompt


@dataclass
class WireResult:
    router: str
    prompt_tokens: int
    n: int
    router_ttft_p50_ms: float | None = None
    router_ttft_p90_ms: float | None = None
    direct_ttft_p50_ms: float | None = None
    direct_ttft_p90_ms: float | None = None
    added_p50_ms: float | None = None
    added_p90_ms: float | None = None
    errors: int = 0
    skipped: str | None = None
    router_ms: list[float] = field(default_factory=list)
    direct_ms: list[float] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def ttft_ms(client: httpx.Client, url: str, messages: list[dict[str, str]]) -> float:
    """TTFT of one streamed 1-token chat (raises on a non-200 or a stream without text)."""
    body = {"model": "beam", "messages": messages, "max_tokens": 1, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.perf_counter()
    with client.stream(
        "POST", url + "/v1/chat/completions", json=body, headers={"x-session-id": "wire"}
    ) as r:
        if r.status_code != 200:
            raise httpx.HTTPStatusError(f"HTTP {r.status_code}", request=r.request, response=r)
        first = None
        for line in r.iter_lines():
            if first is not None or not line.startswith("data:") or "[DONE]" in line:
                continue
            try:
                obj = json.loads(line[5:])
            except json.JSONDecodeError:
                continue
            if is_token_chunk(obj):
                first = time.perf_counter()
        if first is None:
            raise httpx.RemoteProtocolError("no output token in the stream")
    return (first - t0) * 1e3


def measure(router_url: str, worker_url: str, name: str, *, tokens: int, n: int) -> WireResult:
    builder = PromptBuilder(64)
    messages = synthetic_prompt(builder, tokens, f"wire-{name}")
    res = WireResult(router=name, prompt_tokens=tokens, n=n)
    transport = httpx.HTTPTransport(socket_options=NODELAY)
    with httpx.Client(transport=transport, timeout=60) as client:
        ttft_ms(client, router_url, messages)  # warm (the worker the router picked)
        ttft_ms(client, worker_url, messages)
        for _ in range(n):
            for url, sink in ((router_url, res.router_ms), (worker_url, res.direct_ms)):
                try:
                    sink.append(ttft_ms(client, url, messages))
                except httpx.HTTPError:
                    res.errors += 1
    res.router_ttft_p50_ms = percentile(res.router_ms, 50)
    res.router_ttft_p90_ms = percentile(res.router_ms, 90)
    res.direct_ttft_p50_ms = percentile(res.direct_ms, 50)
    res.direct_ttft_p90_ms = percentile(res.direct_ms, 90)
    if res.router_ttft_p50_ms is not None and res.direct_ttft_p50_ms is not None:
        res.added_p50_ms = res.router_ttft_p50_ms - res.direct_ttft_p50_ms
    if res.router_ttft_p90_ms is not None and res.direct_ttft_p90_ms is not None:
        res.added_p90_ms = res.router_ttft_p90_ms - res.direct_ttft_p90_ms
    return res


def run_wire(
    routers: Sequence[str],
    *,
    tokens: int = 30_000,
    n: int = 30,
    profile: str = "h200-bf16-tp8",
    targets: Sequence[tuple[str, str]] = (),
    worker_url: str | None = None,
    say: Callable[[str], None] = print,
) -> list[WireResult]:
    out: list[WireResult] = []
    with sigterm_as_exception():
        if targets:
            assert worker_url is not None
            for name, url in targets:
                out.append(
                    measure(url.rstrip("/"), worker_url.rstrip("/"), name, tokens=tokens, n=n)
                )
            return out
        for name in routers:
            spec = ROUTERS[name]
            why = spec.unavailable()
            if why is not None:
                say(f"skipping {name}: {why}")
                out.append(WireResult(router=name, prompt_tokens=tokens, n=n, skipped=why))
                continue
            try:
                with Procs() as procs:
                    (worker,) = _start_workers(procs, 1, profile)
                    router = start_router(procs, spec, [worker])
                    out.append(measure(router.url, worker.url, name, tokens=tokens, n=n))
            except ProcError as exc:
                say(f"[red]skipping {name}: {exc}")
                out.append(
                    WireResult(router=name, prompt_tokens=tokens, n=n, skipped=str(exc)[:200])
                )
    return out


def table(results: Sequence[WireResult], title: str) -> Any:
    from rich.table import Table

    t = Table(title=title)
    for c in ("router", "router p50 ms", "p90", "direct p50 ms", "p90", "added p50 ms",
              "added p90 ms", "errors"):  # fmt: skip
        t.add_column(c, justify="left" if c == "router" else "right")

    def f(x: float | None) -> str:
        return "—" if x is None else f"{x:.2f}"

    for r in results:
        if r.skipped:
            t.add_row(r.router, "skipped", r.skipped[:50], "", "", "", "", "")
            continue
        t.add_row(
            r.router,
            f(r.router_ttft_p50_ms),
            f(r.router_ttft_p90_ms),
            f(r.direct_ttft_p50_ms),
            f(r.direct_ttft_p90_ms),
            f(r.added_p50_ms),
            f(r.added_p90_ms),
            str(r.errors),
        )
    return t
