"""Making the corpus: the target's replies to prompts, in resumable shards (:mod:`~specdec.distill.corpus`).

Generation is transformers' ``generate`` over left-padded batches. Every shard is named after its
source and pass (``user_0003-greedy_0000``, ``train-prompts-b433cd58-sample1_0000``), so a rerun skips what exists
(refusing a shard that was made with other settings) and one that asks for more passes adds only the new
shards. Sampled passes seed the generator from the shard's name, so a resumed corpus is the one an
uninterrupted run with the same batch size would have made.
"""
from __future__ import annotations

import hashlib
import random
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from specdec.distill.corpus import Corpus, Record
from specdec.prompts import Prompt, encode_prompt


@dataclass(frozen=True)
class Pass:
    name: str              # greedy, sample0, ...
    temperature: float     # 0 = greedy
    top_p: float = 1.0

    @property
    def sampling(self) -> dict:
        return {"temperature": self.temperature, "top_p": self.top_p}


def reply_passes(samples: int, temperature: float) -> list[Pass]:
    """The greedy reply and ``samples`` sampled ones at ``temperature``."""
    if samples < 0 or (samples and temperature <= 0):
        raise ValueError(f"samples must be >= 0 with a positive temperature, got {samples} at {temperature}")
    return [Pass("greedy", 0.0)] + [Pass(f"sample{i}", temperature) for i in range(samples)]


def name_seed(name: str, seed: int) -> int:
    return zlib.crc32(name.encode()) * 1000003 + seed


@torch.inference_mode()
def generate(model, prompts: list[list[int]], max_new_tokens: int, pad_id: int, eos: set[int],
             temperature: float = 0.0, top_p: float = 1.0) -> list[tuple[list[int], bool]]:
    """One left-padded batch through ``model.generate``: per prompt, the new ids up to and including
    the first EOS, and whether an EOS ended it."""
    b, width = len(prompts), max(len(p) for p in prompts)
    x = torch.full((b, width), pad_id, dtype=torch.int64)
    mask = torch.zeros(b, width, dtype=torch.int64)
    for r, p in enumerate(prompts):
        x[r, width - len(p):] = torch.tensor(p)
        mask[r, width - len(p):] = 1
    gen = dict(do_sample=False, temperature=None, top_p=None, top_k=None) if temperature == 0 else \
        dict(do_sample=True, temperature=temperature, top_p=top_p if top_p < 1 else None, top_k=0)
    out = model.generate(x.to(model.device), attention_mask=mask.to(model.device), max_new_tokens=max_new_tokens,
                         pad_token_id=pad_id, eos_token_id=sorted(eos) or None, **gen)
    rows = []
    for toks in out[:, width:].cpu().tolist():
        end = next((j for j, t in enumerate(toks) if t in eos), None)
        rows.append((toks[: end + 1], True) if end is not None else (toks, False))
    return rows


def _by_length(prompts: list[Prompt], batch_size: int) -> list[list[Prompt]]:
    order = sorted(prompts, key=lambda p: len(p.ids))
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def reply_shard(model, prompts: list[Prompt], p: Pass, max_new_tokens: int, batch_size: int, pad_id: int,
                eos: set[int], max_prompt: int | None) -> list[Record]:
    """The target's replies to ``prompts`` under pass ``p`` (the caller seeds sampling)."""
    records = []
    for batch in _by_length(prompts, batch_size):
        ids = [q.ids[-max_prompt:] if max_prompt else q.ids for q in batch]
        for q, pid, (new, _) in zip(batch, ids, generate(model, ids, max_new_tokens, pad_id, eos, p.temperature, p.top_p)):
            records.append(Record(q.id, q.category, torch.tensor(pid + new).numpy(), len(pid)))
    return records


def file_tag(path: str | Path) -> str:
    """A shard-name tag for a prompt file: its stem and a digest of its bytes (another file, another tag)."""
    path = Path(path)
    return f"{path.stem.replace('_', '-')}-{hashlib.sha256(path.read_bytes()).hexdigest()[:8]}"


def user_turn_prompts(corpus: Corpus, tokenizer, shard: str) -> list[Prompt]:
    """The user turns of a ``user`` shard as chat prompts for the target to answer."""
    return [Prompt(r.id, r.category, encode_prompt(tokenizer, tokenizer.decode(r.ids.tolist()), chat=True))
            for r in corpus.read(shard)]


def make_replies(model, corpus: Corpus, sources: list[tuple[str, list[Prompt]]], passes: list[Pass],
                 max_new_tokens: int, batch_size: int, pad_id: int, eos: set[int], seed: int = 0,
                 max_prompt: int | None = 1024, shard_prompts: int = 1024, deadline: float | None = None,
                 info: dict | None = None, progress: bool = True) -> list[str]:
    """Write the reply shards of every ``(tag, prompts)`` source and pass that the corpus lacks:
    ``{tag}-{pass}_{i:04d}`` for the ``i``-th chunk of ``shard_prompts`` prompts (in a seeded order).
    Stops at ``deadline`` (``time.time()``) with whole shards. Returns the names written."""
    plan = []
    for tag, prompts in sources:
        order = list(prompts)
        random.Random(seed).shuffle(order)
        chunks = [order[i:i + shard_prompts] for i in range(0, len(order), shard_prompts)]
        plan += [(f"{tag}-{p.name}_{i:04d}", p, c) for p in passes for i, c in enumerate(chunks)]
    for name, p, chunk in plan:
        entry = next((s for s in corpus.shards("reply") if s["name"] == name), None)
        if entry is not None and (entry.get("sampling") != p.sampling or entry.get("max_new_tokens") != max_new_tokens
                                  or entry["records"] != len(chunk)):
            raise ValueError(f"corpus {corpus.root} already has shard {name!r} made with other settings "
                             f"({entry.get('sampling')}, {entry.get('max_new_tokens')} new tokens, {entry['records']} "
                             f"prompts; this run: {p.sampling}, {max_new_tokens}, {len(chunk)}): keep them, or use "
                             f"another corpus folder")
    todo = [item for item in plan if not corpus.has(item[0])]
    written = []
    bar = tqdm(total=len(plan), initial=len(plan) - len(todo), desc="replies", unit="shard", disable=not progress)
    for name, p, chunk in todo:
        if deadline is not None and time.time() > deadline:
            bar.write(f"time budget reached: {len(plan) - len(todo) + len(written)} of {len(plan)} reply shards exist")
            break
        t0 = time.perf_counter()
        torch.manual_seed(name_seed(name, seed))
        records = reply_shard(model, chunk, p, max_new_tokens, batch_size, pad_id, eos, max_prompt)
        dt = time.perf_counter() - t0
        entry = corpus.write(name, records, "reply", sampling=p.sampling, max_new_tokens=max_new_tokens,
                             seconds=round(dt, 1), **(info or {}))
        written.append(name)
        bar.set_postfix(tok_s=f"{entry['reply_tokens'] / dt:.0f}")
        bar.update()
    bar.close()
    return written
