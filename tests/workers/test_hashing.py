"""Block hashes against the engines' own code, plus the chaining properties the router needs.

Golden values: tests/workers/golden/kv_goldens.json, written by
tests/workers/golden/make_kv_goldens.py, which ran the REAL hashing code of vLLM 0.33.0
(``vllm/utils/hashing.py`` and ``init_none_hash`` / ``get_request_block_hasher`` /
``hash_block_tokens`` / ``maybe_convert_block_hash`` cut out of
``vllm/v1/core/kv_cache_utils.py``, with cbor2 for sha256_cbor) and of SGLang 0.5.23
(``mem_cache/cpp_utils/hash_binding.cpp`` compiled with g++/pybind11/OpenSSL, driven through
``native_hash.py`` and ``mem_cache/utils.py:compute_node_event_hash_values`` /
``hash_str_to_int64``) from the downloaded wheels. Nothing here derives them from our code.
"""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path
from typing import Any

import pytest
from beamserve.kvwire.hashing import (
    HashingError,
    block_hashes,
    canonical_cbor,
    hash_blocks_sglang,
    hash_blocks_vllm,
    none_hash,
    sglang_event_int,
    vllm_event_int,
)
from hypothesis import given, settings
from hypothesis import strategies as st

GOLDENS: dict[str, Any] = json.loads(
    (Path(__file__).parent / "golden" / "kv_goldens.json").read_text()
)


@pytest.fixture(autouse=True)
def _no_hash_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    # vLLM derives NONE_HASH from PYTHONHASHSEED when set; tests pin it explicitly.
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)


# --- goldens from the real engines -----------------------------------------------------------


@pytest.mark.parametrize("case", GOLDENS["vllm_hash"], ids=lambda c: c["name"])
def test_vllm_hashes_match_real_vllm(case: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    if case["pythonhashseed"] is not None:
        monkeypatch.setenv("PYTHONHASHSEED", case["pythonhashseed"])
    assert none_hash(case["algo"]).hex() == case["none_hash_hex"]
    got = hash_blocks_vllm(
        case["token_ids"],
        case["block_size"],
        algo=case["algo"],
        cache_salt=case["cache_salt"],
        lora=tuple(case["lora"]) if case["lora"] else None,
    )
    assert [b.digest.hex() for b in got] == case["digests_hex"]
    assert [b.event_id for b in got] == case["event_ints"]
    assert all(b.num_tokens == case["block_size"] for b in got)


@pytest.mark.parametrize("case", GOLDENS["sglang_hash"], ids=lambda c: c["name"])
def test_sglang_hashes_match_real_sglang(case: dict[str, Any]) -> None:
    got = hash_blocks_sglang(case["token_ids"], case["page_size"], cache_salt=case["cache_salt"])
    assert [b.digest.hex() for b in got] == case["digests_hex"]
    assert [b.event_id for b in got] == case["event_ints"]
    n = len(case["token_ids"])
    assert sum(b.num_tokens for b in got) == n


def test_default_block_hashes_is_vllm_sha256_at_64() -> None:
    case = next(c for c in GOLDENS["vllm_hash"] if c["name"] == "sha256_3_blocks_of_64_plus_tail")
    assert block_hashes(case["token_ids"]) == case["event_ints"]
    assert block_hashes(case["token_ids"], 64) == case["event_ints"]


def test_none_hash_seed_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    default = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=pickle.HIGHEST_PROTOCOL))
    assert none_hash() == default.digest()
    monkeypatch.setenv("PYTHONHASHSEED", "")  # set but empty is still a seed in vLLM
    assert none_hash() != default.digest()
    assert none_hash(seed="vllm-none-hash") == default.digest()


def test_sha256_hashes_a_pickle_of_parent_tokens_extra() -> None:
    # The documented formula, spelled out once by hand for one block.
    toks = list(range(4))
    expect = hashlib.sha256(
        pickle.dumps((none_hash(), (0, 1, 2, 3), None), protocol=pickle.HIGHEST_PROTOCOL)
    ).digest()
    (b,) = hash_blocks_vllm(toks, 4)
    assert b.digest == expect
    assert b.event_id == int.from_bytes(expect[-8:], "big")


# --- canonical CBOR (sha256_cbor): RFC 8949 Appendix A vectors ------------------------------

CBOR_VECTORS: list[tuple[object, str]] = [
    (0, "00"),
    (23, "17"),
    (24, "1818"),
    (100, "1864"),
    (1000, "1903e8"),
    (1000000, "1a000f4240"),
    (1000000000000, "1b000000e8d4a51000"),
    (18446744073709551615, "1bffffffffffffffff"),
    (18446744073709551616, "c249010000000000000000"),
    (-18446744073709551616, "3bffffffffffffffff"),
    (-18446744073709551617, "c349010000000000000000"),
    (-1, "20"),
    (-10, "29"),
    (-100, "3863"),
    (-1000, "3903e7"),
    (0.0, "f90000"),
    (-0.0, "f98000"),
    (1.5, "f93e00"),
    (65504.0, "f97bff"),
    (100000.0, "fa47c35000"),
    (1.1, "fb3ff199999999999a"),
    (float("inf"), "f97c00"),
    (False, "f4"),
    (True, "f5"),
    (None, "f6"),
    (b"", "40"),
    (b"\x01\x02\x03\x04", "4401020304"),
    ("", "60"),
    ("a", "6161"),
    ("IETF", "6449455446"),
    ("ü", "62c3bc"),
    ([], "80"),
    ((1, (2, 3), [4, 5]), "8301820203820405"),
    (tuple(range(1, 26)), "98190102030405060708090a0b0c0d0e0f101112131415161718181819"),
    ({}, "a0"),
    ({"a": 1, "b": [2, 3]}, "a26161016162820203"),
    ({"bb": 1, "a": 2}, "a261610262626201"),  # canonical: shorter key first
]


