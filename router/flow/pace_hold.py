"""The pace hold: a continuing turn's long new part waits briefly while its prefill would slow the
users decoding on its worker under the SLO's speed.

A continuing turn of an agent session goes back to the worker that holds its context (session
affinity; in a P/D pool, `keep_warm_local`), and its new part — a tool's output, a file — is
prefilled there, in the same engine steps as the decodes of every other user on that worker.
Each prefill chunk beside them lengthens their steps; a few thousand tokens can take a decoding
user that was just keeping 20 tokens/s below it, and that user's whole answer misses the SLO.
Most of those users finish within a second or two, so the new part can often wait that long at
no cost to its own TTFT SLO and take their place instead of their speed.

The rule, for a request routed to a worker it prefills on (no prefill worker) whose uncached
tokens are at least `FlowConfig.pace_hold_tokens`::

    for every request r of this router replica streaming from that worker:
        step_s(r)  = (now − r.first_token_at) / (r.tokens − 1)     its own pace so far, when
                                                                   it has streamed 2+ tokens
                                                                   over 0.25 s or more;
                     else the worker's recent pace (`WorkerLoad.decode_itl_s`); else unknown
        deadline   = r.first_token_at + r.max_tokens / user_tok_s  (when it must end to average
                                                                   user_tok_s after its first token)
        slack(r)   = deadline − now − (r.max_tokens − r.tokens) · step_s(r)
    booked = prefill tokens booked on the worker and sent (what waits there to be prefilled)
             + this request's own; other held requests' are left out (each is checked for itself)
    cost   = booked / prefill_tok_s
    hold  ⇔  some r has slack(r) < cost,
             and  now − admitted + own tokens / prefill_tok_s < pace_hold_max_s
                  (waiting on would end its own prefill past pace_hold_max_s after admission)

The router re-checks every 50 ms; the request goes as soon as no user would be pushed under the
speed, or when its time is up. It stays routed and booked meanwhile (its worker chosen, its
tokens on that worker's books), so routing sees it; a client that leaves cancels it as before
any upstream call. Requests whose pace is unknown (no tokens yet, no recent pace on the
worker) are left out, as are answers that came whole (no stream to count). `tokens` counts
the SSE events the router relayed (one per token from vLLM and SGLang; a role-only first
event, a usage or a `[DONE]` event adds one, so a count may be high by a few, which makes the
slack look larger). `max_tokens` is what the request asked for: an answer that ends early had
more slack than reckoned, so the rule errs towards holding. Counted per router replica: each
sees the users it relays.

Metrics: `beamserve_router_pace_holds_total{outcome="released"|"expired"}`,
`beamserve_router_pace_hold_seconds_total`; log event `router.pace_hold`.

| key (`flow`) | default | meaning |
|---|---|---|
| `pace_hold_tokens` | ``null`` | uncached tokens that make a continuing turn one (null: off) |
| `pace_hold_max_s` | ``1.5`` | its own prefill must still end this soon after admission |
| `pace_hold_user_tok_s` | ``20`` | the decoding speed per user it protects |
| `pace_hold_prefill_tok_s` | ``38000`` | one prefill token's cost beside the decodes, as tokens/s |

Config example: ``flow: {pace_hold_tokens: 1024}``.

`prefill_tok_s` is what one prefill token adds to the engine steps beside the decodes: for Beam
on 8 × H200 in bf16 (the sim's `h200-bf16-tp8` profile) 2.5–2.7e-5 s beside 8–32 decoding users,
≈ 38,000 tokens/s (`scripts/knee-search.py`, `step_costs`). Set the deployment's own.

Measured on virtual time first (`scripts/knee-search.py`, 64 agents, 3 seeds: row
`pd-2p2d-legbooks-cont-pace-hold-1024-1.5`, 14.94 r/s of goodput against 14.69 without it),
then over HTTP beside the gateways on the same workers (docs/bench/agentic.md, "The pace hold,
and late first turns oldest first": slow continuing turns 41–51 a run instead of 102–110, the
pool's goodput 1.20–1.24 × the best gateway's instead of 1.16–1.19 ×). Off by default
(`pace_hold_tokens: null`): it trades a continuing turn's TTFT (up to `pace_hold_max_s`) for
the speed of the users beside it; on a colocated pool it gave 1.025 × on virtual time, within
the seeds' range. Only the HTTP front door holds: the ext_proc picker sees no response stream
to count.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# A stream's own pace counts once it has run this long: the first read of a stream often
# brings several tokens at once (those the worker sent while the router was busy), which over
# a few milliseconds would look like a pace no engine has.
OWN_PACE_AFTER_S = 0.25


@dataclass(frozen=True, slots=True)
class PaceHold:
    """The rule's parameters, as `FlowConfig.pace_hold` gives them (its defaults there):
    `min_tokens` uncached tokens make a request a candidate; `max_s`, `user_tok_s`,
    `prefill_tok_s` as in the module docstring; `poll_s` between checks."""

    min_tokens: int
    max_s: float
    user_tok_s: float
    prefill_tok_s: float
    poll_s: float = 0.05


@dataclass(frozen=True, slots=True)
class Decoding:
    """One request streaming from a worker, as the router has relayed it."""

    first_token_at: float
    max_tokens: int
    tokens: int


def slack_s(d: Decoding, now: float, user_tok_s: float, step_s: float | None) -> float | None:
    """Seconds `d` can still lose and end at `user_tok_s` tokens/s after its first token (module
    docstring); None when its pace is unknown."""
    if d.tokens >= 2 and now - d.first_token_at >= OWN_PACE_AFTER_S:
        step_s = (now - d.first_token_at) / (d.tokens - 1)
    if step_s is None:
        return None
    deadline = d.first_token_at + d.max_tokens / user_tok_s
    return deadline - now - max(d.max_tokens - d.tokens, 0) * step_s


def pushed_under(
    decodings: Iterable[Decoding],
    prefill_tokens: int,
    now: float,
    *,
    user_tok_s: float,
    prefill_tok_s: float,
    worker_step_s: float | None = None,
) -> int:
    """How many of `decodings` a prefill of `prefill_tokens` beside them would push under
    `user_tok_s` (module docstring)."""
    cost = max(prefill_tokens, 0) / prefill_tok_s
    n = 0
    for d in decodings:
        s = slack_s(d, now, user_tok_s, worker_step_s)
        if s is not None and s < cost:
            n += 1
    return n
