"""Drafts with 8-bit or 4-bit weights (draft_weights="q8" / "q4"): the codes, and output that stays the target's."""
from __future__ import annotations

import pytest
import torch

from specdec.api import SpecDecoder, hf_generate
from specdec.draft_weights import q4_codes, q8_codes, quantize_draft, round_weights
from specdec.gguf_weights import QuantLinear
from specdec.linear import weight_bytes
from specdec.verify import SamplingConfig
from tests.conftest import tiny_model
from tests.test_greedy_lossless import perturbed, prompt_of

GREEDY = SamplingConfig()


def test_q8_codes_round_to_nearest_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 96, generator=g) * torch.logspace(-3, 1, 96)
    w[3, :32] = 0.0  # an all-zero group: scale 0, codes 0
    ac = q8_codes(w)
    assert ac.codes.dtype == torch.int8 and int(ac.codes.abs().max()) <= 127
    assert torch.equal(ac.scale.half().float(), ac.scale)  # exact fp16 scales, as the kernel stores them
    assert int(ac.codes[3, :32].abs().max()) == 0 and float(ac.scale[3, 0]) == 0.0
    err = (ac.dequantize() - w).abs().view(40, 3, 32)
    assert bool((err <= ac.scale[..., None] / 2 * (1 + 1e-3) + 1e-12).all())
    with pytest.raises(ValueError, match="groups of 32"):
        q8_codes(torch.zeros(4, 40))


def test_q4_codes_round_to_nearest_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 96, generator=g) * torch.logspace(-3, 1, 96) + 0.3
    w[3, :32] = 0.25  # a constant group: scale 0, every weight its minimum
    ac = q4_codes(w)
    assert ac.codes.dtype == torch.int8 and int(ac.codes.min()) >= 0 and int(ac.codes.max()) <= 15
    assert ac.bits == 4 and ac.minv is not None
    assert torch.equal(ac.scale.half().float(), ac.scale) and torch.equal(ac.minv.half().float(), ac.minv)
    assert float(ac.scale[3, 0]) == 0.0 and torch.equal(ac.dequantize()[3, :32], w[3, :32])
    assert bool(((ac.codes.view(40, 3, 32).amax(-1) >= 14) | (ac.scale == 0)).all())  # the range is used
    err = (ac.dequantize() - w).abs().view(40, 3, 32)
    # Half a step, plus what rounding the minimum and the scale to fp16 moves the grid (2^-11 relative each).
    slack = 2.0**-10 * (ac.minv.abs() + 15 * ac.scale)
    assert bool((err <= (ac.scale / 2 + slack)[..., None] + 1e-12).all())
    with pytest.raises(ValueError, match="groups of 32"):
        q4_codes(torch.zeros(4, 40))


@pytest.mark.parametrize("kind, share", [("q8", 0.6), ("q4", 0.35)])
def test_quantized_draft_cuts_its_bytes_and_keeps_the_targets_output(kind, share):
    target = tiny_model("llama")
    dec = SpecDecoder(target, draft=perturbed(target, 0.6), draft_weights=kind)
    draft = dec.get_draft()[0]
    assert all(isinstance(m, QuantLinear) for m in draft.modules() if isinstance(m, torch.nn.Linear))
    assert {m.qweight.bits for m in draft.modules() if isinstance(m, QuantLinear)} == {8 if kind == "q8" else 4}
    assert not any(isinstance(m, QuantLinear) for m in target.modules())  # the target is never quantized
    dense = SpecDecoder(target, draft=perturbed(target, 0.6))
    assert weight_bytes(draft) < share * weight_bytes(dense.get_draft()[0])
    prompts = [prompt_of(9, seed=1), prompt_of(70, seed=2)]
    for method, opts in [("sd", {"draft_length": 4}), ("gsd", {}), ("ouroboros", {})]:
        out = dec.generate_ids(prompts, method, 30, GREEDY, **opts)
        assert out.tokens == [hf_generate(target, p, 30, GREEDY) for p in prompts], method
        assert out.stats.drafted_tokens > 0, method


def test_quantizing_the_target_as_its_own_draft_leaves_the_target_dense():
    target = tiny_model("llama")
    dec = SpecDecoder(target, draft=target, draft_weights="q8")
    assert dec.get_draft()[0] is not target and not any(isinstance(m, QuantLinear) for m in target.modules())
    prompt = prompt_of(12, seed=4)
    out = dec.generate_ids([prompt], "sd", 30, GREEDY, draft_length=5)
    assert out.tokens[0] == hf_generate(target, prompt, 30, GREEDY)
    assert out.stats.accepted_tokens > 0


def test_bad_draft_weights():
    target = tiny_model("llama")
    with pytest.raises(ValueError, match="draft_weights must be one of dense, q8, q4"):
        SpecDecoder(target, draft=target, draft_weights="q3")
    with pytest.raises(ValueError, match="no linear layers"):
        quantize_draft(torch.nn.Sequential(torch.nn.ReLU()))


@pytest.mark.parametrize("kind", ["q8", "q4"])
def test_rounded_weights_compute_what_the_quantized_draft_computes(kind):
    # What `specdec.distill.agreement --draft-weights` measures: a dense model on the codes' values gives the logits
    # a quantized draft's few-row forwards give (fp32, up to summation order), and a tied embedding stays dense.
    target = tiny_model("llama")
    quantized, rounded = perturbed(target, 0.6), perturbed(target, 0.6)
    for m in (quantized, rounded):  # tied, as the shipped drafts are (tie_word_embeddings)
        m.lm_head.weight = m.get_input_embeddings().weight
    embedding = rounded.get_input_embeddings().weight.detach().clone()
    quantize_draft(quantized, kind=kind)
    assert round_weights(rounded, kind) == sum(isinstance(m, QuantLinear) for m in quantized.modules())
    for m in (quantized, rounded):
        assert torch.equal(m.get_input_embeddings().weight, embedding)  # the embedding stays dense
    assert not torch.equal(rounded.lm_head.weight, embedding)  # the head reads the rounded copy
    assert round_weights(quantized, kind) == 0  # quantized layers are not rounded again
    ids = torch.tensor([prompt_of(6, seed=3)])
    with torch.inference_mode():
        a, b = quantized(ids).logits, rounded(ids).logits
    assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)
    dense = perturbed(target, 0.6)
    dense.lm_head.weight = dense.get_input_embeddings().weight
    assert not torch.allclose(b, dense(ids).logits, atol=1e-4, rtol=1e-4)  # the rounding shows
    with pytest.raises(ValueError, match="q3"):
        round_weights(rounded, "q3")


def test_the_cli_offers_every_draft_weights_kind(capsys):
    from specdec.cli import main
    from specdec.draft_weights import DRAFT_WEIGHTS

    with pytest.raises(SystemExit):
        main(["generate", "--draft-weights", "q3", "--prompt", "x"])
    err = capsys.readouterr().err
    assert "invalid choice: 'q3'" in err and all(f"'{k}'" in err for k in DRAFT_WEIGHTS)
