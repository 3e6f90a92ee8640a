"""The native CPU ``specdec::ngram_match`` and ``specdec::topk_entropy`` against the torch references."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import specdec.kernels as K
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
    torch.testing.assert_close(lse, r_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, r_entropy, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(probs, r_probs, rtol=1e-5, atol=1e-7)
    # ids up to ties: distinct, and the reference's probabilities at them are the returned values.
    full = torch.softmax(logits.float() / temperature, dim=-1)
    torch.testing.assert_close(full.gather(1, ids), probs, rtol=1e-5, atol=1e-7)
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
