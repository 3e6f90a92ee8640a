"""N-Grammys (Stewart et al. 2024): k learning-free drafts of w tokens per step, verified together.

Each step fills ``k`` draft slots per row: first with context matches, then with extended-bigram
rows of the last token (the model's own top-k next tokens, each chained with the top-1 bigram;
:mod:`specdec.ngram_tables`). Context matches come from :func:`specdec.kernels.ngram_match` in two
tiers: the continuations of the longest suffix of ``q + 1 .. n_max`` tokens that occurred before
(what prompt lookup drafts; a longer match predicts better), then those of the last ``q`` tokens
(the paper's query), each tier ranked by count then recency, with repeats dropped. With an n-gram
corpus (:mod:`specdec.ngram_corpus`: the target's own greedy replies to training prompts), up to ``c``
slots after the longest-suffix matches take the corpus continuations of the longest suffix found there;
this source is ours, not the paper's, and ``c = 0`` turns it off.
The drafts are verified in one target pass, either as the trie they form (``verify="tree"``,
shared prefixes verified once), as ``k`` separate branches under the root (``verify="batch"``,
the paper's k batch rows without the k-1 copies of the root), or only the first draft
(``verify="chain"``). For an engine that verifies one chain, :func:`best_chain` picks the trie's likeliest path.
"""
from __future__ import annotations

import torch

from specdec import kernels
from specdec.contracts import SUPPORT_LEVELS, Budget, DecodeState, num_cells, num_sources
from specdec.drafters.base import Drafter
from specdec.kernels.reference import shared_prefixes
from specdec.ngram_corpus import NGramCorpus
from specdec.ngram_tables import NGramTables, extend_bigram
from specdec.tree import DraftTree

STRATEGIES = ("mixed", "context", "bigram")
VERIFY_MODES = ("tree", "batch", "chain")
CORPUS_SLOTS = 2  # the default ``c`` where an n-gram corpus fits the model


def corpus_slots(k: int, has_corpus: bool) -> int:
    """The default ``c`` for ``k`` slots: :data:`CORPUS_SLOTS` of them where there is an n-gram corpus, else 0."""
    return min(CORPUS_SLOTS, k) if has_corpus else 0


def node_cells(source: torch.Tensor, rank: torch.Tensor, drafts: torch.Tensor, w_max: int,
               support: bool = True) -> torch.Tensor:
    """``[B,k,w] int64``: the :class:`~specdec.policies.NodeAcceptance` cell of every draft token, from its
    draft's source and rank (``[B,k]``, as :meth:`NGrammysDrafter.drafts` returns them), its depth and, with
    ``support``, how many drafts share it (:func:`support_level`); ``w_max``: the drafter's ``w``."""
    k, w = drafts.shape[1], drafts.shape[2]
    cells = ((source * k + rank) * w_max)[:, :, None] + torch.arange(w, device=drafts.device)
    return cells * SUPPORT_LEVELS + (support_level(drafts) if support else 0)


