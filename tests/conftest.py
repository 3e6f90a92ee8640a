"""Shared fixtures: tiny random-initialised causal LMs of several architectures."""
from __future__ import annotations

# Triton kernels run in its CPU interpreter where there is no GPU, and on the GPU where there is one (so that
# `pytest tests/` runs tests/test_gpu.py there); this must precede any triton import. TRITON_INTERPRET set by
# the user wins.
TRITON_INTERPRET_CHOSEN = "TRITON_INTERPRET" in __import__("os").environ
__import__("os").environ.setdefault("TRITON_INTERPRET", "0" if __import__("torch").cuda.is_available() else "1")

import functools
import os
import tempfile

import pytest
import torch
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, GPT2Config, GPT2LMHeadModel, LlamaConfig,
                          LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM)

# Tests build n-gram tables for throwaway models: keep them out of the user's cache.
os.environ.setdefault("SPECDEC_TABLES_CACHE", tempfile.mkdtemp(prefix="specdec-tables-"))
# Decoders built in tests stay eager unless a test asks for compiling (a background compile per decoder
# would only load the CPU); tests/test_warmup.py and tests/test_compile.py cover the compiled paths.
os.environ.setdefault("SPECDEC_COMPILE", "off")

ARCHS = ("llama", "qwen2", "gemma3", "gpt2")


@functools.lru_cache(maxsize=None)
def tiny_model(arch: str, vocab: int = 96, seed: int = 0, std: float = 0.3):
    """A small random model whose greedy decoding is decisive (wide logit gaps) and repetitive."""
    common = dict(vocab_size=vocab, bos_token_id=0, eos_token_id=1, pad_token_id=0, initializer_range=std)
    if arch == "llama":
        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=512, **common)
        cls = LlamaForCausalLM
    elif arch == "qwen2":
        cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=1, max_position_embeddings=512, **common)
        cls = Qwen2ForCausalLM
    elif arch == "gemma3":
        # A sliding window shorter than the prompts, so windowed tree attention is exercised.
        cfg = Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, sliding_window=8, max_position_embeddings=512,
                               layer_types=["sliding_attention", "sliding_attention", "full_attention"], **common)
        cls = Gemma3ForCausalLM
    elif arch == "gpt2":
        cfg = GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=512, **common)
        cls = GPT2LMHeadModel
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls._from_config(cfg, attn_implementation="sdpa", dtype=torch.float32).eval()
    model.generation_config.eos_token_id = 1
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture(params=ARCHS)
def arch(request):
    return request.param


def schedule_variants(method: str) -> list[dict]:
    """Options that run every schedule a registered method declares (``[{}]`` for a method without
    one): the identity and sampling tests cover a new schedule without a test of their own."""
    from specdec import methods

    field = next((f for f in methods.get(method).fields() if f.name == "schedule"), None)
    return [{}] if field is None else [{"schedule": c} for c in field.metadata["choices"]]


def untrained_disco(dec, threshold: float = 0.5, max_length: int = 4) -> str:
    """A DISCO classifier file for ``dec``'s default draft with random weights (its stops are arbitrary:
    enough for exactness tests, which must hold whatever the classifier says)."""
    from specdec.policies.disco import DiscoClassifier, draft_fingerprint

    path = os.path.join(tempfile.mkdtemp(prefix="specdec-disco-"), "disco.pt")
    torch.manual_seed(0)
    DiscoClassifier(8, {"draft_fingerprint": draft_fingerprint(dec.get_draft()[0]), "threshold": threshold,
                        "max_length": max_length}).save(path)
    return path


def ungoverned(method: str, options: dict) -> dict:
    """``options`` with the draft governor off where ``method`` has one (a governor decides from wall-clock
    timings: a test that compares drafts across runs needs them not to depend on the machine's load)."""
    from specdec import methods

    if issubclass(methods.get(method).options, methods.GovernedOptions):
        return {"govern": 0, **options}
    return options


def runnable(dec, options: dict) -> dict:
    """``options`` plus what a schedule needs on a decoder of tiny test models (a classifier file for disco)."""
    if options.get("schedule") == "disco" and "disco" not in options:
        return {**options, "disco": untrained_disco(dec)}
    return options
