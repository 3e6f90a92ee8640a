"""The target's measured step cost: seconds of one forward over ``T`` tree tokens."""
from __future__ import annotations

from specdec.policies import planner


class StepCost:
    """Measured seconds of one target forward over ``T`` tree tokens per row, interpolated between samples.

    ``calibrate`` times the runner on a throwaway context once (a few dozen forwards): the shape
    of c(T) is a property of the model, dtype and machine (on one CPU a 4-token step costs 1.5x
    a 1-token step in fp32 and the same in bf16), so it is measured, never assumed. ``observe``
    folds in every timed step; :meth:`explore` makes planners time sizes they avoid now and then.

    The table is for one row. A forward over ``B`` rows of ``T`` tokens is another shape (``B * T`` tokens
    through every weight): :meth:`ensure_batch` calibrates a table of its own per batch size, which
    :meth:`for_batch` returns (a table interpolated in rows for a size below a calibrated one, whose
    finished rows left the batch; one row's table for others).
    """

    SIZES = (1, 2, 3, 4, 5, 6, 8, 11, 16)
    BATCH_SIZES = (1, 2, 3, 4, 6, 8, 12)  # a batch's steps are dearer: fewer, smaller sizes to time
    MAX_CALIBRATION_ROWS = 64  # larger batches reuse this many rows' table (its [rows, 12, V] logits stay small)

    def __init__(self, table: dict[int, float], explore_every: int = 16):
        if not table or 1 not in table:
            raise ValueError("a step-cost table needs at least T = 1")
        self.sizes = sorted(table)
        self.table = dict(table)
        self.explore_every = explore_every
        self._plans = 0
        self.batches: dict[int, StepCost] = {}
        self._between: dict[int, StepCost] = {}  # batch sizes between calibrated ones (see for_batch)

    def for_batch(self, rows: int) -> "StepCost":
        """The table of forwards over ``rows`` rows: its own where :meth:`ensure_batch` made one; for a size
        below a calibrated one (a batch whose finished rows left it), a table interpolated in rows between
        the nearest calibrated sizes (this one-row table below), kept so its own steps update it; else this."""
        if rows <= 1:
            return self
        if rows in self.batches:
            return self.batches[rows]
        upper = min((b for b in self.batches if b > rows), default=None)
        if upper is None:
            return self
        if rows not in self._between:
            lower = max((b for b in self.batches if b < rows), default=1)
            lo, hi = self.batches.get(lower, self), self.batches[upper]
            f = (rows - lower) / (upper - lower)
            self._between[rows] = StepCost({t: lo(t) + f * (hi(t) - lo(t)) for t in hi.sizes}, self.explore_every)
        return self._between[rows]

    def ensure_batch(self, runner, rows: int) -> "StepCost":
        """:meth:`for_batch`, calibrating ``runner`` at ``rows`` rows first if no table exists for them (this
        resets the runner: call it before a generation starts)."""
        if rows > 1 and rows not in self.batches:
            self._between.clear()  # interpolated from the tables so far
            timed = min(rows, self.MAX_CALIBRATION_ROWS)
            if timed not in self.batches:
                self.batches[timed] = StepCost.calibrate(runner, repeats=2, sizes=self.BATCH_SIZES, rows=timed,
                                                         explore_every=self.explore_every)
            # Past the cap the table starts from the capped batch's costs; the batch's own steps then update it.
            self.batches[rows] = self.batches[timed] if timed == rows else StepCost(
                dict(self.batches[timed].table), self.explore_every)
        return self.for_batch(rows)

    def explore(self) -> bool:
        """True once every ``explore_every`` calls: the planner asking then verifies one node more than
        its optimum. ``observe`` corrects only the sizes that run, so without this a calibration that
        overrated larger sizes (taken during a busy moment) would keep the planner off them for good."""
        self._plans += 1
        return self.explore_every > 0 and self._plans % self.explore_every == 0

    def observe(self, t: int, seconds: float, weight: float = 0.2) -> None:
        """Fold one measured forward over ``t`` tokens into the table (exponential average), so a
        calibration skewed by a busy moment corrects itself as decoding goes on."""
        if t in self.table:
            self.table[t] += weight * (seconds - self.table[t])
        else:
            self.table[t] = seconds
            self.sizes = sorted(self.table)

    def __call__(self, t: int) -> float:
        """c(t): interpolated between measured sizes, extrapolated (never downwards) past the largest."""
        return self.costs(max(1, t))[-1]

    def costs(self, n: int) -> list[float]:
        """``[c(1), ..., c(n)]`` in one pass over the table (what a planner scoring every tree size needs)."""
        sizes, table = self.sizes, self.table
        last = sizes[-1]
        prev = sizes[-2] if len(sizes) > 1 else last
        # Past the largest size, grow at least at the table's average rate: a last segment flattened by
        # a noisy sample would otherwise make every larger tree look free (one 61-node step, ~4x a
        # normal one, was seen after such a calibration).
        slope = max(0.0, (table[last] - table[prev]) / max(1, last - prev),
                    (table[last] - table[sizes[0]]) / max(1, last - sizes[0]))
        out, j = [], 0
        for t in range(1, n + 1):
            if t <= sizes[0]:
                out.append(table[sizes[0]])
            elif t > last:
                out.append(table[last] + slope * (t - last))
            else:
                while sizes[j + 1] < t:
                    j += 1
                lo, hi = sizes[j], sizes[j + 1]
                out.append(table[lo] + (table[hi] - table[lo]) * (t - lo) / (hi - lo))
        return out

    def best_size(self, reach: list[float], costs: list[float] | None = None) -> tuple[int, float]:
        """Of draft nodes reached with probabilities ``reach`` (in the order they would be added), how many
        to verify for the most expected tokens per second of target time, and the tokens that emits
        (``1 + `` their reach): :func:`specdec.policies.planner.best_size` on this table, the planner's rule
        handed to drafters with their budget. ``costs``: :meth:`costs` of at least ``len(reach) + 1`` if the
        caller has it."""
        return planner.best_size(reach, self.costs(len(reach) + 1) if costs is None else costs)

    def plan_size(self, reach: list[float]) -> int:
        """How many of one row's draft nodes, reached with probabilities ``reach`` (any order), to verify:
        :func:`specdec.policies.planner.plan_size` on this table, exploring when :meth:`explore` says so (called
        once)."""
        return planner.plan_size(reach, self.costs(len(reach) + 1), self.explore())

    def marginal_bar(self, tokens: float, seconds: float, extra_seconds: float) -> float:
        """:func:`specdec.policies.planner.marginal_bar`: the expected tokens that ``extra_seconds`` of work must
        add to a step emitting ``tokens`` in ``seconds`` (for drafters, which receive the planner with this
        table)."""
        return planner.marginal_bar(tokens, seconds, extra_seconds)

    @classmethod
    def calibrate(cls, runner, context: int = 128, repeats: int = 3, sizes=SIZES, extra_inputs=None, rows: int = 1,
                  explore_every: int = 16) -> "StepCost":
        """Time ``runner`` over chains of each size in ``sizes`` after a ``context``-token prefix, in ``rows``
        rows at once. ``extra_inputs(t) -> dict``: model inputs beside the tokens for ``t`` tokens (a
        feature-conditioned draft's ``target_hidden``, one row only); the prefix then goes through
        ``forward_tree`` as well."""
        try:
            return cls._calibrate(runner, context, repeats, sizes, extra_inputs, rows, explore_every)
        finally:
            runner.release()  # its buffers were sized for this throwaway run

    @classmethod
    def _calibrate(cls, runner, context, repeats, sizes, extra_inputs, rows, explore_every) -> "StepCost":
        import time

        import torch

        from specdec.tree import DraftTree

        vocab = runner.model.get_output_embeddings().weight.shape[0]
        g = torch.Generator().manual_seed(0)
        context = max(1, min(context, runner.max_positions - max(sizes)))  # a model with fewer positions (a draft)
        if rows > 1 and extra_inputs is not None:
            raise ValueError("extra_inputs are calibrated at one row")
        ids = torch.randint(0, vocab, (1, context + max(sizes)), generator=g).to(runner.device).expand(rows, -1)
        runner.reset(rows, ids.shape[1] + 1)
        extra = extra_inputs or (lambda t: None)
        if extra_inputs is None:
            runner.prefill(ids[:, :context], torch.full((rows,), context, device=runner.device))
        else:
            runner.forward_tree(DraftTree.chain(ids[:, 0], ids[:, 1:context]), extra_inputs=extra(context))
            runner.commit(torch.arange(context, device=runner.device)[None], torch.tensor([context], device=runner.device),
                          True, [context])
        trees = {t: DraftTree.chain(ids[:, context], ids[:, context + 1: context + t]) for t in sizes}
        for t, tree in trees.items():
            runner.forward_tree(tree, extra_inputs=extra(t))  # warm-up for each shape
        table = {t: float("inf") for t in sizes}
        for _ in range(repeats):  # rounds over all sizes: a busy moment skews every size alike, not the last few
            for t, tree in trees.items():
                t0 = time.perf_counter()
                runner.forward_tree(tree, extra_inputs=extra(t))
                table[t] = min(table[t], time.perf_counter() - t0)
        return cls(table, explore_every)
