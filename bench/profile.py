"""Profilers of specdec on the CPU: where a decode step's, a forward's and the linear layers' time goes.

    python -m bench.profile SUBCOMMAND [options]      # SUBCOMMAND --help for its options

    step-split     a method's decode time after prefill: target forwards against everything else
    step-cost      the target's cost of one forward over T tree tokens, c(T), as the runtime calibrates it
    draft-cost     c, one draft forward over one target step, per draft and draft weights (dense, q8, q4)
    forward-split  one forward over T tokens split into the linear layers and the rest (--compile: also compiled)
    model-linears  every linear layer of the model over M rows, alone, through the packed kernel (and torch's)
    prefill        prompt encoding through causal SDPA against the tree-attention kernel
    attention      end-to-end A/B of the runner's attention paths: tree-attention kernel against dense-mask SDPA
    linear         transformers' own generate (hf) on torch's linear layers against specdec's kernels

Each subcommand prints its result and, with ``--json OUT``, writes it as JSON. Decoders are built eager
(``compile="off"``) unless a subcommand's ``--compile`` says otherwise, so that no background compile shares
the CPU with a measurement. bench/RESULTS.md gives the command behind every recorded figure.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import time
from dataclasses import dataclass

import torch

from specdec.bench_summary import cpu_name

DEV_PROMPTS = "bench/dev_prompts.jsonl"
RAW = argparse.RawDescriptionHelpFormatter


# ----------------------------------------------------------------------------------------
# Shared helpers
# ----------------------------------------------------------------------------------------


def decoder(model: str, dtype: str, compile: str = "off", **kwargs):
    """A :class:`~specdec.api.SpecDecoder`, eager unless ``compile="on"`` (then compiled before it returns)."""
    from specdec.api import SpecDecoder

    return SpecDecoder(model, dtype=dtype, compile=compile, **kwargs)


def prompts_of(args: argparse.Namespace, dec) -> list:
    """``--prompts`` read for ``dec``, cut by ``--limit`` and ``--per-category`` where the subcommand has them."""
    from specdec.prompts import read_prompts

    return read_prompts(args.prompts, dec, getattr(args, "limit", None), getattr(args, "per_category", None))


def specdec_linears(model: torch.nn.Module) -> list:
    """The model's specdec linear layers (``--linear skinny|packed|auto`` swaps them in)."""
    from specdec.linear import SkinnyLinear

    return [m for m in model.modules() if isinstance(m, SkinnyLinear)]


def inputs_by_width(linears: list, lead: tuple[int, ...], dtype: torch.dtype, generator=None) -> dict:
    """One random input of shape ``lead + (in_features,)`` per input width of ``linears``."""
    return {k: torch.randn(*lead, k, generator=generator).to(dtype) for k in {m.in_features for m in linears}}


def elapsed(fn, *args) -> float:
    """Seconds one call of ``fn(*args)`` takes."""
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


class Best(dict):
    """The lowest time seen per key, in seconds, over interleaved rounds (drift spreads over every key)."""

    def keep(self, key, seconds: float) -> None:
        self[key] = min(self.get(key, math.inf), seconds)

    def ms(self, key) -> float:
        return self[key] * 1e3


@dataclass
class DecodeTotals:
    """Decode time after prefill, summed over generations."""

    decode_s: float = 0.0
    target_s: float = 0.0
    draft_s: float = 0.0
    steps: int = 0
    tokens: int = 0

    def add(self, res) -> list[int]:
        """Adds one generation's ``res`` (batch of one); returns its tokens."""
        st = res.stats
        self.decode_s += st.total_s - st.prefill_s
        self.target_s += st.target_s - st.prefill_s
        self.draft_s += st.draft_s
        self.steps += st.steps
        self.tokens += len(res.tokens[0])
        return res.tokens[0]

    def per_step_ms(self, seconds: float) -> float:
        return 1e3 * seconds / max(1, self.steps)


def finish(out: dict, path: str | None, show: bool = False) -> None:
    """Prints ``out`` as JSON when ``show``; writes it to ``path`` when given."""
    if show:
        print(json.dumps(out, indent=1))
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=1)


def subcommand(subs, name: str, doc: str, dtype: str | None = "bf16", dtype_choices: bool = True):
    """A subparser with the options every profiler has: ``--model``, ``--json`` and (unless None) ``--dtype``."""
    p = subs.add_parser(name, help=doc.strip().splitlines()[0], description=doc, formatter_class=RAW)
    p.add_argument("--model", default="smollm2")
    if dtype is not None:
        p.add_argument("--dtype", default=dtype, **({"choices": ["fp32", "bf16", "fp16"]} if dtype_choices else {}))
    p.add_argument("--json", default=None)
    return p


# ----------------------------------------------------------------------------------------
# step-split
# ----------------------------------------------------------------------------------------

