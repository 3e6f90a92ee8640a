"""``specdec corpus``: grow a distillation corpus (Magpie user turns, then the target's replies).

    specdec corpus --out specdec/data/corpus/smollm2 --magpie 20000 --prompts specdec/data/train_prompts.jsonl \\
        --samples 3 --exclude bench/dev_prompts.jsonl --device cuda

Every stage skips the shards that exist, so the same command resumes an interrupted run, and a
larger ``--magpie`` or more ``--samples`` adds only what is new.
"""
from __future__ import annotations

import json
import shlex
import sys
import time

import torch


def run_corpus(args) -> dict:
    from specdec.api import eos_ids
    from specdec.distill.corpus import Corpus, target_fingerprint
    from specdec.distill.data import file_tag, make_replies, reply_passes, user_turn_prompts
    from specdec.distill.magpie import make_user_turns, read_openings
    from specdec.distill.train import describe_device
    from specdec.hub import load_model
    from specdec.prompts import TokenizerEncoder, read_prompts

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.magpie <= 0 and not args.prompts:
        raise ValueError("nothing to do: give --magpie N and/or --prompts FILE")
    openings = read_openings(args.magpie_openings) if args.magpie_openings else []
    t0 = time.time()
    deadline = t0 + args.minutes * 60 if args.minutes is not None else None
    model, tok = load_model(args.target, args.gen_dtype, args.device)
    corpus = Corpus.open(args.out, args.target, target_fingerprint(model, tok), args.gen_dtype)
    info = {"device": describe_device(args.device), "command": shlex.join(["specdec"] + sys.argv[1:])}
    eos, pad = eos_ids(model, tok), model.generation_config.pad_token_id or 0
    enc = TokenizerEncoder(tok)
    dev_texts = [json.loads(line)["prompt"] for f in args.exclude for line in open(f) if line.strip()]
    excluded = {tuple(p.ids) for f in args.exclude for p in read_prompts(f, enc)}
    for f in args.prompts:  # the given prompts first: they are the closest to what the draft will serve
        prompts = [p for p in read_prompts(f, enc) if tuple(p.ids) not in excluded]
        make_replies(model, corpus, [(file_tag(f), prompts)], reply_passes(args.samples, args.temperature),
                     args.gen_tokens, args.batch_size, pad, eos, args.seed, args.max_prompt, args.shard_prompts,
                     deadline, info)
    if args.magpie > 0:
        make_user_turns(model, tok, corpus, args.magpie, args.magpie_batch, args.magpie_tokens, eos, pad, dev_texts,
                        args.magpie_temperature, args.magpie_top_p, args.seed, deadline, info, openings=openings)
    user_shards = corpus.shards("user")
    for s in (user_shards[::-1] if args.reply_order == "newest" else user_shards):
        if deadline is not None and time.time() > deadline:
            break
        make_replies(model, corpus, [(s["name"], user_turn_prompts(corpus, tok, s["name"]))],
                     reply_passes(args.magpie_samples, args.temperature), args.gen_tokens, args.batch_size, pad, eos,
                     args.seed, args.max_prompt, args.shard_prompts, deadline, info)
    shards = corpus.manifest["shards"]
    return {"out": str(args.out), "shards": len(shards), "user_turns": sum(s["records"] for s in corpus.shards("user")),
            "replies": sum(s["records"] for s in corpus.shards("reply")), "reply_tokens": corpus.reply_tokens(),
            "seconds": round(time.time() - t0)}
