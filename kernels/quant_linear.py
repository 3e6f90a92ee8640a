"""Linear layer over affine-coded weights: ``y = x . W^T + b`` with ``W = code * scale + min`` per group.

The codes (8-bit signed, or 4-bit packed two to a byte) are streamed once per tile of ``x``'s rows
and dequantized in registers, in fp32, exactly as the specification rounds them (``code * scale``
rounded, then ``+ min``: on the GPU the product goes through ``mul.rn``, which the compiler may not
fuse with the add). The products ``x * W`` are IEEE fp32 with fp32 accumulation (no TF32).

A 4-bit byte holds codes ``2j`` (low nibble) and ``2j + 1`` (high nibble); instead of interleaving
them in registers, the kernel reads ``x``'s even and odd columns separately and accumulates the two
half-tiles, both of which share the byte's scale group (groups are even).

Two paths, chosen by the number of rows ``M``:

- ``M <= 8`` (decoding, small verification trees: memory-bound): a GEMV-like tile of ``BLOCK_M =
  next_pow2(M)`` rows. A step's codes are a ``[1, BLOCK_N, BLOCK_C]`` tile, dequantized in the layout
  they were loaded in (vectorised loads of 16 bytes); ``x[:, None, :]`` is broadcast into that layout
  and the products are reduced along K, so only the small ``x`` and scale tiles change layout
  (``tl.dot`` would pad the rows to 16 and multiply zeros).
- ``M > 8`` (wide verification, prompts): ``tl.dot`` in IEEE fp32 over ``BLOCK_M x BLOCK_N`` tiles.

When the grid would leave the GPU idle (few rows, few outputs), K is split over several programs
whose fp32 partial sums are added, with the bias, by a second small kernel, so the output is still
rounded once.

Specification: :func:`specdec.kernels.quant_reference.quant_linear`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

SMALL_M = 8  # up to this many rows: the GEMV path
# BLOCK_M: (BLOCK_N, STEP columns of K per step) of the GEMV path: BLOCK_M * BLOCK_N * STEP products per step.
_GEMV_TILES = {1: (32, 128), 2: (32, 64), 4: (32, 32), 8: (16, 32)}


@triton.jit
def _mul_rn(a, b, EXACT_MUL: tl.constexpr):
    """IEEE fp32 ``a * b`` that the compiler may not contract with a following add into an FMA."""
    if EXACT_MUL:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return a * b  # the interpreter (numpy) never fuses


@triton.jit
def _dequantize(codes, s, mn, GROUP_C: tl.constexpr, HAS_MIN: tl.constexpr, EXACT_MUL: tl.constexpr):
    """fp32 weights of a ``[A, B, C]`` tile of codes whose groups are runs of ``GROUP_C`` codes along the last
    axis: ``codes * s + mn`` with ``s``, ``mn``: ``[A, B, C // GROUP_C]``; the product is rounded on its own."""
    A: tl.constexpr = codes.shape[0]
    B: tl.constexpr = codes.shape[1]
    C: tl.constexpr = codes.shape[2]
    c = tl.reshape(codes.to(tl.float32), [A, B, C // GROUP_C, GROUP_C])
    w = _mul_rn(c, tl.broadcast_to(s[:, :, :, None], [A, B, C // GROUP_C, GROUP_C]), EXACT_MUL)
    if HAS_MIN:
        w = w + mn[:, :, :, None]
    return tl.reshape(w, [A, B, C])


@triton.jit
def _quant_linear_kernel(
    X, CODES, SCALE, MINV, BIAS, Y, PART,
    s_xm, s_xk, s_cn, s_ck, s_sn, s_sg, s_mn, s_mg, s_b, s_ym, s_yn,
    M, N, K, chunk,
    BITS: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STEP: tl.constexpr,
    USE_DOT: tl.constexpr, HAS_MIN: tl.constexpr, HAS_BIAS: tl.constexpr,
    NUM_SPLITS: tl.constexpr, EVEN_K: tl.constexpr, EXACT_MUL: tl.constexpr,
):
    # A step covers STEP columns of K: STEP codes (8-bit) or STEP / 2 bytes (4-bit) per row, GROUPS whole groups.
    # Code tiles are 3-d, [1, BLOCK_N, BLOCK_C]; x tiles 2-d, [BLOCK_M, BLOCK_C]. The GEMV path multiplies them
    # by broadcasting x[:, None, :] into the codes' own layout (only the small x tile changes layout).
    BLOCK_C: tl.constexpr = STEP if BITS == 8 else STEP // 2
    GROUP_C: tl.constexpr = GROUP if BITS == 8 else GROUP // 2
    GROUPS: tl.constexpr = STEP // GROUP
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    # Rows and outputs past the edge wrap around (loads stay in bounds without masks); stores are masked.
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    x_row = X + rm.to(tl.int64)[:, None] * s_xm  # 64-bit row offsets: N * K can exceed 2^31
    c_row = CODES + rn.to(tl.int64)[None, :, None] * s_cn
    s_row = SCALE + rn.to(tl.int64)[None, :, None] * s_sn
    m_row = MINV + rn.to(tl.int64)[None, :, None] * s_mn
    cols = tl.arange(0, BLOCK_C)  # codes (8-bit) or bytes (4-bit) of a row in one step
    grp = tl.arange(0, GROUPS)[None, None, :]

    lo = split * chunk  # chunk: a multiple of STEP
    hi = tl.minimum(lo + chunk, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k_step in range(lo, hi, STEP):
        k0 = tl.multiple_of(k_step, STEP)
        # Code / byte index in the row (4-bit: byte j holds columns 2j, 2j + 1); [1, BLOCK_C] for x, 3-d for codes.
        jx = (k0 // (STEP // BLOCK_C) + cols)[None, :]
        j = jx[None, :, :]
        g = k0 // GROUP + grp
        if EVEN_K:
            c = tl.load(c_row + j * s_ck)
            s = tl.load(s_row + g * s_sg)
            mn = tl.load(m_row + g * s_mg) if HAS_MIN else s
        else:
            # K is a multiple of GROUP: a group lies wholly inside or outside [0, hi).
            c_ok = j * (STEP // BLOCK_C) < hi
            g_ok = g * GROUP < hi
            c = tl.load(c_row + j * s_ck, mask=c_ok, other=0)
            s = tl.load(s_row + g * s_sg, mask=g_ok, other=0.0)
            mn = tl.load(m_row + g * s_mg, mask=g_ok, other=0.0) if HAS_MIN else s
        if BITS == 8:
            if EVEN_K:
                x = tl.load(x_row + jx * s_xk)
            else:
                x = tl.load(x_row + jx * s_xk, mask=jx * (STEP // BLOCK_C) < hi, other=0.0)
            w = _dequantize(c, s, mn, GROUP_C, HAS_MIN, EXACT_MUL)
            if USE_DOT:
                acc = tl.dot(x.to(tl.float32),
                             tl.trans(tl.reshape(w, [BLOCK_N, BLOCK_C])), acc, input_precision="ieee")
            else:
                acc += tl.sum(x.to(tl.float32)[:, None, :] * w, 2)
        else:
            if EVEN_K:
                x_lo = tl.load(x_row + (2 * jx) * s_xk)
                x_hi = tl.load(x_row + (2 * jx + 1) * s_xk)
            else:
                x_lo = tl.load(x_row + (2 * jx) * s_xk, mask=jx * (STEP // BLOCK_C) < hi, other=0.0)
                x_hi = tl.load(x_row + (2 * jx + 1) * s_xk, mask=jx * (STEP // BLOCK_C) < hi, other=0.0)
            # GROUP is even: both nibbles of a byte share its group.
            w_lo = _dequantize(c & 15, s, mn, GROUP_C, HAS_MIN, EXACT_MUL)
            w_hi = _dequantize(c >> 4, s, mn, GROUP_C, HAS_MIN, EXACT_MUL)
            if USE_DOT:
                acc = tl.dot(x_lo.to(tl.float32),
                             tl.trans(tl.reshape(w_lo, [BLOCK_N, BLOCK_C])), acc, input_precision="ieee")
                acc = tl.dot(x_hi.to(tl.float32),
                             tl.trans(tl.reshape(w_hi, [BLOCK_N, BLOCK_C])), acc, input_precision="ieee")
            else:
                acc += tl.sum(x_lo.to(tl.float32)[:, None, :] * w_lo + x_hi.to(tl.float32)[:, None, :] * w_hi, 2)

    om = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    on = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out_ok = (om < M)[:, None] & (on < N)[None, :]
    if NUM_SPLITS == 1:
        if HAS_BIAS:
            acc += tl.load(BIAS + rn * s_b).to(tl.float32)[None, :]
        tl.store(Y + om.to(tl.int64)[:, None] * s_ym + on[None, :] * s_yn, acc.to(Y.dtype.element_ty), mask=out_ok)
    else:
        # Partials are contiguous [NUM_SPLITS, M, N] fp32.
        row = split * M + om.to(tl.int64)
        tl.store(PART + row[:, None] * N + on[None, :], acc, mask=out_ok)


@triton.jit
def _sum_splits_kernel(PART, BIAS, Y, s_b, s_ym, s_yn, M, N,
                       NUM_SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """y[m, n] = sum_s part[s, m, n] (+ bias[n]), rounded once to y's dtype."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # m * N + n
    ok = offs < M * N
    acc = tl.zeros([BLOCK], tl.float32)
    ptr = PART + offs
    for sp in tl.static_range(NUM_SPLITS):
        acc += tl.load(ptr, mask=ok, other=0.0)
        ptr += M * N
    m = offs // N
    n = offs % N
    if HAS_BIAS:
        acc += tl.load(BIAS + n * s_b, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + m * s_ym + n * s_yn, acc.to(Y.dtype.element_ty), mask=ok)


def _num_splits(tiles: int, k: int, step: int, device: torch.device) -> int:
    """Split K only when the output tiles do not fill the GPU; every split keeps >= 512 columns."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if tiles >= 2 * sms:
        return 1
    return max(1, min(triton.cdiv(4 * sms, tiles), k // max(512, step), 16))


def _config(m: int, dtype: torch.dtype) -> tuple[int, int, int, bool, int, int]:
    """(BLOCK_M, BLOCK_N, STEP columns of K per step, use tl.dot, num_warps, num_stages) for ``m`` rows of ``dtype``.

    The fp32 ``tl.dot`` is lowered to FMAs that read all of a step's operands into registers; pipelining fp32
    loads on top of that doubles the registers per thread (about 200 at 64 x 64 with 8 warps, against 80 for
    one stage: ptxas for sm_90), so fp32 activations are not pipelined.
    """
    if m <= SMALL_M:
        block_m = triton.next_power_of_2(max(m, 1))
        return (block_m, *_GEMV_TILES[block_m], False, 4, 3)
    block_m = min(64, triton.next_power_of_2(m))
    return block_m, 64, 32, True, 8 if block_m == 64 else 4, 1 if dtype == torch.float32 else 2


def quant_linear(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    minv: torch.Tensor | None,
    bits: int,
    group: int,
    bias: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """``x . W^T + bias`` with ``W[n, k] = codes[n, k] * scale[n, k // group] + minv[n, k // group]`` (Triton).

    Args:
        x: ``[M, K]`` fp32/bf16/fp16 activations (any strides).
        codes: ``bits == 8``: ``[N, K]`` int8, the signed code of each weight; ``bits == 4``: ``[N, K // 2]``
            uint8, byte ``j`` of row ``n`` holding ``code[n, 2j]`` in its low nibble and ``code[n, 2j + 1]`` in
            its high nibble (codes 0..15). Any strides.
        scale: ``[N, K // group]`` fp32.
        minv: ``[N, K // group]`` fp32, or None (a zero minimum).
        bits: 4 or 8; group: 16 or 32 (``K`` must be a multiple of it).
        bias: ``[N]`` in ``x``'s dtype, or None.
        num_splits: programs over K per output tile (default: a heuristic; tests force it to exercise the
            reduction of the partial sums).
    Returns:
        ``[M, N]`` contiguous, ``x``'s dtype: the fp32 sum of the IEEE fp32 products ``float(x) * W`` (``W``
        computed in fp32, ``code * scale`` rounded before ``+ min``), plus ``bias``, rounded once.
    """
    if x.dim() != 2 or codes.dim() != 2:
        raise ValueError(f"x must be [M, K] and codes [N, K or K/2], got {tuple(x.shape)} and {tuple(codes.shape)}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"unsupported activation dtype {x.dtype}")
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if group not in (16, 32):
        raise ValueError(f"group must be 16 or 32, got {group}")
    m, k = x.shape
    n = codes.shape[0]
    want_codes = (torch.int8, k) if bits == 8 else (torch.uint8, k // 2)
    if k % group:
        raise ValueError(f"K = {k} is not a multiple of group = {group}")
    if codes.dtype != want_codes[0] or codes.shape[1] != want_codes[1]:
        raise ValueError(f"{bits}-bit codes must be {want_codes[0]} [N, {want_codes[1]}], "
                         f"got {codes.dtype} {list(codes.shape)}")
    for name, t in (("scale", scale), ("minv", minv)):
        if t is not None and (t.dtype != torch.float32 or tuple(t.shape) != (n, k // group)):
            raise ValueError(f"{name} must be float32 [{n}, {k // group}], got {t.dtype} {list(t.shape)}")
    if bias is not None and (bias.dtype != x.dtype or tuple(bias.shape) != (n,)):
        raise ValueError(f"bias must be {x.dtype} [{n}], got {bias.dtype} {list(bias.shape)}")
    if any(t is not None and t.device != x.device for t in (codes, scale, minv, bias)):
        raise ValueError("x, codes, scale, minv and bias must be on one device")

    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    block_m, block_n, step, use_dot, warps, stages = _config(m, x.dtype)
    m_tiles, n_tiles = triton.cdiv(m, block_m), triton.cdiv(n, block_n)
    splits = num_splits or _num_splits(m_tiles * n_tiles, k, step, x.device)
    chunk = triton.cdiv(triton.cdiv(max(k, 1), splits), step) * step
    splits = max(1, triton.cdiv(k, chunk))  # no empty split
    # chunk is a multiple of step: every step of every split is full iff K is a multiple of step.
    part = torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if splits > 1 else y
    mn = minv if minv is not None else scale  # never read without HAS_MIN
    bb = bias if bias is not None else y  # never read without HAS_BIAS
    _quant_linear_kernel[(n_tiles, m_tiles, splits)](
        x, codes, scale, mn, bb, y, part,
        *x.stride(), *codes.stride(), *scale.stride(), *mn.stride(), bb.stride(0) if bias is not None else 0,
        *y.stride(),
        m, n, k, chunk,
        BITS=bits, GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, STEP=step, USE_DOT=use_dot,
        HAS_MIN=minv is not None, HAS_BIAS=bias is not None, NUM_SPLITS=splits, EVEN_K=k % step == 0,
        EXACT_MUL=x.device.type == "cuda" and not triton.knobs.runtime.interpret,
        num_warps=warps, num_stages=stages,
    )
    if splits > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](
            part, bb, y, bb.stride(0) if bias is not None else 0, *y.stride(), m, n,
            NUM_SPLITS=splits, HAS_BIAS=bias is not None, BLOCK=block,
        )
    return y
