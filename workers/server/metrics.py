"""`/metrics` with the engine's own names, so dashboards and routers built for vLLM or SGLang
read our workers unchanged (REFERENCE.md, "Metrics names engines expose").

`api="vllm"`: `vllm:num_requests_running`, `vllm:num_requests_waiting`,
`vllm:kv_cache_usage_perc` (fraction 0–1), counters `vllm:prompt_tokens`,
`vllm:generation_tokens`, `vllm:prefix_cache_queries`, `vllm:prefix_cache_hits`,
`vllm:num_preemptions`, `vllm:request_success`, `vllm:nixl_bytes_transferred`,
`vllm:nixl_num_failed_transfers` (exposed with `_total`), histograms
`vllm:time_to_first_token_seconds` and `vllm:e2e_request_latency_seconds`; labels
`model_name`, `engine`.
`api="sglang"`: `sglang:num_running_reqs`, `sglang:num_queue_reqs`, `sglang:token_usage`,
`sglang:cache_hit_rate`, `sglang:prompt_tokens`, `sglang:generation_tokens`,
`sglang:num_transfer_failed_reqs`, histograms `sglang:time_to_first_token_seconds` and
`sglang:e2e_request_latency_seconds`; label `model_name`.
Both: beamserve's own `beamserve_worker_kv_recompute_fallbacks_total` (decode requests whose KV
transfer failed and were prefilled locally), `beamserve_worker_kv_transfers_total`,
`beamserve_worker_kv_transfer_bytes_total`, `beamserve_worker_kv_leases_held`,
`beamserve_worker_kv_event_batches_total`, `beamserve_worker_kv_event_batches_dropped_total`,
`beamserve_worker_ready`, the sim's `beamserve_worker_step_lag_seconds_total` (engine time lost to a
busy host: `beamserve.workers.sim.engine`, "Host lateness"), the sim's
`beamserve_worker_busy_seconds_total`, `…_prefill_busy_seconds_total` (engine seconds
spent in steps, and in steps that computed some prompt) and `…_prefill_computed_tokens_total`
(prompt tokens computed: cache misses and recomputes), which `beamserve bench agentic` samples for
each worker's busy share over a run, and the gauge
`beamserve_worker_queued_prefill_tokens`: prompt tokens still to compute for requests waiting or in
prefill (waiting ones net of their current prefix-cache hit). Neither vLLM nor SGLang exports such a
gauge on `/metrics` (vLLM counts waiting *requests*; SGLang's token load is only on its `/get_load`
endpoint), so it carries beamserve's name; the router combines it with its own book across replicas
(`beamserve.router.load`). Exported by the sim engine only (the ref engine does not track it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Literal

from beamserve.workers.server.backend import WorkerStats
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

Api = Literal["vllm", "sglang"]
QUEUED_PREFILL_TOKENS = "beamserve_worker_queued_prefill_tokens"
# counters without the `_total` suffix, which the exposition adds
BUSY_SECONDS = "beamserve_worker_busy_seconds"
PREFILL_BUSY_SECONDS = "beamserve_worker_prefill_busy_seconds"
PREFILL_COMPUTED_TOKENS = "beamserve_worker_prefill_computed_tokens"
_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
_E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


class _StatsCollector(Collector):
    def __init__(
        self, api: Api, model: str, stats: Callable[[], WorkerStats], ready: Callable[[], bool]
    ) -> None:
        self.api, self.model, self._stats, self._ready = api, model, stats, ready

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        if self.api == "vllm":
            labels, values = ["model_name", "engine"], [self.model, "0"]
            yield from self._family(
                GaugeMetricFamily,
                labels,
                values,
                [
                    (
                        "vllm:num_requests_running",
                        "Requests in model execution batches.",
                        s.running,
                    ),
                    ("vllm:num_requests_waiting", "Requests waiting to be processed.", s.waiting),
                    (
                        "vllm:kv_cache_usage_perc",
                        "KV-cache usage. 1 means 100 percent usage.",
                        s.kv_usage,
                    ),
                ],
            )
            yield from self._family(
                CounterMetricFamily,
                labels,
                values,
                [
                    ("vllm:prompt_tokens", "Prefill tokens processed.", s.prompt_tokens),
                    ("vllm:generation_tokens", "Generation tokens processed.", s.generation_tokens),
                    (
                        "vllm:prefix_cache_queries",
                        "Prefix cache queries, in tokens.",
                        s.prefix_queries_tokens,
                    ),
                    (
                        "vllm:prefix_cache_hits",
                        "Prefix cache hits, in tokens.",
                        s.prefix_hits_tokens,
                    ),
                    ("vllm:num_preemptions", "Cumulative preemptions.", s.preemptions),
                    (
                        "vllm:request_success",
                        "Successfully processed requests.",
                        s.requests_finished,
                    ),
                    (
                        "vllm:nixl_bytes_transferred",
                        "KV bytes pulled from prefill workers.",
                        s.transfer_bytes,
                    ),
                    ("vllm:nixl_num_failed_transfers", "Failed KV transfers.", s.transfer_failures),
                ],
            )
        else:
            labels, values = ["model_name"], [self.model]
            hit = s.prefix_hits_tokens / s.prefix_queries_tokens if s.prefix_queries_tokens else 0
            yield from self._family(
                GaugeMetricFamily,
                labels,
                values,
                [
                    ("sglang:num_running_reqs", "The number of running requests.", s.running),
                    (
                        "sglang:num_queue_reqs",
                        "The number of requests in the waiting queue.",
                        s.waiting,
                    ),
                    ("sglang:token_usage", "The token usage.", s.kv_usage),
                    ("sglang:cache_hit_rate", "The prefix cache hit rate.", hit),
                ],
            )
            yield from self._family(
                CounterMetricFamily,
                labels,
                values,
                [
                    (
                        "sglang:prompt_tokens",
                        "Number of prefill tokens processed.",
                        s.prompt_tokens,
                    ),
                    (
                        "sglang:generation_tokens",
                        "Number of generation tokens processed.",
                        s.generation_tokens,
                    ),
                    (
                        "sglang:num_transfer_failed_reqs",
                        "Requests whose KV transfer failed.",
                        s.transfer_failures,
                    ),
                ],
            )
        yield from self._family(
            CounterMetricFamily,
            [],
            [],
            [
                (
                    "beamserve_worker_kv_recompute_fallbacks",
                    "Decode requests whose KV transfer failed and were prefilled locally.",
                    s.recompute_fallbacks,
                ),
                (
                    "beamserve_worker_kv_transfers",
                    "Decode requests served from transferred KV.",
                    s.transfers,
                ),
                (
                    "beamserve_worker_kv_transfer_bytes",
                    "KV bytes moved into this worker.",
                    s.transfer_bytes,
                ),
                (
                    "beamserve_worker_kv_event_batches",
                    "KV event batches emitted.",
                    s.kv_event_batches,
                ),
                (
                    "beamserve_worker_kv_event_batches_dropped",
                    "KV event batches dropped (faults).",
                    s.kv_event_batches_dropped,
                ),
                (
                    "beamserve_worker_step_lag_seconds",
                    "sim: engine time lost to a busy host (step timers that ran late).",
                    s.step_lag_seconds,
                ),
            ],
        )
        yield from self._family(
            GaugeMetricFamily,
            [],
            [],
            [
                (
                    "beamserve_worker_kv_leases_held",
                    "Prefill KV leases awaiting their decode side.",
                    s.leases_held,
                ),
                ("beamserve_worker_ready", "1 while the engine can serve.", float(self._ready())),
            ],
        )
        if s.busy_seconds is not None:
            yield from self._family(
                CounterMetricFamily,
                [],
                [],
                [
                    (BUSY_SECONDS, "sim: engine seconds spent in steps.", s.busy_seconds),
                    (
                        PREFILL_BUSY_SECONDS,
                        "sim: engine seconds spent in steps that computed some prompt.",
                        s.prefill_busy_seconds or 0.0,
                    ),
                    (
                        PREFILL_COMPUTED_TOKENS,
                        "sim: prompt tokens computed (prefix-cache misses and recomputes).",
                        s.prefill_computed_tokens or 0,
                    ),
                ],
            )
        if s.queued_prefill_tokens is not None:
            yield from self._family(
                GaugeMetricFamily,
                [],
                [],
                [
                    (
                        QUEUED_PREFILL_TOKENS,
                        "Prompt tokens still to compute for requests waiting or in prefill.",
                        s.queued_prefill_tokens,
                    )
                ],
            )

    @staticmethod
    def _family(
        kind: type[GaugeMetricFamily] | type[CounterMetricFamily],
        labels: list[str],
        values: list[str],
        rows: list[tuple[str, str, float]],
    ) -> Iterator[Metric]:
        for name, doc, value in rows:
            fam = kind(name, doc, labels=labels)
            fam.add_metric(values, float(value))
            yield fam


class WorkerMetrics:
    """One registry per worker app: engine stats read at scrape time, plus latency histograms
    observed by the HTTP layer."""

    def __init__(
        self, api: Api, model: str, stats: Callable[[], WorkerStats], ready: Callable[[], bool]
    ) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_StatsCollector(api, model, stats, ready))
        prefix = "vllm" if api == "vllm" else "sglang"
        labels = ["model_name", "engine"] if api == "vllm" else ["model_name"]
        lv = [model, "0"] if api == "vllm" else [model]
        self.ttft = Histogram(
            f"{prefix}:time_to_first_token_seconds",
            "Time to first token in seconds.",
            labels,
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        ).labels(*lv)
        self.e2e = Histogram(
            f"{prefix}:e2e_request_latency_seconds",
            "End-to-end request latency in seconds.",
            labels,
            buckets=_E2E_BUCKETS,
            registry=self.registry,
        ).labels(*lv)

    def render(self) -> bytes:
        return generate_latest(self.registry)
