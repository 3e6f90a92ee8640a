"""N-Grammys: lossless greedy decoding, model-derived tables, table cache, trie/forest building."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

from specdec import ngram_tables
from specdec.api import SpecDecoder, hf_generate
from specdec.ngram_tables import bigram_topk, extend_bigram, load_tables, unigram_ranking, weights_key
from specdec.policies import Budget, NodeAcceptance, StepCost
from specdec.tree import DraftTree
from specdec.verify import SamplingConfig
from tests.conftest import tiny_model
from tests.test_greedy_lossless import prompt_of

GREEDY = SamplingConfig()
REPETITIVE = [5, 6, 7, 8, 5, 6, 7, 9, 5, 6, 7, 8, 5, 6]


@pytest.mark.parametrize("verify", ["tree", "batch", "chain"])
def test_ngrammys_matches_transformers(arch, verify):
    dec = SpecDecoder(tiny_model(arch))
    accepted = 0
    for prompt in (prompt_of(1, seed=1), prompt_of(45, seed=45), REPETITIVE):
        ref = hf_generate(dec.model, prompt, 40, GREEDY)  # greedy: shorter runs are its prefixes
        for strategy in ("mixed", "context", "bigram"):
            for max_new in (1, 7, 40):  # 7 with w = 4 cuts drafts in the middle
                out = dec.generate_ids([prompt], "ngrammys", max_new, GREEDY, k=5, w=4, strategy=strategy, verify=verify)
                assert out.tokens[0] == ref[:max_new], (strategy, len(prompt), max_new)
                accepted += out.stats.accepted_tokens
        # the cost schedule may prune everything when the CPU is busy: the static one, ungoverned, verifies every draft
        out = dec.generate_ids([prompt], "ngrammys", 40, GREEDY, k=5, w=4, verify=verify, schedule="static", govern=0)
        assert out.tokens[0] == ref
        accepted += out.stats.accepted_tokens
    assert accepted > 0  # speculation did happen somewhere


def test_ngrammys_ragged_batch():
    dec = SpecDecoder(tiny_model("llama"))
    prompts = [REPETITIVE, prompt_of(3, seed=3), prompt_of(30, seed=30)]
    out = dec.generate_ids(prompts, "ngrammys", 25, GREEDY, k=6, w=3)
    for p, toks in zip(prompts, out.tokens):
        assert toks == hf_generate(dec.model, p, 25, GREEDY)
    alloc = out.stats.drafter["allocation"]
    assert alloc["steps"] > 0 and alloc["context_slots"] + alloc["bigram_slots"] == 6 * alloc["steps"]
    assert alloc["corpus_slots"] == 0  # no corpus fits a model loaded without its tokenizer


def test_context_drafts_put_the_longest_match_first_by_hand():
    from specdec.drafters.base import DecodeState
    from specdec.drafters.ngrammys import NGrammysDrafter

    seq = torch.tensor([REPETITIVE])
    state = DecodeState(seq, torch.tensor([len(REPETITIVE)]), [len(REPETITIVE)])
    # The suffix 7 8 5 6 occurred once before (then 7 9 5); the last token 6 three times (7 8 5 twice, 7 9 5 once).
    drafts, n, n_long, match_n = NGrammysDrafter(None, k=4, w=3, strategy="context").context_drafts(state, 3)
    assert drafts[0].tolist() == [[7, 9, 5], [7, 8, 5], [-1] * 3, [-1] * 3]  # the repeat of 7 9 5 is dropped
    assert match_n.tolist() == [4]
    assert n.tolist() == [2] and n_long.tolist() == [1]
    drafter = NGrammysDrafter(None, k=4, w=3, strategy="context", acceptance=NodeAcceptance(4, 3))
    drafter.propose(state, Budget.static(1, 3, StepCost({1: 1.0, 16: 1.0})))  # nearly free verification: every node is kept
    cell = drafter._slot[0]
    source, support = (cell // (4 * 3 * NodeAcceptance.SUPPORT)).tolist(), (cell % NodeAcceptance.SUPPORT).tolist()
    # root, 7 9 5 (a 4-token suffix match: source 2 + 4 - 1 - 1), 7 8 5 (a q-match, source 1; 7 is shared)
    assert source[1:] == [4, 4, 4, 1, 1] and support[1:] == [1, 0, 0, 0, 0]
    short = [3, 4, 9, 3, 4]  # the longest earlier match is the 2 tokens 3 4 (source 2), the q-match 4 gives 9
    st = DecodeState(torch.tensor([short]), torch.tensor([5]), [5])
    drafter = NGrammysDrafter(None, k=2, w=2, strategy="context", acceptance=NodeAcceptance(2, 2))
    tree = drafter.propose(st, Budget.static(1, 2, StepCost({1: 1.0, 16: 1.0})))
    assert tree.tokens[0, 1:].tolist() == [9, 3]
    assert (drafter._slot // (2 * 2 * NodeAcceptance.SUPPORT)).tolist()[0][1:] == [2, 2]
    # Verification cost that doubles per node keeps only the root, but an exploring plan keeps one node more.
    steep = {1: 1.0, 2: 2.0, 3: 4.0, 4: 8.0, 5: 16.0, 6: 32.0}
    for every, size in ((0, 1), (1, 2)):
        drafter = NGrammysDrafter(None, k=4, w=3, strategy="context", acceptance=NodeAcceptance(4, 3))
        tree = drafter.propose(state, Budget.static(1, 3, StepCost(steep, explore_every=every)))
        assert tree.size == size and tree.tokens[0, 1:].tolist() == [7][: size - 1]
    drafts, n, n_long, match_n = NGrammysDrafter(None, k=4, w=3, n_max=1, strategy="context").context_drafts(state, 3)
    assert drafts[0].tolist() == [[7, 8, 5], [7, 9, 5], [-1] * 3, [-1] * 3]  # q-matches alone, by count
    assert n.tolist() == [2] and n_long.tolist() == [0] and match_n.tolist() == [0]


def test_support_level_by_hand():
    from specdec.drafters.ngrammys import support_level

    drafts = torch.tensor([[[1, 2, 3], [1, 2, 4], [1, 5, -1], [-1, -1, -1]],
                           [[6, -1, 7], [6, 8, 9], [-1, -1, -1], [-1, -1, -1]]])
    # 1 starts three drafts (level 2), 1 2 two (level 1); a draft ends at its first padding, so the
    # second row's first draft is the lone token 6, which the second draft shares
    assert support_level(drafts).tolist() == [[[2, 1, 0], [2, 1, 0], [2, 0, 0], [0, 0, 0]],
                                              [[1, 0, 0], [1, 0, 0], [0, 0, 0], [0, 0, 0]]]


def test_ngrammys_options_are_checked():
    from specdec.drafters.ngrammys import NGrammysDrafter

    with pytest.raises(ValueError, match="acceptance table"):  # a table learned for other options
        NGrammysDrafter(None, k=4, w=3, n_max=6, strategy="context", acceptance=NodeAcceptance(4, 3))
    dec = SpecDecoder(tiny_model("llama"))
    for bad in ({"k": 0}, {"strategy": "unigram"}, {"verify": "dense"}, {"kk": 3}, {"k": 64}):
        with pytest.raises(ValueError):
            dec.generate_ids([[3, 4]], "ngrammys", 4, GREEDY, **bad)


def test_unigram_ranking_by_hand():
    # E^T E / V = I / 2, mean output embedding (1, -0.5): squared distances .625, .125, 2.125, 1.625.
    e = torch.tensor([[2**0.5, 0.0], [0.0, 2**0.5], [0.0, 0.0], [0.0, 0.0]])
    u = torch.tensor([[0.0, 0.0], [1.0, 0.0], [3.0, 0.0], [0.0, -2.0]])
    assert unigram_ranking(e, u).tolist() == [1, 0, 3, 2]


def shift_model(v: int = 8) -> LlamaForCausalLM:
    """A layer-free model whose logits after token x rank x+1, x+2, ... (mod v) highest, in that order."""
    cfg = LlamaConfig(vocab_size=v, hidden_size=v, intermediate_size=8, num_hidden_layers=0, num_attention_heads=1,
                      num_key_value_heads=1, tie_word_embeddings=False, max_position_embeddings=16)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.eye(v))
        x, y = torch.meshgrid(torch.arange(v), torch.arange(v), indexing="xy")  # weight[y, x]
        model.lm_head.weight.copy_(-((y - x - 1) % v).float())
    return model


def test_bigram_table_by_hand():
    v = 8
    big = bigram_topk(shift_model(v), k=3, batch_size=3)
    assert big.tolist() == [[(x + 1) % v, (x + 2) % v, (x + 3) % v] for x in range(v)]
    ext = extend_bigram(big, 4)
    assert ext.shape == (v, 3, 4)
    assert ext[2].tolist() == [[3, 4, 5, 6], [4, 5, 6, 7], [5, 6, 7, 0]]
    rows = torch.tensor([2, 7, 2])
    assert torch.equal(extend_bigram(big, 4, rows, k=2), ext[rows, :2])  # what a decoding step builds


def test_bigram_table_equals_one_forward_per_token():
    model = tiny_model("qwen2")
    big = bigram_topk(model, k=5, batch_size=7)
    with torch.no_grad():
        for x in (0, 13, 95):
            logits = model(input_ids=torch.tensor([[x]])).logits[0, -1]
            assert big[x].tolist() == logits.topk(5).indices.tolist()


def test_table_cache_reused_and_invalidated(tmp_path, monkeypatch):
    model = tiny_model("llama", seed=3)
    calls = []
    real = ngram_tables.compute_tables
    monkeypatch.setattr(ngram_tables, "compute_tables", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    first = load_tables(model, k_max=4, cache=tmp_path, progress=False)
    again = load_tables(model, k_max=4, cache=tmp_path, progress=False)
    assert len(calls) == 1 and torch.equal(first.bigram, again.bigram)
    changed = tiny_model("llama", seed=3).__class__._from_config(model.config, attn_implementation="sdpa").eval()
    changed.load_state_dict(model.state_dict())
    assert weights_key(changed) == weights_key(model)
    with torch.no_grad():
        changed.lm_head.weight[0, 0] += 1e-3
    assert weights_key(changed) != weights_key(model)
    load_tables(changed, k_max=4, cache=tmp_path, progress=False)
    assert len(calls) == 2 and len(list(tmp_path.iterdir())) == 2


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.integers(1, 6), st.integers(1, 5), st.integers(2, 4), st.integers(0, 10**6))
def test_from_drafts_builds_trie_and_forest(b, k, w, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    drafts = torch.randint(0, vocab, (b, k, w), generator=g)
    cut = torch.randint(0, w + 1, (b, k), generator=g)  # chain lengths, 0 = empty slot
    drafts = torch.where(torch.arange(w)[None, None] < cut[:, :, None], drafts, -1)
    root = torch.randint(0, vocab, (b,), generator=g)
    chains = [[[t for t in c if t >= 0] for c in row] for row in drafts.tolist()]
    trie, owner, _ = DraftTree.from_drafts(root, drafts, merge=True)
    ref = DraftTree.from_chains(root, chains)
    n = ref.valid.sum(-1)
    assert torch.equal(trie.valid.sum(-1), n)
    for r in range(b):
        m = int(n[r])
        assert trie.tokens[r, :m].tolist() == ref.tokens[r, :m].tolist()
        assert trie.parents[r, :m].tolist() == ref.parents[r, :m].tolist()
    forest, chain_of, _ = DraftTree.from_drafts(root, drafts, merge=False)
    assert torch.equal(forest.valid.sum(-1), 1 + cut.sum(-1))
    for tree in (trie, forest):  # built without validation: a checked rebuild agrees, mask included
        checked = DraftTree.from_parents(tree.tokens, tree.parents, tree.valid)
        assert torch.equal(checked.mask, tree.mask) and torch.equal(checked.depth, tree.depth)
        keep = torch.rand(tree.valid.shape, generator=torch.Generator().manual_seed(seed)) < 0.5
        for _ in range(tree.size):  # close under parents: a node is kept only with its parent
            keep &= keep.gather(1, tree.parents.clamp(min=0)) | (tree.parents < 0)
        sub, old = tree.select(keep)
        ref = DraftTree.from_parents(sub.tokens, sub.parents, sub.valid)
        assert torch.equal(ref.mask, sub.mask) and torch.equal(sub.valid.sum(-1), (keep & tree.valid).sum(-1).clamp(min=1))
        assert torch.equal(sub.tokens, tree.tokens.gather(1, old))
    for tree, of in ((trie, owner), (forest, chain_of)):
        for r in range(b):
            for i, c in enumerate(chains[r]):
                node = 0  # walk chain i down the tree: every step must find a child with its token
                for tok in c:
                    kids = [j for j in range(tree.size) if tree.valid[r, j] and tree.parents[r, j] == node
                            and tree.tokens[r, j] == tok]
                    assert len(kids) >= 1
                    node = min(kids, key=lambda j: int(of[r, j]) if int(of[r, j]) == i else 10**6 + j)
                    assert int(of[r, node]) <= i


def _set_rates(acceptance: NodeAcceptance, rates: dict[int, float], default: float) -> None:
    """Make ``acceptance`` estimate ``rates[cell]`` for the listed cells and ``default`` elsewhere."""
    r = torch.full_like(acceptance.proposed, default)
    for cell, p in rates.items():
        r[cell] = p
    acceptance.accepted = r * acceptance.proposed
    acceptance._rates = None


def test_a_batch_is_cut_to_one_width_and_learns_from_the_nodes_it_kept():
    from specdec.drafters.base import DecodeState
    from specdec.drafters.ngrammys import NGrammysDrafter
    from specdec.policies import prune

    k, w, levels = 4, 3, NodeAcceptance.SUPPORT
    cell = lambda source, rank, depth, support: ((source * k + rank) * w + depth) * levels + support  # noqa: E731
    no_match = [1, 2, 3, 4, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]  # no token repeats: no context draft
    n = len(REPETITIVE)
    # REPETITIVE drafts 7 9 5 (its 4-token suffix match, source 4) and 7 8 5 (its q-match, source 1), sharing 7.
    seven, eight = cell(4, 0, 0, 1), cell(1, 0, 1, 0)

    # Alone, the shared 7 (0.9) pays for a 1.5x step: (1 + 0.9) / 1.5 > 1. With a second row that drafts
    # nothing the batch would pay 1.5x for 0.9 tokens more: (2 + 0.9) / 1.5 < 2, so no row drafts.
    cost = StepCost({1: 1.0, 2: 1.5, 3: 2.0, 4: 2.5, 16: 9.0}, explore_every=0)
    acceptance = NodeAcceptance(k, w)
    _set_rates(acceptance, {seven: 0.9}, 0.01)
    drafter = NGrammysDrafter(None, k=k, w=w, strategy="context", acceptance=acceptance)
    alone = DecodeState(torch.tensor([REPETITIVE]), torch.tensor([n]), [n])
    assert drafter.propose(alone, Budget.static(1, w, cost)).tokens[0, 1:].tolist() == [7]
    seq = torch.tensor([REPETITIVE, no_match])
    both = DecodeState(seq, torch.tensor([n, len(no_match)]), [n, len(no_match)])
    assert prune(drafter.propose(both, Budget.static(2, w, cost)), cost).size == 1

    # Two rows that both draft, where 7 and 8 (0.8) pay and 9 (0.01) does not: the cut keeps nodes 0, 1 and 4
    # of the proposed trie (7 9 5 8 5), and what the drafter learns is about 7 and 8, not about the nodes
    # that sit at the cut tree's places 1 and 2 in the proposed one (7 and 9).
    cost = StepCost({1: 1.0, 2: 1.2, 3: 1.4, 4: 3.0, 16: 20.0}, explore_every=0)
    _set_rates(acceptance, {seven: 0.9, eight: 0.8}, 0.01)
    drafter = NGrammysDrafter(None, k=k, w=w, strategy="context", acceptance=acceptance)
    twice = DecodeState(torch.tensor([REPETITIVE, REPETITIVE]), torch.tensor([n, n]), [n, n])
    proposed = drafter.propose(twice, Budget.static(2, w, cost))
    assert proposed.tokens[0, 1:].tolist() == [7, 9, 5, 8, 5]
    tree = prune(proposed, cost)
    assert tree.tokens.tolist() == [[6, 7, 8]] * 2 and tree.origin.tolist() == [[0, 1, 4]] * 2
    before = acceptance.proposed.clone()
    path = torch.tensor([[0, 1, 2]] * 2)
    drafter.update(twice, tree, path, [3, 3], [2, 2])
    counted = (acceptance.proposed - before).nonzero().flatten().tolist()
    assert counted == sorted([seven, eight]) and (acceptance.proposed - before)[counted].tolist() == [2.0, 2.0]
    assert drafter.allocation["context_accepted"] == 4


def test_update_credits_the_draft_of_the_cut_trees_last_accepted_node():
    """When the decode loop cut the proposed trie, update() finds each kept node's draft through the cut tree's
    origin: here the cut keeps proposed nodes 0 and 2, and accepting cut node 1 credits proposed node 2's draft
    (a context match), not proposed node 1's (a bigram row)."""
    from specdec.drafters.base import DecodeState
    from specdec.drafters.ngrammys import NGrammysDrafter

    drafter = NGrammysDrafter(None, k=2, w=1, strategy="context")
    drafter._slot_source = torch.tensor([[0, 1]])  # draft 0 from the bigram table, draft 1 a context match
    drafter._chain_of_node = torch.tensor([[0, 0, 1]])  # proposed nodes: root, draft 0's token, draft 1's token
    drafter._slot = None
    tree = DraftTree.from_parents(torch.tensor([[5, 8]]), torch.tensor([[-1, 0]]))
    tree.origin = torch.tensor([[0, 2]])
    state = DecodeState(torch.tensor([[1, 2, 5]]), torch.tensor([3]), [3])
    drafter.update(state, tree, torch.tensor([[0, 1]]), [2], [1])
    assert drafter.allocation["context_accepted"] == 1 and drafter.allocation["bigram_accepted"] == 0


