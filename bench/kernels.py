"""Microbenchmarks of the specdec CPU kernels against the torch code a user would write instead.

Each case times our operator and its baseline in the same run, interleaved (ours, baseline,
baseline, ours, ...), and reports median wall-clock times and ratio = baseline / ours. Threads:
torch's default (``--threads`` to change).

    python -m bench.kernels [--json OUT] [--reps 30] [--only tree_attention]

The same cases run under pytest-benchmark: ``pytest bench/test_kernels_bench.py --benchmark-only``.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

import specdec.kernels as K
from specdec.kernels import reference as R


@dataclass
class Case:
    """One benchmark: ``ours()`` and ``baseline()`` compute the same result; ``nbytes``, where set, is the least
    memory ``ours`` must read (:mod:`bench.kernels_cuda` reports GB/s from it)."""

    op: str
    shape: str
    ours: Callable[[], object]
    baseline: Callable[[], object]
    baseline_name: str
    nbytes: int = 0


# ----------------------------------------------------------------------------------------
# Baselines
# ----------------------------------------------------------------------------------------


def ngram_match_torch(tokens: torch.Tensor, lengths: torch.Tensor, n_min: int, n_max: int, k: int, w: int):
    """Batched torch n-gram matching (the transformers / vLLM-GPU approach, plus ranking).

    For n from n_max down: unfold the context into n-windows, compare them with each row's suffix,
    keep rows without a longer match, then rank the matched continuations by count and recency with
    a sort over 64-bit continuation hashes. tokens ``[B, L]`` int64, lengths ``[B]`` -> like
    :func:`specdec.kernels.ngram_match`.
    """
    b, length = tokens.shape
    ar = torch.arange(length)
    padded = torch.cat([torch.where(ar < lengths[:, None], tokens, -1), tokens.new_full((b, w), -1)], 1)
    conts = padded.unfold(1, w, 1)  # [B, L + 1, w]: the continuation starting at each position
    weights = torch.randint(1, 2**62, (w,), generator=torch.Generator().manual_seed(0))
    hashes = ((conts + 2) * weights).sum(-1)  # [B, L + 1] (int64 arithmetic wraps)
    drafts = tokens.new_full((b, k, w), -1)
    dlens = torch.zeros(b, k, dtype=torch.int32)
    counts = torch.zeros(b, k, dtype=torch.int32)
    match_n = torch.zeros(b, dtype=torch.int32)
    done = torch.zeros(b, dtype=torch.bool)
    rows = torch.arange(b)[:, None]
    sentinel = torch.iinfo(torch.int64).max
    for n in range(n_max, n_min - 1, -1):
        if bool(done.all()):
            break
        starts = length - n + 1
        windows = padded[:, :length].unfold(1, n, 1)  # [B, starts, n]
        suffix = padded.gather(1, (lengths[:, None] - n + torch.arange(n)).clamp(min=0))
        p = torch.arange(starts)
        hit = (windows == suffix[:, None]).all(-1) & (p + n < lengths[:, None]) & ~done[:, None]
        hit &= (lengths > n)[:, None]
        found = hit.any(-1)
        if not bool(found.any()):
            continue
        h = torch.where(hit, hashes[:, n:n + starts], sentinel)
        sh, order = h.sort(dim=-1, stable=True)  # equal continuations adjacent, oldest first
        first = torch.searchsorted(sh, sh, side="left")
        last = torch.searchsorted(sh, sh, side="right")
        is_latest = (torch.arange(starts) == last - 1) & (sh != sentinel)
        score = torch.where(is_latest, (last - first) * (length + 1) + order, -1)
        top_score, top = score.topk(min(k, starts), -1)
        take = top_score >= 0
        pos = order.gather(1, top) + n
        d = conts[rows, pos]  # [B, k', w]
        sel = found[:, None] & take
        kk = top.shape[1]
        drafts[:, :kk] = torch.where(sel[..., None], d, drafts[:, :kk])
        dlens[:, :kk] = torch.where(sel, (d >= 0).sum(-1).int(), dlens[:, :kk])
        counts[:, :kk] = torch.where(sel, (top_score // (length + 1)).int(), counts[:, :kk])
        match_n = torch.where(found, n, match_n)
        done |= found
    return drafts, dlens, counts, match_n


def topk_entropy_torch(logits: torch.Tensor, k: int, temperature: float = 1.0):
    """softmax + topk + entropy in torch: ``H = logsumexp(x) - sum(p * x)``."""
    x = logits.float() / temperature
    lse = torch.logsumexp(x, -1)
    p = torch.softmax(x, -1)
    entropy = lse - (p * x).sum(-1)
    probs, ids = p.topk(k, -1)
    return probs, ids, entropy, lse


def kv_compact_torch(caches: list[torch.Tensor], src: torch.Tensor, dst_start: torch.Tensor, counts: torch.Tensor):
    """Per layer: gather the accepted positions, then ``copy_`` them into place (Medusa/EAGLE style)."""
    for row in range(src.shape[0]):
        n, d0 = int(counts[row]), int(dst_start[row])
        s = src[row, :n]
        for cache in caches:
            cache[row, :, d0:d0 + n].copy_(cache[row].index_select(1, s))


def tree_attention_sdpa(q, kv_k, kv_v, cache_lens, prefix_len, packed_mask):
    """What a user writes without a tree kernel: unpack the ancestor mask into a dense
    ``[B, 1, T, S + T]`` boolean mask over cache + tree and call SDPA (K/V laid out contiguously)."""
    mask = R.tree_attention_mask(cache_lens, prefix_len, packed_mask, q.shape[2])
    return torch.nn.functional.scaled_dot_product_attention(q, kv_k, kv_v, attn_mask=mask, enable_gqa=True)


# ----------------------------------------------------------------------------------------
# Cases
# ----------------------------------------------------------------------------------------


def random_tree_parents(t: int, g: torch.Generator) -> torch.Tensor:
    """An EAGLE-like tree: each node hangs under one of the 8 most recent nodes."""
    return torch.tensor([-1] + [int(torch.randint(max(0, i - 8), i, (1,), generator=g)) for i in range(1, t)])


def repetitive_tokens(b: int, length: int) -> torch.Tensor:
    """``[b, length]`` int64 repetitive text: a small vocabulary with copied spans, so matches and ties are
    frequent (seeded)."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 64, (b, length), generator=g)
    for r in range(b):
        for _ in range(40):
            s, d = (int(x) for x in torch.randint(0, length - 64, (2,), generator=g))
            tokens[r, d:d + 32] = tokens[r, s:s + 32].clone()
    return tokens


