"""Drafters: each turns the decode state into a draft tree for one verification pass."""
from specdec.drafters.base import DecodeState, Drafter, NullDrafter
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.drafters.ngrammys import NGrammysDrafter
from specdec.drafters.prompt_lookup import PromptLookupDrafter

__all__ = ["DecodeState", "Drafter", "NullDrafter", "PromptLookupDrafter", "DraftModelDrafter", "NGrammysDrafter"]