def test_best_chain_is_the_path_with_the_most_expected_tokens():
    from specdec.drafters.ngrammys import best_chain

    k, w, levels = 3, 3, NodeAcceptance.SUPPORT
    cell = lambda source, rank, depth, support: ((source * k + rank) * w + depth) * levels + support  # noqa: E731
    # row 0: 7 9 5 (a 4-token suffix match, source 4) and 7 8 5 (a last-token match, source 1), sharing 7;
    # row 1: 3 (a 2-token suffix match, source 2) and 4 5 (a last-token match); row 2: no draft at all
    drafts = torch.tensor([[[7, 9, 5], [7, 8, 5], [-1] * 3], [[3, -1, -1], [4, 5, -1], [-1] * 3], [[-1] * 3] * 3])
    source = torch.tensor([[4, 1, 0], [2, 1, 0], [0, 0, 0]])
    rank = torch.zeros(3, k, dtype=torch.int64)
    roots = torch.tensor([6, 6, 6])
    seven, nine, eight, five_after_eight = cell(4, 0, 0, 1), cell(4, 0, 1, 0), cell(1, 0, 1, 0), cell(1, 0, 2, 0)
    three = cell(2, 0, 0, 0)  # one likely token beats two unlikely ones
    acceptance = NodeAcceptance(k, w)
    for likelier, want, owner in ((eight, [7, 8, 5], 1), (nine, [7, 9, 5], 0)):
        _set_rates(acceptance, {seven: 0.9, likelier: 0.8, three: 0.5}, 0.01)
        chain, owners, cells, reach = best_chain(roots, drafts, source, rank, w, acceptance.estimate("cpu"))
        assert chain.tolist() == [want, [3, -1, -1], [-1] * 3] and owners.tolist() == [owner, 0, 0]
        assert reach[0].tolist() == pytest.approx([0.9, 0.8, 0.01]) and reach[1].tolist() == [0.5, 0.0, 0.0]
        assert cells[1].tolist() == [three, -1, -1] and cells[2].tolist() == [-1] * 3
        if owner == 1:  # a node's cell is its first draft's: 7's is the suffix match's
            assert cells[0].tolist() == [seven, eight, five_after_eight]
    _set_rates(acceptance, {cell(1, 0, 0, 0): 0.3, cell(1, 0, 1, 0): 0.8}, 0.01)  # now 4 5 beats 3
    chain, owners, _, reach = best_chain(roots[1:2], drafts[1:2], source[1:2], rank[1:2], w, acceptance.estimate("cpu"))
    assert chain.tolist() == [[4, 5, -1]] and owners.tolist() == [1]
    assert reach.tolist() == [pytest.approx([0.3, 0.3, 0.0])]  # a node is never likelier than its parent
    _set_rates(acceptance, {}, 0.5)  # equal estimates: the drafter's order decides
    chain, owners, _, _ = best_chain(roots[:1], drafts[:1], source[:1], rank[:1], w, acceptance.estimate("cpu"))
    assert chain.tolist() == [[7, 9, 5]] and owners.tolist() == [0]


