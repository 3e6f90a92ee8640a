"""The bench harness on tiny models: every method, including transformers' assisted generation."""
from __future__ import annotations

import copy

import pytest

from specdec.api import SpecDecoder
from specdec.bench import Prompt, format_table, run_bench
from tests.conftest import tiny_model
from tests.test_greedy_lossless import perturbed, prompt_of


def test_run_bench_all_methods_identical_and_counted():
    target = tiny_model("llama")
    dec = SpecDecoder(target, draft=perturbed(target, 0.6))
    prompts = [Prompt(f"p{n}", "cat", prompt_of(n, seed=n)) for n in (5, 14)]
    # sd ungoverned: a governor that learned on the first prompt that plain steps win may not draft on the second
    res = run_bench(dec, ["hf-pld", "hf-assisted", "ar", "pld", "sd:govern=0"], prompts, 12, progress=False)
    s = res["summary"]
    assert list(s) == ["hf", "hf-pld", "hf-assisted", "ar", "pld", "sd:govern=0"]
    assert all(s[m]["identical_rate"] == 1.0 for m in s)
    assert all(s[m]["path"] == "eager" for m in s)  # the decoder was not compiled
    runs = {(r["method"], r["prompt_id"]): r for r in res["runs"]}
    for p in prompts:
        assert runs[("hf", p.id)]["target_calls"] == runs[("hf", p.id)]["new_tokens"]  # one forward per token
        assert runs[("sd:govern=0", p.id)]["draft_calls"] > 0 and runs[("hf-assisted", p.id)]["draft_calls"] > 0
        assert runs[("ar", p.id)]["draft_calls"] == 0
    assert s["sd:govern=0"]["accept_rate"] is not None and s["hf-assisted"]["accept_rate"] is None
    assert "hf-assisted" in format_table(res)
    for r in res["runs"]:  # specdec's methods time their prefill, inside the run's time
        assert (r["prefill_seconds"] is None) == r["method"].startswith("hf")
        assert r["graphs_compiled"] == 0 and r["started_at"] > 0  # eager: nothing compiles in a timed run
        assert r["prefill_seconds"] is None or 0 < r["prefill_seconds"] < r["seconds"]
    from bench.report import markdown

    table = markdown(res)
    assert "| cat |" in table and "| overall |" in table and "| pld |" in table and "prefill share" in table


def test_run_bench_batched_rows_match_one_at_a_time():
    """--batch-size: each group of prompts is one ragged call per method; every row's tokens are those of the
    prompt decoded alone (fp32), transformers' padded batch included, and the summary reads throughput over rows."""
    target = tiny_model("llama")
    dec = SpecDecoder(target, draft=perturbed(target, 0.6))
    prompts = [Prompt(f"p{n}", "cat" if n < 9 else "dog", prompt_of(n, seed=n)) for n in (3, 5, 8, 14, 21)]
    methods = ["hf-pld", "ar", "pld", "sd", "ngrammys"]
    one = run_bench(dec, methods, prompts, 12, progress=False)
    res = run_bench(dec, methods, prompts, 12, progress=False, batch_size=3)
    assert res["config"]["batch_size"] == 3
    s = res["summary"]
    assert list(s) == ["hf", *methods] and all(s[m]["identical_rate"] == 1.0 for m in s)
    groups = {r["prompt_id"]: r for r in res["runs"] if r["method"] == "ar"}
    assert list(groups) == ["p3+p5+p8", "p14+p21"]
    assert groups["p3+p5+p8"]["batch_size"] == 3 and groups["p3+p5+p8"]["category"] == "cat"
    assert groups["p14+p21"]["prompt_ids"] == ["p14", "p21"] and groups["p14+p21"]["category"] == "dog"
    for m in ["hf", *methods]:  # the same tokens, now counted per group
        assert sum(r["new_tokens"] for r in res["runs"] if r["method"] == m) == \
            sum(r["new_tokens"] for r in one["runs"] if r["method"] == m), m
        assert s[m]["ms_per_token"] > 0
    # a step of a batch serves all its rows: fewer target forwards than one prompt at a time
    assert s["ar"]["tokens_per_call"] > 2 * one["summary"]["ar"]["tokens_per_call"]
    assert "batches of 3 prompts" in format_table(res)
    with pytest.raises(ValueError, match="batch_size"):
        run_bench(dec, ["ar"], prompts, 4, progress=False, batch_size=0)


