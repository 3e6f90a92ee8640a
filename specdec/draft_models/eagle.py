"""A feature-conditioned draft (the EAGLE idea, Li et al. 2024) as a transformers model class.

At position ``t`` the draft reads the token ``x_t`` and the target's last hidden state ``f_{t-1}``
(the state whose logits chose ``x_t``; zeros at ``t = 0``), fuses them with one linear layer
(``fc``), runs one Llama decoder layer and a final norm, and returns ``f̂_t``, a prediction of the
target's own ``f_t``; its logits (the reduced-vocabulary output layer over ``f̂_t``) propose
``x_{t+1}``. The target has already done the hard part of next-token prediction in ``f_{t-1}``,
so one layer goes much further than a small LM drafting from tokens alone. Drafting a chain feeds
the draft's own ``f̂`` back where the target's state is not known yet.

``SpecdecEagleForCausalLM`` is a :class:`~specdec.draft_models.reduced.SpecdecDraftForCausalLM` (same
vocabulary buffers, same reduced/full logits) whose ``forward`` also takes ``target_hidden``
``[B,T,H]``; without it there is nothing to condition on, so it raises. Drafters find out through
:func:`is_feature_draft`.
"""
from __future__ import annotations

import torch
from huggingface_hub.dataclasses import strict
from torch import nn

from specdec.draft_models.reduced import SpecdecDraftConfig, SpecdecDraftForCausalLM, draft_from_target

MODEL_TYPE = "specdec_eagle"


@strict
class SpecdecEagleConfig(SpecdecDraftConfig):
    """A :class:`SpecdecDraftConfig` for the feature-conditioned draft (``num_hidden_layers`` is
    normally 1)."""

    model_type = MODEL_TYPE


class SpecdecEagleForCausalLM(SpecdecDraftForCausalLM):
    config_class = SpecdecEagleConfig

    def __init__(self, config: SpecdecEagleConfig):
        super().__init__(config)
        h = config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=True)
        with torch.no_grad():  # start as "embedding plus a little of the target state"
            self.fc.weight.zero_()
            self.fc.weight[:, :h].copy_(torch.eye(h))
            self.fc.weight[:, h:].copy_(torch.eye(h) * 0.1)
            self.fc.bias.zero_()

    def fuse(self, input_ids: torch.Tensor, target_hidden: torch.Tensor) -> torch.Tensor:
        """input_ids: ``[B,T]`` TARGET ids; target_hidden: ``[B,T,H]`` the target's last hidden state
        at the position before each token. Returns the decoder layer's input ``[B,T,H]``."""
        if target_hidden.shape[:-1] != input_ids.shape or target_hidden.shape[-1] != self.config.hidden_size:
            raise ValueError(f"target_hidden must be [B,T,{self.config.hidden_size}] for input_ids "
                             f"{list(input_ids.shape)}, got {list(target_hidden.shape)}")
        emb = self.model.embed_tokens(self.target_to_draft[input_ids])
        return self.fc(torch.cat([emb, target_hidden.to(emb.dtype)], dim=-1))

    def forward(self, input_ids=None, target_hidden=None, attention_mask=None, position_ids=None,
                past_key_values=None, inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs):
        """As :meth:`SpecdecDraftForCausalLM.forward`, with ``target_hidden [B,T,H]`` required beside
        ``input_ids`` (or pass ``inputs_embeds`` from :meth:`fuse`)."""
        if inputs_embeds is None:
            if input_ids is None or target_hidden is None:
                raise ValueError("a feature-conditioned (EAGLE) draft needs the target's hidden states "
                                 "(target_hidden) beside input_ids; drive it with specdec's sd method, "
                                 "not as a stand-alone causal LM (e.g. not with hf-assisted)")
            inputs_embeds = self.fuse(input_ids, target_hidden)
        return super().forward(attention_mask=attention_mask, position_ids=position_ids,
                               past_key_values=past_key_values, inputs_embeds=inputs_embeds, labels=labels,
                               use_cache=use_cache, logits_to_keep=logits_to_keep, **kwargs)


def is_feature_draft(model) -> bool:
    """Whether ``model`` drafts from the target's hidden states (needs ``target_hidden``)."""
    return isinstance(model, SpecdecEagleForCausalLM)


def warm_up_inputs(model):
    """The extra inputs beside ``t`` tokens that compiling or timing ``model`` needs, as a callable
    ``t -> dict`` for :meth:`specdec.model.ModelRunner.warm_up` and
    :meth:`specdec.policies.StepCost.calibrate`: zero target states ``[1,t,H]`` (the zeros of a first
    position) for a feature-conditioned draft; None for any other model (it takes none)."""
    if not is_feature_draft(model):
        return None
    width, device, dtype = model.config.hidden_size, model.device, model.dtype
    return lambda t: {"target_hidden": torch.zeros(1, t, width, device=device, dtype=dtype)}


@torch.no_grad()
def eagle_from_target(target, layers: list[int], draft_vocab: torch.Tensor, target_name: str | None = None,
                      dtype: torch.dtype = torch.float32) -> SpecdecEagleForCausalLM:
    """A feature-conditioned draft initialised like :func:`draft_from_target` (the target's layers
    ``layers``, final norm, and the embedding rows of ``draft_vocab``) plus the fusion layer."""
    plain = draft_from_target(target, layers, draft_vocab, target_name, dtype)
    cfg = SpecdecEagleConfig(**plain.config.to_dict())
    draft = SpecdecEagleForCausalLM(cfg).to(dtype)
    missing, unexpected = draft.load_state_dict(plain.state_dict(), strict=False)
    if unexpected or any(not k.startswith("fc.") for k in missing):
        raise RuntimeError(f"draft initialisation mismatch: missing {missing}, unexpected {unexpected}")
    draft.tie_weights()
    draft.generation_config = plain.generation_config
    return draft.eval()
