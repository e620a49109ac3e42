"""A session's next turn keyed from its last one (`PromptHasher.key(..., session=...)`,
`TurnMemo`): the same token ids and block hashes as from scratch, whatever the texts, and
work that follows the new text only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from beamserve.router.prompt import PromptHasher, PromptKey, TurnMemo, _LastTurn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.router.test_prompt_incremental import (
    FRAGMENTS,
    _codecs,
    chat,
    completion,
    message,
    scratch_hashes,
    text,
)

SETTINGS = settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

# How one turn's prompt follows the last: appended to (a turn, or text cut anywhere — inside
# a split token too), edited in the middle, or replaced.
step = st.one_of(
    st.tuples(st.just("append"), st.lists(message, min_size=1, max_size=3)),
    st.tuples(st.just("edit"), message),
    st.tuples(st.just("replace"), st.lists(message, max_size=4)),
)
text_step = st.one_of(
    st.tuples(st.just("append"), text),
    st.tuples(st.just("append"), st.sampled_from(["<|im_st", "art|>", "<|im_start|>", "x"])),
    st.tuples(st.just("cut"), st.integers(0, 40)),
)


def _hashers(tiny_checkpoint: Path, scheme: str, chunk: int, bs: int) -> list[PromptHasher]:
    out = [
        PromptHasher(None, block_size=bs, scheme=scheme, chunk_chars=chunk),  # type: ignore[arg-type]
        PromptHasher(tiny_checkpoint, block_size=bs, scheme=scheme),  # type: ignore[arg-type]
    ]
    for codec, _cuts in _codecs()[:5]:
        h = PromptHasher(None, block_size=bs, scheme=scheme)  # type: ignore[arg-type]
        h.codec, h.precise = codec, True
        from beamserve.router.prompt import split_tokens

        h.split_tokens = split_tokens(codec)
        out.append(h)
    return out


def _scratch(h: PromptHasher, call: Any) -> PromptKey:
    ids = h.codec.encode(h._text(call))
    return PromptKey(ids, scratch_hashes(ids, h.scheme, h.block_size), h.precise)


@SETTINGS
@given(
    first=st.lists(message, max_size=4),
    steps=st.lists(step, min_size=1, max_size=5),
    scheme=st.sampled_from(["vllm", "sglang"]),
    chunk=st.sampled_from([3, 16, 4096]),
    bs=st.sampled_from([1, 4]),
)
def test_a_sessions_chat_turns_key_as_from_scratch(
    tiny_checkpoint: Path, first: list[Any], steps: list[Any], scheme: str, chunk: int, bs: int
) -> None:
    for h in _hashers(tiny_checkpoint, scheme, chunk, bs):
        msgs = list(first)
        for kind, arg in [("append", []), *steps]:
            if kind == "append":
                msgs = [*msgs, *arg]
            elif kind == "edit" and msgs:
                msgs = [arg, *msgs[1:]]
            elif kind == "replace":
                msgs = list(arg)
            call = chat(msgs)
            key = h.key(call, session="s")
            assert key == _scratch(h, call)
            assert key.prompt_tokens == len(key.token_ids)


@SETTINGS
@given(
    start=text,
    steps=st.lists(text_step, min_size=1, max_size=8),
    scheme=st.sampled_from(["vllm", "sglang"]),
    chunk=st.sampled_from([2, 5, 4096]),
    bs=st.sampled_from([1, 4]),
)
def test_a_growing_text_prompt_keys_as_from_scratch(
    tiny_checkpoint: Path, start: str, steps: list[Any], scheme: str, chunk: int, bs: int
) -> None:
    """Text appended anywhere — a split token's first half at the end of one turn, its second
    half at the start of the next — and text cut back."""
    for h in _hashers(tiny_checkpoint, scheme, chunk, bs):
        prompt = start
        for kind, arg in [("append", ""), *steps]:
            prompt = prompt + arg if kind == "append" else prompt[: max(len(prompt) - arg, 0)]
            call = completion(prompt)
            assert h.key(call, session="t") == _scratch(h, call)


def test_a_continuing_turn_tokenizes_and_hashes_only_its_new_text(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Caches off but the memo: the second turn encodes its new messages (and the last
    prompt's final piece) only, and hashes only the blocks past the kept ones."""
    h = PromptHasher(None, block_size=16, segment_cache_bytes=0)
    encoded: list[int] = []
    hashed: list[int] = []
    encode, scratch = h._encode_segment, h._scratch_u32

    def counted_encode(seg: str) -> Any:
        encoded.append(len(seg))
        return encode(seg)

    def counted_scratch(buf: bytes, *a: Any) -> Any:
        hashed.append(len(buf) // 4 // 16)
        return scratch(buf, *a)

    monkeypatch.setattr(h, "_encode_segment", counted_encode)
    monkeypatch.setattr(h, "_scratch_u32", counted_scratch)
    msgs = [{"role": "user", "content": f"part {i} " + " ".join(FRAGMENTS[20:])} for i in range(60)]
    first = h.key(chat(msgs), session="s")
    assert sum(encoded) == len(h._text(chat(msgs))) and sum(hashed) == len(first.block_hashes)
    encoded.clear()
    hashed.clear()
    more = [*msgs, {"role": "assistant", "content": "done"}, {"role": "user", "content": "next"}]
    second = h.key(chat(more), session="s")
    new_chars = len(h._text(chat(more))) - len(h._text(chat(msgs)))
    assert 0 < sum(encoded) <= new_chars + len("<|im_start|>assistant\n")
    assert 0 < sum(hashed) <= len(second.block_hashes) - len(first.block_hashes) + 2
    assert second == _scratch(h, chat(more))
    # Another session, or no session: from scratch (nothing kept across sessions).
    encoded.clear()
    h.key(chat(more), session="other")
    assert sum(encoded) == len(h._text(chat(more)))


def test_the_turn_memo_is_bounded_and_keeps_the_most_recent() -> None:
    memo = TurnMemo(max_bytes=3_000)
    turn = _LastTurn("x" * 500, [500], [b"\0" * 400], [], ())  # 500 + 400 + 100 bytes
    for i in range(5):
        memo.put(f"s{i}", turn)
    assert memo.bytes <= 3_000 and len(memo) == 3
    assert memo.get("s0") is None and memo.get("s4") is turn
    memo.put("s2", turn)  # replaced, not counted twice
    assert len(memo) == 3 and memo.bytes == 3_000
    memo.put("big", _LastTurn("x" * 5_000, [5_000], [], [], ()))  # over the bound: not kept
    assert memo.get("big") is None and memo.bytes <= 3_000


def test_memo_off_or_token_ids_key_from_scratch() -> None:
    h = PromptHasher(None, block_size=4, turn_memo_bytes=0)
    msgs = [{"role": "user", "content": "hello world " * 40}]
    assert h.key(chat(msgs), session="s") == _scratch(h, chat(msgs))
    assert len(h.turns) == 0
    on = PromptHasher(None, block_size=4)
    ids = list(range(100))
    assert on.key(completion(ids), session="s").block_hashes == scratch_hashes(ids, "vllm", 4)
    assert len(on.turns) == 0


@pytest.mark.parametrize("bs", [1, 4])
def test_a_long_last_piece_that_grows_is_keyed_again(bs: int) -> None:
    """The last prompt's final piece — one long word — grows into a different token: the
    blocks from that piece on are hashed again, none kept from the last prompt."""
    h = PromptHasher(None, block_size=bs, chunk_chars=2)
    prompt = "x y " * 5 + "w" * 30
    for more in ("w", "ww z", " w" * 7):
        prompt += more
        assert h.key(completion(prompt), session="s") == _scratch(h, completion(prompt))
