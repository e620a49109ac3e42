"""Child names: every name a BeamDeployment's children (and Kubernetes) derive stays a DNS label."""

from __future__ import annotations

import pytest
from beamserve.operator.admission import validate
from beamserve.operator.naming import (
    CONTROLLER_SUFFIX,
    DNS_LABEL_MAX,
    MAX_NAME_LENGTH,
    PARTS,
    child_name,
    name_problems,
    pool_part,
)


def test_the_longest_name_fits_every_part() -> None:
    name = "b" * MAX_NAME_LENGTH
    for part in PARTS:
        child = child_name(name, part)
        assert len(child) + CONTROLLER_SUFFIX <= DNS_LABEL_MAX
    # a LeaderWorkerSet worker's controller-revision-hash label: <lws>-<group>-<10 hash chars>
    lws = child_name(name, pool_part("prefill", "0123abcd"))
    assert len(f"{lws}-99999-{'h' * 10}") <= DNS_LABEL_MAX


def test_one_more_character_is_refused() -> None:
    name = "b" * (MAX_NAME_LENGTH + 1)
    with pytest.raises(ValueError, match="shorten"):
        child_name(name, pool_part("prefill", "0123abcd"))
    assert name_problems(name)


def test_names_and_parts() -> None:
    assert child_name("beam", "router") == "beam-router"
    assert pool_part("decode", "0123abcd") == "decode-0123abcd"
    with pytest.raises(ValueError, match="revision"):
        pool_part("decode", "xyz")
    with pytest.raises(ValueError, match="role"):
        pool_part("worker", "0123abcd")  # type: ignore[arg-type]
    for bad in ("Beam", "1beam", "beam-", "be_am", "beam.prod", ""):
        assert name_problems(bad), bad
    assert name_problems("beam-prod-2") == []


def test_admission_uses_the_same_limit() -> None:
    spec = {
        "model": {"source": {"hostPath": {"path": "/m"}}},
        "engine": {"name": "sim"},
        "both": {},
    }
    doc = {"apiVersion": "beamserve.io/v1alpha1", "kind": "BeamDeployment", "spec": spec}
    assert validate({**doc, "metadata": {"name": "b" * MAX_NAME_LENGTH}}) == []
    (v,) = validate({**doc, "metadata": {"name": "b" * (MAX_NAME_LENGTH + 1)}})
    assert v.path == "metadata.name" and "shorten" in v.message
