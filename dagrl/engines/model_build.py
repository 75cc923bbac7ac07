"""What each engine's model is made of, given the layout: one recipe per model, called by the
engine build (bundle.py) on the loaded checkpoint and by `dagrl plan --memory`
(memory_estimate.py) on the same model built on the meta device from its config (no memory, no
weights read), so the estimate counts the parameters the run will hold: the LoRA adapters
peft adds, the reference's low-precision linears, the value and score heads.
"""

from __future__ import annotations

import copy

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from dagrl.config.schema import LoraConfig
from dagrl.engines.layout import EngineLayout
from dagrl.engines.lora import apply_lora
from dagrl.engines.models import DTYPES, causal_lm_class, plain_config
from dagrl.engines.precision import store_linears_in_low_precision

# The HF class of each kind of model dagrl loads: the policy (and its reference and rollout
# copy), the critic (one value per position) and the reward model (one score per sequence).
HEADS = {"causal_lm": AutoModelForCausalLM, "value": AutoModelForTokenClassification,
         "score": AutoModelForSequenceClassification}


def actor_model(base: torch.nn.Module, layout: EngineLayout, lora: LoraConfig
                ) -> torch.nn.Module:
    """The trained policy: the base model, wrapped in LoRA adapters when the layout has them
    (before sharding; activation checkpointing and compile do not change what it holds)."""
    if layout.lora_rank:
        return apply_lora(base, layout.lora_rank, lora.alpha, lora.target_modules, lora.dropout)
    return base


def reference_model(base: torch.nn.Module, layout: EngineLayout) -> torch.nn.Module:
    """The frozen reference of its own (not under LoRA, see `EngineLayout.ref_is_actor`): its
    linears in the autocast dtype under mixed precision (engines/precision.py)."""
    return store_linears_in_low_precision(base.eval().requires_grad_(False),
                                          layout.mixed_precision)


def meta_model(config, dtype: str, head: str = "causal_lm") -> torch.nn.Module:
    """The model `load_model` (causal_lm), `load_value_model` (value) or `load_reward_model`
    (score) would give for a checkpoint with this HF `config`, on the meta device."""
    config = copy.deepcopy(plain_config(config))
    if head != "causal_lm":
        config.num_labels = 1
    auto = causal_lm_class(config) if head == "causal_lm" else HEADS[head]
    with torch.device("meta"):
        return auto.from_config(config, dtype=DTYPES[dtype])
