"""`beamserve worker`: the HTTP surface every pool pod serves, over the `sim` or `ref` engine.

- `beamserve.kvwire.codec` (shared with the router's precise mode): chat-template rendering and
  tokenization exactly as the engine does it;
- `backend`: the engine-facing seam (`Backend`), P/D handoff parameters in vLLM and SGLang
  style, and the `sim` backend;
- `ref_backend`: the reference engine (real tiny Beam on CPU) behind the same seam;
- `app`: the FastAPI app (OpenAI API, SGLang-native endpoints, health, metrics, admin);
- `metrics`: Prometheus exposition with vLLM's or SGLang's own metric names.
"""
