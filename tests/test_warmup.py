"""compile="auto": decode eagerly at once, switch to the compiled graphs once they are ready (fp32 identity on both)."""
from __future__ import annotations

import pytest

from specdec.api import SpecDecoder, hf_generate
from specdec.bench import Prompt, run_bench
from specdec.verify import SamplingConfig
from specdec.warmup import compile_mode
from tests.conftest import tiny_model
from tests.test_greedy_lossless import perturbed, prompt_of

GREEDY = SamplingConfig()


def test_compile_modes(monkeypatch):
    assert compile_mode(True) == "on" and compile_mode(False) == "off" and compile_mode("auto") == "auto"
    monkeypatch.setenv("SPECDEC_COMPILE", "auto")
    assert compile_mode(None) == "auto"
    monkeypatch.delenv("SPECDEC_COMPILE")
    assert compile_mode(None) == "auto"  # the default
    with pytest.raises(ValueError, match="compile must be one of"):
        compile_mode("sometimes")
    dec = SpecDecoder(tiny_model("llama"), compile="off")
    assert dec.wait_compiled() is False and not dec.compiled


def test_auto_decodes_eagerly_then_compiled(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    target = tiny_model("llama")
    dec = SpecDecoder(target, draft=perturbed(target, 0.6), compile="auto")
    prompts = [prompt_of(9, seed=3), prompt_of(30, seed=4)]
    refs = [hf_generate(target, p, 16, GREEDY) for p in prompts]
    first = dec.generate_ids(prompts, "sd", 16, GREEDY, draft_length=3)  # at once, whatever the compile's state
    assert first.tokens == refs
    assert dec.wait_compiled(timeout=600)
    assert dec.runner.compiled and dec.draft_runner.compiled and dec.get_draft()[1] is dec.draft_runner
    calls = dec.runner.compiled_calls
    for method in ("ar", "sd", "ngrammys"):
        assert dec.generate_ids(prompts, method, 16, GREEDY).tokens == refs, method
    assert dec.runner.compiled_calls > calls and dec.draft_runner.compiled_calls > 0
    res = run_bench(dec, ["ar", "pld"], [Prompt("p", "c", prompts[0])], 8, progress=False)
    assert res["summary"]["ar"]["path"] == "compiled" and res["summary"]["hf"]["path"] == "eager"
