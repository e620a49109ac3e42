"""The `BeamDeployment` API (`beamserve.io/v1alpha1`): pydantic models, the single source.

Everything else is generated from or checked against these models: the CRD's OpenAPI schema
(`beamserve.operator.crd`), the admission rules (`beamserve.operator.admission`), the pool
commands (`beamserve.operator.pools`, through `beamserve.workers.launch`), and the router's
configuration file (`RouterConfig`: the CRD's `spec.router`, the ConfigMap the operator writes,
and `beamserve router --config FILE`).

JSON field names are camelCase (the Python attributes are snake_case; both are accepted on
input), unknown keys are errors, and strings are never coerced to numbers (what the API server
does with a structural schema). This module imports only pydantic and the launchers' type
aliases: the router, `beamserve validate` and the CRD generator import it without kopf.

Cross-field rules live in `admission.validate` (all of them) and, for servers ≥ 1.25, in the
CRD's CEL rules (a subset); the models here hold only per-field types, enums, bounds and
defaults, so that the schema generated from them is exactly what the API server enforces.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from beamserve.workers.launch.spec import (
    CheckpointFormat,
    GPUModel,
    KVDtypeName,
    PageSize,
    TransferBackend,
)
from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

GROUP = "beamserve.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "BeamDeployment"
PLURAL = "beamdeployments"
SINGULAR = "beamdeployment"
SHORT_NAMES = ("bd",)
LIST_KIND = "BeamDeploymentList"

EngineName = Literal["sglang", "vllm", "sim", "ref"]
PoolRole = Literal["prefill", "decode", "both"]
POOL_ROLES: tuple[PoolRole, ...] = ("prefill", "decode", "both")
GPU_ENGINES = frozenset({"sglang", "vllm"})

Port = Annotated[int, Field(ge=1, le=65535)]
# Kubernetes quantities ("100Gi", "500M", "1.5Ti"): the API server's own pattern, simplified.
Quantity = Annotated[
    str, Field(pattern=r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$", min_length=1)
]
# Prometheus durations, the Prometheus operator's own pattern ("15s", "1m30s", "500ms").
Duration = Annotated[
    str,
    Field(
        pattern=r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?"
        r"(([0-9]+)ms)?)$",
        min_length=1,
    ),
]
# `maxUnavailable` / `maxSurge`: a count or a percentage (Kubernetes IntOrString).
IntOrPercent = int | Annotated[str, Field(pattern=r"^[0-9]{1,3}%$")]
EnvName = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]
# A Kubernetes object passed through unchanged (affinity, tolerations, pod-template overrides):
# the API server keeps unknown fields here (`x-kubernetes-preserve-unknown-fields`).
Passthrough = dict[str, Any]
PASSTHROUGH_FIELDS = frozenset(
    {"resources", "affinity", "tolerations", "topologySpreadConstraints", "podTemplate"}
)
"""Fields (camelCase) the CRD keeps as free-form Kubernetes objects; the rest is structural."""


class _Model(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        frozen=True,
        alias_generator=to_camel,
        populate_by_name=True,
        use_attribute_docstrings=True,
    )

    def to_json_dict(self) -> dict[str, Any]:
        """camelCase JSON (what the API server stores), optional fields left out when unset."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


# -- model ------------------------------------------------------------------------------------


class HostPathSource(_Model):
    """A checkpoint directory on every node (`hostPath` volume, read-only)."""

    path: Annotated[str, Field(pattern=r"^/.*", min_length=1)]
    """Absolute path on the node."""


class PVCSource(_Model):
    """A checkpoint on an existing PersistentVolumeClaim (mounted read-only)."""

    claim_name: Annotated[str, Field(min_length=1, max_length=253)]
    sub_path: str | None = None
    """Folder inside the volume holding `config.json` (default: the volume's root)."""


class DownloadSource(_Model):
    """Downloaded by an init container into a volume the operator creates."""

    uri: Annotated[str, Field(pattern=r"^(hf|s3|gs|https?)://\S+$")]
    """`hf://org/name[@revision]`, `s3://bucket/prefix`, `gs://bucket/prefix` or `https://…`."""
    storage_size: Quantity = "1Ti"
    """Size of the volume the checkpoint is downloaded into (per pod, or per claim)."""
    storage_class_name: str | None = None
    """StorageClass of a shared claim; unset: an `emptyDir` per pod (downloaded per pod)."""
    credentials_secret: str | None = None
    """Secret whose keys become the download's environment (`HF_TOKEN`, `AWS_…`)."""
    image: str | None = None
    """Image of the download init container (default: the operator's image)."""


