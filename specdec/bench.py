"""``specdec bench``: specdec's methods and transformers' baselines side by side, same process, interleaved.

Every method generates for every prompt; the order of methods rotates from prompt to prompt so
that drift in machine speed does not favour one method. ``hf`` (transformers ``generate``) is
always run: it is the reference for speedups and for output identity. Target and draft forward
calls are counted with forward hooks, the same way for every method.
"""
from __future__ import annotations

import contextlib
import os
import platform
import time

import torch
import transformers
from tqdm import tqdm

from specdec import methods
from specdec.api import SpecDecoder, hf_generate, hf_generate_batch
from specdec.bench_summary import cpu_name, format_table, summarize
from specdec.draft_models import is_feature_draft
from specdec.gguf_weights import dense_weights
from specdec.linear import weight_bytes
from specdec.methods import parse_label
from specdec.prompts import Prompt, read_prompts
from specdec.verify import SamplingConfig

HF_METHODS = ("hf", "hf-pld", "hf-assisted")  # transformers' baselines; every other label names a registered method

__all__ = ["run_bench", "summarize", "bench_config", "format_table", "parse_label", "Prompt", "read_prompts"]


class _CallCounter:
    """Counts forward calls of some modules (together) through forward pre-hooks, plus the compiled calls
    of their runners (a compiled runner calls the forward directly, so module hooks do not run)."""

    def __init__(self, *modules: torch.nn.Module, runners=()):
        self.n = 0
        self.handles = [m.register_forward_pre_hook(self._hook) for m in modules]
        self.runners = list(runners)
        self._seen = self._compiled()

    def _compiled(self) -> int:
        return sum(r.compiled_calls for r in self.runners)

    def _hook(self, *_):
        self.n += 1

    def take(self) -> int:
        compiled = self._compiled()
        n, self.n, self._seen = self.n + compiled - self._seen, 0, compiled
        return n


def _compile_events(dec: SpecDecoder) -> tuple[int, float, int]:
    """Graphs compiled, their seconds, and graph drops so far, over the target's and every draft's runner."""
    runners = [dec.runner] + [r for _, r in dec.drafts.values() if r is not None]
    return tuple(map(sum, zip(*(r.compile_events() for r in runners))))


def _run_batch(dec: SpecDecoder, label: str, prompts: list[list[int]], max_new: int, sampling: SamplingConfig,
               options: dict):
    """One method over a ragged batch of prompts in one call: the new tokens per prompt and the call's stats (None
    for transformers' methods)."""
    method, own = parse_label(label)
    if method in HF_METHODS:  # transformers' models as a transformers user has them: dense weights
        with contextlib.ExitStack() as dense:
            for model in [dec.model] + [m for m, _ in dec.drafts.values()]:
                dense.enter_context(dense_weights(model))
            if method == "hf" and len(prompts) > 1:
                return hf_generate_batch(dec.model, prompts, max_new, sampling), None
            # transformers' prompt lookup and assisted generation take one prompt at a time
            return [_run_hf(dec, method, own, p, max_new, sampling) for p in prompts], None
    res = dec.generate_ids(prompts, method, max_new, sampling, **{**options.get(method, {}), **own})
    return res.tokens, res.stats


@contextlib.contextmanager
def without_eos(dec: SpecDecoder):
    """Every row of every method, transformers' too, runs to ``max_new_tokens``: no EOS ends a row. Sampled methods
    then emit the same number of tokens, so their rates compare (with EOS each draws its own reply lengths)."""
    models = [dec.model] + [m for m, _ in dec.drafts.values()]
    kept = dec.eos, [m.generation_config.eos_token_id for m in models]
    try:
        dec.eos = set()
        for m in models:
            m.generation_config.eos_token_id = None
        yield
    finally:
        dec.eos = kept[0]
        for m, eos in zip(models, kept[1]):
            m.generation_config.eos_token_id = eos


def _run_hf(dec: SpecDecoder, method: str, own: dict, prompt: list[int], max_new: int, sampling: SamplingConfig):
    if method == "hf":
        return hf_generate(dec.model, prompt, max_new, sampling)
    if method == "hf-pld":
        return hf_generate(dec.model, prompt, max_new, sampling, prompt_lookup_num_tokens=10)
    return hf_generate(dec.model, prompt, max_new, sampling, assistant_model=dec.get_draft(own.get("draft"))[0])


def stream_bandwidth(seconds: float = 0.5, mib: int = 512) -> float:
    """The machine's memory read bandwidth in bytes/s with torch's threads: the best of repeated sums over a
    ``mib`` MiB fp32 tensor (far past the caches), for about ``seconds``. The floor of a one-row decode step is
    the bytes of weights it reads over this."""
    a = torch.ones(mib * 2**20 // 4)
    best, end = float("inf"), time.perf_counter() + seconds
    a.sum()  # first touch
    while time.perf_counter() < end or best == float("inf"):
        t0 = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t0)
    return a.numel() * 4 / best


