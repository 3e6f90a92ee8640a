"""PEARL: greedy identity of every round kind and ablation, the window rule, the worker process and its faults."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from specdec.api import SpecDecoder, hf_generate
from specdec.draft_worker import DraftWorkerError
from specdec.pearl import WindowLength
from specdec.policies.planner import best_window
from specdec.tree import DraftTree
from specdec.verify import SamplingConfig, Verifier
from tests.conftest import tiny_model
from tests.test_feature_draft import tiny_eagle
from tests.test_greedy_lossless import perturbed, prompt_of

GREEDY = SamplingConfig()


def decoder(arch: str = "llama", scale: float = 0.6) -> SpecDecoder:
    target = tiny_model(arch)
    return SpecDecoder(target, draft=perturbed(target, scale))


def _alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# ---- greedy identity (inline backend: the same rounds, one after the other) -----------------------------------

@pytest.mark.parametrize("pre,post", [(1, 1), (0, 1), (1, 0), (0, 0)])
@pytest.mark.parametrize("gamma", [1, 2, 5])
def test_every_round_kind_matches_transformers(arch, pre, post, gamma):
    """Both strategies on and each ablation, at fixed windows, on a ragged batch with lengths that cut windows
    in the middle: the output is the target's own greedy output."""
    dec = decoder(arch)
    prompts = [prompt_of(5, seed=1), prompt_of(31, seed=2), prompt_of(12, seed=3)]
    for max_new in (1, 7, 26):
        out = dec.generate_ids(prompts, "pearl", max_new, GREEDY, backend="inline", window="fixed", gamma=gamma,
                               pre_verify=pre, post_verify=post)
        assert out.tokens == [hf_generate(dec.model, p, max_new, GREEDY) for p in prompts], (max_new, pre, post)


@pytest.mark.parametrize("scale", [0.0, 0.6, 3.0])
def test_acceptance_regimes_and_round_kinds(scale):
    """A perfect draft stays in post-verify (every window accepted, no bonus), a poor one rejects in
    pre-verify; both lossless. Counts of the round kinds add up."""
    dec = decoder("llama", scale)
    prompt = prompt_of(9, seed=5)
    ref = hf_generate(dec.model, prompt, 40, GREEDY)
    out = dec.generate_ids([prompt], "pearl", 40, GREEDY, backend="inline", window="fixed", gamma=4, govern=0)
    assert out.tokens[0] == ref
    r = out.stats.drafter["pearl"]
    assert r["pre_accept"] + r["pre_reject"] + r["post_all"] + r["post_reject"] + r["bonus"] == out.stats.steps
    if scale == 0.0:
        assert r["pre_reject"] == r["post_reject"] == 0 and r["post_all"] > 0
        # one target forward per 4 tokens once in post-verify
        assert out.stats.target_calls <= 2 + len(ref) // 4 + 2
    if scale == 3.0:
        assert r["pre_reject"] > 0


def test_stops_at_eos_inside_a_window():
    """EOS inside the pending drafts or the window: output ends there, as transformers' does."""
    dec = decoder("qwen2", 0.0)
    prompt = prompt_of(10, seed=7)
    free = hf_generate(dec.model, prompt, 30, GREEDY, eos_token_id=None)
    for cut in (3, 8, 13):
        eos = free[cut]
        ref = hf_generate(dec.model, prompt, 30, GREEDY, eos_token_id=eos)
        dec.eos = {eos}
        out = dec.generate_ids([prompt, prompt_of(4, seed=2)], "pearl", 30, GREEDY, backend="inline",
                               window="fixed", gamma=5)
        assert out.tokens[0] == ref and out.tokens[0][-1] == eos
        assert out.tokens[1] == hf_generate(dec.model, prompt_of(4, seed=2), 30, GREEDY, eos_token_id=eos)


def test_adaptive_window_matches_transformers_and_moves():
    dec = decoder("gemma3", 0.0)
    prompts = [prompt_of(7, seed=1), prompt_of(20, seed=2)]
    out = dec.generate_ids(prompts, "pearl", 30, GREEDY, backend="inline")
    assert out.tokens == [hf_generate(dec.model, p, 30, GREEDY) for p in prompts]
    r = out.stats.drafter["pearl"]
    assert 1 <= r["gamma_sum"] / r["rounds"] <= 8


# ---- the window rule ------------------------------------------------------------------------------------------

def test_best_window_is_the_speed_ratio_when_verification_is_flat_and_drafts_are_right():
    """The paper's Theorem 1: with a flat verification cost and acceptance near 1, gamma = c."""
    for c in (2, 3, 5):
        assert best_window(0.999, 1.0, [float(c)] * 10) == c


