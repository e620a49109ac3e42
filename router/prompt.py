"""From a client request to the token ids and block hashes the engine will cache.

Precise mode (a checkpoint directory is configured): render the chat exactly as the engine does
(`beamserve.kvwire.codec.PromptCodec`: the checkpoint's chat template and tokenizer)
and hash `block_size`-token blocks with the engine's scheme (the router's default KV geometry;
a worker that reports another block size or scheme gets the prompt hashed in its own, once per
distinct geometry and request: `PromptKey.hashes_for`) — vLLM's chained sha256 for vLLM,
`sim` and `ref` workers; SGLang's page hash for SGLang workers — so the router's index keys are
the very hashes the engines publish in their KV events.

Approximate mode (no checkpoint): a deterministic word-level pseudo-tokenizer
(`ApproxCodec`); the hashes only ever match the router's own routing-time predictions, which is
what prefix affinity needs when engine events cannot be matched.

Continuing turns are incremental, with results identical to the from-scratch computation:

* **Tokens.** The rendered prompt is cut right before each occurrence of a *split token*, a
  string at which tokenization provably restarts (`split_tokens`): for `PromptCodec`, the
  tokenizer's special added tokens such as `<|im_start|>` — HF `tokenizers` extracts added
  tokens (leftmost-longest) before it normalizes, pre-tokenizes and runs the model on each
  piece between them, so when no added token can overlap an occurrence of the split token,
  every occurrence starts an extracted token and the encoding of the whole text is the
  concatenation of the encodings of the segments. For `ApproxCodec`: any string that starts
  with punctuation (a piece of its own in `_PIECE`); and, since its pieces are runs of one
  character class, a long segment is cut further every `chunk_chars` characters at the next
  change of class (`piece_chunks`) — cuts that depend only on the text before them, so a
  message that grows by appending (an agent's one long user turn) keeps its earlier chunks.
  Token ids per segment string live in a bounded LRU (`SegmentCache`), so a turn only
  tokenizes its new text.
* **Block hashes.** A bounded LRU trie of blocks (`BlockCache`): (parent node, the block's
  tokens as uint32 bytes) → (node, digest, event id), rooted per scheme, block size and vLLM
  `NONE_HASH`. Dict keys compare by value, so a hit is exact: only blocks past the longest
  cached prefix are hashed, chained on the cached digest — whichever session shared it.
* **A session's next turn.** With a session id (`PromptHasher.key(..., session=...)`), the
  hasher keeps that session's last prompt (`TurnMemo`: its text, its pieces' lengths and
  tokens, its block chain). A prompt whose text starts with the last one's is keyed from
  there: its pieces are the last prompt's up to one that ends at least one split token's
  length before that text's end (`PromptHasher._restart`), then `split` of the rest; only
  the rest is tokenized, and only the blocks past the kept tokens are hashed, chained on the
  kept chain's digest. The cost follows the turn's new text, not the conversation's length.
"""

from __future__ import annotations

import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from beamserve.kvwire.codec import ApproxCodec, Codec, PromptCodec
from beamserve.kvwire.geometry import HashScheme, KVGeometry
from beamserve.kvwire.hashing import chain_sglang_u32, chain_vllm, hash_blocks_sglang, none_hash
from beamserve.router.api.convert import UpstreamCall

__all__ = ["HashScheme", "PromptHasher", "PromptKey", "PromptTooLong"]

APPROX_SPLIT_TOKENS = ("<|im_start|>",)
DEFAULT_SEGMENT_CACHE_BYTES = 128 << 20
DEFAULT_CHUNK_CHARS = 4096
DEFAULT_BLOCK_CACHE_BLOCKS = 1 << 17  # 8.4M tokens of 64-token blocks, ≈ 70 MB
DEFAULT_TURN_MEMO_BYTES = 128 << 20  # ≈ 150 sessions of 100K tokens; more of fewer
_U32 = "I" if array("I").itemsize == 4 else "L"  # a 4-byte unsigned C type
_LITTLE = sys.byteorder == "little"  # native uint32 bytes are SGLang's page bytes

