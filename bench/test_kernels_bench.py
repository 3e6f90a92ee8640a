"""pytest-benchmark view of :mod:`bench.kernels` (not part of the default ``pytest tests`` run).

    pytest bench/test_kernels_bench.py --benchmark-only

Every case appears twice, ``ours`` and ``baseline``, in one benchmark group per case.
"""
from __future__ import annotations

import functools

import pytest

from bench.kernels import CASES
from specdec import kernels

pytestmark = pytest.mark.skipif(not kernels.has_native("tree_attention"), reason="specdec._C is not built")


@functools.lru_cache(maxsize=None)
def build(case_id: str):
    return dict(CASES)[case_id]()


@pytest.mark.parametrize("side", ["ours", "baseline"])
@pytest.mark.parametrize("case_id", [case_id for case_id, _ in CASES])
def test_kernel(benchmark, case_id, side):
    case = build(case_id)
    benchmark.group = f"{case.op} {case.shape}"
    benchmark(case.ours if side == "ours" else case.baseline)
