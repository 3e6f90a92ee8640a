"""The planner's rules against brute force: every decision of how much to draft or verify maximises expected tokens
per second, and the planner's callers (StepCost, vLLM's lengths, the tensor planners) agree with its one rule."""
from __future__ import annotations

import itertools
import random

import pytest
import torch

from specdec.policies import StepCost
from specdec.policies.batch_length import LinearStepCost, plan_lengths
from specdec.policies.planner import batch_width, best_size, best_sizes, marginal_bar, next_draft_token_pays, pays


def _costs(rng: random.Random, n: int) -> list[float]:
    """Non-decreasing step seconds c(1) .. c(n), flat stretches included (a batch's free width)."""
    out, c = [], rng.uniform(0.5, 2.0)
    for _ in range(n):
        out.append(c)
        c += rng.choice([0.0, rng.uniform(0.0, 0.3), rng.uniform(0.0, 2.0)])
    return out


def _brute_best(reach: list[float], costs: list[float], base: float) -> tuple[int, float]:
    rates = [(base + sum(reach[:n])) / costs[n] for n in range(min(len(reach), len(costs) - 1) + 1)]
    n = max(range(len(rates)), key=lambda i: (rates[i], -i))  # the smallest size among the best
    return n, base + sum(reach[:n])


@pytest.mark.parametrize("seed", range(200))
def test_best_size_is_the_brute_force_optimum(seed):
    rng = random.Random(seed)
    reach = sorted((rng.random() for _ in range(rng.randint(0, 9))), reverse=True)
    costs = _costs(rng, rng.randint(1, 11))
    base = rng.choice([1.0, float(rng.randint(1, 8))])
    n, expected = best_size(reach, costs, base)
    want_n, want_e = _brute_best(reach, costs, base)
    rate = lambda k: (base + sum(reach[:k])) / costs[k]  # noqa: E731
    assert rate(n) == pytest.approx(rate(want_n), rel=1e-12) and expected == pytest.approx(base + sum(reach[:n]))
    assert n <= want_n or rate(n) > rate(want_n) * (1 - 1e-12)
    table = StepCost({t: c for t, c in enumerate(costs, start=1)})
    if base == 1.0:  # what drafters are handed: the same rule on the table's own costs
        assert table.best_size(reach, costs) == (n, expected)


@pytest.mark.parametrize("seed", range(100))
def test_tensor_planners_keep_the_brute_force_best_rows_and_width(seed):
    rng = random.Random(seed)
    rows, t = rng.randint(1, 4), rng.randint(2, 8)
    reach = torch.rand(rows, t)
    valid = torch.rand(rows, t) < 0.8
    valid[:, 0] = True
    table = StepCost({s: c for s, c in enumerate(_costs(rng, t), start=1)})
    costs = table.costs(t)
    sizes = best_sizes(reach, valid, table)
    for r in range(rows):  # float32 sums in the planner: the same rate, to rounding
        nodes = sorted((reach[r, j].item() for j in range(1, t) if valid[r, j]), reverse=True)
        rate = lambda n: (1.0 + sum(nodes[:n])) / costs[n]  # noqa: E731
        assert sizes[r] <= len(nodes) and rate(sizes[r]) == pytest.approx(rate(_brute_best(nodes, costs, 1.0)[0]), rel=1e-5)
    width = max(batch_width(reach, valid, table), default=0)
    held = [sorted((reach[r, j].item() for j in range(1, t) if valid[r, j]), reverse=True) for r in range(rows)]
    rate = lambda w: sum(1.0 + sum(h[:w]) for h in held) / costs[w]  # noqa: E731
    best = max(rate(w) for w in range(t))
    assert rate(width) == pytest.approx(best, rel=1e-5)


@pytest.mark.parametrize("seed", range(60))
def test_vllm_lengths_are_the_best_prefixes_of_every_chain(seed):
    rng = random.Random(seed)
    reach = [sorted((rng.random() for _ in range(rng.randint(0, 3))), reverse=True) for _ in range(rng.randint(1, 3))]
    cost = LinearStepCost(explore_every=0)
    for tokens in range(1, 20):  # a fitted slope: the plan weighs tokens against seconds
        cost.observe(tokens, 0.01 + rng.uniform(0.001, 0.004) * tokens)
    a, b = cost.coefficients()
    plan = plan_lengths(reach, cost)
    rate = lambda ns: (len(reach) + sum(sum(r[:n]) for r, n in zip(reach, ns))) / (a + b * (len(reach) + sum(ns)))  # noqa: E731
    best = max(rate(ns) for ns in itertools.product(*[range(len(r) + 1) for r in reach]))
    assert rate(plan) == pytest.approx(best, rel=1e-9)


@pytest.mark.parametrize("seed", range(100))
def test_pays_and_the_marginal_bar_are_one_rule(seed):
    rng = random.Random(seed)
    tokens, seconds, extra = rng.uniform(1, 5), rng.uniform(0.1, 2), rng.uniform(0.0, 1)
    bar = marginal_bar(tokens, seconds, extra)
    for gain in (bar * 0.99, bar * 1.01):
        assert pays(gain, tokens, seconds, extra) == (gain > bar)
    # DISCO's next token: one more draft forward and one more verified node, against the step so far
    depth = rng.randint(1, 5)
    reach = [torch.tensor([rng.random()]) for _ in range(depth)]
    for i in range(1, depth):
        reach[i] = reach[i] * reach[i - 1]
    p, d = torch.tensor([rng.random()]), rng.uniform(0.0, 0.5)
    costs = _costs(rng, depth + 2)
    now = (1 + sum(x.item() for x in reach)) / (costs[depth] + depth * d)
    more = (1 + sum(x.item() for x in reach) + reach[-1].item() * p.item()) / (costs[depth + 1] + (depth + 1) * d)
    if abs(now - more) > 1e-9 * now:
        assert next_draft_token_pays(reach, p, costs, d).item() == (more > now)
