"""Length policies: each step's drafting budget per row, and stop rules that end a row's draft early.

A policy turns the tokens each row may still emit into a :class:`~specdec.contracts.Budget`
(``budget``) and learns from what verification accepted (``update``). Every policy may carry the
target's measured :class:`~specdec.policies.cost.StepCost` (cost-aware drafters and the planner size
trees by it; the decode loop times every step into it) and a :class:`StopRule` for model drafters.
"""
from __future__ import annotations

import torch

from specdec.contracts import Budget, StopRule
from specdec.policies.cost import StepCost


class StaticLength:
    """Always ``k`` tokens deep (or what a row has left to emit)."""

    def __init__(self, k: int, cost: StepCost | None = None, stop: StopRule | None = None,
                 max_nodes: int | None = None):
        if k < 1:
            raise ValueError(f"draft length must be >= 1, got {k}")
        if max_nodes is not None and max_nodes < 0:
            raise ValueError(f"max_nodes must be >= 0, got {max_nodes}")
        self.k, self.cost, self.stop, self.max_nodes = k, cost, stop, max_nodes

    @property
    def max_depth(self) -> int:
        """The deepest budget this policy ever gives."""
        return self.k

    def begin(self, batch_size: int, state=None) -> None:
        """A new generation of ``batch_size`` rows starts (``state``: its :class:`DecodeState`)."""
        if self.stop is not None:
            self.stop.begin(batch_size, state)

    def depths(self, rows: int) -> list[int]:
        """This step's wanted depth per row, before the rows' remaining lengths cut it."""
        return [self.k] * rows

    def budget(self, left: list[int]) -> Budget:
        """The budget for rows that may still draft ``left [B]`` tokens (what each may emit, less the
        token verification always adds)."""
        depth = [max(0, min(d, n)) for d, n in zip(self.depths(len(left)), left)]
        nodes = None if self.max_nodes is None else [self.max_nodes] * len(left)
        cost = None if self.cost is None else self.cost.for_batch(len(left))
        return Budget(depth, nodes, cost=cost, stop=self.stop)

    @property
    def keeps_rows(self) -> bool:
        """Whether :meth:`keep_rows` can drop finished rows (its stop rule, if any, must drop them too)."""
        return self.stop is None or self.stop.keeps_rows

    def keep_rows(self, rows: list[int]) -> None:
        """Finished rows left the batch: keep ``rows`` (ascending batch indices) only (a stop rule that keeps its
        rows refuses, :meth:`StopRule.keep_rows`)."""
        if self.stop is not None:
            self.stop.keep_rows(rows)

    def prepare_batch(self, runner, rows: int) -> None:
        """Before a batch of ``rows`` rows decodes: calibrate this policy's step cost, and its stop rule's (DISCO's
        cost mode), at that batch size where no table exists yet (target forwards on ``runner``)."""
        for cost in (self.cost, None if self.stop is None else self.stop.cost):
            if isinstance(cost, StepCost):
                cost.ensure_batch(runner, rows)

    def observe_step(self, tree_size: int, seconds: float, rows: int = 1) -> None:
        """The measured target forward over ``rows`` rows of ``tree_size`` nodes."""
        if self.cost is not None:
            self.cost.for_batch(rows).observe(tree_size, seconds)

    def update(self, drafted: list[int], accepted: list[int], rows: list[int] | None = None) -> None:
        """Per active row: draft tokens verified and accepted this step; ``rows``: which rows the lists
        describe (default: all, in order)."""
        if self.stop is not None:
            self.stop.update(drafted, accepted, rows)


class HeuristicLength(StaticLength):
    """transformers' ``"heuristic"`` schedule, per row: +2 after a fully accepted draft, else -1 (floor 1)."""

    def __init__(self, k: int = 5, max_k: int = 64, cost: StepCost | None = None, stop: StopRule | None = None,
                 max_nodes: int | None = None):
        super().__init__(k, cost, stop, max_nodes)
        self.max_k = max_k
        self._rows: list[int] = []

    @property
    def max_depth(self) -> int:
        return max(self.k, self.max_k)

    def begin(self, batch_size: int, state=None) -> None:
        super().begin(batch_size, state)
        self._rows = [self.k] * batch_size

    def keep_rows(self, rows: list[int]) -> None:
        super().keep_rows(rows)
        self._rows = [self._rows[r] for r in rows] if self._rows else []

    def length(self) -> int:
        """The current length of row 0 (the whole schedule, for one row)."""
        return self._rows[0] if self._rows else self.k

    def depths(self, rows: int) -> list[int]:
        if len(self._rows) != rows:
            self._rows = [self.k] * rows
        return list(self._rows)

    def update(self, drafted: list[int], accepted: list[int], rows: list[int] | None = None) -> None:
        super().update(drafted, accepted, rows)
        if not self._rows:
            self._rows = [self.k] * len(drafted)
        for r, d, a in zip(rows if rows is not None else range(len(drafted)), drafted, accepted):
            if d:
                self._rows[r] = min(self.max_k, self._rows[r] + 2) if a == d else max(1, self._rows[r] - 1)


class ConfidenceStop(StopRule):
    """Stop a row's draft once the draft's top-1 probability falls below ``threshold`` (transformers'
    ``assistant_confidence_threshold``): a draft unsure of its token is unlikely to be accepted."""

    keeps_rows = True  # no per-row state: the default keep_rows

    def __init__(self, threshold: float):
        if not 0.0 <= threshold < 1.0:
            raise ValueError(f"confidence threshold must be in [0, 1), got {threshold}")
        self.threshold = threshold

    def keep_going(self, depth: int, logits: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        top = logits.float().softmax(-1).amax(-1)
        return top >= self.threshold
