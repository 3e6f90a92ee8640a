"""Draft-length policies: how many tokens to draft next step."""
from __future__ import annotations


class StaticLength:
    """Always ``k`` tokens."""

    def __init__(self, k: int):
        if k < 1:
            raise ValueError(f"draft length must be >= 1, got {k}")
        self.k = k

    def length(self) -> int:
        return self.k

    def update(self, drafted: int, accepted: int) -> None:
        pass


class HeuristicLength(StaticLength):
    """transformers' ``"heuristic"`` schedule: +2 after a fully accepted draft, else -1 (floor 1)."""

    def __init__(self, k: int = 5, max_k: int = 64):
        super().__init__(k)
        self.max_k = max_k

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        self.k = min(self.max_k, self.k + 2) if accepted == drafted else max(1, self.k - 1)


class StepCost:
    """Measured seconds of one target forward over ``T`` tree tokens, interpolated between samples.

    ``calibrate`` times the runner on a throwaway context once (a few dozen forwards): the shape
    of c(T) is a property of the model, dtype and machine (on one CPU a 4-token step costs 1.5x
    a 1-token step in fp32 and the same in bf16), so it is measured, never assumed. ``observe``
    folds in every timed step; :meth:`explore` makes planners time sizes they avoid now and then.
    """

    SIZES = (1, 2, 3, 4, 5, 6, 8, 11, 16)

    def __init__(self, table: dict[int, float], explore_every: int = 16):
        if not table or 1 not in table:
            raise ValueError("a step-cost table needs at least T = 1")
        self.sizes = sorted(table)
        self.table = dict(table)
        self.explore_every = explore_every
        self._plans = 0

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

    @classmethod
    def calibrate(cls, runner, context: int = 128, repeats: int = 3, sizes=SIZES) -> "StepCost":
        import time

        import torch

        from specdec.tree import DraftTree

        vocab = runner.model.get_output_embeddings().weight.shape[0]
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (1, context + max(sizes)), generator=g).to(runner.device)
        runner.reset(1, ids.shape[1] + 1)
        runner.prefill(ids[:, :context], torch.tensor([context], device=runner.device))
        trees = {t: DraftTree.chain(ids[:, context], ids[:, context + 1: context + t]) for t in sizes}
        for tree in trees.values():
            runner.forward_tree(tree)  # warm-up for each shape
        table = {t: float("inf") for t in sizes}
        for _ in range(repeats):  # rounds over all sizes: a busy moment skews every size alike, not the last few
            for t, tree in trees.items():
                t0 = time.perf_counter()
                runner.forward_tree(tree)
                table[t] = min(table[t], time.perf_counter() - t0)
        return cls(table)


class AcceptanceModel:
    """Per-signal acceptance of deterministic drafts: P(accept >= i) = beta * gamma**(i-1).

    beta is the chance the first draft token is accepted; gamma the chance each further token is,
    given the previous one was. Counts are censored correctly: a draft accepted in full tells
    that the run went on at least that far, not where it would have stopped.
    """

    def __init__(self, prior_beta: float = 0.3, prior_gamma: float = 0.7, prior_weight: float = 4.0):
        self.prior = (prior_beta, prior_gamma, prior_weight)
        self.stats: dict[int, list[float]] = {}

    def _get(self, signal: int) -> list[float]:
        if signal not in self.stats:
            b, g, w = self.prior
            self.stats[signal] = [b * w, w, g * w, w]  # first: successes, trials; continuation: successes, trials
        return self.stats[signal]

    def params(self, signal: int) -> tuple[float, float]:
        s = self._get(signal)
        return s[0] / s[1], min(s[2] / s[3], 0.98)

    def update(self, signal: int, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        s = self._get(signal)
        s[1] += 1
        if accepted >= 1:
            s[0] += 1
            s[2] += accepted - 1
            s[3] += accepted - 1 + (1 if accepted < drafted else 0)

    def expected_accepted(self, signal: int, k: int) -> float:
        beta, gamma = self.params(signal)
        return beta * (1 - gamma**k) / (1 - gamma)


def best_length(acceptance: AcceptanceModel, cost: StepCost, signal: int, max_k: int) -> int:
    """The draft length in ``[0, max_k]`` with the most expected tokens per second of target time."""
    costs = cost.costs(max_k + 1)
    best_k, best_rate = 0, 1.0 / costs[0]
    for k in range(1, max_k + 1):
        rate = (1.0 + acceptance.expected_accepted(signal, k)) / costs[k]
        if rate > best_rate:
            best_k, best_rate = k, rate
    return best_k
