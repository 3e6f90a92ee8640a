"""The contracts between drafting and planning, below both: the decode state a drafter reads, the per-row budget it
drafts within, the stop rule it consults, the step cost it may plan with, and the length policy the decode loop asks.

``specdec.drafters`` and ``specdec.policies`` both import from here and never from each other.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch


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

    def advance(self, emitted: torch.Tensor, counts: torch.Tensor, counts_host: list[int]) -> None:
        """Append what a verification step emitted: the first ``counts [B]`` of each row's ``emitted [B,W]``
        tokens (``counts_host``: the same counts on the host)."""
        width = emitted.shape[1]
        ar = torch.arange(width, device=self.seq.device)
        keep = ar[None] < counts[:, None]
        pos = torch.where(keep, self.seq_lens[:, None] + ar, 0)
        self.seq.scatter_(1, pos, torch.where(keep, emitted, self.seq[:, :1]))
        self.seq_lens += counts
        self.seq_lens_host = [s + n for s, n in zip(self.seq_lens_host, counts_host)]


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


@runtime_checkable
class AcceptanceLearner(Protocol):
    """An acceptance estimate learned online from verification: ``estimate(key)`` reads it, ``observe(key,
    outcome)`` counts what the target did. The key is each learner's own: a request's signal and draft length
    (:class:`~specdec.policies.AcceptanceModel`), every n-gram cell at once
    (:class:`~specdec.policies.NodeAcceptance`), a draft probability
    (:class:`~specdec.policies.ProbabilityCalibration`), a classifier logit
    (:class:`~specdec.policies.disco.PlattCalibration`), a phrase's source and position
    (:class:`~specdec.drafters.ouroboros.PhraseRates`). Planners read estimates; drafters and stop rules observe."""

    def estimate(self, *key: Any) -> Any: ...

    def observe(self, *outcome: Any) -> None: ...


class StepCostLike(Protocol):
    """What a drafter or a stop rule may read of the measured target step cost (:class:`specdec.policies.StepCost`)."""

    def costs(self, n: int) -> list[float]: ...

    def for_batch(self, rows: int) -> "StepCostLike":
        """The table of forwards over ``rows`` rows (a one-row table answers with itself)."""
        ...

    def best_size(self, reach: list[float], costs: list[float] | None = None) -> tuple[int, float]: ...

    def explore(self) -> bool: ...

    def plan_size(self, reach: list[float]) -> int:
        """How many of one row's draft nodes, reached with probabilities ``reach``, pay for their verification
        (the planner's rule and its exploration)."""
        ...

    def marginal_bar(self, tokens: float, seconds: float, extra_seconds: float) -> float:
        """The expected tokens that ``extra_seconds`` of work must add to a step emitting ``tokens`` in
        ``seconds`` to raise its rate (the planner's rule)."""
        ...


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
    cost: StepCostLike | None = None  # the step cost a cost-aware rule plans with (a batch calibrates it first)

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


class LengthPolicy(Protocol):
    """Each step's drafting budget per row, learned from what verification accepted
    (:class:`specdec.policies.StaticLength` and its kind). The decode loop calls, per generation, ``begin``, then
    per step ``budget``, ``observe_step`` (the timed target forward) and ``update``; ``keep_rows`` when finished
    rows leave the batch (only where :attr:`keeps_rows`)."""

    cost: StepCostLike | None  # the target's measured step cost (``None``: no cost planning)
    stop: StopRule | None  # consulted by a model drafter after every drafted token (``None``: draft to the depth)

    @property
    def max_depth(self) -> int:
        """The deepest budget this policy ever gives."""
        ...

    @property
    def keeps_rows(self) -> bool:
        """Whether :meth:`keep_rows` can drop finished rows (its stop rule's too)."""
        ...

    def begin(self, batch_size: int, state: DecodeState | None = None) -> None: ...

    def budget(self, left: list[int]) -> Budget:
        """The budget for rows that may still draft ``left [B]`` tokens."""
        ...

    def keep_rows(self, rows: list[int]) -> None: ...

    def observe_step(self, tree_size: int, seconds: float, rows: int = 1) -> None: ...

    def update(self, drafted: list[int], accepted: list[int], rows: list[int] | None = None) -> None: ...

    def prepare_batch(self, runner, rows: int) -> None:
        """Before a batch of ``rows`` rows decodes: calibrate the step-cost tables this policy and its stop rule
        plan with at that batch size, where none exists yet (this runs target forwards on ``runner``)."""
        ...


# The cells n-gram draft nodes are learned by, shared by the drafter that numbers them
# (:mod:`specdec.drafters.ngrammys`) and the learner that keeps a rate per cell
# (:class:`specdec.policies.NodeAcceptance`).

SUPPORT_LEVELS = 3  # support_level's levels: one draft, two, three or more


def num_sources(q: int, n_max: int, corpus: bool = False, store: bool = False, recycle: bool = False) -> int:
    """Number of draft sources as the drafters number them: 0 bigram rows, 1 matches of the last ``q``
    tokens, ``2 + j`` longest-suffix matches of ``q + 1 + j`` tokens (at least one such source), with
    ``corpus`` then one per corpus match length ``1 .. n_max``, with ``store`` (``hybrid``'s past outputs)
    one per store match length ``1 .. n_max``, and with ``recycle`` one for the recycled successors."""
    return 2 + max(1, n_max - q) + (n_max if corpus else 0) + (n_max if store else 0) + (1 if recycle else 0)


def num_cells(k: int, w: int, q: int, n_max: int, corpus: bool = False, store: bool = False,
              recycle: bool = False) -> int:
    """Number of (source, rank, depth, support) cells a node can fall in; a cell is
    ``((source * k + rank) * w + depth) * SUPPORT_LEVELS + support``."""
    return num_sources(q, n_max, corpus, store, recycle) * k * w * SUPPORT_LEVELS
