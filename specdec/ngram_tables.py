"""Model-derived n-gram tables (N-Grammys, Stewart et al. 2024, section 4.1).

- :func:`unigram_ranking`: a context-free token ranking from the embedding matrices.
- :func:`bigram_topk`: the model's own next-token top-k after every single vocabulary token.
- :func:`extend_bigram`: the top-k bigram rows extended to ``w`` tokens by chaining the top-1 bigram.

The bigram table costs one forward per vocabulary entry, so :func:`load_tables` computes it once
per model and keeps it on disk under a key that hashes the weights: a fine-tuned or re-converted
model never reuses a stale table.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # the drafter reads tables without loading transformers
    from transformers import PreTrainedModel

TABLE_VERSION = 1  # bump when the way tables are computed changes


def unigram_ranking(input_embeddings: torch.Tensor, output_embeddings: torch.Tensor) -> torch.Tensor:
    """Tokens ranked by the paper's unigram ``p(x) ~ exp(-||u_x - u_mean||_V)``, most likely first.

    The inner product ``<a, b>_V = a^T (E^T E / V) b`` compares two output embeddings by the logits
    they induce over the input embeddings ``E``; tokens whose output embedding sits near the mean
    are the ones the model predicts in "average" contexts. (The paper's appendix code ranks by an
    uncentred inner product instead; we follow the formula in the text.)

    input_embeddings: ``[V, d]``; output_embeddings: ``[V, d]``. Returns ``[V] int64`` token ids.
    """
    if input_embeddings.shape[1] != output_embeddings.shape[1]:
        raise ValueError("input and output embeddings need the same width")
    e = input_embeddings.double()
    u = output_embeddings.double()
    cov = e.T @ e / e.shape[0]
    centred = u - u.mean(0, keepdim=True)
    dist2 = ((centred @ cov) * centred).sum(-1)
    return torch.sort(dist2.clamp(min=0).sqrt(), stable=True).indices


@torch.inference_mode()
def bigram_topk(model: PreTrainedModel, k: int, batch_size: int = 1024, progress: bool = False) -> torch.Tensor:
    """``[V, k] int64``: row ``x`` holds the model's top-``k`` next tokens after the one-token input ``x``.

    Every vocabulary entry is run as its own sequence of length one (batched ``[batch_size, 1]``),
    so position 0 and no other context: the model's pure bigram.
    """
    vocab = model.get_output_embeddings().weight.shape[0]
    if not 1 <= k <= vocab:
        raise ValueError(f"k must be in [1, {vocab}], got {k}")
    device = model.device
    out = torch.empty(vocab, k, dtype=torch.int64)
    starts = range(0, vocab, batch_size)
    if progress:
        from tqdm import tqdm

        starts = tqdm(starts, desc="bigram table", unit="batch")
    for s in starts:
        ids = torch.arange(s, min(s + batch_size, vocab), device=device)[:, None]
        logits = model(input_ids=ids, use_cache=False).logits[:, -1].float()
        out[s: s + ids.shape[0]] = logits.topk(k, dim=-1).indices.cpu()
    return out


def extend_bigram(bigram: torch.Tensor, w: int, rows: torch.Tensor | None = None, k: int | None = None) -> torch.Tensor:
    """Extended bigram ``[V, k, w] int64``: row ``(x, i)`` is ``[b_i, t(b_i), t(t(b_i)), ...]`` with
    ``b_i = bigram[x, i]`` and ``t(y) = bigram[y, 0]`` (the "chained" extension of the paper).

    rows: ``[B]`` token ids to extend (default every vocabulary entry) -> ``[B, k, w]``; k: the first
    ``k`` bigram columns only (default all). A decoding step extends just its last tokens this way,
    in ``w - 1`` gathers, instead of building the whole table."""
    if w < 1:
        raise ValueError(f"w must be >= 1, got {w}")
    first = bigram if rows is None else bigram[rows]
    cols = [first if k is None else first[:, :k]]
    top1 = bigram[:, 0]
    for _ in range(w - 1):
        cols.append(top1[cols[-1]])
    return torch.stack(cols, dim=-1)


def weights_key(model: PreTrainedModel) -> str:
    """A hex digest of the model's config, parameter names, dtypes and bytes: changes with any weight."""
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps(model.config.to_dict(), sort_keys=True, default=str).encode())
    for name, t in sorted(model.state_dict().items()):
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@dataclass
class NGramTables:
    """What the N-Grammys drafter reads: ``bigram [V, k_max]`` and ``unigram [V]`` (token ids)."""

    bigram: torch.Tensor
    unigram: torch.Tensor
    _copies: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def bigram_on(self, device: torch.device | str) -> torch.Tensor:
        """``bigram`` on ``device`` (copied once per device and kept)."""
        device = torch.device(device)
        if self.bigram.device == device:
            return self.bigram
        if device not in self._copies:
            self._copies[device] = self.bigram.to(device)
        return self._copies[device]


def compute_tables(model: PreTrainedModel, k_max: int = 32, progress: bool = False) -> NGramTables:
    """Compute both tables from ``model`` (one forward per vocabulary token for the bigram)."""
    uni = unigram_ranking(model.get_input_embeddings().weight.detach().cpu(),
                          model.get_output_embeddings().weight.detach().cpu())
    return NGramTables(bigram_topk(model, k_max, progress=progress), uni)


def load_tables(model: PreTrainedModel, cache: Path | str, k_max: int = 32, progress: bool = True) -> NGramTables:
    """Tables for ``model``, from the folder ``cache`` or computed and saved there (the decoder passes
    :func:`specdec.hub.tables_cache_dir`)."""
    path = Path(cache) / f"v{TABLE_VERSION}-k{k_max}-{weights_key(model)}.pt"
    if path.exists():
        data = torch.load(path, weights_only=True)
        return NGramTables(data["bigram"].long(), data["unigram"].long())
    tables = compute_tables(model, k_max, progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"bigram": tables.bigram.int(), "unigram": tables.unigram.int()}, tmp)
    tmp.rename(path)  # atomic: a half-written table is never loaded
    return tables
