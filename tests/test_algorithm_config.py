"""Selecting the algorithms by their verl names: config checks, `dagrl plan`, the graph nodes
they need, and the roles that feed them (the adaptive KL controller's input, the rollout
correction of the old_logprob node, GDPO's reward components)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dagrl.algorithms import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    OLD_POLICY_ESTIMATORS,
    POLICY_LOSSES,
    AdaptiveKLController,
    AdvantageInputs,
)
from dagrl.cli import main as cli_main
from dagrl.config import schema
from dagrl.config.loader import ConfigError
from dagrl.dag.spec import NodeSpec
from dagrl.data.batch import Batch
from dagrl.observe.metrics import StepMetrics
from dagrl.roles.advantage import advantage, kl_penalty
from dagrl.roles.forward import old_logprob
from dagrl.roles.plan import build_graph
from dagrl.train import load_cli_config


@pytest.mark.parametrize("key, registry", [
    ("adv_estimator", ADVANTAGE_ESTIMATORS), ("policy_loss", POLICY_LOSSES),
    ("kl_loss_type", KL_ESTIMATORS), ("kl_reward_type", KL_ESTIMATORS)])
def test_every_registered_name_is_accepted_and_others_refused_with_the_choices(key, registry):
    for name in registry.names():
        extra = ["algorithm.dro_beta=0.1"] if name == "dro" else []
        assert getattr(load_cli_config([f"algorithm.{key}={name}", *extra]).algorithm,
                       key) == name
    with pytest.raises(ConfigError) as err:
        load_cli_config([f"algorithm.{key}=no_such_name"])
    message = str(err.value)
    assert message.startswith(f"algorithm.{key}: unknown")
    assert all(name in message for name in registry.names())


@pytest.mark.parametrize("overrides, fragment", [
    (["algorithm.policy_loss=dro"], "dro_beta must be > 0"),
    (["algorithm.rollout_correction.rollout_rs=token_k4",
      "algorithm.rollout_correction.rollout_rs_threshold=2"], "unknown rollout_rs option"),
    (["algorithm.rollout_correction.rollout_rs=seq_max_k1",
      "algorithm.rollout_correction.rollout_rs_threshold=2"], "unknown rollout_rs option"),
    (["algorithm.rollout_correction.rollout_rs=token_k2"], "rollout_rs_threshold"),
    (["algorithm.rollout_correction.rollout_rs=token_k2,seq_sum_k3",
      "algorithm.rollout_correction.rollout_rs_threshold='1,2,3'"], "one per"),
    (["algorithm.rollout_correction.rollout_rs=token_k3",
      "algorithm.rollout_correction.rollout_rs_threshold=0.5_2"], "one upper bound"),
    (["algorithm.rollout_correction.rollout_is_threshold=2_1"], "rollout_is_threshold"),
    (["algorithm.rollout_correction.rollout_is=tokens"], "rollout_is"),
    (["algorithm.gdpo_reward_keys=[a,b]", "algorithm.gdpo_reward_weights=[1.0]"],
     "gdpo_reward_weights"),
    (["algorithm.kl_cov_ratio=0"], "kl_cov_ratio"),
])
def test_bad_algorithm_settings_name_the_key(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_cli_config(overrides)


def test_l_u_thresholds_stay_strings_on_the_command_line():
    # YAML 1.1 would read 0.5_2 as the float 0.52 (an underscore is its digit separator).
    rc = load_cli_config(["algorithm.rollout_correction.rollout_is_threshold=0.5_2",
                          "algorithm.rollout_correction.rollout_rs=token_k1",
                          "algorithm.rollout_correction.rollout_rs_threshold=0.5_2"]
                         ).algorithm.rollout_correction
    assert rc.rollout_is_threshold == "0.5_2" and rc.rollout_rs_threshold == "0.5_2"
    assert load_cli_config(["algorithm.rollout_correction.rollout_is_threshold=1.5"]
                           ).algorithm.rollout_correction.rollout_is_threshold == 1.5


def test_plan_shows_the_active_estimator_loss_and_terms(capsys):
    assert cli_main(["plan", "algorithm.policy_loss=sapo", "algorithm.adv_estimator=opo",
                     "algorithm.kl_loss_type=k3+"]) == 0
    out = capsys.readouterr().out
    assert "adv_estimator  opo: OPO" in out
    assert "policy_loss    sapo: SAPO" in out
    assert "seq-mean-token-mean (pinned by sapo; token-mean for the other terms)" in out
    assert "kl_loss        k3+ x 0.001" in out
    assert cli_main(["plan", "algorithm.policy_loss=bypass_mode",
                     "algorithm.rollout_correction.rollout_is=token"]) == 0
    assert "rollout_corr   is=token (threshold 2.0), rs=none, bypass loss_type=ppo_clip" in (
        capsys.readouterr().out)


def test_old_policy_estimators_agree_between_layers_and_read_sum_pi_squared():
    assert schema.OLD_POLICY_ESTIMATORS == OLD_POLICY_ESTIMATORS
    mask = torch.ones(2, 3)
    x = AdvantageInputs(torch.ones(2, 3), mask, group_index=torch.tensor([0, 0]),
                        old_logprobs=-torch.ones(2, 3))
    for name in ADVANTAGE_ESTIMATORS.names():
        if name in OLD_POLICY_ESTIMATORS:
            with pytest.raises(KeyError, match="sum_pi_squared"):
                ADVANTAGE_ESTIMATORS.get(name)(x)


def _roles(*overrides: str) -> list[str]:
    return [n.role for n in build_graph(load_cli_config(list(overrides))).nodes]


def test_graph_runs_old_logprob_when_the_algorithm_reads_pi_old():
    assert "old_logprob" not in _roles()
    assert "old_logprob" in _roles("algorithm.adv_estimator=optimal_token_baseline")
    assert "old_logprob" in _roles("algorithm.rollout_correction.rollout_is=token")
    # Bypass mode takes pi_old from the rollout, even with several updates per batch ...
    assert "old_logprob" not in _roles("algorithm.policy_loss=bypass_mode", "actor.ppo_epochs=2")
    # ... but a KL penalty in the reward still reads pi_old.
    assert "old_logprob" in _roles("algorithm.policy_loss=bypass_mode",
                                   "algorithm.kl_in_reward=true")


def _ctx(cfg, node: str, **engines) -> SimpleNamespace:
    return SimpleNamespace(config=cfg, node=NodeSpec(node, node), engines=SimpleNamespace(
        **engines), metrics=StepMetrics(), reduce_sum=lambda t: t)


def test_kl_penalty_steps_the_adaptive_controller_on_the_mean_of_sequence_means():
    cfg = load_cli_config(["algorithm.kl_in_reward=true", "algorithm.kl_ctrl=adaptive"])
    # One long sequence with a small KL, one short with a large one: the token mean is
    # (8·0.01 + 1·1.0) / 9 = 0.12 (above the 0.1 target), the mean of sequence means
    # (0.01 + 1.0) / 2 = 0.505: both raise beta here, by different amounts.
    mask = torch.zeros(2, 8)
    mask[0], mask[1, 0] = 1.0, 1.0
    old = torch.zeros(2, 8)
    ref = torch.full((2, 8), -0.01)
    ref[1, 0] = -1.0
    batch = Batch({"token_level_scores": torch.zeros(2, 8), "old_logprobs": old,
                   "ref_logprobs": ref, "response_mask": mask})
    ctrl = AdaptiveKLController(init_coef=0.1, target=0.1, horizon=100)
    kl_penalty(_ctx(cfg, "kl_penalty", kl_controller=ctrl), batch)
    error = min(max(0.505 / 0.1 - 1, -0.2), 0.2)
    assert ctrl.value == pytest.approx(0.1 * (1 + error * 2 / 100))
    # With a target of 0.3 the two readings disagree on the direction: the token mean (0.12)
    # would lower beta, verl's quantity (0.505) raises it.
    ctrl2 = AdaptiveKLController(init_coef=0.1, target=0.3, horizon=100)
    kl_penalty(_ctx(cfg, "kl_penalty", kl_controller=ctrl2), batch)
    assert ctrl2.value > 0.1


class _FakeActor:
    def __init__(self, old: torch.Tensor, sum_sq: torch.Tensor) -> None:
        self.old, self.sum_sq, self.asked = old, sum_sq, None

    def compute_logprobs(self, batch, with_sum_pi_squared=False):
        self.asked = with_sum_pi_squared
        return self.old, (self.sum_sq if with_sum_pi_squared else None)


def test_old_logprob_node_applies_the_rollout_correction_and_computes_sum_pi_squared():
    cfg = load_cli_config(["algorithm.adv_estimator=optimal_token_baseline",
                           "algorithm.rollout_correction.rollout_is=token",
                           "algorithm.rollout_correction.rollout_is_threshold=1.5",
                           "algorithm.rollout_correction.rollout_rs=token_k1",
                           "algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0"])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    rollout = torch.tensor([[-1.0, -1.0, -3.0, 0.0]])
    old = torch.tensor([[-0.8, -1.1, -1.0, 0.0]])   # ratios e^0.2, e^-0.1, e^2
    batch = Batch({"response_mask": mask, "rollout_logprobs": rollout})
    actor = _FakeActor(old, torch.full((1, 4), 0.3))
    out = old_logprob(_ctx(cfg, "old_logprob", actor=actor), batch)
    assert actor.asked is True and torch.equal(out["sum_pi_squared"], torch.full((1, 4), 0.3))
    # k1 = log(pi_rollout / pi_train) = -2 for the third token: outside [log 0.5, log 2].
    assert torch.equal(out["response_mask"], torch.tensor([[1.0, 1.0, 0.0, 0.0]]))
    expected = torch.tensor([[min(float(torch.tensor(0.2).exp()), 1.5),
                              float(torch.tensor(-0.1).exp()), 1.5, 0.0]])
    assert torch.allclose(out["rollout_is_weights"], expected)


def test_advantage_node_feeds_gdpo_its_reward_components():
    cfg = load_cli_config(["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[a,b]",
                           "algorithm.gdpo_reward_weights=[1.0,0.0]"])
    mask = torch.ones(4, 2)
    batch = Batch({"token_level_scores": torch.zeros(4, 2), "response_mask": mask,
                   "score_component_a": torch.tensor([1.0, 0.0, 1.0, 1.0]),
                   "score_component_b": torch.tensor([5.0, -3.0, 0.0, 2.0])},
                  {"uid": ["p", "p", "q", "q"]})
    out = advantage(_ctx(cfg, "advantage"), batch)
    # Weight 0 on b: only a counts; group q is all-equal in a, so its advantage is 0.
    adv = out["advantages"][:, 0]
    assert adv[2] == adv[3] and adv[0] > 0 > adv[1]
    assert float(adv[0]) == pytest.approx(-float(adv[1]))


def _actor(tiny_model, *overrides: str):
    from dagrl.engines.actor import ActorEngine
    from dagrl.engines.layout import EngineLayout

    cfg = load_cli_config(["algorithm.kl_loss_coef=0", *overrides])
    return ActorEngine(tiny_model, cfg.actor, cfg.algorithm, EngineLayout.of(cfg, 1),
                       temperature=1.0)


def _micro_batch(vocab: int) -> Batch:
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 1, 1], [1, 1, 1, 1]])
    return Batch({"prompt_ids": torch.randint(4, vocab, (4, 3), generator=g),
                  "prompt_mask": torch.ones(4, 3, dtype=torch.long),
                  "responses": torch.randint(4, vocab, (4, 4), generator=g),
                  "response_mask": mask, "advantages": torch.randn(4, 4, generator=g)})


def test_actor_weights_its_loss_by_the_rollout_is_weights_and_bypass_reads_the_rollout(
        tiny_model):
    actor = _actor(tiny_model)
    micro = _micro_batch(tiny_model.config.vocab_size)
    old, sum_sq = actor.compute_logprobs(micro, with_sum_pi_squared=True)
    micro["old_logprobs"] = old
    denoms = {"token-mean": float(micro["response_mask"].sum())}
    _, plain = actor.micro_loss(micro, denoms, StepMetrics())
    micro["rollout_is_weights"] = torch.full((4, 4), 2.5)
    _, weighted = actor.micro_loss(micro, denoms, StepMetrics())
    assert float(weighted) == pytest.approx(2.5 * float(plain), rel=1e-5)
    # Σπ² of the old_logprob pass: in (π_y², 1] on every response token.
    mask = micro["response_mask"].bool()
    assert bool(((sum_sq[mask] <= 1 + 1e-6) & (sum_sq[mask] >= old[mask].exp() ** 2 - 1e-6))
                .all())
    # bypass_mode takes pi_old from rollout_logprobs, whatever old_logprobs holds.
    bypass = _actor(tiny_model, "algorithm.policy_loss=bypass_mode")
    micro = micro.drop_keys(["rollout_is_weights"])
    micro["rollout_logprobs"] = old
    _, same = bypass.micro_loss(micro, denoms, StepMetrics())
    micro["old_logprobs"] = old - 1.0
    _, still = bypass.micro_loss(micro, denoms, StepMetrics())
    assert float(same) == pytest.approx(float(plain), rel=1e-5) and float(still) == float(same)
    micro["rollout_logprobs"] = old - 1.0
    _, moved = bypass.micro_loss(micro, denoms, StepMetrics())
    assert float(moved) != pytest.approx(float(same), rel=1e-3)
