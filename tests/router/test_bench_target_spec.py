"""`beamserve bench agentic --target FILE.yaml`: the spec comes up as local processes
(LocalStack), the replay runs against its router, and it goes down again — every process it
started is gone when the command returns; a spec that does not validate never starts one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def spec_file(tmp: Path, model: Path, name: str, pools: dict[str, int]) -> Path:
    doc = {
        "apiVersion": "beamserve.io/v1alpha1",
        "kind": "BeamDeployment",
        "metadata": {"name": name},
        "spec": {
            "model": {"source": {"hostPath": {"path": str(model)}}},
            "engine": {"name": "sim", "simProfile": "h200-bf16-tp8"},
            **{role: {"replicas": n} for role, n in pools.items()},
            "router": {"replicas": 1},
            "monitoring": {"enabled": False},
        },
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def bench(*args: str, kind: str = "agentic") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(Path(sys.executable).parent / "beamserve"), "bench", kind, *args],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=REPO,
        env={**os.environ, "BEAMSERVE_LOG_JSON": "1"},
        check=False,
    )


def pids_spawned(stdout: str) -> list[int]:
    out = []
    for line in stdout.splitlines():
        if line.startswith("{") and '"up.spawn"' in line:
            out.append(int(json.loads(line)["pid"]))
    return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(")")[-1].split()[0] != "Z"


def test_target_spec_up_replay_down(tiny_checkpoint: Path, tmp_path: Path) -> None:
    spec = spec_file(tmp_path, tiny_checkpoint, "bench-pd", {"prefill": 1, "decode": 1})
    out = tmp_path / "r.json"
    run = bench(
        "--target", str(spec), "--sessions", "2", "--max-turns", "3", "--token-scale", "0.05",
        "--think-scale", "0", "--concurrency", "2,1", "--json", str(out),
        "--logs", str(tmp_path / "logs"),
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads(out.read_text())
    assert [r["concurrency"] for r in results] == [2, 1]
    for r in results:
        assert r["router"] == "bench-pd" and r["mode"] == "target"
        assert r["ok"] == r["requests"] == 6 and not r["errors"], r
        assert r["target_spec"] == str(spec)
        assert r["pools"] == {
            "prefill": {"replicas": 1, "tp": 1},
            "decode": {"replicas": 1, "tp": 1},
        }
        assert r["gpus"] == 2 * 8  # two h200-bf16-tp8 sim workers
        assert r["ttft_p50_s"] > 0
    # a stack per level (each starts cold): 2 workers + 1 router, twice, all stopped
    pids = pids_spawned(run.stdout + run.stderr)  # LocalStack's log lines, pids included
    assert len(pids) == 6, run.stderr[-2000:]
    assert not [p for p in pids if alive(p)]
    # the stack's logs are kept under --logs
    logs = sorted(p.name for p in (tmp_path / "logs").glob("bench-pd-c2-stack/logs/*.log"))
    assert any("router" in n for n in logs) and any("decode" in n for n in logs), logs


def test_target_spec_refused_before_anything_starts(tiny_checkpoint: Path, tmp_path: Path) -> None:
    # a decode pool without a prefill pool: the admission rules refuse it
    spec = spec_file(tmp_path, tiny_checkpoint, "bench-bad", {"decode": 1})
    run = bench("--target", str(spec), "--sessions", "1", "--max-turns", "1", "--concurrency", "1")
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    assert "spec.prefill" in run.stdout or "spec.prefill" in run.stderr, run.stdout[-2000:]
    assert not pids_spawned(run.stdout + run.stderr)
    run = bench("--target", str(tmp_path / "missing.yaml"), "--concurrency", "1")
    assert run.returncode == 2 and "no such file" in run.stdout
    # wire-overhead measures one worker behind a running router: a spec file is refused
    run = bench("--target", str(spec), "--worker", "http://127.0.0.1:1", kind="wire-overhead")
    assert run.returncode == 2 and "not a spec file" in run.stdout, run.stdout
