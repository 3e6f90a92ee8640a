"""Drafters: each turns the decode state into a draft tree for one verification pass.

The names below load on first access, so importing one drafter module (``specdec.drafters.ngrammys``,
say, from an engine integration) does not pull in the model-based drafters and transformers.
"""
from __future__ import annotations

import importlib

_LAZY = {
    "DecodeState": "specdec.drafters.base",
    "Drafter": "specdec.drafters.base",
    "NullDrafter": "specdec.drafters.base",
    "PromptLookupDrafter": "specdec.drafters.prompt_lookup",
    "DraftModelDrafter": "specdec.drafters.draft_model",
    "NGrammysDrafter": "specdec.drafters.ngrammys",
}
__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'specdec.drafters' has no attribute {name!r}")
