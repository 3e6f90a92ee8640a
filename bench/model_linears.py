"""The linear layers of one target forward over M rows, alone: every weight of the model through the packed kernel.

    OMP_NUM_THREADS=1 python -m bench.model_linears --dtype bf16 --rows 1,2,4,5,6,8,12 --json out.json

A verification of M tree tokens multiplies M rows through every weight (SmolLM2-135M: 211 of them, 270 MB in bf16,
read from DRAM once per forward). This times exactly that, without the model's other ops, best of ``--repeats``,
with the rows' sizes interleaved so that drift in machine speed spreads over all of them. To compare two builds
of the extension, run it once per build, alternating, a few times.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from specdec.hub import load_model
from specdec.linear import SkinnyLinear


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--rows", default="1,2,4,5,6,8,12")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    model, _ = load_model(args.model, args.dtype, linear="packed")
    layers = [m for m in model.modules() if isinstance(m, SkinnyLinear)]
    op = torch.ops.specdec.packed_linear
    dtype = layers[0].weight.dtype
    best = {m: float("inf") for m in rows}
    with torch.inference_mode():
        for _ in range(args.repeats):
            for m in rows:
                xs = {k: torch.randn(m, k, dtype=dtype) for k in {lin.in_features for lin in layers}}
                t = time.perf_counter()
                for lin in layers:
                    op(xs[lin.in_features], lin.packed_weight(), lin.out_features, lin.bias)
                best[m] = min(best[m], time.perf_counter() - t)
    mb = sum(lin.weight.numel() * lin.weight.element_size() for lin in layers) / 2**20
    out = {"model": args.model, "dtype": args.dtype, "threads": torch.get_num_threads(), "layers": len(layers),
           "weight_mib": round(mb, 1), "ms": {m: round(v * 1e3, 2) for m, v in best.items()}}
    print(f"{len(layers)} weights, {mb:.0f} MiB, {out['threads']} threads, best of {args.repeats}, ms: "
          + "  ".join(f"M={m}: {v:.1f}" for m, v in out["ms"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
