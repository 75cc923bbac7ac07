"""The critic (PPO): a value model, V(s_t) for the state before each response token, trained
with the clipped value loss ½·max((V − R)², (V_clip − R)²) against the GAE returns R."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from transformers import AutoModelForTokenClassification
from transformers.utils import logging as hf_logging

from dagrl.algorithms.loss_agg import agg_loss
from dagrl.algorithms.value_loss import clipped_value_loss
from dagrl.config.model_source import check_model_dir
from dagrl.config.schema import CriticConfig
from dagrl.data.batch import Batch, response_attention
from dagrl.engines.attention import resolve_attn_implementation
from dagrl.engines.forward import batch_values, response_values
from dagrl.engines.layout import EngineLayout
from dagrl.engines.models import DTYPES, _disable_dropout
from dagrl.engines.train_engine import TrainEngine, token_mean
from dagrl.observe.metrics import StepMetrics


def load_value_model(path: str, dtype: str, device: torch.device,
                     attn_implementation: str = "auto") -> torch.nn.Module:
    """A causal-LM checkpoint as a value model: the same backbone with a new scalar head
    (`*ForTokenClassification` with one label: one value per position)."""
    check_model_dir(path, "")
    # transformers prints a LOAD REPORT table naming the new head MISSING (and an untied LM
    # head UNEXPECTED) on every load of a causal LM as a value model: by design here, so the
    # table is silenced and any other key is named in one line instead.
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model, info = AutoModelForTokenClassification.from_pretrained(
            path, num_labels=1, dtype=DTYPES[dtype], local_files_only=True,
            attn_implementation=resolve_attn_implementation(attn_implementation, device),
            output_loading_info=True)
    finally:
        hf_logging.set_verbosity(verbosity)
    other = sorted({*(k for k in info["missing_keys"] if not k.startswith("score.")),
                    *(k for k in info["unexpected_keys"] if not k.startswith("lm_head."))})
    if other:
        print(f"[dagrl] warning: value model {path}: weights missing or unused besides the new "
              f"value head: {', '.join(other[:8])}{' ...' if len(other) > 8 else ''}",
              flush=True)
    _disable_dropout(model)
    return model.to(device)


class CriticEngine(TrainEngine):
    name = "critic"
    loss_metric = "vf_loss"

    def __init__(self, model: torch.nn.Module, cfg: CriticConfig, layout: EngineLayout, *,
                 loss_agg_mode: str) -> None:
        """`layout`: see TrainEngine (the critic steps on the actor's mini-batches)."""
        super().__init__(model, cfg, layout, loss_agg_mode=loss_agg_mode,
                         micro_batch_size=cfg.micro_batch_size, epochs=cfg.ppo_epochs,
                         max_tokens_per_micro_batch=cfg.max_tokens_per_micro_batch)
        self.cfg = cfg

    def compute_values(self, batch: Batch) -> torch.Tensor:
        self.model.eval()
        with self.autocast():
            return batch_values(self.model, batch, micro_batch_size=self.micro_batch_size,
                                max_tokens=self.max_tokens, pack=self.pack,
                                share_prompts=self.share_prompts)

    def micro_loss(self, micro: Batch, denoms: Mapping[str, float], metrics: StepMetrics):
        mask = micro["response_mask"]
        with self.autocast():
            values = response_values(self.model, micro["prompt_ids"], micro["prompt_mask"],
                                     micro["responses"], mask,
                                     attention_mask=response_attention(micro), pack=self.pack,
                                     share_prompts=self.share_prompts)
        loss_mat, stats = clipped_value_loss(values, micro["values"], micro["returns"], mask,
                                             cliprange_value=self.cfg.cliprange_value)
        loss = agg_loss(loss_mat, mask, self.loss_agg_mode, denom=denoms[self.loss_agg_mode])
        token_mean(metrics, "critic/values", values, mask)
        for name, value in stats.items():
            token_mean(metrics, f"critic/{name}", value, mask)
        return loss, loss
