"""Bad input gets a clear error, never a wrong answer or a hang."""
from __future__ import annotations

import copy

import pytest
import torch

from specdec.api import SpecDecoder
from specdec.cli import main
from specdec.hub import load_model, resolve
from specdec.verify import SamplingConfig
from tests.conftest import tiny_model


@pytest.fixture
def dec():
    return SpecDecoder(tiny_model("llama"), draft=tiny_model("llama", seed=1))


def test_empty_prompt(dec):
    with pytest.raises(ValueError, match="empty prompt"):
        dec.generate_ids([[]], "pld", 4)
    with pytest.raises(ValueError, match="no prompts"):
        dec.generate_ids([], "pld", 4)


def test_draft_with_other_vocabulary():
    with pytest.raises(ValueError, match="vocabulary"):
        SpecDecoder(tiny_model("llama"), draft=tiny_model("llama", vocab=128))


def test_prompt_longer_than_context(dec):
    with pytest.raises(ValueError, match="context too long"):
        dec.generate_ids([[5] * 600], "ar", 4)
    with pytest.raises(ValueError, match="context too long"):
        dec.generate_ids([[5] * 500], "sd", 20)  # prompt fits, prompt + new tokens does not


@pytest.mark.parametrize("n", [0, -3])
def test_max_new_tokens_must_be_positive(dec, n):
    with pytest.raises(ValueError, match="max_new_tokens"):
        dec.generate_ids([[5, 6]], "ar", n)


def test_unknown_method_and_options(dec):
    with pytest.raises(ValueError, match="unknown method"):
        dec.generate_ids([[5, 6]], "medusa", 4)
    with pytest.raises(ValueError, match="unknown options"):
        dec.generate_ids([[5, 6]], "sd", 4, draft_len=3)
    with pytest.raises(ValueError, match="unknown options for 'pld'"):
        dec.generate_ids([[5, 6]], "pld", 4, width=3)
    with pytest.raises(ValueError, match="takes: none"):
        dec.generate_ids([[5, 6]], "ar", 4, k=3)
    with pytest.raises(ValueError, match="must be one of"):
        dec.generate_ids([[5, 6]], "ngrammys", 4, strategy="magic")
    with pytest.raises(ValueError, match="must be int"):
        dec.generate_ids([[5, 6]], "pld", 4, num_tokens="many")
    with pytest.raises(ValueError, match="must be >= 1"):
        dec.generate_ids([[5, 6]], "pld", 4, num_tokens=0)


def test_sd_needs_a_draft():
    with pytest.raises(ValueError, match="needs a draft"):
        SpecDecoder(tiny_model("llama")).generate_ids([[5, 6]], "sd", 4)


def test_token_ids_out_of_vocabulary(dec):
    with pytest.raises(ValueError, match="token ids"):
        dec.generate_ids([[5, 96]], "ar", 4)


def test_unknown_model_and_dtype(tmp_path):
    with pytest.raises(ValueError, match="unknown model"):
        resolve("no-such-model")
    with pytest.raises(ValueError, match="unknown model"):
        resolve(str(tmp_path))  # a folder without a model
    with pytest.raises(ValueError, match="dtype"):
        load_model("smollm2", dtype="int3")


def test_nan_logits_raise():
    broken = copy.deepcopy(tiny_model("qwen2"))
    with torch.no_grad():
        broken.get_output_embeddings().weight[3, 0] = float("nan")
    dec = SpecDecoder(broken)
    for method in ("ar", "pld"):
        with pytest.raises(FloatingPointError, match="NaN"):
            dec.generate_ids([[5, 6, 7]], method, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_check_logits_finds_any_nan(dtype):
    """check_logits reads each row's maximum: a NaN anywhere, next to -inf or not, must still be found."""
    from specdec.verify import check_logits

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 97, generator=gen).to(dtype)
    logits[0, 1, 3], logits[1, 4, 0], logits[1, 2, 96] = float("-inf"), float("-inf"), float("-inf")
    logits[0, 3, :-1] = float("-inf")
    check_logits(logits)  # masked tokens are no error while a row keeps one finite logit
    check_logits(logits[:, 0])
    for b, t, v in [(0, 0, 0), (1, 4, 96), (0, 1, 50), (0, 3, 7), (1, 2, 95)]:
        broken = logits.clone()
        broken[b, t, v] = float("nan")
        with pytest.raises(FloatingPointError, match="NaN"):
            check_logits(broken)
        with pytest.raises(FloatingPointError, match="NaN"):
            check_logits(broken[:, t])
    # A real vocabulary's width, where the reduction runs vectorised and in parallel chunks.
    wide = torch.randn(1, 6, 49152, generator=gen).to(dtype)
    wide[0, 2, 100] = float("-inf")
    check_logits(wide)
    for t, v in [(0, 0), (5, 49151), (2, 101), (3, 24577), (4, 49147)]:
        broken = wide.clone()
        broken[0, t, v] = float("nan")
        with pytest.raises(FloatingPointError, match="NaN"):
            check_logits(broken)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_check_logits_refuses_rows_without_a_token(dtype):
    """+inf (no distribution, no single argmax) and a row that is all -inf (nothing can follow) raise."""
    from specdec.verify import check_logits

    logits = torch.randn(2, 4, 50).to(dtype)
    plus = logits.clone()
    plus[1, 2, 7] = float("inf")
    with pytest.raises(FloatingPointError, match=r"\+inf"):
        check_logits(plus)
    dead = logits.clone()
    dead[0, 3, :] = float("-inf")
    with pytest.raises(FloatingPointError, match="all -inf"):
        check_logits(dead)
    with pytest.raises(FloatingPointError, match="the draft X produced"):
        check_logits(dead[:, 3], "the draft X")