def test_run_bench_rounds_repeat_every_group_with_the_order_rotating():
    """--rounds N: every group runs N times, each run tagged with its round, the methods' order rotating from one
    group's calls to the next, every run checked against transformers' tokens."""
    target = tiny_model("llama")
    dec = SpecDecoder(target, draft=perturbed(target, 0.6))
    prompts = [Prompt(f"p{n}", "cat", prompt_of(n, seed=n)) for n in (3, 5, 8)]
    methods = ["ar", "pld"]
    one = run_bench(dec, methods, prompts, 10, progress=False, batch_size=2)
    res = run_bench(dec, methods, prompts, 10, progress=False, batch_size=2, rounds=3)
    assert res["config"]["rounds"] == 3 and one["config"]["rounds"] == 1
    runs = res["runs"]
    assert len(runs) == 3 * 2 * 3  # rounds x groups x (hf + methods)
    for m in ["hf", *methods]:
        mine = [r for r in runs if r["method"] == m]
        assert [r["round"] for r in mine] == [0, 0, 1, 1, 2, 2]
        assert sum(r["new_tokens"] for r in mine) == 3 * sum(r["new_tokens"] for r in one["runs"] if r["method"] == m)
    assert all(r["identical_to_reference"] for r in runs)
    firsts = [runs[i]["method"] for i in range(0, len(runs), 3)]  # who went first in each group's calls
    assert firsts == ["hf", "ar", "pld", "hf", "ar", "pld"]
    with pytest.raises(ValueError, match="rounds"):
        run_bench(dec, ["ar"], prompts, 4, progress=False, rounds=0)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_run_bench_ignore_eos_runs_every_row_to_the_end(temperature):
    """--ignore-eos: with the target's EOS set to a token its greedy replies emit early, every method (transformers'
    batch and assisted generation too) still runs every row to max_new_tokens, greedy rows stay identical, and the
    EOS ids come back after the run."""
    from specdec.api import hf_generate
    from specdec.verify import SamplingConfig

    target = copy.deepcopy(tiny_model("llama"))  # its generation config's EOS changes below: not the cached model
    dec = SpecDecoder(target, draft=perturbed(target, 0.6))
    prompts = [Prompt(f"p{n}", "cat", prompt_of(n, seed=n)) for n in (5, 14, 9)]
    eos = hf_generate(target, prompts[0].ids, 3, SamplingConfig())[1]
    target.generation_config.eos_token_id, dec.eos = eos, {eos}
    methods, sampling = ["hf-assisted", "ar", "sd", "ngrammys"], SamplingConfig(temperature=temperature, seed=0)
    ended = run_bench(dec, methods, prompts, 12, sampling, progress=False, batch_size=2)
    res = run_bench(dec, methods, prompts, 12, sampling, progress=False, batch_size=2, ignore_eos=True)

    def tokens(result, m):
        return sum(r["new_tokens"] for r in result["runs"] if r["method"] == m)
    if not temperature:
        assert tokens(ended, "hf") < 12 * len(prompts)  # EOS ends the first prompt's row early
    assert res["config"]["ignore_eos"] and not ended["config"]["ignore_eos"]
    assert all(tokens(res, m) == 12 * len(prompts) for m in ["hf", *methods])
    if not temperature:
        assert all(res["summary"][m]["identical_rate"] == 1.0 for m in res["summary"])
    assert target.generation_config.eos_token_id == eos and dec.eos == {eos}


def test_run_bench_rejects_unknown_or_draftless_methods():
    dec = SpecDecoder(tiny_model("llama"))
    prompts = [Prompt("p", "cat", prompt_of(4))]
    with pytest.raises(ValueError, match="unknown method"):
        run_bench(dec, ["medusa"], prompts, 4, progress=False)
    with pytest.raises(ValueError, match="needs --draft"):
        run_bench(dec, ["hf-assisted"], prompts, 4, progress=False)


