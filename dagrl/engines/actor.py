"""The actor: the trained policy and its loss,

    L = agg'(policy_loss(π/π_old, A, ρ)) − c_H · agg(H(π)) + β · agg(KL(π ‖ π_ref)),

with the policy loss, aggregation and KL estimator chosen by name from their registries. agg'
is agg unless the policy loss pins its own mode (SAPO, GMPO); ρ are the rollout importance
weights when the batch carries them (the old_logprob node's rollout correction). With
policy_loss=bypass_mode, π_old is the rollout engine's policy (the batch's rollout_logprobs).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from dagrl.algorithms.kl import kl_penalty
from dagrl.algorithms.loss_agg import agg_loss
from dagrl.algorithms.policy_loss import POLICY_LOSSES, PolicyLossParams, pinned_agg_mode
from dagrl.algorithms.rollout_correction import RolloutCorrectionParams
from dagrl.config.schema import ActorConfig, AlgorithmConfig, RolloutCorrectionConfig
from dagrl.data.batch import Batch, response_attention
from dagrl.data.vision import batch_images
from dagrl.engines.forward import batch_logprob_stats, response_logprobs
from dagrl.engines.layout import EngineLayout
from dagrl.engines.lora import (
    adapter_config,
    adapter_tensors,
    is_adapter,
    is_lora,
    lora_scalings,
    merged_weights,
)
from dagrl.engines.rollout_shards import gather_rollout_shards
from dagrl.engines.train_engine import TrainEngine, token_mean
from dagrl.engines.weight_sync import gather_full_weights
from dagrl.observe.metrics import StepMetrics
from dagrl.rollout.shards import RolloutShard


class ActorEngine(TrainEngine):
    name = "actor"
    loss_metric = "pg_loss"

    def __init__(self, model: torch.nn.Module, cfg: ActorConfig, algo: AlgorithmConfig,
                 layout: EngineLayout, *, temperature: float) -> None:
        """`temperature`: the T of log softmax(z / T), the one the rollout recorded
        (`rollout.sampling.logprob_temperature`); `layout`: see TrainEngine."""
        super().__init__(model, cfg, layout, loss_agg_mode=algo.loss_agg_mode,
                         micro_batch_size=cfg.micro_batch_size, epochs=cfg.ppo_epochs,
                         max_tokens_per_micro_batch=cfg.max_tokens_per_micro_batch)
        self.cfg, self.algo = cfg, algo
        self.temperature = temperature
        self.policy_loss_fn = POLICY_LOSSES.get(algo.policy_loss)
        self.loss_params = policy_loss_params(algo)
        # The policy term's aggregation, and every mode whose global denominator it needs.
        self.pg_agg_mode = pinned_agg_mode(self.policy_loss_fn) or algo.loss_agg_mode
        self.agg_modes = tuple(dict.fromkeys((algo.loss_agg_mode, self.pg_agg_mode)))

    def compute_logprobs(self, batch: Batch, with_sum_pi_squared: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Forward-only log-probs of the responses under the current weights: [N, R], and
        Σ_v π(v | s_t)² [N, R] when asked for (else None)."""
        self.model.eval()
        with self.autocast():
            return batch_logprob_stats(self.model, batch, micro_batch_size=self.micro_batch_size,
                                       temperature=self.temperature,
                                       chunk_tokens=self.cfg.logits_chunk_tokens,
                                       max_tokens=self.max_tokens, pack=self.pack,
                                       with_sum_pi_squared=with_sum_pi_squared,
                                       share_prompts=self.share_prompts)

    def check_batch(self, batch: Batch) -> None:
        if self.algo.kl_loss_coef > 0 and "ref_logprobs" not in batch:
            raise KeyError("actor_update: algorithm.kl_loss_coef > 0 needs 'ref_logprobs' in the "
                           "batch; add a ref_logprob node before actor_update in the graph")
        if self.algo.bypass_mode:
            if "rollout_logprobs" not in batch:
                raise KeyError("actor_update: policy_loss=bypass_mode takes pi_old from the "
                               "rollout's log-probs, and the batch has no 'rollout_logprobs'")
            return
        if "old_logprobs" not in batch and (self.epochs > 1
                                            or len(batch) > self.mini_batch_samples):
            raise KeyError("actor_update: 'old_logprobs' is missing and this batch gets more than "
                           "one optimizer step (actor.ppo_epochs > 1 or actor.mini_batch_size < "
                           "data.train_batch_size), so pi_old != pi after the first; add an "
                           "old_logprob node before actor_update in the graph")

    def micro_loss(self, micro: Batch, denoms: Mapping[str, float], metrics: StepMetrics):
        algo, mode = self.algo, self.loss_agg_mode
        mask = micro["response_mask"]
        with self.autocast():
            out = response_logprobs(self.model, micro["prompt_ids"], micro["prompt_mask"],
                                    micro["responses"], mask,
                                    attention_mask=response_attention(micro),
                                    temperature=self.temperature,
                                    with_entropy=True, chunk_tokens=self.cfg.logits_chunk_tokens,
                                    pack=self.pack, images=batch_images(micro),
                                    share_prompts=self.share_prompts)
        # Without an old_logprob pass the batch gets one optimizer step (checked in
        # check_batch): pi_old = pi, as a constant. In sync mode pi generated the batch; in async
        # mode pi is up to max_staleness versions newer, and pi_old = pi is what a recomputed
        # old_logprob would give too (decoupled PPO's proximal policy): the staleness itself is
        # corrected only by a rollout correction or bypass_mode (docs/async.md).
        if algo.bypass_mode:   # verl's bypass mode: pi_old is the rollout policy
            old = micro["rollout_logprobs"]
        else:
            old = micro["old_logprobs"] if "old_logprobs" in micro else out.logprobs.detach()
        if "old_logprobs" not in micro and "rollout_logprobs" in micro:
            # The same check the old_logprob node makes: rollout and training numerics agree.
            token_mean(metrics, "actor/rollout_logprob_gap",
                       (out.logprobs.detach() - micro["rollout_logprobs"]).abs(), mask)
        weights = micro.get("rollout_is_weights")
        loss_mat, stats = self.policy_loss_fn(out.logprobs, old, micro["advantages"], mask,
                                              self.loss_params, rollout_is_weights=weights)
        pg_loss = agg_loss(loss_mat, mask, self.pg_agg_mode, denom=denoms[self.pg_agg_mode])
        loss = pg_loss
        denom = denoms[mode]
        if algo.entropy_coeff:
            loss = loss - algo.entropy_coeff * agg_loss(out.entropy, mask, mode, denom=denom)
        if algo.kl_loss_coef > 0:
            kl = kl_penalty(out.logprobs, micro["ref_logprobs"], algo.kl_loss_type)
            loss = loss + algo.kl_loss_coef * agg_loss(kl, mask, mode, denom=denom)
            token_mean(metrics, "actor/kl", kl, mask)
        token_mean(metrics, "actor/entropy", out.entropy, mask)
        for name, value in stats.items():
            token_mean(metrics, f"actor/{name}", value, mask)
        return loss, pg_loss

    def full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor) for every parameter, gathered from the shards bucket by bucket
        (engines/weight_sync.py); a collective over the actor's ranks. Under LoRA: the plain
        HF weights with the adapters merged in."""
        weights = gather_full_weights(self.model)
        if is_lora(self.model):
            return merged_weights(weights, lora_scalings(self.model))
        return weights

    @property
    def is_lora(self) -> bool:
        return is_lora(self.model)

    def adapter_config(self) -> dict:
        """peft's adapter_config.json of the actor's adapters."""
        return adapter_config(self.model)

    def adapter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The LoRA adapters alone, gathered from the shards, under peft's saved names (what a
        rollout engine that applies adapters itself takes); a collective over the actor's
        ranks."""
        return adapter_tensors(gather_full_weights(self.model, select=is_adapter))

    def rollout_weights(self, shard: RolloutShard | None) -> Iterator[tuple[str, torch.Tensor]]:
        """What a rollout engine reads: the full weights, or with a tensor-parallel engine
        (`shard`) each rank's blocks only (engines/rollout_shards.py). Under LoRA the merge
        needs whole adapters: full weights."""
        if shard is None or is_lora(self.model):
            return self.full_weights()
        return gather_rollout_shards(self.model, shard)


