"""The n-gram corpus: index and lookup by hand and against brute force, save/load, ngrammys drafting from it
losslessly, the shipped corpus and the ``specdec ngram-corpus`` command."""
from __future__ import annotations

import json
import random
import subprocess
import sys
from collections import Counter

import pytest
import torch

from specdec.api import SpecDecoder, hf_generate
from specdec.drafters.base import DecodeState
from specdec.drafters.ngrammys import NGrammysDrafter
from specdec.ngram_corpus import NGramCorpus, generate_corpus, max_exact_n, pack_keys, shipped_corpus, vocab_fingerprint
from specdec.policies import Budget, NodeAcceptance, StepCost
from specdec.verify import SamplingConfig
from tests.conftest import tiny_model
from tests.test_greedy_lossless import prompt_of

GREEDY = SamplingConfig()


def lookup(corpus, rows, k, w, n_max=None):
    width = max(map(len, rows))
    seq = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    return corpus.match(seq, torch.tensor([len(r) for r in rows]), k, w, n_max)


def test_match_by_hand():
    docs = [[1, 2, 3, 4, 5], [9, 2, 3, 7], [2, 3, 4, 6], [8, 3, 1], [2, 3, 7]]
    c = NGramCorpus.build(docs, vocab=10, n_max=3, k_max=3)
    # suffix 2 3 (5 2 3 never occurs): continuations 7 (twice), 4 6 and 4 5 (once each): by count, then latest
    d, n, m = lookup(c, [[5, 2, 3]], k=3, w=2)
    assert m.tolist() == [2] and n.tolist() == [3]
    assert d[0].tolist() == [[7, -1], [4, 6], [4, 5]]  # 7 ends its document: the draft stops there
    # the longer suffix 1 2 3 wins over 2 3
    d, n, m = lookup(c, [[1, 2, 3]], k=2, w=3)
    assert m.tolist() == [3] and n.tolist() == [1] and d[0].tolist() == [[4, 5, -1], [-1, -1, -1]]
    # 3 alone: 7 (twice), then 1, 4 6, 4 5 from the latest back
    d, n, m = lookup(c, [[0, 3]], k=3, w=1)
    assert m.tolist() == [1] and d[0].tolist() == [[7], [1], [4]]
    # no n-gram crosses a document: 5 ends doc 0 and nothing follows it; 0 is never in the corpus
    d, n, m = lookup(c, [[5], [0, 0, 0]], k=2, w=2)
    assert m.tolist() == [0, 0] and n.tolist() == [0, 0] and (d == -1).all()
    # a batch of ragged rows, k above k_max padded with -1, n_max lowered per call
    d, n, m = lookup(c, [[1, 2, 3], [2, 3]], k=5, w=1, n_max=1)
    assert m.tolist() == [1, 1] and d.shape == (2, 5, 1) and d[0, :, 0].tolist() == [7, 1, 4, -1, -1]


def brute(docs, row, n_max, k, w):
    for n in range(min(n_max, len(row)), 0, -1):
        q, cnt, last = row[-n:], Counter(), {}
        for di, doc in enumerate(docs):
            for i in range(n, len(doc)):
                if doc[i - n:i] == q:
                    key = tuple(doc[i:i + 4])
                    cnt[key] += 1
                    last[key] = (di, i)
        if cnt:
            order = sorted(cnt, key=lambda c: (-cnt[c], tuple(-x for x in last[c])))[:k]
            out = []
            for c in order:
                di, i = last[c]
                out.append((doc := docs[di])[i:i + w] + [-1] * max(0, i + w - len(doc)))
            return n, out
    return 0, []


@pytest.mark.parametrize("seed", range(4))
def test_match_equals_brute_force(seed):
    rnd = random.Random(seed)
    docs = [[rnd.randrange(6) for _ in range(rnd.randrange(1, 30))] for _ in range(12)]
    c = NGramCorpus.build(docs, vocab=6, n_max=3, k_max=3)
    rows = [[rnd.randrange(6) for _ in range(rnd.randrange(1, 6))] for _ in range(20)]
    d, n, m = lookup(c, rows, k=3, w=5)
    for b, row in enumerate(rows):
        bn, bd = brute(docs, row, 3, 3, 5)
        assert m[b].item() == bn and n[b].item() == len(bd), row
        assert d[b, : len(bd)].tolist() == bd, row
        assert (d[b, len(bd):] == -1).all(), row


