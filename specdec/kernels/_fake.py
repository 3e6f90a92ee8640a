"""Fake (meta) implementations of the ``torch.ops.specdec`` operators.

They let FakeTensor tracing (``torch.compile``, ``torch.export``) reason about the C++ operators
without running them. ``csrc/ops.cpp`` names this module with ``m.set_python_module``.
"""
from __future__ import annotations

import torch


@torch.library.register_fake("specdec::kv_compact")
def _kv_compact_fake(
    caches: list[torch.Tensor], src: torch.Tensor, dst_start: torch.Tensor, counts: torch.Tensor
) -> None:
    """Mutates ``caches`` (``[B, H, S, D]`` each) in place and returns nothing: nothing to fake."""
