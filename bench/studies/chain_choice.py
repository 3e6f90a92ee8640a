"""Tokens per verification call of chain-choice rules, replayed on the target's greedy replies (no target runs).

    OMP_NUM_THREADS=1 python -m bench.studies.chain_choice --replies bench/dev_replies/smollm2-bf16 --k 8

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
  greedy verification the same as ``oracle`` by construction, replayed as a check);
- ``draft``: the draft with the most expected accepted tokens by a draft model's own probabilities (``--draft``,
  default the shipped ``smollm2-draft``), all drafts scored in one forward of the draft model per call over its
  cache of the reply so far (:func:`draft_probs`); what a proposer holding a small draft model could choose;
- ``features`` / ``features-cv``: the draft with the highest mean accepted length, by a table over richer per-draft
  features (source, rank, how many of the drafts share its first one and two tokens, how far it agrees with the
  continuation of the longest suffix match in the context, that match's length), fitted on the very replies it
  is scored on (``features``: in-sample, optimistic, though not a ceiling: another order of the same keys can do
  better) or on the other half of the replies (``features-cv``: two folds by record, the honest figure).

Tokens per call here assume every call drafts; vLLM's measured figures also count the steps where the proposer
cut its chain by cost.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from specdec.contracts import OUTCOMES, DecodeState, last_outcome
from specdec.drafters.ngrammys import NGrammysDrafter, best_chain
from specdec.kernels import ngram_match
from specdec.policies import NodeAcceptance
from specdec.tree import DraftTree

RULES = ("pld", "first", "best", "best-history", "oracle", "tree", "draft", "features", "features-cv")


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


def draft_probs(model, cache, new: list[int], drafts: list[list[int]]) -> list[list[float]]:
    """A causal LM's probability of every token of every draft, all drafts in one forward.

    model: a transformers causal LM; cache: its ``DynamicCache`` over the sequence so far, without ``new``;
    new: ``[n >= 1]`` tokens to append first (the last is the token the drafts continue); drafts: ``[D]``
    non-empty token lists. The drafts' tokens but their last attend to the cache, ``new`` and their own
    draft's earlier tokens (a 4-D mask), at the positions they would take; afterwards the cache holds ``new``
    and nothing of the drafts. Returns ``[D][len(draft)]``: ``p(draft[j] | sequence, new, draft[:j])``.
    """
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        raise ValueError("draft_probs needs SDPA attention: eager attention would add the boolean mask to the scores")
    past, n0 = cache.get_seq_length(), len(new)
    flat, rows = [], []  # rows[i][j]: the output row whose logits predict drafts[i][j]
    for d in drafts:
        start = n0 + len(flat)
        rows.append([n0 - 1] + [start + j for j in range(len(d) - 1)])
        flat += d[:-1]
    q = n0 + len(flat)
    visible = torch.zeros(q, past + q, dtype=torch.bool)
    visible[:, :past] = True
    visible[:n0, past:past + n0] = torch.ones(n0, n0, dtype=torch.bool).tril()
    visible[n0:, past:past + n0] = True
    positions = list(range(past, past + n0))
    for i, d in enumerate(drafts):
        first = rows[i][1] if len(d) > 1 else q
        for j, r in enumerate(rows[i][1:]):
            visible[r, past + first: past + r + 1] = True
            positions.append(past + n0 + j)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([new + flat]), attention_mask=visible[None, None],
                       position_ids=torch.tensor([positions]), past_key_values=cache, use_cache=True).logits[0]
    if flat:
        cache.crop(-len(flat))
    probs = logits.float().softmax(-1)
    return [[float(probs[r, t]) for r, t in zip(rows[i], d)] for i, d in enumerate(drafts)]


def expected_accepted(probs: list[float]) -> float:
    """Expected accepted length of a chain whose tokens are each right with ``probs`` given the ones before."""
    total, p = 0.0, 1.0
    for x in probs:
        p *= x
        total += p
    return total


def replay(records, drafter: NGrammysDrafter, tables: list[NodeAcceptance], rule: str, k: int,
           draft_model=None) -> dict:
    """Calls and emitted tokens of ``rule`` over the replies of ``records``; ``tables``: the acceptance
    estimates, one per outcome of the request's last chain (:func:`specdec.contracts.last_outcome`) for
    ``best-history``; ``draft_model``: the causal LM that scores drafts for ``draft``."""
    from transformers import DynamicCache

    calls = emitted = 0
    per_category: dict[str, list[int]] = {}
    scoring: list[float] = []  # seconds per draft-model forward (rule draft)
    for rec in records:
        ids = [int(t) for t in rec.ids]
        outcome = 0
        cache = DynamicCache(config=draft_model.config) if rule == "draft" else None
        scored = 0  # tokens of ids the draft model's cache holds
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
                    elif rule == "draft":
                        unique = []
                        for x in drafts[0].tolist():
                            x = [t for t in x if t >= 0]
                            if x and x not in unique:
                                unique.append(x)
                        if unique:
                            t0 = time.perf_counter()
                            probs = draft_probs(draft_model, cache, ids[scored:pos], unique)
                            scoring.append(time.perf_counter() - t0)
                            scored = pos
                            chosen = max(range(len(unique)), key=lambda i: (expected_accepted(probs[i]), -i))
                            acc = accepted_prefix(unique[chosen], reply)
                    else:
                        acceptance = tables[outcome if rule == "best-history" else 0]
                        chain, _, cells, _ = best_chain(state.roots, drafts, source, rank, drafter.w,
                                                     acceptance.estimate("cpu"))
                        n = int((chain[0] >= 0).sum())
                        acc = accepted_prefix(chain[0].tolist(), reply)
                        if n:
                            acceptance.observe(cells[0, :n], torch.arange(n) < acc)
                        outcome = last_outcome(n, acc, outcome)
            calls += 1
            emitted += acc + 1
            per_category.setdefault(rec.category, [0, 0])
            per_category[rec.category][0] += 1
            per_category[rec.category][1] += acc + 1
            pos += acc + 1
    out = {"calls": calls, "emitted": emitted, "tokens_per_call": round(emitted / max(1, calls), 3),
           "per_category": {c: round(e / n, 3) for c, (n, e) in sorted(per_category.items())}}
    if scoring:
        out["draft_forward_ms_median"] = round(1e3 * sorted(scoring)[len(scoring) // 2], 2)
    return out


def longest_match(ids: list[int], w: int, cap: int = 64) -> tuple[list[int], int]:
    """The ``w`` tokens after the earlier position whose preceding tokens match the end of ``ids`` longest
    (up to ``cap``; the most recent among equals), and that match's length (0 and [] without one)."""
    best_len, best_p = 0, -1
    for p in range(len(ids) - 2, -1, -1):
        n = 0
        while n < cap and p - n >= 0 and ids[p - n] == ids[len(ids) - 1 - n]:
            n += 1
        if n > best_len:
            best_len, best_p = n, p
    return (ids[best_p + 1: best_p + 1 + w], best_len) if best_p >= 0 else ([], 0)


