"""How a batch is cut into the micro-batches of a forward (or forward + backward) pass.

- by count (the default): consecutive runs of `micro_batch_size` samples;
- by tokens (`max_tokens_per_micro_batch` > 0, verl's dynamic batch size): samples sorted by
  length, longest first, then cut into runs whose real tokens (prompt + response, no padding)
  sum to at most the budget; a sample longer than the budget goes alone. The sort also puts
  samples of similar length together, so the padded layout carries little padding; with
  `model.pack_sequences` there is none at all.

Every micro-batch comes with the positions of its samples in the batch, so per-sample outputs
go back in batch order, and the update's loss (each micro-batch divided by the mini-batch's
global normaliser, engines/train_engine.py) is the same however the batch is cut.
"""

from __future__ import annotations

import torch

from dagrl.data.batch import Batch, response_attention


def sample_tokens(batch: Batch) -> torch.Tensor:
    """Real tokens of each sample (prompt and response, no padding): [N]."""
    return batch["prompt_mask"].sum(1) + response_attention(batch).sum(1)


def micro_batches(batch: Batch, micro_batch_size: int,
                  max_tokens: int = 0) -> list[tuple[torch.Tensor, Batch]]:
    """[(positions in `batch` [n], micro-batch of those n samples)], covering every sample once."""
    if max_tokens <= 0:
        out, start = [], 0
        for part in batch.split(micro_batch_size):
            out.append((torch.arange(start, start + len(part)), part))
            start += len(part)
        return out
    tokens = sample_tokens(batch).cpu()
    order = torch.argsort(tokens, descending=True, stable=True)
    groups: list[list[int]] = []
    total = 0
    for i in order.tolist():
        t = int(tokens[i])
        if not groups or total + t > max_tokens:
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += t
    return [(torch.tensor(g), batch.select(g)) for g in groups]
