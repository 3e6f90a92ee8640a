"""Verifier.verify's VerifyResult: per-node target data, bonus=False (PEARL's post-verify), emitted tokens.

The statistical test of sampling with ``bonus=False`` lives in tests/test_sampling.py with the other
chi-square tests; here: exact checks of the per-node fields against ``logits.argmax(-1)`` and
:func:`processed_probs`, and greedy ``bonus=False`` by hand.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from specdec import kernels
from specdec.tree import DraftTree
from specdec.verify import SamplingConfig, Verifier, VerifyResult, node_argmax, processed_probs

CPU = torch.device("cpu")
GREEDY = SamplingConfig()
SAMPLING_CONFIGS = {
    "temp": SamplingConfig(temperature=0.7, seed=3),
    "topk3": SamplingConfig(temperature=1.2, top_k=3, seed=3),  # fewer survivors than k = 8: -1 padding
    "topp": SamplingConfig(temperature=0.9, top_p=0.6, seed=3),
    "topk-topp": SamplingConfig(temperature=1.1, top_k=20, top_p=0.9, seed=3),
}


def random_tree(seed: int, b: int = 3, t: int = 9, v: int = 40, follow: float = 0.7):
    """A random tree per row whose tokens often follow ``logits``' argmax (so paths get long), some
    padding nodes; and the logits ``[b, t, v]`` fp32."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, t, v, generator=g) * 3
    am = logits.argmax(-1)
    parents = torch.full((b, t), -1, dtype=torch.int64)
    for i in range(1, t):
        parents[:, i] = torch.randint(0, i, (b,), generator=g)
    tokens = torch.randint(0, v, (b, t), generator=g)
    follow_it = torch.rand(b, t, generator=g) < follow
    tokens = torch.where(follow_it, am.gather(1, parents.clamp(min=0)), tokens)
    valid = torch.rand(b, t, generator=g) < 0.85
    valid[:, 0] = True
    return DraftTree.from_parents(tokens, parents, valid), logits


# ----------------------------------------------------------------------------------------
# The result itself
# ----------------------------------------------------------------------------------------


def test_result_is_frozen_and_per_node_is_opt_in():
    tree, logits = random_tree(0)
    res = Verifier(GREEDY, CPU).verify(tree, logits)
    assert isinstance(res, VerifyResult)
    assert res.target_argmax is None and res.target_topk_ids is None and res.target_topk_probs is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        res.path = res.path  # type: ignore[misc]
    assert Verifier(GREEDY, CPU).verify(tree, logits, per_node=True).target_argmax is not None
    assert Verifier(GREEDY, CPU, per_node=True).verify(tree, logits, per_node=False).target_argmax is None
    sampled = Verifier(SAMPLING_CONFIGS["temp"], CPU, per_node=True).verify(tree, logits)
    assert sampled.target_argmax is None and sampled.target_topk_ids is not None


@pytest.mark.parametrize("seed", range(4))
def test_greedy_fields_equal_the_kernel(seed):
    """path, path_len, next_token are the kernel's; has_next is all True with the bonus."""
    tree, logits = random_tree(seed)
    res = Verifier(GREEDY, CPU, per_node=True).verify(tree, logits)
    path, length, nxt = kernels.tree_verify_greedy(tree.tokens, tree.parents, logits, tree.valid)
    assert torch.equal(res.path, path) and torch.equal(res.path_len, length) and torch.equal(res.next_token, nxt)
    assert res.has_next.dtype == torch.bool and bool(res.has_next.all())
    assert res.path_len.dtype == torch.int32 and res.next_token.dtype == torch.int64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seed", range(3))
def test_greedy_target_argmax_is_logits_argmax(dtype, seed):
    tree, logits = random_tree(seed, v=300)
    logits = logits.to(dtype)
    res = Verifier(GREEDY, CPU, per_node=True).verify(tree, logits)
    assert res.target_argmax.dtype == torch.int64 and res.target_argmax.shape == tree.tokens.shape
    assert torch.equal(res.target_argmax, logits.argmax(-1))


