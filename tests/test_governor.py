"""The draft governor: it stops drafting where plain steps emit more per second, resumes where drafting
pays again, and whatever it decides, every method's output stays the target's own."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from specdec import methods
from specdec.api import hf_generate
from specdec.policies import DraftGovernor
from specdec.verify import SamplingConfig
from tests.conftest import runnable
from tests.test_greedy_lossless import decoder, prompt_of

GREEDY = SamplingConfig()


def drive(gov: DraftGovernor, steps: int, rate, rows: int = 4) -> list[bool]:
    """Run ``gov`` for ``steps`` steps over ``rows`` rows where a step of kind ``k`` at step ``i`` emits one
    token per row at ``rate(i, k)`` tokens per second per row. Returns the kinds it chose."""
    kinds = []
    for i in range(steps):
        k = gov.drafts(rows)
        gov.observe(k, rows, rows, 1.0 / rate(i, k))
        kinds.append(k)
    return kinds


def confirmed(steps: int, probe: int = 3, pause: int = 8, refresh: int = 128, blocks: bool = False) -> list[bool]:
    """The kinds a governor takes for ``steps`` steps after a probe drafting won, where drafting keeps winning: ``pause``
    drafting steps, a probe that times plain steps again (plain first: it re-times them; ``blocks``: drafting first),
    twice as many drafting steps, another probe, ... up to ``refresh`` drafting steps between probes."""
    kinds, run = [], pause
    while len(kinds) < steps:
        kinds += [True] * run + ([True] * probe + [False] * (probe + 1) if blocks else [False, True] * probe)
        run = min(2 * run, refresh)
    return kinds[:steps]


def test_stops_drafting_where_plain_steps_win_and_probes_again():
    gov = DraftGovernor(probe=3, pause=8, max_pause=64)
    kinds = drive(gov, 400, lambda i, k: 1.0 if k else 2.0)
    assert kinds[:6] == [True, False] * 3  # the first probe alternates the kinds
    drafting = sum(kinds[6:])
    # After the probe only probes draft: 3 steps after pauses of 9, 17, 33, 65, 65, ... plain steps.
    assert 0 < drafting <= 3 * 8, drafting
    assert not any(kinds[-40:-20]) or not any(kinds[-20:])  # long plain stretches at the end


@pytest.mark.parametrize("explore", [0.02, None])
def test_resumes_drafting_once_it_pays_again(explore):
    # A drafting step here takes 2x a plain one: a lost probe (3 such steps, 1.5 s more) costs 3 plain steps' time, so
    # the pause after it is 3 / explore plain steps (150 at 2%, 300 at the default 1%): the price of a small budget is
    # a later look at a dear draft that starts to pay.
    gov = DraftGovernor(probe=3, pause=8, max_pause=64, **({} if explore is None else {"explore": explore}))
    hold = 1.5 / (gov.explore * 0.5)  # plain steps of 0.5 s
    kinds = drive(gov, 600, lambda i, k: (1.0 if i < 100 else 3.0) if k else 2.0)
    assert sum(kinds[30:100]) < 20  # plain while drafting loses
    # Drafting from then on but for the plain steps of the probes that confirm it (after 8, 16, 32, ... drafting steps).
    switched = next(i for i in range(100, 600) if sum(kinds[i: i + 20]) >= 20 - gov.probe)
    assert switched < 2 * 3 + max(64, hold) + 2 * 3 + 5  # found after the first probe's pause and a probe
    assert sum(kinds[-100:]) > 90  # and drafting kept (plain only in refresh probes)


def test_keeps_drafting_where_it_pays():
    gov = DraftGovernor(probe=3, refresh=128)
    kinds = drive(gov, 500, lambda i, k: 2.0 if k else 1.0)
    assert kinds == [True, False] * 3 + confirmed(494)  # plain steps only in probes, rarer as drafting keeps winning


def test_a_winning_first_probe_is_confirmed_soon():
    # A fresh decoder's first plain steps are slow (first calls of a step's kernels), so its first probe says drafting
    # wins where it loses (here at half the plain rate). Trusted for ``refresh`` steps, it drafted 128 of them at a loss
    # (`sd:schedule=disco` over 4 rows drafted 95 of a first call's 104 steps, 0.66x `ar`, AMX Xeon); the probe that
    # confirms it after ``pause`` drafting steps times plain steps again and finds the loss, and the slow plain steps
    # from before it do not overrule that a step later.
    for drafting_rate in (1.0, 1.2, 1.5):
        gov = DraftGovernor(probe=3, pause=8, refresh=128)
        kinds = drive(gov, 150, lambda i, k: drafting_rate if k else (0.2 if i < 6 else 2.0))
        assert kinds[:6] == [True, False] * 3 and all(kinds[6:14])  # won on the slow plain steps
        shown = "".join(".D"[k] for k in kinds)
        assert sum(kinds) <= 3 + 8 + 3 + 3, shown  # lost at the confirming probe, then paused
        assert not any(kinds[6 + 8 + 6: 6 + 8 + 6 + 9]), shown  # the pause after that loss holds


def test_one_slow_step_decides_nothing():
    steady = drive(DraftGovernor(probe=3, window=5), 200, lambda i, k: 2.0 if k else 1.0)
    # A drafting step 200x slower than the rest (a page fault, a busy core) changes no decision.
    assert drive(DraftGovernor(probe=3, window=5), 200, lambda i, k: (0.01 if i == 50 else 2.0) if k else 1.0) == steady


def test_a_dear_losing_draft_costs_at_most_its_exploration_share():
    # Sixteen rows: a drafting step takes 3.3x a plain step for the same tokens. The old doubling schedule alone
    # (explore=1: pauses of at most 64 steps) probes every ~67 steps, 3 dear steps each time.
    def lost_share(gov):
        kinds = drive(gov, 3000, lambda i, k: 0.3 if k else 1.0, rows=16)
        drafting = sum(kinds)
        return drafting * (1 / 0.3 - 1) / (len(kinds) - drafting + drafting / 0.3)

    assert lost_share(DraftGovernor(explore=1.0, max_hold=64)) > 0.08
    assert lost_share(DraftGovernor(explore=0.02)) <= 0.025  # the first probe's loss included
    assert lost_share(DraftGovernor()) <= 0.0125  # the default budget, 1%


def test_a_probes_catch_up_counts_whole_in_its_cost():
    # Sixteen rows, a draft that loses: a drafting step costs 2 plain steps for the same tokens, and the probe's
    # first one also reads the prompts into the draft (20 plain steps more). The probe lost 23 plain steps, so
    # at 1% of the decode time (the default) the next waits 23 / 0.01 = 2300 plain steps. Clipped to 3x the probe's
    # median, as the decision clips it, the prompt read would count 4 plain steps, and the next would come after 700.
    gov, kinds = DraftGovernor(), []
    wait = 23 / gov.explore
    for i in range(int(wait) + 300):
        k = gov.drafts(16)
        gov.observe(k, 16, 16, (22.0 if i == 0 else 2.0) if k else 1.0)
        kinds.append(k)
    assert kinds[:6] == [True, False] * 3
    assert wait - 50 < kinds.index(True, 6) < wait + 50


@pytest.mark.parametrize("first_call", [5, 6])
def test_a_probe_cut_by_the_end_of_a_call_goes_on_in_the_next(first_call):
    # A short first call (a warm-up) ends inside the probe (5 steps) or right after it (6): the next call finishes
    # it and pays for its lost cost, instead of deciding on the window and probing again after 8 plain steps.
    gov = DraftGovernor()
    first = drive(gov, first_call, lambda i, k: 0.3 if k else 1.0, rows=16)
    gov.begin()
    second = drive(gov, 200, lambda i, k: 0.3 if k else 1.0, rows=16)
    assert (first + second)[:6] == [True, False] * 3
    assert not any((first + second)[6:])


@pytest.mark.parametrize("pays", [False, True])
def test_a_probe_cut_after_a_drafting_step_is_decided_without_drafting_again(pays):
    # A call ends after the probe's second drafting step: the next call pairs it with one plain step and decides on
    # the two pairs. Another drafting step first would read the new call's prompts into a model draft, a cost the
    # probe was not meant to pay.
    gov, rate = DraftGovernor(), (lambda i, k: (2.0 if pays else 0.3) if k else 1.0)
    first = drive(gov, 3, rate, rows=16)
    gov.begin()
    second = drive(gov, 100, rate, rows=16)
    assert first == [True, False, True] and second[0] is False
    assert second[1:] == confirmed(99) if pays else not any(second[1:])


def losing_calls(calls: list[list[int]]) -> list[bool]:
    """One governor over calls whose steps run over the given rows, a drafting step 3x a plain one for the same
    tokens: the kinds it chose."""
    gov, kinds = DraftGovernor(), []
    for rows_of_steps in calls:
        gov.begin()
        for rows in rows_of_steps:
            k = gov.drafts(rows)
            gov.observe(k, rows, rows, 0.3 if k else 0.1)
            kinds.append(k)
    return kinds


def test_rows_finishing_do_not_restart_probes():
    # A dear losing draft over a ragged batch: rows finish during a short first call (16 down to 9), then a long call
    # starts at 16 rows and sheds one row every 12 steps. Each batch size it reaches holds a step or two at most;
    # deciding as the nearest batch size with a probe's worth of steps, it keeps the first probe's pause instead of
    # probing again at 16 and at every smaller size.
    kinds = losing_calls([[16, 16, 16, 12, 10, 9, 9, 8], [16 - i // 12 for i in range(120)]])
    assert kinds[:6] == [True, False] * 3 and not any(kinds[6:])


def test_a_probe_over_shrinking_batches_is_judged_near_its_sizes_and_holds_there():
    # A short call's probe ran while rows finished (16 down to 5): no batch size holds a probe's worth of steps, so
    # its verdict (on its steps within a factor of two of its last, 13 to 7 rows) decides at the sizes it ran near;
    # the next call at 16 rows waits out its pause instead of probing again (and its first drafting step would read
    # the new prompts into a model draft).
    kinds = losing_calls([[16, 16, 13, 12, 9, 7, 5], [16] * 100])
    assert kinds[:6] == [True, False] * 3 and not any(kinds[6:])


def test_a_probe_cut_at_one_row_does_not_decide_for_sixteen():
    # The bench's warm-up call (one row, 8 tokens) ends inside a probe that drafting wins; the next call runs 16 rows,
    # where a drafting step takes 6x a plain one for 1.6x its tokens. The plain step pairing the cut probe runs at 16
    # rows: judged against one-row drafting steps it made drafting win there (128 drafting steps running: `sd` at 0.42x
    # `ar` over 4,000 sampled tokens). The one-row steps say nothing of 16 rows: the call probes at 16 rows, and stops.
    gov = DraftGovernor()
    for k in (True, False, True):  # the first call's steps, cut after a drafting one
        assert gov.drafts(1) == k
        gov.observe(k, 1, 3 if k else 1, 0.04 if k else 0.02)
    gov.begin()
    kinds = []
    for _ in range(100):
        k = gov.drafts(16)
        gov.observe(k, 16, 16 * (1.6 if k else 1.0), 0.36 if k else 0.06)
        kinds.append(k)
    assert kinds[:7] == [False] + [True, False] * 3 and not any(kinds[7:])
    assert gov.rate(1, True) is not None  # the one-row steps still count for one row


@pytest.mark.parametrize("lengths", [(2, 1), (7, 1), (1, 7), (2, 4)])
def test_calls_alternating_one_and_sixteen_rows_still_decide(lengths):
    # Short calls alternate between 1 row (drafting pays) and 16 (a drafting step 6x a plain one), each cut inside a
    # probe, whose pairing plain step then runs at the other size: such a probe decides nothing. The rates each size
    # gathers must: a probe at a size that timed fewer plain steps starts with one (one-step calls at 16 rows cut
    # every probe after its first step, a drafting one, and drafted at every call).
    gov = DraftGovernor()
    kinds = {1: [], 16: []}
    for call in range(60):
        rows = 1 if call % 2 == 0 else 16
        gov.begin()
        for _ in range(lengths[call % 2]):
            k = gov.drafts(rows)
            if rows == 1:
                gov.observe(k, 1, 3 if k else 1, 0.04 if k else 0.02)
            else:
                gov.observe(k, 16, 16 * (1.6 if k else 1.0), 0.36 if k else 0.06)
            kinds[rows].append(k)
    assert sum(kinds[16][-30:]) <= 4 and sum(kinds[1][-30:]) >= 24


def test_a_loss_at_many_rows_does_not_silence_one_row():
    # Sixteen rows lose (a dear probe, a long pause), then one row is left, where drafting pays: 16 rows are no
    # guide to one, so it probes at once instead of waiting out the 16-row pause.
    gov = DraftGovernor()
    assert not any(drive(gov, 100, lambda i, k: 0.3 if k else 1.0, rows=16)[6:])
    one = drive(gov, 50, lambda i, k: 2.0 if k else 1.0, rows=1)
    assert one == [True, False] * 3 + confirmed(44)


def test_a_cheap_losing_draft_keeps_the_doubling_schedule():
    # One row: a drafting step costs 2% more than a plain one. Its probes lose little (3 x 2% of a step, under the
    # default 1% budget over the first pause of 8 steps), so the pauses stay the doubling ones and a row that starts
    # copying its context is found as soon as before. (At 5% dearer the first pause is 16 steps, not 8.)
    def kinds(gov):
        return drive(gov, 400, lambda i, k: 0.98 if k else 1.0, rows=1)

    assert kinds(DraftGovernor()) == kinds(DraftGovernor(explore=1.0, max_hold=64))


def test_batch_sizes_are_governed_apart():
    gov = DraftGovernor(probe=3)
    drive(gov, 100, lambda i, k: 2.0 if k else 1.0, rows=1)  # one row: drafting pays
    big = drive(gov, 100, lambda i, k: 1.0 if k else 2.0, rows=16)  # sixteen rows: it does not
    assert sum(big[-50:]) < 10
    gov.begin()
    assert all(drive(gov, 20, lambda i, k: 2.0 if k else 1.0, rows=1))  # one row's rates were kept
    assert gov.rate(16, True) == pytest.approx(1.0) and gov.rate(16, False) == pytest.approx(2.0)


def test_rejects_bad_settings():
    with pytest.raises(ValueError):
        DraftGovernor(probe=0)
    with pytest.raises(ValueError):
        DraftGovernor(pause=16, max_pause=8)
    with pytest.raises(ValueError):
        DraftGovernor(explore=0)
    with pytest.raises(ValueError):
        DraftGovernor(max_pause=64, max_hold=32)


class Scripted(DraftGovernor):
    """Drafts on the steps ``pattern`` says (cycled): exactness must not depend on what a governor decides."""

    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = pattern

    def begin(self) -> None:
        super().begin()
        self.step = 0

    def drafts(self, rows: int) -> bool:
        kind = self.pattern[self.step % len(self.pattern)] == "d"
        self.step += 1
        self.counts["drafting_steps" if kind else "plain_steps"] += 1
        return kind


def static_schedule(method: str) -> dict:
    """``schedule="static"`` where ``method`` has it: a cost schedule cuts drafts by acceptance the cached
    decoder learned in earlier tests (near zero on random models) and by measured step times, so whether
    a drafting step drafts anything would depend on test order and machine load."""
    fields = {f.name: f for f in dataclasses.fields(methods.get(method).options)}
    return {"schedule": "static"} if "schedule" in fields and fields["schedule"].default == "cost" else {}


GOVERNED = [m for m in methods.names() if issubclass(methods.get(m).options, methods.GovernedOptions)]


def test_every_shared_loop_method_is_governed():
    assert {"pld", "sd", "ngrammys", "gsd", "ouroboros"} <= set(GOVERNED)


@pytest.mark.parametrize("method", GOVERNED)
@pytest.mark.parametrize("pattern", ["dp", "pppd", "ddddpppp"])
def test_greedy_output_is_the_targets_whatever_the_governor_decides(arch, method, pattern):
    """Plain steps between drafting ones (a model draft catching up on what it skipped, acceptance tables that
    saw no draft) leave the output the target's own, in a ragged batch too."""
    dec = decoder(arch)
    prompts = [prompt_of(9, seed=1) * 2, prompt_of(4, seed=2)]
    opts = runnable(dec, static_schedule(method))
    out = dec.generate_ids(prompts, method, 30, GREEDY, governor=Scripted(pattern), **opts)
    for p, got in zip(prompts, out.tokens):
        assert got == hf_generate(dec.model, p, 30, GREEDY)
    counts = out.stats.drafter["governor"]
    assert counts["plain_steps"] > 0 and counts["drafting_steps"] > 0
    assert out.stats.drafted_tokens > 0


