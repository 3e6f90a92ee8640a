"""specdec.kernels: engine-agnostic hot-path operators for speculative decoding.

Every operator takes plain torch tensors, documents the shape and dtype of each, and dispatches
by device to the fastest backend available (see :mod:`specdec.kernels._dispatch`). The pure
torch references in :mod:`specdec.kernels.reference` are the specification.

Operators:

- :func:`tree_attention`: tree queries over a cached prefix plus the tree (packed ancestor mask), or plus
  a pending region of uncommitted draft nodes of which the queries are the newest (rectangular mask).
- :func:`ngram_match`: batched context n-gram matching, all n at once.
- :func:`topk_entropy`: top-k probabilities and entropy of a softmax, one pass over V.
- :func:`kv_compact`: in-place KV-cache compaction of accepted tokens, all layers in one call.
- :func:`tree_verify_greedy` / :func:`tree_verify_sampling`: acceptance over a draft tree.
- :func:`draft_tree`: k draft chains merged into a verification tree (trie or branches) with its ancestor
  mask and each node's reach estimate, optionally cut to the likeliest nodes the planner keeps.
- :func:`skinny_linear`: ``x . W^T + b`` for a few rows (verification's T tokens), batch-invariant.
- :func:`pack_linear_weight` / :func:`packed_linear`: the same product over a weight prepacked once
  into column panels, several times faster from a few rows on (CPU).
"""
from __future__ import annotations

import math

import torch

from specdec.kernels import reference
from specdec.kernels._dispatch import choose, has_native, native_ops, triton_kernels
from specdec.kernels.reference import pack_mask, sample_from_probs, tree_depth, unpack_mask

__all__ = [
    "tree_attention",
    "ngram_match",
    "topk_entropy",
    "kv_compact",
    "tree_verify_greedy",
    "tree_verify_sampling",
    "draft_tree",
    "skinny_linear",
    "pack_linear_weight",
    "packed_linear",
    "pack_mask",
    "unpack_mask",
    "tree_depth",
    "sample_from_probs",
    "has_native",
    "reference",
]


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


TRITON_FP32_MAX_TREE = 32


def tree_attention_triton_pays(dtype: torch.dtype, t: int) -> bool:
    """Whether ``auto`` takes the Triton tree attention for ``t`` queries of ``dtype`` on CUDA.

    Its fp32 path (exact ``ieee`` dots on tiles sized for bf16) was measured on an H100 at 2.95x SDPA with
    8 queries but 0.07-0.19x with 64 (bench/RESULTS.md, GPU); past ``TRITON_FP32_MAX_TREE`` fp32 queries the
    torch reference (SDPA over a dense mask) runs instead. bf16 beat SDPA at every measured shape (fp16 was not
    measured and keeps the kernel).
    """
    return dtype != torch.float32 or t <= TRITON_FP32_MAX_TREE


