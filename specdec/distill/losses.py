"""Training losses of the two draft kinds, against the online :class:`~specdec.distill.teacher.Teacher`.

Both return ``(loss, top-1 agreement)`` for a batch of examples; the loss is the cross-entropy of the
draft's distribution over its vocabulary against the target's (KL up to a constant) at every
position that predicts a reply token.

The feature-conditioned (EAGLE) draft at position ``t`` reads ``x_t`` and the target's ``f_{t-1}`` and
returns ``f̂_t``; a smooth-L1 regression of ``f̂_t`` onto ``f_t`` keeps its states usable as inputs
for the next drafted token. With ``unroll=2`` a second pass reads the draft's own ``f̂_{t-1}`` in place
of ``f_{t-1}``, as chain drafting does from its second token on (in that pass the earlier positions'
keys also come from predicted states).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec.distill.teacher import Example, Teacher, collate, soft_ce


def layers_loss(draft, batch: list[Example], teacher: Teacher, autocast: bool = False):
    """A token-only draft (:class:`~specdec.draft_models.reduced.SpecdecDraftForCausalLM`)."""
    dev = draft.draft_vocab.device
    ids, mask = collate(batch, dev)
    p = teacher.labels(teacher.feats(ids, batch)[mask], draft.draft_vocab)
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
        hidden = draft.model(input_ids=draft.target_to_draft[ids], use_cache=False).last_hidden_state
        logits = draft.lm_head(hidden[mask])[:, : draft.draft_vocab_size]
    agree = (logits.argmax(-1) == p.argmax(-1)).float().mean().item()
    return soft_ce(logits, p), agree


def eagle_loss(draft, batch: list[Example], teacher: Teacher, autocast: bool = False, unroll: int = 1,
               reg_weight: float = 1.0):
    """A feature-conditioned draft (:class:`~specdec.draft_models.eagle.SpecdecEagleForCausalLM`);
    the loss is summed over the ``unroll`` passes, the agreement is the first pass's."""
    if unroll < 1:
        raise ValueError(f"unroll must be >= 1, got {unroll}")
    dev = draft.draft_vocab.device
    ids, mask = collate(batch, dev)
    feat = teacher.feats(ids, batch)
    p = teacher.labels(feat[mask], draft.draft_vocab)
    prev = F.pad(feat[:, :-1], (0, 0, 1, 0))
    total, agree = 0.0, 0.0
    for k in range(unroll):
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
            hidden = draft.model(inputs_embeds=draft.fuse(ids, prev), use_cache=False).last_hidden_state
            logits = draft.lm_head(hidden[mask])[:, : draft.draft_vocab_size]
        total = total + soft_ce(logits, p) + reg_weight * F.smooth_l1_loss(hidden.float()[mask], feat[mask])
        if k == 0:
            agree = (logits.argmax(-1) == p.argmax(-1)).float().mean().item()
        prev = F.pad(hidden[:, :-1], (0, 0, 1, 0))
    return total, agree