class ModelSourceSpec(_Model):
    """Where the checkpoint comes from: exactly one of `hostPath`, `pvc`, `download`."""

    host_path: HostPathSource | None = None
    pvc: PVCSource | None = None
    download: DownloadSource | None = None


class DraftModelSpec(_Model):
    """DFlash2 block-parallel drafting with a separate draft checkpoint (engines sglang, vllm)."""

    source: ModelSourceSpec
    method: Literal["dflash2"] = "dflash2"
    block_size: Annotated[int, Field(ge=2, le=64)] = 8
    """Verify-window length in tokens: 1 anchor + `blockSize - 1` drafted tokens."""
    mount_path: Annotated[str, Field(pattern=r"^/.*")] = "/models/draft"
    attention_backend: Annotated[str, Field(pattern=r"^[A-Za-z0-9_]+$")] | None = None
    """The draft's attention backend (SGLang `--speculative-draft-attention-backend`)."""
    simulate_acceptance_length: Annotated[float, Field(gt=0)] | None = None
    """Benchmarks only, SGLang only: pretend this many tokens are accepted per step
    (`SGLANG_SIMULATE_ACC_LEN`)."""


class ModelSpec(_Model):
    source: ModelSourceSpec
    format: CheckpointFormat = "bf16"
    """Weight format: `bf16`, `fp8`, or `nvfp4` (a ModelOpt NVFP4 export)."""
    served_name: Annotated[str, Field(min_length=1, max_length=256)] = "beam"
    """The model name clients send (`/v1/models`)."""
    mount_path: Annotated[str, Field(pattern=r"^/.*")] = "/models/beam"
    """Where pods see the checkpoint directory (holding `config.json`)."""
    fingerprint: Annotated[str, Field(pattern=r"^[0-9a-f]{12,64}$")] | None = None
    """`BeamModelConfig.fingerprint()` of the checkpoint (hex); pairs compare it."""
    kv_heads: Annotated[int, Field(ge=1, le=1024)] = 8
    """`num_key_value_heads` of the checkpoint's `config.json` (Beam 1.0: 8). Admission checks
    every pool's attention TP against it; workers re-check against the real config."""
    context_length: Annotated[int, Field(ge=1)] | None = None
    """Longest prompt + output per request (default: the engine's, from the config)."""
    draft: DraftModelSpec | None = None


# -- engine -----------------------------------------------------------------------------------


class EnvVar(_Model):
    """A literal environment variable (secrets go through the pod-template override)."""

    name: EnvName
    value: str = ""


class EngineSpec(_Model):
    name: EngineName
    """`sglang` or `vllm` (GPU pods), `sim` (simulated Beam) or `ref` (tiny real Beam, CPU)."""
    image: Annotated[str, Field(min_length=1)] | None = None
    """Container image; required for sglang/vllm; sim/ref default to the operator's image."""
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    api: Literal["vllm", "sglang"] = "vllm"
    """HTTP surface and P/D handoff style of the `sim` and `ref` engines."""
    sim_profile: Annotated[str, Field(min_length=1)] = "tiny-cpu"
    """`sim` only: the simulated hardware profile."""
    extra_args: list[str] = []
    """Appended to every pool's command line; must not repeat a flag beamserve renders."""
    extra_env: list[EnvVar] = []
    """Added to every pool's environment; must not redefine a variable beamserve sets."""


# -- pools ------------------------------------------------------------------------------------


class PoolPorts(_Model):
    """Container ports of a worker pod (named ports on its Service, which the router watches)."""

    http: Port = 8000
    kv_events: Port = 5557
    """ZMQ PUB endpoint of KV events (`kv-events`; vLLM adds the attention-DP rank)."""
    kv_replay: Port = 5800
    """ZMQ ROUTER replay endpoint (`kv-replay`; vLLM adds the attention-DP rank, so the default
    leaves room for the ranks of `kvEvents` and `sideChannel` below it)."""
    bootstrap: Port = 8998
    """SGLang's bootstrap server (prefill), vLLM Mooncake's bootstrap, sim/ref KV handshake."""
    side_channel: Port = 5600
    """vLLM NIXL handshake (`VLLM_NIXL_SIDE_CHANNEL_PORT`; vLLM adds the attention-DP rank)."""
    dist_init: Port = 39746
    """Multi-node pools: the leader's rendezvous port (`--dist-init-addr LEADER:PORT`)."""