STEP_SPLIT = """Where the time of a speculative step goes: target forward against everything else.

Runs a method over prompts and splits the decode time after prefill into the target's forward
passes and the rest (drafting, verification, cache commit, Python).

    python -m bench.profile step-split --prompts bench/dev_prompts.jsonl --per-category 2 \\
        --method pld --max-new-tokens 128 --dtype bf16 [--compile on] [--json OUT]
"""


def step_split(args: argparse.Namespace) -> None:
    from tqdm import tqdm

    dec = decoder(args.model, args.dtype, compile=args.compile)
    prompts = prompts_of(args, dec)
    dec.generate_ids([prompts[0].ids], args.method, 8)  # warm-up
    t = DecodeTotals()
    for p in tqdm(prompts, desc=args.method):
        t.add(dec.generate_ids([p.ids], args.method, args.max_new_tokens))
    other = t.decode_s - t.target_s
    finish({
        "method": args.method, "dtype": args.dtype, "prompts": len(prompts), "steps": t.steps, "new_tokens": t.tokens,
        "decode_s": t.decode_s, "target_forward_s": t.target_s, "other_s": other, "other_share": other / t.decode_s,
        "drafting_s": t.draft_s, "ms_per_step": t.per_step_ms(t.decode_s),
        "target_ms_per_step": t.per_step_ms(t.target_s), "other_ms_per_step": t.per_step_ms(other),
    }, args.json, show=True)


# ----------------------------------------------------------------------------------------
# step-cost
# ----------------------------------------------------------------------------------------

STEP_COST = """The target's measured cost of one forward over T tree tokens, c(T), as the runtime calibrates it.

    python -m bench.profile step-cost --dtype bf16 --dtype fp32
    python -m bench.profile step-cost --dtype bf16 --rows 16     # a 16-row batch's table (the batch planner's)

The shape of c(T) decides what speculation can gain on a machine: where verifying T tokens costs about
one step (a CPU with native bf16 matrix units, a GPU) long drafts and wide trees pay; where it grows
linearly with T (bf16 on a CPU without bf16 instructions, whose bf16 GEMM for more than one row is a
slow fallback) no draft pays, and the cost-aware schedules stop drafting.
"""


def step_cost(args: argparse.Namespace) -> None:
    from specdec.policies import StepCost

    out = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "context": args.context, "linear": args.linear,
           "rows": args.rows, "ms": {}}
    sizes = StepCost.SIZES if args.rows == 1 else StepCost.BATCH_SIZES
    for dtype in args.dtype or ["bf16", "fp32"]:
        dec = decoder(args.model, dtype, compile=args.compile, linear=args.linear)
        cost = StepCost.calibrate(dec.runner, context=args.context, repeats=args.repeats, sizes=sizes, rows=args.rows)
        out["ms"][dtype] = {t: round(v * 1000, 1) for t, v in cost.table.items()}
    sizes = sorted({t for row in out["ms"].values() for t in row})
    print(f"{out['cpu']}, {out['threads']} threads, {args.rows} row(s), {args.context}-token context, "
          f"best of {args.repeats}, ms")
    print("| T | " + " | ".join(map(str, sizes)) + " |")
    print("|---|" + "---|" * len(sizes))
    for dtype, row in out["ms"].items():
        print(f"| {dtype} | " + " | ".join(f"{row[t]:.1f}" for t in sizes) + " |")
    finish(out, args.json)


# ----------------------------------------------------------------------------------------
# draft-cost
# ----------------------------------------------------------------------------------------

DRAFT_COST = """c, what a draft forward costs: one draft token's forward over one target step, per draft and weights.

    python -m bench.profile draft-cost --dtype bf16 --drafts smollm2-draft,smollm2-eagle --draft-weights dense,q8

For each draft and each ``--draft-weights`` (dense: as shipped; q8 / q4: its linear layers as 8-bit / 4-bit blocks,
:mod:`specdec.draft_weights`) one decoder is built; the target's one-token step (``StepCost``) and the draft's
one-token forward (``draft_seconds``, what the planners read) are each the best of ``--repeats`` calibrations
after a ``--context``-token prefix, interleaved round by round. c is the draft's over the target's, same
threads. The draft-model methods live on it: a drafted token that is accepted a of the time pays for itself
only while c < a.
"""