# A segment's tokens: their ids as native uint32 bytes when every id fits (4 bytes a token,
# decoded only when the ids themselves are read), else the ids.
_Part = tuple[int, ...] | bytes


def _part_len(part: _Part) -> int:
    return len(part) // 4 if isinstance(part, bytes) else len(part)


def _part_ids(part: _Part) -> Sequence[int]:
    return array(_U32, part).tolist() if isinstance(part, bytes) else part


def _joined_ids(parts: Sequence[_Part]) -> list[int]:
    out: list[int] = []
    for part in parts:
        out += _part_ids(part)
    return out


class PromptKey:
    """A request's prompt as routing sees it: its token ids, the event ids of its full blocks
    (in the hasher's scheme), and whether they are the engine's (precise mode).

    `PromptKey(token_ids, block_hashes, precise)`; from `PromptHasher.key` the `token_ids`
    tuple is only assembled (from cached segments) when first read — routing needs only
    `prompt_tokens` and `block_hashes`. `hashes_for(geometry)`: the block hashes in another
    KV geometry (a worker with its own block size or scheme), computed once per geometry."""

    __slots__ = (
        "_buf",
        "_by_layout",
        "_hasher",
        "_ids",
        "_parts",
        "_rest",
        "block_hashes",
        "precise",
        "prompt_tokens",
    )

    def __init__(
        self, token_ids: Sequence[int], block_hashes: tuple[int, ...], precise: bool
    ) -> None:
        self._ids: tuple[int, ...] | None = tuple(token_ids)
        self._parts: Sequence[_Part] = ()
        self._buf: bytes | None = None
        self._hasher: PromptHasher | None = None
        self._by_layout: dict[tuple[int, str], tuple[int, ...]] | None = None
        self._rest: _Rest | None = None
        self.prompt_tokens = len(self._ids)
        self.block_hashes = block_hashes
        self.precise = precise

    @classmethod
    def of_parts(
        cls, parts: Sequence[_Part], block_hashes: tuple[int, ...], precise: bool
    ) -> PromptKey:
        """The key whose token ids are the concatenation of `parts` (ids, or ids as native
        uint32 bytes; assembled lazily)."""
        key = cls((), block_hashes, precise)
        one = parts[0] if len(parts) == 1 else None
        key._ids, key._parts = (one if isinstance(one, tuple) else None), parts
        key.prompt_tokens = sum(map(_part_len, parts))
        return key

    def hashes_for(self, geometry: KVGeometry) -> tuple[int, ...]:
        """The prompt's block hashes in `geometry`'s block size and hash scheme (its window and
        event format do not change them); its own `block_hashes` when they already are."""
        hasher = self._hasher
        if hasher is None:
            return ()
        bs, scheme = geometry.block_size, geometry.hash_scheme
        if bs == hasher.block_size and scheme == hasher.scheme:
            return self.block_hashes
        cache = self._by_layout
        if cache is None:
            cache = self._by_layout = {}
        out = cache.get((bs, scheme))
        if out is None:
            parts = list(self._parts) if self._parts else [self.token_ids]
            out = cache[(bs, scheme)] = hasher.hashes_in(parts, self._buf, bs, scheme)
        return out

    @property
    def partial(self) -> bool:
        """A *head* key (`PromptHasher.key(..., head_chars=...)`): its `block_hashes` and token
        ids cover the prompt's first segments only, and `prompt_tokens` is an estimate of the
        whole prompt's; `grow` and `complete` go further."""
        return self._rest is not None

    def grow(self, factor: int = 4) -> PromptKey:
        """A head `factor` times as long (the whole key once that is half the prompt or
        more); the whole key of a key that is not partial is itself."""
        rest, hasher = self._rest, self._hasher
        if rest is None or hasher is None:
            return self
        segs, chars = rest
        return hasher.head_key(segs, chars * factor)

    def complete(self) -> PromptKey:
        """The whole prompt's key (itself when not partial). Tokenizes and hashes only what
        the head did not (the segment and block caches hold the head's)."""
        rest, hasher = self._rest, self._hasher
        if rest is None or hasher is None:
            return self
        return hasher.whole_key(rest[0])

    @property
    def token_ids(self) -> tuple[int, ...]:
        ids = self._ids
        if ids is None:
            ids = self._ids = tuple(_joined_ids(self._parts))
        return ids

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PromptKey):
            return NotImplemented
        return (self.token_ids, self.block_hashes, self.precise) == (
            other.token_ids,
            other.block_hashes,
            other.precise,
        )

    def __hash__(self) -> int:
        return hash((self.token_ids, self.block_hashes, self.precise))

    def __repr__(self) -> str:
        return (
            f"PromptKey(token_ids=<{self.prompt_tokens} tokens>, "
            f"block_hashes=<{len(self.block_hashes)} blocks>, precise={self.precise})"
        )


