"""``specdec train-disco``: label data, train and tune DISCO's stop classifier (:mod:`specdec.policies.disco`).

Data (the paper's Appendix D, teacher-forced): for every training prompt, the target's own greedy
reply (the shipped n-gram corpus already holds them for the training prompts; otherwise ``ar`` makes
them), one teacher-forced target pass over prompt + reply (the labels: does the draft's argmax equal
the target's, or softly ``1 - TV`` of the two distributions) and one teacher-forced draft pass (the
features at every reply position). Because the prefix is the target's own greedy output, these are
exactly the draft's predictions in a greedy speculative run that has not yet failed (for feature
drafts, exactly at depth 1: deeper tokens read the draft's own states at run time). Each position's
depth is its depth in a simulated run of static ``--sim-length`` drafts.

Tuning (the paper's Appendix E): the threshold and maximum length that minimise simulated latency on a
validation split of the prompts (never the dev prompts), with this machine's measured target step
costs and draft forward time. A greedy run is replayed exactly on the teacher-forced data, so the
simulation also gives the best static length and the oracle for the same split.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from specdec.draft_models import is_feature_draft
from specdec.policies.disco import FEATURES, LAYOUT, DiscoClassifier, PlattCalibration, disco_features, draft_fingerprint


@dataclass
class Sequence:
    """One prompt's teacher-forced data over its reply positions 1..n-1 (position 0 comes from the prefill)."""

    prompt_id: str
    category: str
    features: torch.Tensor  # [n-1, F] at the simulated depth
    agree: torch.Tensor     # [n-1] bool: draft argmax == target argmax
    soft: torch.Tensor      # [n-1] float: 1 - TV(draft, target)


def _target_ids(model, draft_logits: torch.Tensor) -> torch.Tensor:
    """Argmax of reduced-vocabulary draft logits ``[N, Vd]`` as target ids."""
    top = draft_logits.argmax(-1)
    vocab = getattr(model, "draft_vocab", None)
    return vocab[top] if vocab is not None else top


