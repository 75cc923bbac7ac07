"""Left-padded prompt batches for the rollout tests."""

from __future__ import annotations

import torch


def left_padded(tok, texts: list[str], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """BOS + each text's tokens, right-aligned in `width` columns: ids, mask [len(texts), width]."""
    ids = torch.full((len(texts), width), tok.pad_token_id)
    mask = torch.zeros(len(texts), width, dtype=torch.long)
    for i, text in enumerate(texts):
        toks = [tok.bos_token_id] + tok(text, add_special_tokens=False)["input_ids"]
        ids[i, width - len(toks):] = torch.tensor(toks)
        mask[i, width - len(toks):] = 1
    return ids, mask