def _piece_class(c: str) -> int:
    """`ApproxCodec`'s piece classes: 0 whitespace (`\\s`), 1 word (`\\w`), 2 other (a piece
    of its own)."""
    if c.isspace():
        return 0
    return 1 if c.isalnum() or c == "_" else 2


def piece_chunks(seg: str, size: int) -> list[str]:
    """`seg` cut about every `size` characters, each cut at the first index ≥ the target where
    `ApproxCodec` starts a new piece whatever came before (the two characters differ in class,
    or one is of neither run class); `"".join` gives `seg` back."""
    n = len(seg)
    if size <= 0 or n <= size:
        return [seg]
    out: list[str] = []
    start = 0
    while n - start > size:
        i = start + size
        while i < n:
            a, b = _piece_class(seg[i - 1]), _piece_class(seg[i])
            if a != b or a == 2:
                break
            i += 1
        if i >= n:
            break
        out.append(seg[start:i])
        start = i
    out.append(seg[start:])
    return out


def _straddles(token: str, split: str) -> bool:
    """Could an occurrence of `token` start before an occurrence of `split` and end inside or
    past its start? (A proper suffix of `token` and `split` agree on their common length.)"""
    return any(
        token[k:].startswith(split) or split.startswith(token[k:]) for k in range(1, len(token))
    )


def split_tokens(codec: Codec) -> tuple[str, ...]:
    """The strings before which `codec.encode` provably restarts (module docstring); empty when
    none is safe (then a prompt is cached whole).

    `PromptCodec`: special added tokens that are matched on the raw text (`normalized` false),
    strip nothing on their left, are not `single_word` (no added token is: its match depends on
    the neighbouring characters), start with a non-space character, and that no added token
    can straddle; the tokenizer must not encode special tokens as text, truncate or pad.
    Subclasses and other codecs: none."""
    if type(codec) is ApproxCodec:
        return APPROX_SPLIT_TOKENS
    if type(codec) is not PromptCodec:
        return ()
    tok = codec.tokenizer
    try:
        if tok.encode_special_tokens or tok.truncation is not None or tok.padding is not None:
            return ()
        added = list(tok.get_added_tokens_decoder().values())
    except AttributeError:  # not an HF `tokenizers.Tokenizer`
        return ()
    if any(a.single_word for a in added):
        return ()
    contents = [str(a.content) for a in added if a.content]
    candidates = [
        str(a.content)
        for a in added
        if a.special and not a.normalized and not a.lstrip and a.content
        if not str(a.content)[0].isspace()
    ]
    return tuple(s for s in candidates if not any(_straddles(t, s) for t in contents))


