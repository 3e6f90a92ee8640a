"""Draft-length policies: the cost model, the acceptance model and the choice they make."""
from __future__ import annotations

import pytest
import torch

from specdec.policies import AcceptanceModel, Budget, HeuristicLength, StaticLength, StepCost, best_length, prune


def test_step_cost_interpolates_and_learns():
    cost = StepCost({1: 1.0, 3: 2.0})
    assert cost(2) == pytest.approx(1.5) and cost(1) == 1.0 and cost(5) == pytest.approx(3.0)
    for _ in range(50):
        cost.observe(3, 1.0)  # the calibration overestimated T = 3
    assert cost(3) == pytest.approx(1.0, abs=1e-3)
    cost.observe(8, 4.0)
    assert cost(8) == 4.0 and cost(5) == pytest.approx(2.2, abs=0.01)  # between T=3 (1.0) and T=8 (4.0)
    with pytest.raises(ValueError):
        StepCost({2: 1.0})


def test_step_cost_extrapolates_at_least_the_average_slope():
    # A noisy last sample (c(16) below c(11)) must not make trees past 16 nodes free.
    cost = StepCost({1: 1.0, 6: 1.2, 11: 2.0, 16: 1.9})
    assert cost(26) == pytest.approx(1.9 + 10 * 0.9 / 15)
    steep = StepCost({1: 1.0, 6: 1.2, 11: 2.0, 16: 3.0})  # the last segment, when steeper, still rules
    assert steep(21) == pytest.approx(4.0)


@pytest.mark.parametrize("table", [{1: 1.0}, {1: 1.0, 3: 2.0}, {1: 0.5, 2: 0.4, 4: 0.9, 8: 1.0, 11: 3.0}])
def test_step_cost_costs_equal_pointwise_calls(table):
    cost = StepCost(table)
    assert cost.costs(14) == pytest.approx([cost(t) for t in range(1, 15)], abs=1e-12)
    assert cost.costs(0) == []


def test_step_cost_explores_once_every_n_plans():
    cost = StepCost({1: 1.0}, explore_every=3)
    assert [cost.explore() for _ in range(7)] == [False, False, True, False, False, True, False]
    assert not any(StepCost({1: 1.0}, explore_every=0).explore() for _ in range(5))


def test_acceptance_model_is_censoring_aware():
    acc = AcceptanceModel(prior_weight=1e-6)
    for _ in range(100):
        acc.observe(1, drafted=4, accepted=0)
        acc.observe(1, drafted=4, accepted=4)  # full acceptance: no failure observed for continuation
    beta, gamma = acc.params(1)
    assert beta == pytest.approx(0.5, abs=1e-3)
    assert gamma > 0.97  # every continuation trial succeeded (capped below 1)
    assert acc.estimate(1, 1) == pytest.approx(0.5, abs=1e-3)


def test_best_length_follows_cost_shape():
    acc = AcceptanceModel(prior_beta=0.4, prior_gamma=0.8)
    flat = StepCost({1: 1.0, 16: 1.05})  # long verification nearly free: draft long
    steep = StepCost({1: 1.0, 2: 1.02, 3: 1.05, 4: 1.6, 16: 3.0})  # a cliff after T = 3
    assert best_length(acc, flat, 1, 10) == 10
    assert best_length(acc, steep, 1, 10) == 2
    hopeless = AcceptanceModel(prior_beta=0.001, prior_gamma=0.1)
    assert best_length(hopeless, steep, 1, 10) == 0


def test_heuristic_schedule_matches_transformers():
    pol = HeuristicLength(5, max_k=8)
    pol.begin(1)
    pol.update([5], [5])
    assert pol.length() == 7
    pol.update([7], [7])
    assert pol.length() == 8
    pol.update([8], [2])
    assert pol.length() == 7
    for _ in range(10):
        pol.update([1], [0])
    assert pol.length() == 1
    with pytest.raises(ValueError):
        StaticLength(0)


def test_prompt_lookup_explores_one_token_more():
    import torch

    from specdec.drafters.base import DecodeState
    from specdec.drafters.prompt_lookup import PromptLookupDrafter

    seq = torch.tensor([[5, 6, 7, 8, 9, 5, 6], [1, 2, 3, 4, 10, 11, 12]])  # row 0 repeats 5 6 -> 7 8 9; row 1 never
    state = DecodeState(seq, torch.tensor([7, 7]), [7, 7])
    steep = {1: 1.0, 2: 10.0, 3: 100.0, 4: 1000.0}
    lengths = {}
    for every in (0, 1):
        drafter = PromptLookupDrafter(3, acceptance=AcceptanceModel())
        cost = StepCost(steep, explore_every=every)
        lengths[every] = prune(drafter.propose(state, Budget.static(2, 3, cost)), cost).num_drafted.tolist()
    assert lengths[0] == [0, 0]  # verification too dear: nothing drafted
    assert lengths[1] == [1, 0]  # exploring drafts one token where a match exists


