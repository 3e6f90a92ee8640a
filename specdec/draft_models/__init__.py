"""The draft model classes specdec ships and loads: runtime code, below the API and the trainer.

:mod:`~specdec.draft_models.reduced`: a small Llama over a reduced draft vocabulary;
:mod:`~specdec.draft_models.eagle`: the feature-conditioned (EAGLE-style) draft. ``specdec distill``
trains both; loading one by folder needs :func:`register_draft_models` first (``specdec.hub`` calls it).
"""
from __future__ import annotations

from specdec.draft_models.eagle import SpecdecEagleConfig, SpecdecEagleForCausalLM, is_feature_draft, warm_up_inputs
from specdec.draft_models.reduced import SpecdecDraftConfig, SpecdecDraftForCausalLM, register


def register_draft_models() -> None:
    """Make transformers' ``AutoConfig``/``AutoModelForCausalLM`` know both draft classes (idempotent)."""
    register(SpecdecDraftConfig, SpecdecDraftForCausalLM)
    register(SpecdecEagleConfig, SpecdecEagleForCausalLM)


__all__ = ["SpecdecDraftConfig", "SpecdecDraftForCausalLM", "SpecdecEagleConfig", "SpecdecEagleForCausalLM",
           "is_feature_draft", "register_draft_models", "warm_up_inputs"]
