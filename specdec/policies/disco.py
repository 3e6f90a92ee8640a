"""DISCO (Mamou et al., "Dynamic Speculation Lookahead"): a small classifier over the draft's own
distribution decides, after every drafted token, whether drafting goes on.

Features are scale-free (no token ids), so one classifier can serve other drafts and models: the
draft distribution's 10 largest probabilities (sorted), its entropy divided by ``log V`` of the
draft's vocabulary, the depth in this step's draft and ``log(1 + position)`` in the generation
(the paper's "position counted from the beginning of the generation"). They come from the fused
:func:`specdec.kernels.topk_entropy`.

Two ways to stop (:class:`DiscoStop`): the paper's (go on while the calibrated acceptance probability
is at least a threshold tuned on a validation split) and a cost mode (go on while the expected
accepted tokens of one more draft token pay for its draft forward and the extra verification cost,
from the measured step costs), which needs no per-machine threshold. Every verified draft token
recalibrates the classifier online (:class:`PlattCalibration`), so a new workload needs no
relabelling. Stopping reads only the drafted prefix: output stays exactly the target's.
"""
from __future__ import annotations

import math
import time
from pathlib import Path

import torch
from torch import nn

from specdec import kernels
from specdec.contracts import StopRule
from specdec.policies.planner import next_draft_token_pays

TOPK = 10
FEATURES = tuple(f"top{i + 1}" for i in range(TOPK)) + ("entropy_over_log_v", "depth", "log1p_position")
LAYOUT = "disco-v1:" + ",".join(FEATURES)
FORMAT = "specdec-disco-1"


def disco_features(logits: torch.Tensor, depth: torch.Tensor | int, position: torch.Tensor) -> torch.Tensor:
    """The classifier's input for every row.

    logits: ``[N, V]`` the draft's logits at the drafted position (its own, possibly reduced, vocabulary);
    depth: ``[N]`` or an int, the drafted token's depth (1 = first draft token of the step);
    position: ``[N]`` the drafted token's index among the generated tokens (0 = the first new token).
    Returns ``[N, len(FEATURES)]`` fp32.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got {tuple(logits.shape)}")
    n, v = logits.shape
    if v < 2:
        raise ValueError("DISCO features need a vocabulary of at least 2 tokens")
    logits = logits.float()
    if not bool(torch.isfinite(logits.amax(-1)).all()):
        raise ValueError("draft logits hold NaN or are all -inf: no distribution to read features from")
    probs, _, entropy, _ = kernels.topk_entropy(logits, min(TOPK, v))
    if probs.shape[1] < TOPK:
        probs = nn.functional.pad(probs, (0, TOPK - probs.shape[1]))
    depth = torch.as_tensor(depth, dtype=torch.float32, device=logits.device).expand(n)
    pos = torch.log1p(position.to(device=logits.device, dtype=torch.float32))
    return torch.cat([probs, (entropy / math.log(v))[:, None], depth[:, None], pos[:, None]], dim=1)


class DiscoClassifier(nn.Module):
    """The paper's 2-layer feed-forward classifier: features ``[N, F]`` -> acceptance logit ``[N]``.

    ``meta`` travels with the weights: the draft it was trained for (:func:`draft_fingerprint`), the
    feature layout, the tuned ``threshold`` and ``max_length`` (paper mode), and how it was trained.
    """

    def __init__(self, hidden: int = 32, meta: dict | None = None):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(len(FEATURES), hidden), nn.ReLU(), nn.Linear(hidden, 1))
        # Standardisation of the inputs, fitted on the training data (kept as buffers, saved with the weights).
        self.register_buffer("mean", torch.zeros(len(FEATURES)))
        self.register_buffer("std", torch.ones(len(FEATURES)))
        self.meta = dict(meta or {})

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.net((features - self.mean) / self.std).squeeze(-1)

    def save(self, path: str | Path) -> None:
        torch.save({"format": FORMAT, "layout": LAYOUT, "hidden": self.net[0].out_features,
                    "state_dict": self.state_dict(), "meta": self.meta}, path)

    @classmethod
    def load(cls, path: str | Path, draft_fingerprint: str | None = None) -> "DiscoClassifier":
        """Load ``path``; with ``draft_fingerprint``, refuse a classifier trained for another draft."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no DISCO classifier at {path} (train one with `specdec train-disco`)")
        try:
            blob = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unreadable file is the same user error
            raise ValueError(f"{path} is not a DISCO classifier file: {e}") from None
        if not isinstance(blob, dict) or blob.get("format") != FORMAT:
            raise ValueError(f"{path} is not a DISCO classifier file (format {FORMAT!r})")
        if blob.get("layout") != LAYOUT:
            raise ValueError(f"{path} was trained on another feature layout ({blob.get('layout')!r}); this build "
                             f"reads {LAYOUT!r}: retrain it with `specdec train-disco`")
        meta = blob.get("meta", {})
        if draft_fingerprint is not None and meta.get("draft_fingerprint") != draft_fingerprint:
            raise ValueError(f"{path} was trained for draft {meta.get('draft')!r} ({meta.get('draft_fingerprint')}), "
                             f"not this one ({draft_fingerprint}): train one for it with `specdec train-disco`")
        model = cls(int(blob["hidden"]), meta)
        model.load_state_dict(blob["state_dict"])
        return model.eval()


