"""`RefBeam`: the compute core of the reference engine — transformers' `BeamForCausalLM` on CPU.

Greedy decoding only; no batching. What it guarantees, and why:

* **Exactness.** The model runs in bfloat16 (Beam's KV dtype and the pools' `bf16`), so the KV
  laid out in pages is the model's own bytes, and a decode side that rebuilds the cache from
  those bytes continues bit for bit where an uninterrupted run would. One CPU thread per
  process (`torch.set_num_threads(1)`), so kernels reduce in the same order in every worker.
* **One prefill schedule.** The prompt is computed in chunks of `prefill_chunk` tokens
  (default 16, the tiny pools' page size) at absolute boundaries `[c·C, (c+1)·C)`. A different
  chunking gives different low bits (measured: one 90-token chunk vs six 16-token chunks
  differ by up to 0.68 in the last layer's keys, and greedy tokens diverge), so a prefix-cache
  hit — which resumes at a page boundary — is exact only when every run uses the same
  boundaries. `generate` (the colocated reference) uses the same schedule;
  `prefill_chunk=None` computes the prompt in one call and then matches `model.generate`.
* **Sliding layers.** HF's `DynamicCache(config=…)` keeps only `sliding_window − 1` tokens per
  sliding layer. `prefill` turns on the layers' past recording so every computed token stays
  available, and returns keys/values from the first page-aligned token the pools may hold;
  `decode_from` rebuilds `DynamicCache(config=…)` with the last `window − 1` tokens and sets
  each sliding layer's token count to `seq_len`, the state an uninterrupted run has.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from beamserve.kv_transfer.model import FULL_ATTENTION, BeamModelConfig
from beamserve.workers.ref.kv import LayerKV, RequestKV

DEFAULT_PREFILL_CHUNK = 16


class RefEngineError(RuntimeError):
    """The reference engine cannot serve this checkpoint or request (message names the fix)."""


@dataclass(frozen=True)
class PrefillOutput:
    kv: RequestKV
    first_token: int
    computed_tokens: int  # tokens this call ran through the model (the rest came from `prefix`)
    seconds: float


def quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


class RefBeam:
    """A loaded tiny (or any) Beam checkpoint that prefills and decodes greedily on CPU."""

    def __init__(
        self,
        path: str | Path,
        prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
        num_threads: int = 1,
    ) -> None:
        import torch
        from transformers import AutoConfig, BeamForCausalLM

        quiet_transformers()
        torch.set_num_threads(num_threads)
        self.path = Path(path)
        self.kv_config = BeamModelConfig.from_checkpoint(self.path)
        self.config: Any = AutoConfig.from_pretrained(self.path, local_files_only=True)
        if self.config.model_type != "beam":
            raise RefEngineError(
                f"{self.path}: model_type {self.config.model_type!r}; the ref engine serves Beam "
                "checkpoints (make one with `beamserve model make-tiny DIR`)"
            )
        if prefill_chunk is not None and prefill_chunk <= 0:
            raise RefEngineError(f"prefill_chunk: must be positive or None, got {prefill_chunk}")
        self.prefill_chunk = prefill_chunk
        self.model: Any = BeamForCausalLM.from_pretrained(
            self.path, dtype=torch.bfloat16, attn_implementation="sdpa", local_files_only=True
        ).eval()
        self.window = int(self.config.sliding_window)
        self.full = tuple(t == FULL_ATTENTION for t in self.config.layer_types)

    # -- the two halves of disaggregation ------------------------------------------------------
    def prefill(self, token_ids: Sequence[int], prefix: RequestKV | None = None) -> PrefillOutput:
        """Run the prompt (or the part after `prefix`) and return its KV and the first token.

        `prefix` (from a prefix cache) must cover a multiple of `prefill_chunk` tokens, hold
        every token for full layers and at least the last `window − 1` for sliding layers.
        The returned KV holds every token for full layers and, for sliding layers, every token
        from `prefix`'s sliding start (0 without a prefix).
        """
        t0 = time.perf_counter()
        n = len(token_ids)
        done = 0 if prefix is None else prefix.seq_len
        if n == 0 or done >= n:
            raise RefEngineError(
                f"prefill: {n} prompt tokens with {done} cached; at least one token must be "
                "computed (the first output token comes from its logits)"
            )
        chunk = self.prefill_chunk or n
        if done % chunk:
            raise RefEngineError(
                f"prefix: {done} tokens is not a multiple of prefill_chunk {chunk}; cut the "
                "prefix to a chunk boundary so the result stays bitwise reproducible"
            )
        cache = self._cache(prefix, record_past=True)
        logits: Any = None
        for start in range(done, n, chunk):
            logits = self._forward(token_ids[start : start + chunk], cache, start)
        first = int(logits[0, -1].argmax())
        kv = self._export(cache, n)
        return PrefillOutput(kv, first, n - done, time.perf_counter() - t0)

    def decode_from(self, kv: RequestKV, seq_len: int, first_token: int, n: int) -> list[int]:
        """Continue greedily from transferred KV: `n` tokens, the first being `first_token`
        (the token prefill sampled), then `n − 1` more."""
        if kv.seq_len != seq_len:
            raise RefEngineError(f"kv: holds {kv.seq_len} tokens, seq_len says {seq_len}")
        cache = self._cache(kv, record_past=False)
        out = [int(first_token)]
        for i in range(n - 1):
            logits = self._forward([out[-1]], cache, seq_len + i)
            out.append(int(logits[0, -1].argmax()))
        return out[:n]

    # -- the colocated reference ---------------------------------------------------------------
    def generate(self, token_ids: Sequence[int], n: int) -> list[int]:
        """Colocated reference: one instance, one uninterrupted greedy loop (same prefill
        schedule, HF's own `DynamicCache(config=…)` throughout, nothing exported)."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.config)
        chunk = self.prefill_chunk or len(token_ids)
        logits: Any = None
        for start in range(0, len(token_ids), chunk):
            logits = self._forward(token_ids[start : start + chunk], cache, start)
        out = [int(logits[0, -1].argmax())]
        for i in range(n - 1):
            logits = self._forward([out[-1]], cache, len(token_ids) + i)
            out.append(int(logits[0, -1].argmax()))
        return out[:n]

    def hf_generate(self, token_ids: Sequence[int], n: int) -> list[int]:
        """transformers' own `generate` (greedy, no EOS stop): equals `generate` when
        `prefill_chunk` is None or covers the prompt."""
        import torch

        with torch.no_grad():
            ids = torch.tensor([list(token_ids)], dtype=torch.long)
            out = self.model.generate(
                ids,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=self.config.pad_token_id,
            )
        return [int(t) for t in out[0, len(token_ids) :].tolist()]

    # -- internals -----------------------------------------------------------------------------
    def _forward(self, tokens: Sequence[int], cache: Any, start: int) -> Any:
        import torch

        ids = torch.tensor([list(tokens)], dtype=torch.long)
        pos = torch.arange(start, start + len(tokens), dtype=torch.long).unsqueeze(0)
        with torch.no_grad():
            return self.model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True).logits

    def _cache(self, kv: RequestKV | None, record_past: bool) -> Any:
        """`DynamicCache(config=…)`, optionally seeded with `kv` (sliding layers: the last
        `window − 1` tokens unless recording the past, token count set to `kv.seq_len`)."""
        import torch
        from transformers import DynamicCache

        cache = DynamicCache(config=self.config)
        if record_past:
            for layer in cache.layers:
                if getattr(layer, "is_sliding", False):
                    layer.activate_past_recording()
        if kv is None:
            return cache
        if len(kv.layers) != len(self.full):
            raise RefEngineError(f"kv: {len(kv.layers)} layers, the model has {len(self.full)}")
        keep = self.window - 1
        for i, layer in enumerate(kv.layers):
            k, v = layer.keys, layer.values
            if self.full[i]:
                if layer.start != 0:
                    raise RefEngineError(f"kv: full-attention layer {i} starts at {layer.start}")
            else:
                need = max(0, kv.seq_len - keep)
                if layer.start > need:
                    raise RefEngineError(
                        f"kv: sliding layer {i} starts at token {layer.start}; continuing at "
                        f"{kv.seq_len} needs tokens from {need} (window − 1 = {keep})"
                    )
                if not record_past:
                    k, v = k[:, need - layer.start :], v[:, need - layer.start :]
            cache.update(_to_torch(k, torch)[None], _to_torch(v, torch)[None], i)
            if not self.full[i]:
                cache.layers[i].cumulative_length = kv.seq_len
        return cache

    def _export(self, cache: Any, seq_len: int) -> RequestKV:
        """The cache's KV as bf16 bits (a resumed prefix's tokens are in the cache already)."""
        layers = []
        for i, layer in enumerate(cache.layers):
            k, v = _to_numpy(layer.keys[0]), _to_numpy(layer.values[0])
            start = seq_len - int(k.shape[1])
            if self.full[i] and start != 0:
                raise RefEngineError(f"internal: full layer {i} lost tokens (starts at {start})")
            layers.append(LayerKV(start, k, v))
        return RequestKV(seq_len, tuple(layers))


def _to_numpy(t: Any) -> np.ndarray[Any, np.dtype[np.uint16]]:
    import torch

    if t.dtype != torch.bfloat16:
        raise RefEngineError(f"kv dtype {t.dtype}: the ref engine keeps KV in bfloat16")
    bits: np.ndarray[Any, np.dtype[np.uint16]] = (
        t.contiguous().view(torch.int16).numpy().view(np.uint16).copy()
    )
    return bits


def _to_torch(a: np.ndarray[Any, np.dtype[np.uint16]], torch: Any) -> Any:
    return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)


def load_tokenizer(path: str | Path) -> Any:
    """The checkpoint's tokenizer, loaded the way a real checkpoint's is."""
    from transformers import AutoTokenizer

    quiet_transformers()
    return AutoTokenizer.from_pretrained(Path(path), local_files_only=True)


def chat_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Render `messages` with the checkpoint's chat template (assistant turn opened) and
    tokenize the text (special tokens are in the text already)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids: list[int] = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids
