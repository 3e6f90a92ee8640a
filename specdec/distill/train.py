"""``specdec distill``: train a draft on a corpus of the target's own replies.

Pipeline: (optionally add replies to the corpus) -> split held-out prompts per category -> choose the
draft vocabulary from the training replies -> initialise the draft from target layers -> AdamW with
warmup and cosine decay, the frozen target as online teacher, held-out agreement every
``eval_every`` steps and early stopping on it -> save the best draft with ``distill_summary.json``
(the command, the device, the corpus used and every held-out measurement).
"""
from __future__ import annotations

import copy
import json
import math
import os
import random
import shlex
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from specdec.distill.corpus import Corpus, CorpusMismatch, target_fingerprint
from specdec.distill.losses import eagle_loss, layers_loss
from specdec.distill.teacher import Example, Teacher, agreement, make_batches, make_examples, parse_labels
from specdec.distill.vocab import count_tokens, coverage, select_vocab


def describe_device(device: str) -> str:
    """``cuda (NVIDIA H100 80GB HBM3)`` or ``cpu: model name (instructions), N cores``."""
    if str(device).startswith("cuda"):
        return f"cuda ({torch.cuda.get_device_name(torch.device(device))})"
    from specdec.bench_summary import cpu_name

    return f"cpu: {cpu_name()}, {os.cpu_count()} cores"


def held_out_split(ids_by_category: dict[str, list[str]], share: float, seed: int) -> set[str]:
    """Prompt ids held out: ``share`` of every category's prompts (at least one where a category has two)."""
    rng = random.Random(seed)
    held = set()
    for cat in sorted(ids_by_category):
        ids = sorted(set(ids_by_category[cat]))
        if share > 0 and len(ids) > 1:
            held.update(rng.sample(ids, max(1, round(len(ids) * share))))
    return held