def draft_fingerprint(model: nn.Module) -> str:
    """An identity of a draft model for classifier files: architecture, parameter count, output width."""
    vocab = getattr(model, "draft_vocab_size", None) or model.get_output_embeddings().weight.shape[0]
    return f"{model.config.model_type}:{sum(p.numel() for p in model.parameters())}:{vocab}"


class PlattCalibration:
    """``sigmoid(a * z + b)`` over the classifier's logit ``z``, refitted online from verified tokens.

    Starts at ``(a0, b0)`` (the fit on the training run's validation split, stored with the classifier);
    every verified draft token is one (logit, accepted) pair, and a few Newton steps on the logistic loss
    over a sliding window of recent pairs (with a weak prior at the start) keep the probabilities honest
    on the workload at hand. ``reset`` returns to the start.
    """

    def __init__(self, a0: float = 1.0, b0: float = 0.0, window: int = 2048, prior: float = 20.0,
                 refit_every: int = 64):
        self.a0, self.b0 = float(a0), float(b0)
        self.window, self.prior, self.refit_every = window, prior, refit_every
        self.reset()

    def reset(self) -> None:
        self.a, self.b = self.a0, self.b0
        self._z: list[float] = []
        self._y: list[float] = []
        self._new = 0

    @property
    def seen(self) -> int:
        return len(self._z)

    def estimate(self, z: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.a * z + self.b)

    def observe(self, z: list[float], y: list[float]) -> None:
        """Pairs of classifier logits and outcomes (1 accepted, 0 rejected)."""
        self._z = (self._z + list(z))[-self.window:]
        self._y = (self._y + list(y))[-self.window:]
        self._new += len(z)
        if self._new >= self.refit_every:
            self._new = 0
            self.refit()

    def refit(self, steps: int = 5) -> None:
        """Newton steps on the pairs seen (the prior keeps an empty or one-sided window near the start)."""
        z = torch.tensor(self._z, dtype=torch.float64)
        y = torch.tensor(self._y, dtype=torch.float64)
        x = torch.stack([z, torch.ones_like(z)], 1)
        w = torch.tensor([self.a, self.b], dtype=torch.float64)
        anchor = torch.tensor([self.a0, self.b0], dtype=torch.float64)
        for _ in range(steps):
            p = torch.sigmoid(x @ w)
            grad = x.T @ (p - y) + self.prior * (w - anchor)
            hess = (x.T * (p * (1 - p))) @ x + self.prior * torch.eye(2, dtype=torch.float64)
            w = w - torch.linalg.solve(hess, grad)
        self.a, self.b = float(w[0]), float(w[1])