class SegmentCache:
    """Bounded LRU: rendered segment → its tokens (`_Part`: native uint32 bytes, or the ids
    when one does not fit).

    Size: each entry counts `len(segment) + 4 · tokens` bytes (the string and the uint32
    bytes; `12 · tokens` for an ids tuple) plus 100; the least recently used entries go once
    the total passes `max_bytes`. Thread-safe."""

    def __init__(self, max_bytes: int = DEFAULT_SEGMENT_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._d: OrderedDict[str, _Part] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._d)

    @staticmethod
    def _cost(seg: str, part: _Part) -> int:
        return len(seg) + (len(part) if isinstance(part, bytes) else 12 * len(part)) + 100

    def get_many(self, segs: Sequence[str]) -> list[_Part | None]:
        d = self._d
        with self._lock:
            out = [d.get(s) for s in segs]
            for s, e in zip(segs, out, strict=True):
                if e is not None:
                    d.move_to_end(s)
        return out

    def put(self, seg: str, entry: _Part) -> None:
        cost = self._cost(seg, entry)
        if cost > self.max_bytes:
            return
        d = self._d
        with self._lock:
            old = d.pop(seg, None)
            if old is not None:
                self.bytes -= self._cost(seg, old)
            d[seg] = entry
            self.bytes += cost
            while self.bytes > self.max_bytes and d:
                k, v = d.popitem(last=False)
                self.bytes -= self._cost(k, v)


_Node = tuple[int, bytes, int]  # node serial, raw digest, event id