def draft_cost(args: argparse.Namespace) -> None:
    from specdec.draft_models import warm_up_inputs
    from specdec.linear import weight_bytes
    from specdec.policies import StepCost

    out = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "dtype": args.dtype, "compile": args.compile,
           "context": args.context, "runs": []}
    decs = [(name, w, decoder(args.model, args.dtype, compile=args.compile, draft=name, draft_weights=w))
            for name in args.drafts.split(",") for w in args.draft_weights.split(",")]
    best = {(name, w): [float("inf"), float("inf")] for name, w, _ in decs}
    for _ in range(args.repeats):  # rounds over all decoders: a busy moment skews them alike
        for name, w, dec in decs:
            model, runner = dec.get_draft(name)
            target = StepCost.calibrate(dec.runner, context=args.context, repeats=1, sizes=(1,))(1)
            draft = StepCost.calibrate(runner, context=args.context, repeats=1, sizes=(1,),
                                       extra_inputs=warm_up_inputs(model))(1)
            b = best[(name, w)]
            b[0], b[1] = min(b[0], target), min(b[1], draft)
    print(f"{out['cpu']}, {out['threads']} threads, {args.dtype}, compile {args.compile}, best of {args.repeats}")
    print("| draft | weights | MB read | draft ms | target ms | c |")
    print("|---|---|---|---|---|---|")
    for name, w, dec in decs:
        target, draft = best[(name, w)]
        mb = weight_bytes(dec.get_draft(name)[0]) / 1e6
        out["runs"].append({"draft": name, "draft_weights": w, "draft_mb": round(mb, 1), "draft_ms": draft * 1e3,
                            "target_ms": target * 1e3, "c": draft / target})
        print(f"| {name} | {w} | {mb:.1f} | {draft * 1e3:.2f} | {target * 1e3:.2f} | {draft / target:.3f} |")
    finish(out, args.json)


# ----------------------------------------------------------------------------------------
# forward-split
# ----------------------------------------------------------------------------------------

FORWARD_SPLIT = """Where a verification forward's extra time goes: one target forward over T tree tokens against one token.

    OMP_NUM_THREADS=1 python -m bench.profile forward-split --dtype bf16 --context 400 --sizes 1,6 --json out.json

For each tree size T (a chain of T tokens after a ``--context``-token prompt) this times, best of ``--repeats``
forwards, the whole forward, the linear layers inside it (forward hooks around every specdec linear) and the
same linear layers called back to back outside the model. The rest of the forward is attention and the
model's other ops. Sizes are interleaved round by round, so drift in machine speed spreads over all of them;
the best of each size over all rounds is reported. What a speculative call costs more than a one-token step is
what the drafts must pay for: the growth from T = 1, split into its parts.

With ``--compile`` a second runner over the same model runs its forwards through ``torch.compile``
(:class:`specdec.model.ModelRunner` ``compile=True``), and its whole forward is timed in the same rounds
(``compiled@T``), next to the eager runner's without hooks (``eager@T``; the ``forward`` column includes the
hooks' own cost); hooks would break its graph, so it gets no linear/rest split. ``--ablate`` adds one compiled
runner per option of :func:`specdec.compile_passes.compile_options` with that option undone (``ungrouped@T``: the
quantized products that share an input called one by one; ``asserts@T``: inductor's size and alignment asserts
back on; ``python_wrapper@T``: the graph's wrapper in Python, not C++): what each is worth. Compiled runners
compile lazily, on their first timed call (a slow sample that the best-of leaves out), so only the graphs of the
sizes asked for are built.

    python -m bench.profile forward-split --dtype bf16 --context 200 --sizes 1,4 --compile --ablate
"""


# What forward-split --ablate undoes of specdec.compile_passes.compile_options(), one compiled runner each.
ABLATIONS = {
    "ungrouped": lambda o: {k: v for k, v in o.items() if k != "post_grad_custom_post_pass"},
    "asserts": lambda o: {**o, "size_asserts": True, "alignment_asserts": True},
    "python_wrapper": lambda o: {k: v for k, v in o.items() if not k.startswith("cpp_wrapper")},
}


