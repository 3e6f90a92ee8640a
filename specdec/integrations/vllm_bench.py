"""vLLM as a peer of ``specdec bench``: vLLM without speculation, with its own n-gram proposer, and with
specdec's proposers, over the same prompts and token budget, greedy, written in ``specdec bench``'s JSON
schema (``python -m bench.report`` reads it beside specdec's own files).

Run it with the vLLM environment's Python (``make vllm`` builds ``.venv-vllm``), Intel's OpenMP preloaded
as vLLM's CPU build asks for speculative decoding::

    LD_PRELOAD=$(ls .venv-vllm/lib/libiomp5.so) .venv-vllm/bin/python -m specdec.integrations.vllm_bench --prompts bench/dev_prompts.jsonl \\
        --concurrency 16 --max-new-tokens 128 --dtype bf16 --json vllm_c16.json

Methods: ``vllm`` (no speculation; the reference for speed and identity), ``vllm-ngram`` (vLLM's
``NgramProposer``), ``vllm-suffix`` (vLLM's suffix decoding, where its package installs),
``vllm-specdec-pld`` and ``vllm-specdec-ngrammys`` (:mod:`specdec.integrations.vllm`), and specdec's own
engine as a peer: ``specdec-NAME`` runs the registered method ``NAME`` (``specdec-ar``, ``specdec-pld``,
``specdec-ngrammys``, ...) in this process on one thread (vLLM's CPU worker computes on one core too), a group
of requests as one ragged batch, eager unless ``--specdec-compile on`` (vLLM runs with ``enforce_eager``,
no compiled graphs, here). Every vLLM method
has its own engine (each in its own processes, as vLLM starts them; an idle one takes no CPU), and the
methods take turns: prompts go in groups of ``--concurrency`` requests, submitted together, and the order
of methods rotates from group to group, so drift in machine speed does not favour one method.
A group's wall time is split over its requests by their new tokens, so a method's summed seconds are
its wall time and its tokens per second the group's throughput. ``target_calls`` per request is
``new_tokens - accepted`` (each engine step emits one token plus the accepted drafts); drafted and
accepted tokens come from vLLM's spec-decode counters per group, split the same way.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import time

from specdec import settings

METHODS = ("vllm", "vllm-ngram", "vllm-suffix", "vllm-specdec-pld", "vllm-specdec-ngrammys")
ENGINE_PREFIX = "specdec-"  # specdec's own engine: specdec-<registered method>
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def speculative_config(method: str, k: int) -> dict | None:
    """vLLM's ``speculative_config`` for a bench method (``k`` draft tokens at most)."""
    if method == "vllm":
        return None
    if method == "vllm-ngram":  # the same n-gram sizes as specdec's pld
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    if method == "vllm-suffix":
        return {"method": "suffix", "num_speculative_tokens": k}
    if method == "vllm-specdec-pld":
        return {"method": "custom_class", "num_speculative_tokens": k,
                "model": "specdec.integrations.vllm.PromptLookupProposer"}
    if method == "vllm-specdec-ngrammys":
        return {"method": "custom_class", "num_speculative_tokens": k,
                "model": "specdec.integrations.vllm.NGrammysProposer"}
    raise ValueError(f"unknown method {method!r}: choose from {', '.join(METHODS)}")


def split_label(label: str) -> tuple[str, dict]:
    """A bench label's method and the proposer options it carries: ``vllm-specdec-pld:history=false:n_max=5``
    runs ``vllm-specdec-pld`` with ``SPECDEC_VLLM_OPTIONS={"history": false, "n_max": 5}`` (values read as
    JSON where they parse, else as strings), so two settings of one proposer compare in one run. Only
    specdec's proposers take options."""
    from specdec.methods import parse_label

    method, raw = parse_label(label)
    options = {}
    for key, value in raw.items():
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    if options and not method.startswith("vllm-specdec-"):
        raise ValueError(f"{label!r}: only specdec's proposers (vllm-specdec-*) take options")
    return method, options


def _start_engine(label: str, make):
    """``make()`` (which starts a vLLM engine) with the label's proposer options in ``SPECDEC_VLLM_OPTIONS``
    on top of the ones already set; vLLM's engine process reads them when it builds the proposer."""
    from specdec.integrations.vllm import OPTIONS_ENV

    _, options = split_label(label)
    before = os.environ.get(OPTIONS_ENV)
    if options:
        os.environ[OPTIONS_ENV] = json.dumps({**json.loads(before or "{}"), **options})
    try:
        return make()
    finally:
        if before is None:
            os.environ.pop(OPTIONS_ENV, None)
        else:
            os.environ[OPTIONS_ENV] = before


