"""The Triton kernels (``specdec.triton_kernels``) against the torch references.

On a machine without a GPU they run in Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``,
also set by ``tests/conftest.py`` before anything imports triton); with ``TRITON_INTERPRET=0`` and
a GPU they run on CUDA tensors. Shapes are small: the interpreter executes every program in Python.
"""
from __future__ import annotations

from tests.triton_device import INTERPRET, triton_device  # noqa: I001  (before anything imports triton)

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import specdec.kernels as K
from specdec.kernels import _dispatch, reference
from specdec.tree import SparseProbs, ancestor_mask

DEVICE = triton_device()

from specdec.triton_kernels import topk_entropy as topk_mod
from specdec.triton_kernels import tree_attention as attn_mod

pytestmark = [
    # The interpreter evaluates both sides of masked selects (inf - inf, 0 * inf) in numpy.
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
]
# Interpreted examples are slow: a fixed set of them, and no shrinking of a failure (it would take minutes).
FAST = settings(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow],
                phases=(Phase.explicit, Phase.generate))


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_parents(kind: str, t: int, g: torch.Generator) -> list[int]:
    if kind == "chain":
        return list(range(-1, t - 1))
    if kind == "bushy":
        return [-1] + [0] * (t - 1)
    return [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, t)]


# ----------------------------------------------------------------------------------------
# tree_attention
# ----------------------------------------------------------------------------------------

ATTN_TOL = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.float16: dict(atol=3e-3, rtol=3e-3),
            torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}


def check_tree_attention(b, hkv, ratio, t, s, d, kind, window, dtype, splits, seed):
    g = gen(seed)
    hq = hkv * ratio

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)

    q, k_cache, v_cache = rnd(b, hq, t, d), rnd(b, hkv, s, d), rnd(b, hkv, s, d)
    k_tree, v_tree = rnd(b, hkv, t, d), rnd(b, hkv, t, d)
    cache_lens = torch.randint(0, s + 1, (b,), generator=g)
    cache_lens[0] = 0 if s == 0 or seed % 3 == 0 else cache_lens[0]  # an empty prefix row
    parents = torch.tensor([random_parents(kind, t, g) for _ in range(b)])
    mask = None if kind == "chain" else ancestor_mask(parents, torch.ones(b, t, dtype=torch.bool))
    positions = cache_lens[:, None] + reference.tree_depth(parents) if window is not None else None
    args = [x.to(DEVICE) if isinstance(x, torch.Tensor) else x for x in (cache_lens, mask, positions)]
    if splits is None:
        got = K.tree_attention(q, k_cache, v_cache, args[0], k_tree, v_tree, args[1], None, args[2], window,
                               backend="triton")
    else:
        got = attn_mod.tree_attention(q, k_cache, v_cache, args[0], k_tree, v_tree, args[1], None, args[2], window,
                                      num_splits=splits)
    f32 = [x.float().cpu() for x in (q, k_cache, v_cache, k_tree, v_tree)]
    want = reference.tree_attention(f32[0], f32[1], f32[2], cache_lens, f32[3], f32[4], mask, None, positions, window)
    assert got.dtype == dtype and got.shape == (b, hq, t, d)
    torch.testing.assert_close(got.float().cpu(), want, **ATTN_TOL[dtype])


@settings(FAST, max_examples=14)
@given(
    b=st.integers(1, 2), hkv=st.integers(1, 2), ratio=st.sampled_from([1, 4, 8]), t=st.integers(1, 9),
    s=st.integers(0, 24), d=st.sampled_from([64, 128]), kind=st.sampled_from(["chain", "bushy", "random"]),
    window=st.one_of(st.none(), st.integers(0, 8)),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    splits=st.sampled_from([None, 2, 3]), seed=st.integers(0, 2**16),
)
def test_tree_attention_matches_reference(b, hkv, ratio, t, s, d, kind, window, dtype, splits, seed):
    check_tree_attention(b, hkv, ratio, t, s, d, kind, window, dtype, splits, seed)


