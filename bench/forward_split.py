"""Where a verification forward's extra time goes: one target forward over T tree tokens against one token.

    OMP_NUM_THREADS=1 python -m bench.forward_split --dtype bf16 --context 400 --sizes 1,6 --json out.json

With ``--compile`` a second runner over the same model runs its forwards through ``torch.compile``
(:class:`specdec.model.ModelRunner` ``compile=True``), and its whole forward is timed in the same rounds
(``compiled@T``), next to the eager runner's without hooks (``eager@T``; the ``forward`` column includes the
hooks' own cost); hooks would break its graph, so it gets no linear/rest split.

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
from specdec.model import ModelRunner
from specdec.tree import DraftTree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--context", type=int, default=400)
    ap.add_argument("--sizes", default="1,6")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--compile", action="store_true", help="also time a compiled runner's forwards")
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

    gen = torch.Generator().manual_seed(0)
    vocab = runner.config.vocab_size
    prompt = torch.randint(vocab, (1, args.context), generator=gen)
    parts = ["forward", "linears_in_forward", "linears_alone"]
    compiled = None
    if args.compile:
        compiled = ModelRunner(runner.model, compile=True)
        compiled.warm_up()  # before the hooks: they are not traced into its graphs
        parts += ["eager", "compiled"]
    for r in [runner] + ([compiled] if compiled else []):
        r.reset(1, args.context + max(sizes) + 1)
        r.prefill(prompt, torch.tensor([args.context]))

    def add_hooks():
        return [h for m in linears for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post))]

    hooks = add_hooks()
    best = {(part, t): float("inf") for t in sizes for part in parts}
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
                if compiled is not None:
                    for h in hooks:  # the compiled graphs were traced without them; keep it that way
                        h.remove()
                    for _ in range(args.repeats):  # both without hooks: they cost ~2 us each, 422 per forward
                        for part, r in (("eager", runner), ("compiled", compiled)):
                            s = time.perf_counter()
                            r.forward_tree(tree)
                            best[part, t] = min(best[part, t], time.perf_counter() - s)
                    hooks = add_hooks()
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
    print("T      forward  linears (in forward)  linears (alone)  rest of forward" + ("  eager (no hooks)  compiled" if compiled else ""))
    for t in sizes:
        f, li, la = (best[p, t] * 1e3 for p in ("forward", "linears_in_forward", "linears_alone"))
        extra = f"  {best['eager', t] * 1e3:16.1f}  {best['compiled', t] * 1e3:8.1f}" if compiled else ""
        print(f"{t:<6} {f:8.1f}  {li:20.1f}  {la:15.1f}  {f - li:15.1f}{extra}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"model": args.model, "dtype": args.dtype, "context": args.context,
                       "threads": torch.get_num_threads(), "ms": ms}, fh, indent=1)


if __name__ == "__main__":
    main()
