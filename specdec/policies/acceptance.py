"""Acceptance estimates the planners score drafts by, learned from verification outcomes."""
from __future__ import annotations

import torch

from specdec.contracts import SUPPORT_LEVELS, num_cells, num_sources


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

    def observe(self, signal: int, drafted: int, accepted: int) -> None:
        """A step that verified ``drafted`` draft tokens under ``signal`` and accepted ``accepted`` of them."""
        if drafted <= 0:
            return
        s = self._get(signal)
        s[1] += 1
        if accepted >= 1:
            s[0] += 1
            s[2] += accepted - 1
            s[3] += accepted - 1 + (1 if accepted < drafted else 0)

    def estimate(self, signal: int, k: int) -> float:
        """Expected accepted tokens of a ``k``-token draft under ``signal``."""
        beta, gamma = self.params(signal)
        return beta * (1 - gamma**k) / (1 - gamma)


class NodeAcceptance:
    """How often a draft node was accepted, per cell (source, rank, depth, support), with a Beta prior.

    Sources: 0 bigram rows, 1 matches of the last ``q`` tokens, ``2 + j`` longest-suffix matches of
    ``q + 1 + j`` tokens (``j < n_max - q``), and with ``corpus`` then one per corpus match length
    ``1 .. n_max``, with ``store`` one per stored-output match length and with ``recycle`` one for recycled
    successors (``hybrid``). Support: :func:`specdec.drafters.ngrammys.support_level` (how many drafts share the node). The prior expects
    longer matches to be accepted more often than short ones and those more than bigram rows, deeper or
    lower-ranked nodes less often, and shared nodes more often; measured counts take over after a few steps.
    A cell is ``((source * k + rank) * w + depth) * SUPPORT + support``.
    """

    SUPPORT_PRIOR = (1.0, 1.6, 2.2)  # the prior's factor per support level: one draft, two, three or more
    SUPPORT = SUPPORT_LEVELS
    sources = staticmethod(num_sources)
    cells = staticmethod(num_cells)

    def __init__(self, k: int, w: int, q: int = 1, n_max: int = 4, *, corpus: bool = False, store: bool = False,
                 recycle: bool = False, prior_weight: float = 2.0):
        rank = torch.arange(k, dtype=torch.float64)[:, None]
        depth = torch.arange(w, dtype=torch.float64)[None, :]
        ctx = 0.5 * 0.8**depth / (1 + rank)
        big = 0.25 * 0.6**depth / (1 + rank)
        longs = [min(0.9, 0.55 + 0.05 * j) * 0.85**depth / (1 + rank) for j in range(self.sources(q, n_max) - 2)]
        # corpus matches of 1 .. n_max tokens: a 1-token match is about a bigram row's worth
        cors = [min(0.6, 0.15 * (1 + j)) * 0.8**depth / (1 + rank) for j in range(n_max if corpus else 0)]
        # hybrid's past outputs (as the corpus, a little likelier: the same workload) and recycled successors
        stored = [min(0.7, 0.2 * (1 + j)) * 0.8**depth / (1 + rank) for j in range(n_max if store else 0)]
        recycled = [0.3 * 0.65**depth / (1 + rank)] if recycle else []
        base = torch.stack([big, ctx, *longs, *cors, *stored, *recycled])  # [sources, k, w]
        boost = torch.tensor(self.SUPPORT_PRIOR, dtype=torch.float64)
        prior = (base[..., None] * boost).clamp(max=0.95).reshape(-1)
        self.accepted = prior * prior_weight
        self.proposed = torch.full_like(prior, prior_weight)
        self._rates: torch.Tensor | None = None

    def estimate(self, device) -> torch.Tensor:
        """``[sources*k*w*SUPPORT] float`` acceptance estimate of each cell."""
        if self._rates is None or self._rates.device != torch.device(device):
            self._rates = (self.accepted / self.proposed).float().to(device)
        return self._rates

    def observe(self, cells: torch.Tensor, accepted: torch.Tensor) -> None:
        """cells: ``[N]`` cell of each verified node; accepted: ``[N] bool``."""
        cells = cells.cpu()
        self.proposed.index_add_(0, cells, torch.ones(cells.shape[0], dtype=torch.float64))
        self.accepted.index_add_(0, cells, accepted.cpu().double())
        self._rates = None


class ProbabilityCalibration:
    """How often a draft model's candidate is the target's token, per bin of the draft's own probability.

    Distilled drafts are over-confident, and how much depends on the draft and the workload, so the
    probability a drafter reads off its softmax is mapped to the rate measured for that bin (each bin's
    prior is its centre, worth ``prior_weight`` observations). ``estimate(probs)`` maps host floats;
    ``observe(probs, hits)`` counts candidates whose parent the target reached, and whether each one was
    the target's token there.
    """

    def __init__(self, bins: int = 20, prior_weight: float = 4.0):
        if bins < 1:
            raise ValueError(f"bins must be >= 1, got {bins}")
        self.bins = bins
        centre = [(i + 0.5) / bins for i in range(bins)]
        self.hits = [c * prior_weight for c in centre]
        self.seen = [prior_weight] * bins
        self.observed = 0

    def _bin(self, p: float) -> int:
        return min(self.bins - 1, max(0, int(p * self.bins)))

    def estimate(self, probs: list[float]) -> list[float]:
        return [self.hits[i] / self.seen[i] for i in map(self._bin, probs)]

    def observe(self, probs: list[float], hits: list[bool]) -> None:
        for p, h in zip(probs, hits):
            i = self._bin(p)
            self.seen[i] += 1.0
            self.hits[i] += float(h)
        self.observed += len(probs)
