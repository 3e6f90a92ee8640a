"""PEARL's go/no-go figures: can a draft loop run beside the target on this machine without slowing it?

Times the target's one-thread step (a 1-token and a ``gamma``-token chain forward over a real prompt) pinned to
core 0 in four settings, side by side in one run:

- ``idle``: the other core idle;
- ``process``: a draft loop (one-token draft forwards, back to back) running in a second process pinned to core 1,
  one intra-op thread (what ``pearl`` does);
- ``thread``: the same draft loop in a Python thread of this process (one interpreter lock, torch's intra-op
  thread count set to 1 for both);
- ``2 threads``: the target alone at two intra-op threads (what the other methods get in the two-core bench).

and the draft's one-token step alone and beside the target. Prints a table and writes JSON::

    python -m bench.pearl_overlap --dtype bf16 --out bench/results/pearl_overlap_bf16.json
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import threading
import time

import torch

from specdec.hub import load_model
from specdec.model import ModelRunner
from specdec.tree import DraftTree

PROMPT = list(range(1000, 1100))  # 100 tokens of context: the dev prompts' median is about 120


def _runner(name: str, dtype: str, linear: str) -> ModelRunner:
    model, _ = load_model(name, dtype, "cpu", linear)
    runner = ModelRunner(model)
    runner.reset(1, len(PROMPT) + 64)
    ids = torch.tensor([PROMPT])
    runner.prefill(ids, torch.tensor([len(PROMPT)]))
    return runner


def _time(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _draft_step(runner: ModelRunner):
    tree = DraftTree.chain(torch.tensor([7]))
    return lambda: runner.forward_tree(tree)


def _draft_loop(name, dtype, linear, core, ready, stop, steps):
    """A second process: one-token draft forwards back to back until ``stop`` is set; counts them."""
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    step = _draft_step(_runner(name, dtype, linear))
    with torch.inference_mode():
        step()
        ready.set()
        t0, n = time.perf_counter(), 0
        while not stop.is_set():
            step()
            n += 1
    steps.value = (time.perf_counter() - t0) / max(n, 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--draft", default="smollm2-draft")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--linear", default="auto")
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("needs two cores")
    os.sched_setaffinity(0, {cores[0]})
    torch.set_num_threads(1)
    target = _runner(args.model, args.dtype, args.linear)
    draft = _runner(args.draft, args.dtype, args.linear)
    trees = {1: DraftTree.chain(torch.tensor([7])), args.gamma: DraftTree.chain(torch.tensor([7]),
                                                                                torch.arange(8, 7 + args.gamma)[None])}
    res: dict = {"config": vars(args) | {"torch": torch.__version__}, "target_ms": {}, "draft_ms": {}}

    def target_times(label):
        with torch.inference_mode():
            for n, tree in trees.items():
                target.forward_tree(tree)  # warm
                res["target_ms"].setdefault(label, {})[n] = 1e3 * statistics.median(
                    _time(lambda: target.forward_tree(tree), args.iters))

    with torch.inference_mode():
        step = _draft_step(draft)
        step()
        res["draft_ms"]["idle"] = 1e3 * statistics.median(_time(step, args.iters * 4))
    target_times("idle")

    ctx = mp.get_context("spawn")
    ready, stop, per = ctx.Event(), ctx.Event(), ctx.Value("d", 0.0)
    proc = ctx.Process(target=_draft_loop, args=(args.draft, args.dtype, args.linear, cores[1], ready, stop, per),
                       daemon=True)
    proc.start()
    ready.wait()
    target_times("process")
    stop.set()
    proc.join()
    res["draft_ms"]["process"] = 1e3 * per.value

    # The same loop in a thread: both threads on the two cores, one interpreter lock.
    os.sched_setaffinity(0, set(cores[:2]))
    flag, count = threading.Event(), [0, 0.0]

    def loop():
        with torch.inference_mode():
            t0 = time.perf_counter()
            while not flag.is_set():
                step()
                count[0] += 1
            count[1] = time.perf_counter() - t0

    th = threading.Thread(target=loop, daemon=True)
    th.start()
    target_times("thread")
    flag.set()
    th.join()
    res["draft_ms"]["thread"] = 1e3 * count[1] / max(count[0], 1)

    torch.set_num_threads(2)
    target_times("2 threads")
    torch.set_num_threads(1)

    print(f"target step (ms, median of {args.iters}; draft step idle {res['draft_ms']['idle']:.2f} ms)")
    print(f"{'setting':<12}" + "".join(f"{f'{n} tok':>10}" for n in trees) + f"{'draft ms':>10}")
    for label, row in res["target_ms"].items():
        d = res["draft_ms"].get(label)
        print(f"{label:<12}" + "".join(f"{row[n]:>10.2f}" for n in trees) + (f"{d:>10.2f}" if d else f"{'-':>10}"))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
