"""Measure a draft against its target: step-cost ratio and greedy chain acceptance per category.

    python -m specdec.distill.evaluate --draft smollm2-draft --prompts dev_prompts.jsonl \\
        --per-category 2 --dtype bf16 --max-new-tokens 128 --json OUT.json

cost ratio c = median single-token step time of the draft / of the target (both through specdec's
``ModelRunner``, batch 1, interleaved in the same run). Acceptance: ``sd`` with a static draft
length; per-token acceptance = accepted draft tokens / proposed draft tokens, and mean accepted
length per verification step (accepted drafts per step, not counting the target's own token).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specdec.draft_models.eagle import is_feature_draft
from specdec.tree import DraftTree


@torch.inference_mode()
def step_times(runner, prompt: list[int], steps: int) -> list[float]:
    """Seconds of ``steps`` single-token forwards (+ commit) after encoding ``prompt``. A
    feature-conditioned draft gets zero target states of the right shape (the cost is the same)."""
    feature = is_feature_draft(runner.model)
    h = runner.config.hidden_size

    def extra(t: int):
        return {"target_hidden": torch.zeros(1, t, h, dtype=runner.model.dtype, device=runner.device)} if feature else None

    n = len(prompt)
    runner.reset(1, n + steps + 8)
    ids = torch.tensor([prompt], device=runner.device)
    logits, _ = runner.forward_tree(DraftTree.chain(ids[:, 0], ids[:, 1:]), extra_inputs=extra(n))
    runner.commit(torch.arange(n, device=runner.device)[None], torch.tensor([n], device=runner.device), True, [n])
    tok = logits[:, -1].argmax(-1)
    out = []
    for _ in range(steps):
        t = time.perf_counter()
        logits, _ = runner.forward_tree(DraftTree.chain(tok), feature, extra(1))
        runner.commit(torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, dtype=torch.int64), True, [1])
        out.append(time.perf_counter() - t)
        tok = logits[:, 0].argmax(-1)
    return out


def cost_ratio(dec, prompt: list[int], steps: int = 32, rounds: int = 3) -> dict:
    """Interleaved target/draft step timings (the draft in its cheap reduced-vocabulary mode if any)."""
    model = dec.draft_runner.model
    mode = model.reduced_logits if hasattr(model, "reduced_logits") else None
    t_target, t_draft = [], []
    for _ in range(rounds):
        t_target += step_times(dec.runner, prompt, steps)[2:]
        if mode:
            with mode():
                t_draft += step_times(dec.draft_runner, prompt, steps)[2:]
        else:
            t_draft += step_times(dec.draft_runner, prompt, steps)[2:]
    mt, md = statistics.median(t_target), statistics.median(t_draft)
    return {"target_step_ms": mt * 1e3, "draft_step_ms": md * 1e3, "c": md / mt}


def acceptance(dec, prompts, max_new_tokens: int, draft_length: int) -> dict:
    """Greedy chain drafting with ``sd``: per-category and overall acceptance."""
    from specdec.verify import SamplingConfig

    cats: dict[str, dict] = {}
    for p in prompts:
        res = dec.generate_ids([p.ids], "sd", max_new_tokens, SamplingConfig(), draft_length=draft_length)
        st = res.stats
        c = cats.setdefault(p.category, {"prompts": 0, "drafted": 0, "accepted": 0, "steps": 0, "new_tokens": 0})
        c["prompts"] += 1
        c["drafted"] += st.drafted_tokens
        c["accepted"] += st.accepted_tokens
        c["steps"] += st.steps
        c["new_tokens"] += len(res.tokens[0])
    total = {k: sum(c[k] for c in cats.values()) for k in ("prompts", "drafted", "accepted", "steps", "new_tokens")}
    for c in list(cats.values()) + [total]:
        c["accept_rate"] = c["accepted"] / c["drafted"] if c["drafted"] else None
        c["mean_accepted_per_step"] = c["accepted"] / c["steps"] if c["steps"] else None
        c["tokens_per_step"] = c["new_tokens"] / c["steps"] if c["steps"] else None
    return {"per_category": cats, "overall": total}


def main(argv=None) -> int:
    from specdec.api import SpecDecoder
    from specdec.prompts import read_prompts

    ap = argparse.ArgumentParser(prog="python -m specdec.distill.evaluate")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--draft", default="smollm2-draft")
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--per-category", type=int, default=None)
    ap.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--draft-length", type=int, default=5)
    ap.add_argument("--linear", default="auto", choices=["auto", "skinny", "torch"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--skip-acceptance", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dec = SpecDecoder(args.model, args.draft, args.dtype, linear=args.linear)
    prompts = read_prompts(args.prompts, dec, args.limit, args.per_category)
    out = {"config": {k: v for k, v in vars(args).items() if k != "json"}, "threads": torch.get_num_threads()}
    out["cost"] = cost_ratio(dec, prompts[0].ids)
    print(json.dumps(out["cost"]), flush=True)
    if not args.skip_acceptance:
        out["acceptance"] = acceptance(dec, prompts, args.max_new_tokens, args.draft_length)
        for cat, c in out["acceptance"]["per_category"].items():
            print(f"{cat:<16} accept {c['accept_rate']:.3f}  accepted/step {c['mean_accepted_per_step']:.2f}")
        o = out["acceptance"]["overall"]
        print(f"{'overall':<16} accept {o['accept_rate']:.3f}  accepted/step {o['mean_accepted_per_step']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
