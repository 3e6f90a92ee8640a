"""Where each thread's time goes in the compiled one-token decode step: kernels, host code, idle waits.

Runs the target's one-token step (``ModelRunner.forward_tree`` on a one-node tree, the `ar` step) in a loop for
``--seconds`` while ``perf record -e cpu-clock`` (a software clock: no PMU needed, as in a VM) samples this
process, then splits each thread's samples by where they landed: the quantized-weight kernels (4-bit and 8-bit),
tree attention, inductor's fused kernels, OpenMP waits (the worker spinning while the main thread runs serial
code, or either thread at a barrier), Python and the host libraries; the JSON adds each thread's top symbols and
sample count. Milliseconds per step: a thread's share of its own samples times the step (a thread that slept
instead of spinning would read short; OpenMP's workers spin between parallel regions)::

    OMP_NUM_THREADS=2 python -m bench.studies.step_threads --seconds 10 --json bench/results/step_threads_zen3.json

Needs ``perf`` on PATH (``linux-perf``); the first run on a machine compiles the step's graphs (minutes).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time

import torch

# (category, test on the symbol and library of a sample), first match wins.
CATEGORIES = [
    ("4-bit weight kernel", lambda sym, lib: "run<4," in sym and lib.startswith("_C.")),
    ("8-bit weight kernel", lambda sym, lib: "run<8," in sym and lib.startswith("_C.")),
    ("tree attention", lambda sym, lib: "attend" in sym and lib.startswith("_C.")),
    ("specdec ops, host side", lambda sym, lib: lib.startswith("_C.")),
    ("inductor fused kernels", lambda sym, lib: "cpp_fused" in sym),
    ("inductor wrapper", lambda sym, lib: lib.endswith("main.so")),
    ("OpenMP waits", lambda sym, lib: lib.startswith("libgomp") or lib.startswith("libomp")),
    ("Python", lambda sym, lib: lib.startswith("libpython") or lib.startswith("libtorch_python")),
    ("libtorch (dispatch, AOTI shims, math)", lambda sym, lib: lib.startswith("libtorch_cpu") or lib.startswith("libc10")),
    ("libc (malloc, memset)", lambda sym, lib: lib.startswith("libc.so")),
]
TOP_SYMBOLS = 40  # per thread, in the JSON
SAMPLE = re.compile(r"^\s*(\d+)\s+[0-9a-f]+\s+(.*?)\s+\(([^()]*(?:\([^()]*\))?)\)\s*$")  # "(lib.so (deleted))" too


def classify(sym: str, lib: str) -> str:
    """The category of one sample (``other`` where none matches)."""
    for name, test in CATEGORIES:
        if test(sym, lib):
            return name
    return "other"


def split_samples(script: str, symbols: dict[int, collections.Counter] | None = None) -> dict[int, collections.Counter]:
    """Per thread id, samples per category, from ``perf script -F tid,ip,sym,dso`` output; with ``symbols``, also
    fills it with each thread's samples per symbol."""
    out: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in script.splitlines():
        m = SAMPLE.match(line)
        if m:
            tid, sym, dso = m.groups()
            out[int(tid)][classify(sym, os.path.basename(dso.split(" (")[0]))] += 1
            if symbols is not None:
                symbols.setdefault(int(tid), collections.Counter())[sym] += 1
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    ap.add_argument("--context", type=int, default=200, help="tokens in the cache before the timed steps")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    perf = shutil.which("perf")
    if perf is None:
        raise SystemExit("step_threads needs `perf` on PATH (e.g. apt install linux-perf)")
    from specdec.api import SpecDecoder
    from specdec.bench_summary import cpu_name
    from specdec.tree import DraftTree

    runner = SpecDecoder(args.model, dtype=args.dtype, compile="on", corpus=None).runner
    gen = torch.Generator().manual_seed(0)
    vocab = runner.config.vocab_size
    runner.reset(1, args.context + 64 + int(args.seconds * 400))
    runner.prefill(torch.randint(vocab, (1, args.context), generator=gen), torch.tensor([args.context]))
    tree = DraftTree.chain(torch.randint(vocab, (1,), generator=gen), torch.zeros(1, 0, dtype=torch.long))
    with torch.inference_mode():
        for _ in range(50):  # first calls: graph loads, allocator warm-up
            runner.forward_tree(tree)
        main_tid = threading.get_native_id()
        with tempfile.TemporaryDirectory() as tmp:
            data = os.path.join(tmp, "perf.data")
            rec = subprocess.Popen([perf, "record", "-q", "-e", "cpu-clock", "-F", "2000", "-p", str(os.getpid()),
                                    "-o", data, "--", "sleep", str(args.seconds)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            time.sleep(0.5)  # perf attaches
            steps, start = 0, time.perf_counter()
            while rec.poll() is None:
                runner.forward_tree(tree)
                steps += 1
            wall = time.perf_counter() - start
            if steps == 0:
                raise SystemExit("perf record ended before a step ran: " + rec.stderr.read().decode()[-500:])
            if rec.returncode != 0:
                raise SystemExit(f"perf record failed: {rec.stderr.read().decode()[-500:]}")
            script = subprocess.run([perf, "script", "-i", data, "-F", "tid,ip,sym,dso"], check=True,
                                    capture_output=True, text=True).stdout
    step_ms = wall / steps * 1e3
    symbols: dict[int, collections.Counter] = {}
    threads = split_samples(script, symbols)
    result = {"cpu": cpu_name(), "threads": torch.get_num_threads(),
              "model": args.model, "dtype": args.dtype, "context": args.context, "steps": steps,
              "step_ms": step_ms, "per_thread": {}, "top_symbols": {}}
    print(f"{steps} one-token steps, {step_ms:.2f} ms a step ({args.model}, {args.dtype}, context {args.context}, "
          f"{torch.get_num_threads()} threads); ms a step by where each thread was:")
    for tid, counts in sorted(threads.items(), key=lambda kv: kv[0] != main_tid):
        total = sum(counts.values())
        if total < 0.05 * max(sum(c.values()) for c in threads.values()):
            continue  # a thread that hardly ran (perf's own, a Python helper)
        name = "main" if tid == main_tid else f"worker {tid}"
        ms = {cat: n / total * step_ms for cat, n in counts.most_common()}
        result["per_thread"][name] = ms
        result.setdefault("samples", {})[name] = total
        result["top_symbols"][name] = {sym: n / total * step_ms for sym, n in symbols[tid].most_common(TOP_SYMBOLS)}
        print(f"  {name}: " + ", ".join(f"{cat} {v:.2f}" for cat, v in ms.items() if v >= 0.01))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
