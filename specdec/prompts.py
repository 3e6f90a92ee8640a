"""Prompt files: JSON lines with ``id``, ``category``, ``chat`` and ``prompt`` (bench, corpus, distill)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


def encode_prompt(tokenizer, prompt: str, chat: bool = True) -> list[int]:
    """Token ids of ``prompt``, through the chat template when ``chat`` and the tokenizer has one."""
    if tokenizer is None:
        raise ValueError("text prompts need a tokenizer")
    if not prompt:
        raise ValueError("empty prompt")
    if chat and tokenizer.chat_template:
        enc = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_dict=True)
        return list(enc["input_ids"])
    return tokenizer(prompt)["input_ids"]


class TokenizerEncoder:
    """``encode(prompt, chat)`` over a bare tokenizer, for :func:`read_prompts` without a decoder."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def encode(self, prompt: str, chat: bool = True) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, chat)


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
