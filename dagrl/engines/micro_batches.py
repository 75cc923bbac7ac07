"""How a batch is cut into the micro-batches of a forward (or forward + backward) pass.

- by count (the default): consecutive runs of `micro_batch_size` samples;
- by tokens (`max_tokens_per_micro_batch` > 0, verl's dynamic batch size): samples sorted by
  length, longest first, then cut into runs whose real tokens (prompt + response, no padding)
  sum to at most the budget; a sample longer than the budget goes alone. The sort also puts
  samples of similar length together, so the padded layout carries little padding; with
  `model.pack_sequences` there is none at all;
- by tokens with `model.share_prompts`: the budget counts the tokens the shared-prompt layout
  runs (engines/shared_prompts.py), and a prompt's samples stay in one micro-batch, so its
  prompt is computed once. Each group is one row, its prompt once and every response after
  it, and a micro-batch's rows are padded to its longest: the budget bounds rows x longest
  row, the tokens the forward computes and keeps activations for (counting only the real
  tokens let 3 rows of 234 through a budget of 600: 702 tokens' activations in SmolLM2's
  learning run). Groups are packed largest first; a group over the budget is cut into runs
  of its samples, each a row with the prompt. A step of long responses gets more
  micro-batches, a step of short ones fewer.

Every micro-batch comes with the positions of its samples in the batch, so per-sample outputs
go back in batch order, and the update's loss (each micro-batch divided by the mini-batch's
global normaliser, engines/train_engine.py) is the same however the batch is cut.
"""

from __future__ import annotations

import torch

from dagrl.data.batch import Batch, response_attention
from dagrl.engines.shared_prompts import distinct_prompts


def sample_tokens(batch: Batch) -> torch.Tensor:
    """Real tokens of each sample (prompt and response, no padding): [N]."""
    return batch["prompt_mask"].sum(1) + response_attention(batch).sum(1)


def micro_batches(batch: Batch, micro_batch_size: int, max_tokens: int = 0,
                  share_prompts: bool = False) -> list[tuple[torch.Tensor, Batch]]:
    """[(positions in `batch` [n], micro-batch of those n samples)], covering every sample once."""
    if max_tokens <= 0:
        out, start = [], 0
        for part in batch.split(micro_batch_size):
            out.append((torch.arange(start, start + len(part)), part))
            start += len(part)
        return out
    units = _prompt_groups(batch, max_tokens) if share_prompts else _samples(batch)
    units.sort(key=lambda unit: unit[0], reverse=True)      # stable: ties keep batch order
    cut: list[list[int]] = []
    total = rows = longest = 0
    for tokens, samples in units:
        # Shared rows are padded to the micro-batch's longest, its first (units come longest
        # first); samples count their real tokens (packed, or sorted into little padding).
        cost = (rows + 1) * longest if share_prompts else total + tokens
        if not cut or cost > max_tokens:
            cut.append([])
            total = rows = 0
            longest = tokens
        cut[-1].extend(samples)
        total += tokens
        rows += 1
    return [(torch.tensor(samples), batch.select(samples)) for samples in cut]


def _samples(batch: Batch) -> list[tuple[int, list[int]]]:
    """(real tokens, [sample]) per sample."""
    return [(int(t), [i]) for i, t in enumerate(sample_tokens(batch).cpu().tolist())]


def _prompt_groups(batch: Batch, max_tokens: int) -> list[tuple[int, list[int]]]:
    """(shared-layout tokens, samples) per distinct prompt: the prompt once plus every sample's
    response tokens; a group over `max_tokens` is cut into runs of its samples that fit (each
    run computes the prompt again), a sample alone being the smallest run."""
    prompts, row_prompt = distinct_prompts(batch["prompt_ids"].cpu(), batch["prompt_mask"].cpu())
    responses = response_attention(batch).sum(1).cpu().tolist()
    members: list[list[int]] = [[] for _ in prompts]
    for i, g in enumerate(row_prompt):
        members[g].append(i)
    units = []
    for prompt, samples in zip(prompts, members, strict=True):
        tokens = len(prompt)
        run: list[int] = []
        for i in samples:
            if run and tokens + responses[i] > max_tokens:
                units.append((tokens, run))
                tokens, run = len(prompt), []
            run.append(i)
            tokens += int(responses[i])
        units.append((tokens, run))
    return units
