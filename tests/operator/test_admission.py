"""`admission.validate` / `validate_update`: every rule reports the field path and a fix."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
from beamserve.operator.admission import Violation, validate, validate_update
from beamserve.operator.naming import MAX_NAME_LENGTH

_spec = importlib.util.spec_from_file_location("_specs", Path(__file__).parent / "_specs.py")
assert _spec is not None and _spec.loader is not None
S = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(S)
D = S.DELETE


def _sim(**over: Any) -> dict[str, Any]:
    base = S.disagg(engine={"name": "sim", "image": D}, prefill={"tp": 1}, decode={"tp": 1})
    return S.merge(base, over)


# (case id, spec or whole object, field path the violation must name)
INVALID: list[tuple[str, dict[str, Any], str]] = [
    # structure: unknown fields, types, enums, bounds
    ("unknown top-level spec field", S.disagg(replicas=3), "spec.replicas"),
    ("unknown pool field", S.disagg(decode={"gpus": 4}), "spec.decode.gpus"),
    ("unknown nested field", S.disagg(kv={"pagesize": 64}), "spec.kv.pagesize"),
    ("snake_case is not the JSON name", S.disagg(decode={"attention_dp": 2}),
     "spec.decode.attention_dp"),
    ("string for a number", S.disagg(decode={"tp": "4"}), "spec.decode.tp"),
    ("float for an int", S.disagg(decode={"tp": 4.0}), "spec.decode.tp"),
    ("bool for an int", S.disagg(decode={"replicas": True}), "spec.decode.replicas"),
    ("negative replicas", S.disagg(decode={"replicas": -1}), "spec.decode.replicas"),
    ("tp 0", S.disagg(decode={"tp": 0}), "spec.decode.tp"),
    ("tp over 64", S.disagg(decode={"tp": 128}), "spec.decode.tp"),
    ("unknown engine", S.disagg(engine={"name": "tgi"}), "spec.engine.name"),
    ("missing engine", S.disagg(engine=D), "spec.engine"),
    ("missing model", S.disagg(model=D), "spec.model"),
    ("missing model source", S.disagg(model={"source": D}), "spec.model.source"),
    ("bad page size", S.disagg(kv={"pageSize": 128}), "spec.kv.pageSize"),
    ("bad kv dtype", S.disagg(kv={"dtype": "fp16"}), "spec.kv.dtype"),
    ("bad backend", S.disagg(kv={"transferBackend": "ucx"}), "spec.kv.transferBackend"),
    ("bad format", S.disagg(model={"format": "int4"}), "spec.model.format"),
    ("port 0", S.disagg(decode={"ports": {"http": 0}}), "spec.decode.ports.http"),
    ("port over 65535", S.disagg(decode={"ports": {"http": 70000}}), "spec.decode.ports.http"),
    ("relative host path", S.disagg(model={"source": {"hostPath": {"path": "m"}}}),
     "spec.model.source.hostPath.path"),
    ("bad download uri", S.disagg(model={"source": {"hostPath": D, "download": {"uri": "x"}}}),
     "spec.model.source.download.uri"),
    ("bad quantity", S.disagg(model={"source": {"hostPath": D, "download": {
        "uri": "hf://a/b", "storageSize": "lots"}}}), "spec.model.source.download.storageSize"),
    ("draft block 1", S.disagg(model={"draft": {"source": {"pvc": {"claimName": "d"}},
                                                "blockSize": 1}}), "spec.model.draft.blockSize"),
    ("bad interval", S.disagg(monitoring={"interval": "15"}), "spec.monitoring.interval"),
    ("bad maxSurge", S.disagg(rollout={"maxSurge": "a lot"}), "spec.rollout.maxSurge"),
    ("bad env name", S.disagg(engine={"extraEnv": [{"name": "1X", "value": "v"}]}),
     "spec.engine.extraEnv[0].name"),
    ("toleration not an object", S.disagg(decode={"tolerations": ["x"]}),
     "spec.decode.tolerations[0]"),
    ("bad policy preset", S.disagg(router={"policy": "random"}), "spec.router.policy"),
    ("memory fraction 0", S.disagg(decode={"tuning": {"memoryFraction": 0}}),
     "spec.decode.tuning.memoryFraction"),
    ("bad session store type", S.disagg(router={"sessionStore": {"type": "etcd"}}),
     "spec.router.sessionStore.type"),
    ("bad redis url", S.disagg(router={"sessionStore": {"type": "external", "url": "h:1"}}),
     "spec.router.sessionStore.url"),
    ("sync channel with spaces", S.disagg(router={"replicaSync": {"channel": "a b"}}),
     "spec.router.replicaSync.channel"),
    # pools
    ("both and prefill/decode", S.disagg(both={"tp": 4}), "spec.both"),
    ("no pool", S.disagg(prefill=D, decode=D), "spec"),
    ("prefill without decode", S.disagg(decode=D), "spec.decode"),
    ("decode without prefill", S.disagg(prefill=D), "spec.prefill"),
    # model
    ("two sources", S.disagg(model={"source": {"pvc": {"claimName": "m"}}}), "spec.model.source"),
    ("no source", S.disagg(model={"source": {"hostPath": D}}), "spec.model.source"),
    ("draft with two sources", S.disagg(model={"draft": {"source": {
        "pvc": {"claimName": "d"}, "hostPath": {"path": "/d"}}}}), "spec.model.draft.source"),
    ("draft on sim", _sim(model={"draft": {"source": {"pvc": {"claimName": "d"}}}}),
     "spec.model.draft"),
    ("draft at the model's mount", S.disagg(model={"draft": {"source": {
        "pvc": {"claimName": "d"}}, "mountPath": "/models/beam"}}), "spec.model.draft.mountPath"),
    ("context shorter than a page", S.disagg(model={"contextLength": 10}),
     "spec.model.contextLength"),
    # engine
    ("sglang without image", S.disagg(engine={"image": D}), "spec.engine.image"),
    ("vllm without image", S.aggregated(engine={"image": D}), "spec.engine.image"),
    ("sglang api on vllm", S.aggregated(engine={"api": "sglang"}), "spec.engine.api"),
    ("sim profile on vllm", S.aggregated(engine={"simProfile": "h200"}),
     "spec.engine.simProfile"),
    ("ib device on vllm", S.aggregated(kv={"ibDevice": "mlx5_0"}), "spec.kv.ibDevice"),
    ("load-failure policy on sglang", S.disagg(kv={"onLoadFailure": "fail"}),
     "spec.kv.onLoadFailure"),
    ("duplicate extra env", S.disagg(engine={"extraEnv": [{"name": "A"}, {"name": "A"}]}),
     "spec.engine.extraEnv[1].name"),
    ("extra env overrides POD_IP", S.disagg(engine={"extraEnv": [{"name": "POD_IP"}]}),
     "spec.engine.extraEnv[0].name"),
    ("extra env overrides the launcher's", S.disagg(engine={"extraEnv": [
        {"name": "SGLANG_HOST_IP", "value": "1.2.3.4"}]}), "spec.engine.extraEnv[0].name"),
    ("extra arg repeats a rendered flag", S.disagg(engine={"extraArgs": ["--tp-size", "2"]}),
     "spec.engine.extraArgs[0]"),
    ("pool extra arg repeats a flag", S.disagg(decode={"extraArgs": ["--page-size=32"]}),
     "spec.decode.extraArgs[0]"),
    ("vllm extra arg repeats a flag", S.aggregated(both={"extraArgs": ["--block-size", "16"]}),
     "spec.both.extraArgs[0]"),
    # parallelism vs the model
    ("attentionDp does not divide tp", S.disagg(decode={"attentionDp": 3}),
     "spec.decode.attentionDp"),
    ("tp does not shard 8 KV heads", S.disagg(prefill={"tp": 6}, decode={"tp": 3}),
     "spec.decode.tp"),
    ("tp 12 over 8 heads", S.aggregated(both={"tp": 12}), "spec.both.tp"),
    ("tp 4 over 2 heads is fine, 3 is not", S.disagg(model={"kvHeads": 2},
     prefill={"tp": 3}, decode={"tp": 1}), "spec.prefill.tp"),
    ("sglang ep does not divide tp", S.disagg(decode={"ep": 3}), "spec.decode.ep"),
    ("vllm ep other than 1 or tp", S.aggregated(both={"tp": 8, "ep": 4}), "spec.both.ep"),
    ("pp unsupported", S.disagg(decode={"pp": 2}), "spec.decode.pp"),
    ("sim attention dp", _sim(decode={"attentionDp": 2, "tp": 2}), "spec.decode.attentionDp"),
    ("sim ep", _sim(decode={"ep": 2}), "spec.decode.ep"),
    ("ref multi-node", S.disagg(engine={"name": "ref", "image": D}, prefill={"tp": 2},
     decode={"tp": 1, "nodesPerReplica": 2}), "spec.decode.nodesPerReplica"),
    ("sim with GPUs", _sim(decode={"gpusPerNode": 1}), "spec.decode.gpusPerNode"),
    ("sim tuning", _sim(decode={"tuning": {"maxRunningRequests": 8}}),
     "spec.decode.tuning.maxRunningRequests"),
    ("sim host cache", _sim(kv={"hostCacheGb": 8}), "spec.kv.hostCacheGb"),
    ("ref has no step budget", S.disagg(engine={"name": "ref", "image": D}, prefill={"tp": 1},
     decode={"tp": 1, "tuning": {"chunkedPrefillSize": 2048}}),
     "spec.decode.tuning.chunkedPrefillSize"),
    ("sim budget not a page multiple", _sim(decode={"tuning": {"chunkedPrefillSize": 1000}}),
     "spec.decode.tuning.chunkedPrefillSize"),
    # GPUs and nodes
    ("gpusPerNode ≠ tp", S.disagg(decode={"gpusPerNode": 8}), "spec.decode.gpusPerNode"),
    ("gpusPerNode × nodes ≠ tp", S.disagg(prefill={"tp": 16, "nodesPerReplica": 2,
     "gpusPerNode": 4}), "spec.prefill.gpusPerNode"),
    ("nodes do not split tp", S.disagg(prefill={"tp": 8, "nodesPerReplica": 3}),
     "spec.prefill.nodesPerReplica"),
    # pairs
    ("attention TPs do not divide", S.disagg(model={"kvHeads": 24}, prefill={"tp": 8},
     decode={"tp": 3}), "spec.decode.tp"),
    ("attention TP with dp does not divide", S.disagg(prefill={"tp": 8},
     decode={"tp": 6, "attentionDp": 2}), "spec.decode.tp"),
    ("page sizes differ", S.disagg(decode={"kv": {"pageSize": 32}}), "spec.decode.kv.pageSize"),
    ("page sizes differ (prefill override)", S.disagg(prefill={"kv": {"pageSize": 16}}),
     "spec.prefill.kv.pageSize"),
    ("kv dtypes differ", S.disagg(decode={"kv": {"dtype": "fp8_e4m3"}}), "spec.decode.kv.dtype"),
    ("sim page sizes differ", _sim(decode={"kv": {"pageSize": 16}}), "spec.decode.kv.pageSize"),
    ("sglang decode host cache", S.disagg(kv={"hostCacheGb": 64}), "spec.kv.hostCacheGb"),
    ("sglang decode host cache override", S.disagg(decode={"kv": {"hostCacheGb": 8}}),
     "spec.decode.kv.hostCacheGb"),
    # tuning
    ("chunk not a page multiple", S.disagg(prefill={"tuning": {"chunkedPrefillSize": 1000}}),
     "spec.prefill.tuning.chunkedPrefillSize"),
    ("vllm has no unified memory", S.aggregated(both={"tuning": {"unifiedMemory": True}}),
     "spec.both.tuning.unifiedMemory"),
    ("vllm has no prefill/decode interval", S.aggregated(both={"tuning": {
        "prefillDecodeInterval": 0}}), "spec.both.tuning.prefillDecodeInterval"),
    ("vllm has no tokenizer workers", S.aggregated(both={"tuning": {"tokenizerWorkers": 2}}),
     "spec.both.tuning.tokenizerWorkers"),
    ("unknown attention backend", S.disagg(decode={"tuning": {"attentionBackend": "nope"}}),
     "spec.decode.tuning.attentionBackend"),
    ("unified memory under P/D over nixl", S.disagg(decode={"tuning": {"unifiedMemory": True}}),
     "spec.decode.tuning.unifiedMemory"),
    ("bad draft attention backend", S.disagg(model={"draft": {"source": {"pvc": {
        "claimName": "d"}}, "attentionBackend": "nope"}}), "spec.model.draft.attentionBackend"),
    ("simulated acceptance on vllm", S.aggregated(model={"draft": {"source": {"pvc": {
        "claimName": "d"}}, "simulateAcceptanceLength": 4.0}}),
     "spec.model.draft.simulateAcceptanceLength"),
    # ports
    ("http = kvEvents", S.disagg(decode={"ports": {"kvEvents": 8000}}),
     "spec.decode.ports.kvEvents"),
    ("kvEvents = kvReplay", S.disagg(decode={"ports": {"kvReplay": 5557}}),
     "spec.decode.ports.kvReplay"),
    ("prefill bootstrap = http", S.disagg(prefill={"ports": {"bootstrap": 8000}}),
     "spec.prefill.ports.bootstrap"),
    ("vllm DP range overlaps", S.disagg(engine={"name": "vllm", "image": "v"}, prefill={"tp": 8},
     decode={"tp": 8, "attentionDp": 2, "ports": {"kvReplay": 5558, "kvEvents": 5557}}),
     "spec.decode.ports.kvReplay"),
    ("vllm side channel = http", S.disagg(engine={"name": "vllm", "image": "v"},
     decode={"ports": {"sideChannel": 8000}}), "spec.decode.ports.sideChannel"),
    ("multi-node dist-init = http", S.disagg(prefill={"tp": 16, "nodesPerReplica": 2,
     "ports": {"distInit": 8000}}), "spec.prefill.ports.distInit"),
    ("port range past 65535", S.disagg(engine={"name": "vllm", "image": "v"},
     decode={"tp": 8, "attentionDp": 4, "ports": {"kvReplay": 65534}}),
     "spec.decode.ports.kvReplay"),
    ("router grpc = http", S.disagg(router={"grpcPort": 8080}), "spec.router.grpcPort"),
    ("LIFO after its own rescue", S.disagg(router={"flowControl": {"lifoAfterSeconds": 40}}),
     "spec.router.flowControl.lifoAfterSeconds"),
    # Kubernetes passthroughs
    ("toleration unknown field", S.disagg(decode={"tolerations": [{"kee": "a"}]}),
     "spec.decode.tolerations[0].kee"),
    ("toleration operator", S.disagg(decode={"tolerations": [{"key": "a", "operator": "In"}]}),
     "spec.decode.tolerations[0].operator"),
    ("toleration effect", S.disagg(decode={"tolerations": [{"key": "a", "effect": "Never"}]}),
     "spec.decode.tolerations[0].effect"),
    ("spread without topologyKey", S.disagg(decode={"topologySpreadConstraints": [
        {"maxSkew": 1, "whenUnsatisfiable": "DoNotSchedule"}]}),
     "spec.decode.topologySpreadConstraints[0].topologyKey"),
    ("affinity typo", S.disagg(decode={"affinity": {"nodeAfinity": {}}}),
     "spec.decode.affinity.nodeAfinity"),
    ("resources typo", S.disagg(decode={"resources": {"limit": {}}}),
     "spec.decode.resources.limit"),
    ("GPU limit by hand", S.disagg(decode={"resources": {"limits": {"nvidia.com/gpu": 4}}}),
     "spec.decode.resources.limits"),
    ("bad resource quantity", S.disagg(decode={"resources": {"requests": {"cpu": "lots"}}}),
     "spec.decode.resources.requests['cpu']"),
    ("request over limit", S.disagg(decode={"resources": {"requests": {"memory": "2Gi"},
     "limits": {"memory": "1Gi"}}}), "spec.decode.resources.requests['memory']"),
    ("router request over limit", S.disagg(router={"resources": {"requests": {"cpu": "2"},
     "limits": {"cpu": "500m"}}}), "spec.router.resources.requests['cpu']"),
    ("pod template typo", S.disagg(decode={"podTemplate": {"specs": {}}}),
     "spec.decode.podTemplate.specs"),
    ("bad node selector key", S.disagg(decode={"nodeSelector": {"-bad": "x"}}),
     "spec.decode.nodeSelector"),
    ("bad node selector value", S.disagg(decode={"nodeSelector": {"a": "b c"}}),
     "spec.decode.nodeSelector"),
    ("bad priority class", S.disagg(decode={"priorityClassName": "High_Prio"}),
     "spec.decode.priorityClassName"),
    ("bad monitor label", S.disagg(monitoring={"labels": {"a b": "c"}}),
     "spec.monitoring.labels"),
    # router
    ("replicated routers, memory sessions", S.disagg(router={"replicas": 2}),
     "spec.router.sessionStore.type"),
    ("sync channel, memory sessions", S.disagg(router={"replicaSync": {"channel": "x:sync"}}),
     "spec.router.replicaSync.channel"),
    ("external store without url", S.disagg(router={"sessionStore": {"type": "external"}}),
     "spec.router.sessionStore.url"),
    ("url on a memory store", S.disagg(router={"sessionStore": {"url": "redis://r:6379"}}),
     "spec.router.sessionStore.url"),
    ("redis section on external", S.disagg(router={"sessionStore": {
        "type": "external", "url": "redis://r:6379", "redis": {}}}),
     "spec.router.sessionStore.redis"),
    ("policy and policyConfig", S.disagg(router={"policy": "weighted", "policyConfig": {
        "strategy": "weighted"}}), "spec.router.policyConfig"),
    ("invalid policyConfig", S.disagg(router={"policyConfig": {"scorers": [{"type": "nope"}]}}),
     "spec.router.policyConfig"),
    # references, images, hardware
    ("claim name not an object name", S.disagg(model={"source": {"hostPath": D, "pvc": {
        "claimName": "Beam_Weights"}}}), "spec.model.source.pvc.claimName"),
    ("secret name not an object name", S.disagg(router={"apiKeysSecretRef": {
        "name": "Keys!", "key": "k"}}), "spec.router.apiKeysSecretRef.name"),
    ("image with a space", S.disagg(engine={"image": "lmsysorg/sglang v1"}), "spec.engine.image"),
    ("bad GPU resource name", S.disagg(decode={"gpuResource": "nvidia gpu"}),
     "spec.decode.gpuResource"),
    ("NVFP4 on Hopper", S.disagg(model={"format": "nvfp4"}, decode={"tuning": {"gpu": "h200"}}),
     "spec.decode.tuning.gpu"),
    ("monitoring interval 0", S.disagg(monitoring={"interval": "0s"}),
     "spec.monitoring.interval"),
    ("ref with fp8 weights", S.merge(_sim(model={"format": "fp8"}), {"engine": {"name": "ref"}}),
     "spec.model.format"),
    ("sim with fp8 KV", _sim(kv={"dtype": "fp8_e4m3"}), "spec.kv.dtype"),
    ("sim without prefix caching", _sim(kv={"prefixCaching": False}), "spec.kv.prefixCaching"),
    # pool roles that follow the load: one aggregated pool of engines that send and receive KV
    ("poolRoles on a P/D pair", S.disagg(engine={"name": "vllm", "image": "v"}, router={
        "disaggregation": {"poolRoles": {}}}), "spec.router.disaggregation.poolRoles"),
    ("poolRoles on SGLang", S.aggregated(engine={"name": "sglang", "image": "s"}, both={
        "replicas": 4}, router={"disaggregation": {"poolRoles": {}}}),
     "spec.router.disaggregation.poolRoles"),
    ("poolRoles on the sim's SGLang surface", S.aggregated(engine={
        "name": "sim", "image": D, "api": "sglang"}, both={"replicas": 4, "tp": 1}, router={
        "disaggregation": {"poolRoles": {}}}), "spec.router.disaggregation.poolRoles"),
    ("poolRoles over Mooncake", S.aggregated(both={"replicas": 4}, kv={
        "transferBackend": "mooncake"}, router={"disaggregation": {"poolRoles": {}}}),
     "spec.kv.transferBackend"),
    ("poolRoles on one worker", S.aggregated(router={"disaggregation": {"poolRoles": {}}}),
     "spec.both.replicas"),
    ("poolRoles lines crossed", S.aggregated(both={"replicas": 4}, router={"disaggregation": {
        "poolRoles": {"splitAtSessionsPerWorker": 2, "colocateBelowSessionsPerWorker": 3}}}),
     "spec.router.disaggregation.poolRoles"),
    ("poolRoles unknown key", S.aggregated(both={"replicas": 4}, router={"disaggregation": {
        "poolRoles": {"prefillWorker": 2}}}), "spec.router.disaggregation.poolRoles.prefillWorker"),
    ("poolRoles spill line under the split line", S.aggregated(both={"replicas": 4}, router={
        "disaggregation": {"poolRoles": {"splitAtSessionsPerWorker": 6,
                                         "spillAtSessionsPerWorker": 4}},
        "flowControl": {"prefillSpillAfterSeconds": 0.3}}),
     "spec.router.disaggregation.poolRoles"),
    ("poolRoles spill line with the spill off", S.aggregated(both={"replicas": 4}, router={
        "disaggregation": {"poolRoles": {"spillAtSessionsPerWorker": 24}}}),
     "spec.router.disaggregation.poolRoles.spillAtSessionsPerWorker"),
    ("poolRoles spill stop without a spill line", S.aggregated(both={"replicas": 4}, router={
        "disaggregation": {"poolRoles": {"spillStopBelowSessionsPerWorker": 4}},
        "flowControl": {"prefillSpillAfterSeconds": 0.3}}),
     "spec.router.disaggregation.poolRoles"),
    ("spill lull with the spill off", S.aggregated(both={"replicas": 4}, router={
        "flowControl": {"prefillSpillLullSeconds": 2}}),
     "spec.router.flowControl.prefillSpillLullSeconds"),
    ("spill lull speed zero", S.aggregated(both={"replicas": 4}, router={"flowControl": {
        "prefillSpillAfterSeconds": 0.3, "prefillSpillLullUserTokensPerSecond": 0}}),
     "spec.router.flowControl.prefillSpillLullUserTokensPerSecond"),
    # rollout
    ("no rollout progress", S.disagg(rollout={"maxSurge": 0, "maxUnavailable": "0%"}),
     "spec.rollout.maxSurge"),
    ("percent over 100", S.disagg(rollout={"maxSurge": "150%"}), "spec.rollout.maxSurge"),
    # whole objects
    ("name too long", S.obj(S.disagg(), name="b" * (MAX_NAME_LENGTH + 1)), "metadata.name"),
    ("name not a DNS label", S.obj(S.disagg(), name="Beam_1"), "metadata.name"),
    ("name starts with a digit", S.obj(S.disagg(), name="1beam"), "metadata.name"),
    ("no name", S.merge(S.obj(S.disagg()), {"metadata": {"name": D}}), "metadata.name"),
    ("wrong apiVersion", S.merge(S.obj(S.disagg()), {"apiVersion": "beamserve.io/v1"}),
     "apiVersion"),
    ("wrong kind", S.merge(S.obj(S.disagg()), {"kind": "Deployment"}), "kind"),
    ("unknown top-level field", S.merge(S.obj(S.disagg()), {"specs": {}}), "specs"),
    ("spec missing", S.merge(S.obj(S.disagg()), {"spec": D}), "spec"),
]  # fmt: skip


@pytest.mark.parametrize(("spec", "path"), [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_invalid_spec_names_the_field(spec: dict[str, Any], path: str) -> None:
    found = validate(spec)
    assert found, "accepted"
    assert any(v.path == path or v.path.startswith(f"{path}[") for v in found), [
        str(v) for v in found
    ]
    for v in found:
        assert (v.message and ";" in str(v)) or "(" in v.message, f"no fix in {v}"


@pytest.mark.parametrize(
    "spec",
    [
        S.disagg(),
        S.aggregated(),
        S.obj(S.disagg(), name="b" * MAX_NAME_LENGTH),
        S.disagg(model={"kvHeads": 2}, prefill={"tp": 2}, decode={"tp": 1}),
        S.disagg(prefill={"tp": 4}, decode={"tp": 8}),  # decode TP > prefill TP
        S.disagg(prefill={"tp": 16, "nodesPerReplica": 2, "gpusPerNode": 8}, decode={"tp": 2}),
        S.disagg(prefill={"replicas": 0}, decode={"replicas": 0}),
        S.disagg(kv={"hostCacheGb": 64}, decode={"kv": {"hostCacheGb": 0}}),
        S.disagg(router={"replicas": 3, "sessionStore": {"type": "redis"}}),
        S.disagg(router={"policyConfig": {"strategy": "weighted", "scorers": [
            {"type": "load", "weight": 1}]}}),
        S.disagg(decode={"tolerations": [{"key": "g", "operator": "Exists"}],
                         "nodeSelector": {"nvidia.com/gpu.product": "H200"}}),
        S.disagg(engine={"name": "vllm", "image": "v"}, kv={"onLoadFailure": "fail"}),
        S.disagg(engine={"extraArgs": ["--enable-torch-compile"], "extraEnv": [{"name": "A"}]}),
        S.disagg(rollout={"maxSurge": "25%", "maxUnavailable": 0}),
        S.disagg(monitoring={"interval": "1m30s"}),
        S.aggregated(both={"replicas": 4}, router={"disaggregation": {"poolRoles": {
            "prefillWorkers": 2, "splitAtSessionsPerWorker": 3}}}),
        S.aggregated(both={"replicas": 4}, router={
            "disaggregation": {"poolRoles": {"prefillWorkers": 2, "spillAtSessionsPerWorker": 24}},
            "flowControl": {"prefillSpillAfterSeconds": 0.3, "prefillSpillTokensPerSecond": 1e5}}),
        S.aggregated(both={"replicas": 4}, router={
            "disaggregation": {"poolRoles": {"prefillWorkers": 2, "spillAtSessionsPerWorker": 24,
                                             "spillStopBelowSessionsPerWorker": 0}},
            "flowControl": {"prefillSpillAfterSeconds": 0.3,
                            "prefillSpillUserTokensPerSecond": 12}}),
        S.aggregated(both={"replicas": 4}, router={
            "disaggregation": {"poolRoles": {"prefillWorkers": 2, "spillAtSessionsPerWorker": 24}},
            "flowControl": {"prefillSpillAfterSeconds": 0.3, "prefillSpillLullSeconds": 2,
                            "prefillSpillLullUserTokensPerSecond": 6,
                            "prefillSpillLullMaxTokens": 262144}}),
        S.aggregated(engine={"name": "sim", "image": D, "api": "vllm"}, both={"replicas": 2,
            "tp": 1}, router={"disaggregation": {"poolRoles": {}}}),
        S.disagg(decode={"resources": {"requests": {"cpu": "500m", "memory": "64Gi"},
                                       "limits": {"cpu": 2, "memory": "1e11"}}}),
    ],
)  # fmt: skip
def test_valid_specs_pass(spec: dict[str, Any]) -> None:
    assert validate(spec) == []


def test_every_violation_at_once() -> None:
    spec = S.disagg(
        engine={"image": D},
        decode={"attentionDp": 3},
        router={"replicas": 2},
        rollout={"maxSurge": 0},
    )
    paths = {v.path for v in validate(spec)}
    assert {"spec.engine.image", "spec.decode.attentionDp", "spec.router.sessionStore.type",
            "spec.rollout.maxSurge"} <= paths  # fmt: skip


def test_not_a_mapping() -> None:
    assert validate([1, 2]) == [Violation("spec", validate([1, 2])[0].message)]


UNSAFE_UPDATES: list[tuple[str, dict[str, Any], dict[str, Any], str]] = [
    ("disaggregated → aggregated", S.disagg(), S.aggregated(engine={"name": "sglang",
     "image": "i"}), "spec.both"),
    ("aggregated → disaggregated", S.aggregated(), S.disagg(engine={"name": "vllm", "image": "v"}),
     "spec.both"),
    ("single-node → multi-node", S.disagg(prefill={"tp": 16}), S.disagg(prefill={"tp": 16,
     "nodesPerReplica": 2}), "spec.prefill.nodesPerReplica"),
    ("download claim shrinks", S.disagg(model={"source": {"hostPath": D, "download": {
        "uri": "hf://a/b", "storageSize": "1Ti", "storageClassName": "fast"}}}),
     S.disagg(model={"source": {"hostPath": D, "download": {
        "uri": "hf://a/b", "storageSize": "500Gi", "storageClassName": "fast"}}}),
     "spec.model.source.download.storageSize"),
    ("download claim class changes", S.disagg(model={"source": {"hostPath": D, "download": {
        "uri": "hf://a/b", "storageClassName": "fast"}}}),
     S.disagg(model={"source": {"hostPath": D, "download": {
        "uri": "hf://a/b", "storageClassName": "slow"}}}),
     "spec.model.source.download.storageClassName"),
    ("redis claim shrinks", S.disagg(router={"sessionStore": {"type": "redis", "redis": {
        "storageSize": "10Gi"}}}), S.disagg(router={"sessionStore": {"type": "redis", "redis": {
        "storageSize": "1Gi"}}}), "spec.router.sessionStore.redis.storageSize"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("old", "new", "path"), [c[1:] for c in UNSAFE_UPDATES], ids=[c[0] for c in UNSAFE_UPDATES]
)
def test_unsafe_updates_are_refused(old: dict[str, Any], new: dict[str, Any], path: str) -> None:
    assert validate(old) == [] and validate(new) == []
    found = validate_update(S.obj(old), S.obj(new))
    assert any(v.path == path for v in found), [str(v) for v in found]


def test_safe_updates_pass() -> None:
    old = S.disagg()
    for new in (
        S.disagg(decode={"replicas": 5}),
        S.disagg(decode={"tp": 2}),
        S.disagg(kv={"pageSize": 32}),  # a new revision of both pools, not an in-place change
        S.disagg(engine={"image": "lmsysorg/sglang:v0.5.24"}),
        S.disagg(model={"source": {"hostPath": {"path": "/mnt/beam-1.1"}}}),
    ):
        assert validate_update(old, new) == []
    assert validate_update(old, S.disagg(decode={"tp": 3})) == validate(S.disagg(decode={"tp": 3}))


def test_the_sim_takes_its_step_budget_from_chunked_prefill_size() -> None:
    """`tuning.chunkedPrefillSize` is the one engine knob a sim pool has: its workers get it
    as `--max-num-batched-tokens` (the sim's per-step budget, as vLLM names it)."""
    from beamserve.operator.api import BeamDeploymentSpec
    from beamserve.operator.pools import pool_command

    spec = _sim(decode={"tuning": {"chunkedPrefillSize": 2048}})
    assert validate(spec) == []
    parsed = BeamDeploymentSpec.model_validate(spec)
    decode = list(pool_command(parsed, "decode").argv)
    assert decode[decode.index("--max-num-batched-tokens") + 1] == "2048"
    assert "--max-num-batched-tokens" not in pool_command(parsed, "prefill").argv
