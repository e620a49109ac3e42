"""`beamserve check disagg --engine ref`: disaggregated greedy decoding == colocated, exactly.

For each TP pair (prefill TP : decode TP), a prefill worker process and a decode worker
process serve every request: prefill computes the prompt's KV and first token into its TP
shards and publishes it; decode pulls it into its own TP layout over NIXL or Mooncake through
the HTTP handshake, rebuilds the cache and decodes. The reference is computed separately, in
this process, by one model instance in one uninterrupted greedy loop (`RefBeam.generate`).

A pair passes when every request's tokens equal the reference's, every request's KV came by
transfer (no recompute fallback), and the bytes moved equal `bytes_minimum` of the decode
layout. The requests are `prompts` chat-templated prompts plus one follow-up turn of the first
conversation (prompt + its answer + a new user message), which the prefill worker's prefix
cache must resume from cached KV (`reused` > 0).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from beamserve.workers.ref.corpus import FOLLOW_UP, SYSTEM_PROMPT, USER_TURNS
from beamserve.workers.ref.worker import (
    DecodeResult,
    PoolSpec,
    PrefillResult,
    WorkerProcess,
    WorkerSpec,
    close_all,
)


@dataclass(frozen=True)
class Case:
    """One request and the colocated reference's answer to it."""

    name: str
    token_ids: tuple[int, ...]
    expected: tuple[int, ...]
    follow_up: bool = False


@dataclass
class PairResult:
    backend: str
    prefill_tp: int
    decode_tp: int
    requests: int = 0
    equal: int = 0
    fallbacks: int = 0
    reused_tokens: int = 0  # prompt tokens of follow-up turns resumed from the prefix cache
    follow_up_tokens: int = 0
    bytes_moved: int = 0
    bytes_minimum: int = 0
    seconds: float = 0.0  # serving the requests (prefill + transfer + decode), no start-up
    startup_s: float = 0.0
    problems: list[str] = field(default_factory=list)

    @property
    def pair(self) -> str:
        return f"{self.prefill_tp}:{self.decode_tp}"

    @property
    def ok(self) -> bool:
        return (
            self.requests > 0
            and self.equal == self.requests
            and self.fallbacks == 0
            and self.bytes_moved == self.bytes_minimum
            and (self.follow_up_tokens == 0 or self.reused_tokens > 0)
            and not self.problems
        )


def build_cases(
    model_dir: str | Path, prompts: int, tokens: int, system_prompt: str | None = SYSTEM_PROMPT
) -> list[Case]:
    """`prompts` chat prompts (cycling through `corpus.USER_TURNS`) plus a follow-up turn of
    the first, each with the colocated reference's `tokens` greedy tokens."""
    from beamserve.workers.ref.engine import RefBeam, chat_prompt, load_tokenizer

    tok = load_tokenizer(model_dir)
    engine = RefBeam(model_dir)
    cases = []
    for i in range(prompts):
        system = [{"role": "system", "content": system_prompt}] if system_prompt else []
        user = [{"role": "user", "content": USER_TURNS[i % len(USER_TURNS)]}]
        ids = chat_prompt(tok, system + user)
        cases.append(Case(f"p{i}", tuple(ids), tuple(engine.generate(ids, tokens))))
    if cases:
        # The next turn as an engine sees it: the previous prompt and answer, token for token,
        # then the closing of the answer and a new user message.
        first = cases[0]
        tail = f"<|im_end|>\n<|im_start|>user\n{FOLLOW_UP}<|im_end|>\n<|im_start|>assistant\n"
        ids = [*first.token_ids, *first.expected, *tok(tail, add_special_tokens=False)["input_ids"]]
        cases.append(Case("p0-turn2", tuple(ids), tuple(engine.generate(ids, tokens)), True))
    return cases


@contextmanager
def worker_pair(
    model_dir: str | Path, prefill: PoolSpec, decode: PoolSpec, log_dir: Path | None = None
) -> Iterator[tuple[WorkerProcess, WorkerProcess]]:
    """A prefill and a decode worker process, started side by side, closed on exit."""
    tag = uuid.uuid4().hex[:6]
    logs = (
        (str(log_dir / f"prefill-{tag}.log"), str(log_dir / f"decode-{tag}.log"))
        if log_dir
        else (None, None)
    )
    p = WorkerProcess(WorkerSpec("prefill", str(model_dir), prefill, log_path=logs[0]))
    d = WorkerProcess(WorkerSpec("decode", str(model_dir), decode, log_path=logs[1]))
    try:
        p.wait_ready()
        d.wait_ready()
        yield p, d
    finally:
        close_all([p, d])


