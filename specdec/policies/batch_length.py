"""Per-request draft lengths for an engine that verifies a whole batch of chains in one step.

An engine such as vLLM runs every request's ``1 + drafted`` tokens in one forward, so a step's cost
grows with the batch's total token count ``T``, not with any one request's length. :class:`LinearStepCost`
fits ``c(T) = a + b T`` to the engine's measured step times; :func:`plan_lengths` then keeps, across all
requests, the draft tokens most likely to be accepted, as many as raise the batch's expected tokens per
second (the planner's :func:`~specdec.policies.planner.best_size`). A chain's tokens are reached with falling
probability, so the kept set is a prefix of every chain.
"""
from __future__ import annotations

from specdec.policies.planner import best_size


class LinearStepCost:
    """``c(T) = a + b T`` seconds for a step over ``T`` tokens, fitted by exponentially weighted least squares.

    ``decay`` weights recent steps more (the engine's load changes). Until the observed step sizes carry
    ``min_info`` (their weighted sum of squared deviations from the mean, token²: 16 steps one token off the
    mean, or 4 steps two tokens off) the slope is unknown and :attr:`ready` is False. A plan that keeps every
    token (a slope fitted near 0, or none yet) would make every step the same size, and the fit could never
    see the slope again: :meth:`explore` has one step in ``explore_every`` verify half the planned tokens
    (at one request drafting 8 tokens, steps of 9 tokens and one in 16 of 5 reach ``min_info`` at the second
    exploring step, step 32: one alone never does)."""

    def __init__(self, decay: float = 0.98, min_info: float = 16.0, explore_every: int = 16):
        self.decay, self.min_info, self.explore_every = decay, min_info, explore_every
        self._s = [0.0] * 5  # weight, sum T, sum T^2, sum c, sum T c
        self._plans = 0

    def explore(self) -> bool:
        """True once every ``explore_every`` calls (the planner then keeps half its tokens)."""
        self._plans += 1
        return self.explore_every > 0 and self._plans % self.explore_every == 0

    def observe(self, tokens: int, seconds: float) -> None:
        d, s = self.decay, self._s
        for i, v in enumerate((1.0, tokens, tokens * tokens, seconds, tokens * seconds)):
            s[i] = d * s[i] + v

    @property
    def ready(self) -> bool:
        w, st, stt = self._s[:3]
        return w > 0 and stt - st * st / w >= self.min_info

    def coefficients(self) -> tuple[float, float]:
        """``(a, b)``; ``b`` is clamped at 0 (a step over more tokens never costs less) and ``a`` above 0."""
        w, st, stt, sc, stc = self._s
        if w == 0:
            return 1.0, 0.0
        mean_t, mean_c = st / w, sc / w
        var = stt / w - mean_t ** 2
        b = max(0.0, (stc / w - mean_t * mean_c) / var) if var > 1e-9 else 0.0
        a = max(mean_c - b * mean_t, 1e-6)
        return a, b


def plan_lengths(reach: list[list[float]], cost: LinearStepCost) -> list[int]:
    """How many draft tokens each request verifies this step.

    reach: per request, the probability that each of its draft tokens is accepted (non-increasing along a
    chain; an empty list for a request without a draft). Returns per request ``n`` in ``[0, len(reach[i])]``
    maximising ``(B + sum of kept reach) / c(B + sum n)``; without a fitted cost every draft token is kept.
    On an exploring step (:meth:`LinearStepCost.explore`) only the likelier half of those is kept.
    """
    explore = cost.explore()
    tokens = [(p, i) for i, row in enumerate(reach) for p in row]
    tokens.sort(key=lambda x: -x[0])  # stable: equal reach keeps chain order, so prefixes stay prefixes
    n_rows, best_k = len(reach), len(tokens)
    if cost.ready:
        a, b = cost.coefficients()
        costs = [a + b * (n_rows + k) for k in range(len(tokens) + 1)]
        best_k, _ = best_size([p for p, _ in tokens], costs, base=float(n_rows))
    if explore:
        best_k //= 2
    out = [0] * n_rows
    for _, i in tokens[:best_k]:
        out[i] += 1
    return out
