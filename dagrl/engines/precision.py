"""Mixed precision (`model.mixed_precision`): bfloat16 matmuls, float32 everything else.

Under `torch.autocast` the linear layers and attention matmuls of a forward (and, through
autograd, of its backward) run in bfloat16, while the trained weights, their gradients and
AdamW's moments stay float32 (the master copy), as do the log-softmax, entropy and losses
(forward.py casts each head chunk's logits to float32 first; HF's RMSNorm computes in float32).
The reference and the old-logprob pass run under the same autocast as the update, so at the
first step KL(pi || pi_ref) is exactly 0 and pi/pi_old exactly 1, as in full precision.

Why autocast rather than FSDP2's MixedPrecisionPolicy: it is one mechanism for one worker and
for N (FSDP2 all-gathers the float32 shards, autocast casts them as each layer runs), so N
workers still reproduce one. The cost is float32 all-gathers: twice the bytes of a bfloat16
gather on GPUs.

The rollout engine generates from a bfloat16 copy (`ModelConfig.rollout_dtype`): decoding
reads every weight once per token, so half the bytes is the win there; a weight sync casts the
float32 weights into it.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

DTYPES = {"bfloat16": torch.bfloat16}


def autocast(mixed_precision: str, device: torch.device) -> AbstractContextManager:
    """The context a forward runs in: autocast to bfloat16, or nothing for 'none'."""
    if mixed_precision == "none":
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[mixed_precision])


def matmul_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype a matmul on `t` runs in here: autocast's where it is on for `t`'s device, else
    `t`'s own (for the custom autograd functions that turn autocast off inside and must keep
    its choice: attention.py, head_stats.py)."""
    device = t.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else t.dtype



@torch.no_grad()
def store_linears_in_low_precision(model: torch.nn.Module, mixed_precision: str
                                   ) -> torch.nn.Module:
    """For a frozen model that only ever runs under `autocast` (the reference): keep its linear
    layers' weights and biases in the autocast dtype. Autocast casts them at every use anyway
    (round to nearest, the same values as a stored cast), so the outputs are bit-identical and
    the linears take half the memory (SmolLM2-135M: -0.2 GiB). Embeddings and norms are not
    autocast ops and stay float32; a head tied to the embeddings stays with them."""
    if mixed_precision == "none":
        return model
    dtype = DTYPES[mixed_precision]
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    kept = {id(p) for m in model.modules() if not isinstance(m, torch.nn.Linear)
            for p in m.parameters(recurse=False)}
    for module in linears:
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) not in kept:
                setattr(module, name, torch.nn.Parameter(param.to(dtype), requires_grad=False))
    return model
