"""`ref`: a real tiny Beam on CPU — transformers' `BeamForCausalLM`, KV laid out as TP shards in
the `kv_transfer` page layout, moved between separate prefill and decode worker processes.

Modules (this package imports none of them eagerly: torch loads only where compute runs):

    checkpoint    make_tiny(DIR, seed): config.json, safetensors, tokenizer.json, chat template
    engine        RefBeam: prefill → RequestKV, decode_from(KV), generate (colocated reference)
    kv            RequestKV / LayerKV: a request's KV as bf16 bits
    shards        ShardedKV: per-rank regions, each with its own transfer agent; page pools
    prefix_cache  chained block hashes → cached pages (full and window lifetimes)
    worker        PrefillWorker, DecodeWorker (recompute fallback), WorkerProcess
    check         `beamserve check disagg --engine ref`
    cli           the `model make-tiny` and `check disagg` subcommands

See docs/ref-engine.md.
"""
