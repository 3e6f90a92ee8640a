"""Decode forwards through torch.compile (``SpecDecoder(compile=True)``): lossless, and compiled up front."""
from __future__ import annotations

import pytest
import torch
import torch._dynamo

from specdec.api import SpecDecoder, hf_generate
from specdec.verify import SamplingConfig
from tests.conftest import tiny_model
from tests.test_greedy_lossless import prompt_of
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


@pytest.mark.parametrize("method,opts", [("ar", {}), ("pld", {}), ("ngrammys", {"k": 5, "w": 4}),
                                         ("ngrammys", {"k": 5, "w": 4, "schedule": "static"})])
def test_compiled_methods_match_transformers(compiled_decoder, method, opts):
    dec = compiled_decoder
    assert dec.runner.compiled
    for prompt in (prompt_of(1, seed=1), prompt_of(45, seed=45), REPETITIVE):
        ref = hf_generate(dec.model, prompt, 40, GREEDY)
        out = dec.generate_ids([prompt], method, 40, GREEDY, **opts)
        assert out.tokens[0] == ref, (method, len(prompt))


def test_warm_up_compiles_every_kind_of_forward(compiled_decoder):
    """After warm_up, single-row decoding (one token, chains, trees) compiles nothing more: a compile
    inside a timed decode would cost minutes on the embedded model."""
    dec = compiled_decoder
    before = _frames()
    for prompt in (prompt_of(9, seed=9), REPETITIVE):
        for method, opts in (("ar", {}), ("pld", {}), ("ngrammys", {"k": 5, "w": 4, "schedule": "static"})):
            dec.generate_ids([prompt], method, 20, GREEDY, **opts)
    assert _frames() == before


def test_compiled_runner_leaves_the_model_eager(compiled_decoder):
    """Only the runner's calls are compiled: the model object (and so ``model.generate``) is unchanged."""
    dec = compiled_decoder
    assert type(dec.model).__name__ == "LlamaForCausalLM"
    assert dec.runner.model is dec.model
