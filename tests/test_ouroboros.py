"""Ouroboros: the phrase pool, the lookahead window, the drafter's parts and its errors."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from specdec.api import SpecDecoder
from specdec.drafters import ouroboros
from specdec.drafters.lookahead import JacobiWindow, check_window, window_size
from specdec.drafters import phrase_pool
from specdec.drafters.phrase_pool import PhrasePool
from specdec.tree import DraftTree
from tests.conftest import tiny_model
from tests.test_feature_draft import VOCAB, tiny_eagle
from tests.test_greedy_lossless import perturbed


# ---- the phrase pool ---------------------------------------------------------------------------------------

def test_pool_keeps_capacity_phrases_per_key_and_evicts_the_oldest():
    pool = PhrasePool(50, capacity=3, phrase_len=3)
    for p in ([1, 2], [3, 4], [5, 6], [7, 8]):
        pool.insert(9, p)
    assert pool.lookup(9) == [[7, 8], [5, 6], [3, 4]]  # newest first, [1, 2] evicted
    assert pool.lookup(9, 2) == [[7, 8], [5, 6]]
    assert pool.lookup(10) == [] and len(pool) == 3


def test_pool_refresh_on_hit_protects_a_phrase_from_eviction():
    pool = PhrasePool(50, capacity=3, phrase_len=3)
    for p in ([1, 2], [3, 4], [5, 6]):
        pool.insert(9, p)
    pool.insert(9, [1, 2])  # a hit: refreshed, now the newest
    pool.insert(9, [7, 8])  # evicts the least recently touched: [3, 4]
    assert pool.lookup(9) == [[7, 8], [1, 2], [5, 6]]
    assert pool.stats()["refreshes"] == 1


def test_pool_dedups_prefixes_and_extensions():
    pool = PhrasePool(50, capacity=4, phrase_len=4)
    pool.insert(1, [2, 3, 4])
    pool.insert(1, [2, 3])  # a prefix of a stored phrase: only a refresh
    assert pool.lookup(1) == [[2, 3, 4]]
    pool.insert(1, [2, 3, 4, 5, 6])  # extends it (cut to P = 4): replaces it
    assert pool.lookup(1) == [[2, 3, 4, 5]]
    pool.insert(1, [2, 7])
    assert pool.lookup(1) == [[2, 7], [2, 3, 4, 5]]


def test_pool_insert_counts_saturate_and_extensions_count_once():
    pool = PhrasePool(50, capacity=2, phrase_len=4)
    pool.insert(1, [2, 3])
    pool.insert(1, [2, 3, 4])  # an extension: one more sighting
    assert pool.lookup_tagged(1) == [([2, 3, 4], 0, 2)]
    for _ in range(300):
        pool.insert(1, [2, 3, 4])
    assert pool.lookup_tagged(1)[0][2] == 255


def test_pool_remove_and_replace():
    pool = PhrasePool(50, capacity=3, phrase_len=3)
    for p in ([1, 2], [3, 4], [5, 6]):
        pool.insert(9, p)
    assert pool.remove(9, [1, 2]) and not pool.remove(9, [1, 2]) and not pool.remove(9, [3])
    pool.replace(9, [3, 4], [3, 5, 6])
    assert sorted(pool.lookup(9)) == [[3, 5, 6], [5, 6]]
    assert pool.lookup(9)[0] == [3, 5, 6]


def test_pool_source_tags_keep_the_highest_and_survive_a_round_trip(tmp_path):
    pool = PhrasePool(50, capacity=3, phrase_len=3)
    pool.insert(1, [2, 3], source=0)
    pool.insert(1, [2, 3], source=2)  # a refresh raises the tag
    pool.insert(1, [2], source=1)  # a prefix refresh never lowers it
    pool.insert(1, [4, 5], source=3)
    assert pool.lookup_tagged(1) == [([4, 5], 3, 1), ([2, 3], 2, 3)]  # (phrase, source, times inserted)
    assert pool.lookup(1, order="frequent") == [[2, 3], [4, 5]]
    pool.save(tmp_path / "p.npz")
    assert PhrasePool.load(tmp_path / "p.npz").lookup_tagged(1) == [([4, 5], 3, 1), ([2, 3], 2, 3)]
    with pytest.raises(ValueError, match="order"):
        pool.lookup(1, order="best")


def test_pool_rejects_bad_keys_and_tokens():
    pool = PhrasePool(10, capacity=2, phrase_len=2)
    with pytest.raises(ValueError, match="outside the pool's vocabulary"):
        pool.insert(10, [1])
    with pytest.raises(ValueError, match="phrase tokens"):
        pool.insert(1, [1, 12])
    for args in ((0, 1, 1), (10, 0, 1), (10, 1, 0)):
        with pytest.raises(ValueError, match="must be >= 1"):
            PhrasePool(*args)


def test_pool_save_load_round_trip_and_atomic_write(tmp_path, monkeypatch):
    pool = PhrasePool(100, capacity=3, phrase_len=4)
    rng = np.random.default_rng(0)
    for _ in range(200):
        pool.insert(int(rng.integers(100)), rng.integers(0, 100, size=int(rng.integers(1, 6))).tolist())
    path = tmp_path / "pool.npz"
    pool.save(path)
    back = PhrasePool.load(path, 100, 3, 4)
    for key in range(100):
        assert back.lookup(key) == pool.lookup(key)
    assert os.listdir(tmp_path) == ["pool.npz"]  # no temporary file left behind
    # A write that fails half-way (disk full) leaves the old file as it was.
    before = path.read_bytes()

    def half_write(f, **arrays):
        f.write(b"PK half a file")
        raise OSError("no space left on device")

    monkeypatch.setattr(phrase_pool.np, "savez", half_write)
    with pytest.raises(OSError, match="no space"):
        pool.save(path)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["pool.npz"]


def test_pool_load_rejects_corrupt_and_mismatched_files(tmp_path):
    pool = PhrasePool(100, capacity=3, phrase_len=4)
    pool.insert(5, [1, 2, 3])
    good = tmp_path / "pool.npz"
    pool.save(good)
    with pytest.raises(ValueError, match="vocabulary is 100"):
        PhrasePool.load(good, vocab_size=200)
    with pytest.raises(ValueError, match="phrase length is 4"):
        PhrasePool.load(good, 100, 3, 5)
    truncated = tmp_path / "truncated.npz"
    truncated.write_bytes(good.read_bytes()[:100])
    with pytest.raises(ValueError, match="not a readable phrase pool"):
        PhrasePool.load(truncated)
    other = tmp_path / "other.npz"
    np.savez(other, x=np.zeros(3))
    with pytest.raises(ValueError, match="not a phrase pool file"):
        PhrasePool.load(other)
    with np.load(good) as z:
        fields = {k: z[k] for k in z.files}
    bad = tmp_path / "bad.npz"
    for name, change in (("phrases", 1000), ("seen", -1), ("lens", -3)):  # ids outside the vocabulary, a used
        broken = dict(fields)                                              # slot seen 0 times or empty
        broken[name] = (fields[name].astype(np.int64) + change).astype(fields[name].dtype)
        np.savez(bad, **broken)
        with pytest.raises(ValueError, match="corrupt"):
            PhrasePool.load(bad)
    broken = dict(fields, sources=fields["sources"] + 9)
    np.savez(bad, **broken)
    PhrasePool.load(bad)  # any tag is a valid pool ...
    with pytest.raises(ValueError, match="corrupt"):
        PhrasePool.load(bad, max_source=3)  # ... but not for a drafter that knows 4 sources


# ---- the lookahead window ---------------------------------------------------------------------------------

@pytest.mark.parametrize("width,level", [(2, 3), (4, 3), (3, 5)])
def test_window_is_a_tree_with_the_lookahead_depths(width, level):
    w = JacobiWindow(width, level, list(range(10, 30)), np.random.default_rng(0))
    toks, pars = w.layout(1)
    assert len(toks) == w.size == window_size(width, level)
    tree = DraftTree.from_parents(torch.tensor([[7] + toks]), torch.tensor([[-1] + pars]))  # checks parents < child
    depth = tree.depth[0].tolist()
    expect = [0] + [j + 1 for j in range(width - 1)] + [j + lv for lv in range(1, level - 1) for j in range(width)]
    assert depth == expect
    # level-l column j sees level 0 before column j and levels 1..l of column j
    node = 1 + (width - 1) + (level - 3) * width + (width - 1)  # the last level's last column
    chain = []
    while node > 0:
        chain.append(node)
        node = pars[node - 1]
    assert len(chain) == depth[1 + w.size - 1]


def test_window_update_spells_ngrams_and_shifts():
    w = JacobiWindow(3, 4, [1], np.random.default_rng(0))
    w.levels = [[10, 11], [20, 21, 22], [30, 31, 32]]
    grams = w.update(99, [40, 41, 42])
    assert grams == [(99, [20, 30, 40]), (10, [21, 31, 41]), (11, [22, 32, 42])]
    assert w.levels == [[21, 22], [30, 31, 32], [40, 41, 42]]


def test_window_too_small_is_refused():
    with pytest.raises(ValueError, match="W >= 2"):
        check_window(1, 3)
    with pytest.raises(ValueError, match="N >= 3"):
        check_window(4, 2)


# ---- the method ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dec():
    target = tiny_model("llama")
    return SpecDecoder(target, draft=perturbed(target, 0.3))


@pytest.fixture(scope="module")
def exact_dec():
    """The draft is the target: the window's n-grams are the target's own continuations, so the draft's walk
    into pool phrases and the target's acceptance of appended phrases both happen."""
    target = tiny_model("llama")
    return SpecDecoder(target, draft=perturbed(target, 0.0))


