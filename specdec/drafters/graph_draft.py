"""GSD (graph-structured speculative decoding): the draft model grows a graph of its top-k continuations.

A step: the draft catches up on the committed tokens (one forward), then expands level by level. Each
level is one draft forward over the whole frontier of every row, written into the draft runner's
pending region (:meth:`~specdec.model.ModelRunner.forward_pending`): a frontier node attends to the
committed prefix and to its own ancestors there, so nothing is recomputed. Each frontier node's ``k``
candidates (``specdec.kernels.topk_entropy`` on the draft's logits, or draws, see below) go into the
row's :class:`~specdec.drafters.draft_graph.DraftGraph`, which prunes (a node below ``prob_threshold``
or below ``sibling_threshold`` times its best sibling is not expanded) and merges candidates whose
(tau + 1)-gram already occurs into its first occurrence: the graph computes each shared run once. The
graph is unmerged into a tree and, with per-node acceptance estimates (the draft's probability,
calibrated online against the target's tokens), handed to the decode loop, whose cost planner keeps the
nodes that pay for their measured verification cost.

Exactness. Greedy decoding verifies by matching the target's argmax, so any tree is exact. Sampling
has two variants (``siblings``):

* ``topk``: the children are the draft's ``k`` most likely tokens under the processed distribution
  (temperature, top-k, top-p), a deterministic function of the draft's logits. Every node is verified as
  a one-hot proposal: recursive rejection sampling over distinct deterministic candidates accepts each
  with the residual target probability and is exact for *any* choice of candidates that does not look at
  the verification's random numbers. Pruning, merging, the node cap and the planner may therefore keep or
  drop any node.
* ``sample``: the ``k`` children of a node are drawn without replacement from ``q``, the draft's
  processed distribution over its ``proposal_topk`` most likely tokens (Gumbel top-k, whose order is the
  draw order), and the ``i``-th carries ``q`` with the ``i - 1`` tokens drawn before it removed and
  renormalised: exactly the distribution it was drawn from given those draws. The verifier's recursive
  rejection rule is exact when each tried candidate follows the proposal it is verified with, given
  everything drawn before (each test then turns the current target distribution into the residual, and
  the residual's own continuation is exact by induction). That holds as long as neither whether a
  candidate is in the tree, nor where, nor which proposal it carries depends on its own value: a node
  selected *because* of its value follows ``q`` conditioned on being selected, not ``q``. The unmerged
  tree therefore has one node per candidate, in the order the candidates were placed, merged or not
  (:meth:`DraftGraph.unmerge`), and the node cap counts candidates placed before it, never its own
  value. The thresholds only decide whether a node is *expanded*: that changes its descendants (tried
  only after it is accepted, given its value) and the places of later candidates (their predecessors'
  values, not theirs). What a merge copies under a merged candidate (the target's successors, drawn in
  another context, present because the candidate's value matched) is verified one-hot. The cost planner
  would choose sizes from every node's estimate, its own included, so ``siblings=sample`` runs without it
  (``schedule=static``). Candidates dropped for any reason are simply never tried: the later siblings'
  proposals already condition on them. A one-hot node is exact for the same reason the ``topk`` variant
  is. ``tests/test_sampling.py`` checks both variants, merges included, with chi-square tests and
  catches a planted bug (siblings verified against the undivided ``q``).
"""
from __future__ import annotations

import torch

from specdec.drafters.base import Budget, DecodeState, Drafter, StepCostLike
from specdec.drafters.draft_graph import DraftGraph, Flat
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.tree import DraftTree, SparseProbs
from specdec.verify import SamplingConfig, processed_logits
from specdec import kernels

SIBLINGS = ("topk", "sample")


