"""The memory a generation needs: specdec's estimate against the peak measured, per batch size.

Each batch size runs in a fresh process (so memory freed by an earlier run cannot hide a peak; glibc maps
every allocation past 64 KiB on its own there, so resident memory follows what is live): load the model,
warm up on one short prompt, then one ``generate_ids`` call over the first ``B`` dev prompts while a
thread samples the process's resident memory every millisecond. The measured figure is the peak less the
resident memory just before the call; the estimate is :func:`specdec.memory.estimate` for the same call::

    python -m bench.memory --batches 1,16,64 --method pld --dtype fp32 --json bench/results/memory_estimate.json

``--forwards 16x128,4x512`` measures instead the one factor the estimate takes from measurement, a prompt
forward's transient per token (:data:`specdec.memory.FORWARD_BYTES`), on single forwards, so that every
generation's peak checks the estimate out of sample. ``--live`` finds what a peak holds: the Python stack and the
largest tensors alive at the last new peak that were not alive before the call.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import threading
import time
import traceback


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Samples resident memory in a thread while the ``with`` body runs; ``peak`` holds the largest. With
    ``live``, each new peak (``LIVE_STEP`` past the last one recorded) also records where the main thread was
    (its Python stack) and the largest tensors alive then that were not alive on entry (:func:`live_tensors`):
    ``where`` holds the last."""

    LIVE_STEP = 4 << 20

    def __init__(self, live: bool = False):
        self.live, self.where = live, None

    def __enter__(self):
        self.peak, self._stop = rss(), False
        self._main = threading.get_ident()
        self._noted = self.peak
        self._before = {t["ptr"] for t in live_tensors(top=None)} if self.live else set()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop:
            now = rss()
            self.peak = max(self.peak, now)
            if self.live and now > self._noted + self.LIVE_STEP:
                try:
                    self.where = self._note(now)
                except Exception as e:  # a diagnostic must not end the sampling
                    self.where = {"rss_bytes": now, "stack": [], "tensors": [], "error": repr(e)}
                self._noted = max(now, rss())  # the listing's own memory is no new peak
            time.sleep(0.001)

    def _note(self, now: int) -> dict:
        frame = sys._current_frames().get(self._main)
        stack = [f"{fs.filename.split('site-packages/')[-1]}:{fs.lineno} {fs.name}"
                 for fs in traceback.extract_stack(frame)][-16:] if frame is not None else []
        return {"rss_bytes": now, "stack": stack, "tensors": live_tensors(exclude=self._before)}

    def __exit__(self, *exc):
        self._stop = True
        self._thread.join()
        self.peak = max(self.peak, rss())


def live_tensors(top: int | None = 12, exclude: set[int] = frozenset()) -> list[dict]:
    """The ``top`` (None: all) largest CPU tensor storages alive (reachable from Python) but those whose address is
    in ``exclude``, largest first: address, bytes, shape and dtype of one tensor on each, and how many tensors share
    it. Tensors an operator holds mid-call are not listed."""
    import torch

    seen: dict[int, dict] = {}
    # type(), not isinstance: isinstance reads __class__, which raises on a dead weak proxy and warns on deprecated
    # torch objects (and the warnings filters are not the sampler thread's to change)
    tensors = [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)]
    for obj in tensors:
        try:
            if obj.device.type != "cpu":
                continue
            st = obj.untyped_storage()
            key = st.data_ptr()
            if key in exclude:
                continue
            if key in seen:
                seen[key]["views"] += 1
            else:
                seen[key] = {"ptr": key, "bytes": st.nbytes(), "shape": list(obj.shape), "dtype": str(obj.dtype),
                             "views": 1}
        except Exception:  # a tensor subclass without real storage (fake and functional tensors a compile left behind)
            continue
    return sorted(seen.values(), key=lambda t: -t["bytes"])[:top]


def one(args) -> dict:
    from specdec.api import SpecDecoder
    from specdec.prompts import read_prompts
    from specdec.verify import SamplingConfig

    dec = SpecDecoder(args.model, draft=args.draft, dtype=args.dtype, compile="off")
    prompts = [p.ids for p in read_prompts(args.prompts, dec)]
    rows = [prompts[i % len(prompts)] for i in range(args.one)]
    sampling = SamplingConfig(temperature=args.temperature, seed=0)
    dec.generate_ids([prompts[0][:16]], args.method, 4, sampling)  # lazy initialisation, untimed and unmeasured
    gc.collect()
    before = rss()
    with PeakRSS(args.live) as peak:
        res = dec.generate_ids(rows, args.method, args.max_new_tokens, sampling, max_memory=args.max_memory)
    measured = peak.peak - before
    est = res.stats.memory_estimate
    return {"batch": args.one, "model": args.model, "method": args.method, "dtype": args.dtype, "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature, "longest_prompt": max(len(r) for r in rows), "chunks": res.stats.chunks,
            "estimate_bytes": est, "measured_peak_bytes": measured, "estimate_over_measured": est / measured,
            "rss_before_bytes": before,
            "parts": dec.estimate_memory(rows, args.method, args.max_new_tokens, sampling).parts,
            **({"at_peak": {**peak.where, "rss_bytes": peak.where["rss_bytes"] - before}} if peak.where else {})}


