"""Time Beam's decoder layers at the real dimensions on one GPU (run on an NVIDIA H200).

transformers' own Beam layers (`BeamForCausalLM`), bf16, random weights, real dimensions
(hidden 5120, 48/8 heads × 128, 256 experts top-8 with moe_intermediate 2560, dense
intermediate 20480, window 512). A model of three layers is built — dense MLP + sliding
attention, sparse MLP + sliding attention, sparse MLP + full attention — and every layer is
timed with CUDA events inside real forward passes:

* prefill: batch 1, T new tokens (T in PREFILL_TOKENS);
* decode: one new token for each of B sequences that already hold C tokens of KV.

Prints and writes JSON (`--out`): per layer kind, milliseconds per call. Standalone on
purpose: it runs on the GPU machine's own Python with only torch and transformers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import BeamConfig, BeamForCausalLM
from transformers.cache_utils import DynamicCache

PREFILL_TOKENS = (512, 2048, 8192, 16384)
DECODE_POINTS = ((1, 2048), (1, 16384), (8, 2048), (8, 8192), (32, 2048), (32, 4096), (64, 2048))
KINDS = ("dense_sliding", "sparse_sliding", "sparse_full")


def build() -> BeamForCausalLM:
    cfg = BeamConfig(
        vocab_size=4096,  # the embedding and head are not what we time
        num_hidden_layers=3,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse", "sparse"],
        max_position_embeddings=65536,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = BeamForCausalLM(cfg).to(torch.bfloat16)
    model.eval()
    return model


class LayerTimer:
    def __init__(self, model: BeamForCausalLM) -> None:
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._pending: dict[int, torch.cuda.Event] = {}
        self._idx: list[int] = []
        for i, layer in enumerate(model.model.layers):
            layer.register_forward_pre_hook(self._pre(i))
            layer.register_forward_hook(self._post(i))
        self.samples: dict[int, list[float]] = {}

    def _pre(self, i: int):  # type: ignore[no-untyped-def]
        def hook(_mod, _args):  # type: ignore[no-untyped-def]
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._pending[i] = ev

        return hook

    def _post(self, i: int):  # type: ignore[no-untyped-def]
        def hook(_mod, _args, _out):  # type: ignore[no-untyped-def]
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.events.append((self._pending.pop(i), ev))
            self.samples.setdefault(i, [])
            self._idx.append(i)

        return hook

    def reset(self) -> None:
        self.events, self._idx, self.samples = [], [], {}

    def collect(self) -> dict[str, float]:
        torch.cuda.synchronize()
        for (a, b), i in zip(self.events, self._idx, strict=True):
            self.samples[i].append(a.elapsed_time(b))
        return {KINDS[i]: statistics.median(v) for i, v in sorted(self.samples.items())}


@torch.inference_mode()
def prefill(model: BeamForCausalLM, timer: LayerTimer, tokens: int, reps: int) -> dict[str, float]:
    ids = torch.randint(0, 4096, (1, tokens), device="cuda")
    model(input_ids=ids, use_cache=True)  # warm-up
    timer.reset()
    for _ in range(reps):
        model(input_ids=ids, use_cache=True)
    return timer.collect()


@torch.inference_mode()
def decode(
    model: BeamForCausalLM, timer: LayerTimer, batch: int, context: int, reps: int
) -> dict[str, float]:
    ids = torch.randint(0, 4096, (batch, context), device="cuda")
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    nxt = out.logits[:, -1:].argmax(-1)
    pos = torch.full((batch, 1), context, device="cuda")
    model(input_ids=nxt, past_key_values=cache, position_ids=pos, use_cache=True)  # warm-up
    timer.reset()
    for r in range(reps):
        pos = torch.full((batch, 1), context + 1 + r, device="cuda")
        model(input_ids=nxt, past_key_values=cache, position_ids=pos, use_cache=True)
    return timer.collect()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="h200_beam_layers.json")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    t0 = time.time()
    model = build()
    timer = LayerTimer(model)
    result: dict[str, object] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "dtype": "bfloat16",
        "layer_kinds": list(KINDS),
        "prefill": [],
        "decode": [],
    }
    for t in PREFILL_TOKENS:
        row = {"tokens": t, "ms": prefill(model, timer, t, args.reps)}
        result["prefill"].append(row)  # type: ignore[attr-defined]
        print("prefill", row, flush=True)
    for b, c in DECODE_POINTS:
        row = {"batch": b, "context": c, "ms": decode(model, timer, b, c, args.reps * 4)}
        result["decode"].append(row)  # type: ignore[attr-defined]
        print("decode", row, flush=True)
        torch.cuda.empty_cache()
    result["wall_s"] = round(time.time() - t0, 1)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
