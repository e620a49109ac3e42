"""`beamserve router`'s JSON options (`--endpoints`, `--disaggregation`, `--flow`, `--policy`, …):
inline JSON of any length, or a file that holds it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from beamserve.cli import build_parser

# Longer than a file name may be (255 bytes on Linux), and without a "/" to split it into
# short path components: what a pool_roles section written inline looks like.
DISAGG = {
    "min_uncached_tokens": 8192,
    "keep_warm_local": True,
    "pool_roles": {
        "prefill_workers": 2,
        "split_at_sessions_per_worker": 28,
        "spill_at_sessions_per_worker": 28,
        "colocate_below_sessions_per_worker": 26,
        "settle_s": 2,
        "spill_stop_below_sessions_per_worker": 0,
    },
}


def _parse(*flags: str) -> object:
    return build_parser().parse_args(["router", "--endpoints", "[]", *flags])


def test_inline_json_longer_than_a_file_name_parses() -> None:
    text = json.dumps(DISAGG)
    assert len(text) > 255 and "/" not in text
    args = _parse("--disaggregation", text, "--policy", json.dumps({"name": "x" * 300}))
    assert args.disaggregation == DISAGG  # type: ignore[attr-defined]
    assert args.policy == {"name": "x" * 300}  # type: ignore[attr-defined]


def test_json_in_a_file_parses(tmp_path: Path) -> None:
    path = tmp_path / "disagg.json"
    path.write_text(json.dumps(DISAGG))
    assert _parse("--disaggregation", str(path)).disaggregation == DISAGG  # type: ignore[attr-defined]


def test_a_policy_name_stays_a_name() -> None:
    assert _parse("--policy", "least-load").policy == "least-load"  # type: ignore[attr-defined]


@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
               min_size=1, max_size=600))  # fmt: skip
def test_neither_json_nor_a_file_is_a_usage_error_naming_the_option(text: str) -> None:
    try:
        json.loads(text)
    except ValueError:
        pass
    else:
        return  # valid JSON: accepted inline
    if len(text) < 200 and Path(text).exists():
        return  # (names an existing path, e.g. ".": not what this test is about)
    with pytest.raises(SystemExit) as exc:
        _parse("--flow", text)
    assert exc.value.code == 2  # argparse's usage error, never a traceback


def test_the_error_names_the_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parse("--flow", "pool_roles" * 40)  # a long word: neither JSON nor a file
    err = capsys.readouterr().err
    assert "argument --flow: not JSON (or a JSON file)" in err