class PoolKVOverride(_Model):
    """Per-pool overrides of `spec.kv` (page size and dtype must still agree across pools)."""

    page_size: PageSize | None = None
    dtype: KVDtypeName | None = None
    host_cache_gb: Annotated[int, Field(ge=0)] | None = None


class EngineTuning(_Model):
    """Engine knobs of one pool (sglang and vllm; each engine refuses what it lacks)."""

    gpu: GPUModel | None = None
    """The pool's GPU model: picks the attention backends for its generation."""
    attention_backend: Annotated[str, Field(pattern=r"^[a-z0-9_]+$")] | None = None
    """e.g. `trtllm_mha` (Blackwell), `fa3` (Hopper); default: the engine's choice."""
    memory_fraction: Annotated[float, Field(gt=0, le=1)] | None = None
    """Fraction of GPU memory for weights + KV (SGLang `--mem-fraction-static`)."""
    unified_memory: bool | None = None
    """GB200/GB300: use unified CPU/GPU memory (SGLang `--enable-unified-memory`)."""
    max_running_requests: Annotated[int, Field(ge=1)] | None = None
    cuda_graph_max_batch_size: Annotated[int, Field(ge=1)] | None = None
    chunked_prefill_size: Annotated[int, Field(ge=1)] | None = None
    """Tokens per prefill chunk, a multiple of the page size (sim: its per-step token budget)."""
    prefill_decode_interval: Annotated[int, Field(ge=0)] | None = None
    cache_report: bool | None = None
    """Report cached tokens in usage (SGLang `--enable-cache-report`)."""
    tokenizer_workers: Annotated[int, Field(ge=1)] | None = None


class PoolSpec(_Model):
    """One worker pool: `replicas` engine instances, each `tp` GPUs over `nodesPerReplica` nodes."""

    replicas: Annotated[int, Field(ge=0)] = 1
    tp: Annotated[int, Field(ge=1, le=64)] = 1
    """Tensor-parallel size of one engine instance (GPUs per replica ÷ `pp`)."""
    pp: Annotated[int, Field(ge=1, le=16)] = 1
    """Pipeline-parallel size (only where the launcher renders it)."""
    ep: Annotated[int, Field(ge=1, le=64)] = 1
    """Expert-parallel size of the MoE layers (1 = experts tensor-parallel)."""
    attention_dp: Annotated[int, Field(ge=1, le=64)] = 1
    """Attention data-parallel groups inside `tp` (KV heads shard over `tp / attentionDp`)."""
    nodes_per_replica: Annotated[int, Field(ge=1, le=64)] = 1
    """Nodes one engine instance spans (> 1: a LeaderWorkerSet)."""
    gpus_per_node: Annotated[int, Field(ge=0, le=64)] | None = None
    """GPUs each pod requests; default `tp × pp ÷ nodesPerReplica` (sglang/vllm), 0 (sim/ref)."""
    gpu_resource: Annotated[str, Field(min_length=1)] = "nvidia.com/gpu"
    ports: PoolPorts = PoolPorts()
    kv: PoolKVOverride = PoolKVOverride()
    tuning: EngineTuning = EngineTuning()
    extra_args: list[str] = []
    """Appended after `spec.engine.extraArgs` for this pool only."""
    resources: Passthrough | None = None
    """Container `resources` (requests/limits); the GPU limit is added from `gpusPerNode`."""
    node_selector: dict[str, str] = {}
    tolerations: list[Passthrough] = []
    affinity: Passthrough | None = None
    topology_spread_constraints: list[Passthrough] = []
    priority_class_name: str | None = None
    pod_template: Passthrough | None = None
    """A partial pod template merged over the generated one (labels, annotations, volumes,
    sidecars, securityContext …): the escape hatch for what the API does not model."""


# -- kv ---------------------------------------------------------------------------------------


class KVSpec(_Model):
    transfer_backend: TransferBackend = "nixl"
    page_size: PageSize = 64
    """Tokens per KV page (SGLang `--page-size`, vLLM `--block-size`); 64: fewer descriptors."""
    dtype: KVDtypeName = "bf16"
    host_cache_gb: Annotated[int, Field(ge=0)] = 0
    """Hierarchical (host-memory) KV cache per GPU rank, in GB; 0 = off."""
    prefix_caching: bool = True
    ib_device: Annotated[str, Field(min_length=1)] | None = None
    """SGLang only: RDMA devices (`--disaggregation-ib-device`, e.g. `mlx5_0,mlx5_1`)."""
    on_load_failure: Literal["recompute", "fail"] = "recompute"
    """vLLM only: when decode cannot load the KV, recompute locally or fail the request."""


