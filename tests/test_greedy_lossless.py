"""Greedy output of every method equals transformers' generate, token for token (fp32)."""
from __future__ import annotations

import copy

import pytest
import torch

from specdec import methods
from specdec.api import SpecDecoder, hf_generate
from specdec.tree import DraftTree
from specdec.verify import SamplingConfig
from tests.conftest import runnable, schedule_variants, tiny_model, ungoverned

GREEDY = SamplingConfig()


def perturbed(model, scale: float, seed: int = 0):
    """A copy of ``model`` with noisy output weights: a draft that agrees with it part of the time."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        w = draft.get_output_embeddings().weight
        w.add_(torch.randn(w.shape, generator=g) * scale * w.std())
    return draft


def prompt_of(n: int, seed: int = 0, vocab: int = 96) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n,), generator=g).tolist()


def decoder(arch: str, draft_kind: str = "noisy") -> SpecDecoder:
    target = tiny_model(arch)
    draft = {"self": target, "noisy": perturbed(target, 0.6), "other": tiny_model(arch, seed=1)}[draft_kind]
    return SpecDecoder(target, draft=draft)


@pytest.mark.parametrize("method,opts", [("ar", {}), ("pld", {}), ("pld", {"num_tokens": 3, "n_min": 1, "n_max": 1}),
                                         ("sd", {"draft_length": 4}), ("sd", {"draft_length": 3, "schedule": "heuristic"})])
@pytest.mark.parametrize("plen", [1, 6, 45])
def test_methods_match_transformers(arch, method, opts, plen):
    dec = decoder(arch)
    prompt = prompt_of(plen, seed=plen)
    for max_new in (1, 7, 40):  # 7 with draft length 4 cuts a draft in the middle
        ref = hf_generate(dec.model, prompt, max_new, GREEDY)
        out = dec.generate_ids([prompt], method, max_new, GREEDY, **dict(opts))
        assert out.tokens[0] == ref, (method, max_new)


@pytest.mark.parametrize("draft_kind", ["self", "noisy", "other"])
def test_sd_acceptance_regimes(arch, draft_kind):
    """Full, partial and near-zero acceptance all stay lossless; a perfect draft is fully accepted."""
    dec = decoder(arch, draft_kind)
    prompt = prompt_of(12, seed=4)
    ref = hf_generate(dec.model, prompt, 30, GREEDY)
    out = dec.generate_ids([prompt], "sd", 30, GREEDY, draft_length=5)
    assert out.tokens[0] == ref
    if draft_kind == "self":
        assert out.stats.accepted_tokens == out.stats.drafted_tokens > 0


@pytest.mark.parametrize("method", ["pld", "sd"])
def test_stops_at_eos_inside_a_draft(arch, method):
    """EOS set to a token the target emits mid-way: output ends there, as transformers' does."""
    dec = decoder(arch, "self")
    prompt = prompt_of(10, seed=7)
    free = hf_generate(dec.model, prompt, 30, GREEDY, eos_token_id=None)
    eos = free[12]
    ref = hf_generate(dec.model, prompt, 30, GREEDY, eos_token_id=eos)
    dec.eos = {eos}
    out = dec.generate_ids([prompt], method, 30, GREEDY, **({"draft_length": 6} if method == "sd" else {}))
    assert out.tokens[0] == ref
    assert out.tokens[0][-1] == eos and len(ref) <= 13


def test_repetitive_context_is_accepted_by_pld():
    """pld drafts get accepted where the target repeats itself (gemma3 tiny model loops)."""
    dec = decoder("gemma3")
    prompt = prompt_of(8, seed=1)
    ref = hf_generate(dec.model, prompt, 40, GREEDY)
    out = dec.generate_ids([prompt], "pld", 40, GREEDY, govern=0)  # ungoverned: on a tiny model plain steps may win
    assert out.tokens[0] == ref
    assert out.stats.accepted_tokens > 0 and out.stats.target_calls < len(ref)


