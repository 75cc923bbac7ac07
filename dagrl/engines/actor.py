"""The actor: a trainable policy, its optimizer, and the PPO-style update loop.

One call of `update` runs `ppo_epochs` passes over this worker's shard of the step's batch,
split into mini-batches (one optimizer step each) and micro-batches (gradient accumulation).
The loss of every micro-batch is divided by the *global* normaliser of its mini-batch
(tokens or sequences summed over all micro-batches and all data-parallel ranks), so the
accumulated gradient is the exact gradient of the full mini-batch loss, however the batch is
split across micro-batches and workers.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist

from dagrl.algorithms.kl import kl_penalty
from dagrl.algorithms.loss_agg import agg_denominator, agg_loss
from dagrl.algorithms.policy_loss import POLICY_LOSSES
from dagrl.config.schema import ActorConfig, AlgorithmConfig
from dagrl.data.batch import Batch
from dagrl.engines.forward import batch_logprobs, response_logprobs
from dagrl.observe.metrics import StepMetrics


def _all_reduce_sum(value: float, group: dist.ProcessGroup | None, device) -> float:
    if group is None or dist.get_world_size(group) == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    return float(t.item())


class ActorEngine:
    """Owns the trained policy. `dp_group` is the data-parallel group of the update (None when
    running alone); gradients are averaged over it by the sharding wrapper, which is why the
    loss is multiplied by the group size before backward."""

    def __init__(self, model: torch.nn.Module, cfg: ActorConfig, algo: AlgorithmConfig, *,
                 temperature: float, samples_per_prompt: int,
                 dp_group: dist.ProcessGroup | None = None) -> None:
        self.model = model
        self.cfg = cfg
        self.algo = algo
        self.temperature = temperature if temperature > 0 else 1.0
        self.samples_per_prompt = samples_per_prompt
        self.dp_group = dp_group
        self.dp_size = dist.get_world_size(dp_group) if dp_group is not None else 1
        self.policy_loss_fn = POLICY_LOSSES.get(algo.policy_loss)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas),
                                           weight_decay=cfg.weight_decay)
        warmup = cfg.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
        self.version = 0   # bumped after every optimizer step; the generator syncs on change

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def compute_logprobs(self, batch: Batch, micro_batch_size: int) -> torch.Tensor:
        self.model.eval()
        return batch_logprobs(self.model, batch, micro_batch_size=micro_batch_size,
                              temperature=self.temperature)

    def update(self, batch: Batch, metrics: StepMetrics) -> None:
        """PPO epochs × mini-batches × micro-batches over this worker's batch shard."""
        cfg, algo = self.cfg, self.algo
        mini_size = cfg.mini_batch_size * self.samples_per_prompt // self.dp_size  # local samples
        use_kl = algo.kl_loss_coef > 0
        if use_kl and "ref_logprobs" not in batch:
            raise KeyError("actor_update: algorithm.kl_loss_coef > 0 needs 'ref_logprobs' in the "
                           "batch; add a ref_logprob node before actor_update in the graph")
        self.model.train()
        for _ in range(cfg.ppo_epochs):
            for mini in batch.split(mini_size):
                self._optimizer_step(mini, metrics, use_kl)

    def _optimizer_step(self, mini: Batch, metrics: StepMetrics, use_kl: bool) -> None:
        cfg, algo = self.cfg, self.algo
        mode = algo.loss_agg_mode
        # Global normaliser of this mini-batch (see module docstring).
        denom = _all_reduce_sum(agg_denominator(mini["response_mask"], mode), self.dp_group,
                                self.device)
        self.optimizer.zero_grad(set_to_none=True)
        pg_total = 0.0
        for micro in mini.split(cfg.micro_batch_size):
            mask = micro["response_mask"]
            out = response_logprobs(self.model, micro["prompt_ids"], micro["prompt_mask"],
                                    micro["responses"], mask, temperature=self.temperature,
                                    with_entropy=True)
            loss_mat, stats = self.policy_loss_fn(
                out.logprobs, micro["old_logprobs"], micro["advantages"], mask,
                clip_ratio_low=algo.clip_ratio_low, clip_ratio_high=algo.clip_ratio_high,
                clip_ratio_c=algo.clip_ratio_c)
            pg_loss = agg_loss(loss_mat, mask, mode, denom=denom)
            loss = pg_loss
            if algo.entropy_coeff:
                loss = loss - algo.entropy_coeff * agg_loss(out.entropy, mask, mode, denom=denom)
            if use_kl:
                kl = kl_penalty(out.logprobs, micro["ref_logprobs"], algo.kl_loss_type)
                loss = loss + algo.kl_loss_coef * agg_loss(kl, mask, mode, denom=denom)
                _token_mean(metrics, "actor/kl", kl, mask)
            # The sharding wrapper averages gradients over dp ranks; each rank's loss is already
            # a share of the global mean, so undo the average.
            (loss * self.dp_size).backward()
            pg_total += float(pg_loss.detach())
            _token_mean(metrics, "actor/entropy", out.entropy, mask)
            for name, value in stats.items():
                _token_mean(metrics, f"actor/{name}", value, mask)
        grad_norm = self._clip_grad_norm()
        self.optimizer.step()
        self.scheduler.step()
        self.version += 1
        metrics.add_sum("actor/pg_loss", pg_total)   # shares of the global mean: sum over ranks
        # The same value on every rank: a mean over ranks (and over this step's mini-batches).
        metrics.add_mean("actor/grad_norm", grad_norm, 1.0)
        metrics.add_mean("actor/lr", self.scheduler.get_last_lr()[0], 1.0)
        metrics.add_sum("actor/optimizer_steps", 1.0 / self.dp_size)

    def _clip_grad_norm(self) -> float:
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        if hasattr(norm, "full_tensor"):   # a DTensor under FSDP2
            norm = norm.full_tensor()
        return float(norm)

    @torch.no_grad()
    def full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor) for every parameter, for the rollout generator."""
        for name, param in self.model.named_parameters():
            tensor = param.full_tensor() if hasattr(param, "full_tensor") else param
            yield name, tensor.detach()


def _token_mean(metrics: StepMetrics, name: str, values: torch.Tensor, mask: torch.Tensor) -> None:
    mask = mask.to(values.dtype)
    metrics.add_mean(name, float((values.detach() * mask).sum()), float(mask.sum()))
