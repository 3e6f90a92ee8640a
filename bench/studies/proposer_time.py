"""Time one ``propose`` call of specdec's vLLM proposers, without vLLM: what a proposer adds to each vLLM step.

    OMP_NUM_THREADS=1 python -m bench.studies.proposer_time --prompts bench/dev_prompts.jsonl --limit 32

Each of the first ``--limit`` dev prompts (cut to ``--context`` tokens) is one request; every proposer is
called ``--steps`` times per request, as vLLM calls it once per step, and the median and mean per call are
printed (ms). The configuration vLLM would hand the proposer is built by hand (a ``SimpleNamespace``). A
request is proposed for again at the same length, so no verification outcome is learned: the time of learning
(a few small host operations per step) is not in these figures.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from types import SimpleNamespace

import numpy as np
import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--prompts", default="bench/dev_prompts.jsonl")
    p.add_argument("--limit", type=int, default=32)
    p.add_argument("--context", type=int, default=3000)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--k", type=int, default=8, help="num_speculative_tokens")
    p.add_argument("--ngrammys-options", default="", help="SPECDEC_VLLM_OPTIONS for NGrammysProposer alone "
                   "(JSON, e.g. '{\"slots\": 1}')")
    args = p.parse_args()
    from transformers import AutoTokenizer

    from specdec.hub import resolve
    from specdec.integrations.vllm import OPTIONS_ENV, NGrammysProposer, PromptLookupProposer
    from specdec.prompts import TokenizerEncoder, read_prompts

    torch.set_num_threads(1)
    path = str(resolve(args.model))
    tok = AutoTokenizer.from_pretrained(path)
    vocab = len(tok)
    config = SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=args.k),
        model_config=SimpleNamespace(max_model_len=args.context + 1, model=path, tokenizer=path,
                                     get_vocab_size=lambda: vocab),
        scheduler_config=SimpleNamespace(max_num_seqs=1))
    prompts = read_prompts(args.prompts, TokenizerEncoder(tok), args.limit)
    out = {"model": args.model, "prompts": len(prompts), "context": args.context, "k": args.k,
           "ngrammys_options": args.ngrammys_options, "ms": {}}
    user = os.environ.get(OPTIONS_ENV, "")
    for cls in (PromptLookupProposer, NGrammysProposer):
        os.environ[OPTIONS_ENV] = args.ngrammys_options or user if cls is NGrammysProposer else user
        proposer = cls(config)
        buf = np.zeros((1, args.context + 1), dtype=np.int32)
        times = []
        for q in prompts:
            ids = q.ids[-args.context:]
            buf[0, :len(ids)] = ids
            n = np.array([len(ids)])
            for _ in range(args.steps):
                t0 = time.perf_counter()
                proposer.propose([[ids[-1]]], n, buf)
                times.append(time.perf_counter() - t0)
        out["ms"][cls.__name__] = {"median": round(1e3 * float(np.median(times)), 3),
                                   "mean": round(1e3 * float(np.mean(times)), 3)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
