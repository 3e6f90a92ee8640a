"""PEARL's go/no-go figures: can a draft loop run beside the target on this machine without slowing it?

Times the target's one-thread step (a 1-token and a ``gamma``-token chain forward over a real prompt) pinned to
core 0 in four settings, which take turns for ``--rounds`` rounds (so drift hits them alike):

- ``idle``: the other core idle;
- ``process``: a draft loop (one-token draft forwards, back to back) running in a second process pinned to core 1,
  one intra-op thread (what ``pearl`` does);
- ``thread``: the same draft loop in a Python thread of this process (one interpreter lock, torch's intra-op
  thread count set to 1 for both);
- ``2 threads``: the target alone at two intra-op threads (what the other methods get in the two-core bench).

and the draft's one-token step alone, beside the target and at two threads. Prints a table, writes JSON, and
prints what the measured costs predict for PEARL and for sequential ``sd`` at each draft acceptance rate::

    python -m bench.studies.pearl_overlap --dtype bf16 --out bench/results/pearl_overlap_bf16.json
    python -m bench.studies.pearl_overlap --from-json bench/results/pearl_overlap_bf16.json
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


def _draft_loop(name, dtype, linear, core, ready, go, stop, seconds, steps):
    """A second process: one-token draft forwards back to back while ``go`` is set (until ``stop``); adds their
    wall time and count to ``seconds`` and ``steps``."""
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    step = _draft_step(_runner(name, dtype, linear))
    with torch.inference_mode():
        step()
        ready.set()
        while not stop.is_set():
            if not go.wait(0.05):
                continue
            t0 = time.perf_counter()
            step()
            with seconds.get_lock():
                seconds.value += time.perf_counter() - t0
                steps.value += 1


class _ThreadLoop:
    """The same draft loop in a Python thread of this process, switched on and off."""

    def __init__(self, step):
        self.step, self.go, self.stop = step, threading.Event(), threading.Event()
        self.seconds, self.steps = 0.0, 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        with torch.inference_mode():
            while not self.stop.is_set():
                if not self.go.wait(0.05):
                    continue
                t0 = time.perf_counter()
                self.step()
                self.seconds += time.perf_counter() - t0
                self.steps += 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--draft", default="smollm2-draft")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--linear", default="auto")
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--iters", type=int, default=40, help="timed target steps per setting and size")
    p.add_argument("--rounds", type=int, default=8, help="the settings take turns this many times (drift in the "
                                                          "machine's speed then hits all of them alike)")
    p.add_argument("--out", default=None)
    p.add_argument("--from-json", default=None, help="print the table and the predictions of an earlier run")
    args = p.parse_args()
    if args.gamma < 2:
        raise SystemExit("--gamma must be >= 2 (the predictions interpolate between the 1- and gamma-token steps)")
    if args.from_json:
        with open(args.from_json) as f:
            report(json.load(f))
        return
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("needs two cores")
    os.sched_setaffinity(0, {cores[0]})
    torch.set_num_threads(1)
    target = _runner(args.model, args.dtype, args.linear)
    draft = _runner(args.draft, args.dtype, args.linear)
    trees = {1: DraftTree.chain(torch.tensor([7])), args.gamma: DraftTree.chain(torch.tensor([7]),
                                                                                torch.arange(8, 7 + args.gamma)[None])}
    step = _draft_step(draft)
    ctx = mp.get_context("spawn")
    ready, go, stop = ctx.Event(), ctx.Event(), ctx.Event()
    proc_s, proc_n = ctx.Value("d", 0.0), ctx.Value("i", 0)
    proc = ctx.Process(target=_draft_loop, args=(args.draft, args.dtype, args.linear, cores[1], ready, go, stop,
                                                 proc_s, proc_n), daemon=True)
    proc.start()
    ready.wait()
    thread = _ThreadLoop(step)
    settings = ("idle", "process", "thread", "2 threads")
    times: dict = {label: {n: [] for n in trees} for label in settings}
    draft_idle, draft_two = [], []
    per_round = max(1, args.iters // args.rounds)
    with torch.inference_mode():
        for tree in trees.values():
            target.forward_tree(tree)  # warm
        step()
        for _ in range(args.rounds):
            for label in settings:
                if label == "process":
                    go.set()
                elif label == "thread":
                    os.sched_setaffinity(0, set(cores[:2]))
                    thread.go.set()
                elif label == "2 threads":
                    os.sched_setaffinity(0, set(cores[:2]))
                    torch.set_num_threads(2)
                time.sleep(0.05)  # the loop beside is running
                for n, tree in trees.items():
                    times[label][n] += _time(lambda: target.forward_tree(tree), per_round)
                if label == "idle":
                    draft_idle += _time(step, per_round)
                if label == "2 threads":
                    draft_two += _time(step, per_round)
                go.clear()
                thread.go.clear()
                time.sleep(0.05)
                torch.set_num_threads(1)
                os.sched_setaffinity(0, {cores[0]})
    stop.set()
    thread.stop.set()
    proc.join()
    thread.thread.join()
    res: dict = {"config": vars(args) | {"torch": torch.__version__},
                 "target_ms": {label: {n: 1e3 * statistics.median(v) for n, v in row.items()}
                               for label, row in times.items()},
                 "draft_ms": {"idle": 1e3 * statistics.median(draft_idle),
                              "process": 1e3 * proc_s.value / max(proc_n.value, 1),
                              "thread": 1e3 * thread.seconds / max(thread.steps, 1),
                              "2 threads": 1e3 * statistics.median(draft_two)}}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    report(res)


def _cost(row: dict, n: int) -> float:
    """Seconds of a target forward over ``n`` tokens, linear through the measured 1- and gamma-token steps."""
    (n1, c1), (n2, c2) = sorted((int(k), v / 1e3) for k, v in row.items())
    return c1 + (c2 - c1) * (n - n1) / (n2 - n1)


def report(res: dict) -> None:
    """The measured table, and what it predicts: tokens/s of PEARL (target on one thread beside the draft
    process) and of sd (both on two threads, one after the other) per per-token acceptance ``alpha``, each at its
    best window or draft length (:func:`specdec.policies.planner.best_window`; sd's ``(1 - a^(k+1)) / (1 - a)``
    tokens per
    ``k`` draft forwards and one target forward over ``k + 1`` tokens)."""
    from specdec.policies.planner import best_window

    ms = res["target_ms"]
    sizes = sorted(int(n) for n in next(iter(ms.values())))
    print(f"target step (ms, median of {res['config']['iters']}), and the draft's one-token step (beside it; "
          "alone on 1 thread for idle, on 2 for 2 threads)")
    print(f"{'setting':<12}" + "".join(f"{f'{n} tok':>10}" for n in sizes) + f"{'draft ms':>10}")
    for label, row in ms.items():
        d = res["draft_ms"].get(label)
        print(f"{label:<12}" + "".join(f"{row[str(n)] if str(n) in row else row[n]:>10.2f}" for n in sizes)
              + (f"{d:>10.2f}" if d else f"{'-':>10}"))
    pearl_row = {str(k): v for k, v in ms["process"].items()}
    sd_row = {str(k): v for k, v in ms["2 threads"].items()}
    t_q, t_q2 = res["draft_ms"]["process"] / 1e3, res["draft_ms"]["2 threads"] / 1e3
    pearl_costs = [_cost(pearl_row, n) for n in range(1, 17)]
    print("\npredicted tokens/s (no prefill, no loop overhead) per per-token acceptance alpha")
    print(f"{'alpha':>6}{'pearl':>9}{'window':>8}{'sd 2thr':>9}{'length':>8}{'pearl/sd':>10}")
    for a in (0.27, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9):
        g = best_window(a, t_q, pearl_costs)
        stay = a ** g
        post = a / (1 - stay)
        rate = (1 + post * (1 - stay) / (1 - a)) / (max(g * t_q, pearl_costs[0]) + post * max(g * t_q, pearl_costs[g - 1]))
        sd = max(((1 - a ** (k + 1)) / (1 - a) / (k * t_q2 + _cost(sd_row, k + 1)), k) for k in range(1, 16))
        print(f"{a:>6.2f}{rate:>9.1f}{g:>8}{sd[0]:>9.1f}{sd[1]:>8}{rate / sd[0]:>9.2f}x")


if __name__ == "__main__":
    main()
