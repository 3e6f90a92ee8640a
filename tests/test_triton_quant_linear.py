"""The Triton linear layer over affine-coded weights (``specdec.triton_kernels.quant_linear``) against
its torch reference (:mod:`specdec.kernels.quant_reference`).

Like ``tests/test_triton_kernels.py``: in Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``,
also set by ``tests/conftest.py``), or on CUDA tensors with ``TRITON_INTERPRET=0`` and a GPU. Shapes are
small: the interpreter executes every program in Python.
"""
from __future__ import annotations

from tests.triton_device import triton_device  # noqa: I001  (before anything imports triton)

import pytest
import torch

from specdec.kernels import quant_reference as ref

DEVICE = triton_device()

from specdec.triton_kernels.quant_linear import quant_linear


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make_layer(n, k, bits, group, has_min, has_bias, dtype, seed):
    """Random codes, scales, minimums and bias (CPU tensors)."""
    g = gen(seed)
    if bits == 8:
        codes = torch.randint(-128, 128, (n, k), generator=g).to(torch.int8)
    else:
        codes = ref.pack_int4(torch.randint(0, 16, (n, k), generator=g))
    scale = torch.rand(n, k // group, generator=g) * 0.1 + 0.01
    minv = -8 * scale * (1 + 0.1 * torch.randn(n, k // group, generator=g)) if has_min else None
    bias = torch.randn(n, generator=g).to(dtype) if has_bias else None
    return codes, scale, minv, bias


def check(x, codes, scale, minv, bits, group, bias, num_splits=None):
    want = ref.quant_linear(x, codes, scale, minv, bits, group, bias)
    dev = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    got = quant_linear(dev(x), dev(codes), dev(scale), dev(minv), bits, group, dev(bias), num_splits=num_splits)
    assert got.shape == want.shape and got.dtype == x.dtype and got.device.type == DEVICE
    w = ref.quant_linear_dequantize(codes, scale, minv, bits, group)
    mag = float((x.float().abs() @ w.abs().T).max()) if x.numel() and w.numel() else 1.0
    rtol = 1e-5 if x.dtype == torch.float32 else 1e-2  # bf16/fp16: one rounding of the output apart
    torch.testing.assert_close(got.cpu().float(), want.float(), rtol=rtol, atol=1e-5 * max(mag, 1.0))
    return got


# (M, N, K, minv, bias): M = 1, 3, 6 take the GEMV path (M <= 8; tiles of 1, 4, 8 rows), M = 12, 33 the tl.dot path
# (one tile of 16 or 64 rows, some past the edge); N = 17, 50 leave partial output tiles; K = 96 leaves a partial
# last K step on some paths.
CASES = [(1, 17, 32, True, False), (3, 50, 96, False, True), (33, 17, 96, True, True), (1, 50, 96, False, False),
         (33, 50, 32, False, True), (3, 17, 32, True, True), (6, 17, 96, True, True), (12, 50, 32, True, False)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [16, 32])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_quant_linear_matches_reference(case, bits, group, dtype):
    m, n, k, has_min, has_bias = CASES[case]
    seed = 1000 * case + 10 * bits + group
    codes, scale, minv, bias = make_layer(n, k, bits, group, has_min, has_bias, dtype, seed)
    x = torch.randn(m, k, generator=gen(seed + 1)).to(dtype)
    check(x, codes, scale, minv, bits, group, bias)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m,splits", [(3, 3), (33, 2)])
def test_quant_linear_split_k(bits, m, splits):
    """K split over several programs; their partial sums (and the bias) added by the second kernel."""
    n, k, group = 19, 192, 32
    codes, scale, minv, bias = make_layer(n, k, bits, group, True, True, torch.float32, 7 * m + bits)
    x = torch.randn(m, k, generator=gen(m))
    check(x, codes, scale, minv, bits, group, bias, num_splits=splits)


def test_quant_linear_fp16_and_strided_x():
    """fp16 activations, and an ``x`` that is a non-contiguous view."""
    n, k, group = 20, 64, 16
    codes, scale, minv, bias = make_layer(n, k, 4, group, True, True, torch.float16, 3)
    big = torch.randn(2 * k, 5, generator=gen(4)).to(torch.float16)
    check(big[::2].T, codes, scale, minv, 4, group, bias)  # [5, K] with strides (1, 10)
    codes8, scale8, _, _ = make_layer(n, k, 8, group, False, False, torch.float32, 5)
    check(torch.randn(2 * k, 12, generator=gen(6))[::2].T, codes8, scale8, None, 8, group, None)


@pytest.mark.parametrize("m", [3, 16])  # the GEMV and the tl.dot path
def test_quant_linear_nibble_order(m):
    """Byte j of a 4-bit row holds code 2j in its low nibble and code 2j + 1 in its high nibble."""
    k = 32
    # Row 0: codes 0, 1, 2, ..., 15, 0, 1, ...; row 1: 15, 14, ...
    want_codes = torch.stack([torch.arange(k) % 16, 15 - torch.arange(k) % 16])
    packed = torch.tensor([[16 * (2 * j + 1) + 2 * j for j in range(8)] * 2,
                           [16 * (14 - 2 * j) + 15 - 2 * j for j in range(8)] * 2], dtype=torch.uint8)
    assert torch.equal(ref.pack_int4(want_codes), packed)
    assert torch.equal(ref.unpack_int4(packed), want_codes.to(torch.int32))
    scale = torch.ones(2, k // 16)
    cols = torch.tensor([1, 6, 11, 16, 17, 30, 31, 0, 2, 3, 4, 5, 7, 8, 9, 10])[:m]
    x = torch.eye(k)[cols]  # row i picks column cols[i]
    want = torch.stack([cols % 16, 15 - cols % 16], 1).float()
    assert torch.equal(ref.quant_linear(x, packed, scale, None, 4, 16), want)
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    assert torch.equal(quant_linear(dev(x), dev(packed), dev(scale), None, 4, 16).cpu(), want)
    # With a minimum per group: W = code * scale + min (code 2j + 1 of group 1 is the high nibble).
    minv = torch.tensor([[0.5, -100.0], [2.0, 3.0]])
    scale2 = torch.tensor([[1.0, 2.0], [0.25, 4.0]])
    grp = cols // 16
    want2 = torch.stack([(cols % 16) * scale2[0, grp] + minv[0, grp],
                         (15 - cols % 16) * scale2[1, grp] + minv[1, grp]], 1).float()
    assert torch.equal(ref.quant_linear(x, packed, scale2, minv, 4, 16), want2)
    assert torch.equal(quant_linear(dev(x), dev(packed), dev(scale2), dev(minv), 4, 16).cpu(), want2)


def test_quant_linear_8bit_signed_codes():
    """int8 codes are signed: -128 and 127 dequantize as such."""
    codes = torch.tensor([[-128, 127, -1, 0] * 4], dtype=torch.int8)
    scale, minv = torch.tensor([[0.5]]), torch.tensor([[1.0]])
    x = torch.eye(16)[:4]
    want = torch.tensor([[-63.0], [64.5], [0.5], [1.0]])
    assert torch.equal(ref.quant_linear(x, codes, scale, minv, 8, 16), want)
    assert torch.equal(quant_linear(x.to(DEVICE), codes.to(DEVICE), scale.to(DEVICE), minv.to(DEVICE), 8, 16).cpu(),
                       want)


def test_quant_linear_empty_and_errors():
    codes, scale, _, _ = make_layer(4, 32, 8, 16, False, False, torch.float32, 0)
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    assert quant_linear(dev(torch.zeros(0, 32)), dev(codes), dev(scale), None, 8, 16).shape == (0, 4)
    x = dev(torch.zeros(2, 32))
    with pytest.raises(ValueError, match="bits"):
        quant_linear(x, dev(codes), dev(scale), None, 3, 16)
    with pytest.raises(ValueError, match="group"):
        quant_linear(x, dev(codes), dev(scale), None, 8, 64)
    with pytest.raises(ValueError, match="codes"):
        quant_linear(x, dev(codes.to(torch.uint8)), dev(scale), None, 8, 16)
    with pytest.raises(ValueError, match="codes"):
        quant_linear(x, dev(codes.to(torch.uint8)), dev(scale), None, 4, 16)  # [N, K] bytes for 4 bits
    with pytest.raises(ValueError, match="scale"):
        quant_linear(x, dev(codes), dev(scale[:, :1]), None, 8, 16)
    with pytest.raises(ValueError, match="multiple"):
        quant_linear(dev(torch.zeros(2, 24)), dev(codes[:, :24]), dev(scale), None, 8, 16)
    with pytest.raises(ValueError, match="bias"):
        quant_linear(x, dev(codes), dev(scale), None, 8, 16, dev(torch.zeros(4, dtype=torch.float16)))
