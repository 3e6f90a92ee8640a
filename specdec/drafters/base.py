"""The drafter contract: a drafter proposes a tree per step within its :class:`~specdec.contracts.Budget` and learns
from what verification accepted. The types it shares with the policies live in :mod:`specdec.contracts`."""
from __future__ import annotations

import torch

from specdec.contracts import (OUTCOMES, Budget, DecodeState, LengthPolicy, StepCostLike, StopRule,  # noqa: F401
                               last_outcome, with_outcome)
from specdec.tree import DraftTree


class Drafter:
    """Proposes a draft tree per step and learns from the outcome.

    ``begin`` sees the prompts once; ``propose(state, budget)`` returns a :class:`DraftTree` with at
    most ``budget.max_depth[b]`` draft tokens on any root-to-leaf path of row ``b``; a drafter that
    cannot plan by cost itself may attach per-node acceptance estimates (``DraftTree.accept``) for the
    decode loop's planner to prune by; ``update`` gets the accepted path.
    ``draft_calls`` counts forward passes of a draft model (0 for model-free drafters).
    Drafters with ``needs_hidden`` condition on the target's last hidden state: the decode loop then
    hands them, through :meth:`add_hidden`, the state of every position the target commits. Drafters
    with ``per_node`` learn from what the target wanted at every node: the decode loop then verifies
    with per-node outputs and hands the result to :meth:`observe_verdict` before :meth:`update` (the loop
    reads ``per_node`` after each :meth:`propose`, so a drafter may say it per step).
    """

    draft_calls: int = 0
    needs_hidden: bool = False
    per_node: bool = False
    keeps_rows: bool = False  # implements keep_rows: the decode loop may then drop finished rows from the batch
    # Nodes past the longest sequence that the drafter's own draft model grows in its pending region (0: a chain or
    # no draft model); its cache keeps them and DRAFT_CACHE_SLACK more (the memory estimate reads it).
    draft_nodes: int = 0

    def begin(self, state: DecodeState) -> None:
        self.draft_calls = 0

    def max_tree_size(self, depth: int) -> int:
        """The most nodes (root included) a tree of this drafter can have when budgets allow ``depth`` draft
        tokens: the target's cache keeps that much room past each row (a drafter that does not know says
        256)."""
        return 256

    def propose(self, state: DecodeState, budget: Budget) -> DraftTree:
        raise NotImplementedError

    def update(self, state: DecodeState, tree: DraftTree, path: torch.Tensor, path_len: list[int],
               drafted: list[int]) -> None:
        """Called after verification, once ``state`` includes the accepted tokens and the next token.

        path_len: accepted path length per row (root included, 0 for finished rows); drafted: the
        tree's draft nodes per row. Both are host lists the decode loop already has.
        """

    def observe_verdict(self, tree: DraftTree, verdict) -> None:
        """``per_node`` drafters: the :class:`~specdec.verify.VerifyResult` of ``tree`` (the tree the target
        verified, possibly pruned from the proposed one), with ``target_argmax`` (greedy) or
        ``target_topk_*`` (sampling) filled; called before :meth:`update` of the same step."""

    def add_hidden(self, hidden: torch.Tensor, counts: torch.Tensor) -> None:
        """The target's last hidden states of the next ``counts [B]`` committed positions of each row,
        in order: ``hidden [B,n,H]`` (columns past ``counts[b]`` are ignored). Called after ``begin``
        with the prompt, then after every verification with the accepted path (root first)."""

    def keep_rows(self, rows: list[int]) -> None:
        """Finished rows left the batch: keep the per-row state of ``rows`` (ascending batch indices) only, in
        that order. Called only where :attr:`keeps_rows`; this default suits a drafter with no per-row state."""
        if not self.keeps_rows:
            raise NotImplementedError(f"{type(self).__name__} keeps its rows")

    def finish(self) -> None:
        """The generation is over (a drafter that keeps state outside the process saves it here)."""

    def summary(self) -> dict:
        """Drafter-specific statistics of the last generation (JSON-serialisable)."""
        return {}


class NullDrafter(Drafter):
    """No drafts: every step verifies only the root (plain autoregressive decoding)."""

    keeps_rows = True

    def max_tree_size(self, depth: int) -> int:
        return 1

    def propose(self, state: DecodeState, budget: Budget) -> DraftTree:
        return DraftTree.chain(state.roots)