def forward_split(args: argparse.Namespace) -> None:
    from specdec.model import ModelRunner
    from specdec.tree import DraftTree

    sizes = [int(t) for t in args.sizes.split(",")]
    runner = decoder(args.model, args.dtype, corpus=None).runner
    linears = specdec_linears(runner.model)
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
    arms = {}  # compiled runners by name; their graphs are traced when hooks are off (below)
    if args.compile:
        from specdec.compile_passes import compile_options

        arms["compiled"] = ModelRunner(runner.model, compile=True)
        device_type = next(runner.model.parameters()).device.type
        for name, undo in (ABLATIONS.items() if args.ablate else ()):
            arms[name] = ModelRunner(runner.model, compile=True, compile_options=undo(compile_options(device_type)))
    for r in [runner, *arms.values()]:
        r.reset(1, args.context + max(sizes) + 1)
        r.prefill(prompt, torch.tensor([args.context]))

    def add_hooks():
        return [h for m in linears for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post))]

    hooks = add_hooks()
    best = Best()
    with torch.inference_mode():
        for _ in range(args.rounds):
            for t in sizes:
                tree = DraftTree.chain(torch.randint(vocab, (1,), generator=gen),
                                       torch.randint(vocab, (1, t - 1), generator=gen))
                for _ in range(args.repeats):  # the KV is written at the same offset every time: nothing is committed
                    spent[0] = 0.0
                    best.keep(("forward", t), elapsed(runner.forward_tree, tree))
                    best.keep(("linears_in_forward", t), spent[0])
                if arms:
                    for h in hooks:  # the compiled graphs were traced without them; keep it that way
                        h.remove()
                    for _ in range(args.repeats):  # both without hooks: they cost ~2 us each, 422 per forward
                        for part, r in (("eager", runner), *arms.items()):
                            best.keep((part, t), elapsed(r.forward_tree, tree))
                    hooks = add_hooks()
                xs = inputs_by_width(linears, (1, t), linears[0].weight.dtype, gen)
                for _ in range(args.repeats):
                    spent[0] = 0.0
                    for m in linears:
                        m(xs[m.in_features])
                    best.keep(("linears_alone", t), spent[0])
    for h in hooks:
        h.remove()
    print(f"{args.model} {args.dtype}, {args.context}-token context, {torch.get_num_threads()} thread(s), "
          f"best of {args.rounds} x {args.repeats}, ms")
    timed = (["eager"] if arms else []) + list(arms)
    print("T      forward  linears (in forward)  linears (alone)  rest of forward" + "".join(f"  {p:>9}" for p in timed))
    for t in sizes:
        f, li, la = (best.ms((p, t)) for p in ("forward", "linears_in_forward", "linears_alone"))
        extra = "".join(f"  {best.ms((p, t)):9.1f}" for p in timed)
        print(f"{t:<6} {f:8.1f}  {li:20.1f}  {la:15.1f}  {f - li:15.1f}{extra}")
    parts = ["forward", "linears_in_forward", "linears_alone"] + timed
    ms = {f"{part}@{t}": round(best.ms((part, t)), 2) for t in sizes for part in parts}
    finish({"model": args.model, "dtype": args.dtype, "context": args.context,
            "threads": torch.get_num_threads(), "ms": ms}, args.json)


# ----------------------------------------------------------------------------------------
# model-linears
# ----------------------------------------------------------------------------------------

MODEL_LINEARS = """The linear layers of one target forward over M rows, alone: every weight of the model through the packed
kernel (``--kernels packed,torch``: also through torch's GEMM, ``F.linear``, on the same weights; ``widened``: torch's
fp32 GEMM on the weights widened per call, ``specdec.linear.widened_linear``; ``quant``: the quantized-weight kernel
over the GGUF's blocks as stored, csrc/quant_linear.cpp, with the bytes it reads; ``tiles``: the same kernel on AMX
tiles at every row count, ``tile_rows=1``, where the CPU has them).

    OMP_NUM_THREADS=2 python -m bench.profile model-linears --dtype bf16 --rows 1,4,16,64 --kernels quant,packed,torch
    OMP_NUM_THREADS=2 python -m bench.profile model-linears --dtype bf16 --rows 1,4,6,8,16,32,64 --kernels quant,tiles,torch

    OMP_NUM_THREADS=1 python -m bench.profile model-linears --dtype bf16 --rows 1,2,4,5,6,8,12 --json out.json
    OMP_NUM_THREADS=1 python -m bench.profile model-linears --dtype bf16 --rows 4,6,7,8,16,32,64 --kernels packed,torch
    OMP_NUM_THREADS=2 python -m bench.profile model-linears --dtype bf16 --rows 64,128,256,512 --kernels packed,widened

A verification of M tree tokens multiplies M rows through every weight (SmolLM2-135M: 211 of them, 270 MB in bf16,
read from DRAM once per forward). This times exactly that, without the model's other ops, best of ``--repeats``,
with the rows' sizes and kernels interleaved so that drift in machine speed spreads over all of them. The
packed-against-torch crossover is where ``--linear auto`` hands products to torch (``specdec.linear.default_max_rows``).
To compare two builds of the extension, run it once per build, alternating, a few times.
"""


