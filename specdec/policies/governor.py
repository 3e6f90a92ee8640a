"""The draft governor: stop drafting while steps without a draft emit more tokens per second.

The planners size each draft by the target forward's measured cost and the draft's expected reach; they
do not see what the rest of a step costs (drafting, pruning, verification, the drafter's bookkeeping), and
their reach estimates can run high. In a batch that is what decides: 16 rows of `ngrammys` verified 1.1x
`ar`'s tokens per forward at 1.7x its step time. The governor measures whole steps instead, wall clock
from budget to update, and compares the two kinds a decode loop can take: drafting steps (the method as
built) and plain steps (a zero budget: the target verifies each row's root, one token a row, as `ar`).

Per batch size (rows still generating) it keeps the last few steps of each kind, tokens per row and seconds,
and drafts while drafting's rate over them (their tokens over their seconds: a draft pays in bursts, a row
copying its context for a step or two, which a median would ignore; each step's seconds clipped to 3x the
median, so one slow step decides nothing) is at least the plain steps'. Rates are taken in
probes that alternate the two kinds step by step, so both are timed under the same load (this machine's
speed drifts by 20% over seconds). Once plain steps win it probes again after a pause that doubles each
time drafting still loses (8, 16, 32, 64 steps) and resets once it wins, so a row that starts copying its
context is found again. While drafting wins it probes again after a number of drafting steps that starts at
``pause`` and doubles with each probe drafting wins, up to ``refresh``: one winning probe of three steps a kind is thin
evidence (its plain steps may carry a fresh decoder's first-step costs), and a governor that trusted it for ``refresh``
steps drafted 95 of a first call's 104 steps at a loss (`sd:schedule=disco` over 4 rows on an AMX Xeon: 0.66x `ar` in that
call, 0.88x over its round). The schedule restarts at ``pause`` after a probe that drafting loses (one schedule for
every batch size); across calls it stays where it got to, so a long-lived decoder pays the extra probes once.

A probe that drafting loses costs time: its drafting steps' seconds beyond what plain steps would have taken
for the same tokens, counted whole (its first drafting step carries a model draft's catch-up on every token it
skipped, the prompts at the first probe). Where a drafting step is dear that is most of the loss, not the
pause: 16 rows of `pld` on a Zen 3 drafted in 7% of their steps, nearly all of them probes, each as dear as
3-4 plain steps, and ran at 0.87x `ar` (c25e01e's never-slower table). So the pause after a lost probe is
also at least what keeps the probes' lost time under ``explore`` of the decode time (its lost seconds over
``explore`` plain steps): short where a draft is cheap to try (one row), long where it is dear. Where a model
draft's catch-up over the skipped steps alone costs more than ``explore`` of them, the pauses grow to
``max_hold``: no pause keeps such probes cheaper, so they become rare.

Rates persist across generations of one decoder, and so does the probe schedule (a probe that a generation ended
inside is judged in the next on the steps it took), so each call does not pay to relearn them. A probe is judged on
its own steps, over whatever batch sizes they ran (rows finish during it) but those more than a factor of two from
its last step's, and decides only near the sizes it ran over. A batch size met with too few steps of either kind
(rows finishing shrink the batch a size at a time) decides as the nearest size within a factor of two that has a
probe's worth of both, and starts from its steps; without one, as the last probe decided where it ran over sizes
within a factor of two; without that, it probes.

Every decision keeps decoding exact: a plain step is a draft of nothing.
"""
from __future__ import annotations

import math
from collections import deque
from statistics import median


# The share of decode time lost probes may cost. 2% left a draft that never pays at 0.96-0.98x `ar` by construction,
# too near the never-slower bar of 0.97x: `gsd` over 4 rows, 16 dev prompts, two rounds, AMX Xeon: 0.96x (21 drafting
# steps of 996) at 2%, 0.98x (9 of 1,001) at 1% (bench/RESULTS.md, governor). Drafts that pay are not probed by it: they
# keep drafting and re-time plain steps after 8, 16, ... up to ``refresh`` steps; cheap losing drafts wait out the doubling
# pause.
EXPLORE = 0.01


