"""Compiled forwards saved to disk (:mod:`specdec.precompile`): a later decoder loads them instead of tracing and
compiling, reads its own weights through them, and decodes exactly as transformers does."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch._dynamo
import torch._dynamo.aot_compile

from specdec import precompile
from specdec.api import SpecDecoder, hf_generate
from specdec.verify import SamplingConfig
from tests.conftest import tiny_model
from tests.test_greedy_lossless import perturbed, prompt_of
from tests.test_ngrammys import REPETITIVE

GREEDY = SamplingConfig()
METHODS = (("ar", {}), ("pld", {"govern": 0}), ("ngrammys", {"k": 5, "w": 4, "schedule": "static", "govern": 0}))


def _refuse(*args, **kwargs):
    raise AssertionError("traced or compiled although saved graphs cover the call")


def _check_decodes(dec: SpecDecoder, model) -> None:
    for prompt in (prompt_of(30, seed=1), REPETITIVE):
        for method, opts in METHODS:
            out = dec.generate_ids([prompt], method, 24, GREEDY, **opts)
            assert out.tokens[0] == hf_generate(model, prompt, 24, GREEDY), (method, prompt[:4])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``(model, directory, cache)``: a tiny model whose warm-up graphs a first decoder compiled and saved in
    ``directory`` under ``cache``, a ``$SPECDEC_CACHE`` of this module's own that each test sets again."""
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDEC_CACHE", str(cache))
        mp.delenv("SPECDEC_PRECOMPILE", raising=False)
        torch._dynamo.reset()
        model = tiny_model("llama")
        first = SpecDecoder(copy.deepcopy(model), compile=True)
        forward = first.runner._compiled
        assert isinstance(forward, precompile.PrecompiledForward)
        assert forward._failed is None and forward.loaded == 0 and forward.saved >= 3
        assert forward.saved == len(list(forward.directory.glob("*.graph")))
        compiled, seconds, dropped = first.runner.compile_events()  # the bench's record of compiles in a run
        assert compiled == forward.saved and seconds > 0 and dropped == 0
        _check_decodes(first, model)
        torch._dynamo.reset()
    yield model, forward.directory, cache
    torch._dynamo.reset()


def test_saved_graphs_load_without_compiling_and_decode_exactly(saved, monkeypatch):
    model, directory, cache = saved
    monkeypatch.setenv("SPECDEC_CACHE", str(cache))
    monkeypatch.setattr(torch._dynamo.aot_compile, "aot_compile_fullgraph", _refuse)
    monkeypatch.setattr(torch, "compile", _refuse)
    dec = SpecDecoder(copy.deepcopy(model), compile=True)
    forward = dec.runner._compiled
    assert forward.directory == directory and forward.loaded == len(list(directory.glob("*.graph")))
    assert forward.saved == 0
    calls = dec.runner.compiled_calls
    _check_decodes(dec, model)
    assert dec.runner.compiled_calls > calls
    assert dec.runner.compile_events() == (0, 0.0, 0)


def test_saved_graphs_read_the_loading_models_weights(saved, monkeypatch):
    """Weights are inputs of a saved graph, not constants in it: a model of the same structure with other
    weights loads the same graphs and decodes as itself."""
    model, directory, cache = saved
    monkeypatch.setenv("SPECDEC_CACHE", str(cache))
    other = perturbed(model, 0.6)
    assert precompile.fingerprint(other) == precompile.fingerprint(model)
    monkeypatch.setattr(torch._dynamo.aot_compile, "aot_compile_fullgraph", _refuse)
    dec = SpecDecoder(copy.deepcopy(other), compile=True)
    assert dec.runner._compiled.loaded > 0
    _check_decodes(dec, other)


def test_fingerprint_separates_models_that_cannot_share_graphs():
    llama = tiny_model("llama")
    assert precompile.fingerprint(copy.deepcopy(llama)) == precompile.fingerprint(llama)
    assert precompile.fingerprint(tiny_model("qwen2")) != precompile.fingerprint(llama)
    assert precompile.fingerprint(copy.deepcopy(llama).to(torch.bfloat16)) != precompile.fingerprint(llama)
    wider = copy.deepcopy(tiny_model("llama"))
    wider.model.layers = wider.model.layers[:1]
    assert precompile.fingerprint(wider) != precompile.fingerprint(llama)


