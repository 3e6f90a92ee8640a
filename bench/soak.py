"""Soak: every method on one long sampled generation of a batch, watched for leaks and slowdowns.

For each method, one ``generate_ids`` call decodes ``--batch-size`` dev prompts for ``--max-new-tokens`` new
tokens each, sampled, with EOS ignored (every row runs to the end). A monitor thread samples, every
``--every`` seconds, the process's resident memory and the target runner's committed length (the runner owns
it, so the decode loop is not touched), which gives the run's speed over time. Per method it reports:

- ``rss_growth``: resident memory at the end of the run over resident memory once the first quarter of the
  tokens is decoded (after warm-up: caches allocated, pools grown); flat means within 5%.
- ``speed_ratio``: new tokens per second over the last quarter of the run over the first quarter. The context is
  longer at the end, and at 16 rows of 4,000 tokens reading the KV cache costs more than reading the weights, so
  plain decoding slows down too: steady means within 10% of ``ar``'s ratio in the same run (``speed_vs_ar``; ``ar``
  runs first), or of 1 where ``ar`` is not run.
- ``workers``: child processes alive a second after the call (multiprocessing's resource tracker aside): PEARL's
  draft worker stays for the decoder's next call, one at most; after ``SpecDecoder.close()`` at the end none may
  be left (``workers_left_after_close``).

    OMP_NUM_THREADS=2 python -m bench.soak --draft smollm2-draft --batch-size 16 --max-new-tokens 4000 \\
        --json bench/results/soak.json
"""
from __future__ import annotations

import argparse
import json
import os
import threading
import time

from bench.memory import rss

MAX_RSS_GROWTH = 0.05  # the bar: resident memory flat within 5% after warm-up
MIN_SPEED_RATIO = 0.90  # last quarter within 10% of the first


def workers() -> list[int]:
    """Pids of this process's live child processes (zombies excluded), but for multiprocessing's resource tracker,
    which lives until the interpreter exits by design."""
    me, out = os.getpid(), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] != "Z" and b"multiprocessing.resource_tracker" not in cmdline:
            out.append(int(pid))
    return out


class Monitor:
    """Samples ``(seconds, resident bytes, progress)`` in a thread; progress is the longest committed length seen so
    far (finished rows leave the batch, so the current longest can shrink near the end)."""

    def __init__(self, runner, every: float):
        self.runner, self.every, self.samples, self._seen = runner, every, [], 0

    def __enter__(self):
        self._stop, self._t0 = False, time.perf_counter()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        self._seen = max(self._seen, max(self.runner.lengths_host, default=0))
        self.samples.append((time.perf_counter() - self._t0, rss(), self._seen))

    def _run(self) -> None:
        while not self._stop:
            self._sample()
            time.sleep(self.every)

    def __exit__(self, *exc):
        self._stop = True
        self._thread.join()
        self._sample()


def quarters(samples: list[tuple[float, int, int]], start: int) -> dict:
    """Speed and memory of a run from its samples; ``start``: the progress when decoding began (the longest prompt),
    so the quarters are those of the new tokens."""
    end = samples[-1][2]

    def at(frac: float) -> tuple[float, int, int]:  # the first sample at or past that share of the new tokens
        goal = start + frac * (end - start)
        return next(s for s in samples if s[2] >= goal)

    q1, q3, last = at(0.25), at(0.75), at(1.0)
    first = next(s for s in samples if s[2] > start)
    speed_first = (q1[2] - first[2]) / max(q1[0] - first[0], 1e-9)
    speed_last = (last[2] - q3[2]) / max(last[0] - q3[0], 1e-9)
    return {"tokens_per_s_first_quarter": round(speed_first, 2), "tokens_per_s_last_quarter": round(speed_last, 2),
            "speed_ratio": round(speed_last / speed_first, 3) if speed_first else None,
            "rss_after_first_quarter_mb": round(q1[1] / 1e6, 1), "rss_end_mb": round(samples[-1][1] / 1e6, 1),
            "rss_growth": round(samples[-1][1] / q1[1] - 1, 4)}


def soak(dec, method: str, prompts: list[list[int]], max_new: int, seed: int, every: float,
         reference: float | None = None) -> dict:
    """One soak run of ``method`` (see the module docstring); ``reference``: ``ar``'s speed ratio in the same run."""
    from specdec.methods import parse_label
    from specdec.verify import SamplingConfig

    name, own = parse_label(method)
    sampling = SamplingConfig(temperature=1.0, seed=seed)
    dec.generate_ids(prompts[:1], name, 8, sampling, **own)  # warm-up: first-call initialisation, not the soak's
    start = max(len(p) for p in prompts)
    dec.runner.release()  # no lengths left from the warm-up: progress starts at 0
    rss_start = rss()
    with Monitor(dec.runner, every) as mon:
        res = dec.generate_ids(prompts, name, max_new, sampling, **own)
    time.sleep(1.0)
    out = {"method": method, "rows": len(prompts), "new_tokens": sum(len(t) for t in res.tokens),
           "seconds": round(mon.samples[-1][0], 2), "samples": len(mon.samples), "rss_start_mb": round(rss_start / 1e6, 1),
           "target_cache_mb": round(dec.runner.cache_bytes() / 1e6, 1),
           **quarters(mon.samples, start), "workers": len(workers()),
           # what the method did: its steps, draft tokens verified and accepted, and its governor's step kinds
           "steps": res.stats.steps, "drafted_tokens": res.stats.drafted_tokens,
           "accepted_tokens": res.stats.accepted_tokens, "governor": (res.stats.drafter or {}).get("governor")}
    return judge(out, reference)


def judge(run: dict, reference: float | None) -> dict:
    """``run`` with its ``speed_vs_ar`` (its speed ratio over ``reference``, ``ar``'s) and ``ok``: memory flat,
    speed steady (against ``ar``'s slowdown where given), at most one worker left."""
    run["speed_vs_ar"] = round(run["speed_ratio"] / reference, 3) if reference and run["speed_ratio"] else None
    steady = run["speed_vs_ar"] if reference else run["speed_ratio"]
    run["ok"] = run["rss_growth"] <= MAX_RSS_GROWTH and (steady or 0) >= MIN_SPEED_RATIO and run["workers"] <= 1
    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--draft", default=None, help="a draft model, for the draft-model methods (else they are skipped)")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--compile", default="off", choices=["auto", "on", "off"])
    p.add_argument("--methods", default=None, help="comma list (default: every registered method that can run)")
    p.add_argument("--prompts", default="bench/dev_prompts.jsonl")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=4000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--every", type=float, default=0.25, help="seconds between samples")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    from specdec import methods as registry
    from specdec.api import SpecDecoder
    from specdec.bench import without_eos
    from specdec.bench_summary import cpu_name
    from specdec.prompts import read_prompts

    dec = SpecDecoder(args.model, draft=args.draft, dtype=args.dtype, compile=args.compile)
    dec.wait_compiled()
    labels = args.methods.split(",") if args.methods else [
        m for m in registry.names() if args.draft is not None or not registry.get(m).needs_draft]
    prompts = [p.ids for p in read_prompts(args.prompts, dec)[: args.batch_size]]
    out = {"config": {"model": args.model, "draft": args.draft, "dtype": args.dtype, "compile": dec.compiled,
                      "batch_size": len(prompts), "max_new_tokens": args.max_new_tokens, "cpu": cpu_name(),
                      "threads": __import__("torch").get_num_threads()}, "runs": []}
    labels = sorted(labels, key=lambda m: m != "ar")  # ar first: the others' slowdowns read against its own
    reference = None
    with without_eos(dec):  # every row runs to --max-new-tokens
        for label in labels:
            run = soak(dec, label, prompts, args.max_new_tokens, args.seed, args.every, reference)
            if label == "ar":  # the reference: steady against itself
                reference = judge(run, run["speed_ratio"])["speed_ratio"]
            out["runs"].append(run)
            print(f"{label:<12} {run['new_tokens']:>7} tokens {run['seconds']:>8.1f} s  speed last/first quarter "
                  f"{run['speed_ratio']} (over ar's {run['speed_vs_ar']})  "
                  f"RSS {run['rss_start_mb']} | {run['rss_after_first_quarter_mb']} -> {run['rss_end_mb']} MB "
                  f"({100 * run['rss_growth']:+.1f}%)  workers {run['workers']}  {'ok' if run['ok'] else 'FAIL'}", flush=True)
            write(out, args.json)  # after every method: a long soak keeps what it measured
    dec.close()
    time.sleep(1.0)
    out["workers_left_after_close"] = len(workers())
    print(f"worker processes left after SpecDecoder.close(): {out['workers_left_after_close']}")
    write(out, args.json)


def write(out: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