def test_a_zero_probe_budget_is_refused_when_the_options_are_read():
    with pytest.raises(ValueError, match="explore"):
        methods.get("gsd").parse({"explore": "0"})


@pytest.mark.parametrize("method", ["pld", "pearl"])
def test_the_explore_option_sets_the_probe_budget_of_the_methods_governor(monkeypatch, method):
    """``METHOD:explore=X`` reaches the governor the decoder builds (beside a method's own governor options: PEARL's
    blocks), and a governor is learned per value, so an A/B of two budgets in one bench run compares two."""
    import specdec.api as api

    built = []

    class Spy(DraftGovernor):
        def __init__(self, **options):
            built.append(options)
            super().__init__(**options)
    monkeypatch.setattr(api, "DraftGovernor", Spy)
    dec = decoder("llama")
    extra = {"backend": "inline"} if method == "pearl" else {}
    for explore in (0.0071, 0.0071, 0.0093):
        dec.generate_ids([prompt_of(6, seed=3)], method, 4, GREEDY, explore=explore, **extra)
    assert [b["explore"] for b in built] == [0.0071, 0.0093]
    assert all(b.get("blocks", False) == (method == "pearl") for b in built)


@pytest.mark.parametrize("pattern", ["dp", "pppd"])
def test_pearl_inline_falls_back_to_plain_rounds_exactly(pattern):
    """PEARL's plain rounds (the draft idle, the target on every thread) between concurrent ones, inline."""
    dec = decoder("llama")
    prompts = [prompt_of(9, seed=1) * 2, prompt_of(4, seed=2)]
    out = dec.generate_ids(prompts, "pearl", 30, GREEDY, governor=Scripted(pattern), backend="inline")
    for p, got in zip(prompts, out.tokens):
        assert got == hf_generate(dec.model, p, 30, GREEDY)
    assert out.stats.drafter["governor"]["plain_steps"] > 0 and out.stats.drafted_tokens > 0


