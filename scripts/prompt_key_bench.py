"""Hand-run measurement of `PromptHasher.key` on continuing agentic turns (not a test).

    .venv/bin/python scripts/prompt_key_bench.py [--tokenizer DIR] [--tokens 30000 120000]

Builds a synthetic coding-agent conversation (system prompt, user turns, assistant turns with
tool calls, long tool results) until it reaches the target size, then times, for each of
`--turns` continuing turns (the previous prompt + an assistant message and a tool result):
`from scratch` (render, encode, hash every block, as before the incremental caches) and
`key()` on a hasher that has seen the previous turn. Prints ms (median, p90) per mode.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from beamserve.kvwire.hashing import block_hashes, hash_blocks_sglang
from beamserve.router.api.convert import UpstreamCall
from beamserve.router.prompt import PromptHasher

WORDS = (  # noqa: SIM905 (one readable block)
    "def class return import self value error file test build run the of and to in is for "
    "on that with as it be this by are from or at an not have was we you can if all but "
    "config router worker prompt token block hash cache index session request response "
    "stream async await yield lambda None True False print len range dict list str int"
).split()
PUNCT = [*"()[]{}:;,.=+-*/<>_'\"#@!?%&|", "\n", "\n    ", "  "]


def text(rng: random.Random, n_words: int) -> str:
    out: list[str] = []
    for _ in range(n_words):
        out.append(rng.choice(WORDS))
        r = rng.random()
        if r < 0.35:
            out.append(rng.choice(PUNCT))
        elif r < 0.4:
            out.append(str(rng.randrange(100000)))
        elif r < 0.42:
            out.append(rng.choice(["é", "→", "日本語", "🙂", "<|im", "|>"]))
        out.append(" ")
    return "".join(out)


def turn_messages(rng: random.Random, i: int) -> list[dict[str, Any]]:
    call = {
        "id": f"call_{i}",
        "type": "function",
        "function": {"name": "bash", "arguments": '{"cmd": "' + text(rng, 8) + '"}'},
    }
    return [
        {"role": "assistant", "content": text(rng, 40), "tool_calls": [call]},
        {
            "role": "tool",
            "tool_call_id": f"call_{i}",
            "content": text(rng, rng.randrange(150, 450)),
        },
    ]


def call_of(messages: list[dict[str, Any]]) -> UpstreamCall:
    return UpstreamCall(
        path="/v1/chat/completions",
        body={"messages": messages},
        stream=True,
        client_api="chat",
        model="m",
        messages_for_session=list(messages),
    )


def scratch(h: PromptHasher, call: UpstreamCall) -> tuple[tuple[int, ...], tuple[int, ...]]:
    ids = h.codec.encode(h.codec.render(call.messages_for_session, call.body.get("tools")))
    if h.scheme == "sglang":
        hs = tuple(b.event_id for b in hash_blocks_sglang(ids, h.block_size, include_partial=False))
    else:
        hs = tuple(block_hashes(ids, h.block_size))
    return tuple(ids), hs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--scheme", default="vllm", choices=["vllm", "sglang"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[30_000, 120_000])
    ap.add_argument("--turns", type=int, default=15)
    args = ap.parse_args()
    for target in args.tokens:
        rng = random.Random(target)
        h = PromptHasher(args.tokenizer, scheme=args.scheme)
        msgs: list[dict[str, Any]] = [
            {"role": "system", "content": text(rng, 1500)},
            {"role": "user", "content": text(rng, 60)},
        ]
        i = 0
        while len(h.codec.encode(h.codec.render(msgs))) < target:
            msgs += turn_messages(rng, i)
            i += 1
        h.key(call_of(msgs))  # the previous turn: the hasher has seen it
        t_scratch: list[float] = []
        t_key: list[float] = []
        n_tokens = 0
        for _ in range(args.turns):
            msgs = msgs + turn_messages(rng, i)
            i += 1
            call = call_of(msgs)
            t0 = time.perf_counter()
            ids, hs = scratch(h, call)
            t1 = time.perf_counter()
            key = h.key(call)
            t2 = time.perf_counter()
            assert key.token_ids == ids and key.block_hashes == hs, "mismatch"
            t_scratch.append((t1 - t0) * 1e3)
            t_key.append((t2 - t1) * 1e3)
            n_tokens = len(ids)
        mode = "precise" if args.tokenizer else "approx"
        for name, ts in (("from scratch", t_scratch), ("key() warm", t_key)):
            ts.sort()
            print(
                f"{mode:8s} {args.scheme:6s} ~{n_tokens:>7,} tokens  {name:13s} "
                f"p50 {statistics.median(ts):7.2f} ms  p90 {ts[int(len(ts) * 0.9)]:7.2f} ms"
            )


if __name__ == "__main__":
    main()
