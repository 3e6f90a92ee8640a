"""The feature-conditioned (EAGLE-style) draft: model class, the runner's hidden states, the drafter."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdec.api import SpecDecoder, hf_generate
from specdec.draft_models.eagle import SpecdecEagleForCausalLM, eagle_from_target, is_feature_draft
from specdec.drafters.feature_draft import FeatureDraftDrafter
from specdec.model import ModelRunner
from specdec.verify import SamplingConfig
from tests.conftest import tiny_model

VOCAB = 96
DRAFT_VOCAB = torch.tensor(list(range(2, 60, 2)) + [1, 61, 70, 80, 95])


def tiny_eagle(target, seed: int = 0) -> SpecdecEagleForCausalLM:
    torch.manual_seed(seed)
    d = eagle_from_target(target, [1], DRAFT_VOCAB)
    with torch.no_grad():  # make the drafts depend strongly on the target state, so misalignment shows
        d.fc.weight.normal_(0, 0.3)
    return d


def test_needs_target_hidden_and_checks_its_shape():
    target = tiny_model("llama", VOCAB)
    d = tiny_eagle(target)
    assert is_feature_draft(d) and d.get_output_embeddings().weight.shape[0] == VOCAB
    ids = torch.randint(0, VOCAB, (2, 5))
    with pytest.raises(ValueError, match="target_hidden"):
        d(input_ids=ids)
    with pytest.raises(ValueError, match="target_hidden"):
        d(input_ids=ids, target_hidden=torch.zeros(2, 4, 64))
    out = d(input_ids=ids, target_hidden=torch.zeros(2, 5, 64))
    assert out.logits.shape == (2, 5, VOCAB)


def test_save_and_reload_round_trips(tmp_path):
    from transformers import AutoModelForCausalLM

    from specdec.draft_models import register_draft_models

    register_draft_models()  # explicit: importing specdec registers nothing with transformers
    d = tiny_eagle(tiny_model("llama", VOCAB))
    d.save_pretrained(tmp_path)
    back = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(back, SpecdecEagleForCausalLM)
    ids, h = torch.randint(0, VOCAB, (1, 6)), torch.randn(1, 6, 64)
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids, target_hidden=h).logits, d(input_ids=ids, target_hidden=h).logits)


@pytest.mark.parametrize("row_min", [64, 1])  # one padded forward; one forward per row
def test_prefill_returns_every_prompt_positions_hidden_state_for_ragged_rows(row_min, monkeypatch):
    import specdec.model as model_mod

    monkeypatch.setattr(model_mod, "ROW_PREFILL_MIN", row_min)
    target = tiny_model("llama", VOCAB)
    runner = ModelRunner(target)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    runner.reset(2, 16)
    ids = torch.zeros(2, 6, dtype=torch.int64)
    for r, p in enumerate(prompts):
        ids[r, : len(p)] = torch.tensor(p)
    _, hidden = runner.prefill(ids, torch.tensor([6, 3]), return_hidden=True)
    assert hidden.shape == (2, 6, 64)
    for r, p in enumerate(prompts):
        with torch.no_grad():
            ref = target.model(input_ids=torch.tensor([p])).last_hidden_state[0]
        torch.testing.assert_close(hidden[r, : len(p)], ref, atol=1e-5, rtol=1e-5)


def _teacher_forced_chain(target, draft, seq: list[int], k: int) -> list[int]:
    """The chain the draft should propose after the committed tokens ``seq`` (last one = root),
    computed from scratch: target states of all but the root, then the draft over the whole
    sequence, then its own states for the later tokens."""
    with torch.no_grad():
        f = target.model(input_ids=torch.tensor([seq[:-1]])).last_hidden_state
        tokens = list(seq)
        prev = F.pad(f, (0, 0, 1, 0))  # [1, len(seq), H]: f_{t-1} for every token
        out = []
        for _ in range(k):
            h = draft.model(inputs_embeds=draft.fuse(torch.tensor([tokens]), prev)).last_hidden_state
            with draft.reduced_logits():
                logits = draft.lm_head(h[:, -1])[..., : draft.draft_vocab_size]
            tok = int(draft.draft_vocab[logits.argmax(-1)])
            out.append(tok)
            tokens.append(tok)
            prev = torch.cat([prev, h[:, -1:]], dim=1)
        return out


def _check_chains(target, draft, prompts: list[list[int]], draft_length: int) -> int:
    """Decode ``prompts`` (one ragged batch) with sd; check every row's chain at every step against
    the from-scratch recomputation, and greedy outputs against transformers. Returns accepted tokens."""
    dec = SpecDecoder(target, draft=draft)
    seen, rows = [], []
    orig = FeatureDraftDrafter.propose

    def spy(self, state, max_len):
        tree = orig(self, state, max_len)
        rows.append(state.seq.shape[0])
        for r in range(state.seq.shape[0]):
            seq = state.seq[r, : state.seq_lens_host[r]].tolist()
            seen.append((seq, tree.tokens[r, 1:][tree.valid[r, 1:]].tolist()))  # rows near their end draft less
        return tree

    FeatureDraftDrafter.propose = spy
    try:
        res = dec.generate_ids(prompts, "sd", 24, draft_length=draft_length)
    finally:
        FeatureDraftDrafter.propose = orig
    assert res.tokens == [hf_generate(target, p, 24, SamplingConfig()) for p in prompts]
    for seq, drafted in seen:
        assert drafted == _teacher_forced_chain(target, draft, seq, len(drafted))
    assert len(seen) > 3
    assert rows == sorted(rows, reverse=True) and rows[0] == len(prompts)
    if len({len(t) for t in res.tokens}) > 1:  # rows that ended first left the batch, their draft state with them
        assert rows[-1] < len(prompts)
    return res.stats.accepted_tokens


@pytest.mark.parametrize("draft_length", [1, 3])
def test_drafter_feeds_the_target_state_before_each_token(draft_length):
    """Every step's chain equals the one recomputed from scratch with the target's states: the
    drafter's feature buffer, catch-up and rollback line up with the committed sequence."""
    target = tiny_model("llama", VOCAB)
    _check_chains(target, tiny_eagle(target), [[3, 4, 5, 6, 7, 9, 11]], draft_length)


