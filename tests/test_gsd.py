"""GSD: the draft graph (merges, cycles, unmerging) on hand-made distributions, and the drafter on tiny models."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from specdec.api import SpecDecoder, hf_generate
from specdec.drafters.draft_graph import DraftGraph
from specdec.drafters.graph_draft import sibling_proposals
from specdec.verify import SamplingConfig
from tests.conftest import tiny_model
from tests.test_feature_draft import VOCAB, tiny_eagle
from tests.test_greedy_lossless import decoder, prompt_of

GREEDY = SamplingConfig()


def grow(graph: DraftGraph, dist) -> DraftGraph:
    """Expand ``graph`` level by level as the drafter does, the candidates of a node from ``dist(path)``
    (``path``: the tokens from the root, root excluded) as ``[(token, prob), ...]`` in rank order."""
    frontier = [0]
    while frontier:
        nxt = []
        for node in frontier:
            cands = dist(path_of(graph, node))
            nxt += graph.add_children(node, [t for t, _ in cands], [p for _, p in cands])
        frontier = nxt
    return graph


def path_of(graph: DraftGraph, node: int) -> tuple[int, ...]:
    out = []
    while node > 0:
        out.append(graph.tokens[node])
        node = graph.parent[node]
    return tuple(reversed(out))


TABLE = {(): [(2, 0.6), (3, 0.4)], (2,): [(5, 0.7), (6, 0.3)], (3,): [(2, 0.5), (6, 0.5)],
         (2, 5): [(9, 0.9)], (2, 6): [(9, 0.9)], (3, 2): [(5, 0.8)], (3, 6): [(9, 0.8)]}


def table(path):
    return TABLE.get(path, [])


def test_merges_where_the_bigram_repeats_tau_1():
    """tau = 1: a candidate merges into the first node with the same token after the same token."""
    g = grow(DraftGraph(1, tau=1, prob_threshold=0.0, sibling_threshold=0.0), table)
    # created: 2, 3 | 5, 6 (under 2), 2, 6 (under 3) | 9 (under 2-5), 9 (under 2-6); merged: (3,2)->5 into
    # (2,5), (3,6)->9 into (6,9)
    assert [path_of(g, n) for n in range(1, len(g.tokens))] == [(2,), (3,), (2, 5), (2, 6), (3, 2), (3, 6), (2, 5, 9),
                                                               (2, 6, 9)]
    merged = [(path_of(g, u), e.token, path_of(g, e.node)) for u in range(len(g.tokens)) for e in g.edges[u] if e.merged]
    assert merged == [((3, 2), 5, (2, 5)), ((3, 6), 9, (2, 6, 9))]
    assert g.merges == 2 and g.refused == 0
    # The graph's paths and the unmerged tree's: the table's, and 9 after (3, 2, 5), read through (2, 5).
    want = {p + (t,) for p, cands in TABLE.items() for t, _ in cands} | {(3, 2, 5, 9)}
    assert g.paths() == g.unmerge().paths() == want
    flat = g.unmerge()
    # One tree node per candidate in placement order (merged ones among their siblings), then the copies of what
    # lies under a merge target: only (3, 2, 5, 9) here.
    assert flat.tokens == [1, 2, 3, 5, 6, 2, 6, 9, 9, 5, 9, 9] and flat.copied == [False] * 11 + [True]


def test_tau_0_merges_on_one_token_and_tau_2_not_here():
    g0 = grow(DraftGraph(1, tau=0, prob_threshold=0.0, sibling_threshold=0.0), table)
    # tau 0: (3)->2 merges into node 2, (3)->6 into (2,6); the merged paths read through the first occurrence.
    merged = [(path_of(g0, u), e.token, path_of(g0, e.node)) for u in range(len(g0.tokens)) for e in g0.edges[u]
              if e.merged]
    assert ((3,), 2, (2,)) in merged and ((3,), 6, (2, 6)) in merged
    assert g0.paths() == g0.unmerge().paths()
    g2 = grow(DraftGraph(1, tau=2, prob_threshold=0.0, sibling_threshold=0.0), table)
    assert g2.merges == 0 and g2.paths() == g2.unmerge().paths() == {p + (t,) for p, c in TABLE.items() for t, _ in c}


def test_a_merge_that_closes_a_cycle_is_refused():
    """tau = 0 on a repeating token: merging 7 under 7 into its own ancestor would loop; the candidate is
    created instead and the graph stays finite."""
    g = grow(DraftGraph(1, tau=0, prob_threshold=0.0, sibling_threshold=0.0, max_depth=4),
             lambda path: [(7, 0.9)] if len(path) < 4 else [])
    assert g.refused >= 1 and g.merges == 0
    assert g.paths() == {(7,) * n for n in range(1, 5)}


def test_thresholds_decide_expansion_not_membership():
    """prob_threshold and sibling_threshold make a node a leaf: it stays in the tree, unexpanded."""
    dist = {(): [(2, 0.5), (3, 0.14), (4, 0.1)], (2,): [(5, 0.9)], (3,): [(6, 0.9)], (4,): [(7, 0.9)]}
    g = grow(DraftGraph(1, tau=2, prob_threshold=0.12, sibling_threshold=0.3), lambda p: dist.get(p, []))
    # 3 (0.14 < 0.3 * 0.5) and 4 (0.1 < 0.12) are leaves; 2 is expanded
    assert g.paths() == {(2,), (3,), (4,), (2, 5)}


def test_node_cap_and_depth_bound():
    dist = lambda path: [(10 + len(path), 0.5), (20 + len(path), 0.4)] if len(path) < 6 else []  # noqa: E731
    g = grow(DraftGraph(1, tau=3, prob_threshold=0.0, sibling_threshold=0.0, max_depth=3, max_nodes=5), dist)
    assert g.size == 5 and max(g.depth) <= 3
    assert len(g.unmerge(3)) == 4  # the root and the first three created nodes
    assert [path_of(g, n) for n in g.unmerge(3).nodes[1:]] == [(10,), (20,), (10, 11)]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), tau=st.integers(0, 2), k=st.integers(1, 3), vocab=st.integers(2, 5))
def test_random_graphs_are_dags_whose_unmerged_paths_equal_the_graphs(seed, tau, k, vocab):
    """On random distributions over a tiny vocabulary (many repeats): no cycle; every merge edge points at
    the first node carrying the candidate's (tau + 1)-gram; a created node repeats an earlier gram only where
    merging into it would have closed a cycle; the unmerged tree has exactly the graph's paths."""
    rng = random.Random(seed)
    memo = {}

    def dist(path):
        if path not in memo:
            toks = rng.sample(range(2, 2 + vocab), min(k, vocab))
            memo[path] = [(t, rng.random()) for t in toks]
        return memo[path]

    g = grow(DraftGraph(1, tau=tau, prob_threshold=0.0, sibling_threshold=0.0, max_depth=5, max_nodes=40), dist)
    for u in range(len(g.tokens)):
        assert not any(e.node == u or g.reaches(e.node, u) for e in g.edges[u]), "cycle"
    first: dict = {}
    for n in range(len(g.tokens)):
        gram = g.gram(g.parent[n], g.tokens[n]) if n else ((g.tokens[0],) if tau == 0 else None)
        if gram is None:
            continue
        if gram in first:
            assert g.reaches(first[gram], g.parent[n]), "a repeated n-gram was created although merging was possible"
        else:
            first[gram] = n
    for u in range(len(g.tokens)):
        for e in g.edges[u]:
            if e.merged:
                assert first[g.gram(u, e.token)] == e.node
    assert g.unmerge().paths() == g.paths()
    plain = grow(DraftGraph(1, tau=tau, prob_threshold=0.0, sibling_threshold=0.0, max_depth=5, max_nodes=40,
                            merge=False), dist)
    assert plain.merges == 0 and plain.unmerge().paths() == plain.paths()