def test_run_bench_oracle_reference_is_untimed_and_uncounted():
    """The oracle's reference run happens before the timer starts: its forwards are not the method's. Both
    ungoverned: a governor's plain steps, decided from wall-clock timings, would change the forward counts with the
    machine's load (CI saw 15 target calls against 14)."""
    target = tiny_model("llama")
    dec = SpecDecoder(target, draft=perturbed(target, 0.6))
    prompts = [Prompt(f"p{n}", "cat", prompt_of(n, seed=n)) for n in (6, 11)]
    res = run_bench(dec, ["sd:schedule=oracle:govern=0", "sd:draft_length=1:govern=0"], prompts, 16, progress=False)
    s = res["summary"]
    assert s["sd:schedule=oracle:govern=0"]["identical_rate"] == 1.0
    runs = {(r["method"], r["prompt_id"]): r for r in res["runs"]}
    for p in prompts:
        oracle, one = runs[("sd:schedule=oracle:govern=0", p.id)], runs[("sd:draft_length=1:govern=0", p.id)]
        # one target forward per step plus the prefill, none from the reference run
        assert oracle["target_calls"] <= one["target_calls"] <= oracle["new_tokens"]


def test_cuda_kernel_bench_cases_build_and_agree_on_the_host(monkeypatch):
    """bench.kernels_cuda's cases check ours against the baseline when built; built on CPU tensors here (CI has
    no GPU) so the script cannot rot between GPU sessions."""
    import torch

    import bench.kernels_cuda as kc

    monkeypatch.setattr(kc, "CUDA", torch.device("cpu"))
    for case_id, build in kc.CASES:
        if any(big in case_id for big in ("S4096", "N1024", "B64", "kv_compact-B16")):
            continue  # the largest shapes only cost time here
        case = build()
        case.ours(), case.baseline()
        assert case.op in case_id


def test_chain_choice_draft_probs_match_separate_forwards():
    """bench.studies.chain_choice's draft rule scores every draft in one masked forward over the draft model's cache:
    each draft's probabilities equal a plain forward over the sequence followed by that draft alone, and the
    cache afterwards holds the sequence and nothing of the drafts."""
    import torch
    from transformers import DynamicCache

    from bench.studies.chain_choice import draft_probs, expected_accepted

    model = tiny_model.__wrapped__("llama")  # a fresh one: the cached model may carry another test's attention
    seq = [3, 17, 42, 5, 17, 42, 9, 11]
    cache = DynamicCache(config=model.config)
    drafts = [[5, 17, 42], [9], [5, 30], [60, 61, 62, 63]]
    scored = 0
    for upto in (5, 8):  # two calls: the second appends to the cache the first left
        got = draft_probs(model, cache, seq[scored:upto], drafts)
        scored = upto
        assert cache.get_seq_length() == upto
        for d, probs in zip(drafts, got):
            with torch.no_grad():
                full = model(input_ids=torch.tensor([seq[:upto] + d])).logits[0].softmax(-1)
            want = [float(full[upto - 1 + j, t]) for j, t in enumerate(d)]
            assert probs == pytest.approx(want, rel=1e-4, abs=1e-6)
    assert expected_accepted([0.5, 0.5, 1.0]) == pytest.approx(0.5 + 0.25 + 0.25)
    assert expected_accepted([]) == 0.0


def test_chain_choice_longest_match_and_table_walk():
    """bench.studies.chain_choice's feature table: the longest earlier suffix match (most recent among equals) and the
    walk that verifies, at each call, the draft its table rates highest and jumps past what that draft got."""
    from bench.studies.chain_choice import draft_features, fit_table, longest_match, walk_table

    assert longest_match([1, 2, 3, 9, 1, 2, 3], 2) == ([9, 1], 3)
    assert longest_match([5, 3, 7, 4, 3], 3) == ([7, 4, 3], 1)  # the only earlier 3
    assert longest_match([4, 4, 4], 1) == ([4], 2)  # overlapping matches count
    assert longest_match([1, 2, 3], 2) == ([], 0)

    keys = draft_features([[7, 8], [7, 9], [-1, -1]], [2, 0, 0], [0, 5, 1], ([7, 8], 4))
    assert keys == [(2, 0, 2, 1, 2, 3), (0, 3, 2, 1, 1, 3), None]

    a, b = ("a",), ("b",)
    # three positions; at the first, draft "b" gets 2 tokens (jump to past the third), "a" gets 0
    rows = [[([a, b], [0, 2]), ([a, b], [1, 0]), None]]
    table = fit_table(rows)
    assert table[b] > table[a]
    assert walk_table(rows, table) == (1, 3)  # one call, two accepted + one
    assert walk_table(rows, {a: 1.0, b: 0.0}) == (2, 3)  # "a": none accepted, then one (past the last position)


