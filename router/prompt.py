"""From a client request to the token ids and block hashes the engine will cache.

Precise mode (a checkpoint directory is configured): render the chat exactly as the engine does
(`beamserve.workers.server.codec.PromptCodec`: the checkpoint's chat template and tokenizer)
and hash `block_size`-token blocks with the engine's scheme — vLLM's chained sha256 for vLLM,
`sim` and `ref` workers; SGLang's page hash for SGLang workers — so the router's index keys are
the very hashes the engines publish in their KV events.

Approximate mode (no checkpoint): a deterministic word-level pseudo-tokenizer
(`ApproxCodec`); the hashes only ever match the router's own routing-time predictions, which is
what prefix affinity needs when engine events cannot be matched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from beamserve.router.api.convert import UpstreamCall
from beamserve.workers.hashing import block_hashes, hash_blocks_sglang
from beamserve.workers.server.codec import ApproxCodec, Codec, PromptCodec

HashScheme = Literal["vllm", "sglang"]


@dataclass(frozen=True, slots=True)
class PromptKey:
    token_ids: tuple[int, ...]
    block_hashes: tuple[int, ...]
    precise: bool

    @property
    def prompt_tokens(self) -> int:
        return len(self.token_ids)


class PromptHasher:
    def __init__(
        self,
        model_dir: str | Path | None = None,
        *,
        block_size: int = 64,
        scheme: HashScheme = "vllm",
    ) -> None:
        self.codec: Codec = (
            PromptCodec.from_model_dir(model_dir) if model_dir is not None else ApproxCodec()
        )
        self.precise = model_dir is not None
        self.block_size = block_size
        self.scheme: HashScheme = scheme

    def token_ids(self, call: UpstreamCall) -> list[int]:
        prompt = call.prompt
        if isinstance(prompt, list):
            return [int(t) for t in prompt]
        if isinstance(prompt, str):
            return self.codec.encode(prompt)
        tools: Any = call.body.get("tools")
        return self.codec.encode(self.codec.render(call.messages_for_session, tools))

    def hashes(self, token_ids: Sequence[int]) -> tuple[int, ...]:
        if self.scheme == "sglang":
            pages = hash_blocks_sglang(list(token_ids), self.block_size, include_partial=False)
            return tuple(b.event_id for b in pages)
        return tuple(block_hashes(list(token_ids), self.block_size))

    def key(self, call: UpstreamCall) -> PromptKey:
        ids = self.token_ids(call)
        return PromptKey(tuple(ids), self.hashes(ids), self.precise)