def _bucket(n: int, edges: tuple[int, ...]) -> int:
    return sum(n > e for e in edges)


def draft_features(drafts: list[list[int]], source: list[int], rank: list[int], longest: tuple[list[int], int]):
    """One key per draft (None for an empty slot): (source, rank capped at 3, drafts sharing its first token
    capped at 4, sharing its first two capped at 3, tokens agreeing with the longest match's continuation capped
    at 3, that match's length bucketed)."""
    cont, n = longest
    keys = []
    for d, s, r in zip(drafts, source, rank):
        if d[0] < 0:
            keys.append(None)
            continue
        share1 = sum(x[0] == d[0] for x in drafts)
        share2 = sum(x[:2] == d[:2] for x in drafts) if len(d) > 1 and d[1] >= 0 else 0
        agree = accepted_prefix(d, cont)
        keys.append((s, min(r, 3), min(share1, 4), min(share2, 3), min(agree, 3), _bucket(n, (0, 1, 3, 6, 12))))
    return keys


def positions(records, drafter: NGrammysDrafter, k: int) -> list[list[tuple | None]]:
    """For each record, at every decode position: (per-draft keys, per-draft accepted lengths), or None where
    the call drafts nothing (the reply's last token)."""
    out = []
    for rec in records:
        ids = [int(t) for t in rec.ids]
        rows = []
        for pos in range(rec.prompt_len + 1, len(ids)):
            w = min(k, len(ids) - pos - 1)
            if w <= 0:
                rows.append(None)
                continue
            state = DecodeState(torch.tensor([ids[:pos]]), torch.tensor([pos]), [pos])
            drafts, source, rank = drafter.drafts(state, w)
            d = drafts[0].tolist()
            keys = draft_features(d, source[0].tolist(), rank[0].tolist(), longest_match(ids[:pos], w))
            rows.append((keys, [accepted_prefix(x, ids[pos: pos + k]) for x in d]))
        out.append(rows)
    return out


