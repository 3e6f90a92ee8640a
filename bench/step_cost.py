"""The target's measured cost of one forward over T tree tokens, c(T), as the runtime calibrates it.

    python -m bench.step_cost --dtype bf16 --dtype fp32

The shape of c(T) decides what speculation can gain on a machine: where verifying T tokens costs about
one step (a CPU with native bf16 matrix units, a GPU) long drafts and wide trees pay; where it grows
linearly with T (bf16 on a CPU without bf16 instructions, whose bf16 GEMM for more than one row is a
slow fallback) no draft pays, and the cost-aware schedules stop drafting.
"""
from __future__ import annotations

import argparse
import json
import platform

import torch

from specdec.api import SpecDecoder
from specdec.linear import LINEAR_KERNELS
from specdec.policies import StepCost


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", action="append", default=None, help="fp32, bf16 or fp16 (repeatable)")
    ap.add_argument("--context", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--linear", default="auto", choices=list(LINEAR_KERNELS))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    out = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "context": args.context, "linear": args.linear,
           "ms": {}}
    for dtype in args.dtype or ["bf16", "fp32"]:
        dec = SpecDecoder(args.model, dtype=dtype, linear=args.linear)
        cost = StepCost.calibrate(dec.runner, context=args.context, repeats=args.repeats)
        out["ms"][dtype] = {t: round(v * 1000, 1) for t, v in cost.table.items()}
    sizes = sorted({t for row in out["ms"].values() for t in row})
    print(f"{out['cpu']}, {out['threads']} threads, {args.context}-token context, best of {args.repeats}, ms")
    print("| T | " + " | ".join(map(str, sizes)) + " |")
    print("|---|" + "---|" * len(sizes))
    for dtype, row in out["ms"].items():
        print(f"| {dtype} | " + " | ".join(f"{row[t]:.1f}" for t in sizes) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