@pytest.mark.parametrize("method", ["ar", "pld", "sd"])
def test_ragged_batch_matches_rows_alone(arch, method):
    """Rows of different lengths in one batch give each row's own greedy output."""
    dec = decoder(arch)
    prompts = [prompt_of(n, seed=n) for n in (3, 17, 9)]
    out = dec.generate_ids(prompts, method, 20, GREEDY)
    for p, toks in zip(prompts, out.tokens):
        assert toks == hf_generate(dec.model, p, 20, GREEDY)


@pytest.mark.parametrize("method,opts", [("ar", {}), ("pld", {}), ("ngrammys", {}), ("sd", {}),
                                         ("sd", {"schedule": "heuristic"}), ("sd", {"confidence": 0.4}),
                                         ("gsd", {"schedule": "static"}), ("gsd", {}), ("ouroboros", {"schedule": "static"}),
                                         ("ouroboros", {}), ("hybrid", {}), ("hybrid", {"schedule": "static", "r": 0}),
                                         ("pearl", {"backend": "inline", "window": "fixed", "gamma": 3}),
                                         ("pearl", {"window": "fixed", "gamma": 3}), ("pearl", {"backend": "inline"})])
def test_finished_rows_leave_the_batch(arch, method, opts, monkeypatch):
    """Rows that end (at an EOS, or at the token budget) leave the batch: later forwards compute fewer rows,
    down to one, and every row is still its own greedy output; twice on one decoder (the second generation
    reuses the buffers the first shrank); sampled rows end as they should. A draft model's cache and a stop
    rule's state leave with their rows."""
    check_rows_leave(decoder(arch), method, opts, monkeypatch,
                     same_drafts=method == "sd" or opts.get("schedule") == "static" or opts.get("window") == "fixed")


def check_rows_leave(dec: SpecDecoder, method: str, opts: dict, monkeypatch, sampled: bool = True,
                     same_drafts: bool = False) -> None:
    """:func:`test_finished_rows_leave_the_batch` for decoder ``dec`` and ``method`` with ``opts``. ``same_drafts``
    (methods whose drafts do not depend on timings): the rows still generating draft and accept exactly what they do
    when finished rows stand still, so no row's draft state (cache, stop rule) went to another row."""
    import specdec.decoding
    import specdec.pearl
    from specdec.model import ModelRunner

    if same_drafts:
        opts = ungoverned(method, opts)
    rows, decoding = [], [False]  # rows of each forward after the prompt's (calibrations run before it)
    forward, prefill = ModelRunner.forward_tree, ModelRunner.prefill

    def prefill_then_count(self, *a, **k):
        if self is not dec.runner:  # a draft model's prompt
            return prefill(self, *a, **k)
        decoding[0] = False
        out = prefill(self, *a, **k)
        rows.clear()
        decoding[0] = True
        return out

    monkeypatch.setattr(ModelRunner, "forward_tree", lambda self, tree, *a, **k: (
        rows.append(tree.tokens.shape[0]) if decoding[0] and self is dec.runner else None) or forward(self, tree, *a, **k))
    monkeypatch.setattr(ModelRunner, "prefill", prefill_then_count)
    prompts = [prompt_of(n, seed=n + 20) for n in (5, 12, 30, 8)]
    free = [hf_generate(dec.model, p, 24, GREEDY, eos_token_id=None) for p in prompts]
    # Rows 0-2 end at an EOS, a token of their own that row 3 never emits (the latest in their first dozen; tiny
    # models loop, gemma3's repeats one token from the first); row 3 runs to the budget and ends last.
    eos = {next(t for t in reversed(f[:12]) if t not in free[3]) for f in free[:3]}
    monkeypatch.setattr(dec, "eos", eos)
    refs = [hf_generate(dec.model, p, 24, GREEDY, eos_token_id=sorted(eos)) for p in prompts]
    assert len(refs[3]) == 24 and max(map(len, refs[:3])) < 24
    for _ in range(2):
        out = dec.generate_ids(prompts, method, 24, GREEDY, **opts)
        assert out.tokens == refs
        assert rows == sorted(rows, reverse=True) and rows[-1] < len(prompts)
        if method == "ar":  # rows ended by their first token leave before the first forward; row 3 ends alone
            assert rows[0] == sum(len(r) > 1 for r in refs) and rows[-1] == 1
        else:  # the first step verifies every row
            assert rows[0] == len(prompts)
    if same_drafts:  # from the same start: what methods learn across calls (DISCO's calibration) forgotten
        dec.reset_learned()
        out = dec.generate_ids(prompts, method, 24, GREEDY, **opts)
        dec.reset_learned()
        with monkeypatch.context() as m:
            for module in (specdec.decoding, specdec.pearl):
                m.setattr(module, "leave_batch", lambda live, done, *holders: (live, None))
            still = dec.generate_ids(prompts, method, 24, GREEDY, **opts)
        assert still.tokens == refs and set(rows) == {len(prompts)}
        assert (out.stats.drafted_tokens, out.stats.accepted_tokens) == (still.stats.drafted_tokens,
                                                                         still.stats.accepted_tokens) != (0, 0)
    if sampled:
        for toks in dec.generate_ids(prompts, method, 24, SamplingConfig(temperature=1.0, seed=3), **opts).tokens:
            ends = [i for i, t in enumerate(toks) if t in eos]
            assert 0 < len(toks) <= 24 and (ends == [len(toks) - 1] or (not ends and len(toks) == 24))


