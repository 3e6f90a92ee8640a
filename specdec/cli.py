"""Command line: ``specdec generate`` and ``specdec bench``."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from specdec.hub import DEFAULT_MODEL


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="smollm2 (default), gemma3-270m, or a local model folder")
    p.add_argument("--draft", default=None, help="draft model (same vocabulary), needed by sd and hf-assisted")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--num-tokens", type=int, default=None, help="pld: draft length (default 10)")
    p.add_argument("--draft-length", type=int, default=None, help="sd: draft length (default 5)")
    p.add_argument("--schedule", choices=["cost", "static", "heuristic"], default=None,
                   help="draft-length schedule: pld cost (default), static, heuristic; sd static (default), heuristic")


def _method_options(args, method: str) -> dict:
    names = {"pld": {"num_tokens": args.num_tokens, "schedule": args.schedule},
             "sd": {"draft_length": args.draft_length, "schedule": args.schedule}}
    return {k: v for k, v in names.get(method, {}).items() if v is not None}


def _sampling(args):
    from specdec.verify import SamplingConfig

    return SamplingConfig(args.temperature, args.top_k, args.top_p, args.seed)


def cmd_generate(args) -> int:
    from specdec.api import SpecDecoder

    dec = SpecDecoder(args.model, args.draft, args.dtype)
    s = _sampling(args)
    out = dec.generate(args.prompt, args.method, args.max_new_tokens, chat=not args.no_chat, temperature=s.temperature,
                       top_k=s.top_k, top_p=s.top_p, seed=s.seed, **_method_options(args, args.method))
    if args.json:
        stats = asdict(out.stats)
        print(json.dumps({"text": out.text, "tokens": out.tokens, "stats": stats}))
    else:
        print(out.text)
        st = out.stats
        print(f"[{args.method}] {len(out.tokens)} tokens in {st.total_s:.2f}s, {st.target_calls} target calls, "
              f"{st.accepted_tokens}/{st.drafted_tokens} drafts accepted", file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    from specdec.api import SpecDecoder
    from specdec.bench import bench_config, format_table, read_prompts, run_bench

    dec = SpecDecoder(args.model, args.draft, args.dtype)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    prompts = read_prompts(args.prompts, dec, args.limit, args.per_category)
    s = _sampling(args)
    options = {m: _method_options(args, m) for m in methods}
    result = run_bench(dec, methods, prompts, args.max_new_tokens, s, options,
                       bench_config(args.model, args.draft, args.dtype, args.max_new_tokens, s))
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specdec", description="Lossless speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate a completion")
    _common(g)
    g.add_argument("--method", default="pld", help="ar, sd or pld")
    g.add_argument("--prompt", required=True)
    g.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    g.add_argument("--json", action="store_true", help="print text, tokens and stats as JSON")
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="benchmark methods against transformers side by side")
    _common(b)
    b.add_argument("--methods", default="hf,hf-pld,ar,pld", help="comma list of hf, hf-pld, hf-assisted, ar, sd, pld")
    b.add_argument("--prompts", required=True, help="JSON lines with id, category, chat, prompt")
    b.add_argument("--limit", type=int, default=None)
    b.add_argument("--per-category", type=int, default=None, help="first K prompts of each category, interleaved")
    b.add_argument("--json", default=None, metavar="OUT", help="write the full results here")
    b.set_defaults(func=cmd_bench)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FloatingPointError) as exc:
        print(f"specdec: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
