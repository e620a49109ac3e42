"""`beamserve demo`: its workload pieces (pure), and the demo end to end (slow: real ref)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from beamserve.operator.local.demo import (
    Conversation,
    DemoTurn,
    block_text,
    load_turns,
    pad_to_page,
    parse_route_header,
    repo_file,
    scale_blocks,
    vocabulary,
)
from hypothesis import given
from hypothesis import strategies as st

from tests.conftest import RunBeamserve

VOCAB = vocabulary()


def test_the_route_header_names_the_decision() -> None:
    pd = parse_route_header("decode=d-0; prefill=p-0; reason=load; hit=none:0/18 blocks; band=new")
    assert (pd.decision, pd.decode, pd.prefill, pd.reason) == ("P/D", "d-0", "p-0", "load")
    warm = parse_route_header("decode=d-0; prefill=-; reason=sticky; hit=full:12/18 blocks")
    assert (warm.decision, warm.prefill, warm.hit_blocks) == ("warm", None, 12)
    assert parse_route_header("decode=d-0; prefill=-; reason=load; hit=none:0/3").decision == (
        "local"
    )


@given(st.text(min_size=1, max_size=12), st.integers(min_value=0, max_value=2**40))
def test_block_texts_are_a_function_of_session_and_hash_id(session: str, h: int) -> None:
    a = block_text(session, h, 3, VOCAB)
    assert a == block_text(session, h, 3, VOCAB) and a.endswith("\n")
    assert len(a.split()) == 3
    assert block_text(session + "x", h, 8, VOCAB) != block_text(session, h, 8, VOCAB)


def test_a_turn_that_extends_the_last_continues_the_conversation() -> None:
    talk = Conversation()
    first = talk.next_messages(DemoTurn("s", 1, (1, 2)), 2, VOCAB)
    talk.answered(first, "answer one")
    second = talk.next_messages(DemoTurn("s", 2, (1, 2, 3)), 2, VOCAB)
    assert second[:2] == [*first, {"role": "assistant", "content": "answer one"}]
    assert second[2] == {"role": "user", "content": block_text("s", 3, 2, VOCAB)}
    talk.answered(second, "answer two")
    other = talk.next_messages(DemoTurn("s", 3, (9, 2, 3)), 2, VOCAB)  # a sub-agent call
    assert len(other) == 1 and other[0]["content"].count("\n") == 3


def test_prompts_are_padded_to_whole_pages() -> None:
    def count(messages: list[dict[str, str]]) -> int:
        return sum(len(m["content"].split()) for m in messages)  # one token per word

    for text in ("a b c d e", "a b c d e f", "x " * 16):
        padded = pad_to_page([{"role": "user", "content": text}], count, 16)
        assert count(padded) % 16 == 0 and padded[0]["content"].startswith(text)
    assert pad_to_page([{"role": "user", "content": "x " * 16}], count, 16)[0]["content"] == (
        "x " * 16
    )


def test_the_longest_turn_is_scaled_into_the_budget() -> None:
    turns = load_turns(repo_file("data/traces/claude-code"), ["trace_0002"], 4)
    assert [t.turn for t in turns] == [1, 2, 3, 4]

    def words(text: str) -> int:
        return len(text.split())

    n = scale_blocks(turns, words, VOCAB)
    longest = max(len(t.hash_ids) for t in turns)
    assert n * longest <= 3000 < (n + 1) * longest or n == 8


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_the_demo_runs_end_to_end(beamserve: RunBeamserve, tmp_path: Path) -> None:
    """The real thing, smaller: two sessions of two turns on a fresh checkpoint it makes."""
    spec = yaml.safe_load(repo_file("manifests/examples/local-ref.yaml").read_text())
    spec["spec"]["model"]["source"]["hostPath"]["path"] = str(tmp_path / "beam-tiny")
    spec_path = tmp_path / "local-ref.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    state = tmp_path / "state"
    run = beamserve(
        "demo", "--spec", str(spec_path), "--sessions", "trace_0002", "trace_0024",
        "--turns", "2", "--state-dir", str(state), timeout=420,
    )  # fmt: skip
    out = run.stdout
    assert run.returncode == 0, out + run.stderr
    assert f"made the tiny Beam checkpoint: {tmp_path / 'beam-tiny'}" in out
    turns = re.findall(r"^  (trace_\d+) #(\d): ([\d,]+) tok, TTFT ([\d,]+) ms, cached ([\d,]+), "
                       r"(P/D|warm|local) .*KV ([\d.]+) MB$", out, re.M)  # fmt: skip
    assert [(s, int(t)) for s, t, *_ in turns] == [
        ("trace_0002", 1), ("trace_0002", 2), ("trace_0024", 1), ("trace_0024", 2)
    ]  # fmt: skip
    first = [t for t in turns if t[1] == "1"]
    assert all(t[5] == "P/D" and float(t[6]) > 0 for t in first)  # cold and long: P/D
    assert "summary" in out and "KV moved:" in out
    assert out.rstrip().endswith("every process stopped")
    assert not (state / "state.json").exists()
