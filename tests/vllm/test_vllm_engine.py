"""specdec's proposers inside vLLM's CPU engine (run in the vLLM venv: ``make vllm``, then
``.venv-vllm/bin/python -m pytest -q tests/vllm --noconftest``; ``make test`` does both).

A tiny random Llama (fp32, no tokenizer: prompts go in as token ids) generates greedily without
speculation and with each proposer: the tokens must be identical. Bad options must stop the engine at
start with specdec's message."""
from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: its errors reach the test
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; without it vLLM asks for 92% of the machine's memory

vllm = pytest.importorskip("vllm", reason="vLLM is not installed in this environment (make vllm builds .venv-vllm)")

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

PROPOSERS = ["specdec.integrations.vllm.PromptLookupProposer", "specdec.integrations.vllm.NGrammysProposer"]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                      initializer_range=0.3, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    return str(path)


def prompts():
    import random

    rng = random.Random(0)
    out = []
    for i in range(6):  # repeated phrases, so prompt lookup finds matches
        phrase = [rng.randrange(3, 256) for _ in range(rng.randrange(3, 9))]
        out.append((phrase * 4 + [rng.randrange(3, 256) for _ in range(5)])[: 40])
    return out


def generate(model: str, spec: dict | None) -> tuple[list[list[int]], int, int]:
    """Greedy tokens per prompt, the draft tokens vLLM accepted and those it was given."""
    llm = LLM(model=model, dtype="float32", max_model_len=256, enforce_eager=True, max_num_seqs=4,
              skip_tokenizer_init=True, speculative_config=spec, seed=0, disable_log_stats=False)
    try:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts()],
                            SamplingParams(temperature=0.0, max_tokens=48, detokenize=False), use_tqdm=False)
        metrics = llm.get_metrics()
        accepted = sum(int(m.value) for m in metrics if m.name == "vllm:spec_decode_num_accepted_tokens")
        drafted = sum(int(m.value) for m in metrics if m.name == "vllm:spec_decode_num_draft_tokens")
        return [list(o.outputs[0].token_ids) for o in outs], accepted, drafted
    finally:
        llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return generate(tiny_llama, None)[0]


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("proposer", PROPOSERS)
def test_greedy_output_is_vllms_own(tiny_llama, reference, proposer, adaptive, monkeypatch):
    options = {"adaptive": adaptive, **({"corpus": None} if "NGrammys" in proposer else {})}
    monkeypatch.setenv("SPECDEC_VLLM_OPTIONS", json.dumps(options))
    got, accepted, drafted = generate(tiny_llama, {"method": "custom_class", "model": proposer,
                                                   "num_speculative_tokens": 5})
    assert all(len(r) == 48 for r in reference)
    # Cost-aware lengths keep every draft token until the step cost's slope is fitted (plan_lengths), so the
    # proposer drafts either way; what it drafts later depends on the step times measured.
    assert drafted > 0
    if not adaptive:
        assert accepted > 0  # vLLM verified the drafts and kept some of them
    assert got == reference


def test_bad_options_stop_the_engine_at_start(tiny_llama, monkeypatch):
    monkeypatch.setenv("SPECDEC_VLLM_OPTIONS", json.dumps({"n_mx": 3}))
    with pytest.raises(Exception) as info:
        generate(tiny_llama, {"method": "custom_class", "model": PROPOSERS[0], "num_speculative_tokens": 5})
    assert "unknown option(s) ['n_mx']" in str(info.value)
