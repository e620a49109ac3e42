"""`PromptCodec` renders and tokenizes exactly as transformers does for the same checkpoint
(the router's precise mode depends on it), and `ApproxCodec` is stable."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from beamserve.kvwire.codec import ApproxCodec, CodecError, PromptCodec, load_codec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=60)
call = st.fixed_dictionaries(
    {
        "id": st.just("call_1"),
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": st.sampled_from(["ls", "cat"]), "arguments": text}
        ),
    }
)
message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "tool"]), "content": text}),
    st.fixed_dictionaries(
        {
            "role": st.just("user"),
            "content": st.lists(
                st.fixed_dictionaries({"type": st.just("text"), "text": text}),
                min_size=1,
                max_size=3,
            ),
        }
    ),
    st.fixed_dictionaries(
        {
            "role": st.just("assistant"),
            "content": st.one_of(st.none(), text),
            "tool_calls": st.lists(call, max_size=2),
        }
    ),
)
tools = st.one_of(
    st.none(),
    st.lists(
        st.fixed_dictionaries({"type": st.just("function"),
                               "function": st.fixed_dictionaries({"name": text})}),
        min_size=1, max_size=2,
    ),
)  # fmt: skip


@pytest.fixture(scope="module")
def hf(tiny_checkpoint: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_checkpoint)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(messages=st.lists(message, min_size=1, max_size=5), tool_list=tools)
def test_renders_and_tokenizes_like_transformers(
    tiny_checkpoint: Path, hf: Any, messages: list[dict[str, Any]], tool_list: Any
) -> None:
    codec = PromptCodec.from_model_dir(tiny_checkpoint)
    ours = codec.render(messages, tool_list)
    theirs = hf.apply_chat_template(
        messages, tools=tool_list, tokenize=False, add_generation_prompt=True
    )
    assert ours == theirs
    assert codec.encode(ours) == hf(theirs, add_special_tokens=False)["input_ids"]


def test_checkpoint_facts(tiny_checkpoint: Path) -> None:
    codec = load_codec(tiny_checkpoint)
    assert isinstance(codec, PromptCodec)
    assert codec.eos_token_id is not None and codec.vocab_size > 100
    assert codec.decode(codec.encode("hello world")) == "hello world"


def test_missing_tokenizer_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(CodecError, match=r"tokenizer\.json"):
        PromptCodec.from_model_dir(tmp_path)


@given(st.lists(text, min_size=1, max_size=4))
def test_approx_codec_is_deterministic_and_in_vocab(parts: list[str]) -> None:
    a, b = ApproxCodec(vocab_size=1000), ApproxCodec(vocab_size=1000)
    msgs = [{"role": "user", "content": p} for p in parts]
    ids = a.encode(a.render(msgs))
    assert ids == b.encode(b.render(msgs))
    assert all(16 <= t < 1000 for t in ids)


@settings(max_examples=8, deadline=None)
@given(st.lists(text, min_size=1, max_size=6), st.integers(1, 3))
def test_long_prompts_tokenize_exactly_as_short_ones(
    tiny_checkpoint: Path, parts: list[str], spread: int
) -> None:
    """Past 64K characters `encode` takes the GIL-releasing path; the ids must not change."""
    codec = PromptCodec.from_model_dir(tiny_checkpoint)
    unit = "\n".join(parts) + " <|im_start|>user\nlorem ipsum ☃ " * spread
    long = unit * (65_536 // len(unit) + 1)
    assert len(long) >= 65_536
    want = list(codec.tokenizer.encode(long, add_special_tokens=False).ids)
    assert codec.encode(long) == want
