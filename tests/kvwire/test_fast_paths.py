"""The router's hot-path shortcuts give exactly what the reference computations give.

`ApproxCodec.encode_u32` (unit memo) against the codec's formula per piece; `chain_vllm` and
`chain_sglang_u32` against `hash_blocks_vllm` / `hash_blocks_sglang`; the prompt hasher's
SGLang pages hashed from the uint32 bytes against a from-scratch hash.
"""

from __future__ import annotations

import zlib
from array import array

from beamserve.kvwire.codec import _PIECE, _U32, ApproxCodec
from beamserve.kvwire.hashing import (
    chain_sglang_u32,
    chain_vllm,
    hash_blocks_sglang,
    hash_blocks_vllm,
    none_hash,
)
from beamserve.router.prompt import PromptHasher
from hypothesis import given, settings
from hypothesis import strategies as st

_TEXT = st.text(
    st.sampled_from(list("ab_9 \t\n\r.,;é٣\u00a0\u2003\u2028\x1c\x85ß漢-<|>"))
    | st.characters(exclude_categories=("Cs",)),
    max_size=200,
)
_IDS = st.lists(st.integers(0, (1 << 32) - 1), max_size=70)
_PARENT = st.none() | st.binary(min_size=32, max_size=32)


@settings(max_examples=400, deadline=None)
@given(s=_TEXT, vocab=st.sampled_from([17, 1000, 151_936]))
def test_encode_u32_is_the_formula_as_uint32(s: str, vocab: int) -> None:
    codec = ApproxCodec(vocab_size=vocab)
    expected = [zlib.crc32(p.encode()) % (vocab - 16) + 16 for p in _PIECE.findall(s)]
    for _ in range(2):  # the second time from the memo
        buf = codec.encode_u32(s)
        assert buf == array(_U32, expected).tobytes()
        assert codec.encode(s) == expected


def test_the_unit_memo_is_bounded_and_restarts_on_a_new_vocabulary() -> None:
    codec = ApproxCodec(vocab_size=1000)
    codec.encode("alpha beta. gamma")
    assert len(codec._units) == 3  # "alpha ", "beta. ", "gamma"
    codec.vocab_size = 1001
    assert codec.encode("alpha") == [zlib.crc32(b"alpha") % 985 + 16]
    assert len(codec._units) == 1


@settings(max_examples=200, deadline=None)
@given(ids=_IDS, bs=st.integers(1, 9), parent=_PARENT)
def test_chain_vllm_equals_hash_blocks_vllm(ids: list[int], bs: int, parent: bytes | None) -> None:
    ref = hash_blocks_vllm(ids, bs, parent)
    assert chain_vllm(ids, bs, parent) == [(b.digest, b.event_id) for b in ref]
    assert chain_vllm(ids, bs) == [(b.digest, b.event_id) for b in hash_blocks_vllm(ids, bs)]
    assert chain_vllm(ids, bs, none_hash()) == chain_vllm(ids, bs)


@settings(max_examples=200, deadline=None)
@given(ids=_IDS, bs=st.integers(1, 9), parent=_PARENT)
def test_chain_sglang_u32_equals_hash_blocks_sglang(
    ids: list[int], bs: int, parent: bytes | None
) -> None:
    ref = hash_blocks_sglang(ids, bs, parent, include_partial=False)
    buf = array(_U32, ids).tobytes()
    if array(_U32, [1]).tobytes() == (1).to_bytes(4, "little"):
        assert chain_sglang_u32(buf, bs, parent) == [(b.digest, b.event_id) for b in ref]


@settings(max_examples=100, deadline=None)
@given(
    lists=st.lists(st.lists(st.integers(0, 500), max_size=40), min_size=1, max_size=4),
    bs=st.sampled_from([1, 4, 16]),
)
def test_sglang_prompt_hashes_equal_from_scratch(lists: list[list[int]], bs: int) -> None:
    """Growing prompts share cached pages; every answer equals a from-scratch SGLang hash."""
    h = PromptHasher(None, block_size=bs, scheme="sglang")
    prefix: list[int] = []
    for more in lists:
        prefix = prefix + more
        ref = hash_blocks_sglang(prefix, bs, include_partial=False)
        assert h.hashes(prefix) == tuple(b.event_id for b in ref)
