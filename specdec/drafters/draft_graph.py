"""GSD's draft graph for one row: top-k expansion, pruning rules, merging of recurring n-grams, unmerging.

Host-side and small (tens of nodes): :class:`~specdec.drafters.graph_draft.GraphDrafter` runs the
draft model and feeds each level's candidates here; tests drive it with hand-made distributions.

Nodes are numbered in creation order (node 0 is the root, the pending token), so a node's tree parent
precedes it. Every node keeps its ``k`` candidate edges in rank order; an edge ends at the node it created
or, for a merged candidate, at the *first occurrence* of its (tau + 1)-gram: the candidate and its ``tau``
nearest ancestors (the root counts as a token), so ``tau = 0`` merges on one matching token. A merge whose
target can already reach the candidate's parent is refused (it would close a cycle), so the graph stays
a DAG, and the candidate becomes a node of its own.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Edge:
    """A candidate of a node: its token, the draft probability it was picked with, the node it leads to,
    whether that node was reached by merging, and the proposal cell it was drawn from (-1: none)."""

    token: int
    prob: float
    node: int
    merged: bool
    cell: int = -1


@dataclass
class Flat:
    """An unmerged tree (what the target verifies): per node its token, parent (-1 at the root), the graph
    node it stands for, whether it lies under a merged candidate (a copy of the merge target's successors),
    its edge's probability and proposal cell."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    nodes: list[int] = field(default_factory=list)
    copied: list[bool] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    cells: list[int] = field(default_factory=list)

    def add(self, token: int, parent: int, node: int, copied: bool, prob: float, cell: int) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.nodes.append(node)
        self.copied.append(copied)
        self.probs.append(prob)
        self.cells.append(cell)
        return len(self.tokens) - 1

    def __len__(self) -> int:
        return len(self.tokens)

    def paths(self) -> set[tuple[int, ...]]:
        """Every root-to-node token path (root excluded)."""
        out, memo = set(), {0: ()}
        for i in range(1, len(self.tokens)):
            memo[i] = memo[self.parents[i]] + (self.tokens[i],)
            out.add(memo[i])
        return out


class DraftGraph:
    """One row's draft graph.

    tau: preceding tokens a merge must match (``tau >= 0``); merge: merge at all; prob_threshold: a node
    whose draft probability is below it is not expanded (a leaf); sibling_threshold: nor one below this
    fraction of its best sibling's; max_depth: nodes at this depth are leaves; max_nodes: at most this many
    edges (candidates placed, merged or not; later ones are dropped).
    """

    def __init__(self, root: int, tau: int = 2, prob_threshold: float = 0.2, sibling_threshold: float = 0.3,
                 max_depth: int = 10, max_nodes: int = 64, merge: bool = True):
        self.tau, self.merge = tau, merge
        self.prob_threshold, self.sibling_threshold = prob_threshold, sibling_threshold
        self.max_depth, self.max_nodes = max_depth, max_nodes
        self.tokens, self.parent, self.depth = [root], [-1], [0]
        self.order: list[tuple[int, int]] = []  # every edge as (node, index in its edges), in placement order
        self.edges: list[list[Edge]] = [[]]
        self.expanded = [False]
        self.cands: dict[int, list[tuple[int, float]]] = {}  # expanded node -> its candidates (token, prob) in rank order
        self.grams: dict[tuple[int, ...], int] = {}
        self.merges = 0
        self.refused = 0  # merges refused because they would close a cycle
        self._register(0)

    @property
    def size(self) -> int:
        """Created draft nodes (root excluded; merged candidates are edges, not nodes)."""
        return len(self.tokens) - 1

    def gram(self, parent: int, token: int) -> tuple[int, ...] | None:
        """The (tau + 1)-gram ending in ``token`` under ``parent``, or None when the path from the root is
        shorter than ``tau`` tokens above it."""
        out, node = [token], parent
        for _ in range(self.tau):
            if node < 0:
                return None
            out.append(self.tokens[node])
            node = self.parent[node]
        return tuple(reversed(out))

    def _register(self, node: int) -> None:
        g = self.gram(self.parent[node], self.tokens[node]) if node else (self.tokens[0],) if self.tau == 0 else None
        if g is not None and g not in self.grams:
            self.grams[g] = node

    def reaches(self, start: int, goal: int) -> bool:
        """Whether ``goal`` is ``start`` or below it (through tree and merge edges)."""
        todo, seen = [start], {start}
        while todo:
            node = todo.pop()
            if node == goal:
                return True
            for e in self.edges[node]:
                if e.node not in seen:
                    seen.add(e.node)
                    todo.append(e.node)
        return False

    def add_children(self, node: int, tokens: list[int], probs: list[float], cells: list[int] | None = None,
                     depth_limit: int | None = None) -> list[int]:
        """Expand ``node`` with its candidates in rank order (``tokens`` distinct; a -1 token or a zero
        probability ends the list). Each candidate becomes an edge, to a new node or merged into an
        existing one, until the graph holds ``max_nodes`` edges (later candidates are dropped, whatever
        their values). Returns the new nodes to expand next (in order). ``depth_limit``: this row's depth
        bound if lower than ``max_depth``."""
        limit = self.max_depth if depth_limit is None else min(depth_limit, self.max_depth)
        self.expanded[node] = True
        live = list(zip(tokens, probs, cells or [-1] * len(tokens)))
        cut = next((i for i, (t, p, _) in enumerate(live) if t < 0 or p <= 0.0), len(live))
        live = live[:cut]
        self.cands[node] = [(t, p) for t, p, _ in live]
        best = max((p for _, p, _ in live), default=0.0)
        depth = self.depth[node] + 1
        grow = []
        for tok, p, c in live:
            if self.num_edges >= self.max_nodes:
                break
            g = self.gram(node, tok) if self.merge else None
            target = self.grams.get(g) if g is not None else None
            if target is not None:
                if not self.reaches(target, node):
                    self._edge(node, Edge(tok, p, target, True, c))
                    self.merges += 1
                    continue
                self.refused += 1
            new = len(self.tokens)
            self.tokens.append(tok)
            self.parent.append(node)
            self.depth.append(depth)
            self.edges.append([])
            self.expanded.append(False)
            self._edge(node, Edge(tok, p, new, False, c))
            self._register(new)
            if depth < limit and p >= self.prob_threshold and p >= self.sibling_threshold * best:
                grow.append(new)
        return grow

    def _edge(self, node: int, edge: Edge) -> None:
        self.edges[node].append(edge)
        self.order.append((node, len(self.edges[node]) - 1))

    @property
    def num_edges(self) -> int:
        """Candidates placed so far (created nodes and merges)."""
        return len(self.order)

    def child(self, node: int, token: int) -> int | None:
        """The node ``token`` leads to from ``node`` (None if it is not a candidate)."""
        return next((e.node for e in self.edges[node] if e.token == token), None)

    def unmerge(self, max_nodes: int | None = None) -> Flat:
        """The graph as a tree whose root-to-node paths are exactly the graph's paths (a node reached by
        several paths appears once per path), capped at ``max_nodes`` draft nodes.

        Order: first one tree node per edge, in the order the edges were placed (level by level, each
        node's candidates in rank order; a merged candidate sits among its siblings like a created one);
        then, breadth-first, the copies of what lies under each merge's target (``copied``). A candidate's
        place, and whether the cap keeps it, depend only on the candidates placed before it, never on its
        own value, which the sampling argument in :mod:`specdec.drafters.graph_draft` relies on.
        """
        cap = float("inf") if max_nodes is None else max_nodes
        flat = Flat()
        flat.add(self.tokens[0], -1, 0, False, 1.0, -1)
        place = {0: 0}  # created node -> its tree node
        merged = []
        for node, i in self.order:
            if len(flat) > cap:
                break
            e = self.edges[node][i]
            at = flat.add(e.token, place[node], e.node, False, e.prob, e.cell)
            if e.merged:
                merged.append(at)
            else:
                place[e.node] = at
        todo, j = merged, 0
        while j < len(todo) and len(flat) <= cap:
            at = todo[j]
            for e in self.edges[flat.nodes[at]]:
                if len(flat) > cap:
                    break
                todo.append(flat.add(e.token, at, e.node, True, e.prob, e.cell))
            j += 1
        return flat

    def paths(self, limit: int = 100_000) -> set[tuple[int, ...]]:
        """Every token path from the root through the graph (root excluded)."""
        out: set[tuple[int, ...]] = set()
        todo = [(0, ())]
        while todo:
            node, path = todo.pop()
            for e in self.edges[node]:
                p = path + (e.token,)
                out.add(p)
                if len(out) > limit:
                    raise ValueError("too many paths")
                todo.append((e.node, p))
        return out