def sibling_proposals(probs: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """The distribution each of ``k`` draws without replacement was drawn from: ``probs [...,K]`` with the
    entries drawn before it (``order [...,k]``, indices into K in draw order) removed, renormalised.
    Returns ``[..., k, K]``."""
    picked = torch.nn.functional.one_hot(order, probs.shape[-1]).bool()  # [...,k,K]
    before = torch.zeros_like(picked)
    before[..., 1:, :] = picked[..., :-1, :].cumsum(-2).bool()
    rest = probs.unsqueeze(-2).expand_as(picked).masked_fill(before, 0.0)
    return rest / rest.sum(-1, keepdim=True).clamp(min=1e-30)


class GraphDrafter(Drafter):
    """GSD over a chain drafter's model and cache (``base``: a :class:`DraftModelDrafter`, plain or
    feature-conditioned).

    k: candidates per expanded node; tau, prob_threshold, sibling_threshold, merge: see
    :class:`DraftGraph`; max_depth: levels per step; max_nodes: candidates a row's graph places, and draft
    nodes in its verified tree; siblings: ``topk`` or ``sample`` (see the module
    docstring); calibration: maps the draft's probabilities to acceptance estimates
    (:class:`~specdec.policies.ProbabilityCalibration`), None for no estimates (no planning); cost,
    draft_seconds: the target's measured :class:`~specdec.policies.StepCost` and the seconds of one draft
    forward, which with ``calibration`` make the drafting depth cost-aware (:meth:`_worth_expanding`).
    """

    def __init__(self, base: DraftModelDrafter, sampling: SamplingConfig, k: int = 4, tau: int = 2,
                 prob_threshold: float = 0.2, sibling_threshold: float = 0.3, max_depth: int = 10,
                 max_nodes: int = 64, merge: bool = True, siblings: str = "topk", calibration=None,
                 cost: StepCostLike | None = None, draft_seconds: float | None = None):
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        if tau < 0:
            raise ValueError(f"tau must be >= 0, got {tau}")
        for name, value in (("prob_threshold", prob_threshold), ("sibling_threshold", sibling_threshold)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}")
        if max_nodes < 1:
            raise ValueError(f"max_nodes must be >= 1, got {max_nodes}")
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        if siblings not in SIBLINGS:
            raise ValueError(f"siblings must be one of {SIBLINGS}, got {siblings!r}")
        if siblings == "sample" and sampling.greedy:
            raise ValueError("siblings=sample draws the children, which needs sampling (temperature > 0)")
        if siblings == "sample" and k > base.proposal_topk:
            raise ValueError(f"siblings=sample draws k={k} children from proposal_topk={base.proposal_topk} tokens")
        self.base, self.sampling = base, sampling
        self.k, self.tau, self.merge, self.siblings = k, tau, merge, siblings
        self.prob_threshold, self.sibling_threshold = prob_threshold, sibling_threshold
        self.max_depth, self.max_nodes = max_depth, max_nodes
        self.calibration = calibration
        self.cost, self.draft_seconds = cost, draft_seconds
        # Cost-aware drafting depth: needs acceptance estimates, the target's step cost and the draft's.
        self._planning = calibration is not None and cost is not None and draft_seconds is not None
        self.needs_hidden = base.needs_hidden
        self.keeps_rows = base.keeps_rows  # the per-row state is the base draft's (graphs live for one step)
        base.reserve(max_nodes)
        self._graphs: list[DraftGraph | None] = []
        self._stats = self._fresh_stats()

    # ---- Drafter interface ----------------------------------------------------------------------

    @property
    def draft_nodes(self) -> int:
        return self.base.draft_nodes

    def begin(self, state: DecodeState) -> None:
        super().begin(state)
        self.base.begin(state)
        self._stats = self._fresh_stats()

    @staticmethod
    def _fresh_stats() -> dict:
        # coverage: depth -> [times the target reached an expanded node there, top-1 hits, top-k hits]
        return {"steps": 0, "draft_rows": 0, "draft_forwards": 0, "graph_nodes": 0, "merges": 0, "refused_merges": 0,
                "tree_nodes": 0, "copied_nodes": 0, "coverage": {}}

    def max_tree_size(self, depth: int) -> int:
        return 1 + self.max_nodes

    def add_hidden(self, hidden: torch.Tensor, counts: torch.Tensor) -> None:
        self.base.add_hidden(hidden, counts)

    def keep_rows(self, rows: list[int]) -> None:
        self.base.keep_rows(rows)
        self._graphs = []  # the last step's graphs, already learned from in update()

    def propose(self, state: DecodeState, budget: Budget) -> DraftTree:
        with self.base.forward_mode():
            tree = self._propose(state, budget)
        self.draft_calls = self.base.draft_calls
        return tree

    def update(self, state: DecodeState, tree: DraftTree, path: torch.Tensor, path_len: list[int],
               drafted: list[int]) -> None:
        self.base.update(state, tree, path, path_len, drafted)
        rows = [r for r, n in enumerate(path_len) if n > 0 and r < len(self._graphs) and self._graphs[r] is not None]
        if not rows:
            return
        ends = state.seq_lens_host
        lo, hi = min(ends[r] - path_len[r] for r in rows), max(ends[r] for r in rows)
        window = state.seq[:, lo:hi].tolist()  # one transfer of the step's new tokens
        for r in rows:  # the accepted drafts, then the next token
            self._observe(self._graphs[r], window[r][ends[r] - path_len[r] - lo: ends[r] - lo])

    def summary(self) -> dict:
        """Counter groups (summed over prompts by the bench): ``graph`` (steps, draft forwards and rows, graph
        nodes, merges, refused merges, unmerged tree nodes before planning, copied nodes), and per depth ``d``
        the times the target reached an expanded node at depth ``d - 1`` (``reached``) and how often its token
        there was the draft's first candidate (``top1``) or any of the ``k`` (``topk``)."""
        cov = sorted(self._stats["coverage"].items())
        counts = {k: v for k, v in self._stats.items() if k != "coverage"}
        return {"graph": counts, **{name: {str(d): v[i] for d, v in cov} for i, name in enumerate(("reached", "top1",
                                                                                                   "topk"))}}

    # ---- drafting -----------------------------------------------------------------------------------

    def _propose(self, state: DecodeState, budget: Budget) -> DraftTree:
        b = state.seq.shape[0]
        dev = state.seq.device
        self._graphs = [None] * b
        if budget.depth < 1 or not self.base.fits(state, min(budget.depth, self.max_depth)):
            return DraftTree.chain(state.roots)
        logits, hidden = self.base.catch_up(state)
        logits, hidden = logits[:, None], None if hidden is None else hidden[:, None]
        roots = state.roots.tolist()
        limits = [min(d, self.max_depth) for d in budget.max_depth]
        graphs = [DraftGraph(roots[r], self.tau, self.prob_threshold, self.sibling_threshold, self.max_depth,
                             self.max_nodes, self.merge) if limits[r] > 0 else None for r in range(b)]
        self._graphs = graphs
        fed = [[0] if g is not None else [] for g in graphs]  # graph node of each column of ``logits``
        pending: list[dict[int, int]] = [{} for _ in range(b)]  # graph node -> index in the draft's pending region
        base_pos = self.base.root_positions()  # [B]
        proposals: list[SparseProbs] = []
        cells = 0
        n_pending = 0
        for level in range(1, self.max_depth + 1):
            tokens, probs, q = self._children(logits)
            width = logits.shape[1]
            if q is not None:
                proposals.append(q)
            toks, ps = tokens.tolist(), probs.tolist()
            grow: list[list[tuple[int, int]]] = [[] for _ in range(b)]  # (new node, parent column)
            for r, g in enumerate(graphs):
                for col, node in enumerate(fed[r]):
                    c = [cells + col * self.k + i for i in range(self.k)] if q is not None else None
                    grow[r] += [(n, col) for n in g.add_children(node, toks[r][col], ps[r][col], c, limits[r])]
            cells += width * self.k
            if self._planning:  # a batch's own step costs where the policy has them (B rows verify together)
                grow = self._worth_expanding(graphs, grow, budget.cost if budget.cost is not None else self.cost)
            f = max(len(x) for x in grow)
            if f == 0 or level == self.max_depth:
                break
            n_pending += f
            ids = torch.zeros(b, f, dtype=torch.int64)
            depth = torch.zeros(b, f, dtype=torch.int64)
            cols = torch.zeros(b, f, dtype=torch.int64)
            words = (n_pending + 31) // 32
            mask = [[[0] * words for _ in range(f)] for _ in range(b)]
            for r, row in enumerate(grow):
                g = graphs[r]
                for j, (node, col) in enumerate(row):
                    pending[r][node] = n_pending - f + j
                    ids[r, j], depth[r, j], cols[r, j] = g.tokens[node], g.depth[node], col
                    a = node
                    while a > 0:  # the node and its ancestors below the root (which is committed)
                        bit = pending[r][a]
                        mask[r][j][bit // 32] |= 1 << (bit % 32)
                        a = g.parent[a]
            packed = torch.tensor(mask, dtype=torch.int64)
            packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32).to(dev)
            ids, depth, cols = ids.to(dev), depth.to(dev), cols.to(dev)
            extra = None
            if hidden is not None:
                extra = self.base.frontier_inputs(hidden.gather(1, cols[..., None].expand(-1, -1, hidden.shape[-1])))
            logits, hidden = self.base.forward_pending(ids, base_pos[:, None] + depth, packed, self.needs_hidden, extra)
            self._stats["draft_forwards"] += 1
            self._stats["draft_rows"] += sum(len(x) for x in grow)
            fed = [[node for node, _ in row] for row in grow]
        return self._tree(state, graphs, proposals)

    def _worth_expanding(self, graphs: list[DraftGraph | None], grow: list[list[tuple[int, int]]],
                         cost: StepCostLike) -> list[list[tuple[int, int]]]:
        """schedule=cost: the frontier cut to what may pay for another draft forward.

        Each row's tree is planned by the planner's rules, which come with the cost table: ``cost.best_size`` (most
        likely nodes first, the size with the most expected tokens per second) gives its expected tokens ``E``, and
        ``cost.marginal_bar`` the reach a further node needs to be kept, ``E * (c(n+2) - c(n+1)) / c(n+1)``. A frontier node is expanded only if its
        reach times the draft's measured top-1 coverage at its children's depth clears that bar (its best
        child could be kept), and the level only if its nodes' reach times the top-k coverage, the tokens it
        may add, is worth the draft forward's share of a step (``E * d / c(n+1)`` summed over rows).
        """
        costs = cost.costs(self.max_nodes + 2)
        gain, price, out = 0.0, 0.0, []
        for r, row in enumerate(grow):
            g = graphs[r]
            if g is None or not row:
                out.append(row)
                continue
            reach = self._reach(g)
            n, expected = cost.best_size(sorted(reach[1:], reverse=True), costs)
            bar = cost.marginal_bar(expected, costs[n], costs[n + 1] - costs[n])  # a further node's reach
            keep = [(node, col) for node, col in row if reach[node] * self._coverage(g.depth[node] + 1)[0] >= bar]
            out.append(keep)
            gain += sum(reach[node] * self._coverage(g.depth[node] + 1)[1] for node, _ in keep)
            price += cost.marginal_bar(expected, costs[n], self.draft_seconds)  # the draft forward's share
        return out if gain >= price else [[] for _ in grow]

    def _reach(self, g: DraftGraph) -> list[float]:
        """The calibrated reach of every created node of ``g`` (indexed by node; the root's is 1), then that of
        every merged candidate."""
        by_node = [1.0] * len(g.tokens)
        extra = []
        est = self.calibration.estimate([g.edges[u][i].prob for u, i in g.order])
        for (u, i), e in zip(g.order, est):
            edge = g.edges[u][i]
            if edge.merged:
                extra.append(by_node[u] * e)
            else:
                by_node[edge.node] = by_node[u] * e
        return by_node + extra

    def _coverage(self, depth: int) -> tuple[float, float]:
        """How often the target's token at ``depth`` (given it reached an expanded node above) was the draft's
        first / any candidate, so far (prior 0.3 / 0.5, worth 10 observations)."""
        reached, hits1, hitsk = self._stats["coverage"].get(depth, (0, 0, 0))
        return (hits1 + 3.0) / (reached + 10.0), (hitsk + 5.0) / (reached + 10.0)

    def _children(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, SparseProbs | None]:
        """Candidates of every column of ``logits [B,F,V]``: tokens ``[B,F,k]`` (target ids, -1 where a
        column has fewer), their draft probabilities ``[B,F,k]`` and, for ``siblings=sample``, the proposal
        each was drawn from (``[B, F*k, K]``)."""
        self.base.check(logits)
        b, f, v = logits.shape
        k = min(self.k, v)
        vocab_map = self.base.vocab_map
        if self.siblings == "topk":
            if self.sampling.greedy:
                probs, ids, _, _ = kernels.topk_entropy(logits.reshape(b * f, v), k)
            else:
                probs, ids = processed_logits(logits.reshape(b * f, v), self.sampling).softmax(-1).topk(k, dim=-1)
            ids = torch.where(probs > 0, ids if vocab_map is None else vocab_map[ids], -1)
            return ids.view(b, f, k), probs.view(b, f, k), None
        q = SparseProbs.top_k(processed_logits(logits, self.sampling), self.base.proposal_topk)  # [B,F,K]
        if vocab_map is not None:
            q = q.map_ids(vocab_map)
        gumbel = -torch.log(-torch.log(torch.rand(q.probs.shape, generator=self.base.generator,
                                                  device=q.probs.device).clamp(min=1e-20)))
        keys = torch.where(q.probs > 0, q.probs.log() + gumbel, float("-inf"))
        order = keys.topk(k, dim=-1).indices  # [B,F,k] draw order
        probs = q.probs.gather(2, order)
        ids = torch.where(probs > 0, q.ids.gather(2, order), -1)
        rest = sibling_proposals(q.probs, order)
        proposals = SparseProbs(q.ids[:, :, None].expand(-1, -1, k, -1).reshape(b, f * k, q.k),
                                rest.reshape(b, f * k, q.k))
        return ids, probs, proposals

    def _tree(self, state: DecodeState, graphs: list[DraftGraph | None], proposals: list[SparseProbs]) -> DraftTree:
        """The rows' graphs unmerged into one :class:`DraftTree` (proposals, acceptance estimates)."""
        b = len(graphs)
        dev = state.seq.device
        flats = [g.unmerge(self.max_nodes) if g is not None else None for g in graphs]
        roots = state.roots.tolist()
        t = max(len(f) if f is not None else 1 for f in flats)
        tokens = torch.zeros(b, t, dtype=torch.int64)
        parents = torch.zeros(b, t, dtype=torch.int64)
        valid = torch.zeros(b, t, dtype=torch.bool)
        cell = torch.full((b, t), -1, dtype=torch.int64)
        accept = torch.zeros(b, t)
        for r, flat in enumerate(flats):
            if flat is None:
                flat = Flat()
                flat.add(roots[r], -1, 0, False, 1.0, -1)
            n = len(flat)
            tokens[r, :n] = torch.tensor(flat.tokens)
            parents[r, :n] = torch.tensor(flat.parents)
            valid[r, :n] = True
            if proposals:  # copies are verified one-hot (see the module docstring)
                cell[r, :n] = torch.tensor([-1 if c else x for c, x in zip(flat.copied, flat.cells)])
            if self.calibration is not None:
                est = [1.0] + self.calibration.estimate(flat.probs[1:])
                reach = [1.0] * n
                for i in range(1, n):
                    reach[i] = reach[flat.parents[i]] * est[i]
                accept[r, :n] = torch.tensor(reach)
            g = graphs[r]
            if g is not None:
                self._stats["graph_nodes"] += g.size
                self._stats["merges"] += g.merges
                self._stats["refused_merges"] += g.refused
                self._stats["tree_nodes"] += n - 1
                self._stats["copied_nodes"] += sum(flat.copied)
        self._stats["steps"] += 1
        probs = None
        if proposals:
            table = SparseProbs.cat(proposals)
            one = table.gather(cell.clamp(min=0).to(dev))
            none = (cell < 0).to(dev)[..., None]
            probs = SparseProbs(one.ids.masked_fill(none, -1), one.probs.masked_fill(none, 0.0))
        tree = DraftTree.from_parents(tokens.to(dev), parents.to(dev), valid.to(dev), probs, check=False)
        if self.calibration is not None:
            tree.accept = accept.to(dev)
        return tree

    # ---- learning -----------------------------------------------------------------------------------

    def _observe(self, graph: DraftGraph, target: list[int]) -> None:
        """Walk the target's tokens ``target`` (accepted drafts, then the next token) through the graph:
        coverage per depth and calibration of the candidates at every node the target reached."""
        node, probs, hits = 0, [], []
        cover = self._stats["coverage"]
        for depth, tok in enumerate(target, start=1):
            if node is None or not graph.expanded[node]:
                break
            cands = graph.cands[node]
            row = cover.setdefault(depth, [0, 0, 0])
            row[0] += 1
            row[1] += int(bool(cands) and cands[0][0] == tok)
            row[2] += int(any(t == tok for t, _ in cands))
            probs += [p for _, p in cands]
            hits += [t == tok for t, _ in cands]
            node = graph.child(node, tok)
        if self.calibration is not None and probs:
            self.calibration.observe(probs, hits)