def test_pearl_prefills_and_plain_rounds_on_every_thread(monkeypatch):
    """The draft has nothing to do during the prefill, so the target's prefill runs on every thread the process
    has, as a plain round does (16 rows prefilled on one thread cost pearl 7 of its 38 seconds on a Zen 3);
    drafting rounds run on one, and the process gets its threads back afterwards."""
    dec = decoder("llama")
    seen = {}

    def spy(name):
        real = getattr(dec.runner, name)

        def call(*args, **kwargs):
            seen.setdefault(name, set()).add(torch.get_num_threads())
            return real(*args, **kwargs)
        monkeypatch.setattr(dec.runner, name, call)
    spy("prefill")
    spy("forward_tree")
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        out = dec.generate_ids([prompt_of(9, seed=1), prompt_of(4, seed=2)], "pearl", 12, GREEDY,
                               governor=Scripted("dp"), backend="inline", window="fixed", gamma=2)
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(threads)
    assert out.stats.drafter["governor"]["plain_steps"] > 0 and out.stats.drafted_tokens > 0
    assert seen["prefill"] == {3}
    assert seen["forward_tree"] == {1, 3}  # drafting rounds on one thread, plain ones on all three


def test_block_probes_draft_then_go_plain():
    # blocks: 3 drafting steps, then 4 plain ones (the loop may count the first as drafting); then as always
    gov = DraftGovernor(blocks=True)
    kinds = drive(gov, 100, lambda i, k: 0.3 if k else 1.0, rows=16)
    assert kinds[:7] == [True] * 3 + [False] * 4 and not any(kinds[7:])
    gov = DraftGovernor(blocks=True)
    assert drive(gov, 100, lambda i, k: 2.0 if k else 1.0, rows=16) == [True] * 3 + [False] * 4 + confirmed(93, blocks=True)


