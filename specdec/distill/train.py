"""KL distillation of a reduced-vocabulary draft on the target's generations, and the command's driver.

The loss at every generated position is the cross-entropy of the draft's distribution (over its
vocabulary) against the target's top-k distribution renormalised over the draft vocabulary, i.e.
KL(target || draft) up to a constant. Held-out greedy records give a cheap acceptance proxy: on the
target's own greedy continuation, top-1 agreement of draft and target at a position is exactly
whether greedy chain drafting accepts the draft token there.
"""
from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from specdec.distill.data import generate_data, load_records
from specdec.draft_models.reduced import SpecdecDraftForCausalLM, draft_from_target
from specdec.distill.vocab import count_tokens, coverage, select_vocab


@dataclass
class Example:
    ids: torch.Tensor      # [L] target ids fed to the draft
    first: int             # position whose logits predict the first generated token
    topk_lp: torch.Tensor  # [G,K] target log-probs at positions first .. first+G-1
    topk_idx: torch.Tensor  # [G,K] their target ids
    greedy: bool


def make_examples(records: list[dict], max_context: int, greedy: bool) -> list[Example]:
    """Examples predicting every generated token; the prompt is cut to its last ``max_context`` tokens."""
    out = []
    for r in records:
        g = len(r["topk_idx"])
        if g == 0:
            continue
        p = r["prompt_len"]
        start = max(0, p - max_context)
        ids = r["ids"][start: p + g - 1].long()
        out.append(Example(ids, p - 1 - start, r["topk_lp"].float(), r["topk_idx"].long(), greedy))
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


def _collate(batch: list[Example], draft: SpecdecDraftForCausalLM):
    """Build a batch on the host; return its tensors on the draft's device."""
    width = max(len(e.ids) for e in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.int64)  # right padding: causal attention never sees it
    rows, cols, lps, idxs = [], [], [], []
    for r, e in enumerate(batch):
        ids[r, : len(e.ids)] = e.ids
        g = len(e.topk_idx)
        rows.append(torch.full((g,), r))
        cols.append(torch.arange(e.first, e.first + g))
        lps.append(e.topk_lp)
        idxs.append(e.topk_idx)
    dev = draft.target_to_draft.device
    d_idx = draft.target_to_draft[torch.cat(idxs).to(dev)]   # [N,K] draft ids; Vd = outside the draft vocab
    lp = torch.cat(lps).to(dev).masked_fill(d_idx == draft.draft_vocab_size, float("-inf"))
    return (ids.to(dev), torch.cat(rows).to(dev), torch.cat(cols).to(dev), d_idx.clamp(max=draft.draft_vocab_size - 1),
            lp)


def distill_loss(draft: SpecdecDraftForCausalLM, batch: list[Example], autocast: bool = False):
    """Mean cross-entropy against the renormalised target top-k, and top-1 agreement (a float)."""
    dev = draft.draft_vocab.device
    ids, rows, cols, d_idx, lp = _collate(batch, draft)
    keep = torch.isfinite(lp).any(-1)  # positions whose whole top-k lies outside the draft vocab teach nothing
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
        hidden = draft.model(input_ids=draft.target_to_draft[ids], use_cache=False).last_hidden_state
        logits = draft.lm_head(hidden[rows, cols])[:, : draft.draft_vocab_size]
    logq = logits.float().log_softmax(-1)
    p = lp.softmax(-1).nan_to_num(0.0)
    loss = -(p * logq.gather(1, d_idx)).sum(-1)
    loss = loss[keep].mean() if bool(keep.any()) else logq.sum() * 0
    # top-1 agreement in target ids: the target's argmax is top-k column 0
    target_top = torch.cat([e.topk_idx[:, 0] for e in batch]).to(dev)
    agree = (draft.draft_vocab[logits.argmax(-1)] == target_top).float().mean().item()
    return loss, agree


@torch.no_grad()
def evaluate(draft, examples: list[Example], max_tokens: int) -> dict:
    """Held-out loss and top-1 agreement (= greedy per-token acceptance on the target's own chains)."""
    was = draft.training
    draft.eval()
    tot_loss = tot_agree = n = 0.0
    for b in make_batches(examples, max_tokens, 0):
        k = sum(len(e.topk_idx) for e in b)
        loss, agree = distill_loss(draft, b)
        tot_loss += loss.item() * k
        tot_agree += agree * k
        n += k
    draft.train(was)
    return {"loss": tot_loss / max(n, 1), "top1_agreement": tot_agree / max(n, 1), "positions": int(n)}


