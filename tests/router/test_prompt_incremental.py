"""`PromptHasher`'s caches never change a result: token ids and block hashes from the segment
cache and the block trie equal the from-scratch `codec.encode(codec.render(...))` and
`block_hashes` / `hash_blocks_sglang`, for both codecs and both schemes, across turns."""

from __future__ import annotations

import random
import zlib
from pathlib import Path
from typing import Any

import pytest
from beamserve.kvwire.codec import _PIECE, ApproxCodec, PromptCodec, compile_chat_template
from beamserve.kvwire.hashing import block_hashes, hash_blocks_sglang
from beamserve.router.api.convert import UpstreamCall
from beamserve.router.prompt import PromptHasher, PromptKey, piece_chunks, split_tokens
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

# Text that tokenizers find hard: odd unicode, whole and partial special-token strings.
FRAGMENTS = [
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_", "im_start|>", "<|", "|>", "<", "|",
    "<tool_call>", "\n", "\n\n", " ", "  ", "\t", "\r\n", "é", "ß", "İ", "ﬁ", "日本語", "🙂",
    "\u200b", "\u0301", "d<|im", "x<|im_st", "_start|>x", "[UNK]", "a", "the", "Hello", "123",
    "x_y", "{}", "'s", " world", "ǅ",
]  # fmt: skip
chunk = st.one_of(
    st.sampled_from(FRAGMENTS),
    st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12),
)
text = st.lists(chunk, max_size=14).map("".join)
call_ = st.fixed_dictionaries(
    {
        "id": st.just("call_1"),
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": st.sampled_from(["ls", "cat"]), "arguments": text}
        ),
    }
)
message = st.one_of(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "tool"]), "content": st.one_of(text)}
    ),
    st.fixed_dictionaries(
        {
            "role": st.just("user"),
            "content": st.lists(
                st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=3
            ),
        }
    ),
    st.fixed_dictionaries(
        {
            "role": st.just("assistant"),
            "content": st.one_of(st.none(), st.just(""), text),
            "tool_calls": st.lists(call_, max_size=2),
        }
    ),
)
SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def chat(messages: list[dict[str, Any]], tools: Any = None) -> UpstreamCall:
    body: dict[str, Any] = {"messages": messages}
    if tools:
        body["tools"] = tools
    return UpstreamCall(
        path="/v1/chat/completions",
        body=body,
        stream=True,
        client_api="chat",
        model="m",
        messages_for_session=list(messages),
    )


def completion(prompt: str | list[int]) -> UpstreamCall:
    return UpstreamCall(
        path="/v1/completions", body={}, stream=False, client_api="completions", model="m",
        prompt=prompt,
    )  # fmt: skip


def scratch_hashes(ids: list[int], scheme: str, bs: int) -> tuple[int, ...]:
    if scheme == "sglang":
        return tuple(b.event_id for b in hash_blocks_sglang(ids, bs, include_partial=False))
    return tuple(block_hashes(ids, bs))


@pytest.fixture(scope="module")
def precise(tiny_checkpoint: Path) -> PromptHasher:
    """One hasher for the module: its caches carry over from example to example."""
    return PromptHasher(tiny_checkpoint, block_size=4)


@pytest.fixture(scope="module")
def approx() -> PromptHasher:
    return PromptHasher(None, block_size=4, scheme="sglang")


def test_the_tiny_checkpoint_splits_before_its_special_tokens(precise: PromptHasher) -> None:
    assert set(precise.split_tokens) == {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}
    assert split_tokens(ApproxCodec()) == ("<|im_start|>",)


