"""Chain drafting with a feature-conditioned (EAGLE-style) draft model.

The draft reads, beside each token ``x_t``, the target's last hidden state ``f_{t-1}`` (see
:mod:`specdec.draft_models.eagle`). The decode loop hands this drafter the target's state of every
committed position (:meth:`add_hidden`); they are kept in ``feat [B, capacity + 2, H]``, where
column ``t`` holds ``f_{t-1}`` (column 0 is zeros: nothing precedes the first token) and the last
column takes the writes of padded path entries.

A step: catch up on the committed tokens the draft has not read, each paired with the target's
state before it; then draft a chain, feeding the draft's own last hidden state back where the
target's is not known yet. Positions drafted from the draft's own states are never kept: after
verification the draft rolls back to the committed tokens it read with true target states, and
the next catch-up re-reads the accepted tokens with theirs (one forward for all of them).
"""
from __future__ import annotations

import torch

from specdec.drafters.base import DecodeState
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.model import ModelRunner
from specdec.verify import SamplingConfig


class FeatureDraftDrafter(DraftModelDrafter):
    """:class:`DraftModelDrafter` for a draft whose forward takes ``target_hidden [B,T,H]``."""

    needs_hidden = True

    def __init__(self, runner: ModelRunner, sampling: SamplingConfig, proposal_topk: int = 64):
        super().__init__(runner, sampling, proposal_topk)
        self._proposed_at: list[int] = []

    def begin(self, state: DecodeState) -> None:
        super().begin(state)
        b, cap = state.seq.shape
        cfg = self.runner.config
        self._feat = torch.zeros(b, cap + 2, cfg.hidden_size, dtype=self.runner.model.dtype, device=state.seq.device)
        self._nfeat = torch.zeros(b, dtype=torch.int64, device=state.seq.device)
        self._proposed_at = [0] * b

    def keep_rows(self, rows: list[int]) -> None:
        super().keep_rows(rows)
        for j, r in enumerate(rows):  # in place, as the runner moves its KV: r >= j, so no source is overwritten first
            if r != j:
                self._feat[j].copy_(self._feat[r])
        self._feat = self._feat[: len(rows)]
        self._nfeat = self._nfeat.index_select(0, torch.tensor(rows, dtype=torch.int64, device=self._nfeat.device))
        self._proposed_at = [self._proposed_at[r] for r in rows]

    def catch_up(self, state: DecodeState) -> tuple[torch.Tensor, torch.Tensor | None]:
        self._proposed_at = list(state.seq_lens_host)  # positions below it are read with the target's states
        return super().catch_up(state)

    def add_hidden(self, hidden: torch.Tensor, counts: torch.Tensor) -> None:
        b, n, _ = hidden.shape
        dump = self._feat.shape[1] - 1
        ar = torch.arange(n, device=hidden.device)
        cols = torch.where(ar[None] < counts[:, None], self._nfeat[:, None] + 1 + ar, dump).clamp(max=dump)
        rows = torch.arange(b, device=hidden.device)[:, None].expand(b, n)
        self._feat[rows, cols] = hidden.to(self._feat.dtype)
        self._nfeat += counts.long()

    def _gather_feat(self, positions: torch.Tensor) -> torch.Tensor:
        cols = positions.clamp(max=self._feat.shape[1] - 1)
        return self._feat.gather(1, cols[..., None].expand(-1, -1, self._feat.shape[2]))

    def catch_up_inputs(self, positions: torch.Tensor) -> dict:
        # The token at position t is paired with f_{t-1}, stored in column t.
        return {"target_hidden": self._gather_feat(positions)}

    def frontier_inputs(self, hidden: torch.Tensor | None) -> dict:
        return {"target_hidden": hidden}

    def step_inputs(self, hidden: torch.Tensor | None) -> dict:
        return {"target_hidden": hidden[:, None]}

    def valid_prefix(self, state: DecodeState) -> list[int]:
        # Only positions read with the target's own state stay: those before this step's drafts (and,
        # as for any draft, never the pending root, so a finished row still has a token to read).
        return [min(seen, at, total - 1) for seen, at, total in zip(self.seen, self._proposed_at, state.seq_lens_host)]
