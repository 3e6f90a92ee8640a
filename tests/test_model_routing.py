"""The runner's two attention paths (tree-attention kernel, dense-mask SDPA) give the same logits."""
from __future__ import annotations

import pytest
import torch

from specdec import kernels
from specdec.model import ModelRunner, default_attention
from specdec.tree import DraftTree
from tests.conftest import tiny_model

needs_kernel = pytest.mark.skipif(not kernels.has_native("tree_attention"), reason="specdec._C is not built")


def run_steps(model, attention: str, prompts: list[list[int]]):
    """Ragged prefill, one chain step, one bushy-tree step with a partial commit; every step's logits."""
    runner = ModelRunner(model, attention=attention)
    b, width = len(prompts), max(len(p) for p in prompts)
    runner.reset(b, width + 32)
    ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
    lens = torch.tensor([len(p) for p in prompts])
    first, _ = runner.prefill(ids, lens)
    out = [first]
    root = first.argmax(-1)
    chain = DraftTree.chain(root, torch.tensor([[5, 6, 7]] * b))
    logits, _ = runner.forward_tree(chain)
    out.append(logits)
    path = torch.tensor([[0, 1, -1, -1]] * b)
    runner.commit(path, torch.full((b,), 2), True, [2] * b)
    tree = DraftTree.from_chains(root, [[[3, 4], [3, 9, 2], [8]] for _ in range(b)])
    logits, _ = runner.forward_tree(tree)
    out.append(logits)
    return out


@needs_kernel
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])  # gemma3: sliding-window layers
def test_kernel_and_sdpa_paths_agree(arch, monkeypatch):
    model = tiny_model(arch)
    prompts = [list(range(2, 14)), list(range(20, 25)), list(range(30, 49))]  # ragged rows, past the window
    want = run_steps(model, "sdpa", prompts)

    def no_dense(*args, **kwargs):
        raise AssertionError("the kernel path built a dense mask")

    monkeypatch.setattr("specdec.model.tree_attention_mask", no_dense)
    monkeypatch.setattr("specdec.model.WIDE_TREE_SDPA", None)  # wide forwards' SDPA route: test_wide_tree_attention_paths
    got = run_steps(model, "kernel", prompts)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def test_wide_tree_route_setting():
    """``$SPECDEC_WIDE_TREE_SDPA``: a number of tokens (8 by default), 0 for never; negative is an error."""
    from specdec.model import _wide_tree_sdpa

    assert _wide_tree_sdpa(None) == 8 and _wide_tree_sdpa("") == 8 and _wide_tree_sdpa("12") == 12
    assert _wide_tree_sdpa("0") is None
    with pytest.raises(ValueError, match="SPECDEC_WIDE_TREE_SDPA"):
        _wide_tree_sdpa("-1")


def test_attention_selection(monkeypatch):
    monkeypatch.setenv("SPECDEC_ATTN", "sdpa")
    assert default_attention(torch.device("cpu")) == "sdpa"
    assert ModelRunner(tiny_model("llama")).attention == "sdpa"
    assert ModelRunner(tiny_model("llama"), attention="kernel").attention == "kernel"
    monkeypatch.setenv("SPECDEC_ATTN", "dense")
    with pytest.raises(ValueError):
        default_attention(torch.device("cpu"))
    monkeypatch.delenv("SPECDEC_ATTN")
    assert default_attention(torch.device("cpu")) == ("kernel" if kernels.has_native("tree_attention") else "sdpa")
    with pytest.raises(ValueError):
        ModelRunner(tiny_model("llama"), attention="flash")


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_token_step_route(dtype, monkeypatch):
    """On the CPU a one-token step with every key visible takes the kernel in every dtype (it beats
    SDPA's unmasked path there), and gives the SDPA runner's logits."""
    import copy

    import specdec.model

    model = copy.deepcopy(tiny_model("llama")).to(dtype)
    prompt = torch.arange(2, 30)[None]
    calls = []
    real = specdec.model._native_tree_attention()

    def counting(*a, **k):  # the runner calls the compiled kernel directly: count it there
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(specdec.model, "_native_tree_attention", lambda: counting)

    def one_step(attention, model=model, token=None):
        runner = ModelRunner(model, attention=attention)
        runner.reset(1, 40)
        first, _ = runner.prefill(prompt, torch.tensor([prompt.shape[1]]))
        calls.clear()
        token = first.argmax(-1) if token is None else token
        logits, _ = runner.forward_tree(DraftTree.chain(token, torch.zeros(1, 0, dtype=torch.long)))
        return logits.float(), len(calls), token

    want, sdpa_calls, token = one_step("sdpa")
    got, kernel_calls, _ = one_step("kernel", token=token)
    assert sdpa_calls == 0
    assert kernel_calls == model.config.num_hidden_layers
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    else:
        # Half-precision paths round differently (SDPA rounds the probabilities to bf16, the kernel
        # keeps them in fp32), so both are held against the same weights run in fp32: the kernel's
        # error must be of SDPA's size, not larger.
        truth, _, _ = one_step("sdpa", copy.deepcopy(model).float(), token)
        sdpa_err, kernel_err = (want - truth).abs().max().item(), (got - truth).abs().max().item()
        assert kernel_err <= 1.5 * sdpa_err + 1e-3, (kernel_err, sdpa_err)


def test_one_forward_route(monkeypatch):
    """:func:`route_attention`: wide trees and chains on an AVX-512 CPU take SDPA (prompts on an empty cache and
    narrow forwards keep the kernel); without AVX-512, or with the route off, the kernel stays; ``native`` only on
    the kernel route, where the extension has one."""
    from specdec import model as model_mod

    cpu = torch.device("cpu")
    monkeypatch.setattr(model_mod, "WIDE_TREE_SDPA", 8)
    monkeypatch.setattr(model_mod, "_prompt_sdpa", lambda device_type: True)
    native = kernels.has_native("tree_attention")
    assert model_mod.route_attention("kernel", cpu, 8, prompt=False) == ("sdpa", False)
    assert model_mod.route_attention("kernel", cpu, 7, prompt=False) == ("kernel", native)
    assert model_mod.route_attention("kernel", cpu, 64, prompt=True) == ("kernel", native)
    assert model_mod.route_attention("sdpa", cpu, 1, prompt=False) == ("sdpa", False)
    monkeypatch.setattr(model_mod, "_prompt_sdpa", lambda device_type: False)
    assert model_mod.route_attention("kernel", cpu, 64, prompt=False) == ("kernel", native)
    monkeypatch.setattr(model_mod, "_prompt_sdpa", lambda device_type: True)
    monkeypatch.setattr(model_mod, "WIDE_TREE_SDPA", None)
    assert model_mod.route_attention("kernel", cpu, 64, prompt=False) == ("kernel", native)
