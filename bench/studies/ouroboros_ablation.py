"""Ouroboros' ablation (the paper's Table 4) on this target, and its end-to-end rows, from one bench run.

The rows add the paper's parts one at a time to ``sd`` at the same draft length (3): phrase drafting (the
lookahead window and pool phrases in the draft's forwards), lengthening (pool phrases after the draft),
phrases from verification, history (the pool kept across prompts: every earlier prompt of the run warms it).
Then the defaults (one chain token, phrases after the root and every chain token, committed text feeding
the pool, cost planning, no lookahead window: each chosen by measurement), cold and warm. Every row is
measured in the same run as ``hf``, ``ar``, the best static ``sd`` and ``ngrammys``::

    python -m bench.studies.ouroboros_ablation --shard 0/2 --json /tmp/abl_0.json & \\
    python -m bench.studies.ouroboros_ablation --shard 1/2 --json /tmp/abl_1.json; wait
    python -m bench.report /tmp/abl_0.json /tmp/abl_1.json --out bench/results/ouroboros_bf16_96p.json
    python -m bench.studies.ouroboros_ablation --from-json bench/results/ouroboros_bf16_96p.json

Per row: speed over ``hf``, ``ar`` and ``sd``; tokens per target call; draft forwards per target call; pool
hit rate (lengthening lookups that found a phrase); P(A = gamma) (steps whose whole chain was accepted);
phrase tokens accepted per appended phrase node.
"""
from __future__ import annotations

from bench.studies.grid_common import grid_parser, load_or_run

SD = "sd:draft_length=1"  # the best static sd with this draft
# The paper's ablation at one draft length for every row (3: the walk and the phrases after d_gamma both get
# a chance; the paper's own rows use gamma = 12 with a 6B draft), against sd at that length.
PAPER = "ouroboros:gamma=3:k=3:attach=last:context=0:schedule=static"
ROWS = [
    (SD, "sd, 1 token (the best static sd)"),
    ("sd:draft_length=3", "sd, 3 tokens (the paper's baseline: same gamma)"),
    (f"{PAPER}:lookahead=1:lengthen=0:verification=0:history=0", "+ phrase drafting"),
    (f"{PAPER}:lookahead=1:lengthen=1:verification=0:history=0", "+ lengthening"),
    (f"{PAPER}:lookahead=1:lengthen=1:verification=1:history=0", "+ phrases from verification"),
    (f"{PAPER}:lookahead=1:lengthen=1:verification=1:history=1", "+ history (the paper's method)"),
    ("ouroboros:history=0", "defaults, cold pool (every generation starts empty)"),
    ("ouroboros", "defaults, warm pool (kept across the run's prompts)"),
]
PEERS = ["ar", "ngrammys"]


def table(result: dict) -> str:
    s = result["summary"]
    hf, ar, sd = (s[x]["tokens_per_second"] for x in ("hf", "ar", SD))
    lines = ["| row | label | over `hf` | over `ar` | over `sd` | tokens per call | draft forwards per call | "
             "pool hit rate | P(A = gamma) | accepted per phrase node |", "|" + "---|" * 10]
    runs = result["runs"]
    for label, name in ROWS + [(p, p) for p in PEERS if p in s]:
        if label not in s:
            continue
        mine = [r for r in runs if r["method"] == label]
        calls = sum(r["target_calls"] for r in mine)
        drafts = sum(r["draft_calls"] for r in mine)
        d = s[label].get("drafter") or {}
        o = d.get("ouroboros", {})
        hit = f"{o['lookup_hits'] / o['lookups']:.2f}" if o.get("lookups") else "-"
        full = f"{o['full_accepts'] / o['rows']:.2f}" if o.get("rows") else "-"
        per_node = f"{o['phrase_tokens_accepted'] / o['phrase_nodes']:.3f}" if o.get("phrase_nodes") else "-"
        tps = s[label]["tokens_per_second"]
        lines.append(f"| {name} | `{label}` | {tps / hf:.2f}x | {tps / ar:.2f}x | {tps / sd:.2f}x | "
                     f"{s[label]['tokens_per_call']:.2f} | {drafts / calls:.2f} | {hit} | {full} | {per_node} |")
    return "\n".join(lines)


def main() -> None:
    ap = grid_parser(__doc__, max_new_tokens=128)
    ap.set_defaults(per_category=12)
    args = ap.parse_args()
    result = load_or_run(args, [label for label, _ in ROWS] + PEERS, draft="smollm2-draft", compile="off")
    print(table(result))


if __name__ == "__main__":
    main()
