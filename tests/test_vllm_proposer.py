"""specdec's vLLM proposers without vLLM: the call convention vLLM 0.32 uses for ``custom_class``
proposers, fed from numpy arrays laid out as vLLM's input batch lays them out.

The end-to-end check inside vLLM's CPU engine is ``tests/vllm/test_vllm_engine.py`` (its own venv)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from specdec import kernels
from specdec.integrations.vllm import NGrammysProposer, PromptLookupProposer, read_options
from specdec.policies.batch_length import LinearStepCost, plan_lengths


def vllm_config(k=4, max_model_len=64, vocab=96, model="unused", max_num_seqs=8):
    """The attributes of vLLM's ``VllmConfig`` the proposers read."""
    mc = SimpleNamespace(max_model_len=max_model_len, model=model, tokenizer=model, get_vocab_size=lambda: vocab)
    return SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k), model_config=mc,
                           scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs))


def batch(rows: list[list[int]], max_model_len=64, max_num_seqs=8):
    """vLLM's ``token_ids_cpu [max_num_seqs, max_model_len] int32`` and ``num_tokens_no_spec``."""
    ids = np.zeros((max_num_seqs, max_model_len), dtype=np.int32)
    n = np.zeros(max_num_seqs, dtype=np.int32)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
        n[i] = len(r)
    return ids, n


ROWS = [[5, 6, 7, 8, 9, 5, 6, 7], [1, 2, 3, 1, 2], [4, 4, 4, 4], [10, 11, 12]]


def test_prompt_lookup_matches_the_kernel(monkeypatch):
    monkeypatch.setenv("SPECDEC_VLLM_OPTIONS", json.dumps({"adaptive": False}))
    p = PromptLookupProposer(vllm_config(k=4))
    ids, n = batch(ROWS)
    out = p.propose([[r[-1]] for r in ROWS], n, ids)
    seq = torch.tensor([r + [0] * (8 - len(r)) for r in ROWS])
    drafts, _, _, _ = kernels.ngram_match(seq, torch.tensor([len(r) for r in ROWS]), 1, 4, 1, 4)
    want = [[t for t in d if t >= 0] for d in drafts[:, 0].tolist()]
    assert out == want
    assert out[0] == [8, 9, 5, 6] and out[3] == []


def test_rows_that_do_not_decode_get_no_draft(monkeypatch):
    monkeypatch.setenv("SPECDEC_VLLM_OPTIONS", json.dumps({"adaptive": False}))
    p = PromptLookupProposer(vllm_config(k=4, max_model_len=10))
    ids, n = batch(ROWS, max_model_len=10)
    out = p.propose([[7], [], [4], [12]], n, ids)
    assert out[1] == []  # a prefill in progress
    assert out[0] == [8, 9]  # cut at max_model_len (8 tokens + 2)
    assert len(out) == 4


@pytest.mark.parametrize("slots", [1, 10])
def test_ngrammys_chain_before_any_learning(monkeypatch, slots):
    monkeypatch.setenv("SPECDEC_VLLM_OPTIONS", json.dumps({"adaptive": False, "corpus": None, "bigram": False,
                                                           "slots": slots}))
    p = NGrammysProposer(vllm_config(k=3))
    ids, n = batch(ROWS)
    out = p.propose([[r[-1]] for r in ROWS], n, ids)
    assert out[0] == [8, 9, 5]  # the longest-suffix match: the drafter's first slot, and the prior's best
    assert out[1] == [3, 1, 2]
    assert out[3] == []  # no match, no bigram table


def test_ngrammys_chain_follows_what_vllm_accepts(monkeypatch):
    """Two drafts every step: the longest-suffix match 1 2 3 (first in the drafter's order, and the prior's
    favourite) and a last-token match 5 6 7. vLLM rejects the first and would accept the second whole: the
    proposer learns per node and switches. With ``slots = 1`` it drafts the first one for good."""
    for slots, want in ((10, [5, 6, 7]), (1, [1, 2, 3])):
        monkeypatch.setenv("SPECDEC_VLLM_OPTIONS", json.dumps({"corpus": None, "bigram": False, "slots": slots}))
        p = NGrammysProposer(vllm_config(k=3, max_model_len=256))
        p.cost = LinearStepCost(explore_every=0)  # never fitted: every chain is drafted whole
        monkeypatch.setattr(p.cost, "observe", lambda *a: None)

        def drafts(state, w, slots=slots):
            b = state.seq.shape[0]
            d = torch.full((b, slots, w), -1)
            d[:, 0] = torch.tensor([1, 2, 3])
            if slots > 1:
                d[:, 1] = torch.tensor([5, 6, 7])
            source = torch.tensor([[4] + [1] * (slots - 1)]).expand(b, -1)  # a 4-token suffix match, then q-matches
            return d, source, torch.zeros(b, slots, dtype=torch.int64)

        monkeypatch.setattr(p.drafter, "drafts", drafts)
        row = [9] * 10
        ids, n = batch([row], max_model_len=256)
        out = p.propose([[9]], n, ids)
        assert out == [[1, 2, 3]]
        for _ in range(6):
            new = out[0] + [8] if out[0] == [5, 6, 7] else [8]  # 5 6 7 accepted whole, 1 2 3 rejected
            row += new
            ids, n = batch([row], max_model_len=256)
            out = p.propose([new], n, ids)
        assert out == [want]
    assert p.stats["accepted"] == 0  # slots = 1: nothing accepted


