"""``specdec corpus`` and ``specdec distill``: a corpus of the target's own text, and small drafts trained on it.

The draft classes it trains live in :mod:`specdec.draft_models` (runtime code). Modules:
:mod:`~specdec.distill.corpus` (uint16 token shards with a manifest),
:mod:`~specdec.distill.magpie` (user turns the target writes itself, filtered),
:mod:`~specdec.distill.data` (the target's replies, shard by shard),
:mod:`~specdec.distill.corpus_command` (the ``specdec corpus`` driver),
:mod:`~specdec.distill.vocab` (draft vocabulary),
:mod:`~specdec.distill.teacher` (examples, the frozen target as online teacher, its feature cache, chain agreement),
:mod:`~specdec.distill.losses` (the two draft kinds' losses),
:mod:`~specdec.distill.train` (the training loop with early stopping, and the ``specdec distill`` driver),
:mod:`~specdec.distill.agreement` (agreement of drafts on the target's greedy replies, per category) and
:mod:`~specdec.distill.evaluate` (step-cost ratio and ``sd`` acceptance).
"""
from specdec.draft_models.reduced import SpecdecDraftConfig, SpecdecDraftForCausalLM, draft_from_target

__all__ = ["SpecdecDraftConfig", "SpecdecDraftForCausalLM", "draft_from_target"]