class DraftGovernor:
    """Decides per step whether the decode loop drafts, from measured whole-step rates.

    probe: steps of each kind in one probe; pause: plain steps before drafting is tried again (doubling
    to ``max_pause`` while it keeps losing), and drafting steps before plain steps are first timed again after a
    probe drafting won (doubling with each such probe); explore: the share of decode time a lost probe may cost (the
    pause after one is long enough for that, up to ``max_hold`` steps); refresh: the most drafting steps between
    re-timings of plain steps; window: steps kept per kind and batch size; blocks: probe with ``probe`` drafting steps, then
    ``probe + 1`` plain ones, instead of alternating, for a loop whose step hands work to the next (a PEARL round's
    window is verified by the next round: that loop counts the plain step that harvests it as drafting).
    """

    def __init__(self, probe: int = 3, pause: int = 8, max_pause: int = 64, refresh: int = 128, window: int = 8,
                 explore: float = EXPLORE, max_hold: int = 4096, blocks: bool = False):
        if min(probe, pause, refresh, window) < 1 or max_pause < pause or max_hold < max_pause:
            raise ValueError("probe, pause, refresh and window must be >= 1 and pause <= max_pause <= max_hold")
        if not 0 < explore <= 1:
            raise ValueError(f"explore must lie in (0, 1], got {explore}")
        self.probe, self.pause, self.max_pause, self.refresh, self.window = probe, pause, max_pause, refresh, window
        self.explore, self.max_hold, self.blocks = explore, max_hold, blocks
        self._rates: dict[int, dict[bool, deque]] = {}  # rows -> drafting? -> (tokens per row, seconds) of recent steps
        self._pause, self._waited, self._since_plain = pause, 0, 0
        # Drafting steps before plain steps are timed again (set by a probe drafting wins), and what the next such probe
        # sets it to: ``pause``, doubling with each probe drafting wins up to ``refresh``, back to ``pause`` on a loss.
        self._recheck, self._confirm = refresh, min(pause, refresh)
        self._hold = 0  # plain steps the last lost probe's cost asks for before the next probe
        self._queue: list[bool] = []  # the kinds of a probe's remaining steps, last first
        self._probing = False  # the step decided last belongs to a probe
        self._probe: list[tuple[bool, int, float, float]] = []  # the probe's steps: drafting?, rows, tokens/row, s
        self._verdict: tuple[bool, int, int] | None = None  # the last probe's: drafting won?, fewest and most rows
        self.begin()

    def begin(self) -> None:
        """A new generation starts. The rates and the probe schedule carry over (a workload of short generations
        would otherwise pay for a probe every few steps). A probe the last generation ended inside is judged on the
        steps it took, after the plain steps that pair its drafting steps (one at most, but in ``blocks``): dropped,
        it set no pause for its cost, so the next probe came 8 steps later (an 8-token call before 128 tokens: two
        probes of `ouroboros` over 16 sampled rows, 15 plain steps each); carried whole, its next drafting step
        re-read the new prompts into a model draft (16 rows of `sd` at 0.86x `ar`). Steps more than a factor of
        two from the new call's batch size decide nothing there (:meth:`_judge`)."""
        self.counts = {"drafting_steps": 0, "plain_steps": 0, "switches_to_plain": 0, "switches_to_drafting": 0}
        self._last: bool | None = None
        drafted = sum(k for k, *_ in self._probe)
        self._queue = [False] * max(0, drafted - (len(self._probe) - drafted)) if self._queue else []

    def _bucket(self, rows: int) -> dict[bool, deque]:
        if rows not in self._rates:
            # Per-row rates of a nearby batch size are a fair start (:meth:`_near`), or a nearby size's few steps (a
            # probe going on while rows finish); without one, a probe starts it.
            near = self._near(rows)
            if near is None:
                near = self._near(rows, need=0)
            self._rates[rows] = {k: deque(self._rates[near][k] if near is not None else (), maxlen=self.window)
                                 for k in (True, False)}
        return self._rates[rows]

    def _near(self, rows: int, need: int | None = None) -> int | None:
        """The batch size nearest ``rows``, within a factor of two, whose recent steps hold ``need`` (default: a
        probe's worth) of both kinds (None: none). Farther sizes say little: a drafting step's cost over a plain
        one's grows with rows."""
        need = self.probe if need is None else need
        full = [b for b, k in self._rates.items()
                if min(len(k[True]), len(k[False])) >= need and rows <= 2 * b and b <= 2 * rows]
        return min(full, key=lambda b: (abs(b - rows), b), default=None)

    def rate(self, rows: int, drafting: bool) -> float | None:
        """Tokens per second per row of the recent ``drafting`` (or plain) steps over ``rows`` rows (None before
        any): their tokens over their seconds, each step's clipped to 3x their median."""
        return _rate(list(self._rates.get(rows, {}).get(drafting, ())))

    def drafts(self, rows: int) -> bool:
        """Whether the next step over ``rows`` rows drafts."""
        kind = self._decide(rows)
        if self._last is not None and kind != self._last:
            self.counts["switches_to_drafting" if kind else "switches_to_plain"] += 1
        self._last = kind
        self.counts["drafting_steps" if kind else "plain_steps"] += 1
        return kind

    def _decide(self, rows: int) -> bool:
        self._probing = bool(self._queue)
        if self._probing:
            return self._queue.pop()
        if self._probe:  # a probe just ended: its own steps decide (timed side by side) where they ran near here
            won = self._judge(rows)
            if won is not None and self._verdict_near(rows):
                return self._follow(won, rows)
        bucket = self._bucket(rows)
        if min(len(bucket[True]), len(bucket[False])) < self.probe:
            near = self._near(rows)
            if near is not None:  # decide as the nearest batch size with a probe's worth does
                timed = near
            elif self._verdict_near(rows):
                return self._follow(self._verdict[0], rows)  # the last probe ran over batch sizes near this one
            else:  # nothing to go on yet
                return self._compare(rows)
        else:
            timed = rows
        return self._follow(self.rate(timed, True) >= self.rate(timed, False), rows)

    def _follow(self, drafting: bool | None, rows: int) -> bool:
        """The step over ``rows`` rows after deciding whether ``drafting`` wins (None: no evidence, probe): draft, or
        wait out the pause, or probe again once the pause or the refresh interval is over."""
        if drafting is None:
            return self._compare(rows)
        if drafting:
            self._pause, self._waited, self._hold = self.pause, 0, 0
            self._since_plain += 1
            if self._since_plain > self._recheck:
                self._since_plain = 0
                return self._compare(rows, retime=True)
            return True
        self._waited += 1
        if self._waited > max(self._pause, self._hold):
            self._waited, self._pause = 0, min(2 * self._pause, self.max_pause)
            return self._compare(rows)
        return False

    def _verdict_near(self, rows: int) -> bool:
        """Whether the last probe ran over batch sizes within a factor of two of ``rows``."""
        return self._verdict is not None and self._verdict[1] <= 2 * rows and rows <= 2 * self._verdict[2]

    def _judge(self, rows: int) -> bool | None:
        """Whether drafting won the probe that just ended (None: it lacks a step of either kind), on its own steps
        whatever batch sizes they ran over (rows finish during a probe), but those more than a factor of two from its
        last step's size: a probe cut by the end of a one-row call is paired by a plain step of the next call, over
        16 rows, and one-row drafting steps against it said drafting won at 16 rows (`sd` then drafted 128 steps
        running at a sixth of the plain rate: 0.42x `ar` over 4,000 tokens). Sets the pause its cost asks for, or the
        drafting steps before plain steps are re-timed; the winning kind's steps from before the probe are dropped as
        stale (older slow plain steps overruled a lost re-timing probe a step later, then drafting ran unchecked)."""
        steps, self._probe = self._probe, []
        last = steps[-1][1] if steps else 0
        steps = [s for s in steps if s[1] <= 2 * last and last <= 2 * s[1]]
        drafting = [(n, t) for k, _, n, t in steps if k]
        plain = [(n, t) for k, _, n, t in steps if not k]
        if not drafting or not plain:
            return None
        wins = _rate(drafting) >= _rate(plain)
        self._verdict = (wins, min(r for _, r, *_ in steps), max(r for _, r, *_ in steps))
        if not self._verdict_near(rows):  # it ran at other batch sizes: its cost and steps say nothing here
            return wins
        if not wins:
            self._hold = self._cost_pause(drafting, plain)
            self._confirm = min(self.pause, self.refresh)
        else:
            self._since_plain, self._recheck = 0, self._confirm
            self._confirm = min(2 * self._confirm, self.refresh)
        bucket = self._bucket(rows)[wins]  # the winner's steps from before the probe are stale
        bucket.clear()
        bucket.extend(drafting if wins else plain)
        return wins

    def _cost_pause(self, drafting: list[tuple[float, float]], plain: list[tuple[float, float]]) -> int:
        """Plain steps to wait after a probe that drafting lost (its steps of each kind as (tokens per row,
        seconds)), so that its cost stays under ``explore`` of the decode time: the probe's drafting seconds beyond
        the same tokens at the probe's plain rate, over ``explore`` plain steps (their median seconds). The drafting
        seconds count whole, not clipped as the decision clips them: a probe's first drafting step carries the
        draft's catch-up on every token since the last probe (the prompts, at the first), 5-25x a plain step over
        16 rows, and that is what the probe cost."""
        rate = _rate(plain)
        lost = sum(max(0.0, t - n / rate) for n, t in drafting)
        return min(self.max_hold, math.ceil(lost / (self.explore * median(t for _, t in _clip(plain)))))

    def _compare(self, rows: int, retime: bool = False) -> bool:
        """Start a probe over ``rows`` rows: ``probe`` drafting and plain steps, alternating (so that both kinds are timed under
        the same load, on a machine whose speed drifts), drafting first unless this batch size has timed fewer plain
        steps than drafting ones (calls of a step or two at 16 rows, between calls of one row, each cut the probe
        after its first step: always a drafting one, so 16 rows never timed a plain step), or this probe re-times plain
        steps while drafting wins (``retime``: its first step is plain); or in blocks (``blocks``, which ``retime``
        does not change: drafting steps first)."""
        bucket = self._rates.get(rows)
        plain_first = retime or bucket is not None and len(bucket[False]) < len(bucket[True])
        # popped from the end
        self._queue = [False] * (self.probe + 1) + [True] * self.probe if self.blocks else \
            [True, False] * self.probe if plain_first else [False, True] * self.probe
        self._probing, self._probe = True, []
        return self._queue.pop()

    def observe(self, drafting: bool, rows: int, tokens: int, seconds: float) -> None:
        """A step over ``rows`` rows that drafted (or not) emitted ``tokens`` in ``seconds`` of wall time."""
        if rows > 0 and seconds > 0:
            self._bucket(rows)[drafting].append((tokens / rows, seconds))
            if self._probing:
                self._probe.append((drafting, rows, tokens / rows, seconds))

    def summary(self) -> dict:
        """Steps of each kind and switches between them in this generation (JSON-serialisable)."""
        return dict(self.counts)


def _clip(steps: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Steps as (tokens per row, seconds), each step's seconds clipped to 3x their median: one slow step decides
    nothing."""
    if not steps:
        return []
    cap = 3 * median(t for _, t in steps)
    return [(n, min(t, cap)) for n, t in steps]


def _rate(steps: list[tuple[float, float]]) -> float | None:
    """Tokens per row per second of ``steps`` (None: no steps): their tokens over their clipped seconds."""
    seen = _clip(steps)
    return sum(n for n, _ in seen) / sum(t for _, t in seen) if seen else None
