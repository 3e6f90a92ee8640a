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
class DraftTree:
    """A batch of draft trees.

    tokens: ``[B,T] int64``; parents: ``[B,T] int64`` (-1 at the root); valid: ``[B,T] bool``;
    depth: ``[B,T] int64``; is_chain: every row is a chain (attention is causal, no mask);
    draft_probs: ``[B,T,V]`` float proposal distributions (None for deterministic drafts; the root's
    row is unused). :attr:`mask` is derived on first use. accept: ``[B,T]`` float, the drafter's estimate
    that each node is accepted (reached) given the root, or None; a planner prunes by it
    (:func:`specdec.policies.prune`), whatever source each node came from.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    valid: torch.Tensor
    depth: torch.Tensor
    is_chain: bool
    draft_probs: torch.Tensor | None = None
    _mask: torch.Tensor | None = field(default=None, repr=False)
    accept: torch.Tensor | None = None

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
    def chain(cls, root: torch.Tensor, drafts: torch.Tensor | None = None, draft_probs: torch.Tensor | None = None) -> "DraftTree":
        """One chain per row. root: ``[B]``; drafts: ``[B,k]`` int64, -1 padded at the end (or None).

        draft_probs: ``[B,k,V]`` distributions the drafts were sampled from, or None.
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
            probs = torch.cat([torch.zeros_like(draft_probs[:, :1]), draft_probs], dim=1)
        return cls(tokens, parents, valid, depth, True, probs)

    @classmethod
    def from_parents(cls, tokens: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor | None = None,
                     draft_probs: torch.Tensor | None = None, check: bool = True) -> "DraftTree":
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
    def from_chains(cls, root: torch.Tensor, chains: list[list[list[int]]]) -> "DraftTree":
        """Merge several chains per row into a trie (shared prefixes become shared nodes).

        root: ``[B]``; chains: for each row, a list of token lists. Node order is insertion order,
        so a chain listed first keeps the lowest indices (verification tries siblings in index order).
        """
        b = root.shape[0]
        rows_tokens, rows_parents = [], []
        for r in range(b):
            toks, pars = [int(root[r])], [-1]
            children: dict[tuple[int, int], int] = {}
            for chain in chains[r]:
                node = 0
                for tok in chain:
                    key = (node, int(tok))
                    if key not in children:
                        children[key] = len(toks)
                        toks.append(int(tok))
                        pars.append(node)
                    node = children[key]
            rows_tokens.append(toks)
            rows_parents.append(pars)
        t = max(len(x) for x in rows_tokens)
        tokens = torch.zeros(b, t, dtype=torch.int64)
        parents = torch.zeros(b, t, dtype=torch.int64)
        valid = torch.zeros(b, t, dtype=torch.bool)
        for r in range(b):
            n = len(rows_tokens[r])
            tokens[r, :n] = torch.tensor(rows_tokens[r])
            parents[r, :n] = torch.tensor(rows_parents[r])
            valid[r, :n] = True
        dev = root.device
        return cls.from_parents(tokens.to(dev), parents.to(dev), valid.to(dev))

    @classmethod
    def from_drafts(cls, root: torch.Tensor, drafts: torch.Tensor, merge: bool = True, accept: torch.Tensor | None = None,
                    cost: torch.Tensor | None = None, extra: int = 0) -> tuple["DraftTree", torch.Tensor, torch.Tensor]:
        """Several chains per row as one tree, mask included (:func:`specdec.kernels.draft_tree`).

        root: ``[B]``; drafts: ``[B,k,w] int64``, each chain -1 padded at its end (an empty slot is
        all -1). ``merge=True`` builds the trie (chains sharing a prefix share its nodes);
        ``merge=False`` keeps every chain as its own branch under the root (the paper's k batch
        rows, minus the k-1 copies of the root). With ``accept [B,k,w]`` and ``cost`` the tree keeps
        only the nodes that pay for their verification cost (see the kernel).

        Returns the tree, ``[B,T] int64`` the first chain through each node and ``[B,T] int64`` that
        chain's cell ``i * w + d`` (both -1 at the root and at padding).
        """
        tokens, parents, valid, depth, mask, chain, slot = kernels.draft_tree(root, drafts, merge, accept, cost, extra)
        return cls(tokens, parents, valid, depth, False, None, mask), chain, slot

    def select(self, keep: torch.Tensor) -> tuple["DraftTree", torch.Tensor]:
        """The subtree of the nodes in ``keep`` ``[B,T] bool`` (closed under parents; the root is always kept).

        Kept nodes keep their relative order. Returns the subtree and ``[B,T']`` the old index of
        every new node (0 at padding).
        """
        tokens, parents, valid, old = kernels.reference.subtree(self.tokens, self.parents, self.valid, keep)
        probs = None
        if self.draft_probs is not None:
            probs = self.draft_probs.gather(1, old[:, :, None].expand(-1, -1, self.draft_probs.shape[-1]))
        tree = DraftTree.from_parents(tokens, parents, valid, probs, check=False)
        if self.accept is not None:
            tree.accept = self.accept.gather(1, old)
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
