"""N-Grammys (Stewart et al. 2024): k learning-free drafts of w tokens per step, verified together.

Each step fills ``k`` draft slots per row: first with context matches (the continuations of the
last ``q`` tokens' earlier occurrences, ranked by count then recency, from
:func:`specdec.kernels.ngram_match`), then with extended-bigram rows of the last token (the
model's own top-k next tokens, each chained with the top-1 bigram; :mod:`specdec.ngram_tables`).
The drafts are verified in one target pass, either as the trie they form (``verify="tree"``,
shared prefixes verified once), as ``k`` separate branches under the root (``verify="batch"``,
the paper's k batch rows without the k-1 copies of the root), or only the best draft
(``verify="chain"``).
"""
from __future__ import annotations

import torch

from specdec import kernels
from specdec.drafters.base import DecodeState, Drafter
from specdec.ngram_tables import NGramTables
from specdec.tree import DraftTree

STRATEGIES = ("mixed", "context", "bigram")
VERIFY_MODES = ("tree", "batch", "chain")


class NGrammysDrafter(Drafter):
    """``k`` drafts of up to ``w`` tokens per row; context query length ``q`` (the paper's q = 1).

    ``strategy``: ``mixed`` (context first, bigram fills the rest), ``context`` or ``bigram`` only.
    ``allocation`` counts, over all steps and rows, the slots each source filled and the accepted
    tokens each source's chains produced (a node shared by both sources counts for the lower slot,
    i.e. the context).
    """

    def __init__(self, tables: NGramTables, k: int = 10, w: int = 10, q: int = 1,
                 strategy: str = "mixed", verify: str = "tree"):
        if k < 1 or w < 1 or q < 1:
            raise ValueError(f"need k, w, q >= 1, got k={k}, w={w}, q={q}")
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
        if strategy != "context" and k > tables.bigram.shape[1]:
            raise ValueError(f"k={k} exceeds the bigram table's width {tables.bigram.shape[1]}")
        self.tables, self.k, self.w, self.q = tables, k, w, q
        self.strategy, self.verify = strategy, verify
        self._ext: torch.Tensor | None = None
        self._chain_of_node: torch.Tensor | None = None
        self._n_ctx: torch.Tensor | None = None
        self.allocation = {"steps": 0, "context_slots": 0, "bigram_slots": 0,
                           "context_accepted": 0, "bigram_accepted": 0}

    def _extended(self, device) -> torch.Tensor:
        if self._ext is None or self._ext.device != torch.device(device):
            self._ext = self.tables.extended(self.w, device)
        return self._ext

    def drafts(self, state: DecodeState, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B,k,w]`` drafts (-1 padded, best first) and ``[B]`` how many came from the context."""
        b = state.seq.shape[0]
        dev = state.seq.device
        k = self.k
        if self.strategy == "bigram":
            n_ctx = torch.zeros(b, dtype=torch.int64, device=dev)
            ctx = torch.full((b, k, w), -1, dtype=torch.int64, device=dev)
        else:
            width = max(state.seq_lens_host)
            ctx, _, counts, _ = kernels.ngram_match(state.seq[:, :width], state.seq_lens, self.q, self.q, k, w)
            n_ctx = (counts > 0).sum(-1)
        if self.strategy == "context":
            return ctx, n_ctx
        slot = torch.arange(k, device=dev)[None, :] - n_ctx[:, None]  # bigram rank for each remaining slot
        big = self._extended(dev)[state.roots][:, :, :w]  # [B,k_max,w]
        fill = big.gather(1, slot.clamp(min=0)[:, :, None].expand(b, k, w))
        return torch.where((slot >= 0)[:, :, None], fill, ctx), n_ctx

    def propose(self, state: DecodeState, max_len: int) -> DraftTree:
        w = min(self.w, max_len)
        self._chain_of_node = None
        if w < 1:
            return DraftTree.chain(state.roots)
        drafts, self._n_ctx = self.drafts(state, w)
        if self.verify == "chain":
            tree = DraftTree.chain(state.roots, drafts[:, 0])
            self._chain_of_node = torch.zeros(tree.tokens.shape, dtype=torch.int64, device=drafts.device)
            return tree
        tree, self._chain_of_node = DraftTree.from_drafts(state.roots, drafts, merge=self.verify == "tree")
        return tree

    def update(self, state: DecodeState, tree: DraftTree, path: torch.Tensor, path_len: list[int]) -> None:
        if self._chain_of_node is None:
            return
        last = path.gather(1, (torch.tensor(path_len, device=path.device) - 1).clamp(min=0)[:, None]).squeeze(1)
        chain = self._chain_of_node.gather(1, last[:, None]).squeeze(1)
        a = self.allocation
        n_ctx = self._n_ctx.tolist()
        slots = self.k if self.verify != "chain" else 1
        for nc, c, n in zip(n_ctx, chain.tolist(), path_len):
            if n == 0:  # a finished row
                continue
            a["steps"] += 1
            a["context_slots"] += min(nc, slots)
            a["bigram_slots"] += slots - min(nc, slots) if self.strategy != "context" else 0
            if n > 1:
                a["context_accepted" if c < nc else "bigram_accepted"] += n - 1

    def summary(self) -> dict:
        return {"allocation": dict(self.allocation)}
