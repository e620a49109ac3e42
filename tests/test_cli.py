"""The `beamserve` command line, run as a user would (a real subprocess)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import RunBeamserve

FIELDS = {
    "backend",
    "src_tp",
    "dst_tp",
    "tokens",
    "bytes_moved",
    "bytes_minimum",
    "descriptors",
    "plan_ms",
    "seconds",
    "gbps",
    "memcpy_gbps",
    "verified",
}


def test_help_lists_the_commands(beamserve: RunBeamserve) -> None:
    out = beamserve("--help")
    assert out.returncode == 0
    assert "demo" in out.stdout and "bench" in out.stdout
    kv = beamserve("bench", "kv-transfer", "--help")
    assert "--tokens" in kv.stdout and "--pairs" in kv.stdout and "--backend" in kv.stdout


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["bench", "kv-transfer", "--pairs", "8x4"], "PREFILL_TP:DECODE_TP"),
        (["bench", "kv-transfer", "--tokens", "0"], "positive integer"),
        (["bench", "kv-transfer", "--backend", "rdma"], "invalid choice"),
        (["bench", "kv-transfer", "--driver", "gpu"], "invalid choice"),
    ],
)
def test_bad_arguments_name_the_flag(beamserve: RunBeamserve, args: list[str], needle: str) -> None:
    out = beamserve(*args)
    assert out.returncode == 2
    assert needle in out.stderr


@pytest.mark.parametrize(
    ("memory", "backend", "fix"), [("dram", "cma", "--backend shm"), ("vram", "nixl", "cuda_ipc")]
)
def test_the_host_local_driver_on_regions_it_cannot_map_is_refused_naming_the_fix(
    beamserve: RunBeamserve, tmp_path: Path, memory: str, backend: str, fix: str
) -> None:
    out = beamserve(
        "bench", "kv-transfer", "--tokens", "100", "--pairs", "2:1", "--backend", backend,
        "--memory", memory, "--driver", "host_local", "--json", str(tmp_path / "kv.json"),
    )  # fmt: skip
    assert out.returncode == 2
    assert fix in out.stdout
    assert not (tmp_path / "kv.json").exists()


@pytest.mark.integration
def test_bench_kv_transfer_writes_json_and_plot(beamserve: RunBeamserve, tmp_path: Path) -> None:
    out_json = tmp_path / "kv.json"
    run = beamserve(
        "bench",
        "kv-transfer",
        "--tokens",
        "100",
        "700",
        "--pairs",
        "2:1",
        "1:2",
        "--backend",
        "nixl",
        "mooncake",
        "--json",
        str(out_json),
    )
    assert run.returncode == 0, run.stdout + run.stderr
    rows = json.loads(out_json.read_text())
    assert len(rows) == 2 * 2 * 2
    for row in rows:
        assert set(row) >= FIELDS
        assert row["bytes_moved"] == row["bytes_minimum"] > 0
        assert row["verified"] is True
        assert row["gbps"] > 0 and row["memcpy_gbps"] > 0
    assert {(r["backend"], r["src_tp"], r["dst_tp"]) for r in rows} == {
        (b, p, d) for b in ("nixl", "mooncake") for p, d in ((2, 1), (1, 2))
    }
    assert out_json.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "goal bytes_moved == bytes_minimum everywhere: met" in run.stdout


@pytest.mark.integration
def test_demo_moves_and_verifies(beamserve: RunBeamserve) -> None:
    run = beamserve("demo", "kv", "--tokens", "3000", "--pair", "2:1")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "verified: byte for byte: yes" in run.stdout
    assert "exactly the minimum" in run.stdout


def test_bench_kv_transfer_repeats_report_the_median_pull(
    beamserve: RunBeamserve, tmp_path: Path
) -> None:
    """`--repeats 3`: each row is the median of three pulls of fresh requests, every pull's
    time kept, against the median of the three same-run baselines."""
    out_json = tmp_path / "kv.json"
    run = beamserve(
        "bench", "kv-transfer", "--tokens", "700", "--pairs", "2:1", "--backend", "cma",
        "--repeats", "3", "--json", str(out_json),
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    (row,) = json.loads(out_json.read_text())
    assert row["repeats"] == 3 and len(row["seconds_each"]) == 3
    assert row["seconds"] == sorted(row["seconds_each"])[1]
    assert row["bytes_moved"] == row["bytes_minimum"] and row["verified"] is True