def model_linears(args: argparse.Namespace) -> None:
    from specdec.hub import load_model
    from specdec.linear import widened_linear

    rows = [int(r) for r in args.rows.split(",")]
    kernels = args.kernels.split(",")
    if not kernels or any(k not in ("packed", "torch", "widened", "quant", "tiles") for k in kernels):
        raise SystemExit(f"--kernels takes packed, torch, widened, quant and/or tiles, got {args.kernels!r}")
    quant = any(k in ("quant", "tiles") for k in kernels)
    model, _ = load_model(args.model, args.dtype, linear="packed", weights="gguf" if quant else "dense")
    layers = specdec_linears(model)
    op = torch.ops.specdec.packed_linear
    best = Best()

    def all_layers(kernel, xs):
        for lin in layers:
            x = xs[lin.in_features]
            if kernel == "packed":
                op(x, lin.packed_weight(), lin.out_features, lin.bias)
            elif kernel in ("quant", "tiles"):
                quant_call(x, lin.qweight, lin.bias, tile_rows=1 if kernel == "tiles" else 0)
            elif kernel == "widened":
                widened_linear(x, lin.weight, lin.bias)
            else:
                torch.nn.functional.linear(x, lin.weight, lin.bias)

    with torch.inference_mode():
        for r in range(args.repeats):
            for m in rows:
                xs = inputs_by_width(layers, (m,), layers[0].weight.dtype)
                for kernel in kernels if r % 2 == 0 else kernels[::-1]:
                    best.keep((kernel, m), elapsed(lambda: all_layers(kernel, xs)))
    mb = sum(lin.weight.numel() * lin.weight.element_size() for lin in layers) / 2**20
    out = {"model": args.model, "dtype": args.dtype, "threads": torch.get_num_threads(), "layers": len(layers),
           "weight_mib": round(mb, 1), "cpu": cpu_name()}
    if quant:
        out["quant_mib"] = round(sum(lin.qweight.nbytes for lin in layers) / 2**20, 1)
    if "quant" in kernels:
        out["quant_one_row"] = quant_one_row_split(layers, args.repeats)
    for kernel in kernels:
        key = "ms" if kernel == "packed" else f"ms_{kernel}"
        out[key] = {m: round(best.ms((kernel, m)), 2) for m in rows}
        size = out["quant_mib"] if kernel in ("quant", "tiles") else mb
        print(f"{kernel}: {len(layers)} weights, {size:.0f} MiB, {out['threads']} threads, best of {args.repeats}, ms: "
              + "  ".join(f"M={m}: {v:.1f} ({size * 2**20 / v / 1e6:.1f} GB/s)" for m, v in out[key].items()))
    finish(out, args.json)


def quant_call(x: torch.Tensor, q, bias: torch.Tensor | None, tile_rows: int = 0) -> torch.Tensor:
    """One ``specdec::quant_linear`` call on a packed weight, as the compiled graphs make it (the op's overload)."""
    return torch.ops.specdec.quant_linear.default(x, q.packed, q.n, q.k, q.bits, q.group, q.has_min, q.f16_scale, bias,
                                                  tile_rows)


def quant_one_row_split(layers: list, repeats: int) -> dict:
    """Where a one-row pass over the quantized weights goes: the decoder layers' weights (many small calls) against
    the largest one (the LM head, one long stream), and the fixed cost of one call (a 16 x 32 weight: dispatch,
    argument checks, the thread pool), each the best of ``repeats`` x 20 passes."""
    from specdec.gguf_blocks import AffineCodes
    from specdec.kernels.quant import pack_quant_weight

    tiny = pack_quant_weight(AffineCodes(torch.zeros(16, 32, dtype=torch.int8), torch.ones(16, 1), torch.zeros(16, 1),
                                         4, 32, True, "Q4_1"))
    dtype = layers[0].weight.dtype
    head = max(layers, key=lambda lin: lin.qweight.nbytes)
    rest = [lin for lin in layers if lin is not head]
    xs = {k: torch.randn(1, k, dtype=dtype) for k in {lin.in_features for lin in layers} | {32}}
    parts = {"layers": lambda: [quant_call(xs[lin.in_features], lin.qweight, lin.bias) for lin in rest],
             "head": lambda: quant_call(xs[head.in_features], head.qweight, head.bias),
             "call": lambda: [quant_call(xs[32], tiny, None) for _ in range(100)]}
    best = Best()
    with torch.inference_mode():
        for _ in range(repeats * 20):
            for name, fn in parts.items():
                best.keep(name, elapsed(fn))
    nbytes = {"layers": sum(lin.qweight.nbytes for lin in rest), "head": head.qweight.nbytes}
    out = {"layers": len(rest), "layers_ms": round(best.ms("layers"), 2),
           "layers_gb_s": round(nbytes["layers"] / best.ms("layers") / 1e6, 1),
           "head_ms": round(best.ms("head"), 2), "head_gb_s": round(nbytes["head"] / best.ms("head") / 1e6, 1),
           "call_us": round(best.ms("call") * 10, 1)}
    print(f"quant, one row: {out['layers']} decoder weights {out['layers_ms']} ms ({out['layers_gb_s']} GB/s), "
          f"the LM head {out['head_ms']} ms ({out['head_gb_s']} GB/s); one call's fixed cost {out['call_us']} us")
    return out


# ----------------------------------------------------------------------------------------
# prefill
# ----------------------------------------------------------------------------------------

PREFILL = """Prompt encoding (prefill) through the two attention paths of a prompt on an empty cache, interleaved.

    OMP_NUM_THREADS=1 python -m bench.profile prefill --dtype bf16 --json out.json

Every prompt is prefilled once per path (``specdec.model.PROMPT_ATTENTION``: ``sdpa``, causal SDPA, against
``kernel``, the tree-attention kernel that verifications use), the order alternating from prompt to prompt,
best of ``--repeats``; the sums are over all prompts. Also the largest difference of the last-token logits
between the paths (both are one correct attention; they round differently).
"""