def test_soak_watches_memory_speed_and_workers():
    """bench/soak.py on a tiny model: the quarters come from the runner's committed lengths, sampled in a thread,
    and PEARL's worker process is gone after its run."""
    import time

    from bench.soak import judge, quarters, soak, workers

    target = tiny_model("llama")
    dec = SpecDecoder(target, draft=perturbed(target, 0.6))
    dec.eos = set()
    prompts = [prompt_of(n, seed=n) for n in (4, 9)]
    before = len(workers())  # workers other tests' decoders may still hold
    for method in ("ar", "pearl"):
        run = soak(dec, method, prompts, 96, seed=0, every=0.0005)
        assert run["new_tokens"] == 2 * 96 and run["workers"] - before == (method == "pearl"), run  # kept for reuse
        assert run["tokens_per_s_first_quarter"] > 0 and run["tokens_per_s_last_quarter"] > 0
        assert run["rss_end_mb"] > 0 and run["rss_start_mb"] > 0 and set(run) >= {"speed_ratio", "rss_growth", "ok"}
        assert 0 < run["steps"] <= 96 and 0 <= run["accepted_tokens"] <= run["drafted_tokens"] and (run["governor"] is None) == (method == "ar")
        assert run["speed_vs_ar"] is None  # no reference given
    # a slowdown reads against ar's in the same run: steady where ar slowed down as much
    run = soak(dec, "ar", prompts, 96, seed=0, every=0.0005, reference=0.5)
    assert run["speed_vs_ar"] == round(run["speed_ratio"] / 0.5, 3)
    assert judge({**run, "speed_ratio": 0.44, "rss_growth": 0.0}, 0.44)["ok"]  # slowing down as ar does is steady
    assert not judge({**run, "speed_ratio": 0.44, "rss_growth": 0.0}, None)["ok"]
    dec.close()
    time.sleep(1.0)
    assert len(workers()) == before
    # by hand: 100 new tokens at 10 per second, then 5 per second in the last quarter; memory up 10%
    samples = [(t, 1000, 9 + 10 * t) for t in range(8)] + [(8 + t, 1000 if t < 4 else 1100, 84 + 5 * t)
                                                          for t in range(6)]
    q = quarters(samples, 9)
    assert q["tokens_per_s_first_quarter"] == 10 and q["tokens_per_s_last_quarter"] == 5
    assert q["speed_ratio"] == 0.5 and q["rss_growth"] == 0.1


def test_allocation_table_shows_every_source_kind_by_hand():
    from bench.report import allocation

    def run(method, alloc):
        return {"method": method, "prompt_id": "p", "category": "c", "new_tokens": 10, "seconds": 1.0,
                "target_calls": 5, "draft_calls": 0, "drafted_tokens": 10, "accepted_tokens": 5, "drafter":
                {"allocation": alloc}, "identical_to_reference": True}

    runs = [run("ngrammys", {"steps": 5, "context_slots": 6, "corpus_slots": 2, "bigram_slots": 2,
                             "context_accepted": 3, "corpus_accepted": 1, "bigram_accepted": 0}),
            run("hybrid", {"steps": 5, "context_slots": 4, "store_slots": 2, "corpus_slots": 2, "recycle_slots": 1,
                           "bigram_slots": 1, "context_accepted": 2, "store_accepted": 1, "corpus_accepted": 0,
                           "recycle_accepted": 1, "bigram_accepted": 0})]
    head, _, ngrammys, hybrid = allocation(runs, ["ngrammys", "hybrid"])
    assert head.count("slots / accepted") == 5  # context, store, corpus, recycle, bigram
    assert ngrammys == "| ngrammys | 2.0 | 60% / 75% | 0% / 0% | 20% / 25% | 0% / 0% | 20% / 0% |"
    assert hybrid == "| hybrid | 2.0 | 40% / 50% | 20% / 25% | 20% / 0% | 10% / 25% | 10% / 0% |"


