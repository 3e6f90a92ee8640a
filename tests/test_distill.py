"""specdec distill: the reduced-vocabulary draft class, the pipeline on a tiny target, the shipped draft."""
from __future__ import annotations

import json

import numpy as np
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


def _tiny_target(tmp_path, chat: bool = False):
    target = tiny_model("llama", VOCAB, 0, 0.3)
    tdir = tmp_path / "target"
    target.save_pretrained(tdir)
    tok = _tiny_tokenizer()
    if chat:  # a template whose user text starts after "t2 t3" and ends with EOS (t1)
        tok.chat_template = ("{% for m in messages %}t2 t3 {{ m['content'] }} t1 {% endfor %}"
                             "{% if add_generation_prompt %}t4 {% endif %}")
    tok.save_pretrained(tdir)
    return target, tdir


def _prompt_file(tmp_path, n: int = 12, name: str = "p.jsonl", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rows = [{"id": f"p{i}", "category": "c" + str(i % 2), "chat": False,
             "prompt": " ".join(f"t{int(t)}" for t in torch.randint(2, VOCAB, (int(torch.randint(3, 9, (1,), generator=g)),),
                                                                      generator=g))} for i in range(n)]
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("arch", ["layers", "eagle"])
def test_distill_end_to_end_on_a_tiny_target(tmp_path, arch):
    from specdec.distill.corpus import Corpus

    target, tdir = _tiny_target(tmp_path)
    out, work, corpus = tmp_path / "draft", tmp_path / "work", tmp_path / "corpus"
    prompts = _prompt_file(tmp_path)
    assert cli_main(["corpus", "--target", str(tdir), "--out", str(corpus), "--prompts", str(prompts),
                     "--samples", "1", "--gen-dtype", "fp32", "--gen-tokens", "12", "--batch-size", "4",
                     "--shard-prompts", "5"]) == 0
    c = Corpus.load(corpus)
    names = [s["name"] for s in c.shards("reply")]
    assert len(names) == 6 and {n.rsplit("-", 1)[1].split("_")[0] for n in names} == {"greedy", "sample0"}
    assert c.manifest["token_dtype"] == "uint16" and c.reply_tokens() > 0
    args = ["distill", "--target", str(tdir), "--corpus", str(corpus), "--out", str(out), "--work", str(work),
            "--arch", arch, "--layers", "1", "--draft-vocab", "40", "--max-tokens", "64", "--held-out", "0.2",
            "--eval-every", "3", "--seed", "0", "--no-autocast"]
    assert cli_main(args + ["--steps", "6"]) == 0
    summary = json.loads((out / "distill_summary.json").read_text())
    assert summary["steps"] == 6 and summary["positions"]["train"] > 0 and summary["held_out_prompts"] == 2
    assert [e["step"] for e in summary["evals"]] == [3, 6] and set(summary["held_out"]["per_category"]) == {"c0", "c1"}
    draft, tok = load_model(str(out))
    assert isinstance(draft, SpecdecDraftForCausalLM) and draft.draft_vocab.numel() == 40
    assert tok.get_vocab() == _tiny_tokenizer().get_vocab()
    # Resuming a finished run keeps its step count; more steps continue from the checkpoint.
    assert cli_main(args + ["--steps", "8", "--resume"]) == 0
    assert json.loads((out / "distill_summary.json").read_text())["steps"] == 8
    dec = SpecDecoder(target, draft=draft)
    p = [5, 6, 7, 8]
    assert dec.generate_ids([p], "sd", 16).tokens[0] == hf_generate(target, p, 16, SamplingConfig())


def test_distill_init_goes_on_from_a_draft_with_a_clean_held_out_set(tmp_path, capsys):
    """--init: the draft keeps its vocabulary and weights, the prompts held out along its lineage stay held
    out, the prompts any ancestor trained on never become held-out ones (also when a stage read an older,
    renamed copy of the corpus), and new prompts are split as usual."""
    import shutil

    from safetensors.torch import load_file

    _, tdir = _tiny_target(tmp_path)
    corpus = tmp_path / "corpus"
    gen = ["corpus", "--target", str(tdir), "--out", str(corpus), "--samples", "0", "--gen-dtype", "fp32",
           "--gen-tokens", "8", "--batch-size", "4"]
    assert cli_main(gen + ["--prompts", str(_prompt_file(tmp_path))]) == 0
    before = tmp_path / "before"   # the corpus as it was, under another folder name
    shutil.copytree(corpus, before)
    common = ["distill", "--target", str(tdir), "--arch", "eagle", "--max-tokens", "64", "--held-out", "0.2",
              "--eval-every", "0", "--no-autocast"]
    first = tmp_path / "first"
    assert cli_main(common + ["--corpus", str(corpus), "--out", str(first), "--work", str(tmp_path / "w1"),
                              "--layers", "1", "--draft-vocab", "40", "--steps", "3"]) == 0
    s1 = json.loads((first / "distill_summary.json").read_text())
    old_ids = {f"p{i}" for i in range(12)}
    # more prompts arrive in the corpus
    new_file = tmp_path / "more.jsonl"
    new_file.write_text(_prompt_file(tmp_path, 20, "tmp.jsonl", seed=1).read_text().replace('"id": "p', '"id": "n'))
    assert cli_main(gen + ["--prompts", str(new_file)]) == 0
    new_ids = {f"n{i}" for i in range(20)}

    def go_on(name, init, *extra, corpus=corpus):
        assert cli_main(common + ["--corpus", str(corpus), "--out", str(tmp_path / name), "--work",
                                  str(tmp_path / f"w_{name}"), "--init", str(init), *extra]) == 0
        return json.loads((tmp_path / name / "distill_summary.json").read_text())

    s2 = go_on("second", first, "--steps", "0")
    held = set(s2["held_out_ids"])
    assert set(s1["held_out_ids"]) <= held and not (held & (old_ids - set(s1["held_out_ids"])))
    assert held - set(s1["held_out_ids"]) and held - set(s1["held_out_ids"]) <= new_ids
    assert s2["init"]["draft"] == str(first) and s2["init"]["init"] is None
    assert s2["draft_vocab"] == 40 and s2["layers"] == [1] and len(s2["reply_shard_names"]) == 2
    w1, w2 = load_file(first / "model.safetensors"), load_file(tmp_path / "second" / "model.safetensors")
    assert w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1)   # no steps: the same draft
    # a stage on the older copy of the corpus: the lineage still saw the new shard and held out its prompts
    s3 = go_on("third", tmp_path / "second", "--steps", "1", corpus=before)
    assert s3["init"]["init"]["draft"] == str(first) and len(s3["reply_shard_names"]) == 1
    assert set(s3["seen_shard_names"]) == set(s2["reply_shard_names"]) and set(s3["held_out_ids"]) == held
    s4 = go_on("fourth", tmp_path / "third", "--steps", "1")
    assert set(s4["held_out_ids"]) == held   # nothing new to split, nothing the lineage trained on held out
    # an older summary without shard names: the first reply shards of its one corpus are what it saw
    for key in ("reply_shard_names", "seen_shard_names"):
        s1.pop(key, None)
    (first / "distill_summary.json").write_text(json.dumps(s1))
    assert set(go_on("fifth", first, "--steps", "1")["held_out_ids"]) == held
    bad = common + ["--corpus", str(corpus), "--out", str(tmp_path / "x"), "--work", str(tmp_path / "wx"),
                    "--steps", "1"]
    for extra, msg in [(["--arch", "layers"], "not --arch layers"), (["--layers", "1"], "drop --layers"),
                       (["--draft-vocab", "40"], "drop --layers")]:
        assert cli_main(bad + ["--init", str(first)] + extra) != 0
        assert msg in capsys.readouterr().err
    s1["corpora"] = ["elsewhere"]
    (first / "distill_summary.json").write_text(json.dumps(s1))
    assert cli_main(bad + ["--init", str(first)]) != 0
    assert "held-out measurement would not be clean" in capsys.readouterr().err
    (first / "distill_summary.json").unlink()   # no summary: no clean held-out set is possible
    assert cli_main(bad + ["--init", str(first)]) != 0
    assert "--held-out 0" in capsys.readouterr().err
    assert cli_main(bad + ["--init", str(first), "--held-out", "0"]) == 0


