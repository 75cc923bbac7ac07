"""Write `verl_algorithms.json`: verl's own outputs on fixed inputs, the reference that
`tests/test_verl_reference.py` holds dagrl's algorithms to (values and gradients to 1e-6).

Not run by the test suite: it needs verl, which dagrl does not depend on. Run it in a separate
environment with verl's algorithm code (it runs on CPU):

    python -m venv /tmp/verlref && . /tmp/verlref/bin/activate
    pip install -c constraints-cpu.txt torch==2.13.0
    pip install --no-deps verl==0.9.1
    pip install packaging numpy omegaconf ray tensordict "transformers>=5.5.3,<5.11" \
        codetiming orjson          # what verl.trainer.ppo.core_algos imports
    python tests/golden/verl_reference.py

The inputs are generated here (seeded) and stored in the fixture with the outputs, so the test
never depends on a random generator. They are float64 and cover ragged lengths, response masks
with gaps (multi-turn observation tokens inside a response), singleton prompt groups, ties,
ratios outside every clip range and an empty row where a function allows one.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
import verl
from verl.trainer.config import AlgoConfig
from verl.trainer.config.algorithm import RolloutCorrectionConfig
from verl.trainer.ppo import core_algos as ca
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask
from verl.workers.config import ActorConfig, PolicyLossConfig

OUT = Path(__file__).parent / "verl_algorithms.json"
DT = torch.float64
CLIP_COV_SEED = 1234


def _masks() -> torch.Tensor:
    """[9, 8]: ragged lengths, two rows with gaps (observation tokens), one full row."""
    rows = [
        [1, 1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 1, 1, 1, 0],   # a gap of 2 (a tool turn)
        [1, 1, 1, 1, 1, 1, 1, 1],
        [1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0],
        [1, 0, 1, 1, 0, 1, 0, 0],   # two gaps
        [1, 1, 1, 1, 1, 1, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0],
    ]
    return torch.tensor(rows, dtype=DT)


# Groups of 3, 4, 1 and 1 samples, not adjacent: two singleton groups.
GROUPS = [0, 1, 0, 1, 2, 1, 0, 3, 1]


def make_batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = _masks()
    B, T = mask.shape
    lengths = mask.sum(-1).long()
    last = torch.tensor([int(row.nonzero().max()) for row in mask])
    # Outcome scores with ties inside groups, on the last response token, plus small
    # per-token rewards (a KL penalty's shape) so returns along the tokens matter.
    scores = torch.tensor([1.0, 0.0, 1.0, 0.5, 0.25, 0.5, 0.0, 1.0, 0.0], dtype=DT)
    token_rewards = 0.05 * torch.randn(B, T, generator=g, dtype=DT) * mask
    token_rewards[torch.arange(B), last] += scores
    old_logprobs = -torch.rand(B, T, generator=g, dtype=DT) * 2.0 - 0.05
    # Log-ratios mostly inside a clip range, some far outside in both directions.
    delta = 0.15 * torch.randn(B, T, generator=g, dtype=DT)
    delta[0, 1], delta[3, 2], delta[5, 0], delta[7, 4] = 1.3, -0.9, 0.6, 1.6
    logprobs = (old_logprobs + delta).clamp(max=-1e-3)
    rollout_logprobs = old_logprobs + 0.3 * torch.randn(B, T, generator=g, dtype=DT)
    rollout_logprobs[2, 5] -= 2.5   # a token the rollout found very unlikely
    pi = torch.exp(old_logprobs)
    # Σπ² lies in [π_y², 1]: the sampled token's share plus some of the rest.
    sum_pi_sq = pi**2 + torch.rand(B, T, generator=g, dtype=DT) * (1 - pi) ** 2
    advantages = torch.randn(B, T, generator=g, dtype=DT)
    advantages[1] = 0.0   # a zero-advantage row
    values = torch.randn(B, T, generator=g, dtype=DT)
    new_values = values + 0.4 * torch.randn(B, T, generator=g, dtype=DT)
    returns = values + torch.randn(B, T, generator=g, dtype=DT)
    is_weights = 0.5 + torch.rand(B, T, generator=g, dtype=DT)
    ref_logprobs = old_logprobs + 0.4 * torch.randn(B, T, generator=g, dtype=DT)
    # GDPO's two reward components (float32-exact values, as verl reads them as float32).
    comp_a = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0], dtype=DT)
    comp_b = torch.tensor([0.25, 0.5, 0.75, 0.0, 1.0, 0.5, 0.25, 0.0, 0.5], dtype=DT)
    # ReMax's baseline: a greedy response's score per sample.
    baseline_scores = scores * 0.5 - 0.1
    # The outcome alone, with exact zeros (GPG's α counts the nonzero scores) and ties.
    outcome_rewards = torch.zeros(B, T, dtype=DT)
    outcome_rewards[torch.arange(B), last] = scores
    return {"response_mask": mask, "token_level_rewards": token_rewards,
            "outcome_rewards": outcome_rewards, "baseline_scores": baseline_scores,
            "old_logprobs": old_logprobs, "logprobs": logprobs,
            "rollout_logprobs": rollout_logprobs, "sum_pi_squared": sum_pi_sq,
            "advantages": advantages, "values": values, "new_values": new_values,
            "returns": returns, "rollout_is_weights": is_weights, "ref_logprobs": ref_logprobs,
            "reward_component_a": comp_a, "reward_component_b": comp_b,
            "lengths": lengths.to(DT), "group_index": torch.tensor(GROUPS, dtype=DT)}


def _index(batch) -> np.ndarray:
    return np.array([int(i) for i in batch["group_index"]])


# ------------------------------------------------------------------------- advantages

ADVANTAGE_CASES = [
    ("grpo", {"norm_adv_by_std_in_grpo": True}),
    ("grpo", {"norm_adv_by_std_in_grpo": False}),
    ("grpo_vectorized", {"norm_adv_by_std_in_grpo": True}),
    ("rloo", {}),
    ("rloo_vectorized", {}),
    ("rloo", {"outcome": True}),
    ("opo", {}),
    ("gpg", {}),
    ("gpg", {"outcome": True}),
    ("grpo", {"norm_adv_by_std_in_grpo": True, "outcome": True}),
    ("grpo_passk", {"norm_adv_by_std_in_grpo": True, "no_singletons": True}),
    ("grpo_passk", {"norm_adv_by_std_in_grpo": False, "no_singletons": True}),
    ("grpo_passk", {"norm_adv_by_std_in_grpo": True, "no_singletons": True, "outcome": True}),
    ("gdpo", {"norm_adv_by_std_in_grpo": True}),
    ("gdpo", {"norm_adv_by_std_in_grpo": True, "gdpo_reward_keys": ["a", "b"],
              "gdpo_reward_weights": [1.0, 0.5]}),
    ("reinforce_plus_plus", {"gamma": 1.0}),
    ("reinforce_plus_plus", {"gamma": 0.9}),
    ("reinforce_plus_plus_baseline", {}),
    ("remax", {}),
    ("gae", {"gamma": 1.0, "lam": 1.0}),
    ("gae", {"gamma": 0.9, "lam": 0.8}),
    ("optimal_token_baseline", {}),
    ("optimal_token_baseline", {"with_is_weights": True}),
    ("tir_optimal_token_baseline", {}),
    ("tir_optimal_token_baseline", {"with_is_weights": True}),
]


def _passk_groups(batch) -> np.ndarray:
    # pass@k needs two samples per group: the two singletons join group 1.
    return np.array([0, 1, 0, 1, 1, 1, 0, 1, 1])


def verl_advantage(name: str, opts: dict, batch) -> tuple[torch.Tensor, torch.Tensor, list]:
    """verl's (advantages, returns) and the group index it was given."""
    rewards = batch["outcome_rewards" if opts.get("outcome") else "token_level_rewards"]
    mask = batch["response_mask"]
    index = _passk_groups(batch) if opts.get("no_singletons") else _index(batch)
    norm = opts.get("norm_adv_by_std_in_grpo", True)
    config = AlgoConfig(gamma=opts.get("gamma", 1.0), lam=opts.get("lam", 1.0),
                        norm_adv_by_std_in_grpo=norm,
                        gdpo_reward_keys=opts.get("gdpo_reward_keys"),
                        gdpo_reward_weights=opts.get("gdpo_reward_weights"))
    fn = ca.get_adv_estimator_fn(name)
    r = rewards.clone()   # the loop estimators write into their sums
    if name in ("grpo", "grpo_vectorized"):
        out = fn(r, mask, index, norm_adv_by_std_in_grpo=norm)
    elif name == "gae":
        out = fn(r, batch["values"], mask, gamma=opts["gamma"], lam=opts["lam"])
    elif name == "remax":
        out = fn(r, batch["baseline_scores"], mask, config=config)
    elif name in ("optimal_token_baseline", "tir_optimal_token_baseline"):
        weights = batch["rollout_is_weights"] if opts.get("with_is_weights") else None
        out = fn(r, mask, index, batch["old_logprobs"], batch["sum_pi_squared"],
                 rollout_is_weights=weights)
    elif name == "gdpo" and opts.get("gdpo_reward_keys"):
        B, T = mask.shape
        prompts = torch.zeros(B, 3, dtype=torch.long)
        attention = torch.cat([torch.ones(B, 3), mask], dim=1).long()
        non_tensor = {"a": batch["reward_component_a"].numpy(),
                      "b": batch["reward_component_b"].numpy()}
        out = fn(r, mask, index, norm_adv_by_std_in_grpo=norm, config=config,
                 non_tensor_batch=non_tensor, batch={"prompts": prompts,
                                                     "attention_mask": attention})
    else:
        # As verl's compute_advantage calls the other estimators: by keyword.
        out = fn(token_level_rewards=r, response_mask=mask, index=index, config=config,
                 norm_adv_by_std_in_grpo=norm)
    return out[0], out[1], index.tolist()


