"""hybrid: the store of past outputs (bound, persistence, bad files), recycled successors, the ranking of sources,
learning across requests and processes, and sampling with a planted bug."""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch

from specdec.api import SpecDecoder, hf_generate
from specdec.contracts import DecodeState
from specdec.drafters.hybrid import HybridDrafter, SuccessorTable
from specdec.suffix_store import SuffixStore
from specdec.tree import SparseProbs
from specdec.verify import SamplingConfig
from tests.test_sampling import POWER, e2e_pvalues
from tests.conftest import tiny_model
from tests.test_greedy_lossless import prompt_of
from tests.test_sampling import e2e_decoder  # noqa: F401 (the fixture)

GREEDY = SamplingConfig()


def test_store_drafts_the_continuation_of_the_longest_suffix_by_hand():
    store = SuffixStore(50, n_max=3)
    store.add([[1, 2, 3, 4, 5], [9, 2, 3, 7, 8], [2, 3, 7, 6]])
    seq = torch.tensor([[0, 9, 2, 3, 0], [0, 0, 0, 4, 0], [11, 12, 0, 0, 0]])
    drafts, count, match_n = store.match(seq, torch.tensor([4, 4, 2]), k=3, w=2)
    # row 0 ends "9 2 3": only the second output continues it; row 1 ends "4": the first output's "5";
    # row 2's "11 12" / "12" never occurred
    assert match_n.tolist() == [3, 1, 0] and count.tolist() == [1, 1, 0]
    assert drafts[0, 0].tolist() == [7, 8] and drafts[1, 0].tolist() == [5, -1]
    assert (drafts[2] == -1).all()
    # the suffix "2 3" alone: three continuations, each seen once, so the latest first
    drafts, count, match_n = store.match(torch.tensor([[5, 2, 3]]), torch.tensor([3]), k=3, w=2)
    assert match_n.item() == 2 and drafts[0].tolist() == [[7, 6], [7, 8], [4, 5]]
    store.add([[2, 3, 4, 5]])  # now "4 5" was seen twice: the more frequent first
    drafts, *_ = store.match(torch.tensor([[5, 2, 3]]), torch.tensor([3]), k=3, w=2)
    assert drafts[0].tolist() == [[4, 5], [7, 6], [7, 8]]


def test_store_tiers_agree_with_one_index_and_never_pass_the_bound():
    rng = np.random.default_rng(0)
    store = SuffixStore(30, n_max=3, k_max=2, max_tokens=5000)
    docs = []
    for step in range(60):
        new = [rng.integers(0, 30, size=rng.integers(2, 120)).tolist() for _ in range(4)]
        store.add(new)
        docs += new
        assert store.num_tokens <= 5000
        assert store.docs == docs[len(docs) - len(store.docs):]  # the newest outputs, oldest gone first
    assert len(store.docs) < len(docs) and store.recent is not None or store.base is not None
    # both tiers together draft as one index over the same outputs does
    whole = SuffixStore(30, n_max=3, k_max=2, max_tokens=10**6)
    whole.add(store.docs)
    seq = torch.tensor(rng.integers(0, 30, size=(40, 6)))
    lens = torch.full((40,), 6)
    got, want = store.match(seq, lens, 2, 4), whole.match(seq, lens, 2, 4)
    assert torch.equal(got[2], want[2])  # the same longest suffix per row
    # a document longer than the bound keeps its end
    store.add([list(range(30)) * 200])
    assert store.docs == [(list(range(30)) * 200)[-5000:]]


def test_store_checks_its_input():
    with pytest.raises(ValueError, match="max_tokens"):
        SuffixStore(10, max_tokens=1)
    with pytest.raises(ValueError, match=r"\[0, 10\)"):
        SuffixStore(10).add([[1, 2, 10]])
    store = SuffixStore(10)
    store.add([[3], []])  # too short to continue anything: skipped
    assert len(store) == 0 and store.match(torch.tensor([[3]]), torch.tensor([1]), 2, 2)[1].item() == 0


