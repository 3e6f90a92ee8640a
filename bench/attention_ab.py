"""End-to-end A/B of the runner's attention paths: the tree-attention kernel vs the dense-mask SDPA.

One decoder (one loaded model); every prompt is generated with both paths, the order alternating
from prompt to prompt and round to round, and the decode times (after prefill) are summed per path.

    python -m bench.attention_ab --prompts specdec/data/demo_prompts.jsonl --method pld \
        --max-new-tokens 64 --dtype fp32 [--schedule static] [--rounds 2] [--threads N] [--json OUT]
"""
from __future__ import annotations

import argparse
import json

import torch

from specdec.api import SpecDecoder
from specdec.bench import read_prompts

PATHS = ("sdpa", "kernel")


def set_attention(dec: SpecDecoder, path: str) -> None:
    for runner in (dec.runner, dec.draft_runner):
        if runner is not None:
            runner.attention = path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--method", default="pld")
    ap.add_argument("--schedule", default=None, help="pld/sd draft-length schedule (static: same drafts on both paths)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    dec = SpecDecoder(args.model, dtype=args.dtype)
    prompts = read_prompts(args.prompts, dec, args.limit)
    opts = {"schedule": args.schedule} if args.schedule else {}
    for path in PATHS:  # warm-up
        set_attention(dec, path)
        dec.generate_ids([prompts[0].ids], args.method, 8, **opts)
    sums = {p: {"decode_s": 0.0, "target_s": 0.0, "tokens": 0, "steps": 0} for p in PATHS}
    same, runs = 0, 0
    for r in range(args.rounds):
        for i, prompt in enumerate(prompts):
            order = PATHS if (i + r) % 2 == 0 else PATHS[::-1]
            outs = {}
            for path in order:
                set_attention(dec, path)
                res = dec.generate_ids([prompt.ids], args.method, args.max_new_tokens, **opts)
                st = res.stats
                s = sums[path]
                s["decode_s"] += st.total_s - st.prefill_s
                s["target_s"] += st.target_s - st.prefill_s
                s["tokens"] += len(res.tokens[0])
                s["steps"] += st.steps
                outs[path] = res.tokens[0]
            same += outs["sdpa"] == outs["kernel"]
            runs += 1
    out = {"model": args.model, "method": args.method, "schedule": args.schedule, "dtype": args.dtype,
           "threads": torch.get_num_threads(),
           "max_new_tokens": args.max_new_tokens, "prompts": len(prompts), "rounds": args.rounds,
           "identical_outputs": f"{same}/{runs}"}
    for p in PATHS:
        s = sums[p]
        out[p] = {**s, "tokens_per_s": s["tokens"] / s["decode_s"], "ms_per_step": 1e3 * s["decode_s"] / s["steps"],
                  "target_ms_per_step": 1e3 * s["target_s"] / s["steps"]}
    out["decode_speedup"] = sums["sdpa"]["decode_s"] / sums["kernel"]["decode_s"]
    out["target_forward_speedup"] = sums["sdpa"]["target_s"] / sums["kernel"]["target_s"]
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