def test_drafter_lines_up_every_row_of_a_ragged_batch():
    """Rows of different lengths, finishing at different steps (EOS is id 1 in the tiny models)."""
    target = tiny_model("llama", VOCAB)
    _check_chains(target, tiny_eagle(target), [[3, 4, 5, 6, 7, 9, 11], [8], [20, 21, 22, 1, 30]], 3)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_sd_with_feature_draft_ragged_batch(temperature):
    from tests.test_distill import check_sd_ragged

    target = tiny_model("llama", VOCAB)
    check_sd_ragged(target, tiny_eagle(target), [[3, 4, 5, 6], [10, 20, 30, 40, 50, 2, 7], [8]], temperature)


def test_hf_assisted_refuses_a_feature_draft():
    from specdec.bench import Prompt, run_bench

    target = tiny_model("llama", VOCAB)
    dec = SpecDecoder(target, draft=tiny_eagle(target))
    with pytest.raises(ValueError, match="hf-assisted"):
        run_bench(dec, ["hf", "hf-assisted"], [Prompt("p", "c", [3, 4, 5])], 8)


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    """``specdec distill --arch eagle`` on a tiny target: (target, trained draft, summary)."""
    import json

    from transformers import AutoModelForCausalLM

    from specdec.draft_models import register_draft_models

    register_draft_models()

    from specdec.cli import main as cli_main
    from specdec.distill.corpus import Corpus
    from tests.test_distill import _tiny_tokenizer

    tmp = tmp_path_factory.mktemp("eagle")
    target = tiny_model("llama", VOCAB)
    tdir, out, work = tmp / "target", tmp / "draft", tmp / "work"
    target.save_pretrained(tdir)
    _tiny_tokenizer().save_pretrained(tdir)
    g = torch.Generator().manual_seed(0)
    rows = [{"id": f"p{i}", "category": "c", "chat": False,
             "prompt": " ".join(f"t{int(t)}" for t in torch.randint(2, VOCAB, (6,), generator=g))} for i in range(24)]
    prompts = tmp / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["distill", "--arch", "eagle", "--target", str(tdir), "--prompts", str(prompts), "--out", str(out),
            "--work", str(work), "--gen-dtype", "fp32", "--gen-tokens", "24", "--batch-size", "8",
            "--layers", "1", "--draft-vocab", "48", "--max-tokens", "256", "--held-out", "0.2", "--seed", "0",
            "--no-autocast", "--lr", "3e-3", "--steps", "150", "--save-dtype", "fp32"]
    assert cli_main(args) == 0
    corpus = Corpus.load(work / "corpus")
    assert sorted(s["name"].rsplit("-", 1)[1] for s in corpus.shards("reply")) == ["greedy_0000", "sample0_0000"]
    summary = json.loads((out / "distill_summary.json").read_text())
    records = [r for s in corpus.shards("reply") if s["sampling"]["temperature"] == 0 for r in corpus.read(s["name"])]
    # training prompts whose greedy reply runs long (short ones end in EOS before sd drafts much)
    prompts_ids = [r.ids[: r.prompt_len].tolist() for r in records
                   if r.id not in summary["held_out_ids"] and len(r.ids) - r.prompt_len >= 20]
    return target, AutoModelForCausalLM.from_pretrained(out).eval(), summary, prompts_ids


