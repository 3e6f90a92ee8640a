"""Linear layers over quantized weights kept as stored: :class:`QuantWeight`, :func:`pack_quant_weight`,
:func:`quant_linear`.

A weight arrives as affine codes (:class:`specdec.gguf_blocks.AffineCodes`: ``W[n, k] = code * scale + min``
per group of 16 or 32 ``k``) and is repacked once, per device, into the layout its kernel streams:

- CPU (``csrc/quant_linear.cpp``): column panels of 16 output features, ``[ceil(N / 16), K / group, chunk]``
  uint8, each chunk one group of 16 columns: scales, mins, then the codes k-major (two 4-bit codes a byte,
  or one int8), so one kernel step reads 16 consecutive codes;
- CUDA (``kernels/quant_linear.py``, Triton): the planar codes (``[N, K]`` int8, or ``[N, K / 2]`` nibble
  pairs) with fp32 scales and mins ``[N, K / group]``.

The activations are never quantized: every weight is rebuilt in fp32 and the products accumulate in fp32,
so the result is the dense fp32 model's up to summation order, and (CPU) batch-invariant, unless a caller lets
bf16 products of many rows run on AMX tiles (``tile_rows``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specdec.gguf_blocks import AffineCodes
from specdec.kernels._dispatch import choose, native_ops, triton_kernels

PANEL = 16

# Rows from which bf16 products run faster on AMX tiles than on the vector kernel (csrc/quant_linear.cpp,
# isa_amx): all 211 weights of SmolLM2-135M, 2 threads, Xeon with AMX, ms, vector / tiles: 8.7 / 11.0 at 4 rows,
# 11.8 / 11.2 at 5, 14.2 / 12.2 at 8, 25.0 / 15.7 at 16 (bench/results/quant_tiles_amx.json).
TILE_ROWS = 5


def chunk_bytes(bits: int, group: int, has_min: bool, f16_scale: bool) -> int:
    """Bytes of one CPU chunk: 16 scales (and mins) plus 16 x ``group`` codes of ``bits`` bits."""
    return PANEL * (2 if f16_scale else 4) * (2 if has_min else 1) + PANEL * group * bits // 8


@dataclass
class QuantWeight:
    """A linear weight ``[n, k]`` as packed affine codes, for :func:`quant_linear`.

    packed: CPU ``[ceil(n / 16), k / group, chunk]`` uint8 (layout in ``csrc/quant_linear.cpp``), or for CUDA
    the planar ``codes`` with ``scale`` / ``minv`` (fp32 ``[n, k / group]``; ``minv`` None when zero).
    """

    n: int
    k: int
    bits: int
    group: int
    has_min: bool
    f16_scale: bool
    qtype: str
    packed: torch.Tensor | None = None
    codes: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    minv: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        return (self.packed if self.packed is not None else self.codes).device

    @property
    def nbytes(self) -> int:
        """Bytes a product reads of this weight."""
        if self.packed is not None:
            return self.packed.numel()
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.minv) if t is not None)

    def dequantize(self, backend: str | None = None) -> torch.Tensor:
        """The dense weight ``[n, k]`` fp32."""
        if self.packed is not None:
            if choose("quant_dequantize", self.packed.device, backend, ("cpu",)) == "native":
                return native_ops().quant_dequantize(self.packed, self.n, self.k, self.bits, self.group,
                                                     self.has_min, self.f16_scale)
            return _unpack_cpu(self).dequantize()
        from specdec.kernels.quant_reference import quant_linear_dequantize

        return quant_linear_dequantize(self.codes, self.scale, self.minv, self.bits, self.group)


def _planar_codes(ac: AffineCodes) -> torch.Tensor:
    if ac.bits == 8:
        return ac.codes.contiguous()
    c = ac.codes.to(torch.uint8)
    return (c[:, 0::2] | (c[:, 1::2] << 4)).contiguous()


def _pack_cpu(ac: AffineCodes) -> torch.Tensor:
    n, k = ac.shape
    g, groups, p = ac.group, k // ac.group, -(-n // PANEL)
    pad = p * PANEL - n
    if n == 0:  # a weight of no columns: no panels (the reshapes below cannot infer sizes from nothing)
        return torch.empty(0, groups, chunk_bytes(ac.bits, g, ac.minv is not None, ac.scale_fp16), dtype=torch.uint8)

    def params(t: torch.Tensor) -> torch.Tensor:  # [n, groups] -> [p, groups, 16 * bytes]
        t = torch.nn.functional.pad(t, (0, 0, 0, pad)).view(p, PANEL, groups).transpose(1, 2).contiguous()
        t = t.to(torch.float16) if ac.scale_fp16 else t.float()
        return t.view(torch.uint8).view(p, groups, -1)

    codes = torch.nn.functional.pad(ac.codes, (0, 0, 0, pad)).view(p, PANEL, groups, g).permute(0, 2, 3, 1)
    if ac.bits == 4:
        c = codes.to(torch.uint8)
        codes = c[:, :, 0::2] | (c[:, :, 1::2] << 4)  # [p, groups, g / 2, 16]
    codes = codes.contiguous().view(torch.uint8).reshape(p, groups, -1)
    parts = [params(ac.scale)] + ([params(ac.minv)] if ac.minv is not None else []) + [codes]
    return torch.cat(parts, dim=2).contiguous()


def _unpack_cpu(qw: QuantWeight) -> AffineCodes:
    """The torch reference of the CPU layout: :func:`_pack_cpu` inverted."""
    p, groups, g = qw.packed.shape[0], qw.k // qw.group, qw.group
    sb = 2 if qw.f16_scale else 4
    raw = qw.packed

    def params(off: int) -> torch.Tensor:  # -> [n, groups] fp32
        t = raw[:, :, off:off + PANEL * sb].contiguous().view(torch.float16 if qw.f16_scale else torch.float32)
        return t.float().transpose(1, 2).reshape(p * PANEL, groups)[:qw.n]

    scale = params(0)
    minv = params(PANEL * sb) if qw.has_min else None
    codes = raw[:, :, PANEL * sb * (2 if qw.has_min else 1):].contiguous()
    if qw.bits == 4:
        c = codes.view(p, groups, g // 2, PANEL)
        codes = torch.stack([c & 15, c >> 4], dim=3).view(p, groups, g, PANEL).to(torch.int8)
    else:
        codes = codes.view(torch.int8).view(p, groups, g, PANEL)
    codes = codes.permute(0, 3, 1, 2).reshape(p * PANEL, qw.k)[:qw.n]
    return AffineCodes(codes, scale, minv, qw.bits, g, qw.f16_scale, qw.qtype)


def pack_quant_weight(ac: AffineCodes, device: str | torch.device = "cpu") -> QuantWeight:
    """Repack affine codes once for :func:`quant_linear` on ``device`` (not a hot path).

    ac: a weight ``[N, K]`` (:class:`specdec.gguf_blocks.AffineCodes`: codes int8 ``[N, K]``, scale/min fp32
    ``[N, K / group]``). Returns a :class:`QuantWeight` on ``device``.
    """
    n, k = ac.shape
    if ac.bits not in (4, 8) or ac.group not in (16, 32) or k % ac.group:
        raise ValueError(f"unsupported affine codes: bits={ac.bits}, group={ac.group}, shape {list(ac.shape)}")
    if ac.bits == 4 and ac.codes.numel() and (int(ac.codes.min()) < 0 or int(ac.codes.max()) > 15):
        raise ValueError("4-bit codes must lie in 0..15")
    if ac.scale_fp16 and not all(torch.equal(t.half().float(), t) for t in (ac.scale, ac.minv) if t is not None):
        raise ValueError("scale_fp16 claimed but a scale or min is not an exact fp16 value")
    if ac.bits == 4 and ac.minv is None:  # the 4-bit kernels always add a min
        ac = AffineCodes(ac.codes, ac.scale, torch.zeros_like(ac.scale), 4, ac.group, ac.scale_fp16, ac.qtype)
    qw = QuantWeight(n, k, ac.bits, ac.group, ac.minv is not None, ac.scale_fp16, ac.qtype)
    device = torch.device(device)
    if device.type == "cpu":
        qw.packed = _pack_cpu(ac)
    else:
        qw.codes = _planar_codes(ac).to(device)
        qw.scale = ac.scale.float().contiguous().to(device)
        qw.minv = None if ac.minv is None else ac.minv.float().contiguous().to(device)
    return qw


def quant_linear(x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None = None,
                 backend: str | None = None, tile_rows: int = 0) -> torch.Tensor:
    """``x . W^T + bias`` with ``W`` kept as packed affine codes (:func:`pack_quant_weight`).

    Args:
        x: ``[..., K]`` fp32/bf16/fp16 (never quantized); weight: a :class:`QuantWeight` ``[N, K]`` on x's device;
        bias: ``[N]`` in x's dtype, or None. tile_rows: bf16 products of at least this many rows run on the CPU's
        AMX tiles where it has them (:data:`TILE_ROWS` is where they win); 0 (the default): never.
    Returns:
        ``[..., N]`` in x's dtype: fp32 products of x with the rebuilt weights, fp32 accumulation, one rounding.
        On the CPU batch-invariant: row ``m`` of an ``M``-row call equals the row computed alone, except that
        calls on tiles (bf16, ``M >= tile_rows``) sum in the tile unit's order, so they agree bit for bit with each
        other but not with calls of fewer rows.
    """
    if x.dim() < 1 or x.shape[-1] != weight.k:
        raise ValueError(f"x must be [..., K = {weight.k}], got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"quant_linear supports fp32/bf16/fp16 activations, got {x.dtype}")
    if bias is not None and (tuple(bias.shape) != (weight.n,) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be [N = {weight.n}] in x's dtype {x.dtype}")
    if x.device != weight.device:
        raise ValueError(f"x is on {x.device} but the weight is packed for {weight.device}")
    x2 = x.reshape(math.prod(x.shape[:-1]), weight.k)
    route = choose("quant_linear", x.device, backend, ("cpu",), triton=True)
    if route == "native" and weight.packed is not None:
        tiles = (tile_rows,) if tile_rows else ()  # an extension built before the argument still takes the call
        y = native_ops().quant_linear(x2, weight.packed, weight.n, weight.k, weight.bits, weight.group,
                                      weight.has_min, weight.f16_scale, bias, *tiles)
    elif route == "triton" and weight.codes is not None:
        y = triton_kernels("quant_linear").quant_linear(x2, weight.codes, weight.scale, weight.minv, weight.bits,
                                                        weight.group, bias)
    else:
        y = torch.nn.functional.linear(x2.float(), weight.dequantize("torch" if route == "torch" else None),
                                       None if bias is None else bias.float()).to(x.dtype)
    return y.view(*x.shape[:-1], weight.n)


def quant_linear_group(x: torch.Tensor, weights: list[QuantWeight],
                       biases: list[torch.Tensor | None] | None = None, tile_rows: int = 0) -> list[torch.Tensor]:
    """``[x . W_i^T + b_i]`` for several weights over one x, in one call of the CPU kernel where the weights share
    a format (bits, group, scale type, min) and are packed for the CPU; otherwise one :func:`quant_linear` each.

    Args:
        x: ``[..., K]`` fp32/bf16/fp16; weights: :class:`QuantWeight` ``[N_i, K]`` on x's device; biases: ``[N_i]``
        in x's dtype or None, one per weight (default: none); tile_rows: as :func:`quant_linear`'s.
    Returns:
        ``[..., N_i]`` per weight, each equal bit for bit to ``quant_linear(x, weights[i], biases[i], tile_rows=...)``
        (column slices of the op's one ``[M, sum N_i]`` output where the native kernel ran, so not contiguous).
    """
    biases = [None] * len(weights) if biases is None else list(biases)
    if len(biases) != len(weights):
        raise ValueError(f"{len(weights)} weights but {len(biases)} biases")
    if not weights:
        return []
    w0 = weights[0]
    same = all((w.k, w.bits, w.group, w.has_min, w.f16_scale) == (w0.k, w0.bits, w0.group, w0.has_min, w0.f16_scale)
               and w.packed is not None for w in weights)
    if not (same and x.is_cpu and native_ops() is not None and hasattr(native_ops(), "quant_linear_group")):
        return [quant_linear(x, w, b, tile_rows=tile_rows) for w, b in zip(weights, biases)]
    for w, b in zip(weights, biases):  # the single call's checks, per weight
        if x.dim() < 1 or x.shape[-1] != w.k:
            raise ValueError(f"x must be [..., K = {w.k}], got shape {tuple(x.shape)}")
        if b is not None and (tuple(b.shape) != (w.n,) or b.dtype != x.dtype):
            raise ValueError(f"bias must be [N = {w.n}] in x's dtype {x.dtype}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"quant_linear supports fp32/bf16/fp16 activations, got {x.dtype}")
    x2 = x.reshape(math.prod(x.shape[:-1]), w0.k)
    y = native_ops().quant_linear_group(x2, [w.packed for w in weights], [w.n for w in weights], w0.k, w0.bits,
                                        w0.group, w0.has_min, w0.f16_scale, biases,
                                        *((tile_rows,) if tile_rows else ()))
    return [part.view(*x.shape[:-1], w.n) for part, w in zip(y.split([w.n for w in weights], dim=1), weights)]