def test_store_round_trips_and_bad_files_raise(tmp_path):
    store = SuffixStore(40, n_max=3, fingerprint="abc")
    store.add([[1, 2, 3, 4], [5, 6, 7]])
    path = tmp_path / "store.npz"
    store.save(path)
    back = SuffixStore.load(path, 40, "abc")
    assert back.docs == store.docs and back.n_max == 3
    seq, lens = torch.tensor([[1, 2]]), torch.tensor([2])
    assert torch.equal(back.match(seq, lens, 2, 3)[0], store.match(seq, lens, 2, 3)[0])
    assert SuffixStore.load(path, 40, "abc", max_tokens=4).docs == [[5, 6, 7]]  # a smaller bound keeps the newest
    with pytest.raises(ValueError, match="another vocabulary"):
        SuffixStore.load(path, 41, "abc")
    with pytest.raises(ValueError, match="another vocabulary"):
        SuffixStore.load(path, 40, "xyz")
    raw = path.read_bytes()
    (tmp_path / "cut.npz").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ValueError, match="not a readable suffix store"):
        SuffixStore.load(tmp_path / "cut.npz", 40)
    (tmp_path / "junk.npz").write_bytes(b"\x00" * 300)
    with pytest.raises(ValueError, match="not a readable suffix store"):
        SuffixStore.load(tmp_path / "junk.npz", 40)
    np.savez(tmp_path / "other.npz", keys=np.arange(3))  # another npz (a phrase pool's fields, say)
    with pytest.raises(ValueError, match="not a suffix store file"):
        SuffixStore.load(tmp_path / "other.npz", 40)
    with np.load(path) as z:
        fields = {k: z[k] for k in z.files}
    for name, value in (("tokens", np.array([1, 2, 3, 99, 5, 6, 7], dtype=np.int32)),
                        ("lengths", np.array([4, 4]))):
        np.savez(tmp_path / "bad.npz", **{**fields, name: value})
        with pytest.raises(ValueError, match="corrupt suffix store"):
            SuffixStore.load(tmp_path / "bad.npz", 40)


