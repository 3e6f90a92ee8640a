"""A small same-tokenizer draft model with a reduced vocabulary, as a transformers model class.

``SpecdecDraftForCausalLM`` is a Llama body (a few layers, the target's width) whose embedding and
output layer cover only ``draft_vocab_size`` frequent target tokens (plus one UNK slot, shared by
every other target id). It takes TARGET token ids and, by default, returns FULL target-vocabulary
logits (``-inf`` outside the draft vocabulary), so it is an ordinary causal LM to transformers
(``generate(..., assistant_model=draft)``) and to specdec's ``ModelRunner``. Drafters that know
about it switch to the cheap path (:meth:`reduced_logits`): logits over the draft vocabulary only,
mapped back to target ids through the ``draft_vocab`` buffer.

Buffers (saved with the weights): ``draft_vocab [Vd]`` draft id -> target id (ascending, so argmax
ties break as over the full vocabulary); ``target_to_draft [Vt]`` target id -> draft id, ``Vd``
(the UNK slot) for ids outside the draft vocabulary.
"""
from __future__ import annotations

import contextlib

import torch
from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

MODEL_TYPE = "specdec_draft"


@strict
class SpecdecDraftConfig(LlamaConfig):
    """A Llama config whose ``vocab_size`` is the TARGET's (what the model's logits cover) and whose
    embedding/output layer have ``draft_vocab_size + 1`` rows (the last is the UNK slot)."""

    model_type = MODEL_TYPE
    draft_vocab_size: int = 8192
    target_model: str | None = None  # what it was distilled from (informational)


class _TargetVocabHead(nn.Module):
    """What ``get_output_embeddings()`` reports: the head as seen from the target vocabulary.

    Generic code reads the output width from ``get_output_embeddings().weight.shape[0]`` (e.g.
    specdec's same-vocabulary check); this model's logits are target-vocabulary wide, so the view
    says so. ``weight`` is a meta tensor (no memory); the real weights are ``lm_head``.
    """

    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.weight = torch.empty(vocab, hidden, device="meta")


class SpecdecDraftForCausalLM(LlamaForCausalLM):
    config_class = SpecdecDraftConfig
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: SpecdecDraftConfig):
        super().__init__(config)
        vd, h = config.draft_vocab_size, config.hidden_size
        # The Llama body built target-vocabulary layers; replace them with draft-vocabulary ones.
        self.model.embed_tokens = nn.Embedding(vd + 1, h)
        self.lm_head = nn.Linear(h, vd + 1, bias=False)
        self.register_buffer("draft_vocab", torch.arange(vd, dtype=torch.int64))
        t2d = torch.full((config.vocab_size,), vd, dtype=torch.int64)
        t2d[:vd] = torch.arange(vd)
        self.register_buffer("target_to_draft", t2d)
        self._reduced = False
        self.post_init()

    # -- vocabulary -------------------------------------------------------------------------
    @property
    def draft_vocab_size(self) -> int:
        return self.config.draft_vocab_size

    def set_vocab(self, draft_vocab: torch.Tensor) -> None:
        """Install the draft vocabulary: ``draft_vocab [Vd]`` distinct target ids (sorted here)."""
        vd = self.config.draft_vocab_size
        ids = torch.as_tensor(draft_vocab, dtype=torch.int64).sort().values
        if ids.numel() != vd or ids.unique().numel() != vd:
            raise ValueError(f"draft vocabulary must hold {vd} distinct target ids")
        self.draft_vocab.copy_(ids)
        self.target_to_draft.fill_(vd)
        self.target_to_draft[ids] = torch.arange(vd, device=ids.device)

    def get_output_embeddings(self):
        return _TargetVocabHead(self.config.vocab_size, self.config.hidden_size)

    @contextlib.contextmanager
    def reduced_logits(self):
        """Within this context the model returns ``[..., Vd]`` draft-vocabulary logits (map the
        argmax through ``draft_vocab``) instead of full target-vocabulary logits."""
        old, self._reduced = self._reduced, True
        try:
            yield self
        finally:
            self._reduced = old

    # -- forward ----------------------------------------------------------------------------
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs):
        """As ``LlamaForCausalLM.forward`` but ``input_ids`` are TARGET ids and ``labels`` are not
        supported (train with :func:`specdec.distill.train.distill_loss`)."""
        if labels is not None:
            raise ValueError("SpecdecDraftForCausalLM does not compute a loss from labels")
        if input_ids is not None:
            input_ids = self.target_to_draft[input_ids]
        out = super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                              logits_to_keep=logits_to_keep, **kwargs)
        vd = self.config.draft_vocab_size
        logits = out.logits[..., :vd]  # the UNK slot is never proposed
        if not self._reduced:
            full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
            full[..., self.draft_vocab] = logits
            logits = full
        out.logits = logits
        return out


def register(config_cls=SpecdecDraftConfig, model_cls=SpecdecDraftForCausalLM) -> None:
    """Make ``AutoConfig``/``AutoModelForCausalLM`` (and so ``specdec.hub.load_model``) know a draft class."""
    AutoConfig.register(config_cls.model_type, config_cls, exist_ok=True)
    AutoModelForCausalLM.register(config_cls, model_cls, exist_ok=True)


@torch.no_grad()
def draft_from_target(target, layers: list[int], draft_vocab: torch.Tensor, target_name: str | None = None,
                      dtype: torch.dtype = torch.float32) -> SpecdecDraftForCausalLM:
    """A draft initialised from a Llama-architecture ``target``: its layers ``layers`` (in order),
    final norm, and the embedding rows of ``draft_vocab`` (UNK slot: the mean embedding)."""
    tcfg = target.config.get_text_config()
    if tcfg.model_type != "llama":
        raise ValueError(f"draft initialisation needs a Llama-architecture target, got {tcfg.model_type!r}")
    n = tcfg.num_hidden_layers
    if not layers or any(not 0 <= i < n for i in layers):
        raise ValueError(f"layers must be indices in [0, {n})")
    fields = {k: getattr(tcfg, k) for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
        "hidden_act", "max_position_embeddings", "rms_norm_eps", "rope_parameters", "attention_bias", "mlp_bias",
        "bos_token_id", "eos_token_id", "pad_token_id")}
    cfg = SpecdecDraftConfig(**fields, num_hidden_layers=len(layers), tie_word_embeddings=True,
                             draft_vocab_size=int(draft_vocab.numel()), target_model=target_name)
    draft = SpecdecDraftForCausalLM(cfg).to(dtype)
    draft.set_vocab(draft_vocab)
    emb = target.get_input_embeddings().weight.float()
    rows = torch.cat([emb[draft.draft_vocab], emb.mean(0, keepdim=True)])
    draft.model.embed_tokens.weight.copy_(rows)
    for dst, src in zip(draft.model.layers, layers):
        dst.load_state_dict(target.model.layers[src].state_dict())
    draft.model.norm.load_state_dict(target.model.norm.state_dict())
    draft.tie_weights()
    draft.generation_config = type(target.generation_config).from_dict(target.generation_config.to_dict())
    return draft.eval()