def test_corpus_shards_round_trip_and_store_uint16(tmp_path):
    from specdec.distill.corpus import Corpus, Record

    fp = {"vocab_size": 50000, "tokenizer": "x", "config_sha": "y"}
    c = Corpus.open(tmp_path / "c", "t", fp, "bf16")
    recs = [Record("a", "qa", np.array([1, 49999, 7, 8]), 2), Record("b", "code", np.array([3, 4, 5]), 1)]
    c.write("s_0000", recs, "reply", sampling={"temperature": 0.0})
    back = Corpus.load(tmp_path / "c").read("s_0000")
    assert [(r.id, r.category, r.ids.tolist(), r.prompt_len) for r in back] == \
        [(r.id, r.category, r.ids.tolist(), r.prompt_len) for r in recs]
    with np.load(tmp_path / "c" / "s_0000.npz") as z:
        assert z["tokens"].dtype == np.uint16
    with pytest.raises(ValueError, match="already has"):
        c.write("s_0000", recs, "reply")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        c.write("s_0001", [Record("c", "qa", np.array([50000]), 1)], "reply")
    big = Corpus.open(tmp_path / "g", "t", {**fp, "vocab_size": 262144}, "bf16")
    assert big.manifest["token_dtype"] == "uint32"


@pytest.mark.parametrize("change", ["target", "gen_dtype", "vocab_size", "tokenizer"])
def test_corpus_refuses_mixed_shards(tmp_path, change):
    from specdec.distill.corpus import Corpus, CorpusMismatch

    fp = {"vocab_size": 100, "tokenizer": "x", "config_sha": "y"}
    Corpus.open(tmp_path, "t", fp, "bf16")
    kw = {"target": "t", "fingerprint": dict(fp), "gen_dtype": "bf16"}
    if change in fp:
        kw["fingerprint"][change] = 7 if change == "vocab_size" else "other"
    else:
        kw[change] = "other"
    with pytest.raises(CorpusMismatch, match=change):
        Corpus.open(tmp_path, kw["target"], kw["fingerprint"], kw["gen_dtype"])


