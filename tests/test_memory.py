"""Memory: the estimate's parts, chunking a batch that does not fit, and the errors when it may not."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

from specdec import memory
from specdec.api import hf_generate
from specdec.verify import SamplingConfig
from tests.test_greedy_lossless import decoder, prompt_of

GREEDY = SamplingConfig()


@pytest.mark.parametrize("text,value", [("512MiB", 512 * 2**20), ("2GiB", 2 * 2**30), ("2.5GB", 2_500_000_000),
                                        ("8G", 8_000_000_000), ("1000", 1000), (4096, 4096), ("3kb", 3000)])
def test_parse_bytes(text, value):
    assert memory.parse_bytes(text) == value


@pytest.mark.parametrize("bad", ["lots", "-1GB", "0", 0, -5])
def test_parse_bytes_rejects(bad):
    with pytest.raises(ValueError):
        memory.parse_bytes(bad)


def test_chunks_are_the_longest_runs_that_fit():
    need = lambda lens: memory.MemoryEstimate({"x": 10 * len(lens) * max(lens)})  # noqa: E731
    assert memory.chunks([1, 1, 1, 1, 1], need, 30) == [(0, 3), (3, 5)]
    assert memory.chunks([1, 3, 1, 1], need, 30) == [(0, 1), (1, 2), (2, 4)]
    with pytest.raises(memory.MemoryLimitError, match="one row"):
        memory.chunks([1, 4], need, 30)


@pytest.mark.parametrize("method,options", [("ar", {}), ("pld", {}), ("sd", {"draft_length": 3}), ("gsd", {}),
                                            ("ngrammys", {"k": 3, "w": 4}), ("ouroboros", {})])
def test_kv_estimate_is_what_the_runners_allocate(method, options):
    """The estimate's cache parts equal the buffers the runners hold after the call: the target's room per row
    is the prompt, the new tokens and the method's largest tree, not a fixed margin; the draft's, the nodes its own
    forwards grow (none for a chain; Ouroboros' lookahead window and phrases, more than the target's tree)."""
    dec = decoder("llama")
    prompts = [prompt_of(5, seed=1), prompt_of(17, seed=2)]
    est = dec.estimate_memory(prompts, method, 12, GREEDY, **options)
    dec.generate_ids(prompts, method, 12, GREEDY, **options)
    assert est.parts["target KV"] == dec.runner.cache_bytes()
    drafted = method in ("sd", "gsd", "ouroboros")
    assert ("draft KV" in est.parts) == drafted == (dec.draft_runner.cache_bytes() > 0)
    assert est.parts.get("draft KV", 0) == dec.draft_runner.cache_bytes()
    trees = {"ar": 0, "pld": 11, "sd": 4, "gsd": 33, "ngrammys": 13, "ouroboros": 18}
    per_position = memory.kv_cache_bytes(dec.model.config, 2, 1, dec.model.dtype)
    assert dec.runner.cache_bytes() == per_position * (17 + 12 + 1 + trees[method])


@pytest.mark.parametrize("method", ["ar", "pld", "sd", "gsd"])
def test_chunked_batch_equals_whole(arch, method):
    """A ragged batch forced into chunks by a small max_memory gives hf's greedy tokens for every row."""
    dec = decoder(arch)
    prompts = [prompt_of(n, seed=n) for n in (3, 17, 9, 30, 5)]
    one_row = dec.estimate_memory(prompts[3:4], method, 16, GREEDY).total
    res = dec.generate_ids(prompts, method, 16, GREEDY, max_memory=int(2.5 * one_row))
    assert res.stats.chunks > 1
    assert res.tokens == [hf_generate(dec.model, p, 16, GREEDY) for p in prompts]
    whole = dec.generate_ids(prompts, method, 16, GREEDY)
    assert whole.stats.chunks == 1 and whole.tokens == res.tokens