def test_ngrammys_cuts_its_chain_by_its_nodes_estimates(monkeypatch):
    """A chain whose third node is rarely accepted, at a step cost where a token costs about a tenth of a step:
    the proposer drafts the two likely nodes only."""
    monkeypatch.setenv("SPECDEC_VLLM_OPTIONS", json.dumps({"corpus": None, "bigram": False}))
    p = NGrammysProposer(vllm_config(k=3, max_model_len=256))
    cost = LinearStepCost(explore_every=0)
    for t in range(2, 30):
        cost.observe(t, 0.010 + 0.001 * t)
    monkeypatch.setattr(cost, "observe", lambda *a: None)
    p.cost = cost
    slots, levels = p.slots, p.nodes.SUPPORT

    def drafts(state, w):
        b = state.seq.shape[0]
        d = torch.full((b, slots, w), -1)
        d[:, 0] = torch.tensor([1, 2, 3])
        return d, torch.full((b, slots), 4), torch.zeros(b, slots, dtype=torch.int64)

    monkeypatch.setattr(p.drafter, "drafts", drafts)
    rates = torch.full_like(p.nodes.proposed, 0.01)
    rates[[((4 * slots) * 3 + depth) * levels for depth in (0, 1)]] = 0.9
    p.nodes.accepted, p.nodes._rates = rates * p.nodes.proposed, None
    ids, n = batch([[9] * 10], max_model_len=256)
    assert p.propose([[9]], n, ids) == [[1, 2]]


def test_ngrammys_reads_the_bigram_table(monkeypatch):
    from specdec.ngram_tables import NGramTables

    vocab = 16
    bigram = (torch.arange(vocab)[:, None] + torch.arange(1, 5)[None]) % vocab  # x -> x+1, x+2, ...
    monkeypatch.setattr(NGrammysProposer, "_tables", lambda self: NGramTables(bigram, torch.arange(vocab)))
    monkeypatch.setenv("SPECDEC_VLLM_OPTIONS", json.dumps({"adaptive": False, "corpus": None}))
    p = NGrammysProposer(vllm_config(k=3, vocab=vocab))
    ids, n = batch([[10, 11, 12]])
    assert p.propose([[12]], n, ids) == [[13, 14, 15]]  # no context match: the extended bigram row


def test_adaptive_lengths_learn_from_outcomes(monkeypatch):
    monkeypatch.delenv("SPECDEC_VLLM_OPTIONS", raising=False)
    p = PromptLookupProposer(vllm_config(k=8, max_model_len=256))
    rows = [[1, 2, 3, 4] * 6, [7, 8, 9] * 8]
    ids, n = batch(rows, max_model_len=256)
    first = p.propose([[r[-1]] for r in rows], n, ids)
    assert [len(d) for d in first] == [8, 8]  # no step cost fitted yet: every draft token
    # vLLM accepted all of row 0's drafts and none of row 1's: lengths grow by what was sampled
    drafted = accepted = 0
    for step in range(12):
        sampled = []
        drafted += sum(len(d) for d in first)
        accepted += len(first[0])
        for i, (r, d) in enumerate(zip(rows, first)):
            new = d + [r[len(r) % 4]] if i == 0 else [99]
            r.extend(new)
            sampled.append(new)
        ids, n = batch(rows, max_model_len=256)
        first = p.propose(sampled, n, ids)
    assert p.stats["drafted"] == drafted and p.stats["accepted"] == accepted > 0