@pytest.mark.parametrize("method", ["ar", "ngrammys", "sd"])
def test_ragged_batch_encoded_row_by_row(arch, method, monkeypatch):
    """Ragged prompts encoded one row per forward into the batch cache (what long, uneven prompts take
    instead of one padded forward), twice on one decoder (the second reuses the batch buffers): each row's
    own greedy output."""
    import specdec.model as model_mod

    calls = []
    monkeypatch.setattr(model_mod, "ROW_PREFILL_MIN", 1)
    orig = model_mod.ModelRunner._encode_rows
    monkeypatch.setattr(model_mod.ModelRunner, "_encode_rows", lambda self, *a: calls.append(1) or orig(self, *a))
    dec = decoder(arch)
    for seeds in ((1, 2, 3, 4), (5, 6, 7, 8)):
        prompts = [prompt_of(n, seed=s) for n, s in zip((4, 41, 1, 9), seeds)]
        out = dec.generate_ids(prompts, method, 16, GREEDY)
        assert out.tokens == [hf_generate(dec.model, p, 16, GREEDY) for p in prompts]
    assert calls  # the row-by-row path ran


@pytest.mark.parametrize("path", ["sdpa", "kernel"])
def test_prompt_attention_paths(arch, path, monkeypatch):
    """Prompts on an empty cache attend through causal SDPA (``PROMPT_ATTENTION="sdpa"``, the default) or the
    tree kernel; both give transformers' greedy output, single and ragged (row by row and padded), and the
    SDPA path is taken only where it is plain causal attention (Gemma3's 8-token window: not its sliding layers
    over longer prompts)."""
    import specdec.model as model_mod

    monkeypatch.setattr(model_mod, "PROMPT_ATTENTION", path)
    monkeypatch.setattr(model_mod, "_prompt_sdpa", lambda device_type: True)  # the path on any CPU, AVX-512 or not
    sdpa = torch.nn.functional.scaled_dot_product_attention
    causal = []

    def spy(*args, **kwargs):
        if kwargs.get("is_causal"):
            causal.append(args[0].shape[2])
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    dec = decoder(arch)
    hf = {}
    for row_min in (1, 10_000):  # ragged rows one by one, then as one padded forward
        monkeypatch.setattr(model_mod, "ROW_PREFILL_MIN", row_min)
        prompts = [prompt_of(n, seed=n) for n in (23, 6, 1, 40)]
        for batch in ([prompts[0]], prompts):
            out = dec.generate_ids(batch, "ngrammys", 12, GREEDY)
            for p, toks in zip(batch, out.tokens):
                key = tuple(p)
                if key not in hf:
                    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
                    hf[key] = hf_generate(dec.model, p, 12, GREEDY)
                    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
                assert toks == hf[key]
            # Greedy tokens of a decisive tiny model barely depend on attention: compare the logits too.
            runner = dec.runner
            runner.reset(len(batch), 64)
            lens = torch.tensor([len(p) for p in batch])
            ids = torch.zeros(len(batch), int(lens.max()), dtype=torch.long)
            for i, p in enumerate(batch):
                ids[i, :len(p)] = torch.tensor(p)
            logits = runner.prefill(ids, lens)[0]
            monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
            with torch.no_grad():
                for i, p in enumerate(batch):
                    torch.testing.assert_close(logits[i], dec.model(torch.tensor([p])).logits[0, -1], atol=1e-4, rtol=1e-4)
            monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    if path == "kernel":
        assert not causal
    else:
        assert causal and max(causal) >= 22  # the prompts themselves, not only one-token steps
        if arch == "gemma3":
            assert max(causal) >= 39 and dec.model.config.sliding_window == 8  # full-attention layers only


