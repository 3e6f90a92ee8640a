"""specdec distill: the reduced-vocabulary draft class, the pipeline on a tiny target, the shipped draft."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import PreTrainedTokenizerFast

import specdec
from specdec.api import SpecDecoder, hf_generate
from specdec.cli import main as cli_main
from specdec.draft_models.reduced import SpecdecDraftForCausalLM, draft_from_target
from specdec.distill.vocab import count_tokens, coverage, select_vocab
from specdec.hub import load_model, resolve
from specdec.verify import SamplingConfig
from tests.conftest import tiny_model

VOCAB = 96
DRAFT_VOCAB = torch.tensor([1, 2, 3, 5, 8, 13, 21, 34, 40, 41, 42, 43, 44, 50, 55, 60, 70, 80, 89, 95])


def tiny_draft(seed: int = 0) -> SpecdecDraftForCausalLM:
    torch.manual_seed(seed)
    return draft_from_target(tiny_model("llama", VOCAB, 0, 0.3), [1], DRAFT_VOCAB)


def test_vocab_map_round_trips_and_unknown_ids_go_to_unk():
    d = tiny_draft()
    vd = len(DRAFT_VOCAB)
    assert d.draft_vocab.tolist() == sorted(DRAFT_VOCAB.tolist())
    assert torch.equal(d.target_to_draft[d.draft_vocab], torch.arange(vd))  # draft -> target -> draft
    outside = torch.tensor(sorted(set(range(VOCAB)) - set(DRAFT_VOCAB.tolist())))
    assert (d.target_to_draft[outside] == vd).all()  # the UNK slot
    with pytest.raises(ValueError):
        d.set_vocab(torch.tensor([1, 1] + list(range(2, vd))))


def test_select_vocab_keeps_frequent_ids_and_forced_ones():
    counts = count_tokens([torch.tensor([5, 5, 5, 7, 7, 9]), torch.tensor([3])], 12)
    vocab = select_vocab(counts, 3, {11})
    assert vocab.tolist() == [5, 7, 11]
    assert coverage(counts, vocab) == pytest.approx(5 / 7)


def test_full_logits_are_minus_inf_outside_the_draft_vocab_and_reduced_mode_matches():
    d = tiny_draft()
    ids = torch.randint(0, VOCAB, (2, 7))
    with torch.no_grad():
        full = d(input_ids=ids).logits
        with d.reduced_logits():
            red = d(input_ids=ids).logits
    assert full.shape == (2, 7, VOCAB) and red.shape == (2, 7, len(DRAFT_VOCAB))
    assert torch.equal(full[..., d.draft_vocab], red)
    mask = torch.ones(VOCAB, dtype=torch.bool)
    mask[d.draft_vocab] = False
    assert torch.isinf(full[..., mask]).all()
    assert d.get_output_embeddings().weight.shape[0] == VOCAB  # same-vocabulary checks see the target width


def test_all_vocab_single_layer_copy_equals_target_layers():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=True, initializer_range=0.3)
    torch.manual_seed(0)
    target = LlamaForCausalLM(cfg).eval()
    d = draft_from_target(target, [0, 1], torch.arange(VOCAB))
    ids = torch.randint(0, VOCAB, (1, 9))
    with torch.no_grad():
        assert torch.allclose(d(input_ids=ids).logits, target(input_ids=ids).logits, atol=1e-5)


def test_reduced_vocab_draft_as_transformers_assistant_is_lossless():
    target, d = tiny_model("llama", VOCAB, 0, 0.3), tiny_draft()
    for prompt in ([3, 4, 5, 6], [10, 20, 30, 40, 50, 2, 7]):
        plain = hf_generate(target, prompt, 24, SamplingConfig())
        assert hf_generate(target, prompt, 24, SamplingConfig(), assistant_model=d) == plain


def check_sd_ragged(target, draft, prompts: list[list[int]], temperature: float) -> None:
    """sd over a ragged batch: drafts are made, tokens are in range, greedy equals transformers."""
    dec = SpecDecoder(target, draft=draft)
    res = dec.generate_ids(prompts, "sd", 20, SamplingConfig(temperature, seed=1), draft_length=3)
    assert res.stats.drafted_tokens > 0
    for p, toks in zip(prompts, res.tokens):
        assert all(0 <= t < VOCAB for t in toks)
        if temperature == 0:
            assert toks == hf_generate(target, p, 20, SamplingConfig())


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_sd_with_reduced_vocab_draft(temperature):
    check_sd_ragged(tiny_model("llama", VOCAB, 0, 0.3), tiny_draft(), [[3, 4, 5, 6], [10, 20, 30, 40, 50, 2, 7]],
                    temperature)


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="t0", pad_token="t0", eos_token="t1")


def test_distill_end_to_end_on_a_tiny_target(tmp_path):
    target = tiny_model("llama", VOCAB, 0, 0.3)
    tdir, out, work = tmp_path / "target", tmp_path / "draft", tmp_path / "work"
    target.save_pretrained(tdir)
    _tiny_tokenizer().save_pretrained(tdir)
    g = torch.Generator().manual_seed(0)
    rows = [{"id": f"p{i}", "category": "c" + str(i % 2), "chat": False,
             "prompt": " ".join(f"t{int(t)}" for t in torch.randint(2, VOCAB, (int(torch.randint(3, 9, (1,), generator=g)),),
                                                                      generator=g))} for i in range(12)]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["distill", "--target", str(tdir), "--prompts", str(prompts), "--out", str(out), "--work", str(work),
            "--gen-dtype", "fp32", "--gen-tokens", "12", "--batch-size", "4", "--top-k", "4", "--layers", "1",
            "--draft-vocab", "40", "--max-tokens", "64", "--held-out", "0.2", "--seed", "0"]
    assert cli_main(args + ["--steps", "6"]) == 0
    summary = json.loads((out / "distill_summary.json").read_text())
    assert summary["steps"] == 6 and summary["positions"]["greedy"] > 0 and "held_out" in summary
    assert sorted(p.name.split("_")[0] for p in (work / "data").glob("*.pt")) == ["greedy"] * 3 + ["prompt"] * 3 + ["sample0"] * 3
    draft, tok = load_model(str(out))
    assert isinstance(draft, SpecdecDraftForCausalLM) and draft.draft_vocab.numel() == 40
    assert tok.get_vocab() == _tiny_tokenizer().get_vocab()
    # Resuming a finished run keeps its step count; more steps continue from the checkpoint.
    assert cli_main(args + ["--steps", "8", "--resume"]) == 0
    assert json.loads((out / "distill_summary.json").read_text())["steps"] == 8
    dec = SpecDecoder(target, draft=draft)
    p = [5, 6, 7, 8]
    assert dec.generate_ids([p], "sd", 16).tokens[0] == hf_generate(target, p, 16, SamplingConfig())


SHIPPED_PROMPTS = [
    "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox",
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that returns the sum of a list of numbers.",
]


SHIPPED_DRAFTS = ["smollm2-draft", "smollm2-eagle"]


@pytest.mark.parametrize("name", SHIPPED_DRAFTS)
def test_shipped_draft_is_small_and_resolves(name):
    path = resolve(name)
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    assert size <= 25_000_000, size


@pytest.mark.parametrize("name", SHIPPED_DRAFTS)
def test_shipped_draft_borrows_its_targets_tokenizer(name):
    from specdec.hub import tokenizer_path

    assert not (resolve(name) / "tokenizer.json").exists()  # shipped without one, to stay small
    assert tokenizer_path(resolve(name)) == resolve("smollm2")
    _, tok = load_model(name, "fp32")
    _, target_tok = load_model("smollm2", "fp32")
    assert tok.get_vocab() == target_tok.get_vocab() and tok.chat_template == target_tok.chat_template


@pytest.mark.parametrize("name", SHIPPED_DRAFTS)
@pytest.mark.parametrize("prompt", SHIPPED_PROMPTS)
def test_sd_with_shipped_draft_is_lossless_on_embedded_model(prompt, name):
    out = specdec.generate(prompt, method="sd", draft=name, max_new_tokens=32)
    model, tok = load_model("smollm2", "fp32")
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, return_dict=True)["input_ids"]
    assert out.tokens == hf_generate(model, list(ids), 32, SamplingConfig())
    assert out.stats.drafted_tokens > 0
