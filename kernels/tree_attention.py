"""Tree attention: ``T`` tree queries over a cached prefix plus ``N >= T`` pending tree nodes (packed mask).

The queries are the last ``T`` of the pending nodes: ``N == T`` is one verification tree, ``N > T`` a tree
grown level by level whose earlier levels' KV is already cached (a rectangular ``[T, ceil(N/32)]`` mask).

Flash-style online softmax. One program handles a tile of ``BLOCK_M`` (query head, tree node)
rows that share one KV head, so every K/V tile is loaded once for all ``Hq / Hkv`` query heads of
a GQA group. The prefix needs no mask beyond ``cache_lens`` (and the sliding window); only the
``T x N`` pending block reads the packed bits. When the grid would leave the GPU idle (few rows, long
prefix) the prefix is split over several programs whose partial results are merged by their
log-sum-exp afterwards (split-K / flash-decoding; the xformers prefix/suffix merge).

Specification: :func:`specdec.kernels.reference.tree_attention`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _online_update(q, k_t, v, s_mask, m_i, l_i, acc, qk_scale, F32_DOT: tl.constexpr):
    """One K/V tile of the online softmax. k_t: [D, N]; v: [N, D]; s_mask: [M, N] visible."""
    if F32_DOT:
        s = tl.dot(q.to(tl.float32), k_t.to(tl.float32), input_precision="ieee")
    else:
        s = tl.dot(q, k_t)
    s = tl.where(s_mask, s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen nothing yet keeps m = -inf; subtract 0 instead to avoid inf - inf.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_safe)
    p = tl.math.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if F32_DOT:
        # p is rounded to v's dtype first, as the tensor-core path below does.
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _tree_attention_kernel(
    Q, KC, VC, LENS, KT, VT, MASK, POS, O, O_PART, LSE_PART,
    sq_b, sq_h, sq_t, sq_d,
    skc_b, skc_h, skc_s, skc_d,
    svc_b, svc_h, svc_s, svc_d,
    skt_b, skt_h, skt_t, skt_d,
    svt_b, svt_h, svt_t, svt_d,
    sm_b, sm_t, sm_w,
    sp_b, sp_t,
    so_b, so_h, so_t, so_d,
    B, HQ, T, N, S, D, chunk, window, qk_scale,
    RATIO: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_WINDOW: tl.constexpr, NUM_SPLITS: tl.constexpr, F32_DOT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    split = tl.program_id(2)
    hkv_count = HQ // RATIO
    b = (bh // hkv_count).to(tl.int64)  # 64-bit offsets: a batch of caches can exceed 2^31 elements
    hkv = bh % hkv_count

    # Rows of the tile: r = (head within the GQA group) * T + tree node.
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = r < RATIO * T
    h = hkv * RATIO + r // T
    i = r % T
    node = i + (N - T)  # the query's own index among the pending nodes
    d = tl.arange(0, HEAD_D)  # HEAD_D: D rounded up to a power of two; padded columns are zeros
    d_ok = d < D

    q = tl.load(Q + b * sq_b + h[:, None] * sq_h + i[:, None] * sq_t + d[None, :] * sq_d,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if HAS_WINDOW:
        qpos = tl.load(POS + b * sp_b + node * sp_t, mask=row_ok, other=0).to(tl.int32)
        lowest = tl.where(row_ok, qpos - window, 2**31 - 1)  # a key at position p is visible iff p > qpos - window

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_D], tl.float32)

    # Prefix: keys [lo, hi) of this split, all visible up to cache_lens[b] (and the window).
    cache_len = tl.minimum(tl.load(LENS + b), S).to(tl.int32)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, cache_len)
    if HAS_WINDOW:
        lo = tl.maximum(lo, tl.min(lowest) + 1)
    kc_base = KC + b * skc_b + hkv * skc_h
    vc_base = VC + b * svc_b + hkv * svc_h
    for kstart in range(lo, hi, BLOCK_N):
        kpos = kstart + tl.arange(0, BLOCK_N)
        kmask = kpos < hi
        k_t = tl.load(kc_base + kpos[None, :] * skc_s + d[:, None] * skc_d, mask=kmask[None, :] & d_ok[:, None],
                      other=0.0)
        v = tl.load(vc_base + kpos[:, None] * svc_s + d[None, :] * svc_d, mask=kmask[:, None] & d_ok[None, :],
                    other=0.0)
        vis = kmask[None, :] & row_ok[:, None]
        if HAS_WINDOW:
            vis = vis & (kpos[None, :] > lowest[:, None])
        m_i, l_i, acc = _online_update(q, k_t, v, vis, m_i, l_i, acc, qk_scale, F32_DOT)

    # Pending block: the last split also owns the N pending keys, masked by the packed bits.
    if split == NUM_SPLITS - 1:
        kt_base = KT + b * skt_b + hkv * skt_h
        vt_base = VT + b * svt_b + hkv * svt_h
        for jstart in range(0, N, BLOCK_N):
            j = jstart + tl.arange(0, BLOCK_N)
            jmask = j < N
            k_t = tl.load(kt_base + j[None, :] * skt_t + d[:, None] * skt_d, mask=jmask[None, :] & d_ok[:, None],
                          other=0.0)
            v = tl.load(vt_base + j[:, None] * svt_t + d[None, :] * svt_d, mask=jmask[:, None] & d_ok[None, :],
                        other=0.0)
            both = row_ok[:, None] & jmask[None, :]
            if HAS_MASK:
                word = tl.load(MASK + b * sm_b + i[:, None] * sm_t + (j // 32)[None, :] * sm_w, mask=both, other=0)
                vis = both & (((word >> (j % 32)[None, :]) & 1) != 0)
            else:
                vis = both & (j[None, :] <= node[:, None])
            if HAS_WINDOW:
                kpos = tl.load(POS + b * sp_b + j * sp_t, mask=jmask, other=0).to(tl.int32)
                vis = vis & (kpos[None, :] > lowest[:, None])
            m_i, l_i, acc = _online_update(q, k_t, v, vis, m_i, l_i, acc, qk_scale, F32_DOT)

    # A row that sees no key at all gets zeros (as SDPA does), not 0/0.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:
        tl.store(O + b * so_b + h[:, None] * so_h + i[:, None] * so_t + d[None, :] * so_d,
                 out.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        # Partials are contiguous [NUM_SPLITS, B, HQ, T, (D)] fp32; lse in log2 units.
        row = ((split * B + b) * HQ + h) * T + i
        tl.store(O_PART + row[:, None] * HEAD_D + d[None, :], out, mask=row_ok[:, None])
        lse = tl.where(l_i > 0, m_i + tl.math.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(LSE_PART + row, lse, mask=row_ok)


@triton.jit
def _merge_splits_kernel(O_PART, LSE_PART, O, so_b, so_h, so_t, so_d, B, HQ, T, D,
                         NUM_SPLITS: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_R: tl.constexpr):
    """out = sum_s w_s o_s / sum_s w_s with w_s = 2^(lse_s - max lse), for BLOCK_R (b, h, i) rows."""
    rows = B * HQ * T
    row = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # (b * HQ + h) * T + i
    ok = row < rows
    d = tl.arange(0, HEAD_D)
    top = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for sp in tl.static_range(NUM_SPLITS):
        top = tl.maximum(top, tl.load(LSE_PART + sp * rows + row, mask=ok, other=float("-inf")))
    top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, HEAD_D], tl.float32)
    for sp in tl.static_range(NUM_SPLITS):
        w = tl.math.exp2(tl.load(LSE_PART + sp * rows + row, mask=ok, other=float("-inf")) - top)
        part = tl.load(O_PART + (sp * rows + row)[:, None] * HEAD_D + d[None, :], mask=ok[:, None], other=0.0)
        total += w
        acc += part * w[:, None]
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    b = row // (HQ * T)
    h = (row // T) % HQ
    i = row % T
    tl.store(O + b[:, None] * so_b + h[:, None] * so_h + i[:, None] * so_t + d[None, :] * so_d,
             out.to(O.dtype.element_ty), mask=ok[:, None] & (d < D)[None, :])


def _f32_dot(dtype: torch.dtype) -> bool:
    """Whether the dots run in fp32 (IEEE): fp32 inputs ask for fp32 accuracy (no TF32), and the
    Triton 3.9 interpreter multiplies bf16 tensors as their raw uint16 bits."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and triton.knobs.runtime.interpret)