@pytest.mark.parametrize("seed", range(3))
def test_host_and_device_lookups_agree(seed):
    # the CPU path probes dictionaries; other devices binary-search sorted keys: both on the CPU here
    rnd = random.Random(seed)
    docs = [[rnd.randrange(7) for _ in range(rnd.randrange(2, 25))] for _ in range(10)]
    c = NGramCorpus.build(docs, vocab=7, n_max=4, k_max=3)
    rows = [[rnd.randrange(-1, 9) for _ in range(rnd.randrange(1, 7))] for _ in range(30)]  # foreign ids too
    width = max(map(len, rows))
    seq = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    lens = torch.tensor([len(r) for r in rows])
    for top in (1, 4):
        host, device = c._find_host(seq, lens, 3, top), c._find_device(seq, lens, 3, top)
        assert torch.equal(host[0], device[0]) and torch.equal(host[1], device[1])
    assert (host[1] > 0).any() and (host[1] < 4).any()


def test_keys_are_exact_and_n_max_fits_int64():
    assert max_exact_n(49152, 4) == 4 and max_exact_n(262144, 4) == 3 and max_exact_n(10, 2) == 2
    w = torch.tensor([[49151, 0, 49151, 3], [49151, 0, 49151, 4]])
    assert pack_keys(w, 49152).unique().numel() == 2 and (pack_keys(w, 49152) > 0).all()
    c = NGramCorpus.build([[1, 2, 3, 4, 5]], vocab=262144, n_max=4)
    assert c.n_max == 3


def test_bad_input():
    for docs in ([], [[]], [[1], [2]]):
        with pytest.raises(ValueError, match="two tokens"):
            NGramCorpus.build(docs, vocab=5)
    with pytest.raises(ValueError, match="lie in"):
        NGramCorpus.build([[1, 5]], vocab=5)
    c = NGramCorpus.build([[1, 2]], vocab=5)
    assert c.n_max == 1
    with pytest.raises(ValueError):
        lookup(c, [[1]], k=0, w=1)
    # context ids outside the corpus vocabulary never match (and never index out of range)
    d, n, m = lookup(c, [[1, 77]], k=1, w=1)
    assert m.tolist() == [0]


@pytest.mark.parametrize("span", [1, 4])
def test_save_load_round_trip(tmp_path, span):
    c = NGramCorpus.build([[1, 2, 3], [3, 2, 1, 2, 3, 3], [2, 1, 0]], vocab=4, n_max=2, k_max=2, span=span, meta={"x": 1})
    c.save(tmp_path / "c.pt")
    r = NGramCorpus.load(tmp_path / "c.pt")
    assert torch.equal(r.tokens, c.tokens) and r.meta == {"x": 1} and (r.n_max, r.k_max, r.span) == (2, 2, span)
    assert all(torch.equal(a, b) for a, b in zip(r.keys + r.starts, c.keys + c.starts))
    torch.save({"version": 0}, tmp_path / "old.pt")
    with pytest.raises(ValueError, match="version"):
        NGramCorpus.load(tmp_path / "old.pt")