@SETTINGS
@given(messages=st.lists(message, max_size=6), tools=st.one_of(st.none(), st.just([{"a": "b"}])))
def test_chat_tokens_equal_a_plain_encode(
    precise: PromptHasher, approx: PromptHasher, messages: list[dict[str, Any]], tools: Any
) -> None:
    for h in (precise, approx):
        expected = h.codec.encode(h.codec.render(messages, tools))
        key = h.key(chat(messages, tools))
        assert key.token_ids == tuple(expected)
        assert key.prompt_tokens == len(expected)
        assert key.block_hashes == scratch_hashes(expected, h.scheme, h.block_size)
        assert h.token_ids(chat(messages, tools)) == expected


@SETTINGS
@given(prompt=text)
def test_text_prompts_equal_a_plain_encode(
    precise: PromptHasher, approx: PromptHasher, prompt: str
) -> None:
    for h in (precise, approx):
        expected = h.codec.encode(prompt)
        assert h.encode(prompt) == tuple(expected)
        key = h.key(completion(prompt))
        assert key.token_ids == tuple(expected)
        assert key.block_hashes == scratch_hashes(expected, h.scheme, h.block_size)
        assert "".join(h.split(prompt)) == prompt


@pytest.mark.parametrize("scheme", ["vllm", "sglang"])
@pytest.mark.parametrize("mode", ["approx", "precise"])
def test_a_growing_conversation_equals_from_scratch_every_turn(
    tiny_checkpoint: Path, scheme: Any, mode: str
) -> None:
    h = PromptHasher(tiny_checkpoint if mode == "precise" else None, scheme=scheme)
    rng = random.Random(7)

    def words(n: int) -> str:
        return " ".join(rng.choice(FRAGMENTS) for _ in range(n))

    messages: list[dict[str, Any]] = [{"role": "system", "content": words(600)}]
    for turn in range(12):
        messages = [*messages, {"role": "user", "content": words(rng.randrange(0, 300))}]
        if turn == 6:  # an edit in the middle (compaction): the cache may only serve a prefix
            messages[1] = {"role": "user", "content": "edited " + words(20)}
        ids = h.codec.encode(h.codec.render(messages))
        key = h.key(chat(messages))
        assert key == PromptKey(ids, scratch_hashes(ids, scheme, 64), mode == "precise")
        messages.append({"role": "assistant", "content": words(40)})
    assert len(h.segments) > 0 and len(h.blocks) > 0


@st.composite
def related_id_lists(draw: Any) -> list[list[int]]:
    """A few token lists that share prefixes (continuations, branches, edits)."""
    base = draw(st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=120))
    out = [base]
    for _ in range(draw(st.integers(1, 4))):
        src = draw(st.sampled_from(out))
        cut = draw(st.integers(0, len(src)))
        tail = draw(st.lists(st.integers(0, 300), max_size=60))
        out.append(src[:cut] + tail)
    return out


@settings(max_examples=200, deadline=None)
@given(
    lists=related_id_lists(), bs=st.sampled_from([1, 2, 4, 64]), cap=st.sampled_from([0, 3, 10**6])
)
def test_block_hashes_equal_from_scratch(lists: list[list[int]], bs: int, cap: int) -> None:
    for scheme in ("vllm", "sglang"):
        h = PromptHasher(None, block_size=bs, scheme=scheme, block_cache_blocks=cap)  # type: ignore[arg-type]
        for ids in lists + lists[::-1]:
            assert h.hashes(ids) == scratch_hashes(ids, scheme, bs)


def test_ids_beyond_uint32_skip_the_cache_and_match() -> None:
    ids = [2**40 + i for i in range(10)] + [1, 2, 3, 4, 5, 6]
    for scheme in ("vllm", "sglang"):
        h = PromptHasher(None, block_size=4, scheme=scheme)  # type: ignore[arg-type]
        assert h.hashes(ids) == scratch_hashes(ids, scheme, 4)
        assert h.key(completion(ids)).block_hashes == scratch_hashes(ids, scheme, 4)