class Recording(Scripted):
    """A scripted governor that keeps what each step was decided and observed as."""

    def begin(self) -> None:
        super().begin()
        self.decided, self.observed = [], []

    def drafts(self, rows: int) -> bool:
        kind = super().drafts(rows)
        self.decided.append(kind)
        return kind

    def observe(self, drafting: bool, rows: int, tokens: int, seconds: float) -> None:
        self.observed.append(drafting)


def test_pearl_times_a_round_that_verifies_a_windows_drafts_as_drafting():
    """A PEARL round's window is verified by the next round, so a plain round right after a drafting one harvests
    the drafting round's work and is timed as drafting (alternating probes had credited it to plain rounds: 64 rows
    drafted in 98% of their rounds at 0.74x `ar`); PEARL's learned governor probes in blocks."""
    dec = decoder("llama")
    gov = Recording("ddpp")
    gov.blocks = True
    dec.generate_ids([prompt_of(9, seed=1), prompt_of(4, seed=2)], "pearl", 24, GREEDY, governor=gov,
                     backend="inline", window="fixed", gamma=2)
    pairs = list(zip(gov.decided, gov.observed))
    assert (False, True) in pairs and (False, False) in pairs  # harvesting and plain rounds
    assert all(o for d, o in pairs if d)
    assert all(not o or gov.decided[i - 1] for i, (d, o) in enumerate(pairs) if not d)  # right after drafting
    dec.generate_ids([prompt_of(9, seed=1)], "pearl", 4, GREEDY, backend="inline")
    assert [g.blocks for k, g in dec._learned.items() if k[0] == "governor" and k[1] == "pearl"] == [True]


