"""The worker's HTTP surface: what vLLM or SGLang would serve, over a `Backend`.

OpenAI API (`/v1/chat/completions`, `/v1/completions` — streaming SSE with
`stream_options.include_usage`, `kv_transfer_params` in and out — and `/v1/models`), health and
readiness (`/health` and `/ready` answer 503 until the engine can serve), `/metrics` with the
engine's names (`metrics`). With `api="sglang"` also SGLang's native endpoints the SGLang Model
Gateway calls: `/generate` (with `bootstrap_host` / `bootstrap_port` / `bootstrap_room`),
`/health_generate`, `/server_info` and `/get_server_info`, `/model_info` and
`/get_model_info`, `/get_load`, `/flush_cache`. Admin (fault injection, for tests and chaos
drills): `GET|PUT /admin/faults`, `POST /admin/kill`, `POST /admin/revive`, and vLLM's
`POST /reset_prefix_cache`.

Errors use vLLM's OpenAI error shape `{"error": {"message", "type", "param", "code"}}`. A client
that disconnects mid-stream aborts its request in the engine.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from beamserve.kvwire.codec import CodecError
from beamserve.workers.server.backend import (
    Backend,
    BackendUnavailableError,
    GenerateEvent,
    GenerateInput,
    HandoffError,
    parse_bootstrap,
    parse_kv_transfer_params,
)
from beamserve.workers.server.metrics import WorkerMetrics
from beamserve.workers.sim.faults import FaultConfigError
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

Api = Literal["vllm", "sglang"]
DEFAULT_MAX_TOKENS = 256


class BadRequest(ValueError):
    """A request body that cannot be served; the message names the field and the fix."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}
    return JSONResponse(
        status_code=status,
        content={
            "error": {
                "message": message,
                "type": kind.get(status, "InternalServerError"),
                "param": param,
                "code": status,
            }
        },
    )


def kv_geometry_report(page_size: int, info: dict[str, Any]) -> dict[str, Any]:
    """What this worker tells a router about its KV geometry (`beamserve.kvwire.geometry`), as
    extra fields of its `/v1/models` entry and of `/server_info`: the block size it caches and
    hashes in, the sliding window it runs (the checkpoint's config.json), the hash chain of
    its block hashes and its KV-event wire format (vLLM's, whatever its HTTP surface: the
    engines hash and publish as vLLM does), and whether it caches prefixes at all."""
    out: dict[str, Any] = {"block_size": page_size}
    window = info.get("sliding_window")
    if isinstance(window, int) and not isinstance(window, bool) and window >= 0:
        out["sliding_window"] = window
    out["kv_hash_scheme"] = "vllm"
    out["kv_event_format"] = "vllm"
    if isinstance(info.get("prefix_caching"), bool):
        # Whether it keeps prompts' KV for later requests (a ref decode worker does not): a
        # router must not count on a prefix there, whatever it sent it before.
        out["prefix_caching"] = info["prefix_caching"]
    return out


