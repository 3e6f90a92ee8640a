"""Tokens per verification call of chain-choice rules, replayed on the target's greedy replies (no target runs).

    OMP_NUM_THREADS=1 python -m bench.chain_choice --replies bench/dev_replies/smollm2-bf16 --k 8

What caps a chain proposer inside vLLM at one request, where verification is nearly free and every rule drafts
its whole chain: each greedy reply is decoded again by replaying it, one verification call at a time; a call
verifies one chain of up to ``--k`` tokens (as vLLM's hook does) and emits the accepted prefix plus one token.
Rules, all from the same N-Grammys drafts (:class:`specdec.drafters.ngrammys.NGrammysDrafter`: ``--slots``
drafts per step from context matches, the n-gram corpus and the bigram table):

- ``pld``: the continuation of the longest earlier suffix match of 1-4 tokens (``vllm-specdec-pld``'s chain);
- ``first``: the first draft in the drafter's order (``vllm-specdec-ngrammys:slots=1``'s chain);
- ``best``: the root-to-leaf path of the drafts' trie with the most expected accepted tokens, by the drafter's
  per-node estimates learned online from the chains verified (:func:`specdec.drafters.ngrammys.best_chain`,
  ``vllm-specdec-ngrammys``'s chain since it was measured here);
- ``best-history``: ``best`` with estimates kept per outcome of the request's own last chain (none yet,
  rejected, partly or wholly accepted), as the vLLM proposers keep theirs;
- ``oracle``: whichever draft the reply accepts longest (no rule choosing among these drafts does better);
- ``tree``: the whole trie verified at once (what tree verification, which vLLM's hook cannot take, gets; under
  greedy verification the same as ``oracle`` by construction, replayed as a check).

Tokens per call here assume every call drafts; vLLM's measured figures also count the steps where the proposer
cut its chain by cost.
"""
from __future__ import annotations

import argparse
import json

import torch

from specdec.drafters.base import OUTCOMES, DecodeState, last_outcome
from specdec.drafters.ngrammys import NGrammysDrafter, best_chain
from specdec.kernels import ngram_match
from specdec.policies import NodeAcceptance
from specdec.tree import DraftTree

RULES = ("pld", "first", "best", "best-history", "oracle", "tree")


def accepted_prefix(draft: list[int], reply: list[int]) -> int:
    """How many leading tokens of ``draft`` (-1 padded) equal ``reply``'s."""
    n = 0
    for d, r in zip(draft, reply):
        if d < 0 or d != r:
            break
        n += 1
    return n


def tree_accepted(tree: DraftTree, reply: list[int]) -> int:
    """Row 0's accepted depth when the whole trie is verified against ``reply``."""
    parents, valid, tokens = tree.parents[0].tolist(), tree.valid[0].tolist(), tree.tokens[0].tolist()
    node, depth = 0, 0
    while depth < len(reply):
        nxt = [i for i in range(1, len(parents)) if valid[i] and parents[i] == node and tokens[i] == reply[depth]]
        if not nxt:
            break
        node, depth = nxt[0], depth + 1
    return depth


def replay(records, drafter: NGrammysDrafter, tables: list[NodeAcceptance], rule: str, k: int) -> dict:
    """Calls and emitted tokens of ``rule`` over the replies of ``records``; ``tables``: the acceptance
    estimates, one per outcome of the request's last chain (:func:`specdec.drafters.base.last_outcome`) for
    ``best-history``."""
    calls = emitted = 0
    per_category: dict[str, list[int]] = {}
    for rec in records:
        ids = [int(t) for t in rec.ids]
        outcome = 0
        pos = rec.prompt_len  # tokens known before the call; the reply's tokens from here are what the target emits
        while pos < len(ids):
            # the target's first reply token comes from the prompt's forward: decoding starts after it
            if pos == rec.prompt_len:
                pos += 1
                continue
            reply = ids[pos: pos + k]
            w = min(k, len(ids) - pos - 1)  # the call emits one token past its drafts
            seq = torch.tensor([ids[:pos]])
            lens = torch.tensor([pos])
            acc = 0
            if w > 0:
                if rule == "pld":
                    d, _, _, _ = ngram_match(seq, lens, 1, 4, 1, w)
                    acc = accepted_prefix(d[0, 0].tolist(), reply)
                else:
                    state = DecodeState(seq, lens, [pos])
                    drafts, source, rank = drafter.drafts(state, w)
                    if rule == "first":
                        acc = accepted_prefix(drafts[0, 0].tolist(), reply)
                    elif rule == "oracle":
                        acc = max(accepted_prefix(x, reply) for x in drafts[0].tolist())
                    elif rule == "tree":
                        tree, _, _ = DraftTree.from_drafts(state.roots, drafts, True)
                        acc = tree_accepted(tree, reply)
                    else:
                        acceptance = tables[outcome if rule == "best-history" else 0]
                        chain, _, cells, _ = best_chain(state.roots, drafts, source, rank, drafter.w,
                                                     acceptance.rates("cpu"))
                        n = int((chain[0] >= 0).sum())
                        acc = accepted_prefix(chain[0].tolist(), reply)
                        if n:
                            acceptance.update(cells[0, :n], torch.arange(n) < acc)
                        outcome = last_outcome(n, acc, outcome)
            calls += 1
            emitted += acc + 1
            per_category.setdefault(rec.category, [0, 0])
            per_category[rec.category][0] += 1
            per_category[rec.category][1] += acc + 1
            pos += acc + 1
    return {"calls": calls, "emitted": emitted, "tokens_per_call": round(emitted / max(1, calls), 3),
            "per_category": {c: round(e / n, 3) for c, (n, e) in sorted(per_category.items())}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replies", default="bench/dev_replies/smollm2-bf16")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--k", type=int, default=8, help="num_speculative_tokens: the longest chain a call verifies")
    p.add_argument("--slots", type=int, default=10, help="drafts per step the rules choose among (ngrammys' k)")
    p.add_argument("--rules", default=",".join(RULES))
    p.add_argument("--json", default=None)
    args = p.parse_args()
    from specdec.api import SpecDecoder
    from specdec.distill.corpus import Corpus
    from specdec.drafters.ngrammys import corpus_slots

    torch.set_num_threads(1)
    dec = SpecDecoder(args.model, dtype="bf16", compile="off")
    corpus = Corpus.load(args.replies)
    records = [r for s in corpus.shards("reply") if s["sampling"]["temperature"] == 0 for r in corpus.read(s["name"])]
    ngram_corpus = dec.ngram_corpus()
    c = corpus_slots(args.slots, ngram_corpus is not None)
    out = {"config": {"replies": args.replies, "k": args.k, "slots": args.slots, "corpus_slots": c,
                      "records": len(records)}, "rules": {}}
    for rule in args.rules.split(","):
        if rule not in RULES:
            raise SystemExit(f"unknown rule {rule!r}: one of {RULES}")
        drafter = NGrammysDrafter(dec.ngram_tables(), k=args.slots, w=args.k, corpus=ngram_corpus, c=c)
        tables = [NodeAcceptance(args.slots, args.k, corpus=c > 0) for _ in range(OUTCOMES)]
        out["rules"][rule] = replay(records, drafter, tables, rule, args.k)
        print(rule, json.dumps(out["rules"][rule]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
