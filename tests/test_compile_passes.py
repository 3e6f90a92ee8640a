"""specdec.compile_passes: the compiled forwards group the quantized products that read one input, and compute
exactly what the separate products would."""
from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch.fx.experimental.proxy_tensor import make_fx

from specdec.api import SpecDecoder, hf_generate
from specdec.compile_passes import GroupQuantLinears
from specdec.kernels import has_native
from specdec.kernels.quant import pack_quant_weight
from specdec.verify import SamplingConfig
from tests.test_gguf_weights import quantized
from tests.test_greedy_lossless import prompt_of
from tests.test_ngrammys import REPETITIVE
from tests.test_quant_linear import random_codes

pytestmark = pytest.mark.skipif(not has_native("quant_linear_group"), reason="needs the compiled extension")
GREEDY = SamplingConfig()


def _targets(graph: torch.fx.Graph) -> list:
    return [n.target for n in graph.nodes if n.op == "call_function"]


def test_pass_groups_products_of_one_input_and_one_format():
    """Three products of views of one x: the two of one format become one group call; the one of another format,
    and the product of another input, stay single. The graph's outputs do not change, bit for bit."""
    k = 96
    q4 = [pack_quant_weight(random_codes(n, k, 4, 32, True, True, seed=n)) for n in (40, 16)]
    q8 = pack_quant_weight(random_codes(24, k, 8, 32, False, True))
    op = torch.ops.specdec.quant_linear.default

    def layer(x, y, a, b, c, bias):
        rows = x.numel() // k
        qa = op(x.reshape(rows, k), a, 40, k, 4, 32, True, True, None)
        qb = op(x.reshape(rows, k), b, 16, k, 4, 32, True, True, bias)
        qc = op(x.reshape(rows, k), c, 24, k, 8, 32, False, True, None)
        qy = op(y.reshape(rows, k), a, 40, k, 4, 32, True, True, None)
        return qa.sum(-1) + qb.sum(-1) + qc.sum(-1) + qy.sum(-1), qb

    args = (torch.randn(1, 3, k), torch.randn(1, 3, k), q4[0].packed, q4[1].packed, q8.packed, torch.randn(16))
    gm = make_fx(layer)(*args)
    before = gm(*args)
    GroupQuantLinears()(gm.graph)
    gm.graph.lint()
    gm.recompile()
    targets = _targets(gm.graph)
    assert targets.count(torch.ops.specdec.quant_linear_group.default) == 1
    assert targets.count(op) == 2
    after = gm(*args)
    assert all(torch.equal(u, v) for u, v in zip(before, after))


def test_pass_groups_only_products_with_one_tile_rows_and_keeps_it():
    """tile_rows is part of a product's format: two products that differ in it stay apart, and a group call carries
    its members' tile_rows (on an AMX CPU a group on tiles sums differently from one on the vector kernel)."""
    k = 96
    ws = [pack_quant_weight(random_codes(n, k, 4, 32, True, True, seed=n)) for n in (40, 16, 24)]
    op = torch.ops.specdec.quant_linear.default

    def layer(x, a, b, c):
        xs = x.reshape(-1, k)
        return (op(xs, a, 40, k, 4, 32, True, True, None, 5), op(xs, b, 16, k, 4, 32, True, True, None, 5),
                op(xs, c, 24, k, 4, 32, True, True, None))

    args = (torch.randn(1, 6, k).bfloat16(), ws[0].packed, ws[1].packed, ws[2].packed)
    gm = make_fx(layer)(*args)
    before = gm(*args)
    GroupQuantLinears()(gm.graph)
    gm.graph.lint()
    gm.recompile()
    groups = [n for n in gm.graph.nodes if n.target is torch.ops.specdec.quant_linear_group.default]
    assert len(groups) == 1 and groups[0].args[-1] == 5 and len(groups[0].args[1]) == 2
    assert _targets(gm.graph).count(op) == 1
    assert all(torch.equal(u, v) for u, v in zip(before, gm(*args)))


def _group_calls(dec: SpecDecoder, prompt: list[int]) -> tuple[int, int]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        dec.generate_ids([prompt], "ar", 3, GREEDY)
    names = [e.name for e in prof.events()]
    return names.count("specdec::quant_linear_group"), names.count("specdec::quant_linear")


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_compiled_quantized_model_runs_grouped_products(arch):
    """A compiled decoder over GGUF blocks (qwen2: q/k/v with biases) makes grouped calls in its decode steps and
    still gives transformers' greedy tokens on the dense weights (fp32)."""
    torch._dynamo.reset()
    model, dense = quantized(arch)
    dec = SpecDecoder(model, compile=True, corpus=None)
    assert dec.runner.compiled
    grouped, _ = _group_calls(dec, prompt_of(9, seed=9))
    assert grouped > 0
    for prompt in (prompt_of(33, seed=2), REPETITIVE):
        ref = hf_generate(dense, prompt, 30, GREEDY)
        for method in ("ar", "ngrammys"):
            assert dec.generate_ids([prompt], method, 30, GREEDY).tokens[0] == ref, (arch, method)
    torch._dynamo.reset()