# ----------------------------------------------------------------------------- losses

LOSS_CASES = [
    ("vanilla", "token-mean", {}),
    ("vanilla", "seq-mean-token-mean", {"with_is_weights": True}),
    ("vanilla", "seq-mean-token-sum-norm", {}),
    ("vanilla", "token-sum", {}),
    ("vanilla", "seq-mean-token-sum", {}),
    ("gspo", "seq-mean-token-mean", {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4}),
    ("gspo", "token-mean", {"with_is_weights": True}),
    ("sapo", "token-mean", {}),
    ("sapo", "token-mean", {"tau_pos": 2.0, "tau_neg": 3.0, "with_is_weights": True}),
    ("geo_mean", "token-mean", {"clip_ratio_low": 0.4, "clip_ratio_high": 0.4}),
    ("geo_mean", "token-mean", {"with_is_weights": True}),
    ("cispo", "token-mean", {}),
    ("cispo", "seq-mean-token-mean", {"with_is_weights": True}),
    ("dppo_tv", "token-mean", {}),
    ("dppo_tv", "token-mean", {"clip_ratio_low": 0.05, "clip_ratio_high": 0.05,
                               "with_is_weights": True}),
    ("dppo_kl", "token-mean", {"clip_ratio_low": 0.02, "clip_ratio_high": 0.02}),
    ("dppo_kl", "seq-mean-token-mean", {"clip_ratio_c": 1.5, "with_is_weights": True}),
    ("gpg", "token-mean", {}),
    ("gpg", "seq-mean-token-sum", {"with_is_weights": True}),
    ("dro", "token-mean", {"dro_beta": 0.1}),
    ("dro", "token-mean", {"dro_beta": 2.0, "with_is_weights": True}),
    ("clip_cov", "token-mean", {"clip_cov_ratio": 0.2, "clip_cov_lb": 0.05,
                                "clip_cov_ub": 2.0}),
    ("clip_cov", "token-mean", {"clip_cov_ratio": 0.05, "clip_cov_lb": 0.0,
                                "clip_cov_ub": 5.0, "with_is_weights": True}),
    ("kl_cov", "token-mean", {"kl_cov_ratio": 0.15, "ppo_kl_coef": 0.5}),
    ("kl_cov", "token-mean", {"kl_cov_ratio": 0.0002, "ppo_kl_coef": 0.1,
                              "with_is_weights": True}),
    ("reinforce", "token-mean", {}),
    ("reinforce", "seq-mean-token-sum", {"with_is_weights": True}),
    ("bypass_mode", "token-mean", {"loss_type": "ppo_clip", "rollout_is": "token"}),
    ("bypass_mode", "token-mean", {"loss_type": "reinforce", "rollout_is": "token",
                                   "rollout_is_threshold": 1.5}),
    ("bypass_mode", "seq-mean-token-mean", {"loss_type": "reinforce", "rollout_is": "sequence",
                                            "rollout_is_batch_normalize": True}),
    ("bypass_mode", "token-mean", {"loss_type": "reinforce", "rollout_is": "token",
                                   "rollout_is_threshold": "0.7_1.6",
                                   "rollout_is_batch_normalize": True,
                                   "rollout_rs": "token_k1,seq_mean_k3",
                                   "rollout_rs_threshold": "0.4_2.5,0.08"}),
    ("bypass_mode", "token-mean", {"loss_type": "ppo_clip", "rollout_is": None,
                                   "rollout_rs": "seq_max_k2", "rollout_rs_threshold": 0.3}),
]

