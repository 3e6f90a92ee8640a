"""specdec.kernels.skinny_linear / packed_linear and the SkinnyLinear swap: accuracy, batch invariance,
layout, losslessness."""
from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from specdec.api import SpecDecoder, hf_generate
from specdec.kernels import has_native, pack_linear_weight, packed_linear, reference, skinny_linear
from specdec.linear import cpu_has_bf16_dot, cpu_has_half_gemm, SkinnyLinear, apply_linear_kernel, use_skinny_linear
from specdec.verify import SamplingConfig
from tests.conftest import tiny_model

native = pytest.mark.skipif(not has_native("skinny_linear"), reason="specdec._C is not built")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _linear(kernel: str, x, w, b, backend: str = "cpp"):
    """``x . w^T + b`` through skinny_linear, or packed_linear over ``w`` packed."""
    if kernel == "skinny":
        return skinny_linear(x, w, b, backend=backend)
    return packed_linear(x, pack_linear_weight(w), w.shape[0], b, backend=backend)


@native
@pytest.mark.parametrize("kernel", ["skinny", "packed"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k,n", [(1, 64, 32), (2, 77, 5), (3, 8, 17), (5, 8, 1), (4, 200, 48), (7, 31, 64),
                                   (8, 40, 40), (9, 200, 33), (16, 576, 130), (13, 19, 33), (40, 31, 7)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_reference(kernel, dtype, m, k, n, bias):
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    y = _linear(kernel, x, w, b)
    ref = reference.skinny_linear(x, w, b)
    assert y.dtype == dtype and y.shape == (m, n)
    scale = ref.float().abs().max().clamp_min(1.0)
    assert ((y.float() - ref.float()).abs().max() / scale) < TOL[dtype]
    torch.testing.assert_close(_linear(kernel, x, w, b, backend="torch"), ref, atol=0, rtol=0)


@native
@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_invariant(dtype):
    """Every row of an M-row call equals, bit for bit, the row computed alone or in any other batch."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(13, 203, generator=g).to(dtype)
    w = torch.randn(67, 203, generator=g).to(dtype)
    b = torch.randn(67, generator=g).to(dtype)
    full = skinny_linear(x, w, b, backend="cpp")
    for i in range(13):
        assert torch.equal(skinny_linear(x[i:i + 1], w, b, backend="cpp")[0], full[i])
    for lo, hi in [(0, 2), (3, 6), (5, 12), (2, 13)]:
        assert torch.equal(skinny_linear(x[lo:hi], w, b, backend="cpp"), full[lo:hi])


@native
def test_leading_dims_and_threads():
    x = torch.randn(2, 3, 48)
    w = torch.randn(70, 48)
    y = skinny_linear(x, w)
    assert y.shape == (2, 3, 70)
    torch.testing.assert_close(y, x @ w.T, atol=1e-4, rtol=1e-4)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = skinny_linear(x, w)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, y)  # the split over weight rows does not change any sum


@pytest.mark.parametrize("backend", ["torch", pytest.param("cpp", marks=native)])
def test_bad_input(backend):
    w = torch.randn(4, 8)
    with pytest.raises(ValueError, match="share one dtype"):
        skinny_linear(torch.randn(2, 8, dtype=torch.bfloat16), w, backend=backend)
    with pytest.raises(ValueError, match="must be"):
        skinny_linear(torch.randn(2, 7), w, backend=backend)
    with pytest.raises(ValueError, match="supports fp32/bf16/fp16"):
        skinny_linear(torch.randn(2, 8, dtype=torch.float64), w.double(), backend=backend)
    with pytest.raises(ValueError, match="bias"):
        skinny_linear(torch.randn(2, 8), w, torch.randn(5), backend=backend)


@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_layout(dtype):
    """Panels of 16 columns, k-major, zero past N; bf16 interleaves the two halves of a panel."""
    w = torch.arange(35 * 3, dtype=torch.float32).view(35, 3).to(dtype)
    packed = pack_linear_weight(w)
    assert packed.shape == (3, 3, 16) and packed.dtype == dtype
    second = w[8] if dtype == torch.bfloat16 else w[1]  # slot 1 of panel 0
    assert torch.equal(packed[0, :, 0], w[0]) and torch.equal(packed[0, :, 1], second)
    assert torch.equal(packed[2, :, 0], w[32])
    cols = 32 + reference.panel_columns(dtype)  # weight column held by each slot of panel 2
    assert cols.tolist()[:4] == ([32, 40, 33, 41] if dtype == torch.bfloat16 else [32, 33, 34, 35])
    assert not packed[2, :, cols >= 35].any() and packed[2, :, cols < 35].all()  # zero past N = 35
    assert torch.equal(reference.unpack_linear_weight(packed, 35), w)


@native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,n", [(203, 150), (96, 50), (17, 4100)])  # (17, 4100): enough panels to split over threads
def test_packed_batch_invariant(dtype, k, n):
    """Every row of an M-row call equals, bit for bit, the row alone, in any other batch (any row
    blocking: the fp32 path's 1, 2, 3-6, 6 + 1 and 6 + 2 over panel pairs (odd panel counts too), the bf16
    pair-dot path's four panels up to 4 rows and two past that, and several blocks) and with one thread or two."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(20, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    packed = pack_linear_weight(w)
    full = packed_linear(x, packed, n, b, backend="cpp")
    for i in range(20):
        assert torch.equal(packed_linear(x[i:i + 1], packed, n, b, backend="cpp")[0], full[i])
    for lo, hi in [(0, 2), (0, 4), (0, 5), (3, 6), (5, 12), (2, 13), (1, 9), (4, 20), (12, 20)]:
        assert torch.equal(packed_linear(x[lo:hi], packed, n, b, backend="cpp"), full[lo:hi])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(packed_linear(x, packed, n, b, backend="cpp"), full)
        assert torch.equal(packed_linear(x[:1], packed, n, b, backend="cpp"), full[:1])
    finally:
        torch.set_num_threads(threads)


@native
@pytest.mark.skipif(not cpu_has_bf16_dot(),
                    reason="the bf16 pair-dot path needs a CPU with AVX-512-BF16")
def test_bf16_dot_path_agrees_with_fp32_path(tmp_path):
    """The pair-dot path (this process) and the fp32 path (a process with SPECDEC_BF16_DOT=0, read once per
    process) give the same products up to fp32 summation order, odd K and a bias included."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(11, 203, generator=g).to(torch.bfloat16)
    w = torch.randn(70, 203, generator=g).to(torch.bfloat16)
    b = torch.randn(70, generator=g).to(torch.bfloat16)
    torch.save((x, w, b), tmp_path / "in.pt")
    code = ("import sys, torch; from specdec.kernels import pack_linear_weight, packed_linear; "
            "x, w, b = torch.load(sys.argv[1]); "
            "torch.save(packed_linear(x, pack_linear_weight(w), w.shape[0], b, backend='cpp'), sys.argv[2])")
    env = {**os.environ, "SPECDEC_BF16_DOT": "0"}
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")], env=env,
                   check=True)
    fp32_path = torch.load(tmp_path / "out.pt")
    dot = packed_linear(x, pack_linear_weight(w), 70, b, backend="cpp")
    torch.testing.assert_close(dot.float(), fp32_path.float(), atol=0.05, rtol=0.02)
    ref = (x.float() @ w.float().T + b.float()).to(torch.bfloat16)
    torch.testing.assert_close(dot.float(), ref.float(), atol=0.05, rtol=0.02)


@native
@pytest.mark.parametrize("kernel", ["skinny", "packed"])
def test_empty_dims(kernel):
    """K = 0 gives the bias; M = 0 and N = 0 give empty results."""
    b = torch.randn(5)
    torch.testing.assert_close(_linear(kernel, torch.randn(3, 0), torch.randn(5, 0), b), b.expand(3, 5))
    assert _linear(kernel, torch.randn(0, 8), torch.randn(5, 8), b).shape == (0, 5)
    assert _linear(kernel, torch.randn(2, 8), torch.randn(0, 8), None).shape == (2, 0)
    bf = torch.bfloat16  # the bf16 pair-dot path where the CPU has AVX-512-BF16
    torch.testing.assert_close(_linear(kernel, torch.randn(3, 0, dtype=bf), torch.randn(5, 0, dtype=bf), b.to(bf)),
                               b.to(bf).expand(3, 5))


@pytest.mark.parametrize("backend", ["torch", pytest.param("cpp", marks=native)])
def test_packed_bad_input(backend):
    w = torch.randn(20, 8)
    packed = pack_linear_weight(w)
    with pytest.raises(ValueError, match="share one dtype"):
        packed_linear(torch.randn(2, 8, dtype=torch.bfloat16), packed, 20, backend=backend)
    with pytest.raises(ValueError, match="must be"):
        packed_linear(torch.randn(2, 7), packed, 20, backend=backend)
    with pytest.raises(ValueError, match="does not fit"):
        packed_linear(torch.randn(2, 8), packed, 40, backend=backend)
    with pytest.raises(ValueError, match="packed must be"):
        packed_linear(torch.randn(2, 8), w, 20, backend=backend)
    with pytest.raises(ValueError, match="bias"):
        packed_linear(torch.randn(2, 8), packed, 20, torch.randn(5), backend=backend)
    with pytest.raises(ValueError, match="supports fp32/bf16/fp16"):
        pack_linear_weight(w.double())


@native
def test_module_prepacked_follows_weight_changes():
    """The packed copy is rebuilt when the weight changes in place, is replaced, loaded or converted,
    and after repack() for changes through ``.data``; it is not pickled or deep-copied."""
    torch.manual_seed(0)
    lin = nn.Linear(40, 24)
    sk = SkinnyLinear.from_linear(lin, max_rows=8, prepack=True)
    x = torch.randn(3, 40)

    def expect():
        return nn.functional.linear(x.to(sk.weight.dtype).float(), sk.weight.float(), sk.bias.float()).to(sk.weight.dtype)

    with torch.no_grad():
        assert torch.equal(sk(x), packed_linear(x, pack_linear_weight(lin.weight), 24, lin.bias))
        lin.weight.mul_(-2.0)  # shared Parameter, updated in place
        torch.testing.assert_close(sk(x), expect())
        sk.load_state_dict({"weight": torch.randn(24, 40), "bias": torch.zeros(24)})
        torch.testing.assert_close(sk(x), expect())
        sk.weight.data.mul_(3.0)  # invisible to the version counter
        sk.repack()
        torch.testing.assert_close(sk(x), expect())
        sk.to(torch.bfloat16)  # the bf16 panel layout differs from fp32's: a converted copy would be wrong
        torch.testing.assert_close(sk(x.bfloat16()), expect())
        sk.to(torch.float16).to(torch.float32)  # the new fp32 weight may land at the old address
        torch.testing.assert_close(sk(x), expect(), atol=1e-5, rtol=1e-5)
        clone = copy.deepcopy(sk)
        assert clone._packed is None and sk._packed is not None
        torch.testing.assert_close(clone(x), sk(x))


@native
def test_prepack_inference_tensors():
    """Weights created under inference_mode (no version counter) are packed and used."""
    with torch.inference_mode():
        lin = nn.Linear(32, 20)
        sk = SkinnyLinear.from_linear(lin, max_rows=8, prepack=True)
        x = torch.randn(2, 32)
        torch.testing.assert_close(sk(x), nn.functional.linear(x, lin.weight, lin.bias))


def test_swap_keeps_parameters_and_ties():
    model = copy.deepcopy(tiny_model("llama"))
    keys = list(model.state_dict())
    linears = sum(type(m) is nn.Linear for m in model.modules())
    model.config.tie_word_embeddings = True
    model.tie_weights()
    assert use_skinny_linear(model) == linears
    assert list(model.state_dict()) == keys
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    with pytest.raises(ValueError, match="unknown linear kernel"):
        apply_linear_kernel(model, "fast", "cpu")


@native
def test_module_routes_by_rows_and_grad():
    lin = nn.Linear(24, 10)
    sk = SkinnyLinear.from_linear(lin, max_rows=4)
    x = torch.randn(3, 24)
    with torch.no_grad():
        assert torch.equal(sk(x), skinny_linear(x, lin.weight, lin.bias))  # 3 rows: the kernel
        torch.testing.assert_close(sk(torch.randn(6, 24)).shape, torch.Size([6, 10]))  # 6 rows: nn.Linear
    y = sk(x)  # weights require grad: nn.Linear, so backward works
    y.sum().backward()
    assert lin.weight.grad is not None and lin.weight.grad.shape == (10, 24)


@native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_module_widens_half_precision_prefill(dtype):
    """Half-precision products over more than max_rows rows take the fp32 GEMM when ``widen`` is set
    (one rounding at the end, so within one output ulp of torch's own kernel), and torch's kernel when not."""
    torch.manual_seed(0)
    lin = nn.Linear(48, 20).to(dtype)
    x = torch.randn(2, 9, 48).to(dtype)
    expect = nn.functional.linear(x.float(), lin.weight.float(), lin.bias.float()).to(dtype)
    assert SkinnyLinear.from_linear(lin, max_rows=4).widen == (not cpu_has_half_gemm(dtype))
    with torch.no_grad():
        widened = SkinnyLinear.from_linear(lin, max_rows=4, widen=True)(x)
        plain = SkinnyLinear.from_linear(lin, max_rows=4, widen=False)(x)
        assert widened.dtype == dtype and widened.shape == (2, 9, 20)
        assert torch.equal(widened, expect)
        assert torch.equal(plain, lin(x))
        torch.testing.assert_close(widened, plain)
        few = x[0, :3]  # at most max_rows rows: the skinny kernel whatever ``widen`` says
        assert torch.equal(SkinnyLinear.from_linear(lin, max_rows=4, widen=True)(few), skinny_linear(few, lin.weight, lin.bias))


@native
@pytest.mark.parametrize("prepack", [False, True], ids=["skinny", "packed"])
@pytest.mark.parametrize("method,opts", [("pld", {}), ("ngrammys", {}), ("sd", {"draft_length": 4})])
def test_lossless_with_skinny(arch, method, opts, prepack):
    """Greedy decoding on a target whose linear layers run the skinny (or packed) kernel equals
    transformers' generate on that same model, and (decisive tiny models) on the unmodified model too."""
    stock = tiny_model(arch)
    target = copy.deepcopy(stock)
    use_skinny_linear(target, prepack=prepack)
    draft = copy.deepcopy(tiny_model(arch, seed=1))
    use_skinny_linear(draft, prepack=prepack)
    dec = SpecDecoder(target, draft=draft)
    g = torch.Generator().manual_seed(3)
    for plen in (1, 9, 30):
        prompt = torch.randint(2, 96, (plen,), generator=g).tolist()
        ref = hf_generate(target, prompt, 40, SamplingConfig())
        out = dec.generate_ids([prompt], method, 40, SamplingConfig(), **opts)
        assert out.tokens[0] == ref
        assert hf_generate(stock, prompt, 40, SamplingConfig()) == ref


@native
@pytest.mark.parametrize("cpu,auto,packed", [
    ("amx", 8, 64),             # AMX tiles and AVX-512-BF16 (Sapphire Rapids): auto hands over past 8 rows
    ("avx512-bf16", 1024, 1024),  # AVX-512-BF16 without tiles (Zen 4): the kernel's pair dot products win to 1024
    ("avx512-bf16, dot off", 64, 64),  # the same CPU with SPECDEC_BF16_DOT=0: the fp32 path's limits
    ("avx2", 256, 256),         # no bf16 instructions: torch's bf16 GEMM is a slow fallback
])
def test_auto_limits_packed_rows_by_cpu(cpu, auto, packed, monkeypatch):
    """Where ``--linear auto`` and ``packed`` hand bf16 products to torch's GEMM, per CPU kind (measured: the
    docstrings of specdec.linear)."""
    import specdec.linear as linear_mod

    bf16 = lambda dtype: dtype == torch.bfloat16  # noqa: E731
    monkeypatch.setattr(linear_mod, "cpu_has_matrix_tiles", lambda dtype: cpu == "amx" and bf16(dtype))
    monkeypatch.setattr(linear_mod, "cpu_has_half_gemm", lambda dtype: cpu != "avx2" and bf16(dtype))
    monkeypatch.setattr(linear_mod, "cpu_has_bf16_dot", lambda: cpu in ("amx", "avx512-bf16"))
    limits = {}
    for kernel in ("auto", "packed"):
        model = copy.deepcopy(tiny_model("llama")).to(torch.bfloat16)
        apply_linear_kernel(model, kernel, "cpu")
        limits[kernel] = {m.max_rows for m in model.modules() if isinstance(m, SkinnyLinear)}
    assert limits == {"auto": {auto}, "packed": {packed}}
    fp32 = copy.deepcopy(tiny_model("llama"))
    apply_linear_kernel(fp32, "auto", "cpu")  # fp32 keeps the batch-invariant kernel: the identity tests rely on it
    assert {m.max_rows for m in fp32.modules() if isinstance(m, SkinnyLinear)} == {linear_mod.default_max_rows(torch.float32, True, False)}