def _prepare(dec: SpecDecoder, label: str, prompts: list[list[int]], max_new: int, sampling: SamplingConfig,
             options: dict):
    """A method's per-call preparation (``Method.prepare``), outside the timed region."""
    method, own = parse_label(label)
    if method in HF_METHODS:
        return
    spec = methods.get(method)
    if spec.prepare is not None:
        spec.prepare(dec, spec.parse({**options.get(method, {}), **own}), prompts, max_new, sampling)


def run_bench(dec: SpecDecoder, labels: list[str], prompts: list[Prompt], max_new_tokens: int,
              sampling: SamplingConfig = SamplingConfig(), options: dict | None = None,
              config: dict | None = None, progress: bool = True, batch_size: int = 1, ignore_eos: bool = False,
              rounds: int = 1) -> dict:
    """Run the methods ``labels`` (``name`` or ``name:key=value:...``; plus ``hf``) over ``prompts``; return
    the bench JSON (config, runs, and the summary keyed by each label as written). ``options``: per
    method name, options that apply to all its labels (the CLI's flags); a label's own options win.

    ``batch_size``: the prompts are decoded ``batch_size`` at a time, in order, each group as one ragged batch (one
    ``generate_ids`` call; ``hf`` as one left-padded ``generate`` call; ``hf-pld`` and ``hf-assisted`` prompt by
    prompt, as transformers runs them). A run then covers a group: its ``prompt_ids``, ``batch_size``, the tokens
    of all its rows and the call's seconds, so the summary's tokens per second is the throughput over all rows.

    ``ignore_eos``: every row runs to ``max_new_tokens`` (:func:`without_eos`).

    ``rounds``: every group runs this many times (each run records its ``round``), the methods' order rotating
    from group to group: more samples behind each ratio where the machine's speed drifts (two cores here: one
    group's calls of the same work spread by +-20%)."""
    if ignore_eos:
        with without_eos(dec):
            out = run_bench(dec, labels, prompts, max_new_tokens, sampling, options, config, progress, batch_size,
                            rounds=rounds)
        out["config"]["ignore_eos"] = True
        return out
    options = options or {}
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    for label in labels:  # every label is checked before anything runs
        m, own = parse_label(label)
        if m in HF_METHODS:
            if own and not (m == "hf-assisted" and set(own) == {"draft"}):
                raise ValueError(f"{m!r} takes no options" + (" but draft=NAME" if m == "hf-assisted" else ""))
            needs_draft = m == "hf-assisted"
        else:
            try:
                spec = methods.get(m)
            except ValueError:
                raise ValueError(f"unknown method {m!r}: choose from {', '.join(HF_METHODS + methods.names())}") from None
            spec.parse({**options.get(m, {}), **own})
            needs_draft = spec.needs_draft
        if needs_draft and dec.draft is None:
            raise ValueError(f"method {m!r} needs --draft")
        if "draft" in own:
            dec.get_draft(str(own["draft"]))  # an unknown name fails here, before anything runs
        if m == "hf-assisted" and is_feature_draft(dec.get_draft(own.get("draft"))[0]):
            raise ValueError("hf-assisted cannot drive a feature-conditioned (EAGLE) draft: transformers' assisted "
                             "generation does not hand it the target's hidden states; use sd")
    labels = ["hf"] + [m for m in labels if m != "hf"]
    dec.wait_compiled()  # compile="auto": every timed run takes one path (the summary's "path" says which)
    with dense_weights(dec.model):  # after the background compile: no graph is traced while the flags are on
        dense_bytes = weight_bytes(dec.model)
    held_bytes = weight_bytes(dec.model)
    if config is not None:
        config = {**config, "weight_bytes": held_bytes, "dense_weight_bytes": dense_bytes,
                  "stream_bytes_per_s": stream_bandwidth()}
    target_calls = _CallCounter(dec.model, runners=[dec.runner])
    draft_calls = _CallCounter(*[m for m, _ in dec.drafts.values()], runners=[r for _, r in dec.drafts.values()])

    if batch_size > 1:  # groups of one category where the prompts allow it (per-category reports stay per category)
        order = list(dict.fromkeys(p.category for p in prompts))
        prompts = sorted(prompts, key=lambda p: order.index(p.category))
    groups = [prompts[i: i + batch_size] for i in range(0, len(prompts), batch_size)]
    # Warm up every method once (first calls pay for lazy initialisation and allocator growth).
    for m in labels:
        _run_batch(dec, m, [p.ids for p in groups[0]], min(8, max_new_tokens), sampling, options)
    target_calls.take(), draft_calls.take()

    runs, reference = [], {}
    schedule = [(r, group) for r in range(rounds) for group in groups]
    bar = tqdm(total=len(schedule) * len(labels), desc="bench", disable=not progress)
    for i, (round_, group) in enumerate(schedule):
        ids = [p.ids for p in group]
        order = labels[i % len(labels):] + labels[: i % len(labels)]
        # hf runs first on its prompts only if it rotates there; identity is checked after the loop.
        for m in order:
            _prepare(dec, m, ids, max_new_tokens, sampling, options)  # untimed (the oracle's reference run)
            target_calls.take(), draft_calls.take()  # its forwards are not the method's
            compiled_before = dec.runner.compiled_calls
            events_before, started_at = _compile_events(dec), time.time()
            t0 = time.perf_counter()
            tokens, stats = _run_batch(dec, m, ids, max_new_tokens, sampling, options)
            seconds = time.perf_counter() - t0
            events = [a - b for a, b in zip(_compile_events(dec), events_before)]
            categories = {p.category for p in group}
            run = {
                "method": m, "prompt_id": "+".join(p.id for p in group),
                "category": categories.pop() if len(categories) == 1 else "mixed",
                "new_tokens": sum(len(t) for t in tokens),
                "seconds": seconds, "prefill_seconds": stats.prefill_s if stats else None,
                "weight_bytes": dense_bytes if parse_label(m)[0] in HF_METHODS else held_bytes,
                "target_calls": target_calls.take(), "draft_calls": draft_calls.take() + (stats.remote_draft_calls if stats else 0),
                "compiled_target_calls": dec.runner.compiled_calls - compiled_before,
                # a graph compiled inside a timed run is a stall the run's seconds include: named, not hidden
                "graphs_compiled": events[0], "compile_seconds": events[1], "graphs_dropped": events[2],
                "started_at": started_at,  # wall clock: runs of concurrent shards can be lined up
                "drafted_tokens": stats.drafted_tokens if stats else None,
                "accepted_tokens": stats.accepted_tokens if stats else None,
                "drafter": stats.drafter if stats and stats.drafter else None,
                "chunks": stats.chunks if stats else None,
                "memory_estimate": stats.memory_estimate if stats else None,
                "identical_to_reference": None, "_tokens": tokens, "round": round_,
            }
            if batch_size > 1:
                # transformers' prompt lookup and assisted generation ran the group's prompts one after another
                one_by_one = parse_label(m)[0] in ("hf-pld", "hf-assisted")
                run.update(prompt_ids=[p.id for p in group], batch_size=len(group),
                           rows_at_once=1 if one_by_one else len(group))
            if m == "hf":
                reference[run["prompt_id"]] = tokens
            runs.append(run)
            bar.set_postfix(method=m, prompt=run["prompt_id"][:40])
            bar.update()
    bar.close()
    for run in runs:
        tokens = run.pop("_tokens")
        if sampling.greedy:
            if len(tokens) != len(reference[run["prompt_id"]]):
                raise RuntimeError(f"{run['method']} returned {len(tokens)} rows for {run['prompt_id']}")
            same = [a == b for a, b in zip(tokens, reference[run["prompt_id"]])]
            run["identical_to_reference"] = all(same)
            if batch_size > 1:
                run["identical_rows"] = sum(same)
    return {"config": {**(config or {}), "batch_size": batch_size, "ignore_eos": False, "rounds": rounds},
            "runs": runs, "summary": summarize(runs)}


def bench_config(model: str, draft: str | None, dtype: str, max_new_tokens: int, sampling: SamplingConfig,
                 linear: str = "torch", compile: bool = False, weights: str = "dense",
                 draft_weights: str = "dense", compile_options: dict | None = None) -> dict:
    """The run's setup, as the bench JSON records it; ``compile_options``: the inductor options a caller set over
    specdec's own (``--compile-option``)."""
    plain = (bool, int, float, str, type(None))
    return {
        "model": model, "draft": draft, "dtype": dtype, "linear": linear, "compile": compile, "weights": weights,
        "draft_weights": draft_weights,
        "compile_options": {k: v if isinstance(v, plain) else repr(v) for k, v in (compile_options or {}).items()},
        "max_new_tokens": max_new_tokens,
        "temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p, "seed": sampling.seed,
        "threads": torch.get_num_threads(), "cores": len(os.sched_getaffinity(0)), "torch": torch.__version__, "transformers": transformers.__version__,
        "python": platform.python_version(), "machine": platform.machine(), "cpu": cpu_name(),
    }