def fit_table(rows: list[list[tuple | None]]) -> dict[tuple, float]:
    """Mean accepted length per key over every position of ``rows`` (one pseudo-count at 0.5)."""
    sums: dict[tuple, list[float]] = {}
    for rec in rows:
        for row in rec:
            for key, acc in zip(*row) if row else ():
                if key is not None:
                    t = sums.setdefault(key, [0.5, 1])
                    t[0] += acc
                    t[1] += 1
    return {key: a / n for key, (a, n) in sums.items()}


def walk_table(rows: list[list[tuple | None]], table: dict[tuple, float]) -> tuple[int, int]:
    """Calls and emitted tokens when every call verifies the draft the table rates highest."""
    calls = emitted = 0
    for rec in rows:
        i = 0
        while i < len(rec):
            acc = 0
            if rec[i] is not None:
                keys, accs = rec[i]
                rated = [(table.get(key, 0.0), -j) for j, key in enumerate(keys) if key is not None]
                acc = accs[-max(rated)[1]] if rated else 0
            calls, emitted, i = calls + 1, emitted + acc + 1, i + acc + 1
    return calls, emitted


def features_rule(rows: list[list[tuple | None]], cross: bool) -> dict:
    if cross:
        a, b = rows[0::2], rows[1::2]
        (c1, e1), (c2, e2) = walk_table(a, fit_table(b)), walk_table(b, fit_table(a))
        calls, emitted = c1 + c2, e1 + e2
    else:
        calls, emitted = walk_table(rows, fit_table(rows))
    return {"calls": calls, "emitted": emitted, "tokens_per_call": round(emitted / max(1, calls), 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replies", default="bench/dev_replies/smollm2-bf16")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--k", type=int, default=8, help="num_speculative_tokens: the longest chain a call verifies")
    p.add_argument("--slots", type=int, default=10, help="drafts per step the rules choose among (ngrammys' k)")
    p.add_argument("--rules", default=",".join(RULES))
    p.add_argument("--draft", default="smollm2-draft", help="the draft model of rule draft")
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
    rules, rows = args.rules.split(","), None
    for rule in rules:
        if rule not in RULES:
            raise SystemExit(f"unknown rule {rule!r}: one of {RULES}")
    for rule in rules:
        drafter = NGrammysDrafter(dec.ngram_tables(), k=args.slots, w=args.k, corpus=ngram_corpus, c=c)
        if rule.startswith("features"):
            rows = rows or positions(records, drafter, args.k)
            out["rules"][rule] = features_rule(rows, rule == "features-cv")
        else:
            tables = [NodeAcceptance(args.slots, args.k, corpus=c > 0) for _ in range(OUTCOMES)]
            draft_model = None
            if rule == "draft":
                from specdec.hub import load_model

                draft_model = load_model(args.draft, dtype="bf16")[0]
                out["config"]["draft"] = args.draft
            out["rules"][rule] = replay(records, drafter, tables, rule, args.k, draft_model)
        print(rule, json.dumps(out["rules"][rule]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
