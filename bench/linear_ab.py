"""transformers' own ``generate`` (``hf``) with torch's linear layers against specdec's skinny kernel.

    OMP_NUM_THREADS=1 python -m bench.linear_ab --dtype bf16 --per-category 2 --json out.json
    python -m bench.linear_ab --dtype bf16 --max-new-tokens 1 ...   # prefill alone

One process, one model loaded once and copied; the two copies decode the same prompts in alternating
order, so the ratio is side by side. This is the absolute reference for ``specdec bench --linear skinny``,
whose ``hf`` baseline already runs on the skinny kernel.
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
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dec = SpecDecoder(args.model, dtype=args.dtype, linear="torch")
    models = {"torch": dec.model, "skinny": copy.deepcopy(dec.model)}
    use_skinny_linear(models["skinny"])
    prompts = read_prompts(args.prompts, dec, per_category=args.per_category)
    seconds = {name: 0.0 for name in models}
    tokens = {name: 0 for name in models}
    same = 0
    for i, p in enumerate(tqdm(prompts, desc="linear a/b")):
        outs = {}
        for name in (["torch", "skinny"] if i % 2 == 0 else ["skinny", "torch"]):
            t = time.perf_counter()
            outs[name] = hf_generate(models[name], p.ids, args.max_new_tokens, SamplingConfig())
            seconds[name] += time.perf_counter() - t
            tokens[name] += len(outs[name])
        same += outs["torch"] == outs["skinny"]
    tps = {name: tokens[name] / seconds[name] for name in models}
    result = {"model": args.model, "dtype": args.dtype, "threads": torch.get_num_threads(), "prompts": len(prompts),
              "max_new_tokens": args.max_new_tokens, "tokens_per_second": tps, "seconds": seconds,
              "skinny_over_torch": tps["skinny"] / tps["torch"], "identical_outputs": same}
    print(f"hf tok/s: torch {tps['torch']:.1f}, skinny {tps['skinny']:.1f} "
          f"({result['skinny_over_torch']:.2f}x); identical outputs {same}/{len(prompts)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