class BlockCache:
    """Bounded LRU trie of hashed blocks (module docstring).

    Two maps: one entry per block, (parent node, block bytes) → node; and one per aligned run
    of `stride` blocks, (node before the run, the run's bytes) → its `stride` nodes, so a long
    cached prefix is walked `stride` blocks a lookup. Keys compare by value: a hit is exact.
    `max_blocks` per-block entries (and `max_blocks / stride` runs) at most, least recently
    used first out; evicting an inner node leaves its descendants unreachable until they age
    out too. Thread-safe."""

    def __init__(self, max_blocks: int = DEFAULT_BLOCK_CACHE_BLOCKS, stride: int = 16) -> None:
        self.max_blocks = max_blocks
        self.stride = max(1, stride)
        self._d: OrderedDict[tuple[int, bytes], _Node] = OrderedDict()
        self._runs: OrderedDict[tuple[int, bytes], tuple[_Node, ...]] = OrderedDict()
        self._roots: dict[tuple[Any, ...], int] = {}
        self._serial = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._d)

    def root(self, key: tuple[Any, ...]) -> int:
        """The node a chain starts from, one per `key` (scheme, block size, first parent)."""
        with self._lock:
            node = self._roots.get(key)
            if node is None:
                self._serial += 1
                node = self._roots[key] = self._serial
            return node

    def walk(self, root: int, buf: bytes, step: int, n_blocks: int) -> tuple[list[_Node], int]:
        """The nodes of the longest cached prefix of the `n_blocks` blocks of `step` bytes in
        `buf`, and how many leading runs were found whole."""
        out: list[_Node] = []
        node, i, s = root, 0, self.stride
        runs, d = self._runs, self._d
        with self._lock:
            if s > 1:
                while i + s <= n_blocks:
                    key = (node, buf[i * step : (i + s) * step])
                    run = runs.get(key)
                    if run is None:
                        break
                    runs.move_to_end(key)
                    out += run
                    node, i = run[-1][0], i + s
            n_runs = i // s
            while i < n_blocks:
                key = (node, buf[i * step : (i + 1) * step])
                hit = d.get(key)
                if hit is None:
                    break
                d.move_to_end(key)
                out.append(hit)
                node, i = hit[0], i + 1
        return out, n_runs

    def extend(
        self,
        root: int,
        nodes: list[_Node],
        new: Sequence[tuple[bytes, int]],
        buf: bytes,
        step: int,
        n_runs: int,
    ) -> list[_Node]:
        """Append the blocks hashed past the cached prefix `nodes` ((digest, event id) each, in
        order) and record the runs not yet recorded past the first `n_runs`; the whole chain."""
        d, runs, s = self._d, self._runs, self.stride
        k = len(nodes)
        with self._lock:
            chain_ = list(nodes)
            node = nodes[-1][0] if nodes else root
            for j, (digest, event_id) in enumerate(new):
                self._serial += 1
                entry = (self._serial, digest, event_id)
                d[(node, buf[(k + j) * step : (k + j + 1) * step])] = entry
                chain_.append(entry)
                node = self._serial
            if s > 1:
                for r in range(n_runs, len(chain_) // s):
                    before = chain_[r * s - 1][0] if r else root
                    run = tuple(chain_[r * s : (r + 1) * s])
                    runs[(before, buf[r * s * step : (r + 1) * s * step])] = run
            while len(d) > self.max_blocks:
                d.popitem(last=False)
            while len(runs) > self.max_blocks // s:
                runs.popitem(last=False)
        return chain_


_Tokens = tuple[list[_Part], bytes | None]  # the parts, and all their uint32 bytes (or None)


class _LastTurn(NamedTuple):
    """A session's last prompt as `PromptHasher.key` keyed it (`TurnMemo`)."""

    text: str
    seg_lens: list[int]  # its pieces' lengths (`split`), in order
    parts: list[_Part]  # their tokens (uint32 bytes each)
    nodes: list[_Node]  # its full blocks' chain (the block trie's nodes)
    hashes: tuple[int, ...]  # their event ids


class TurnMemo:
    """Bounded LRU: session id → its last prompt (`_LastTurn`). An entry counts its text's
    characters, 4 bytes a token and 64 a block, plus 100; the least recently used go once the
    total passes `max_bytes` (an entry over it is not kept). Thread-safe."""

    def __init__(self, max_bytes: int = DEFAULT_TURN_MEMO_BYTES) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._d: OrderedDict[str, tuple[_LastTurn, int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._d)

    def get(self, session: str) -> _LastTurn | None:
        with self._lock:
            hit = self._d.get(session)
            if hit is None:
                return None
            self._d.move_to_end(session)
            return hit[0]

    def discard(self, session: str) -> None:
        with self._lock:
            old = self._d.pop(session, None)
            if old is not None:
                self.bytes -= old[1]

    def put(self, session: str, turn: _LastTurn) -> None:
        tokens = sum(map(_part_len, turn.parts))
        cost = len(turn.text) + 4 * tokens + 64 * len(turn.nodes) + 100
        with self._lock:
            old = self._d.pop(session, None)
            if old is not None:
                self.bytes -= old[1]
            if cost > self.max_bytes:
                return
            self._d[session] = (turn, cost)
            self.bytes += cost
            while self.bytes > self.max_bytes and self._d:
                _k, (_t, c) = self._d.popitem(last=False)
                self.bytes -= c


class PromptTooLong(ValueError):
    """The prompt has at least `floor` tokens, over the limit given to `PromptHasher.key`."""

    def __init__(self, floor: int) -> None:
        super().__init__(f"the prompt has at least {floor} tokens")
        self.floor = floor


class PromptHasher:
    """The prompt key of a request (module docstring), incremental across turns.

    `segment_cache_bytes` / `block_cache_blocks` / `turn_memo_bytes` bound the caches and
    the sessions' last prompts (0 turns one off); results never depend on them. Safe to call
    from several threads."""

    def __init__(
        self,
        model_dir: str | Path | None = None,
        *,
        block_size: int = 64,
        scheme: HashScheme = "vllm",
        segment_cache_bytes: int = DEFAULT_SEGMENT_CACHE_BYTES,
        chunk_chars: int = DEFAULT_CHUNK_CHARS,
        block_cache_blocks: int = DEFAULT_BLOCK_CACHE_BLOCKS,
        turn_memo_bytes: int = DEFAULT_TURN_MEMO_BYTES,
    ) -> None:
        self.codec: Codec = (
            PromptCodec.from_model_dir(model_dir) if model_dir is not None else ApproxCodec()
        )
        self.precise = model_dir is not None
        self.block_size = block_size
        self.scheme: HashScheme = scheme
        self.segments = SegmentCache(segment_cache_bytes)
        self.blocks = BlockCache(block_cache_blocks)
        self.split_tokens = split_tokens(self.codec)
        self.turns = TurnMemo(turn_memo_bytes)
        # Cutting inside a segment is provably safe for ApproxCodec only (`piece_chunks`).
        self.chunk_chars = chunk_chars if type(self.codec) is ApproxCodec else 0

    # --- tokens ----------------------------------------------------------------------------

    def split(self, text: str) -> list[str]:
        """`text` cut before each occurrence of a split token (`split_tokens`); `"".join` of
        the pieces gives it back."""
        cuts: list[int] = []
        for tok in self.split_tokens:
            at = text.find(tok)
            while at >= 0:
                cuts.append(at)
                at = text.find(tok, at + len(tok))
        segs: list[str] = []
        if cuts:
            if len(self.split_tokens) > 1:
                cuts.sort()
            prev = 0
            for cut in cuts:
                if cut > prev:
                    segs.append(text[prev:cut])
                    prev = cut
            segs.append(text[prev:])
        else:
            segs = [text]
        size = self.chunk_chars
        if size and any(len(seg) > size for seg in segs):
            return [c for seg in segs for c in piece_chunks(seg, size)]
        return segs

    def _encode_segment(self, seg: str) -> _Part:
        codec = self.codec
        if type(codec) is ApproxCodec and codec.vocab_size <= 1 << 32:
            return codec.encode_u32(seg)  # the uint32 bytes without an int per token
        raw = codec.encode(seg)
        buf = _uint32(raw)
        return buf if buf is not None else tuple(raw)

    def _encode(self, text: str) -> _Tokens:
        return self._encode_segs(self.split(text))

    def _encode_segs(self, segs: Sequence[str]) -> _Tokens:
        if self.segments.max_bytes <= 0:
            entries = [self._encode_segment(s) for s in segs]
        else:
            entries = []
            for seg, hit in zip(segs, self.segments.get_many(segs), strict=True):
                if hit is None:
                    hit = self._encode_segment(seg)
                    self.segments.put(seg, hit)
                entries.append(hit)
        if all(isinstance(e, bytes) for e in entries):
            return entries, b"".join(entries)  # type: ignore[arg-type]
        return entries, None

    def encode(self, text: str) -> tuple[int, ...]:
        """`tuple(self.codec.encode(text))`, from the segment cache where it can."""
        return tuple(_joined_ids(self._encode(text)[0]))

    def _call_tokens(self, call: UpstreamCall, limit: int | None = None) -> _Tokens:
        prompt = call.prompt
        if isinstance(prompt, list):
            ids = tuple(int(t) for t in prompt)
            buf = _uint32(ids)
            return ([buf] if buf is not None else [ids]), buf
        text = self._text(call)
        if limit is not None and (floor := self.token_floor(text)) > limit:
            raise PromptTooLong(floor)
        return self._encode(text)

    def _text(self, call: UpstreamCall) -> str:
        """The text prompt the worker tokenizes (a chat rendered as the engine renders it)."""
        if isinstance(call.prompt, str):
            return call.prompt
        tools: Any = call.body.get("tools")
        return self.codec.render(call.messages_for_session, tools)

    def token_floor(self, text: str) -> int:
        """A number of tokens `text` has at least, known without tokenizing it: no token of a
        checkpoint's vocabulary covers more than its longest entry's characters, halved for
        normalizers that compose characters. 0 in approximate mode (no such bound)."""
        longest = getattr(self.codec, "longest_token_chars", None)
        return len(text) // (2 * longest) if isinstance(longest, int) and longest > 0 else 0

    def token_ids(self, call: UpstreamCall) -> list[int]:
        return _joined_ids(self._call_tokens(call)[0])

    # --- block hashes ----------------------------------------------------------------------

    @staticmethod
    def _scratch(
        token_ids: Sequence[int], parent: bytes | None, bs: int, scheme: HashScheme
    ) -> list[tuple[bytes, int]]:
        if scheme == "sglang":
            pages = hash_blocks_sglang(token_ids, bs, parent=parent, include_partial=False)
            return [(b.digest, b.event_id) for b in pages]
        return chain_vllm(token_ids, bs, parent)

    @staticmethod
    def _scratch_u32(
        buf: bytes, parent: bytes | None, bs: int, scheme: HashScheme
    ) -> list[tuple[bytes, int]]:
        """`_scratch` of the tokens in `buf` (native uint32), hashing SGLang pages from the
        bytes themselves where they are SGLang's (little-endian)."""
        if scheme == "sglang" and _LITTLE:
            return chain_sglang_u32(buf, bs, parent)
        return PromptHasher._scratch(array(_U32, buf).tolist(), parent, bs, scheme)

    def _hashes(self, parts: list[_Part], buf: bytes | None) -> tuple[int, ...]:
        return self.hashes_in(parts, buf, self.block_size, self.scheme)

    def hashes_in(
        self, parts: Sequence[_Part], buf: bytes | None, bs: int, scheme: HashScheme
    ) -> tuple[int, ...]:
        """Event ids of the full `bs`-token blocks of the concatenated `parts` (`buf`: their
        uint32 bytes, or None) in `scheme`, through the block cache (rooted per scheme and
        block size, so geometries never share entries)."""
        if buf is None or self.blocks.max_blocks <= 0:
            return tuple(e for _, e in self._scratch(_joined_ids(parts), None, bs, scheme))
        return tuple([node[2] for node in self._chain(buf, bs, scheme)])

    def _chain(
        self, buf: bytes, bs: int, scheme: HashScheme, kept: Sequence[_Node] = ()
    ) -> list[_Node]:
        """The trie nodes of the full `bs`-token blocks of `buf` (uint32 bytes), through the
        block cache. `kept`: the nodes of its first blocks, known already (then the blocks
        past them are hashed without a lookup)."""
        step = 4 * bs  # bytes per block in `buf`
        n = len(buf) // step
        if n == 0:
            return []
        if scheme == "sglang":
            root_key: tuple[Any, ...] = ("sglang", bs)
            parent: bytes | None = None
        else:
            parent = none_hash()  # what hash_blocks_vllm chains the first block on, now
            root_key = ("vllm", bs, parent)
        root = self.blocks.root(root_key)
        if kept:
            nodes, n_runs = list(kept), len(kept) // self.blocks.stride
        else:
            nodes, n_runs = self.blocks.walk(root, buf, step, n)
        k = len(nodes)
        if k < n or n_runs < n // self.blocks.stride:
            if nodes:
                parent = nodes[-1][1]
            new = self._scratch_u32(buf[k * step : n * step], parent, bs, scheme)
            nodes = self.blocks.extend(root, nodes, new, buf, step, n_runs)
        return nodes

    def hashes(self, token_ids: Sequence[int]) -> tuple[int, ...]:
        """Event ids of the full blocks of `token_ids`, in this hasher's scheme."""
        ids = tuple(int(t) for t in token_ids)
        return self._hashes([ids], _uint32(ids))

    def key(
        self,
        call: UpstreamCall,
        limit: int | None = None,
        *,
        head_chars: int = 0,
        max_chars: int | None = None,
        session: str | None = None,
    ) -> PromptKey:
        """The request's prompt key. `limit`: the most tokens it may have; a prompt that has
        more for sure (`token_floor`) raises `PromptTooLong` before being tokenized.

        `session`: the id of the session the request belongs to. Its text prompt is keyed from
        that session's last one when it starts with it (`turns`; the module docstring), and
        is the session's last from then on.

        `head_chars` > 0: in approximate mode, a text prompt of more than twice as many
        characters — and of at most `max_chars` (None: any) — gets a *head* key
        (`head_key`, `PromptKey.partial`): tokenized and hashed over its first segments only,
        with `prompt_tokens` estimated. An approximate token is one character or more, so
        `max_chars` bounds the whole prompt's tokens without counting them."""
        if head_chars > 0 and not self.precise and not isinstance(call.prompt, list):
            text = self._text(call)
            if len(text) > 2 * head_chars and (max_chars is None or len(text) <= max_chars):
                return self.head_key(self.split(text), head_chars)
        if session is not None and self._memo_on() and not isinstance(call.prompt, list):
            text = self._text(call)
            if limit is not None and (floor := self.token_floor(text)) > limit:
                raise PromptTooLong(floor)
            return self._turn_key(session, text)
        parts, buf = self._call_tokens(call, limit)
        return self._key(parts, buf)

    def _memo_on(self) -> bool:
        return self.turns.max_bytes > 0 and self.blocks.max_blocks > 0

    def _turn_key(self, session: str, text: str) -> PromptKey:
        """`text`'s key, from `session`'s last prompt where it can (the module docstring);
        the session's last prompt is `text` from now on."""
        last = self.turns.get(session)
        restart = self._restart(last, text) if last is not None else None
        seg_lens: list[int] = []
        parts: list[_Part] = []
        kept: list[_Node] = []
        hashes: tuple[int, ...] = ()
        c = 0
        if last is not None and restart is not None:
            k, c = restart
            seg_lens, parts = last.seg_lens[:k], last.parts[:k]
            kept_blocks = sum(map(_part_len, parts)) // self.block_size
            kept, hashes = last.nodes[:kept_blocks], last.hashes[:kept_blocks]
        segs = self.split(text[c:]) if c < len(text) else []
        parts = parts + self._encode_segs(segs)[0]
        if not all(isinstance(p, bytes) for p in parts):  # an id over uint32: no memo
            self.turns.discard(session)
            return self._key(parts, None)
        buf = b"".join(parts)  # type: ignore[arg-type]
        nodes = self._chain(buf, self.block_size, self.scheme, kept)
        hashes += tuple([node[2] for node in nodes[len(kept) :]])
        seg_lens += [len(x) for x in segs]
        self.turns.put(session, _LastTurn(text, seg_lens, parts, nodes, hashes))
        key = PromptKey.of_parts(parts, hashes, self.precise)
        key._hasher, key._buf = self, buf
        return key

    def _restart(self, last: _LastTurn, text: str) -> tuple[int, int] | None:
        """Where `text` is keyed anew from, when it starts with `last`'s text: (k, c) — keep
        `last`'s first k pieces, which end at character c, at least one split token's length
        before the end of `last`'s text (a split token of `text` that begins before c then
        lies inside `last`'s text, which was cut there too; and where a piece ends depends on
        no character after it). None: not an extension, or no piece to keep."""
        longest = max(map(len, self.split_tokens), default=0)
        if not longest or not text.startswith(last.text):
            return None  # (no split token: a prompt is one piece, cached whole)
        reach = len(last.text) - longest
        k, c = len(last.seg_lens), len(last.text)
        while k > 0 and c > reach:
            k -= 1
            c -= last.seg_lens[k]
        return (k, c) if k > 0 else None

    def _key(self, parts: list[_Part], buf: bytes | None) -> PromptKey:
        key = PromptKey.of_parts(parts, self._hashes(parts, buf), self.precise)
        key._hasher, key._buf = self, buf
        return key

    def whole_key(self, segs: Sequence[str]) -> PromptKey:
        """The key of the text cut into `segs` (`split`)."""
        parts, buf = self._encode_segs(segs)
        return self._key(parts, buf)

    def head_key(self, segs: list[str], head_chars: int) -> PromptKey:
        """The key of the text cut into `segs` (`split`) over its shortest run of leading
        segments of `head_chars` characters or more — tokenization restarts at every cut, so
        those are exactly the whole prompt's first tokens and blocks — with `prompt_tokens`
        the head's tokens plus the rest's characters at the head's tokens per character (no
        more than the characters: an approximate token is one or more). The whole key
        (`whole_key`) when the head would be half the text or more."""
        total = sum(map(len, segs))
        chars = j = 0
        while j < len(segs) and chars < head_chars:
            chars += len(segs[j])
            j += 1
        if 2 * chars >= total:
            return self.whole_key(segs)
        parts, buf = self._encode_segs(segs[:j])
        key = self._key(parts, buf)
        tokens = key.prompt_tokens
        key.prompt_tokens = tokens + round((total - chars) * tokens / max(chars, 1))
        key._rest = (segs, chars)
        return key


# A head key's way to the rest (`PromptKey.partial`): the prompt's segments, and the characters
# of those the head covers.
_Rest = tuple[list[str], int]


def _uint32(ids: Sequence[int]) -> bytes | None:
    try:
        return array(_U32, ids).tobytes()
    except (OverflowError, TypeError):
        return None
