"""Prompt files: JSON lines with ``id``, ``category``, ``chat`` and ``prompt`` (bench, corpus, distill)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Prompt:
    id: str
    category: str
    ids: list[int]


def read_prompts(path: str | Path, decoder, limit: int | None = None,
                 per_category: int | None = None) -> list[Prompt]:
    """Prompts from JSON lines with ``id``, ``category``, ``chat`` and ``prompt``.

    ``decoder``: anything with ``encode(prompt, chat) -> list[int]`` (a :class:`~specdec.api.SpecDecoder`).
    ``per_category`` keeps the first K prompts of each category, taken round-robin across
    categories so that ``limit`` then cuts a balanced set.
    """
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if per_category:
        by_cat: dict[str, list[dict]] = {}
        for row in rows:
            by_cat.setdefault(row.get("category", "none"), []).append(row)
        rows = [cat[i] for i in range(per_category) for cat in by_cat.values() if i < len(cat)]
    rows = rows[:limit] if limit else rows
    if not rows:
        raise ValueError(f"no prompts in {path}")
    return [Prompt(str(row.get("id", i)), row.get("category", "none"), decoder.encode(row["prompt"], bool(row.get("chat", True))))
            for i, row in enumerate(rows)]
