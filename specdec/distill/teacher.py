"""What a draft learns from and is measured against: the corpus as training examples, the frozen
target as an online teacher, and chain agreement on the target's greedy replies.

The corpus stores token ids only. The frozen target (``Teacher``) runs over the ids: its last hidden
states are the inputs of a feature-conditioned draft, and its output layer over them, restricted to the
draft's vocabulary, gives the soft labels. The hidden states are computed at every step, or once per
corpus into a memory-mapped cache outside the repository (:meth:`Teacher.cache_features`).
"""
from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from specdec.distill.corpus import Record


@dataclass
class Example:
    ids: torch.Tensor   # [L] target ids: the prompt's last tokens, then the reply
    first: int          # the position whose prediction is the reply's first token
    id: str             # the prompt's id (held-out splits are by prompt)
    category: str
    greedy: bool        # a greedy reply: its next tokens are the target's argmax
    offset: int = -1    # its first row in a feature cache (-1: none, the teacher runs)
    store: int = 0      # which of the teacher's caches holds it


def make_examples(records: list[Record], max_context: int, greedy: bool) -> list[Example]:
    """One example per record with a reply; the prompt is cut to its last ``max_context`` tokens."""
    out = []
    for r in records:
        p = r.prompt_len
        if len(r.ids) <= p or p < 1:
            continue
        start = max(0, p - max_context)
        out.append(Example(torch.as_tensor(r.ids[start:], dtype=torch.int64), p - 1 - start, r.id, r.category, greedy))
    return out


def make_batches(examples: list[Example], max_tokens: int, seed: int) -> list[list[Example]]:
    """Length-bucketed batches of at most ``max_tokens`` padded tokens, in a seeded random order."""
    order = sorted(range(len(examples)), key=lambda i: len(examples[i].ids))
    batches, cur, width = [], [], 0
    for i in order:
        w = max(width, len(examples[i].ids))
        if cur and w * (len(cur) + 1) > max_tokens:
            batches.append(cur)
            cur, w = [], len(examples[i].ids)
        cur.append(examples[i])
        width = w
    if cur:
        batches.append(cur)
    random.Random(seed).shuffle(batches)
    return batches


def collate(batch: list[Example], device) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids [B,T]`` (right padding: causal attention never sees it) and ``mask [B,T]`` (the positions
    that predict a reply token: ``first`` onward, before the last)."""
    width = max(len(e.ids) for e in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.int64)
    mask = torch.zeros(len(batch), width, dtype=torch.bool)
    for r, e in enumerate(batch):
        n = len(e.ids)
        ids[r, :n] = e.ids
        mask[r, e.first: n - 1] = True
    return ids.to(device), mask.to(device)


def parse_labels(spec: str) -> int | None:
    """``full`` -> None (the whole distribution), ``hard`` -> 1, ``topk:K`` -> K."""
    if spec == "full":
        return None
    if spec == "hard":
        return 1
    if spec.startswith("topk:") and spec[5:].isdigit() and int(spec[5:]) >= 1:
        return int(spec[5:])
    raise ValueError(f"labels must be full, hard or topk:K, got {spec!r}")


class Teacher:
    """The frozen target: ``feats(ids, batch) -> [B,T,H]`` last hidden states and ``labels(feat, vocab)
    -> [N,Vd]`` its next-token distribution over the draft vocabulary (renormalised; ``top_k`` keeps
    only its K most likely entries, ``top_k=1`` is the hard label).

    ``body`` may be a bf16 copy of the target's body (the features are then bf16-rounded, as when the
    target serves in bf16); ``head`` stays fp32. With a feature cache (:meth:`cache_features`), the
    examples that have rows in it are read instead of recomputed."""

    def __init__(self, target, top_k: int | None = None, body=None):
        self.body = body if body is not None else target.model
        self.head = target.get_output_embeddings().weight.detach()
        self.top_k = top_k
        self.caches: list[np.ndarray] = []

    @torch.no_grad()
    def feats(self, ids: torch.Tensor, batch: list[Example] | None = None) -> torch.Tensor:
        if self.caches and batch and all(e.offset >= 0 for e in batch):
            out = torch.zeros(*ids.shape, self.caches[0].shape[1])
            for r, e in enumerate(batch):
                out[r, : len(e.ids)] = torch.from_numpy(np.array(self.caches[e.store][e.offset: e.offset + len(e.ids)]))
            return out.to(ids.device)
        return self.body(input_ids=ids, use_cache=False).last_hidden_state.float()

    @torch.no_grad()
    def labels(self, feat: torch.Tensor, vocab: torch.Tensor) -> torch.Tensor:
        logits = feat @ self.head[vocab].float().T
        if self.top_k is not None and self.top_k < logits.shape[-1]:
            kth = logits.topk(self.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        return logits.softmax(-1)

    @torch.no_grad()
    def cache_features(self, examples: list[Example], folder: str | Path, max_tokens: int,
                       progress: bool = True) -> None:
        """One prefill pass over ``examples``: their hidden states (fp16, ``[sum L, H]``) in a memory-mapped
        file under ``folder``, reused by every later epoch and by a later run over the same examples
        (the file is keyed by their ids). Resumable: finished batches are recorded as it goes. Several
        folders (training and held-out examples) can be cached side by side."""
        from tqdm import tqdm

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        h = self.head.shape[1]
        digest = hashlib.blake2b(digest_size=16)
        for e in examples:
            digest.update(e.ids.numpy().astype(np.int32).tobytes() + b"|")
        # the examples, how they are batched (``done`` lists batch indices), and which target in which dtype
        digest.update(self.head[:8].float().cpu().numpy().tobytes())
        key = f"{digest.hexdigest()}-{h}-{max_tokens}-{next(self.body.parameters()).dtype}"
        offsets = np.cumsum([0] + [len(e.ids) for e in examples])
        meta_path, data_path = folder / "features.json", folder / "features.f16"
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        if meta.get("key") != key:
            meta = {"key": key, "rows": int(offsets[-1]), "hidden": h, "done": []}
            np.lib.format.open_memmap(data_path, "w+", np.float16, (max(int(offsets[-1]), 1), h)).flush()
            meta_path.write_text(json.dumps(meta))
        store = np.load(data_path, mmap_mode="r+")
        order = sorted(range(len(examples)), key=lambda i: len(examples[i].ids))
        groups, cur = [], []
        for i in order:
            if cur and len(examples[i].ids) * (len(cur) + 1) > max_tokens:
                groups.append(cur)
                cur = []
            cur.append(i)
        if cur:
            groups.append(cur)
        done = set(meta["done"])
        dev = self.head.device
        for g, idx in enumerate(tqdm(groups, desc="features", unit="batch", disable=not progress)):
            if g in done:
                continue
            batch = [examples[i] for i in idx]
            ids, _ = collate(batch, dev)
            f = self.body(input_ids=ids, use_cache=False).last_hidden_state.half().cpu().numpy()
            for r, i in enumerate(idx):
                store[offsets[i]: offsets[i + 1]] = f[r, : len(examples[i].ids)]
            done.add(g)
            if len(done) % 50 == 0 or len(done) == len(groups):
                store.flush()
                meta["done"] = sorted(done)
                meta_path.write_text(json.dumps(meta))
        store.flush()
        for e, o in zip(examples, offsets[:-1]):
            e.offset, e.store = int(o), len(self.caches)
        self.caches.append(np.load(data_path, mmap_mode="r"))


def soft_ce(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``logits [N,V]`` against the distributions ``p [N,V]``."""
    return -(p * logits.float().log_softmax(-1)).sum(-1).mean()


