"""Command line: ``specdec generate``, ``bench``, ``corpus``, ``distill``, ``train-disco`` and ``ngram-corpus``."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from specdec.hub import DEFAULT_MODEL
from specdec.linear import LINEAR_KERNELS


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="smollm2 (default), gemma3-270m, or a local model folder")
    p.add_argument("--draft", default=None,
                   help="draft model (same vocabulary), needed by sd and hf-assisted; a comma list loads several "
                        "(the first is the default; bench methods pick another, e.g. sd:draft=NAME)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--linear", default="auto", choices=list(LINEAR_KERNELS),
                   help="linear layers of target and draft: specdec's packed kernel (weights prepacked once; "
                        "streams them once for all verified tokens, batch-invariant), its skinny kernel (weights "
                        "as stored), torch's, or auto (default: packed on CPU when specdec._C is built)")
    p.add_argument("--weights", default="auto", choices=["auto", "gguf", "dense"],
                   help="gguf: the linear layers compute with the GGUF's quantized blocks as stored (fp32 "
                        "activations and sums, never quantized: the model's exact weights, 2.8x fewer bytes per step "
                        "for smollm2); dense: transformers' dequantized weights; auto (default): gguf for a model "
                        "from a GGUF file (smollm2, gemma3-270m, a .gguf path)")
    p.add_argument("--draft-weights", default="dense", choices=["dense", "q8", "q4"],
                   help="q8: the drafts' linear layers as 8-bit blocks (int8 codes, an fp16 scale per 32 weights), "
                        "half the bytes a draft forward reads; q4: as 4-bit blocks (codes, an fp16 scale and minimum "
                        "per 32 weights), under a third; the output stays the target's (verification is exact "
                        "whatever a draft computes); dense (default): as the drafts ship")
    p.add_argument("--compile", nargs="?", const="on", default=None, choices=["auto", "on", "off", "saved"],
                   help="run specdec's decode forwards (target and drafts) through torch.compile, which fuses the "
                        "model's small ops (about 1.3x faster on a CPU; hf baselines stay eager). Compiling takes "
                        "minutes the first time per model, dtype and machine; the graphs are saved and load in seconds "
                        "after. bench: auto (default, $SPECDEC_COMPILE) compiles before timing; generate: saved by "
                        "default (the saved graphs where a bench, a demo or a compiled run left them, else eager: one "
                        "generation does not pay for compiling); --compile alone means on")
    p.add_argument("--compile-option", action="append", default=[], metavar="NAME=VALUE", type=_compile_option,
                   help="an inductor option set over specdec's own for its compiled forwards (repeatable), e.g. "
                        "cpp_wrapper=false: graphs compile in about half the time, a CPU step runs slower")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--corpus", default="auto",
                   help="ngrammys' n-gram corpus: auto (the shipped one for the model's vocabulary), none, or a file "
                        "written by specdec ngram-corpus")
    _method_flags(p)


def _compile_option(text: str) -> tuple[str, object]:
    """``NAME=VALUE`` as ``(name, value)``: dashes in the name read as underscores (inductor's names have none). For an
    option whose default is a string the value stays as typed (``memory_pool=none`` is the string); otherwise it is a
    Python literal (``true``/``false``/``none`` in any case) or, failing that, the string as typed. Names and value
    types are checked by :func:`specdec.api.check_inductor_overrides`."""
    import ast

    import torch._inductor.config as inductor_config

    name, sep, value = text.partition("=")
    name, value = name.strip().replace("-", "_"), value.strip()
    if not sep or not name or not value:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    if isinstance(inductor_config.get_config_copy().get(name), str):
        return name, value
    lowered = {"true": True, "false": False, "none": None}
    if value.lower() in lowered:
        return name, lowered[value.lower()]
    try:
        return name, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return name, value


def _method_flags(p: argparse.ArgumentParser) -> None:
    """One flag per method option in the registry (an option several methods share gets one flag)."""
    from specdec import methods

    flags: dict[str, dict] = {}
    for spec in methods.REGISTRY.values():
        for f in spec.fields():
            if not f.metadata.get("cli", True):
                continue
            flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
            entry = flags.setdefault(flag, {"dest": f"opt_{f.name}", "help": [], "choices": set()})
            default = "auto" if f.default is None else f.default
            entry["help"].append(f"{spec.name}: {f.metadata['help']} (default {default})")
            entry["choices"] |= set(f.metadata.get("choices") or ())
    for flag, entry in flags.items():
        choices = sorted(entry["choices"], key=str) or None
        p.add_argument(flag, dest=entry["dest"], default=None, metavar=None if choices else "V",
                       choices=[str(c) for c in choices] if choices else None, help="; ".join(entry["help"]))


def _method_options(args, method: str) -> dict:
    """The options of ``method`` given as flags (values as typed; the registry converts and checks them)."""
    from specdec import methods

    if method not in methods.REGISTRY:
        return {}
    out = {}
    for f in methods.get(method).fields():
        value = getattr(args, f"opt_{f.name}", None)
        if value is not None:
            out[f.name] = value
    return out


def _sampling(args):
    from specdec.verify import SamplingConfig

    return SamplingConfig(args.temperature, args.top_k, args.top_p, args.seed)


def _decoder(args):
    """The SpecDecoder that ``generate`` and ``bench`` run: target, drafts, dtype, linear kernel, n-gram corpus."""
    from specdec.api import SpecDecoder
    from specdec.warmup import compile_mode

    compile = args.compile
    if compile is None and args.command == "generate":
        compile = "saved"
    dec = SpecDecoder(args.model, args.draft and [d.strip() for d in args.draft.split(",")], args.dtype,
                      linear=args.linear, corpus=None if args.corpus == "none" else args.corpus, compile=compile,
                      weights=args.weights, draft_weights=args.draft_weights,
                      compile_options=dict(args.compile_option) or None)
    if args.command == "bench" and compile_mode(compile) == "auto":
        print("specdec: compiling the decode graphs before timing (minutes the first time on this machine, "
              "then from the cache)", file=sys.stderr)
        if not dec.wait_compiled():
            print("specdec: compiling failed; the bench runs eager", file=sys.stderr)
    return dec


def cmd_generate(args) -> int:
    dec = _decoder(args)
    s = _sampling(args)
    out = dec.generate(args.prompt, args.method, args.max_new_tokens, chat=not args.no_chat, temperature=s.temperature,
                       top_k=s.top_k, top_p=s.top_p, seed=s.seed, max_memory=args.max_memory,
                       **_method_options(args, args.method))
    if args.json:
        stats = asdict(out.stats)
        print(json.dumps({"text": out.text, "tokens": out.tokens, "stats": stats}))
    else:
        print(out.text)
        st = out.stats
        print(f"[{args.method}] {len(out.tokens)} tokens in {st.total_s:.2f}s, {st.target_calls} target calls, "
              f"{st.accepted_tokens}/{st.drafted_tokens} drafts accepted, memory estimate "
              f"{(st.memory_estimate or 0) / 2**20:.0f} MiB" + (f", {st.chunks} chunks" if st.chunks > 1 else ""),
              file=sys.stderr)
    return 0


def _weights_used(dec) -> str:
    from specdec.gguf_weights import QuantLinear

    return "gguf" if any(isinstance(m, QuantLinear) for m in dec.model.modules()) else "dense"


def cmd_bench(args) -> int:
    from specdec.bench import bench_config, format_table, run_bench
    from specdec.methods import parse_label
    from specdec.prompts import read_prompts

    if args.threads is not None:
        if args.threads < 1:
            raise SystemExit("--threads must be >= 1")
        import torch

        torch.set_num_threads(args.threads)
    dec = _decoder(args)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    prompts = read_prompts(args.prompts, dec, args.limit, args.per_category)
    s = _sampling(args)
    options = {name: _method_options(args, name) for name in {parse_label(m)[0] for m in methods}}
    result = run_bench(dec, methods, prompts, args.max_new_tokens, s, options,
                       bench_config(args.model, args.draft, args.dtype, args.max_new_tokens, s, args.linear,
                                    dec.compiled, _weights_used(dec), args.draft_weights,
                                    dict(args.compile_option)), batch_size=args.batch_size,
                       ignore_eos=args.ignore_eos, rounds=args.rounds)
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def _corpus_args(c: argparse.ArgumentParser) -> None:
    a = c.add_argument
    a("--target", default=DEFAULT_MODEL, help="target model (name or folder): an instruct model for --magpie")
    a("--out", required=True, help="corpus folder; created, or extended when it exists (same target and dtype)")
    a("--gen-dtype", default="bf16", choices=["fp32", "bf16", "fp16"], help="target dtype for generation")
    a("--device", default="cpu", help="cpu (default) or cuda")
    a("--magpie", type=int, default=0, metavar="N", help="grow the corpus to N filtered user turns written by the "
      "target itself (Magpie), and reply to them")
    a("--magpie-batch", type=int, default=256, help="candidate user turns per shard")
    a("--magpie-tokens", type=int, default=128, help="longest user turn; longer ones are dropped as unfinished")
    a("--magpie-temperature", type=float, default=1.0)
    a("--magpie-top-p", type=float, default=1.0)
    a("--magpie-openings", default=None, metavar="FILE", help="task openings (JSON lines with category and text) "
      "the user turns continue, one per shard in turn, to steer Magpie towards those tasks (e.g. "
      "specdec/data/magpie_openings.jsonl: summarization, rag, translation)")
    a("--magpie-samples", type=int, default=0, help="sampled replies per user turn, besides the greedy one")
    a("--reply-order", default="oldest", choices=["oldest", "newest"], help="which user-turn shards are answered "
      "first when time runs short: oldest (in the order written) or newest (e.g. the turns just steered by "
      "--magpie-openings)")
    a("--prompts", action="append", default=[], help="prompt file (JSON lines) to reply to; repeatable")
    a("--samples", type=int, default=1, help="sampled replies per --prompts prompt, besides the greedy one")
    a("--temperature", type=float, default=0.8, help="temperature of the sampled replies")
    a("--exclude", action="append", default=[], help="evaluation prompts (JSON lines): user turns sharing a word "
      "8-gram with them are dropped, and --prompts entries equal to them are skipped; repeatable")
    a("--gen-tokens", type=int, default=192, help="new tokens per reply")
    a("--batch-size", type=int, default=32, help="generation batch size")
    a("--max-prompt", type=int, default=1024, help="prompt tokens kept for generation (the last N)")
    a("--shard-prompts", type=int, default=1024, help="prompts per reply shard of a --prompts file")
    a("--minutes", type=float, default=None, help="stop after this long, with whole shards (rerun to resume)")
    a("--threads", type=int, default=None)
    a("--seed", type=int, default=0)


def cmd_corpus(args) -> int:
    from specdec.distill.corpus_command import run_corpus

    print(json.dumps(run_corpus(args), indent=1))
    return 0


def _distill_args(d: argparse.ArgumentParser) -> None:
    a = d.add_argument
    a("--target", default=DEFAULT_MODEL, help="target model (name or folder); Llama architecture")
    a("--corpus", action="append", default=[], help="corpus folder made by `specdec corpus`; repeatable")
    a("--prompts", default=None, help="training prompts (JSON lines): their replies are added to the (first) "
      "corpus first, WORK/corpus when none is given")
    a("--out", required=True, help="folder for the trained draft (loadable with --draft OUT)")
    a("--work", default="distill_work", help="checkpoints and log (resumable)")
    a("--limit", type=int, default=None, help="use the first N prompts only")
    a("--gen-dtype", default="bf16", choices=["fp32", "bf16", "fp16"], help="target dtype for --prompts replies")
    a("--gen-tokens", type=int, default=128, help="new tokens per --prompts reply")
    a("--samples", type=int, default=1, help="sampled --prompts replies per prompt, besides the greedy one")
    a("--temperature", type=float, default=0.8, help="temperature of the sampled replies")
    a("--batch-size", type=int, default=16, help="generation batch size")
    a("--max-prompt", type=int, default=1024, help="prompt tokens kept for generation (the last N)")
    a("--arch", default="layers", choices=["layers", "eagle"],
      help="layers: a small LM from a few target layers, drafting from tokens alone; eagle: decoder layers that "
           "also read the target's last hidden state (needs specdec's sd, not hf-assisted)")
    a("--layers", default=None, help="target layers copied into the draft, in order (default 0,29; eagle: 29)")
    a("--unroll", type=int, default=1, help="eagle: training passes that read the draft's own states (1 or 2)")
    a("--labels", default="full", help="soft labels: full (the target's distribution over the draft vocabulary), "
      "topk:K (its K most likely tokens, renormalised) or hard (its argmax)")
    a("--draft-vocab", type=int, default=None, help="draft vocabulary size (most frequent reply tokens; default 8192)")
    a("--max-context", type=int, default=256, help="prompt tokens kept before the reply when training")
    a("--max-positions", type=int, default=None, help="train on a seeded subset of about N reply tokens "
      "(data-size curves)")
    a("--max-tokens", type=int, default=4096, help="padded tokens per training batch")
    a("--feature-cache", default=None, metavar="DIR", help="compute the target's hidden states over the training "
      "examples once, into a memory-mapped file here (outside the repository), instead of at every step")
    a("--steps", type=int, default=3000, help="training steps (cosine schedule length)")
    a("--train-minutes", type=float, default=None, help="stop training after this long (schedule follows it)")
    a("--lr", type=float, default=5e-4)
    a("--held-out", type=float, default=0.03, help="share of every category's prompts held out")
    a("--eval-every", type=int, default=200, help="held-out agreement every N steps (0: only at the end)")
    a("--eval-positions", type=int, default=20000, help="held-out reply tokens measured during training "
      "(the final measurement uses all)")
    a("--patience", type=int, default=3, help="stop after N measurements without a gain (0: never)")
    a("--no-autocast", dest="autocast", action="store_false", help="train in fp32 (default: bf16 autocast)")
    a("--save-dtype", default="bf16", choices=["fp32", "bf16", "fp16"])
    a("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    a("--device", default="cpu", help="where the teacher runs and the draft trains: cpu (default) or cuda")
    a("--seed", type=int, default=0)
    a("--init", default=None, metavar="DRAFT", help="go on training this draft (a name such as smollm2-eagle or a "
      "folder; same --arch) with its own layers and vocabulary instead of starting from target layers; the "
      "prompts it was held out on stay held out and those it trained on stay in training")
    a("--resume", action="store_true", help="continue training from WORK/ckpt.pt")


def cmd_distill(args) -> int:
    from specdec.distill.train import run_distill

    summary = run_distill(args)
    print(json.dumps(summary, indent=1))
    return 0


def cmd_train_disco(args) -> int:
    from specdec.distill.disco import run_train_disco

    summary = run_train_disco(args)
    v = summary["validation"]
    print(json.dumps({"out": args.out, "validation_auc": v["auc"], "tuned": summary["tuned"],
                      "seconds": summary["seconds"]}, indent=1))
    return 0


def cmd_ngram_corpus(args) -> int:
    from specdec.api import SpecDecoder
    from specdec.ngram_corpus import generate_corpus
    from specdec.prompts import read_prompts
    from specdec.ngram_tables import weights_key

    dec = SpecDecoder(args.model, dtype=args.dtype, linear=args.linear, corpus=None)
    prompts = read_prompts(args.prompts, dec, args.limit)
    excluded = []
    if args.exclude:  # e.g. the evaluation prompts: their replies must not be in the corpus
        held_out = {tuple(p.ids) for p in read_prompts(args.exclude, dec)}
        excluded = [p.id for p in prompts if tuple(p.ids) in held_out]
        prompts = [p for p in prompts if tuple(p.ids) not in held_out]
    meta = {"excluded": excluded, "model": args.model, "weights_key": weights_key(dec.model), "dtype": args.dtype,
            "prompts": str(args.prompts), "command": "specdec " + " ".join(sys.argv[1:])}
    corpus = generate_corpus(dec, [p.ids for p in prompts], args.max_new_tokens, args.batch_size, progress=True, meta=meta)
    corpus.save(args.out)
    print(json.dumps({"out": args.out, "documents": len(prompts), "tokens": int((corpus.tokens >= 0).sum()),
                      "ngrams": [k.numel() for k in corpus.keys]}))
    return 0


def _registry() -> dict:
    from specdec import methods

    return methods.REGISTRY


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specdec", description="Lossless speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate a completion")
    _common(g)
    g.add_argument("--method", default="pld", help="one of: " + "; ".join(
        f"{m.name} ({m.summary})" for m in _registry().values()))
    g.add_argument("--prompt", required=True)
    g.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    g.add_argument("--json", action="store_true", help="print text, tokens and stats as JSON")
    g.add_argument("--max-memory", default=None, help="memory the call may use beyond the weights, e.g. 2GiB "
                   "(default: 90%% of the free memory); a call that needs more runs in chunks")
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="benchmark methods against transformers side by side")
    _common(b)
    b.add_argument("--methods", default="hf,hf-pld,ar,pld",
                   help="comma list of hf, hf-pld, hf-assisted, " + ", ".join(_registry()) + "; a method may carry its "
                   "own options after colons (the option names below with underscores), e.g. sd:draft_length=2, "
                   "ngrammys:strategy=context:verify=batch; the JSON summary is keyed by each label as written")
    b.add_argument("--prompts", required=True, help="JSON lines with id, category, chat, prompt")
    b.add_argument("--limit", type=int, default=None)
    b.add_argument("--per-category", type=int, default=None, help="first K prompts of each category, interleaved")
    b.add_argument("--json", default=None, metavar="OUT", help="write the full results here")
    b.add_argument("--batch-size", type=int, default=1, help="decode the prompts N at a time, in order, each group as "
                   "one ragged batch (every method; hf as one padded generate call, hf-pld and hf-assisted prompt by "
                   "prompt): tok/s is then the throughput over all rows, ms/tok the time per token a row sees")
    b.add_argument("--rounds", type=int, default=1, help="run every group N times, the methods' order rotating: "
                   "N samples behind each ratio on a machine whose speed drifts")
    b.add_argument("--ignore-eos", action="store_true", help="every row runs to --max-new-tokens, transformers' "
                   "too: sampled methods then emit the same tokens, so their rates compare")
    b.add_argument("--threads", type=int, default=None, help="intra-op threads every method runs with (default: "
                   "torch's, from OMP_NUM_THREADS or the cores); 2 on a two-core machine is the fair setting for "
                   "pearl, which runs its target on one thread and its draft worker on the other core")
    b.set_defaults(func=cmd_bench)

    c = sub.add_parser("ngram-corpus", help="index the target's greedy replies to prompts for ngrammys' corpus drafts")
    c.add_argument("--model", default=DEFAULT_MODEL)
    c.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"])
    c.add_argument("--linear", default="auto", choices=list(LINEAR_KERNELS))
    c.add_argument("--prompts", required=True, help="JSON lines with id, category, chat, prompt (use training prompts)")
    c.add_argument("--limit", type=int, default=None)
    c.add_argument("--exclude", default=None, help="prompts file whose prompts are left out (the evaluation set)")
    c.add_argument("--max-new-tokens", type=int, default=128)
    c.add_argument("--batch-size", type=int, default=8)
    c.add_argument("--out", required=True, help="file to write (specdec/data/ngram_corpus/NAME.pt ships it)")
    c.set_defaults(func=cmd_ngram_corpus)

    k = sub.add_parser("corpus", help="grow a distillation corpus: user turns the target writes itself (Magpie) "
                       "and its replies, in resumable uint16 token shards")
    _corpus_args(k)
    k.set_defaults(func=cmd_corpus)

    d = sub.add_parser("distill", help="train a small draft model on a corpus of the target's own replies")
    _distill_args(d)
    d.set_defaults(func=cmd_distill)

    t = sub.add_parser("train-disco", help="label teacher-forced data and train DISCO's stop classifier for a draft")
    t.add_argument("--target", default=DEFAULT_MODEL, help="target model (name or folder)")
    t.add_argument("--draft", required=True, help="the draft the classifier is for (name or folder)")
    t.add_argument("--prompts", required=True, help="training prompts (JSON lines); never the dev prompts")
    t.add_argument("--out", required=True, help="folder for disco.pt and summary.json")
    t.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"],
                   help="of target and draft (labels, and the step costs the tuning simulates)")
    t.add_argument("--linear", default="auto", choices=list(LINEAR_KERNELS))
    t.add_argument("--max-new-tokens", type=int, default=128, help="reply length (replies come from the shipped "
                   "n-gram corpus where it holds them, else from ar)")
    t.add_argument("--limit", type=int, default=None, help="use the first N prompts")
    t.add_argument("--work", default=None, help="keep the teacher-forced data here; a rerun with the same inputs "
                   "reads it instead of running the models again")
    t.add_argument("--exclude", default=None, help="prompts (JSON lines) to leave out, e.g. the dev prompts")
    t.add_argument("--labels", default="hard", choices=["hard", "soft"],
                   help="hard: draft argmax == target argmax (greedy acceptance); soft: 1 - TV(draft, target)")
    t.add_argument("--hidden", type=int, default=32, help="classifier width")
    t.add_argument("--epochs", type=int, default=300)
    t.add_argument("--sim-length", type=int, default=8, help="static draft length of the simulated run that gives "
                   "each position its depth feature")
    t.add_argument("--validation", default="hash", choices=["hash", "distill-held-out"],
                   help="the prompts that tune threshold and length: a hash split (--val-fraction), or the prompts "
                        "the draft's distillation held out (a distilled draft memorised the others)")
    t.add_argument("--val-fraction", type=float, default=0.2, help="hash split: share of prompts held out")
    t.add_argument("--leave-one-out", action="store_true", help="also report leave-one-category-out ROC-AUC")
    t.add_argument("--transfer", default=None, help="a classifier trained for another draft: report its ROC-AUC "
                   "on this draft's validation data")
    t.set_defaults(func=cmd_train_disco)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FloatingPointError, MemoryError) as exc:
        print(f"specdec: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
