"""The native CPU operators (``torch.ops.specdec.*``) against the torch references."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import specdec.kernels as K
from specdec.kernels import reference
from specdec.kernels._dispatch import native_ops

ops = native_ops()
if ops is None or not hasattr(ops, "ngram_match") or not hasattr(ops, "topk_entropy"):
    pytest.skip("specdec._C is not built: run `pip install --no-build-isolation -e .`", allow_module_level=True)


# ----------------------------------------------------------------------------------------
# ngram_match
# ----------------------------------------------------------------------------------------


def assert_ngram_equal(tokens, lengths, n_min, n_max, k, w):
    got = K.ngram_match(tokens, lengths, n_min, n_max, k, w, backend="cpp")
    want = K.ngram_match(tokens, lengths, n_min, n_max, k, w, backend="torch")
    names = ("drafts", "draft_lens", "counts", "match_n")
    for name, g, r in zip(names, got, want):
        assert g.dtype == r.dtype and g.shape == r.shape, (name, g.dtype, r.dtype, g.shape, r.shape)
        assert torch.equal(g, r), (name, tokens, lengths, n_min, n_max, k, w, g, r)


@st.composite
def ngram_batches(draw):
    b = draw(st.integers(1, 4))
    vocab = draw(st.integers(1, 6))  # small vocabularies: many matches, many tied groups
    pad_len = draw(st.integers(0, 40))
    lengths = [draw(st.integers(0, pad_len)) for _ in range(b)]
    # Padding past lengths[b] repeats the suffix's tokens: it would match (and extend drafts) if read.
    rows = [draw(st.lists(st.integers(0, vocab - 1), min_size=pad_len, max_size=pad_len)) for _ in range(b)]
    n_min = draw(st.integers(1, 4))
    n_max = draw(st.integers(n_min, 6))
    return torch.tensor(rows, dtype=torch.int64).reshape(b, pad_len), torch.tensor(lengths), n_min, n_max, \
        draw(st.integers(1, 6)), draw(st.integers(1, 8))


@settings(max_examples=300, deadline=None)
@given(ngram_batches())
def test_ngram_match_native_matches_reference(case):
    assert_ngram_equal(*case)


@pytest.mark.parametrize(
    "rows,lengths,n_min,n_max,k,w",
    [
        ([[1, 2, 3]], [3], 3, 4, 2, 2),  # context shorter than n + 1
        ([[1, 2, 3]], [1], 1, 1, 2, 2),  # one token: nothing can precede the suffix
        ([[7]], [0], 1, 2, 1, 1),  # empty row
        ([[1, 2, 3, 4, 5, 6]], [6], 1, 3, 3, 3),  # no match at all
        ([[5] * 12], [12], 1, 4, 4, 3),  # all-same tokens: truncated continuations are distinct
        ([[5] * 12], [12], 2, 2, 10, 20),  # w > remaining context, k > number of continuations
        ([[1, 2, 9, 1, 2, 9, 9, 9], [1, 2, 1, 2, 1, 2, 1, 2]], [5, 3], 1, 3, 3, 4),  # padding would match
        ([[3, 1, 3, 2, 3, 1, 3, 2, 3]], [9], 1, 1, 4, 2),  # count ties broken by recency
        ([[4, 4, 1, 4, 4, 2, 4, 4, 1, 4, 4]], [11], 1, 8, 5, 3),  # n_max > the longest match
        ([[-1, 3, -1, 3]], [4], 1, 2, 2, 2),  # negative ids compare like the reference's padding
    ],
)
def test_ngram_match_native_edge_cases(rows, lengths, n_min, n_max, k, w):
    assert_ngram_equal(torch.tensor(rows, dtype=torch.int64), torch.tensor(lengths), n_min, n_max, k, w)


def test_ngram_match_native_long_context_and_int32_inputs():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 8, (3, 1500), generator=g)
    lengths = torch.tensor([1500, 777, 2])
    assert_ngram_equal(tokens, lengths, 1, 4, 10, 10)
    assert_ngram_equal(tokens.int(), lengths.int(), 2, 5, 3, 7)  # the public op casts to int64


def test_ngram_match_native_bad_inputs():
    t, l = torch.zeros(2, 5, dtype=torch.int64), torch.tensor([5, 5])
    bad = [
        (t[0], l, 1, 2, 1, 1),  # 1-D tokens
        (t.float(), l, 1, 2, 1, 1),  # float tokens
        (t.int(), l, 1, 2, 1, 1),  # int32 tokens (the public op casts; the raw op does not)
        (t, l[:1], 1, 2, 1, 1),  # lengths not [B]
        (t, torch.tensor([5, 6]), 1, 2, 1, 1),  # lengths > L
        (t, torch.tensor([5, -1]), 1, 2, 1, 1),  # negative length
        (t, l, 0, 2, 1, 1),
        (t, l, 3, 2, 1, 1),
        (t, l, 1, 2, 0, 1),
        (t, l, 1, 2, 1, 0),
    ]
    for args in bad:
        with pytest.raises(RuntimeError):
            ops.ngram_match(*args)
    with pytest.raises(ValueError):
        K.ngram_match(t, l, 0, 2, 1, 1, backend="cpp")


# ----------------------------------------------------------------------------------------
# topk_entropy
# ----------------------------------------------------------------------------------------


def assert_topk_entropy_close(logits, k, temperature):
    probs, ids, entropy, lse = K.topk_entropy(logits, k, temperature, backend="cpp")
    r_probs, r_ids, r_entropy, r_lse = K.topk_entropy(logits, k, temperature, backend="torch")
    assert (probs.dtype, ids.dtype, entropy.dtype, lse.dtype) == (torch.float32, torch.int64, torch.float32, torch.float32)
    assert probs.shape == ids.shape == (logits.shape[0], k) and entropy.shape == lse.shape == (logits.shape[0],)
    # The reference's log-probabilities x - lse are fp32: they carry lse's rounding, ulp(|lse|), into
    # the probabilities (relative) and the entropy (absolute).
    lse_ulp = 2 * torch.finfo(torch.float32).eps * float(r_lse.abs().max())
    rtol = 1e-5 + lse_ulp
    torch.testing.assert_close(lse, r_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, r_entropy, rtol=1e-5, atol=1e-5 + lse_ulp)
    torch.testing.assert_close(probs, r_probs, rtol=rtol, atol=1e-7)
    # ids up to ties: distinct, and the reference's probabilities at them are the returned values.
    full = torch.softmax(logits.float() / temperature, dim=-1)
    torch.testing.assert_close(full.gather(1, ids), probs, rtol=rtol, atol=1e-7)
    for r in range(logits.shape[0]):
        assert len(set(ids[r].tolist())) == k
    assert bool((probs[:, :-1] >= probs[:, 1:]).all())


@settings(max_examples=120, deadline=None)
@given(
    st.integers(1, 5),
    st.integers(1, 3000),
    st.data(),
    st.sampled_from([0.3, 1.0, 2.5]),
    st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    st.floats(0.01, 30.0),
    st.floats(0.0, 0.9),
    st.integers(0, 2**31 - 1),
)
def test_topk_entropy_native_matches_reference(n, v, data, temperature, dtype, spread, masked, seed):
    k = data.draw(st.integers(1, min(v, 64)))
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=g) * spread
    mask = torch.rand(n, v, generator=g) < masked
    mask[:, 0] = False  # at least one finite logit per row
    logits = logits.masked_fill(mask, float("-inf")).to(dtype)
    assert_topk_entropy_close(logits, k, temperature)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_topk_entropy_native_large_vocab(dtype):
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(6, 49152, generator=g) * 4).to(dtype)
    logits[1, 1000:] = float("-inf")
    logits[2, 7] = 60.0  # peaked: entropy near 0
    logits[3] = logits[3].sort().values  # the max arrives last: every chunk rescales the sums
    assert_topk_entropy_close(logits, 10, 1.0)
    assert_topk_entropy_close(logits, 10, 0.7)
    if dtype == torch.float32:  # no ties in fp32 random logits: ids exactly torch.topk's
        _, ids, _, _ = K.topk_entropy(logits[[0, 4, 5]], 10, 1.0, backend="cpp")
        assert torch.equal(ids, logits[[0, 4, 5]].topk(10).indices)


def test_topk_entropy_native_edge_rows():
    inf = float("-inf")
    logits = torch.tensor([[0.0, inf, 1.0, inf], [100.0, 0.0, 0.0, 0.0], [3.0] * 4, [inf, inf, inf, 2.0]])
    assert_topk_entropy_close(logits, 4, 1.0)  # k = V, with -inf entries among the top-k
    assert_topk_entropy_close(logits, 1, 1.0)
    _, _, entropy, _ = K.topk_entropy(logits, 2, 1.0, backend="cpp")
    torch.testing.assert_close(entropy[2], torch.tensor(math.log(4)))
    assert entropy[3].item() == 0.0
    # Every logit -inf: like the reference, NaN probabilities, -inf logsumexp, zero entropy.
    probs, _, entropy, lse = K.topk_entropy(torch.full((1, 5), inf), 2, 1.0, backend="cpp")
    assert torch.isnan(probs).all() and lse.item() == inf and entropy.item() == 0.0


def test_topk_entropy_native_bad_inputs():
    x = torch.randn(2, 5)
    for args in [(x[0], 2, 1.0), (x, 0, 1.0), (x, 6, 1.0), (x, 2, 0.0), (x, 2, -1.0), (x.long(), 2, 1.0)]:
        with pytest.raises(RuntimeError):
            ops.topk_entropy(*args)
    with pytest.raises(ValueError):
        K.topk_entropy(x, 2, 0.0, backend="cpp")


# ----------------------------------------------------------------------------------------
# torch.compile
# ----------------------------------------------------------------------------------------


def test_native_ops_compile_fullgraph():
    def fn(tokens, lengths, logits):
        drafts, dlens, counts, match_n = ops.ngram_match(tokens, lengths, 1, 3, 4, 5)
        probs, ids, entropy, lse = ops.topk_entropy(logits, 3, 0.8)
        return drafts + 1, dlens * 2, counts, match_n, probs * 2, ids, entropy + lse

    g = torch.Generator().manual_seed(0)
    tokens, lengths = torch.randint(0, 4, (3, 30), generator=g), torch.tensor([30, 12, 2])
    logits = torch.randn(4, 100, generator=g)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for got, want in zip(compiled(tokens, lengths, logits), fn(tokens, lengths, logits)):
        assert torch.equal(got, want)


def test_native_ops_opcheck():
    g = torch.Generator().manual_seed(0)
    tokens, lengths = torch.randint(0, 4, (3, 30), generator=g), torch.tensor([30, 12, 2])
    torch.library.opcheck(ops.ngram_match.default, (tokens, lengths, 1, 3, 4, 5))
    torch.library.opcheck(ops.topk_entropy.default, (torch.randn(4, 100, generator=g), 3, 0.8))


# ----------------------------------------------------------------------------------------
# tree_attention
# ----------------------------------------------------------------------------------------

needs_tree_ops = pytest.mark.skipif(
    not (hasattr(ops, "tree_attention") and hasattr(ops, "tree_verify_greedy")),
    reason="specdec._C predates the tree kernels: rebuild it",
)
ATTN_TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=3e-3, rtol=3e-3),
            torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """``[T, T] bool``: row i sees node i and its ancestors."""
    t = len(parents)
    vis = torch.zeros(t, t, dtype=torch.bool)
    for i in range(t):
        j = i
        while j >= 0:
            vis[i, j] = True
            j = parents[j]
    return vis


def tree_parents(kind: str, t: int, rng: torch.Generator) -> list[int]:
    if kind == "chain":
        return list(range(-1, t - 1))
    if kind == "bushy":
        return [-1] + [0] * (t - 1)
    return [-1] + [int(torch.randint(0, i, (1,), generator=rng)) for i in range(1, t)]


def attention_inputs(b, hkv, group, d, t, s, lens, kind, dtype, seed, strided=False):
    """Random inputs; cache slots past ``lens[b]`` hold NaN, which the kernel must never read."""
    g = torch.Generator().manual_seed(seed)
    hq = hkv * group
    if strided:  # q as transformers hands it over ([B, T, Hq, D] transposed), caches as views of a larger buffer
        q = torch.randn(b, t, hq, d, generator=g).transpose(1, 2)
        big = torch.randn(b, hkv, s + t + 5, d, generator=g)
        k_cache, k_tree = big[:, :, :s], big[:, :, s + 3:s + 3 + t]
        big_v = torch.randn(b, hkv, s + t + 5, d, generator=g)
        v_cache, v_tree = big_v[:, :, :s], big_v[:, :, s + 3:s + 3 + t]
    else:
        q = torch.randn(b, hq, t, d, generator=g)
        k_cache, v_cache = torch.randn(b, hkv, s, d, generator=g), torch.randn(b, hkv, s, d, generator=g)
        k_tree, v_tree = torch.randn(b, hkv, t, d, generator=g), torch.randn(b, hkv, t, d, generator=g)
    q, k_cache, v_cache, k_tree, v_tree = (x.to(dtype) for x in (q, k_cache, v_cache, k_tree, v_tree))
    clean = [k_cache.clone(), v_cache.clone()]
    for r in range(b):
        for c in clean:
            c[r, :, lens[r]:] = 0
        k_cache[r, :, lens[r]:] = float("nan")
        v_cache[r, :, lens[r]:] = float("nan")
    if kind is None:
        mask, parents = None, [list(range(-1, t - 1)) for _ in range(b)]
    else:
        parents = [tree_parents(kind, t, g) for _ in range(b)]
        mask = K.pack_mask(torch.stack([ancestor_mask(p) for p in parents]))
    depth = torch.stack([K.tree_depth(torch.tensor([p]))[0] for p in parents])
    positions = torch.tensor(lens)[:, None] + depth
    return q, k_cache, v_cache, clean, k_tree, v_tree, mask, positions


def assert_tree_attention_close(b, hkv, group, d, t, s, lens, kind, dtype, seed, window=None, scale=None,
                                strided=False):
    q, k_cache, v_cache, clean, k_tree, v_tree, mask, positions = attention_inputs(
        b, hkv, group, d, t, s, lens, kind, dtype, seed, strided)
    pos = positions if window is not None else None
    cache_lens = torch.tensor(lens, dtype=torch.int64)
    got = K.tree_attention(q, k_cache, v_cache, cache_lens.int(), k_tree, v_tree, mask, scale, pos, window,
                           backend="cpp")
    assert got.dtype == dtype and got.shape == (b, hkv * group, t, d) and got.is_contiguous()
    f = lambda x: x.float()  # noqa: E731  (the reference in fp32: the kernel accumulates in fp32)
    want = reference.tree_attention(f(q), f(clean[0]), f(clean[1]), cache_lens, f(k_tree), f(v_tree), mask, scale,
                                    pos, window)
    torch.testing.assert_close(got.float(), want, **ATTN_TOL[dtype])


@needs_tree_ops
@settings(max_examples=150, deadline=None)
@given(
    b=st.integers(1, 3), hkv=st.integers(1, 3), group=st.sampled_from([1, 2, 3, 4, 8]),
    d=st.sampled_from([4, 16, 24, 64]), t=st.integers(1, 70), s=st.integers(0, 40), data=st.data(),
    kind=st.sampled_from([None, "chain", "bushy", "random"]),
    dtype=st.sampled_from([torch.float32, torch.float32, torch.bfloat16, torch.float16]),
    scale=st.sampled_from([None, 0.3]), strided=st.booleans(), seed=st.integers(0, 2**31 - 1),
)
def test_tree_attention_native_matches_reference(b, hkv, group, d, t, s, data, kind, dtype, scale, strided, seed):
    lens = [data.draw(st.integers(0, s)) for _ in range(b)]
    window = data.draw(st.one_of(st.none(), st.integers(1, s + t + 1)))
    assert_tree_attention_close(b, hkv, group, d, t, s, lens, kind, dtype, seed, window, scale, strided)


@needs_tree_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "b,hkv,group,d,t,s,lens,kind,window",
    [
        (1, 3, 3, 64, 64, 1024, [1024], "random", None),  # the benchmark shape: several prefix chunks
        (2, 2, 4, 128, 33, 1100, [1100, 517], "bushy", None),  # D = 128, ragged rows across a chunk edge
        (3, 1, 2, 64, 1, 20, [0, 20, 7], None, None),  # T = 1, one row with an empty cache
        (2, 1, 1, 8, 1, 0, [0, 0], "chain", None),  # nothing cached at all
        (1, 2, 2, 16, 96, 600, [600], "chain", 300),  # long chain, window cutting into the prefix
        (2, 1, 3, 16, 40, 50, [50, 3], "random", 1),  # window 1: every query sees only itself
        (1, 1, 1, 32, 700, 0, [0], None, None),  # prefill-like: a long causal chain, tree keys in chunks
    ],
)
def test_tree_attention_native_edge_cases(dtype, b, hkv, group, d, t, s, lens, kind, window):
    assert_tree_attention_close(b, hkv, group, d, t, s, lens, kind, dtype, seed=7, window=window)


@needs_tree_ops
@pytest.mark.parametrize("direct_rows,direct8_rows", [("0", "0"), ("32", "0"), ("1000", "0"), ("0", "32"), ("0", "1000")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "b,hkv,group,d,t,s,lens,kind,window",
    [
        (4, 3, 3, 64, 1, 300, [300, 17, 0, 299], None, None),  # a batched decode step (M = 3), ragged rows
        (2, 1, 4, 256, 1, 40, [40, 33], None, 20),  # Gemma-like heads (D = 256, M = 4), a window
        (1, 3, 3, 64, 6, 270, [270], "random", None),  # a small tree (M = 18)
        (2, 2, 8, 48, 9, 30, [30, 5], "bushy", None),  # D = 48 (three 16-lane steps), M up to 72
        (1, 1, 2, 16, 70, 33, [33], "chain", 40),  # long chain, tree keys across a chunk's 16-key blocks
        (1, 2, 1, 32, 5, 50, [50], "chain", None),  # M = 5: the 8-lane paths' one-row block after a 4-row one
        (1, 3, 3, 64, 1, 1100, [1100], None, None),  # a decode step whose keys are cut into 3 splits, then merged
    ],
)
def test_tree_attention_native_direct_and_panel_paths(monkeypatch, direct_rows, direct8_rows, dtype, b, hkv, group, d,
                                                      t, s, lens, kind, window):
    """The three CPU paths of the kernel against the reference: with ``SPECDEC_ATTENTION_DIRECT_ROWS`` and
    ``SPECDEC_ATTENTION_DIRECT8_ROWS`` 0 every task goes through the key panels; with 32 (the AVX-512 default of the
    first, the AVX2 default of the second) and 1000, tasks of up to that many rows take the 16-lane or the 8-lane
    direct paths. An explicit setting applies on any CPU, so every path runs here whatever the instruction set."""
    monkeypatch.setenv("SPECDEC_ATTENTION_DIRECT_ROWS", direct_rows)
    monkeypatch.setenv("SPECDEC_ATTENTION_DIRECT8_ROWS", direct8_rows)
    assert_tree_attention_close(b, hkv, group, d, t, s, lens, kind, dtype, seed=11, window=window)


@needs_tree_ops
def test_tree_attention_native_bad_inputs():
    q, kv, lens = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8), torch.tensor([5])
    tree = torch.randn(1, 2, 3, 8)
    mask = K.pack_mask(torch.ones(1, 3, 3, dtype=torch.bool))
    bad = [
        (q[0], kv, kv, lens, tree, tree, mask),  # 3-D q
        (torch.randn(1, 3, 3, 8), kv, kv, lens, tree, tree, mask),  # Hq not a multiple of Hkv
        (q.double(), kv.double(), kv.double(), lens, tree.double(), tree.double(), mask),  # fp64
        (q, kv.half(), kv, lens, tree, tree, mask),  # mixed dtypes
        (q, kv, kv, torch.tensor([6]), tree, tree, mask),  # cache_lens > S
        (q, kv, kv, torch.tensor([-1]), tree, tree, mask),
        (q, kv, kv, lens, tree[:, :, :2], tree, mask),  # k_tree not [B, Hkv, T, D]
        (q, kv, kv, lens, tree, tree, mask.long()),  # mask not int32
        (q, kv, kv, lens, tree, tree, mask[:, :2]),  # mask not [B, T, W]
    ]
    for args in bad:
        with pytest.raises(RuntimeError):
            ops.tree_attention(*args)
    with pytest.raises(RuntimeError):  # a window needs positions
        ops.tree_attention(q, kv, kv, lens, tree, tree, mask, None, None, 4)
    with pytest.raises(ValueError):
        K.tree_attention(q, kv, kv, lens, tree, tree, mask, window=4, backend="cpp")


# ----------------------------------------------------------------------------------------
# tree_verify_greedy
# ----------------------------------------------------------------------------------------


def assert_verify_equal(tokens, parents, logits, valid):
    got = K.tree_verify_greedy(tokens, parents, logits, valid, backend="cpp")
    want = K.tree_verify_greedy(tokens, parents, logits, valid, backend="torch")
    for name, g, r in zip(("path", "length", "next_token"), got, want):
        assert g.dtype == r.dtype and g.shape == r.shape, (name, g.dtype, r.dtype, g.shape, r.shape)
        assert torch.equal(g, r), (name, tokens, parents, valid, g, r)


@st.composite
def verify_batches(draw):
    """Trees whose tokens often follow the target's argmax; logits with ties, NaN and -inf rows."""
    b, t = draw(st.integers(1, 4)), draw(st.integers(1, 40))
    v = draw(st.sampled_from([1, 2, 7, 16, 33, 1500]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    if draw(st.booleans()):
        logits = torch.randint(0, 3, (b, t, v), generator=g).float()  # many ties: first index wins
    else:
        logits = torch.randn(b, t, v, generator=g)
    if draw(st.integers(0, 4)) == 0:
        logits[0, 0, -1] = float("nan")  # torch.argmax takes the first NaN
    if draw(st.integers(0, 4)) == 0:
        logits[-1, -1] = float("-inf")  # an all -inf row: index 0
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]))
    logits = logits.to(dtype)
    pred = logits.argmax(-1)
    kind = draw(st.sampled_from(["chain", "bushy", "random"]))
    parents = torch.tensor([tree_parents(kind, t, g) for _ in range(b)], dtype=torch.int64).reshape(b, t)
    follow = torch.rand(b, t, generator=g) < 0.7
    noise = torch.randint(0, v, (b, t), generator=g)
    tokens = torch.where(follow, pred.gather(1, parents.clamp(min=0)), noise)
    valid = None
    if draw(st.booleans()):
        valid = torch.rand(b, t, generator=g) < 0.8
        valid[:, 0] = draw(st.booleans()) or valid[:, 0]
    if draw(st.booleans()):  # logits as a view: every other row of a larger vocabulary
        wide = torch.zeros(b, t, 2 * v, dtype=dtype)
        wide[..., ::2] = logits
        logits = wide[..., ::2]
    return tokens, parents, logits, valid


