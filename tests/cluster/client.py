"""The clients of the cluster tier, run inside the cluster's network namespace (nsenter) by
tests/cluster/test_cluster.py. Prints one JSON object on stdout.

  client.py turns URL SESSION   openai SDK, two streamed turns of one conversation (the first
                                long enough to disaggregate), then anthropic SDK, streamed
  client.py loop URL SECONDS    streamed requests back to back for SECONDS; each one's outcome
                                and duration (for "no request hangs" while a pod is killed)
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import anthropic
import httpx
import openai

SYSTEM = "You are a careful coding agent. " + " ".join(
    f"Rule {i}: read the file before you change it, and say which lines you touched."
    for i in range(60)
)


def route_of(headers: httpx.Headers) -> dict[str, str]:
    raw = headers.get("x-beamserve-route", "")
    return dict(p.strip().split("=", 1) for p in raw.split(";") if "=" in p)


def turns(url: str, session: str) -> dict[str, Any]:
    oa = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    msgs: list[Any] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Why does main print twice?"},
    ]
    out: dict[str, Any] = {"openai": []}
    for turn in range(2):
        raw = oa.chat.completions.with_raw_response.create(
            model="beam", messages=msgs, max_tokens=6, stream=True,
            stream_options={"include_usage": True}, extra_headers={"x-session-id": session},
        )  # fmt: skip
        chunks = list(raw.parse())
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
        details = usage.prompt_tokens_details if usage else None
        out["openai"].append(
            {
                "route": route_of(raw.headers),
                "chunks": len(chunks),
                "text": text,
                "prompt_tokens": usage.prompt_tokens if usage else None,
                "completion_tokens": usage.completion_tokens if usage else None,
                "cached_tokens": (details.cached_tokens if details else None),
            }
        )
        msgs += [{"role": "assistant", "content": text},
                 {"role": "user", "content": f"and step {turn + 1}?"}]  # fmt: skip
    ac = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=60)
    events = []
    with ac.messages.stream(
        model="beam", max_tokens=5, system=SYSTEM,
        messages=[{"role": "user", "content": "Summarize the rules."}],
        extra_headers={"x-session-id": session + "-anthropic"},
    ) as s:  # fmt: skip
        for ev in s:
            events.append(ev.type)
        final = s.get_final_message()
        out["anthropic"] = {
            "route": route_of(s.response.headers),
            "events": events,
            "text": "".join(b.text for b in final.content if b.type == "text"),
            "output_tokens": final.usage.output_tokens,
        }
    return out


LONG = " ".join(f"line {i}: the quick brown fox jumps over the lazy dog." for i in range(40))


def loop(url: str, seconds: float) -> dict[str, Any]:
    oa = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=30)
    results = []
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        t0 = time.monotonic()
        try:
            raw = oa.chat.completions.with_raw_response.create(
                model="beam", messages=[{"role": "user", "content": f"request {i}: {LONG}"}],
                max_tokens=8, stream=True, extra_headers={"x-session-id": f"loop-{i}"},
            )  # fmt: skip
            n = sum(1 for _ in raw.parse())
            route = route_of(raw.headers)
            results.append(
                {"ok": True, "s": time.monotonic() - t0, "chunks": n,
                 "decode": route.get("decode"), "prefill": route.get("prefill")}
            )  # fmt: skip
        except Exception as e:  # every failure counts, with its type: the test reads them
            results.append({"ok": False, "s": time.monotonic() - t0, "error": repr(e)[:200]})
        i += 1
        time.sleep(0.2)
    return {"results": results}


def main() -> None:
    mode, url, arg = sys.argv[1], sys.argv[2], sys.argv[3]
    result = turns(url, arg) if mode == "turns" else loop(url, float(arg))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
