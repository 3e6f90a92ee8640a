"""Per-row budgets, stop rules and the cost planner."""
from __future__ import annotations

import torch

from specdec.api import SpecDecoder, hf_generate
from specdec.drafters import DraftModelDrafter
from specdec.drafters.base import Budget, DecodeState, StopRule
from specdec.model import ModelRunner
from specdec.policies import HeuristicLength, StaticLength, StepCost, best_sizes, cap_nodes, prune
from specdec.tree import DraftTree
from specdec.verify import SamplingConfig
from tests.conftest import tiny_model
from tests.test_greedy_lossless import perturbed, prompt_of

GREEDY = SamplingConfig()


class StopRowZeroAt(StopRule):
    """Row 0 stops after ``depth`` tokens; the others go on. Records what it was asked."""

    def __init__(self, depth: int):
        self.depth, self.calls = depth, []

    def keep_going(self, depth, logits, tokens=None):
        self.calls.append((depth, tuple(logits.shape)))
        assert tokens is not None and tokens.shape == (logits.shape[0],)  # the drafted tokens come along
        go = torch.ones(logits.shape[0], dtype=torch.bool)
        go[0] = depth < self.depth
        return go


def _state(prompts):
    width = max(map(len, prompts)) + 8
    seq = torch.zeros(len(prompts), width, dtype=torch.int64)
    for r, p in enumerate(prompts):
        seq[r, : len(p)] = torch.tensor(p)
    lens = [len(p) for p in prompts]
    return DecodeState(seq, torch.tensor(lens), lens)


def test_draft_model_honours_per_row_depths_and_stop_rules():
    draft = tiny_model("llama")
    prompts = [prompt_of(6, seed=1), prompt_of(9, seed=2), prompt_of(4, seed=3)]
    runner = ModelRunner(draft)
    state = _state(prompts)

    class Drafter(DraftModelDrafter):
        def propose(self, state, budget):  # each proposal from the same state: roll back after it
            tree = super().propose(state, budget)
            self.update(state, tree, None, [], [])
            return tree

    drafter = Drafter(runner, GREEDY)
    drafter.begin(state)
    tree = drafter.propose(state, Budget([1, 4, 0]))
    assert tree.num_drafted.tolist() == [1, 4, 0]
    full = drafter.propose(state, Budget.static(3, 4))
    assert (tree.tokens[1, 1:] == full.tokens[1, 1:]).all()  # the same chain, whatever the other rows do
    stop = StopRowZeroAt(2)
    cut = drafter.propose(state, Budget([4, 4, 4], stop=stop))
    assert cut.num_drafted.tolist() == [2, 4, 4]
    assert [d for d, _ in stop.calls] == [1, 2, 3, 4] and stop.calls[0][1][0] == 3
    assert drafter.propose(state, Budget([4, 4, 4], stop=StopRowZeroAt(0))).num_drafted.tolist()[0] == 1
    everyone_stops = StopRule()
    everyone_stops.keep_going = lambda depth, logits, tokens: torch.zeros(logits.shape[0], dtype=torch.bool)
    calls = drafter.draft_calls
    assert drafter.propose(state, Budget([4, 4, 4], stop=everyone_stops)).num_drafted.tolist() == [1, 1, 1]
    assert drafter.draft_calls == calls + 1  # no draft forward after every row stopped


def test_confidence_stop_is_lossless_and_drafts_less():
    target = tiny_model("llama")
    dec = SpecDecoder(target, draft=perturbed(target, 0.6))
    prompts = [prompt_of(7, seed=4), prompt_of(25, seed=5)]
    ref = [hf_generate(target, p, 30, GREEDY) for p in prompts]
    # ungoverned: a governor's plain steps, decided from wall-clock timings, would change what each run drafts
    plain = dec.generate_ids(prompts, "sd", 30, GREEDY, draft_length=6, govern=0)
    sure = dec.generate_ids(prompts, "sd", 30, GREEDY, draft_length=6, confidence=0.9, govern=0)
    assert plain.tokens == ref and sure.tokens == ref
    assert sure.stats.drafted_tokens < plain.stats.drafted_tokens


