"""``specdec distill``: train a small same-tokenizer draft model from the target's own behaviour.

Modules: :mod:`~specdec.distill.model` (the reduced-vocabulary draft class, registered with
transformers' Auto classes on import), :mod:`~specdec.distill.vocab` (draft vocabulary),
:mod:`~specdec.distill.data` (the target's batched generations and top-k log-probs),
:mod:`~specdec.distill.train` (KL distillation loop, checkpoints, the command's driver).
"""
from specdec.distill.model import SpecdecDraftConfig, SpecdecDraftForCausalLM, draft_from_target

__all__ = ["SpecdecDraftConfig", "SpecdecDraftForCausalLM", "draft_from_target"]