def test_pearl_begins_each_call_with_its_governor():
    """Each call starts the governor's generation (its counts are the call's own rounds; a probe cut by the end of
    the last call is judged, not carried on into new prompts)."""
    dec = decoder("llama")
    gov = DraftGovernor(blocks=True)
    for n in (5, 20):
        out = dec.generate_ids([prompt_of(9, seed=1), prompt_of(4, seed=2)], "pearl", n, GREEDY, governor=gov,
                               backend="inline", window="fixed", gamma=2)
        counts = out.stats.drafter["governor"]
        assert counts["drafting_steps"] + counts["plain_steps"] == out.stats.drafter["pearl"]["rounds"]


def test_govern_option_turns_it_off():
    dec = decoder("llama")
    prompt = prompt_of(12)
    on = dec.generate_ids([prompt], "pld", 20, GREEDY)
    off = dec.generate_ids([prompt], "pld", 20, GREEDY, govern=0)
    assert on.tokens == off.tokens
    assert "governor" in on.stats.drafter and "governor" not in off.stats.drafter
    with pytest.raises(ValueError, match="govern"):
        dec.generate_ids([prompt], "pld", 20, GREEDY, govern=2)


@pytest.mark.parametrize("method", ["pld", "ngrammys", "sd", "ouroboros", "pearl"])
def test_a_sampled_generation_that_never_drafts_is_ars(method):
    """A plain step is `ar`'s step: the same draw from the same generator, so with the same seed a generation whose
    governor never lets it draft samples `ar`'s tokens (a ragged batch)."""
    dec = decoder("llama")
    prompts = [prompt_of(9, seed=1) * 2, prompt_of(4, seed=2), prompt_of(6, seed=3)]
    sampling = SamplingConfig(temperature=1.0, seed=7)
    opts = runnable(dec, {})
    ar = dec.generate_ids(prompts, "ar", 25, sampling)
    plain = dec.generate_ids(prompts, method, 25, sampling, governor=Scripted("p"), **opts)
    assert plain.tokens == ar.tokens
    assert plain.stats.drafted_tokens == 0 and plain.stats.drafter["governor"]["drafting_steps"] == 0
