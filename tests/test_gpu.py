"""On a CUDA device: every operator's ``auto`` backend (CUDA or Triton) against the torch reference,
and greedy decoding of every method against transformers' ``generate`` on the GPU.

Skipped without a GPU (CI has none); on a GPU machine ``pytest tests/`` runs them (tests/conftest.py then leaves
Triton's interpreter off), unless ``TRITON_INTERPRET=1`` is set by hand.
"""
from __future__ import annotations

import copy
import os

import pytest
import torch

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("needs a CUDA device and TRITON_INTERPRET=0", allow_module_level=True)

import specdec.kernels as K
from specdec.api import SpecDecoder, hf_generate
from specdec.kernels import _dispatch, reference
from specdec.tree import DraftTree
from specdec.verify import SamplingConfig
from tests.conftest import tiny_model

CUDA = torch.device("cuda")


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("seed", range(40))
def test_ngram_match_cuda(seed):
    g = gen(seed)
    b, width = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(1, 300, (1,), generator=g))
    vocab = int(torch.randint(1, 8, (1,), generator=g))
    tokens = torch.randint(0, vocab, (b, width), generator=g)
    lengths = torch.randint(0, width + 1, (b,), generator=g)
    n_min = int(torch.randint(1, 4, (1,), generator=g))
    n_max = n_min + int(torch.randint(0, 3, (1,), generator=g))
    k, w = int(torch.randint(1, 11, (1,), generator=g)), int(torch.randint(1, 11, (1,), generator=g))
    want = reference.ngram_match(tokens, lengths, n_min, n_max, k, w)
    got = K.ngram_match(tokens.to(CUDA), lengths.to(CUDA), n_min, n_max, k, w)
    assert _dispatch.choose("ngram_match", CUDA, None, ("cpu", "cuda")) == "native"
    for name, a, r in zip(("drafts", "lens", "counts", "match_n"), got, want):
        assert a.is_cuda and a.dtype == r.dtype and torch.equal(a.cpu(), r), (name, seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("seed", range(6))
def test_kv_compact_cuda(dtype, seed):
    g = gen(seed)
    b, h, s, d = 3, 2, 64, 64
    caches = [torch.randn(b, h, s, d, generator=g).to(dtype) for _ in range(3)]
    src = torch.full((b, 8), -1, dtype=torch.int64)
    dst_start, counts = torch.tensor([5, 0, 20]), torch.tensor([4, 0, 8])
    for row in range(b):
        c = int(counts[row])
        picks = torch.randperm(s - int(dst_start[row]) - 1, generator=g)[:c].sort().values + int(dst_start[row])
        src[row, :c] = torch.maximum(picks, dst_start[row] + torch.arange(c))
    want = [c.clone() for c in caches]
    reference.kv_compact(want, src, dst_start, counts)
    got = [c.to(CUDA) for c in caches]
    K.kv_compact(got, src.to(CUDA), dst_start.to(CUDA), counts.to(CUDA))
    for a, r in zip(got, want):
        assert torch.equal(a.cpu(), r)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,v,k", [(1, 49152, 10), (7, 1000, 5), (16, 262144, 8)])
def test_topk_entropy_cuda(dtype, n, v, k):
    logits = (torch.randn(n, v, generator=gen(v)) * 4).to(dtype)
    want = reference.topk_entropy(logits, k, 0.7)
    got = K.topk_entropy(logits.to(CUDA), k, 0.7)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(got[0].cpu(), want[0], **tol)
    torch.testing.assert_close(got[2].cpu(), want[2], **tol)
    torch.testing.assert_close(got[3].cpu(), want[3], **tol)
    # ids may differ only where probabilities tie
    same = got[1].cpu() == want[1]
    assert torch.allclose(got[0].cpu()[~same], want[0][~same], **tol)


def random_tree(b: int, t: int, g: torch.Generator) -> DraftTree:
    parents = torch.full((b, t), -1, dtype=torch.int64)
    for i in range(1, t):
        parents[:, i] = torch.randint(0, i, (b,), generator=g)
    return DraftTree.from_parents(torch.randint(0, 50, (b, t), generator=g), parents)


@pytest.mark.parametrize("backend", ["auto", "triton"])  # auto leaves Triton for large fp32 trees
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,s", [(1, 0), (7, 33), (64, 1024), (130, 300)])
def test_tree_attention_cuda(dtype, t, s, backend):
    g = gen(t + s)
    b, hkv, group, d = 2, 3, 3, 64
    tree = random_tree(b, t, g)
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    q, kc, vc = rnd(b, hkv * group, t, d), rnd(b, hkv, s, d), rnd(b, hkv, s, d)
    kt, vt = rnd(b, hkv, t, d), rnd(b, hkv, t, d)
    lens = torch.tensor([s, s // 2])
    args = (q, kc, vc, lens, kt, vt, tree.mask)
    want = reference.tree_attention(*args, scale=d**-0.5)
    got = K.tree_attention(*[a.to(CUDA) for a in args], scale=d**-0.5, backend=backend)
    tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(got.cpu().float(), want.float(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits,group", [(4, 32), (8, 16)])
@pytest.mark.parametrize("m", [1, 5, 24, 300])  # GEMV path (with split K), tl.dot path
def test_quant_linear_cuda(m, bits, group, dtype):
    pytest.importorskip("triton")
    from specdec.kernels import quant_reference
    from specdec.triton_kernels.quant_linear import quant_linear

    g = gen(m + bits)
    n, k = 1000, 2048
    if bits == 8:
        codes = torch.randint(-128, 128, (n, k), generator=g).to(torch.int8)
    else:
        codes = quant_reference.pack_int4(torch.randint(0, 16, (n, k), generator=g))
    scale = torch.rand(n, k // group, generator=g) * 0.02 + 0.001
    minv = torch.randn(n, k // group, generator=g) * 0.1
    bias = torch.randn(n, generator=g).to(dtype)
    x = torch.randn(m, k, generator=g).to(dtype)
    want = quant_reference.quant_linear(x, codes, scale, minv, bits, group, bias)
    got = quant_linear(*[t.to(CUDA) for t in (x, codes, scale, minv)], bits, group, bias.to(CUDA))
    w = quant_reference.quant_linear_dequantize(codes, scale, minv, bits, group)
    mag = float((x.float().abs() @ w.abs().T).max())
    rtol = 1e-5 if dtype == torch.float32 else 1e-2
    assert got.is_cuda and got.dtype == dtype
    torch.testing.assert_close(got.cpu().float(), want.float(), rtol=rtol, atol=1e-5 * mag)


@pytest.mark.parametrize("seed", range(10))
def test_tree_verify_greedy_cuda(seed):
    g = gen(seed)
    b, t, v = 3, 24, 49152
    tree = random_tree(b, t, g)
    logits = torch.randn(b, t, v, generator=g)
    # plant the draft tokens as argmax along a random path so some acceptance happens
    logits[0, 0, tree.tokens[0, 1]] = 50.0
    want = reference.tree_verify_greedy(tree.tokens, tree.parents, logits, tree.valid)
    got = K.tree_verify_greedy(tree.tokens.to(CUDA), tree.parents.to(CUDA), logits.to(CUDA), tree.valid.to(CUDA))
    for a, r in zip(got, want):
        assert torch.equal(a.cpu(), r.to(a.dtype)), seed


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("method,opts", [("ar", {}), ("pld", {}), ("ngrammys", {"schedule": "static"}),
                                         ("sd", {"draft_length": 4}), ("gsd", {}), ("ouroboros", {}),
                                         ("pearl", {"backend": "inline"}), ("pearl", {})])
def test_greedy_decoding_on_cuda_matches_transformers(arch, method, opts):
    target = tiny_model(arch)
    model = copy.deepcopy(target).to(CUDA)
    draft = copy.deepcopy(tiny_model(arch, seed=1)).to(CUDA)
    dec = SpecDecoder(model, draft=draft)
    prompts = [torch.randint(2, 96, (n,), generator=gen(n)).tolist() for n in (5, 40)]
    for prompt in prompts:
        ref = hf_generate(model, prompt, 40, SamplingConfig())
        out = dec.generate_ids([prompt], method, 40, SamplingConfig(), **opts)
        assert out.tokens[0] == ref, (arch, method)
    out = dec.generate_ids(prompts, method, 40, SamplingConfig(), **opts)  # ragged batch
    assert out.tokens == [hf_generate(model, p, 40, SamplingConfig()) for p in prompts]


@pytest.mark.parametrize("with_q", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_tree_verify_sampling_cuda(with_q, seed):
    g = gen(seed)
    b, t, v = 2, 12, 3000
    tree = random_tree(b, t, g)
    p = torch.softmax(torch.randn(b, t, v, generator=g) * 3, -1)
    q = torch.softmax(torch.randn(b, t, v, generator=g) * 3, -1) if with_q else None
    u = torch.rand(b, t + 1, generator=g)
    want = reference.tree_verify_sampling(tree.tokens, tree.parents, p, q, u, tree.valid)
    cu = lambda x: None if x is None else x.to(CUDA)  # noqa: E731
    got = K.tree_verify_sampling(cu(tree.tokens), cu(tree.parents), cu(p), cu(q), cu(u), cu(tree.valid))
    for a, r in zip(got, want):
        assert torch.equal(a.cpu(), r.to(a.dtype)), seed