def test_heuristic_length_is_per_row():
    pol = HeuristicLength(3, max_k=10)
    pol.begin(2)
    pol.update([3], [3], rows=[1])  # only row 1 drafted, fully accepted
    assert pol.budget([20, 20]).max_depth == [3, 5]
    assert pol.budget([20, 2]).max_depth == [3, 2]  # no row drafts past what it may still emit


def test_prune_keeps_parents_and_pays_for_cost():
    # root -> a (0.9) -> b (0.8) ; root -> c (0.3) -> d (0.05)
    tree = DraftTree.from_parents(torch.tensor([[9, 1, 2, 3, 4]]), torch.tensor([[-1, 0, 1, 0, 3]]))
    tree.accept = torch.tensor([[1.0, 0.9, 0.72, 0.3, 0.015]])
    free = StepCost({1: 1.0, 16: 1.0}, explore_every=0)
    assert best_sizes(tree.accept, tree.valid, free) == [4]
    steep = StepCost({1: 1.0, 5: 1.8}, explore_every=0)
    # n nodes: (1 + sum of the n best) / c(n + 1) = 1.0, 1.58, 1.87, 1.83, 1.63
    assert best_sizes(tree.accept, tree.valid, steep) == [2]
    assert prune(tree, steep).tokens[0].tolist() == [9, 1, 2]
    linear = StepCost({1: 1.0, 5: 1.4}, explore_every=0)
    # 1.0, 1.73, 2.18, 2.25, 2.10: the branch c joins, its child d does not
    assert best_sizes(tree.accept, tree.valid, linear) == [3]
    assert best_sizes(tree.accept, tree.valid, linear, explore=True) == [4]
    kept = prune(tree, linear)
    assert kept.tokens[0].tolist() == [9, 1, 2, 3] and kept.parents[0].tolist() == [-1, 0, 1, 0]
    assert torch.allclose(kept.accept[0], torch.tensor([1.0, 0.9, 0.72, 0.3]))
    chain = DraftTree.chain(torch.tensor([9, 9]), torch.tensor([[1, 2, 3], [4, -1, -1]]))
    chain.accept = torch.tensor([[1.0, 0.9, 0.8, 0.1], [1.0, 0.95, 0.0, 0.0]])
    cut = prune(chain, linear)
    assert cut.is_chain and cut.num_drafted.tolist() == [2, 1]


def test_node_caps_keep_a_tree_and_stay_lossless():
    tree = DraftTree.from_parents(torch.tensor([[9, 1, 2, 3, 4]]), torch.tensor([[-1, 0, 1, 0, 3]]))
    assert cap_nodes(tree, [4]) is tree
    first = cap_nodes(tree, [2])  # no estimates: the first nodes in order (parents come first)
    assert first.tokens[0].tolist() == [9, 1, 2]
    tree.accept = torch.tensor([[1.0, 0.9, 0.2, 0.5, 0.4]])
    best = cap_nodes(tree, [3])  # by estimate: a (0.9), c (0.5), d (0.4)
    assert best.tokens[0].tolist() == [9, 1, 3, 4] and best.parents[0].tolist() == [-1, 0, 0, 2]
    chain = cap_nodes(DraftTree.chain(torch.tensor([5, 6]), torch.tensor([[1, 2, 3], [4, 5, -1]])), [1, 3])
    assert chain.is_chain and chain.num_drafted.tolist() == [1, 2]
    target = tiny_model("llama")
    dec = SpecDecoder(target)
    prompts = [prompt_of(8, seed=6), prompt_of(20, seed=7)]
    from specdec.drafters import NGrammysDrafter
    from specdec.decoding import speculative_generate
    seen = []

    class Spy(NGrammysDrafter):
        def update(self, state, tree, path, path_len, drafted):
            seen.append(max(drafted))
            super().update(state, tree, path, path_len, drafted)

    out = speculative_generate(dec.runner, Spy(None, k=4, w=3, strategy="context"), prompts, 20, GREEDY, dec.eos,
                               StaticLength(3, max_nodes=2))
    assert out.tokens == [hf_generate(target, p, 20, GREEDY) for p in prompts]
    assert max(seen) <= 2 and max(seen) > 0


