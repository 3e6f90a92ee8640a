"""DISCO: features, classifier files, online calibration, the stop rule and the trainer, on tiny models."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from specdec.api import hf_generate
from specdec.distill import disco as trainer
from specdec.policies.disco import (FEATURES, DiscoClassifier, DiscoStop, OracleStop, PlattCalibration,
                                    disco_features, draft_fingerprint, tree_accept)
from specdec.prompts import Prompt
from specdec.verify import SamplingConfig
from tests.test_greedy_lossless import decoder, prompt_of

GREEDY = SamplingConfig()


def test_features_are_sorted_top_probabilities_entropy_depth_position():
    logits = torch.randn(5, 40)
    f = disco_features(logits, 3, torch.tensor([0, 1, 2, 10, 100]))
    assert f.shape == (5, len(FEATURES))
    p = logits.softmax(-1)
    torch.testing.assert_close(f[:, :10], p.topk(10, -1).values)
    ent = -(p * p.log()).sum(-1) / math.log(40)
    torch.testing.assert_close(f[:, 10], ent)
    assert f[:, 11].tolist() == [3.0] * 5
    torch.testing.assert_close(f[:, 12], torch.log1p(torch.tensor([0.0, 1, 2, 10, 100])))
    small = disco_features(torch.randn(2, 4), torch.tensor([1, 2]), torch.tensor([0, 0]))  # V < 10: zero padded
    assert small[:, 4:10].abs().sum() == 0 and small[:, 11].tolist() == [1.0, 2.0]


def test_features_reject_nan_and_bad_shapes():
    bad = torch.randn(2, 8)
    bad[1] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        disco_features(bad, 1, torch.zeros(2))
    with pytest.raises(ValueError, match=r"\[N, V\]"):
        disco_features(torch.randn(8), 1, torch.zeros(1))


def test_classifier_file_round_trip_and_bad_files(tmp_path):
    model = DiscoClassifier(8, {"draft": "x", "draft_fingerprint": "fp", "threshold": 0.4})
    path = tmp_path / "disco.pt"
    model.save(path)
    x = torch.randn(6, len(FEATURES))
    loaded = DiscoClassifier.load(path, "fp")
    torch.testing.assert_close(loaded(x), model(x))
    assert loaded.meta["threshold"] == 0.4
    with pytest.raises(ValueError, match="trained for draft"):
        DiscoClassifier.load(path, "another")
    with pytest.raises(FileNotFoundError, match="train-disco"):
        DiscoClassifier.load(tmp_path / "missing.pt")
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match="not a DISCO classifier"):
        DiscoClassifier.load(junk)
    blob = torch.load(path, weights_only=True)
    blob["layout"] = "disco-v0:top5"
    torch.save(blob, tmp_path / "old.pt")
    with pytest.raises(ValueError, match="feature layout"):
        DiscoClassifier.load(tmp_path / "old.pt")


def test_platt_calibration_recovers_a_known_sigmoid():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(4000, generator=g) * 2
    y = (torch.rand(4000, generator=g) < torch.sigmoid(0.5 * z - 1.0)).float()
    cal = PlattCalibration(window=4000, prior=1.0, refit_every=4000)
    cal.observe(z.tolist(), y.tolist())
    assert abs(cal.a - 0.5) < 0.1 and abs(cal.b + 1.0) < 0.15, (cal.a, cal.b)
    cal.reset()
    assert (cal.a, cal.b, cal.seen) == (1.0, 0.0, 0)


def test_simulated_depths():
    # accepted, accepted, rejected -> restart; with length 2 a fully accepted draft skips the bonus position
    assert trainer.simulated_depths([True, False, True, True, True, False], 2) == [1, 2, 1, 2, 0, 1]
    assert trainer.simulated_depths([False, False], 3) == [1, 1]


def test_roc_auc_matches_pairwise_count():
    g = torch.Generator().manual_seed(1)
    s = torch.randint(0, 5, (60,), generator=g).float()  # ties included
    y = torch.rand(60, generator=g) < 0.4
    pos, neg = s[y], s[~y]
    want = ((pos[:, None] > neg[None]).float() + 0.5 * (pos[:, None] == neg[None]).float()).mean()
    assert trainer.roc_auc(s, y) == pytest.approx(float(want))
    assert trainer.roc_auc(s, torch.ones(60, dtype=torch.bool)) is None


class _Constant(DiscoClassifier):
    """A classifier whose logit is fixed per depth (for checking the stop rules' arithmetic)."""

    def __init__(self, logit_by_depth: dict[int, float]):
        super().__init__(4, {"threshold": 0.5})
        self.by_depth = logit_by_depth

    def forward(self, x):
        return torch.tensor([self.by_depth[int(d)] for d in x[:, FEATURES.index("depth")]])


def test_paper_mode_stops_below_threshold_and_calibration_learns_from_outcomes():
    stop = DiscoStop(_Constant({1: 2.0, 2: -2.0}), "paper", threshold=0.5)
    stop.begin(2)
    assert stop.keep_going(1, torch.randn(2, 16), torch.tensor([3, 4])).tolist() == [True, True]
    assert stop.keep_going(2, torch.randn(2, 16), torch.tensor([3, 4])).tolist() == [False, False]
    stop.update([2, 2], [2, 0])
    # row 0: both tokens verified and accepted; row 1: the first rejected, the second never judged
    assert stop.calibration._z == [2.0, -2.0, 2.0] and stop.calibration._y == [1.0, 1.0, 0.0]
    assert stop._position == [4, 2]
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        DiscoStop(_Constant({}), "paper", threshold=1.5)
    with pytest.raises(ValueError, match="cost mode"):
        DiscoStop(_Constant({}), "cost")


class _Cost:
    def __init__(self, per_node: float):
        self.per_node = per_node

    def costs(self, n):
        return [1.0 + self.per_node * (t - 1) for t in range(1, n + 1)]

    def for_batch(self, rows):  # the contract's (specdec.contracts.StepCostLike): one table for every batch
        return self


def test_cost_mode_weighs_acceptance_against_draft_and_verify_cost():
    confident, doubtful = _Constant({1: 4.0}), _Constant({1: -4.0})
    for clf, want in ((confident, True), (doubtful, False)):
        stop = DiscoStop(clf, "cost", cost=_Cost(0.05), draft_seconds=0.1)
        stop.begin(1)
        assert stop.keep_going(1, torch.randn(1, 16), torch.tensor([1])).item() is want
    # an expensive draft does not pay even for a confident token
    stop = DiscoStop(confident, "cost", cost=_Cost(0.05), draft_seconds=5.0)
    stop.begin(1)
    assert not stop.keep_going(1, torch.randn(1, 16), torch.tensor([1])).item()


class _BatchCost(_Cost):
    """Cheap steps for one row; a batch's own table (``for_batch``) makes every node dear."""

    def for_batch(self, rows):
        return self if rows == 1 else _Cost(10.0)


def test_cost_mode_reads_the_batchs_own_step_costs():
    stop = DiscoStop(_Constant({1: 4.0}), "cost", cost=_BatchCost(0.05), draft_seconds=0.1)
    stop.begin(1)
    assert stop.keep_going(1, torch.randn(1, 16), torch.tensor([1])).item()
    stop.begin(2)   # two rows verify together: one more node costs what the batch's table says
    assert stop.keep_going(1, torch.randn(2, 16), torch.tensor([1, 2])).tolist() == [False, False]


def test_oracle_stops_at_the_first_disagreement():
    state = SimpleNamespace(seq=torch.tensor([[7, 8, 20, 0, 0]]), seq_lens_host=[3])
    stop = OracleStop({(7, 8): [20, 21, 22, 23]})
    stop.begin(1, state)
    assert stop.keep_going(1, torch.randn(1, 4), torch.tensor([21])).item()
    assert not stop.keep_going(2, torch.randn(1, 4), torch.tensor([5])).item()
    stop.update([2], [1])
    assert stop._position == [3]
    with pytest.raises(ValueError, match="no reference"):
        OracleStop({}).begin(1, state)


def test_stop_rules_keep_the_rows_that_stay():
    """After finished rows leave, DISCO's and the oracle's per-row state are the rows that stay, in order."""
    stop = DiscoStop(DiscoClassifier(4, {}), "paper", 0.5)
    stop.begin(3)
    stop.update([2, 2, 2], [1, 0, 2])
    stop.keep_rows([0, 2])
    assert stop._position == [3, 4]
    oracle = OracleStop({})
    oracle._ref, oracle._position = [[1], [2], [3]], [1, 2, 3]
    oracle.keep_rows([1, 2])
    assert (oracle._ref, oracle._position) == ([[2], [3]], [2, 3])


@pytest.fixture(scope="module")
def tiny_disco(tmp_path_factory):
    """A decoder on tiny llama models and a DISCO classifier trained for its draft in seconds."""
    dec = decoder("llama")
    draft, _ = dec.get_draft()
    prompts = [Prompt(f"p{i}", "cat" + str(i % 2), prompt_of(6 + i, seed=i)) for i in range(12)]
    replies = [dec.generate_ids([p.ids], "ar", 24).tokens[0] for p in prompts]
    seqs = trainer.build_sequences(dec, prompts, replies, draft, sim_length=4, progress=False)
    train, val = trainer.split_by_prompt(seqs, held_ids={"p0", "p1", "p2", "p3"})
    model = trainer.train_classifier(train, hidden=8, epochs=30, meta={"draft_fingerprint": draft_fingerprint(draft)})
    calibration = trainer.fit_calibration(model, val)
    tuned = trainer.tune(model, val, [1.0 + 0.1 * d for d in range(33)], 0.2, max_lengths=range(1, 5), calibration=calibration,
                         thresholds=[0.2, 0.5, 0.8])
    model.meta.update(threshold=tuned["threshold"], max_length=tuned["max_length"])
    path = tmp_path_factory.mktemp("disco") / "disco.pt"
    model.save(path)
    return dec, path, seqs, model, tuned


def test_trainer_labels_are_teacher_forced_agreement(tiny_disco):
    dec, _, seqs, model, tuned = tiny_disco
    assert len(seqs) == 12 and all(len(s.features) == len(s.agree) == len(s.soft) for s in seqs)
    agree = torch.cat([s.agree for s in seqs]).float().mean()
    assert 0.05 < float(agree) < 0.95  # the noisy draft agrees part of the time: both labels occur
    assert ((torch.cat([s.soft for s in seqs]) >= 0) & (torch.cat([s.soft for s in seqs]) <= 1)).all()
    report = trainer.evaluate(model, seqs)
    assert 0.0 <= report["auc"] <= 1.0 and sum(r["n"] for r in report["reliability"]) == report["positions"]
    assert tuned["threshold"] in (0.2, 0.5, 0.8) and 1 <= tuned["max_length"] <= 4


def test_trainer_labels_match_a_real_greedy_run(tiny_disco):
    """The teacher-forced agreement of the first drafted position equals what sd at draft length 1
    accepts there (the replay the tuning simulates is exact for greedy decoding)."""
    dec, _, seqs, _, _ = tiny_disco
    p = prompt_of(6, seed=0)
    draft, _ = dec.get_draft()
    reply = dec.generate_ids([p], "ar", 24).tokens[0]
    _, agree, _ = trainer.teacher_forced(dec.model, draft, p, reply)
    # draft's argmax at reply position 1 vs the target's; a one-token sd step from position 1 agrees
    out = dec.generate_ids([p], "sd", 2, GREEDY, draft_length=1)
    assert out.tokens[0] == reply[:2]
    assert bool(agree[1]) == (out.stats.accepted_tokens == 1)


@pytest.mark.parametrize("opts", [{"disco_mode": "paper"}, {"disco_mode": "cost"},
                                  {"disco_mode": "paper", "disco_threshold": 0.0, "max_draft_length": 3}])
def test_disco_schedule_is_lossless(tiny_disco, opts):
    dec, path, *_ = tiny_disco
    prompts = [prompt_of(5, seed=11), prompt_of(30, seed=12), prompt_of(9, seed=13)]
    # ungoverned: the module's decoder is shared, and a governor that learned plain steps win would draft nothing
    out = dec.generate_ids(prompts, "sd", 24, GREEDY, schedule="disco", disco=str(path), govern=0, **opts)
    assert out.tokens == [hf_generate(dec.model, p, 24, GREEDY) for p in prompts]
    assert out.stats.drafted_tokens > 0
    if opts["disco_mode"] == "cost":  # the batch of three had its own step costs measured for the stop rule
        assert 3 in dec.step_cost().batches


@pytest.mark.parametrize("opts", [{"schedule": "disco", "disco_mode": "paper"}, {"schedule": "disco", "disco_mode": "cost"},
                                  {"schedule": "oracle"}])
def test_rows_leave_the_batch_with_their_stop_rule_state(tiny_disco, opts, monkeypatch):
    """Finished rows leave a batch drafted under DISCO's (or the oracle's) stop rule: the rule's per-row
    positions (and the oracle's references) leave with them, and every row stays its own greedy output."""
    from tests.test_greedy_lossless import check_rows_leave

    dec, path, *_ = tiny_disco
    if opts["schedule"] == "disco":
        opts = {**opts, "disco": str(path)}
    monkeypatch.setattr(dec, "_references", {})  # the oracle's references are run with the EOS set here
    monkeypatch.setattr(dec, "_reference_len", {})
    check_rows_leave(dec, "sd", opts, monkeypatch, sampled=opts["schedule"] != "oracle",
                     same_drafts=opts.get("disco_mode") != "cost")  # cost mode weighs measured times


def test_disco_threshold_zero_drafts_to_the_maximum_and_one_stops_after_one(tiny_disco):
    dec, path, *_ = tiny_disco
    p = [prompt_of(7, seed=21)]
    always = dec.generate_ids(p, "sd", 20, GREEDY, schedule="disco", disco=str(path), disco_threshold=0.0,
                              max_draft_length=3, govern=0)
    static = dec.generate_ids(p, "sd", 20, GREEDY, draft_length=3, govern=0)
    assert always.stats.drafted_tokens == static.stats.drafted_tokens
    never = dec.generate_ids(p, "sd", 20, GREEDY, schedule="disco", disco=str(path), disco_threshold=1.0,
                             max_draft_length=3, govern=0)
    one = dec.generate_ids(p, "sd", 20, GREEDY, draft_length=1, govern=0)
    assert never.stats.drafted_tokens == one.stats.drafted_tokens
    assert never.tokens == always.tokens == one.tokens


def test_disco_bad_inputs(tiny_disco, tmp_path):
    dec, path, *_ = tiny_disco
    p = [prompt_of(5, seed=1)]
    with pytest.raises(ValueError, match=r"must be in \[0, 1\]"):
        dec.generate_ids(p, "sd", 4, GREEDY, schedule="disco", disco=str(path), disco_threshold=1.5)
    with pytest.raises(FileNotFoundError):
        dec.generate_ids(p, "sd", 4, GREEDY, schedule="disco", disco=str(tmp_path / "none.pt"))
    with pytest.raises(ValueError, match="no DISCO classifier ships"):
        dec.generate_ids(p, "sd", 4, GREEDY, schedule="disco")
    other = DiscoClassifier(4, {"draft_fingerprint": "llama:1:96"})
    other.save(tmp_path / "other.pt")
    with pytest.raises(ValueError, match="trained for draft"):
        dec.generate_ids(p, "sd", 4, GREEDY, schedule="disco", disco=str(tmp_path / "other.pt"))
    with pytest.raises(ValueError, match="apply to schedule=disco"):
        dec.generate_ids(p, "sd", 4, GREEDY, disco_threshold=0.3)
    with pytest.raises(ValueError, match="greedy only"):
        dec.generate_ids(p, "sd", 4, SamplingConfig(temperature=0.8, seed=0), schedule="oracle")


def test_oracle_schedule_is_lossless_and_drafts_only_what_the_target_accepts_plus_one(tiny_disco):
    dec, *_ = tiny_disco
    prompts = [prompt_of(8, seed=31), prompt_of(15, seed=32)]
    out = dec.generate_ids(prompts, "sd", 30, GREEDY, schedule="oracle")
    assert out.tokens == [hf_generate(dec.model, p, 30, GREEDY) for p in prompts]
    for p in prompts:  # alone: every step drafts its accepted tokens and at most one rejected token (ungoverned:
        # a governor's plain steps, decided from the machine's timings, would make more target calls)
        one = dec.generate_ids([p], "sd", 30, GREEDY, schedule="oracle", govern=0)
        assert one.stats.drafted_tokens - one.stats.accepted_tokens <= one.stats.steps
        static = dec.generate_ids([p], "sd", 30, GREEDY, draft_length=1, govern=0)
        assert one.stats.target_calls <= static.stats.target_calls


def test_tree_accept_multiplies_node_chances_along_paths():
    from specdec.policies import StepCost, prune
    from specdec.tree import DraftTree

    clf = _Constant({1: 0.0, 2: 2.0, 3: -1.0})  # sigmoid: 0.5, 0.881, 0.269 by depth
    tree = DraftTree.from_parents(torch.tensor([[5, 6, 7, 8, 9]]), torch.tensor([[-1, 0, 0, 1, 3]]))
    reach = tree_accept(clf, None, tree, torch.randn(1, 5, 16), torch.tensor([3]))
    s = torch.sigmoid(torch.tensor([0.0, 2.0, -1.0]))
    want = torch.tensor([[1.0, s[0], s[0], s[0] * s[1], s[0] * s[1] * s[2]]])
    torch.testing.assert_close(reach, want)
    tree.accept = reach
    cheap = StepCost({1: 1.0, 16: 1.0 + 1e-3})  # verifying more nodes costs almost nothing: all are kept
    assert prune(tree, cheap).valid.sum() == 5
    dear = StepCost({1: 1.0, 2: 2.0, 16: 16.0})  # every node costs a whole step: none pays
    assert prune(tree, dear).valid.sum() <= 2