# -- router -----------------------------------------------------------------------------------


class SecretKeyRef(_Model):
    name: Annotated[str, Field(min_length=1, max_length=253)]
    key: Annotated[str, Field(min_length=1)]


class ManagedRedisSpec(_Model):
    """A single-replica Redis the operator runs for shared sessions."""

    image: Annotated[str, Field(min_length=1)] = "redis:7.4-alpine"
    storage_size: Quantity | None = None
    """A PersistentVolumeClaim of this size (default: `emptyDir`, sessions lost on restart)."""
    resources: Passthrough | None = None


class SessionStoreSpec(_Model):
    """Where routers keep sessions: `memory` (one router), `redis` (managed), `external`."""

    type: Literal["memory", "redis", "external"] = "memory"
    redis: ManagedRedisSpec | None = None
    """`type: redis` only."""
    url: Annotated[str, Field(pattern=r"^rediss?://\S+$")] | None = None
    """`type: external`: `redis://host:port/db` (or `urlSecretRef`)."""
    url_secret_ref: SecretKeyRef | None = None


class ReplicaSyncSpec(_Model):
    """Routers sharing their bookings, routing-time predictions and flow-control room over the
    session store's Redis (pub/sub), so each replica routes as if it saw all the traffic."""

    enabled: bool = True
    """Takes effect with a Redis session store (`redis` or `external`); false: each replica
    learns the others' load from the workers' metrics only."""
    channel: Annotated[str, Field(pattern=r"^\S+$", max_length=256)] | None = None
    """The pub/sub channel (default: from the session key prefix, `beamserve:session-sync`);
    set it when two deployments share one Redis."""


class PoolRolesSpec(_Model):
    """An aggregated (`both`) pool whose roles follow its load: its engines can each send and
    receive KV (vLLM NIXL `kv_both`), and the router serves it colocated while it is lightly
    loaded and splits it into prefill and decode workers once it is not (docs/policies.md,
    "Pool roles that follow the load")."""

    prefill_workers: Annotated[int, Field(ge=1)] = 1
    """Workers that prefill while the pool is split (the lowest ids; at least one decodes)."""
    split_at_sessions_per_worker: Annotated[float, Field(gt=0)] = 10.0
    """Active sessions (in flight or between turns) per worker at which the pool splits."""
    colocate_below_sessions_per_worker: Annotated[float, Field(gt=0)] | None = None
    """Per worker, below which it serves colocated again (default: ⅔ of the split line);
    must not exceed splitAtSessionsPerWorker."""
    settle_seconds: Annotated[float, Field(ge=0)] = 10.0
    """How long the pool stays under that line before it does."""
    spill_at_sessions_per_worker: Annotated[float, Field(gt=0)] | None = None
    """Split, the prefill stage spills (flowControl.prefillSpillAfterSeconds) only from this
    many active sessions per worker on; null: whenever split. At least
    splitAtSessionsPerWorker."""
    spill_stop_below_sessions_per_worker: Annotated[float, Field(ge=0)] | None = None
    """Once spilling, the stage spills on until the active sessions per worker fall under
    this (0: until the pool serves colocated again); null: half of spillAtSessionsPerWorker.
    Needs spillAtSessionsPerWorker and must not exceed it."""
    drain_quiet_seconds: Annotated[float, Field(gt=0)] | None = 2.0
    """Split, once no new session has come for this long, none is held and a prefill worker
    is idle (the end of a burst), the pool drains: every worker decodes, and a continuing turn
    moves by KV handoff from its worker to the one with the fewest requests in flight
    (docs/policies.md, "The drain"). A new session ends it. null: never drains."""
    drain_below_peak: Annotated[float, Field(gt=0, le=1)] | None = 0.9
    """… and only while the pool's active sessions are under this share of their peak over
    the last minute (null: any quiet spell)."""
    drain_move_margin: Annotated[int, Field(ge=1)] = 2
    """A turn moves only to a worker with at least this many fewer requests in flight."""
    drain_max_prefill_tokens: Annotated[int, Field(ge=0)] = 8192
    """… and with at most this many prompt tokens queued for prefill."""

    @model_validator(mode="after")
    def _ordered(self) -> PoolRolesSpec:
        c = self.colocate_below_sessions_per_worker
        if c is not None and c > self.split_at_sessions_per_worker:
            raise ValueError(
                f"colocateBelowSessionsPerWorker {c} exceeds splitAtSessionsPerWorker "
                f"{self.split_at_sessions_per_worker}; lower it, or the pool would flap"
            )
        spill = self.spill_at_sessions_per_worker
        if spill is not None and spill < self.split_at_sessions_per_worker:
            raise ValueError(
                f"spillAtSessionsPerWorker {spill} is below splitAtSessionsPerWorker "
                f"{self.split_at_sessions_per_worker}; the spill acts only on a split pool — "
                "raise it, or remove it to spill whenever split"
            )
        stop = self.spill_stop_below_sessions_per_worker
        if stop is not None and (spill is None or stop > spill):
            raise ValueError(
                f"spillStopBelowSessionsPerWorker {stop} needs a spillAtSessionsPerWorker at or "
                f"above it (now {spill}); set that line, or remove spillStopBelowSessionsPerWorker"
            )
        return self


