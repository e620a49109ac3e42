"""Prefix-cache block hashes exactly as vLLM 0.33 and SGLang 0.5.23 compute them.

The router indexes KV events by these hashes, and our simulated engine must emit the same
integers a real engine would for the same tokens, so a router built against vLLM or SGLang
indexes our workers unchanged.

vLLM (``vllm/v1/core/kv_cache_utils.py``): for each FULL block ``i`` of ``block_size`` tokens,
``h_i = hash_fn((h_{i-1} or NONE_HASH, tuple(block_tokens), extra_keys))``; ``hash_fn`` is
SHA-256 over a pickle (``sha256``, the default) or over canonical CBOR (``sha256_cbor``);
``NONE_HASH = hash_fn("vllm-none-hash")`` unless ``PYTHONHASHSEED`` is set, then
``hash_fn(PYTHONHASHSEED)``. A KV event carries the last 8 bytes as an unsigned big-endian int.

SGLang (``sglang/srt/mem_cache/cpp_utils/hash_binding.cpp``, reached through
``mem_cache/utils.py:get_hash_str``): per page of ``page_size`` tokens (the last page may be
partial), ``d_i = SHA-256(d_{i-1} || page bytes)`` where the page bytes are the tokens as
little-endian uint32 — or, when any token of the page is ≥ 2^32, one ``0xFF`` byte then every
token of the page as little-endian uint64. The first page has no previous digest unless the
request carries a cache salt (then ``SHA-256(b"sglang-cache-salt-v1\0" + salt)``). A KV event
carries the first 8 bytes as a signed big-endian int (``utils.py:hash_str_to_int64``).
"""

from __future__ import annotations

import hashlib
import os
import pickle
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "VLLM_HASH_ALGOS",
    "BlockHash",
    "HashingError",
    "block_hashes",
    "canonical_cbor",
    "chain_sglang_u32",
    "chain_vllm",
    "hash_blocks_sglang",
    "hash_blocks_vllm",
    "none_hash",
    "sglang_event_int",
    "vllm_event_int",
]

VLLM_HASH_ALGOS = ("sha256", "sha256_cbor")
_VLLM_NONE_HASH_SEED = "vllm-none-hash"
DEFAULT_BLOCK_SIZE = 64


class HashingError(ValueError):
    """A hashing input the engines would not accept (unknown algorithm, bad block size)."""


@dataclass(frozen=True, slots=True)
class BlockHash:
    """One block's hash: the raw digest the engine chains on, and the event integer.

    ``digest`` is what the next block's hash takes as its parent; ``event_id`` is the integer
    a KV event carries for this block (vLLM: last 8 bytes unsigned; SGLang: first 8 bytes
    signed). ``num_tokens`` is the block's token count (< block size only for SGLang's last
    partial page).
    """

    digest: bytes
    event_id: int
    num_tokens: int


# --- canonical CBOR (RFC 8949 §4.2.1 deterministic encoding) -------------------------------
# vLLM's sha256_cbor calls cbor2.dumps(x, canonical=True). The inputs are tuples of bytes,
# ints, strings and None; we encode that subset ourselves rather than depend on cbor2.


def _cbor_head(major: int, value: int) -> bytes:
    if value < 24:
        return bytes([(major << 5) | value])
    if value < 1 << 8:
        return bytes([(major << 5) | 24, value])
    if value < 1 << 16:
        return bytes([(major << 5) | 25]) + value.to_bytes(2, "big")
    if value < 1 << 32:
        return bytes([(major << 5) | 26]) + value.to_bytes(4, "big")
    return bytes([(major << 5) | 27]) + value.to_bytes(8, "big")


def canonical_cbor(obj: object) -> bytes:
    """Canonical CBOR of ints, bytes, str, bool, None, float, tuples/lists and str-keyed dicts.

    Matches ``cbor2.dumps(obj, canonical=True)`` for these types (ints beyond 64 bits use
    bignum tags 2/3; floats use the shortest exact width; dict keys sorted by encoded bytes).
    """
    out = bytearray()
    _cbor_encode(obj, out)
    return bytes(out)


def _cbor_encode(obj: object, out: bytearray) -> None:
    if obj is None:
        out.append(0xF6)
    elif obj is True:
        out.append(0xF5)
    elif obj is False:
        out.append(0xF4)
    elif isinstance(obj, int):
        if 0 <= obj < 1 << 64:
            out += _cbor_head(0, obj)
        elif -(1 << 64) <= obj < 0:
            out += _cbor_head(1, -1 - obj)
        else:
            tag, mag = (2, obj) if obj >= 0 else (3, -1 - obj)
            raw = mag.to_bytes((mag.bit_length() + 7) // 8, "big")
            out += _cbor_head(6, tag)
            out += _cbor_head(2, len(raw)) + raw
    elif isinstance(obj, bytes | bytearray | memoryview):
        raw = bytes(obj)
        out += _cbor_head(2, len(raw)) + raw
    elif isinstance(obj, str):
        raw = obj.encode("utf-8")
        out += _cbor_head(3, len(raw)) + raw
    elif isinstance(obj, float):
        out += _cbor_float(obj)
    elif isinstance(obj, tuple | list):
        out += _cbor_head(4, len(obj))
        for item in obj:
            _cbor_encode(item, out)
    elif isinstance(obj, dict):
        items = []
        for key, value in obj.items():
            kb = bytearray()
            _cbor_encode(key, kb)
            items.append((bytes(kb), value))
        # RFC 7049 canonical (what cbor2 canonical=True does): shorter keys first, then bytes.
        items.sort(key=lambda kv: (len(kv[0]), kv[0]))
        out += _cbor_head(5, len(items))
        for kb_, value in items:
            out += kb_
            _cbor_encode(value, out)
    else:
        raise HashingError(f"cannot CBOR-encode {type(obj).__name__} for sha256_cbor hashing")


def _cbor_float(value: float) -> bytes:
    if value != value:  # NaN: canonical form is half-precision 0x7e00
        return b"\xf9\x7e\x00"
    for fmt, head in (("e", 0xF9), ("f", 0xFA)):
        try:
            packed = struct.pack(">" + fmt, value)
        except OverflowError:
            continue
        if struct.unpack(">" + fmt, packed)[0] == value:
            return bytes([head]) + packed
    return b"\xfb" + struct.pack(">d", value)


# --- vLLM ------------------------------------------------------------------------------------


def _vllm_hash_fn(algo: str) -> Any:
    if algo == "sha256":
        return lambda obj: hashlib.sha256(
            pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        ).digest()
    if algo == "sha256_cbor":
        return lambda obj: hashlib.sha256(canonical_cbor(obj)).digest()
    raise HashingError(
        f"unknown vLLM prefix-caching hash algorithm {algo!r}; choose one of {VLLM_HASH_ALGOS} "
        "(xxhash variants use a random seed per process and cannot be reproduced outside it)"
    )


def none_hash(algo: str = "sha256", seed: str | None = None) -> bytes:
    """vLLM's ``NONE_HASH``: the parent of the first block.

    ``seed`` defaults to ``PYTHONHASHSEED`` when set, else ``"vllm-none-hash"`` — the engine
    process's environment decides, so pass the engine's value when it differs from ours.
    """
    if seed is None:
        # vLLM tests `is not None`: an empty PYTHONHASHSEED is a seed too.
        env_seed = os.environ.get("PYTHONHASHSEED")
        seed = env_seed if env_seed is not None else _VLLM_NONE_HASH_SEED
    digest: bytes = _vllm_hash_fn(algo)(seed)
    return digest


def vllm_event_int(digest: bytes) -> int:
    """The integer vLLM puts in KV events for a block hash: last 8 bytes, unsigned big-endian."""
    return int.from_bytes(digest[-8:], "big", signed=False)


def hash_blocks_vllm(
    token_ids: Sequence[int],
    block_size: int = DEFAULT_BLOCK_SIZE,
    parent: int | bytes | None = None,
    extra_keys: tuple[Any, ...] | Sequence[tuple[Any, ...] | None] | None = None,
    algo: str = "sha256",
    none_hash_seed: str | None = None,
    *,
    cache_salt: str | None = None,
    lora: tuple[str, str] | None = None,
) -> list[BlockHash]:
    """Chained vLLM block hashes over the FULL blocks of ``token_ids``.

    ``parent`` continues a chain: the previous block's raw 32-byte digest. An int (an event
    integer) raises ``HashingError``: it is a truncation and cannot be chained on.
    ``extra_keys``: one tuple applied to every block, or a sequence with one entry (tuple or
    None) per full block, as vLLM's ``generate_block_hash_extra_keys`` yields (LoRA name,
    multimodal hashes, cache salt). Tokens past the last full block are not hashed.
    ``cache_salt`` / ``lora`` (name, path) build the extra keys as vLLM does for a request
    with that salt or adapter (salt on the first block only); they exclude ``extra_keys``.
    ``parent`` with ``cache_salt`` is refused: the salt applies to the chain's first block.
    """
    if block_size <= 0:
        raise HashingError(f"block_size must be positive, got {block_size}")
    if isinstance(parent, int):
        raise HashingError(
            "vLLM chains on the full 32-byte digest, not the 8-byte event integer; pass "
            "BlockHash.digest of the previous block as parent"
        )
    hash_fn = _vllm_hash_fn(algo)
    prev: bytes = parent if parent else none_hash(algo, none_hash_seed)
    n_full = len(token_ids) // block_size
    per_block: list[tuple[Any, ...] | None]
    if cache_salt is not None or lora is not None:
        if extra_keys is not None:
            raise HashingError("give either extra_keys or cache_salt/lora, not both")
        if cache_salt and parent:
            raise HashingError("cache_salt keys only a chain's first block; drop parent")
        lora_keys: list[tuple[str, ...]] = [("lora", *lora)] if lora else []
        salt_keys: list[tuple[str, ...]] = [("cache_salt", cache_salt)] if cache_salt else []
        per_block = [
            tuple(lora_keys + (salt_keys if i == 0 else [])) or None for i in range(n_full)
        ]
    elif extra_keys is None:
        per_block = [None] * n_full
    elif isinstance(extra_keys, tuple):
        per_block = [extra_keys] * n_full
    else:
        per_block = list(extra_keys)
        if len(per_block) < n_full:
            raise HashingError(
                f"extra_keys has {len(per_block)} entries for {n_full} full blocks; "
                "give one per block or a single tuple for all"
            )
    out: list[BlockHash] = []
    for i in range(n_full):
        block = tuple(map(int, token_ids[i * block_size : (i + 1) * block_size]))
        digest: bytes = hash_fn((prev, block, per_block[i]))
        out.append(BlockHash(digest, vllm_event_int(digest), block_size))
        prev = digest
    return out


def chain_vllm(
    token_ids: Sequence[int], block_size: int, parent: bytes | None = None
) -> list[tuple[bytes, int]]:
    """``[(b.digest, b.event_id) for b in hash_blocks_vllm(token_ids, block_size, parent)]``
    for the default ``sha256`` and no extra keys, in one tight loop without ``BlockHash``
    objects (the router hashes every prompt it has not seen). ``token_ids`` must be plain
    ints (a subclass would pickle differently); ``parent`` None or empty: ``NONE_HASH``."""
    if block_size <= 0:
        raise HashingError(f"block_size must be positive, got {block_size}")
    prev = parent or none_hash()
    dumps, sha256, proto, from_bytes = (
        pickle.dumps,
        hashlib.sha256,
        pickle.HIGHEST_PROTOCOL,
        int.from_bytes,
    )
    out: list[tuple[bytes, int]] = []
    for i in range(0, len(token_ids) // block_size * block_size, block_size):
        digest = sha256(dumps((prev, tuple(token_ids[i : i + block_size]), None), proto)).digest()
        out.append((digest, from_bytes(digest[-8:], "big")))
        prev = digest
    return out


# --- SGLang ----------------------------------------------------------------------------------


def sglang_event_int(digest: bytes) -> int:
    """The integer SGLang puts in KV events for a page hash: first 8 bytes, signed big-endian."""
    return int.from_bytes(digest[:8], "big", signed=True)


def _sglang_page_bytes(tokens: Sequence[int]) -> bytes:
    """The bytes SGLang hashes for one page (after the previous page's digest).

    Every token fits uint32: the tokens as little-endian uint32. Otherwise the whole page
    goes wide: one 0xFF tag byte (an odd length can never collide with a uint32 page), then
    every token as little-endian uint64. Token ids must lie in [0, 2^63).
    """
    ints = list(map(int, tokens))
    if not ints:
        return b""
    lo, hi = min(ints), max(ints)
    if lo < 0 or hi >= 1 << 63:
        bad = next(t for t in ints if t < 0 or t >= 1 << 63)
        raise HashingError(f"token id {bad} outside [0, 2^63): SGLang refuses it")
    if hi < 1 << 32:
        return struct.pack(f"<{len(ints)}I", *ints)
    return b"\xff" + struct.pack(f"<{len(ints)}Q", *ints)


def hash_blocks_sglang(
    token_ids: Sequence[int],
    page_size: int = DEFAULT_BLOCK_SIZE,
    parent: int | bytes | None = None,
    include_partial: bool = True,
    *,
    cache_salt: str | None = None,
) -> list[BlockHash]:
    """Chained SGLang page hashes; the last page may be partial (``include_partial``).

    ``parent`` is the previous page's 32-byte digest (an int is refused: the event integer is
    a truncation and cannot be chained on). ``cache_salt`` seeds a chain with no parent as
    SGLang's event hashes do for a salted request.
    """
    if page_size <= 0:
        raise HashingError(f"page_size must be positive, got {page_size}")
    if isinstance(parent, int):
        raise HashingError("SGLang chains on the 32-byte digest; pass BlockHash.digest as parent")
    prev: bytes | None = parent or None
    if prev is None and cache_salt is not None:
        prev = hashlib.sha256(b"sglang-cache-salt-v1\0" + cache_salt.encode("utf-8")).digest()
    out: list[BlockHash] = []
    stop = len(token_ids) if include_partial else len(token_ids) // page_size * page_size
    for start in range(0, stop, page_size):
        page = token_ids[start : min(start + page_size, stop)]
        h = hashlib.sha256()
        if prev is not None:
            h.update(prev)
        h.update(_sglang_page_bytes(page))
        digest = h.digest()
        out.append(BlockHash(digest, sglang_event_int(digest), len(page)))
        prev = digest
    return out


def chain_sglang_u32(
    page_bytes: bytes, page_size: int, parent: bytes | None = None
) -> list[tuple[bytes, int]]:
    """(digest, event id) of each FULL page of tokens given as little-endian uint32 bytes (4 a
    token): what ``hash_blocks_sglang(ids, page_size, parent, include_partial=False)`` gives
    for those ids (all below 2^32, so SGLang hashes exactly these bytes), without decoding
    them. ``parent`` None or empty: no previous digest (no salt)."""
    if page_size <= 0:
        raise HashingError(f"page_size must be positive, got {page_size}")
    step = 4 * page_size
    prev = parent or None
    sha256, from_bytes = hashlib.sha256, int.from_bytes
    out: list[tuple[bytes, int]] = []
    for i in range(0, len(page_bytes) // step * step, step):
        h = sha256(prev) if prev is not None else sha256()
        h.update(page_bytes[i : i + step])
        digest = h.digest()
        out.append((digest, from_bytes(digest[:8], "big", signed=True)))
        prev = digest
    return out


# --- default ---------------------------------------------------------------------------------


def block_hashes(token_ids: Sequence[int], block_size: int = DEFAULT_BLOCK_SIZE) -> list[int]:
    """vLLM ``sha256`` event integers of the full blocks of ``token_ids`` (the platform default).

    The prefix property holds: the hashes of a prefix are a prefix of the hashes.
    """
    return [b.event_id for b in hash_blocks_vllm(token_ids, block_size)]
