"""KV-cache events: what an engine tells the router about the blocks it holds, and their bytes.

One set of types for both sides: the engines (the simulator, the reference engine) emit them
through a `KVEventSink`, the workers' ZMQ publisher (`beamserve.workers.kv_events`) encodes
them, the router's subscriber (`beamserve.router.index.subscriber`) decodes them back into
these same types and hands them to the prefix index. Field names and meanings follow vLLM's
``vllm/distributed/kv_events.py`` (REFERENCE.md, "KV events"):

- `BlockStored`: blocks newly resident on `medium`; `block_hashes` are chained (each block's hash
  covers its parent's), `parent_block_hash` is the hash of the block before the first one, or
  `None` at the start of a sequence. `token_ids` holds `block_size` tokens per block, or is empty
  when the engine only knows hashes (trace replays).
- `BlockRemoved`: blocks no longer resident on `medium`.
- `AllBlocksCleared`: the engine dropped its whole cache (reset or restart).

Beam's hybrid attention gives every block two KV lifetimes, published as two groups:
`group_idx` `FULL_GROUP` (`kv_cache_spec_kind` `"full_attention"`) for the full-attention layers,
and `WINDOW_GROUP` (`"sliding_window"`, with `kv_cache_spec_sliding_window` set: the window the
worker really runs, which the router takes as that worker's geometry) for the sliding-window
layers, so a consumer can tell whether a hit's window tail is still resident.

Wire format (vLLM 0.33, and SGLang 0.5.23's variant), byte for byte as the engines write it
(``vllm/distributed/kv_events.py``, ``sglang/srt/disaggregation/kv_events.py``):

- payload = msgpack of the batch as a positional array ``[ts, events, dp_rank]`` (a None
  rank is written as nil by both engines; ``ts`` always float64);
- each event a msgpack map, first key ``"type"`` = the class name, then the fields in
  declaration order; fields that have a default in the engine's struct and still hold it are
  omitted (vLLM's required fields are always written, None as nil).

The ZMQ framing around a payload (``[topic, seq, payload]`` frames, the replay socket) belongs
to the publisher and the subscriber, not to this module. The payloads are built with plain
``msgpack``; tests check them byte for byte against payloads the engines' own ``msgspec``
encoders produced (docs/kv-events.md says how).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeAlias

import msgpack

__all__ = [
    "END_SEQ",
    "FULL_ATTENTION_KIND",
    "FULL_GROUP",
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MEDIUM_STORAGE",
    "SGLANG_MEDIUM_CPU_PINNED",
    "SGLANG_MEDIUM_DISK",
    "SGLANG_MEDIUM_EXTERNAL",
    "SGLANG_MEDIUM_GPU",
    "SLIDING_WINDOW_KIND",
    "SPEC_KIND_FULL_ATTENTION",
    "SPEC_KIND_SLIDING_WINDOW",
    "WINDOW_GROUP",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatchLike",
    "ExternalBlockHash",
    "KVEvent",
    "KVEventBatch",
    "KVEventDecodeError",
    "KVEventEncodeError",
    "KVEventSink",
    "WireFormat",
    "decode_batch",
    "encode_batch",
    "event_to_wire",
]

WireFormat: TypeAlias = Literal["vllm", "sglang"]
# vLLM publishes int hashes by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1: the last 8
# bytes of the digest, unsigned) and raw digests (msgpack bin) when that is set to 0.
ExternalBlockHash: TypeAlias = int | bytes

# Media (vllm/distributed/kv_events.py MEDIUM_*; sglang StorageMedium values).
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
SGLANG_MEDIUM_GPU = "GPU"
SGLANG_MEDIUM_CPU_PINNED = "CPU_PINNED"
SGLANG_MEDIUM_DISK = "DISK"
SGLANG_MEDIUM_EXTERNAL = "EXTERNAL"

# vllm/v1/kv_cache_interface.py KVCacheSpecKind values for Beam's two KV lifetimes.
SPEC_KIND_FULL_ATTENTION = "full_attention"
SPEC_KIND_SLIDING_WINDOW = "sliding_window"

# Replay end marker (the publisher's replay socket): seq -1 as 8 signed big-endian bytes.
END_SEQ = (-1).to_bytes(8, "big", signed=True)

# Beam's two KV cache groups (the engines' `group_idx` order) and their kinds.
FULL_GROUP = 0
WINDOW_GROUP = 1
FULL_ATTENTION_KIND = SPEC_KIND_FULL_ATTENTION
SLIDING_WINDOW_KIND = SPEC_KIND_SLIDING_WINDOW


class KVEventEncodeError(ValueError):
    """An event that the chosen wire format cannot carry."""


class KVEventDecodeError(ValueError):
    """A payload that is not a KV event batch of the given wire format."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks entered the cache: one event per run of chained blocks of one group.

    ``block_hashes`` are the event integers (or raw digests) of the stored blocks in chain
    order; ``parent_block_hash`` the hash of the block before the first (None at the start
    of a sequence); ``token_ids`` the tokens of all of them (``block_size`` per block).
    ``group_idx`` / ``kv_cache_spec_kind`` / ``kv_cache_spec_sliding_window`` tell a consumer
    which KV cache group the blocks belong to — for Beam, ``"full_attention"`` blocks (kept for
    the whole context) apart from ``"sliding_window"`` blocks (window 512, freed as it slides).
    ``cache_salt`` exists only in SGLang's format (vLLM folds the salt into the hash).
    """

    block_hashes: tuple[ExternalBlockHash, ...]
    parent_block_hash: ExternalBlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: tuple[tuple[int, ...], ...] | None = None
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        # Accept lists from callers; store tuples so events stay hashable and immutable.
        object.__setattr__(self, "block_hashes", tuple(self.block_hashes))
        object.__setattr__(self, "token_ids", tuple(self.token_ids))
        if self.extra_keys is not None:
            object.__setattr__(
                self,
                "extra_keys",
                tuple(None if k is None else tuple(k) for k in self.extra_keys),
            )
        if self.lookahead_token_ids is not None:
            object.__setattr__(
                self, "lookahead_token_ids", tuple(tuple(t) for t in self.lookahead_token_ids)
            )


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks left the cache (evicted or freed); ``group_idx`` as in ``BlockStored``."""

    block_hashes: tuple[ExternalBlockHash, ...]
    medium: str | None = MEDIUM_GPU
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_hashes", tuple(self.block_hashes))


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole prefix cache was reset."""


KVEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatchLike(Protocol):
    """Anything batch-shaped: ``KVEventBatch`` or an engine's own batch type with the same
    attribute names. Events are encoded by class name (``BlockStored`` / ``BlockRemoved`` /
    ``AllBlocksCleared``) and vLLM field names; a field the object lacks counts as None."""

    @property
    def ts(self) -> float: ...

    @property
    def events(self) -> Sequence[object]: ...

    @property
    def data_parallel_rank(self) -> int | None: ...


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    """One published message: events of one scheduler step, stamped with wall time ``ts``
    (seconds since the epoch, float) and the data-parallel rank that produced them (vLLM's
    ``data_parallel_rank``, SGLang's ``attn_dp_rank``)."""

    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "events", tuple(self.events))
        object.__setattr__(self, "ts", float(self.ts))


# --- encoding --------------------------------------------------------------------------------
# Field lists in the engines' declaration order. "required" fields have no default in the
# engine's msgspec struct and are always written; "optional" ones are omitted while None.

_VLLM_STORED_REQUIRED = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
)
_VLLM_STORED_OPTIONAL = (
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
)
_VLLM_REMOVED_REQUIRED = ("block_hashes", "medium")
_VLLM_REMOVED_OPTIONAL = ("group_idx", "locality", "ownership")

_SGLANG_STORED_REQUIRED = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
)
_SGLANG_STORED_OPTIONAL = ("medium", "cache_salt", "session_id", "lora_name")
_SGLANG_REMOVED_REQUIRED = ("block_hashes",)
_SGLANG_REMOVED_OPTIONAL = ("medium",)

_VLLM_ONLY_STORED = (
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "lookahead_token_ids",
)
_VLLM_ONLY_REMOVED = ("group_idx", "locality", "ownership")


def _wire_value(value: Any) -> Any:
    # Tuples encode as msgpack arrays either way; lists keep nested tuples readable.
    if isinstance(value, tuple):
        return [_wire_value(v) for v in value]
    return value


# The engines' msgspec encoder sizes a struct's map header by the struct's field count (tag
# included), not by the fields written: vLLM's BlockStored (16) always gets a map16 header
# (0xde + 2 bytes) even with 8 keys; the other structs have ≤ 15 and get a fixmap.
_MAP16_STRUCTS = {("vllm", "BlockStored")}


def _fields_map(
    event: object, type_name: str, required: Sequence[str], optional: Sequence[str]
) -> dict[str, Any]:
    out: dict[str, Any] = {"type": type_name}
    for name in required:
        out[name] = _wire_value(getattr(event, name, None))
    for name in optional:
        value = getattr(event, name, None)
        if value is not None:
            out[name] = _wire_value(value)
    return out


def _refuse_set(event: object, names: Sequence[str], fmt: str, why: str) -> None:
    present = [n for n in names if getattr(event, n, None) is not None]
    if present:
        raise KVEventEncodeError(
            f"{type(event).__name__} fields {present} do not exist in {fmt}'s format; {why}"
        )


def event_to_wire(event: object, wire_format: WireFormat = "vllm") -> dict[str, Any]:
    """The msgpack map of one event (``{"type": ClassName, field: value, ...}``) in order.

    ``event`` is one of this module's event classes or any object whose class has the same
    name and carries the vLLM field names (missing fields count as None).
    """
    kind = type(event).__name__
    if kind not in ("BlockStored", "BlockRemoved", "AllBlocksCleared"):
        raise KVEventEncodeError(
            f"cannot encode {kind}: KV events are BlockStored, BlockRemoved or AllBlocksCleared"
        )
    if kind == "AllBlocksCleared":
        return {"type": "AllBlocksCleared"}
    if wire_format == "vllm":
        if kind == "BlockStored":
            _refuse_set(
                event,
                ("cache_salt",),
                "vLLM",
                "vLLM folds the salt into the block hash (hash_blocks_vllm(cache_salt=...))",
            )
            return _fields_map(event, "BlockStored", _VLLM_STORED_REQUIRED, _VLLM_STORED_OPTIONAL)
        return _fields_map(event, "BlockRemoved", _VLLM_REMOVED_REQUIRED, _VLLM_REMOVED_OPTIONAL)
    if wire_format == "sglang":
        why = (
            "SGLang events carry no KV cache group, so publish only the full-attention "
            "group in SGLang mode"
        )
        if kind == "BlockStored":
            _refuse_set(event, _VLLM_ONLY_STORED, "SGLang", why)
            return _fields_map(
                event, "BlockStored", _SGLANG_STORED_REQUIRED, _SGLANG_STORED_OPTIONAL
            )
        _refuse_set(event, _VLLM_ONLY_REMOVED, "SGLang", why)
        return _fields_map(
            event, "BlockRemoved", _SGLANG_REMOVED_REQUIRED, _SGLANG_REMOVED_OPTIONAL
        )
    raise KVEventEncodeError(f"unknown wire format {wire_format!r}; choose 'vllm' or 'sglang'")


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes([0x90 | n])
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def _pack_event(event: object, wire_format: WireFormat, pack: Callable[[Any], bytes]) -> bytes:
    fields = event_to_wire(event, wire_format)
    n = len(fields)
    if (wire_format, fields["type"]) in _MAP16_STRUCTS:
        head = b"\xde" + n.to_bytes(2, "big")
    else:
        head = bytes([0x80 | n])
    return head + b"".join(pack(k) + pack(v) for k, v in fields.items())


def encode_batch(
    batch: EventBatchLike,
    wire_format: WireFormat = "vllm",
    *,
    data_parallel_rank: int | None = None,
) -> bytes:
    """The msgpack payload of a batch, byte-identical to the engine's msgspec encoding.

    ``data_parallel_rank`` fills in for a batch whose own rank is None (as the engines'
    publishers stamp theirs). Raises ``KVEventEncodeError`` for a field the format cannot
    carry and for values msgpack cannot hold (ints outside [-2^63, 2^64)).
    """
    rank = batch.data_parallel_rank
    if rank is None:
        rank = data_parallel_rank
    packer = msgpack.Packer(use_bin_type=True)
    # Both engines write all three slots (msgspec keeps defaults in array_like structs): a
    # None rank is nil.
    try:
        parts = [
            b"\x93",
            packer.pack(batch.ts),
            _array_header(len(batch.events)),
            *(_pack_event(e, wire_format, packer.pack) for e in batch.events),
            packer.pack(rank),
        ]
    except (OverflowError, TypeError, ValueError) as exc:
        if isinstance(exc, KVEventEncodeError):
            raise
        raise KVEventEncodeError(f"cannot encode KV event batch: {exc}") from exc
    return b"".join(parts)


def _as_tuple(value: Any, what: str) -> tuple[Any, ...]:
    if not isinstance(value, list | tuple):
        raise KVEventDecodeError(f"{what}: expected an array, got {type(value).__name__}")
    return tuple(value)


def _decode_event(obj: Any, wire_format: WireFormat) -> KVEvent:
    if not isinstance(obj, dict) or "type" not in obj:
        raise KVEventDecodeError(f"event is not a tagged map: {obj!r:.200}")
    fields = dict(obj)
    tag = fields.pop("type")
    try:
        if tag == "AllBlocksCleared":
            return AllBlocksCleared()
        if tag == "BlockStored":
            fields.setdefault("medium", None)
            if fields.get("extra_keys") is not None:
                fields["extra_keys"] = tuple(
                    None if k is None else _as_tuple(k, "extra_keys entry")
                    for k in fields["extra_keys"]
                )
            return BlockStored(**fields)
        if tag == "BlockRemoved":
            fields.setdefault("medium", None)
            return BlockRemoved(**fields)
    except TypeError as exc:
        raise KVEventDecodeError(f"{tag} in {wire_format} format: {exc}") from exc
    raise KVEventDecodeError(f"unknown event type {tag!r}")


def decode_batch(payload: bytes, wire_format: WireFormat = "vllm") -> KVEventBatch:
    """Inverse of ``encode_batch`` (tolerates unknown-free payloads of either engine)."""
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:
        raise KVEventDecodeError(f"payload is not msgpack: {exc}") from exc
    if not isinstance(obj, list) or len(obj) not in (2, 3):
        raise KVEventDecodeError("batch is not a [ts, events, dp_rank] array")
    ts, events = obj[0], obj[1]
    rank = obj[2] if len(obj) == 3 else None
    if not isinstance(events, list):
        raise KVEventDecodeError("batch events is not an array")
    return KVEventBatch(float(ts), tuple(_decode_event(e, wire_format) for e in events), rank)


class KVEventSink(Protocol):
    """Receives each batch once, in order; must not block (publishers queue internally)."""

    def __call__(self, batch: KVEventBatch, /) -> None: ...
