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


@torch.library.register_fake("specdec::ngram_match")
def _ngram_match_fake(
    tokens: torch.Tensor, lengths: torch.Tensor, n_min: int, n_max: int, k: int, w: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """drafts ``[B, k, w]`` int64, draft lengths and counts ``[B, k]`` int32, matched n ``[B]`` int32."""
    b = tokens.shape[0]
    return (
        tokens.new_empty((b, k, w), dtype=torch.int64),
        tokens.new_empty((b, k), dtype=torch.int32),
        tokens.new_empty((b, k), dtype=torch.int32),
        tokens.new_empty((b,), dtype=torch.int32),
    )


@torch.library.register_fake("specdec::topk_entropy")
def _topk_entropy_fake(
    logits: torch.Tensor, k: int, temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """probs ``[N, k]`` fp32, ids ``[N, k]`` int64, entropy and logsumexp ``[N]`` fp32."""
    n = logits.shape[0]
    return (
        logits.new_empty((n, k), dtype=torch.float32),
        logits.new_empty((n, k), dtype=torch.int64),
        logits.new_empty((n,), dtype=torch.float32),
        logits.new_empty((n,), dtype=torch.float32),
    )


@torch.library.register_fake("specdec::tree_attention")
def _tree_attention_fake(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_lens: torch.Tensor,
    k_tree: torch.Tensor,
    v_tree: torch.Tensor,
    tree_mask: torch.Tensor | None,
    scale: float | None = None,
    tree_positions: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """``[B, Hq, T, D]`` (contiguous), the dtype of ``q``: one row per query, whatever the number ``N >= T``
    of pending nodes in ``k_tree``."""
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


@torch.library.register_fake("specdec::tree_verify_greedy")
def _tree_verify_greedy_fake(
    tokens: torch.Tensor, parents: torch.Tensor, target_logits: torch.Tensor, valid: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """path ``[B, T]`` int64, length ``[B]`` int32, next token ``[B]`` int64."""
    b, t = tokens.shape
    return (
        tokens.new_empty((b, t), dtype=torch.int64),
        tokens.new_empty((b,), dtype=torch.int32),
        tokens.new_empty((b,), dtype=torch.int64),
    )


@torch.library.register_fake("specdec::skinny_linear")
def _skinny_linear_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``[M, N]`` in x's dtype."""
    return x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.register_fake("specdec::packed_linear")
def _packed_linear_fake(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``[M, n]`` in x's dtype."""
    return x.new_empty((x.shape[0], n))


@torch.library.register_fake("specdec::quant_linear")
def _quant_linear_fake(x: torch.Tensor, packed: torch.Tensor, n: int, k: int, bits: int, group: int, has_min: bool,
                       f16_scale: bool, bias: torch.Tensor | None = None, tile_rows: int = 0) -> torch.Tensor:
    """``[M, n]`` in x's dtype."""
    return x.new_empty((x.shape[0], n))


@torch.library.register_fake("specdec::quant_linear_group")
def _quant_linear_group_fake(x: torch.Tensor, packed: list[torch.Tensor], n: list[int], k: int, bits: int, group: int,
                             has_min: bool, f16_scale: bool, bias: list[torch.Tensor | None],
                             tile_rows: int = 0) -> torch.Tensor:
    """``[M, sum n_i]`` in x's dtype: the weights' outputs side by side."""
    return x.new_empty((x.shape[0], sum(n)))


@torch.library.register_fake("specdec::quant_dequantize")
def _quant_dequantize_fake(packed: torch.Tensor, n: int, k: int, bits: int, group: int, has_min: bool,
                           f16_scale: bool) -> torch.Tensor:
    """``[n, k]`` fp32."""
    return packed.new_empty((n, k), dtype=torch.float32)


@torch.library.register_fake("specdec::draft_tree")
def _draft_tree_fake(
    root: torch.Tensor, drafts: torch.Tensor, merge: bool = True, accept: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """tokens, parents, depth, chain, slot ``[B, T]`` int64, valid ``[B, T]`` bool, mask ``[B, T, ceil(T/32)]``
    int32, reach ``[B, T]`` fp32; ``T`` (the largest row's node count) depends on the data."""
    b = drafts.shape[0]
    t = torch.library.get_ctx().new_dynamic_size()
    words = (t + 31) // 32
    i64 = lambda: drafts.new_empty((b, t), dtype=torch.int64)  # noqa: E731
    return (i64(), i64(), drafts.new_empty((b, t), dtype=torch.bool), i64(),
            drafts.new_empty((b, t, words), dtype=torch.int32), i64(), i64(),
            drafts.new_empty((b, t), dtype=torch.float32))
