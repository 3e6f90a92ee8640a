"""Markdown tables from ``specdec bench --json`` files: overall and per category.

    python -m bench.report bench/results/issue4_compile_bf16.json
    python -m bench.report shard_a.json shard_b.json --out merged.json   # runs of several shards, merged

Shards are runs of the same methods over disjoint prompt sets (e.g. two one-thread processes, one per
core); their runs are pooled, and every ratio is still computed from runs interleaved within a process.
"""
from __future__ import annotations

import argparse
import json

from specdec.bench_summary import summarize


def reference_of(runs: list[dict]) -> str:
    """The method speedups are over: ``hf`` in specdec's bench files, ``vllm`` in vLLM's."""
    return "hf" if any(r["method"] == "hf" for r in runs) else "vllm"


def _x(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def markdown(result: dict) -> str:
    runs = result["runs"]
    cats = sorted({r["category"] for r in runs})
    methods = list(dict.fromkeys(r["method"] for r in runs))
    rows = ["| category | " + " | ".join(f"{m} speedup / tok per call" for m in methods) + " |",
            "|---|" + "---|" * len(methods)]
    ref = reference_of(runs)
    for cat in cats + ["overall"]:
        s = summarize([r for r in runs if cat == "overall" or r["category"] == cat], ref)
        cells = [f"{_x(s[m]['speedup'])}x / {_x(s[m]['tokens_per_call'])}" for m in methods]
        rows.append(f"| {cat} | " + " | ".join(cells) + " |")
    s = summarize(runs, ref)
    rows += ["", f"| method | tok/s | speedup over {ref} | tok/call | accept rate | identical |", "|---|---|---|---|---|---|"]
    for m in methods:
        acc = "-" if s[m]["accept_rate"] is None else f"{s[m]['accept_rate']:.2f}"
        ident = "-" if s[m]["identical_rate"] is None else f"{s[m]['identical_rate']:.0%}"
        rows.append(f"| {m} | {s[m]['tokens_per_second']:.1f} | {_x(s[m]['speedup'])}x | {_x(s[m]['tokens_per_call'])} "
                    f"| {acc} | {ident} |")
    acc = acceptance(runs, cats, [m for m in methods if s[m]["accept_rate"] is not None])
    alloc = allocation(runs, methods)
    pre = prefill_share(runs, methods)
    return "\n".join(rows + ([""] + acc if acc else []) + ([""] + alloc if alloc else []) + ([""] + pre if pre else []))


def prefill_share(runs: list[dict], methods: list[str]) -> list[str]:
    """For specdec's methods (which time their prefill): the prompt's share of the end-to-end time,
    which every method pays alike and which caps any end-to-end speedup."""
    rows = []
    for m in methods:
        rs = [r for r in runs if r["method"] == m and r.get("prefill_seconds") is not None]
        if rs:
            pre, total = sum(r["prefill_seconds"] for r in rs), sum(r["seconds"] for r in rs)
            rows.append(f"| {m} | {pre:.1f} | {total:.1f} | {pre / total:.0%} |")
    return ["| method | prefill s | total s | prefill share |", "|---|---|---|---|"] + rows if rows else []


def acceptance(runs: list[dict], cats: list[str], methods: list[str]) -> list[str]:
    """Per category: accepted / drafted tokens of each drafting method."""
    if not methods:
        return []
    rows = ["| category | " + " | ".join(f"{m} accept rate" for m in methods) + " |", "|---|" + "---|" * len(methods)]
    for cat in cats + ["overall"]:
        s = summarize([r for r in runs if cat == "overall" or r["category"] == cat])
        cells = ["-" if s[m]["accept_rate"] is None else f"{s[m]['accept_rate']:.3f}" for m in methods]
        rows.append(f"| {cat} | " + " | ".join(cells) + " |")
    return rows


SOURCE_KINDS = ("context", "store", "corpus", "recycle", "bigram")  # ngrammys' and hybrid's, as they rank them


def allocation(runs: list[dict], methods: list[str]) -> list[str]:
    """The per-source table of ngrammys and hybrid: draft nodes per call, and per source kind its share of the
    draft slots and the share of accepted tokens it produced (the paper's allocation ablation, and hybrid's)."""
    s = summarize(runs)
    rows, kinds = [], []
    allocs = {m: s[m].get("drafter", {}).get("allocation") for m in methods}
    allocs = {m: a for m, a in allocs.items() if a}
    kinds = [k for k in SOURCE_KINDS if any(f"{k}_slots" in a for a in allocs.values())]
    for m, a in allocs.items():
        rs = [r for r in runs if r["method"] == m]
        nodes = sum(r["drafted_tokens"] or 0 for r in rs) / max(1, sum(r["target_calls"] for r in rs))
        slots = sum(a.get(f"{k}_slots", 0) for k in kinds)
        accepted = sum(a.get(f"{k}_accepted", 0) for k in kinds)
        cells = [f"{a.get(f'{k}_slots', 0) / max(1, slots):.0%} / {a.get(f'{k}_accepted', 0) / max(1, accepted):.0%}"
                 for k in kinds]
        rows.append(f"| {m} | {nodes:.1f} | " + " | ".join(cells) + " |")
    head = ["| method | draft nodes per call | " + " | ".join(f"{k}: slots / accepted" for k in kinds) + " |",
            "|---" * (2 + len(kinds)) + "|"]
    return head + rows if rows else []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="+")
    ap.add_argument("--out", default=None, help="write the merged bench JSON here")
    args = ap.parse_args()
    parts = []
    for path in args.json:
        with open(path) as f:
            parts.append(json.load(f))
    runs = [r for p in parts for r in p["runs"]]
    merged = {"config": {**parts[0]["config"], "shards": len(parts)}, "runs": runs, "summary": summarize(runs, reference_of(runs))}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(merged, f, indent=1)
    print(markdown(merged))


if __name__ == "__main__":
    main()
