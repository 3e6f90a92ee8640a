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