def test_a_changed_model_drops_its_graphs(saved, monkeypatch):
    """Saved graphs guard the call's inputs, not the model's tensors: a model changed between generations (here its
    LM head tied to the embedding) is fingerprinted again and gets graphs of its own, never the old ones."""
    model, directory, cache = saved
    monkeypatch.setenv("SPECDEC_CACHE", str(cache))
    dec = SpecDecoder(copy.deepcopy(model), compile=True)
    forward = dec.runner._compiled
    assert forward.directory == directory and forward.loaded > 0
    dec.model.lm_head.weight = dec.model.model.embed_tokens.weight
    tied = copy.deepcopy(model)
    tied.lm_head.weight = tied.model.embed_tokens.weight
    prompt = prompt_of(30, seed=1)
    out = dec.generate_ids([prompt], "ar", 16, GREEDY)
    assert forward.directory != directory and forward.saved > 0
    assert dec.runner.compile_events()[::2] == (forward.saved, 1)  # the drop, and the graphs compiled after it
    assert out.tokens[0] == hf_generate(tied, prompt, 16, GREEDY)


def test_fingerprint_sees_ties_and_compile_options():
    llama = tiny_model("llama")
    untied = copy.deepcopy(llama)
    untied.lm_head.weight = torch.nn.Parameter(untied.model.embed_tokens.weight.detach().clone())
    tied = copy.deepcopy(llama)
    tied.lm_head.weight = tied.model.embed_tokens.weight
    assert precompile.fingerprint(untied) != precompile.fingerprint(tied)
    assert precompile.fingerprint(llama, {}) != precompile.fingerprint(llama, {"size_asserts": True})


def test_a_graph_that_cannot_be_saved_runs_through_torch_compile(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    torch._dynamo.reset()

    def unsaveable(self, entry):
        raise RuntimeError("cannot pickle")

    monkeypatch.setattr(precompile.PrecompiledForward, "_save", unsaveable)
    model = tiny_model("llama")
    with pytest.warns(UserWarning, match="ahead-of-time compile of LlamaForCausalLM failed"):
        dec = SpecDecoder(copy.deepcopy(model), compile=True)
    assert "cannot pickle" in dec.runner._compiled._failed
    _check_decodes(dec, model)
    torch._dynamo.reset()


def test_off_switch(monkeypatch):
    monkeypatch.setenv("SPECDEC_PRECOMPILE", "0")
    from specdec.model import ModelRunner

    runner = ModelRunner(tiny_model("llama"), compile=True)
    assert not isinstance(runner._compiled, precompile.PrecompiledForward)


def test_saved_mode_runs_saved_graphs_and_never_compiles(saved, monkeypatch, tmp_path):
    """``compile="saved"`` (``specdec generate``'s default) runs what an earlier process saved; with nothing saved
    it decodes eagerly; it never traces or compiles; ``SPECDEC_PRECOMPILE=0`` turns it off."""
    model, directory, cache = saved
    monkeypatch.setenv("SPECDEC_CACHE", str(cache))
    monkeypatch.setattr(torch._dynamo.aot_compile, "aot_compile_fullgraph", _refuse)
    monkeypatch.setattr(torch, "compile", _refuse)
    dec = SpecDecoder(copy.deepcopy(model), compile="saved")
    _check_decodes(dec, model)
    assert dec.runner._compiled.loaded > 0 and dec.runner._compiled.hits > 0
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "empty"))
    dec = SpecDecoder(copy.deepcopy(model), compile="saved")
    _check_decodes(dec, model)
    assert dec.runner._compiled.loaded == 0 and dec.runner._compiled.hits == 0
    monkeypatch.setenv("SPECDEC_CACHE", str(cache))
    monkeypatch.setenv("SPECDEC_PRECOMPILE", "0")
    assert not SpecDecoder(copy.deepcopy(model), compile="saved").runner.compiled


def test_saved_graphs_drop_the_submodules_pinned_constants_and_keep_runtime_flags(saved, monkeypatch):
    """A submodule's plain attributes (layer_idx, head_dim) are pinned by the fingerprint, so their guards are not
    saved (checked before every call, they took 0.65 of SmolLM2's 2.2 ms of guards); flags that change between
    calls (training) keep theirs, as do the call's inputs."""
    from torch._dynamo.package import load_guards_state

    model, directory, cache = saved
    monkeypatch.setenv("SPECDEC_CACHE", str(cache))
    forward = SpecDecoder(copy.deepcopy(model), compile=True).runner._compiled
    forward._load()
    assert forward._entries
    names = [g.name for e in forward._entries
             for g in load_guards_state(e._artifacts.guards_state).output_graph._guards]
    assert not [n for n in names if n.endswith((".layer_idx", ".head_dim", ".in_features"))]
    assert [n for n in names if "._modules[" in n and n.endswith(".training")]
    assert [n for n in names if "input_ids" in n]