@torch.no_grad()
def agreement(draft, teacher: Teacher | None, examples: list[Example], max_tokens: int = 8192) -> dict:
    """Chain agreement with the target on its own greedy replies (``examples`` should be greedy):

    - ``depth1``: the draft's top-1 equals the next reply token (the first token of a draft chain);
    - ``depth2``: the second chain token is right given the first was: for a token-only draft that is
      ``depth1`` at the next position; a feature-conditioned draft reads its own predicted state there
      (in that pass every earlier position's state is predicted too, an approximation).

    Returns overall and per-category ``{depth1, depth2, positions}``."""
    from specdec.draft_models.eagle import is_feature_draft

    was = draft.training
    draft.eval()
    dev = draft.draft_vocab.device
    feature = is_feature_draft(draft)
    cats: dict[str, list[int]] = {}
    for batch in make_batches(examples, max_tokens, 0):
        ids, mask = collate(batch, dev)
        nxt = F.pad(ids[:, 1:], (0, 1), value=-1)
        if feature:
            feat = teacher.feats(ids, batch)
            prev = F.pad(feat[:, :-1], (0, 0, 1, 0))
            hidden = draft.model(inputs_embeds=draft.fuse(ids, prev), use_cache=False).last_hidden_state
            h1 = draft.draft_vocab[draft.lm_head(hidden)[..., : draft.draft_vocab_size].argmax(-1)] == nxt
            own = draft.model(inputs_embeds=draft.fuse(ids, F.pad(hidden[:, :-1], (0, 0, 1, 0))),
                              use_cache=False).last_hidden_state
            h2 = draft.draft_vocab[draft.lm_head(own)[..., : draft.draft_vocab_size].argmax(-1)] == nxt
        else:
            hidden = draft.model(input_ids=draft.target_to_draft[ids], use_cache=False).last_hidden_state
            h1 = draft.draft_vocab[draft.lm_head(hidden)[..., : draft.draft_vocab_size].argmax(-1)] == nxt
            h2 = h1
        h1 = h1 & mask
        pair = F.pad(mask[:, 1:], (0, 1), value=False)   # the next position is a reply position too
        first_ok = h1 & pair
        second_ok = first_ok & F.pad(h2[:, 1:], (0, 1), value=False)
        for r, e in enumerate(batch):
            c = cats.setdefault(e.category, [0, 0, 0, 0])
            c[0] += int(h1[r].sum())
            c[1] += int(mask[r].sum())
            c[2] += int(second_ok[r].sum())
            c[3] += int(first_ok[r].sum())
    draft.train(was)

    def row(c):
        return {"depth1": c[0] / max(c[1], 1), "depth2": c[2] / max(c[3], 1), "positions": c[1]}

    total = [sum(c[i] for c in cats.values()) for i in range(4)]
    return {**row(total), "per_category": {k: row(c) for k, c in sorted(cats.items())}}