class DiscoStop(StopRule):
    """The DISCO stop rule for a model drafter.

    mode ``"paper"``: a row goes on drafting while its last token's calibrated acceptance probability is
    at least ``threshold``. mode ``"cost"``: a row goes on while one more draft token's expected accepted
    tokens (the chance the whole draft so far is accepted times the last token's) are worth, at the
    row's current seconds per emitted token, more than one draft forward (``draft_seconds``, measured
    between calls) plus the verification cost of one more node (``cost``, the target's
    :class:`~specdec.policies.StepCost`). The depth cap is the budget's (the policy's maximum length).
    """

    keeps_rows = True  # keep_rows moves the rows' positions

    def __init__(self, classifier: DiscoClassifier, mode: str = "paper", threshold: float | None = None,
                 calibration: PlattCalibration | None = None, cost=None, draft_seconds: float | None = None):
        if mode not in ("paper", "cost"):
            raise ValueError(f"DISCO mode must be 'paper' or 'cost', got {mode!r}")
        threshold = classifier.meta.get("threshold", 0.5) if threshold is None else threshold
        if not 0.0 <= float(threshold) <= 1.0:
            raise ValueError(f"DISCO threshold must be in [0, 1], got {threshold}")
        if mode == "cost" and (cost is None or draft_seconds is None):
            raise ValueError("DISCO cost mode needs the target's step cost and the draft's step seconds")
        self.classifier, self.mode, self.threshold = classifier, mode, float(threshold)
        self.calibration = calibration or PlattCalibration()
        self.cost, self.draft_seconds = cost, draft_seconds
        self._step_cost = cost  # this step's table (:meth:`keep_going` picks the batch's)
        self._position: list[int] = []

    def begin(self, batch_size: int, state=None) -> None:
        self._position = [1] * batch_size  # the first new token comes from the prefill
        self._step_cost = self.cost
        self._logits: list[torch.Tensor] = []
        self._reach: list[torch.Tensor] = []
        self._last_call = None

    def keep_rows(self, rows: list[int]) -> None:
        # update() consumed the step's logits; _start and _reach are rebuilt at the next step's first token
        self._position = [self._position[r] for r in rows]

    def keep_going(self, depth: int, logits: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        now = time.perf_counter()
        if depth == 1:
            self._logits = []
            self._start = torch.tensor(self._position, device=logits.device)  # one host copy per step
            # The rows drafting now are verified together: their batch's own step costs, where measured.
            self._step_cost = None if self.cost is None else self.cost.for_batch(logits.shape[0])
        elif self.mode == "cost" and self._last_call is not None:  # one draft forward since the previous token
            self.draft_seconds = 0.9 * self.draft_seconds + 0.1 * (now - self._last_call)
        position = self._start + (depth - 1)
        with torch.no_grad():
            z = self.classifier(disco_features(logits, depth, position))
        self._logits.append(z)
        p = self.calibration.estimate(z)
        if self.mode == "paper":
            going = p >= self.threshold
        else:
            self._reach = [p] if depth == 1 else self._reach + [self._reach[-1] * p]
            going = next_draft_token_pays(self._reach, p, self._step_cost.costs(depth + 2), self.draft_seconds)
        self._last_call = time.perf_counter()
        return going

    def update(self, drafted: list[int], accepted: list[int], rows: list[int] | None = None) -> None:
        rows = list(range(len(drafted))) if rows is None else rows
        if self._logits:
            z = torch.stack(self._logits, 1).tolist()  # [B, depth drafted]
            zs, ys = [], []
            for r, d, a in zip(rows, drafted, accepted):
                # Verified outcomes: the accepted tokens, and the first rejected one (later ones were never judged).
                for i in range(min(d, a + 1, len(z[r]))):
                    zs.append(z[r][i])
                    ys.append(1.0 if i < a else 0.0)
            self.calibration.observe(zs, ys)
        self._logits = []
        for r, a in zip(rows, accepted):
            self._position[r] += a + 1


@torch.no_grad()
def tree_accept(classifier: DiscoClassifier, calibration: PlattCalibration | None, tree, node_logits: torch.Tensor,
                position: torch.Tensor) -> torch.Tensor:
    """Per-node reach estimates for any draft tree whose nodes a draft model proposed: the chance that
    every node on the path from the root is accepted, each node's own chance from the classifier (and
    the online calibration). Set them as ``tree.accept`` and :func:`specdec.policies.prune` cuts the
    tree by the same cost rule as n-gram nodes.

    tree: a :class:`~specdec.tree.DraftTree` ``[B,T]``; node_logits: ``[B,T,V]`` the draft's logits each
    node's token was picked from (the root's row is ignored); position: ``[B]`` the index among the
    generated tokens of each row's first draft token. Returns ``[B,T]`` fp32 (1 at the root, 0 at padding).
    """
    b, t = tree.tokens.shape
    depth = tree.depth
    flat = node_logits.reshape(b * t, -1)
    pos = (position[:, None] + (depth - 1).clamp(min=0)).reshape(-1)
    z = classifier(disco_features(flat, depth.reshape(-1).clamp(min=1), pos)).view(b, t)
    p = (calibration.estimate(z) if calibration is not None else torch.sigmoid(z)).float()
    reach = torch.ones(b, t, device=p.device)
    for i in range(1, t):  # parents come before their children
        parent = tree.parents[:, i].clamp(min=0)
        reach[:, i] = reach.gather(1, parent[:, None]).squeeze(1) * p[:, i]
    return torch.where(tree.valid, reach, 0.0)


class OracleStop(StopRule):
    """A benchmark ceiling, greedy only: each row drafts until its first token that differs from the
    target's own greedy continuation (``references``: prompt tuple -> the new tokens ``ar`` produced),
    as the paper's oracle does. It reads the reference, so it is no method, only the bound a learned
    stop rule could reach."""

    keeps_rows = True  # keep_rows moves the rows' references and positions

    def __init__(self, references: dict[tuple[int, ...], list[int]]):
        self.references = references
        self._ref: list[list[int]] = []
        self._position: list[int] = []

    def begin(self, batch_size: int, state=None) -> None:
        if state is None:
            raise ValueError("the oracle schedule needs the prompts (the decode state) at begin")
        self._ref = []
        for r in range(batch_size):
            prompt = tuple(state.seq[r, : state.seq_lens_host[r] - 1].tolist())
            if prompt not in self.references:
                raise ValueError("the oracle schedule has no reference run for this prompt (prepare the method first)")
            self._ref.append(self.references[prompt])
        self._position = [1] * batch_size

    def keep_rows(self, rows: list[int]) -> None:
        self._ref = [self._ref[r] for r in rows]
        self._position = [self._position[r] for r in rows]

    def keep_going(self, depth: int, logits: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        if tokens is None:
            raise ValueError("the oracle stop rule needs the drafted tokens")
        want = []
        for r, ref in enumerate(self._ref):
            i = self._position[r] + depth - 1
            want.append(ref[i] if i < len(ref) else -2)
        return tokens == torch.tensor(want, device=tokens.device)

    def update(self, drafted: list[int], accepted: list[int], rows: list[int] | None = None) -> None:
        for r, a in zip(range(len(drafted)) if rows is None else rows, accepted):
            self._position[r] += a + 1
