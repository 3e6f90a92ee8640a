"""Where a verification forward's extra time goes: one target forward over T tree tokens against one token.

    OMP_NUM_THREADS=1 python -m bench.forward_split --dtype bf16 --context 400 --sizes 1,6 --json out.json

For each tree size T (a chain of T tokens after a ``--context``-token prompt) this times, best of ``--repeats``
forwards, the whole forward, the linear layers inside it (forward hooks around every specdec linear) and the
same linear layers called back to back outside the model. The rest of the forward is attention and the
model's other ops. Sizes are interleaved round by round, so drift in machine speed spreads over all of them;
the best of each size over all rounds is reported. What a speculative call costs more than a one-token step is
what the drafts must pay for: the growth from T = 1, split into its parts.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from specdec.api import SpecDecoder
from specdec.linear import SkinnyLinear
from specdec.tree import DraftTree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--context", type=int, default=400)
    ap.add_argument("--sizes", default="1,6")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    sizes = [int(t) for t in args.sizes.split(",")]
    dec = SpecDecoder(args.model, dtype=args.dtype, corpus=None)
    runner = dec.runner
    linears = [m for m in runner.model.modules() if isinstance(m, SkinnyLinear)]
    if not linears:
        raise SystemExit("no specdec linear layers in this model (--linear torch?)")
    spent = [0.0]
    started: dict[int, float] = {}

    def pre(module, _):
        started[id(module)] = time.perf_counter()

    def post(module, _, __):
        spent[0] += time.perf_counter() - started[id(module)]

    hooks = [h for m in linears for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post))]
    gen = torch.Generator().manual_seed(0)
    vocab = runner.config.vocab_size
    runner.reset(1, args.context + max(sizes) + 1)
    runner.prefill(torch.randint(vocab, (1, args.context), generator=gen), torch.tensor([args.context]))
    best = {(part, t): float("inf") for t in sizes for part in ("forward", "linears_in_forward", "linears_alone")}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for t in sizes:
                tree = DraftTree.chain(torch.randint(vocab, (1,), generator=gen),
                                       torch.randint(vocab, (1, t - 1), generator=gen))
                for _ in range(args.repeats):  # the KV is written at the same offset every time: nothing is committed
                    spent[0] = 0.0
                    s = time.perf_counter()
                    runner.forward_tree(tree)
                    best["forward", t] = min(best["forward", t], time.perf_counter() - s)
                    best["linears_in_forward", t] = min(best["linears_in_forward", t], spent[0])
                xs = {k: torch.randn(1, t, k, generator=gen).to(linears[0].weight.dtype) for k in {m.in_features for m in linears}}
                for _ in range(args.repeats):
                    spent[0] = 0.0
                    for m in linears:
                        m(xs[m.in_features])
                    best["linears_alone", t] = min(best["linears_alone", t], spent[0])
    for h in hooks:
        h.remove()
    ms = {f"{part}@{t}": round(v * 1e3, 2) for (part, t), v in best.items()}
    print(f"{args.model} {args.dtype}, {args.context}-token context, {torch.get_num_threads()} thread(s), "
          f"best of {args.rounds} x {args.repeats}, ms")
    print("T      forward  linears (in forward)  linears (alone)  rest of forward")
    for t in sizes:
        f, li, la = (best[p, t] * 1e3 for p in ("forward", "linears_in_forward", "linears_alone"))
        print(f"{t:<6} {f:8.1f}  {li:20.1f}  {la:15.1f}  {f - li:15.1f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"model": args.model, "dtype": args.dtype, "context": args.context,
                       "threads": torch.get_num_threads(), "ms": ms}, fh, indent=1)


if __name__ == "__main__":
    main()
