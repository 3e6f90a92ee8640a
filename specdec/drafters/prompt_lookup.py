"""Prompt lookup decoding: draft the continuation of the latest context n-gram match."""
from __future__ import annotations

import torch

from specdec import kernels
from specdec.drafters.base import Budget, DecodeState, Drafter, last_outcome, with_outcome
from specdec.tree import DraftTree


class PromptLookupDrafter(Drafter):
    """Chains from :func:`specdec.kernels.ngram_match` (the most frequent, then most recent, continuation
    of the longest matching suffix n-gram with ``n`` in ``[n_min, n_max]``), up to ``num_tokens`` long.

    With ``acceptance`` (an :class:`specdec.policies.AcceptanceModel` learned here per matched n-gram
    size), each chain carries per-node acceptance estimates (``DraftTree.accept``), which the decode
    loop's planner cuts to the length with the most expected tokens per second when the budget carries
    the step cost: where a longer verification is nearly free drafts stay long, where it is not, weak
    matches draft little. With ``history`` the estimates are kept per matched size and per outcome of the
    row's own last verified draft (:func:`specdec.contracts.last_outcome`).
    """

    def __init__(self, num_tokens: int = 10, n_min: int = 1, n_max: int = 4, acceptance=None, history: bool = True):
        if num_tokens < 1 or n_min < 1 or n_max < n_min:
            raise ValueError("need num_tokens >= 1 and 1 <= n_min <= n_max")
        self.num_tokens, self.n_min, self.n_max = num_tokens, n_min, n_max
        self.acceptance, self.history = acceptance, history
        self._signal: list[int] = []  # this step's acceptance signal per row (0: no match)
        self._outcome: list[int] = []  # per row, its last verified draft's outcome

    def begin(self, state: DecodeState) -> None:
        super().begin(state)
        self._signal, self._outcome = [], [0] * state.seq.shape[0]

    keeps_rows = True

    def keep_rows(self, rows: list[int]) -> None:
        self._outcome = [self._outcome[r] for r in rows] if self._outcome else []

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
            if len(self._outcome) != len(match_n):  # proposing without begin(): no outcomes yet
                self._outcome = [0] * len(match_n)
            self._signal = [with_outcome(n, o) if n > 0 and self.history else n
                            for n, o in zip(match_n.tolist(), self._outcome)]
            reach = [[1.0] + [beta * gamma**i for i in range(w)]
                     for beta, gamma in (self.acceptance.params(s) if s > 0 else (0.0, 0.0) for s in self._signal)]
            tree.accept = torch.tensor(reach, device=drafts.device)
        return tree

    def update(self, state: DecodeState, tree: DraftTree, path: torch.Tensor, path_len: list[int],
               drafted: list[int]) -> None:
        if self.acceptance is None or not self._signal:
            return
        for r, (s, d, a) in enumerate(zip(self._signal, drafted, path_len)):
            if s > 0:
                self.acceptance.observe(s, d, a - 1)
            if a > 0:
                self._outcome[r] = last_outcome(d, a - 1, self._outcome[r])