def test_a_failed_save_leaves_the_old_file(tmp_path, monkeypatch):
    store = SuffixStore(40)
    store.add([[1, 2, 3]])
    path = tmp_path / "store.npz"
    store.save(path)
    before = path.read_bytes()
    store.add([[4, 5, 6]])

    def fail(f, **arrays):
        f.write(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez", fail)
    with pytest.raises(OSError, match="disk full"):
        store.save(path)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["store.npz"]  # no temporary file left


def test_successor_table_keeps_the_newest_distinct_successors_by_hand():
    table = SuccessorTable(10, r=3)
    table.observe(torch.tensor([1, 2]), torch.tensor([[4], [5]]))
    table.observe(torch.tensor([1]), torch.tensor([[6]]))
    table.observe(torch.tensor([1, 3]), torch.tensor([[4], [-1]]))  # 4 again: back to the front; -1: nothing
    assert table.table[1].tolist() == [4, 6, -1] and table.table[2].tolist() == [5, -1, -1]
    assert (table.table[3] == -1).all()
    table.observe(torch.tensor([1]), torch.tensor([[7, 8]]))  # sampling: the target's likeliest tokens, in order
    assert table.table[1].tolist() == [7, 8, 4]
    table.observe(torch.tensor([4, 5]), torch.tensor([[5], [1]]))
    # chains: successor i of the root, then each token's newest successor
    assert table.chains(torch.tensor([1]), 2, 4).tolist() == [[[7, -1, -1, -1], [8, -1, -1, -1]]]
    assert table.chains(torch.tensor([4]), 1, 4).tolist() == [[[5, 1, 7, -1]]]


def test_sources_are_ranked_and_cut_to_k_by_hand():
    from specdec.policies import NodeAcceptance

    store, table = SuffixStore(20, n_max=3), SuccessorTable(20, r=2)
    store.add([[9, 1, 2, 3, 4]])
    table.observe(torch.tensor([2]), torch.tensor([[8]]))
    drafter = HybridDrafter(None, store=store, s=1, successors=table, r=1, k=3, w=2, q=1, n_max=3,
                            strategy="context", acceptance=NodeAcceptance(3, 2, 1, 3, store=True, recycle=True))
    seq = torch.tensor([[5, 1, 2, 6, 1, 2]])
    state = DecodeState(seq, torch.tensor([6]), [6])
    drafts, source, rank = drafter.drafts(state, 2)
    # context: "1 2" occurred before (then 6 1), the store: "1 2" then "3 4", recycled: 2 -> 8
    assert drafts[0].tolist() == [[6, 1], [3, 4], [8, -1]]
    store0 = 2 + 2  # bigram, last-q, two longest-suffix sources
    assert source[0].tolist() == [2, store0 + 1, store0 + 3] and rank[0].tolist() == [0, 0, 0]
    assert [drafter.KINDS[drafter.source_kind(s)] for s in source[0].tolist()] == ["context", "store", "recycle"]
    with pytest.raises(ValueError, match="acceptance table does not fit"):
        HybridDrafter(None, store=store, s=1, k=3, w=2, n_max=3, strategy="context",
                      acceptance=NodeAcceptance(3, 2, 1, 3))
    with pytest.raises(ValueError, match="need a suffix store"):
        HybridDrafter(None, s=1, k=3, w=2, strategy="context")


def test_the_store_learns_across_requests_and_processes(tmp_path):
    """A second decoder that loads the first one's store file drafts the first one's outputs from it: the same
    prompt again is answered mostly from the store; and every output is the target's own."""
    path = str(tmp_path / "store.npz")
    model = tiny_model("llama")
    prompts = [prompt_of(9, seed=4), prompt_of(20, seed=5)]
    refs = [hf_generate(model, p, 30, GREEDY) for p in prompts]
    opts = dict(store_file=path, r=0, c=0, schedule="static", govern=0, k=2, w=4, n_max=3)
    first = SpecDecoder(model).generate_ids(prompts, "hybrid", 30, GREEDY, **opts)
    assert first.tokens == refs and os.path.exists(path)
    assert SuffixStore.load(path, model.config.vocab_size).num_tokens == sum(min(len(p), 8) + 29 for p in prompts)
    again = SpecDecoder(model).generate_ids(prompts, "hybrid", 30, GREEDY, **opts)
    assert again.tokens == refs
    alloc = again.stats.drafter["allocation"]
    assert alloc["store_accepted"] > first.stats.drafter["allocation"]["store_accepted"]
    assert again.stats.accepted_tokens > first.stats.accepted_tokens
    assert again.stats.drafter["store"]["documents"] == 4
    # a store file of another vocabulary is refused with a clear error, not read
    SuffixStore(7).save(tmp_path / "foreign.npz")
    with pytest.raises(ValueError, match="another vocabulary"):
        SpecDecoder(model).generate_ids(prompts, "hybrid", 4, GREEDY, store_file=str(tmp_path / "foreign.npz"))


def test_recycling_learns_the_targets_successors():
    from specdec.tree import DraftTree
    from specdec.verify import VerifyResult

    # by hand: a verdict's argmax at every valid node goes to that node's token's row
    drafter = HybridDrafter(None, successors=SuccessorTable(20, r=2), r=2, k=3, w=3, strategy="context")
    tree = DraftTree.from_chains(torch.tensor([5, 9]), [[[3, 4], [7]], [[8]]])
    argmax = torch.full(tree.tokens.shape, -1, dtype=torch.int64)
    argmax[tree.valid] = torch.arange(11, 11 + int(tree.valid.sum()))
    verdict = VerifyResult(torch.zeros_like(argmax), torch.ones(2, dtype=torch.int32), argmax[:, 0],
                           torch.ones(2, dtype=torch.bool), target_argmax=argmax)
    drafter.observe_verdict(tree, verdict)
    for tok, want in zip(tree.tokens[tree.valid].tolist(), argmax[tree.valid].tolist()):
        assert drafter.successors.table[tok, 0].item() == want
    # end to end: the table learns from the target's verdicts, and its chains are drafted
    dec = SpecDecoder(tiny_model("llama"))
    prompt = prompt_of(12, seed=6)
    out = dec.generate_ids([prompt], "hybrid", 30, GREEDY, s=0, c=0, schedule="static", govern=0)
    assert out.tokens[0] == hf_generate(dec.model, prompt, 30, GREEDY)
    table = next(v for k, v in dec._learned.items() if k[-1] == "successors")
    seq = prompt + out.tokens[0]
    # every committed token stood at a verified node, so it has a successor (which one depends on the contexts
    # the token was verified in since: a random tiny model's argmax follows its context more than its last token)
    assert all(table.table[a, 0] >= 0 for a in seq[len(prompt) - 1:-1])
    assert (table.table[:, 0] >= 0).sum() > len(set(seq[len(prompt) - 1:-1]))  # rejected draft nodes too
    assert out.stats.drafter["allocation"]["recycle_slots"] > 0


def recycled_as_sampled(original):
    """A planted bug: each draft node that is a recycled successor of its parent is verified as if drawn from
    the uniform distribution over the parent's recycled successors (a q it was never drawn from)."""

    def propose(self, state, budget):
        tree = original(self, state, budget)
        if self.successors is None:
            return tree
        table = self.successors.on(tree.tokens.device)
        parent_tok = tree.tokens.gather(1, tree.parents.clamp(min=0))
        ids = table[parent_tok.clamp(min=0)]  # [B,T,r]
        hit = (ids == tree.tokens[..., None]).any(-1) & (tree.parents >= 0) & tree.valid
        q = (ids >= 0).float() / (ids >= 0).sum(-1, keepdim=True).clamp(min=1)
        return dataclasses.replace(tree, draft_probs=SparseProbs(torch.where(hit[..., None], ids, -1),
                                                                 torch.where(hit[..., None], q, 0.0)))

    return propose


def test_hybrid_planted_bug_is_detected(e2e_decoder, monkeypatch):
    """End to end power: the chi-square harness that passes hybrid (the registry's case in test_sampling) fails it
    when recycled successors are verified against a proposal they were not drawn from."""
    monkeypatch.setattr(HybridDrafter, "propose", recycled_as_sampled(HybridDrafter.propose))
    pvals, drafted, accepted, _ = e2e_pvalues(e2e_decoder, "hybrid:s=0:c=0", "temp0.8", False, rows=3000)
    assert drafted > 1500 and accepted > 0, (drafted, accepted)
    assert min(pvals.values()) < POWER, pvals


def test_a_store_is_warmed_from_an_ngram_corpus(tmp_path, capsys):
    from specdec.ngram_corpus import NGramCorpus
    from specdec.suffix_store import main

    docs = [[1, 2, 3, 4], [5, 6, 7], [8, 9]]
    NGramCorpus.build(docs, 20, meta={"vocab_fingerprint": "fp"}).save(tmp_path / "corpus.pt")
    main(["--from-corpus", str(tmp_path / "corpus.pt"), "--out", str(tmp_path / "store.npz"), "--max-tokens", "7"])
    store = SuffixStore.load(tmp_path / "store.npz", 20, "fp")
    assert store.docs == [[5, 6, 7], [8, 9]] and store.max_tokens == 7  # the newest within the bound
    assert "2 outputs, 5 tokens (of 9" in capsys.readouterr().out