def run_requests(
    prefill: WorkerProcess,
    decode: WorkerProcess,
    cases: Sequence[Case],
    tokens: int,
    result: PairResult,
    deadline_s: float = 30.0,
) -> list[tuple[Case, PrefillResult, DecodeResult]]:
    """Serve every case through the pair, in order; fold the outcome into `result`."""
    url = prefill.info["url"]
    out = []
    t0 = time.perf_counter()
    for case in cases:
        rid = f"{case.name}-{uuid.uuid4().hex[:8]}"
        pre: PrefillResult = prefill.call("prefill", rid, list(case.token_ids))
        dec: DecodeResult = decode.call(
            "generate", rid, url, list(case.token_ids), pre.first_token, tokens, deadline_s
        )
        out.append((case, pre, dec))
        result.requests += 1
        result.equal += tuple(dec.tokens) == case.expected
        result.fallbacks += dec.source != "transfer"
        result.bytes_moved += dec.bytes_moved
        result.bytes_minimum += dec.bytes_minimum
        if case.follow_up:
            result.reused_tokens += pre.cached_tokens
            result.follow_up_tokens += len(case.token_ids)
        if tuple(dec.tokens) != case.expected:
            result.problems.append(
                f"{case.name}: decoded {dec.tokens}, colocated {list(case.expected)}"
            )
        if dec.error:
            result.problems.append(f"{case.name}: {dec.error}")
    result.seconds = time.perf_counter() - t0
    return out


def run_check(
    model_dir: str | Path,
    pairs: Sequence[tuple[int, int]],
    backend: str,
    cases: Sequence[Case],
    tokens: int,
    reuse_workers: bool = False,
    deadline_s: float = 30.0,
    log_dir: Path | None = None,
    on_result: Callable[[PairResult], None] | None = None,
) -> list[PairResult]:
    """Run every pair; fresh worker processes per pair unless `reuse_workers` (then one
    prefill and one decode process, re-sharded per pair: fresh pools, agents, handshake)."""
    results = []
    if reuse_workers and pairs:
        t0 = time.perf_counter()
        p0, d0 = pairs[0]
        with worker_pair(model_dir, PoolSpec(p0, backend), PoolSpec(d0, backend), log_dir) as (
            pw,
            dw,
        ):
            startup = time.perf_counter() - t0
            for i, (p, d) in enumerate(pairs):
                t1 = time.perf_counter()
                if i:
                    pw.info["url"] = pw.call("reconfigure", PoolSpec(p, backend))
                    dw.call("reconfigure", PoolSpec(d, backend))
                r = PairResult(backend, p, d, startup_s=startup + time.perf_counter() - t1)
                startup = 0.0
                _guarded(r, partial(run_requests, pw, dw, cases, tokens, r, deadline_s))
                results.append(r)
                if on_result:
                    on_result(r)
        return results
    for p, d in pairs:
        r = PairResult(backend, p, d)
        t0 = time.perf_counter()

        def one(r: PairResult = r, p: int = p, d: int = d, t0: float = t0) -> None:
            with worker_pair(model_dir, PoolSpec(p, backend), PoolSpec(d, backend), log_dir) as (
                pw,
                dw,
            ):
                r.startup_s = time.perf_counter() - t0
                run_requests(pw, dw, cases, tokens, r, deadline_s)

        _guarded(r, one)
        results.append(r)
        if on_result:
            on_result(r)
    return results


def check_pairs(model_dir: str | Path, pairs: Sequence[tuple[int, int]]) -> None:
    """Refuse TP pairs the model or the planner cannot serve, before any process starts
    (raises `TopologyError` / `TransferPlanError` naming the fix)."""
    from beamserve.kv_transfer.model import BeamModelConfig
    from beamserve.kv_transfer.plan import check_pair

    model = BeamModelConfig.from_checkpoint(model_dir)
    for p, d in pairs:
        check_pair(PoolSpec(p).pool_layout(model), PoolSpec(d).pool_layout(model))


def _guarded(result: PairResult, fn: Callable[[], Any]) -> None:
    try:
        fn()
    except Exception as exc:  # a failed pair is reported, the others still run
        result.problems.append(f"{type(exc).__name__}: {exc}")
