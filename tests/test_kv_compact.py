"""The native CPU ``specdec::kv_compact`` against :func:`specdec.kernels.reference.kv_compact`."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import specdec.kernels as K
from specdec.kernels import reference
from specdec.kernels._dispatch import native_ops

ops = native_ops()
if ops is None:
    pytest.skip("specdec._C is not built: run `pip install --no-build-isolation -e .`", allow_module_level=True)

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# How a [B,H,S,D] cache view sits in memory: contiguous, HF-style [B,S,H,D] storage, or stride(-1) != 1.
LAYOUTS = {
    "contiguous": (lambda b, h, s, d: (b, h, s, d), lambda x: x),
    "bshd": (lambda b, h, s, d: (b, s, h, d), lambda x: x.transpose(1, 2)),
    "strided_d": (lambda b, h, s, d: (b, h, s, 2 * d), lambda x: x[..., ::2]),
}


@st.composite
def compactions(draw):
    """Index tensors ``src [B,n]``, ``dst_start [B]``, ``counts [B]`` satisfying the op's contract, and S."""
    b = draw(st.integers(1, 4))
    s = draw(st.integers(1, 64))
    n = draw(st.integers(1, s))
    src = torch.full((b, n), -1, dtype=torch.int64)  # padding past counts[b] must be ignored
    dst_start = torch.zeros(b, dtype=torch.int64)
    counts = torch.zeros(b, dtype=torch.int64)
    for row in range(b):
        c = draw(st.integers(0, n))
        d0 = draw(st.integers(0, s - c))
        # src[j] = d0 + j + gap[j] with gaps non-decreasing: ascending, never before its destination;
        # gap 0 is src == dst, small gaps make source and destination ranges overlap.
        gaps = sorted(draw(st.lists(st.integers(0, s - c - d0), min_size=c, max_size=c)))
        src[row, :c] = torch.tensor([d0 + j + g for j, g in enumerate(gaps)], dtype=torch.int64)
        dst_start[row], counts[row] = d0, c
    return s, src, dst_start, counts


@st.composite
def cache_specs(draw):
    """Per cache tensor: (H, D, dtype, layout)."""
    return draw(
        st.lists(
            st.tuples(
                st.integers(1, 4), st.sampled_from([8, 64, 128]), st.sampled_from(DTYPES), st.sampled_from(list(LAYOUTS))
            ),
            min_size=1,
            max_size=4,
        )
    )


def make_caches(b: int, s: int, specs, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Backing storages and their ``[B,H,S,D]`` cache views."""
    gen = torch.Generator().manual_seed(seed)
    bases, views = [], []
    for h, d, dtype, layout in specs:
        shape, view = LAYOUTS[layout]
        base = torch.randn(shape(b, h, s, d), generator=gen).to(dtype)
        bases.append(base)
        views.append(view(base))
    return bases, views


@settings(max_examples=200, deadline=None)
@given(compactions(), cache_specs(), st.integers(0, 2**31 - 1))
def test_matches_reference(compaction, specs, seed):
    s, src, dst_start, counts = compaction
    bases, caches = make_caches(src.shape[0], s, specs, seed)
    ref_bases = [x.clone() for x in bases]
    ref_caches = [LAYOUTS[spec[3]][1](x) for spec, x in zip(specs, ref_bases)]

    ops.kv_compact(caches, src, dst_start, counts)
    reference.kv_compact(ref_caches, src, dst_start, counts)
    for got, want in zip(bases, ref_bases):  # whole storages: nothing outside the views moves either
        assert torch.equal(got, want)


def test_public_api_uses_native():
    bases, caches = make_caches(2, 16, [(2, 64, torch.float16, "contiguous"), (4, 128, torch.float32, "bshd")], 0)
    want = [x.clone() for x in caches]
    src = torch.tensor([[5, 6, 9], [3, 4, -1]])
    dst_start, counts = torch.tensor([4, 1]), torch.tensor([3, 2])
    K.kv_compact(caches, src, dst_start, counts, backend="cpp")
    reference.kv_compact(want, src, dst_start, counts)
    assert all(torch.equal(got, ref) for got, ref in zip(caches, want))


def _valid_call():
    cache = torch.zeros(2, 2, 8, 16)
    return [cache], torch.tensor([[3, 4], [2, 7]]), torch.tensor([0, 1]), torch.tensor([2, 1])


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda c, s, d, n: (c, s.int(), d, n), "src must be int64"),
        (lambda c, s, d, n: (c, s, d.int(), n), "dst_start must be int64"),
        (lambda c, s, d, n: (c, s[0], d, n), "src must be 2-D"),
        (lambda c, s, d, n: (c, s, d, n[:1]), r"dst_start and counts must be \[B\]"),
        (lambda c, s, d, n: (c, s.index_fill(1, torch.tensor([1]), 8), d, n), r"src\[0, 1\] = 8 is out of bounds"),
        (lambda c, s, d, n: (c, s, torch.tensor([0, 8]), n), r"dst_start\[1\] \+ counts\[1\] = 8 \+ 1"),
        (lambda c, s, d, n: (c, s, d, torch.tensor([3, 1])), r"counts\[0\] = 3 is outside \[0, n = 2\]"),
        (lambda c, s, d, n: (c, s, torch.tensor([0, 3]), n), r"src\[1, 0\] = 2 precedes its destination"),
        (lambda c, s, d, n: (c + [torch.zeros(2, 2, 9, 16)], s, d, n), r"caches\[1\] has shape"),
        (lambda c, s, d, n: ([c[0][0]], s, d, n), r"caches\[0\] must be \[B, H, S, D\]"),
    ],
)
def test_rejects_bad_input(edit, match):
    with pytest.raises(RuntimeError, match=match):
        ops.kv_compact(*edit(*_valid_call()))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiles_fullgraph(backend):
    def step(k, v, src, dst_start, counts):
        torch.ops.specdec.kv_compact([k, v], src, dst_start, counts)
        return k.sum() + v.sum()

    _, (k, v) = make_caches(2, 16, [(2, 8, torch.float32, "contiguous"), (2, 8, torch.float32, "bshd")], 1)
    want = [k.clone(), v.clone()]
    src, dst_start, counts = torch.tensor([[5, 6, 9], [3, 4, 5]]), torch.tensor([4, 1]), torch.tensor([3, 2])
    reference.kv_compact(want, src, dst_start, counts)

    torch._dynamo.reset()
    total = torch.compile(step, fullgraph=True, backend=backend)(k, v, src, dst_start, counts)
    assert torch.equal(k, want[0]) and torch.equal(v, want[1])
    torch.testing.assert_close(total, want[0].sum() + want[1].sum())