def broken_draft(target):
    """A copy of ``target`` whose logit of token 3 is NaN at every position."""
    draft = copy.deepcopy(target)
    with torch.no_grad():
        draft.get_output_embeddings().weight[3, 0] = float("nan")
    return draft


@pytest.mark.parametrize("method,opts", [("sd", {"draft_length": 3}), ("gsd", {}), ("ouroboros", {}), ("pearl", {})])
@pytest.mark.parametrize("greedy", [True, False])
def test_nan_draft_logits_raise(method, opts, greedy):
    """A draft's NaN logits are an error naming the draft: a sampled draft's probabilities divide the target's,
    and even a greedy draft's argmax over NaN means nothing."""
    target = tiny_model("llama")
    dec = SpecDecoder(target, draft=broken_draft(target))
    sampling = SamplingConfig() if greedy else SamplingConfig(temperature=1.0, seed=0)
    try:  # pearl's draft runs in a worker process: its error comes back with its type
        with pytest.raises(FloatingPointError, match="the draft .* NaN"):
            dec.generate_ids([[5, 6, 7]], method, 8, sampling, **opts)
    finally:
        dec.close()


def short_draft(positions: int = 32):
    """A GPT-2 draft (learned position embeddings) of the tiny models' vocabulary with only ``positions``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_embd=32, n_layer=1, n_head=2, n_positions=positions, vocab_size=96, bos_token_id=0,
                     eos_token_id=1, pad_token_id=0)
    torch.manual_seed(3)
    return GPT2LMHeadModel._from_config(cfg, attn_implementation="sdpa", dtype=torch.float32).eval()


# Static schedules without the governor: whether a cost planner or the governor finds a draft worth its measured
# time on a tiny model depends on the machine's timings, and this test checks positions, not costs.
@pytest.mark.parametrize("method,opts", [("sd", {"draft_length": 3, "govern": 0}),
                                         ("gsd", {"schedule": "static", "govern": 0}),
                                         ("ouroboros", {"schedule": "static", "govern": 0})])
def test_draft_shorter_context_than_target_stops_drafting(method, opts):
    """Past the draft's own max_position_embeddings the draft drafts nothing and decoding goes on as ar, with the
    target's own tokens (a GPT-2 draft fed a position past its table would raise an IndexError)."""
    target = tiny_model("llama")
    dec = SpecDecoder(target, draft=short_draft(32))
    prompt = list(range(2, 12))  # 10 tokens: the draft has room for a few steps, then none
    ref = dec.generate_ids([prompt], "ar", 40).tokens[0]
    out = dec.generate_ids([prompt], method, 40, **opts)
    assert out.tokens[0] == ref
    assert out.stats.drafted_tokens > 0  # it drafted while it had room


def test_pearl_refuses_a_context_past_its_draft():
    """PEARL's draft runs ahead for the whole generation: a context past the draft's positions is refused."""
    target = tiny_model("llama")
    dec = SpecDecoder(target, draft=short_draft(32))
    with pytest.raises(ValueError, match="context too long for pearl's draft"):
        dec.generate_ids([list(range(2, 12))], "pearl", 40)
    out = dec.generate_ids([list(range(2, 8))], "pearl", 12)  # within the draft's positions: decodes as usual
    assert out.tokens[0] == dec.generate_ids([list(range(2, 8))], "ar", 12).tokens[0]


@pytest.mark.parametrize("kwargs", [dict(temperature=-1.0), dict(temperature=float("nan")), dict(temperature=1.0, top_p=0.0),
                                    dict(temperature=1.0, top_k=-2)])
def test_bad_sampling_settings(kwargs):
    with pytest.raises(ValueError):
        SamplingConfig(**kwargs)


def test_cli_reports_errors_without_traceback(capsys):
    assert main(["generate", "--model", "no-such-model", "--prompt", "hi"]) == 2
    assert "unknown model" in capsys.readouterr().err


def test_encoder_decoder_model_is_unsupported(tmp_path):
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=64, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8)
    T5ForConditionalGeneration(cfg).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="unsupported model"):
        load_model(str(tmp_path))
