"""Fused top-k, entropy and log-partition of ``softmax(logits / T)``: one pass over ``V`` per row.

Each program streams a slice of one row in ``BLOCK_V`` tiles and keeps, in registers, the online
max ``m``, ``s = sum e^(x-m)`` and ``t = sum e^(x-m) (x-m)`` (entropy ``H = log s - t / s``) and a
running top-``K`` list. Values and indices travel together as one int64 key (an order-preserving
integer image of the fp32 value in the high half, the inverted index in the low half, so equal
values rank the lower index first): keys are unique, and selection works on keys alone.

Per tile, only keys above the list's current minimum can enter. When many do (the first tiles
of a row), the tile's bitonic top-``K`` (``tl.topk``) is merged with the list; when a few do (most
later tiles), each replaces the list's minimum in turn; when none does, the tile costs nothing
beyond the sums. Rows that are few and long are split over several programs; a second small
kernel merges their partial sums and lists.

Specification: :func:`specdec.kernels.reference.topk_entropy`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_K = 1024
NONE = tl.constexpr(-(2**63))  # key of padding lanes and removed entries


@triton.jit
def _to_key(x, idx):
    """int64 keys ordered like (x, -idx): x fp32, idx int32 >= 0."""
    bits = x.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return (ordered.to(tl.int64) << 32) | (0xFFFFFFFF - idx.to(tl.int64))


@triton.jit
def _from_key(key):
    """Inverse of :func:`_to_key`: (x fp32, idx int64)."""
    ordered = (key >> 32).to(tl.int32)
    bits = tl.where(ordered >= 0, ordered, ordered ^ 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True), 0xFFFFFFFF - (key & 0xFFFFFFFF)


@triton.jit
def _merge_stats(m_a, s_a, t_a, m_b, s_b, t_b):
    """Combine two (m, s, t) summaries; s = 0 means empty (then m may be -inf)."""
    m = tl.maximum(m_a, m_b)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    da = tl.where(s_a > 0, m_a - m_safe, 0.0)
    db = tl.where(s_b > 0, m_b - m_safe, 0.0)
    ea = tl.where(s_a > 0, tl.exp(da), 0.0)
    eb = tl.where(s_b > 0, tl.exp(db), 0.0)
    # t is relative to m: shifting the reference from m_a to m adds (m_a - m) per unit of mass.
    t = ea * (t_a + da * s_a) + eb * (t_b + db * s_b)
    return m, ea * s_a + eb * s_b, t


@triton.jit
def _finish(KEYS_ROW, m, s, t, PROBS, IDS, ENT, LSE, row, k, K_PAD: tl.constexpr):
    """Write the outputs of one row from its merged stats and top keys ([K_PAD])."""
    lse = tl.where(s > 0, m + tl.log(tl.where(s > 0, s, 1.0)), float("-inf"))
    ent = tl.where(s > 0, tl.log(tl.where(s > 0, s, 1.0)) - t / tl.where(s > 0, s, 1.0), 0.0)
    tl.store(LSE + row, lse)
    tl.store(ENT + row, ent)
    if K_PAD <= 64:
        # Small lists: k rounds of "take the maximum" (cheaper than a bitonic sort).
        keys = KEYS_ROW
        for j in range(0, k):
            best = tl.max(keys, 0)
            x, idx = _from_key(best)
            tl.store(PROBS + row * k + j, tl.exp(x - lse))
            tl.store(IDS + row * k + j, idx)
            keys = tl.where(keys == best, NONE, keys)
    else:
        x, idx = _from_key(tl.sort(KEYS_ROW, descending=True))
        j = tl.arange(0, K_PAD)
        tl.store(PROBS + row * k + j, tl.exp(x - lse), mask=j < k)
        tl.store(IDS + row * k + j, idx, mask=j < k)


@triton.jit
def _topk_entropy_kernel(
    LOGITS, s_n, s_v, V, chunk, temperature, k,
    M_PART, S_PART, T_PART, KEY_PART,
    PROBS, IDS, ENT, LSE,
    K_PAD: tl.constexpr, BLOCK_V: tl.constexpr, NUM_SPLITS: tl.constexpr, EXTRACT_MAX: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # 64-bit offsets: N * V can exceed 2^31
    split = tl.program_id(1)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, V)
    lanes = tl.arange(0, BLOCK_V)

    m = float("-inf")
    s = 0.0
    t = 0.0
    slots = tl.arange(0, K_PAD)
    top = slots.to(tl.int64) + (NONE + 1)  # the running top-K (unordered); distinct placeholders below any real key
    kth = tl.min(top, 0)
    for start in range(lo, hi, BLOCK_V):
        offs = start + lanes
        ok = offs < hi
        raw = tl.load(LOGITS + row * s_n + offs * s_v, mask=ok, other=float("-inf")).to(tl.float32)
        x = tl.math.div_rn(raw, temperature)  # correctly rounded, like torch's division
        x = tl.where(ok, x, float("-inf"))
        # Stats of the tile, relative to its own max, then merged into the running ones.
        bm = tl.max(x, 0)
        bm_safe = tl.where(bm == float("-inf"), 0.0, bm)
        e = tl.exp(x - bm_safe)
        bs = tl.sum(e, 0)
        bt = tl.sum(tl.where(e > 0, e * (x - bm_safe), 0.0), 0)
        m, s, t = _merge_stats(m, s, t, bm, bs, bt)
        # Streaming top-K on keys; padding lanes rank below everything.
        keys = tl.where(ok, _to_key(x, offs), NONE)
        entering = tl.minimum(tl.sum((keys > kth).to(tl.int32), 0), K_PAD)  # rounds the loop below would take
        if entering > EXTRACT_MAX:
            # Many newcomers (the first tiles of a row): a bitonic top-K of the tile, then of both lists.
            both = tl.reshape(tl.join(top, tl.topk(keys, K_PAD)), [2 * K_PAD])
            top = tl.topk(both, K_PAD)
            kth = tl.min(top, 0)
        else:
            # A few newcomers (most tiles later on): each replaces the current minimum of the list.
            best = tl.max(keys, 0)
            while best > kth:
                top = tl.where(top == kth, best, top)  # keys are unique: exactly one slot
                keys = tl.where(keys == best, NONE, keys)
                kth = tl.min(top, 0)
                best = tl.max(keys, 0)

    j = tl.arange(0, K_PAD)
    if NUM_SPLITS == 1:
        _finish(top, m, s, t, PROBS, IDS, ENT, LSE, row, k, K_PAD)
    else:
        part = row * NUM_SPLITS + split
        tl.store(M_PART + part, m)
        tl.store(S_PART + part, s)
        tl.store(T_PART + part, t)
        tl.store(KEY_PART + part * K_PAD + j, top)


@triton.jit
def _merge_kernel(M_PART, S_PART, T_PART, KEY_PART, PROBS, IDS, ENT, LSE, k,
                  K_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr):
    row = tl.program_id(0)
    sp = tl.arange(0, SPLITS_PAD)
    ok = sp < NUM_SPLITS
    m_p = tl.load(M_PART + row * NUM_SPLITS + sp, mask=ok, other=float("-inf"))
    s_p = tl.load(S_PART + row * NUM_SPLITS + sp, mask=ok, other=0.0)
    t_p = tl.load(T_PART + row * NUM_SPLITS + sp, mask=ok, other=0.0)
    m = tl.max(m_p, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    d = tl.where(s_p > 0, m_p - m_safe, 0.0)
    e = tl.where(s_p > 0, tl.exp(d), 0.0)
    s = tl.sum(e * s_p, 0)
    t = tl.sum(e * (t_p + d * s_p), 0)
    j = tl.arange(0, K_PAD)
    keys = tl.load(KEY_PART + (row * NUM_SPLITS + sp[:, None]) * K_PAD + j[None, :], mask=ok[:, None],
                   other=-(2**63))
    top = tl.reshape(keys, [SPLITS_PAD * K_PAD])
    if SPLITS_PAD > 1:
        top = tl.topk(top, K_PAD)
    _finish(top, m, s, t, PROBS, IDS, ENT, LSE, row, k, K_PAD)


def _num_splits(n: int, v: int, block_v: int, device: torch.device) -> int:
    """Split rows over several programs only when there are fewer rows than SMs."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(triton.cdiv(2 * sms, max(n, 1)), triton.cdiv(v, 4 * block_v), 64))


