"""Training data: the target's own batched generations on the training prompts, with its top-k
log-probabilities at every generated position (KL targets stored once instead of recomputed).

A first pass runs the target once over the prompts themselves (teacher forcing: no decoding,
so many positions per second). Generation is transformers' ``generate`` over left-padded batches; a logits processor placed before
any sampling warper records the top-k of the target's raw log-softmax at each step. Each batch is
written as one shard (``{pass}_{index:04d}.pt``) under the work folder, so an interrupted run
resumes where it stopped. Prompts are shuffled with the seed and then length-sorted within groups,
so every prefix of the shards covers all categories while batches stay similar in length.
"""
from __future__ import annotations

import random
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import LogitsProcessor, LogitsProcessorList


class _TopKRecorder(LogitsProcessor):
    """Records ``(log-probs [B,K] fp16, ids [B,K] int32)`` of the raw scores at each step."""

    def __init__(self, k: int):
        self.k = k
        self.steps: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, input_ids, scores):
        lp = scores.float().log_softmax(-1)
        v, i = lp.topk(self.k, dim=-1)
        self.steps.append((v.half(), i.int()))
        return scores


def batches(prompts: list, batch_size: int, seed: int, group: int = 8) -> list[list]:
    """Shuffled, then length-sorted within groups of ``group`` batches."""
    order = list(prompts)
    random.Random(seed).shuffle(order)
    out = []
    span = batch_size * group
    for g in range(0, len(order), span):
        chunk = sorted(order[g:g + span], key=lambda p: len(p.ids))
        out += [chunk[i:i + batch_size] for i in range(0, len(chunk), batch_size)]
    return out


@torch.inference_mode()
def generate_batch(model, prompts: list, max_new_tokens: int, top_k: int, pad_id: int, eos: set[int],
                   temperature: float = 0.0, max_prompt: int | None = None) -> list[dict]:
    """One left-padded batch through ``model.generate``; returns one record per prompt."""
    ids = [p.ids[-max_prompt:] if max_prompt else p.ids for p in prompts]
    b, width = len(ids), max(len(p) for p in ids)
    x = torch.full((b, width), pad_id, dtype=torch.int64)
    mask = torch.zeros(b, width, dtype=torch.int64)
    for r, p in enumerate(ids):
        x[r, width - len(p):] = torch.tensor(p)
        mask[r, width - len(p):] = 1
    rec = _TopKRecorder(top_k)
    gen = dict(do_sample=False, temperature=None, top_p=None, top_k=None) if temperature == 0 else \
        dict(do_sample=True, temperature=temperature, top_p=None, top_k=0)
    out = model.generate(x.to(model.device), attention_mask=mask.to(model.device), max_new_tokens=max_new_tokens,
                         pad_token_id=pad_id, logits_processor=LogitsProcessorList([rec]), **gen)
    new = out[:, width:].cpu()
    lps = torch.stack([s[0] for s in rec.steps], 1).cpu()   # [B,G,K]
    idx = torch.stack([s[1] for s in rec.steps], 1).cpu()
    records = []
    for r, p in enumerate(prompts):
        toks = new[r].tolist()
        n = len(toks)
        for j, t in enumerate(toks):
            if t in eos:
                n = j + 1
                break
        records.append({"id": p.id, "category": p.category, "prompt_len": len(ids[r]),
                        "ids": torch.tensor(ids[r] + toks[:n], dtype=torch.int32),
                        "topk_lp": lps[r, :n].clone(), "topk_idx": idx[r, :n].clone()})
    return records


@torch.inference_mode()
def teacher_force_batch(model, prompts: list, top_k: int, max_len: int) -> list[dict]:
    """The target's top-k log-probs at every position of the prompts themselves (one batched forward,
    right padding, no decoding): ``prompt_len`` 1, so position ``j`` predicts token ``j + 1``."""
    ids = [p.ids[:max_len] for p in prompts]
    b, width = len(ids), max(len(p) for p in ids)
    x = torch.zeros(b, width, dtype=torch.int64)
    for r, p in enumerate(ids):
        x[r, : len(p)] = torch.tensor(p)
    hidden = model.model(input_ids=x.to(model.device), use_cache=False).last_hidden_state  # causal: padding is never seen
    head = model.get_output_embeddings()
    records = []
    for r, p in enumerate(prompts):
        n = len(ids[r])
        lp = head(hidden[r, : n - 1]).float().log_softmax(-1)
        v, i = lp.topk(top_k, dim=-1)
        records.append({"id": p.id, "category": p.category, "prompt_len": 1, "ids": torch.tensor(ids[r], dtype=torch.int32),
                        "topk_lp": v.half().cpu(), "topk_idx": i.int().cpu()})
    return records


def generate_data(model, prompts: list, work: Path, passes: list[tuple[str, float]], max_new_tokens: int,
                  batch_size: int, top_k: int, seed: int, eos: set[int], pad_id: int,
                  max_prompt: int | None = None, deadline: float | None = None, progress: bool = True) -> list[Path]:
    """Write the shards of every pass (``(name, temperature)``; 0 = greedy, None = teacher forcing on
    the prompts, see :func:`teacher_force_batch`) under ``work``; existing
    shards are kept (resume). Stops early (with the shards so far) at the ``deadline`` (time.time())."""
    work.mkdir(parents=True, exist_ok=True)
    plan = [(name, temp, i, chunk) for p_i, (name, temp) in enumerate(passes)
            for i, chunk in enumerate(batches(prompts, batch_size, seed + p_i))]
    done = [work / f"{name}_{i:04d}.pt" for name, _, i, _ in plan if (work / f"{name}_{i:04d}.pt").exists()]
    todo = [item for item in plan if not (work / f"{item[0]}_{item[2]:04d}.pt").exists()]
    bar = tqdm(total=len(plan), initial=len(plan) - len(todo), desc="generate", unit="batch", disable=not progress)
    tokens, t0 = 0, time.perf_counter()
    for n, (name, temp, i, chunk) in enumerate(todo):
        if deadline is not None and time.time() > deadline:
            bar.write(f"generation budget reached after {len(done)} of {len(plan)} batches")
            break
        if temp:
            torch.manual_seed(seed * 100003 + i + 7 * n)
        if temp is None:
            records = teacher_force_batch(model, chunk, top_k, max_prompt or 1024)
        else:
            records = generate_batch(model, chunk, max_new_tokens, top_k, pad_id, eos, temp, max_prompt)
        path = work / f"{name}_{i:04d}.pt"
        tmp = path.with_suffix(".tmp")
        torch.save(records, tmp)
        tmp.rename(path)
        done.append(path)
        tokens += sum(len(r["topk_idx"]) for r in records)
        bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - t0):.0f}")
        bar.update()
    bar.close()
    return sorted(done)


def load_records(paths: list[Path]) -> list[dict]:
    out = []
    for p in paths:
        out += torch.load(p, weights_only=True)
    return out
