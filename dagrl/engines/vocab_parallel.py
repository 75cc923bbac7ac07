"""Log-probs, entropy and Σπ² from an LM head sharded over the vocabulary (tensor parallelism),
without ever forming a rank's [n, V] logits: each rank holds z[:, r*V/tp : (r+1)*V/tp].

With z the logits over the whole vocabulary, m = max z (a constant: it cancels), e = exp(z − m),
S = Σ_v e_v (summed over the ranks' slices):

    log softmax(z)[y] = (z_y − m) − log S
    entropy           = log S − Σ_v e_v (z_v − m) / S
    Σ_v softmax(z)²_v = Σ_v e_v² / S²

Per chunk, one all-reduce of the max (no gradient) and one of the four partial sums stacked,
[n, 4]. Partial sums go through DTensor (`Partial` -> `Replicate`): in backward each rank's
summand receives the whole gradient, and the hidden states' gradient (each rank's part from its
vocabulary slice) is summed over the group (`sum_grad_over`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Shard

from dagrl.engines.tensor_parallel import sum_grad_over


def is_vocab_sharded(weight: torch.Tensor) -> bool:
    """A head weight [V, H] sharded over its rows on a mesh (tensor parallelism)."""
    return isinstance(weight, DTensor) and any(p == Shard(0) for p in weight.placements)


def _sum_over(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Σ over the ranks of `mesh`, whole on every rank; in backward every summand gets the
    whole gradient."""
    return DTensor.from_local(x, mesh, [Partial()], run_check=False).full_tensor()


def vocab_parallel_token_stats(hidden: torch.Tensor, weight: torch.Tensor,
                               bias: torch.Tensor | None, targets: torch.Tensor,
                               temperature: float, with_entropy: bool,
                               with_sum_pi_squared: bool) -> torch.Tensor:
    """hidden [n, H] (whole, the same on every tp rank), weight a DTensor [V, H] sharded on
    dim 0, targets [n] -> [n, 3] = (log softmax(z/T)[y], entropy, Σπ²) as in
    forward._token_logprobs; the last two are 0 unless asked for."""
    mesh = weight.device_mesh
    w = weight.to_local()                                                # [V/tp, H]
    b = bias.to_local() if bias is not None else None
    z = F.linear(sum_grad_over(hidden, mesh), w, b).float() / temperature  # [n, V/tp]
    m = z.detach().amax(-1)                                              # [n]
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=mesh.get_group())
    shifted = z - m[:, None]
    e = shifted.exp()                                                    # [n, V/tp]
    width = z.shape[-1]
    first = mesh.get_local_rank() * width            # torch.chunk rows: V divides by tp
    local_y = targets - first
    mine = (local_y >= 0) & (local_y < width)
    picked = shifted.gather(-1, local_y.clamp(0, width - 1)[:, None]).squeeze(-1)
    zero = torch.zeros_like(picked)
    parts = [e.sum(-1), torch.where(mine, picked, zero),
             (e * shifted).sum(-1) if with_entropy else zero,
             e.square().sum(-1) if with_sum_pi_squared else zero]
    total = _sum_over(torch.stack(parts, dim=-1), mesh)                  # [n, 4]
    s, z_y, ez, ee = total.unbind(-1)
    log_s = s.log()
    logprobs = z_y - log_s
    entropy = log_s - ez / s if with_entropy else zero
    sum_sq = ee / s.square() if with_sum_pi_squared else zero
    return torch.stack([logprobs, entropy, sum_sq], dim=-1)