def test_best_window_shrinks_with_poor_acceptance_and_costly_verification():
    flat = [5.0] * 10
    assert all(best_window(a, 1.0, flat) == 5 for a in (0.1, 0.5, 0.9))  # up to c the window is free
    steep = [5.0 + 2.0 * n for n in range(10)]  # each verified token costs 40% of a one-token step
    assert [best_window(a, 1.0, steep) for a in (0.2, 0.6, 0.8, 0.99)] == [1, 2, 3, 10]
    assert best_window(0.6, 100.0, flat) == 1  # a slow draft: one token a round


def test_window_options_are_checked():
    dec = decoder()
    with pytest.raises(ValueError, match="gamma"):
        dec.generate_ids([[3, 4]], "pearl", 4, GREEDY, gamma=9, max_gamma=4)
    with pytest.raises(ValueError, match="gamma"):
        dec.generate_ids([[3, 4]], "pearl", 4, GREEDY, gamma=0)
    with pytest.raises(ValueError, match="must be one of"):
        dec.generate_ids([[3, 4]], "pearl", 4, GREEDY, backend="threads")
    with pytest.raises(ValueError, match="gamma"):
        WindowLength(0)


def test_pearl_refuses_a_feature_draft():
    target = tiny_model("llama")
    dec = SpecDecoder(target, draft=tiny_eagle(target))
    with pytest.raises(ValueError, match="feature-conditioned"):
        dec.generate_ids([[3, 4]], "pearl", 4, GREEDY)


def test_pearl_needs_a_draft():
    dec = SpecDecoder(tiny_model("llama"))
    with pytest.raises(ValueError, match="needs a draft"):
        dec.generate_ids([[3, 4]], "pearl", 4, GREEDY)


# ---- the per-row bonus ----------------------------------------------------------------------------------------

def test_per_row_bonus_draws_where_asked_and_checks_the_leaf():
    v = Verifier(GREEDY, torch.device("cpu"))
    # row 0: chain [root, 5, 6] (node 2 unverified, no bonus); row 1: [root, 5] with a bonus at its leaf
    tree = DraftTree.chain(torch.tensor([1, 1]), torch.tensor([[5, 6], [5, -1]]))
    logits = torch.zeros(2, 2, 10)
    logits[:, 0, 5] = 1.0
    logits[:, 1, 6] = 1.0
    res = v.verify(tree, logits, bonus=torch.tensor([False, True]))
    assert res.path_len.tolist() == [3, 2] and res.has_next.tolist() == [False, True]
    assert res.next_token.tolist() == [-1, 6]
    with pytest.raises(ValueError, match="node T-1"):
        v.verify(tree, logits, bonus=torch.tensor([True, True]))
    with pytest.raises(ValueError, match="bool"):
        v.verify(tree, logits, bonus=torch.tensor([1, 1]))


# ---- the worker process ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def worker_decoder():
    dec = decoder("llama", 0.6)
    yield dec
    dec.close()


def test_process_backend_matches_inline_and_transformers(worker_decoder):
    """The worker process drafts the same windows as the inline backend: same tokens, same counts."""
    dec = worker_decoder
    prompts = [prompt_of(6, seed=1), prompt_of(25, seed=2), prompt_of(11, seed=3)]
    proc = dec.generate_ids(prompts, "pearl", 30, GREEDY, window="fixed", gamma=3, govern=0)
    inline = dec.generate_ids(prompts, "pearl", 30, GREEDY, window="fixed", gamma=3, backend="inline", govern=0)
    assert proc.tokens == inline.tokens == [hf_generate(dec.model, p, 30, GREEDY) for p in prompts]
    assert proc.stats.draft_calls == inline.stats.draft_calls > 0
    assert proc.stats.drafter["pearl"]["rounds"] == inline.stats.drafter["pearl"]["rounds"]


def test_process_backend_stops_at_eos_like_transformers(worker_decoder):
    """EOS inside a window of one row while the other rows go on: the worker's rows stay in step."""
    dec = worker_decoder
    prompts = [prompt_of(6, seed=1), prompt_of(25, seed=2), prompt_of(11, seed=3)]
    free = hf_generate(dec.model, prompts[0], 30, GREEDY, eos_token_id=None)
    saved, dec.eos = dec.eos, {free[9]}
    try:
        out = dec.generate_ids(prompts, "pearl", 30, GREEDY, window="fixed", gamma=4)
        assert out.tokens == [hf_generate(dec.model, p, 30, GREEDY, eos_token_id=free[9]) for p in prompts]
        assert len(out.tokens[0]) <= 10
    finally:
        dec.eos = saved


def test_process_backend_samples_like_inline(worker_decoder):
    """Same seed, same draws: the worker's sampled proposals travel through shared memory intact."""
    dec = worker_decoder
    cfg = SamplingConfig(temperature=0.9, seed=3)
    prompts = [prompt_of(6, seed=1), prompt_of(13, seed=2)]
    # ungoverned: the same draws need the same rounds, and a governor's plain rounds follow timings
    proc = dec.generate_ids(prompts, "pearl", 24, cfg, window="fixed", gamma=3, proposal_topk=8, govern=0)
    inline = dec.generate_ids(prompts, "pearl", 24, cfg, window="fixed", gamma=3, proposal_topk=8, backend="inline",
                              govern=0)
    assert proc.tokens == inline.tokens