def _int_field(body: dict[str, Any], name: str, default: int | None, low: int = 1) -> int | None:
    v = body.get(name, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise BadRequest(f"{name}: must be an integer ≥ {low}, got {v!r}", name)
    return v


def _max_tokens(body: dict[str, Any]) -> int:
    for name in ("max_completion_tokens", "max_tokens"):
        v = _int_field(body, name, None)
        if v is not None:
            return v
    return DEFAULT_MAX_TOKENS


async def _json(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"body: not valid JSON ({exc}); send a JSON object") from exc
    if not isinstance(body, dict):
        raise BadRequest("body: must be a JSON object")
    return body


def sglang_input(
    backend: Backend, rid: str, prompt: list[int], max_tokens: int, body: dict[str, Any]
) -> GenerateInput:
    """SGLang's P/D legs carry the same bootstrap fields: on a prefill worker the request is
    the prefill leg (its KV published under the room), elsewhere the decode leg."""
    handoff = parse_bootstrap(body)
    prefill_leg = handoff is not None and backend.role == "prefill"
    return GenerateInput(
        rid,
        tuple(prompt),
        max_tokens,
        prefill_leg=prefill_leg,
        lease_id=handoff.lease_id if prefill_leg and handoff else None,
        handoff=None if prefill_leg else handoff,
        handoff_style="sglang",
    )


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


DEFAULT_MAX_MODEL_LEN = 131_072


def build_worker_app(
    backend: Backend,
    *,
    api: Api = "vllm",
    served_model_name: str,
    max_model_len: int | None = None,
) -> FastAPI:
    """The worker app; `backend` must be started by the caller (see `cli`).

    `max_model_len`: the longest prompt + output a request may ask for (vLLM's flag of the same
    name); default: the engine's KV capacity, at most 131,072 tokens."""
    app = FastAPI(title=f"beamserve worker ({backend.engine}, {backend.role})")
    metrics = WorkerMetrics(api, served_model_name, backend.stats, lambda: backend.ready)
    app.state.backend = backend
    app.state.metrics = metrics
    started = int(time.time())
    info = backend.server_info()
    capacity = int(info.get("max_total_num_tokens") or DEFAULT_MAX_MODEL_LEN)
    limit = max_model_len or min(capacity, DEFAULT_MAX_MODEL_LEN)
    geometry = kv_geometry_report(backend.page_size, info)
    # The engine's step budget, under vLLM's flag name: a router sizes pieces of prefill by it.
    budget = info.get("chunked_prefill_size")
    step = {"max_num_batched_tokens": budget} if isinstance(budget, int) and budget > 0 else {}

    @app.exception_handler(BadRequest)
    async def _bad(_: Request, exc: BadRequest) -> JSONResponse:
        return error_response(400, str(exc), exc.param)

    @app.exception_handler(HandoffError)
    async def _handoff(_: Request, exc: HandoffError) -> JSONResponse:
        return error_response(400, str(exc), "kv_transfer_params")

    @app.exception_handler(CodecError)
    async def _codec(_: Request, exc: CodecError) -> JSONResponse:
        return error_response(400, str(exc), "messages")

    @app.exception_handler(BackendUnavailableError)
    async def _dead(_: Request, exc: BackendUnavailableError) -> JSONResponse:
        return error_response(503, str(exc))

    # --- health, info, metrics -----------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if backend.ready else 503)

    @app.get("/ready")
    async def ready() -> Response:
        return Response(status_code=200 if backend.ready else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": served_model_name,
                    "object": "model",
                    "created": started,
                    "owned_by": "beamserve",
                    "root": served_model_name,
                    "parent": None,
                    "max_model_len": limit,
                    **geometry,
                    **step,
                }
            ],
        }

    # --- OpenAI generation ---------------------------------------------------------------------
    def _prompt_from_chat(body: dict[str, Any]) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages: must be a non-empty list of message objects", "messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise BadRequest(f"messages.{i}: must be an object with a string role", "messages")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise BadRequest("tools: must be a list", "tools")
        return backend.codec.encode(backend.codec.render(messages, tools))

    def _prompt_from_completion(body: dict[str, Any]) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, str) and prompt:
            return backend.codec.encode(prompt)
        if (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
        ):
            return list(prompt)
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            return backend.codec.encode(prompt[0])
        raise BadRequest(
            "prompt: give a non-empty string or a list of token ids (batches are not supported)",
            "prompt",
        )

    def _check_length(prompt_len: int, max_tokens: int, field: str) -> None:
        if prompt_len + max_tokens > limit:
            raise BadRequest(
                f"{field}: this model's maximum context length is {limit} tokens, but the "
                f"request asks for {prompt_len + max_tokens} ({prompt_len} in the prompt, "
                f"{max_tokens} to generate); shorten the prompt or lower max_tokens",
                field,
            )

    def _input(body: dict[str, Any], prompt: list[int], request: Request) -> GenerateInput:
        if body.get("n", 1) != 1:
            raise BadRequest("n: only n=1 is supported", "n")
        _check_length(
            len(prompt), _max_tokens(body), "messages" if "messages" in body else "prompt"
        )
        rid = str(body.get("request_id") or request.headers.get("x-request-id") or "")
        rid = rid or f"cmpl-{uuid.uuid4().hex}"
        if api == "sglang":
            return sglang_input(backend, rid, prompt, _max_tokens(body), body)
        prefill_leg, handoff = parse_kv_transfer_params(body.get("kv_transfer_params"))
        if prefill_leg and backend.handshake_url is None:
            raise BadRequest(
                "kv_transfer_params.do_remote_decode: this worker does not serve prefill "
                f"(role {backend.role}); send the prefill leg to a prefill worker",
                "kv_transfer_params",
            )
        return GenerateInput(
            rid, tuple(prompt), _max_tokens(body), prefill_leg=prefill_leg, handoff=handoff
        )

    async def _collect(inp: GenerateInput) -> tuple[list[int], GenerateEvent]:
        t0 = time.monotonic()
        tokens: list[int] = []
        last: GenerateEvent | None = None
        async for ev in backend.generate(inp):
            if not tokens and ev.token_ids:
                metrics.ttft.observe(time.monotonic() - t0)
            tokens.extend(ev.token_ids)
            last = ev
        metrics.e2e.observe(time.monotonic() - t0)
        if last is None:
            raise BackendUnavailableError("the engine ended the request without an answer")
        if last.finish_reason == "error":
            raise BackendUnavailableError(last.error or "the engine failed the request")
        return tokens, last

    def _usage(ev: GenerateEvent, prompt_len: int) -> dict[str, Any]:
        prompt_tokens = ev.prompt_tokens or prompt_len
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": ev.completion_tokens,
            "total_tokens": prompt_tokens + ev.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": ev.cached_tokens},
        }

    async def _first(inp: GenerateInput) -> tuple[AsyncIterator[GenerateEvent], GenerateEvent]:
        """Start the generation and wait for its first event, so that failures before the
        first byte become an HTTP status instead of a broken stream."""
        it = backend.generate(inp).__aiter__()
        try:
            first = await it.__anext__()
        except StopAsyncIteration as exc:
            raise BackendUnavailableError("the engine ended the request without an answer") from exc
        if first.finish_reason == "error":
            raise BackendUnavailableError(first.error or "the engine failed the request")
        return it, first

    async def _stream(
        inp: GenerateInput,
        kind: Literal["chat", "completion"],
        include_usage: bool,
    ) -> StreamingResponse:
        t0 = time.monotonic()
        it, first = await _first(inp)
        created = int(time.time())
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        base = {"id": inp.request_id, "object": obj, "created": created, "model": served_model_name}

        def chunk(text: str, finish: str | None, **extra: Any) -> dict[str, Any]:
            if kind == "chat":
                delta: dict[str, Any] = {"content": text} if text or finish is None else {}
                choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text, "finish_reason": finish}
            return {**base, "choices": [choice], **extra}

        async def body() -> AsyncIterator[bytes]:
            if kind == "chat":
                yield _sse(
                    {
                        **base,
                        "choices": [
                            {
                                "index": 0,
                                "delta": {"role": "assistant", "content": ""},
                                "finish_reason": None,
                            }
                        ],
                    }
                )
            ev: GenerateEvent | None = first
            seen = False
            last = first
            while ev is not None:
                if ev.token_ids and not seen:
                    seen = True
                    metrics.ttft.observe(time.monotonic() - t0)
                text = backend.codec.decode(ev.token_ids) if ev.token_ids else ""
                last = ev
                if ev.finish_reason == "error":
                    yield _sse(
                        {
                            "error": {
                                "message": ev.error or "engine failed",
                                "type": "InternalServerError",
                                "param": None,
                                "code": 500,
                            }
                        }
                    )
                    return
                extra = {}
                if ev.finish_reason is not None and ev.kv_transfer_params is not None:
                    extra["kv_transfer_params"] = ev.kv_transfer_params
                if text or ev.finish_reason is not None:
                    yield _sse(chunk(text, ev.finish_reason, **extra))
                ev = await anext(it, None)
            metrics.e2e.observe(time.monotonic() - t0)
            if include_usage:
                yield _sse({**base, "choices": [], "usage": _usage(last, len(inp.prompt_ids))})
            yield b"data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: Request) -> Response:
        body = await _json(request)
        inp = _input(body, _prompt_from_chat(body), request)
        if body.get("stream"):
            opts = body.get("stream_options") or {}
            return await _stream(inp, "chat", bool(opts.get("include_usage")))
        tokens, last = await _collect(inp)
        out: dict[str, Any] = {
            "id": inp.request_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": served_model_name,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": backend.codec.decode(tokens)},
                    "finish_reason": last.finish_reason,
                }
            ],
            "usage": _usage(last, len(inp.prompt_ids)),
            "kv_transfer_params": last.kv_transfer_params,
        }
        return JSONResponse(out)

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        body = await _json(request)
        inp = _input(body, _prompt_from_completion(body), request)
        if body.get("stream"):
            opts = body.get("stream_options") or {}
            return await _stream(inp, "completion", bool(opts.get("include_usage")))
        tokens, last = await _collect(inp)
        return JSONResponse(
            {
                "id": inp.request_id,
                "object": "text_completion",
                "created": int(time.time()),
                "model": served_model_name,
                "choices": [
                    {
                        "index": 0,
                        "text": backend.codec.decode(tokens),
                        "finish_reason": last.finish_reason,
                    }
                ],
                "usage": _usage(last, len(inp.prompt_ids)),
                "kv_transfer_params": last.kv_transfer_params,
            }
        )

    # --- admin -----------------------------------------------------------------------------------
    @app.get("/admin/faults")
    async def get_faults() -> dict[str, Any]:
        return backend.faults()

    @app.put("/admin/faults", response_model=None)
    async def put_faults(request: Request) -> Response:
        body = await _json(request)
        try:
            return JSONResponse(backend.set_faults(body))
        except FaultConfigError as exc:
            return error_response(400, str(exc), "faults")

    @app.post("/admin/kill")
    async def kill(request: Request) -> dict[str, Any]:
        reason = request.query_params.get("reason", "killed by /admin/kill")
        backend.kill(reason)
        return {"alive": False, "reason": reason}

    @app.post("/admin/revive")
    async def revive() -> dict[str, Any]:
        backend.revive()
        return {"alive": backend.ready}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict[str, Any]:
        return {"freed_pages": backend.reset_prefix_cache()}

    if api == "sglang":
        _add_sglang_routes(app, backend, served_model_name, metrics, _first, _check_length)
    return app


