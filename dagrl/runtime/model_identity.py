"""Which model a checkpoint was written for, and whether a resume is about to load it into
another one.

DCP loads by parameter name and shape, so a checkpoint of one architecture loads into another
whose names and shapes happen to agree: a tiny-qwen2 checkpoint resumed as tiny-llama loses
the q/k/v biases without a word. The manifest therefore records the model's identity (its
type, a hash of the config fields that define its function, a hash of its vocabulary), and the
pre-flight compares it with the configured model before anything is built.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

# The config fields that make two models compute different functions (the text model's); the
# others (dtype, cache and output switches, versions, paths) do not.
STRUCTURE = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads", "num_key_value_heads", "tie_word_embeddings",
             "attention_bias", "mlp_bias", "num_experts", "num_local_experts",
             "num_experts_per_tok", "moe_intermediate_size", "hidden_act")


def _sha(data) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


def model_identity(config, tokenizer, path: str) -> dict:
    """The identity of the model `config` describes, with `tokenizer`; `path` is only shown."""
    text = config.get_text_config()
    shape = {key: getattr(text, key) for key in STRUCTURE if getattr(text, key, None) is not None}
    return {"model_type": config.model_type, "path": str(path),
            "config_sha256": _sha({"model_type": config.model_type, **shape}),
            "tokenizer_sha256": _sha(sorted(tokenizer.get_vocab().items()))}


def describe(identity: dict) -> str:
    return (f"{identity['model_type']} (config {identity['config_sha256'][:12]}, tokenizer "
            f"{identity['tokenizer_sha256'][:12]}) from {identity['path']}")


def identity_mismatch(checkpoint: Path, saved: dict, current: dict) -> str:
    """"" when `current` is the model `saved` names; else the line that says both."""
    if all(saved.get(k) == current[k] for k in ("model_type", "config_sha256",
                                                "tokenizer_sha256")):
        return ""
    return (f"checkpoint {checkpoint} was written for {describe(saved)}; this run's model is "
            f"{describe(current)}. Resume with the model it was written for, or start anew "
            "(trainer.resume=never, or another trainer.run_dir)")
