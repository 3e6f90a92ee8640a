"""transformers' own ``generate`` (``hf``) with torch's linear layers against specdec's kernels.

    OMP_NUM_THREADS=1 python -m bench.linear_ab --dtype bf16 --per-category 2 --json out.json
    python -m bench.linear_ab --dtype bf16 --max-new-tokens 1 ...   # prefill alone
    python -m bench.linear_ab --kernels torch,skinny,packed ...     # default: torch,skinny

One process, one model loaded once and copied per kernel; the copies decode the same prompts in
rotating order, so the ratios are side by side. This is the absolute reference for ``specdec bench
--linear skinny|packed``, whose ``hf`` baseline already runs on that kernel.
"""
from __future__ import annotations

import argparse
import copy
import json
import time

import torch
from tqdm import tqdm

from specdec.api import SpecDecoder, hf_generate
from specdec.bench import read_prompts
from specdec.linear import use_skinny_linear
from specdec.verify import SamplingConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--prompts", default="../shared/data/dev_prompts.jsonl")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--kernels", default="torch,skinny", help="comma list of torch, skinny, packed")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    names = [k.strip() for k in args.kernels.split(",")]
    if not names or set(names) - {"torch", "skinny", "packed"} or len(set(names)) != len(names):
        ap.error(f"--kernels takes distinct names among torch, skinny, packed; got {args.kernels!r}")
    dec = SpecDecoder(args.model, dtype=args.dtype, linear="torch")
    models = {}
    for name in names:
        models[name] = copy.deepcopy(dec.model)
        if name != "torch":
            use_skinny_linear(models[name], prepack=name == "packed")
    prompts = read_prompts(args.prompts, dec, per_category=args.per_category)
    seconds = {name: 0.0 for name in models}
    tokens = {name: 0 for name in models}
    same = {name: 0 for name in models}  # outputs equal to the first kernel's
    for i, p in enumerate(tqdm(prompts, desc="linear a/b")):
        outs = {}
        for name in names[i % len(names):] + names[:i % len(names)]:
            t = time.perf_counter()
            outs[name] = hf_generate(models[name], p.ids, args.max_new_tokens, SamplingConfig())
            seconds[name] += time.perf_counter() - t
            tokens[name] += len(outs[name])
        for name in names:
            same[name] += outs[name] == outs[names[0]]
    tps = {name: tokens[name] / seconds[name] for name in models}
    ratio = {name: tps[name] / tps[names[0]] for name in names}
    result = {"model": args.model, "dtype": args.dtype, "threads": torch.get_num_threads(), "prompts": len(prompts),
              "max_new_tokens": args.max_new_tokens, "tokens_per_second": tps, "seconds": seconds,
              f"over_{names[0]}": ratio, f"identical_to_{names[0]}": same}
    print("hf tok/s: " + ", ".join(f"{n} {tps[n]:.1f} ({ratio[n]:.2f}x, {same[n]}/{len(prompts)} identical)" for n in names))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