def prompts_of(seed: int, lens=(5, 9, 14)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 90, (n,), generator=g).tolist() for n in lens]


PARTS = [dict(lookahead=a, lengthen=b, verification=c, history=d, context=e) for a in (0, 1) for b in (0, 1)
         for c in (0, 1) for d in (0, 1) for e in (0, 1)]


@pytest.mark.parametrize("parts", PARTS, ids=lambda p: "".join(str(v) for v in p.values()))
def test_every_combination_of_parts_is_lossless(exact_dec, parts):
    prompts = prompts_of(1)
    ref = exact_dec.generate_ids(prompts, "ar", 30).tokens
    for attach in ("last", "all"):
        res = exact_dec.generate_ids(prompts, "ouroboros", 30, **parts, attach=attach, gamma=4)
        assert res.tokens == ref, (parts, attach)


@pytest.mark.parametrize("lookahead", [0, 1])
def test_a_long_prompt_computes_only_the_logits_the_walk_reads(exact_dec, monkeypatch, lookahead):
    """A draft forward that feeds a long context (a catch-up after many plain steps; the prompt too, where the
    draft's prefill does not read it first): past CATCH_UP_ALL_LOGITS columns it asks for the anchor's, the
    phrases' and the window's logits only (a [B, prompt, V] tensor was the largest allocation of a call), and
    the drafts, walk and window updates read the same values: the output, the drafts and the pool are unchanged.
    By default the draft's prefill reads the prompt, and the output is the same."""
    from specdec.drafters.draft_model import DraftModelDrafter
    from specdec.model import ModelRunner

    exact_dec.reset_learned()
    prompts = prompts_of(3, lens=(70, 90, 130))
    ref = exact_dec.generate_ids(prompts, "ar", 24).tokens
    opts = dict(gamma=3, schedule="static", lookahead=lookahead, govern=0)
    prefill, read = ModelRunner.prefill, []

    def reading(self, *a, **k):
        read.append(self is exact_dec.get_draft()[1])
        return prefill(self, *a, **k)

    monkeypatch.setattr(ModelRunner, "prefill", reading)
    first = exact_dec.generate_ids(prompts, "ouroboros", 24, **opts)
    assert first.tokens == ref
    assert read.count(True) == 1  # the draft's one prompt read
    exact_dec.reset_learned()
    monkeypatch.setattr(DraftModelDrafter, "read_prompt", lambda self, state: None)
    forward, asked = ModelRunner.forward_tree, []

    def recording(self, tree, *a, logits_at=None, **k):
        if self is exact_dec.get_draft()[1] and logits_at is not None:
            asked.append((tree.tokens.shape[1], len(logits_at)))
        return forward(self, tree, *a, logits_at=logits_at, **k)

    monkeypatch.setattr(ModelRunner, "forward_tree", recording)
    res = exact_dec.generate_ids(prompts, "ouroboros", 24, **opts)
    assert res.tokens == ref
    assert asked and all(n < t for t, n in asked)  # fewer columns than the forward's nodes
    # the prefill's read drafts as the chain's does: the same drafts, acceptances, walk and pool
    assert (first.stats.drafted_tokens, first.stats.accepted_tokens, first.stats.drafter["ouroboros"]) == (
        res.stats.drafted_tokens, res.stats.accepted_tokens, res.stats.drafter["ouroboros"])
    exact_dec.reset_learned()
    monkeypatch.setattr(ouroboros, "CATCH_UP_ALL_LOGITS", 10**6)  # every column's logits, as before
    full = exact_dec.generate_ids(prompts, "ouroboros", 24, **opts)
    assert full.tokens == ref
    assert (full.stats.drafted_tokens, full.stats.accepted_tokens, full.stats.drafter["ouroboros"]) == (
        res.stats.drafted_tokens, res.stats.accepted_tokens, res.stats.drafter["ouroboros"])