def test_distill_refuses_a_corpus_of_another_target(tmp_path, capsys):
    from specdec.distill.corpus import Corpus

    _, tdir = _tiny_target(tmp_path)
    Corpus.open(tmp_path / "c", "other", {"vocab_size": 50, "tokenizer": "x", "config_sha": "y"}, "fp32")
    assert cli_main(["distill", "--target", str(tdir), "--corpus", str(tmp_path / "c"), "--out", str(tmp_path / "o"),
                     "--work", str(tmp_path / "w")]) != 0
    assert "was made by another target or vocabulary" in capsys.readouterr().err
    assert cli_main(["corpus", "--target", str(tdir), "--out", str(tmp_path / "c"), "--prompts",
                     str(_prompt_file(tmp_path)), "--gen-dtype", "fp32"]) != 0
    assert "holds shards of another target or dtype" in capsys.readouterr().err
    assert not (tmp_path / "o").exists() and Corpus.load(tmp_path / "c").manifest["shards"] == []


def test_reply_shards_resume_to_the_same_corpus(tmp_path):
    """An interrupted run (here: one shard deleted from a finished corpus, as if it had not been
    reached) resumes to the shards an uninterrupted run wrote, sampled ones included."""
    from specdec.distill.corpus import Corpus

    _, tdir = _tiny_target(tmp_path)
    prompts = _prompt_file(tmp_path)
    cmd = ["corpus", "--target", str(tdir), "--prompts", str(prompts), "--samples", "1", "--gen-dtype", "fp32",
           "--gen-tokens", "10", "--batch-size", "3", "--shard-prompts", "4"]
    assert cli_main(cmd + ["--out", str(tmp_path / "a")]) == 0
    full = Corpus.load(tmp_path / "a")
    assert cli_main(cmd + ["--out", str(tmp_path / "b"), "--minutes", "0"]) == 0   # budget spent at once
    assert Corpus.load(tmp_path / "b").manifest["shards"] == []
    assert cli_main(cmd + ["--out", str(tmp_path / "b")]) == 0
    partial = Corpus.load(tmp_path / "b")
    drop = partial.manifest["shards"].pop(2)
    partial._save_manifest()
    (tmp_path / "b" / f"{drop['name']}.npz").unlink()
    assert cli_main(cmd + ["--out", str(tmp_path / "b")]) == 0
    resumed = Corpus.load(tmp_path / "b")
    assert sorted(s["name"] for s in resumed.manifest["shards"]) == sorted(s["name"] for s in full.manifest["shards"])
    for s in full.manifest["shards"]:
        assert [r.ids.tolist() for r in resumed.read(s["name"])] == [r.ids.tolist() for r in full.read(s["name"])]


