"""Before launch: can this prefill pool hand KV to this decode pool?

Rules (each problem is reported with its fix, all at once, in one `PairCompatError`):

* roles: the first pool is `prefill`, the second `decode`;
* same engine (SGLang's bootstrap handoff and vLLM's `kv_transfer_params` do not mix) and the
  same transfer backend;
* same model: equal fingerprints when both pools carry one, else the same checkpoint path; and
  the same checkpoint format;
* same page size and KV dtype — SGLang's decode refuses a mismatch at bootstrap, and vLLM needs
  equal block sizes for hybrid (sliding-window) models like Beam;
* the attention TP sizes divide one another, in either direction (both engines map ranks
  by the ratio: vLLM's `tp_mapping`, SGLang's heterogeneous-TP slices); with the model's
  config at hand, `kv_transfer.check_pair` also checks that each TP shards the KV heads.
"""

from __future__ import annotations

from beamserve.kv_transfer.errors import KVTransferError
from beamserve.kv_transfer.model import BeamModelConfig
from beamserve.kv_transfer.plan import check_pair
from beamserve.kv_transfer.topology import PoolLayout
from beamserve.workers.launch.errors import PairCompatError
from beamserve.workers.launch.spec import PoolSpec


def check_pair_compat(
    prefill: PoolSpec, decode: PoolSpec, model: BeamModelConfig | None = None
) -> None:
    """Raise `PairCompatError` unless `prefill` can hand KV to `decode`.

    `model` is the checkpoint's config (`BeamModelConfig.from_checkpoint(path)`); without
    it, the KV-head checks are skipped and the model is compared by fingerprint or path.
    """
    problems = _problems(prefill, decode, model)
    if problems:
        raise PairCompatError("prefill/decode pair refused:\n  " + "\n  ".join(problems))


def _problems(p: PoolSpec, d: PoolSpec, model: BeamModelConfig | None) -> list[str]:
    out: list[str] = []
    if p.role != "prefill":
        out.append(f"prefill.role: is {p.role!r}; pass the prefill pool first")
    if d.role != "decode":
        out.append(f"decode.role: is {d.role!r}; pass the decode pool second")
    if p.engine != d.engine:
        out.append(
            f"engine: prefill runs {p.engine}, decode runs {d.engine}; their P/D handoffs "
            "differ, so run both pools on the same engine"
        )
    if p.transfer.backend != d.transfer.backend:
        out.append(
            f"transfer.backend: prefill uses {p.transfer.backend}, decode uses "
            f"{d.transfer.backend}; set both to the same backend (nixl or mooncake)"
        )
    out += _model_problems(p, d, model)
    pk, dk = p.kv_cache, d.kv_cache
    if pk.page_size != dk.page_size:
        out.append(
            f"kv_cache.page_size: prefill uses {pk.page_size}, decode uses {dk.page_size}; "
            "set both pools to the same page size (64 recommended)"
        )
    if pk.dtype != dk.dtype:
        out.append(
            f"kv_cache.dtype: prefill uses {pk.dtype}, decode uses {dk.dtype}; "
            "set both pools to the same KV dtype (bf16 or fp8_e4m3)"
        )
    a, b = p.parallel.attention_tp, d.parallel.attention_tp
    if max(a, b) % min(a, b):
        out.append(
            f"parallel: prefill attention TP {a} and decode attention TP {b} do not divide "
            f"one another; choose decode attention TP from {_dividing(a)} "
            f"(or prefill from {_dividing(b)})"
        )
    elif model is not None and not out:
        try:
            check_pair(
                PoolLayout(model, p.topology(), full_pages=1, window_pages=1),
                PoolLayout(model, d.topology(), full_pages=1, window_pages=1),
            )
        except KVTransferError as exc:
            out.append(f"parallel: {exc}")
    return out


def _model_problems(p: PoolSpec, d: PoolSpec, model: BeamModelConfig | None) -> list[str]:
    out: list[str] = []
    pm, dm = p.model, d.model
    if pm.fingerprint is not None and dm.fingerprint is not None:
        if not _same_fingerprint(pm.fingerprint, dm.fingerprint):
            out.append(
                f"model.fingerprint: prefill serves {pm.fingerprint[:12]}, decode serves "
                f"{dm.fingerprint[:12]}; serve the same checkpoint on both pools"
            )
    elif pm.path != dm.path:
        out.append(
            f"model.path: prefill serves {pm.path!r}, decode serves {dm.path!r}; serve the "
            "same checkpoint on both pools (or set model.fingerprint on both)"
        )
    if pm.format != dm.format:
        out.append(
            f"model.format: prefill loads {pm.format}, decode loads {dm.format}; load the "
            "same checkpoint format on both pools"
        )
    if model is not None:
        actual = model.fingerprint()
        for side, fp in (("prefill", pm.fingerprint), ("decode", dm.fingerprint)):
            if fp is not None and not _same_fingerprint(fp, actual):
                out.append(
                    f"model.fingerprint: the {side} pool names {fp[:12]}, but the checkpoint "
                    f"config hashes to {actual[:12]}; update the fingerprint or the path"
                )
        for side, spec in (("prefill", p), ("decode", d)):
            try:
                spec.topology().check_model(model)
            except KVTransferError as exc:
                out.append(f"{side}.parallel: attention {exc}")
    return out


def _same_fingerprint(a: str, b: str) -> bool:
    n = min(len(a), len(b))
    return a[:n] == b[:n]


def _dividing(n: int) -> list[int]:
    """Sizes that divide `n`, then `n` times powers of two, up to 64."""
    out = [k for k in range(1, n + 1) if n % k == 0]
    k = 2 * n
    while k <= 64:
        out.append(k)
        k *= 2
    return out