class NGrammysDrafter(Drafter):
    """``k`` drafts of up to ``w`` tokens per row; context query length ``q`` (the paper's q = 1), and
    longest-suffix matches of up to ``n_max`` tokens ranked first (``n_max <= q`` turns that tier off).

    With ``acceptance`` (a per-cell acceptance table, :class:`specdec.policies.NodeAcceptance`, learned
    here) and a budget that carries the step cost, the trees are pruned to the nodes that pay for their
    verification cost: one row's here, a batch's to one width for all rows by the decode loop's planner
    (:func:`specdec.policies.prune`, from the nodes' ``DraftTree.accept``); otherwise all ``k x w`` drafts are
    verified (the paper's static schedule).

    ``strategy``: ``mixed`` (context first, bigram fills the rest), ``context`` or ``bigram`` only;
    ``corpus`` and ``c``: up to ``c`` corpus drafts per step (not with ``bigram``). ``support``: the
    pruning's acceptance estimates tell apart nodes by how many drafts share them (:func:`support_level`).
    ``allocation`` counts, over all steps and rows, the slots each source filled and the accepted
    tokens each source's chains produced (a node shared by two sources counts for the lower slot).
    """

    keeps_rows = True  # nothing per row outlives a step: finished rows may leave the batch
    KINDS = ("bigram", "context", "corpus")  # what ``allocation`` counts per source kind

    def __init__(self, tables: NGramTables | None, k: int = 10, w: int = 10, q: int = 1, n_max: int = 4,
                 strategy: str = "mixed", verify: str = "tree", acceptance=None,
                 corpus: NGramCorpus | None = None, c: int = 0, support: bool = True):
        if k < 1 or w < 1 or q < 1:
            raise ValueError(f"need k, w, q >= 1, got k={k}, w={w}, q={q}")
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
        if strategy != "context" and tables is None:
            raise ValueError(f"strategy {strategy!r} needs the model's n-gram tables")
        if strategy != "context" and k > tables.bigram.shape[1]:
            raise ValueError(f"k={k} exceeds the bigram table's width {tables.bigram.shape[1]}")
        if c < 0 or c > k:
            raise ValueError(f"corpus slots c must be in [0, k={k}], got {c}")
        if c > 0 and corpus is None:
            raise ValueError("corpus slots (c > 0) need an n-gram corpus")
        if c > 0 and strategy == "bigram":
            raise ValueError("strategy 'bigram' drafts from the bigram table only: use c=0")
        self.tables, self.k, self.w, self.q, self.n_max = tables, k, w, q, n_max
        self.strategy, self.verify = strategy, verify
        self.corpus, self.c = (corpus if c else None), c
        self.support = bool(support)
        self.acceptance = acceptance
        if acceptance is not None and acceptance.proposed.numel() != self.num_cells():
            raise ValueError(f"the acceptance table does not fit k={k}, w={w}, q={q}, n_max={n_max}, c={c}: "
                             f"build it with NodeAcceptance(k, w, q, n_max, corpus={c > 0})")
        self._slot: torch.Tensor | None = None  # [B,T] (source, rank, depth, support) cell of each node
        self._chain_of_node: torch.Tensor | None = None
        self._slot_source: torch.Tensor | None = None  # [B,k] source of each draft slot (numbered as :func:`num_sources` does)
        self._slot_rank: torch.Tensor | None = None  # [B,k] rank of each slot among its source's drafts
        self.allocation = {"steps": 0, **{f"{kind}_{what}": 0 for what in ("slots", "accepted") for kind in self.KINDS}}

    def num_cells(self) -> int:
        """How many (source, rank, depth, support) cells this drafter's nodes fall in."""
        return num_cells(self.k, self.w, self.q, self.n_max, self.c > 0)

    def source_kind(self, source: int) -> int:
        """The index in :attr:`KINDS` of a slot's source (numbered as :func:`num_sources` does)."""
        return 0 if source == 0 else 2 if source >= num_sources(self.q, self.n_max) else 1

    def context_drafts(self, state: DecodeState, w: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[B,k,w]`` context drafts (-1 padded, best first), ``[B]`` how many there are, ``[B]`` how
        many of them (the first) continue the longest matching suffix, and ``[B]`` that suffix's length
        (``q + 1 .. n_max``, 0 without one)."""
        k = self.k
        width = max(state.seq_lens_host)
        seq = state.seq[:, :width]
        ctx, _, counts, _ = kernels.ngram_match(seq, state.seq_lens, self.q, self.q, k, w)
        found = counts > 0
        if self.n_max <= self.q:
            n = found.sum(-1)
            return ctx, n, torch.zeros_like(n), torch.zeros_like(n)
        long, _, long_counts, match_n = kernels.ngram_match(seq, state.seq_lens, self.q + 1, self.n_max, k, w)
        long_found = long_counts > 0
        # A q-match continuation equal to a longer match's is a repeat: drop it.
        repeat = ((ctx[:, :, None, :] == long[:, None, :, :]).all(-1) & long_found[:, None, :]).any(-1)
        both = torch.cat([long, ctx], 1)  # [B,2k,w]
        keep = torch.cat([long_found, found & ~repeat], 1)
        order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices[:, :k]  # kept first, in order
        drafts = both.gather(1, order[:, :, None].expand(-1, -1, w))
        n = keep.sum(-1).clamp(max=k)
        drafts = drafts.masked_fill((torch.arange(k, device=seq.device)[None] >= n[:, None])[:, :, None], -1)
        return drafts, n, long_found.sum(-1), match_n.long()

    def drafts(self, state: DecodeState, w: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[B,k,w]`` drafts (-1 padded), and for each of the ``k`` slots ``[B,k]`` its source (numbered as
        :func:`num_sources` does) and ``[B,k]`` its rank among that source's drafts.

        Slot order: longest-suffix context matches, then up to ``c`` corpus drafts, then the q-matches,
        then extended-bigram rows (``mixed``) for the slots left.
        """
        b, dev, k = state.seq.shape[0], state.seq.device, self.k
        slot = torch.arange(k, device=dev)[None, :].expand(b, k)
        zero = torch.zeros(b, dtype=torch.int64, device=dev)
        if self.strategy == "bigram":
            n_long = n_ctx = match_n = zero
            ctx = torch.full((b, k, w), -1, dtype=torch.int64, device=dev)
        else:
            ctx, n_ctx, n_long, match_n = self.context_drafts(state, w)
        n_cor, cor_n = zero, zero
        if self.c:
            cor, n_cor, cor_n = self.corpus.match(state.seq, state.seq_lens, self.c, w, self.n_max)
            n_cor = torch.minimum(n_cor, k - n_long)
        # slot -> (source, rank, where its draft comes from)
        in_long = slot < n_long[:, None]
        in_cor = ~in_long & (slot < (n_long + n_cor)[:, None])
        ctx_slot = torch.where(in_long, slot, slot - n_cor[:, None])  # index into ctx for context slots
        in_q = ~in_long & ~in_cor & (ctx_slot < n_ctx[:, None])
        in_big = ~(in_long | in_cor | in_q)
        drafts = ctx.gather(1, ctx_slot.clamp(0, k - 1)[:, :, None].expand(b, k, w))
        if self.c:
            cor_rank = (slot - n_long[:, None]).clamp(0, self.c - 1)
            drafts = torch.where(in_cor[:, :, None], cor.gather(1, cor_rank[:, :, None].expand(b, k, w)), drafts)
        big_rank = ctx_slot - n_ctx[:, None]
        if self.strategy == "context":
            drafts = drafts.masked_fill(in_big[:, :, None], -1)
        else:
            big = extend_bigram(self.tables.bigram_on(dev), w, state.roots, k)  # [B,k,w]
            fill = big.gather(1, big_rank.clamp(0, k - 1)[:, :, None].expand(b, k, w))
            drafts = torch.where(in_big[:, :, None], fill, drafts)
        n_src = num_sources(self.q, self.n_max)  # corpus sources follow the context ones
        long_source = 2 + (match_n[:, None] - self.q - 1).clamp(min=0)  # a longer match is accepted more often
        source = torch.where(in_long, long_source, torch.where(in_cor, n_src + cor_n[:, None] - 1,
                                                               torch.where(in_q, 1, 0)))
        rank = torch.where(in_long, slot, torch.where(in_cor, slot - n_long[:, None],
                                                      torch.where(in_q, ctx_slot - n_long[:, None], big_rank)))
        return drafts, source, rank.clamp(0, k - 1)

    def max_tree_size(self, depth: int) -> int:
        return 1 + self.k * min(self.w, depth)  # k branches that share nothing, at most

    def propose(self, state: DecodeState, budget: Budget) -> DraftTree:
        w = min(self.w, budget.depth)
        self._chain_of_node = None
        if w < 1:
            return DraftTree.chain(state.roots)
        drafts, self._slot_source, self._slot_rank = self.drafts(state, w)
        if min(budget.max_depth) < w:  # rows allowed less than the deepest: cut their drafts
            cut = torch.arange(w, device=drafts.device) >= budget.row_depth(drafts.device)[:, None, None]
            drafts = drafts.masked_fill(cut, -1)
        if self.verify == "chain":
            tree = DraftTree.chain(state.roots, drafts[:, 0])
            self._chain_of_node = torch.zeros(tree.tokens.shape, dtype=torch.int64, device=drafts.device)
            return tree
        merge = self.verify == "tree"
        if budget.cost is None or self.acceptance is None:
            tree, self._chain_of_node, _ = DraftTree.from_drafts(state.roots, drafts, merge)
            return tree
        # A node's estimate comes from its cell (source, rank among that source's drafts, depth, and how many
        # drafts share its prefix; a longest-suffix or corpus match's source is its suffix length).
        b, dev = drafts.shape[0], drafts.device
        cells = node_cells(self._slot_source, self._slot_rank, drafts, self.w, self.support)
        accept = self.acceptance.estimate(dev)[cells]  # [B,k,w]
        tree, self._chain_of_node, slot = DraftTree.from_drafts(state.roots, drafts, merge, accept)
        if b == 1:
            # One row: the planner picks how many of its likeliest nodes pay, and the kernel cuts there (a
            # host decision and a second pass of the kernel beat the dozen small tensor ops of a cut).
            # update() finds the kept nodes through their cells.
            keep = [budget.cost.plan_size(tree.accept[0, 1:].tolist())]  # one row: no padding
            tree, self._chain_of_node, slot = DraftTree.from_drafts(state.roots, drafts, merge, accept, keep)
        # Several rows share one forward as wide as the widest row, so the cut is the batch's: the whole tree
        # goes to the decode loop's planner with its estimates (cut row by row, one row's likely node would
        # make every row pay a wider step). update() finds its nodes again through the cut tree's origin.
        self._slot = cells.reshape(b, -1).gather(1, slot.clamp(min=0))  # [B,T] cell of each node
        return tree

    def update(self, state: DecodeState, tree: DraftTree, path: torch.Tensor, path_len: list[int],
               drafted: list[int]) -> None:
        if self._chain_of_node is None:
            return
        chain_of_node, slot_of_node = self._chain_of_node, self._slot
        if tree.origin is not None:  # the decode loop cut the proposed tree: index the bookkeeping by its nodes
            chain_of_node = chain_of_node.gather(1, tree.origin)
            slot_of_node = None if slot_of_node is None else slot_of_node.gather(1, tree.origin)
        t, k = tree.size, self._slot_source.shape[1]  # a chain cut to fewer nodes keeps the proposed one's first
        chain_of_node = chain_of_node[:, :t]
        slot_of_node = None if slot_of_node is None else slot_of_node[:, :t]
        # Bookkeeping over a few nodes per row, on the host after one transfer: a dozen small torch ops
        # here cost ~0.4 ms per step right after a forward (cold caches), the host loop ~0.05 ms.
        parts = [path, chain_of_node, self._slot_source]
        if slot_of_node is not None:
            parts += [slot_of_node, tree.valid.long()]
        slots = self.k if self.verify != "chain" else 1
        a, names = self.allocation, self.KINDS
        cells, accepted = [], []
        for row, n in zip(torch.cat(parts, 1).tolist(), path_len):
            if n == 0:  # a finished row
                continue
            row_path, chain, source = row[:n], row[t: 2 * t], row[2 * t: 2 * t + k]
            if slot_of_node is not None:  # every verified draft node: its cell, and whether it was accepted
                slot, valid = row[2 * t + k: 3 * t + k], row[3 * t + k:]
                on_path = set(row_path)
                for node in range(1, t):
                    if valid[node]:
                        cells.append(slot[node])
                        accepted.append(node in on_path)
            kind = [self.source_kind(s) for s in source]
            a["steps"] += 1
            for i, name in enumerate(names):
                if name != "bigram" or self.strategy != "context":  # a context-only drafter's empty slots
                    a[f"{name}_slots"] += kind[:slots].count(i)
            if n > 1:
                a[f"{names[kind[chain[row_path[-1]]]]}_accepted"] += n - 1
        if self._slot is not None:
            if cells:
                self.acceptance.observe(torch.tensor(cells), torch.tensor(accepted))
            self._slot = None

    def summary(self) -> dict:
        return {"allocation": dict(self.allocation)}


def best_chain(roots: torch.Tensor, drafts: torch.Tensor, source: torch.Tensor, rank: torch.Tensor, w_max: int,
               rates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row, the one chain to verify among ``k`` drafts: the root-to-leaf path of their trie with the most
    expected accepted tokens (the sum of its nodes' reach, as :func:`specdec.kernels.draft_tree` estimates it),
    for an engine that verifies chains only. Ties go to the drafter's order.

    roots: ``[B]``; drafts, source, rank: ``[B,k,w]`` / ``[B,k]`` / ``[B,k]`` as :meth:`NGrammysDrafter.drafts`
    returns them; w_max: the drafter's ``w`` (cells are numbered by it); rates: ``[cells]`` fp32,
    :meth:`specdec.policies.NodeAcceptance.rates`. Returns the chain ``[B,w]`` int64 (-1 padded), ``[B]``
    the slot of the draft it is a prefix of (0 where the chain is empty) and ``[B,w]`` int64 the cell of
    each chain node (-1 padded; a node's cell is its first draft's, as the drafter learns), for learning
    from the chain's verification, and ``[B,w]`` fp32 each chain node's reach estimate (0 padded), for cutting
    the chain by cost.
    """
    b, k, w = drafts.shape
    dev = drafts.device
    cells = node_cells(source, rank, drafts, w_max).reshape(b, k * w)
    tree, _, slot = DraftTree.from_drafts(roots, drafts, True, rates[cells].reshape(b, k, w))
    reach = tree.accept
    reach[:, 0] = 0.0
    parents = tree.parents.clamp(min=0)
    total = reach.clone()  # expected accepted tokens of the path to each node
    for _ in range(w):
        total = torch.where(tree.valid, reach + total.gather(1, parents), 0.0)
    best = total.argmax(1)  # the root where no row's draft has any estimate: an empty chain
    depth = tree.depth.gather(1, best[:, None])  # [B,1]
    up = [best[:, None]]  # up[j]: the ancestor j levels above the best node
    for _ in range(w - 1):
        up.append(parents.gather(1, up[-1]))
    ar = torch.arange(w, device=dev)[None]
    on = ar < depth
    path = torch.cat(up, 1).gather(1, (depth - 1 - ar).clamp(min=0))  # [B,w]: the path's node at depth d + 1
    node_slot = slot.gather(1, path).clamp(min=0)
    chain = torch.where(on, tree.tokens.gather(1, path), -1)
    # the path to a leaf is a prefix of the leaf's first chain: the draft the chain is
    owner = torch.where(depth[:, 0] > 0, slot.gather(1, best[:, None])[:, 0].clamp(min=0) // w, 0)
    return chain, owner, torch.where(on, cells.gather(1, node_slot), -1), torch.where(on, reach.gather(1, path), 0.0)


def support_level(drafts: torch.Tensor) -> torch.Tensor:
    """``[B,k,w] int64``: how many of a row's ``k`` drafts share each draft's prefix up to each depth,
    as a level ``0 .. SUPPORT_LEVELS - 1`` (one draft, two, three or more).

    drafts: ``[B,k,w]`` (-1 padded; a draft ends at its first padding). Drafts from different sources
    that agree are accepted far more often than either alone: on 24 dev prompts (bf16) a verified node
    was accepted 20% of the time alone, 42% when two drafts shared it and 67% with three or more, and
    the gap holds within each (source, rank, depth) cell."""
    return (shared_prefixes(drafts).sum(2) - 1).clamp(0, SUPPORT_LEVELS - 1)