@pytest.mark.parametrize("history", [True, False])
def test_history_keeps_acceptance_per_requests_last_outcome(monkeypatch, history):
    """Two requests with the same kind of match: vLLM accepts every draft of one (it copies its context)
    and none of the other. With history the dear tokens go to the one that copies."""
    monkeypatch.setenv("SPECDEC_VLLM_OPTIONS", json.dumps({"history": history}))
    p = PromptLookupProposer(vllm_config(k=6, max_model_len=256))
    monkeypatch.setattr(p, "chains", lambda seq, lens, w: (torch.arange(1, 1 + w).repeat(seq.shape[0], 1),
                                                           torch.full((seq.shape[0],), 4), None))
    cost = LinearStepCost(explore_every=0)
    for t in range(2, 30):  # a dear token: a step over 2 + 12 tokens costs 2.2x a step over 2
        cost.observe(t, 0.010 + 0.001 * t)
    monkeypatch.setattr(cost, "observe", lambda *a: None)
    p.cost = cost
    n = np.array([10, 10, 0, 0, 0, 0, 0, 0])
    ids = np.zeros((8, 256), dtype=np.int32)
    ids[1, :10] = 7  # two prompts
    out = p.propose([[1], [1]], n, ids)
    for _ in range(20):
        sampled = [out[0] + [5], [5]]  # row 0: every draft token accepted; row 1: none
        for row, new in enumerate(sampled):
            ids[row, n[row]: n[row] + len(new)] = new
            n[row] += len(new)
        out = p.propose(sampled, n, ids)
    signals = {row: p._last[p.request_key(ids, row, int(n[row]))][1] for row in (0, 1)}
    if history:
        assert signals[0] % p.HISTORY == 3 and signals[0] // p.HISTORY == 4  # wholly accepted, 4-gram match
        assert len(out[0]) == 6 and len(out[1]) < len(out[0]), out
    else:
        assert signals[0] == signals[1] == 4  # the matched n-gram size alone
        assert len(out[0]) == len(out[1]), out


def test_requests_keep_their_history_when_vllm_moves_their_rows(monkeypatch):
    """vLLM moves a request to another batch row when others finish (and passes no request ids): what the
    request's last draft did still reaches its next step, and a request new to a row does not inherit it."""
    monkeypatch.delenv("SPECDEC_VLLM_OPTIONS", raising=False)
    p = PromptLookupProposer(vllm_config(k=4, max_model_len=256))
    p.cost = LinearStepCost(explore_every=0)
    monkeypatch.setattr(p.cost, "observe", lambda *a: None)  # never fitted: every draft token is kept
    reqs = [[5, 6, 7, 8] * 3, [1, 2, 3] * 4, [9, 9, 4, 2, 6] * 2]  # request 0 copies its context
    rows = [0, 1, 2]  # request -> row
    sampled = [[r[-1]] for r in reqs]
    for step in range(6):
        ids, n = batch([reqs[q] for q in sorted(range(len(reqs)), key=rows.__getitem__)], max_model_len=256)
        by_row = [None] * len(reqs)
        for q, row in enumerate(rows):
            by_row[row] = sampled[q]
        out = p.propose(by_row, n, ids)
        signal = p._last[p.request_key(ids, rows[0], len(reqs[0]))][1]
        if step >= 1:
            assert signal % p.HISTORY == 3, (step, signal)  # its last draft was wholly accepted, wherever it sat
        for q in range(len(reqs)):  # request 0 accepts all it was given; the others none
            draft = out[rows[q]]
            sampled[q] = draft + [reqs[q][len(reqs[q]) % 4]] if q == 0 else [0]
            reqs[q] += sampled[q]
        rows = rows[1:] + rows[:1] if step % 2 == 0 else rows[::-1]  # vLLM moves the requests around
    assert p.stats["accepted"] == 5 * 4, p.stats  # steps 1-5 each learned request 0's 4 accepted tokens
    # a request new to request 0's row, as long as request 0 was at its last draft but with other tokens, starts afresh
    other = [3] * (len(reqs[0]) - len(sampled[0]) + 1)
    ids, n = batch([other], max_model_len=256)
    p.propose([[3]], n, ids)
    assert p._outcome == {}


def test_identical_requests_share_their_history(monkeypatch):
    """One prompt twice (greedy): both requests have one key at every step, draft alike and both learn."""
    monkeypatch.delenv("SPECDEC_VLLM_OPTIONS", raising=False)
    p = PromptLookupProposer(vllm_config(k=4, max_model_len=256))
    p.cost = LinearStepCost(explore_every=0)
    monkeypatch.setattr(p.cost, "observe", lambda *a: None)
    reqs = [[5, 6, 7, 8] * 3, [5, 6, 7, 8] * 3]
    sampled = [[8], [8]]
    for _ in range(4):
        ids, n = batch(reqs, max_model_len=256)
        out = p.propose(sampled, n, ids)
        assert out[0] == out[1] and len(out[0]) == 4
        sampled = [d + [[5, 6, 7, 8][len(r) % 4]] for d, r in zip(out, reqs)]  # every draft token accepted
        for r, s in zip(reqs, sampled):
            r += s
    assert p.stats["accepted"] == 2 * 3 * 4 and p._outcome == {0: 3, 1: 3}


def test_bench_labels_carry_proposer_options(monkeypatch):
    from specdec.integrations.vllm import OPTIONS_ENV
    from specdec.integrations.vllm_bench import _start_engine, split_label

    assert split_label("vllm-specdec-pld:history=false:n_max=5:corpus=x") == (
        "vllm-specdec-pld", {"history": False, "n_max": 5, "corpus": "x"})
    assert split_label("vllm-ngram") == ("vllm-ngram", {})
    with pytest.raises(ValueError, match="only specdec's proposers"):
        split_label("vllm-ngram:k=3")
    with pytest.raises(ValueError, match="name=value"):
        split_label("vllm-specdec-pld:history")
    monkeypatch.setenv(OPTIONS_ENV, json.dumps({"n_min": 2}))
    seen = _start_engine("vllm-specdec-pld:history=false", lambda: json.loads(os.environ[OPTIONS_ENV]))
    assert seen == {"n_min": 2, "history": False} and json.loads(os.environ[OPTIONS_ENV]) == {"n_min": 2}
    from specdec.integrations.vllm_bench import check_label

    monkeypatch.delenv(OPTIONS_ENV)
    check_label("vllm-specdec-pld:history=false", 8)
    check_label("vllm-ngram", 8)
    with pytest.raises(ValueError, match="must be bool"):  # refused before any engine starts, not at its start
        check_label("vllm-specdec-pld:history=0", 8)
    with pytest.raises(ValueError, match="unknown option.*n_mx"):
        check_label("vllm-specdec-ngrammys:n_mx=3", 8)
    with pytest.raises(ValueError, match="unknown method"):
        check_label("vllm-medusa", 8)


def test_bad_options_fail_at_start(monkeypatch):
    monkeypatch.setenv("SPECDEC_VLLM_OPTIONS", json.dumps({"n_mx": 3}))
    with pytest.raises(ValueError, match="unknown option.*n_mx.*allowed"):
        PromptLookupProposer(vllm_config())
    monkeypatch.setenv("SPECDEC_VLLM_OPTIONS", json.dumps({"n_min": 3, "n_max": 2}))
    with pytest.raises(ValueError, match="n_min <= n_max"):
        PromptLookupProposer(vllm_config())
    monkeypatch.setenv("SPECDEC_VLLM_OPTIONS", json.dumps({"n_max": "4"}))
    with pytest.raises(ValueError, match="must be int"):
        PromptLookupProposer(vllm_config())
    monkeypatch.setenv("SPECDEC_VLLM_OPTIONS", "[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        PromptLookupProposer(vllm_config())
    monkeypatch.setenv("SPECDEC_VLLM_OPTIONS", json.dumps({"c": None}))
    assert read_options({"a": 1, "c": "x"}, frozenset({"c"})) == {"a": 1, "c": None}


def test_corpus_of_another_vocabulary_is_refused(monkeypatch, tmp_path):
    from transformers import AutoTokenizer

    from specdec.hub import resolve, tokenizer_path
    from specdec.ngram_corpus import NGramCorpus

    corpus = NGramCorpus.build([[1, 2, 3, 4, 5]], 96, meta={"vocab_fingerprint": "not-this-one"})
    path = tmp_path / "c.pt"
    corpus.save(path)
    try:
        model = str(tokenizer_path(resolve("smollm2")))
        AutoTokenizer.from_pretrained(model)
    except Exception as exc:  # the embedded model's package is part of `make setup`
        pytest.fail(f"embedded model unavailable: {exc}")
    monkeypatch.setenv("SPECDEC_VLLM_OPTIONS", json.dumps({"corpus": str(path), "bigram": False}))
    with pytest.raises(ValueError, match="another vocabulary"):
        NGrammysProposer(vllm_config(model=model, vocab=49152))


def test_step_cost_fit_and_plan():
    cost = LinearStepCost()
    assert plan_lengths([[0.9, 0.5], []], cost) == [2, 0]  # not fitted: everything
    for t in range(2, 30):
        cost.observe(t, 0.010 + 0.002 * t)
    a, b = cost.coefficients()
    assert abs(a - 0.010) < 1e-6 and abs(b - 0.002) < 1e-6
    # a token is worth its 0.002 s when its reach beats the rate so far
    out = plan_lengths([[0.95, 0.9, 0.85, 0.1, 0.05], [0.2, 0.1]], cost)
    assert out[0] == 3 and out[1] <= 1
    flat = LinearStepCost()
    for t in range(2, 30):
        flat.observe(t, 0.010)
    assert plan_lengths([[0.3] * 5, [0.01]], flat) == [5, 1]  # free tokens are always worth verifying


def test_plan_explores_smaller_steps():
    """A plan that keeps every token makes every step the same size, and a fit that saw one size only can
    never learn the slope: one plan in explore_every keeps the likelier half, and the fit then gets ready."""
    cost = LinearStepCost(explore_every=4)
    reach = [[0.9, 0.8, 0.6, 0.5, 0.3, 0.2, 0.1, 0.1], [0.7, 0.4, 0.1, 0.1]]
    plans = [plan_lengths(reach, cost) for _ in range(8)]
    assert plans[:3] == [[8, 4]] * 3 and plans[3] == plans[7] == [4, 2]  # the six likeliest tokens
    for plan in plans:
        cost.observe(2 + sum(plan), 0.010 + 0.002 * (2 + sum(plan)))
    assert cost.ready and abs(cost.coefficients()[1] - 0.002) < 1e-9


def test_module_imports_without_transformers_or_vllm():
    code = "import specdec.integrations.vllm, sys; print(' '.join(sys.modules))"
    loaded = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                timeout=300).stdout.split())
    assert "transformers" not in loaded and "vllm" not in loaded


def test_bench_methods_map_to_vllm_configs():
    from specdec.integrations.vllm_bench import METHODS, speculative_config

    assert speculative_config("vllm", 8) is None
    assert speculative_config("vllm-ngram", 5)["num_speculative_tokens"] == 5
    for m in METHODS[1:]:
        assert speculative_config(m, 4)["num_speculative_tokens"] == 4
    assert speculative_config("vllm-specdec-pld", 4)["model"].endswith("PromptLookupProposer")
    with pytest.raises(ValueError, match="unknown method"):
        speculative_config("vllm-medusa", 4)


def test_bench_engine_labels():
    from specdec.integrations.vllm_bench import _engine_method

    assert _engine_method("vllm-ngram") is None
    assert _engine_method("specdec-ngrammys") == ("ngrammys", {})
    assert _engine_method("specdec-pld:history=0") == ("pld", {"history": "0"})
    with pytest.raises(ValueError, match="history"):
        _engine_method("specdec-pld:history=2")
    with pytest.raises(ValueError, match="unknown specdec method"):
        _engine_method("specdec-medusa")
    with pytest.raises(ValueError, match="needs a draft"):
        _engine_method("specdec-sd")


def test_bench_engine_group_is_one_batch_on_one_thread(monkeypatch):
    from tests.conftest import tiny_model

    from specdec.api import SpecDecoder
    from specdec.integrations.vllm_bench import _run_engine

    dec = SpecDecoder(tiny_model("llama"), corpus=None)
    group = [SimpleNamespace(ids=[5, 6, 7, 5, 6, 7, 5, 6]), SimpleNamespace(ids=[9, 3, 9, 3])]
    seen = []
    monkeypatch.setattr(dec, "generate_ids", lambda prompts, method, n, _orig=dec.generate_ids, **o:
                        seen.append(torch.get_num_threads()) or _orig(prompts, method, n, **o))
    threads = torch.get_num_threads()
    toks, seconds, drafted, accepted, prefill = _run_engine(dec, ("pld", {"history": "0"}), group, 12)
    assert seen == [1] and torch.get_num_threads() == threads and 0 < prefill < seconds and 0 <= accepted <= drafted
    assert toks == dec.generate_ids([g.ids for g in group], "ar", 12).tokens  # lossless, one batch


def test_step_cost_fit_gets_ready_when_only_exploring_steps_differ():
    """One request that always drafts its whole chain: only the exploring steps (one in 16, half the tokens)
    differ in size, and that is enough for the fit to get ready and see the slope."""
    cost = LinearStepCost()
    for _ in range(40):
        plan = plan_lengths([[0.5] * 8], cost)
        cost.observe(1 + plan[0], 0.040 + 0.002 * (1 + plan[0]))
    assert cost.ready and abs(cost.coefficients()[1] - 0.002) < 1e-9
    early = LinearStepCost()  # one exploring step alone is not enough: the second one (step 32) is
    for step in range(1, 33):
        early.observe(5 if step % 16 == 0 else 9, 0.058)
        assert early.ready == (step == 32), step
    same = LinearStepCost()
    for _ in range(40):
        same.observe(9, 0.058)
    assert not same.ready  # one size only: no slope to see