LOSS_DEFAULTS = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0,
                 "tau_pos": 1.0, "tau_neg": 1.05, "clip_cov_ratio": 0.0002, "clip_cov_lb": 1.0,
                 "clip_cov_ub": 5.0, "kl_cov_ratio": 0.0002, "ppo_kl_coef": 0.1,
                 "dro_beta": 0.1}
CORRECTION_KEYS = ("loss_type", "rollout_is", "rollout_is_threshold",
                   "rollout_is_batch_normalize", "rollout_rs", "rollout_rs_threshold")


def _actor_config(loss: str, agg: str, settings: dict, correction: dict) -> ActorConfig:
    rc = RolloutCorrectionConfig(**correction)
    policy_loss = PolicyLossConfig(
        loss_mode=loss, clip_cov_ratio=settings["clip_cov_ratio"],
        clip_cov_lb=settings["clip_cov_lb"], clip_cov_ub=settings["clip_cov_ub"],
        kl_cov_ratio=settings["kl_cov_ratio"], ppo_kl_coef=settings["ppo_kl_coef"],
        dro_beta=settings["dro_beta"], rollout_correction=rc)
    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_mini_batch_size=4,
                       ppo_micro_batch_size_per_gpu=4, loss_agg_mode=agg,
                       clip_ratio=settings["clip_ratio_low"],
                       clip_ratio_low=settings["clip_ratio_low"],
                       clip_ratio_high=settings["clip_ratio_high"],
                       clip_ratio_c=settings["clip_ratio_c"], tau_pos=settings["tau_pos"],
                       tau_neg=settings["tau_neg"], policy_loss=policy_loss)