def test_sibling_proposals_remove_earlier_draws():
    probs = torch.tensor([[0.5, 0.3, 0.2, 0.0]])
    out = sibling_proposals(probs, torch.tensor([[1, 0, 2]]))  # drew index 1, then 0, then 2
    torch.testing.assert_close(out[0], torch.tensor([[0.5, 0.3, 0.2, 0.0], [5 / 7, 0.0, 2 / 7, 0.0],
                                                     [0.0, 0.0, 1.0, 0.0]]))


# ---- the drafter on tiny models -------------------------------------------------------------------------


def test_merging_saves_draft_rows():
    """A self-draft on a repetitive prompt merges often (tau = 0): the draft model computes fewer rows, counted
    by a hook on the draft model, and the output is the same. Ungoverned: a governor's plain steps, decided from
    wall-clock timings, change how many levels each run drafts (CI saw 283 rows merged against 239 unmerged)."""
    dec = decoder("llama", "self")
    rows = []
    hook = dec.draft.register_forward_hook(lambda m, args, kwargs, out: rows.append(kwargs["input_ids"].numel()),
                                           with_kwargs=True)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]
    try:
        out = {}
        for merge in (1, 0):
            rows.clear()
            res = dec.generate_ids([prompt], "gsd", 24, GREEDY, tau=0, merge=merge, schedule="static", k=3,
                                   prob_threshold=0.0, sibling_threshold=0.0, max_depth=4, govern=0)
            out[merge] = (res.tokens, sum(rows), res.stats.drafter)
    finally:
        hook.remove()
    assert out[1][0] == out[0][0]
    assert out[1][2]["graph"]["merges"] > 0 and out[0][2]["graph"]["merges"] == 0
    assert out[1][1] < out[0][1]
    assert out[1][2]["graph"]["draft_rows"] < out[0][2]["graph"]["draft_rows"]


