"""`beamserve worker --max-num-batched-tokens`: the sim engine's per-step token budget (vLLM's
flag of that name, SGLang's `--chunked-prefill-size`), reported where the engines report it,
and refused with the fix when it cannot work."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
from beamserve.workers.sim.profiles import get_profile

from tests.conftest import SpawnWorker

H200 = "h200-bf16-tp8"


def _worker(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(Path(sys.executable).parent / "beamserve"), "worker", "--port", "0", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_budget_reaches_the_engine_and_its_reports(spawn_worker: SpawnWorker) -> None:
    small = spawn_worker("--api", "sglang", "--profile", H200, "--max-num-batched-tokens", "2048")
    default = spawn_worker("--api", "sglang", "--profile", H200)
    assert small.info["chunked_prefill_size"] == 2048
    assert default.info["chunked_prefill_size"] == get_profile(H200).max_batched_tokens == 8192
    for w, want in ((small, 2048), (default, 8192)):
        assert httpx.get(w.url + "/get_server_info").json()["chunked_prefill_size"] == want


def test_a_long_prompt_is_prefilled_in_budget_sized_chunks(spawn_worker: SpawnWorker) -> None:
    """A prefill step is compute-bound from ≈ 1,400 tokens on (h200-bf16-tp8), so 8,192-token
    and 2,048-token chunks take a long prompt alike; 256-token chunks are memory-bound steps,
    ≈ 5.5 × the time to the first token. The sim runs 20 × faster than the wall clock; the
    ratio of the two workers' TTFT shows the step count, not the host."""
    text = " ".join(f"w{i:05d}" for i in range(8000))  # ≈ 16K tokens under the sim's codec
    ttft = {}
    for budget in ("8192", "256"):
        w = spawn_worker("--profile", H200, "--speed", "20", "--max-num-batched-tokens", budget)
        body = {"model": "beam", "prompt": text, "max_tokens": 1}
        usage = httpx.post(w.url + "/v1/completions", json=body, timeout=60).json()["usage"]
        assert usage["prompt_tokens"] > 12_000
        metrics = httpx.get(w.url + "/metrics").text.splitlines()
        line = next(x for x in metrics if x.startswith("vllm:time_to_first_token_seconds_sum"))
        ttft[budget] = float(line.split()[-1])
    assert ttft["256"] > 2.5 * ttft["8192"], ttft


def test_a_budget_that_cannot_hold_the_decode_batch_is_refused_with_the_fix() -> None:
    r = _worker("--profile", H200, "--max-num-batched-tokens", "16")
    assert r.returncode == 2
    assert "--max-num-batched-tokens" in r.stderr and "raise it to at least" in r.stderr


def test_the_flag_is_the_sims_and_the_ref_engine_says_so(tmp_path: Path) -> None:
    r = _worker("--engine", "ref", "--model", str(tmp_path), "--max-num-batched-tokens", "2048")
    assert r.returncode == 2
    assert "--max-num-batched-tokens is a sim setting" in r.stderr