def test_greedy_target_argmax_ties_and_strides():
    """First maximum on ties (as torch.argmax); logits need only a contiguous vocabulary axis."""
    logits = torch.zeros(2, 4, 10)
    logits[0, 1, [3, 7]] = 5.0
    logits[1, 2, [9, 2]] = 1.0
    logits[1, 3] = float("-inf")  # all -inf: index 0
    assert torch.equal(node_argmax(logits), logits.argmax(-1))
    big = torch.randn(3, 7, 64)
    view = big[:, 1:6]  # strided over T: not a view-reshapeable [B*T, 1, V]
    assert torch.equal(node_argmax(view), view.argmax(-1))
    assert node_argmax(torch.zeros(2, 0, 5)).shape == (2, 0)


@pytest.mark.parametrize("config", list(SAMPLING_CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sampling_topk_is_the_processed_distribution(config, dtype):
    tree, logits = random_tree(5, v=200)
    logits = logits.to(dtype)
    cfg = SAMPLING_CONFIGS[config]
    res = Verifier(cfg, CPU, per_node=True).verify(tree, logits)
    b, t = tree.tokens.shape
    assert res.target_topk_ids.shape == (b, t, 8) and res.target_topk_ids.dtype == torch.int64
    assert res.target_topk_probs.shape == (b, t, 8) and res.target_topk_probs.dtype == torch.float32
    want = processed_probs(logits, cfg)
    top = want.topk(8, dim=-1).values
    torch.testing.assert_close(res.target_topk_probs, top, rtol=1e-5, atol=1e-7)
    ids, probs = res.target_topk_ids, res.target_topk_probs
    # Ids: -1 exactly where the processed probability is 0; elsewhere the probability of that id (ties safe).
    assert torch.equal(ids < 0, top == 0)
    torch.testing.assert_close(want.gather(-1, ids.clamp(min=0)).where(ids >= 0, 0.0), probs, rtol=1e-5, atol=1e-7)
    # As many real ids as tokens survive the filters (top_k=3 keeps 3, more on bf16 ties), at most 8.
    assert torch.equal((ids >= 0).sum(-1), (want > 0).sum(-1).clamp(max=8))
    if config == "topk3":
        assert bool((ids[..., :3] >= 0).all()) and bool((ids[..., 3:] == -1).any())
    # Distinct ids per node.
    for row in ids.view(-1, 8).tolist():
        kept = [x for x in row if x >= 0]
        assert len(set(kept)) == len(kept)


def test_sampling_topk_k_option_and_small_vocabulary():
    tree, logits = random_tree(6, v=5)
    res = Verifier(SAMPLING_CONFIGS["temp"], CPU, per_node=True, topk=3).verify(tree, logits)
    assert res.target_topk_ids.shape[-1] == 3
    res = Verifier(SAMPLING_CONFIGS["temp"], CPU, per_node=True, topk=50).verify(tree, logits)
    assert res.target_topk_ids.shape[-1] == 5  # k = min(topk, V)
    with pytest.raises(ValueError):
        Verifier(GREEDY, CPU, topk=0)


@pytest.mark.parametrize("config", ["temp", "topk-topp"])
def test_sampling_per_node_does_not_change_the_draws(config):
    """Per-node data uses no randomness: the same seed gives the same verification with and without it."""
    tree, logits = random_tree(7)
    cfg = SAMPLING_CONFIGS[config]
    a = Verifier(cfg, CPU).verify(tree, logits)
    b = Verifier(cfg, CPU, per_node=True).verify(tree, logits)
    for f in ("path", "path_len", "next_token", "has_next"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f


def test_emitted_tokens():
    tree, logits = random_tree(8, b=6, t=7)
    for bonus in (True, False):
        res = Verifier(GREEDY, CPU).verify(tree, logits if bonus else logits[:, :-1], bonus=bonus)
        out = res.emitted(tree)
        assert out.shape == tree.tokens.shape
        for r in range(tree.tokens.shape[0]):
            n = int(res.path_len[r])
            want = tree.tokens[r, res.path[r, 1:n]].tolist() + ([int(res.next_token[r])] if res.has_next[r] else [])
            assert int(res.num_emitted[r]) == len(want)
            assert out[r].tolist() == want + [-1] * (out.shape[1] - len(want))


# ----------------------------------------------------------------------------------------
# bonus=False, greedy
# ----------------------------------------------------------------------------------------


def one_hot_logits(argmax_at_node: list[list[int]], v: int = 10) -> torch.Tensor:
    """``[B, N, v]`` logits whose argmax at node ``i`` of row ``b`` is ``argmax_at_node[b][i]``."""
    out = torch.full((len(argmax_at_node), len(argmax_at_node[0]), v), -1.0)
    for b, row in enumerate(argmax_at_node):
        for i, tok in enumerate(row):
            out[b, i, tok] = 1.0
    return out


def test_greedy_no_bonus_by_hand():
    # Chain root(9) -> 4 -> 5 -> 6; logits at nodes 0, 1, 2 only (node 3 is the leaf, no logits).
    root = torch.tensor([9, 9, 9, 9])
    drafts = torch.tensor([[4, 5, 6],     # row 0: target says 4, 5, 6: all accepted -> no next token
                           [4, 5, 6],     # row 1: target says 4, 5, 2: last draft rejected -> correction 2
                           [4, 5, 6],     # row 2: target says 3, ...: first draft rejected -> correction 3
                           [4, 5, -1]])   # row 3: a shorter chain, both accepted -> ends at its leaf
    tree = DraftTree.chain(root, drafts)
    logits = one_hot_logits([[4, 5, 6], [4, 5, 2], [3, 5, 6], [4, 5, 7]])
    v = Verifier(GREEDY, CPU, per_node=True)
    res = v.verify(tree, logits, bonus=False)
    assert res.path.tolist() == [[0, 1, 2, 3], [0, 1, 2, -1], [0, -1, -1, -1], [0, 1, 2, -1]]
    assert res.path_len.tolist() == [4, 3, 1, 3]
    assert res.has_next.tolist() == [False, True, True, False]
    assert res.next_token.tolist() == [-1, 2, 3, -1]
    assert res.num_emitted.tolist() == [3, 3, 1, 2]
    assert res.emitted(tree).tolist() == [[4, 5, 6, -1], [4, 5, 2, -1], [3, -1, -1, -1], [4, 5, -1, -1]]
    assert res.target_argmax.tolist() == [[4, 5, 6, -1], [4, 5, 2, -1], [3, 5, 6, -1], [4, 5, 7, -1]]
    # With the bonus (one more logits row) the same rows emit their next token at the leaf too.
    full = torch.cat([logits, one_hot_logits([[8], [8], [8], [8]])], dim=1)
    res = v.verify(tree, full)
    assert res.path_len.tolist() == [4, 3, 1, 3] and res.has_next.all()
    assert res.next_token.tolist() == [8, 2, 3, 7]


def test_greedy_no_bonus_tree_by_hand():
    # root -> 1 (tok 4) -> 3 (tok 6); root -> 2 (tok 5) -> 4 (tok 7); node 4 is the last node (no logits).
    tokens = torch.tensor([[9, 4, 5, 6, 7]] * 3)
    parents = torch.tensor([[-1, 0, 0, 1, 2]] * 3)
    tree = DraftTree.from_parents(tokens, parents)
    res = Verifier(GREEDY, CPU).verify(tree, one_hot_logits([
        [5, 0, 7, 0],   # root -> 2 -> 4 accepted: ends at leaf 4 (the logit-less node)
        [4, 6, 0, 0],   # root -> 1 -> 3 accepted: ends at leaf 3 (it has logits; they are not used)
        [5, 0, 1, 0],   # root -> 2 accepted, node 4 rejected: correction 1 at node 2
    ]), bonus=False)
    assert res.path.tolist() == [[0, 2, 4, -1, -1], [0, 1, 3, -1, -1], [0, 2, -1, -1, -1]]
    assert res.has_next.tolist() == [False, False, True] and res.next_token.tolist() == [-1, -1, 1]


def test_no_bonus_root_only_and_shapes():
    root = torch.tensor([3, 4])
    tree = DraftTree.chain(root)
    for cfg in (GREEDY, SAMPLING_CONFIGS["temp"]):
        res = Verifier(cfg, CPU, per_node=True).verify(tree, torch.zeros(2, 0, 6), bonus=False)
        assert res.path.tolist() == [[0], [0]] and res.path_len.tolist() == [1, 1]
        assert res.has_next.tolist() == [False, False] and res.next_token.tolist() == [-1, -1]
        assert res.num_emitted.tolist() == [0, 0]
    tree = DraftTree.chain(root, torch.tensor([[1, 2], [1, 2]]))
    v = Verifier(GREEDY, CPU)
    with pytest.raises(ValueError, match="T-1"):
        v.verify(tree, torch.zeros(2, 3, 6), bonus=False)
    with pytest.raises(ValueError, match=r"\[B, T, V\]"):
        v.verify(tree, torch.zeros(2, 2, 6))
    with pytest.raises(FloatingPointError):
        v.verify(tree, torch.full((2, 2, 6), float("nan")), bonus=False)


@pytest.mark.parametrize("config", ["greedy", "temp", "topk-topp"])
@pytest.mark.parametrize("seed", range(3))
def test_no_bonus_agrees_with_bonus(config, seed):
    """Same seed, same decisions: bonus=False changes only the rows whose path ends at a leaf, where it
    drops the next token; the per-node data is the same but for node T-1's row."""
    tree, logits = random_tree(seed, b=16, t=6, v=12, follow=0.6)
    cfg = GREEDY if config == "greedy" else SAMPLING_CONFIGS[config]
    with_bonus = Verifier(cfg, CPU, per_node=True).verify(tree, logits)
    no_bonus = Verifier(cfg, CPU, per_node=True).verify(tree, logits[:, :-1], bonus=False)
    assert torch.equal(with_bonus.path, no_bonus.path) and torch.equal(with_bonus.path_len, no_bonus.path_len)
    has = no_bonus.has_next
    assert torch.equal(no_bonus.next_token, torch.where(has, with_bonus.next_token, -1))
    assert 0 < int(has.sum()) < has.numel()  # both kinds of rows occur
    if config == "greedy":
        assert torch.equal(no_bonus.target_argmax[:, :-1], with_bonus.target_argmax[:, :-1])
        assert bool((no_bonus.target_argmax[:, -1] == -1).all())
    else:
        assert torch.equal(no_bonus.target_topk_ids[:, :-1], with_bonus.target_topk_ids[:, :-1])
        torch.testing.assert_close(no_bonus.target_topk_probs[:, :-1], with_bonus.target_topk_probs[:, :-1])
        assert bool((no_bonus.target_topk_ids[:, -1] == -1).all()) and bool((no_bonus.target_topk_probs[:, -1] == 0).all())


@pytest.mark.parametrize("seed", range(4))
def test_ends_at_leaf_chain_shortcut_equals_general_tree(seed):
    """Chains take a shortcut (the child of node i is node i + 1); the general rule gives the same answer."""
    g = torch.Generator().manual_seed(seed)
    b, k, v = 12, 5, 6
    logits = torch.randn(b, k + 1, v, generator=g)
    am = logits.argmax(-1)
    drafts = torch.where(torch.rand(b, k, generator=g) < 0.7, am[:, :k], torch.randint(0, v, (b, k), generator=g))
    drafts[torch.arange(b), torch.randint(1, k + 1, (b,), generator=g).clamp(max=k - 1)] = -1  # ragged lengths
    chain = DraftTree.chain(torch.zeros(b, dtype=torch.int64), drafts)
    general = DraftTree.from_parents(chain.tokens, chain.parents, chain.valid)
    assert chain.is_chain and not general.is_chain
    for cfg in (GREEDY, SAMPLING_CONFIGS["temp"]):
        a = Verifier(cfg, CPU).verify(chain, logits[:, :-1], bonus=False)
        c = Verifier(cfg, CPU).verify(general, logits[:, :-1], bonus=False)
        assert torch.equal(a.has_next, c.has_next) and torch.equal(a.next_token, c.next_token)
        assert 0 < int(a.has_next.sum()) < b


def test_emitted_of_a_lone_root():
    """A step that drafted nothing (a one-node tree) emits just the next token."""
    tree = DraftTree.chain(torch.tensor([5, 6]))
    logits = torch.zeros(2, 1, 11)
    logits[0, 0, 3] = logits[1, 0, 9] = 1.0
    res = Verifier(SamplingConfig(), torch.device("cpu")).verify(tree, logits)
    assert res.emitted(tree).tolist() == [[3], [9]]
