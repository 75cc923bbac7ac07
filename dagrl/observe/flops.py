"""Model FLOPs for an MFU estimate.

A dense transformer with N parameters (those used in matmuls: all but the input embedding) costs
about 2·N FLOPs per token forward and 6·N forward + backward (Kaplan et al. 2020; attention's
sequence-length term is left out, small for the short sequences of RL post-training). A node's
FLOPs are its role's FLOPs per parameter per token × N × the tokens of its shard (prompt +
response). MFU = achieved FLOP/s per device / the device's peak: reported only for devices whose
peak is in PEAK_TFLOPS, never with a guessed peak.
"""

from __future__ import annotations

import torch

from dagrl.data.batch import response_attention

# FLOPs per parameter per token of the built-in roles. Roles not listed (user roles, reward,
# advantage, filter) count as 0: they do no model matmuls, or none we can know of.
FORWARD, TRAIN = 2, 6
ROLE_FLOPS = {"rollout": FORWARD, "old_logprob": FORWARD, "ref_logprob": FORWARD,
              "values": FORWARD, "greedy_baseline": FORWARD,
              "actor_update": TRAIN, "critic_update": TRAIN}

# Dense peak TFLOP/s per device (vendor datasheets, no sparsity): bf16/fp16 tensor cores, and
# fp32 without TF32 (PyTorch's default for matmuls). First match of a substring of the device
# name wins, so more specific names come first.
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    ("H200", {"bfloat16": 989.4, "float16": 989.4, "float32": 66.9}),
    ("H100 NVL", {"bfloat16": 835.5, "float16": 835.5, "float32": 60.0}),
    ("H100 PCIe", {"bfloat16": 756.5, "float16": 756.5, "float32": 51.2}),
    ("H100", {"bfloat16": 989.4, "float16": 989.4, "float32": 66.9}),
    ("A100", {"bfloat16": 312.0, "float16": 312.0, "float32": 19.5}),
    ("L40S", {"bfloat16": 362.1, "float16": 362.1, "float32": 91.6}),
]


def peak_tflops(device_name: str, dtype: str) -> float | None:
    """The device's dense peak for `dtype` ('bfloat16' | 'float16' | 'float32'), or None."""
    for key, peaks in PEAK_TFLOPS:
        if key.lower() in device_name.lower():
            return peaks.get(dtype)
    return None


def matmul_params(model: torch.nn.Module) -> int:
    """Parameters that take part in matmuls: all but the input embedding table (a lookup),
    keeping it when it is tied to the output projection (then it is that matmul)."""
    params = {id(p): p for p in model.parameters()}
    total = sum(p.numel() for p in params.values())   # a DTensor shard reports the full size
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if embed is not None and (out is None or out.weight is not embed.weight):
        total -= embed.weight.numel()
    return total


def role_flops_per_token(role: str, n_params: int, passes: int = 1) -> float:
    """FLOPs per token of a role's node; `passes` multiplies training roles (ppo_epochs)."""
    per_param = ROLE_FLOPS.get(role, 0)
    return float(per_param * n_params * (passes if per_param == TRAIN else 1))


def batch_tokens(batch) -> int:
    """Prompt + response tokens in a batch (0 when it has neither mask)."""
    total = int(batch["prompt_mask"].sum()) if "prompt_mask" in batch else 0
    if "response_mask" in batch:   # with a multi-turn response's tool tokens
        total += int(response_attention(batch).sum())
    return total
