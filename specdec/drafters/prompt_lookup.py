"""Prompt lookup decoding: draft the continuation of the latest context n-gram match."""
from __future__ import annotations

import torch

from specdec import kernels
from specdec.drafters.base import DecodeState, Drafter
from specdec.tree import DraftTree


class PromptLookupDrafter(Drafter):
    """Chains from :func:`specdec.kernels.ngram_match` (the most frequent, then most recent, continuation
    of the longest matching suffix n-gram with ``n`` in ``[n_min, n_max]``), up to ``num_tokens`` long.
    """

    def __init__(self, num_tokens: int = 10, n_min: int = 1, n_max: int = 3):
        if num_tokens < 1 or n_min < 1 or n_max < n_min:
            raise ValueError("need num_tokens >= 1 and 1 <= n_min <= n_max")
        self.num_tokens, self.n_min, self.n_max = num_tokens, n_min, n_max

    def propose(self, state: DecodeState, max_len: int) -> DraftTree:
        w = min(self.num_tokens, max_len)
        if w < 1:
            return DraftTree.chain(state.roots)
        width = max(state.seq_lens_host)
        drafts, _, _ = kernels.ngram_match(state.seq[:, :width], state.seq_lens, self.n_min, self.n_max, 1, w)
        return DraftTree.chain(state.roots, drafts[:, 0])