def ngram_case() -> Case:
    b, length = 8, 4096
    tokens = repetitive_tokens(b, length)
    lengths = torch.full((b,), length)
    args = (tokens, lengths, 1, 4, 10, 10)
    got, want = K.ngram_match(*args), ngram_match_torch(*args)
    assert all(torch.equal(x, y) for x, y in zip(got, want)), "the torch n-gram baseline disagrees with the kernel"
    return Case("ngram_match", "B=8 L=4096 n=1..4 k=10 w=10", lambda: K.ngram_match(*args),
                lambda: ngram_match_torch(*args), "batched unfold per n + hash-sort ranking")


def topk_entropy_case(dtype: torch.dtype) -> Case:
    logits = (torch.randn(16, 49152, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    name = str(dtype).replace("torch.", "")
    return Case("topk_entropy", f"N=16 V=49152 k=10 {name}", lambda: K.topk_entropy(logits, 10),
                lambda: topk_entropy_torch(logits, 10), "logsumexp + softmax + topk + sum(p*x)")


def kv_compact_case() -> Case:
    layers, b, h, d, s, moved = 30, 1, 3, 64, 2048, 16
    caches = [torch.randn(b, h, s, d) for _ in range(2 * layers)]
    dst_start = torch.tensor([1500])
    src = (1600 + torch.arange(moved) * 2)[None]  # accepted tree nodes, spread over the written tree
    counts = torch.tensor([moved])
    return Case("kv_compact", f"layers={layers} B=1 H=3 D=64 S=2048 moved={moved}",
                lambda: K.kv_compact(caches, src, dst_start, counts),
                lambda: kv_compact_torch(caches, src, dst_start, counts), "per-layer index_select + index_copy_")


def tree_attention_case(t: int, dtype: torch.dtype) -> Case:
    g = torch.Generator().manual_seed(0)
    b, hq, hkv, d, s = 1, 9, 3, 64, 1024
    q = torch.randn(b, hq, t, d, generator=g).to(dtype)
    kv_k = torch.randn(b, hkv, s + t, d, generator=g).to(dtype)  # cache then tree, as the runtime lays them out
    kv_v = torch.randn(b, hkv, s + t, d, generator=g).to(dtype)
    lens = torch.tensor([s])
    parents = random_tree_parents(t, g)
    mask = K.pack_mask(torch.stack([_ancestors(parents)]))
    ours = lambda: K.tree_attention(q, kv_k[:, :, :s], kv_v[:, :, :s], lens, kv_k[:, :, s:], kv_v[:, :, s:], mask)  # noqa: E731
    base = lambda: tree_attention_sdpa(q, kv_k, kv_v, lens, s, mask)  # noqa: E731
    torch.testing.assert_close(ours().float(), base().float(), atol=2e-2, rtol=2e-2)
    name = str(dtype).replace("torch.", "")
    return Case("tree_attention", f"Hq=9 Hkv=3 D=64 S=1024 T={t} {name}", ours, base,
                "dense bool mask from the packed mask + SDPA (enable_gqa)")


def _batch_attention_inputs(b: int, s: int, t: int, dtype: torch.dtype, g: torch.Generator):
    """SmolLM2's attention shape (Hq=9 Hkv=3 D=64): queries ``[b, 9, t, 64]``, keys and values
    ``[b, 3, s + t, 64]`` (``s`` cached, then the tree), and ``lens [b]`` = ``s``."""
    q = torch.randn(b, 9, t, 64, generator=g).to(dtype)
    kv_k = torch.randn(b, 3, s + t, 64, generator=g).to(dtype)
    kv_v = torch.randn(b, 3, s + t, 64, generator=g).to(dtype)
    return q, kv_k, kv_v, torch.full((b,), s)


def tree_sdpa_case(b: int, s: int, t: int, dtype: torch.dtype) -> Case:
    """The kernel against SDPA with a dense mask built beforehand, as the runner's SDPA route shares one mask
    among all layers of a forward (``specdec.model.WIDE_TREE_SDPA``): ``b`` rows of ``s`` cached tokens and a
    random tree of ``t`` nodes each."""
    g = torch.Generator().manual_seed(0)
    q, kv_k, kv_v, lens = _batch_attention_inputs(b, s, t, dtype, g)
    mask = K.pack_mask(torch.stack([_ancestors(random_tree_parents(t, g)) for _ in range(b)]))
    dense = R.tree_attention_mask(lens, s, mask, t)
    native = K.native_ops().tree_attention  # as the runner calls it: no wrapper checks on either side
    ours = lambda: native(q, kv_k[:, :, :s], kv_v[:, :, :s], lens, kv_k[:, :, s:], kv_v[:, :, s:], mask)  # noqa: E731
    base = lambda: torch.nn.functional.scaled_dot_product_attention(q, kv_k, kv_v, attn_mask=dense, enable_gqa=True)  # noqa: E731
    torch.testing.assert_close(ours().float(), base().float(), atol=2e-2, rtol=2e-2)
    name = str(dtype).replace("torch.", "")
    return Case("tree_attention", f"B={b} S={s} T={t} {name}: vs SDPA", ours, base, "SDPA, dense mask prebuilt")


DIRECT_ROWS = "SPECDEC_ATTENTION_DIRECT_ROWS"
DIRECT8_ROWS = "SPECDEC_ATTENTION_DIRECT8_ROWS"
SPLIT_KEYS = "SPECDEC_ATTENTION_SPLIT_KEYS"


def _with_switch(name: str, value: str | None, fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` run with the extension's switch ``$name`` set to ``value`` (None: unset) for the call, then restored
    (both sides of an A/B pay the same environment writes)."""
    def run():
        outer = os.environ.get(name)
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
        try:
            return fn()
        finally:
            if outer is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = outer
    return run


def _chain_attention(b: int, s: int, t: int, dtype: torch.dtype) -> Callable[[], torch.Tensor]:
    """The native kernel on ``b`` rows of ``s`` cached tokens and a causal chain of ``t`` (a decode step at t = 1)."""
    q, kv_k, kv_v, lens = _batch_attention_inputs(b, s, t, dtype, torch.Generator().manual_seed(0))
    mask = K.pack_mask(torch.tril(torch.ones(t, t, dtype=torch.bool)).expand(b, t, t)) if t > 1 else None
    native = K.native_ops().tree_attention
    return lambda: native(q, kv_k[:, :, :s], kv_v[:, :, :s], lens, kv_k[:, :, s:], kv_v[:, :, s:], mask)


def tree_attention_paths_case(b: int, s: int, t: int, dtype: torch.dtype, lanes: int = 16) -> Case:
    """One of the CPU kernel's direct paths on one input against every task through the key panels (both switches
    0): tasks of up to 32 rows on the 16-lane paths (the AVX-512 default, ``SPECDEC_ATTENTION_DIRECT_ROWS=32``) or
    on the 8-lane ones (the AVX2 default, ``SPECDEC_ATTENTION_DIRECT8_ROWS=32``), ``lanes``.
    ``b`` rows of ``s`` cached tokens and a causal chain of ``t`` (a batched decode step at ``t = 1``)."""
    attend = _chain_attention(b, s, t, dtype)
    on = (DIRECT_ROWS, DIRECT8_ROWS)[lanes == 8]
    off = (DIRECT8_ROWS, DIRECT_ROWS)[lanes == 8]
    direct = _with_switch(on, "32", _with_switch(off, "0", attend))
    panels = _with_switch(DIRECT_ROWS, "0", _with_switch(DIRECT8_ROWS, "0", attend))
    torch.testing.assert_close(direct().float(), panels().float(), atol=2e-2, rtol=2e-2)
    name = str(dtype).replace("torch.", "")
    return Case("tree_attention", f"B={b} S={s} T={t} {name}: direct, {lanes} lanes", direct, panels,
                f"key panels ({DIRECT_ROWS}={DIRECT8_ROWS}=0)")


def tree_attention_splits_case(s: int, dtype: torch.dtype) -> Case:
    """A one-row decode step over ``s`` cached tokens (3 tasks, one per kv head): the kernel's default, which cuts
    the keys every 512 rows into tasks of their own, against no cut (``SPECDEC_ATTENTION_SPLIT_KEYS=0``). On one
    thread this times the cost of the merge alone."""
    attend = _chain_attention(1, s, 1, dtype)
    split, whole = _with_switch(SPLIT_KEYS, None, attend), _with_switch(SPLIT_KEYS, "0", attend)
    torch.testing.assert_close(split().float(), whole().float(), atol=2e-2, rtol=2e-2)
    name = str(dtype).replace("torch.", "")
    return Case("tree_attention", f"B=1 S={s} T=1 {name}: key splits", split, whole, f"no splits ({SPLIT_KEYS}=0)")


def _ancestors(parents: torch.Tensor) -> torch.Tensor:
    t = parents.shape[0]
    vis = torch.eye(t, dtype=torch.bool)
    for i in range(1, t):
        vis[i] |= vis[int(parents[i])]
    return vis


def tree_verify_case(accept: str) -> Case:
    g = torch.Generator().manual_seed(0)
    b, t, v = 1, 64, 49152
    logits = torch.randn(b, t, v, generator=g)
    pred = logits.argmax(-1)
    if accept == "all":  # worst case for the lazy argmax: a chain accepted to the end
        parents = torch.arange(-1, t - 1)[None]
        tokens = pred.gather(1, parents.clamp(min=0))
    else:  # a tree whose nodes follow the target 80% of the time: a few levels are accepted
        parents = random_tree_parents(t, g)[None]
        tokens = torch.where(torch.rand(b, t, generator=g) < 0.8, pred.gather(1, parents.clamp(min=0)), 7)
    ours = lambda: K.tree_verify_greedy(tokens, parents, logits)  # noqa: E731
    base = lambda: R.tree_verify_greedy(tokens, parents, logits)  # noqa: E731
    assert all(torch.equal(x, y) for x, y in zip(ours(), base()))
    depth = int(ours()[1][0])
    return Case("tree_verify_greedy", f"B=1 T=64 V=49152 {accept} (path {depth})", ours, base,
                "torch reference (argmax at every node + pointer jumping)")


def skinny_linear_case(m: int, dtype: torch.dtype) -> Case:
    """M rows through 24 weights of SmolLM2's MLP shape (85 MB in fp32, 42 MB in bf16: more than the
    L3 cache, so the weights stream from memory as in a model step)."""
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(1536, 576, generator=g).to(dtype) for _ in range(24)]
    x = torch.randn(m, 576, generator=g).to(dtype)
    ours = lambda: [K.skinny_linear(x, w) for w in ws]  # noqa: E731
    base = lambda: [torch.nn.functional.linear(x, w) for w in ws]  # noqa: E731
    torch.testing.assert_close(ours()[0].float(), base()[0].float(), atol=0.3, rtol=2e-2)
    name = str(dtype).replace("torch.", "")
    return Case("skinny_linear", f"24 x [1536, 576] M={m} {name}", ours, base, "torch.nn.functional.linear")


def packed_linear_case(m: int, dtype: torch.dtype) -> Case:
    """The same 24 weights as :func:`skinny_linear_case`, prepacked: the packed kernel against skinny_linear."""
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(1536, 576, generator=g).to(dtype) for _ in range(24)]
    ps = [K.pack_linear_weight(w) for w in ws]
    x = torch.randn(m, 576, generator=g).to(dtype)
    ours = lambda: [K.packed_linear(x, p, 1536) for p in ps]  # noqa: E731
    base = lambda: [K.skinny_linear(x, w) for w in ws]  # noqa: E731
    torch.testing.assert_close(ours()[0].float(), base()[0].float(), atol=0.3, rtol=2e-2)
    name = str(dtype).replace("torch.", "")
    return Case("packed_linear", f"24 x [1536, 576] M={m} {name}", ours, base, "specdec skinny_linear")


def quant_linear_case(m: int, dtype: torch.dtype) -> Case:
    """M rows through 64 weights of SmolLM2's MLP shape kept as Q4_1 blocks (the embedded model's layer format:
    4-bit codes, fp16 scale and min per 32 weights; 36 MB, more than the L3 cache), against ``F.linear`` on the
    same weights dense in x's dtype, the product a transformers user runs."""
    from specdec.draft_weights import q4_codes
    from specdec.kernels.quant import pack_quant_weight, quant_linear

    g = torch.Generator().manual_seed(0)
    qs = [pack_quant_weight(q4_codes(torch.randn(1536, 576, generator=g) * 0.02)) for _ in range(64)]
    ws = [q.dequantize().to(dtype) for q in qs]
    x = torch.randn(m, 576, generator=g).to(dtype)
    ours = lambda: [quant_linear(x, q) for q in qs]  # noqa: E731
    base = lambda: [torch.nn.functional.linear(x, w) for w in ws]  # noqa: E731
    torch.testing.assert_close(ours()[0].float(), base()[0].float(), atol=0.05, rtol=2e-2)
    name = str(dtype).replace("torch.", "")
    return Case("quant_linear", f"64 x [1536, 576] Q4_1 M={m} {name}", ours, base, "torch.nn.functional.linear (dense)")


# (id, builder): building a case makes its inputs and checks ours against the baseline once.
CASES: list[tuple[str, Callable[[], Case]]] = [
    ("ngram_match", ngram_case),
    ("topk_entropy-fp32", lambda: topk_entropy_case(torch.float32)),
    ("topk_entropy-bf16", lambda: topk_entropy_case(torch.bfloat16)),
    ("kv_compact", kv_compact_case),
    *((f"tree_attention-T{t}-{name}", functools.partial(tree_attention_case, t, dt))
      for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)) for t in (1, 8, 16, 64, 128)),
    *((f"tree_attention_paths-B{b}-T{t}-{name}", functools.partial(tree_attention_paths_case, b, s, t, dt))
      for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16))
      for b, s, t in ((16, 400, 1), (16, 400, 2), (16, 400, 6), (1, 1024, 1), (1, 1024, 4), (1, 1024, 8))),
    *((f"tree_attention_paths8-B{b}-S{s}-T{t}-{name}", functools.partial(tree_attention_paths_case, b, s, t, dt, 8))
      for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16))
      for b, s, t in ((1, 200, 1), (1, 400, 1), (1, 1024, 1), (1, 400, 4), (16, 400, 1), (16, 400, 2))),
    *((f"tree_attention_splits-S{s}-{name}", functools.partial(tree_attention_splits_case, s, dt))
      for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)) for s in (400, 800, 1500, 3000)),
    *((f"tree_sdpa-B{b}-T{t}-{name}", functools.partial(tree_sdpa_case, b, s, t, dt))
      for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16))
      for b, s, t in ((1, 400, 4), (1, 400, 6), (1, 400, 8), (1, 400, 11), (1, 400, 16), (1, 400, 32),
                      (16, 400, 2), (16, 400, 4), (16, 400, 8))),
    ("tree_verify_greedy-typical", lambda: tree_verify_case("typical")),
    ("tree_verify_greedy-all", lambda: tree_verify_case("all")),
    *((f"skinny_linear-M{m}-{name}", functools.partial(skinny_linear_case, m, dt))
      for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)) for m in (1, 2, 4, 8, 16)),
    *((f"packed_linear-M{m}-{name}", functools.partial(packed_linear_case, m, dt))
      for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)) for m in (1, 2, 4, 8, 16, 64)),
    *((f"quant_linear-M{m}-{name}", functools.partial(quant_linear_case, m, dt))
      for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)) for m in (1, 2, 3, 4, 8)),
]


# ----------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------


def _time_ms(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - t0)


def measure(case: Case, reps: int = 30, warmup: int = 3) -> dict:
    """Median times of ours and the baseline, interleaved (the order alternates every repetition)."""
    for _ in range(warmup):
        case.ours()
        case.baseline()
    ours, base = [], []
    for i in range(reps):
        if i % 2 == 0:
            ours.append(_time_ms(case.ours))
            base.append(_time_ms(case.baseline))
        else:
            base.append(_time_ms(case.baseline))
            ours.append(_time_ms(case.ours))
    o, b = statistics.median(ours), statistics.median(base)
    return {"op": case.op, "shape": case.shape, "ours_ms": round(o, 4), "baseline_ms": round(b, 4),
            "ratio": round(b / o, 2), "baseline": case.baseline_name}


def format_table(results: list[dict]) -> str:
    lines = [f"{'op':<20} {'shape':<44} {'ours ms':>9} {'base ms':>9} {'ratio':>6}"]
    for r in results:
        lines.append(f"{r['op']:<20} {r['shape']:<44} {r['ours_ms']:>9.3f} {r['baseline_ms']:>9.3f} {r['ratio']:>6.2f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None, help="write {'results': [...]} here")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--only", default=None, help="run the cases whose id contains this string")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not K.has_native("tree_attention"):
        raise SystemExit("specdec._C is not built (or predates the tree kernels): pip install --no-build-isolation -e .")
    results = []
    for case_id, build in CASES:
        if args.only and args.only not in case_id:
            continue
        results.append(measure(build(), args.reps))
        print(format_table(results[-1:]).splitlines()[-1], flush=True)
    print()
    print(f"threads={torch.get_num_threads()}, median of {args.reps} interleaved runs; ratio = baseline / ours")
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "reps": args.reps, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