def test_worker_death_mid_generation_is_a_clear_error_and_leaves_no_zombie():
    dec = decoder("llama", 0.6)
    dec.generate_ids([prompt_of(6)], "pearl", 4, GREEDY)
    worker, _ = dec.draft_backend("draft0")
    pid = worker.pid
    killer = threading.Timer(0.5, os.kill, (pid, signal.SIGKILL))
    killer.start()
    # The kill lands inside a round ("died") or, on a slow or loaded machine, between two requests, where the next
    # send finds the worker gone ("is not running"): both are the clear error this test asks for.
    with pytest.raises(DraftWorkerError, match="died|is not running"):
        for _ in range(200):  # long enough that the kill lands mid-generation
            dec.generate_ids([prompt_of(40, seed=2)], "pearl", 400, GREEDY, govern=0)  # every round asks the worker
    killer.join()
    assert not _alive(pid)
    # The next call starts a new worker and works.
    prompt = prompt_of(6)
    assert dec.generate_ids([prompt], "pearl", 12, GREEDY).tokens[0] == hf_generate(dec.model, prompt, 12, GREEDY)
    assert dec.draft_backend("draft0")[0].pid != pid
    dec.close()


def test_worker_error_is_reported_with_its_traceback(worker_decoder):
    worker, _ = worker_decoder.draft_backend("draft0")
    worker.begin(1, 16, 2, GREEDY)
    worker.submit([0], [2], [0])  # no token to draft from: the worker raises, the parent reports it
    with pytest.raises(DraftWorkerError, match="Traceback"):
        worker.result()
    assert worker.alive


def test_close_stops_the_worker():
    dec = decoder("llama", 0.6)
    worker, _ = dec.draft_backend("draft0")
    pid = worker.pid
    assert _alive(pid)
    dec.close()
    assert not _alive(pid)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _parent_with_worker(tmp_path, then: str, **popen):
    """A Python process that starts a pearl worker, prints its pid, then runs ``then``; returns (process, pid)."""
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(f"""
        import faulthandler, signal, sys, time
        faulthandler.register(signal.SIGUSR1)  # a stuck run prints where it is
        # Ctrl-C raises KeyboardInterrupt, as at a terminal (a test run started in the background inherits an
        # ignored SIGINT, and Python then keeps it ignored)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.path.insert(0, {ROOT!r})
        from tests.test_pearl import decoder
        from tests.test_greedy_lossless import prompt_of
        dec = decoder("llama", 0.6)
        dec.generate_ids([prompt_of(6)], "pearl", 4)
        print(dec.draft_backend("draft0")[0].pid, flush=True)
    """) + textwrap.dedent(then))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, **popen)
    try:
        pid = int(proc.stdout.readline())
    except ValueError:
        proc.kill()
        raise
    assert _alive(pid)
    return proc, pid


def _gone(pid: int, seconds: float = 10.0) -> bool:
    deadline = time.time() + seconds
    while _alive(pid) and time.time() < deadline:
        time.sleep(0.1)
    return not _alive(pid)


def test_ctrl_c_leaves_no_child_behind(tmp_path):
    """SIGINT to the parent mid-generation: it exits (KeyboardInterrupt) and its worker is gone."""
    proc, pid = _parent_with_worker(tmp_path, """
        while True:
            dec.generate_ids([prompt_of(40)], "pearl", 300)
    """, stderr=subprocess.PIPE, start_new_session=True)
    try:
        time.sleep(1.0)
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole process group
        try:
            _, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)
            time.sleep(1.0)
            proc.kill()
            _, err = proc.communicate()
            pytest.fail(f"the parent did not exit after SIGINT; worker alive: {_alive(pid)}\n{err[-4000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "KeyboardInterrupt" in err
    assert _gone(pid)


def test_parent_killed_takes_the_worker_with_it(tmp_path):
    """SIGKILL to the parent (no cleanup can run): the worker sees its parent gone and exits."""
    proc, pid = _parent_with_worker(tmp_path, "time.sleep(600)")
    try:
        proc.kill()
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert _gone(pid)


def test_worker_outlives_the_thread_that_started_it():
    """A decoder used from a thread pool: the worker started by one thread serves calls from another."""
    dec = decoder("llama", 0.6)
    prompt = prompt_of(8)
    started = threading.Thread(target=lambda: dec.generate_ids([prompt], "pearl", 4, GREEDY))
    started.start()
    started.join()
    pid = dec.draft_backend("draft0")[0].pid
    time.sleep(0.5)
    assert dec.generate_ids([prompt], "pearl", 16, GREEDY).tokens[0] == hf_generate(dec.model, prompt, 16, GREEDY)
    assert dec.draft_backend("draft0")[0].pid == pid
    dec.close()