def tree_attention(
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
    backend: str | None = None,
) -> torch.Tensor:
    """Attention of ``T`` tree tokens over a cached prefix and over the pending nodes they descend from.

    The tree operands hold ``N >= T`` pending (uncommitted) nodes, and the queries are the last ``T``
    of them: ``N == T`` is one verification tree (a square mask); ``N > T`` is a tree grown level by
    level, where earlier levels' KV is already in the cache and only the new frontier is computed.

    Args:
        q: ``[B, Hq, T, D]`` queries (fp32/fp16/bf16); query ``i`` is pending node ``N - T + i``.
        k_cache, v_cache: ``[B, Hkv, S, D]`` cached keys/values; row ``b`` is valid up to ``cache_lens[b]``.
        cache_lens: ``[B]`` int32/int64, ``<= S``.
        k_tree, v_tree: ``[B, Hkv, N, D]`` keys/values of the pending nodes, ``N >= T``, the queries' own last.
        tree_mask: ``[B, T, ceil(N/32)]`` int32 packed mask: bit ``j`` of row ``i`` set iff query ``i`` sees
            pending node ``j`` (itself and its ancestors, for a tree); or ``None`` for a causal chain
            (query ``i`` sees pending nodes ``j <= N - T + i``). A row may have no bit set (a padding
            query: it sees the prefix only).
        scale: softmax scale, default ``D ** -0.5``.
        tree_positions: ``[B, N]`` int absolute positions of the pending nodes (only with ``window``);
            query ``i`` is at ``tree_positions[:, N - T + i]``.
        window: sliding-window size (a query at position ``p`` sees keys at positions ``> p - window``).
    Returns:
        ``[B, Hq, T, D]``, same dtype as ``q``. A query that sees no key at all gets zeros (never NaN).
    """
    _check(q.dim() == 4 and k_cache.dim() == 4 and k_tree.dim() == 4, "q, k_cache, k_tree must be 4-D")
    _check(q.shape[1] % k_cache.shape[1] == 0, f"Hq={q.shape[1]} is not a multiple of Hkv={k_cache.shape[1]}")
    b, t, n = q.shape[0], q.shape[2], k_tree.shape[2]
    if n < t:
        raise ValueError(f"k_tree must hold N >= T = {t} pending nodes, got {n}")
    if tree_mask is not None and tuple(tree_mask.shape) != (b, t, (n + 31) // 32):
        raise ValueError(f"tree_mask must be [B, T, ceil(N/32)] = [{b}, {t}, {(n + 31) // 32}], got {list(tree_mask.shape)}")
    _check(window is None or tree_positions is not None, "tree_positions are required with a sliding window")
    if window is not None and tuple(tree_positions.shape) != (b, n):
        raise ValueError(f"tree_positions must be [B, N] = [{b}, {n}], got {list(tree_positions.shape)}")
    triton = q.dtype in (torch.float32, torch.float16, torch.bfloat16)  # what the Triton kernel covers
    route = choose("tree_attention", q.device, backend, ("cpu",), triton=triton,
                   triton_pays=tree_attention_triton_pays(q.dtype, t))
    if route == "native":
        return native_ops().tree_attention(q, k_cache, v_cache, cache_lens, k_tree, v_tree, tree_mask, scale,
                                           tree_positions, window)
    if route == "triton":
        return triton_kernels("tree_attention").tree_attention(q, k_cache, v_cache, cache_lens, k_tree, v_tree,
                                                               tree_mask, scale, tree_positions, window)
    return reference.tree_attention(q, k_cache, v_cache, cache_lens, k_tree, v_tree, tree_mask, scale, tree_positions, window)


def ngram_match(
    tokens: torch.Tensor,
    lengths: torch.Tensor,
    n_min: int,
    n_max: int,
    k: int,
    w: int,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draft continuations of each row's context suffix from its earlier occurrences.

    Args:
        tokens: ``[B, L]`` int64 token ids; row ``b`` is valid up to ``lengths[b]``.
        lengths: ``[B]`` int.
        n_min, n_max: n-gram sizes to try; the longest size with a match wins.
        k: drafts per row; w: maximum draft length.
    Returns:
        drafts ``[B, k, w]`` int64 (-1 padded), draft lengths ``[B, k]`` int32, counts ``[B, k]`` int32,
        matched n-gram size ``[B]`` int32 (0 where nothing matched). Drafts are ranked by how often
        the continuation occurred, ties by recency.
    """
    _check(tokens.dim() == 2 and lengths.dim() == 1 and lengths.shape[0] == tokens.shape[0], "tokens [B,L], lengths [B]")
    _check(k >= 1 and w >= 1, "k and w must be >= 1")
    _check(1 <= n_min <= n_max, f"need 1 <= n_min <= n_max, got {n_min}, {n_max}")
    if choose("ngram_match", tokens.device, backend, ("cpu", "cuda")) == "native":
        return native_ops().ngram_match(tokens.long(), lengths.long(), n_min, n_max, k, w)
    return reference.ngram_match(tokens, lengths, n_min, n_max, k, w)


def topk_entropy(
    logits: torch.Tensor, k: int, temperature: float = 1.0, backend: str | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k of ``softmax(logits / temperature)`` with its entropy and log-partition.

    Args:
        logits: ``[N, V]`` float.
        k: number of top entries (``<= V``); temperature: ``> 0``.
    Returns:
        probs ``[N, k]`` fp32 (descending), ids ``[N, k]`` int64, entropy ``[N]`` fp32 (nats),
        logsumexp ``[N]`` fp32 of ``logits / temperature``.
    """
    _check(logits.dim() == 2, "logits must be [N, V]")
    _check(1 <= k <= logits.shape[1], f"k must be in [1, V], got {k}")
    _check(temperature > 0, f"temperature must be > 0, got {temperature}")
    route = choose("topk_entropy", logits.device, backend, ("cpu",), triton=k <= 1024)  # Triton keeps k <= 1024
    if route == "native":
        return native_ops().topk_entropy(logits, k, float(temperature))
    if route == "triton":
        return triton_kernels("topk_entropy").topk_entropy(logits, k, float(temperature))
    return reference.topk_entropy(logits, k, temperature)


def skinny_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, backend: str | None = None
) -> torch.Tensor:
    """``x . weight^T + bias`` for a few rows of ``x``, each weight row read once per call.

    Every output element is accumulated in fp32 in an order that does not depend on the number of
    rows, then rounded once to the dtype: row ``m`` of an ``M``-row call equals, bit for bit, the same
    row computed alone. That makes verifying ``T`` drafted tokens agree exactly with one-token
    decoding through the same layer, and on CPUs without bf16 matrix instructions it costs about
    one row's weight traffic instead of ``M`` (see ``csrc/skinny_linear.cpp``).

    Args:
        x: ``[..., K]`` fp32/bf16/fp16; weight: ``[N, K]``, same dtype; bias: ``[N]`` same dtype, or None.
    Returns:
        ``[..., N]`` in x's dtype.
    """
    _check(weight.dim() == 2, f"weight must be [N, K], got shape {tuple(weight.shape)}")
    _check(x.dim() >= 1 and x.shape[-1] == weight.shape[1],
           f"x must be [..., K = {weight.shape[1]}], got shape {tuple(x.shape)}")
    _check(x.dtype == weight.dtype and (bias is None or bias.dtype == weight.dtype),
           f"x, weight and bias must share one dtype, got {x.dtype}, {weight.dtype}, {None if bias is None else bias.dtype}")
    _check(x.dtype in (torch.float32, torch.bfloat16, torch.float16), f"skinny_linear supports fp32/bf16/fp16, got {x.dtype}")
    _check(bias is None or tuple(bias.shape) == (weight.shape[0],), f"bias must be [N = {weight.shape[0]}]")
    route = choose("skinny_linear", x.device, backend, ("cpu",))
    if route == "native":
        y = native_ops().skinny_linear(x.reshape(math.prod(x.shape[:-1]), x.shape[-1]), weight, bias)
        return y.view(*x.shape[:-1], weight.shape[0])
    return reference.skinny_linear(x, weight, bias)


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """Prepack a linear weight for :func:`packed_linear` (once per weight; not a hot path).

    Args:
        weight: ``[N, K]`` fp32/bf16/fp16.
    Returns:
        ``[ceil(N / 16), K, 16]``, same dtype and device: panels of 16 output columns, each stored
        k-major so one step of the kernel reads 16 consecutive weights (layout: :func:`reference.pack_linear_weight`).
    """
    _check(weight.dim() == 2, f"weight must be [N, K], got shape {tuple(weight.shape)}")
    _check(weight.dtype in (torch.float32, torch.bfloat16, torch.float16),
           f"pack_linear_weight supports fp32/bf16/fp16, got {weight.dtype}")
    return reference.pack_linear_weight(weight.detach())


def packed_linear(
    x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None, backend: str | None = None
) -> torch.Tensor:
    """``x . W^T + bias`` for a few rows of ``x``, ``W`` given prepacked (:func:`pack_linear_weight`).

    Same contract as :func:`skinny_linear` (fp32 accumulation, one rounding, batch-invariant: row
    ``m`` of an ``M``-row call equals the row computed alone), with a faster CPU kernel: an
    outer-product micro-kernel over the panels (see ``csrc/packed_linear.cpp``). The two kernels
    sum in different orders, so their results may differ in the last bit.

    Args:
        x: ``[..., K]`` fp32/bf16/fp16; packed: ``[ceil(n / 16), K, 16]``, x's dtype;
        n: output features; bias: ``[n]`` x's dtype, or None.
    Returns:
        ``[..., n]`` in x's dtype.
    """
    _check(packed.dim() == 3 and packed.shape[2] == reference.PANEL,
           f"packed must be [ceil(N / 16), K, 16], got shape {tuple(packed.shape)}")
    _check(n >= 0 and -(-n // reference.PANEL) == packed.shape[0], f"n = {n} does not fit {packed.shape[0]} panels of 16")
    _check(x.dim() >= 1 and x.shape[-1] == packed.shape[1],
           f"x must be [..., K = {packed.shape[1]}], got shape {tuple(x.shape)}")
    _check(x.dtype == packed.dtype and (bias is None or bias.dtype == packed.dtype),
           f"x, packed and bias must share one dtype, got {x.dtype}, {packed.dtype}, {None if bias is None else bias.dtype}")
    _check(x.dtype in (torch.float32, torch.bfloat16, torch.float16), f"packed_linear supports fp32/bf16/fp16, got {x.dtype}")
    _check(bias is None or tuple(bias.shape) == (n,), f"bias must be [N = {n}]")
    route = choose("packed_linear", x.device, backend, ("cpu",))
    if route == "native":
        y = native_ops().packed_linear(x.reshape(math.prod(x.shape[:-1]), x.shape[-1]), packed, n, bias)
        return y.view(*x.shape[:-1], n)
    return reference.packed_linear(x, packed, n, bias)


def kv_compact(
    caches: list[torch.Tensor],
    src: torch.Tensor,
    dst_start: torch.Tensor,
    counts: torch.Tensor,
    backend: str | None = None,
) -> None:
    """Copy accepted KV entries into place in every layer's cache, in place, in one call.

    Args:
        caches: list of ``[B, H, S, D]`` tensors (all layers' keys and values; same B and S).
        src: ``[B, n]`` int64 source positions, ascending per row, ``src[b, j] >= dst_start[b] + j``.
        dst_start: ``[B]`` int64 first destination position of each row.
        counts: ``[B]`` int64, ``<= n``: row ``b`` moves ``src[b, :counts[b]]``.
    """
    _check(src.dim() == 2 and dst_start.dim() == 1 and counts.dim() == 1, "src [B,n], dst_start [B], counts [B]")
    if not caches or src.numel() == 0:
        return
    route = choose("kv_compact", caches[0].device, backend, ("cpu", "cuda"), triton=True)
    if route == "native":
        native_ops().kv_compact(caches, src.long(), dst_start.long(), counts.long())
    elif route == "triton":
        triton_kernels("kv_compact").kv_compact(caches, src, dst_start, counts)
    else:
        reference.kv_compact(caches, src, dst_start, counts)


def tree_verify_greedy(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    target_logits: torch.Tensor,
    valid: torch.Tensor | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy acceptance: the deepest root-to-node path whose tokens equal the target's argmax.

    Args:
        tokens: ``[B, T]`` int64, node 0 the root (last committed token).
        parents: ``[B, T]`` int64, ``-1`` at the root; parents precede children.
        target_logits: ``[B, T, V]`` float, the target's logits at every node.
        valid: ``[B, T]`` bool, False for padding nodes.
    Returns:
        path ``[B, T]`` int64 (accepted node indices from the root, -1 padded), length ``[B]``
        int32 (root included), next token ``[B]`` int64.
    """
    _check(tokens.shape == parents.shape and target_logits.shape[:2] == tokens.shape, "tokens/parents [B,T], logits [B,T,V]")
    route = choose("tree_verify_greedy", tokens.device, backend, ("cpu",), triton=True)
    if route == "native":
        return native_ops().tree_verify_greedy(tokens.long(), parents.long(), target_logits,
                                               None if valid is None else valid.bool())
    if route == "triton":
        return triton_kernels("tree_verify").tree_verify_greedy(tokens, parents, target_logits, valid)
    return reference.tree_verify_greedy(tokens, parents, target_logits, valid)


def tree_verify_sampling(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    uniforms: torch.Tensor,
    valid: torch.Tensor | None = None,
    draft_ids: torch.Tensor | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lossless sampling acceptance (recursive rejection sampling) over a draft tree.

    Args:
        tokens, parents, valid: as in :func:`tree_verify_greedy`.
        target_probs: ``[B, T, V]`` float, the target's processed distribution at every node.
        draft_probs: ``[B, T, K]`` float, the distribution node ``i`` was drawn from, over the ids
            ``draft_ids [B, T, K]`` int64 (distinct per node, -1 with probability 0 at unused
            entries; see :class:`specdec.tree.SparseProbs`), or ``[B, T, V]`` over the whole
            vocabulary when ``draft_ids`` is None, or None (deterministic drafts: one-hot
            proposals). An all-zero row is a one-hot proposal too.
        uniforms: ``[B, T + 1]`` uniform [0, 1) draws (one per node, the last for the final sample).
    Returns:
        path ``[B, T]`` int64, length ``[B]`` int32, next token ``[B]`` int64.
    """
    _check(tokens.shape == parents.shape and target_probs.shape[:2] == tokens.shape, "tokens/parents [B,T], probs [B,T,V]")
    _check(uniforms.shape == (tokens.shape[0], tokens.shape[1] + 1), "uniforms must be [B, T+1]")
    if draft_probs is not None:
        _check(draft_probs.shape[:2] == tokens.shape, "draft_probs must be [B, T, K]")
        _check(draft_ids is not None or draft_probs.shape[2] == target_probs.shape[2],
               "draft_probs without draft_ids must cover the whole vocabulary [B, T, V]")
    _check(draft_ids is None or (draft_probs is not None and draft_ids.shape == draft_probs.shape),
           "draft_ids must match draft_probs [B, T, K]")
    if choose("tree_verify_sampling", tokens.device, backend, (), triton=True) == "triton":
        return triton_kernels("tree_verify").tree_verify_sampling(tokens, parents, target_probs, draft_probs,
                                                                  uniforms, valid, draft_ids)
    return reference.tree_verify_sampling(tokens, parents, target_probs, draft_probs, uniforms, valid, draft_ids)


def draft_tree(
    root: torch.Tensor,
    drafts: torch.Tensor,
    merge: bool = True,
    accept: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor]:
    """Merge ``k`` draft chains per row into one verification tree with each node's reach estimate,
    optionally cut to each row's likeliest nodes.

    Args:
        root: ``[B]`` int64, the pending root token of each row.
        drafts: ``[B, k, w]`` int64, each chain -1 padded at its end (an empty slot is all -1).
        merge: True builds the trie (chains sharing a prefix share its nodes); False keeps every chain
            as its own branch under the root. Node order is chain-major: the chain listed first keeps
            the lowest indices (verification tries siblings in index order).
        accept: ``[B, k, w]`` fp32, the acceptance estimate of chain ``i``'s node at depth ``d + 1``, or
            None. A node's reach is that of the first chain through it, capped by its parent's.
        keep: ``[B]`` int64 (needs ``accept``): row ``b`` keeps its ``keep[b]`` draft nodes of highest
            reach (ties: shallower first, then node order; all it holds if fewer), in node order. How
            many pay is the planner's call (:func:`specdec.policies.planner.plan_size` on the uncut
            tree's reach); this op only cuts.
    Returns:
        tokens, parents (-1 at the root), valid (bool), depth, all ``[B, T]``; the packed ancestor-or-self
        mask ``[B, T, ceil(T/32)]`` int32; chain ``[B, T]`` (the first chain through each node) and slot
        ``[B, T]`` (that chain's cell ``i * w + d``), both -1 at the root and at padding; reach ``[B, T]``
        fp32 (1 at the root, 0 at padding; all 0 without ``accept``). ``T`` is the largest row's node
        count; padding nodes hang off the root with token 0.
    """
    _check(drafts.dim() == 3 and root.shape == drafts.shape[:1], "drafts must be [B, k, w] and root [B]")
    _check(accept is not None or keep is None, "keep needs accept (nodes are kept by their reach)")
    if accept is not None:
        _check(accept.shape == drafts.shape, f"accept must be [B, k, w] = {list(drafts.shape)}, got {list(accept.shape)}")
        accept = accept.float()
    if keep is not None:
        _check(keep.shape == drafts.shape[:1] and not keep.is_floating_point(),
               f"keep must be [B] integer node counts, got {keep.dtype} of shape {list(keep.shape)}")
        keep = keep.long()
    root, drafts = root.long(), drafts.long()
    if choose("draft_tree", drafts.device, backend, ("cpu",)) == "native":
        return native_ops().draft_tree(root, drafts, merge, accept, keep)  # checks keep >= 0 on the host
    _check(keep is None or bool((keep >= 0).all()), "keep must be >= 0")
    return reference.draft_tree(root, drafts, merge, accept, keep)