def prefill(args: argparse.Namespace) -> None:
    import specdec.model as model_mod

    dec = decoder(args.model, args.dtype)
    prompts = prompts_of(args, dec)
    runner, paths, before = dec.runner, ("sdpa", "kernel"), model_mod.PROMPT_ATTENTION
    capacity = max(len(p.ids) for p in prompts) + 1  # one cache, allocated once
    best, diff = Best(), 0.0
    try:
        for i, prompt in enumerate(prompts):
            ids = torch.tensor([prompt.ids], device=runner.device)
            logits = {}
            for path in paths if i % 2 == 0 else paths[::-1]:
                model_mod.PROMPT_ATTENTION = path
                for _ in range(args.repeats):
                    runner.reset(1, capacity)
                    start = time.perf_counter()
                    logits[path] = runner.prefill(ids, torch.tensor([ids.shape[1]]))[0]
                    best.keep((path, i), time.perf_counter() - start)
            diff = max(diff, (logits["sdpa"].float() - logits["kernel"].float()).abs().max().item())
    finally:
        model_mod.PROMPT_ATTENTION = before
    tokens = sum(len(p.ids) for p in prompts)
    out = {"model": args.model, "dtype": args.dtype, "threads": torch.get_num_threads(), "cpu": cpu_name(),
           "prompts": len(prompts), "prompt_tokens": tokens, "max_logit_diff": diff,
           "sdpa_applies": model_mod._prompt_sdpa(runner.device.type)}  # False: both paths ran the kernel
    for path in paths:
        sec = sum(best[(path, i)] for i in range(len(prompts)))
        out[path] = {"seconds": round(sec, 3), "tokens_per_s": round(tokens / sec, 1)}
    out["sdpa_speedup"] = round(out["kernel"]["seconds"] / out["sdpa"]["seconds"], 3)
    finish(out, args.json, show=True)


# ----------------------------------------------------------------------------------------
# attention
# ----------------------------------------------------------------------------------------

ATTENTION = """End-to-end A/B of the runner's attention paths: the tree-attention kernel against the dense-mask SDPA.

One decoder (one loaded model); every prompt is generated with both paths, the order alternating
from prompt to prompt and round to round, and the decode times (after prefill) are summed per path.

    python -m bench.profile attention --prompts specdec/data/demo_prompts.jsonl --method pld \\
        --max-new-tokens 64 --dtype fp32 [--schedule static] [--rounds 2] [--threads N] [--json OUT]
"""

PATHS = ("sdpa", "kernel")


def set_attention(dec, path: str) -> None:
    """Every runner of ``dec`` on ``path``; ``"kernel"`` also keeps wide trees on the kernel (no SDPA route,
    :data:`specdec.model.WIDE_TREE_SDPA`), which the ``"sdpa"`` path does not consult."""
    import specdec.model as model_mod

    for runner in (dec.runner, dec.draft_runner):
        if runner is not None:
            runner.attention = path
    model_mod.WIDE_TREE_SDPA = None


