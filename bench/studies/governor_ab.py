"""The draft governor's pause rule, A/B in one process: the doubling pause alone against the cost-bounded one.

Each governed method runs twice per batch, once with a governor whose pause after a lost probe is about the
doubling one (``explore=1, max_hold=64``: the hold is then the probe's lost time in plain steps, within the
doubling pause's cap; close to the rule before the cost bound, not identical) and once with the default
(:class:`specdec.policies.DraftGovernor`), each arm keeping its own governor across calls as a decoder does;
``ar`` runs beside them. One untimed call per arm first (the draft's and the step cost's first-use work), then
``--rounds`` rounds over the prompts in batches of ``--batch-size``, the arms' order reversed every batch.

    OMP_NUM_THREADS=2 python -m bench.studies.governor_ab --batch-size 16 --rounds 2 \\
        --json bench/results/governor_ab_b16_zen3.json
"""
from __future__ import annotations

import argparse
import json

import torch

from specdec.api import SpecDecoder
from specdec.bench_summary import cpu_name
from specdec.policies import DraftGovernor
from specdec.prompts import read_prompts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", default="bench/dev_prompts.jsonl")
    p.add_argument("--per-category", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--methods", default="pld,ngrammys,sd,gsd")
    p.add_argument("--draft", default="smollm2-draft")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--json")
    args = p.parse_args()

    dec = SpecDecoder("smollm2", draft=args.draft, dtype=args.dtype, compile="off")
    ids = [q.ids for q in read_prompts(args.prompts, dec, per_category=args.per_category)]
    batches = [ids[i:i + args.batch_size] for i in range(0, len(ids), args.batch_size)]
    methods = args.methods.split(",")
    arms = ["ar"] + [f"{m}/{rule}" for m in methods for rule in ("doubling", "cost")]
    govs = {a: DraftGovernor(explore=1.0, max_hold=64) if a.endswith("doubling") else DraftGovernor()
            for a in arms[1:]}

    def run(arm: str, batch: list[list[int]]):
        if arm == "ar":
            return dec.generate_ids(batch, method="ar", max_new_tokens=args.max_new_tokens)
        return dec.generate_ids(batch, method=arm.split("/")[0], max_new_tokens=args.max_new_tokens,
                                governor=govs[arm])

    for arm in arms:  # untimed
        run(arm, batches[0])
    totals = {a: {"tokens": 0, "seconds": 0.0, "drafting_steps": 0, "plain_steps": 0} for a in arms}
    for rnd in range(args.rounds):
        for bi, batch in enumerate(batches):
            for arm in arms if (rnd + bi) % 2 == 0 else arms[::-1]:
                r = run(arm, batch)
                t = totals[arm]
                t["tokens"] += sum(len(x) for x in r.tokens)
                t["seconds"] += r.stats.total_s
                g = (r.stats.drafter or {}).get("governor", {})
                t["drafting_steps"] += g.get("drafting_steps", 0)
                t["plain_steps"] += g.get("plain_steps", 0)
    ar = totals["ar"]["tokens"] / totals["ar"]["seconds"]
    print(f"B={args.batch_size}, {len(ids)} prompts, {args.max_new_tokens} tokens, {args.rounds} rounds, "
          f"{torch.get_num_threads()} threads, {cpu_name()}: ar {ar:.1f} tok/s")
    for arm, t in totals.items():
        t["over_ar"] = t["tokens"] / t["seconds"] / ar
        print(f"  {arm:20s} {t['over_ar']:.3f}x ar   drafting steps {t['drafting_steps']}, plain {t['plain_steps']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": {**vars(args), "threads": torch.get_num_threads(), "cpu": cpu_name()},
                       "arms": totals}, f, indent=1)


if __name__ == "__main__":
    main()