def test_magpie_user_turns_filtered_resumed_and_answered(tmp_path, monkeypatch):
    """The Magpie stage on a tiny chat target: the user prefix comes from the template, and canned
    user turns (the random target writes no English) pass through every filter, shard by shard."""
    from specdec.distill import magpie
    from specdec.distill.corpus import Corpus

    _, tdir = _tiny_target(tmp_path, chat=True)
    _, tok = load_model(str(tdir))
    assert magpie.user_prefix(tok) == [2, 3]
    texts = iter(["t5 t6 t7 t8", "t5 t6 t7 t8", "t9 t30 t31", "t41 t42 t43", "t44 t45 t46", "t47 t48 t49",
                  "t50 t51 t52", "t53 t54 t55", "t56 t57 t58"])
    seen_prefixes = []

    def fake_generate(model, prompts, max_new, pad, eos, temperature, top_p):
        seen_prefixes.extend(prompts)
        rows = []
        for _ in prompts:
            ids = [int(w[1:]) for w in next(texts).split()]
            rows.append((ids + [1], True))
        return rows

    monkeypatch.setattr(magpie, "generate", fake_generate)
    monkeypatch.setattr(magpie, "_ENGLISH", frozenset({"t5", "t41", "t44", "t47", "t50", "t53", "t56"}))
    monkeypatch.setattr(magpie, "words", lambda text: text.split())
    corpus = Corpus.open(tmp_path / "c", "tiny", {"vocab_size": VOCAB, "tokenizer": "x", "config_sha": "y"}, "fp32")
    common = dict(batch_size=3, max_tokens=8, eos={1}, pad_id=0, dev_texts=["t53 t54 t55 t99"])
    magpie.make_user_turns(None, tok, corpus, 3, **common)
    # shard 0: kept t5.., dropped the duplicate and the non-English t9..; shard 1: kept all three
    assert [s["records"] for s in corpus.shards("user")] == [1, 3]
    assert corpus.shards("user")[0]["dropped"] == {"unfinished": 0, "length": 0, "language": 1, "duplicate": 1,
                                                   "dev_overlap": 0}
    assert all(p == [2, 3] for p in seen_prefixes)
    magpie.make_user_turns(None, tok, corpus, 5, **common)   # resumes: the duplicate filter remembers shards 0-1
    assert [s["records"] for s in corpus.shards("user")] == [1, 3, 2]   # t53.. overlaps the dev prompt
    assert corpus.shards("user")[2]["dropped"]["dev_overlap"] == 1
    turns = [tok.decode(r.ids.tolist()) for r in corpus.records("user")]
    assert turns == ["t5 t6 t7 t8", "t41 t42 t43", "t44 t45 t46", "t47 t48 t49", "t50 t51 t52", "t56 t57 t58"]
    assert [r.category for r in corpus.records("user")] == ["other"] * 6


def test_prompt_filter_and_category_guess():
    from specdec.distill.magpie import PromptFilter, guess_category

    f = PromptFilter(["Please summarize the following article about the history of the Roman empire in detail"])
    assert f.check("What is the capital of France?", True)
    assert not f.check("what is the capital of  france", True)                    # duplicate after normalising
    assert not f.check("Can you write a story", False)                            # unfinished
    assert not f.check("Hi", True)                                                # too short
    assert not f.check("Это очень хороший вопрос о погоде", True)                 # not English
    assert not f.check("Could you summarize the following article about the history of the Roman empire", True)
    assert f.dropped == {"unfinished": 1, "length": 1, "language": 1, "duplicate": 1, "dev_overlap": 1}
    assert guess_category("Translate 'good morning' into French.") == "translation"
    assert guess_category("Write a Python function that reverses a list.") == "code"
    assert guess_category("Solve the equation 3x + 4 = 10.") == "math"
    assert guess_category("Write a short poem about autumn.") == "writing"
    assert guess_category("Who painted the Mona Lisa?") == "qa"


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
    # ungoverned: the cached decoder's governor may have learned from earlier tests that plain steps win
    out = specdec.generate(prompt, method="sd", draft=name, max_new_tokens=32, govern=0)
    model, tok = load_model("smollm2", "fp32")
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, return_dict=True)["input_ids"]
    assert out.tokens == hf_generate(model, list(ids), 32, SamplingConfig())
    assert out.stats.drafted_tokens > 0


