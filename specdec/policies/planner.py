"""The cost planner: every decision of how much to draft or verify, from acceptance estimates, the measured step
cost and the measured draft seconds.

Every rule here maximises expected tokens per second: a step that verifies ``n`` draft nodes emits
``1 + E[accepted]`` tokens and costs ``c(n + 1)`` of target time (the root is always verified), plus the draft's
forwards where a draft model runs. Two rules do the work: :func:`best_size` (how many of the likeliest nodes to
keep; :func:`best_sizes`, :func:`batch_width`, :func:`best_length`, :func:`plan_size` and :meth:`StepCost.best_size`
are it over a batch, a common width, an acceptance model, a drafter's own list; :func:`explored` is the one
exploration rule on top) and :func:`pays` (whether adding work raises
the rate: DISCO's next draft token, GSD's next frontier level); :func:`best_window` is PEARL's, where drafting
overlaps verification.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specdec.tree import DraftTree, SparseProbs

if TYPE_CHECKING:
    from specdec.policies.acceptance import AcceptanceModel
    from specdec.policies.cost import StepCost


def best_size(reach: list[float], costs: list[float], base: float = 1.0) -> tuple[int, float]:
    """Of draft nodes reached with probabilities ``reach`` (in the order they would be added), how many to verify
    for the most expected tokens per second of target time, and the tokens that emits (``base +`` their reach).
    costs: the step's seconds with ``0 .. m - 1`` nodes (``c(1) .. c(m)`` for one row; nodes past ``m - 1`` are not
    considered); base: the tokens the step emits with none (1 a row). The smallest size wins ties."""
    best_n, best_e, best_rate, expected = 0, base, base / costs[0], base
    for n, r in enumerate(reach[: len(costs) - 1], start=1):
        expected += r
        if expected / costs[n] > best_rate:
            best_n, best_e, best_rate = n, expected, expected / costs[n]
    return best_n, best_e


def explored(best: int, available: int, explore: bool) -> int:
    """The exploration rule every size planner here shares: on an exploring plan (:meth:`StepCost.explore`), one
    node more than the optimum ``best`` where ``available`` nodes allow, so sizes the plan avoids are timed
    now and then."""
    return min(best + 1, available) if explore else best


def plan_size(reach: list[float], costs: list[float], explore: bool = False) -> int:
    """How many of one row's draft nodes, reached with probabilities ``reach`` (any order), to verify: the
    likeliest first, :func:`best_size` on them, then :func:`explored`. costs: ``c(1) .. c(len(reach) + 1)``."""
    n, _ = best_size(sorted(reach, reverse=True), costs)
    return explored(n, len(reach), explore)


def pays(gain, tokens, seconds, extra_seconds):
    """Whether work that adds ``gain`` expected tokens for ``extra_seconds`` raises the rate of a step that emits
    ``tokens`` in ``seconds``: ``(tokens + gain) / (seconds + extra_seconds) > tokens / seconds``. Floats or
    tensors (per row, broadcast)."""
    return (tokens + gain) / (seconds + extra_seconds) > tokens / seconds


def marginal_bar(tokens: float, seconds: float, extra_seconds: float) -> float:
    """The expected tokens that work of ``extra_seconds`` must add to pay (:func:`pays` at equality) in a step that
    emits ``tokens`` in ``seconds``."""
    return tokens * extra_seconds / seconds


def best_window(alpha: float, draft_seconds: float, costs: list[float]) -> int:
    """PEARL: the window length ``g`` in ``1 .. len(costs)`` with the most expected tokens per second.

    alpha: per-token acceptance; draft_seconds: one draft forward (a window of ``g`` costs ``g`` of them);
    costs: ``costs[n-1]`` the target's seconds over a chain of ``n`` tokens. A pre-verify round (target over
    the root) takes ``max(g * t_q, c(1))`` and emits 1 token, then post-verify follows with probability
    ``alpha``; a post-verify round (root plus ``g - 1`` pending) takes ``max(g * t_q, c(g))``, emits
    ``(1 - alpha^g) / (1 - alpha)`` tokens in expectation and stays with probability ``alpha^g``. Their
    stationary mix gives the rate.
    """
    alpha = min(max(alpha, 1e-3), 1 - 1e-3)
    best, best_rate = 1, -1.0
    for g in range(1, len(costs) + 1):
        stay = alpha ** g
        post = alpha / (1 - stay)  # post-verify rounds per pre-verify round
        tokens = 1 + post * (1 - stay) / (1 - alpha)
        seconds = max(g * draft_seconds, costs[0]) + post * max(g * draft_seconds, costs[g - 1])
        rate = tokens / seconds
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = g, rate
    return best


def next_draft_token_pays(reach: list[torch.Tensor], p: torch.Tensor, costs: list[float],
                          draft_seconds: float) -> torch.Tensor:
    """DISCO's cost mode, per row: does drafting one more token raise this step's expected tokens per second?

    reach: ``depth`` tensors ``[B]``, the chance each drafted prefix is accepted; p: ``[B]`` the last token's
    calibrated acceptance (the next one is taken to be accepted about as often: its features are unknown);
    costs: ``c(1) .. c(depth + 2)``; draft_seconds: one draft forward. Returns ``[B] bool``."""
    depth = len(reach)
    emitted = 1.0 + torch.stack(reach).sum(0)
    seconds = costs[depth] + depth * draft_seconds
    return pays(reach[-1] * p, emitted, seconds, draft_seconds + costs[depth + 1] - costs[depth])


def best_length(acceptance: AcceptanceModel, cost: StepCost, signal: int, max_k: int) -> int:
    """The draft length in ``[0, max_k]`` with the most expected tokens per second of target time: :func:`best_size`
    on the reach each further token adds (``acceptance`` gives the expected accepted tokens of a length)."""
    expected = [0.0] + [acceptance.estimate(signal, k) for k in range(1, max_k + 1)]
    return best_size([b - a for a, b in zip(expected, expected[1:])], cost.costs(max_k + 1))[0]


def _expected_and_costs(reach: torch.Tensor, valid: torch.Tensor, cost: StepCost):
    """What the size planners share: ``[B,T-1]`` expected accepted nodes when a row keeps its ``n = 1 ..``
    likeliest nodes (host), ``[B]`` valid nodes per row, and ``c(1) .. c(T)``; ``(None, [0] * B, None)``
    for a tree of roots only."""
    r = reach[:, 1:].float().masked_fill(~valid[:, 1:], 0.0)
    n_valid = valid[:, 1:].sum(-1).tolist()
    if r.shape[1] == 0:
        return None, [0] * r.shape[0], None
    top = r.sort(dim=1, descending=True).values.cumsum(1).cpu()
    return top, n_valid, torch.tensor(cost.costs(r.shape[1] + 1), dtype=top.dtype)


def best_sizes(reach: torch.Tensor, valid: torch.Tensor, cost: StepCost, explore: bool = False) -> list[int]:
    """Per row, how many draft nodes to verify: the ``n`` most likely to be reached.

    reach: ``[B,T]`` probability that each node is accepted (the product of its path's conditional
    acceptance; the root's column is ignored); valid: ``[B,T] bool``. Nodes are taken by descending
    ``reach``, which keeps every kept node's parent (a parent is reached at least as often as its child).
    ``explore``: one node more than the optimum where a row has one (so sizes the plan avoids get timed).
    Returns ``[B]`` host ints.
    """
    top, n_valid, costs = _expected_and_costs(reach, valid, cost)
    if top is None:
        return n_valid
    rates = torch.cat([torch.ones_like(top[:, :1]), 1.0 + top], 1) / costs  # [B,T]: n = 0 .. T-1
    # Rows may not verify more nodes than they hold.
    n = torch.arange(rates.shape[1])[None]
    rates = rates.masked_fill(n > torch.tensor(n_valid)[:, None], float("-inf"))
    best = rates.argmax(1).tolist()  # the first (smallest) n among equal rates
    return [explored(b, v, explore) for b, v in zip(best, n_valid)]


def _chain_sizes(reach: list[list[float]], drafted: list[int], cost: StepCost, explore: bool) -> list[int]:
    """:func:`best_sizes` for chains, on the host: a chain's nodes are already in order of ``reach``
    (a few host operations instead of a dozen small tensor ops per step)."""
    costs = cost.costs(max(drafted, default=0) + 1)
    out = []
    for row, n in zip(reach, drafted):
        best, _ = best_size(row[1: n + 1], costs)
        out.append(explored(best, n, explore))
    return out


def batch_width(reach: torch.Tensor, valid: torch.Tensor, cost: StepCost, active: list[bool] | None = None,
                explore: bool = False) -> list[int]:
    """Per row, how many draft nodes to verify when the rows share one forward of a common width.

    The target runs ``[B, T]`` tokens, ``T`` the widest row's nodes plus the root, so a row's nodes up
    to that width cost nothing more. This picks the ``T`` with the most expected tokens per second over
    the whole batch, ``sum_b (1 + E_b[accepted of its T - 1 likeliest nodes]) / c(T)`` (``cost``: the
    batch's own table, :meth:`StepCost.for_batch`), and gives every row its ``T - 1`` likeliest nodes (or
    all it holds). reach, valid: ``[B,T]`` as in :func:`best_sizes`; active: rows still generating (the
    others emit nothing; default all). Returns ``[B]`` host ints.
    """
    top, n_valid, costs = _expected_and_costs(reach, valid, cost)
    if top is None:
        return n_valid
    if active is not None:
        top = top[torch.tensor(active, dtype=torch.bool)]  # [B',T-1]: rows still generating
    expected = torch.cat([torch.zeros(1, dtype=top.dtype), top.sum(0)]) + float(top.shape[0])  # n = 0 .. T-1
    width = explored(int((expected / costs).argmax()), max(n_valid), explore)  # the first (narrowest) of equal rates
    return [min(width, v) for v in n_valid]


def prune(tree: DraftTree, cost: StepCost, active: list[bool] | None = None) -> DraftTree:
    """``tree`` cut to the nodes worth their verification cost, by its per-node ``accept`` estimates.

    A chain stays a chain (each row cut to its best length, the width to the longest kept); a tree keeps
    each row's most likely nodes (:meth:`DraftTree.select`). A batch of several rows is cut to one width
    for all (:func:`batch_width`; ``active``: rows still generating); one row, to its own best size.
    Calls ``cost.explore()`` once.
    """
    explore = cost.explore()
    if tree.tokens.shape[0] > 1:
        keep = batch_width(tree.accept, tree.valid, cost, active, explore)
    elif tree.is_chain:
        keep = _chain_sizes(tree.accept.tolist(), tree.num_drafted.tolist(), cost, explore)
    else:
        keep = best_sizes(tree.accept, tree.valid, cost, explore)
    if tree.is_chain:
        # The root and the longest kept chain: a step where no row drafts is a one-token step (in a batch, a
        # padded draft slot costs every row a token: 1.76x a one-token step over 16 rows on an AVX-512 EPYC).
        t = 1 + max(keep, default=0)
        cut = torch.arange(t, device=tree.tokens.device)[None] > torch.tensor(keep, device=tree.tokens.device)[:, None]
        probs = None
        if tree.draft_probs is not None:
            probs = SparseProbs(tree.draft_probs.ids[:, :t], tree.draft_probs.probs[:, :t])
        # Copies with standard strides: a compiled forward is specialised on its inputs' strides, and a
        # one-row slice counts as contiguous while keeping its parent's row stride.
        fresh = lambda x: x[:, :t].clone(memory_format=torch.contiguous_format)  # noqa: E731
        return DraftTree(fresh(tree.tokens), fresh(tree.parents), tree.valid[:, :t] & ~cut, fresh(tree.depth), True,
                         probs, accept=tree.accept[:, :t], origin=None if tree.origin is None else tree.origin[:, :t])
    return tree.select((_rank(tree) <= torch.tensor(keep, device=tree.tokens.device)[:, None]) & tree.valid)[0]


def _rank(tree: DraftTree) -> torch.Tensor:
    """``[B,T]`` each node's place in its row (the root 0): by descending ``tree.accept``, ties shallower first
    and then by index (so a parent, reached at least as often as its child, comes first; the order
    :func:`specdec.kernels.draft_tree` cuts by), else in node order."""
    if tree.accept is None:
        return torch.cumsum(tree.valid.long(), 1) - 1
    r = tree.accept.float().masked_fill(~tree.valid, -1.0)
    r[:, 0] = 2.0  # the root first
    by_depth = tree.depth.argsort(dim=1, stable=True)
    order = by_depth.gather(1, r.gather(1, by_depth).argsort(dim=1, descending=True, stable=True))
    return torch.empty_like(order).scatter_(1, order, torch.arange(order.shape[1], device=order.device).expand_as(order))


def cap_nodes(tree: DraftTree, max_nodes: list[int]) -> DraftTree:
    """``tree`` with at most ``max_nodes[b]`` draft nodes in row ``b`` (host ints): the most likely ones by
    ``tree.accept`` when the tree carries estimates, else the first ones in node order (a node's parent
    precedes it, so any prefix of the nodes is a tree). Returns ``tree`` itself when no row is over."""
    if all(n >= m for n, m in zip(max_nodes, tree.num_drafted.tolist())):
        return tree
    limit = torch.tensor(max_nodes, device=tree.tokens.device)[:, None]
    if tree.is_chain:
        cut = torch.arange(tree.size, device=tree.tokens.device)[None] > limit
        return DraftTree(tree.tokens, tree.parents, tree.valid & ~cut, tree.depth, True, tree.draft_probs,
                         accept=tree.accept, origin=tree.origin)
    return tree.select((_rank(tree) <= limit) & tree.valid)[0]