def test_distill_eagle_end_to_end(distilled):
    target, draft, summary, prompts = distilled
    assert is_feature_draft(draft) and summary["arch"] == "eagle" and summary["steps"] == 150
    assert summary["train_top1_ema"] > 0.3  # it learns (a random draft agrees ~1/48 of the time)
    assert summary["held_out"]["positions"] > 0
    dec = SpecDecoder(target, draft=draft)
    for temperature in (0.0, 0.9):
        res = dec.generate_ids(prompts[:3], "sd", 24, SamplingConfig(temperature, seed=0), draft_length=3, govern=0)
        assert res.stats.accepted_tokens > 0
        if temperature == 0:
            assert res.tokens == [hf_generate(target, p, 24, SamplingConfig()) for p in prompts[:3]]


def test_trained_drafter_rereads_accepted_tokens_with_target_states(distilled):
    """With a draft that gets accepted, a drafter that kept the positions it drafted from its own
    states would propose different chains than the from-scratch recomputation."""
    target, draft, _, prompts = distilled
    assert sum(_check_chains(target, draft, [p], 3) for p in prompts[:4]) >= 8
    assert _check_chains(target, draft, prompts[4:8], 3) > 0  # a ragged batch, with acceptances


def test_bench_compares_two_drafts_in_one_run():
    """sd with a feature draft beside hf-assisted and sd with a plain draft, one decoder, one run."""
    from specdec.bench import Prompt, run_bench
    from tests.test_distill import tiny_draft

    target = tiny_model("llama", VOCAB)
    dec = SpecDecoder(target, draft=[tiny_eagle(target), tiny_draft()])
    assert list(dec.drafts) == ["draft0", "draft1"] and dec.get_draft()[0] is dec.drafts["draft0"][0]
    with pytest.raises(ValueError, match="not loaded"):
        dec.get_draft("other")
    prompts = [Prompt("a", "c", [3, 4, 5, 6]), Prompt("b", "c", [7, 8, 9])]
    calls = {name: 0 for name in dec.drafts}
    for name, (model, _) in dec.drafts.items():
        model.register_forward_pre_hook(lambda *_, n=name: calls.__setitem__(n, calls[n] + 1))
    methods = ["hf", "hf-assisted:draft=draft1", "sd:draft_length=3:govern=0", "sd:draft=draft1:draft_length=3:govern=0"]
    res = run_bench(dec, methods, prompts, 12)
    assert all(r["identical_to_reference"] for r in res["runs"])
    used = {}
    for m in methods[1:]:  # which draft each method runs, one call at a time
        before = dict(calls)
        dec_res = run_bench(dec, ["hf", m], prompts[:1], 6)
        assert dec_res["runs"]
        used[m] = {n for n in calls if calls[n] > before[n]}
    assert used == {"hf-assisted:draft=draft1": {"draft1"}, "sd:draft_length=3:govern=0": {"draft0"},
                    "sd:draft=draft1:draft_length=3:govern=0": {"draft1"}}
    with pytest.raises(ValueError, match="not loaded"):
        run_bench(dec, ["hf", "sd:draft=nope"], prompts, 6)


@pytest.mark.parametrize("kind", ["eagle", "plain"])
def test_distill_evaluate_measures_either_draft(kind):
    from specdec.bench import Prompt
    from specdec.distill.evaluate import acceptance, cost_ratio
    from tests.test_distill import tiny_draft

    target = tiny_model("llama", VOCAB)
    dec = SpecDecoder(target, draft=tiny_eagle(target) if kind == "eagle" else tiny_draft())
    cost = cost_ratio(dec, [3, 4, 5, 6, 7], steps=6, rounds=1)
    assert cost["c"] > 0 and cost["target_step_ms"] > 0
    acc = acceptance(dec, [Prompt("a", "x", [3, 4, 5]), Prompt("b", "y", [9, 8])], 10, 2)
    assert set(acc["per_category"]) == {"x", "y"} and acc["overall"]["drafted"] > 0