def train(draft: SpecdecDraftForCausalLM, examples: list[Example], held_out: list[Example], ckpt: Path,
          steps: int, minutes: float | None, lr: float, max_tokens: int, seed: int, resume: bool,
          autocast: bool = True, ckpt_minutes: float = 5.0, progress: bool = True, log=None,
          loss_fn=None, eval_fn=None) -> dict:
    """AdamW with warmup then cosine decay over ``steps`` (or the time budget, whichever ends first).

    ``loss_fn(draft, batch, autocast) -> (loss, top-1 agreement)`` defaults to :func:`distill_loss`,
    ``eval_fn(draft, held_out, max_tokens) -> dict`` to :func:`evaluate`.

    A checkpoint (weights, optimiser, position in the seeded batch order, elapsed time) is written to
    ``ckpt`` every ``ckpt_minutes`` and at the end; ``resume`` continues from it.
    """
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(draft.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    step, epoch, pos, elapsed = 0, 0, 0, 0.0
    if resume and ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        draft.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, epoch, pos, elapsed = state["step"], state["epoch"], state["pos"], state["elapsed"]
        torch.set_rng_state(state["rng"])
    budget = minutes * 60 if minutes else None
    warmup = min(100, max(1, steps // 20))

    def save():
        tmp = ckpt.with_suffix(".tmp")
        torch.save({"model": draft.state_dict(), "opt": opt.state_dict(), "step": step, "epoch": epoch, "pos": pos,
                    "elapsed": elapsed, "rng": torch.get_rng_state()}, tmp)
        tmp.rename(ckpt)

    draft.train()
    bar = tqdm(total=steps, initial=step, desc="distill", unit="step", disable=not progress)
    ema, ema_agree = None, None
    t_start, last_ckpt = time.perf_counter() - elapsed, time.perf_counter()
    batches = make_batches(examples, max_tokens, seed + epoch)
    while step < steps:
        elapsed = time.perf_counter() - t_start
        if budget is not None and elapsed >= budget:
            break
        if pos >= len(batches):
            epoch, pos = epoch + 1, 0
            batches = make_batches(examples, max_tokens, seed + epoch)
        frac = max(step / steps, elapsed / budget if budget else 0.0)
        scale = min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
        for group in opt.param_groups:
            group["lr"] = lr * scale
        loss, agree = (loss_fn or distill_loss)(draft, batches[pos], autocast)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        step, pos = step + 1, pos + 1
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        ema_agree = agree if ema_agree is None else 0.98 * ema_agree + 0.02 * agree
        bar.set_postfix(loss=f"{ema:.3f}", top1=f"{ema_agree:.3f}", epoch=epoch, lr=f"{lr * scale:.1e}")
        bar.update()
        if time.perf_counter() - last_ckpt > ckpt_minutes * 60:
            elapsed = time.perf_counter() - t_start
            save()
            last_ckpt = time.perf_counter()
            if log:
                log({"step": step, "epoch": epoch, "elapsed_s": round(elapsed), "train_loss": ema, "train_top1": ema_agree})
    bar.close()
    elapsed = time.perf_counter() - t_start
    save()
    draft.eval()
    result = {"steps": step, "epochs": epoch + pos / max(len(batches), 1), "train_seconds": elapsed,
              "train_loss_ema": ema, "train_top1_ema": ema_agree}
    if held_out:
        result["held_out"] = (eval_fn or evaluate)(draft, held_out, max_tokens)
    return result


def _eagle_setup(args, target32, layers, vocab, shards, held: set, work: Path):
    """The feature-conditioned draft, its examples (the target's hidden states over every record,
    computed once into the work folder), and its loss and evaluation."""
    from specdec.draft_models.eagle import eagle_from_target
    from specdec.distill.eagle_train import eagle_evaluate, eagle_loss, feature_shards, load_examples

    target32.to(args.device)
    feats = feature_shards(target32, shards, args.max_context, args.max_tokens)
    draft = eagle_from_target(target32, layers, vocab, args.target)
    head = target32.get_output_embeddings().weight.detach().float().to(args.device)
    target32.cpu()
    examples, held_out = [], []
    for shard, feat in zip(shards, feats):
        for e in load_examples([feat]):
            if e.record_id not in held:
                examples.append(e)
            elif shard.name.startswith("greedy"):
                held_out.append(e)

    def loss_fn(d, batch, autocast):
        with torch.autocast(head.device.type, dtype=torch.bfloat16, enabled=autocast):
            return eagle_loss(d, batch, head, args.unroll)

    return draft, examples, held_out, loss_fn, lambda d, h, m: eagle_evaluate(d, h, m)


def run_distill(args) -> dict:
    """The ``specdec distill`` pipeline: generate (resumable) -> vocabulary -> initialise -> train -> save."""
    from specdec.api import SpecDecoder
    from specdec.prompts import read_prompts

    torch.set_num_threads(args.threads) if args.threads else None
    t0 = time.time()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    logf = open(work / "log.jsonl", "a")

    def log(row):
        logf.write(json.dumps({"t": round(time.time() - t0), **row}) + "\n")
        logf.flush()

    dec = SpecDecoder(args.target, dtype=args.gen_dtype, device=args.device)
    prompts = read_prompts(args.prompts, dec, args.limit)
    passes = [("prompt", None)] * args.teacher_forcing + [("greedy", 0.0)] + \
        [(f"sample{i}", args.temperature) for i in range(args.samples)]
    deadline = t0 + args.gen_minutes * 60 if args.gen_minutes else None
    shards = generate_data(dec.model, prompts, work / "data", passes, args.gen_tokens, args.batch_size, args.top_k,
                           args.seed, dec.eos, dec.model.generation_config.pad_token_id or 0,
                           max_prompt=args.max_prompt, deadline=deadline)
    greedy_recs = load_records([s for s in shards if s.name.startswith("greedy")])
    sample_recs = load_records([s for s in shards if not s.name.startswith("greedy")])  # sampled + teacher forcing
    gen_s = time.time() - t0
    positions = {name: sum(len(r["topk_idx"]) for s in shards if s.name.startswith(name) for r in load_records([s]))
                 for name, _ in passes}
    log({"stage": "data", "records": len(greedy_recs) + len(sample_recs), "positions": positions, "seconds": gen_s})

    # Held-out: a few greedy records of whole prompts (all their passes leave training).
    rng = random.Random(args.seed)
    ids = sorted({r["id"] for r in greedy_recs})
    held = set(rng.sample(ids, max(1, int(len(ids) * args.held_out)))) if args.held_out > 0 and len(ids) > 1 else set()
    train_recs = [r for r in greedy_recs + sample_recs if r["id"] not in held]
    held_recs = [r for r in greedy_recs if r["id"] in held]

    vt = dec.model.config.get_text_config().vocab_size
    # The draft proposes the target's argmax: choose the vocabulary from the target's top-1 tokens.
    counts = count_tokens((r["topk_idx"][:, 0] for r in train_recs), vt)
    vocab = select_vocab(counts, args.draft_vocab, dec.eos)
    cov = coverage(count_tokens((r["topk_idx"][:, 0] for r in held_recs), vt), vocab) if held_recs else None
    log({"stage": "vocab", "size": int(vocab.numel()), "train_coverage": coverage(counts, vocab), "held_out_coverage": cov})

    layers = [int(i) for i in (args.layers or ("29" if args.arch == "eagle" else "0,29")).split(",")]
    target32 = dec.model.float().cpu()
    if args.arch == "eagle":
        draft, examples, held_out, loss_fn, eval_fn = _eagle_setup(args, target32, layers, vocab, shards, held, work)
    else:
        draft = draft_from_target(target32, layers, vocab, args.target)
        greedy = {id(r) for r in greedy_recs}
        examples = [e for r in train_recs for e in make_examples([r], args.max_context, id(r) in greedy)]
        held_out = make_examples(held_recs, args.max_context, True)
        loss_fn, eval_fn = None, None
    del dec, target32
    draft.to(args.device)
    if held_out:
        log({"stage": "init", **(eval_fn or evaluate)(draft, held_out, args.max_tokens)})
    result = train(draft, examples, held_out, work / "ckpt.pt", args.steps, args.train_minutes, args.lr,
                   args.max_tokens, args.seed, args.resume, autocast=args.autocast, log=log, loss_fn=loss_fn,
                   eval_fn=eval_fn)
    log({"stage": "train", **result})

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    draft.cpu().to(torch.bfloat16 if args.save_dtype == "bf16" else torch.float16 if args.save_dtype == "fp16"
             else torch.float32).save_pretrained(out)
    from transformers import AutoTokenizer
    from specdec.hub import resolve
    AutoTokenizer.from_pretrained(resolve(args.target)).save_pretrained(out)
    summary = {"target": args.target, "arch": args.arch, "layers": layers, "draft_vocab": int(vocab.numel()),
               "train_coverage": coverage(counts, vocab), "held_out_coverage": cov, "held_out_ids": sorted(held),
               "prompts": len(prompts), "train_records": len(train_recs), "positions": positions,
               "generation_seconds": gen_s, "total_seconds": time.time() - t0, **result}
    (out / "distill_summary.json").write_text(json.dumps(summary, indent=1))
    log({"stage": "done", **summary})
    return summary
