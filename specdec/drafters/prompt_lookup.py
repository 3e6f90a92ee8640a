"""Prompt lookup decoding: draft the continuation of the latest context n-gram match."""
from __future__ import annotations

import torch

from specdec import kernels
from specdec.drafters.base import Budget, DecodeState, Drafter
from specdec.tree import DraftTree


class PromptLookupDrafter(Drafter):
    """Chains from :func:`specdec.kernels.ngram_match` (the most frequent, then most recent, continuation
    of the longest matching suffix n-gram with ``n`` in ``[n_min, n_max]``), up to ``num_tokens`` long.

    With ``acceptance`` (an :class:`specdec.policies.AcceptanceModel` learned here per matched n-gram
    size), each chain carries per-node acceptance estimates (``DraftTree.accept``), which the decode
    loop's planner cuts to the length with the most expected tokens per second when the budget carries
    the step cost: where a longer verification is nearly free drafts stay long, where it is not, weak
    matches draft little.
    """

    def __init__(self, num_tokens: int = 10, n_min: int = 1, n_max: int = 4, acceptance=None):
        if num_tokens < 1 or n_min < 1 or n_max < n_min:
            raise ValueError("need num_tokens >= 1 and 1 <= n_min <= n_max")
        self.num_tokens, self.n_min, self.n_max = num_tokens, n_min, n_max
        self.acceptance = acceptance
        self._signal: list[int] = []

    def max_tree_size(self, depth: int) -> int:
        return 1 + min(self.num_tokens, depth)

    def propose(self, state: DecodeState, budget: Budget) -> DraftTree:
        w = min(self.num_tokens, budget.depth)
        self._signal = []
        if w < 1:
            return DraftTree.chain(state.roots)
        width = max(state.seq_lens_host)
        drafts, _, _, match_n = kernels.ngram_match(state.seq[:, :width], state.seq_lens, self.n_min, self.n_max, 1, w)
        drafts = drafts[:, 0]
        if min(budget.max_depth) < w:
            drafts = drafts.masked_fill(torch.arange(w, device=drafts.device) >= budget.row_depth(drafts.device)[:, None], -1)
        tree = DraftTree.chain(state.roots, drafts)
        if self.acceptance is not None and budget.cost is not None:
            self._signal = match_n.tolist()
            reach = [[1.0] + [beta * gamma**i for i in range(w)]
                     for beta, gamma in (self.acceptance.params(n) if n > 0 else (0.0, 0.0) for n in self._signal)]
            tree.accept = torch.tensor(reach, device=drafts.device)
        return tree

    def update(self, state: DecodeState, tree: DraftTree, path: torch.Tensor, path_len: list[int],
               drafted: list[int]) -> None:
        if self.acceptance is None or not self._signal:
            return
        for n, d, a in zip(self._signal, drafted, path_len):
            if n > 0:
                self.acceptance.update(n, d, a - 1)
