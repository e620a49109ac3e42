"""`PoolSpec`: the engine-relevant part of one pool of a `BeamDeployment` (the boundary model).

Strict: unknown keys are errors, strings are not coerced to numbers, and engine-specific
combinations are checked here, so a spec that validates always renders. `PoolSpec.parse`
turns pydantic's errors into one `PoolSpecError` whose lines each name the field and the fix.

Parallelism is described once for both engines:

* `tp_size` — GPUs of one engine instance (one pod);
* `dp_attention` — attention data-parallel groups inside those GPUs (1 = plain TP); the
  attention (and so KV-head) TP of every group is `tp_size / dp_attention`;
* `ep_size` — expert-parallel size of the MoE layers (1 = experts tensor-parallel).

SGLang takes these as `--tp-size`, `--attn-dp-size`, `--ep-size`; vLLM as
`-tp tp_size/dp_attention`, `--data-parallel-size dp_attention`, `--enable-expert-parallel`
(vLLM's EP size is always TP × DP, so vLLM needs `ep_size` 1 or `tp_size`).

`parallel.nodes` spreads one engine instance over several nodes (a LeaderWorkerSet group):
each node runs the same command, with its rank and the leader's address taken from the
environment as `$(LWS_WORKER_INDEX)` and `$(LWS_LEADER_ADDRESS)` (see `command.py`).

Rules that mirror the engines' own cross-field checks (the contract tests prove each engine
refuses the same thing) name the engine code they come from in `_engine_problems`.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from beamserve.kv_transfer.topology import PAGE_SIZES, KVDtype, PoolTopology
from beamserve.workers.launch.errors import PoolSpecError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

Engine = Literal["sglang", "vllm"]
Role = Literal["prefill", "decode", "both"]
CheckpointFormat = Literal["bf16", "fp8", "nvfp4"]
TransferBackend = Literal["nixl", "mooncake"]
KVDtypeName = Literal["bf16", "fp8_e4m3"]
PageSize = Literal[16, 32, 64]
Port = Annotated[int, Field(ge=1, le=65535)]
GPUModel = Literal["gb300", "gb200", "b300", "b200", "h200", "h100"]
"""GPU models the attention-backend table knows (`beamserve.workers.launch.hardware`)."""

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_ZMQ_ENDPOINT = re.compile(r"^(tcp://[^\s]+:\d+|ipc://[^\s]+|inproc://[^\s]+)$")
_FINGERPRINT = re.compile(r"^[0-9a-f]{12,64}$")

assert tuple(PAGE_SIZES) == (16, 32, 64), "PageSize must follow kv_transfer's PAGE_SIZES"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class ModelSource(_Strict):
    """The checkpoint a pool serves."""

    path: Annotated[str, Field(min_length=1)]
    """Checkpoint directory inside the pod (holds `config.json`)."""
    format: CheckpointFormat = "bf16"
    """Weight format: `bf16` (no quantization flag), `fp8`, or `nvfp4` (a ModelOpt NVFP4
    export)."""
    fingerprint: str | None = None
    """`BeamModelConfig.fingerprint()` of the checkpoint (hex, at least 12 digits). When both
    pools of a pair set it, it decides whether they serve the same model; else `path` does."""
    served_name: Annotated[str, Field(min_length=1)] = "beam"
    """The model name clients send (`/v1/models`)."""

    @model_validator(mode="after")
    def _check(self) -> ModelSource:
        if self.fingerprint is not None and not _FINGERPRINT.match(self.fingerprint):
            raise ValueError(
                "model.fingerprint: expected 12–64 lowercase hex digits "
                "(BeamModelConfig.fingerprint()); remove it or copy it from "
                "`beamserve` output for this checkpoint"
            )
        return self


class Parallelism(_Strict):
    tp_size: Annotated[int, Field(ge=1, le=64)] = 1
    ep_size: Annotated[int, Field(ge=1, le=64)] = 1
    dp_attention: Annotated[int, Field(ge=1, le=64)] = 1
    nodes: Annotated[int, Field(ge=1, le=16)] = 1
    """Nodes one engine instance spans (`tp_size` GPUs in all, `tp_size / nodes` per node);
    above 1 the pool runs as a LeaderWorkerSet (SGLang `--nnodes`, vLLM `--nnodes`)."""

    @property
    def gpus_per_node(self) -> int:
        return self.tp_size // self.nodes

    @property
    def attention_tp(self) -> int:
        """TP size of each attention group: what shards the KV heads."""
        return self.tp_size // self.dp_attention


class KVCacheSpec(_Strict):
    page_size: PageSize = 64
    """Tokens per KV page (SGLang `--page-size`, vLLM `--block-size`); 64 by default, as
    smaller pages blow up transfer descriptors (vllm#50913)."""
    dtype: KVDtypeName = "bf16"
    host_cache_gb: Annotated[int, Field(ge=0)] = 0
    """Hierarchical (host-memory) KV cache per GPU rank, in GB (10^9 bytes); 0 = off."""
    prefix_caching: bool = True

    @property
    def kv_dtype(self) -> KVDtype:
        return KVDtype(self.dtype)


class TransferSpec(_Strict):
    """How KV leaves a prefill pool (used by roles `prefill` and `decode` only)."""

    backend: TransferBackend = "nixl"
    bootstrap_port: Port = 8998
    """SGLang's bootstrap server (prefill side); vLLM Mooncake's bootstrap server."""
    side_channel_port: Port = 5600
    """vLLM NIXL handshake port (`VLLM_NIXL_SIDE_CHANNEL_PORT`); vLLM adds the DP rank."""
    ib_device: str | None = None
    """RDMA devices for SGLang (`--disaggregation-ib-device`), e.g. `mlx5_0,mlx5_1`."""
    on_load_failure: Literal["recompute", "fail"] = "recompute"
    """vLLM only (`kv_load_failure_policy`): when decode cannot load the prefilled KV,
    recompute the prefill locally (`recompute`) or fail the request (`fail`)."""


class KVEventsSpec(_Strict):
    """KV-cache events published on ZMQ PUB (DESIGN.md §3)."""

    endpoint: str = "tcp://*:5557"
    topic: str = "kv-events"
    replay_endpoint: str | None = None

    @model_validator(mode="after")
    def _check(self) -> KVEventsSpec:
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not _ZMQ_ENDPOINT.match(value):
                raise ValueError(
                    f"kv_events.{name}: {value!r} is not a ZMQ endpoint; write "
                    "tcp://*:PORT (bind all interfaces) or ipc:///path"
                )
        return self


class ParserSpec(_Strict):
    """Beam's output parsers, registered under the name `beam` in both engines."""

    reasoning: Literal["beam"] | None = "beam"
    tool_call: Literal["beam"] | None = "beam"


class SpeculativeSpec(_Strict):
    """DFlash2 block-parallel drafting with a separate draft checkpoint."""

    method: Literal["dflash2"] = "dflash2"
    draft_model_path: Annotated[str, Field(min_length=1)]
    block_size: Annotated[int, Field(ge=2, le=64)] = 8
    """Verify-window length in tokens: 1 anchor + `block_size - 1` drafted tokens."""
    draft_attention_backend: str | None = None
    """Attention backend of the draft (SGLang `--speculative-draft-attention-backend`, vLLM
    `speculative_config.attention_backend`); default: the engine's choice (the target's)."""
    simulate_acceptance_length: Annotated[float, Field(gt=0)] | None = None
    """Benchmark runs only: SGLang accepts this many tokens per step whatever the draft
    proposes (`SGLANG_SIMULATE_ACC_LEN`; the seeds' runs use 4). SGLang only."""


class PoolSpec(_Strict):
    """Everything needed to render one pool's engine command line and environment."""

    engine: Engine
    role: Role
    model: ModelSource
    parallel: Parallelism = Parallelism()
    kv_cache: KVCacheSpec = KVCacheSpec()
    transfer: TransferSpec = TransferSpec()
    kv_events: KVEventsSpec | None = None
    metrics: bool = True
    """SGLang `--enable-metrics`; vLLM always serves `/metrics`."""
    parsers: ParserSpec = ParserSpec()
    speculative: SpeculativeSpec | None = None
    context_length: Annotated[int, Field(ge=1)] | None = None
    chunked_prefill_size: Annotated[int, Field(ge=1)] | None = None
    host: Annotated[str, Field(min_length=1)] = "0.0.0.0"
    port: Port = 8000
    pod_ip_env: str = "POD_IP"
    """Environment variable that holds the pod IP (Kubernetes downward API,
    `fieldRef: status.podIP`); rendered as `$(POD_IP)` in the engine environment."""

    # -- hardware and memory --------------------------------------------------------------
    gpu: GPUModel | None = None
    """The pool's GPU model: picks the attention backend per GPU generation when
    `attention_backend` is unset (`hardware.ATTENTION_BACKENDS`)."""
    attention_backend: str | None = None
    """The engine's own backend name (SGLang `--attention-backend`, e.g. `trtllm_mha`, `fa3`;
    vLLM `--attention-backend`, e.g. `FLASHINFER`, `FLASH_ATTN`); default: from `gpu`, else
    the engine's choice."""
    mem_fraction_static: Annotated[float, Field(gt=0, le=1)] | None = None
    """Fraction of GPU memory for weights + KV cache (SGLang `--mem-fraction-static`, vLLM
    `--gpu-memory-utilization`)."""
    unified_memory: bool = False
    """GB200/GB300: one byte pool shared by full-attention KV and sliding-window state
    (SGLang `--enable-unified-memory`; vLLM 0.33 has no equivalent)."""

    # -- scheduling limits ----------------------------------------------------------------
    max_running_requests: Annotated[int, Field(ge=1)] | None = None
    """SGLang `--max-running-requests`, vLLM `--max-num-seqs`."""
    cuda_graph_max_bs: Annotated[int, Field(ge=1)] | None = None
    """Largest decode batch captured as a CUDA graph (SGLang `--cuda-graph-max-bs-decode`,
    vLLM `--max-cudagraph-capture-size`)."""
    prefill_decode_interval: Annotated[int, Field(ge=0)] | None = None
    """Decode rounds after each prefill batch before the next prefill (SGLang
    `--prefill-decode-interval`; vLLM has none)."""
    tokenizer_worker_num: Annotated[int, Field(ge=1)] | None = None
    """SGLang `--tokenizer-worker-num`; vLLM tokenizes in its API servers (only 1 renders)."""
    cache_report: bool = False
    """Report cached prompt tokens in `usage.prompt_tokens_details` (SGLang
    `--enable-cache-report`, vLLM `--enable-prompt-tokens-details`)."""

    # -- multi-node ranks -----------------------------------------------------------------
    dist_init_port: Port = 39746
    """Leader port the nodes of one instance rendezvous on (SGLang `--dist-init-addr
    LEADER:PORT`, vLLM `--master-port`); used when `parallel.nodes` > 1."""
    leader_address_env: str = "LWS_LEADER_ADDRESS"
    """Variable holding the leader pod's address (set by LeaderWorkerSet)."""
    node_rank_env: str = "LWS_WORKER_INDEX"
    """Variable holding this pod's index in its group, 0 on the leader (LeaderWorkerSet)."""

    kv_both: bool = False
    """Role `both` only: the engine can also send and receive KV (vLLM `NixlConnector`,
    `kv_role: kv_both`), so the router may split the pool into prefill and decode workers while
    it is busy and serve it colocated while it is not (`beamserve.router.policy.pool_roles`).
    vLLM over NIXL only: SGLang fixes each server's part (`--disaggregation-mode`), and vLLM's
    Mooncake connector is a producer or a consumer."""

    env: dict[str, str] = {}
    """Extra environment for the engine (e.g. benchmark switches); may not repeat a variable
    the renderer sets."""

    def __hash__(self) -> int:
        # frozen, but `env` is a dict: hash the canonical dump instead of the field values
        return hash(self.model_dump_json())

    @property
    def disaggregated(self) -> bool:
        return self.role != "both"

    @property
    def hands_off_kv(self) -> bool:
        """Sends or receives KV: a prefill or decode pool, or a `kv_both` one."""
        return self.disaggregated or self.kv_both

    @property
    def multinode(self) -> bool:
        return self.parallel.nodes > 1

    @property
    def resolved_attention_backend(self) -> str | None:
        """`attention_backend`, else the table's choice for `gpu`, else None (engine's)."""
        from beamserve.workers.launch.hardware import attention_backend_for

        if self.attention_backend is not None:
            return self.attention_backend
        return None if self.gpu is None else attention_backend_for(self.engine, self.gpu)

    def topology(self) -> PoolTopology:
        """The KV-side view of this pool for `kv_transfer` (attention TP, page size, dtype)."""
        return PoolTopology(
            tp_size=self.parallel.attention_tp,
            page_size=self.kv_cache.page_size,
            kv_dtype=self.kv_cache.kv_dtype,
        )

    @model_validator(mode="after")
    def _check(self) -> PoolSpec:
        problems = _engine_problems(self)
        if problems:
            raise ValueError("\n".join(problems))
        return self

    @classmethod
    def parse(cls, data: Any) -> PoolSpec:
        """Validate a mapping (parsed YAML/JSON); raise `PoolSpecError` listing every problem."""
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise PoolSpecError(_explain(cls, exc)) from None


def _engine_problems(s: PoolSpec) -> list[str]:
    out: list[str] = []
    par = s.parallel
    if par.tp_size % par.dp_attention:
        out.append(
            f"parallel.dp_attention: {par.dp_attention} does not divide tp_size {par.tp_size}; "
            f"choose one of {_divisors(par.tp_size)}"
        )
    if s.engine == "sglang" and par.tp_size % par.ep_size:
        out.append(
            f"parallel.ep_size: {par.ep_size} does not divide tp_size {par.tp_size}; "
            f"choose one of {_divisors(par.tp_size)}"
        )
    if s.engine == "vllm" and par.ep_size not in (1, par.tp_size):
        out.append(
            f"parallel.ep_size: vLLM's expert parallelism spans all {par.tp_size} GPUs "
            f"(TP × DP); set ep_size to 1 or {par.tp_size}"
        )
    if s.chunked_prefill_size is not None and s.chunked_prefill_size % s.kv_cache.page_size:
        out.append(
            f"chunked_prefill_size: {s.chunked_prefill_size} is not a multiple of "
            f"kv_cache.page_size {s.kv_cache.page_size}; round it to "
            f"{_round_to(s.chunked_prefill_size, s.kv_cache.page_size)}"
        )
    if s.context_length is not None and s.context_length < s.kv_cache.page_size:
        out.append(
            f"context_length: {s.context_length} is shorter than one page "
            f"({s.kv_cache.page_size} tokens); raise it"
        )
    if not _ENV_NAME.match(s.pod_ip_env):
        out.append(
            f"pod_ip_env: {s.pod_ip_env!r} is not an environment variable name; "
            "use letters, digits and underscores, e.g. POD_IP"
        )
    if s.kv_both:
        if s.role != "both":
            out.append(
                f"kv_both: a {s.role} pool already hands KV over; kv_both is for role both "
                "pools whose parts the router chooses; remove it"
            )
        if s.engine != "vllm":
            out.append(
                "kv_both: SGLang fixes each server's part (--disaggregation-mode prefill or "
                "decode); run the pool on vllm or remove kv_both"
            )
        elif s.transfer.backend != "nixl":
            out.append(
                f"kv_both: vLLM's {s.transfer.backend} connector is a producer or a consumer, "
                "never both; set transfer.backend to nixl or remove kv_both"
            )
    ports = {"port": s.port}
    if s.hands_off_kv:
        if s.engine == "sglang" and s.role == "prefill":
            ports["transfer.bootstrap_port"] = s.transfer.bootstrap_port
        if s.engine == "vllm" and s.transfer.backend == "nixl":
            ports["transfer.side_channel_port"] = s.transfer.side_channel_port
        if s.engine == "vllm" and s.transfer.backend == "mooncake":
            ports["transfer.bootstrap_port"] = s.transfer.bootstrap_port
    if s.kv_events is not None:
        for name in ("endpoint", "replay_endpoint"):
            ep = getattr(s.kv_events, name)
            if ep is not None and ep.startswith("tcp://"):
                ports[f"kv_events.{name}"] = int(ep.rsplit(":", 1)[1])
    seen: dict[int, str] = {}
    for name, port in ports.items():
        if port in seen:
            out.append(f"{name}: port {port} is already taken by {seen[port]}; pick another")
        seen[port] = name
    if s.transfer.ib_device is not None and s.engine == "vllm":
        out.append(
            "transfer.ib_device: only SGLang takes RDMA devices on the command line; for "
            "vLLM remove it and set UCX_NET_DEVICES in the pod"
        )
    out += _node_problems(s)
    out += _feature_problems(s)
    out += _env_problems(s)
    return out


def _node_problems(s: PoolSpec) -> list[str]:
    out: list[str] = []
    par = s.parallel
    if par.tp_size % par.nodes:
        # vLLM: create_engine_config ("`--nnodes` must evenly divide the total world size");
        # SGLang splits the TP group evenly over the nodes as well
        out.append(
            f"parallel.nodes: {par.nodes} nodes cannot split tp_size {par.tp_size} evenly; "
            f"choose nodes from {_divisors(par.tp_size)}"
        )
    for name in ("leader_address_env", "node_rank_env"):
        if not _ENV_NAME.match(getattr(s, name)):
            out.append(
                f"{name}: {getattr(s, name)!r} is not an environment variable name; use "
                "letters, digits and underscores (LeaderWorkerSet sets LWS_LEADER_ADDRESS "
                "and LWS_WORKER_INDEX)"
            )
    if par.nodes > 1 and s.dist_init_port in _taken_ports(s):
        out.append(
            f"dist_init_port: port {s.dist_init_port} is already taken by "
            f"{_taken_ports(s)[s.dist_init_port]}; pick another"
        )
    return out


def _feature_problems(s: PoolSpec) -> list[str]:
    from beamserve.workers.launch.hardware import (
        SGLANG_DRAFT_ATTENTION_BACKENDS,
        allowed_attention_backends,
    )

    out: list[str] = []
    kv = s.kv_cache
    allowed = allowed_attention_backends(s.engine)
    if s.attention_backend is not None and _backend_name(s.engine, s.attention_backend) not in (
        allowed
    ):
        out.append(
            f"attention_backend: {s.attention_backend!r} is not a {s.engine} attention "
            f"backend for Beam; choose one of {list(allowed)} (or set gpu and leave it unset)"
        )
    sp = s.speculative
    if sp is not None and sp.draft_attention_backend is not None:
        draft_ok = (
            SGLANG_DRAFT_ATTENTION_BACKENDS
            if s.engine == "sglang"
            else allowed_attention_backends("vllm")
        )
        if _backend_name(s.engine, sp.draft_attention_backend) not in draft_ok:
            out.append(
                f"speculative.draft_attention_backend: {sp.draft_attention_backend!r} cannot "
                f"run a {s.engine} DFlash draft (SGLang would silently fall back); choose one "
                f"of {list(draft_ok)}"
            )
    if s.engine == "sglang" and kv.host_cache_gb > 0:
        # sglang pd_disaggregation_hook: a decode server runs with the radix cache off, and
        # kv_cache_hook.handle_cache_compatibility: "enable-hierarchical-cache and
        # disable-radix-cache are mutually exclusive"
        if s.role == "decode":
            out.append(
                "kv_cache.host_cache_gb: SGLang's decode pool runs without a radix cache, so "
                "it cannot keep a hierarchical host cache; set it to 0 on the decode pool "
                "(keep the host cache on the prefill pool)"
            )
        elif not kv.prefix_caching:
            out.append(
                "kv_cache.host_cache_gb: SGLang's hierarchical cache extends the radix "
                "(prefix) cache; set kv_cache.prefix_caching to true or host_cache_gb to 0"
            )
    if s.unified_memory:
        if s.engine == "vllm":
            out.append(
                "unified_memory: vLLM 0.33 has no unified KV memory pool; remove it "
                "(or run the pool on SGLang)"
            )
        elif s.disaggregated:
            # sglang kv_cache_hook.handle_unified_memory_pool
            if s.transfer.backend != "mooncake":
                out.append(
                    "unified_memory: SGLang moves a unified pool between P/D pools only "
                    f"over mooncake, not {s.transfer.backend}; set transfer.backend to "
                    "mooncake or unified_memory to false"
                )
            elif sp is not None:
                out.append(
                    "unified_memory: SGLang's unified pool with P/D over mooncake does not "
                    "support speculative decoding; remove speculative or unified_memory"
                )
    if s.engine == "vllm":
        if s.prefill_decode_interval is not None:
            out.append(
                "prefill_decode_interval: vLLM 0.33 has no prefill/decode interval; remove it"
            )
        if s.tokenizer_worker_num not in (None, 1):
            out.append(
                "tokenizer_worker_num: vLLM 0.33 tokenizes in its API server processes and "
                "has no tokenizer worker count; remove it"
            )
        if sp is not None and sp.simulate_acceptance_length is not None:
            out.append(
                "speculative.simulate_acceptance_length: only SGLang can simulate an "
                "acceptance length (SGLANG_SIMULATE_ACC_LEN); remove it for vLLM"
            )
        if (
            s.max_running_requests is not None
            and s.chunked_prefill_size is not None
            and s.chunked_prefill_size < s.max_running_requests
        ):
            # vllm SchedulerConfig: max_num_batched_tokens must be ≥ max_num_seqs
            out.append(
                f"chunked_prefill_size: vLLM needs at least max_running_requests "
                f"({s.max_running_requests}) tokens per step; raise it to "
                f"{_round_up(s.max_running_requests, kv.page_size)} or lower "
                "max_running_requests"
            )
    return out


# Variables the renderers set themselves (`env` may not repeat them), and the pod's own.
RENDERED_ENV = frozenset(
    {
        "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION",
        "SGLANG_HOST_IP",
        "SGLANG_SIMULATE_ACC_LEN",
        "VLLM_NIXL_SIDE_CHANNEL_HOST",
        "VLLM_NIXL_SIDE_CHANNEL_PORT",
        "VLLM_HOST_IP",
        "VLLM_MOONCAKE_BOOTSTRAP_PORT",
    }
)


def _env_problems(s: PoolSpec) -> list[str]:
    out: list[str] = []
    own = {s.pod_ip_env, s.leader_address_env, s.node_rank_env}
    for key in s.env:
        if not _ENV_NAME.match(key):
            out.append(
                f"env.{key}: not an environment variable name; use letters, digits and underscores"
            )
        elif key in RENDERED_ENV:
            out.append(
                f"env.{key}: the launcher sets it itself; remove it from env (use the "
                "pool spec's own field)"
            )
        elif key in own:
            out.append(
                f"env.{key}: names the pod's own address/rank variable; the pod defines it "
                "(downward API, LeaderWorkerSet), so remove it from env"
            )
    return out


def _backend_name(engine: str, name: str) -> str:
    """vLLM's backend names are enum members (upper case); its parser accepts either case."""
    return name.upper() if engine == "vllm" else name


def _taken_ports(s: PoolSpec) -> dict[int, str]:
    """The HTTP and transfer ports `s` opens (KV-event sockets are checked on their own)."""
    ports = {s.port: "port"}
    if s.hands_off_kv:
        t = s.transfer
        if s.engine == "sglang" and s.role == "prefill":
            ports.setdefault(t.bootstrap_port, "transfer.bootstrap_port")
        if s.engine == "vllm" and t.backend == "nixl":
            ports.setdefault(t.side_channel_port, "transfer.side_channel_port")
        if s.engine == "vllm" and t.backend == "mooncake":
            ports.setdefault(t.bootstrap_port, "transfer.bootstrap_port")
    return ports


def _explain(cls: type[BaseModel], exc: ValidationError) -> list[str]:
    lines: list[str] = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-"))
        kind = err["type"]
        if kind == "extra_forbidden":
            parent = _model_at(cls, err["loc"][:-1])
            valid = sorted(parent.model_fields) if parent is not None else []
            lines.append(f"{loc}: unknown key; valid keys here are {valid}")
        elif kind == "missing":
            lines.append(f"{loc}: required; add it")
        elif kind == "value_error":
            # our own validators: the message already names the field and the fix
            msg = str(err["ctx"]["error"]) if "ctx" in err else err["msg"]
            lines.extend(msg.splitlines())
        else:
            got = err.get("input")
            lines.append(f"{loc}: {err['msg']} (got {got!r})")
    return lines


def _model_at(cls: type[BaseModel], loc: tuple[int | str, ...]) -> type[BaseModel] | None:
    model: type[BaseModel] | None = cls
    for part in loc:
        if model is None:
            return None
        field = model.model_fields.get(str(part))
        if field is None:
            return None
        model = _model_of(field.annotation)
    return model


def _model_of(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _round_to(value: int, unit: int) -> int:
    return max(unit, round(value / unit) * unit)


def _round_up(value: int, unit: int) -> int:
    return -(-value // unit) * unit
