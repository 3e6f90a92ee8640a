"""Decode forwards through torch.compile (``SpecDecoder(compile=True)``): lossless, and compiled up front."""
from __future__ import annotations

import argparse

import pytest
import torch
import torch._dynamo

from specdec.api import SpecDecoder, hf_generate, inductor_options, runner_options
from specdec.cli import _compile_option
from specdec.precompile import PrecompiledForward
from specdec.tree import DraftTree
from specdec.verify import SamplingConfig
from tests.conftest import tiny_model
from tests.test_greedy_lossless import perturbed, prompt_of
from tests.test_ngrammys import REPETITIVE

GREEDY = SamplingConfig()


@pytest.fixture(scope="module")
def compiled_decoder():
    torch._dynamo.reset()
    dec = SpecDecoder(tiny_model("llama"), compile=True)  # compiles here (warm_up)
    yield dec
    torch._dynamo.reset()


def _frames() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def test_warm_up_compiles_every_kind_of_forward(compiled_decoder):
    """After warm_up (the fixture), single-row decoding compiles nothing more: one token, chains, trees,
    a one-node tree (a step without drafts), trees past 32 nodes. A compile inside a timed decode would
    cost minutes on the embedded model. (First in this file: later tests would compile what it misses.)"""
    dec = compiled_decoder
    before = _frames()
    for prompt in (prompt_of(9, seed=9), REPETITIVE):
        for method, opts in (("ar", {}), ("pld", {}), ("ngrammys", {"k": 5, "w": 4, "schedule": "static"}),
                             ("ngrammys", {"k": 10, "w": 6, "schedule": "static"})):
            dec.generate_ids([prompt], method, 20, GREEDY, **opts)
    runner = dec.runner
    runner.reset(1, 80)
    runner.prefill(torch.tensor([prompt_of(11, seed=11)]), torch.tensor([11]))
    root = torch.tensor([3])
    for tree in (DraftTree.from_parents(root[:, None], torch.tensor([[-1]])),  # a lone root, as a tree
                 DraftTree.from_chains(root, [[[4, 5, 6, 7, 8, 9, 10]]]),
                 DraftTree.from_chains(root, [[[i, i + 1] for i in range(2, 60, 2)]])):
        runner.forward_tree(tree)
    assert _frames() == before


@pytest.mark.parametrize("method,opts", [("ar", {}), ("pld", {}), ("ngrammys", {"k": 5, "w": 4}),
                                         ("ngrammys", {"k": 5, "w": 4, "schedule": "static"})])
def test_compiled_methods_match_transformers(compiled_decoder, method, opts):
    dec = compiled_decoder
    assert dec.runner.compiled
    for prompt in (prompt_of(1, seed=1), prompt_of(45, seed=45), REPETITIVE):
        ref = hf_generate(dec.model, prompt, 40, GREEDY)
        out = dec.generate_ids([prompt], method, 40, GREEDY, **opts)
        assert out.tokens[0] == ref, (method, len(prompt))


def test_compiled_runner_leaves_the_model_eager(compiled_decoder):
    """Only the runner's calls are compiled: the model object (and so ``model.generate``) is unchanged."""
    dec = compiled_decoder
    assert type(dec.model).__name__ == "LlamaForCausalLM"
    assert dec.runner.model is dec.model


def test_bench_counts_compiled_calls(compiled_decoder):
    """Module hooks do not see a compiled runner's calls; the bench adds the runner's own count."""
    from specdec.bench import Prompt, run_bench

    prompts = [Prompt(f"p{n}", "cat", prompt_of(n, seed=n)) for n in (5, 14)]
    res = run_bench(compiled_decoder, ["ar", "ngrammys"], prompts, 12, progress=False)
    runs = {(r["method"], r["prompt_id"]): r for r in res["runs"]}
    for p in prompts:
        ar = runs[("ar", p.id)]
        assert ar["target_calls"] == ar["new_tokens"]  # the eager prefill plus one compiled call per further token
        assert 0 < runs[("ngrammys", p.id)]["target_calls"] <= runs[("ngrammys", p.id)]["new_tokens"]
    assert all(s["identical_rate"] == 1.0 for s in res["summary"].values())
    assert {m: s["path"] for m, s in res["summary"].items()} == {"hf": "eager", "ar": "compiled", "ngrammys": "compiled"}


@pytest.mark.parametrize("arch", ["gemma3", "gpt2"])
def test_compiled_other_architectures(arch):
    """Sliding-window layers (gemma3) and learned positions (gpt2) compile too, lazily past warm_up's graphs."""
    dec = SpecDecoder(tiny_model(arch), compile=True)
    for prompt in (prompt_of(45, seed=45), REPETITIVE):  # 45 tokens: past gemma3's 8-token window
        ref = hf_generate(dec.model, prompt, 30, GREEDY)
        for method in ("ar", "ngrammys"):
            assert dec.generate_ids([prompt], method, 30, GREEDY).tokens[0] == ref, (arch, method)


