"""Filter `kv-compat`: keep only workers whose KV can pair with a given worker (or pin).

Formula: keep ``v`` iff ``v.endpoint.revision == revision`` (when `revision` is set) and
``v.endpoint.kv_layout == kv_layout`` (when `kv_layout` is set). `pairs_with(prefill, decode)`
is the handoff test between two endpoints: equal `revision` and `kv_layout`, and the two can
actually hand KV over (sender/receiver, same handoff style, bootstrap port known).

Intent: a prefill worker and a decode worker exchange KV only when both run the same model
revision and the same KV layout (page size, dtype, cache layout). During a rolling update two
revisions serve side by side (llm-d#499): pairing across them would move KV the decode side
cannot read. The disaggregation step binds this filter to the chosen decode worker
(`KVCompatFilter.matching(decode)`); in configuration it pins a revision/layout.

Data: `Endpoint.revision`, `Endpoint.kv_layout`.

| parameter | default | meaning |
|---|---|---|
| `revision` | ``None`` | keep only this revision (``None``: any) |
| `kv_layout` | ``None`` | keep only this KV layout (``None``: any) |

Config example::

    filters:
      - type: kv-compat
        params: {revision: "beam-1.0-r7"}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from beamserve.router.policy.base import PluginParams, parse_params
from beamserve.router.types import Endpoint, RouteRequest, WorkerView

TYPE = "kv-compat"


def pairs_with(prefill: Endpoint, decode: Endpoint) -> bool:
    """True when `prefill`'s KV can be handed to `decode`: `prefill` can send and `decode`
    can receive a handoff (what each worker reported, else its role and labels), both speak
    the same handoff style, an SGLang-style sender has a known bootstrap port, and both run
    the same revision and KV layout."""
    if not (prefill.sends_kv and decode.receives_kv and prefill.id != decode.id):
        return False
    style = prefill.handoff_style
    if style != decode.handoff_style:
        return False
    if style == "sglang" and bootstrap_port_of(prefill) is None:
        return False
    return prefill.revision == decode.revision and prefill.kv_layout == decode.kv_layout


def bootstrap_port_of(ep: Endpoint) -> int | None:
    """An SGLang prefill worker's bootstrap port: reported, else the `bootstrap_port` label."""
    if ep.bootstrap_port is not None:
        return ep.bootstrap_port
    label = ep.label("bootstrap_port")
    return int(label) if label is not None and label.isdigit() else None


class KVCompatParams(PluginParams):
    revision: str | None = None
    kv_layout: str | None = None


class KVCompatFilter:
    """Keeps the workers with the given revision / KV layout, in order."""

    type = TYPE

    def __init__(self, revision: str | None = None, kv_layout: str | None = None) -> None:
        self.revision = revision
        self.kv_layout = kv_layout

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None = None) -> KVCompatFilter:
        p = parse_params(KVCompatParams, params, f"filter {TYPE!r}")
        return cls(p.revision, p.kv_layout)

    @classmethod
    def matching(cls, endpoint: Endpoint) -> KVCompatFilter:
        """The filter keeping exactly the workers that pair with `endpoint`."""
        return cls(endpoint.revision, endpoint.kv_layout)

    def filter(self, request: RouteRequest, views: Sequence[WorkerView]) -> tuple[WorkerView, ...]:
        return tuple(
            v
            for v in views
            if (self.revision is None or v.endpoint.revision == self.revision)
            and (self.kv_layout is None or v.endpoint.kv_layout == self.kv_layout)
        )
