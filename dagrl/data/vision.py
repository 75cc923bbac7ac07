"""Image-text models of the Qwen2-VL / Qwen2.5-VL family: their image inputs, prompt tokens and
M-RoPE positions, shared by the rollout and the teacher-forced passes so that both see the same
pixels, the same tokens at the same positions.

A prompt's `<image>` placeholder (verl's multimodal layout, data/images.py) is rendered as the
family's image block `<|vision_start|><|image_pad|><|vision_end|>` (what its chat template
writes for an image part), and the single `<|image_pad|>` then becomes one token per merged
patch of that image: grid t x h x w patches of 14 px, merged 2 x 2, so t*h*w / 4 tokens. The
model scatters the vision tower's output into those positions in order, so a batch's
`pixel_values` are the samples' patch rows concatenated in row order.

The image processor is the model directory's (preprocessor_config.json) in transformers' PIL
backend, which needs no torchvision (transformers' Qwen2-VL processor class also builds a video
processor, which does). Positions: text and image tokens get M-RoPE's three rows (time,
height, width) from the model's own `get_rope_index` over each whole sequence; a response
continues after its prompt's largest position, so the rollout's decode steps and the training
forward agree token for token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from dagrl.data.positions import position_ids_from_mask

VISION_START, VISION_END, IMAGE_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"
IMAGE_BLOCK = VISION_START + IMAGE_PAD + VISION_END
# The batch field (non-tensor, one entry per sample) that carries each sample's images.
IMAGE_FIELD = "image_inputs"


def reads_images(config) -> bool:
    """Whether a HF model config has a vision tower."""
    return getattr(config, "vision_config", None) is not None


@dataclass
class ImageInputs:
    """The encoded images of one sample, or of a batch's samples concatenated in row order."""
    pixel_values: torch.Tensor      # [patches, channels x temporal x 14 x 14] float32
    image_grid_thw: torch.Tensor    # [images, 3] int64: patches in time, height, width
    # The decoded RGB images themselves, in the same order: for an engine that runs the
    # model's processor itself (vLLM takes images, not patches).
    pictures: tuple = ()

    @staticmethod
    def concat(parts: Sequence[ImageInputs | None]) -> ImageInputs | None:
        """The samples' images in row order (None: no sample has any)."""
        parts = [p for p in parts if p is not None and len(p.image_grid_thw)]
        if not parts:
            return None
        return ImageInputs(torch.cat([p.pixel_values for p in parts]),
                           torch.cat([p.image_grid_thw for p in parts]),
                           tuple(picture for p in parts for picture in p.pictures))

    def to(self, device: torch.device) -> ImageInputs:
        return ImageInputs(self.pixel_values.to(device), self.image_grid_thw.to(device),
                           self.pictures)


def batch_images(batch) -> ImageInputs | None:
    """A Batch's (or micro-batch's) images in row order, None for a text-only batch."""
    if IMAGE_FIELD not in batch:
        return None
    return ImageInputs.concat(list(batch[IMAGE_FIELD]))


def row_images(batch) -> list[ImageInputs | None]:
    """Each row's own images (None for a row without any, and for every row of a text-only
    batch)."""
    return list(batch[IMAGE_FIELD]) if IMAGE_FIELD in batch else [None] * len(batch)


def image_blocks(prompt):
    """A prompt (text or chat messages) with each `<image>` placeholder as the model's image
    block (one image pad between the vision start and end tokens)."""
    from dagrl.data.images import IMAGE_PLACEHOLDER

    if isinstance(prompt, str):
        return prompt.replace(IMAGE_PLACEHOLDER, IMAGE_BLOCK)
    return [{**m, "content": m["content"].replace(IMAGE_PLACEHOLDER, IMAGE_BLOCK)}
            if isinstance(m.get("content"), str) else m for m in prompt]