@pytest.mark.parametrize(
    "b,hkv,ratio,t,s,d,kind,window,dtype,splits",
    [
        (1, 1, 1, 1, 0, 64, "chain", None, torch.float32, None),  # T = 1, no prefix at all
        (2, 1, 4, 1, 17, 128, "random", None, torch.float16, None),  # decode-like: one query per row
        (1, 1, 1, 40, 5, 64, "random", None, torch.float32, None),  # T > 32: two mask words per row
        (2, 2, 8, 3, 30, 64, "bushy", 4, torch.bfloat16, 4),  # GQA 8, window, split prefix
        (2, 1, 1, 5, 12, 80, "random", 3, torch.float32, 2),  # head dim not a power of two
    ],
)
def test_tree_attention_cases(b, hkv, ratio, t, s, d, kind, window, dtype, splits):
    check_tree_attention(b, hkv, ratio, t, s, d, kind, window, dtype, splits, seed=1)


# ----------------------------------------------------------------------------------------
# topk_entropy
# ----------------------------------------------------------------------------------------


def check_topk_entropy(logits, k, temperature, splits=None):
    if splits is None:
        probs, ids, entropy, lse = K.topk_entropy(logits.to(DEVICE), k, temperature, backend="triton")
    else:
        probs, ids, entropy, lse = topk_mod.topk_entropy(logits.to(DEVICE), k, temperature, num_splits=splits)
    probs, ids, entropy, lse = probs.cpu(), ids.cpu(), entropy.cpu(), lse.cpu()
    r_probs, r_ids, r_entropy, r_lse = reference.topk_entropy(logits, k, temperature)
    assert (probs.dtype, ids.dtype, entropy.dtype, lse.dtype) == (torch.float32, torch.int64, torch.float32, torch.float32)
    assert probs.shape == ids.shape == (logits.shape[0], k) and entropy.shape == lse.shape == (logits.shape[0],)
    torch.testing.assert_close(lse, r_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, r_entropy, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(probs, r_probs, rtol=1e-5, atol=1e-7, equal_nan=True)
    # ids up to ties: distinct, their probabilities are the returned ones, equal logits in id order.
    x = logits.float() / temperature
    full = torch.softmax(x, dim=-1)
    torch.testing.assert_close(full.gather(1, ids), probs, rtol=1e-5, atol=1e-7, equal_nan=True)
    picked = x.gather(1, ids)
    for r in range(logits.shape[0]):
        assert len(set(ids[r].tolist())) == k
        for j in range(k - 1):
            assert picked[r, j] > picked[r, j + 1] or (picked[r, j] == picked[r, j + 1] and ids[r, j] < ids[r, j + 1])
    return ids, r_ids


@settings(FAST, max_examples=16)
@given(
    n=st.integers(1, 3), v=st.integers(1, 200), data=st.data(), temperature=st.sampled_from([0.3, 1.0, 2.5]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), ties=st.booleans(),
    masked=st.sampled_from([0.0, 0.5]), splits=st.sampled_from([None, 2, 3]), seed=st.integers(0, 2**16),
)
def test_topk_entropy_matches_reference(n, v, data, temperature, dtype, ties, masked, splits, seed):
    k = data.draw(st.integers(1, min(v, 16)))
    g = gen(seed)
    # Ties: a handful of integer values, so equal logits cross the top-k boundary.
    logits = torch.randint(-2, 3, (n, v), generator=g).float() if ties else torch.randn(n, v, generator=g) * 3
    mask = torch.rand(n, v, generator=g) < masked
    mask[:, 0] = False  # at least one finite logit per row
    logits = logits.masked_fill(mask, float("-inf")).to(dtype)
    ids, r_ids = check_topk_entropy(logits, k, temperature, splits)
    if not ties and masked == 0.0 and dtype == torch.float32:  # no ties: exactly torch.topk's ids
        assert torch.equal(ids, r_ids)


@pytest.mark.parametrize("n,v,k,splits", [(1, 150, 20, None), (2, 100, 33, 2), (1, 80, 65, None), (2, 700, 4, 3)])
def test_topk_entropy_large_k_and_multi_tile(n, v, k, splits):
    # k > 16: the bitonic merge path; k > 64: the sorted output path; v > 512: several tiles per program.
    logits = torch.randn(n, v, generator=gen(v)) * 2
    logits[-1] = logits[-1].sort().values  # the maximum arrives last: every tile rescales the sums
    ids, r_ids = check_topk_entropy(logits, k, 0.8, splits)
    assert torch.equal(ids, r_ids)


def test_topk_entropy_edge_rows():
    inf = float("-inf")
    logits = torch.tensor([[0.0, inf, 1.0, inf], [100.0, 0.0, 0.0, 0.0], [3.0] * 4, [inf, inf, inf, 2.0]])
    check_topk_entropy(logits, 4, 1.0)  # k = V, with -inf entries among the top-k
    check_topk_entropy(logits, 1, 1.0)
    _, ids, entropy, _ = K.topk_entropy(logits.to(DEVICE), 4, 1.0, backend="triton")
    assert ids[2].tolist() == [0, 1, 2, 3] and entropy[3].item() == 0.0
    # Every logit -inf: like the reference, NaN probabilities, -inf logsumexp, zero entropy.
    probs, _, entropy, lse = K.topk_entropy(torch.full((1, 5), inf, device=DEVICE), 2, 1.0, backend="triton")
    assert torch.isnan(probs).all() and lse.item() == inf and entropy.item() == 0.0


# ----------------------------------------------------------------------------------------
# kv_compact
# ----------------------------------------------------------------------------------------


@st.composite
def compactions(draw):
    b, s = draw(st.integers(1, 3)), draw(st.integers(1, 20))
    n = draw(st.integers(1, 6))
    src, dst, counts = [], [], []
    for _ in range(b):
        count = draw(st.integers(0, min(n, s)))
        d0 = draw(st.integers(0, s - count))
        # Any ascending distinct positions in [d0, S) satisfy src[j] >= d0 + j; overlaps are common.
        chosen = sorted(draw(st.lists(st.integers(d0, s - 1), min_size=count, max_size=count, unique=True)))
        src.append(chosen + [s + 7] * (n - count))  # entries past counts[b] must be ignored
        dst.append(d0)
        counts.append(count)
    return s, torch.tensor(src), torch.tensor(dst), torch.tensor(counts)


def make_caches(b, s, g):
    base = torch.randn(b, 3, s, 20, generator=g)
    return [
        torch.randn(b, 2, s, 8, generator=g),
        torch.randn(b, 4, s, 16, generator=g).half(),
        base.bfloat16()[..., 2:9],  # a strided view (D stride 1, row stride 20)
        torch.randn(b, s, 2, 4, generator=g).double().transpose(1, 2),  # [B, H, S, D] over a [B, S, H, D] buffer
        torch.randint(-100, 100, (b, 1, s, 3), generator=g, dtype=torch.int8),
    ]


@settings(FAST, max_examples=25)
@given(case=compactions(), seed=st.integers(0, 2**16))
def test_kv_compact_matches_reference(case, seed):
    s, src, dst, counts = case
    caches = [c.to(DEVICE) for c in make_caches(src.shape[0], s, gen(seed))]
    want = [c.cpu().clone() for c in caches]
    reference.kv_compact(want, src, dst, counts)
    K.kv_compact(caches, src.to(DEVICE), dst.to(DEVICE), counts.to(DEVICE), backend="triton")
    for got, ref in zip(caches, want):
        assert torch.equal(got.cpu(), ref)


def test_kv_compact_overlapping_and_empty():
    g = gen(0)
    caches = [c.to(DEVICE) for c in make_caches(3, 12, g)]
    want = [c.cpu().clone() for c in caches]
    # Row 0 shifts a run left by one (every destination is the previous move's source), row 1 moves
    # nothing, row 2 keeps a prefix in place and then jumps.
    src = torch.tensor([[3, 4, 5, 6, 7], [0, 0, 0, 0, 0], [4, 5, 9, 10, 11]])
    dst, counts = torch.tensor([2, 5, 4]), torch.tensor([5, 0, 5])
    reference.kv_compact(want, src, dst, counts)
    K.kv_compact(caches, src.to(DEVICE), dst.to(DEVICE), counts.to(DEVICE), backend="triton")
    for got, ref in zip(caches, want):
        assert torch.equal(got.cpu(), ref)
    before = [c.clone() for c in caches]
    K.kv_compact(caches, src.to(DEVICE), dst.to(DEVICE), torch.zeros(3, dtype=torch.int64, device=DEVICE),
                 backend="triton")
    K.kv_compact(caches, src[:, :0].to(DEVICE), dst.to(DEVICE), counts.to(DEVICE), backend="triton")
    assert all(torch.equal(a, c) for a, c in zip(before, caches))


# ----------------------------------------------------------------------------------------
# tree_verify
# ----------------------------------------------------------------------------------------


@st.composite
def trees(draw):
    b, t, v = draw(st.integers(1, 3)), draw(st.integers(1, 9)), draw(st.integers(1, 24))
    kind = draw(st.sampled_from(["chain", "bushy", "random"]))
    seed = draw(st.integers(0, 2**16))
    g = gen(seed)
    parents = torch.tensor([random_parents(kind, t, g) for _ in range(b)])
    tokens = torch.randint(0, v, (b, t), generator=g)
    valid = None
    if draw(st.booleans()):
        valid = torch.rand(b, t, generator=g) < 0.85
    return parents, tokens, v, valid, seed


@settings(FAST, max_examples=20)
@given(case=trees(), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_tree_verify_greedy_matches_reference(case, dtype):
    parents, tokens, v, valid, seed = case
    g = gen(seed + 1)
    b, t = tokens.shape
    logits = torch.randint(0, 4, (b, t, v), generator=g).to(dtype)  # small integers: argmax ties
    pred = logits.argmax(-1)
    plant = torch.rand(b, t, generator=g) < 0.7  # most nodes match their parent's argmax
    tokens = torch.where(plant, pred.gather(1, parents.clamp(min=0)), tokens)
    dev = [x.to(DEVICE) if x is not None else None for x in (tokens, parents, logits, valid)]
    got = K.tree_verify_greedy(*dev, backend="triton")
    want = reference.tree_verify_greedy(tokens, parents, logits, valid)
    for name, x, y in zip(("path", "length", "next"), got, want):
        assert x.dtype == y.dtype and torch.equal(x.cpu(), y), (name, x, y)


def test_tree_verify_greedy_nan_and_all_inf():
    logits = torch.tensor([[[0.0, float("nan"), 5.0, float("nan")], [float("-inf")] * 4]])
    tokens, parents = torch.tensor([[7, 1]]), torch.tensor([[-1, 0]])
    got = K.tree_verify_greedy(tokens.to(DEVICE), parents.to(DEVICE), logits.to(DEVICE), backend="triton")
    want = reference.tree_verify_greedy(tokens, parents, logits)
    assert all(torch.equal(x.cpu(), y) for x, y in zip(got, want))


def sparse_proposals(b: int, t: int, v: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B,T,k]`` distinct random ids (a few -1 entries) and probabilities (0 there), every other node
    all zero (one-hot)."""
    ids = torch.rand(b, t, v, generator=g).argsort(-1)[..., :k]
    probs = torch.softmax(torch.randn(b, t, k, generator=g) * 2, -1)
    unused = torch.rand(b, t, k, generator=g) < 0.2
    ids, probs = ids.masked_fill(unused, -1), probs.masked_fill(unused, 0.0)
    probs[:, ::2] = 0.0
    return ids, probs


@settings(FAST, max_examples=20)
@given(case=trees(), k=st.integers(1, 12), u64=st.booleans())
def test_tree_verify_sampling_sparse_matches_reference(case, k, u64):
    """Proposals over a few ids per node (SparseProbs), as the drafters hand them to verification."""
    parents, tokens, v, valid, seed = case
    g = gen(seed + 3)
    b, t = tokens.shape
    target = torch.softmax(torch.randn(b, t, v, generator=g) * 2, -1)
    ids, probs = sparse_proposals(b, t, v, min(k, v), g)
    # Tokens drawn where the proposals put mass, so both acceptances and rejections occur.
    drawn = SparseProbs(ids, probs).sample(g)
    tokens = torch.where(drawn >= 0, drawn, tokens)
    uniforms = torch.rand(b, t + 1, generator=g, dtype=torch.float64 if u64 else torch.float32)
    dev = [x.to(DEVICE) if x is not None else None for x in (tokens, parents, target, probs, uniforms, valid, ids)]
    got = K.tree_verify_sampling(*dev, backend="triton")
    want = reference.tree_verify_sampling(tokens, parents, target, probs, uniforms, valid, ids)
    for name, x, y in zip(("path", "length", "next"), got, want):
        assert x.dtype == y.dtype and torch.equal(x.cpu(), y), (name, x, y)


@settings(FAST, max_examples=20)
@given(case=trees(), draft=st.sampled_from(["none", "probs", "some-zero"]), u64=st.booleans())
def test_tree_verify_sampling_matches_reference(case, draft, u64):
    parents, tokens, v, valid, seed = case
    g = gen(seed + 2)
    b, t = tokens.shape
    target = torch.softmax(torch.randn(b, t, v, generator=g) * 2, -1)
    target = torch.where(torch.rand(b, t, v, generator=g) < 0.3, 0.0, target)  # sparse, unnormalised rows
    draft_probs = None
    if draft != "none":
        draft_probs = torch.softmax(torch.randn(b, t, v, generator=g) * 2, -1)
        if draft == "some-zero":
            draft_probs[:, ::2] = 0.0  # all-zero rows are one-hot proposals
    uniforms = torch.rand(b, t + 1, generator=g, dtype=torch.float64 if u64 else torch.float32)
    dev = [x.to(DEVICE) if x is not None else None for x in (tokens, parents, target, draft_probs, uniforms, valid)]
    got = K.tree_verify_sampling(*dev, backend="triton")
    want = reference.tree_verify_sampling(tokens, parents, target, draft_probs, uniforms, valid)
    for name, x, y in zip(("path", "length", "next"), got, want):
        assert x.dtype == y.dtype and torch.equal(x.cpu(), y), (name, x, y)


# ----------------------------------------------------------------------------------------
# dispatch
# ----------------------------------------------------------------------------------------


def test_tree_attention_fp32_leaves_triton_for_large_trees():
    pays = K.tree_attention_triton_pays
    limit = K.TRITON_FP32_MAX_TREE
    assert pays(torch.float32, limit) and not pays(torch.float32, limit + 1)
    assert pays(torch.bfloat16, 4 * limit) and pays(torch.float16, 4 * limit)


def test_dispatch_prefers_triton_on_cuda_only():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert _dispatch.choose("topk_entropy", cuda, "auto", ("cpu",), triton=True) == "triton"
    assert _dispatch.choose("topk_entropy", cuda, "auto", ("cpu",), triton=False) == "torch"
    assert _dispatch.choose("topk_entropy", cpu, "auto", (), triton=True) == "torch"
    assert _dispatch.choose("topk_entropy", cuda, "torch", ("cpu",), triton=True) == "torch"
    if INTERPRET:
        assert _dispatch.choose("topk_entropy", cpu, "triton", ("cpu",), triton=True) == "triton"
    # a Triton kernel measured slower than torch for a shape is skipped by auto only
    assert _dispatch.choose("tree_attention", cuda, "auto", ("cpu",), triton=True, triton_pays=False) == "torch"
    assert _dispatch.choose("tree_attention", cuda, "triton", ("cpu",), triton=True, triton_pays=False) == "triton"
    with pytest.raises(RuntimeError):
        _dispatch.choose("ngram_match", cuda, "triton", ("cpu", "cuda"))  # no Triton kernel
    with pytest.raises(RuntimeError):
        _dispatch.choose("topk_entropy", cuda, "cpp", ("cpu",), triton=True)  # cpp is the CPU extension
    if not _dispatch.has_native("ngram_match", "cuda"):  # a CPU-only build of the extension
        assert _dispatch.choose("ngram_match", cuda, "auto", ("cpu", "cuda")) == "torch"
        with pytest.raises(RuntimeError):
            _dispatch.choose("ngram_match", cuda, "cuda", ("cpu", "cuda"))


def test_dispatch_without_triton_or_interpreter(monkeypatch):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(_dispatch, "has_triton", lambda: False)
    with pytest.warns(UserWarning, match="triton is not installed"):
        assert _dispatch.choose("dispatch_test_op", cuda, "auto", (), triton=True) == "torch"
    with pytest.raises(RuntimeError):
        _dispatch.choose("dispatch_test_op", cuda, "triton", (), triton=True)
    monkeypatch.undo()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError):
        _dispatch.choose("topk_entropy", cpu, "triton", ("cpu",), triton=True)
