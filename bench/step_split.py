"""Where the time of a speculative step goes: target forward vs everything else.

Runs a method over prompts and splits the decode time after prefill into the target's forward
passes and the rest (drafting, verification, cache commit, Python).

    python -m bench.step_split --prompts ../shared/data/dev_prompts.jsonl --per-category 2 \
        --method pld --max-new-tokens 128 --dtype bf16 [--json OUT]
"""
from __future__ import annotations

import argparse
import json

from tqdm import tqdm

from specdec.api import SpecDecoder
from specdec.bench import read_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--method", default="pld")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    dec = SpecDecoder(args.model, dtype=args.dtype)
    prompts = read_prompts(args.prompts, dec, args.limit, args.per_category)
    dec.generate_ids([prompts[0].ids], args.method, 8)  # warm-up
    target = draft = total = 0.0
    n_steps = tokens = 0
    for p in tqdm(prompts, desc=args.method):
        res = dec.generate_ids([p.ids], args.method, args.max_new_tokens)
        st = res.stats
        target += st.target_s - st.prefill_s
        draft += st.draft_s
        total += st.total_s - st.prefill_s
        n_steps += st.steps
        tokens += len(res.tokens[0])
    other = total - target
    out = {
        "method": args.method, "dtype": args.dtype, "prompts": len(prompts), "steps": n_steps, "new_tokens": tokens,
        "decode_s": total, "target_forward_s": target, "other_s": other, "other_share": other / total,
        "drafting_s": draft, "ms_per_step": 1e3 * total / max(1, n_steps),
        "target_ms_per_step": 1e3 * target / max(1, n_steps), "other_ms_per_step": 1e3 * other / max(1, n_steps),
    }
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