def _catch_up_widths(prompts, limit, monkeypatch, read_prompt=True):
    """A fresh draft's first catch-up on ``prompts`` with CATCH_UP_ALL_LOGITS = ``limit``: its logits ``[B,V]``,
    the logits widths of its runner's tree forwards, and how many prefills it ran."""
    import specdec.drafters.draft_model as dm

    monkeypatch.setattr(dm, "CATCH_UP_ALL_LOGITS", limit)
    runner = ModelRunner(tiny_model("llama"))
    widths, prefills = [], []
    forward, prefill = runner.forward_tree, runner.prefill

    def spy(*args, **kwargs):
        logits, hidden = forward(*args, **kwargs)
        widths.append(logits.shape[1])
        return logits, hidden

    def spy_prefill(ids, lens, *args):
        prefills.append(lens.tolist())
        return prefill(ids, lens, *args)

    runner.forward_tree, runner.prefill = spy, spy_prefill
    drafter = DraftModelDrafter(runner, GREEDY)
    if not read_prompt:
        monkeypatch.setattr(drafter, "read_prompt", lambda state: None)
    state = _state(prompts)
    drafter.begin(state)
    return drafter.catch_up(state)[0], widths, prefills


def test_prompt_catch_up_computes_last_logits_only(monkeypatch):
    """A draft catching up on ragged contexts longer than CATCH_UP_ALL_LOGITS as one chain (a catch-up after many
    plain steps) computes logits at each row's last token only ([B, distinct last columns, V], not [B, W, V]) and
    returns what the full forward gives there."""
    import specdec.drafters.draft_model as dm

    prompts = [prompt_of(70, seed=1), prompt_of(100, seed=2), prompt_of(70, seed=3), prompt_of(90, seed=4)]
    cut, cut_widths, _ = _catch_up_widths(prompts, dm.CATCH_UP_ALL_LOGITS, monkeypatch, read_prompt=False)
    full, full_widths, _ = _catch_up_widths(prompts, 10**6, monkeypatch)
    assert cut_widths == [3] and full_widths == [100]  # the rows end at columns 69, 89 and 99
    torch.testing.assert_close(cut, full, rtol=1e-5, atol=1e-5)
    assert torch.equal(cut.argmax(-1), full.argmax(-1))


def test_a_long_prompt_is_read_by_the_drafts_prefill(monkeypatch):
    """A fresh draft reads ragged prompts longer than CATCH_UP_ALL_LOGITS with its runner's prefill (row by row
    where padding would waste the forward), all but each row's root, then catches up on the roots: no forward as
    wide as the longest prompt, and the logits the padded chain gives."""
    import specdec.drafters.draft_model as dm

    prompts = [prompt_of(70, seed=1), prompt_of(300, seed=2), prompt_of(40, seed=3), prompt_of(90, seed=4)]
    read, widths, prefills = _catch_up_widths(prompts, dm.CATCH_UP_ALL_LOGITS, monkeypatch)
    chain, chain_widths, chain_prefills = _catch_up_widths(prompts, dm.CATCH_UP_ALL_LOGITS, monkeypatch,
                                                           read_prompt=False)
    assert prefills == [[69, 299, 39, 89]] and max(widths) == 1
    assert chain_prefills == [] and chain_widths == [4]
    torch.testing.assert_close(read, chain, rtol=1e-4, atol=1e-4)
    assert torch.equal(read.argmax(-1), chain.argmax(-1))
    short = [prompt_of(30, seed=1), prompt_of(60, seed=2)]  # one chain, the compiled graph's shape
    assert _catch_up_widths(short, dm.CATCH_UP_ALL_LOGITS, monkeypatch)[2] == []