def train(draft, loss_fn, examples: list[Example], held_out: list[Example], ckpt: Path, steps: int,
          minutes: float | None, lr: float, max_tokens: int, seed: int, resume: bool, eval_fn=None,
          eval_every: int = 0, patience: int = 0, ckpt_minutes: float = 5.0, progress: bool = True, log=None) -> dict:
    """AdamW with warmup then cosine decay over ``steps`` (or the time budget, whichever ends first).

    ``loss_fn(draft, batch) -> (loss, top-1 agreement)``; ``eval_fn(draft, examples) -> {"depth1", ...}``.
    Every ``eval_every`` steps the held-out agreement is measured; the best weights are kept and, after
    ``patience`` measurements without a gain, training stops. A checkpoint (weights, best weights,
    optimiser, position in the seeded batch order, elapsed time) is written every ``ckpt_minutes`` and
    at the end; ``resume`` continues from it."""
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(draft.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    st = {"step": 0, "epoch": 0, "pos": 0, "elapsed": 0.0, "best": None, "best_step": 0, "evals": [], "stale": 0}
    best_state = None
    if resume and ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        draft.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        best_state = state["best_state"]
        st.update(state["st"])
        torch.set_rng_state(state["rng"])
    budget = minutes * 60 if minutes else None
    warmup = min(200, max(1, steps // 20))

    def save():
        tmp = ckpt.with_suffix(".tmp")
        torch.save({"model": draft.state_dict(), "opt": opt.state_dict(), "best_state": best_state, "st": st,
                    "rng": torch.get_rng_state()}, tmp)
        tmp.rename(ckpt)

    def measure():
        nonlocal best_state
        res = eval_fn(draft, held_out)
        st["evals"].append({"step": st["step"], "depth1": res["depth1"], "depth2": res["depth2"]})
        if st["best"] is None or res["depth1"] > st["best"]:
            st["best"], st["best_step"], st["stale"] = res["depth1"], st["step"], 0
            best_state = {k: v.detach().clone() for k, v in draft.state_dict().items()}
        else:
            st["stale"] += 1
        if log:
            log({"eval": st["evals"][-1]})
        return res

    draft.train()
    bar = tqdm(total=steps, initial=st["step"], desc="distill", unit="step", disable=not progress)
    ema = ema_agree = None
    t_start, last_ckpt = time.perf_counter() - st["elapsed"], time.perf_counter()
    batches = make_batches(examples, max_tokens, seed + st["epoch"])
    stopped = "steps"
    while st["step"] < steps:
        st["elapsed"] = time.perf_counter() - t_start
        if budget is not None and st["elapsed"] >= budget:
            stopped = "time"
            break
        if st["pos"] >= len(batches):
            st["epoch"], st["pos"] = st["epoch"] + 1, 0
            batches = make_batches(examples, max_tokens, seed + st["epoch"])
        frac = max(st["step"] / steps, st["elapsed"] / budget if budget else 0.0)
        scale = min(1.0, (st["step"] + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
        for group in opt.param_groups:
            group["lr"] = lr * scale
        loss, agree = loss_fn(draft, batches[st["pos"]])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        st["step"], st["pos"] = st["step"] + 1, st["pos"] + 1
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        ema_agree = agree if ema_agree is None else 0.98 * ema_agree + 0.02 * agree
        bar.set_postfix(loss=f"{ema:.3f}", top1=f"{ema_agree:.3f}", epoch=st["epoch"], best=st["best"])
        bar.update()
        if eval_every and held_out and st["step"] % eval_every == 0:
            measure()
            st["evals"][-1]["train_loss"] = ema
            st["evals"][-1]["train_top1"] = ema_agree
            if patience and st["stale"] >= patience:
                stopped = "early"
                break
        if time.perf_counter() - last_ckpt > ckpt_minutes * 60:
            st["elapsed"] = time.perf_counter() - t_start
            save()
            last_ckpt = time.perf_counter()
    bar.close()
    st["elapsed"] = time.perf_counter() - t_start
    if eval_every and held_out and (not st["evals"] or st["evals"][-1]["step"] != st["step"]):
        measure()
    save()
    if best_state is not None:
        draft.load_state_dict(best_state)
    draft.eval()
    result = {"steps": st["step"], "stopped": stopped, "best_step": st["best_step"],
              "epochs": st["epoch"] + st["pos"] / max(len(batches), 1), "train_seconds": st["elapsed"],
              "train_loss_ema": ema, "train_top1_ema": ema_agree, "evals": st["evals"]}
    return result


def load_init_draft(path: str, arch: str, target, device: str):
    """``(draft, its distill_summary or None)`` for ``--init``: a draft of kind ``arch`` (``eagle`` or
    ``layers``) made for ``target``'s vocabulary and width, in fp32 on ``device``, ready to train on."""
    from specdec.draft_models.eagle import is_feature_draft
    from specdec.draft_models.reduced import SpecdecDraftForCausalLM
    from specdec.hub import load_model, resolve

    draft, _ = load_model(path, "fp32", device)
    if not isinstance(draft, SpecdecDraftForCausalLM):
        raise ValueError(f"--init {path} is not a specdec draft (got {type(draft).__name__})")
    if is_feature_draft(draft) != (arch == "eagle"):
        raise ValueError(f"--init {path} is {'an eagle' if is_feature_draft(draft) else 'a layers'} draft, "
                         f"not --arch {arch}")
    tcfg, dcfg = target.config.get_text_config(), draft.config
    if (dcfg.vocab_size, dcfg.hidden_size) != (tcfg.vocab_size, tcfg.hidden_size):
        raise ValueError(f"--init {path} drafts for a vocabulary of {dcfg.vocab_size} and width {dcfg.hidden_size}; "
                         f"the target has {tcfg.vocab_size} and {tcfg.hidden_size}")
    summary_file = resolve(path) / "distill_summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.exists() else None
    for p in draft.parameters():
        p.requires_grad_(True)
    return draft.train(), summary


def _shard_key(name: str) -> str:
    """A reply shard's name without a corpus folder (older summaries wrote ``folder/name``): shards are named
    by what made them, so a renamed or moved corpus keeps its keys."""
    return name.rsplit("/", 1)[-1]


def held_out_for(records: list, share: float, seed: int, init_summary: dict | None,
                 corpora: list[str]) -> tuple[set[str], set[str]]:
    """``(held-out prompt ids, reply shards the draft has now seen)``. ``records``: ``(record, greedy, shard)``.

    From scratch: :func:`held_out_split` over every prompt. Going on from a draft (``init_summary``, its
    ``distill_summary.json``): every prompt held out along its lineage stays held out, the prompts of every
    shard it or its ancestors trained on stay in training, and a share of the prompts new to the lineage is
    held out, so the held-out set never holds a prompt the draft has seen. What the lineage saw: the summary's
    ``seen_shard_names`` (or ``reply_shard_names``); for older summaries, the first ``reply_shards`` reply
    shards of its one corpus (shards are only ever appended)."""
    by_cat: dict[str, list[str]] = {}
    mine = {name for _, _, name in records}
    if init_summary is None:
        for r, _, _ in records:
            by_cat.setdefault(r.category, []).append(r.id)
        return held_out_split(by_cat, share, seed), mine
    names = init_summary.get("seen_shard_names") or init_summary.get("reply_shard_names")
    if names is None:
        theirs = [Path(c).name for c in init_summary.get("corpora", [])]
        if len(theirs) != 1 or theirs != [Path(c).name for c in corpora]:
            raise ValueError(f"the --init draft was trained on the corpora {theirs}, not {corpora}: which of their "
                             "prompts it saw is unknown, so its held-out measurement would not be clean")
        names = list(dict.fromkeys(name for _, _, name in records))[: init_summary.get("reply_shards", 0)]
    old_held, seen_shards = set(init_summary.get("held_out_ids", [])), {_shard_key(n) for n in names}
    seen = {r.id for r, _, name in records if name in seen_shards} - old_held
    for r, _, _ in records:
        if r.id not in seen and r.id not in old_held:
            by_cat.setdefault(r.category, []).append(r.id)
    return old_held | held_out_split(by_cat, share, seed), seen_shards | mine


def _subset(examples: list[Example], max_positions: int | None, seed: int) -> list[Example]:
    """A seeded subset of ``examples`` holding about ``max_positions`` reply tokens (all when None)."""
    if not max_positions:
        return examples
    order = list(examples)
    random.Random(seed).shuffle(order)
    out, n = [], 0
    for e in order:
        if n >= max_positions:
            break
        out.append(e)
        n += len(e.ids) - 1 - e.first
    return out


def run_distill(args) -> dict:
    """The ``specdec distill`` pipeline; returns the summary written beside the draft."""
    from specdec.api import eos_ids
    from specdec.draft_models.eagle import eagle_from_target
    from specdec.draft_models.reduced import draft_from_target
    from specdec.hub import load_model

    top_k = parse_labels(args.labels)  # bad options fail before any model is loaded
    if args.unroll < 1 or (args.unroll > 1 and args.arch != "eagle"):
        raise ValueError(f"--unroll must be >= 1, and above 1 only with --arch eagle (got {args.unroll}, {args.arch})")
    if args.max_context < 1 or not 0 <= args.held_out < 1:
        raise ValueError(f"--max-context must be >= 1 and --held-out in [0, 1), got {args.max_context}, {args.held_out}")
    if args.init and (args.layers or args.draft_vocab):
        raise ValueError("--init continues a draft with its own layers and vocabulary: drop --layers / --draft-vocab")
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.time()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    logf = open(work / "log.jsonl", "a")

    def log(row):
        logf.write(json.dumps({"t": round(time.time() - t0), **row}) + "\n")
        logf.flush()

    command = shlex.join(["specdec"] + sys.argv[1:]) if Path(sys.argv[0]).name in ("specdec", "__main__.py") else None
    device = describe_device(args.device)
    target, tok = load_model(args.target, "fp32", args.device)
    fp = target_fingerprint(target, tok)
    corpora = list(args.corpus or [])
    if args.prompts:  # one command from prompts to draft: the replies go into a corpus first
        from specdec.distill.data import file_tag, make_replies, reply_passes
        from specdec.prompts import TokenizerEncoder, read_prompts

        root = Path(corpora[0]) if corpora else work / "corpus"
        corpus = Corpus.open(root, args.target, fp, args.gen_dtype)
        gen, _ = load_model(args.target, args.gen_dtype, args.device)

        prompts = read_prompts(args.prompts, TokenizerEncoder(tok), args.limit)
        make_replies(gen, corpus, [(file_tag(args.prompts), prompts)], reply_passes(args.samples, args.temperature),
                     args.gen_tokens, args.batch_size, gen.generation_config.pad_token_id or 0, eos_ids(gen, tok),
                     args.seed, args.max_prompt, info={"device": device, "command": command})
        del gen
        corpora = corpora or [str(root)]
    if not corpora:
        raise ValueError("nothing to train on: give --corpus DIR (made by `specdec corpus`) or --prompts FILE")
    records, shard_names, dtypes = [], [], set()   # (record, whether it is a greedy reply, its shard)
    for root in corpora:
        c = Corpus.load(root)
        dtypes.add(c.manifest["gen_dtype"])
        if len(dtypes) > 1:
            raise CorpusMismatch(f"the corpora {corpora} were generated in different dtypes ({sorted(dtypes)})")
        if c.manifest["fingerprint"] != fp:
            raise CorpusMismatch(f"corpus {root} was made by another target or vocabulary "
                                 f"({c.manifest['target']}, {c.manifest['fingerprint']}) than --target {args.target} ({fp})")
        for s in c.shards("reply"):
            records += [(r, s["sampling"]["temperature"] == 0, s["name"]) for r in c.read(s["name"])]
            shard_names.append(s["name"])
    shards = len(shard_names)
    if not records:
        raise ValueError(f"no reply shards in {corpora}: add replies with `specdec corpus`")
    init = init_summary = None
    if args.init:
        init, init_summary = load_init_draft(args.init, args.arch, target, args.device)
        if init_summary is None and args.held_out > 0:
            raise ValueError(f"--init {args.init} has no distill_summary.json: which prompts it trained on is unknown, "
                             "so no held-out set would be clean (pass --held-out 0 to train without one)")
    held, seen_shards = held_out_for(records, args.held_out, args.seed, init_summary, corpora)
    held_present = held & {r.id for r, _, _ in records}
    records = [(r, greedy) for r, greedy, _ in records]
    held_recs = [r for r, greedy in records if r.id in held and greedy]
    examples_all = [e for r, greedy in records if r.id not in held for e in make_examples([r], args.max_context, greedy)]
    held_out = make_examples(held_recs, args.max_context, True)
    # With autocast the teacher's body runs in bf16 (as the target serves); its output layer stays fp32.
    body = copy.deepcopy(target.model).to(torch.bfloat16) if args.autocast else None
    teacher = Teacher(target, top_k, body=body)
    if args.feature_cache:  # over every training example, so runs on subsets share one cache
        teacher.cache_features(examples_all, args.feature_cache, args.max_tokens)
        teacher.cache_features(held_out, Path(args.feature_cache) / "held_out", args.max_tokens)
        log({"stage": "features", "rows": [int(c.shape[0]) for c in teacher.caches], "seconds": round(time.time() - t0)})
    examples = _subset(examples_all, args.max_positions, args.seed)
    if not examples:
        raise ValueError(f"no training examples in {corpora} (every reply is empty or held out)")

    def reply(e):
        return e.ids[e.first + 1:]

    positions = {"train": sum(len(reply(e)) for e in examples),
                 "train_greedy": sum(len(reply(e)) for e in examples if e.greedy),
                 "held_out": sum(len(reply(e)) for e in held_out)}
    log({"stage": "data", "corpora": corpora, "shards": shards, "held_out_prompts": len(held_present), **positions})

    vt = target.config.get_text_config().vocab_size
    counts = count_tokens((reply(e) for e in examples), vt)
    if init is not None:   # the draft goes on with its own vocabulary and layers
        draft, vocab = init, init.draft_vocab.cpu()
        layers = (init_summary or {}).get("layers")
    else:
        vocab = select_vocab(counts, args.draft_vocab or 8192, eos_ids(target, tok))
        layers = [int(i) for i in (args.layers or ("29" if args.arch == "eagle" else "0,29")).split(",")]
        make = eagle_from_target if args.arch == "eagle" else draft_from_target
        draft = make(target, layers, vocab, args.target).to(args.device)
    held_counts = count_tokens((reply(e) for e in held_out), vt)
    cov = {"train": coverage(counts, vocab), "held_out": coverage(held_counts, vocab) if held_out else None}
    eval_set = held_out
    if args.eval_positions:  # a fixed, seeded part of the held-out set for the checks during training
        eval_set = list(held_out)
        random.Random(args.seed).shuffle(eval_set)
        n, cut = 0, len(eval_set)
        for i, e in enumerate(eval_set):
            n += len(e.ids) - 1 - e.first
            if n >= args.eval_positions:
                cut = i + 1
                break
        eval_set = eval_set[:cut]

    def loss_fn(d, batch):
        if args.arch == "eagle":
            return eagle_loss(d, batch, teacher, args.autocast, args.unroll)
        return layers_loss(d, batch, teacher, args.autocast)

    def eval_fn(d, ex):
        return agreement(d, teacher, ex, args.max_tokens)

    if held_out:
        log({"stage": "init", **{k: v for k, v in eval_fn(draft, eval_set).items() if k != "per_category"}})
    for p in target.parameters():
        p.requires_grad_(False)
    result = train(draft, loss_fn, examples, eval_set, work / "ckpt.pt", args.steps, args.train_minutes, args.lr,
                   args.max_tokens, args.seed, args.resume, eval_fn, args.eval_every, args.patience, log=log)
    if held_out:
        result["held_out"] = eval_fn(draft, held_out)
    log({"stage": "train", **{k: v for k, v in result.items() if k != "evals"}})

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.save_dtype]
    draft.cpu().to(dtype).save_pretrained(out)
    summary = {"target": args.target, "arch": args.arch, "layers": layers, "draft_vocab": int(vocab.numel()),
               "labels": args.labels, "unroll": args.unroll if args.arch == "eagle" else None,
               "init": {"draft": args.init, "command": (init_summary or {}).get("command"),  # the whole lineage
                        "init": (init_summary or {}).get("init")} if args.init else None,
               "coverage": cov, "corpora": corpora, "reply_shards": shards, "reply_shard_names": shard_names,
               "seen_shard_names": sorted(seen_shards), "positions": positions,
               "held_out_prompts": len(held_present), "held_out_ids": sorted(held), "device": device, "command": command,
               "total_seconds": round(time.time() - t0), **result}
    (out / "distill_summary.json").write_text(json.dumps(summary, indent=1))
    log({"stage": "done"})
    return summary

