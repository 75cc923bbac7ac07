"""Every policy loss added for verl parity trains the default task (the tiny model on `a+b=`),
and the new estimators and the rollout correction run end to end, on one worker.

The loss runs take two optimizer steps per batch (actor.mini_batch_size = half the batch), so
the second update is off-policy and each loss's clip, gate or trust region is in play rather
than its on-policy gradient, which is the plain policy gradient for all of them.
"""

from __future__ import annotations

import math

import pytest

from dagrl.config.schema import Config
from dagrl.runtime.launch import launch
from dagrl.train import load_cli_config

FAST = ["logging.progress_bar=false", "logging.console_every=1000", "trainer.torch_threads=1"]

NEW_LOSSES = ["dppo_tv", "dppo_kl", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "dro",
              "cispo", "bypass_mode", "reinforce"]


def run(tmp_path, *overrides: str) -> list[dict]:
    cfg: Config = load_cli_config([f"trainer.run_dir={tmp_path / 'run'}", *FAST, *overrides])
    return launch(cfg)


def assert_finite(history: list[dict]) -> None:
    for step in history:
        for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "advantage/abs_mean",
                    "actor/entropy"):
            assert math.isfinite(step[key]), (step.get("step", "?"), key)


@pytest.mark.parametrize("loss", NEW_LOSSES)
def test_new_loss_trains_the_default_task_for_30_steps(tmp_path, loss):
    extra = ["algorithm.dro_beta=0.1"] if loss == "dro" else []
    history = run(tmp_path, f"algorithm.policy_loss={loss}", "trainer.total_steps=30",
                  "actor.mini_batch_size=16", *extra)
    assert len(history) == 30
    assert_finite(history)
    assert all(step["actor/optimizer_steps"] == 2.0 for step in history)
    rewards = [step["reward/mean"] for step in history]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.1, rewards


SCORER = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    digits = sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)
    exact = float(solution_str.strip() == str(ground_truth).strip())
    return {"score": 0.5 * digits + exact, "digits": digits, "exact": exact}
'''


@pytest.mark.parametrize("overrides, signature", [
    (["algorithm.adv_estimator=grpo_passk"], None),
    (["algorithm.adv_estimator=opo"], None),
    (["algorithm.adv_estimator=gpg"], None),
    (["algorithm.adv_estimator=rloo_vectorized"], None),
    (["algorithm.adv_estimator=optimal_token_baseline"], "timing/old_logprob_s"),
    (["algorithm.adv_estimator=tir_optimal_token_baseline"], "timing/old_logprob_s"),
    (["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[digits,exact]",
      "algorithm.gdpo_reward_weights=[1.0,2.0]"], "reward/digits"),
    (["algorithm.rollout_correction.rollout_is=token",
      "algorithm.rollout_correction.rollout_rs=seq_mean_k3",
      "algorithm.rollout_correction.rollout_rs_threshold=0.01"], "rollout_corr/is_weight_mean"),
    (["algorithm.policy_loss=bypass_mode", "algorithm.rollout_correction.loss_type=reinforce",
      "algorithm.rollout_correction.rollout_is=sequence", "actor.ppo_epochs=2"],
     "actor/rollout_rejected"),
    (["algorithm.kl_loss_type=k3+", "algorithm.loss_agg_mode=token-sum"], "actor/kl"),
], ids=lambda v: ",".join(o.split(".")[-1] for o in v) if isinstance(v, list) else str(v))
def test_new_estimators_and_corrections_run(tmp_path, overrides, signature):
    scorer = tmp_path / "scorer.py"
    scorer.write_text(SCORER)
    extra = [f"reward.custom_fn={scorer}:compute_score"] if "gdpo" in str(overrides) else []
    history = run(tmp_path, "trainer.total_steps=3", *overrides, *extra)
    assert len(history) == 3
    assert_finite(history)
    if signature:
        assert signature in history[-1] and math.isfinite(history[-1][signature]), signature
    if "rollout_corr/is_weight_mean" in history[-1]:
        # The native rollout and the trainer compute the same log-probs: weights of 1.
        assert history[-1]["rollout_corr/is_weight_mean"] == pytest.approx(1.0, abs=1e-3)


def test_a_pinned_aggregation_overrides_the_configured_mode(tmp_path):
    # SAPO and GMPO are sequence-mean losses: the configured mode must not change their loss,
    # while it does change vanilla PPO's (same seed, same first batch).
    def pg_loss(loss: str, mode: str) -> float:
        history = run(tmp_path / f"{loss}-{mode}", f"algorithm.policy_loss={loss}",
                      f"algorithm.loss_agg_mode={mode}", "trainer.total_steps=1",
                      "algorithm.kl_loss_coef=0")
        return history[0]["actor/pg_loss"]

    for loss in ("sapo", "geo_mean"):
        assert pg_loss(loss, "token-mean") == pytest.approx(pg_loss(loss, "seq-mean-token-sum"),
                                                            rel=1e-6, abs=1e-9)
    assert pg_loss("vanilla", "token-mean") != pytest.approx(
        pg_loss("vanilla", "seq-mean-token-sum"), rel=1e-3)