@pytest.mark.parametrize("options,match", [
    ({"k": 0}, "k"), ({"tau": -1}, "tau"), ({"prob_threshold": 1.5}, "prob_threshold"),
    ({"sibling_threshold": -0.1}, "sibling_threshold"), ({"max_nodes": 0}, "max_nodes"), ({"max_depth": 0}, "max_depth"),
    ({"siblings": "beam"}, "siblings"),
])
def test_bad_options_raise(options, match):
    dec = decoder("llama")
    with pytest.raises(ValueError, match=match):
        dec.generate_ids([prompt_of(5)], "gsd", 4, GREEDY, **options)


def test_sampled_siblings_need_sampling_and_the_static_schedule():
    dec = decoder("llama")
    with pytest.raises(ValueError, match="needs sampling"):
        dec.generate_ids([prompt_of(5)], "gsd", 4, GREEDY, siblings="sample")
    with pytest.raises(ValueError, match="schedule=static"):
        dec.generate_ids([prompt_of(5)], "gsd", 4, SamplingConfig(temperature=0.8), siblings="sample", schedule="cost")
    with pytest.raises(ValueError, match="proposal_topk"):
        dec.generate_ids([prompt_of(5)], "gsd", 4, SamplingConfig(temperature=0.8), siblings="sample", k=8,
                         proposal_topk=4)


def test_feature_draft_and_stats():
    """A feature-conditioned draft drafts graphs too; coverage per depth is counted from the target's tokens."""
    target = tiny_model("llama", VOCAB)
    dec = SpecDecoder(target, draft=tiny_eagle(target))
    prompts = [[3, 4, 5, 6, 7, 9, 11], [8], [20, 21, 22, 1, 30]]
    res = dec.generate_ids(prompts, "gsd", 16, GREEDY, prob_threshold=0.0, sibling_threshold=0.0, max_depth=3,
                           schedule="static")
    assert res.tokens == [hf_generate(target, p, 16, GREEDY) for p in prompts]
    assert res.stats.drafter["graph"]["draft_forwards"] > 0  # levels past the first were drafted
    d = res.stats.drafter
    assert d["reached"]["1"] > 0 and d["top1"]["1"] <= d["topk"]["1"] <= d["reached"]["1"]


def test_cost_schedule_plans_with_the_batchs_step_costs(monkeypatch):
    """schedule=cost in a batch: the drafter weighs expansion against the batch's own step-cost table (rows
    verify together), not one row's. With a flat batch table (verification free at any size) it drafts
    deeper than with one that makes every extra node dear; the one-row table is the same in both runs."""
    from specdec.policies import StepCost

    monkeypatch.setattr(StepCost, "observe", lambda *a, **k: None)   # keep the tables as set
    target = tiny_model("llama", VOCAB)
    dec = SpecDecoder(target, draft=tiny_eagle(target))
    prompts = [[3, 4, 5, 6, 7, 9, 11], [20, 21, 22, 1, 30]]
    one_row = dec.step_cost()
    forwards = {}
    for name, table in (("flat", {t: 1.0 for t in StepCost.SIZES}),
                        ("dear", {t: 1.0 if t == 1 else 1e4 * t for t in StepCost.SIZES})):
        one_row.batches[2] = StepCost(table, explore_every=0)
        res = dec.generate_ids(prompts, "gsd", 12, GREEDY, prob_threshold=0.0, sibling_threshold=0.0, max_depth=4,
                               schedule="cost", govern=0)  # ungoverned: plain steps would follow the machine's load
        assert res.tokens == [hf_generate(target, p, 12, GREEDY) for p in prompts]
        forwards[name] = res.stats.drafter["graph"]["draft_forwards"]
    assert forwards["dear"] < forwards["flat"], forwards