def verl_loss(loss: str, agg: str, opts: dict, batch) -> tuple[float, torch.Tensor]:
    """verl's scalar policy loss and its gradient with respect to log π [B, T].

    Called as verl's trainer calls it: with global_batch_info carrying the mini-batch's token
    count and its number of rows with a token (dp_size 1), so the denominators come from the
    mask before any rejection, as dagrl's global denominators do.
    """
    settings = {**LOSS_DEFAULTS, **{k: v for k, v in opts.items() if k in LOSS_DEFAULTS}}
    correction = {k: opts[k] for k in CORRECTION_KEYS if k in opts}
    config = _actor_config(loss, agg, settings, correction)
    mask = batch["response_mask"]
    config.global_batch_info.update(dp_size=1, batch_num_tokens=mask.sum(),
                                    global_batch_size=(mask.sum(-1) > 0).sum(),
                                    loss_scale_factor=None)
    logprobs = batch["logprobs"].clone().requires_grad_(True)
    old = batch["rollout_logprobs"] if loss == "bypass_mode" else batch["old_logprobs"]
    weights = batch["rollout_is_weights"] if opts.get("with_is_weights") else None
    if loss == "clip_cov":
        torch.manual_seed(CLIP_COV_SEED)
    if loss == "reinforce":
        value, _ = ca.compute_policy_loss_reinforce(old, logprobs, batch["advantages"], mask,
                                                    loss_agg_mode=agg, config=config,
                                                    rollout_is_weights=weights)
    else:
        fn = ca.get_policy_loss_fn(loss)
        value, _ = fn(old, logprobs, batch["advantages"], mask, loss_agg_mode=agg,
                      config=config, rollout_is_weights=weights)
    (grad,) = torch.autograd.grad(value, logprobs)
    return float(value.detach()), grad