def policy_loss_params(algo: AlgorithmConfig) -> PolicyLossParams:
    """The policy losses' settings from `algorithm.*`."""
    rc = algo.rollout_correction
    return PolicyLossParams(
        clip_ratio_low=algo.clip_ratio_low, clip_ratio_high=algo.clip_ratio_high,
        clip_ratio_c=algo.clip_ratio_c, drift_coef=algo.policy_drift_coef,
        clip_cov_ratio=algo.clip_cov_ratio, clip_cov_lb=algo.clip_cov_lb,
        clip_cov_ub=algo.clip_cov_ub, kl_cov_ratio=algo.kl_cov_ratio,
        ppo_kl_coef=algo.ppo_kl_coef, tau_pos=algo.tau_pos, tau_neg=algo.tau_neg,
        dro_beta=algo.dro_beta, rollout_correction=rollout_correction_params(rc))


def rollout_correction_params(rc: RolloutCorrectionConfig) -> RolloutCorrectionParams:
    """`algorithm.rollout_correction` as the algorithms' parameters (thresholds as strings)."""
    return RolloutCorrectionParams(
        rollout_is=rc.rollout_is, rollout_is_threshold=str(rc.rollout_is_threshold),
        rollout_is_batch_normalize=rc.rollout_is_batch_normalize, rollout_rs=rc.rollout_rs,
        rollout_rs_threshold=str(rc.rollout_rs_threshold), loss_type=rc.loss_type)