@pytest.mark.parametrize("wide", [None, 2])
def test_wide_tree_attention_paths(arch, wide, monkeypatch):
    """Forwards of at least ``WIDE_TREE_SDPA`` tokens attend through SDPA with the dense mask (where torch has
    AVX-512 kernels), narrower ones through the kernel. With the route at 2 tokens (every tree, chain and
    level-by-level draft tree) and off, every method's greedy output is transformers' on a ragged batch;
    prompts never take the route (Gemma3's sliding layers over prompts longer than its 8-token window keep
    the kernel), and a tree's logits agree between the two paths."""
    import specdec.model as model_mod

    if model_mod.default_attention(torch.device("cpu")) != "kernel":
        pytest.skip("the route is the kernel path's (specdec._C is not built, or SPECDEC_ATTN=sdpa)")
    monkeypatch.setattr(model_mod, "WIDE_TREE_SDPA", wide)
    monkeypatch.setattr(model_mod, "_prompt_sdpa", lambda device_type: True)  # the route on any CPU
    sdpa = torch.nn.functional.scaled_dot_product_attention
    masked = []

    def spy(*args, **kwargs):
        if kwargs.get("attn_mask") is not None:
            masked.append((args[0].shape[2], args[1].shape[2]))  # queries, keys
        return sdpa(*args, **kwargs)

    dec = decoder(arch)
    prompts = [prompt_of(n, seed=n) for n in (23, 6, 1, 40)]
    refs = [hf_generate(dec.model, p, 16, GREEDY) for p in prompts]
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    for method, opts in (("ngrammys", {}), ("pld", {"num_tokens": 6}), ("gsd", {}), ("sd", {"draft_length": 4})):
        out = dec.generate_ids(prompts, method, 16, GREEDY, **opts)
        assert out.tokens == refs, method
    if wide is None:
        assert not masked
        return
    assert masked and min(t for t, _ in masked) >= wide
    assert all(keys > t for t, keys in masked)  # trees over a cached prefix, never a prompt on an empty cache
    # One tree over ragged committed rows, through both paths: the same logits.
    runner = dec.runner
    logits = {}
    for route in (None, 2):
        monkeypatch.setattr(model_mod, "WIDE_TREE_SDPA", route)
        runner.reset(2, 80)
        ids = torch.tensor([prompts[0], prompts[3][:23]])
        runner.prefill(ids, torch.tensor([23, 17]))
        tree = DraftTree.from_chains(torch.tensor([5, 9]), [[[3, 4, 5], [3, 7]], [[8], [2, 6, 1, 4]]])
        tree.build_mask()
        logits[route] = runner.forward_tree(tree)[0]
    torch.testing.assert_close(logits[None], logits[2], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("method,options", [(m, o) for m in methods.names() for o in schedule_variants(m)])
def test_every_registered_method_matches_transformers(arch, method, options):
    """Every method in the registry, with each of its schedules, on a ragged batch: a method or
    schedule added to the registry is checked here without a test of its own."""
    dec = decoder(arch)
    prompts = [prompt_of(5, seed=1), prompt_of(33, seed=2), prompt_of(12, seed=3)]
    out = dec.generate_ids(prompts, method, 24, GREEDY, **runnable(dec, options))
    assert out.tokens == [hf_generate(dec.model, p, 24, GREEDY) for p in prompts]