# ---------------------------------------------------------------- KL, value loss, agg

KL_NAMES = ["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl",
            "k1+", "kl+", "abs+", "k2+", "mse+", "k3+", "low_var_kl+"]
AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
             "seq-mean-token-sum-norm"]


def verl_kl(name: str, batch) -> tuple[torch.Tensor, torch.Tensor]:
    logprobs = batch["logprobs"].clone().requires_grad_(True)
    kl = ca.kl_penalty(logprobs, batch["ref_logprobs"], name)
    (grad,) = torch.autograd.grad((kl * batch["response_mask"]).sum(), logprobs)
    return kl.detach(), grad


def verl_value_loss(agg: str, clip: float, batch) -> tuple[float, float, torch.Tensor]:
    vpreds = batch["new_values"].clone().requires_grad_(True)
    loss, clipfrac = ca.compute_value_loss(vpreds, batch["returns"], batch["values"],
                                           batch["response_mask"], cliprange_value=clip,
                                           loss_agg_mode=agg)
    (grad,) = torch.autograd.grad(loss, vpreds)
    return float(loss), float(clipfrac), grad


def verl_agg(mode: str, loss_mat: torch.Tensor, mask: torch.Tensor) -> float:
    return float(ca.agg_loss(loss_mat, mask, mode))


