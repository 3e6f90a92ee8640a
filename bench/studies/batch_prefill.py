"""Where a batch of ragged prompts spends its time in specdec's engine: prefill against decode steps.

One group of ``--batch`` dev prompts (the ``--group``-th, in file order, so groups 4-5 hold the long rag and
summarization prompts) generates ``--max-new-tokens`` with each of ``--methods`` (default ``ar``) as one
batch, on one thread, after a warm-up. ``--row-min`` sets :data:`specdec.model.ROW_PREFILL_MIN`: the default encodes ragged prompts row by
row where that computes fewer positions; a huge value forces the single padded ``[B, longest]`` forward::

    OMP_NUM_THREADS=1 python -m bench.studies.batch_prefill --group 4                    # row by row where it pays
    OMP_NUM_THREADS=1 python -m bench.studies.batch_prefill --group 4 --row-min 1000000  # one padded forward
    OMP_NUM_THREADS=1 python -m bench.studies.batch_prefill --group 0 --max-new-tokens 24 --profile

``--linear packed --prompt-attention kernel`` runs the engine as it was before products over 8 rows went to
torch's GEMM on AMX CPUs and prompts to causal SDPA (``--linear`` as in ``specdec bench``);
``SPECDEC_ATTENTION_DIRECT_ROWS=0 SPECDEC_WIDE_TREE_SDPA=0`` in the environment, as it was before the
tree-attention kernel's few-row path and the wide trees' SDPA route (both recorded in the output).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import time

import torch

import specdec.model as model_mod
from specdec.api import SpecDecoder
from specdec.bench_summary import cpu_name
from specdec.methods import parse_label
from specdec.prompts import TokenizerEncoder, read_prompts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", default="bench/dev_prompts.jsonl")
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--row-min", type=int, default=model_mod.ROW_PREFILL_MIN)
    p.add_argument("--methods", default="ar", help="comma list of methods (with options, as specdec bench's labels: "
                   "pld:history=0), each run on the same batch in turn")
    p.add_argument("--draft", default=None, help="draft model(s) for sd and the methods built on it, as specdec bench "
                   "--draft (e.g. smollm2-eagle)")
    p.add_argument("--linear", default="auto", help="the target's linear kernel, as specdec bench --linear")
    p.add_argument("--prompt-attention", default=model_mod.PROMPT_ATTENTION, choices=["sdpa", "kernel"],
                   help="specdec.model.PROMPT_ATTENTION: how prompts on an empty cache attend")
    p.add_argument("--profile", action="store_true", help="also print torch.profiler's operators of the run, by "
                   "self time (the row-by-row prefill's linear layers show as aten::mm)")
    args = p.parse_args()
    torch.set_num_threads(1)
    model_mod.ROW_PREFILL_MIN = args.row_min
    model_mod.PROMPT_ATTENTION = args.prompt_attention
    dec = SpecDecoder("smollm2", draft=args.draft.split(",") if args.draft else None, dtype=args.dtype, compile="off",
                      linear=args.linear)
    prompts = read_prompts(args.prompts, TokenizerEncoder(dec.tokenizer))
    ids = [q.ids for q in prompts[args.group * args.batch:(args.group + 1) * args.batch]]
    lens = [len(x) for x in ids]
    for method in args.methods.split(","):
        name, options = parse_label(method)  # e.g. pld:history=0
        dec.generate_ids(ids, name, 4, **options)  # warm-up, the cache buffers at this batch size, the batch's step costs
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if args.profile \
                else contextlib.nullcontext() as prof:
            t0 = time.perf_counter()
            res = dec.generate_ids(ids, name, args.max_new_tokens, **options)
            seconds = time.perf_counter() - t0
        if args.profile:
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
        print(json.dumps({"group": args.group, "method": method, "draft": args.draft, "row_min": args.row_min,
                          "linear": args.linear,
                          "prompt_attention": args.prompt_attention,
                          "prompt_sdpa_applies": model_mod._prompt_sdpa(dec.runner.device.type),
                          "wide_tree_sdpa": model_mod.WIDE_TREE_SDPA,
                          "attention_direct_rows": os.environ.get("SPECDEC_ATTENTION_DIRECT_ROWS"), "prompt_tokens": sum(lens),
                          "padded_tokens": len(lens) * max(lens), "new_tokens": sum(len(t) for t in res.tokens),
                          "seconds": round(seconds, 2), "prefill_seconds": round(res.stats.prefill_s, 2),
                          "target_seconds": round(res.stats.target_s, 2), "draft_seconds": round(res.stats.draft_s, 2),
                          "decode_steps": res.stats.steps, "tokens_per_step": round(  # per row and step it ran in
                              sum(len(t) for t in res.tokens) / max(1, len(res.stats.accept_lengths)), 2)
                          if res.stats.accept_lengths else 1.0, "cpu": cpu_name(),
                          "ms_per_step": round(1e3 * (seconds - res.stats.prefill_s) / max(1, res.stats.steps), 1)}))


if __name__ == "__main__":
    main()
