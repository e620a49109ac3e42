"""Prompt rendering and tokenization, exactly as the engine does it.

A real engine renders a chat request with the checkpoint's Jinja chat template (transformers'
sandboxed environment: `trim_blocks`, `lstrip_blocks`, a `tojson` filter that does not escape
HTML, `raise_exception`) and tokenizes the text without adding special tokens (they are in the
text). `PromptCodec` does the same from `tokenizer.json` + `tokenizer_config.json` with only
`tokenizers` and `jinja2`, so the router's precise mode hashes the very token ids the engine
caches (tests check it against `transformers.AutoTokenizer.apply_chat_template`).

`ApproxCodec` stands in when no checkpoint is configured (the `sim` engine without `--model`):
a deterministic word-level pseudo-tokenizer with a ChatML rendering — stable across processes,
so a router using the same codec still predicts the same blocks.
"""

from __future__ import annotations

import functools
import json
import re
import zlib
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol


class CodecError(ValueError):
    """A checkpoint directory without a usable tokenizer, or a request the template refuses."""


class Codec(Protocol):
    """What the worker and the router need from a tokenizer."""

    name: str
    eos_token_id: int | None
    vocab_size: int

    def render(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None
    ) -> str: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    if not ensure_ascii and indent is None and separators is None and not sort_keys:
        # The template's usual call: what json.dumps builds for these arguments, built once.
        return _JSON.encode(x)
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


_JSON = json.JSONEncoder(ensure_ascii=False)