def test_feature_cache_equals_the_online_teacher_and_is_reused(tmp_path):
    from specdec.distill.corpus import Record
    from specdec.distill.teacher import Teacher, collate, make_examples

    target = tiny_model("llama", VOCAB, 0, 0.3)
    g = torch.Generator().manual_seed(1)
    recs = [Record(f"r{i}", "c", torch.randint(2, VOCAB, (int(n),), generator=g).numpy(), 3)
            for i, n in enumerate(torch.randint(5, 20, (9,), generator=g))]
    examples = make_examples(recs, 8, True)
    teacher = Teacher(target)
    ids, _ = collate(examples[:4], "cpu")
    online = teacher.feats(ids)
    teacher.cache_features(examples, tmp_path, max_tokens=40, progress=False)
    assert all(e.offset >= 0 for e in examples)
    cached = teacher.feats(ids, examples[:4])
    for r, e in enumerate(examples[:4]):
        torch.testing.assert_close(cached[r, : len(e.ids)], online[r, : len(e.ids)], atol=2e-2, rtol=2e-3)
    # a second run over the same examples reads the file: its body is never called
    fresh = make_examples(recs, 8, True)
    class NoForward(torch.nn.Module):  # same dtype as the target's body, but must not run
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, **kw):
            raise AssertionError("the cached features were recomputed")

    again = Teacher(target, body=NoForward())
    again.cache_features(fresh, tmp_path, max_tokens=40, progress=False)
    torch.testing.assert_close(again.feats(ids, fresh[:4]), cached)


def test_held_out_split_takes_a_share_of_every_category():
    from specdec.distill.train import held_out_split

    ids = {"qa": [f"q{i}" for i in range(100)], "code": [f"c{i}" for i in range(10)], "one": ["o0"]}
    held = held_out_split(ids, 0.05, 0)
    assert len([i for i in held if i[0] == "q"]) == 5 and len([i for i in held if i[0] == "c"]) == 1
    assert "o0" not in held and held == held_out_split(ids, 0.05, 0) and held_out_split(ids, 0.0, 0) == set()


def test_bad_distill_options_and_changed_reply_settings_fail_clearly(tmp_path, capsys):
    _, tdir = _tiny_target(tmp_path)
    prompts = _prompt_file(tmp_path)
    base = ["corpus", "--target", str(tdir), "--out", str(tmp_path / "c"), "--prompts", str(prompts),
            "--samples", "0", "--gen-dtype", "fp32", "--gen-tokens", "6", "--batch-size", "4"]
    assert cli_main(base) == 0
    assert cli_main(base[:-4] + ["--gen-tokens", "9", "--batch-size", "4"]) != 0   # same shard names, other settings
    assert "made with other settings" in capsys.readouterr().err
    d = ["distill", "--target", str(tdir), "--corpus", str(tmp_path / "c"), "--out", str(tmp_path / "o"),
         "--work", str(tmp_path / "w"), "--steps", "1"]
    for extra, msg in [(["--labels", "top3"], "labels must be"), (["--unroll", "2"], "--unroll"),
                       (["--held-out", "1"], "--held-out"), (["--max-context", "0"], "--max-context")]:
        assert cli_main(d + extra) != 0
        assert msg in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_magpie_gives_up_when_nothing_passes_the_filters(tmp_path, monkeypatch):
    from specdec.distill import magpie
    from specdec.distill.corpus import Corpus

    _, tdir = _tiny_target(tmp_path, chat=True)
    _, tok = load_model(str(tdir))
    monkeypatch.setattr(magpie, "generate", lambda m, prompts, *a: [([5, 6], False)] * len(prompts))  # never ends
    corpus = Corpus.open(tmp_path / "c", "tiny", {"vocab_size": VOCAB, "tokenizer": "x", "config_sha": "y"}, "fp32")
    with pytest.raises(ValueError, match="kept no user turn"):
        magpie.make_user_turns(None, tok, corpus, 10, batch_size=2, max_tokens=4, eos={1}, pad_id=0)
    assert [s["dropped"]["unfinished"] for s in corpus.shards("user")] == [2, 2, 2]


