"""Packed masks, depths and :class:`specdec.tree.DraftTree` against naive, loop-based definitions."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.kernels import pack_mask, tree_depth, unpack_mask
from specdec.tree import DraftTree, SparseProbs, ancestor_mask
from tests.naive import ancestors_or_self, naive_pack, one_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------------------
# Naive definitions (plain Python)
# ----------------------------------------------------------------------------------------


def naive_depth(parents: list[int], i: int) -> int:
    d, j = 0, parents[i]
    while j >= 0:
        d, j = d + 1, parents[j]
    return d


def naive_visibility(parents: list[int], valid: list[bool]) -> list[list[bool]]:
    """Row i sees j iff j is i itself, or j is a valid ancestor of i."""
    t = len(parents)
    vis = [[False] * t for _ in range(t)]
    for i in range(t):
        for j in ancestors_or_self(parents, i):
            vis[i][j] = j == i or valid[j]
    return vis


# ----------------------------------------------------------------------------------------
# Strategies
# ----------------------------------------------------------------------------------------


@st.composite
def parent_lists(draw, max_t: int = 70):
    """One tree as a parents list: random, chain or bushy (every node a child of the root)."""
    t = draw(st.integers(1, max_t))
    kind = draw(st.sampled_from(["random", "chain", "bushy", "deep"]))
    parents = [-1]
    for i in range(1, t):
        if kind == "random":
            parents.append(draw(st.integers(0, i - 1)))
        elif kind == "chain":
            parents.append(i - 1)
        elif kind == "bushy":
            parents.append(0)
        else:  # mostly deep: the parent is one of the last few nodes
            parents.append(draw(st.integers(max(0, i - 3), i - 1)))
    return parents


@st.composite
def tree_batches(draw, max_b: int = 3, max_t: int = 70):
    """``parents [B,T]`` and ``valid [B,T]`` (root always valid; padding nodes invalid)."""
    b = draw(st.integers(1, max_b))
    t = draw(st.integers(1, max_t))
    parents, valid = [], []
    for _ in range(b):
        ps = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, t)]
        # Padding: either invalid trailing nodes, or arbitrary invalid nodes (as leaves or inner nodes).
        mode = draw(st.sampled_from(["none", "tail", "random"]))
        if mode == "none":
            vs = [True] * t
        elif mode == "tail":
            n_valid = draw(st.integers(1, t))
            vs = [i < n_valid for i in range(t)]
            for i in range(n_valid, t):  # padding nodes in from_chains point at the root
                ps[i] = draw(st.sampled_from([0, ps[i]]))
        else:
            vs = [True] + [draw(st.booleans()) for _ in range(1, t)]
        parents.append(ps)
        valid.append(vs)
    return parents, valid


# ----------------------------------------------------------------------------------------
# pack_mask / unpack_mask
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("t", list(range(1, 101)))
def test_pack_unpack_round_trip_every_t(t):
    g = torch.Generator().manual_seed(t)
    mask = torch.rand(3, t, t, generator=g) < 0.5
    mask[0] = True  # every bit set: bit 31 of full words makes them negative
    mask[1] = False
    packed = pack_mask(mask)
    assert packed.dtype == torch.int32 and packed.shape == (3, t, (t + 31) // 32)
    want = torch.tensor([naive_pack(m.tolist()) for m in mask], dtype=torch.int32)
    assert torch.equal(packed, want)
    assert torch.equal(unpack_mask(packed, t), mask)


@pytest.mark.parametrize("t", [32, 33, 63, 64, 65, 96, 100])
def test_pack_bit31_is_negative_word(t):
    mask = torch.zeros(t, dtype=torch.bool)
    mask[31] = True
    packed = pack_mask(mask)
    assert packed[0].item() == -(2**31)
    assert torch.equal(unpack_mask(packed, t), mask)
    if t > 63:
        mask[63] = True
        mask[32] = True
        packed = pack_mask(mask)
        assert packed.tolist() == [-(2**31), -(2**31) + 1] + [0] * ((t + 31) // 32 - 2)
        assert torch.equal(unpack_mask(packed, t), mask)


def test_unpack_negative_words():
    packed = torch.tensor([[-1, -(2**31), 2**31 - 1, 5]], dtype=torch.int32)
    bits = unpack_mask(packed, 128)[0].tolist()
    assert bits[:32] == [True] * 32
    assert bits[32:64] == [False] * 31 + [True]
    assert bits[64:96] == [True] * 31 + [False]
    assert bits[96:128] == [True, False, True] + [False] * 29
    assert unpack_mask(packed, 40)[0].tolist() == bits[:40]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.booleans(), min_size=1, max_size=100), min_size=1, max_size=4).flatmap(
    lambda rows: st.just([r[: min(len(x) for x in rows)] for r in rows])))
def test_pack_unpack_random(rows):
    mask = torch.tensor(rows, dtype=torch.bool)
    packed = pack_mask(mask)
    assert torch.equal(packed, torch.tensor(naive_pack(rows), dtype=torch.int32))
    assert torch.equal(unpack_mask(packed, mask.shape[-1]), mask)


# ----------------------------------------------------------------------------------------
# tree_depth, ancestor_mask, DraftTree.from_parents
# ----------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.lists(parent_lists(), min_size=1, max_size=3))
def test_tree_depth_matches_naive(trees):
    t = min(len(p) for p in trees)
    trees = [p[:t] for p in trees]
    got = tree_depth(torch.tensor(trees, dtype=torch.int64))
    assert got.dtype == torch.int64
    assert got.tolist() == [[naive_depth(p, i) for i in range(t)] for p in trees]


@pytest.mark.parametrize("t", [1, 2, 3, 32, 33, 64, 65, 100])
def test_tree_depth_chain_and_bushy(t):
    chain = torch.arange(-1, t - 1)[None]
    bushy = torch.zeros(1, t, dtype=torch.int64)
    bushy[0, 0] = -1
    assert tree_depth(chain).tolist() == [list(range(t))]
    assert tree_depth(bushy).tolist() == [[0] + [1] * (t - 1)]


@settings(max_examples=60, deadline=None)
@given(tree_batches())
def test_ancestor_mask_matches_naive(batch):
    parents, valid = batch
    b, t = len(parents), len(parents[0])
    p, v = torch.tensor(parents, dtype=torch.int64), torch.tensor(valid)
    packed = ancestor_mask(p, v)
    assert packed.dtype == torch.int32 and packed.shape == (b, t, (t + 31) // 32)
    dense = unpack_mask(packed, t)
    for r in range(b):
        want = naive_visibility(parents[r], valid[r])
        got = dense[r].tolist()
        for i in range(t):
            for j in range(t):
                if not valid[r][j]:
                    # Invalid nodes are visible to nobody but themselves.
                    assert got[i][j] == (i == j), (r, i, j)
                elif valid[r][i]:
                    assert got[i][j] == want[i][j], (r, i, j)
                else:
                    # Rows of invalid nodes: self, and at most their (valid) ancestors.
                    assert got[i][j] <= want[i][j], (r, i, j)
            assert got[i][i]


@settings(max_examples=60, deadline=None)
@given(tree_batches())
def test_from_parents_matches_naive(batch):
    parents, valid = batch
    b, t = len(parents), len(parents[0])
    g = torch.Generator().manual_seed(b * 1000 + t)
    tokens = torch.randint(0, 50, (b, t), generator=g)
    p, v = torch.tensor(parents, dtype=torch.int64), torch.tensor(valid)
    tree = DraftTree.from_parents(tokens, p, v)
    assert tree.size == t and not tree.is_chain
    assert torch.equal(tree.tokens, tokens) and torch.equal(tree.parents, p) and torch.equal(tree.valid, v)
    assert tree.depth.tolist() == [[naive_depth(ps, i) for i in range(t)] for ps in parents]
    assert tree.num_drafted.tolist() == [sum(vs[1:]) for vs in valid]
    dense = tree.dense_mask()
    assert dense.shape == (b, t, t)
    for r in range(b):
        if all(valid[r]):
            assert dense[r].tolist() == naive_visibility(parents[r], valid[r])
        for j in range(t):
            if not valid[r][j]:
                assert dense[r, :, j].tolist() == [i == j for i in range(t)]
    cache_lens = torch.arange(b) * 7 + 3
    assert torch.equal(tree.positions(cache_lens), cache_lens[:, None] + tree.depth)


def test_from_parents_valid_defaults_to_all_and_t1():
    tree = DraftTree.from_parents(torch.tensor([[7], [8]]), torch.tensor([[-1], [-1]]))
    assert tree.valid.tolist() == [[True], [True]]
    assert tree.depth.tolist() == [[0], [0]]
    assert tree.mask.shape == (2, 1, 1)
    assert tree.dense_mask().tolist() == [[[True]], [[True]]]
    assert tree.num_drafted.tolist() == [0, 0]


def test_from_parents_hand_example():
    #        0
    #      /   \
    #     1     2
    #    / \     \
    #   3   4     5
    #   |
    #   6
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2, 3]])
    tree = DraftTree.from_parents(torch.arange(10, 17)[None], parents)
    assert tree.depth.tolist() == [[0, 1, 1, 2, 2, 2, 3]]
    want = [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0],
        [1, 0, 1, 0, 0, 1, 0],
        [1, 1, 0, 1, 0, 0, 1],
    ]
    assert tree.dense_mask()[0].int().tolist() == want
    # Packed: row 6 sees nodes {0, 1, 3, 6} -> 1 + 2 + 8 + 64.
    assert tree.mask[0, 6, 0].item() == 75


@pytest.mark.parametrize("t", [2, 5, 33])
@pytest.mark.parametrize("bad", ["self", "later"])
def test_from_parents_rejects_parent_not_preceding(t, bad):
    parents = torch.arange(-1, t - 1)[None].repeat(2, 1)  # two chains; only row 1 is broken
    if bad == "self":
        parents[1, t - 1] = t - 1  # a self loop
    else:
        parents[1, 1] = t - 1 if t > 2 else 1  # node 1's parent comes after it (or is itself when t == 2)
    with pytest.raises(ValueError, match="precede"):
        DraftTree.from_parents(torch.zeros(2, t, dtype=torch.int64), parents)


# ----------------------------------------------------------------------------------------
# DraftTree.from_chains
# ----------------------------------------------------------------------------------------


def test_from_chains_merges_shared_prefixes():
    tree = DraftTree.from_chains(torch.tensor([1]), [[[5, 6, 7], [5, 6, 8], [9]]])
    assert tree.tokens.tolist() == [[1, 5, 6, 7, 8, 9]]
    assert tree.parents.tolist() == [[-1, 0, 1, 2, 2, 0]]
    assert tree.valid.tolist() == [[True] * 6]
    assert tree.depth.tolist() == [[0, 1, 2, 3, 3, 1]]
    vis = tree.dense_mask()[0].tolist()
    assert vis == naive_visibility([-1, 0, 1, 2, 2, 0], [True] * 6)
    assert vis[4] == [True, True, True, False, True, False]  # 8 sees 1, 5, 6 and itself, not its sibling 7


def test_from_chains_insertion_order():
    # The chain listed first keeps the lowest indices, even when it is shorter.
    tree = DraftTree.from_chains(torch.tensor([0]), [[[9], [5, 6], [5, 7, 1], [9, 2], [5, 6]]])
    assert tree.tokens.tolist() == [[0, 9, 5, 6, 7, 1, 2]]
    assert tree.parents.tolist() == [[-1, 0, 0, 2, 2, 4, 1]]


def test_from_chains_pads_rows_of_different_sizes():
    root = torch.tensor([1, 2, 3])
    tree = DraftTree.from_chains(root, [[[5, 6, 7], [5, 6, 8], [9]], [[4]], []])
    assert tree.size == 6
    assert tree.tokens[:, 0].tolist() == [1, 2, 3]
    assert tree.tokens[1, :2].tolist() == [2, 4]
    assert tree.valid.tolist() == [[True] * 6, [True, True] + [False] * 4, [True] + [False] * 5]
    assert tree.num_drafted.tolist() == [5, 1, 0]
    assert tree.parents[1, :2].tolist() == [-1, 0]
    dense = tree.dense_mask()
    for r, n in enumerate([6, 2, 1]):
        for j in range(n, 6):  # padding: visible to nobody but itself
            assert dense[r, :, j].tolist() == [i == j for i in range(6)]
        assert dense[r, :n, :n].tolist() == naive_visibility(tree.parents[r, :n].tolist(), [True] * n)


def test_from_chains_empty_batch_is_roots_only():
    tree = DraftTree.from_chains(torch.tensor([4, 5]), [[], [[]]])
    assert tree.size == 1
    assert tree.tokens.tolist() == [[4], [5]] and tree.parents.tolist() == [[-1], [-1]]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=5), max_size=5), min_size=1, max_size=3))
def test_from_chains_is_a_trie_of_the_chains(chains):
    root = torch.arange(len(chains)) + 100
    tree = DraftTree.from_chains(root, chains)
    for r, row_chains in enumerate(chains):
        n = int(tree.valid[r].sum())
        toks, pars = tree.tokens[r, :n].tolist(), tree.parents[r, :n].tolist()
        assert toks[0] == 100 + r and pars[0] == -1
        assert not tree.valid[r, n:].any() and tree.valid[r, :n].all()
        # The paths of the trie (root excluded) are exactly the prefixes of the chains.
        paths = set()
        for i in range(1, n):
            assert pars[i] < i
            path, j = [], i
            while j > 0:
                path.append(toks[j])
                j = pars[j]
            paths.add(tuple(reversed(path)))
        prefixes = {tuple(c[:m]) for c in row_chains for m in range(1, len(c) + 1)}
        assert paths == prefixes and len(paths) == n - 1  # no duplicated node
        # Insertion order: nodes appear in order of the first chain prefix that creates them.
        order = []
        for c in row_chains:
            for m in range(1, len(c) + 1):
                if tuple(c[:m]) not in order:
                    order.append(tuple(c[:m]))
        got_order = []
        for i in range(1, n):
            path, j = [], i
            while j > 0:
                path.append(toks[j])
                j = pars[j]
            got_order.append(tuple(reversed(path)))
        assert got_order == order


# ----------------------------------------------------------------------------------------
# DraftTree.chain
# ----------------------------------------------------------------------------------------


def test_chain_with_padded_drafts():
    root = torch.tensor([10, 11, 12, 13])
    drafts = torch.tensor([[3, 4, -1, -1], [5, -1, -1, -1], [6, 7, 8, 9], [-1, 2, 3, -1]])
    tree = DraftTree.chain(root, drafts)
    assert tree.is_chain and tree.mask is None and tree.size == 5
    assert tree.tokens.tolist() == [[10, 3, 4, 0, 0], [11, 5, 0, 0, 0], [12, 6, 7, 8, 9], [13, 0, 2, 3, 0]]
    # A chain ends at its first padding, even if tokens follow it.
    assert tree.valid.tolist() == [
        [True, True, True, False, False],
        [True, True, False, False, False],
        [True] * 5,
        [True, False, False, False, False],
    ]
    assert tree.parents.tolist() == [[-1, 0, 1, 2, 3]] * 4
    assert tree.depth.tolist() == [[0, 1, 2, 3, 4]] * 4
    assert tree.num_drafted.tolist() == [2, 1, 4, 0]
    assert tree.dense_mask()[0].tolist() == torch.ones(5, 5, dtype=torch.bool).tril().tolist()
    assert torch.equal(tree.depth, tree_depth(tree.parents))


def test_chain_without_drafts_and_with_probs():
    tree = DraftTree.chain(torch.tensor([3, 4]))
    assert tree.size == 1 and tree.tokens.tolist() == [[3], [4]] and tree.valid.all()
    assert tree.parents.tolist() == [[-1], [-1]] and tree.depth.tolist() == [[0], [0]]
    probs = SparseProbs.top_k(torch.randn(2, 3, 7), 4)
    tree = DraftTree.chain(torch.tensor([3, 4]), torch.tensor([[1, 2, 3], [4, -1, -1]]), probs)
    assert tree.draft_probs.ids.shape == (2, 4, 4)
    assert torch.equal(tree.draft_probs.probs[:, 0], torch.zeros(2, 4))  # the root: a one-hot row
    assert torch.equal(tree.draft_probs.ids[:, 0], torch.full((2, 4), -1))
    assert torch.equal(tree.draft_probs.probs[:, 1:], probs.probs)
    assert torch.equal(tree.draft_probs.ids[:, 1:], probs.ids)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(-1, 20), min_size=0, max_size=40), min_size=1, max_size=4).map(
    lambda rows: [r[: min(len(x) for x in rows)] for r in rows]))
def test_chain_matches_naive(rows):
    b, k = len(rows), len(rows[0])
    root = torch.arange(b) + 50
    tree = DraftTree.chain(root, torch.tensor(rows, dtype=torch.int64).reshape(b, k))
    for r, row in enumerate(rows):
        n_valid = 1
        while n_valid <= k and row[n_valid - 1] >= 0:
            n_valid += 1
        assert tree.valid[r].tolist() == [i < n_valid for i in range(k + 1)]
        assert tree.tokens[r].tolist() == [50 + r] + [max(x, 0) for x in row]
        assert tree.parents[r].tolist() == list(range(-1, k))
        assert tree.depth[r].tolist() == [naive_depth(list(range(-1, k)), i) for i in range(k + 1)]


@pytest.mark.parametrize("parents", [[[0, 0, 1]], [[-1, -1, 1]]])
def test_from_parents_rejects_a_second_or_missing_root(parents):
    with pytest.raises(ValueError, match="root|parent"):
        DraftTree.from_parents(torch.tensor([[7, 8, 9]]), torch.tensor(parents))


# ----------------------------------------------------------------------------------------
# Sparse proposals through the tree constructors
# ----------------------------------------------------------------------------------------


def test_sparse_probs_top_k_is_the_renormalised_head():
    logits = torch.randn(3, 2, 11)
    logits[0, 0, 4] = float("-inf")  # a filtered id gets probability 0
    q = SparseProbs.top_k(logits, 4)
    want = torch.softmax(logits, -1)
    top = want.topk(4, dim=-1)
    assert torch.equal(q.ids, top.indices)
    torch.testing.assert_close(q.probs, top.values / top.values.sum(-1, keepdim=True))
    assert SparseProbs.top_k(logits, 50).k == 11  # k clamps to the vocabulary
    with pytest.raises(ValueError, match=r"\[B, T, K\]"):
        SparseProbs(q.ids, q.probs[..., :2])


def test_sparse_probs_sample_follows_the_distribution():
    q = SparseProbs(torch.tensor([[[7, 2, 9]]]).expand(20000, 1, 3), torch.tensor([[[0.5, 0.3, 0.2]]]).expand(20000, 1, 3))
    draws = q.sample(torch.Generator().manual_seed(0))[:, 0]
    freq = torch.stack([(draws == i).float().mean() for i in (7, 2, 9)])
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.2]), atol=0.02)
    assert SparseProbs.one_hot(2, 3).sample().tolist() == [[-1] * 3] * 2  # nothing to draw from


def test_sparse_probs_cat_pads_and_map_ids():
    a = SparseProbs(torch.tensor([[[1, 2]]]), torch.tensor([[[0.5, 0.5]]]))
    b = SparseProbs(torch.tensor([[[3, 0, -1]]]), torch.tensor([[[0.7, 0.3, 0.0]]]))
    c = SparseProbs.cat([a, b])
    assert c.ids.tolist() == [[[1, 2, -1], [3, 0, -1]]] and c.probs[0, 0].tolist() == [0.5, 0.5, 0.0]
    mapped = c.map_ids(torch.tensor([10, 11, 12, 13]))
    assert mapped.ids.tolist() == [[[11, 12, -1], [13, 10, -1]]]
    assert c.dense(5)[0].tolist() == [[0, .5, .5, 0, 0], [pytest.approx(.3), 0, 0, pytest.approx(.7), 0]]


def _cell_probs(b: int, cells: int, k: int = 3) -> SparseProbs:
    """Distinct proposals per cell: cell c of row r puts its mass on ids ``100 * r + c`` and beyond."""
    base = 100 * torch.arange(b)[:, None, None] + torch.arange(cells)[None, :, None]
    return SparseProbs(base * 10 + torch.arange(k), torch.softmax(torch.randn(b, cells, k), -1))


def test_from_chains_carries_each_node_its_first_chains_proposal():
    root = torch.tensor([0, 0])
    chains = [[[5, 6], [5, 7, 8]], [[9]]]  # row 0: node "5" is shared; its proposal is chain 0's
    probs = _cell_probs(2, 2 * 3)  # C = 2 chains of at most L = 3 tokens
    tree = DraftTree.from_chains(root, chains, probs)
    # Row 0 nodes: root, 5 (cell 0), 6 (cell 1), 7 (cell 3 + 1 = 4), 8 (cell 5); row 1: root, 9 (cell 0).
    cells = [[-1, 0, 1, 4, 5], [-1, 0, -1, -1, -1]]
    for r in range(2):
        for i, c in enumerate(cells[r]):
            if c < 0:
                assert bool((tree.draft_probs.probs[r, i] == 0).all()) and bool((tree.draft_probs.ids[r, i] == -1).all())
            else:
                assert torch.equal(tree.draft_probs.ids[r, i], probs.ids[r, c])
                assert torch.equal(tree.draft_probs.probs[r, i], probs.probs[r, c])


def test_from_drafts_and_select_carry_proposals():
    drafts = torch.tensor([[[4, 5, -1], [4, 6, 7]], [[8, -1, -1], [-1, -1, -1]]])
    probs = _cell_probs(2, 6)
    tree, _, slot = DraftTree.from_drafts(torch.tensor([1, 2]), drafts, draft_probs=probs)
    for r in range(2):
        for i in range(tree.size):
            c = int(slot[r, i])
            want_ids = probs.ids[r, c] if c >= 0 else torch.full((3,), -1)
            assert torch.equal(tree.draft_probs.ids[r, i], want_ids)
    keep = torch.zeros_like(tree.valid)
    keep[:, :3] = True
    sub, old = tree.select(keep)
    for r in range(2):
        for i in range(sub.size):
            if sub.valid[r, i]:
                assert torch.equal(sub.draft_probs.ids[r, i], tree.draft_probs.ids[r, old[r, i]])
            else:
                assert bool((sub.draft_probs.probs[r, i] == 0).all())