def test_chunking_off_raises_with_the_numbers():
    dec = decoder("llama")
    # Prompts long enough that a batch's step-cost calibration (a 128-token context) is not the call's peak, so
    # the need grows in proportion to the rows.
    prompts = [prompt_of(200, seed=i) for i in range(6)]
    one_row = dec.estimate_memory(prompts[:1], "pld", 16, GREEDY).total
    with pytest.raises(memory.MemoryLimitError, match=r"6 rows need about .* GiB.*largest batch .* is 2 rows"):
        dec.generate_ids(prompts, "pld", 16, GREEDY, max_memory=int(2.5 * one_row), chunk=False)
    with pytest.raises(memory.MemoryLimitError, match="one row needs"):
        dec.generate_ids(prompts, "pld", 16, GREEDY, max_memory=one_row // 2)


def test_sampling_needs_more_than_greedy():
    dec = decoder("llama")
    prompts = [prompt_of(12)]
    greedy = dec.estimate_memory(prompts, "pld", 16, GREEDY).total
    assert dec.estimate_memory(prompts, "pld", 16, SamplingConfig(temperature=0.8, top_p=0.9)).total > greedy


def test_available_memory_is_positive():
    assert memory.available_bytes(torch.device("cpu")) > 0


@pytest.mark.parametrize("lens", [(20, 20), (150, 5, 4, 6)], ids=["even", "ragged"])
def test_a_replaced_cache_frees_its_buffers_at_once(lens):
    """The cache's layers point back at it: a runner replacing its cache must break that cycle, or the old buffers
    (a step-cost calibration's) stay resident until a full garbage collection, through the generation after. Ragged
    prompts are encoded on one-row caches over views of the batch buffers: no view may outlive a release either
    (they kept 16 rows of 4,300 positions, 1.5 GB, resident between the soak's runs)."""
    import gc
    import weakref

    from specdec.model import ModelRunner
    from tests.conftest import tiny_model

    runner = ModelRunner(tiny_model("llama"))
    runner.reset(len(lens), 160)
    ids = torch.zeros(len(lens), max(lens), dtype=torch.int64)
    for i, n in enumerate(lens):
        ids[i, :n] = torch.tensor(prompt_of(n, seed=i))
    gc.disable()  # no collection may free what the runner leaves in reference cycles
    try:
        runner.prefill(ids, torch.tensor(lens))
        old = weakref.ref(runner.cache.layers[0].keys)
        storages = {(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in runner.cache.buffers()}
        runner.release()
        assert old() is None
        assert [o for o in gc.get_objects() if _storage(o) in storages] == []
    finally:
        gc.enable()


def _storage(obj) -> tuple[int, int] | None:
    """Where a tensor's storage starts and its bytes (a view shares its base's; a new tensor at a freed address has
    its own size); None for anything else: other objects, a fake tensor an earlier compile left behind, a dead weak
    proxy (whose isinstance check raises)."""
    try:
        if not isinstance(obj, torch.Tensor) or isinstance(obj, FakeTensor):
            return None
        return obj.untyped_storage().data_ptr(), obj.untyped_storage().nbytes()
    except (ReferenceError, RuntimeError, NotImplementedError):
        return None


def test_ragged_prompts_are_estimated_one_row_at_a_time():
    """ModelRunner.prefill encodes ragged prompts one row per forward: the prompt forward's transient is one row's."""
    dec = decoder("llama")
    shape = dec._call_shape(*_ar_spec(), 16, GREEDY)
    ragged = memory.estimate(shape, [300, 20, 30, 25])
    even = memory.estimate(shape, [300, 300, 300, 300])
    assert ragged.parts["transient"] * 3 < even.parts["transient"]


def _ar_spec():
    from specdec import methods

    spec = methods.get("ar")
    return spec, spec.parse({}), None


def test_live_peak_names_the_tensor_and_the_function_that_holds_it():
    """bench.memory --live: at a new peak the sampler records the main thread's stack and the largest live tensors."""
    import time
    import weakref

    from bench.memory import PeakRSS

    def hold_a_big_tensor():
        x = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, touched
        time.sleep(0.2)  # the sampler looks every millisecond
        return x.sum()

    class Thing:
        pass

    old = torch.ones(80 << 20, dtype=torch.uint8)  # bigger, but alive before: not listed
    things = [Thing() for _ in range(4)]
    dead = [weakref.proxy(t) for t in things]  # a long test process holds dead weak proxies: the listing skips them
    del things
    # a long test process also holds functional (and fake) tensors a compile left behind: no data pointer to read
    fake = torch._to_functional_tensor(torch.ones(8))
    with PeakRSS(live=True) as peak:
        hold_a_big_tensor()
    del old, dead, fake
    assert peak.where is not None and "error" not in peak.where, peak.where
    assert any("hold_a_big_tensor" in line for line in peak.where["stack"])
    biggest = peak.where["tensors"][0]
    assert biggest["bytes"] == 64 << 20 and biggest["shape"] == [64 << 20] and biggest["dtype"] == "torch.uint8"
