"""GGUF quantized blocks as affine codes: ``W[n, k] = code[n, k] * scale[n, g] + min[n, g]``, ``g = k // group``.

Every block type a shipped model uses decodes to this one form, exactly: the dense fp32 weight that
transformers (through ``gguf.quants.dequantize``) builds from the same blocks equals
``code * scale + min`` computed in fp32, bit for bit. For every type here ``code * scale`` is exact in
fp32 whenever a min is present (an fp16 or fp16-times-6-bit scale times a code of at most 5 bits), so a
fused multiply-add ``fma(code, scale, min)`` rounds like the reference's multiply-then-add, and the
kernels may use either. (tests/test_gguf_blocks.py and tests/test_quant_linear.py check every decoder
against ``gguf`` itself.) The one exception to bit for bit is the sign of a zero: Q4_0 (4-bit codes with min
``-8d``) gives +0.0 where ``gguf``'s ``d * (q - 8)`` gives -0.0 (``d < 0``, ``q = 8``); the values are equal.

Types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (blocks of 32, one fp16 scale each) and the K-quants Q4_K, Q5_K (256-weight
super-blocks, a scale ``fp32(d * sc)`` and min ``-fp32(dmin * m)`` per 32) and Q6_K (a scale ``fp32(d * sc)``
per 16, no min) -- every quantized type of Gemma-3-270M's Q4_K_M file (Q5_0, Q8_0, Q4_K, Q6_K) among them.

Codes are stored 4 bits wide (``bits=4``: codes 0..15) or 8 bits wide (``bits=8``: signed codes; 5- and
6-bit codes are widened to 8). ``scale_fp16`` says that every scale and min is an exact fp16 value, so
kernels may store them in 2 bytes (Q4_1, Q5_0, Q5_1, Q8_0; Q4_0 unless some ``|d| > 8188``, where ``-8d``
overflows fp16) instead of 4 (the K-quants' ``d * sc``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch


@dataclass
class AffineCodes:
    """One weight as affine codes.

    codes: ``[N, K]`` int8; scale: ``[N, K // group]`` fp32; minv: same shape or None (zero);
    bits: 4 or 8 (storage width of a code); group: 16 or 32; scale_fp16: scales and mins are exact fp16 values;
    qtype: the GGUF block type they came from.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    minv: torch.Tensor | None
    bits: int
    group: int
    scale_fp16: bool
    qtype: str

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        """The dense weight ``[N, K]`` fp32 (``code * scale`` then ``+ min``, as ``gguf`` computes it)."""
        n, k = self.codes.shape
        w = self.codes.float().view(n, k // self.group, self.group) * self.scale[..., None]
        if self.minv is not None:
            w = w + self.minv[..., None]
        return w.view(n, k)

    def rows(self, index: torch.Tensor) -> "AffineCodes":
        """The same codes with rows reordered: row ``i`` of the result is row ``index[i]``."""
        return AffineCodes(self.codes[index], self.scale[index], None if self.minv is None else self.minv[index],
                           self.bits, self.group, self.scale_fp16, self.qtype)


def _f16(raw: np.ndarray) -> torch.Tensor:
    """``[..., 2]`` uint8 little-endian fp16 bytes -> fp32 tensor ``[...]``."""
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32))


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """``[..., B]`` bytes -> ``[..., 2B]`` codes: the B low nibbles, then the B high nibbles (ggml's order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q4_1(blocks: np.ndarray) -> AffineCodes:
    # block of 32: d (fp16), m (fp16), qs[16]
    n, nb = blocks.shape[:2]
    codes = _nibbles(blocks[..., 4:20]).reshape(n, nb * 32)
    return AffineCodes(torch.from_numpy(codes.astype(np.int8)), _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4]),
                       4, 32, True, "Q4_1")


def _q8_0(blocks: np.ndarray) -> AffineCodes:
    # block of 32: d (fp16), qs[32] int8
    n, nb = blocks.shape[:2]
    codes = np.ascontiguousarray(blocks[..., 2:34]).view(np.int8).reshape(n, nb * 32)
    return AffineCodes(torch.from_numpy(codes.copy()), _f16(blocks[..., 0:2]), None, 8, 32, True, "Q8_0")


def _nibble_pairs(qs: np.ndarray, width: int) -> np.ndarray:
    """``[..., G * width]`` bytes -> ``[..., 2G, width]`` codes: per run of ``width`` bytes its low nibbles,
    then its high nibbles (the K-quants' order: 32 or 64 bytes give 2 x 32 or 2 x 64 codes)."""
    q = qs.reshape(*qs.shape[:-1], -1, 1, width) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)
    return (q & np.uint8(0x0F)).reshape(*qs.shape[:-1], -1, width)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """``[..., 4]`` bytes (a little-endian uint32) -> ``[..., 32]`` bits 0..31 as 0/1 uint8 (Q5_0, Q5_1)."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _q4_0(blocks: np.ndarray) -> AffineCodes:
    # block of 32: d (fp16), qs[16]; W = d * (q - 8), q the unsigned nibble.
    # Stored as 4-bit codes q with min -8d: d * q and -8d are exact in fp32 (an 11-bit fp16 significand times
    # at most 4 bits), and so is their sum d * (q - 8), so it rounds like gguf's product (fma or not). The one
    # difference: gguf's d * 0 is -0.0 when d < 0, ours +0.0 (equal as numbers). -8d is an fp16 value unless
    # |d| > 8188 (then scale_fp16 is False).
    n, nb = blocks.shape[:2]
    codes = _nibbles(blocks[..., 2:18]).reshape(n, nb * 32)
    d = _f16(blocks[..., 0:2])
    minv = d * -8.0
    f16 = bool(torch.equal(minv.half().float(), minv))
    return AffineCodes(torch.from_numpy(codes.astype(np.int8)), d, minv, 4, 32, f16, "Q4_0")


def _q5_0(blocks: np.ndarray) -> AffineCodes:
    # block of 32: d (fp16), qh (uint32: bit j is code j's 5th bit), qs[16]; W = d * (q - 16)
    n, nb = blocks.shape[:2]
    q = _nibbles(blocks[..., 6:22]) | (_high_bits(blocks[..., 2:6]) << np.uint8(4))
    codes = (q.astype(np.int8) - np.int8(16)).reshape(n, nb * 32)
    return AffineCodes(torch.from_numpy(codes), _f16(blocks[..., 0:2]), None, 8, 32, True, "Q5_0")


def _q5_1(blocks: np.ndarray) -> AffineCodes:
    # block of 32: d (fp16), m (fp16), qh (uint32), qs[16]; W = d * q + m, q in 0..31
    n, nb = blocks.shape[:2]
    q = _nibbles(blocks[..., 8:24]) | (_high_bits(blocks[..., 4:8]) << np.uint8(4))
    codes = q.astype(np.int8).reshape(n, nb * 32)
    return AffineCodes(torch.from_numpy(codes), _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4]), 8, 32, True, "Q5_1")


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K ``[..., 12]`` packed 6-bit scales and mins -> two ``[..., 8]`` uint8 (gguf's get_scale_min)."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([d & np.uint8(0x3F), (md & np.uint8(0x0F)) | ((d >> np.uint8(2)) & np.uint8(0x30))], axis=-1)
    mn = np.concatenate([m & np.uint8(0x3F), (md >> np.uint8(4)) | ((m >> np.uint8(2)) & np.uint8(0x30))], axis=-1)
    return sc, mn


def _k_affine(blocks: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K super-block header ``d, dmin, scales[12]`` -> scale ``fp32(d * sc)`` and min
    ``-fp32(dmin * m)``, ``[N, nb * 8]`` (one per 32 weights). Both products are exact (11 x 6 bits)."""
    n, nb = blocks.shape[:2]
    d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16).astype(np.float32)        # [N, nb, 1]
    dmin = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16).astype(np.float32)
    sc, mn = _k_scale_min(blocks[..., 4:16])
    scale = (d * sc.astype(np.float32)).reshape(n, nb * 8)
    minv = -(dmin * mn.astype(np.float32)).reshape(n, nb * 8)
    return torch.from_numpy(scale), torch.from_numpy(minv)