class DisaggregationSpec(_Model):
    """When the router sends a prefill to the prefill pool (else colocated on decode)."""

    enabled: bool = True
    """False: never disaggregate (every request prefills on its decode worker)."""
    min_uncached_tokens: Annotated[int, Field(ge=0)] = 2048
    max_cached_ratio: Annotated[float, Field(ge=0, le=1)] = 0.7
    keep_warm_local: bool = False
    """True: a turn routed to the decode worker that holds its session is prefilled there,
    whatever the size of its new part (a prefill worker would recompute the whole context);
    only new sessions' prompts go to the prefill pool."""
    pool_roles: PoolRolesSpec | None = None
    """Aggregated serving only (`spec.both`, engine vllm over NIXL, or sim with api vllm): the
    pool's engines can hand KV to each other and the router chooses their parts by load."""


class FlowControlSpec(_Model):
    """Turn-priority flow control (the router's `FlowConfig`)."""

    max_queued: Annotated[int, Field(ge=1)] = 5000
    ttl_seconds: Annotated[float, Field(ge=0)] = 60.0
    las_half_life_seconds: Annotated[float, Field(gt=0)] = 60.0
    retry_after_max_seconds: Annotated[int, Field(ge=1)] = 60
    drain_window_seconds: Annotated[float, Field(gt=0)] = 30.0
    hold_continuing: bool = False
    """True: the saturation gate holds continuing turns too (default: only new and sheddable
    work waits; docs/policies.md, "Continuing turns are not gated")."""
    live_session_seconds: Annotated[float, Field(gt=0)] | None = 60.0
    """A request of a session whose record changed within this long counts as a continuing
    turn whatever its prompt (a sub-agent's call its agent is blocked on), so it is not held
    behind new sessions; null: only a prompt that extends the session's last counts (docs/
    router.md, "One request")."""
    lifo_after_seconds: Annotated[float, Field(ge=0)] | None = 2.0
    """Once the oldest waiting new session has waited this long, new sessions are served newest
    first (adaptive LIFO), so those that can still get a quick first token do; null: always
    oldest first (docs/policies.md, "Adaptive LIFO in the lower bands")."""
    lifo_max_wait_seconds: Annotated[float, Field(gt=0)] = 30.0
    """Under adaptive LIFO, requests that waited this long (at most half of ttlSeconds) are
    served first again, so none expires; must be above lifoAfterSeconds."""
    prefill_gate_tokens: Annotated[int, Field(ge=1)] | None = 32768
    """With a prefill pool: new sessions whose prompt the router splits go to it only while a
    prefill worker has less than this much prefill in flight, and wait in the router meanwhile,
    shortest first; null: straight into the prefill workers' own queues (docs/policies.md,
    "The prefill stage of a disaggregated pool")."""
    prefill_gate_lead: bool = False
    """True: the prompt a prefill worker computes now does not count against
    prefillGateTokens, so its next prompt is sent meanwhile and the worker does not idle for
    the router's round trip — but that prompt then waits in the engine first come first
    served, not shortest first in the router; false: every prompt in flight counts."""
    prefill_sjf_window_seconds: Annotated[float, Field(gt=0)] | None = 2.0
    """At that stage, shortest first only among the new sessions that waited less than this
    (they can still meet a TTFT bound this long); the others after them, oldest first; null:
    shortest first among all (docs/policies.md, "The prefill stage of a disaggregated pool")."""
    prefill_lull_longest_first_seconds: Annotated[float, Field(gt=0)] | None = 2.0
    """Once no new session has reached the router for this long while some wait at that stage
    (the end of a burst), those that waited past prefillSjfWindowSeconds (none of which can
    still meet that TTFT bound) go longest first, and the spill takes the shortest of them: the
    backlog ends sooner, with no prefill worker left computing one long last prompt while the
    other idles; null: oldest first always (docs/policies.md, "Longest first in a lull")."""
    prefill_lull_rescue_seconds: Annotated[float, Field(gt=0)] | None = 45.0
    """In such a lull, only the new sessions that waited this long (at most ¾ of the queue's
    TTL) still go first, oldest first, so that none expires; null: those that waited
    lifoMaxWaitSeconds, as outside a lull."""
    prefill_spill_after_seconds: Annotated[float, Field(ge=0)] | None = None
    """At that stage, a new session that waited this long may instead be prefilled on a decode
    worker that has room for it (its queued prefill within prefillSpillMaxTokens, its users'
    slack beyond prefillSpillMarginSeconds); null: never (docs/policies.md, "The prefill
    stage of a disaggregated pool")."""
    prefill_spill_max_tokens: Annotated[int, Field(ge=1)] = 49152
    """A decode worker takes a spilled prefill only while its queued prefill, with it, stays
    within this."""
    prefill_spill_margin_seconds: Annotated[float, Field(ge=0)] = 0.5
    """… and while each user streaming from it keeps this much slack beyond that prefill, at
    paceHoldUserTokensPerSecond (prefill priced at prefillSpillTokensPerSecond)."""
    prefill_spill_tokens_per_second: Annotated[float, Field(gt=0)] | None = None
    """The rate a spilled prefill is priced at against those users' slack; null:
    paceHoldPrefillTokensPerSecond. With the prefill in pieces on, a spilled prompt is
    prefilled a piece at a time beside memory-bound decode steps, which costs the users less
    than a whole prefill would (docs/policies.md, "The prefill in pieces")."""
    prefill_spill_user_tokens_per_second: Annotated[float, Field(gt=0)] | None = None
    """The decoding speed per user the spill keeps (its users' slack is reckoned at it); null:
    paceHoldUserTokensPerSecond. Lower lets a saturated pool's decode workers take more of the
    new sessions' prefill at their users' expense."""
    prefill_spill_lull_seconds: Annotated[float, Field(gt=0)] | None = None
    """Once no new session has reached the router for this long while some wait at that
    stage (the end of a burst), the spill keeps users at prefillSpillLullUserTokensPerSecond
    instead, within prefillSpillLullMaxTokens: the held sessions, which no longer compete with
    new ones, drain on the decode workers too; null: never (docs/policies.md, "The spill in a
    lull")."""
    prefill_spill_lull_user_tokens_per_second: Annotated[float, Field(gt=0)] = 10.0
    """The decoding speed per user the spill keeps in a lull."""
    prefill_spill_lull_max_tokens: Annotated[int, Field(ge=1)] | None = None
    """A decode worker's queued prefill bound for the spill in a lull; null:
    prefillSpillMaxTokens."""
    prefill_spill_lull_below_peak: Annotated[float, Field(gt=0, le=1)] | None = 0.9
    """The spill in a lull only while the pool is draining: its active sessions under this
    share of their peak over prefillSpillLullPeakSeconds (a quiet spell at the peak, when many
    sessions opened at once, is no end of a burst); null: any quiet spell (docs/policies.md,
    "The spill in a lull")."""
    prefill_spill_lull_peak_seconds: Annotated[float, Field(gt=0)] = 60.0
    """The window of that peak."""
    prefill_piece_min_tokens: Annotated[int, Field(ge=1)] | None = None
    """A continuing turn with this many uncached tokens, prefilled on its session's worker, is
    prefilled in pieces: the router first sends its prompt's growing prefixes
    (prefillPieceTokens more each, one answered before the next) so each engine step beside
    the users decoding there holds at most a piece; null: off (docs/policies.md, "The
    prefill in pieces")."""
    prefill_piece_tokens: Annotated[int, Field(ge=1)] = 1024
    """Tokens of prefill per piece."""
    prefill_first_pieces: bool = True
    """A new session's first turn, prefilled on a worker where other sessions live (a
    request of theirs streaming, or one resting between turns), is sent in pieces, so their
    next turns wait for one piece at most instead of the whole prompt (docs/policies.md,
    "First turns beside live sessions")."""
    prefill_first_piece_tokens: Annotated[int, Field(ge=1)] | None = None
    """Tokens per first-turn piece; null: the step budget each worker reports (SGLang's
    chunked_prefill_size, beamserve workers' max_num_batched_tokens) less room for its decodes,
    and no pieces on a worker that reports none (stock vLLM does not: set this to its
    max_num_batched_tokens less a few hundred)."""
    prefill_piece_yield_tokens: Annotated[int, Field(ge=1)] | None = None
    """Before each piece, the router waits while a turn of its own with at most this many
    uncached tokens waits on that worker for its first token, so the short turn's prefill
    takes a step of its own, not one beside the next piece; null: off (docs/policies.md,
    "Pieces yield to short turns")."""
    prefill_piece_yield_max_seconds: Annotated[float, Field(gt=0)] = 0.5
    """The longest one such wait."""
    pace_hold_tokens: Annotated[int, Field(ge=1)] | None = None
    """A continuing turn with this many uncached tokens, prefilled on its session's worker,
    waits in the router while its prefill would slow a user decoding there under
    paceHoldUserTokensPerSecond; null: off (docs/policies.md, "The pace hold")."""
    pace_hold_max_seconds: Annotated[float, Field(gt=0)] = 1.5
    """A held turn goes when waiting longer would end its own prefill later than this after
    admission."""
    pace_hold_user_tokens_per_second: Annotated[float, Field(gt=0)] = 20.0
    """The decoding speed per user the pace hold protects."""
    pace_hold_prefill_tokens_per_second: Annotated[float, Field(gt=0)] = 38000.0
    """What one prefill token costs the engine steps beside the decodes, as tokens/s (38,000:
    Beam on 8 × H200, bf16)."""