def test_pinned_attributes_follow_the_fingerprint():
    """Exactly what :func:`precompile.fingerprint` hashes is dropped from the guards: a submodule's public plain
    instance attribute or a public field of a dataclass it holds; not runtime flags, private names, the model's
    own attributes or anything that is not plain."""
    import dataclasses

    @dataclasses.dataclass
    class Record:
        n: int
        data: torch.Tensor | None = None

    llama = copy.deepcopy(tiny_model("llama"))  # the shared cached model must not keep a local class (later tests pickle it)
    attn = "self._modules['model']._modules['layers']._modules['0']._modules['self_attn']"
    proj = attn + "._modules['q_proj']"
    llama.model.layers[0].self_attn.q_proj.record = Record(4, torch.zeros(1))
    llama.model.layers[0].self_attn.q_proj.dense = False  # as a QuantLinear has it
    pinned = lambda name: precompile._pinned(llama, name)  # noqa: E731
    assert pinned(attn + ".layer_idx") and pinned(attn + ".head_dim") and pinned(proj + ".record.n")
    assert not pinned(attn + ".training") and not pinned(attn + "._private")
    assert pinned(proj + ".dense")  # polled before every call instead (PrecompiledForward)
    assert pinned(proj + "._parameters['bias']") and not pinned(proj + "._parameters['weight']")  # None is pinned
    assert not pinned(proj + ".record.data")
    assert not pinned("self.config") and not pinned("self._reduced") and not pinned(attn + ".missing")
    before = precompile.fingerprint(llama)
    llama.model.layers[0].self_attn.q_proj.dense = True
    assert precompile.fingerprint(llama) == before
    llama.model.layers[0].self_attn.q_proj.bias = torch.nn.Parameter(torch.zeros(llama.config.hidden_size))
    assert precompile.fingerprint(llama) != before
    del llama.model.layers[0].self_attn.q_proj.bias
    llama.model.layers[0].self_attn.q_proj.register_parameter("bias", None)
    assert precompile.fingerprint(llama) == before
    llama.model.layers[0].self_attn.q_proj.record.n = 5
    assert precompile.fingerprint(llama) != before


def test_a_compiled_runner_under_dense_weights_runs_the_dense_weights(tmp_path, monkeypatch):
    """The saved graphs do not guard the quantized layers' ``dense`` flags (211 guards on SmolLM2, half of the
    guard tree checked before every call): the runner polls them, and while dense_weights() is on it runs eagerly,
    on the dense weights, exactly as an eager runner does."""
    from specdec.gguf_weights import dense_weights
    from specdec.kernels import has_native
    from specdec.model import ModelRunner
    from specdec.tree import DraftTree

    if not has_native("quant_linear"):
        pytest.skip("needs the compiled extension")
    from tests.test_gguf_weights import quantized

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.delenv("SPECDEC_PRECOMPILE", raising=False)
    model, _ = quantized("llama")
    compiled, eager = ModelRunner(model, compile=True), ModelRunner(model)
    assert isinstance(compiled._compiled, precompile.PrecompiledForward)
    ids = torch.tensor([prompt_of(20, seed=4)])
    tree = DraftTree.chain(torch.tensor([7]), torch.tensor([[11, 5]]))

    def logits(runner):
        runner.reset(1, 32)
        runner.prefill(ids, torch.tensor([20]))
        return runner.forward_tree(tree)[0]

    quant = logits(compiled)
    hits = compiled._compiled.hits
    assert hits > 0
    with dense_weights(model):
        dense = logits(compiled)
        assert compiled._compiled.hits == hits
        torch.testing.assert_close(dense, logits(eager), rtol=0, atol=0)
    assert not torch.equal(dense, quant)  # the two paths differ in their roundings: the check above can fail
    torch.testing.assert_close(logits(compiled), quant, rtol=0, atol=0)
    assert compiled._compiled.hits > hits

    # A flag set while a graph is traced (dense_weights() entered by another thread): the graph is dropped, not saved.
    layer = next(m for m in model.modules() if hasattr(m, "qweight"))

    class Tracer:
        def aot_compile(self, *args):
            layer.dense = True
            return object()

    late = ModelRunner(model, compile=True)
    late._compiled._compiler = Tracer()
    monkeypatch.setattr(precompile.PrecompiledForward, "_save", _refuse)
    late._compiled._load()
    late._compiled._entries.clear()  # as if nothing were saved: the call captures
    try:
        assert torch.isfinite(logits(late)).all()  # the call ran eagerly
        assert layer.dense
    finally:
        layer.dense = False
    assert late._compiled._failed is None  # _save (refused here) was never called
    assert late._compiled.captured == 0 and not late._compiled._entries


