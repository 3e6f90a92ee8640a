"""Prompt lookup decoding: draft the continuation of the latest context n-gram match."""
from __future__ import annotations

import torch

from specdec import kernels
from specdec.drafters.base import DecodeState, Drafter
from specdec.policies import AcceptanceModel, StepCost, best_length
from specdec.tree import DraftTree


class PromptLookupDrafter(Drafter):
    """Chains from :func:`specdec.kernels.ngram_match` (the most frequent, then most recent, continuation
    of the longest matching suffix n-gram with ``n`` in ``[n_min, n_max]``), up to ``num_tokens`` long.

    With ``cost`` (measured target step costs) and ``acceptance`` (learned per matched n-gram size),
    each draft is cut to the length with the most expected tokens per second: on a machine where a
    longer verification is nearly free drafts stay long, where it is not, weak matches draft little.
    """

    def __init__(self, num_tokens: int = 10, n_min: int = 1, n_max: int = 4,
                 cost: StepCost | None = None, acceptance: AcceptanceModel | None = None):
        if num_tokens < 1 or n_min < 1 or n_max < n_min:
            raise ValueError("need num_tokens >= 1 and 1 <= n_min <= n_max")
        self.num_tokens, self.n_min, self.n_max = num_tokens, n_min, n_max
        self.cost, self.acceptance = cost, acceptance
        self._signal: list[int] = []

    def propose(self, state: DecodeState, max_len: int) -> DraftTree:
        w = min(self.num_tokens, max_len)
        if w < 1:
            self._signal = []
            return DraftTree.chain(state.roots)
        width = max(state.seq_lens_host)
        drafts, _, _, match_n = kernels.ngram_match(state.seq[:, :width], state.seq_lens, self.n_min, self.n_max, 1, w)
        drafts = drafts[:, 0]
        if self.cost is not None and self.acceptance is not None:
            self._signal = match_n.tolist()
            keep = [best_length(self.acceptance, self.cost, n, w) if n > 0 else 0 for n in self._signal]
            if self.cost.explore():  # one token more now and then, so lengths the plan avoids are timed again
                keep = [min(w, x + 1) if n > 0 else 0 for x, n in zip(keep, self._signal)]
            cut = torch.arange(w, device=drafts.device)[None] >= torch.tensor(keep, device=drafts.device)[:, None]
            drafts = drafts.masked_fill(cut, -1)[:, : max(1, max(keep))]
        return DraftTree.chain(state.roots, drafts)

    def observe_step(self, tree_size: int, seconds: float) -> None:
        if self.cost is not None:
            self.cost.observe(tree_size, seconds)

    def update(self, state: DecodeState, tree: DraftTree, path: torch.Tensor, path_len: list[int],
               drafted: list[int]) -> None:
        if self.acceptance is None or not self._signal:
            return
        for n, d, a in zip(self._signal, drafted, path_len):
            if n > 0:
                self.acceptance.update(n, d, a - 1)