@pytest.mark.parametrize("seed", range(6))
def test_one_row_cut_by_the_planner_equals_the_kernels_cut(seed):
    """The two places a tree is cut by cost agree on one row: the kernel's cut at the planner's size (``from_drafts``
    with estimates and :meth:`StepCost.plan_size`, what the drafter does for one row) and the uncut trie with its
    reach cut by :func:`specdec.policies.prune` (what the decode loop does to a batch's trees)."""
    from specdec.policies import prune

    g = torch.Generator().manual_seed(seed)
    k, w = 6, 4
    drafts = torch.randint(0, 4, (1, k, w), generator=g)  # a small vocabulary: many shared prefixes
    drafts[0, torch.randint(0, k, (2,), generator=g), torch.randint(1, w, (1,), generator=g)] = -1
    accept = torch.rand(1, k, w, generator=g)
    cost = StepCost({1: 1.0, 2: 1.1, 4: 1.5, 8: 2.6, 16: 6.0, 32: 14.0}, explore_every=0)
    root = torch.tensor([9])
    whole, _, _ = DraftTree.from_drafts(root, drafts, True, accept)
    kernel, _, _ = DraftTree.from_drafts(root, drafts, True, accept, [cost.plan_size(whole.accept[0, 1:].tolist())])
    planner = prune(whole, cost)
    assert kernel.num_drafted.item() == planner.num_drafted.item()
    assert {_path(kernel, i) for i in range(kernel.size) if kernel.valid[0, i]} == \
        {_path(planner, i) for i in range(planner.size) if planner.valid[0, i]}


def _path(tree: DraftTree, node: int) -> tuple[int, ...]:
    """Row 0's tokens from the root to ``node``."""
    out = []
    while node >= 0:
        out.append(int(tree.tokens[0, node]))
        node = int(tree.parents[0, node])
    return tuple(out[::-1])