@pytest.mark.parametrize("history", [True, False])
def test_prompt_lookup_keeps_acceptance_per_rows_last_outcome(history):
    """Two rows with the same 2-gram match: every draft of row 0 is accepted, none of row 1's. With history
    row 1's estimates fall to its own record and row 0's rise to its; without, both share one estimate."""
    import torch

    from specdec.drafters.base import DecodeState
    from specdec.drafters.prompt_lookup import PromptLookupDrafter

    seq = torch.tensor([[5, 6, 7, 8, 5, 6], [1, 2, 3, 4, 1, 2]])
    state = DecodeState(seq, torch.tensor([6, 6]), [6, 6])
    drafter = PromptLookupDrafter(3, acceptance=AcceptanceModel(), history=history)
    drafter.begin(state)
    cost = StepCost({1: 1.0, 2: 1.0}, explore_every=0)
    for _ in range(6):
        tree = drafter.propose(state, Budget.static(2, 3, cost))
        assert tree.num_drafted.tolist() == [3, 3]
        drafter.update(state, tree, None, [4, 1], [3, 3])  # row 0: all 3 accepted; row 1: none
    accept = drafter.propose(state, Budget.static(2, 3, cost)).accept
    if history:
        assert drafter._signal == [2 * 4 + 3, 2 * 4 + 1]
        assert accept[0, 1] > 0.6 > 0.2 > accept[1, 1]
    else:
        assert drafter._signal == [2, 2] and torch.equal(accept[0], accept[1])


def test_batch_width_shares_one_width_across_rows():
    """Rows verified in one [B, T] forward pay for the widest row: a row's nodes up to that width are free, so
    the width is chosen for the whole batch, and finished rows do not dilute it."""
    import torch

    from specdec.policies import batch_width, best_sizes

    reach = torch.tensor([[1.0, 0.9, 0.8], [1.0, 0.1, 0.05]])
    valid = torch.ones(2, 3, dtype=torch.bool)
    cost = StepCost({1: 1.0, 2: 1.1, 3: 1.5}, explore_every=0)
    # Alone, row 1 would verify nothing (1.1 / 1.1 is no better than 1 / 1); in the batch its node is free.
    assert best_sizes(reach, valid, cost) == [2, 0]
    assert batch_width(reach, valid, cost) == [1, 1]  # (2 + 1.0) / 1.1 beats (2 + 1.85) / 1.5 and 2 / 1
    assert batch_width(reach, valid, cost, active=[True, False]) == [2, 2]  # row 0 alone: 2.7 / 1.5 > 1.9 / 1.1
    short = valid.clone()
    short[1, 2] = False
    assert batch_width(reach, short, cost, active=[True, False]) == [2, 1]  # a row keeps only what it holds
    assert batch_width(reach, valid, StepCost({1: 1.0, 2: 3.0}, explore_every=0)) == [0, 0]


def test_step_cost_interpolates_batches_whose_rows_left(monkeypatch):
    """A batch size below a calibrated one (finished rows left the batch) gets a table interpolated in rows
    between the nearest calibrated sizes, one row's below; kept, so its own steps update it; a new calibration
    drops it."""
    one = StepCost({1: 1.0, 2: 1.2, 4: 1.6}, explore_every=0)
    one.batches[5] = StepCost({1: 5.0, 2: 7.0, 4: 11.0}, explore_every=0)
    assert one.for_batch(6) is one and one.for_batch(1) is one  # above every calibrated size: as before
    two = one.for_batch(2)
    assert two is one.for_batch(2) and two.table == pytest.approx({1: 2.0, 2: 2.65, 4: 3.95})  # a quarter of the way
    two.observe(1, 3.0, weight=1.0)
    assert one.for_batch(2)(1) == 3.0
    monkeypatch.setattr(StepCost, "calibrate", classmethod(lambda cls, *a, **k: cls({1: 3.0, 2: 4.0, 4: 6.0})))
    one.ensure_batch(None, 3)
    assert one.for_batch(2).table == pytest.approx({1: 2.0, 2: 2.6, 4: 3.8})  # now halfway between 1 and 3 rows
    assert one.for_batch(4).table == pytest.approx({1: 4.0, 2: 5.5, 4: 8.5})  # halfway between 3 and 5 rows


