"""Microbenchmarks of specdec's CUDA and Triton kernels against the torch code a user would write instead.

The GPU twin of :mod:`bench.kernels`: every case runs the operator's ``auto`` backend on CUDA tensors (the
CUDA extension or Triton) and a torch baseline on the same tensors, checks they agree, and times both with
``triton.testing.do_bench`` (median over repetitions, CUDA-synchronised, L2 flushed between runs).
``GB/s`` is the bytes an operator must read at least (logits, KV, cache rows), divided by our time: the
distance to the card's memory bandwidth (about 3.35 TB/s on an H100 SXM).

    python -m bench.kernels_cuda [--json OUT] [--only tree_attention]
"""
from __future__ import annotations

import argparse
import json
from typing import Callable

import torch

import specdec.kernels as K
from bench.kernels import (Case, _ancestors, _batch_attention_inputs, random_tree_parents, repetitive_tokens,
                           topk_entropy_torch, tree_attention_sdpa)
from specdec.kernels import reference as R

CUDA = torch.device("cuda")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def tree_attention_case(b: int, s: int, t: int, dtype: torch.dtype) -> Case:
    """SmolLM2's attention shape (Hq=9 Hkv=3 D=64): ``b`` rows of ``s`` cached tokens and an EAGLE-like tree
    of ``t`` nodes each, against SDPA over a dense mask unpacked from the same packed mask."""
    g = torch.Generator().manual_seed(0)
    q, kv_k, kv_v, lens = (x.to(CUDA) for x in _batch_attention_inputs(b, s, t, dtype, g))
    mask = K.pack_mask(torch.stack([_ancestors(random_tree_parents(t, g)) for _ in range(b)])).to(CUDA)
    # Triton forced on CUDA (auto leaves large fp32 trees to SDPA, and this case times the kernel); the host
    # check of tests/test_bench.py runs it on CPU tensors, where auto picks the C++ kernel
    backend = "triton" if q.is_cuda else None
    ours = lambda: K.tree_attention(q, kv_k[:, :, :s], kv_v[:, :, :s], lens, kv_k[:, :, s:], kv_v[:, :, s:],  # noqa: E731
                                   mask, backend=backend)
    base = lambda: tree_attention_sdpa(q, kv_k, kv_v, lens, s, mask)  # noqa: E731
    torch.testing.assert_close(ours().float(), base().float(), atol=2e-2, rtol=2e-2)
    nbytes = 2 * kv_k.numel() * kv_k.element_size() + q.numel() * q.element_size()
    return Case("tree_attention", f"B={b} S={s} T={t} {_name(dtype)}", ours, base,
                "dense bool mask from the packed mask + SDPA (enable_gqa)", nbytes)


def ngram_case(b: int, length: int) -> Case:
    """Repetitive rows (a small vocabulary with copied spans): the CUDA kernel against the torch reference."""
    tokens, lengths = repetitive_tokens(b, length).to(CUDA), torch.full((b,), length, device=CUDA)
    args = (tokens, lengths, 1, 4, 10, 10)
    got, want = K.ngram_match(*args), R.ngram_match(*args)
    assert all(torch.equal(x.cpu(), y.to(x.dtype).cpu()) for x, y in zip(got, want)), "ngram_match disagrees"
    return Case("ngram_match", f"B={b} L={length} n=1..4 k=10 w=10", lambda: K.ngram_match(*args),
                lambda: R.ngram_match(*args), "torch reference (a loop over rows)", tokens.numel() * tokens.element_size())


def topk_entropy_case(n: int, v: int, dtype: torch.dtype) -> Case:
    logits = (torch.randn(n, v, generator=torch.Generator().manual_seed(0)) * 3).to(dtype).to(CUDA)
    got, want = K.topk_entropy(logits, 10), topk_entropy_torch(logits, 10)
    torch.testing.assert_close(got[0].float(), want[0].float(), atol=1e-3, rtol=1e-3)
    return Case("topk_entropy", f"N={n} V={v} k=10 {_name(dtype)}", lambda: K.topk_entropy(logits, 10),
                lambda: topk_entropy_torch(logits, 10), "logsumexp + softmax + topk + sum(p*x)",
                logits.numel() * logits.element_size())


