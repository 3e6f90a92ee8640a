"""``specdec distill``: train a small same-tokenizer draft model from the target's own behaviour.

The draft classes it trains live in :mod:`specdec.draft_models` (runtime code). Modules:
:mod:`~specdec.distill.vocab` (draft vocabulary),
:mod:`~specdec.distill.data` (the target's batched generations and top-k log-probs),
:mod:`~specdec.distill.train` (KL distillation loop, checkpoints, the command's driver) and
:mod:`~specdec.distill.eagle_train` (its data: the target's hidden states; its loss and evaluation).
"""
from specdec.draft_models.reduced import SpecdecDraftConfig, SpecdecDraftForCausalLM, draft_from_target

__all__ = ["SpecdecDraftConfig", "SpecdecDraftForCausalLM", "draft_from_target"]