def test_step_cost_keeps_a_table_per_batch_size():
    """ensure_batch calibrates a runner at B rows once; for_batch returns it (one row's table otherwise), and a
    policy's observations of a B-row step land in the B-row table only."""
    from specdec.api import SpecDecoder
    from tests.conftest import tiny_model

    dec = SpecDecoder(tiny_model("llama"))
    one = dec.step_cost()
    assert one.for_batch(1) is one and one.for_batch(3) is one
    three = one.ensure_batch(dec.runner, 3)
    assert three is not one and one.for_batch(3) is three and one.ensure_batch(dec.runner, 3) is three
    assert sorted(three.table) == list(StepCost.BATCH_SIZES) and all(v > 0 for v in three.table.values())
    policy = StaticLength(4, cost=one)
    before, before3 = dict(one.table), dict(three.table)
    policy.observe_step(2, 123.0, rows=3)
    assert one.table == before and three.table[2] != before3[2]
    assert policy.budget([5, 5, 5]).cost is three and policy.budget([5]).cost is one


def test_batch_cut_keeps_sampled_chains_aligned():
    """A batch of sampled chains cut to one width keeps each kept node's token and its proposal distribution
    (what sampling verification reads) together."""
    import torch

    from specdec.tree import DraftTree, SparseProbs

    ids = torch.arange(2 * 3 * 2).reshape(2, 3, 2) + 20
    probs = torch.rand(2, 3, 2, generator=torch.Generator().manual_seed(0))
    tree = DraftTree.chain(torch.tensor([9, 8]), torch.tensor([[1, 2, 3], [4, 5, 6]]), SparseProbs(ids, probs))
    tree.accept = torch.tensor([[1.0, 0.9, 0.5, 0.1], [1.0, 0.2, 0.1, 0.05]])
    cut = prune(tree, StepCost({1: 1.0, 2: 1.1, 3: 2.0, 4: 3.0}, explore_every=0))  # width 1 (see above)
    assert cut.is_chain and cut.tokens.tolist() == [[9, 1], [8, 4]] and cut.valid.all()
    assert torch.equal(cut.draft_probs.ids, tree.draft_probs.ids[:, :2])
    assert torch.equal(cut.draft_probs.probs, tree.draft_probs.probs[:, :2])


@pytest.mark.parametrize("rows", [1, 3])
def test_a_cut_to_no_draft_is_a_one_token_step(rows):
    """Where no row's draft pays, the cut chain is the roots alone: no padded draft slot, which a batch's forward
    would compute for every row (a two-token step over 16 rows costs 1.76x a one-token step on some CPUs)."""
    import torch

    from specdec.tree import DraftTree

    tree = DraftTree.chain(torch.arange(rows) + 9, torch.arange(rows * 3).reshape(rows, 3) + 1)
    tree.accept = torch.tensor([[1.0, 0.1, 0.05, 0.01]]).expand(rows, 4).clone()
    cut = prune(tree, StepCost({1: 1.0, 2: 1.8, 3: 2.5, 4: 3.3}, explore_every=0))
    assert cut.is_chain and cut.tokens.tolist() == [[9 + r] for r in range(rows)] and cut.valid.all()


def test_acceptance_learners_share_one_contract():
    """Every acceptance learner reads through estimate() and learns through observe() (specdec.contracts)."""
    from specdec.contracts import AcceptanceLearner
    from specdec.drafters.ouroboros import PhraseRates
    from specdec.policies import AcceptanceModel, NodeAcceptance, ProbabilityCalibration
    from specdec.policies.disco import PlattCalibration

    learners = [AcceptanceModel(), NodeAcceptance(2, 3), ProbabilityCalibration(), PlattCalibration(), PhraseRates(3)]
    assert all(isinstance(x, AcceptanceLearner) for x in learners)
    model, nodes, probs, platt, phrases = learners
    before = model.estimate(1, 2)
    model.observe(1, 2, 2)
    assert model.estimate(1, 2) > before
    cells = torch.tensor([0, 0])
    nodes.observe(cells, torch.tensor([True, True]))
    assert nodes.estimate("cpu")[0] > NodeAcceptance(2, 3).estimate("cpu")[0]
    probs.observe([0.9], [False])
    assert probs.estimate([0.9])[0] < ProbabilityCalibration().estimate([0.9])[0]
    assert platt.estimate(torch.tensor([0.0])).item() == pytest.approx(0.5)
    phrases.observe(0, 0, 0, True)
    assert phrases.estimate(0, 0, 0) > PhraseRates(3).estimate(0, 0, 0)