def kv_compact_case(b: int, moved: int) -> Case:
    """SmolLM2's cache (30 layers of K and V, Hkv=3 D=64, 2048 positions, bf16): ``moved`` accepted tree
    nodes per row copied down to the end of the committed prefix, against the per-layer gather + copy."""
    layers, h, d, s = 30, 3, 64, 2048
    caches = [torch.randn(b, h, s, d, dtype=torch.bfloat16, device=CUDA) for _ in range(2 * layers)]
    dst_start = torch.full((b,), 1500, device=CUDA)
    src = (1600 + torch.arange(moved, device=CUDA) * 2)[None].expand(b, moved).contiguous()
    counts = torch.full((b,), moved, device=CUDA)
    src_h, dst_h = src.cpu(), dst_start.cpu()

    def base(caches=caches):
        idx = src_h[0].to(CUDA)  # every row moves the same positions here
        for row in range(b):
            d0 = int(dst_h[row])
            for cache in caches:
                cache[row, :, d0:d0 + moved].copy_(cache[row].index_select(1, idx))

    ours_out, base_out = [c.clone() for c in caches], [c.clone() for c in caches]
    K.kv_compact(ours_out, src, dst_start, counts)
    base(base_out)
    assert all(torch.equal(x, y) for x, y in zip(ours_out, base_out)), "kv_compact disagrees"
    nbytes = 2 * layers * b * h * moved * d * 2
    return Case("kv_compact", f"30 layers B={b} moved={moved} bf16", lambda: K.kv_compact(caches, src, dst_start, counts),
                base, "per row and layer: index_select + copy_", nbytes)