def test_magpie_openings_steer_the_user_turns(tmp_path, monkeypatch):
    """With task openings, shard i continues opening i mod n: the target is handed the user prefix plus
    the opening, the kept turn begins with it and takes its category, and the manifest names it."""
    from specdec.distill import magpie
    from specdec.distill.corpus import Corpus

    _, tdir = _tiny_target(tmp_path, chat=True)
    _, tok = load_model(str(tdir))
    path = tmp_path / "openings.jsonl"
    path.write_text('{"category": "summarization", "text": "t60 t61"}\n\n{"category": "translation", "text": "t70"}\n')
    openings = magpie.read_openings(str(path))
    assert openings == [("summarization", "t60 t61"), ("translation", "t70")]
    handed = []
    counter = iter(range(20, 40))  # ids below 20 would decode to t1x / t0x, which re-encode via the special t1 / t0

    def fake_generate(model, prompts, max_new, pad, eos, temperature, top_p):
        handed.extend(prompts)
        return [([next(counter), next(counter), 1], True) for _ in prompts]

    monkeypatch.setattr(magpie, "generate", fake_generate)
    monkeypatch.setattr(magpie, "_ENGLISH", frozenset({"t60", "t70"}))
    monkeypatch.setattr(magpie, "words", lambda text: text.split())
    corpus = Corpus.open(tmp_path / "c", "tiny", {"vocab_size": VOCAB, "tokenizer": "x", "config_sha": "y"}, "fp32")
    magpie.make_user_turns(None, tok, corpus, 4, batch_size=2, max_tokens=8, eos={1}, pad_id=0, openings=openings)
    assert handed == [[2, 3, 60, 61]] * 2 + [[2, 3, 70]] * 2
    assert [(s["opening"], s["opening_category"]) for s in corpus.shards("user")] == \
        [("t60 t61", "summarization"), ("t70", "translation")]
    turns = [tok.decode(r.ids.tolist()) for r in corpus.records("user")]
    assert turns == ["t60 t61 t20 t21", "t60 t61 t22 t23", "t70 t24 t25", "t70 t26 t27"]
    assert [r.category for r in corpus.records("user")] == ["summarization"] * 2 + ["translation"] * 2
    for bad in ['{"category": "poetry", "text": "x"}', '{"category": "rag", "text": " "}', "[1]", ""]:
        path.write_text(bad + "\n")
        with pytest.raises(ValueError, match="opening"):
            magpie.read_openings(str(path))


@pytest.mark.parametrize("order", ["oldest", "newest"])
def test_corpus_reply_order(tmp_path, monkeypatch, order):
    """--reply-order: the user-turn shards are answered in the order written, or newest first (so the
    turns just steered by --magpie-openings are answered before a time budget runs out)."""
    from specdec.distill import data, magpie
    from specdec.distill.corpus import Corpus, target_fingerprint

    target, tdir = _tiny_target(tmp_path, chat=True)
    _, tok = load_model(str(tdir))
    counter = iter(range(20, 60))
    monkeypatch.setattr(magpie, "generate", lambda m, prompts, *a: [([next(counter) for _ in range(3)] + [1], True)
                                                                      for _ in prompts])
    monkeypatch.setattr(magpie, "_ENGLISH", frozenset(f"t{i}" for i in range(20, 60)))
    monkeypatch.setattr(magpie, "words", lambda text: text.split())
    corpus = Corpus.open(tmp_path / "c", str(tdir), target_fingerprint(target, tok), "fp32")
    magpie.make_user_turns(None, tok, corpus, 6, batch_size=2, max_tokens=8, eos={1}, pad_id=0)
    answered = []
    monkeypatch.setattr(data, "make_replies", lambda model, corpus, sets, *a, **k: answered.extend(n for n, _ in sets))
    assert cli_main(["corpus", "--target", str(tdir), "--out", str(tmp_path / "c"), "--gen-dtype", "fp32",
                     "--magpie", "6", "--reply-order", order]) == 0
    written = ["user_0000", "user_0001", "user_0002"]
    assert answered == (written if order == "oldest" else written[::-1])