def test_graphs_compiled_inside_timed_runs_are_summed_and_named():
    """A forward no warm-up graph covered compiles inside a timed run: the summary sums it per method and the table
    says so (here by hand; the runner's own counts are checked in test_precompile)."""
    from specdec.bench_summary import summarize

    def run(method, compiled, seconds):
        return {"method": method, "prompt_id": "p", "category": "c", "new_tokens": 10, "seconds": 30.0,
                "target_calls": 10, "draft_calls": 0, "drafted_tokens": None, "accepted_tokens": None,
                "identical_to_reference": True, "graphs_compiled": compiled, "compile_seconds": seconds}

    res = {"summary": summarize([run("hf", 0, 0.0), run("ar", 0, 0.0), run("ouroboros", 1, 21.5),
                                 run("ouroboros", 2, 3.0)])}
    assert "graphs_compiled" not in res["summary"]["ar"]
    assert res["summary"]["ouroboros"]["graphs_compiled"] == 3
    assert res["summary"]["ouroboros"]["compile_seconds"] == pytest.approx(24.5)
    lines = format_table(res).splitlines()
    assert [line for line in lines if "compiled inside timed runs" in line] == \
        ["ouroboros: 3 graph(s) compiled inside timed runs, 24.5 s of its time (a forward no warm-up graph covered)"]


def test_step_threads_splits_perf_samples_by_thread_and_kind():
    """bench.studies.step_threads reads `perf script -F tid,ip,sym,dso` lines: each sample lands in its thread and
    category (kernels by their template name, waits by library), unknown code in `other`, malformed lines nowhere."""
    from bench.studies.step_threads import split_samples

    lines = [
        "  101      7fcf2c01de62 [unknown] (/venv/torch/lib/libgomp.so.1)",
        "  101      7fceedb86063 specdec::(anonymous namespace)::isa_avx2::run<4, true, true> (/r/specdec/_C.cpython-311-x86_64-linux-gnu.so)",
        "  100      7fceedb86063 specdec::(anonymous namespace)::isa_avx2::run<8, true, false> (/r/specdec/_C.cpython-311-x86_64-linux-gnu.so)",
        "  100      7fceedb86063 specdec::(anonymous namespace)::attend_avx2<c10::BFloat16> (/r/specdec/_C.cpython-311-x86_64-linux-gnu.so)",
        "  100      7fceedb86063 specdec::(anonymous namespace)::run_products (/r/specdec/_C.cpython-311-x86_64-linux-gnu.so)",
        "  100      7fcf1c301d35 _PyEval_EvalFrameDefault (/usr/lib/libpython3.11.so.1.0)",
        "  100      7fcf1c301d35 cpp_fused_mul_quant_linear_silu_view_3._omp_fn.0 (/tmp/torchinductor_root/ab/cab.main.so)",
        "  100      7fcf1c301d35 c10::Dispatcher::callBoxed (/venv/torch/lib/libtorch_cpu.so)",
        "  100      7fcf1c301d35 something (/lib/ld-linux-x86-64.so.2)",
        "  100      7fcf1c301d35 inductor_entry_impl (/tmp/torchinductor_root/ab/cab.main.so)",
        "  100      7fcf1c301d35 malloc (/usr/lib/x86_64-linux-gnu/libc.so.6 (deleted))",
        "not a sample line",
    ]
    symbols = {}
    out = split_samples("\n".join(lines), symbols)
    assert dict(out[101]) == {"OpenMP waits": 1, "4-bit weight kernel": 1}
    assert dict(out[100]) == {"8-bit weight kernel": 1, "tree attention": 1, "specdec ops, host side": 1, "Python": 1,
                              "inductor fused kernels": 1, "libtorch (dispatch, AOTI shims, math)": 1, "other": 1,
                              "inductor wrapper": 1, "libc (malloc, memset)": 1}
    assert symbols[101]["[unknown]"] == 1 and symbols[100]["malloc"] == 1 and sum(symbols[100].values()) == 9
