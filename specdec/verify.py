"""Acceptance of draft trees: greedy and lossless sampling, over the target's processed logits.

Every method inherits its losslessness from here: greedy output equals the target's argmax
chain; sampled output follows the target's distribution after temperature, top-k and top-p,
processed exactly as transformers' ``generate`` does (temperature, then top-k, then top-p).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec import kernels
from specdec.tree import DraftTree


@dataclass(frozen=True)
class SamplingConfig:
    """temperature 0 means greedy; top_k 0/None and top_p 1.0/None disable those filters."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    def __post_init__(self):
        if self.temperature < 0 or self.temperature != self.temperature:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def processed_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """The sampling distribution ``[..., V] fp32`` of ``logits [..., V]`` under ``cfg`` (not greedy)."""
    x = logits.float() / cfg.temperature
    v = x.shape[-1]
    if cfg.top_k:
        k = min(cfg.top_k, v)
        kth = x.topk(k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if cfg.top_p is not None and cfg.top_p < 1.0:
        # As transformers' TopPLogitsWarper: drop the low tail whose mass is <= 1 - top_p, keep >= 1 token.
        sorted_x, order = x.sort(dim=-1)
        cum = sorted_x.softmax(-1).cumsum(-1)
        drop_sorted = cum <= 1 - cfg.top_p
        drop_sorted[..., -1] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x.softmax(-1)


def check_logits(logits: torch.Tensor) -> None:
    """Raise on NaN logits: a broken model or dtype overflow must not turn into a wrong answer.

    The maximum carries any NaN (max reductions propagate NaN), so one reduction pass answers;
    ``isnan(logits).any()`` would also write a mask as large as the logits (4-7x slower on a CPU at
    SmolLM2's 49k vocabulary), and in bf16 the full ``max()`` is about 3x faster than ``amax(-1)``."""
    if bool(torch.isnan(logits.max())):
        raise FloatingPointError("the model produced NaN logits (try --dtype fp32)")


class Verifier:
    """Greedy or sampling acceptance with its own random stream (independent of any drafter's)."""

    def __init__(self, cfg: SamplingConfig, device: torch.device):
        self.cfg = cfg
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(cfg.seed if cfg.seed is not None else torch.seed())

    def first_token(self, logits: torch.Tensor) -> torch.Tensor:
        """Next token ``[B]`` from logits ``[B,V]`` (after prefill or a plain decode step)."""
        check_logits(logits)
        if self.cfg.greedy:
            return logits.float().argmax(-1)  # torch's half-precision argmax on a CPU is about 2x slower than widening first
        probs = processed_probs(logits, self.cfg)
        u = torch.rand(probs.shape[0], generator=self.generator, device=probs.device)
        return kernels.sample_from_probs(probs, u)

    def verify(self, tree: DraftTree, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Accept a path of ``tree`` given target logits ``[B,T,V]``: (path ``[B,T]``, length ``[B]``, next ``[B]``)."""
        check_logits(logits)
        if self.cfg.greedy:
            return kernels.tree_verify_greedy(tree.tokens, tree.parents, logits, tree.valid)
        probs = processed_probs(logits, self.cfg)
        b, t = tree.tokens.shape
        u = torch.rand(b, t + 1, generator=self.generator, device=logits.device)
        return kernels.tree_verify_sampling(tree.tokens, tree.parents, probs, tree.draft_probs, u, tree.valid)
