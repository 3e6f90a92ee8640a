"""What the grid scripts share: their command line, measuring (or reloading) one bench run, saving a figure."""
from __future__ import annotations

import argparse
import json


def grid_parser(doc: str, max_new_tokens: int) -> argparse.ArgumentParser:
    """The options every grid script takes (add its own knobs to the returned parser)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--prompts", default="bench/dev_prompts.jsonl")
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--shard", default="0/1", help="I/N: run every N-th prompt from the I-th (merge with bench.report)")
    ap.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    ap.add_argument("--json", default=None)
    ap.add_argument("--from-json", default=None, help="plot this earlier result instead of measuring")
    return ap


def load_or_run(args, labels: list[str], draft: str | None = None, **decoder) -> dict:
    """The bench result of ``--from-json``, or one ``run_bench`` of ``labels`` (printed, and written to ``--json``)."""
    if args.from_json:
        with open(args.from_json) as f:
            return json.load(f)
    from specdec.api import SpecDecoder
    from specdec.bench import bench_config, format_table, read_prompts, run_bench
    from specdec.verify import SamplingConfig

    dec = SpecDecoder("smollm2", draft=draft, dtype=args.dtype, **decoder)
    i, n = (int(x) for x in args.shard.split("/"))
    prompts = read_prompts(args.prompts, dec, per_category=args.per_category)[i::n]
    config = bench_config("smollm2", draft, args.dtype, args.max_new_tokens, SamplingConfig(),
                          decoder.get("linear", "auto"))
    result = run_bench(dec, labels, prompts, args.max_new_tokens, SamplingConfig(), {}, config)
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


def save_figure(fig, title: str, png: str) -> None:
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
