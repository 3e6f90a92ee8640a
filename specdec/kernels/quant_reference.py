"""Pure-torch reference of the linear layer over affine-coded ("quantized") weights.

The specification of :func:`specdec.triton_kernels.quant_linear.quant_linear`. A weight row is cut
into groups of ``group`` columns; each group has an fp32 ``scale`` and an optional fp32 ``minv``, and
``W[n, k] = code[n, k] * scale[n, k // group] + minv[n, k // group]`` in fp32 (the product rounded
first, then the minimum added). Codes are 8-bit signed (``int8 [N, K]``) or 4-bit unsigned packed two
to a byte (``uint8 [N, K // 2]``: byte ``j`` holds code ``2j`` in its low nibble, ``2j + 1`` in its high
nibble).
"""
from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def _ieee_fp32(cuda: bool):
    """IEEE fp32 matmuls on CUDA inside the block: TF32, where enabled, is switched off for its duration
    (the flags are left alone otherwise, TF32 being off by default)."""
    mm = torch.backends.cuda.matmul
    if not cuda:
        yield
    elif hasattr(mm, "fp32_precision"):
        prev = mm.fp32_precision
        if prev != "tf32":
            yield
            return
        mm.fp32_precision = "ieee"
        try:
            yield
        finally:
            mm.fp32_precision = prev
    else:
        prev, mm.allow_tf32 = mm.allow_tf32, False
        try:
            yield
        finally:
            mm.allow_tf32 = prev


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes two to a byte: ``[N, K]`` integers in 0..15 (``K`` even) -> ``uint8 [N, K // 2]``
    (code ``2j`` in the low nibble of byte ``j``, code ``2j + 1`` in its high nibble)."""
    c = codes.to(torch.int32)
    if c.shape[-1] % 2:
        raise ValueError(f"K = {c.shape[-1]} must be even to pack 4-bit codes")
    if c.numel() and (int(c.min()) < 0 or int(c.max()) > 15):
        raise ValueError("4-bit codes must lie in 0..15")
    return (c[..., 0::2] | (c[..., 1::2] << 4)).to(torch.uint8)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: ``uint8 [N, K // 2]`` -> ``int32 [N, K]`` codes in 0..15."""
    b = packed.to(torch.int32)
    return torch.stack((b & 15, b >> 4), dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def quant_linear_dequantize(
    codes: torch.Tensor, scale: torch.Tensor, minv: torch.Tensor | None, bits: int, group: int
) -> torch.Tensor:
    """The fp32 weights ``W [N, K]`` of affine codes.

    codes: ``bits == 8``: ``int8 [N, K]``; ``bits == 4``: ``uint8 [N, K // 2]`` (see :func:`pack_int4`).
    scale, minv: ``fp32 [N, K // group]`` (``minv`` None means 0). group: 16 or 32.
    ``W[n, k] = codes[n, k] * scale[n, k // group] + minv[n, k // group]``, the product rounded to fp32
    before the minimum is added.
    """
    if bits == 8:
        if codes.dtype != torch.int8:
            raise ValueError(f"8-bit codes must be int8, got {codes.dtype}")
        c = codes.to(torch.float32)
    elif bits == 4:
        if codes.dtype != torch.uint8:
            raise ValueError(f"4-bit codes must be uint8, got {codes.dtype}")
        c = unpack_int4(codes).to(torch.float32)
    else:
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    n, k = c.shape
    if group <= 0 or k % group:
        raise ValueError(f"K = {k} is not a multiple of group = {group}")
    for name, t in (("scale", scale), ("minv", minv)):
        if t is not None and tuple(t.shape) != (n, k // group):
            raise ValueError(f"{name} must be [{n}, {k // group}], got {list(t.shape)}")
    w = c * scale.to(torch.float32).repeat_interleave(group, dim=1)
    if minv is not None:
        w = w + minv.to(torch.float32).repeat_interleave(group, dim=1)
    return w


def quant_linear(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    minv: torch.Tensor | None,
    bits: int,
    group: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x . W^T + bias`` over affine-coded weights (:func:`quant_linear_dequantize`).

    x: ``[M, K]`` fp32/bf16/fp16; bias: ``[N]`` in ``x``'s dtype or None. Returns ``[M, N]`` in ``x``'s dtype:
    the fp32 product ``float(x) . W^T`` (no TF32), plus ``float(bias)``, rounded once.
    """
    w = quant_linear_dequantize(codes, scale, minv, bits, group)
    if x.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x must be [M, {w.shape[1]}], got {list(x.shape)}")
    xf = x.to(torch.float32)
    with _ieee_fp32(xf.is_cuda):
        y = xf @ w.T
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype)
