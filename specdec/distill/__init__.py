"""``specdec distill``: train a small same-tokenizer draft model from the target's own behaviour.

Modules: :mod:`~specdec.distill.model` (the reduced-vocabulary draft class, registered with
transformers' Auto classes on import), :mod:`~specdec.distill.vocab` (draft vocabulary),
:mod:`~specdec.distill.data` (the target's batched generations and top-k log-probs),
:mod:`~specdec.distill.train` (KL distillation loop, checkpoints, the command's driver),
:mod:`~specdec.distill.eagle` (the feature-conditioned draft class, ``--arch eagle``) and
:mod:`~specdec.distill.eagle_train` (its data: the target's hidden states; its loss and evaluation).
"""
from specdec.distill.model import SpecdecDraftConfig, SpecdecDraftForCausalLM, draft_from_target

__all__ = ["SpecdecDraftConfig", "SpecdecDraftForCausalLM", "draft_from_target"]