def topk_entropy(
    logits: torch.Tensor, k: int, temperature: float = 1.0, num_splits: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k of ``softmax(logits / temperature)`` with its entropy and log-partition (Triton).

    Args:
        logits: ``[N, V]`` fp32/fp16/bf16 (any strides); computed in fp32.
        k: ``1 <= k <= min(V, 1024)``; temperature: ``> 0``.
        num_splits: programs per row (default: a heuristic; tests force it to exercise the merge).
    Returns:
        probs ``[N, k]`` fp32 descending, ids ``[N, k]`` int64 (equal values: lower id first),
        entropy ``[N]`` fp32 (nats), logsumexp ``[N]`` fp32 of ``logits / temperature``.
    """
    n, v = logits.shape
    if not 1 <= k <= min(v, MAX_K):
        raise ValueError(f"k must be in [1, min(V, {MAX_K})], got {k} (V = {v})")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if v >= 2**31:
        raise ValueError("V must be < 2**31")
    dev = logits.device
    probs = torch.empty(n, k, dtype=torch.float32, device=dev)
    ids = torch.empty(n, k, dtype=torch.int64, device=dev)
    entropy = torch.empty(n, dtype=torch.float32, device=dev)
    lse = torch.empty(n, dtype=torch.float32, device=dev)
    if n == 0:
        return probs, ids, entropy, lse
    # tl.topk must select from strictly more than K_PAD >= 2 entries: with k == 1 or with a tile no
    # wider than K_PAD its bitonic reduction ends in a scalar, which Triton 3.6 fails to compile.
    k_pad = max(2, triton.next_power_of_2(k))
    block_v = max(2 * k_pad, min(2048, triton.next_power_of_2(v)))
    splits = num_splits or _num_splits(n, v, block_v, dev)
    chunk = triton.cdiv(triton.cdiv(v, splits), block_v) * block_v
    splits = triton.cdiv(v, chunk)  # no empty split
    if splits > 1:
        m_part = torch.empty(n, splits, dtype=torch.float32, device=dev)
        s_part = torch.empty_like(m_part)
        t_part = torch.empty_like(m_part)
        key_part = torch.empty(n, splits, k_pad, dtype=torch.int64, device=dev)
    else:
        m_part = s_part = t_part = key_part = lse  # unused
    _topk_entropy_kernel[(n, splits)](
        logits, logits.stride(0), logits.stride(1), v, chunk, float(temperature), k,
        m_part, s_part, t_part, key_part, probs, ids, entropy, lse,
        K_PAD=k_pad, BLOCK_V=block_v, NUM_SPLITS=splits, EXTRACT_MAX=16,
        num_warps=8 if block_v >= 2048 else 4,
    )
    if splits > 1:
        _merge_kernel[(n,)](
            m_part, s_part, t_part, key_part, probs, ids, entropy, lse, k,
            K_PAD=k_pad, NUM_SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits),
        )
    return probs, ids, entropy, lse
