"""`beamserve model make-tiny` and `beamserve check disagg`, run as a user runs them."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from beamserve.kv_transfer.model import BeamModelConfig

if TYPE_CHECKING:
    from conftest import RunBeamserve


@pytest.fixture(scope="module")
def made(
    beamserve: RunBeamserve, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    out = tmp_path_factory.mktemp("cli") / "tiny"
    return out, beamserve("model", "make-tiny", str(out), "--seed", "2")


def test_make_tiny_writes_a_loadable_checkpoint(
    made: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    out, run = made
    assert run.returncode == 0, run.stdout + run.stderr
    assert "2 full, 5 sliding, window 32" in run.stdout
    m = BeamModelConfig.from_checkpoint(out)
    assert (m.num_attention_heads, m.num_key_value_heads) == (24, 4)
    assert (out / "model.safetensors").stat().st_size > 0


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--tp-pairs", "2x1"], "PREFILL_TP:DECODE_TP"),
        (["--backend", "rdma"], "invalid choice"),
        (["--engine", "vllm"], "invalid choice"),
        (["--prompts", "0"], "positive integer"),
    ],
)
def test_bad_arguments_name_the_flag(beamserve: RunBeamserve, args: list[str], needle: str) -> None:
    run = beamserve("check", "disagg", *args)
    assert run.returncode == 2 and needle in run.stderr


def test_unservable_pair_is_refused_before_any_process_starts(
    beamserve: RunBeamserve,
    made: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    run = beamserve("check", "disagg", "--model", str(made[0]), "--tp-pairs", "1:1,3:1")
    assert run.returncode == 2
    assert "cannot shard 4 KV heads" in run.stdout and "(1, 2, 4)" in run.stdout


@pytest.mark.integration
def test_check_disagg_passes_on_a_small_pair_set(
    beamserve: RunBeamserve, made: tuple[Path, subprocess.CompletedProcess[str]], tmp_path: Path
) -> None:
    out_json = tmp_path / "check.json"
    run = beamserve(
        "check", "disagg", "--engine", "ref", "--tp-pairs", "2:1,1:2", "--backend", "nixl",
        "--prompts", "1", "--tokens", "4", "--model", str(made[0]), "--json", str(out_json),
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert "disaggregated == colocated for every request: yes" in run.stdout
    rows = json.loads(out_json.read_text())
    assert [(r["pair"], r["backend"], r["ok"]) for r in rows] == [
        ("2:1", "nixl", True),
        ("1:2", "nixl", True),
    ]
    for r in rows:
        assert r["equal"] == r["requests"] == 2 and r["fallbacks"] == 0
        assert r["bytes_moved"] == r["bytes_minimum"] > 0 and r["reused_tokens"] > 0