@pytest.mark.parametrize(("value", "hex_"), CBOR_VECTORS, ids=lambda v: repr(v)[:20])
def test_canonical_cbor_vectors(value: object, hex_: str) -> None:
    assert canonical_cbor(value).hex() == hex_


def test_canonical_cbor_refuses_unknown_types() -> None:
    with pytest.raises(HashingError, match="cannot CBOR-encode"):
        canonical_cbor(object())


# --- properties ------------------------------------------------------------------------------

token_lists = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=80)
wide_token_lists = st.lists(
    st.one_of(st.integers(0, 300), st.integers(2**32, 2**63 - 1)), max_size=40
)
block_sizes = st.integers(min_value=1, max_value=9)


@settings(max_examples=60, deadline=None)
@given(toks=token_lists, bs=block_sizes, cut=st.integers(min_value=0, max_value=80))
def test_vllm_prefix_property(toks: list[int], bs: int, cut: int) -> None:
    full = hash_blocks_vllm(toks, bs)
    assert len(full) == len(toks) // bs
    assert hash_blocks_vllm(toks[:cut], bs) == full[: min(cut, len(toks)) // bs]


@settings(max_examples=40, deadline=None)
@given(toks=token_lists, bs=block_sizes, algo=st.sampled_from(["sha256", "sha256_cbor"]))
def test_vllm_chain_continues_from_parent_digest(toks: list[int], bs: int, algo: str) -> None:
    full = hash_blocks_vllm(toks, bs, algo=algo)
    if len(full) < 2:
        return
    k = len(full) // 2
    tail = hash_blocks_vllm(toks[k * bs :], bs, parent=full[k - 1].digest, algo=algo)
    assert full[k:] == tail


@settings(max_examples=40, deadline=None)
@given(toks=token_lists.filter(lambda t: len(t) >= 8), pos=st.integers(0, 79))
def test_vllm_change_affects_its_block_and_later_only(toks: list[int], pos: int) -> None:
    bs = 4
    pos %= len(toks)
    changed = list(toks)
    changed[pos] = (changed[pos] + 1) % 2**32
    a, b = hash_blocks_vllm(toks, bs), hash_blocks_vllm(changed, bs)
    block = pos // bs
    assert a[:block] == b[:block]
    assert all(x.digest != y.digest for x, y in zip(a[block:], b[block:], strict=True))


@settings(max_examples=60, deadline=None)
@given(toks=st.one_of(token_lists, wide_token_lists), ps=block_sizes, cut=st.integers(0, 80))
def test_sglang_prefix_property_on_full_pages(toks: list[int], ps: int, cut: int) -> None:
    full = hash_blocks_sglang(toks, ps)
    assert len(full) == -(-len(toks) // ps)  # last page may be partial
    n_full = min(cut, len(toks)) // ps
    assert hash_blocks_sglang(toks[:cut], ps, include_partial=False) == full[:n_full]
    if full:
        k = len(full) // 2
        if k:
            rest = hash_blocks_sglang(toks[k * ps :], ps, parent=full[k - 1].digest)
            assert rest == full[k:]


@settings(max_examples=60, deadline=None)
@given(digest=st.binary(min_size=32, max_size=32))
def test_event_integer_conventions(digest: bytes) -> None:
    v = vllm_event_int(digest)
    s = sglang_event_int(digest)
    assert 0 <= v < 2**64 and v.to_bytes(8, "big") == digest[-8:]
    assert -(2**63) <= s < 2**63 and s.to_bytes(8, "big", signed=True) == digest[:8]


def test_sglang_wide_page_is_tagged_once_and_uint64() -> None:
    toks = [1, 2**32]
    (page,) = hash_blocks_sglang(toks, 2)
    expect = hashlib.sha256(b"\xff" + (1).to_bytes(8, "little") + (2**32).to_bytes(8, "little"))
    assert page.digest == expect.digest()


# --- errors carry the fix --------------------------------------------------------------------


def test_errors() -> None:
    with pytest.raises(HashingError, match="digest"):
        hash_blocks_vllm([1] * 64, parent=12345)
    with pytest.raises(HashingError, match="digest"):
        hash_blocks_sglang([1] * 64, parent=12345)
    with pytest.raises(HashingError, match="choose one of"):
        hash_blocks_vllm([1] * 64, algo="md5")
    with pytest.raises(HashingError, match="positive"):
        hash_blocks_vllm([1] * 64, block_size=0)
    with pytest.raises(HashingError, match="positive"):
        hash_blocks_sglang([1] * 64, page_size=0)
    with pytest.raises(HashingError, match="one per block"):
        hash_blocks_vllm([1] * 128, extra_keys=[None])
    with pytest.raises(HashingError, match="either"):
        hash_blocks_vllm([1] * 64, extra_keys=("x",), cache_salt="s")
    with pytest.raises(HashingError, match=r"\[0, 2\^63\)"):
        hash_blocks_sglang([-1])


def test_extra_keys_forms_agree() -> None:
    toks = list(range(12))
    single = hash_blocks_vllm(toks, 4, extra_keys=("k",))
    per_block = hash_blocks_vllm(toks, 4, extra_keys=[("k",)] * 3)
    assert single == per_block
    assert single != hash_blocks_vllm(toks, 4)
