"""Inductor graph passes for the runner's compiled forwards (:class:`specdec.model.ModelRunner` ``compile=True``).

:class:`GroupQuantLinears` turns the ``specdec::quant_linear`` calls of a graph that read one input with weights of
one format (a layer's q, k and v projections; its gate and up projections) into one ``specdec::quant_linear_group``
call. Why: a one-token step of SmolLM2-135M makes 211 quantized products of a few hundred KB each, and a call's fixed
cost (widening x, the thread pool's wake-up and join) was 8.4 us of a 2-core Xeon's step, where its 210 decoder
weights streamed at 8.6 GB/s against 20.5 GB/s for the one large LM head (bench/RESULTS.md, Weights as shipped).
Grouped, a layer makes 4 calls instead of 7. The outputs are the separate calls' bit for bit
(csrc/quant_linear.cpp), so the pass changes no result.

transformers' attention and MLP modules call their projections one by one, and the model code is not ours to change:
the grouping happens on the traced graph, where the calls sit side by side, which is what inductor's own passes
are for. Eager forwards keep the separate calls.
"""
from __future__ import annotations

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

_VIEWS = ("view", "reshape", "_unsafe_view")


def _source(node):
    """A hashable name for the value ``node`` computes, equal for views of one value with the same sizes (each
    projection reshapes its input on its own)."""
    if isinstance(node, torch.fx.Node) and node.op == "call_function":
        packet = getattr(node.target, "_overloadpacket", None)
        if packet is not None and packet.__name__ in _VIEWS and len(node.args) == 2:
            sizes = node.args[1]
            return ("view", _source(node.args[0]), tuple(sizes) if isinstance(sizes, (list, tuple)) else sizes)
    return node


class GroupQuantLinears(CustomGraphPass):
    """Post-grad pass: ``quant_linear`` calls over one input and one weight format become one ``quant_linear_group``
    call, placed where the first of them was (``torch.compile(..., options={"post_grad_custom_post_pass": ...})``)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        single = torch.ops.specdec.quant_linear.default
        groups: dict[tuple, list[torch.fx.Node]] = {}
        order = {node: i for i, node in enumerate(graph.nodes)}
        for node in graph.nodes:
            if node.op == "call_function" and node.target is single:
                x, _, _, k, bits, group, has_min, f16 = node.args[:8]
                groups.setdefault((_source(x), k, bits, group, has_min, f16, _tile_rows(node)), []).append(node)
        for members in groups.values():
            # The group runs where its first member was: the others' weights and biases must exist by then.
            at = order[members[0]]
            members = [m for m in members
                       if all(order.get(a, -1) < at for a in (m.args[1], _bias(m)) if isinstance(a, torch.fx.Node))]
            if len(members) > 1:
                _fuse(graph, members)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))  # inductor's cache key: a changed pass recompiles


def _bias(node: torch.fx.Node):
    return node.args[8] if len(node.args) > 8 else node.kwargs.get("bias")


def _tile_rows(node: torch.fx.Node) -> int:
    return node.args[9] if len(node.args) > 9 else node.kwargs.get("tile_rows", 0)


def _fuse(graph: torch.fx.Graph, members: list[torch.fx.Node]) -> None:
    first = members[0]
    x, _, _, k, bits, group, has_min, f16 = first.args[:8]
    with graph.inserting_before(first):
        fused = graph.call_function(torch.ops.specdec.quant_linear_group.default,
                                    (x, [m.args[1] for m in members], [m.args[2] for m in members], k, bits, group,
                                     has_min, f16, [_bias(m) for m in members], _tile_rows(first)))
        val = first.meta.get("val")
        if val is not None:  # the op's one [M, sum n] output (a fake tensor, in the first product's fake mode)
            val = fused.meta["val"] = val.new_empty((val.shape[0], sum(m.args[2] for m in members)))
        start = 0
        for m in members:
            stop = start + m.args[2]
            part = graph.call_function(torch.ops.aten.slice.Tensor, (fused, 1, start, stop))
            if val is not None:
                part.meta["val"] = val[:, start:stop]
            m.replace_all_uses_with(part)
            start = stop
    for m in members:
        graph.erase_node(m)


def compile_options(device_type: str) -> dict:
    """The inductor options of the runner's compiled forwards on ``device_type``'s models.

    Besides the grouping pass: no size, stride or alignment asserts in the generated wrapper. Inductor checks every
    input of a graph with them on every call (about 640 for a one-token step of SmolLM2-135M: its 272 weights, the
    30 layers' KV buffers, the small inputs), where dynamo's guards have already checked the same tensors: 2.0 ms of
    a 14.2 ms compiled step on a 2-core Xeon with the Python wrapper (``bench.profile forward-split --compile
    --ablate``, its ``asserts`` arm; bench/RESULTS.md). A custom op whose fake output disagrees with its real one is
    caught by the identity tests of the compiled runners instead (tests/test_compile*.py).

    On the CPU the wrapper is C++ (inductor's ``cpp_wrapper``): a one-token step of SmolLM2-135M makes about 150
    custom-op calls, 120 fused-kernel calls and 330 tensor reinterpretations, and in Python they kept one core busy
    while the other waited (a third of the step on a Zen 3). The C++ wrapper calls every op through the dispatcher
    (``quant_linear_group`` returns one tensor for that) and computes the same values bit for bit. It is built
    apart from the kernels (``cpp_wrapper_build_separate``, the wrapper at -O1): 137 s a graph for SmolLM2-135M on
    the Zen 3 instead of 217 s, against 74 s for the Python wrapper, once per machine (the graphs are saved).
    """
    options = {"post_grad_custom_post_pass": GroupQuantLinears(), "size_asserts": False, "alignment_asserts": False}
    if device_type == "cpu":
        options.update(cpp_wrapper=True, cpp_wrapper_build_separate=True)
    return options
