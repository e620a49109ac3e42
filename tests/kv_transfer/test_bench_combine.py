"""`bench.combine`: a `--repeats N` row is the median pull against the median baseline."""

from __future__ import annotations

import dataclasses

import pytest
from beamserve.kv_transfer.bench import TransferResult, combine
from hypothesis import example, given
from hypothesis import strategies as st


def row(seconds: float, base: float, **kw: object) -> TransferResult:
    moved = 1_000_000
    r = TransferResult(
        backend="cma", src_tp=2, dst_tp=1, tokens=700, bytes_moved=moved, bytes_minimum=moved,
        descriptors=10, plan_ms=1.0, seconds=seconds, gbps=moved / seconds / 1e9,
        memcpy_gbps=base, verified=True,
    )  # fmt: skip
    return dataclasses.replace(r, **kw)  # type: ignore[arg-type]


@given(st.lists(st.tuples(st.floats(1e-4, 10.0), st.floats(0.1, 100.0)), min_size=1, max_size=9))
@example([(0.0001, 1.8125)])  # a baseline that rounds away from the ratio's divisor
def test_the_row_is_a_median_pull_that_happened(runs: list[tuple[float, float]]) -> None:
    rows = [row(s, b) for s, b in runs]
    out = combine(rows)
    times = sorted(s for s, _ in runs)
    assert out.seconds == times[(len(times) - 1) // 2]
    assert out.seconds_each == [s for s, _ in runs] and out.repeats == len(runs)
    bases = sorted(b for _, b in runs)
    n = len(bases)
    median = (bases[n // 2] + bases[(n - 1) // 2]) / 2
    assert out.memcpy_gbps == pytest.approx(median, abs=1e-3)
    # Both rounded to 3 decimals in the row: the ratio is of the unrounded median.
    assert out.baseline_ratio == pytest.approx(out.gbps / median, abs=1e-3)


def test_one_unverified_or_short_pull_spoils_the_row() -> None:
    assert combine([row(1.0, 5.0), row(2.0, 5.0, verified=False)]).verified is False
    out = combine([row(1.0, 5.0), row(2.0, 5.0, bytes_moved=999)])
    assert out.bytes_moved != out.bytes_minimum


def test_rows_of_different_shapes_are_not_combined() -> None:
    with pytest.raises(ValueError, match="different rows"):
        combine([row(1.0, 5.0), row(1.0, 5.0, dst_tp=2)])
    with pytest.raises(ValueError, match="no runs"):
        combine([])
