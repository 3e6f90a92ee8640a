"""Naive, loop-based definitions shared by the kernel and tree tests."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_thread():
    """Tests of many tiny ops: intra-op threads only add overhead (a lot on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def naive_pack(rows: list[list[bool]]) -> list[list[int]]:
    """Bit j of word w = column 32*w + j, as a signed (two's-complement) int32."""
    out = []
    for row in rows:
        words = []
        for w in range((len(row) + 31) // 32):
            val = sum(1 << j for j in range(32) if 32 * w + j < len(row) and row[32 * w + j])
            words.append(val - (1 << 32) if val >= 1 << 31 else val)
        out.append(words)
    return out


def ancestors_or_self(parents: list[int], i: int) -> set[int]:
    """Node i and every node on its parent chain."""
    seen, j = {i}, parents[i]
    while j >= 0:
        seen.add(j)
        j = parents[j]
    return seen
