"""The draft tree: what one verification pass of the target sees.

A tree holds, per batch row, ``T`` nodes: node 0 is the root (the last committed token, whose KV
is not cached yet) and every other node is a draft token whose parent precedes it. Rows with
fewer nodes are padded with invalid nodes that no valid node can see. Everything the target
needs is derived once here: depths (position offsets), the packed ancestor mask, validity.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec import kernels
from specdec.kernels.reference import ancestor_mask, tree_depth


@dataclass(eq=False)
class SparseProbs:
    """Proposal distributions of draft nodes, each over a few token ids (never a full-vocabulary row).

    ids: ``[B,T,K] int64`` token ids, distinct within a node, -1 at unused entries (may be an
    expanded view, e.g. one shared reduced vocabulary); probs: ``[B,T,K]`` float, 0 at unused entries.
    A node whose probs are all zero proposed its token deterministically (a one-hot proposal): the
    root, and every node of a deterministic draft.
    """

    ids: torch.Tensor
    probs: torch.Tensor

    def __post_init__(self):
        if self.ids.shape != self.probs.shape or self.ids.dim() != 3:
            raise ValueError(f"ids and probs must both be [B, T, K], got {tuple(self.ids.shape)} and "
                             f"{tuple(self.probs.shape)}")

    @classmethod
    def top_k(cls, logits: torch.Tensor, k: int) -> "SparseProbs":
        """The distribution ``softmax(logits)`` restricted to its ``k`` most likely ids and renormalised.

        logits: ``[B,T,V]`` float (``-inf`` at filtered ids, which get probability 0). Sampling a
        draft from this distribution and verifying against it is exact rejection sampling: any
        proposal is, as long as verification reads the one the token was drawn from."""
        vals, ids = logits.topk(min(k, logits.shape[-1]), dim=-1)
        return cls(ids, vals.float().softmax(-1))

    @classmethod
    def one_hot(cls, b: int, t: int, device: torch.device | str | None = None) -> "SparseProbs":
        """``t`` deterministic nodes per row (probs all zero, ``K = 1``)."""
        return cls(torch.full((b, t, 1), -1, dtype=torch.int64, device=device), torch.zeros(b, t, 1, device=device))

    @property
    def k(self) -> int:
        return self.ids.shape[2]

    def map_ids(self, table: torch.Tensor) -> "SparseProbs":
        """Ids translated through ``table [V'] int64`` (e.g. a reduced draft vocabulary to target ids)."""
        return SparseProbs(torch.where(self.ids >= 0, table[self.ids.clamp(min=0)], -1), self.probs)

    def sample(self, generator: torch.Generator | None = None) -> torch.Tensor:
        """One id per node drawn from its distribution. Returns ``[B,T] int64`` (-1 at one-hot nodes)."""
        b, t, k = self.probs.shape
        flat = self.probs.reshape(b * t, k)
        mass = flat.sum(-1) > 0
        pick = torch.multinomial(torch.where(mass[:, None], flat, 1.0), 1, generator=generator).view(b, t)
        return torch.where(mass.view(b, t), self.ids.gather(2, pick[..., None]).squeeze(2), -1)

    @staticmethod
    def cat(parts: list["SparseProbs"]) -> "SparseProbs":
        """Concatenate along the node axis; narrower parts are padded to the widest ``K``."""
        k = max(p.k for p in parts)
        pad = [(torch.nn.functional.pad(p.ids, (0, k - p.k), value=-1), torch.nn.functional.pad(p.probs, (0, k - p.k)))
               for p in parts]
        return SparseProbs(torch.cat([i for i, _ in pad], dim=1), torch.cat([q for _, q in pad], dim=1))

    def gather(self, nodes: torch.Tensor) -> "SparseProbs":
        """The rows of ``nodes [B,T'] int64`` (indices into the node axis)."""
        idx = nodes[..., None].expand(-1, -1, self.k)
        return SparseProbs(self.ids.gather(1, idx), self.probs.gather(1, idx))

    def dense(self, vocab_size: int) -> torch.Tensor:
        """``[B,T,V] fp32``, the same distributions over the whole vocabulary (tests and debugging)."""
        b, t, _ = self.ids.shape
        out = torch.zeros(b, t, vocab_size, device=self.probs.device)
        return out.scatter_add_(2, self.ids.clamp(min=0), self.probs.float().masked_fill(self.ids < 0, 0.0))


@dataclass(eq=False)
class DraftTree:
    """A batch of draft trees.

    tokens: ``[B,T] int64``; parents: ``[B,T] int64`` (-1 at the root); valid: ``[B,T] bool``;
    depth: ``[B,T] int64``; is_chain: every row is a chain (attention is causal, no mask);
    draft_probs: :class:`SparseProbs` ``[B,T,K]``, the proposal distribution of every node (None for
    deterministic drafts; the root's row is all zero). :attr:`mask` is derived on first use. accept: ``[B,T]`` float, the drafter's estimate
    that each node is accepted (reached) given the root, or None; a planner prunes by it
    (:func:`specdec.policies.prune`), whatever source each node came from. origin: ``[B,T] int64``, each node's
    index in the tree its drafter proposed, set by :meth:`select` (a planner's cut), else None (node ``i`` is
    the proposed tree's node ``i``; a chain cut shorter keeps its first nodes): a drafter that keeps per-node
    bookkeeping maps it through this.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    valid: torch.Tensor
    depth: torch.Tensor
    is_chain: bool
    draft_probs: SparseProbs | None = None
    _mask: torch.Tensor | None = field(default=None, repr=False)
    accept: torch.Tensor | None = None
    origin: torch.Tensor | None = None

    @property
    def mask(self) -> torch.Tensor | None:
        """``[B,T,ceil(T/32)] int32`` packed ancestor mask (self included), None for chains (causal).

        Built when first read, so a tree that is only pruned (:meth:`select`) never pays for it."""
        if self.is_chain:
            return None
        if self._mask is None:
            self._mask = ancestor_mask(self.parents, self.valid)
        return self._mask

    def build_mask(self) -> "DraftTree":
        """Build :attr:`mask` now (the decode loop does this while it times drafting, so the cost is
        counted as the drafter's, not as the target's step). Returns self."""
        _ = self.mask
        return self

    @property
    def size(self) -> int:
        """Number of node slots T (including padding)."""
        return self.tokens.shape[1]

    @property
    def num_drafted(self) -> torch.Tensor:
        """``[B] int64`` valid draft nodes per row (root excluded)."""
        return self.valid[:, 1:].sum(-1)

    @classmethod
    def chain(cls, root: torch.Tensor, drafts: torch.Tensor | None = None, draft_probs: SparseProbs | None = None) -> "DraftTree":
        """One chain per row. root: ``[B]``; drafts: ``[B,k]`` int64, -1 padded at the end (or None).

        draft_probs: :class:`SparseProbs` ``[B,k,K]``, the distributions the drafts were sampled from, or None.
        """
        b = root.shape[0]
        dev = root.device
        if drafts is None:
            drafts = torch.empty(b, 0, dtype=torch.int64, device=dev)
        t = drafts.shape[1] + 1
        tokens = torch.cat([root[:, None], drafts.clamp(min=0)], dim=1)
        valid = torch.cat([torch.ones(b, 1, dtype=torch.bool, device=dev), drafts >= 0], dim=1)
        valid = valid.cumprod(dim=1).bool()  # a chain ends at its first padding
        ar = torch.arange(t, device=dev)
        parents = (ar - 1).expand(b, t).clone()
        depth = ar.expand(b, t).clone()
        probs = None
        if draft_probs is not None:
            probs = SparseProbs.cat([SparseProbs.one_hot(b, 1, dev), draft_probs])
        return cls(tokens, parents, valid, depth, True, probs)

    @classmethod
    def from_parents(cls, tokens: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor | None = None,
                     draft_probs: SparseProbs | None = None, check: bool = True) -> "DraftTree":
        """A general tree. tokens, parents: ``[B,T] int64`` (parents[:,0] = -1, parents[i] < i).

        ``check=False`` skips validating ``parents`` (for trees built here, correct by construction)."""
        b, t = tokens.shape
        if valid is None:
            valid = torch.ones(b, t, dtype=torch.bool, device=tokens.device)
        if check and bool((parents[:, 0] != -1).any()):
            raise ValueError("node 0 is the root: parents[:, 0] must be -1")
        if check and t > 1 and bool(((parents[:, 1:] < 0) | (parents[:, 1:] >= torch.arange(1, t, device=tokens.device))).any()):
            raise ValueError("every non-root node needs a parent that precedes it")
        return cls(tokens, parents, valid, tree_depth(parents), False, draft_probs)

    @classmethod
    def from_chains(cls, root: torch.Tensor, chains: list[list[list[int]]],
                    draft_probs: SparseProbs | None = None) -> "DraftTree":
        """Merge several chains per row into a trie (shared prefixes become shared nodes).

        root: ``[B]``; chains: for each row, a list of token lists. Node order is insertion order,
        so a chain listed first keeps the lowest indices (verification tries siblings in index order).
        draft_probs: :class:`SparseProbs` ``[B, C*L, K]`` with the proposal of token ``d`` of chain
        ``c`` at ``c * L + d`` (``C`` chains of at most ``L`` tokens per row), or None. A node shared
        by several chains keeps the first chain's proposal (chains that share a prefix were drawn
        from the same distributions).
        """
        b = root.shape[0]
        width = max((len(c) for row in chains for c in row), default=0)
        rows_tokens, rows_parents, rows_cells = [], [], []
        for r in range(b):
            toks, pars, cells = [int(root[r])], [-1], [-1]
            children: dict[tuple[int, int], int] = {}
            for c, chain in enumerate(chains[r]):
                node = 0
                for d, tok in enumerate(chain):
                    key = (node, int(tok))
                    if key not in children:
                        children[key] = len(toks)
                        toks.append(int(tok))
                        pars.append(node)
                        cells.append(c * width + d)
                    node = children[key]
            rows_tokens.append(toks)
            rows_parents.append(pars)
            rows_cells.append(cells)
        t = max(len(x) for x in rows_tokens)
        tokens = torch.zeros(b, t, dtype=torch.int64)
        parents = torch.zeros(b, t, dtype=torch.int64)
        cell = torch.full((b, t), -1, dtype=torch.int64)
        valid = torch.zeros(b, t, dtype=torch.bool)
        for r in range(b):
            n = len(rows_tokens[r])
            tokens[r, :n] = torch.tensor(rows_tokens[r])
            parents[r, :n] = torch.tensor(rows_parents[r])
            cell[r, :n] = torch.tensor(rows_cells[r])
            valid[r, :n] = True
        dev = root.device
        probs = None if draft_probs is None else _node_probs(draft_probs, cell.to(dev))
        return cls.from_parents(tokens.to(dev), parents.to(dev), valid.to(dev), probs)

    @classmethod
    def from_drafts(cls, root: torch.Tensor, drafts: torch.Tensor, merge: bool = True, accept: torch.Tensor | None = None,
                    keep: torch.Tensor | list[int] | None = None,
                    draft_probs: SparseProbs | None = None) -> tuple["DraftTree", torch.Tensor, torch.Tensor]:
        """Several chains per row as one tree, mask included (:func:`specdec.kernels.draft_tree`).

        root: ``[B]``; drafts: ``[B,k,w] int64``, each chain -1 padded at its end (an empty slot is
        all -1). ``merge=True`` builds the trie (chains sharing a prefix share its nodes);
        ``merge=False`` keeps every chain as its own branch under the root (the paper's k batch
        rows, minus the k-1 copies of the root). With ``accept [B,k,w]`` the tree carries each node's
        reach in :attr:`accept`; with ``keep`` (``[B]`` node counts, the planner's) it keeps only each
        row's likeliest nodes. draft_probs: :class:`SparseProbs` ``[B, k*w, K]``, the proposal of cell
        ``i * w + d``, or None; a node keeps its first chain's.

        Returns the tree, ``[B,T] int64`` the first chain through each node and ``[B,T] int64`` that
        chain's cell ``i * w + d`` (both -1 at the root and at padding).
        """
        if isinstance(keep, list):
            keep = torch.tensor(keep, dtype=torch.int64)
        tokens, parents, valid, depth, mask, chain, slot, reach = kernels.draft_tree(root, drafts, merge, accept, keep)
        probs = None if draft_probs is None else _node_probs(draft_probs, slot)
        tree = cls(tokens, parents, valid, depth, False, probs, mask)
        if accept is not None:
            tree.accept = reach
        return tree, chain, slot

    def select(self, keep: torch.Tensor) -> tuple["DraftTree", torch.Tensor]:
        """The subtree of the nodes in ``keep`` ``[B,T] bool`` (closed under parents; the root is always kept).

        Kept nodes keep their relative order. Returns the subtree and ``[B,T']`` the old index of
        every new node (0 at padding); the subtree's :attr:`origin` maps its nodes to the proposed tree's.
        """
        tokens, parents, valid, old = kernels.reference.subtree(self.tokens, self.parents, self.valid, keep)
        probs = None if self.draft_probs is None else _node_probs(self.draft_probs, torch.where(valid, old, -1))
        tree = DraftTree.from_parents(tokens, parents, valid, probs, check=False)
        if self.accept is not None:
            tree.accept = self.accept.gather(1, old)
        tree.origin = old if self.origin is None else self.origin.gather(1, old)
        return tree, old

    def positions(self, cache_lens: torch.Tensor) -> torch.Tensor:
        """Absolute positions ``[B,T]`` of the nodes, given committed lengths ``[B]``."""
        return cache_lens[:, None] + self.depth

    def dense_mask(self) -> torch.Tensor:
        """``[B,T,T] bool`` ancestor-or-self visibility (causal for chains)."""
        t = self.size
        if self.mask is None:
            return torch.ones(t, t, dtype=torch.bool, device=self.tokens.device).tril().expand(self.tokens.shape[0], t, t)
        from specdec.kernels import unpack_mask

        return unpack_mask(self.mask, t)


def _node_probs(probs: SparseProbs, cell: torch.Tensor) -> SparseProbs:
    """The proposals of the cells ``cell [B,T] int64`` of ``probs`` (one-hot where ``cell`` is -1)."""
    out = probs.gather(cell.clamp(min=0))
    none = (cell < 0)[..., None]
    return SparseProbs(out.ids.masked_fill(none, -1), out.probs.masked_fill(none, 0.0))