def test_reported_flags_are_seen_without_reading_them():
    """QuantLinear reports its ``dense`` flag (ReportsFlags): the runner reads no flag of such a module before a call
    while none is set, and sees one set directly, on a deep copy, or where the write bypassed the report."""
    from specdec.gguf_weights import QuantLinear
    from specdec.kernels import has_native
    from tests.test_gguf_weights import quantized

    if not has_native("quant_linear"):
        pytest.skip("needs the compiled extension")
    model, _ = quantized("llama")
    forward = precompile.PrecompiledForward(model, {})
    forward._polled, forward._reported = precompile._polled(model)
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert layers and {id(r()) for r in forward._reported} == set(map(id, layers))
    assert all(not isinstance(m, QuantLinear) for m, _ in forward._polled)
    assert not forward._flags_on()
    layers[3].dense = True
    assert forward._flags_on()
    layers[3].dense = False
    assert not forward._flags_on()

    layers[1].dense = True
    twin = copy.deepcopy(model)  # nn.Module.__setstate__ fills __dict__ without __setattr__
    layers[1].dense = False
    twin_layer = [m for m in twin.modules() if isinstance(m, QuantLinear)][1]
    assert twin_layer in precompile._FLAGGED  # noted on the copy itself
    other = precompile.PrecompiledForward(twin, {})
    other._polled, other._reported = precompile._polled(twin)
    assert other._flags_on() and not forward._flags_on()

    object.__setattr__(layers[2], "dense", True)  # unreported until the runner lists the model's flags again
    forward._polled, forward._reported = precompile._polled(model)
    try:
        assert forward._flags_on()
    finally:
        layers[2].dense = False
    assert not forward._flags_on()
    layers[2].dense = True
    del layers[2].dense  # a deleted flag is noted too (the class has none: the module reads as unset)
    assert layers[2] not in precompile._FLAGGED and not forward._flags_on()
    layers[2].dense = False
    twin_layer.dense = False
    assert not other._flags_on() and twin_layer not in precompile._FLAGGED


def test_a_graph_traced_on_a_hooked_model_waits_for_the_hooks_of_the_loading_model(tmp_path, monkeypatch):
    """transformers marks a model the first time a forward asks for hidden states; a graph traced after that reads
    the mark. A model without it yet (a plain draft's target) leaves such a saved graph on disk, unwarned and unread
    while the mark is missing, and binds it once a forward of its own has marked it, without compiling."""
    ids = torch.tensor([prompt_of(12, seed=3)])
    kwargs = dict(input_ids=ids, output_hidden_states=True, use_cache=False)
    hooked = copy.deepcopy(tiny_model("llama"))
    with torch.inference_mode():
        want = hooked(**kwargs).hidden_states[-1]  # eager: transformers installs its capturing hooks and marks the model
        first = precompile.PrecompiledForward(hooked, {}, tmp_path)
        first(**kwargs)
    assert first.saved == 1
    saved = list(tmp_path.glob("*.graph"))

    reads = []  # the graph files each read took
    real_read = precompile.PrecompiledForward._read
    monkeypatch.setattr(precompile.PrecompiledForward, "_read",
                        lambda self, paths, *a: reads.extend(paths) or real_read(self, paths, *a))
    fresh = copy.deepcopy(tiny_model("llama"))
    forward = precompile.PrecompiledForward(fresh, {}, tmp_path)
    with warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("error")
        for _ in range(3):  # plain calls: the first captures its own graph, the waiting one is read once only
            forward(input_ids=ids, use_cache=False)
        assert forward.loaded == 0 and forward.captured == 1 and len(reads) == 1
        assert all(p.exists() for p in saved)
        fresh(**kwargs)  # marks the model
        monkeypatch.setattr(torch._dynamo.aot_compile, "aot_compile_fullgraph", _refuse)
        got = forward(**kwargs).hidden_states[-1]
    assert forward.loaded == 1 and forward.captured == 1 and len(reads) == 2
    torch.testing.assert_close(got, want)


def test_an_unreadable_saved_graph_is_named_and_set_aside(tmp_path):
    """A corrupt file in the graph directory is an error worth a warning, not a graph to wait for: it is renamed
    ``.bad`` (never read again) and the call runs without it."""
    model = copy.deepcopy(tiny_model("llama"))
    (tmp_path / "corrupt.graph").write_bytes(b"not a pickled graph")
    forward = precompile.PrecompiledForward(model, {}, tmp_path, capture=False)
    ids = torch.tensor([prompt_of(6, seed=2)])
    with pytest.warns(UserWarning, match="skipping the saved graph .*corrupt.graph"), torch.inference_mode():
        forward(input_ids=ids, use_cache=False)
    assert forward.loaded == 0 and not forward._waiting
    assert (tmp_path / "corrupt.bad").exists() and not (tmp_path / "corrupt.graph").exists()