@torch.inference_mode()
def teacher_forced(target, draft, prompt: list[int], reply: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draft logits ``[n, Vd]`` (its own vocabulary), whether the draft's argmax equals the target's
    ``[n]`` and ``1 - TV`` of the two distributions ``[n]``, at the positions predicting ``reply[0..n-1]``."""
    seq = torch.tensor([prompt + reply[:-1]], device=target.device)
    p, n = len(prompt), len(reply)
    reduced = getattr(draft, "reduced_logits", None)
    with reduced() if reduced is not None else contextlib.nullcontext():
        if is_feature_draft(draft):  # it reads the target's last hidden state before each token
            hidden = target.get_decoder()(input_ids=seq, use_cache=False).last_hidden_state
            t_logits = target.get_output_embeddings()(hidden[0, p - 1:]).float()
            prev = torch.nn.functional.pad(hidden[:, :-1], (0, 0, 1, 0))
            d_logits = draft(input_ids=seq, target_hidden=prev, use_cache=False, logits_to_keep=n).logits
        else:
            t_logits = target(input_ids=seq, use_cache=False, logits_to_keep=n).logits[0].float()
            d_logits = draft(input_ids=seq, use_cache=False, logits_to_keep=n).logits
    d_logits = d_logits[0].float()
    agree = _target_ids(draft, d_logits) == t_logits.argmax(-1)
    q = d_logits.softmax(-1)
    pt = t_logits.softmax(-1)
    vocab = getattr(draft, "draft_vocab", None)
    pt_on = pt[:, vocab] if vocab is not None else pt  # the target's mass on the draft's vocabulary
    tv = 0.5 * ((q - pt_on).abs().sum(-1) + (1 - pt_on.sum(-1)))  # mass off the draft vocabulary counts too
    return d_logits, agree, (1 - tv).clamp(0, 1)


def simulated_depths(agree: list[bool], length: int) -> list[int]:
    """The depth of each position (1-based) in a greedy run of static ``length``-token drafts, 0 where a
    position is never drafted (the bonus token after a fully accepted draft). Position 0 starts a step."""
    out, depth = [], 1
    skip = False
    for a in agree:
        if skip:
            out.append(0)
            skip, depth = False, 1
            continue
        out.append(depth)
        if not a:
            depth = 1  # the target's correction is emitted here; the next position starts a new draft
        elif depth == length:
            skip, depth = True, 1  # all accepted: the next position is the bonus token
        else:
            depth += 1
    return out


def build_sequences(dec, prompts, replies: list[list[int]], draft, sim_length: int, progress: bool = True
                    ) -> list[Sequence]:
    """Teacher-forced :class:`Sequence` per prompt (``prompts``: :class:`~specdec.prompts.Prompt` list)."""
    out = []
    for pr, reply in tqdm(list(zip(prompts, replies)), desc="teacher forcing", disable=not progress):
        if len(reply) < 2:
            continue
        logits, agree, soft = teacher_forced(dec.model, draft, pr.ids, reply)
        logits, agree, soft = logits[1:], agree[1:], soft[1:]  # reply[0] comes from the prefill
        depth = torch.tensor(simulated_depths(agree.tolist(), sim_length))
        keep = depth > 0
        position = torch.arange(1, len(reply))
        feats = disco_features(logits[keep], depth[keep], position[keep])
        out.append(Sequence(pr.id, pr.category, feats, agree[keep], soft[keep]))
    return out


def split_by_prompt(seqs: list[Sequence], fraction: float = 0.2, held_ids: set[str] | None = None
                    ) -> tuple[list[Sequence], list[Sequence]]:
    """(train, validation): the prompts ``held_ids``, or those whose id hashes under ``fraction``."""
    def held(s):
        if held_ids is not None:
            return s.prompt_id in held_ids
        return int(hashlib.sha256(s.prompt_id.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF < fraction
    return [s for s in seqs if not held(s)], [s for s in seqs if held(s)]


def distill_held_out(draft_name: str) -> set[str] | None:
    """The prompt ids a shipped or distilled draft was NOT trained on (its ``distill_summary.json``), or None.

    A distilled draft has memorised its training prompts (top-1 agreement about 0.8 there, 0.4 on
    prompts it never saw): tuning the threshold on them would tune for a draft that is always right."""
    from specdec.hub import resolve

    try:
        path = resolve(draft_name) / "distill_summary.json"
    except (ValueError, OSError):
        return None
    if not path.is_file():
        return None
    ids = json.loads(path.read_text()).get("held_out_ids")
    return set(ids) if ids else None


def _stack(seqs: list[Sequence], soft: bool) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.cat([s.features for s in seqs])
    y = torch.cat([s.soft if soft else s.agree.float() for s in seqs])
    return x, y


def train_classifier(seqs: list[Sequence], soft: bool = False, hidden: int = 32, epochs: int = 300, seed: int = 0,
                     meta: dict | None = None) -> DiscoClassifier:
    """Fit the classifier by binary cross-entropy (hard labels: argmax agreement; soft: ``1 - TV``)."""
    torch.manual_seed(seed)
    x, y = _stack(seqs, soft)
    model = DiscoClassifier(hidden, meta)
    model.mean.copy_(x.mean(0))
    model.std.copy_(x.std(0).clamp(min=1e-3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=1e-4)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    batch = 8192
    with torch.enable_grad():
        for _ in range(epochs):
            perm = torch.randperm(len(x))
            for s in range(0, len(x), batch):
                idx = perm[s:s + batch]
                opt.zero_grad()
                loss = loss_fn(model(x[idx]), y[idx])
                loss.backward()
                opt.step()
    return model.eval()


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float | None:
    """Area under the ROC curve (Mann-Whitney, ties averaged); None with one class only."""
    labels = labels.bool()
    pos, neg = int(labels.sum()), int((~labels).sum())
    if pos == 0 or neg == 0:
        return None
    order = scores.double().argsort()
    ranks = torch.empty_like(order, dtype=torch.float64)
    ranks[order] = torch.arange(1, len(scores) + 1, dtype=torch.float64)
    # average ranks over ties
    uniq, inv = torch.unique(scores.double(), return_inverse=True)
    sums = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inv, ranks)
    counts = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inv, torch.ones_like(ranks))
    ranks = (sums / counts)[inv]
    return float((ranks[labels].sum() - pos * (pos + 1) / 2) / (pos * neg))


def reliability(probs: torch.Tensor, labels: torch.Tensor, bins: int = 10) -> list[dict]:
    """Per probability bin: count, mean predicted probability, observed acceptance rate."""
    out = []
    idx = (probs * bins).long().clamp(max=bins - 1)
    for b in range(bins):
        sel = idx == b
        n = int(sel.sum())
        if n:
            out.append({"bin": f"{b / bins:.1f}-{(b + 1) / bins:.1f}", "n": n,
                        "predicted": round(float(probs[sel].mean()), 3), "observed": round(float(labels[sel].float().mean()), 3)})
    return out


def logits_of(model: DiscoClassifier, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
    """The classifier's logits ``[N]`` over every position of ``seqs`` and the hard labels ``[N]``."""
    x, y = _stack(seqs, soft=False)
    with torch.no_grad():
        return model(x), y


def fit_calibration(model: DiscoClassifier, seqs: list[Sequence]) -> PlattCalibration:
    """Platt scaling of ``model``'s logits on ``seqs`` (the validation split: prompts the draft never saw)."""
    z, y = logits_of(model, seqs)
    cal = PlattCalibration(prior=1e-3)
    cal.observe(z.tolist(), y.tolist())
    cal.refit(steps=25)
    return PlattCalibration(cal.a, cal.b)


def evaluate(model: DiscoClassifier, seqs: list[Sequence], calibration: PlattCalibration | None = None) -> dict:
    """ROC-AUC (overall and per category) and a reliability table of ``model`` on ``seqs`` (hard labels),
    its probabilities through ``calibration`` when given."""
    x, y = _stack(seqs, soft=False)
    with torch.no_grad():
        z = model(x)
        p = calibration.estimate(z) if calibration is not None else torch.sigmoid(z)
    per_cat = {}
    cats = [s.category for s in seqs for _ in range(len(s.agree))]
    for c in sorted(set(cats)):
        sel = torch.tensor([k == c for k in cats])
        auc = roc_auc(p[sel], y[sel])
        per_cat[c] = {"auc": None if auc is None else round(auc, 3), "positions": int(sel.sum()),
                      "acceptance": round(float(y[sel].mean()), 3)}
    top1 = x[:, 0]
    auc_top1 = roc_auc(top1, y)
    return {"positions": len(y), "acceptance": round(float(y.mean()), 3), "auc": round(roc_auc(p, y) or 0.0, 3),
            "auc_top1_probability": round(auc_top1 or 0.0, 3), "per_category": per_cat,
            "reliability": reliability(p, y)}


def _probs_by_depth(model: DiscoClassifier, seq: Sequence, max_len: int, calibration: PlattCalibration | None = None
                    ) -> torch.Tensor:
    """``[n, max_len]`` the (calibrated) acceptance probability of each position drafted at each depth."""
    depth_col = FEATURES.index("depth")
    x = seq.features.repeat(max_len, 1)
    x[:, depth_col] = torch.arange(1, max_len + 1).repeat_interleave(len(seq.features)).float()
    with torch.no_grad():
        z = model(x)
        p = calibration.estimate(z) if calibration is not None else torch.sigmoid(z)
        return p.view(max_len, -1).T


def simulate(seqs: list[Sequence], rule, target_cost: list[float], draft_seconds: float) -> dict:
    """Replay greedy speculative decoding on teacher-forced sequences: ``rule(seq_index, pos, depth) ->
    bool`` says whether drafting goes on after the token at ``pos`` (drafted at ``depth``); static
    rules ignore the position. Returns seconds per token and tokens per target call."""
    seconds, tokens, calls = 0.0, 0, 0
    for si, s in enumerate(seqs):
        agree = s.agree.tolist()
        n, j = len(agree), 0
        while j < n:
            d = 0
            while j + d < n:
                d += 1
                if not rule(si, j + d - 1, d):
                    break
            a = 0
            while a < d and agree[j + a]:
                a += 1
            seconds += target_cost[min(d, len(target_cost) - 1)] + d * draft_seconds
            tokens += a + 1
            calls += 1
            j += a + 1
    return {"seconds_per_token": seconds / max(1, tokens), "tokens_per_call": tokens / max(1, calls)}


def tune(model: DiscoClassifier, seqs: list[Sequence], target_cost: list[float], draft_seconds: float,
         max_lengths=range(1, 13), thresholds=None, calibration: PlattCalibration | None = None) -> dict:
    """The threshold and maximum length with the lowest simulated latency on ``seqs``, beside the best
    static length, the oracle and plain autoregressive decoding on the same split."""
    thresholds = thresholds if thresholds is not None else [round(0.05 * i, 2) for i in range(1, 20)]
    top = max(max_lengths)
    probs = [_probs_by_depth(model, s, top, calibration) for s in seqs]
    ar = target_cost[1]
    static = {k: simulate(seqs, lambda si, pos, d, k=k: d < k, target_cost, draft_seconds) for k in max_lengths}
    best_k = min(static, key=lambda k: static[k]["seconds_per_token"])
    best = None
    for tau in thresholds:
        for k in max_lengths:
            r = simulate(seqs, lambda si, pos, d, tau=tau, k=k: d < k and float(probs[si][pos, d - 1]) >= tau,
                         target_cost, draft_seconds)
            if best is None or r["seconds_per_token"] < best[2]["seconds_per_token"]:
                best = (tau, k, r)
    oracle = simulate(seqs, lambda si, pos, d: d < 32 and bool(seqs[si].agree[pos]), target_cost, draft_seconds)
    rel = lambda r: round(ar / r["seconds_per_token"], 3)  # noqa: E731
    return {"threshold": best[0], "max_length": best[1],
            "simulated_speedup_over_ar": {"disco": rel(best[2]), f"static_{best_k}": rel(static[best_k]),
                                          "oracle": rel(oracle)},
            "simulated_tokens_per_call": {"disco": round(best[2]["tokens_per_call"], 3),
                                          f"static_{best_k}": round(static[best_k]["tokens_per_call"], 3),
                                          "oracle": round(oracle["tokens_per_call"], 3)},
            "best_static_length": best_k}


def _replies(dec, prompts, max_new_tokens: int, progress: bool) -> list[list[int]]:
    """The target's greedy replies: from the shipped n-gram corpus where it holds them (its documents
    are a prompt's last 8 tokens, then the reply), else generated with ``ar``."""
    corpus = dec.ngram_corpus()
    found: dict[tuple[int, ...], list[int]] = {}
    if corpus is not None:  # documents joined with -1 separators
        flat = corpus.tokens.tolist()
        docs, cur = [], []
        for t in flat:
            if t < 0:
                docs.append(cur)
                cur = []
            else:
                cur.append(t)
        # Documents follow the prompts' order, less the prompts the corpus excluded (by id).
        skip = set(corpus.meta.get("excluded", ()))
        j = 0
        for p in prompts:
            if p.id in skip:
                continue
            if j < len(docs) and docs[j][:8] == p.ids[-8:]:
                found[tuple(p.ids)] = docs[j][8:8 + max_new_tokens]
            j += 1
    out = []
    for p in tqdm(prompts, desc="replies", disable=not progress):
        r = found.get(tuple(p.ids))
        out.append(r if r is not None else dec.generate_ids([p.ids], "ar", max_new_tokens).tokens[0])
    return out


def run_train_disco(args) -> dict:
    """The ``specdec train-disco`` command: returns the summary it writes beside the classifier."""
    from specdec.api import SpecDecoder
    from specdec.prompts import read_prompts

    t0 = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dec = SpecDecoder(args.target, draft=args.draft, dtype=args.dtype, linear=args.linear, compile="off")
    draft, _ = dec.get_draft()
    prompts = read_prompts(args.prompts, dec, args.limit)
    excluded = []
    if args.exclude:  # the evaluation prompts: a stop rule tuned on them would be tuned on the test
        held_out = {tuple(p.ids) for p in read_prompts(args.exclude, dec)}
        excluded = [p.id for p in prompts if tuple(p.ids) in held_out]
        prompts = [p for p in prompts if tuple(p.ids) not in held_out]
    if not prompts:
        raise ValueError(f"no prompts in {args.prompts}")
    key = hashlib.sha256(json.dumps([draft_fingerprint(draft), args.dtype, args.sim_length, args.max_new_tokens,
                                     [p.ids for p in prompts]]).encode()).hexdigest()[:16]
    cached = Path(args.work) / f"disco_data_{key}.pt" if args.work else None
    if cached is not None and cached.is_file():  # the teacher-forced data of an earlier run (same inputs)
        seqs = [Sequence(**r) for r in torch.load(cached, weights_only=True)]
    else:
        replies = _replies(dec, prompts, args.max_new_tokens, True)
        seqs = build_sequences(dec, prompts, replies, draft, args.sim_length)
        if cached is not None:
            cached.parent.mkdir(parents=True, exist_ok=True)
            torch.save([vars(q) for q in seqs], cached)
    held = distill_held_out(args.draft) if args.validation == "distill-held-out" else None
    if args.validation == "distill-held-out" and held is None:
        raise ValueError(f"draft {args.draft!r} lists no held-out prompts (distill_summary.json held_out_ids): "
                         "use --validation hash")
    train, val = split_by_prompt(seqs, args.val_fraction, held)
    if not train or not val:
        raise ValueError(f"{len(seqs)} usable prompts: too few for a train/validation split")
    meta = {"draft": args.draft, "draft_fingerprint": draft_fingerprint(draft), "target": args.target,
            "labels": args.labels, "layout": LAYOUT}
    model = train_classifier(train, soft=args.labels == "soft", hidden=args.hidden, epochs=args.epochs, meta=meta)
    cost = dec.step_cost()
    target_cost = [cost(d + 1) for d in range(33)]  # [d] = a step with d drafted tokens (d + 1 nodes)
    draft_s = dec.draft_seconds()
    calibration = fit_calibration(model, val)
    tuned = tune(model, val, target_cost, draft_s, calibration=calibration)
    model.meta.update({"threshold": tuned["threshold"], "max_length": tuned["max_length"],
                       "calibration": [calibration.a, calibration.b]})
    model.save(out / "disco.pt")
    held_out = {c: None for c in sorted({s.category for s in seqs})}
    if args.leave_one_out:
        for c in held_out:
            rest = [s for s in train if s.category != c]
            only = [s for s in val if s.category == c]  # prompts the draft never saw, of the left-out category
            if rest and only:
                m = train_classifier(rest, soft=args.labels == "soft", hidden=args.hidden, epochs=args.epochs)
                held_out[c] = evaluate(m, only)["auc"]
    transfer = None
    if args.transfer:
        other = DiscoClassifier.load(args.transfer)
        transfer = {"classifier": str(args.transfer), "trained_for": other.meta.get("draft"),
                    "auc_on_this_draft": evaluate(other, val)["auc"]}
    summary = {
        "command": "specdec " + " ".join(sys.argv[1:]),
        "target": args.target, "draft": args.draft, "dtype": args.dtype, "prompts": str(args.prompts),
        "labels": args.labels, "label_note": "hard: the draft's argmax equals the target's at that position (the "
        "greedy acceptance rule this classifier stops for); soft: 1 - TV(draft, target), the acceptance "
        "probability of a sampled draft token",
        "features": list(FEATURES), "hidden": args.hidden, "epochs": args.epochs, "sim_length": args.sim_length,
        "excluded": excluded, "validation_split": args.validation, "prompts_used": len(seqs), "train_prompts": len(train), "validation_prompts": len(val),
        "train_positions": int(sum(len(s.agree) for s in train)), "validation": evaluate(model, val),
        "validation_calibrated": {"platt": [round(calibration.a, 4), round(calibration.b, 4)],
                                  "reliability": evaluate(model, val, calibration)["reliability"]},
        "leave_one_category_out_auc": held_out if args.leave_one_out else None, "transfer": transfer,
        "costs": {"target_step_seconds": [round(c, 5) for c in target_cost[:9]], "draft_step_seconds": round(draft_s, 5)},
        "tuned": tuned, "seconds": round(time.perf_counter() - t0, 1),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary
