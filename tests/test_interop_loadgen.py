"""Interop: an external load generator from PyPI, NVIDIA's aiperf (pinned in
router/bench/aiperf.txt, its own venv `.venv-aiperf`, `make aiperf`), replays a slice of the
bundled Mooncake trace against the local disaggregated stack of tests/test_interop_sdk.py, and
what it measured is checked against what the router counted.

aiperf rebuilds each prompt from the trace's `hash_ids` (one block of tokens per id, from the
tokenizer it is given: the tiny checkpoint's, so nothing is downloaded), so requests that share
hash ids share a prompt prefix, and the router's prefix index must see those hits. Why aiperf
and not guidellm or inference-perf: docs/bench/README.md.

Not in plain `make test` unless `.venv-aiperf` exists (`make aiperf`, ≈ 1.2 GB, ≈ 7 min): the
module is marked `loadgen`; `make test-interop` runs it.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.test_interop_sdk import Stack, stack  # noqa: F401  (the module-scoped fixture)

pytestmark = pytest.mark.loadgen

REPO = Path(__file__).resolve().parents[1]
AIPERF = REPO / ".venv-aiperf" / "bin" / "aiperf"
MOONCAKE = REPO / "data" / "traces" / "mooncake" / "conversation_trace.jsonl"
REQUESTS = 24
BLOCK = 64  # tokens per hash id (the trace's are 512): one KV block of the workers, so a
# shared hash id is a shared block the router can hit


def metric(url: str, name: str, **labels: str) -> float:
    total = 0.0
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=5).text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def trace_slice(path: Path, n: int) -> list[dict[str, object]]:
    """The first `n` requests of the Mooncake trace (≈ 9 s of arrivals, as recorded: the rows at
    3 s share block 0 with those at 0 s, whose KV is stored by then), lengths scaled to
    `BLOCK`-token blocks, outputs capped at 8 tokens."""
    rows = []
    with MOONCAKE.open() as f:
        for line in f:
            row = json.loads(line)
            ids = row["hash_ids"]
            rows.append({
                "timestamp": row["timestamp"],
                "input_length": (len(ids) - 1) * BLOCK + BLOCK // 2,
                "output_length": max(1, min(8, row["output_length"])),
                "hash_ids": ids,
            })  # fmt: skip
            if len(rows) == n:
                break
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def as_hf_cache(tokenizer_dir: Path, cache: Path, repo: str = "beamserve/beam-tiny") -> str:
    """Lay `tokenizer_dir` out as a Hugging Face hub cache entry and return its repository id.

    aiperf 0.13.0 loads the tokenizer again in its prompt-decoding worker processes with
    HF_HUB_OFFLINE=1 forced, and offline it resolves every name, a local path too, through the
    hub cache (`snapshot_download(local_files_only=True)`): a bare path fails there."""
    revision = "0" * 40
    entry = cache / ("models--" + repo.replace("/", "--"))
    snapshot = entry / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "config", "special_tokens")):
            (snapshot / f.name).symlink_to(f)
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text(revision)
    return repo


def aiperf_argv(router_url: str, trace: Path, tokenizer: str, out: Path) -> list[str]:
    """The command docs/bench/README.md shows (there with the path of a `beamserve up`)."""
    return [
        str(AIPERF), "profile", "--model", "beam", "--url", router_url,
        "--endpoint-type", "chat", "--streaming",
        "--input-file", str(trace), "--custom-dataset-type", "mooncake_trace",
        "--fixed-schedule", "--isl-block-size", str(BLOCK),
        "--tokenizer", tokenizer, "--random-seed", "0",
        "--artifact-dir", str(out), "--ui-type", "none",
        "--no-server-metrics", "--no-gpu-telemetry", "--workers-max", "2",
    ]  # fmt: skip


@pytest.mark.skipif(not AIPERF.exists(), reason="no .venv-aiperf: make aiperf")
def test_aiperf_replays_a_mooncake_slice(
    stack: Stack,  # noqa: F811
    tiny_checkpoint: Path,
    tmp_path: Path,
) -> None:
    rows = trace_slice(tmp_path / "trace.jsonl", REQUESTS)
    before = metric(stack.router_url, "beamserve_router_requests_total")
    hits_before = metric(stack.router_url, "beamserve_router_prefix_hits_total")
    repo = as_hf_cache(tiny_checkpoint, tmp_path / "hub")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(
        aiperf_argv(stack.router_url, tmp_path / "trace.jsonl", repo, tmp_path / "out"),
        capture_output=True,
        text=True,
        timeout=420,
        env=env,
        cwd=tmp_path,
        check=False,
    )
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-3000:])
    summary = json.loads(next((tmp_path / "out").rglob("profile_export_aiperf.json")).read_text())
    records = summary  # one object per metric: {"unit", "avg", "p50", …}
    assert records["request_count"]["avg"] == REQUESTS, records["request_count"]
    assert records.get("error_request_count", {"avg": 0})["avg"] == 0
    assert records["time_to_first_token"]["avg"] > 0
    assert records["output_sequence_length"]["avg"] <= 10  # max_tokens 8, re-tokenized by aiperf
    # the router served every one of them, and saw the prefixes the trace's hash ids share
    assert metric(stack.router_url, "beamserve_router_requests_total") - before >= REQUESTS
    shared = sum(1 for r in rows if r["hash_ids"][0] == 0)  # type: ignore[index]
    assert shared > 1
    hits = metric(stack.router_url, "beamserve_router_prefix_hits_total") - hits_before
    assert hits >= 1, "aiperf's shared hash ids reached the router as shared prefixes"