class ImageEncoder:
    """A model's image processor and its image tokens: turns a prompt's images into
    `ImageInputs` and its single image pads into one pad per merged patch."""

    def __init__(self, processor, tokenizer) -> None:
        self.processor = processor
        self.merge = int(getattr(processor, "merge_size", 2))
        self.pad_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        if self.pad_id is None or self.pad_id == tokenizer.unk_token_id:
            raise ValueError(f"the tokenizer has no {IMAGE_PAD} token; an image-text model of "
                             "the Qwen2-VL family has one")

    @classmethod
    def of_model(cls, model_dir: str | Path, tokenizer) -> ImageEncoder | None:
        """The encoder of the model at `model_dir` (its preprocessor_config.json), or None for
        a model that reads text only."""
        from transformers import AutoImageProcessor

        from dagrl.config.model_source import model_reads_images

        if not model_reads_images(str(model_dir)):
            return None
        return cls(AutoImageProcessor.from_pretrained(str(model_dir), local_files_only=True),
                   tokenizer)

    def prompt_images(self, prompt, images: Sequence) -> tuple[object, ImageInputs]:
        """A row's prompt with each `<image>` placeholder as the model's image block, and its
        images (decoded RGB PIL images, data/images.py) encoded."""
        return image_blocks(prompt), self.encode(images)

    def encode(self, images: Sequence) -> ImageInputs:
        """PIL images (RGB) -> their patch rows and grids."""
        out = self.processor(images=list(images), return_tensors="pt")
        return ImageInputs(out["pixel_values"].float(), out["image_grid_thw"].long(),
                           tuple(images))

    def tokens_per_image(self, inputs: ImageInputs) -> list[int]:
        return [int(g.prod()) // self.merge ** 2 for g in inputs.image_grid_thw]

    def expand(self, ids: Sequence[int], inputs: ImageInputs) -> list[int]:
        """`ids` with its k-th image pad repeated as many times as image k has tokens."""
        counts = iter(self.tokens_per_image(inputs))
        out: list[int] = []
        for token in ids:
            if token == self.pad_id:
                n = next(counts, None)
                if n is None:
                    raise ValueError("more image pads in the prompt than images")
                out.extend([token] * n)
            else:
                out.append(token)
        if next(counts, None) is not None:
            raise ValueError("more images than image pads in the prompt")
        return out


def collapse_image_pads(ids: Sequence[int], pad_id: int) -> list[int]:
    """`ids` with each run of image pads back to one pad (the inverse of `ImageEncoder.expand`:
    an engine whose own processor expands each image's pad, as vLLM's does)."""
    return [t for i, t in enumerate(ids) if t != pad_id or i == 0 or ids[i - 1] != pad_id]


def _rope_module(model: torch.nn.Module) -> torch.nn.Module:
    """The submodule that computes M-RoPE positions (Qwen2(.5)-VL's inner model; found through
    LoRA and FSDP2 wrappers)."""
    for module in model.modules():
        if hasattr(module, "get_rope_index") and hasattr(module, "visual"):
            return module
    raise ValueError(f"{type(model).__name__} has no get_rope_index: not an image-text model of "
                     "the Qwen2-VL family")


def image_token_id(model: torch.nn.Module) -> int:
    return int(model.config.image_token_id)


def rope_positions(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   images: ImageInputs | None) -> tuple[torch.Tensor, torch.Tensor]:
    """M-RoPE positions of left- or right-padded rows: ([3, B, L] int64, [B, 1] the offset
    that turns a text position after the last token into its M-RoPE position: a new token
    at column c of an unpadded row has position c + offset on all three rows)."""
    if images is None:   # text only: the three rows are the plain positions
        plain = position_ids_from_mask(attention_mask)
        return plain[None].expand(3, -1, -1), torch.zeros_like(plain[:, :1])
    mm_types = (input_ids == image_token_id(model)).int()
    return _rope_module(model).get_rope_index(input_ids, mm_types,
                                              image_grid_thw=images.image_grid_thw,
                                              attention_mask=attention_mask)


def unemittable_tokens(model: torch.nn.Module) -> list[int]:
    """Tokens a response of `model` may not hold: an image-text model's image pad marks where
    image features go, so a sampled one would break the next forward. The policy is the
    model's distribution with them removed (`remove_tokens`): every rollout backend samples from
    it and reports its log-probs, and the teacher-forced passes score tokens under it."""
    return [image_token_id(model)] if reads_images(model.config) else []


def remove_tokens(logits: torch.Tensor, token_ids: Sequence[int]) -> torch.Tensor:
    """`logits` [..., V] with `token_ids` at the dtype's lowest value: probability 0 after a
    softmax, with no inf (an entropy's 0 * -inf would be NaN) and no gradient to them."""
    if not token_ids:
        return logits
    index = torch.tensor(list(token_ids), device=logits.device)
    return logits.index_fill(-1, index, torch.finfo(logits.dtype).min)


def image_kwargs(images: ImageInputs | None) -> dict:
    """The model forward's image arguments (none for a text-only batch)."""
    if images is None:
        return {}
    return {"pixel_values": images.pixel_values, "image_grid_thw": images.image_grid_thw}
