"""The drafter interface and the decode state it reads."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.tree import DraftTree


@dataclass
class DecodeState:
    """Tokens so far. seq: ``[B, capacity] int64`` (prompt then generated tokens); seq_lens: ``[B]``.

    The last token of each row (``seq[b, seq_lens[b]-1]``) is the pending root: its KV is not in
    the target's cache yet. ``seq_lens_host`` mirrors ``seq_lens`` on the host.
    """

    seq: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_host: list[int]

    @property
    def roots(self) -> torch.Tensor:
        """``[B]`` the pending root token of each row."""
        return self.seq.gather(1, (self.seq_lens - 1)[:, None]).squeeze(1)


class Drafter:
    """Proposes a draft tree per step and learns from the outcome.

    ``begin`` sees the prompts once; ``propose(state, max_len)`` returns a :class:`DraftTree` with at
    most ``max_len`` draft tokens on any root-to-leaf path; ``update`` gets the accepted path.
    ``draft_calls`` counts forward passes of a draft model (0 for model-free drafters).
    Drafters with ``needs_hidden`` condition on the target's last hidden state: the decode loop then
    hands them, through :meth:`add_hidden`, the state of every position the target commits.
    """

    draft_calls: int = 0
    needs_hidden: bool = False

    def begin(self, state: DecodeState) -> None:
        self.draft_calls = 0

    def propose(self, state: DecodeState, max_len: int) -> DraftTree:
        raise NotImplementedError

    def update(self, state: DecodeState, tree: DraftTree, path: torch.Tensor, path_len: list[int],
               drafted: list[int]) -> None:
        """Called after verification, once ``state`` includes the accepted tokens and the next token.

        path_len: accepted path length per row (root included, 0 for finished rows); drafted: the
        tree's draft nodes per row. Both are host lists the decode loop already has.
        """

    def add_hidden(self, hidden: torch.Tensor, counts: torch.Tensor) -> None:
        """The target's last hidden states of the next ``counts [B]`` committed positions of each row,
        in order: ``hidden [B,n,H]`` (columns past ``counts[b]`` are ignored). Called after ``begin``
        with the prompt, then after every verification with the accepted path (root first)."""

    def observe_step(self, tree_size: int, seconds: float) -> None:
        """The measured target forward time over this step's tree (for cost-aware drafters)."""

    def summary(self) -> dict:
        """Drafter-specific statistics of the last generation (JSON-serialisable)."""
        return {}


class NullDrafter(Drafter):
    """No drafts: every step verifies only the root (plain autoregressive decoding)."""

    def propose(self, state: DecodeState, max_len: int) -> DraftTree:
        return DraftTree.chain(state.roots)
