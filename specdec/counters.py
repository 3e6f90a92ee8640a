"""Counters of several generations added up (the decode loops' stats and the bench's summaries both do)."""
from __future__ import annotations


def add_counters(a, b):
    """Nested dicts of numbers added key by key (drafter summaries of several generations)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return {k: add_counters(a[k], b[k]) if k in a and k in b else a.get(k, b.get(k)) for k in {**a, **b}}
    return a + b
