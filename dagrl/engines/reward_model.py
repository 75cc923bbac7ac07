"""A discriminative reward model: a Hugging Face `*ForSequenceClassification` with one label
scores each (prompt, response) pair with one scalar, as in verl's and OpenRLHF's reward-model
workers.

The reward model has its own tokenizer: the policy's response is decoded to text (a multi-turn
episode whole, tool results included, as verl's reward-model worker decodes it:
roles/score.episode_texts) and the pair is rendered with the reward model's chat template
(prompt messages + the response as the assistant turn), or, without one, the message contents
joined by newlines. With several workers the model is FSDP2-sharded over them like the
critic; it is never trained.

The score of a sample is the classification head's output at the sample's last token:
    r_i = w^T h_i[L_i - 1] + b         h_i: final hidden states [L_i, H], L_i tokens
Batches are right-padded and the head's per-position output [B, T, 1] is read at L_i - 1, so
padding never enters the score (the model's own pooling finds the last token through the pad
id, which fails when the pad id is also a real token such as EOS).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForSequenceClassification

from dagrl.config.model_source import check_model_dir
from dagrl.engines.attention import resolve_attn_implementation
from dagrl.engines.models import DTYPES


class RewardModelError(ValueError):
    """The reward model directory holds something that cannot score samples."""


def load_reward_model(path: str, dtype: str, device: torch.device,
                      attn_implementation: str = "auto") -> torch.nn.Module:
    """The sequence classifier in `path`; it must have exactly one label (a scalar reward)."""
    check_model_dir(path, "", section="reward_model")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    if getattr(config, "num_labels", 1) != 1:
        raise RewardModelError(f"reward_model.path: {path!r} has {config.num_labels} labels; a "
                               "reward model has one (a scalar score per sample)")
    model = AutoModelForSequenceClassification.from_pretrained(
        path, local_files_only=True, dtype=DTYPES[dtype],
        attn_implementation=resolve_attn_implementation(attn_implementation, device))
    if not isinstance(getattr(model, "score", None), torch.nn.Module):
        raise RewardModelError(f"reward_model.path: {type(model).__name__} has no `score` head "
                               "(the Llama/Qwen2/Mistral/Gemma sequence classifiers have one)")
    return model.eval().requires_grad_(False).to(device)


def render_pair(tokenizer, prompt: Any, response: str) -> str:
    """The text the reward model reads: chat template over prompt + assistant response, or the
    contents joined by newlines when the tokenizer has no template."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    messages.append({"role": "assistant", "content": response})
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False)
    return "\n".join(m["content"] for m in messages)


class RewardModelEngine:
    """Scores samples with a (possibly sharded) sequence classifier; every rank holding a shard
    must call `score` together, with the same number of micro-batches."""

    def __init__(self, model: torch.nn.Module, tokenizer, *, micro_batch_size: int,
                 max_length: int, device: torch.device) -> None:
        self.model = model
        # The model's own pooling (computed, then ignored) refuses batches without a pad id.
        model.config.pad_token_id = tokenizer.pad_token_id
        self.tokenizer = tokenizer
        self.micro_batch_size = micro_batch_size
        self.max_length = max_length
        self.device = device

    def encode(self, prompts: Sequence[Any], responses: Sequence[str]) -> list[list[int]]:
        """Token ids per sample, keeping the last max_length tokens of a longer input."""
        ids = []
        for prompt, response in zip(prompts, responses, strict=True):
            text = render_pair(self.tokenizer, prompt, response)
            tokens = self.tokenizer(text, add_special_tokens=not self.tokenizer.chat_template)
            ids.append(tokens["input_ids"][-self.max_length:])
        return ids

    @torch.no_grad()
    def score_ids(self, ids: Sequence[Sequence[int]]) -> torch.Tensor:
        """Scores [N] (float32) of N token sequences. Sharded ranks hold equal shares of the
        batch, so they run the same number of forward passes (each one all-gathers)."""
        head_out: list[torch.Tensor] = []
        hook = self.model.score.register_forward_hook(lambda m, i, out: head_out.append(out))
        scores = []
        try:
            mb = self.micro_batch_size
            for k in range(-(-len(ids) // mb)):
                chunk = ids[k * mb:(k + 1) * mb]
                lengths = torch.tensor([len(t) for t in chunk])
                width = int(lengths.max())
                input_ids = torch.full((len(chunk), width), self.tokenizer.pad_token_id)
                mask = torch.zeros((len(chunk), width), dtype=torch.long)
                for i, t in enumerate(chunk):   # right padding: positions 0..L-1 are real
                    input_ids[i, :len(t)] = torch.tensor(t)
                    mask[i, :len(t)] = 1
                head_out.clear()
                self.model(input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device))
                per_token = head_out[-1][..., 0].float().cpu()        # [B, T]
                scores.append(per_token[torch.arange(len(chunk)), lengths - 1])
        finally:
            hook.remove()
        return torch.cat(scores) if scores else torch.zeros(0)

    def score(self, prompts: Sequence[Any], responses: Sequence[str]) -> torch.Tensor:
        """Scores [N] of N (prompt, response) pairs."""
        return self.score_ids(self.encode(prompts, responses))