def tree_verify_case(b: int, t: int, v: int) -> Case:
    """Greedy acceptance over an EAGLE-like tree whose nodes follow the target's argmax 80% of the time."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(b, t, v, generator=g)
    pred = logits.argmax(-1)
    parents = torch.stack([random_tree_parents(t, g) for _ in range(b)])
    tokens = torch.where(torch.rand(b, t, generator=g) < 0.8, pred.gather(1, parents.clamp(min=0)), 7)
    logits, parents, tokens = logits.to(CUDA), parents.to(CUDA), tokens.to(CUDA)
    got, want = K.tree_verify_greedy(tokens, parents, logits), R.tree_verify_greedy(tokens, parents, logits)
    assert all(torch.equal(x.cpu(), y.to(x.dtype).cpu()) for x, y in zip(got, want)), "tree_verify_greedy disagrees"
    return Case("tree_verify_greedy", f"B={b} T={t} V={v} fp32", lambda: K.tree_verify_greedy(tokens, parents, logits),
                lambda: R.tree_verify_greedy(tokens, parents, logits), "torch reference (argmax at every node)",
                logits.numel() * logits.element_size())


def tree_verify_sampling_case(b: int, t: int, v: int) -> Case:
    """Recursive rejection sampling over a tree with top-64 sparse draft proposals."""
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(b, t, v, generator=g) * 2, -1)
    parents = torch.stack([random_tree_parents(t, g) for _ in range(b)])
    dprobs, dids = torch.softmax(torch.randn(b, t, v, generator=g) * 2, -1).topk(64, -1)
    dprobs = dprobs / dprobs.sum(-1, keepdim=True)
    tokens = dids[..., 0]
    uniforms = torch.rand(b, t + 1, generator=g)
    args = [x.to(CUDA) for x in (tokens, parents, probs, dprobs, uniforms)]
    ids = dids.to(CUDA)
    ours = lambda: K.tree_verify_sampling(*args, draft_ids=ids)  # noqa: E731
    base = lambda: K.tree_verify_sampling(*args, draft_ids=ids, backend="torch")  # noqa: E731
    assert all(torch.equal(x.cpu(), y.to(x.dtype).cpu()) for x, y in zip(ours(), base())), "tree_verify_sampling disagrees"
    return Case("tree_verify_sampling", f"B={b} T={t} V={v} top-64 drafts", ours, base, "torch reference",
                args[2].numel() * 4)


CASES: list[tuple[str, Callable[[], Case]]] = [
    *((f"tree_attention-B{b}-S{s}-T{t}-{_name(dt)}", (lambda b=b, s=s, t=t, dt=dt: tree_attention_case(b, s, t, dt)))
      for dt in (torch.bfloat16, torch.float32)
      for b, s, t in ((1, 1024, 1), (1, 1024, 8), (1, 1024, 64), (1, 1024, 128), (16, 1024, 8), (16, 4096, 64))),
    *((f"ngram_match-B{b}-L{n}", (lambda b=b, n=n: ngram_case(b, n))) for b, n in ((1, 4096), (8, 4096), (64, 4096))),
    *((f"topk_entropy-N{n}-{_name(dt)}", (lambda n=n, dt=dt: topk_entropy_case(n, 49152, dt)))
      for dt in (torch.bfloat16, torch.float32) for n in (16, 1024)),
    *((f"kv_compact-B{b}", (lambda b=b: kv_compact_case(b, 16))) for b in (1, 16)),
    *((f"tree_verify_greedy-B{b}-T{t}", (lambda b=b, t=t: tree_verify_case(b, t, 49152))) for b, t in ((1, 64), (16, 64))),
    ("tree_verify_sampling-B16-T16", lambda: tree_verify_sampling_case(16, 16, 49152)),
]


def measure(case: Case) -> dict:
    """Median milliseconds of ours and the baseline (``triton.testing.do_bench``: synchronised, L2 flushed)."""
    from triton.testing import do_bench

    o = do_bench(case.ours, warmup=25, rep=200, return_mode="median")
    b = do_bench(case.baseline, warmup=25, rep=200, return_mode="median")
    return {"op": case.op, "shape": case.shape, "ours_ms": round(o, 4), "baseline_ms": round(b, 4),
            "ratio": round(b / o, 2), "gb_per_s": round(case.nbytes / o / 1e6, 1) if case.nbytes else None,
            "baseline": case.baseline_name}


def format_row(r: dict) -> str:
    gbs = f"{r['gb_per_s']:>8.1f}" if r["gb_per_s"] is not None else f"{'':>8}"
    return f"{r['op']:<20} {r['shape']:<34} {r['ours_ms']:>9.4f} {r['baseline_ms']:>9.4f} {r['ratio']:>7.2f} {gbs}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None, help="write {'device': ..., 'results': [...]} here")
    ap.add_argument("--only", default=None, help="run the cases whose id contains this string")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.kernels_cuda needs a CUDA device (bench.kernels times the CPU kernels)")
    device = torch.cuda.get_device_name()
    print(f"{device}; torch {torch.__version__}; native CUDA ops: "
          f"{[op for op in ('ngram_match', 'kv_compact') if K.has_native(op, 'cuda')]}")
    print(f"{'op':<20} {'shape':<34} {'ours ms':>9} {'base ms':>9} {'ratio':>7} {'GB/s':>8}")
    results, failed = [], []
    for case_id, build in CASES:
        if args.only and args.only not in case_id:
            continue
        try:
            results.append(measure(build()))
        except Exception as e:  # one broken case must not hide the others' timings
            failed.append(f"{case_id}: {type(e).__name__}: {e}")
            print(f"{case_id}: FAILED {type(e).__name__}: {e}", flush=True)
            continue
        print(format_row(results[-1]), flush=True)
    print("median (triton.testing.do_bench); ratio = baseline / ours; GB/s = least bytes read / our time")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "torch": torch.__version__, "results": results, "failed": failed}, f, indent=1)
    if failed:
        raise SystemExit(f"{len(failed)} case(s) failed")


if __name__ == "__main__":
    main()