def _num_splits(programs: int, s: int, device: torch.device) -> int:
    """Split the prefix only when the grid is smaller than the GPU and the prefix is long."""
    if device.type != "cuda" or s < 1024:
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if programs >= sms:
        return 1
    return max(1, min(triton.cdiv(s, 512), triton.cdiv(2 * sms, programs), 16))


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
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of ``T`` tree tokens over a cached prefix and the pending nodes they see (Triton).

    Args:
        q: ``[B, Hq, T, D]`` fp32/fp16/bf16 (any ``D``; tiles are padded to a power of two >= 16); query
            ``i`` is pending node ``N - T + i``.
        k_cache, v_cache: ``[B, Hkv, S, D]``, same dtype as ``q``; row ``b`` valid up to ``cache_lens[b]``.
        cache_lens: ``[B]`` int32/int64 (values above ``S`` are clamped to ``S``).
        k_tree, v_tree: ``[B, Hkv, N, D]``, ``N >= T`` pending nodes, the queries last.
        tree_mask: ``[B, T, ceil(N/32)]`` int32 packed mask (bit ``j`` of row ``i``: query ``i`` sees pending
            node ``j``), or None (causal chain: query ``i`` sees pending nodes ``j <= N - T + i``).
        scale: softmax scale, default ``D ** -0.5``.
        tree_positions: ``[B, N]`` int absolute positions of the pending nodes (required with ``window``).
        window: sliding window: a query at position ``p`` sees keys at positions ``> p - window``.
        num_splits: split the prefix over this many programs per tile (default: a heuristic; tests
            force it to exercise the merge).
    Returns:
        ``[B, Hq, T, D]``, dtype of ``q``. Rows that see no key are zeros.
    """
    b, hq, t, dim = q.shape
    hkv, s, n = k_cache.shape[1], k_cache.shape[2], k_tree.shape[2]
    if n < t:
        raise ValueError(f"k_tree must hold N >= T = {t} pending nodes, got {n}")
    if hq % hkv:
        raise ValueError(f"Hq={hq} is not a multiple of Hkv={hkv}")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"unsupported dtype {q.dtype}")
    if any(x.dtype != q.dtype for x in (k_cache, v_cache, k_tree, v_tree)):
        raise ValueError("q, k_cache, v_cache, k_tree and v_tree must share one dtype")
    if window is not None and tree_positions is None:
        raise ValueError("tree_positions are required with a sliding window")
    ratio = hq // hkv
    out = torch.empty_like(q)
    if b == 0 or t == 0 or hq == 0 or dim == 0:
        return out
    scale = dim ** -0.5 if scale is None else scale

    block_m = min(64, max(16, triton.next_power_of_2(ratio * t)))
    head_d = max(16, triton.next_power_of_2(dim))
    block_n = 64 if head_d <= 64 else 32
    m_tiles = triton.cdiv(ratio * t, block_m)
    splits = num_splits or _num_splits(m_tiles * b * hkv, s, q.device)
    chunk = triton.cdiv(triton.cdiv(max(s, 1), splits), block_n) * block_n

    mask = tree_mask if tree_mask is not None else cache_lens  # any tensor: never read without HAS_MASK
    pos = tree_positions if tree_positions is not None else cache_lens
    mask_strides = tree_mask.stride() if tree_mask is not None else (0, 0, 0)
    pos_strides = tree_positions.stride() if tree_positions is not None else (0, 0)
    if splits > 1:
        o_part = torch.empty(splits, b, hq, t, head_d, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(splits, b, hq, t, dtype=torch.float32, device=q.device)
    else:
        o_part = lse_part = out  # unused
    _tree_attention_kernel[(m_tiles, b * hkv, splits)](
        q, k_cache, v_cache, cache_lens, k_tree, v_tree, mask, pos, out, o_part, lse_part,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *k_tree.stride(), *v_tree.stride(),
        *mask_strides, *pos_strides, *out.stride(),
        b, hq, t, n, s, dim, chunk, 0 if window is None else int(window), float(scale) * LOG2E,
        RATIO=ratio, HEAD_D=head_d, BLOCK_M=block_m, BLOCK_N=block_n,
        HAS_MASK=tree_mask is not None, HAS_WINDOW=window is not None, NUM_SPLITS=splits,
        F32_DOT=_f32_dot(q.dtype),
        num_warps=4 if head_d <= 64 else 8,
    )
    if splits > 1:
        block_r = 16
        _merge_splits_kernel[(triton.cdiv(b * hq * t, block_r),)](
            o_part, lse_part, out, *out.stride(), b, hq, t, dim, NUM_SPLITS=splits, HEAD_D=head_d, BLOCK_R=block_r,
        )
    return out
