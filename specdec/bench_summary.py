"""The bench JSON's summary: per-method totals over runs, and the text table ``specdec bench`` prints.

Kept apart from :mod:`specdec.bench` so that a bench run in another environment (vLLM's,
:mod:`specdec.integrations.vllm_bench`) writes the same summary without loading specdec's engine."""
from __future__ import annotations

import platform

from specdec.counters import add_counters
from specdec.cpuinfo import cpu_fields


def cpu_name() -> str:
    """The CPU's model name and the matrix instructions that set its bf16 speed, e.g. ``AMD EPYC (AVX-512 BF16, no
    AMX)``: bench files record it, since runs on other CPUs are not comparable."""
    fields = cpu_fields()
    name, flags = fields.get("model name") or platform.processor() or platform.machine(), set(fields.get("flags", "").split())
    if not flags:
        return name
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    if "avx512_bf16" in flags:
        isa += " BF16"
    return f"{name} ({isa}, {'AMX' if 'amx_tile' in flags else 'no AMX'})"


def _path(runs: list[dict]) -> str:
    """Which forward path a method's target calls took: ``compiled`` (every decode forward through
    torch.compile), ``eager``, or ``mixed``."""
    compiled = [r.get("compiled_target_calls", 0) > 0 for r in runs if r["target_calls"] > 1]
    return "compiled" if compiled and all(compiled) else "mixed" if any(compiled) else "eager"


def summarize(runs: list[dict], reference: str = "hf") -> dict:
    """Per-method totals: throughput, speedup over ``reference`` (``hf``; a vLLM bench file: ``vllm``),
    tokens per target call, acceptance, identity."""
    summary = {}
    for m in dict.fromkeys(r["method"] for r in runs):
        rs = [r for r in runs if r["method"] == m]
        tokens = sum(r["new_tokens"] for r in rs)
        seconds = sum(r["seconds"] for r in rs)
        calls = sum(r["target_calls"] for r in rs)
        drafted = [r["drafted_tokens"] for r in rs if r["drafted_tokens"] is not None]
        accepted = [r["accepted_tokens"] for r in rs if r["accepted_tokens"] is not None]
        # a batched run (specdec bench --batch-size) counts its rows
        ident = [(r.get("identical_rows", r["identical_to_reference"]), r.get("batch_size", 1)) for r in rs
                 if r["identical_to_reference"] is not None]
        row_tokens = sum(r["new_tokens"] / r.get("rows_at_once", r.get("batch_size", 1)) for r in rs)
        drafter: dict = {}
        for r in rs:  # sum drafter counters (e.g. ngrammys' allocation per source) over prompts
            drafter = add_counters(drafter, r.get("drafter") or {})
        # Weights read per second of decoding: bytes held x target forwards after the prompt's, over the time
        # after the prompt (hf reports no prompt time: its figure includes the prompt and reads low).
        decode_s = sum(r["seconds"] - (r.get("prefill_seconds") or 0.0) for r in rs)
        read = sum(r.get("weight_bytes", 0) * max(r["target_calls"] - 1, 0) for r in rs)
        summary[m] = {
            "tokens_per_second": tokens / seconds if seconds else 0.0,
            # time per output token as a row sees it (a batch's rows share its seconds)
            "ms_per_token": 1e3 * seconds / row_tokens if row_tokens else None,
            "weight_bytes_per_s": read / decode_s if decode_s and read else None,
            "tokens_per_call": tokens / calls if calls else None,
            "accept_rate": sum(accepted) / sum(drafted) if drafted and sum(drafted) else None,
            "identical_rate": sum(i for i, _ in ident) / sum(n for _, n in ident) if ident else None,
            "path": _path(rs),
        }
        if drafter:
            summary[m]["drafter"] = drafter
        compiled = sum(r.get("graphs_compiled", 0) for r in rs)
        if compiled:  # compiles inside timed runs: their seconds count against the method
            summary[m]["graphs_compiled"] = compiled
            summary[m]["compile_seconds"] = sum(r.get("compile_seconds", 0.0) for r in rs)
    ref = summary.get(reference, {}).get("tokens_per_second")
    for m, s in summary.items():
        s["speedup"] = s["tokens_per_second"] / ref if ref else None
    return summary


def format_table(result: dict) -> str:
    """The summary as a fixed-width text table."""
    w = max([12] + [len(m) + 1 for m in result["summary"]])
    head = (f"{'method':<{w}}{'tok/s':>9}{'ms/tok':>8}{'speedup':>9}{'tok/call':>10}{'accept':>8}{'identical':>11}"
            f"{'GB/s':>7}")
    lines = [head, "-" * len(head)]
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for m, s in result["summary"].items():
        gbs = s.get("weight_bytes_per_s")
        lines.append(f"{m:<{w}}{s['tokens_per_second']:>9.1f}{fmt(s.get('ms_per_token'), '.1f'):>8}"
                     f"{fmt(s['speedup'], '.2f') + 'x':>9}"
                     f"{fmt(s['tokens_per_call'], '.2f'):>10}{fmt(s['accept_rate'], '.2f'):>8}"
                     f"{fmt(s['identical_rate'], '.0%'):>11}{fmt(gbs and gbs / 1e9, '.1f'):>7}")
    for m, s in result["summary"].items():
        if s.get("graphs_compiled"):
            lines.append(f"{m}: {s['graphs_compiled']} graph(s) compiled inside timed runs, "
                         f"{s['compile_seconds']:.1f} s of its time (a forward no warm-up graph covered)")
    cfg = result.get("config", {})
    if cfg.get("batch_size", 1) > 1:
        lines.append(f"batches of {cfg['batch_size']} prompts: tok/s over all rows; ms/tok per row; tok/call per "
                     f"target forward of a batch")
    if cfg.get("stream_bytes_per_s"):
        lines.append(f"GB/s: target weights read per second of decoding ({cfg['weight_bytes'] / 1e6:.1f} MB a forward "
                     f"as held, weights={cfg.get('weights', '?')}; hf: {cfg['dense_weight_bytes'] / 1e6:.1f} MB dense, "
                     f"prompt time included); this machine's measured stream (read) bandwidth: "
                     f"{cfg['stream_bytes_per_s'] / 1e9:.1f} GB/s")
    return "\n".join(lines)