def attention(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    dec = decoder(args.model, args.dtype)
    prompts = prompts_of(args, dec)
    opts = {"schedule": args.schedule} if args.schedule else {}
    for path in PATHS:  # warm-up
        set_attention(dec, path)
        dec.generate_ids([prompts[0].ids], args.method, 8, **opts)
    sums = {p: DecodeTotals() for p in PATHS}
    same, runs = 0, 0
    for r in range(args.rounds):
        for i, prompt in enumerate(prompts):
            outs = {}
            for path in PATHS if (i + r) % 2 == 0 else PATHS[::-1]:
                set_attention(dec, path)
                outs[path] = sums[path].add(dec.generate_ids([prompt.ids], args.method, args.max_new_tokens, **opts))
            same += outs["sdpa"] == outs["kernel"]
            runs += 1
    out = {"model": args.model, "method": args.method, "schedule": args.schedule, "dtype": args.dtype,
           "threads": torch.get_num_threads(),
           "max_new_tokens": args.max_new_tokens, "prompts": len(prompts), "rounds": args.rounds,
           "identical_outputs": f"{same}/{runs}"}
    for p, s in sums.items():
        out[p] = {"decode_s": s.decode_s, "target_s": s.target_s, "tokens": s.tokens, "steps": s.steps,
                  "tokens_per_s": s.tokens / s.decode_s, "ms_per_step": s.per_step_ms(s.decode_s),
                  "target_ms_per_step": s.per_step_ms(s.target_s)}
    out["decode_speedup"] = sums["sdpa"].decode_s / sums["kernel"].decode_s
    out["target_forward_speedup"] = sums["sdpa"].target_s / sums["kernel"].target_s
    finish(out, args.json, show=True)


# ----------------------------------------------------------------------------------------
# linear
# ----------------------------------------------------------------------------------------

LINEAR = """transformers' own ``generate`` (``hf``) with torch's linear layers against specdec's kernels.

    OMP_NUM_THREADS=1 python -m bench.profile linear --dtype bf16 --per-category 2 --json out.json
    python -m bench.profile linear --dtype bf16 --max-new-tokens 1 ...   # prefill alone
    python -m bench.profile linear --kernels torch,skinny,packed ...     # default: torch,skinny

One process, one model loaded once and copied per kernel; the copies decode the same prompts in
rotating order, so the ratios are side by side. This is the absolute reference for ``specdec bench
--linear skinny|packed``, whose ``hf`` baseline already runs on that kernel.
"""


def linear(args: argparse.Namespace) -> None:
    from tqdm import tqdm

    from specdec.api import hf_generate
    from specdec.linear import use_skinny_linear
    from specdec.verify import SamplingConfig

    names = [k.strip() for k in args.kernels.split(",")]
    if not names or set(names) - {"torch", "skinny", "packed"} or len(set(names)) != len(names):
        args.parser.error(f"--kernels takes distinct names among torch, skinny, packed; got {args.kernels!r}")
    dec = decoder(args.model, args.dtype, linear="torch")
    models = {}
    for name in names:
        models[name] = copy.deepcopy(dec.model)
        if name != "torch":
            use_skinny_linear(models[name], prepack=name == "packed")
    prompts = prompts_of(args, dec)
    seconds = {name: 0.0 for name in models}
    tokens = {name: 0 for name in models}
    same = {name: 0 for name in models}  # outputs equal to the first kernel's
    for i, p in enumerate(tqdm(prompts, desc="linear a/b")):
        outs = {}
        for name in names[i % len(names):] + names[:i % len(names)]:
            t = time.perf_counter()
            outs[name] = hf_generate(models[name], p.ids, args.max_new_tokens, SamplingConfig())
            seconds[name] += time.perf_counter() - t
            tokens[name] += len(outs[name])
        for name in names:
            same[name] += outs[name] == outs[names[0]]
    tps = {name: tokens[name] / seconds[name] for name in models}
    ratio = {name: tps[name] / tps[names[0]] for name in names}
    print("hf tok/s: " + ", ".join(f"{n} {tps[n]:.1f} ({ratio[n]:.2f}x, {same[n]}/{len(prompts)} identical)" for n in names))
    finish({"model": args.model, "dtype": args.dtype, "threads": torch.get_num_threads(), "prompts": len(prompts),
            "max_new_tokens": args.max_new_tokens, "tokens_per_second": tps, "seconds": seconds,
            f"over_{names[0]}": ratio, f"identical_to_{names[0]}": same}, args.json)


# ----------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------


STREAM = """The machine's memory read bandwidth: the best of repeated sums over a 512 MiB fp32 tensor with torch's threads
(``specdec.bench.stream_bandwidth``, which ``specdec bench`` also runs and prints beside each method's weight bytes read
per second). A one-row decode step that reads B bytes of weights takes at least B over this.

    OMP_NUM_THREADS=2 python -m bench.profile stream
"""


def stream(args: argparse.Namespace) -> None:
    from specdec.bench import stream_bandwidth

    bw = stream_bandwidth(args.seconds)
    print(f"stream read bandwidth: {bw / 1e9:.1f} GB/s ({torch.get_num_threads()} threads, {cpu_name()})")
    finish({"stream_bytes_per_s": bw, "threads": torch.get_num_threads(), "cpu": cpu_name()}, args.json)


# ----------------------------------------------------------------------------------------
# warm-start
# ----------------------------------------------------------------------------------------

WARM_START = """How long a new process takes to decode compiled: import, load, compile or load the graphs, first tokens.

Runs ``--runs`` fresh Python processes one after another, each building ``SpecDecoder(model, compile=on)`` and
generating ``--max-new-tokens`` tokens with ``ar``. The first run on a machine compiles and saves the graphs
(:mod:`specdec.precompile`); later ones load them. ``SPECDEC_PRECOMPILE=0`` in the environment measures the old
path (trace and compile in every process, from inductor's warm cache).

    OMP_NUM_THREADS=2 python -m bench.profile warm-start --runs 3 --dtype bf16 [--json OUT]
"""

_WARM_START_CHILD = """
import json, sys, time
t0 = time.perf_counter()
from specdec.api import SpecDecoder
t1 = time.perf_counter()
dec = SpecDecoder(sys.argv[1], dtype=sys.argv[2], compile="on")
t2 = time.perf_counter()
fwd = dec.runner._compiled
hits, guard_s = getattr(fwd, "hits", 0), getattr(fwd, "guard_seconds", 0.0)
dec.eos = set()  # every run decodes the same number of tokens
out = dec.generate_ids([dec.encode("Name three primes.")], "ar", int(sys.argv[3]))
t3 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "init_s": t2 - t1, "generate_s": t3 - t2, "ready_s": t2 - t0,
                  "decode_ms_per_token": 1e3 * (out.stats.total_s - out.stats.prefill_s) / max(1, out.stats.steps),
                  "guard_ms_per_call": 1e3 * (getattr(fwd, "guard_seconds", 0.0) - guard_s)
                  / max(1, getattr(fwd, "hits", 0) - hits),
                  "graphs_loaded": getattr(fwd, "loaded", None), "graphs_saved": getattr(fwd, "saved", None)}))
"""


def warm_start(args: argparse.Namespace) -> None:
    import subprocess
    import sys

    runs = []
    for i in range(args.runs):
        t = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", _WARM_START_CHILD, args.model, args.dtype,
                               str(args.max_new_tokens)], capture_output=True, text=True, check=True)
        run = json.loads(done.stdout.strip().splitlines()[-1])
        run["process_s"] = time.perf_counter() - t
        runs.append(run)
        print(f"run {i}: ready in {run['ready_s']:.1f} s (import {run['import_s']:.1f}, decoder {run['init_s']:.1f}), "
              f"graphs loaded {run['graphs_loaded']}, saved {run['graphs_saved']}, "
              f"{run['decode_ms_per_token']:.1f} ms/token, guards {run['guard_ms_per_call']:.2f} ms/call")
    finish({"model": args.model, "dtype": args.dtype, "cpu": cpu_name(), "threads": os.environ.get("OMP_NUM_THREADS"),
            "precompile": os.environ.get("SPECDEC_PRECOMPILE", "1"), "runs": runs}, args.json)


