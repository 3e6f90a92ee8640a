"""Draft vocabulary: the most frequent target tokens in the target's own generations."""
from __future__ import annotations

import torch


def count_tokens(sequences, vocab_size: int) -> torch.Tensor:
    """``[vocab_size]`` int64 occurrence counts of the ids in ``sequences`` (iterable of 1-D tensors)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for s in sequences:
        counts += torch.bincount(torch.as_tensor(s, dtype=torch.int64).flatten(), minlength=vocab_size)[:vocab_size]
    return counts


def select_vocab(counts: torch.Tensor, size: int, always: set[int] = frozenset()) -> torch.Tensor:
    """The ``size`` most frequent ids (ties: lower id first), always including ``always`` (e.g. EOS);
    returned sorted ascending."""
    size = min(size, counts.numel())
    keep = sorted(i for i in always if 0 <= i < counts.numel())[:size]
    score = counts.double().clone()
    score[keep] = float("inf")
    # stable order: by count descending, then id ascending
    order = torch.sort(score, descending=True, stable=True).indices[:size]
    return order.sort().values


def coverage(counts: torch.Tensor, vocab: torch.Tensor) -> float:
    """Share of the counted tokens that lie in ``vocab``."""
    total = int(counts.sum())
    return float(counts[vocab].sum()) / total if total else 1.0
