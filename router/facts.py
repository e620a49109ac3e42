"""What each worker says about itself, learned over HTTP — never guessed from a name.

Discovery knows where a worker is and what it was deployed as (role, pool, revision, labels);
the worker itself knows what it actually serves. Before a worker takes part in P/D or in the
router's length check, the router asks it (`probe_facts`):

- ``GET /v1/models`` (vLLM and SGLang both serve it): `max_model_len` of the served model;
  beamserve's workers add their KV geometry to the entry (`block_size`, `sliding_window`,
  `kv_hash_scheme`, `kv_event_format`) and their step budget (`max_num_batched_tokens`, vLLM's
  flag of that name).
- ``GET /server_info`` (SGLang's surface only; vLLM answers 404): `disaggregation_mode`
  (``null`` | ``prefill`` | ``decode``), `disaggregation_bootstrap_port`, `page_size`,
  `context_length`, `chunked_prefill_size` (and, from beamserve's workers, the geometry fields
  above). Its presence is
  what marks the SGLang surface, whatever the labels say.

`apply_facts(endpoint, facts)` (pure) folds the answers into the `Endpoint`:

(`kv_role` is a discovery label holding vLLM's `kv_transfer_config.kv_role`: senders are
``kv_producer`` and ``kv_both``, receivers ``kv_consumer`` and ``kv_both``.)

| fact | SGLang surface | vLLM surface |
|---|---|---|
| `api` | ``sglang`` | ``vllm`` |
| `kv_send` | mode ``prefill`` + bootstrap port | role ``prefill`` or `kv_role` ∈ KV_SENDERS |
| `kv_receive` | mode ``decode`` | role ``decode`` or `kv_role` ∈ KV_RECEIVERS |
| `bootstrap_port` | reported | — |
| `max_model_len` | `/v1/models`, else `context_length` | `/v1/models` |
| `geometry.block_size` | `page_size` | `/v1/models` `block_size` |
| `geometry.sliding_window` | `sliding_window` (either answer) | `/v1/models` `sliding_window` |
| `geometry.hash_scheme` / `event_format` | reported, else ``sglang`` | reported, else the default |
| `prefix_caching` | `prefix_caching`, else not `disable_radix_cache` | `prefix_caching` |
| `step_budget` | `chunked_prefill_size`, else `max_num_batched_tokens` | `max_num_batched_tokens` |

The geometry (`beamserve.kvwire.geometry.KVGeometry`) is the router's default (its
`--block-size`, `--sliding-window`, `--hash-scheme`) with what the worker reported laid over it;
a worker that reports none keeps `Endpoint.geometry` None (the default applies). A report that
contradicts the router's flags is logged once per worker (`worker.geometry_mismatch`) and wins.

vLLM has no HTTP self-report of its KV connector, so there the deployment's role and labels
(written by the operator from the same spec that rendered the engine's `--kv-transfer-config`)
stand. A worker whose discovery role contradicts its own report is logged once and taken at
its word. Until a worker has answered (`unprobed`), it serves colocated requests only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
import structlog
from beamserve.kvwire.geometry import DEFAULT_GEOMETRY, HASH_SCHEMES, KVGeometry, KVGeometryError
from beamserve.router.types import KV_RECEIVERS, KV_SENDERS, Endpoint, HandoffStyle

log = structlog.get_logger(__name__)

SGLANG_MODES = ("null", "prefill", "decode")


@dataclass(frozen=True, slots=True)
class WorkerFacts:
    """One worker's answers. `disaggregation_mode` is None on the vLLM surface (not reported).
    `page_size` / `sliding_window` / `hash_scheme` / `event_format`: its KV geometry as far as
    it reported it (None: not reported; `geometry` lays them over a default)."""

    api: HandoffStyle
    max_model_len: int | None = None
    disaggregation_mode: str | None = None
    bootstrap_port: int | None = None
    page_size: int | None = None
    served_models: tuple[str, ...] = ()
    sliding_window: int | None = None
    hash_scheme: str | None = None
    event_format: str | None = None
    prefix_caching: bool | None = None  # None: not reported (assumed to cache)
    step_budget: int | None = None  # tokens per engine step; None: not reported

    def geometry(self, default: KVGeometry = DEFAULT_GEOMETRY) -> KVGeometry | None:
        """`default` with what the worker reported laid over it (the SGLang surface hashes and
        publishes SGLang's way unless it says otherwise); None when it reported nothing (and
        `default` applies as is). A report out of range is ignored, with a warning."""
        sglang = self.api == "sglang"
        reported: dict[str, Any] = {}
        if self.page_size is not None:
            reported["block_size"] = self.page_size
        if self.sliding_window is not None:
            reported["sliding_window"] = self.sliding_window
        scheme = self.hash_scheme or ("sglang" if sglang else None)
        if scheme is not None:
            reported["hash_scheme"] = scheme
        events = self.event_format or ("sglang" if sglang else None)
        if events is not None:
            reported["event_format"] = events
        if not reported:
            return None
        try:
            return default.with_(**reported)
        except KVGeometryError as exc:
            log.warning("worker.geometry_invalid", reported=reported, error=str(exc))
            return None


def _scheme(value: Any) -> str | None:
    return value if isinstance(value, str) and value in HASH_SCHEMES else None


def _window(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


def _positive_int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return None
    try:
        n = int(value)
    except ValueError:
        return None
    return n if n > 0 else None


def facts_from(
    models: Mapping[str, Any] | None, server_info: Mapping[str, Any] | None
) -> WorkerFacts:
    """Parse `/v1/models` and `/server_info` answers (None: the endpoint did not answer)."""
    data = models.get("data") if isinstance(models, Mapping) else None
    entries = [m for m in data if isinstance(m, Mapping)] if isinstance(data, list) else []
    lens = [n for m in entries if (n := _positive_int(m.get("max_model_len"))) is not None]
    served = tuple(str(m["id"]) for m in entries if isinstance(m.get("id"), str))
    # The KV geometry: beamserve's workers add it to their model entry (and to /server_info).
    first: Mapping[str, Any] = entries[0] if entries else {}
    info: Mapping[str, Any] = server_info if isinstance(server_info, Mapping) else {}

    def reported(key: str) -> Any:
        return info[key] if info.get(key) is not None else first.get(key)

    window = _window(reported("sliding_window"))
    scheme = _scheme(reported("kv_hash_scheme"))
    events = _scheme(reported("kv_event_format"))
    block_size = _positive_int(first.get("block_size"))
    caching = _prefix_caching(reported("prefix_caching"), info.get("disable_radix_cache"))
    budget = _positive_int(reported("max_num_batched_tokens"))
    if isinstance(server_info, Mapping) and "disaggregation_mode" in server_info:
        mode = str(server_info.get("disaggregation_mode") or "null")
        context = _positive_int(server_info.get("context_length"))
        return WorkerFacts(
            api="sglang",
            max_model_len=min(lens) if lens else context,
            disaggregation_mode=mode if mode in SGLANG_MODES else "null",
            bootstrap_port=_positive_int(server_info.get("disaggregation_bootstrap_port")),
            page_size=_positive_int(server_info.get("page_size")) or block_size,
            served_models=served,
            sliding_window=window,
            hash_scheme=scheme,
            event_format=events,
            prefix_caching=caching,
            step_budget=_positive_int(server_info.get("chunked_prefill_size")) or budget,
        )
    return WorkerFacts(
        api="vllm",
        max_model_len=min(lens) if lens else None,
        page_size=block_size,
        served_models=served,
        sliding_window=window,
        hash_scheme=scheme,
        event_format=events,
        prefix_caching=caching,
        step_budget=budget,
    )


def _prefix_caching(reported: Any, disable_radix_cache: Any) -> bool | None:
    """beamserve's workers say `prefix_caching`; SGLang's `/server_info` says
    `disable_radix_cache` (its `--disable-radix-cache`, usual on decode servers)."""
    if isinstance(reported, bool):
        return reported
    if isinstance(disable_radix_cache, bool):
        return not disable_radix_cache
    return None


def apply_facts(
    ep: Endpoint, facts: WorkerFacts | None, default: KVGeometry = DEFAULT_GEOMETRY
) -> Endpoint:
    """`ep` with what the worker reported (table in the module docstring), its geometry laid
    over `default` (the router's flags); without facts (not probed yet) it may not take part
    in a KV handoff."""
    if facts is None:
        return replace(ep, kv_send=False, kv_receive=False)
    if facts.api == "sglang":
        mode = facts.disaggregation_mode
        send = mode == "prefill" and facts.bootstrap_port is not None
        receive = mode == "decode"
        wanted = {"prefill": "prefill", "decode": "decode", "both": "null"}[ep.role]
        if mode != wanted:
            log.warning(
                "worker.role_mismatch",
                worker=ep.id,
                discovery_role=ep.role,
                reported_disaggregation_mode=mode,
                fix="the worker's own report wins; relabel it or restart it with the intended "
                "--disaggregation-mode",
            )
    else:
        kv_role = ep.label("kv_role")
        send = ep.role == "prefill" or kv_role in KV_SENDERS
        receive = ep.role == "decode" or kv_role in KV_RECEIVERS
    return replace(
        ep,
        api=facts.api,
        kv_send=send,
        kv_receive=receive,
        bootstrap_port=facts.bootstrap_port,
        max_model_len=facts.max_model_len,
        geometry=facts.geometry(default),
        prefix_caching=facts.prefix_caching,
        step_budget=facts.step_budget,
    )


async def _get_json(
    http: aiohttp.ClientSession, url: str, timeout: aiohttp.ClientTimeout
) -> Mapping[str, Any] | None:
    async with http.get(url, timeout=timeout) as r:
        if r.status != 200:
            return None
        try:
            value = await r.json(content_type=None)
        except ValueError:
            return None
    return value if isinstance(value, Mapping) else None


async def probe_facts(
    http: aiohttp.ClientSession, ep: Endpoint, timeout: float = 2.0
) -> WorkerFacts | None:
    """Ask one worker (None: unreachable, or `/v1/models` did not answer — try again later)."""
    t = aiohttp.ClientTimeout(total=timeout)
    try:
        models = await _get_json(http, ep.url + "/v1/models", t)
        if models is None:
            return None
        info = await _get_json(http, ep.url + "/server_info", t)
    except (TimeoutError, aiohttp.ClientError):
        return None
    return facts_from(models, info)


class FactsBook:
    """Facts per worker (keyed by id and URL) and the enriched endpoint list.

    `endpoints(discovered)` is called on every request: it rebuilds only when the discovered
    list or the facts changed. `default`: the router's default KV geometry (its flags); a
    worker whose reported geometry differs is logged once (per worker and report)."""

    def __init__(self, default: KVGeometry = DEFAULT_GEOMETRY) -> None:
        self.default = default
        self._mismatch_logged: dict[str, KVGeometry] = {}
        self._event_windows: dict[str, int] = {}
        self._facts: dict[tuple[str, str], WorkerFacts] = {}
        self._source: Sequence[Endpoint] | None = None
        self._version = 0
        self._built_version = -1
        self._enriched: list[Endpoint] = []

    def get(self, ep: Endpoint) -> WorkerFacts | None:
        return self._facts.get((ep.id, ep.url))

    def learned(self, ep: Endpoint, facts: WorkerFacts) -> None:
        key = (ep.id, ep.url)
        if self._facts.get(key) != facts:
            self._facts[key] = facts
            self._version += 1
            log.info("worker.facts", worker=ep.id, **_fields(facts))
            self._check_geometry(ep, facts)

    def _check_geometry(self, ep: Endpoint, facts: WorkerFacts) -> None:
        g = facts.geometry(self.default)
        if g is None or g == self.default or self._mismatch_logged.get(ep.id) == g:
            return
        self._mismatch_logged[ep.id] = g
        log.warning(
            "worker.geometry_mismatch",
            worker=ep.id,
            reported=str(g),
            flags=str(self.default),
            differs={k: {"worker": w, "flags": f} for k, (w, f) in g.differs(self.default).items()},
            fix="the worker's own report wins for this worker; set --block-size / "
            "--sliding-window / --hash-scheme to match if the flags were meant for it",
        )

    def forget(self, keep: Iterable[Endpoint]) -> None:
        live = {(e.id, e.url) for e in keep}
        for key in [k for k in self._facts if k not in live]:
            del self._facts[key]
            self._version += 1

    def event_windows(self, windows: Mapping[str, int]) -> None:
        """The sliding windows the workers' KV events carried (`PrefixIndex.reported_windows`):
        laid over the geometry of a worker whose HTTP answers named no window."""
        changed = {k: v for k, v in windows.items() if self._event_windows.get(k) != v}
        if changed:
            self._event_windows.update(changed)
            self._version += 1

    def endpoints(self, discovered: Sequence[Endpoint]) -> list[Endpoint]:
        if discovered is not self._source or self._built_version != self._version:
            self._enriched = [self._enrich(e) for e in discovered]
            self._source, self._built_version = discovered, self._version
        return self._enriched

    def _enrich(self, discovered: Endpoint) -> Endpoint:
        facts = self.get(discovered)
        ep = apply_facts(discovered, facts, self.default)
        window = self._event_windows.get(ep.id)
        if window is None or (facts is not None and facts.sliding_window is not None):
            return ep
        g = ep.geometry or self.default
        if g.sliding_window == window:
            return ep
        if ep.id not in self._mismatch_logged:
            self._mismatch_logged[ep.id] = g
            log.warning(
                "worker.geometry_mismatch",
                worker=ep.id,
                reported=f"kv_cache_spec_sliding_window {window} (KV events)",
                flags=str(g),
                fix="the worker's events win for this worker; set --sliding-window to match",
            )
        return replace(ep, geometry=g.with_(sliding_window=window))

    async def probe(
        self,
        http: aiohttp.ClientSession,
        endpoints: Iterable[Endpoint],
        *,
        only_missing: bool = True,
    ) -> None:
        todo = [e for e in endpoints if not only_missing or self.get(e) is None]
        found = await asyncio.gather(*(probe_facts(http, e) for e in todo))
        for ep, facts in zip(todo, found, strict=True):
            if facts is not None:
                self.learned(ep, facts)


def _fields(f: WorkerFacts) -> dict[str, Any]:
    return {
        "api": f.api,
        "max_model_len": f.max_model_len,
        "disaggregation_mode": f.disaggregation_mode,
        "bootstrap_port": f.bootstrap_port,
        "page_size": f.page_size,
        "sliding_window": f.sliding_window,
        "hash_scheme": f.hash_scheme,
        "event_format": f.event_format,
        "prefix_caching": f.prefix_caching,
        "step_budget": f.step_budget,
    }