CORRECTION_CASES = [
    {"rollout_is": "token", "rollout_is_threshold": 2.0},
    {"rollout_is": "sequence", "rollout_is_threshold": 5.0, "rollout_is_batch_normalize": True},
    {"rollout_is": "token", "rollout_is_threshold": "0.6_1.8", "rollout_is_batch_normalize": True},
    {"rollout_is": "sequence", "rollout_is_threshold": "0.2_3.0"},
    {"rollout_is": None, "rollout_rs": "token_k2,seq_sum_k1",
     "rollout_rs_threshold": "0.2,0.3_4.0"},
    {"rollout_is": "token", "rollout_is_threshold": 2.0,
     "rollout_rs": "token_k1,token_k3,seq_sum_k2,seq_sum_k3,seq_mean_k1,seq_mean_k2,seq_max_k3",
     "rollout_rs_threshold": "2.5"},
    # One option at a time, each with a threshold that rejects some tokens or sequences.
    {"rollout_is": None, "rollout_rs": "token_k1", "rollout_rs_threshold": 1.3},
    {"rollout_is": None, "rollout_rs": "token_k2", "rollout_rs_threshold": 0.05},
    {"rollout_is": None, "rollout_rs": "token_k3", "rollout_rs_threshold": 0.05},
    {"rollout_is": None, "rollout_rs": "seq_sum_k1", "rollout_rs_threshold": "0.7_1.5"},
    {"rollout_is": None, "rollout_rs": "seq_sum_k3", "rollout_rs_threshold": 0.3},
    {"rollout_is": None, "rollout_rs": "seq_mean_k1", "rollout_rs_threshold": 1.1},
    {"rollout_is": None, "rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.05},
    {"rollout_is": None, "rollout_rs": "seq_max_k2", "rollout_rs_threshold": 0.2},
    {"rollout_is": None, "rollout_rs": "seq_max_k3", "rollout_rs_threshold": 0.2},
]


def verl_correction(opts: dict, batch) -> tuple[torch.Tensor | None, torch.Tensor]:
    weights, mask, _ = compute_rollout_correction_and_rejection_mask(
        batch["old_logprobs"], batch["rollout_logprobs"], batch["response_mask"],
        rollout_is=opts.get("rollout_is"),
        rollout_is_threshold=opts.get("rollout_is_threshold", 2.0),
        rollout_is_batch_normalize=opts.get("rollout_is_batch_normalize", False),
        rollout_rs=opts.get("rollout_rs"), rollout_rs_threshold=opts.get("rollout_rs_threshold"))
    return (weights.batch["rollout_is_weights"] if weights is not None else None), mask


def _list(t: torch.Tensor | None):
    return None if t is None else t.detach().to(DT).tolist()


def main() -> None:
    batch = make_batch(seed=21)
    agg_mask = batch["response_mask"].clone()
    agg_mask[4] = 0.0   # an empty row for the aggregation modes
    advantages = []
    for name, opts in ADVANTAGE_CASES:
        adv, ret, index = verl_advantage(name, opts, batch)
        advantages.append({"name": name, "opts": opts, "group_index": index,
                           "advantages": _list(adv), "returns": _list(ret)})
    losses = []
    for loss, agg, opts in LOSS_CASES:
        value, grad = verl_loss(loss, agg, opts, batch)
        losses.append({"name": loss, "agg": agg, "opts": opts, "loss": value,
                       "grad": _list(grad)})
    kls = []
    for name in KL_NAMES:
        kl, grad = verl_kl(name, batch)
        kls.append({"name": name, "kl": _list(kl), "grad": _list(grad)})
    value_losses = []
    for agg, clip in (("token-mean", 0.25), ("seq-mean-token-mean", 0.1)):
        loss, clipfrac, grad = verl_value_loss(agg, clip, batch)
        value_losses.append({"agg": agg, "cliprange_value": clip, "loss": loss,
                             "clipfrac": clipfrac, "grad": _list(grad)})
    aggs = [{"mode": mode, "loss": verl_agg(mode, batch["advantages"], agg_mask)}
            for mode in AGG_MODES]
    corrections = []
    for opts in CORRECTION_CASES:
        weights, mask = verl_correction(opts, batch)
        corrections.append({"opts": opts, "weights": _list(weights), "mask": _list(mask)})
    # verl's adaptive KL controller input (ray_trainer.apply_kl_penalty): the batch mean of the
    # per-sequence masked mean of the k1 KL.
    kld = ca.kl_penalty(batch["old_logprobs"], batch["ref_logprobs"], "kl") * agg_mask
    seq_mean = (kld * agg_mask).sum(-1) / (agg_mask.sum(-1) + 1e-8)
    fixture = {
        "verl_version": verl.__version__, "torch_version": torch.__version__,
        "clip_cov_seed": CLIP_COV_SEED,
        "batch": {k: _list(v) for k, v in batch.items()}, "agg_mask": _list(agg_mask),
        "advantages": advantages, "losses": losses, "kl": kls, "value_loss": value_losses,
        "agg": aggs, "rollout_correction": corrections,
        "adaptive_kl_input": float(seq_mean.mean()),
    }
    for case in losses + value_losses + aggs:
        assert math.isfinite(case["loss"]), case
    OUT.write_text(json.dumps(fixture, indent=None, separators=(",", ":")) + "\n")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes) from verl {verl.__version__}")


if __name__ == "__main__":
    main()