def test_the_walk_and_the_phrases_happen_and_stay_exact(exact_dec):
    exact_dec.reset_learned()
    prompts = prompts_of(2)
    ref = exact_dec.generate_ids(prompts, "ar", 40).tokens
    res = exact_dec.generate_ids(prompts, "ouroboros", 40, gamma=5, schedule="static", lookahead=1, context=0, govern=0)
    assert res.tokens == ref
    s = res.stats.drafter["ouroboros"]
    assert s["walk_tokens"] > 0 and s["phrase_tokens_accepted"] > 0 and s["from_window"] > 0, s
    assert res.stats.draft_calls < s["chain_tokens"]  # phrases saved draft forwards


def test_committed_text_feeds_the_pool_and_its_phrases_are_accepted(dec):
    """context=1: a prompt that repeats itself puts its phrases in the pool before the first step, and the
    target accepts them (the draft is a poor one here, so the phrases do the work)."""
    dec.reset_learned()
    loop = [11, 12, 13, 14, 15, 16, 17, 18]
    prompts = [loop * 4, [3] + loop * 3]
    ref = dec.generate_ids(prompts, "ar", 24).tokens
    res = dec.generate_ids(prompts, "ouroboros", 24, context=1, lookahead=0, attach="all", history=0)
    assert res.tokens == ref
    s = res.stats.drafter
    assert s["ouroboros"]["from_context"] >= len(loop * 7) - 2 * 4
    if ref[0][:8] == loop:  # the tiny target continues the loop: the context phrases must have been accepted
        assert s["phrase_rates"]["context"]["accepted"] > 0, s