def forwards(args) -> dict:
    """The transient of one padded prompt forward per ``ROWSxT`` shape of ``--forwards``, for the target and the
    ``--draft``: peak resident memory less that before, less the cache the forward allocated, per token and per
    (hidden + intermediate) element: what :data:`specdec.memory.FORWARD_BYTES` states."""
    import torch

    from specdec.api import SpecDecoder
    from specdec.memory import _dims, kv_cache_bytes

    dec = SpecDecoder(args.model, draft=args.draft, dtype=args.dtype, compile="off")
    out = []
    for label, runner in [("target", dec.runner)] + [(name, r) for name, (_, r) in dec.drafts.items()]:
        _, _, _, hidden, inter, _ = _dims(runner.model.config)
        for shape in args.forwards.split(","):
            rows, t = (int(v) for v in shape.split("x"))
            runner.reset(rows, t + 1)
            ids = torch.randint(10, 1000, (rows, t), generator=torch.Generator().manual_seed(0))
            gc.collect()
            before = rss()
            with PeakRSS() as peak, torch.inference_mode():
                runner.prefill(ids, torch.full((rows,), t))
            transient = peak.peak - before - kv_cache_bytes(runner.model.config, rows, t + 1, runner.model.dtype)
            out.append({"model": label, "rows": rows, "tokens": t, "transient_bytes": transient,
                        "bytes_per_token_element": transient / (rows * t) / (hidden + inter)})
            runner.release()
    return {"dtype": args.dtype, "forwards": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--model", default="smollm2", help="smollm2, gemma3-270m, or a local model folder")
    ap.add_argument("--method", default="pld")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-memory", default=None, help="forwarded to generate_ids (forces chunks when small)")
    ap.add_argument("--prompts", default="bench/dev_prompts.jsonl")
    ap.add_argument("--json", default=None)
    ap.add_argument("--append", action="store_true", help="add the runs to those already in --json")
    ap.add_argument("--forwards", default=None, metavar="ROWSxT,...",
                    help="instead: one padded prompt forward per shape (e.g. 16x128,4x512), target and --draft, "
                         "and its transient per token and (hidden + intermediate) element")
    ap.add_argument("--live", action="store_true", help="record the Python stack and the largest live tensors at the "
                                                          "peak (slows the run; for finding what a peak holds)")
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # the child process
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(forwards(args) if args.forwards else one(args)))
        return
    rows = []
    for b in [0] if args.forwards else (int(x) for x in args.batches.split(",")):
        cmd = [sys.executable, "-m", "bench.memory", "--one", str(b)] + sys.argv[1:]
        # glibc keeps freed heap memory for reuse, so a peak could hide in memory an earlier allocation (model
        # loading) freed: every allocation past 64 KiB is mapped and unmapped on its own instead, and resident
        # memory then follows what is live.
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout.strip().splitlines()[-1]
        rows.append(json.loads(out))
        r = rows[-1]
        if args.forwards:
            for f in r["forwards"]:
                print(f"{args.dtype} {f['model']} {f['rows']}x{f['tokens']}: transient {f['transient_bytes'] / 2**20:.1f} "
                      f"MiB, {f['bytes_per_token_element']:.1f} bytes per token and element", flush=True)
            continue
        print(f"batch {b:>4}: estimate {r['estimate_bytes'] / 2**20:8.1f} MiB, measured peak "
              f"{r['measured_peak_bytes'] / 2**20:8.1f} MiB, ratio {r['estimate_over_measured']:.2f}", flush=True)
        if "at_peak" in r:
            at = r["at_peak"]
            print(f"  at {at['rss_bytes'] / 2**20:.1f} MiB past the start:\n    " + "\n    ".join(at["stack"]))
            for t in at["tensors"]:
                print(f"    {t['bytes'] / 2**20:8.1f} MiB {t['dtype']} {t['shape']} ({t['views']} views)")
    if args.json:
        runs = []
        if args.append and os.path.exists(args.json):
            with open(args.json) as f:
                runs = json.load(f)["runs"]
        with open(args.json, "w") as f:
            json.dump({"runs": runs + rows}, f, indent=1)


if __name__ == "__main__":
    main()