@needs_tree_ops
@settings(max_examples=300, deadline=None)
@given(verify_batches())
def test_tree_verify_greedy_native_matches_reference(case):
    assert_verify_equal(*case)


@needs_tree_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_tree_verify_greedy_native_large_vocab(dtype):
    g = torch.Generator().manual_seed(3)
    b, t, v = 3, 64, 49152
    logits = torch.randn(b, t, v, generator=g).to(dtype)
    logits[:, :, 40000] = 50.0  # the maximum twice, in different chunks: the first one wins
    logits[:, :, 2000] = 50.0
    logits[1, :, 100] = 60.0
    pred = logits.argmax(-1)
    parents = torch.tensor([list(range(-1, t - 1)), [-1] + [0] * (t - 1), [-1] + [i // 2 for i in range(t - 1)]])
    tokens = pred.gather(1, parents.clamp(min=0))
    tokens[0, 40] = 5  # row 0 accepted up to node 39
    assert_verify_equal(tokens, parents, logits, None)
    assert_verify_equal(tokens, parents, logits, torch.rand(b, t, generator=g) < 0.9)


@needs_tree_ops
def test_tree_verify_greedy_native_bad_inputs():
    tokens, parents, logits = torch.zeros(1, 3, dtype=torch.int64), torch.tensor([[-1, 0, 1]]), torch.randn(1, 3, 5)
    bad = [
        (tokens, torch.tensor([[-1, 0, 2]]), logits, None),  # a parent that does not precede its child
        (tokens, torch.tensor([[-1, 0, -2]]), logits, None),
        (tokens.int(), parents, logits, None),  # int32 tokens (the public op casts)
        (tokens, parents, logits[:, :2], None),  # logits not [B, T, V]
        (tokens, parents, logits.long(), None),
        (tokens, parents, logits, torch.ones(1, 3, dtype=torch.int64)),  # valid not bool
        (tokens, parents, logits, torch.ones(1, 2, dtype=torch.bool)),
    ]
    for args in bad:
        with pytest.raises(RuntimeError):
            ops.tree_verify_greedy(*args)


@needs_tree_ops
def test_tree_ops_compile_fullgraph_and_opcheck():
    q, k_cache, v_cache, _, k_tree, v_tree, mask, positions = attention_inputs(
        2, 2, 3, 16, 9, 12, [12, 4], "random", torch.float32, 0)
    k_cache, v_cache = k_cache.nan_to_num(), v_cache.nan_to_num()
    lens = torch.tensor([12, 4])
    g = torch.Generator().manual_seed(0)
    tokens, parents = torch.randint(0, 5, (2, 9), generator=g), torch.tensor([[-1] + list(range(8))] * 2)
    logits = torch.randn(2, 9, 5, generator=g)

    def fn(q, k_cache, v_cache, k_tree, v_tree):
        out = ops.tree_attention(q, k_cache, v_cache, lens, k_tree, v_tree, mask, 0.5, positions, 6)
        path, length, nxt = ops.tree_verify_greedy(tokens, parents, logits, None)
        return out * 2, path + 1, length, nxt

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    args = (q, k_cache, v_cache, k_tree, v_tree)
    for got, want in zip(compiled(*args), fn(*args)):
        assert torch.equal(got, want)
    torch.library.opcheck(ops.tree_attention.default, (q, k_cache, v_cache, lens, k_tree, v_tree, mask, 0.5, positions, 6))
    torch.library.opcheck(ops.tree_attention.default, (q, k_cache, v_cache, lens, k_tree, v_tree, None))
    torch.library.opcheck(ops.tree_verify_greedy.default, (tokens, parents, logits, torch.rand(2, 9, generator=g) < 0.8))


# ----------------------------------------------------------------------------------------
# draft_tree
# ----------------------------------------------------------------------------------------

needs_draft_tree = pytest.mark.skipif(not hasattr(ops, "draft_tree"), reason="specdec._C predates draft_tree: rebuild it")


@st.composite
def draft_batches(draw):
    b, k, w = draw(st.integers(1, 3)), draw(st.integers(1, 6)), draw(st.integers(1, 6))
    vocab = draw(st.integers(1, 4))  # small vocabularies: many shared prefixes
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    drafts = torch.randint(0, vocab, (b, k, w), generator=g)
    cut = torch.randint(0, w + 1, (b, k), generator=g)  # chain lengths, 0 = empty slot
    drafts = torch.where(torch.arange(w)[None, None] < cut[:, :, None], drafts, -1)
    if draw(st.booleans()):  # tokens after a chain's first -1 must be ignored
        drafts = torch.where(torch.rand(b, k, w, generator=g) < 0.2, -1, drafts.abs())
    root = torch.randint(0, vocab, (b,), generator=g)
    # Estimates on a coarse grid (ties, which the order must break alike), 0 included.
    accept = torch.randint(0, 5, (b, k, w), generator=g).float() / 4
    keep = torch.randint(0, k * w + 2, (b,), generator=g)  # node counts, past what a row holds included
    return root, drafts, draw(st.booleans()), accept, keep


@needs_draft_tree
@settings(max_examples=400, deadline=None)
@given(draft_batches(), st.sampled_from(["whole", "reach", "cut"]))
def test_draft_tree_native_matches_reference(case, mode):
    root, drafts, merge, accept, keep = case
    args = (root, drafts, merge) + {"whole": (), "reach": (accept,), "cut": (accept, keep)}[mode]
    got = K.draft_tree(*args, backend="cpp")
    want = K.draft_tree(*args, backend="torch")
    names = ("tokens", "parents", "valid", "depth", "mask", "chain", "slot", "reach")
    for name, g, r in zip(names, got, want, strict=True):
        assert g.dtype == r.dtype and g.shape == r.shape, (name, g.dtype, r.dtype, g.shape, r.shape)
        assert torch.equal(g, r), (name, args, g, r)
    tokens, parents, valid, depth, mask, chain, slot, reach = got
    if mode != "whole":
        # A node's reach is its first chain's cell capped by its parent's; a cut keeps the likeliest.
        cell = accept.reshape(accept.shape[0], -1).gather(1, slot.clamp(min=0))
        up = reach.gather(1, parents.clamp(min=0))
        inner = valid.clone()
        inner[:, 0] = False
        assert torch.equal(reach[inner], torch.minimum(cell, up)[inner]) and (reach[:, 0] == 1).all()
        assert (reach[~valid] == 0).all()
    if mode == "cut":
        whole = K.draft_tree(root, drafts, merge, accept, backend="cpp")
        for r in range(root.shape[0]):
            held = int(whole[2][r].sum()) - 1
            assert int(valid[r].sum()) - 1 == min(int(keep[r]), held)
            dropped = sorted(whole[7][r, 1:][whole[2][r, 1:]].tolist(), reverse=True)[int(valid[r].sum()) - 1:]
            assert all(reach[r, i] >= max(dropped, default=0.0) for i in range(1, int(valid[r].sum())))
    # The tree is well formed: a checked rebuild agrees on depth and mask, and every node's token is
    # its chain's token at its depth.
    from specdec.tree import DraftTree

    checked = DraftTree.from_parents(tokens, parents, valid)
    assert torch.equal(checked.depth, depth) and torch.equal(checked.mask, mask)
    b, k, w = drafts.shape
    flat = drafts.reshape(b, k * w)
    node = valid.clone()
    node[:, 0] = False
    assert torch.equal(tokens[node], flat.gather(1, slot.clamp(min=0))[node])
    assert torch.equal(chain[node], slot[node] // w) and torch.equal(depth[node], slot[node] % w + 1)


@needs_draft_tree
def test_draft_tree_cuts_where_the_planner_says():
    # One chain of 4 with estimates 0.9, 0.8, 0.1, 0.05: flat costs keep all, steep costs only the root.
    from specdec.policies.planner import plan_size

    root, drafts = torch.tensor([7]), torch.tensor([[[1, 2, 3, 4]]])
    accept = torch.tensor([[[0.9, 0.8, 0.1, 0.05]]])
    for backend in ("cpp", "torch"):
        reach = K.draft_tree(root, drafts, True, accept, backend=backend)[7]

        def cut(cost, extra):
            keep = torch.tensor([plan_size(reach[0, 1:].tolist(), cost.tolist(), explore=bool(extra))])
            return K.draft_tree(root, drafts, True, accept, keep, backend=backend)

        tokens, _, valid, *_ = cut(torch.ones(5), 0)
        assert tokens[valid].tolist() == [7, 1, 2, 3, 4]
        tokens, _, valid, *_ = cut(torch.arange(1, 6).float() ** 3, 0)
        assert tokens[valid].tolist() == [7]
        # c(n) = 1 + 0.3 (n - 1): the 0.1 node no longer pays (2.7 / 1.6 > 2.8 / 1.9), extra=1 takes it.
        cost = 1 + 0.3 * torch.arange(5).float()
        tokens, _, valid, *_ = cut(cost, 0)
        assert tokens[valid].tolist() == [7, 1, 2]
        tokens, _, valid, *_ = cut(cost, 1)
        assert tokens[valid].tolist() == [7, 1, 2, 3]


@needs_draft_tree
@pytest.mark.parametrize("backend", ["cpp", "torch"])
def test_draft_tree_bad_inputs(backend):
    root, drafts = torch.tensor([7]), torch.tensor([[[1, 2]]])
    with pytest.raises(ValueError, match="keep needs accept"):
        K.draft_tree(root, drafts, True, None, torch.tensor([1]), backend=backend)
    with pytest.raises(ValueError, match="accept must be"):
        K.draft_tree(root, drafts, True, torch.ones(1, 2), torch.tensor([1]), backend=backend)
    with pytest.raises(ValueError, match="keep must be"):
        K.draft_tree(root, drafts, True, torch.ones(1, 1, 2), torch.tensor([1.0]), backend=backend)
    with pytest.raises(ValueError, match="keep must be"):
        K.draft_tree(root, drafts, True, torch.ones(1, 1, 2), torch.tensor([1, 1]), backend=backend)
    with pytest.raises(ValueError, match="drafts must be"):
        K.draft_tree(torch.tensor([7, 8]), drafts, backend=backend)
    with pytest.raises((ValueError, RuntimeError), match=">= 0"):
        K.draft_tree(root, drafts, True, torch.ones(1, 1, 2), torch.tensor([-1]), backend=backend)


@needs_draft_tree
def test_draft_tree_compile_fullgraph_and_opcheck():
    g = torch.Generator().manual_seed(0)
    root, drafts = torch.tensor([3, 1]), torch.randint(0, 3, (2, 4, 3), generator=g)
    accept, keep = torch.rand(2, 4, 3, generator=g), torch.tensor([3, 5])
    torch.library.opcheck(ops.draft_tree.default, (root, drafts, True, accept, keep))
    torch.library.opcheck(ops.draft_tree.default, (root, drafts, True, accept))
    torch.library.opcheck(ops.draft_tree.default, (root, drafts, False))