def test_compiled_ragged_batch(compiled_decoder):
    prompts = [REPETITIVE, prompt_of(3, seed=3), prompt_of(30, seed=30)]
    for method in ("ar", "ngrammys"):
        out = compiled_decoder.generate_ids(prompts, method, 25, GREEDY)
        for p, toks in zip(prompts, out.tokens):
            assert toks == hf_generate(compiled_decoder.model, p, 25, GREEDY), method


def test_compiled_draft_runner_sd(monkeypatch):
    """sd with both runners compiled (target and draft) stays lossless, also as finished rows leave the batch
    (both caches shrink under the compiled graphs)."""
    from tests.test_greedy_lossless import check_rows_leave, perturbed

    target = tiny_model("llama")
    dec = SpecDecoder(target, draft=perturbed(target, 0.6), compile=True)
    assert dec.draft_runner.compiled
    accepted = 0
    for prompt in (prompt_of(45, seed=45), prompt_of(6, seed=6)):
        out = dec.generate_ids([prompt], "sd", 40, GREEDY, draft_length=4, govern=0)
        assert out.tokens[0] == hf_generate(target, prompt, 40, GREEDY)
        accepted += out.stats.accepted_tokens
    assert accepted > 0
    check_rows_leave(dec, "sd", {"draft_length": 3}, monkeypatch, sampled=False)


def test_a_drafts_catch_up_of_a_short_prompt_was_compiled_in_warm_up(monkeypatch, tmp_path):
    """A drafter's first forward reads a short prompt (at most CATCH_UP_ALL_LOGITS tokens) as a chain on an empty
    cache, compiled: warm-up compiles that graph, so decoding compiles nothing (on a fresh graph cache, every
    process compiled it inside its first generation on a short prompt; 13-39 s on the embedded draft)."""
    from tests.test_greedy_lossless import perturbed

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))  # no graph saved by an earlier run covers anything
    torch._dynamo.reset()
    target = tiny_model("llama")
    dec = SpecDecoder(target, draft=perturbed(target, 0.6), compile=True)
    before = [r.compile_events()[0] for r in (dec.runner, dec.draft_runner)]
    assert min(before) > 0  # warm-up compiled both runners' graphs, here
    for prompt in (prompt_of(45, seed=45), prompt_of(6, seed=6)):
        for method, opts in (("sd", {"draft_length": 3, "govern": 0}), ("ouroboros", {"govern": 0})):
            out = dec.generate_ids([prompt], method, 30, GREEDY, **opts)
            assert out.tokens[0] == hf_generate(target, prompt, 30, GREEDY), (method, len(prompt))
    assert [r.compile_events()[0] for r in (dec.runner, dec.draft_runner)] == before
    torch._dynamo.reset()


def test_compiled_feature_draft_sd():
    """A decoder holding a feature-conditioned (EAGLE) draft compiles, target and draft: the draft's warm-up
    passes the zero target states its forward requires (it raised there, and the whole decoder stayed eager)
    and covers the hidden-state forwards its drafter runs, the target's those sd with such a draft runs.
    Decoding then compiles nothing more, runs through both compiled runners and gives the target's greedy
    tokens (fp32)."""
    from tests.test_feature_draft import VOCAB, tiny_eagle

    target = tiny_model("llama", VOCAB)
    dec = SpecDecoder(target, draft=tiny_eagle(target), compile=True)  # compiles here (warm_up)
    assert dec.runner.compiled and dec.draft_runner.compiled
    before, frames = (dec.runner.compiled_calls, dec.draft_runner.compiled_calls), _frames()
    for prompt in (prompt_of(45, seed=45), prompt_of(6, seed=6), REPETITIVE):
        for method, opts in (("sd", {"draft_length": 3}), ("ar", {})):
            out = dec.generate_ids([prompt], method, 30, GREEDY, **opts)
            assert out.tokens[0] == hf_generate(target, prompt, 30, GREEDY), (method, len(prompt))
    assert dec.runner.compiled_calls > before[0] and dec.draft_runner.compiled_calls > before[1]
    assert _frames() == frames


def test_failed_compile_warns_naming_the_model_and_keeps_the_others_compiled(monkeypatch):
    """A runner whose compile fails is named, with the error: ``on`` raises; ``auto`` warns and runs that model
    eagerly while the others switch to their compiled runners (not the whole decoder back to eager)."""
    from specdec.draft_models import is_feature_draft
    from specdec.model import ModelRunner
    from tests.test_feature_draft import VOCAB, tiny_eagle

    def warm(runner, extra_inputs, return_hidden, catch_up):  # compiles nothing: the draft fails at once, the rest pass
        if is_feature_draft(runner.model):
            raise ValueError("a feature-conditioned (EAGLE) draft needs the target's hidden states")

    monkeypatch.setattr(ModelRunner, "_warm_up", warm)
    target = tiny_model("llama", VOCAB)
    draft = tiny_eagle(target)
    with pytest.raises(RuntimeError, match="SpecdecEagleForCausalLM.*needs the target's hidden states"):
        SpecDecoder(target, draft=draft, compile="on")
    dec = SpecDecoder(target, draft=draft, compile="auto")
    with pytest.warns(RuntimeWarning, match="SpecdecEagleForCausalLM.*needs the target's hidden states.*eagerly"):
        assert dec.wait_compiled(timeout=60)
    assert dec.runner.compiled and not dec.draft_runner.compiled


