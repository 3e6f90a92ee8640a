"""The quantized-weight linear kernel (csrc/quant_linear.cpp) against its reference (dequantize, then an fp32
matmul), the CPU layout against its torch inverse, and the GGUF decoders against ``gguf`` itself."""
from __future__ import annotations

import itertools

import gguf
import numpy as np
import pytest
import torch

from specdec.gguf_blocks import AffineCodes, decode_blocks
from specdec.kernels import has_native
from specdec.kernels.quant import QuantWeight, _unpack_cpu, pack_quant_weight, quant_linear, quant_linear_group

pytestmark = pytest.mark.skipif(not has_native("quant_linear"), reason="needs the compiled extension")

# (bits, group, has_min, scale_fp16): every format the shipped models' block types decode to.
FORMATS = [(4, 32, True, True), (8, 32, False, True), (4, 32, True, False), (8, 16, False, False),
           (8, 32, True, True), (4, 16, False, True), (8, 32, True, False)]


def random_codes(n: int, k: int, bits: int, group: int, has_min: bool, f16: bool, seed: int = 0) -> AffineCodes:
    g = torch.Generator().manual_seed(seed)
    lo, hi = (0, 16) if bits == 4 else (-128, 128)
    codes = torch.randint(lo, hi, (n, k), generator=g, dtype=torch.int32).to(torch.int8)
    scale = torch.rand(n, k // group, generator=g) * 0.02 + 1e-3
    minv = -(torch.rand(n, k // group, generator=g) * 0.1) if has_min else None
    if f16:
        scale = scale.half().float()
        minv = None if minv is None else minv.half().float()
    elif has_min:  # K-quant-like: scales with a few more mantissa bits than fp16 (d * 6-bit sc), exact products
        scale = scale.half().float() * torch.randint(1, 64, scale.shape, generator=g).float()
    return AffineCodes(codes, scale, minv, bits, group, f16, "test")


def reference(x: torch.Tensor, ac: AffineCodes, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ ac.dequantize().double().T
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k", [(17, 32), (50, 96), (64, 160), (3, 64)])
def test_layout_roundtrip_and_dequantize(fmt, n, k):
    bits, group, has_min, f16 = fmt
    if k % group:
        pytest.skip("K not a multiple of the group")
    ac = random_codes(n, k, *fmt)
    qw = pack_quant_weight(ac)
    back = _unpack_cpu(qw)
    assert torch.equal(back.codes, ac.codes) and torch.equal(back.scale, ac.scale)
    if ac.minv is not None:
        assert torch.equal(back.minv, ac.minv)
    else:  # 4-bit codes are stored with a zero min, 8-bit ones without
        assert back.minv is None if bits == 8 else torch.equal(back.minv, torch.zeros_like(ac.scale))
    assert torch.equal(qw.dequantize(), ac.dequantize())  # native unpacking, bit for bit
    assert torch.equal(qw.dequantize("torch"), ac.dequantize())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 9, 17, 33, 130])
def test_matches_dequantize_then_matmul(fmt, dtype, m):
    n, k = 50, 96 if fmt[1] == 32 else 80
    ac = random_codes(n, k, *fmt, seed=m)
    qw = pack_quant_weight(ac)
    torch.manual_seed(m)
    x = torch.randn(m, k).to(dtype)
    bias = torch.randn(n).to(dtype)
    for b in (None, bias):
        y = quant_linear(x, qw, b)
        assert y.dtype == dtype and y.shape == (m, n)
        ref = reference(x.float(), ac, None if b is None else b.float())
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(y.double(), ref.to(dtype).double(), rtol=tol, atol=tol * ref.abs().max().item())
        # the torch backend is the same product
        torch.testing.assert_close(quant_linear(x, qw, b, backend="torch").double(), y.double(), rtol=tol,
                                   atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("fmt", FORMATS[:4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_batch_invariant(fmt, dtype):
    """A row's result does not depend on the rows that share the call, bit for bit: alone, with a bias, and side by
    side with another weight in one grouped call (each product writing its columns of one output). 70 columns: an
    odd number of 16-column panels, so blocks of two panels end on a single one."""
    n, k = 70, 128
    ac = random_codes(n, k, *fmt)
    qw = pack_quant_weight(ac)
    x = torch.randn(40, k).to(dtype)
    b = torch.randn(n).to(dtype)
    alone = torch.cat([quant_linear(x[i:i + 1], qw) for i in range(40)])
    alone_b = torch.cat([quant_linear(x[i:i + 1], qw, b) for i in range(40)])
    grouped = torch.cat([torch.cat(quant_linear_group(x[i:i + 1], [qw, qw], [b, None]), 1) for i in range(40)])
    for m in (2, 3, 4, 6, 7, 8, 9, 16, 40):
        assert torch.equal(quant_linear(x[:m], qw), alone[:m]), m
        assert torch.equal(quant_linear(x[:m], qw, b), alone_b[:m]), m
        assert torch.equal(torch.cat(quant_linear_group(x[:m], [qw, qw], [b, None]), 1), grouped[:m]), m
    assert torch.equal(grouped[:, :n], alone_b) and torch.equal(grouped[:, n:], alone)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [5, 16, 21, 40])
def test_tile_products_match_dequantize_then_matmul(fmt, m):
    """bf16 products on AMX tiles (tile_rows; the vector kernel where the CPU has no tiles): the same product as
    the reference, to bf16's rounding, biases included, over row tiles of 16 and a short last one."""
    n, k = 50, 96 if fmt[1] == 32 else 80
    ac = random_codes(n, k, *fmt, seed=m)
    qw = pack_quant_weight(ac)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g).bfloat16()
    for b in (None, torch.randn(n, generator=g).bfloat16()):
        y = quant_linear(x, qw, b, tile_rows=5)
        ref = reference(x.float(), ac, None if b is None else b.float())
        assert y.dtype == torch.bfloat16 and y.shape == (m, n)
        torch.testing.assert_close(y.double(), ref.bfloat16().double(), rtol=1e-2, atol=1e-2 * ref.abs().max().item())


@pytest.mark.parametrize("fmt", FORMATS[:4])
def test_tile_calls_are_batch_invariant_among_themselves(fmt):
    """A row of a call on tiles does not depend on the rows that share it: rows 5..12 of a 40-row call equal the
    same rows in an 8-row call and in a 21-row one (row tiles of 16 cut them differently), bit for bit."""
    ac = random_codes(70, 128, *fmt)
    qw = pack_quant_weight(ac)
    x = torch.randn(40, 128, generator=torch.Generator().manual_seed(1)).bfloat16()
    full = quant_linear(x, qw, tile_rows=5)
    assert torch.equal(quant_linear(x[5:13], qw, tile_rows=5), full[5:13])
    assert torch.equal(quant_linear(x[:21], qw, tile_rows=5), full[:21])


def tile_sensitive_input() -> tuple[torch.Tensor, QuantWeight]:
    """Five rows of x = (1, 2^-30, -1, 0, ...) against codes of 1: summed in order in fp32 (the vector kernel) the
    2^-30 is lost. The tile unit keeps it: observed on a Sapphire Rapids Xeon, not documented (Intel's pseudo-code
    rounds each product into fp32 in k order, which would lose it too)."""
    codes = torch.zeros(16, 32, dtype=torch.int8)
    codes[:, :3] = 1
    qw = pack_quant_weight(AffineCodes(codes, torch.ones(16, 1), torch.zeros(16, 1), 4, 32, True, "test"))
    x = torch.zeros(5, 32)
    x[:, :3] = torch.tensor([1.0, 2.0 ** -30, -1.0])
    return x.bfloat16(), qw


def test_tiles_run_only_where_asked(monkeypatch):
    """tile_rows = 0, fewer rows than tile_rows, fp32 x or SPECDEC_AMX=0 keep the vector kernel (batch-invariant
    with one-row calls); on a CPU with AMX tiles a bf16 call of tile_rows rows or more takes them."""
    from specdec.linear import cpu_has_matrix_tiles

    monkeypatch.delenv("SPECDEC_AMX", raising=False)
    x, qw = tile_sensitive_input()
    vector = quant_linear(x[:1], qw)[0, 0].item()
    assert vector == 0.0
    assert quant_linear(x, qw)[0, 0].item() == vector
    assert quant_linear(x, qw, tile_rows=6)[0, 0].item() == vector
    assert quant_linear(x.float(), qw, tile_rows=1)[0, 0].item() == 0.0
    tiles = quant_linear(x, qw, tile_rows=5)[0, 0].item()
    assert tiles == (2.0 ** -30 if cpu_has_matrix_tiles(torch.bfloat16) else vector)
    monkeypatch.setenv("SPECDEC_AMX", "0")
    assert quant_linear(x, qw, tile_rows=5)[0, 0].item() == vector


def test_tile_products_split_over_many_tasks():
    """A weight of 300 panels runs as several tasks of the thread pool, each starting its own double buffer at its
    first panel: every output still matches the reference, and equals the same rows in a call of other rows."""
    ac = random_codes(16 * 300 - 5, 64, 4, 32, True, True, seed=3)
    qw = pack_quant_weight(ac)
    x = torch.randn(20, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    y = quant_linear(x, qw, tile_rows=5)
    ref = reference(x.float(), ac, None)
    torch.testing.assert_close(y.double(), ref.bfloat16().double(), rtol=1e-2, atol=1e-2 * ref.abs().max().item())
    assert torch.equal(quant_linear(x[3:9], qw, tile_rows=5), y[3:9])


def test_a_quant_linear_passes_its_tile_rows(monkeypatch):
    """QuantLinear hands its tile_rows to the kernel: on an AMX CPU its products of 5 rows round as tile calls."""
    from specdec.gguf_weights import QuantLinear
    from specdec.linear import cpu_has_matrix_tiles

    monkeypatch.delenv("SPECDEC_AMX", raising=False)
    x, qw = tile_sensitive_input()
    dense = torch.nn.Linear(32, 16, bias=False).bfloat16()
    for tiles in (0, 5):
        lin = QuantLinear.from_quant(dense, qw, max_rows=64, widen_prompts=False, tile_rows=tiles)
        with torch.no_grad():
            want = quant_linear(x, qw, tile_rows=tiles)
            assert torch.equal(lin(x), want)
            assert torch.equal(lin(x.view(1, 5, 32)), want.view(1, 5, 16))
            assert lin(x)[0, 0].item() == (2.0 ** -30 if tiles and cpu_has_matrix_tiles(torch.bfloat16) else 0.0)


def test_fp32_weights_are_the_dense_weights_exactly():
    """One-hot rows of x read single weights: each must be the dense fp32 value (code * scale + min), exactly."""
    for fmt in FORMATS:
        ac = random_codes(20, 64 if fmt[1] == 32 else 32, *fmt)
        qw = pack_quant_weight(ac)
        k = ac.shape[1]
        assert torch.equal(quant_linear(torch.eye(k), qw), ac.dequantize().T), fmt


def test_nibble_order_by_hand():
    codes = torch.zeros(1, 32, dtype=torch.int8)
    codes[0, 1] = 15  # the high nibble of the first byte
    codes[0, 30] = 2
    ac = AffineCodes(codes, torch.ones(1, 1), torch.full((1, 1), 0.5), 4, 32, True, "test")
    x = torch.zeros(1, 32)
    x[0, 1], x[0, 30] = 1.0, 10.0
    # sum_k x_k (code_k + 0.5) = 15.5 + 10 * 2.5
    assert quant_linear(x, pack_quant_weight(ac)).item() == 15.5 + 25.0


def test_bad_input_is_refused():
    qw = pack_quant_weight(random_codes(16, 32, 4, 32, True, True))
    with pytest.raises(ValueError, match="K = 32"):
        quant_linear(torch.randn(2, 31), qw)
    with pytest.raises(ValueError, match="activations"):
        quant_linear(torch.randn(2, 32).double(), qw)
    with pytest.raises(ValueError, match="bias"):
        quant_linear(torch.randn(2, 32), qw, torch.randn(15))
    with pytest.raises(RuntimeError, match="packed must be"):
        torch.ops.specdec.quant_linear(torch.randn(2, 32), qw.packed[:, :, :-1], 16, 32, 4, 32, True, True, None)
    with pytest.raises(ValueError, match="0..15"):
        pack_quant_weight(AffineCodes(torch.full((1, 32), 16, dtype=torch.int8), torch.ones(1, 1), None, 4, 32, True, "t"))
    with pytest.raises(ValueError, match="fp16"):
        pack_quant_weight(AffineCodes(torch.zeros(1, 32, dtype=torch.int8), torch.full((1, 1), 0.1), None, 8, 32, True, "t"))


def test_empty_rows():
    qw = pack_quant_weight(random_codes(16, 32, 8, 32, False, True))
    assert quant_linear(torch.randn(0, 32), qw).shape == (0, 16)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_decoders_match_gguf(qtype):
    """Blocks quantized by ``gguf`` itself decode to exactly its dequantization."""
    qt = gguf.GGMLQuantizationType[qtype]
    try:
        from specdec.gguf_blocks import BLOCK_TYPES
    except ImportError:  # pragma: no cover
        raise
    if qtype not in BLOCK_TYPES:
        pytest.skip(f"{qtype} not decoded")
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((24, 96)) * 0.05).astype(np.float32)
    raw = gguf.quantize(w, qt)
    ac = decode_blocks(qtype, raw, 24, 96)
    assert torch.equal(ac.dequantize(), torch.from_numpy(gguf.dequantize(raw, qt).reshape(24, 96)))
    x = torch.randn(3, 96)
    torch.testing.assert_close(quant_linear(x, pack_quant_weight(ac)), x @ ac.dequantize().T, rtol=1e-5, atol=1e-5)


def test_fuzz_shapes():
    rng = np.random.default_rng(1)
    for _ in range(25):
        fmt = FORMATS[rng.integers(len(FORMATS))]
        n = int(rng.integers(1, 70))
        k = fmt[1] * int(rng.integers(1, 6))
        m = int(rng.integers(1, 70))
        dtype = [torch.float32, torch.bfloat16, torch.float16][rng.integers(3)]
        ac = random_codes(n, k, *fmt, seed=int(rng.integers(1000)))
        x = torch.randn(m, k).to(dtype)
        y = quant_linear(x, pack_quant_weight(ac))
        ref = reference(x.float(), ac, None)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(y.double(), ref.to(dtype).double(), rtol=tol, atol=tol * (ref.abs().max().item() + 1))


@pytest.mark.parametrize("fmt", FORMATS[:4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 9, 40])
def test_group_equals_the_separate_calls(fmt, dtype, m):
    """One grouped call (a layer's q, k, v) returns each weight's separate product bit for bit, biases included."""
    from specdec.kernels.quant import quant_linear_group

    k = fmt[1] * 5
    weights = [pack_quant_weight(random_codes(n, k, *fmt, seed=n)) for n in (70, 16, 3, 33)]
    g = torch.Generator().manual_seed(m)
    biases = [None, torch.randn(16, generator=g).to(dtype), None, torch.randn(33, generator=g).to(dtype)]
    x = torch.randn(2, m, k, generator=g).to(dtype)
    for tile_rows in (0, 5):
        ys = quant_linear_group(x, weights, biases, tile_rows=tile_rows)
        assert len(ys) == 4
        for y, w, b in zip(ys, weights, biases):
            assert y.shape == (2, m, w.n) and y.dtype == dtype
            assert torch.equal(y, quant_linear(x, w, b, tile_rows=tile_rows))


def test_group_mixed_formats_and_bad_input():
    """Weights of different formats fall back to separate calls; the op refuses lists that do not match."""
    from specdec.kernels.quant import quant_linear_group

    a, b = pack_quant_weight(random_codes(16, 64, 4, 32, True, True)), pack_quant_weight(random_codes(8, 64, 8, 32, False, True))
    x = torch.randn(3, 64)
    for y, w in zip(quant_linear_group(x, [a, b]), (a, b)):
        assert torch.equal(y, quant_linear(x, w))
    assert quant_linear_group(x, []) == []
    with pytest.raises(ValueError, match="biases"):
        quant_linear_group(x, [a, a], [None])
    with pytest.raises(ValueError, match="K = 64"):
        quant_linear_group(torch.randn(3, 32), [a, a])
    with pytest.raises(RuntimeError, match="one each per weight"):
        torch.ops.specdec.quant_linear_group(x, [a.packed, a.packed], [16], 64, 4, 32, True, True, [None, None])
    with pytest.raises(RuntimeError, match="packed must be"):
        torch.ops.specdec.quant_linear_group(x, [a.packed, b.packed], [16, 8], 64, 4, 32, True, True, [None, None])
    assert torch.ops.specdec.quant_linear_group(torch.randn(0, 64), [a.packed], [16], 64, 4, 32, True, True,
                                                [None]).shape == (0, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_group_op_puts_the_outputs_side_by_side(dtype):
    """The raw op returns one [M, sum n] tensor, weight i's columns after those of the weights before it (one tensor
    so that inductor's C++ wrapper can call it without Python), each block the weight's own product bit for bit; a
    weight of no columns takes none."""
    ws = [pack_quant_weight(random_codes(n, 64, 4, 32, True, True, seed=n)) for n in (20, 0, 33)]
    x = torch.randn(5, 64).to(dtype)
    bias = torch.randn(33).to(dtype)
    y = torch.ops.specdec.quant_linear_group(x, [w.packed for w in ws], [20, 0, 33], 64, 4, 32, True, True,
                                             [None, None, bias])
    assert y.shape == (5, 53) and y.dtype == dtype
    assert torch.equal(y, torch.cat([quant_linear(x, ws[0]), quant_linear(x, ws[2], bias)], dim=1))