def check_label(label: str, k: int) -> None:
    """Refuse a vLLM bench label now, before any engine starts: an unknown method, or proposer options (the
    label's over ``$SPECDEC_VLLM_OPTIONS``) of unknown names or wrong types. Values out of range (``n_min >
    n_max``, a corpus of another vocabulary) still fail at that engine's start."""
    from specdec.integrations.vllm import read_options

    model = (speculative_config(split_label(label)[0], k) or {}).get("model", "")
    if model.startswith("specdec."):
        module, name = model.rsplit(".", 1)
        cls = getattr(importlib.import_module(module), name)
        _start_engine(label, lambda: read_options(cls.DEFAULTS, cls.NULLABLE))


def _spec_counters(llm) -> tuple[int, int]:
    """(draft tokens, accepted tokens) this engine has verified so far, or (0, 0) without speculation.

    Read from the engine's own Prometheus logger objects: ``LLM.get_metrics`` reads the process-wide
    registry, which holds only the last engine started (each new engine unregisters the others')."""
    drafted = accepted = 0
    manager = getattr(llm.llm_engine, "logger_manager", None)
    for logger in getattr(manager, "stat_loggers", []):
        prom = getattr(logger, "spec_decoding_prom", None)
        if prom is None or not getattr(prom, "spec_decoding_enabled", False):
            continue
        for counter in prom.counter_spec_decode_num_draft_tokens.values():
            drafted += int(counter._value.get())
        for counter in prom.counter_spec_decode_num_accepted_tokens.values():
            accepted += int(counter._value.get())
    return drafted, accepted


def _engine_method(label: str) -> tuple[str, dict] | None:
    """The specdec method and options a ``specdec-NAME[:key=value...]`` label runs in specdec's own engine,
    else None (a vLLM method)."""
    if not label.startswith(ENGINE_PREFIX):
        return None
    from specdec import methods

    name, options = methods.parse_label(label[len(ENGINE_PREFIX):])
    if name not in methods.names():
        raise ValueError(f"unknown specdec method in {label!r}: choose from {', '.join(methods.names())}")
    if methods.get(name).needs_draft:
        raise ValueError(f"{label!r} needs a draft model, which this bench does not load")
    methods.get(name).parse(options)  # bad options fail before any engine starts
    return name, options


def _bound_core() -> int | None:
    """The one core vLLM's worker was told to compute on (``VLLM_CPU_OMP_THREADS_BIND=N``), else None."""
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "")
    return int(bind) if bind.isdigit() else None


