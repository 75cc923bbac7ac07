"""Left-padded prompt batches for the rollout tests (text, and text with images)."""

from __future__ import annotations

import torch
from PIL import Image

from dagrl.data.vision import ImageInputs


def left_padded(tok, texts: list[str], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """BOS + each text's tokens, right-aligned in `width` columns: ids, mask [len(texts), width]."""
    ids = torch.full((len(texts), width), tok.pad_token_id)
    mask = torch.zeros(len(texts), width, dtype=torch.long)
    for i, text in enumerate(texts):
        toks = [tok.bos_token_id] + tok(text, add_special_tokens=False)["input_ids"]
        ids[i, width - len(toks):] = torch.tensor(toks)
        mask[i, width - len(toks):] = 1
    return ids, mask


def picture(size: tuple[int, int], colour: str, box: tuple[int, int, int, int]) -> Image.Image:
    image = Image.new("RGB", size, "white")
    image.paste(Image.new("RGB", (box[2] - box[0], box[3] - box[1]), colour), box[:2])
    return image


def image_prompts(tokenizer, encoder, rows):
    """rows: (text with IMAGE_BLOCKs, images) -> left-padded ids, mask, the images in order."""
    ids, images = [], []
    for text, pictures in rows:
        raw = tokenizer(text, add_special_tokens=False)["input_ids"]
        inputs = encoder.encode(pictures) if pictures else None
        ids.append(encoder.expand(raw, inputs) if inputs else raw)
        images.append(inputs)
    width = max(map(len, ids))
    prompt = torch.zeros(len(ids), width, dtype=torch.long)
    mask = torch.zeros(len(ids), width, dtype=torch.long)
    for i, row in enumerate(ids):
        prompt[i, width - len(row):] = torch.tensor(row)
        mask[i, width - len(row):] = 1
    return prompt, mask, ImageInputs.concat(images)
