"""What the vLLM tests share (tests/test_vllm*.py): a small engine, the prompts, a seeded
weight change."""

from __future__ import annotations

import torch

# A small KV pool: the engines of a test module fit beside each other and the trainer.
SMALL_ENGINE = ["rollout.vllm.gpu_memory_utilization=0.2", "rollout.vllm.cpu_kv_cache_gb=0.25"]
PROMPTS = ["1+2=", "13+7=", "4+4=", "20+19=", "0+0=", "9+9="]


def move_weights(model: torch.nn.Module) -> None:
    """A trained step's worth of change to every weight (seeded): greedy outputs move."""
    with torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