def _add_sglang_routes(
    app: FastAPI,
    backend: Backend,
    model: str,
    metrics: WorkerMetrics,
    first: Any,
    check_length: Any,
) -> None:
    """SGLang's native endpoints (sglang 0.5.23 `http_server.py`; what sglang-router calls)."""

    def server_info() -> dict[str, Any]:
        info = backend.server_info()
        mode = "null" if backend.role == "both" else backend.role
        port = None
        if backend.handshake_url is not None:
            port = int(backend.handshake_url.rsplit(":", 1)[1])
        return {
            "model_path": model,
            "served_model_name": model,
            "tokenizer_path": model,
            "tp_size": backend.tp_size,
            "dp_size": 1,
            **kv_geometry_report(backend.page_size, info),
            "page_size": backend.page_size,
            "disaggregation_mode": mode,
            "disaggregation_bootstrap_port": port,
            "disaggregation_transfer_backend": "nixl",
            "max_total_num_tokens": info.get("max_total_num_tokens"),
            "max_running_requests": info.get("max_running_requests"),
            "chunked_prefill_size": info.get("chunked_prefill_size"),
            "internal_states": [{"last_gen_throughput": 0.0}],
            "version": "0.5.23",
            "frontend": "beamserve",
            "beamserve": info,
        }

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def _server_info() -> dict[str, Any]:
        return server_info()

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def _model_info() -> dict[str, Any]:
        return {
            "model_path": model,
            "served_model_name": model,
            "tokenizer_path": model,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "disaggregation_mode": "null" if backend.role == "both" else backend.role,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": "beam",
            "architectures": ["BeamForCausalLM"],
        }

    @app.get("/health_generate")
    async def _health_generate() -> Response:
        return Response(status_code=200 if backend.ready else 503)

    @app.get("/get_load")
    async def _get_load() -> list[dict[str, Any]]:
        s = backend.stats()
        return [
            {
                "dp_rank": 0,
                "num_reqs": s.running + s.waiting,
                "num_waiting_reqs": s.waiting,
                "num_tokens": int(s.kv_usage * (server_info()["max_total_num_tokens"] or 0)),
            }
        ]

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def _flush_cache() -> Response:
        backend.reset_prefix_cache()
        return Response("Cache flushed.\n", status_code=200)

    @app.post("/generate", response_model=None)
    async def generate(request: Request) -> Response:
        body = await _json(request)
        if "input_ids" in body:
            ids = body["input_ids"]
            if (
                not isinstance(ids, list)
                or not ids
                or not all(isinstance(t, int) and t >= 0 for t in ids)
            ):
                raise BadRequest("input_ids: must be a non-empty list of token ids", "input_ids")
            prompt = list(ids)
        elif isinstance(body.get("text"), str) and body["text"]:
            prompt = backend.codec.encode(body["text"])
        else:
            raise BadRequest("text or input_ids: give one (a string or a list of token ids)")
        params = body.get("sampling_params") or {}
        if not isinstance(params, dict):
            raise BadRequest("sampling_params: must be an object", "sampling_params")
        max_new = _int_field(params, "max_new_tokens", 128)
        assert max_new is not None
        check_length(len(prompt), max_new, "input_ids" if "input_ids" in body else "text")
        rid = str(body.get("rid") or f"{uuid.uuid4().hex}")
        inp = sglang_input(backend, rid, prompt, max_new, body)
        t0 = time.monotonic()

        def meta(ev: GenerateEvent, n_out: int) -> dict[str, Any]:
            fr: dict[str, Any] | None = None
            if ev.finish_reason == "length":
                fr = {"type": "length", "length": n_out}
            elif ev.finish_reason is not None:
                fr = {"type": ev.finish_reason, "matched": None}
            return {
                "id": rid,
                "finish_reason": fr,
                "prompt_tokens": ev.prompt_tokens or len(prompt),
                "completion_tokens": n_out,
                "cached_tokens": ev.cached_tokens,
                "e2e_latency": time.monotonic() - t0,
            }

        it, ev0 = await first(inp)
        if body.get("stream"):

            async def sse() -> AsyncIterator[bytes]:
                out: list[int] = []
                ev: GenerateEvent | None = ev0
                while ev is not None:
                    if ev.finish_reason == "error":
                        yield _sse({"error": {"message": ev.error, "code": 500}})
                        return
                    if ev.token_ids and not out:
                        metrics.ttft.observe(time.monotonic() - t0)
                    out.extend(ev.token_ids)
                    yield _sse(
                        {
                            "text": backend.codec.decode(out),
                            "output_ids": out,
                            "meta_info": meta(ev, len(out)),
                        }
                    )
                    ev = await anext(it, None)
                yield b"data: [DONE]\n\n"

            return StreamingResponse(sse(), media_type="text/event-stream")
        out: list[int] = list(ev0.token_ids)
        last = ev0
        async for ev in it:
            out.extend(ev.token_ids)
            last = ev
        if last.finish_reason == "error":
            raise BackendUnavailableError(last.error or "the engine failed the request")
        metrics.e2e.observe(time.monotonic() - t0)
        text = backend.codec.decode(out)
        return JSONResponse({"text": text, "output_ids": out, "meta_info": meta(last, len(out))})