def test_a_tiny_segment_cache_evicts_and_stays_exact() -> None:
    h = PromptHasher(None, segment_cache_bytes=2_000, block_cache_blocks=5)
    msgs = [{"role": "user", "content": f"turn {i} " + "word " * 50} for i in range(30)]
    for n in range(1, 30):
        ids = h.codec.encode(h.codec.render(msgs[:n]))
        assert h.key(chat(msgs[:n])).token_ids == tuple(ids)
    assert h.segments.bytes <= 2_000 and len(h.blocks) <= 5


def _hf_codec(added: list[Any], normalizer: Any = None) -> PromptCodec:
    """A small BPE with Metaspace pre-tokenization (prepend on the first piece only), an
    optional normalizer, and the given added tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    corpus = [" ".join(FRAGMENTS) * 3, "hello world the cat sat on the mat 123 x_y"]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]"]))
    tok.add_tokens(added)
    return PromptCodec(
        name="t",
        tokenizer=tok,
        template=compile_chat_template(
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}<|im_start|>assistant\n"
        ),
        special={},
        eos_token_id=None,
        vocab_size=int(tok.get_vocab_size(with_added_tokens=True)),
    )


def _added(content: str, **kw: Any) -> Any:
    from tokenizers import AddedToken

    return AddedToken(content, **{"special": True, "normalized": False, **kw})


def _codecs() -> list[tuple[PromptCodec, set[str]]]:
    from tokenizers import normalizers

    lower = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    plain = [_added("<|im_start|>"), _added("<|im_end|>")]
    both = {"<|im_start|>", "<|im_end|>", "[UNK]"}  # [UNK]: the BPE's own special token
    return [
        (_hf_codec(plain), both),
        (_hf_codec(plain, lower), both),
        # lstrip: the token takes the spaces before it, so no cut before it.
        (_hf_codec([_added("<|im_start|>", lstrip=True), _added("<|im_end|>", rstrip=True)]),
         {"<|im_end|>", "[UNK]"}),
        # An added token that can overlap `<|im_…` forbids cutting there.
        (_hf_codec([*plain, _added("d<|im", normalized=True, special=False)]), {"[UNK]"}),
        (_hf_codec([*plain, _added("x<|im_st")]), {"<|im_end|>", "[UNK]", "x<|im_st"}),
        # One starting inside it cannot win over it (leftmost match first): cuts stay.
        (_hf_codec([*plain, _added("_start|>x")]), both),
        # single_word anywhere: no cuts at all.
        (_hf_codec([*plain, _added("cat", single_word=True, special=False)]), set()),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def hf_hashers() -> list[tuple[PromptHasher, set[str]]]:
    out = []
    for codec, cuts in _codecs():
        h = PromptHasher(None, block_size=4)
        h.codec, h.precise = codec, True
        h.split_tokens = split_tokens(codec)
        h._ints = tuple(range(codec.vocab_size))
        out.append((h, cuts))
    return out


def test_split_tokens_follow_the_added_tokens_flags(
    hf_hashers: list[tuple[PromptHasher, set[str]]],
) -> None:
    for h, cuts in hf_hashers:
        assert set(h.split_tokens) == cuts


@SETTINGS
@given(messages=st.lists(message, max_size=5), prompt=text)
def test_other_tokenizers_stay_exact(
    hf_hashers: list[tuple[PromptHasher, set[str]]], messages: list[dict[str, Any]], prompt: str
) -> None:
    for h, _ in hf_hashers:
        assert h.encode(prompt) == tuple(h.codec.encode(prompt))
        rendered = h.codec.render(messages)
        assert h.key(chat(messages)).token_ids == tuple(h.codec.encode(rendered))


@settings(max_examples=200, deadline=None)
@given(s=text, vocab=st.sampled_from([17, 1000, 151_936]))
def test_approx_encode_matches_its_formula(s: str, vocab: int) -> None:
    codec = ApproxCodec(vocab_size=vocab)
    span = vocab - 16
    expected = [zlib.crc32(p.encode()) % span + 16 for p in _PIECE.findall(s)]
    assert codec.encode(s) == expected
    assert codec.encode(s) == expected  # from the memo
    codec.vocab_size = vocab + 1  # a changed vocabulary never reads a stale memo
    assert codec.encode(s) == [zlib.crc32(p.encode()) % (span + 1) + 16 for p in _PIECE.findall(s)]


_CHUNK_TEXT = st.text(
    # No lone surrogates: request bodies cannot carry them (parse_request refuses them).
    st.sampled_from(list("ab_9 \t\n.,;é٣\u00a0\u2003ß漢-"))
    | st.characters(exclude_categories=("Cs",)),
    max_size=300,
)


@settings(max_examples=300, deadline=None)
@given(text=_CHUNK_TEXT, more=_CHUNK_TEXT, size=st.integers(1, 40))
def test_piece_chunks_cut_where_approx_tokenization_restarts(
    text: str, more: str, size: int
) -> None:
    """Cutting a segment every `size` characters at a change of piece class changes no token,
    and a text that grows by appending keeps all its earlier chunks but the last."""
    chunks = piece_chunks(text, size)
    assert "".join(chunks) == text
    codec = ApproxCodec()
    assert [t for c in chunks for t in codec.encode(c)] == codec.encode(text)
    grown = piece_chunks(text + more, size)
    assert grown[: len(chunks) - 1] == chunks[:-1]
    h = PromptHasher(None, chunk_chars=size, segment_cache_bytes=1 << 20)
    assert h.encode(text) == tuple(codec.encode(text))
    assert h.encode(text + more) == tuple(codec.encode(text + more))  # from cached chunks


@settings(max_examples=200, deadline=None)
@given(
    text=_CHUNK_TEXT,
    head=st.integers(1, 60),
    size=st.integers(1, 12),
    scheme=st.sampled_from(["vllm", "sglang"]),
    bound=st.one_of(st.none(), st.integers(0, 400)),
)
def test_a_head_key_is_the_whole_keys_prefix_and_completes_to_it(
    text: str, head: int, size: int, scheme: str, bound: int | None
) -> None:
    """A head key (`head_chars`) holds the whole prompt's first blocks and token ids, estimates
    a length no larger than the text's characters, is given only to a text of more than twice
    `head_chars` characters and at most `max_chars`, and both `complete` and repeated `grow`
    end at exactly the key computed whole."""
    whole = PromptHasher(None, block_size=4, scheme=scheme, chunk_chars=size).key(completion(text))
    h = PromptHasher(None, block_size=4, scheme=scheme, chunk_chars=size)
    key = h.key(completion(text), head_chars=head, max_chars=bound)
    if len(text) <= 2 * head or (bound is not None and len(text) > bound):
        assert not key.partial
    if not key.partial:
        assert (key.token_ids, key.block_hashes) == (whole.token_ids, whole.block_hashes)
        return
    n = len(key.token_ids)
    assert key.token_ids == whole.token_ids[:n]
    assert key.block_hashes == whole.block_hashes[: len(key.block_hashes)]
    assert len(key.block_hashes) == n // 4
    assert n <= key.prompt_tokens <= len(text)
    done = key.complete()
    assert not done.partial
    assert (done.prompt_tokens, done.token_ids, done.block_hashes) == (
        whole.prompt_tokens,
        whole.token_ids,
        whole.block_hashes,
    )
    grown = key
    while grown.partial:
        grown = grown.grow(2)
    assert (grown.token_ids, grown.block_hashes) == (whole.token_ids, whole.block_hashes)


def test_head_keys_are_approximate_mode_only(precise: PromptHasher) -> None:
    """Precise mode counts real tokens for the length check: never a head key."""
    text = "hello world, " * 400
    assert not precise.key(completion(text), head_chars=64).partial
    approx = PromptHasher(None, chunk_chars=64)
    assert approx.key(completion(text), head_chars=64).partial
    assert not approx.key(completion([1, 2, 3] * 400), head_chars=4).partial  # token ids