def test_drafter_slot_order_by_hand():
    # context: longest match 7 8 5 6 -> 7 9 5; q-match 6 -> 7 8 5; corpus: suffix 5 6 -> 1 2 3
    seq = [5, 6, 7, 8, 5, 6, 7, 9, 5, 6, 7, 8, 5, 6]
    corpus = NGramCorpus.build([[5, 6, 1, 2, 3]], vocab=16, n_max=4)
    state = DecodeState(torch.tensor([seq]), torch.tensor([len(seq)]), [len(seq)])
    drafter = NGrammysDrafter(None, k=4, w=3, strategy="context", corpus=corpus, c=1)
    drafts, source, rank = drafter.drafts(state, 3)
    assert drafts[0].tolist() == [[7, 9, 5], [1, 2, 3], [7, 8, 5], [-1] * 3]
    n_src = NodeAcceptance.sources(1, 4)
    assert source[0, :3].tolist() == [4, n_src + 2 - 1, 1] and rank[0, :3].tolist() == [0, 0, 0]
    # a free verification keeps every node; each node's cell has its slot's source
    cost = StepCost({1: 1.0, 16: 1.0}, explore_every=0)
    drafter = NGrammysDrafter(None, k=4, w=3, strategy="context", corpus=corpus, c=1,
                              acceptance=NodeAcceptance(4, 3, corpus=True))
    tree = drafter.propose(state, Budget.static(1, 3, cost))
    assert tree.size == 1 + 3 + 3 + 2  # 7 shared by both context drafts
    sources = sorted(set((drafter._slot // (4 * 3 * NodeAcceptance.SUPPORT)).tolist()[0][1:]))
    assert sources == [1, 4, n_src + 1]
    with pytest.raises(ValueError, match="corpus"):
        NGrammysDrafter(None, k=4, w=3, strategy="context", c=1)
    with pytest.raises(ValueError, match="c must"):
        NGrammysDrafter(None, k=4, w=3, strategy="context", corpus=corpus, c=5)
    with pytest.raises(ValueError, match="acceptance table"):
        NGrammysDrafter(None, k=4, w=3, strategy="context", corpus=corpus, c=1, acceptance=NodeAcceptance(4, 3))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_ngrammys_with_corpus_matches_transformers(arch):
    model = tiny_model(arch)
    prompts = [prompt_of(5, seed=5), prompt_of(30, seed=30), prompt_of(12, seed=12)]
    plain = SpecDecoder(model, corpus=None)
    corpus = generate_corpus(plain, prompts[:2], max_new_tokens=30, batch_size=2)
    assert corpus.meta["documents"] == 2
    dec = SpecDecoder(model, corpus=corpus)
    refs = [hf_generate(model, p, 30, GREEDY) for p in prompts]
    for verify in ("tree", "batch", "chain"):
        # static: every draft is verified, so the corpus hits below do not depend on a timing-based plan
        out = dec.generate_ids(prompts, "ngrammys", 30, GREEDY, k=5, w=4, verify=verify, schedule="static")
        assert dec.generate_ids(prompts, "ngrammys", 30, GREEDY, k=5, w=4, verify=verify).tokens == refs
        assert out.tokens == refs, verify
        alloc = out.stats.drafter["allocation"]
        assert alloc["corpus_slots"] > 0
        if verify != "chain":  # two of the prompts' replies are in the corpus: its drafts get accepted
            assert alloc["corpus_accepted"] > 0, verify
        assert alloc["context_slots"] + alloc["corpus_slots"] + alloc["bigram_slots"] == alloc["steps"] * (5 if verify != "chain" else 1)
    off = dec.generate_ids(prompts, "ngrammys", 30, GREEDY, k=5, w=4, c=0)
    assert off.tokens == refs and off.stats.drafter["allocation"]["corpus_slots"] == 0


def test_corpus_checks_in_the_decoder():
    model = tiny_model("llama")  # vocabulary of 96 ids
    with pytest.raises(ValueError, match="vocabulary"):
        SpecDecoder(model, corpus=NGramCorpus.build([[1, 2]], vocab=200))
    with pytest.raises(TypeError, match="corpus must be"):
        SpecDecoder(model, corpus=3)
    dec = SpecDecoder(model, corpus=None)
    with pytest.raises(ValueError, match="corpus"):
        dec.generate_ids([[3, 4]], "ngrammys", 4, GREEDY, c=2)
    # a loaded model without a tokenizer finds no shipped corpus: c defaults to 0
    assert SpecDecoder(model).ngram_corpus() is None
    assert dec.generate_ids([[3, 4, 3, 4]], "ngrammys", 6, GREEDY).tokens == [hf_generate(model, [3, 4, 3, 4], 6, GREEDY)]


def test_shipped_corpus_fits_the_embedded_model_and_decodes_losslessly():
    dec = SpecDecoder("smollm2", dtype="fp32")
    corpus = dec.ngram_corpus()
    assert corpus is not None, "no shipped corpus matches the embedded tokenizer"
    assert corpus.meta["vocab_fingerprint"] == vocab_fingerprint(dec.tokenizer) and corpus.meta["documents"] == 610
    assert corpus.meta["excluded"]  # the training prompts that are also dev prompts
    ids = dec.encode("Write a short Python function that returns the sum of a list.")
    # context + corpus: the default mixed strategy would first compute the bigram table (minutes on a fresh cache)
    out = dec.generate_ids([ids], "ngrammys", 24, GREEDY, strategy="context")
    assert out.tokens[0] == hf_generate(dec.model, ids, 24, GREEDY)
    assert out.stats.drafter["allocation"]["corpus_slots"] > 0


def test_ngram_corpus_command(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": str(i), "category": "qa", "chat": True, "prompt": p}) + "\n"
                               for i, p in enumerate(["Name a colour.", "Count to five.", "Say hello."])))
    held_out = tmp_path / "dev.jsonl"
    held_out.write_text(json.dumps({"id": "d", "category": "qa", "chat": True, "prompt": "Say hello."}) + "\n")
    out = tmp_path / "c.pt"
    proc = subprocess.run([sys.executable, "-m", "specdec.cli", "ngram-corpus", "--prompts", str(prompts), "--dtype", "fp32",
                           "--max-new-tokens", "6", "--exclude", str(held_out), "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    c = NGramCorpus.load(out)
    assert c.meta["documents"] == 2 and c.meta["excluded"] == ["2"]
    assert c.meta["max_new_tokens"] == 6 and c.meta["weights_key"]
    assert int((c.tokens >= 0).sum()) <= 2 * (8 + 6)
    dec = SpecDecoder("smollm2", dtype="fp32", corpus=out)
    assert dec.ngram_corpus().meta == c.meta
    foreign = NGramCorpus.build([[1, 2]], vocab=8, meta={"vocab_fingerprint": "another tokenizer"})
    with pytest.raises(ValueError, match="another tokenizer"):
        SpecDecoder(dec.model, tokenizer=dec.tokenizer, corpus=foreign)
    assert shipped_corpus(dec.tokenizer, folder=tmp_path) is not None  # the fingerprint is recorded
