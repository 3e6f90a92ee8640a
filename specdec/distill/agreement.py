"""Chain agreement of drafts with their target on a corpus of the target's greedy replies, per category.

    python -m specdec.distill.agreement --drafts smollm2-draft,smollm2-eagle \\
        --replies bench/dev_replies/smollm2-bf16 --json OUT.json

``depth1`` is the rate at which the draft's first token equals the target's next greedy token (the
per-token acceptance of one-token ``sd``); ``depth2`` the rate of the second chain token given the
first (see :func:`specdec.distill.teacher.agreement`). Teacher-forced, so it measures the draft
alone, without decoding. The target runs in fp32 here; ``specdec distill`` measures its held-out prompts
with a bf16 teacher, so the two agree only roughly for a feature-conditioned draft. ``--draft-weights q8,q4`` measures
each draft with its linear weights rounded as ``SpecDecoder(draft_weights=...)`` stores them (each weight replaced by
its codes' values: the function a quantized draft's few-row forwards compute).
"""
from __future__ import annotations

import argparse
import json

import torch

from specdec.distill.corpus import Corpus, CorpusMismatch, target_fingerprint
from specdec.distill.teacher import Teacher, agreement, make_examples


def measure(drafts: list[str], replies: str, target: str = "smollm2", device: str = "cpu",
            max_context: int = 1024, max_tokens: int = 8192, weights: tuple[str, ...] = ("dense",)) -> dict:
    """``{draft: agreement dict}`` on the greedy reply shards of the corpus ``replies`` (``draft:KIND`` for each
    ``weights`` kind but dense)."""
    from specdec.draft_weights import DRAFT_WEIGHTS, round_weights
    from specdec.hub import load_model

    weights = tuple(dict.fromkeys(weights))  # each kind once
    for kind in weights:
        if kind not in DRAFT_WEIGHTS:
            raise ValueError(f"draft weights {kind!r}: expected one of {', '.join(DRAFT_WEIGHTS)}")

    tgt, tok = load_model(target, "fp32", device)
    corpus = Corpus.load(replies)
    if corpus.manifest["fingerprint"] != target_fingerprint(tgt, tok):
        raise CorpusMismatch(f"the replies in {replies} were made by {corpus.manifest['target']}, not {target}")
    greedy = [r for s in corpus.shards("reply") if s["sampling"]["temperature"] == 0 for r in corpus.read(s["name"])]
    if not greedy:
        raise ValueError(f"no greedy reply shards in {replies}")
    examples = make_examples(greedy, max_context, True)
    teacher = Teacher(tgt)
    out = {}
    for name in drafts:
        for kind in weights:
            draft, _ = load_model(name, "fp32", device)
            if not hasattr(draft, "draft_vocab"):
                raise ValueError(f"{name} is not a distilled specdec draft (no draft vocabulary)")
            if kind != "dense" and not round_weights(draft, kind):
                raise ValueError(f"{name} has no linear layer that draft weights {kind!r} would round")
            with torch.inference_mode():
                out[name if kind == "dense" else f"{name}:{kind}"] = agreement(draft, teacher, examples, max_tokens)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specdec.distill.agreement")
    ap.add_argument("--drafts", required=True, help="comma list of draft names or folders")
    ap.add_argument("--replies", required=True, help="corpus of the target's greedy replies (specdec corpus)")
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--draft-weights", default="dense", help="comma list of dense, q8, q4 (each draft measured with each)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    res = measure(args.drafts.split(","), args.replies, args.target, args.device,
                  weights=tuple(args.draft_weights.split(",")))
    cats = sorted({c for r in res.values() for c in r["per_category"]})
    print(f"{'draft':<40} {'all':>11} " + " ".join(f"{c[:11]:>11}" for c in cats))
    for name, r in res.items():
        print(f"{name[-40:]:<40} {r['depth1']:.3f}/{r['depth2']:.3f} " +
              " ".join(f"{r['per_category'][c]['depth1']:.3f}/{r['per_category'][c]['depth2']:.3f}" for c in cats))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "results": res}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