def test_a_warm_pool_from_other_prompts_never_changes_an_output(dec):
    dec.reset_learned()
    target = dec.generate_ids(prompts_of(3), "ar", 30).tokens
    cold = dec.generate_ids(prompts_of(3), "ouroboros", 30, history=0).tokens
    for seed in (4, 5, 6):  # warm the history pool on other prompts
        dec.generate_ids(prompts_of(seed), "ouroboros", 30)
    warm = dec.generate_ids(prompts_of(3), "ouroboros", 30)
    assert the_pool(dec).stats()["phrases"] > 0
    assert cold == target and warm.tokens == target


def the_pool(dec) -> PhrasePool:
    """The decoder's most recently made phrase pool."""
    return [v for k, v in dec._learned.items() if k[-1] == "pool"][-1]


def test_history_off_starts_every_generation_cold(dec):
    """With history, a phrase of the first generation's prompt is still in the pool after a second generation
    on other prompts; without, the second generation started from an empty pool."""
    first = prompts_of(7)[2]
    for history in (1, 0):
        dec.reset_learned()
        dec.generate_ids([first], "ouroboros", 10, history=history)
        assert first[1:5] in the_pool(dec).lookup(first[0])  # context=1: the prompt's phrases
        dec.generate_ids(prompts_of(8), "ouroboros", 10, history=history)
        assert (first[1:5] in the_pool(dec).lookup(first[0])) == bool(history)


