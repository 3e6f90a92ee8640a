"""The drafter contract: the decode state it reads, the budget it drafts within, the stop rule it consults."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

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

    @classmethod
    def of(cls, prompts: list[list[int]], capacity: int, device) -> "DecodeState":
        """Prompts (token id lists, ragged) laid into a ``[B, capacity]`` buffer on ``device``."""
        seq = torch.zeros(len(prompts), capacity, dtype=torch.int64)
        for r, p in enumerate(prompts):
            seq[r, : len(p)] = torch.tensor(p, dtype=torch.int64)
        lens = [len(p) for p in prompts]
        return cls(seq.to(device), torch.tensor(lens, device=device), lens)

    def padded(self) -> torch.Tensor:
        """``[B, max(seq_lens)]`` the tokens so far, right-padded."""
        return self.seq[:, : max(self.seq_lens_host)]

    def append(self, tokens: torch.Tensor) -> None:
        """One token per row: ``tokens [B]``."""
        self.seq[torch.arange(self.seq.shape[0], device=self.seq.device), self.seq_lens] = tokens
        self.seq_lens += 1
        self.seq_lens_host = [n + 1 for n in self.seq_lens_host]

    def keep_rows(self, rows: list[int]) -> None:
        """Keep only the rows ``rows`` (ascending indices), in that order (finished rows leave the batch)."""
        index = torch.tensor(rows, dtype=torch.int64, device=self.seq.device)
        self.seq, self.seq_lens = self.seq.index_select(0, index), self.seq_lens.index_select(0, index)
        self.seq_lens_host = [self.seq_lens_host[r] for r in rows]

    def advance(self, step) -> None:
        """Append what a verification step emitted: ``step.emitted [B,W]``, ``step.path_len [B]`` tokens of
        each row (host copy ``step.lengths``)."""
        width = step.emitted.shape[1]
        ar = torch.arange(width, device=self.seq.device)
        keep = ar[None] < step.path_len[:, None]
        pos = torch.where(keep, self.seq_lens[:, None] + ar, 0)
        self.seq.scatter_(1, pos, torch.where(keep, step.emitted, self.seq[:, :1]))
        self.seq_lens += step.path_len
        self.seq_lens_host = [s + n for s, n in zip(self.seq_lens_host, step.lengths)]


OUTCOMES = 4  # what a request's last verified draft did: none yet, rejected, partly accepted, wholly accepted


def last_outcome(drafted: int, accepted: int, before: int = 0) -> int:
    """The :data:`OUTCOMES` level of a step that verified ``drafted`` draft tokens of a request and accepted
    ``accepted``; a step that drafted nothing keeps the level ``before``. Acceptance runs in spells (a
    request copying its context goes on copying), so keeping acceptance per level sharpens it."""
    if drafted <= 0:
        return before
    return 1 if accepted <= 0 else 2 if accepted < drafted else 3


def with_outcome(signal: int, outcome: int) -> int:
    """An acceptance-model signal split by a request's :func:`last_outcome` level."""
    return signal * OUTCOMES + outcome


class StepCostLike(Protocol):
    """What a drafter may read of the measured target step cost (:class:`specdec.policies.StepCost`)."""

    def costs(self, n: int) -> list[float]: ...

    def best_size(self, reach: list[float], costs: list[float] | None = None) -> tuple[int, float]: ...

    def explore(self) -> bool: ...


class StopRule:
    """Decides, after every token a model drafter drafts, which rows keep drafting.

    ``keep_going(depth, logits, tokens)`` is called with the depth just drafted (1 for the first draft
    token), the draft's logits ``[B, V]`` at that position (the distribution the token was picked from;
    ``V`` is the draft's own vocabulary, which may be reduced) and the drafted tokens ``[B]`` (target
    ids); it returns ``[B] bool``. A row that stops drafts nothing more this step; the token just
    drafted stays in the draft (a rule may read it, never drop it: stopping depends on the drafted
    prefix only, which keeps verification exact). ``update`` learns from each step's outcome.
    """

    keeps_rows: bool = False  # implements keep_rows: finished rows may then leave the batch

    def begin(self, batch_size: int, state: DecodeState | None = None) -> None:
        """A new generation of ``batch_size`` rows starts (``state``: its prompts and first tokens)."""

    def keep_rows(self, rows: list[int]) -> None:
        """Finished rows left the batch: keep the per-row state of ``rows`` (ascending batch indices) only.
        Called only where :attr:`keeps_rows`; this default suits a rule with no per-row state."""
        if not self.keeps_rows:
            raise NotImplementedError(f"{type(self).__name__} keeps its rows")

    def keep_going(self, depth: int, logits: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def update(self, drafted: list[int], accepted: list[int], rows: list[int] | None = None) -> None:
        """Draft tokens verified and accepted this step, for the rows ``rows`` (default: all, in order;
        finished rows are left out)."""


@dataclass
class Budget:
    """What one step may draft, per row.

    max_depth: ``[B]`` host ints, draft tokens on any root-to-leaf path (0: draft nothing);
    max_nodes: ``[B]`` host ints, draft nodes in the row's tree (``None``: no limit beyond the drafter's own);
    cost: the target's measured step cost per tree size (``StepCost``), for drafters that size their
    trees by it (``None``: draft to the depth, no cost planning); stop: a rule a model drafter consults
    after every drafted token (``None``: draft to the depth).
    """

    max_depth: list[int]
    max_nodes: list[int] | None = None
    cost: StepCostLike | None = None
    stop: StopRule | None = None

    @property
    def depth(self) -> int:
        """The deepest any row may draft this step."""
        return max(self.max_depth, default=0)

    @classmethod
    def static(cls, batch_size: int, depth: int, cost: StepCostLike | None = None) -> "Budget":
        """Every row may draft ``depth`` tokens deep."""
        return cls([depth] * batch_size, cost=cost)

    def row_depth(self, device) -> torch.Tensor:
        """``[B] int64`` :attr:`max_depth` on ``device``."""
        return torch.tensor(self.max_depth, dtype=torch.int64, device=device)


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
    with per-node outputs and hands the result to :meth:`observe_verdict` before :meth:`update`.
    """

    draft_calls: int = 0
    needs_hidden: bool = False
    per_node: bool = False
    keeps_rows: bool = False  # implements keep_rows: the decode loop may then drop finished rows from the batch

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