class SaturationSpec(_Model):
    max_prefill_tokens: Annotated[float, Field(gt=0)] = 65536.0
    max_queue_len: Annotated[float, Field(gt=0)] = 5.0
    max_kv_usage: Annotated[float, Field(gt=0)] = 0.8
    stale_after_seconds: Annotated[float, Field(ge=0)] = 2.0
    max_decode_itl_seconds: Annotated[float, Field(gt=0)] | None = 0.05
    """Decode seconds per output token, as the router times its users' streams, at which a
    worker counts as full, so new sessions wait (0.05: 20 tokens/s per user); null: off
    (docs/policies.md, "Saturation gate")."""
    cap_workers_at_threshold: bool = True
    """A worker past full counts as full in the pool's mean, so one overloaded worker does not
    hold new sessions while another has room; false: the raw mean (docs/policies.md,
    "Saturation gate")."""


RouterPolicyName = Literal[
    "sticky-until-saturated", "weighted", "round-robin", "least-load", "prefix-only"
]


class RouterConfig(_Model):
    """The router: `spec.router` of a BeamDeployment, the ConfigMap the operator writes, and
    the file `beamserve router --config FILE` reads (its flags override the file).

    `replicas`, `image`, `resources` and `nodeSelector` shape the router's Deployment; the rest
    is the router process's configuration.
    """

    replicas: Annotated[int, Field(ge=0)] = 1
    image: Annotated[str, Field(min_length=1)] | None = None
    """Default: the operator's image."""
    port: Port = 8080
    grpc_port: Port | None = None
    """Serve the Envoy ext_proc endpoint picker (Gateway API Inference Extension) here."""
    policy: RouterPolicyName = "sticky-until-saturated"
    policy_config: Passthrough | None = None
    """A full policy configuration (filters, scorers, picker) in place of the `policy` preset."""
    disaggregation: DisaggregationSpec = DisaggregationSpec()
    flow_control: FlowControlSpec = FlowControlSpec()
    saturation: SaturationSpec = SaturationSpec()
    session_store: SessionStoreSpec = SessionStoreSpec()
    replica_sync: ReplicaSyncSpec = ReplicaSyncSpec()
    api_keys_secret_ref: SecretKeyRef | None = None
    """A Secret key holding the API keys (JSON `{key: {tenant, priority, rate_per_s, burst}}`);
    unset: no key required."""
    max_body_bytes: Annotated[int, Field(ge=1024)] = 32 * 1024 * 1024
    scrape_interval_seconds: Annotated[float, Field(gt=0)] = 1.0
    prefill_timeout_seconds: Annotated[float, Field(gt=0)] = 30.0
    resources: Passthrough | None = None
    node_selector: dict[str, str] = {}


