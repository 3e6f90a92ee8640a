"""Training data, loss and evaluation of the feature-conditioned (EAGLE) draft.

Data: the target's last hidden state ``f_t`` at every position of the records that
:mod:`specdec.distill.data` wrote (prompt passes and generations), from one batched teacher-forced
forward per shard, saved next to it (``feat_{shard}``) so an interrupted run resumes.

Loss at position ``t`` (the draft read ``x_t`` and ``f_{t-1}`` and returned ``f̂_t``): the
cross-entropy of the draft's logits against the target's own distribution at ``t`` (the target's
output layer over ``f_t``, renormalised over the draft vocabulary) plus a smooth-L1 regression of
``f̂_t`` onto ``f_t``, which keeps the draft's states usable as inputs for the next drafted token.
With ``unroll=2`` a second pass reads the draft's own ``f̂_{t-1}`` in place of ``f_{t-1}``, as
chain drafting does from its second token on (an approximation: in that pass the earlier positions'
keys also come from predicted states).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from specdec.draft_models.eagle import SpecdecEagleForCausalLM


@dataclass
class FeatureExample:
    ids: torch.Tensor    # [L] target ids
    feat: torch.Tensor   # [L,H] fp16 target last hidden states
    first: int           # first position whose prediction is a generated token (0 for prompt passes)
    record_id: str = ""  # the prompt's id (held-out splits are by prompt)


@torch.inference_mode()
def feature_shards(model, shards: list[Path], max_context: int, max_tokens: int, progress: bool = True) -> list[Path]:
    """For each data shard, a ``feat_{name}`` shard of ``{"ids", "feat", "first"}`` records: the prompt
    cut to its last ``max_context`` tokens, then the generation, with the target's last hidden state
    at every position. Existing feature shards made with the same ``max_context`` are kept (resume);
    the target is the one the data shards came from (the work folder belongs to one target)."""
    out = []
    for shard in tqdm(shards, desc="features", unit="shard", disable=not progress):
        path = shard.with_name(f"feat_{shard.name}")
        out.append(path)
        if path.exists() and torch.load(path, weights_only=True)[0].get("max_context") == max_context:
            continue
        recs = []
        for r in torch.load(shard, weights_only=True):
            p, g = r["prompt_len"], len(r["topk_idx"])
            start = max(0, p - max_context)
            ids = r["ids"][start: p + g].long()
            recs.append({"id": r["id"], "ids": ids, "first": p - 1 - start if g and p > 1 else 0,
                         "max_context": max_context})
        recs.sort(key=lambda r: len(r["ids"]))
        i = 0
        while i < len(recs):
            j = i + 1
            while j < len(recs) and len(recs[j]["ids"]) * (j + 1 - i) <= max_tokens:
                j += 1
            chunk = recs[i:j]
            width = len(chunk[-1]["ids"])
            x = torch.zeros(len(chunk), width, dtype=torch.int64)
            for r_i, r in enumerate(chunk):
                x[r_i, : len(r["ids"])] = r["ids"]
            hidden = model.model(input_ids=x.to(model.device), use_cache=False).last_hidden_state  # right padding: causal
            for r_i, r in enumerate(chunk):
                r["feat"] = hidden[r_i, : len(r["ids"])].half().cpu()
            i = j
        tmp = path.with_suffix(".tmp")
        torch.save(recs, tmp)
        tmp.rename(path)
    return out


def load_examples(paths: list[Path]) -> list[FeatureExample]:
    out = []
    for p in paths:
        out += [FeatureExample(r["ids"], r["feat"], r["first"], r["id"]) for r in torch.load(p, weights_only=True)]
    return out


def _collate(batch: list[FeatureExample], dev):
    width = max(len(e.ids) for e in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.int64)
    feat = torch.zeros(len(batch), width, batch[0].feat.shape[1])
    valid = torch.zeros(len(batch), width, dtype=torch.bool)
    for r, e in enumerate(batch):
        n = len(e.ids)
        ids[r, :n], feat[r, :n], valid[r, :n] = e.ids, e.feat.float(), True
    return ids.to(dev), feat.to(dev), valid.to(dev)


def _draft_pass(draft: SpecdecEagleForCausalLM, ids, prev):
    hidden = draft.model(inputs_embeds=draft.fuse(ids, prev), use_cache=False).last_hidden_state
    return hidden, draft.lm_head(hidden)[..., : draft.draft_vocab_size]


def eagle_loss(draft: SpecdecEagleForCausalLM, batch: list[FeatureExample], target_head: torch.Tensor,
               unroll: int = 1, reg_weight: float = 1.0):
    """Mean loss over every position (summed over unrolled passes) and the first pass's top-1
    agreement with the target (a float). target_head: ``[Vt,H]`` the target's output layer; its rows
    of the draft's current vocabulary (``draft.draft_vocab``) give the teacher distribution."""
    if unroll < 1:
        raise ValueError(f"unroll must be >= 1, got {unroll}")
    dev = target_head.device
    ids, feat, valid = _collate(batch, dev)
    with torch.no_grad(), torch.autocast(dev.type, enabled=False):  # the teacher stays fp32
        p = (feat @ target_head[draft.draft_vocab].float().T).softmax(-1)
    prev = F.pad(feat[:, :-1], (0, 0, 1, 0))
    total, agree = 0.0, 0.0
    for k in range(unroll):
        hidden, logits = _draft_pass(draft, ids, prev)
        ce = -(p * logits.float().log_softmax(-1)).sum(-1)[valid].mean()
        reg = F.smooth_l1_loss(hidden.float()[valid], feat[valid])
        total = total + ce + reg_weight * reg
        if k == 0:
            agree = (logits.argmax(-1) == p.argmax(-1))[valid].float().mean().item()
        prev = F.pad(hidden[:, :-1], (0, 0, 1, 0))
    return total, agree


@torch.no_grad()
def eagle_evaluate(draft: SpecdecEagleForCausalLM, examples: list[FeatureExample], max_tokens: int = 8192) -> dict:
    """Top-1 agreement with the target's greedy next token at the generated positions of ``examples``:
    ``depth1`` reads the target's true states (the first drafted token of a step), ``depth2`` the
    draft's own (later tokens; approximate, see the module docstring)."""
    was = draft.training
    draft.eval()
    dev = draft.draft_vocab.device
    hits = [0, 0]
    n = 0
    order = sorted(examples, key=lambda e: len(e.ids))
    i = 0
    while i < len(order):
        j = i + 1
        while j < len(order) and len(order[j].ids) * (j + 1 - i) <= max_tokens:
            j += 1
        batch = order[i:j]
        i = j
        ids, feat, valid = _collate(batch, dev)
        nxt = F.pad(ids[:, 1:], (0, 1), value=-1)
        mask = valid & F.pad(valid[:, 1:], (0, 1), value=False)  # a next token exists
        for r, e in enumerate(batch):
            mask[r, : e.first] = False
        prev = F.pad(feat[:, :-1], (0, 0, 1, 0))
        for k in range(2):
            hidden, logits = _draft_pass(draft, ids, prev)
            hits[k] += int(((draft.draft_vocab[logits.argmax(-1)] == nxt) & mask).sum())
            prev = F.pad(hidden[:, :-1], (0, 0, 1, 0))
        n += int(mask.sum())
    draft.train(was)
    return {"depth1_agreement": hits[0] / max(n, 1), "depth2_agreement": hits[1] / max(n, 1), "positions": n}
