"""`builtin:tiny-qwen2.5-vl`: a small randomly initialised Qwen2.5-VL written from a config, like
the tiny text models (engines/models.py), for training an image-text model from scratch on CPU.

Its tokenizer is the tiny models' character tokenizer with the upper-case letters and the
punctuation of the built-in visual task's questions (data/shapes.py) added, and the family's
vision tokens (its video pad too) as special tokens. Its vision tower is Qwen2.5-VL's (14 px
patches, 2 x 2 merge, windowed attention with one full-attention block) at a small width;
its text model a Qwen2 decoder with M-RoPE, whose three sections (time, height, width) split
the head's rotary frequencies. The image processor (preprocessor_config.json) resizes each
image to a multiple of 28 px between 56 x 56 and 224 x 224 pixels: 4 to 64 image tokens.
"""

from __future__ import annotations

from transformers import Qwen2_5_VLConfig

from dagrl.data.vision import IMAGE_PAD, VISION_END, VISION_START

# Beyond the tiny models' characters: what the visual task's questions use.
EXTRA_CHARACTERS = list("ABCDEFGHIJKLMNOPQRSTUVWXYZ,()!'")
# The video pad too, though the tiny model reads no video: vLLM's Qwen2-VL processor looks it
# up in every vocabulary of the family (KeyError '<|video_pad|>' without it).
VIDEO_PAD = "<|video_pad|>"
VISION_TOKENS = [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]
MIN_PIXELS, MAX_PIXELS = 56 * 56, 224 * 224


def add_vision_tokens(tokenizer):
    """The family's vision tokens as special tokens of `tokenizer` (in place; returned)."""
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    return tokenizer


def mrope_sections(head_dim: int) -> list[int]:
    """M-RoPE's (time, height, width) split of a head's head_dim / 2 rotary frequencies, in
    Qwen2-VL's proportions (16, 24, 24 of 64)."""
    half = head_dim // 2
    time = half // 4
    height = (half - time) // 2
    return [time, height, half - time - height]


def tiny_vlm_config(tokenizer, hidden_size: int, layers: int, heads: int = 2,
                    max_positions: int = 512) -> Qwen2_5_VLConfig:
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    text = {
        "vocab_size": len(tokenizer), "hidden_size": hidden_size,
        "intermediate_size": 4 * hidden_size, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": max(heads // 2, 1),
        "max_position_embeddings": max_positions,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                            "mrope_section": mrope_sections(hidden_size // heads)},
        "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
    }
    vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
              "out_hidden_size": hidden_size, "patch_size": 14, "spatial_merge_size": 2,
              "temporal_patch_size": 2, "window_size": 56, "fullatt_block_indexes": [1]}
    return Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, tie_word_embeddings=True,
        image_token_id=ids[IMAGE_PAD], vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END], video_token_id=ids[VIDEO_PAD])


def tiny_image_processor():
    """Qwen2-VL's image processor in transformers' PIL backend (no torchvision needed) with
    the tiny model's pixel bounds."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    return Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