def _q4_k(blocks: np.ndarray) -> AffineCodes:
    # super-block of 256 = 8 x 32: d, dmin (fp16), scales[12] (6-bit sc, m), qs[128];
    # W = fp32(d * sc) * q - fp32(dmin * m), q in 0..15
    n, nb = blocks.shape[:2]
    scale, minv = _k_affine(blocks)
    codes = _nibble_pairs(blocks[..., 16:144], 32).reshape(n, nb * 256)
    return AffineCodes(torch.from_numpy(codes.astype(np.int8)), scale, minv, 4, 32, False, "Q4_K")


def _q5_k(blocks: np.ndarray) -> AffineCodes:
    # super-block of 256 = 8 x 32: d, dmin (fp16), scales[12], qh[32] (bit i of qh[j]: 5th bit of code j of
    # sub-block i), qs[128]; W = fp32(d * sc) * q - fp32(dmin * m), q in 0..31
    n, nb = blocks.shape[:2]
    scale, minv = _k_affine(blocks)
    ql = _nibble_pairs(blocks[..., 48:176], 32)                                           # [N, nb, 8, 32]
    qh = (blocks[..., None, 16:48] >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & np.uint8(1)
    codes = (ql | (qh << np.uint8(4))).astype(np.int8).reshape(n, nb * 256)
    return AffineCodes(torch.from_numpy(codes), scale, minv, 8, 32, False, "Q5_K")


def _q6_k(blocks: np.ndarray) -> AffineCodes:
    # super-block of 256 = 16 x 16: ql[128], qh[64], scales[16] int8, d (fp16); W = fp32(d * sc) * (q - 32)
    n, nb = blocks.shape[:2]
    ql = _nibble_pairs(blocks[..., 0:128], 64).reshape(n, nb, 8, 32)
    qh = blocks[..., 128:192].reshape(n, nb, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
    qh = (qh & np.uint8(0x03)).reshape(n, nb, 8, 32)
    codes = ((ql | (qh << np.uint8(4))).astype(np.int8) - np.int8(32)).reshape(n, nb * 256)
    sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32)       # [N, nb, 16]
    d = np.ascontiguousarray(blocks[..., 208:210]).view(np.float16).astype(np.float32)     # [N, nb, 1]
    scale = (d * sc).reshape(n, nb * 16)
    return AffineCodes(torch.from_numpy(codes), torch.from_numpy(scale), None, 8, 16, False, "Q6_K")


@dataclass(frozen=True)
class BlockType:
    block: int        # weights per block
    nbytes: int       # bytes per block
    decode: Callable[[np.ndarray], AffineCodes]  # [N, K // block, nbytes] uint8 -> AffineCodes


BLOCK_TYPES: dict[str, BlockType] = {
    "Q4_0": BlockType(32, 18, _q4_0),
    "Q4_1": BlockType(32, 20, _q4_1),
    "Q5_0": BlockType(32, 22, _q5_0),
    "Q5_1": BlockType(32, 24, _q5_1),
    "Q8_0": BlockType(32, 34, _q8_0),
    "Q4_K": BlockType(256, 144, _q4_k),
    "Q5_K": BlockType(256, 176, _q5_k),
    "Q6_K": BlockType(256, 210, _q6_k),
}


def decode_blocks(qtype: str, raw: np.ndarray, n: int, k: int) -> AffineCodes:
    """Decode one GGUF tensor's raw blocks.

    qtype: the GGML type name (``Q4_1``, ...); raw: its bytes, uint8, ``N * K / block * nbytes`` of them
    (any shape); n, k: the weight's ``[N, K]`` (GGUF lists dims the other way round, ``[K, N]``).
    """
    if qtype not in BLOCK_TYPES:
        raise ValueError(f"GGUF block type {qtype} is not supported for quantized weights "
                         f"(supported: {', '.join(BLOCK_TYPES)}); use --weights dense")
    bt = BLOCK_TYPES[qtype]
    if k % bt.block:
        raise ValueError(f"a {qtype} weight needs K a multiple of {bt.block}, got [{n}, {k}]")
    raw = np.asarray(raw, dtype=np.uint8).reshape(-1)
    if raw.size != n * (k // bt.block) * bt.nbytes:
        raise ValueError(f"{qtype} weight [{n}, {k}] needs {n * (k // bt.block) * bt.nbytes} bytes, got {raw.size}")
    return bt.decode(raw.reshape(n, k // bt.block, bt.nbytes))