def _raise(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def compile_chat_template(source: str) -> Any:
    """Compile `source` the way transformers does (see the module docstring)."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    return env.from_string(source)


_LONG_TEXT_CHARS = 65_536


@dataclass
class PromptCodec:
    """A checkpoint's tokenizer and chat template (see the module docstring)."""

    name: str
    tokenizer: Any
    template: Any
    special: dict[str, str | None]
    eos_token_id: int | None
    vocab_size: int

    @classmethod
    def from_model_dir(cls, path: str | Path) -> PromptCodec:
        from tokenizers import Tokenizer

        d = Path(path)
        tok_file, cfg_file = d / "tokenizer.json", d / "tokenizer_config.json"
        if not tok_file.is_file():
            raise CodecError(f"{d}: no tokenizer.json; point --model at a checkpoint directory")
        cfg: dict[str, Any] = {}
        if cfg_file.is_file():
            cfg = json.loads(cfg_file.read_text())
        source = cfg.get("chat_template")
        if not isinstance(source, str):
            jinja = d / "chat_template.jinja"
            if not jinja.is_file():
                raise CodecError(
                    f"{d}: tokenizer_config.json has no chat_template and there is no "
                    "chat_template.jinja; add one"
                )
            source = jinja.read_text()
        tokenizer = Tokenizer.from_file(str(tok_file))

        def token(key: str) -> str | None:
            v = cfg.get(key)
            if isinstance(v, dict):
                v = v.get("content")
            return v if isinstance(v, str) else None

        special = {k: token(k) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        eos = special["eos_token"]
        eos_id = tokenizer.token_to_id(eos) if eos else None
        return cls(
            name=d.name,
            tokenizer=tokenizer,
            template=compile_chat_template(source),
            special=special,
            eos_token_id=eos_id,
            vocab_size=int(tokenizer.get_vocab_size(with_added_tokens=True)),
        )

    def render(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None
    ) -> str:
        try:
            text: str = self.template.render(
                messages=[dict(m) for m in messages],
                tools=list(tools) if tools else None,
                add_generation_prompt=True,
                **{k: v for k, v in self.special.items() if v is not None},
            )
        except Exception as exc:  # jinja2 TemplateError, UndefinedError, TypeError
            raise CodecError(f"messages: the chat template refused them: {exc}") from exc
        return text

    def encode(self, text: str) -> list[int]:
        if len(text) >= _LONG_TEXT_CHARS:
            # Same pipeline and result; `encode_batch` releases the GIL while it works, so a
            # long prompt tokenized in a worker thread does not stall the serving event loop.
            return list(self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids)
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        text: str = self.tokenizer.decode(list(token_ids), skip_special_tokens=True)
        return text

    @functools.cached_property
    def longest_token_chars(self) -> int:
        """Characters of the vocabulary's longest token (a byte-level BPE token's characters
        stand for one byte each), so a text of n characters has at least n / this tokens."""
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        return max((len(t) for t in vocab), default=1)


_PIECE = re.compile(r"\s+|\w+|[^\w\s]")
_WORDS = (  # noqa: SIM905 (one readable block)
    "the of and to in is for on that with as it be this by are from or at an not have was we "
    "you can if all but they which one will has more their what so about there when up use "
    "out do some into then them these its time only new would other like code file test run "
    "build fix error value return def class import call list map key type data read write"
).split()


_UNIT = re.compile(r"\S+\s*|\s+")
# A unit is a run of non-space characters with the whitespace run after it (or a leading
# whitespace run). It ends where a non-space character follows whitespace — a change of piece
# class, where tokenization restarts whatever came before — so a text's pieces are its units'
# pieces one after another, and a unit can be memoized as a whole: one match of a simple regex
# for every two pieces or more, not one per piece.
_UNIT_MEMO_MAX = 1 << 17  # distinct units remembered by one ApproxCodec (≈ 20 MB at most)
_U32 = "I" if array("I").itemsize == 4 else "L"  # a 4-byte unsigned C type


class _UnitIds(dict[str, bytes]):
    """unit → its pieces' ids (`crc32(piece) mod span + 16` each) as native uint32 bytes,
    computed on first sight (`ApproxCodec.encode_u32`)."""

    def __init__(self, span: int) -> None:
        super().__init__()
        self.span = span

    def __missing__(self, unit: str) -> bytes:
        span = self.span
        ids = [zlib.crc32(p.encode()) % span + 16 for p in _PIECE.findall(unit)]
        v = self[unit] = array(_U32, ids).tobytes()
        return v


@dataclass
class ApproxCodec:
    """Word-level pseudo-tokens for the simulator without a checkpoint (module docstring).

    A piece (a run of word characters, one punctuation mark, or a run of whitespace) maps to
    `crc32(piece) mod (vocab_size − 16) + 16`; ids below 16 are reserved (0 = end of text).
    Decoding maps any id to a word of a fixed list, so generated text is readable."""

    name: str = "approx"
    vocab_size: int = 151_936
    eos_token_id: int | None = 0

    def render(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None
    ) -> str:
        parts = []
        if tools:
            parts.append("<|im_start|>system\n" + _tojson(list(tools)) + "<|im_end|>\n")
        for m in messages:
            parts.append(f"<|im_start|>{m.get('role', 'user')}\n{_content_text(m)}<|im_end|>\n")
        parts.append("<|im_start|>assistant\n")
        return "".join(parts)

    _units: _UnitIds = field(
        default_factory=lambda: _UnitIds(0), init=False, repr=False, compare=False
    )

    def encode(self, text: str) -> list[int]:
        return array(_U32, self.encode_u32(text)).tolist()

    def encode_u32(self, text: str) -> bytes:
        """`encode(text)` as native-endian uint32 bytes (what `array("I", ids).tobytes()`
        gives), built without an int per token: the ids of `[crc32(p.encode()) % span + 16
        for p in pieces]`, through a bounded memo of unit → bytes (`_UNIT`; units repeat:
        words and the space after them), joined in C. Needs `vocab_size` ≤ 2^32."""
        units = self._units
        if units.span != self.vocab_size - 16 or len(units) > _UNIT_MEMO_MAX:
            units = self._units = _UnitIds(self.vocab_size - 16)
        return b"".join(map(units.__getitem__, _UNIT.findall(text)))

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(_WORDS[t % len(_WORDS)] + " " for t in token_ids if t >= 16)


def _content_text(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        text = "".join(
            str(p.get("text", "")) for p in content if isinstance(p, dict) and "text" in p
        )
    else:
        text = ""
    calls = message.get("tool_calls") or []
    for call in calls:
        fn = call.get("function", {}) if isinstance(call, dict) else {}
        text += f"<tool_call>{_tojson(fn)}</tool_call>"
    return text


def load_codec(model_dir: str | Path | None, vocab_size: int = 151_936) -> Codec:
    """The checkpoint's `PromptCodec`, or `ApproxCodec` when no directory is given."""
    if model_dir is None:
        return ApproxCodec(vocab_size=vocab_size)
    return PromptCodec.from_model_dir(model_dir)