def parser() -> argparse.ArgumentParser:
    from specdec.linear import LINEAR_KERNELS

    ap = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__, formatter_class=RAW)
    subs = ap.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND")

    p = subcommand(subs, "step-split", STEP_SPLIT, dtype_choices=False)
    p.add_argument("--prompts", default=DEV_PROMPTS)
    p.add_argument("--per-category", type=int, default=2)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--method", default="pld")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--compile", default="off", choices=["off", "on"],
                   help="on: decode through the compiled graphs (compiled before timing); default off")
    p.set_defaults(run=step_split)

    p = subcommand(subs, "step-cost", STEP_COST, dtype=None)
    p.add_argument("--dtype", action="append", default=None, help="fp32, bf16 or fp16 (repeatable)")
    p.add_argument("--context", type=int, default=400)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--linear", default="auto", choices=list(LINEAR_KERNELS))
    p.add_argument("--rows", type=int, default=1, help="batch rows per forward (a batch's table, as the planner's)")
    p.add_argument("--compile", default="off", choices=["off", "on"],
                   help="on: calibrate the compiled runner (compiled first); default off")
    p.set_defaults(run=step_cost)

    p = subcommand(subs, "draft-cost", DRAFT_COST)
    p.add_argument("--drafts", default="smollm2-draft,smollm2-eagle")
    p.add_argument("--draft-weights", default="dense,q8")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--compile", default="off", choices=["off", "on"])
    p.set_defaults(run=draft_cost)

    p = subcommand(subs, "forward-split", FORWARD_SPLIT)
    p.add_argument("--context", type=int, default=400)
    p.add_argument("--sizes", default="1,6")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--compile", action="store_true", help="also time a compiled runner's forwards")
    p.add_argument("--ablate", action="store_true",
                   help="with --compile, also one compiled runner per compile option undone (ungrouped products, "
                        "inductor's asserts, the C++ wrapper): what each is worth")
    p.set_defaults(run=forward_split)

    p = subcommand(subs, "model-linears", MODEL_LINEARS)
    p.add_argument("--rows", default="1,2,4,5,6,8,12")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--kernels", default="packed", help="packed, torch (F.linear on the same weights), widened (the fp32 GEMM on widened weights), quant and/or "
                        "tiles (quant on AMX tiles at every row count)")
    p.set_defaults(run=model_linears)

    p = subcommand(subs, "stream", STREAM, dtype=None)
    p.add_argument("--seconds", type=float, default=2.0)
    p.set_defaults(run=stream)

    p = subcommand(subs, "prefill", PREFILL)
    p.add_argument("--prompts", default=DEV_PROMPTS)
    p.add_argument("--per-category", type=int, default=None)
    p.add_argument("--repeats", type=int, default=2)
    p.set_defaults(run=prefill)

    p = subcommand(subs, "attention", ATTENTION, dtype="fp32", dtype_choices=False)
    p.add_argument("--prompts", default=DEV_PROMPTS)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--method", default="pld")
    p.add_argument("--schedule", default=None, help="pld/sd draft-length schedule (static: same drafts on both paths)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.set_defaults(run=attention)

    p = subcommand(subs, "warm-start", WARM_START)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.set_defaults(run=warm_start)

    p = subcommand(subs, "linear", LINEAR)
    p.add_argument("--prompts", default=DEV_PROMPTS)
    p.add_argument("--per-category", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--kernels", default="torch,skinny", help="comma list of torch, skinny, packed")
    p.set_defaults(run=linear, parser=p)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
