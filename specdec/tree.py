"""The draft tree: what one verification pass of the target sees.

A tree holds, per batch row, ``T`` nodes: node 0 is the root (the last committed token, whose KV
is not cached yet) and every other node is a draft token whose parent precedes it. Rows with
fewer nodes are padded with invalid nodes that no valid node can see. Everything the target
needs is derived once here: depths (position offsets), the packed ancestor mask, validity.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.kernels import pack_mask, tree_depth


@dataclass(eq=False)
class DraftTree:
    """A batch of draft trees.

    tokens: ``[B,T] int64``; parents: ``[B,T] int64`` (-1 at the root); valid: ``[B,T] bool``;
    depth: ``[B,T] int64``; is_chain: every row is a chain (attention is causal, no mask);
    draft_probs: ``[B,T,V]`` float proposal distributions (None for deterministic drafts; the root's
    row is unused). :attr:`mask` is derived on first use.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    valid: torch.Tensor
    depth: torch.Tensor
    is_chain: bool
    draft_probs: torch.Tensor | None = None
    _mask: torch.Tensor | None = field(default=None, repr=False)

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
    def from_drafts(cls, root: torch.Tensor, drafts: torch.Tensor, merge: bool = True) -> tuple["DraftTree", torch.Tensor]:
        """Several chains per row as one tree, vectorised (no Python loop over rows or nodes).

        root: ``[B]``; drafts: ``[B,k,w] int64``, each chain -1 padded at its end (an empty slot is
        all -1). ``merge=True`` builds the trie (chains sharing a prefix share its nodes);
        ``merge=False`` keeps every chain as its own branch under the root (the paper's k batch
        rows, minus the k-1 copies of the root). Node order is chain-major, so the chain listed
        first keeps the lowest indices (verification tries siblings in index order).

        Returns the tree and ``[B,T] int64`` the first chain through each node (-1 at the root and
        at padding).
        """
        b, k, w = drafts.shape
        dev = drafts.device
        valid = (drafts >= 0).cumprod(-1).bool()  # [B,k,w]: a chain ends at its first padding
        ar_k = torch.arange(k, device=dev)
        if merge:
            same = (drafts[:, :, None, :] == drafts[:, None, :, :]).cumprod(-1).bool()  # [B,k,k,w] equal prefixes
            same &= valid[:, :, None, :] & valid[:, None, :, :]
            first = torch.where(same, ar_k[None, None, :, None], k).amin(2)  # [B,k,w] first chain with this prefix
            owner = first.clamp(max=k - 1)
        else:
            owner = ar_k[None, :, None].expand(b, k, w)
        exists = valid & (owner == ar_k[None, :, None])  # one node per distinct (prefix, depth)
        flat_exists = exists.reshape(b, k * w)
        index = flat_exists.long().cumsum(-1).reshape(b, k, w)  # node index (root = 0) where exists
        t = int(index[:, -1, -1].max()) + 1 if k * w else 1
        # parent of (i, d) is the node of (owner[i, d-1], d-1); at d = 0 the root.
        flat_parent = owner[:, :, :-1] * w + torch.arange(w - 1, device=dev)
        parent_idx = index.reshape(b, k * w).gather(1, flat_parent.reshape(b, -1)).reshape(b, k, w - 1)
        parents_kw = torch.cat([torch.zeros(b, k, 1, dtype=torch.int64, device=dev), parent_idx], dim=-1)
        tokens = torch.zeros(b, t, dtype=torch.int64, device=dev)
        parents = torch.zeros(b, t, dtype=torch.int64, device=dev)
        chain = torch.full((b, t), -1, dtype=torch.int64, device=dev)
        node_valid = torch.zeros(b, t, dtype=torch.bool, device=dev)
        dst = torch.where(exists, index, 0).reshape(b, k * w)
        src_ok = flat_exists
        tokens.scatter_(1, dst, torch.where(src_ok, drafts.reshape(b, -1), 0))
        parents.scatter_(1, dst, torch.where(src_ok, parents_kw.reshape(b, -1), 0))
        chain.scatter_(1, dst, torch.where(src_ok, ar_k[None, :, None].expand(b, k, w).reshape(b, -1), -1))
        node_valid.scatter_(1, dst, src_ok)
        # Slot 0 received the scatter of every non-existing (i, d); reset it to the root.
        tokens[:, 0] = root
        parents[:, 0] = -1
        chain[:, 0] = -1
        node_valid[:, 0] = True
        return cls.from_parents(tokens, parents, node_valid, check=False), chain

    def select(self, keep: torch.Tensor) -> tuple["DraftTree", torch.Tensor]:
        """The subtree of the nodes in ``keep`` ``[B,T] bool`` (closed under parents; the root is always kept).

        Kept nodes keep their relative order. Returns the subtree and ``[B,T']`` the old index of
        every new node (0 at padding).
        """
        b, t = self.tokens.shape
        keep = keep & self.valid
        keep[:, 0] = True
        new_index = keep.long().cumsum(-1) - 1  # [B,T] position of each kept node
        t_new = int(keep.sum(-1).max())
        dst = torch.where(keep, new_index, t_new)  # dropped nodes go to a spill column, cut below
        old = torch.zeros(b, t_new + 1, dtype=torch.int64, device=self.tokens.device)
        old.scatter_(1, dst, torch.arange(t, device=self.tokens.device).expand(b, t))
        old = old[:, :t_new]
        valid = torch.arange(t_new, device=keep.device)[None] < keep.sum(-1, keepdim=True)
        tokens = self.tokens.gather(1, old)
        parents = torch.where(valid, new_index.gather(1, self.parents.gather(1, old).clamp(min=0)), 0)
        parents[:, 0] = -1
        probs = None
        if self.draft_probs is not None:
            probs = self.draft_probs.gather(1, old[:, :, None].expand(-1, -1, self.draft_probs.shape[-1]))
        return DraftTree.from_parents(tokens, parents, valid, probs, check=False), old

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


def ancestor_mask(parents: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Packed ancestor-or-self mask ``[B,T,ceil(T/32)] int32`` from parents ``[B,T]``.

    Computed by transitive closure with boolean matrix squaring (log2 T batched matmuls), so no
    Python loop over nodes. Invalid nodes are visible to nobody but themselves.
    """
    b, t = parents.shape
    dev = parents.device
    eye = torch.eye(t, dtype=torch.bool, device=dev).expand(b, t, t)
    reach = eye.clone()
    has_parent = parents >= 0
    reach[torch.arange(b, device=dev)[:, None].expand(b, t)[has_parent],
          torch.arange(t, device=dev)[None].expand(b, t)[has_parent],
          parents[has_parent]] = True
    for _ in range(max(1, (t - 1).bit_length())):
        reach = reach | (torch.bmm(reach.float(), reach.float()) > 0)
    reach = reach & (valid[:, None, :] | eye)
    return pack_mask(reach)