def test_compile_options_are_set_over_specdecs_on_every_runner():
    """``compile_options`` (``--compile-option``) reaches the target's and the drafts' runners over specdec's own
    options, the compiled graphs are built with them, and they keep the output (here inductor's Python wrapper, not
    the CPU's C++ one)."""
    target = tiny_model("llama")
    overrides = {"cpp_wrapper": False}
    dec = SpecDecoder(target, draft=perturbed(target, 0.6), compile=True, compile_options=overrides)
    for runner in (dec.runner, dec.draft_runner):
        assert runner.compiled and runner.compile_options["cpp_wrapper"] is False
        assert "post_grad_custom_post_pass" in runner.compile_options  # specdec's grouping pass stays
        if isinstance(runner._compiled, PrecompiledForward):  # what the saved graphs are built and keyed with
            assert runner._compiled.options["cpp_wrapper"] is False
    assert dec.runner.compile_options is not dec.draft_runner.compile_options  # each runner holds its own
    overrides["cpp_wrapper"] = True  # the caller's dict is not kept
    assert dec.compile_options == {"cpp_wrapper": False} and dec.runner.compile_options["cpp_wrapper"] is False
    prompt = prompt_of(20, seed=20)
    ref = hf_generate(dec.model, prompt, 20, GREEDY)
    for method in ("ar", "sd"):
        assert dec.generate_ids([prompt], method, 20, GREEDY).tokens[0] == ref, method
    dec.runner.use_eager()
    assert dec.runner.compile_options is None


def test_compile_options_merge_per_device_type():
    """Each runner's options come from its own model's device type: a model on another device than the CPU does not
    get the CPU's C++ wrapper (here a meta-device module stands in for a draft on a GPU)."""
    overrides = {"max_autotune": True}
    assert runner_options(torch.nn.Linear(2, 2), overrides)["cpp_wrapper"] is True
    other = runner_options(torch.nn.Linear(2, 2, device="meta"), overrides)
    assert other.get("cpp_wrapper") is None and other["max_autotune"] is True
    assert inductor_options("cpu", {"cpp.threads": 1})["cpp.threads"] == 1
    assert inductor_options("cuda", None).get("cpp_wrapper") is None


def test_compile_options_are_checked_before_loading():
    """A misspelt name, a value of the wrong type or a non-dict raises before a model loads (the model name here
    does not exist: the options error must come first); options with compile off warn that they do nothing."""
    with pytest.raises(ValueError, match="no inductor option named 'cpp_wraper'"):
        SpecDecoder("no-such-model", compile="off", compile_options={"cpp_wraper": False})
    with pytest.raises(TypeError, match="'cpp_wrapper' takes bool values"):
        SpecDecoder("no-such-model", compile="on", compile_options={"cpp_wrapper": "false"})
    with pytest.raises(TypeError, match="'cpp.threads' takes int values"):
        inductor_options("cpu", {"cpp.threads": True})
    with pytest.raises(TypeError, match="dict"):
        inductor_options("cpu", [("cpp_wrapper", False)])
    assert inductor_options("cpu", {"cpp.simdlen": None})["cpp.simdlen"] is None
    with pytest.warns(RuntimeWarning, match="ignored: compile is off"):
        SpecDecoder(tiny_model("llama"), compile="off", compile_options={"cpp_wrapper": False})


@pytest.mark.parametrize("text,parsed", [("cpp_wrapper=false", ("cpp_wrapper", False)), ("cpp.threads=2", ("cpp.threads", 2)),
                                         (" max_autotune = True ", ("max_autotune", True)), ("cpp.simdlen=None", ("cpp.simdlen", None)),
                                         ("cpp.cxx=g++", ("cpp.cxx", "g++")), ("cpp-wrapper=FALSE", ("cpp_wrapper", False)),
                                         ("cpp.cxx=a=b", ("cpp.cxx", "a=b")), ("memory_pool=none", ("memory_pool", "none"))])
def test_cli_compile_option(text, parsed):
    """``--compile-option NAME=VALUE``: literals and booleans parsed, other values kept as strings (and every value of
    an option whose default is a string), dashes read as underscores."""
    assert _compile_option(text) == parsed


def test_cli_compile_option_needs_a_name_and_a_value():
    """A bare name, a bare value or an empty value is refused by argparse with the expected form."""
    for bad in ("cpp_wrapper", "=1", "cpp_wrapper=", "cpp_wrapper= "):
        with pytest.raises(argparse.ArgumentTypeError):
            _compile_option(bad)
