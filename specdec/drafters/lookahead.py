"""The Jacobi window of lookahead decoding (Fu et al.), laid out as a tree over a model's pending region.

A window of width ``W`` and level ``N`` holds ``N - 1`` levels of guesses: level 0 has ``W - 1`` tokens,
levels ``1 .. N-2`` have ``W`` tokens each. Level-0 column ``j`` sits at depth ``j + 1`` after the root;
level-``l`` column ``j`` (``l >= 1``) at depth ``j + l``. A token sees the root, the level-0 tokens of
earlier columns and the tokens of its own column on levels ``1 .. l``: that is a tree, so the window runs
through the ordinary tree attention (level-0 column ``j``'s parent is level-0 column ``j - 1``, level-1
column ``j``'s is level-0 column ``j - 1``, level-``l`` column ``j``'s is level-``l-1`` column ``j``; the
root parents column 0).

After a forward, the model's prediction at each last-level node gives ``new [W]``: column ``j`` then
spells the ``N``-gram (level-0 column ``j - 1``, or the root for ``j = 0``; levels ``1 .. N-2`` of column
``j``; ``new[j]``), whose first token keys the rest in the phrase pool. The levels then shift up (level 0
takes level 1 without its first column, level ``l`` takes level ``l + 1``, the last level takes ``new``).
The window's contents are guesses only: they never decide an emitted token.
"""
from __future__ import annotations

import numpy as np


class JacobiWindow:
    """One row's window. width: ``W >= 2``; level: ``N >= 3``; seed: tokens to draw the first guesses from
    (the prompt); rng: a numpy ``Generator``."""

    def __init__(self, width: int, level: int, seed: list[int], rng: np.random.Generator):
        check_window(width, level)
        if not seed:
            raise ValueError("the window needs at least one token to draw its first guesses from")
        self.width, self.level = width, level
        draw = rng.choice(np.asarray(seed, dtype=np.int64), size=(level - 1) * width)
        self.levels = [draw[:width - 1].tolist()] + [draw[width * lv: width * (lv + 1)].tolist()
                                                      for lv in range(1, level - 1)]

    @property
    def size(self) -> int:
        """Nodes the window adds to a tree: ``(W - 1) + (N - 2) W``."""
        return window_size(self.width, self.level)

    def layout(self, offset: int, root: int = 0) -> tuple[list[int], list[int]]:
        """The window's tokens and parents, for nodes numbered from ``offset`` on, hanging off node ``root``.
        The last level's ``W`` nodes come last."""
        w = self.width
        tokens: list[int] = []
        parents: list[int] = []
        for j, tok in enumerate(self.levels[0]):  # level 0: a chain under the root
            tokens.append(tok)
            parents.append(root if j == 0 else offset + j - 1)
        base = offset + (w - 1)
        for lv in range(1, self.level - 1):
            for j, tok in enumerate(self.levels[lv]):
                tokens.append(tok)
                if lv == 1:
                    parents.append(root if j == 0 else offset + j - 1)
                else:
                    parents.append(base + (lv - 2) * w + j)
        return tokens, parents

    def update(self, root: int, new: list[int]) -> list[tuple[int, list[int]]]:
        """Take the model's predictions ``new [W]`` at the last level; return the ``W`` n-grams as
        ``(key, phrase)`` and shift the levels."""
        grams = []
        for j in range(self.width):
            key = root if j == 0 else self.levels[0][j - 1]
            grams.append((key, [self.levels[lv][j] for lv in range(1, self.level - 1)] + [new[j]]))
        self.levels = [self.levels[1][1:]] + self.levels[2:] + [list(new)]
        return grams


def window_size(width: int, level: int) -> int:
    """Nodes of a ``W x N`` window: ``(W - 1) + (N - 2) W``."""
    return (width - 1) + (level - 2) * width


def check_window(width: int, level: int) -> None:
    """Raise ``ValueError`` unless ``W >= 2`` and ``N >= 3`` (smaller windows spell no n-gram)."""
    if width < 2:
        raise ValueError(f"the lookahead window needs W >= 2 columns, got {width}")
    if level < 3:
        raise ValueError(f"the lookahead window needs N >= 3 (a key, one guess level and the prediction), got {level}")
