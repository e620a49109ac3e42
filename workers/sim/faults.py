"""Fault injection: what can be made to go wrong in a simulated engine, and when.

`FaultConfig` is the declarative part (from a config file, or the admin endpoint's JSON via
`FaultConfig.from_dict`, which rejects unknown keys); `FaultInjector` is its live state inside
one engine (counters such as "the next N requests fail" count down; a seeded RNG decides the
probabilistic faults, so a replay with the same seed fails the same requests).
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Any, Literal


class FaultConfigError(ValueError):
    """A fault setting is invalid; the message names the key and its valid range."""


@dataclass(frozen=True)
class FaultConfig:
    """All faults off by default.

    - `slowdown`: every step takes this many times longer (≥ 1 slows, < 1 speeds up; > 0);
    - `fail_probability`: each arriving request fails at once with this probability;
    - `fail_next`: the next N arriving requests fail at once;
    - `die_after_tokens`: the engine dies once it has emitted this many more output tokens
      (mid-stream: running requests end with an error, new ones are refused until `revive`);
    - `drop_kv_events_probability`: each KV event batch is dropped with this probability;
    - `drop_next_kv_batches`: the next N KV event batches are dropped;
    - `kv_event_delay_s`: KV event batches are delivered this many seconds late (in order);
    - `seed`: seeds the RNG of the probabilistic faults.
    """

    slowdown: float = 1.0
    fail_probability: float = 0.0
    fail_next: int = 0
    die_after_tokens: int | None = None
    drop_kv_events_probability: float = 0.0
    drop_next_kv_batches: int = 0
    kv_event_delay_s: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.slowdown > 0:
            raise FaultConfigError(f"slowdown: must be > 0, got {self.slowdown}")
        for name in ("fail_probability", "drop_kv_events_probability"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise FaultConfigError(f"{name}: must lie in [0, 1], got {getattr(self, name)}")
        for name in ("fail_next", "drop_next_kv_batches"):
            if getattr(self, name) < 0:
                raise FaultConfigError(f"{name}: must be ≥ 0")
        if self.die_after_tokens is not None and self.die_after_tokens < 0:
            raise FaultConfigError("die_after_tokens: must be ≥ 0 or null")
        if self.kv_event_delay_s < 0:
            raise FaultConfigError("kv_event_delay_s: must be ≥ 0")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> FaultConfig:
        """Strict parse: unknown keys raise `FaultConfigError` naming the valid ones."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - names)
        if unknown:
            raise FaultConfigError(f"unknown fault settings {unknown}; valid: {sorted(names)}")
        try:
            return cls(**raw)
        except TypeError as exc:  # pragma: no cover - dataclass arity errors
            raise FaultConfigError(str(exc)) from None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


KVBatchFate = Literal["deliver", "drop"]


class FaultInjector:
    """The live fault state of one engine. Not thread-safe (the engine is single-threaded)."""

    def __init__(self, config: FaultConfig | None = None) -> None:
        self.set(config or FaultConfig())

    def set(self, config: FaultConfig) -> None:
        """Replace every fault; counters restart from the new config."""
        self._config = config
        self._rng = random.Random(config.seed)
        self._fail_next = config.fail_next
        self._drop_next = config.drop_next_kv_batches
        self._tokens_left = config.die_after_tokens

    @property
    def config(self) -> FaultConfig:
        """The current faults, counters as they stand now."""
        return dataclasses.replace(
            self._config,
            fail_next=self._fail_next,
            drop_next_kv_batches=self._drop_next,
            die_after_tokens=self._tokens_left,
        )

    @property
    def slowdown(self) -> float:
        return self._config.slowdown

    @property
    def kv_event_delay_s(self) -> float:
        return self._config.kv_event_delay_s

    def request_fails(self) -> bool:
        """Decide for one arriving request."""
        if self._fail_next > 0:
            self._fail_next -= 1
            return True
        p = self._config.fail_probability
        return p > 0 and self._rng.random() < p

    def kv_batch_fate(self) -> KVBatchFate:
        """Decide for one KV event batch."""
        if self._drop_next > 0:
            self._drop_next -= 1
            return "drop"
        p = self._config.drop_kv_events_probability
        return "drop" if p > 0 and self._rng.random() < p else "deliver"

    def token_allowance(self) -> int | None:
        """How many more tokens may be emitted before the engine dies (None = unlimited)."""
        return self._tokens_left

    def tokens_emitted(self, n: int) -> bool:
        """Count `n` emitted tokens; True when the engine must die now."""
        if self._tokens_left is None:
            return False
        self._tokens_left = max(0, self._tokens_left - n)
        return self._tokens_left == 0