def test_pool_file_is_saved_and_loaded(dec, tmp_path):
    dec.reset_learned()
    path = tmp_path / "phrases.npz"
    dec.generate_ids(prompts_of(9), "ouroboros", 20, pool_file=str(path))
    assert path.exists()
    saved = PhrasePool.load(path)
    dec.reset_learned()  # a new pool: read from the file
    res = dec.generate_ids(prompts_of(10), "ouroboros", 20, pool_file=str(path), lookahead=0, verification=0,
                           context=0)
    assert len(the_pool(dec)) == len(saved) and res.stats.drafter["pool"]["phrases"] == 0


def test_a_corrupt_pool_file_is_a_clear_error(dec, tmp_path):
    dec.reset_learned()
    path = tmp_path / "phrases.npz"
    path.write_bytes(b"not a zip file at all")
    with pytest.raises(ValueError, match="not a readable phrase pool"):
        dec.generate_ids(prompts_of(9), "ouroboros", 5, pool_file=str(path))


@pytest.mark.parametrize("opts,match", [
    ({"k": -1}, "'k' must be >= 0"),
    ({"phrase_len": 0}, "'phrase_len' must be >= 1"),
    ({"w": 1}, "'w' must be >= 2"),
    ({"n": 2}, "'n' must be >= 3"),
    ({"gamma": 0}, "'gamma' must be >= 1"),
    ({"attach": "middle"}, "'attach' must be one of"),
    ({"order": "best"}, "'order' must be one of"),
])
def test_bad_options_are_clear_errors(dec, opts, match):
    with pytest.raises(ValueError, match=match):
        dec.generate_ids(prompts_of(1), "ouroboros", 5, **opts)


def test_sampling_with_the_planner_and_feature_drafts_are_refused(dec):
    from specdec.verify import SamplingConfig

    with pytest.raises(ValueError, match="schedule=static"):
        dec.generate_ids(prompts_of(1), "ouroboros", 5, SamplingConfig(temperature=0.8), schedule="cost")
    target = tiny_model("llama", VOCAB)
    feature = SpecDecoder(target, draft=tiny_eagle(target))
    with pytest.raises(ValueError, match="plain draft model"):
        feature.generate_ids([[1, 2, 3]], "ouroboros", 5)


def test_walk_follows_only_matching_draws():
    trie = ouroboros._Trie(5)
    a = trie.add(0, 7, 1, (0, 0))
    trie.add(a, 8, 1, (0, 1))
    picks = [7, 0, 3, 0]  # root draws 7 (a phrase head), node 1 draws 0 (no child)
    assert ouroboros.walk(trie, picks, 10) == ([7, 0], [0, 1])
    assert ouroboros.walk(trie, picks, 1) == ([7], [0])
    assert ouroboros.walk(trie, [6, 8, 9], 10) == ([6], [0])


def test_draft_cache_keeps_only_what_the_committed_text_confirms(monkeypatch):
    """When the target takes a phrase branch instead of the drafted chain, the draft's cache must drop the
    chain tokens the text does not confirm (else the draft drafts from a context that never happened)."""
    diverged = 0
    original = ouroboros.OuroborosDrafter.update

    def checked(self, state, tree, path, path_len, drafted):
        nonlocal diverged
        chains = [list(c) for c in self._chains]
        original(self, state, tree, path, path_len, drafted)
        seq = state.seq.tolist()
        for r, n in enumerate(path_len):
            if n == 0 or not chains[r]:
                continue
            start = state.seq_lens_host[r] - n
            cached = max(0, self.base.seen[r] - start)  # this step's chain tokens the draft cache kept
            assert cached <= len(chains[r]) and seq[r][start: start + cached] == chains[r][:cached]
            diverged += n > 1 and seq[r][start] != chains[r][0]  # accepted tokens, but not the chain's

    monkeypatch.setattr(ouroboros.OuroborosDrafter, "update", checked)
    target = tiny_model("llama")
    dec = SpecDecoder(target, draft=perturbed(target, 3.0))  # a draft that is often wrong
    loop = [11, 12, 13, 14, 15, 16, 17, 18]
    prompts = [loop * 4, [3] + loop * 3, prompts_of(11)[2]]
    ref = dec.generate_ids(prompts, "ar", 32).tokens
    res = dec.generate_ids(prompts, "ouroboros", 32, gamma=3, attach="all", context=1, lookahead=1,
                           schedule="static", govern=0)
    assert res.tokens == ref
    assert diverged > 0  # the case happened