def _run_engine(dec, method: tuple[str, dict], group, max_new_tokens: int) -> tuple[list[list[int]], float, int, int, float]:
    """One group through specdec's engine as one batch, on one thread (pinned to vLLM's core where it has
    one, so both engines compute on the same core): (tokens per request, seconds, drafted, accepted,
    prefill seconds)."""
    import torch

    core, cores = _bound_core(), os.sched_getaffinity(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    if core is not None:
        os.sched_setaffinity(0, {core})
    try:
        t0 = time.perf_counter()
        res = dec.generate_ids([p.ids for p in group], method[0], max_new_tokens, **method[1])
        seconds = time.perf_counter() - t0
    finally:
        torch.set_num_threads(threads)
        if core is not None:
            os.sched_setaffinity(0, cores)
    return res.tokens, seconds, res.stats.drafted_tokens, res.stats.accepted_tokens, res.stats.prefill_s


def run(args) -> dict:
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from specdec.hub import resolve
    from specdec.prompts import TokenizerEncoder, read_prompts

    labels = ["vllm"] + [m for m in args.methods.split(",") if m and m != "vllm"]
    engine = {m: _engine_method(m) for m in labels}  # specdec's method for specdec-NAME labels, else None
    for m in labels:  # unknown names and bad proposer options fail before any engine starts
        if engine[m] is None:
            check_label(m, args.k)
    path = str(resolve(args.model))
    prompts = read_prompts(args.prompts, TokenizerEncoder(AutoTokenizer.from_pretrained(path)), args.limit)
    longest = max(len(p.ids) for p in prompts) + args.max_new_tokens + args.k + 1
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)
    groups = [prompts[i: i + args.concurrency] for i in range(0, len(prompts), args.concurrency)]
    dec = None
    if any(engine.values()):
        from specdec.api import SpecDecoder

        dec = SpecDecoder(path, dtype=args.dtype, compile=args.specdec_compile)
    engines = {m: _start_engine(m, lambda m=m: LLM(
        model=path, dtype=DTYPES[args.dtype], max_model_len=max(longest, 256), enforce_eager=True,
        max_num_seqs=args.concurrency, speculative_config=speculative_config(split_label(m)[0], args.k),
        disable_log_stats=False, seed=0, kv_cache_memory_bytes=args.kv_cache_mib << 20))
        for m in labels if engine[m] is None}
    for llm in engines.values():  # warm-up: first calls pay for lazy initialisation
        llm.generate([TokensPrompt(prompt_token_ids=prompts[0].ids)], SamplingParams(temperature=0.0, max_tokens=8),
                     use_tqdm=False)
    for m in labels:
        if engine[m]:
            _run_engine(dec, engine[m], groups[0], 8)
    runs, reference = [], {}
    for g, group in enumerate(groups):
        order = labels[g % len(labels):] + labels[: g % len(labels)]
        for m in order:
            if engine[m]:
                toks, seconds, drafted, accepted, prefill = _run_engine(dec, engine[m], group, args.max_new_tokens)
                speculative = engine[m][0] != "ar"
            else:
                llm = engines[m]
                d0, a0 = _spec_counters(llm)
                t0 = time.perf_counter()
                outs = llm.generate([TokensPrompt(prompt_token_ids=p.ids) for p in group], sp, use_tqdm=False)
                seconds = time.perf_counter() - t0
                d1, a1 = _spec_counters(llm)
                toks = [list(o.outputs[0].token_ids) for o in outs]
                drafted, accepted, prefill = d1 - d0, a1 - a0, None  # vLLM interleaves prefill with decode steps
                speculative = split_label(m)[0] != "vllm"
            total = sum(len(t) for t in toks) or 1
            for p, t in zip(group, toks):
                share = len(t) / total
                row_drafted, row_accepted = (None, 0)
                if speculative:
                    row_drafted, row_accepted = round(drafted * share), round(accepted * share)
                runs.append({"method": m, "prompt_id": p.id, "category": p.category, "new_tokens": len(t),
                             "seconds": seconds * share,
                             "prefill_seconds": None if prefill is None else prefill * share,
                             "target_calls": max(1, len(t) - row_accepted), "draft_calls": 0, "compiled_target_calls": 0,
                             "drafted_tokens": row_drafted,
                             "accepted_tokens": row_accepted if speculative else None,
                             "drafter": None, "chunks": None, "memory_estimate": None,
                             "identical_to_reference": None, "_tokens": t})
                if m == "vllm":
                    reference[p.id] = t
        print(f"group {g + 1}/{len(groups)} done", flush=True)
    for llm in engines.values():
        llm.llm_engine.engine_core.shutdown()
    for r in runs:
        r["identical_to_reference"] = r.pop("_tokens") == reference[r["prompt_id"]]
    import torch
    import vllm

    from specdec.bench_summary import cpu_name, summarize

    config = {"engine": "vllm", "vllm": vllm.__version__, "specdec_compile": args.specdec_compile,
              "model": args.model, "dtype": args.dtype,
              "max_new_tokens": args.max_new_tokens, "temperature": 0.0, "concurrency": args.concurrency,
              "num_speculative_tokens": args.k, "specdec_vllm_options": settings.get("SPECDEC_VLLM_OPTIONS"),
              "ld_preload": os.environ.get("LD_PRELOAD"), "omp_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
              "threads": torch.get_num_threads(), "cores": len(os.sched_getaffinity(0)), "torch": torch.__version__,
              "python": platform.python_version(), "machine": platform.machine(), "cpu": cpu_name()}
    return {"config": config, "runs": runs, "summary": summarize(runs, reference="vllm")}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="model name or transformers folder")
    p.add_argument("--prompts", required=True, help="JSON lines with id, category, chat, prompt")
    p.add_argument("--methods", default=",".join(m for m in METHODS if m != "vllm-suffix"),
                   help="comma list of " + ", ".join(METHODS) + ", and specdec-NAME: specdec's own engine running "
                   "its method NAME (e.g. specdec-ar, specdec-ngrammys); specdec's proposers take options on the "
                   "label, e.g. vllm-specdec-pld:history=false")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--concurrency", type=int, default=1, help="requests submitted together (vLLM's max_num_seqs)")
    p.add_argument("--k", type=int, default=8, help="num_speculative_tokens of every speculative method")
    p.add_argument("--kv-cache-mib", type=int, default=1024, help="KV cache per engine (vLLM's CPU default takes "
                   "92%% of the memory; every method has an engine)")
    p.add_argument("--specdec-compile", choices=["off", "on"], default="off",
                   help="specdec-NAME methods: torch.compile specdec's decode forwards (off matches vLLM's enforce_eager)")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--json", default=None, metavar="OUT")
    args = p.parse_args(argv)
    if min(args.concurrency, args.k, args.max_new_tokens, args.kv_cache_mib) < 1:
        p.error("--concurrency, --k, --max-new-tokens and --kv-cache-mib must be >= 1")
    result = run(args)
    from specdec.bench_summary import format_table

    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