# -- rollout, monitoring ----------------------------------------------------------------------


class RolloutSpec(_Model):
    max_unavailable: IntOrPercent = 0
    """Replicas of a pool that may be unready during a rollout (count or `N%`)."""
    max_surge: IntOrPercent = 1
    """Extra replicas of a pool a rollout may add (count or `N%`)."""
    drain_timeout_seconds: Annotated[int, Field(ge=0, le=86400)] = 600
    """How long a retiring revision may finish in-flight requests before it is removed."""


class MonitoringSpec(_Model):
    enabled: bool = True
    """Create a ServiceMonitor/PodMonitor per role when the Prometheus operator's API exists."""
    kind: Literal["ServiceMonitor", "PodMonitor"] = "ServiceMonitor"
    interval: Duration = "15s"
    labels: dict[str, str] = {}
    """Extra labels on the monitors (to match a Prometheus' selector)."""


# -- the spec ---------------------------------------------------------------------------------


class BeamDeploymentSpec(_Model):
    """Disaggregated (`prefill` + `decode`) or aggregated (`both`) serving of one model."""

    model: ModelSpec
    engine: EngineSpec
    prefill: PoolSpec | None = None
    decode: PoolSpec | None = None
    both: PoolSpec | None = None
    """Aggregated serving: one pool that prefills and decodes (exclusive with prefill/decode)."""
    kv: KVSpec = KVSpec()
    router: RouterConfig = RouterConfig()
    rollout: RolloutSpec = RolloutSpec()
    monitoring: MonitoringSpec = MonitoringSpec()

    def pools(self) -> dict[PoolRole, PoolSpec]:
        """The pools this spec sets, by role, in `POOL_ROLES` order."""
        out: dict[PoolRole, PoolSpec] = {}
        for role in POOL_ROLES:
            pool = getattr(self, role)
            if pool is not None:
                out[role] = pool
        return out

    def swings(self, role: PoolRole) -> bool:
        """Is `role`'s pool one whose parts the router chooses by load: the `both` pool, with
        `router.disaggregation.poolRoles` set (its engines send and receive KV)."""
        return role == "both" and self.router.disaggregation.pool_roles is not None

    def page_size(self, role: PoolRole) -> int:
        pool = getattr(self, role)
        override = pool.kv.page_size if pool is not None else None
        return int(override) if override is not None else int(self.kv.page_size)

    def kv_dtype(self, role: PoolRole) -> str:
        pool = getattr(self, role)
        override = pool.kv.dtype if pool is not None else None
        return str(override) if override is not None else str(self.kv.dtype)

    def host_cache_gb(self, role: PoolRole) -> int:
        pool = getattr(self, role)
        override = pool.kv.host_cache_gb if pool is not None else None
        return override if override is not None else self.kv.host_cache_gb

    def gpus_per_node(self, role: PoolRole) -> int:
        pool: PoolSpec = getattr(self, role)
        if pool.gpus_per_node is not None:
            return pool.gpus_per_node
        if self.engine.name not in GPU_ENGINES:
            return 0
        return max(1, pool.tp * pool.pp // pool.nodes_per_replica)


# -- status -----------------------------------------------------------------------------------

ConditionType = Literal["Ready", "Progressing", "Degraded"]


class Condition(_Model):
    """A Kubernetes-style condition (`metav1.Condition` without `observedGeneration`)."""

    type: ConditionType
    status: Literal["True", "False", "Unknown"]
    reason: Annotated[str, Field(pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")]
    message: str = ""
    last_transition_time: str
    """RFC 3339 time of the last status change."""


class PoolStatus(_Model):
    replicas: Annotated[int, Field(ge=0)] = 0
    ready_replicas: Annotated[int, Field(ge=0)] = 0
    updated_replicas: Annotated[int, Field(ge=0)] = 0
    """Replicas of the update revision."""
    selector: str = ""
    """Label selector of the pool's pods (string form, as `/scale` reports it)."""


class BeamDeploymentStatus(_Model):
    observed_generation: Annotated[int, Field(ge=0)] | None = None
    conditions: list[Condition] = []
    prefill: PoolStatus | None = None
    decode: PoolStatus | None = None
    both: PoolStatus | None = None
    current_revision: str | None = None
    """The revision every ready pool runs."""
    update_revision: str | None = None
    """The revision the spec asks for (equal to `currentRevision` when converged)."""
    router_endpoint: str | None = None
    """`http://<service>.<namespace>.svc:<port>`: where clients send requests."""


class ObjectMeta(_Model):
    """The part of `metadata` the API reads (everything else passes through)."""

    model_config = ConfigDict(extra="allow")
    name: str | None = None
    namespace: str | None = None
    generation: int | None = None


class BeamDeployment(_Model):
    """A whole object, as `kubectl apply -f` sends it."""

    api_version: Literal["beamserve.io/v1alpha1"] = "beamserve.io/v1alpha1"
    kind: Literal["BeamDeployment"] = "BeamDeployment"
    metadata: ObjectMeta = ObjectMeta()
    spec: BeamDeploymentSpec
    status: BeamDeploymentStatus | None = None
