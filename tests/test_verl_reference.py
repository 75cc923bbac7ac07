"""dagrl's algorithms against verl's own outputs, values and gradients to 1e-6.

The reference numbers in `golden/verl_algorithms.json` were computed by verl's
`core_algos` (and `rollout_corr_helper`) on the inputs stored beside them, by
`golden/verl_reference.py` (its docstring says how to rerun it; the fixture records the verl
version). The inputs have ragged lengths, response masks with gaps, singleton prompt groups and
ratios outside every clip range. Comparisons are on the response tokens: outside the mask dagrl
returns 0 and verl leaves whatever its arithmetic produced there.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dagrl.algorithms import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    AdvantageInputs,
    PolicyLossParams,
    RolloutCorrectionParams,
    agg_loss,
    clipped_value_loss,
    kl_penalty,
    pinned_agg_mode,
    rollout_correction,
)
from dagrl.algorithms.kl_control import controller_kl_sums

FIXTURE = json.loads((Path(__file__).parent / "golden" / "verl_algorithms.json").read_text())
DT = torch.float64
ATOL = 1e-6


def _t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=DT)


BATCH = {k: _t(v) for k, v in FIXTURE["batch"].items()}
MASK = BATCH["response_mask"]
VALID = MASK.bool()


def assert_close_on_mask(got: torch.Tensor, expected: torch.Tensor, mask=VALID) -> None:
    diff = (got - expected).abs()[mask]
    assert float(diff.max()) <= ATOL * max(1.0, float(expected[mask].abs().max())), (
        f"max |dagrl - verl| on the mask = {float(diff.max()):.3g}")


def _id(case: dict) -> str:
    opts = ",".join(f"{k}={v}" for k, v in case.get("opts", {}).items())
    return f"{case.get('name', case.get('mode', ''))}-{case.get('agg', '')}-{opts}"


def test_the_fixture_is_verls():
    # The numbers come from verl itself; the version is recorded with them.
    assert FIXTURE["verl_version"] == "0.9.1"
    assert len(FIXTURE["advantages"]) >= 20 and len(FIXTURE["losses"]) >= 30


def test_the_inputs_have_gaps_ragged_lengths_and_singleton_groups():
    lengths = MASK.sum(-1)
    assert len(set(lengths.tolist())) >= 5
    gaps = (MASK[:, 1:] > MASK[:, :-1]).any(-1)   # a 1 after a 0 in the row
    assert int(gaps.sum()) >= 2
    counts = torch.bincount(BATCH["group_index"].long())
    assert int((counts == 1).sum()) >= 2


# ------------------------------------------------------------------------- advantages


@pytest.mark.parametrize("case", FIXTURE["advantages"], ids=_id)
def test_advantage_estimator_matches_verl(case):
    opts = case["opts"]
    components = None
    if opts.get("gdpo_reward_keys"):
        components = {"a": BATCH["reward_component_a"], "b": BATCH["reward_component_b"]}
    rewards = BATCH["outcome_rewards" if opts.get("outcome") else "token_level_rewards"]
    x = AdvantageInputs(
        rewards, MASK,
        group_index=torch.tensor(case["group_index"], dtype=torch.long),
        values=BATCH["values"], baseline_scores=BATCH["baseline_scores"],
        old_logprobs=BATCH["old_logprobs"], sum_pi_squared=BATCH["sum_pi_squared"],
        rollout_is_weights=BATCH["rollout_is_weights"] if opts.get("with_is_weights") else None,
        reward_components=components, reward_weights=opts.get("gdpo_reward_weights"),
        gamma=opts.get("gamma", 1.0), lam=opts.get("lam", 1.0),
        norm_by_std=opts.get("norm_adv_by_std_in_grpo", True))
    adv, ret = ADVANTAGE_ESTIMATORS.get(case["name"])(x)
    assert_close_on_mask(adv, _t(case["advantages"]))
    assert_close_on_mask(ret, _t(case["returns"]))
    # Zero outside the mask (verl leaves values there for some estimators; dagrl does not).
    assert torch.all(adv[~VALID] == 0) and torch.all(ret[~VALID] == 0)


def test_gpg_cases_cover_zero_scores():
    # GPG's α = B / #{r ≠ 0}: the outcome-only case has zero scores, so α ≠ 1 there.
    scores = BATCH["outcome_rewards"].sum(-1)
    assert 0 < int((scores == 0).sum()) < len(scores)
    assert any(c["name"] == "gpg" and c["opts"].get("outcome") for c in FIXTURE["advantages"])


def test_rloo_twins_differ_only_on_singleton_groups():
    by_name = {c["name"]: c for c in FIXTURE["advantages"]
               if c["name"].startswith("rloo") and not c["opts"]}
    loop, vec = _t(by_name["rloo"]["advantages"]), _t(by_name["rloo_vectorized"]["advantages"])
    counts = torch.bincount(BATCH["group_index"].long())[BATCH["group_index"].long()]
    singleton = (counts == 1).unsqueeze(-1) & VALID
    # verl's loop keeps A = r for a singleton, its vectorized twin gives 0: both reproduced.
    assert torch.all(vec[singleton] == 0) and torch.all(loop[singleton] != 0)
    assert_close_on_mask(loop, vec, VALID & ~singleton)


def test_grpo_passk_refuses_singleton_groups():
    x = AdvantageInputs(BATCH["token_level_rewards"], MASK,
                        group_index=BATCH["group_index"].long())
    with pytest.raises(ValueError, match="at least 2 samples per group"):
        ADVANTAGE_ESTIMATORS.get("grpo_passk")(x)


# ----------------------------------------------------------------------------- losses


def _params(opts: dict) -> PolicyLossParams:
    base = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, dro_beta=0.1)
    fields = PolicyLossParams.__dataclass_fields__
    base.update({k: v for k, v in opts.items() if k in fields})
    correction = {k: ("" if v is None else str(v) if "threshold" in k else v)
                  for k, v in opts.items() if k in RolloutCorrectionParams.__dataclass_fields__}
    return PolicyLossParams(**base, rollout_correction=RolloutCorrectionParams(**correction))


def dagrl_loss(name: str, agg: str, opts: dict, logprobs: torch.Tensor) -> torch.Tensor:
    fn = POLICY_LOSSES.get(name)
    old = BATCH["rollout_logprobs"] if name == "bypass_mode" else BATCH["old_logprobs"]
    weights = BATCH["rollout_is_weights"] if opts.get("with_is_weights") else None
    if name == "clip_cov":
        torch.manual_seed(FIXTURE["clip_cov_seed"])
    loss_mat, stats = fn(logprobs, old, BATCH["advantages"], MASK, _params(opts),
                         rollout_is_weights=weights)
    for value in stats.values():
        assert not value.requires_grad and value.shape == MASK.shape
    return agg_loss(loss_mat, MASK, pinned_agg_mode(fn) or agg)


@pytest.mark.parametrize("case", FIXTURE["losses"], ids=_id)
def test_policy_loss_value_and_gradient_match_verl(case):
    logprobs = BATCH["logprobs"].clone().requires_grad_(True)
    loss = dagrl_loss(case["name"], case["agg"], case["opts"], logprobs)
    (grad,) = torch.autograd.grad(loss, logprobs)
    assert float(loss.detach()) == pytest.approx(case["loss"], abs=ATOL, rel=ATOL)
    assert_close_on_mask(grad, _t(case["grad"]))
    assert torch.all(grad[~VALID] == 0)


@pytest.mark.parametrize("name", ["clip_cov", "kl_cov", "dppo_tv", "dppo_kl", "geo_mean",
                                  "bypass_mode", "cispo", "sapo"])
def test_the_reference_cases_exercise_each_loss_branch(name):
    # A test on inputs where every branch agrees would not notice a wrong branch: the same
    # loss with the restraint switched off must give a different gradient.
    case = next(c for c in FIXTURE["losses"] if c["name"] == name)
    plain = {"clip_cov": "vanilla", "kl_cov": "vanilla", "dppo_tv": "gpg", "dppo_kl": "gpg",
             "geo_mean": "gspo", "bypass_mode": "vanilla", "cispo": "gpg", "sapo": "vanilla"}
    logprobs = BATCH["logprobs"].clone().requires_grad_(True)
    other = dagrl_loss(plain[name], case["agg"], {}, logprobs)
    (grad,) = torch.autograd.grad(other, logprobs)
    assert float((grad - _t(case["grad"])).abs().max()) > 1e-3


# ------------------------------------------------------------ KL, value loss, agg, IS


@pytest.mark.parametrize("case", FIXTURE["kl"], ids=_id)
def test_kl_estimator_value_and_gradient_match_verl(case):
    logprobs = BATCH["logprobs"].clone().requires_grad_(True)
    kl = kl_penalty(logprobs, BATCH["ref_logprobs"], case["name"])
    (grad,) = torch.autograd.grad((kl * MASK).sum(), logprobs)
    assert_close_on_mask(kl.detach(), _t(case["kl"]))
    assert_close_on_mask(grad, _t(case["grad"]))


def test_every_kl_name_of_verl_is_registered():
    assert {c["name"] for c in FIXTURE["kl"]} == set(KL_ESTIMATORS.names())


def test_straight_through_variants_take_k2s_gradient():
    by_name = {c["name"]: c for c in FIXTURE["kl"]}
    for name in ("k1", "abs", "k3"):
        assert by_name[f"{name}+"]["kl"] == by_name[name]["kl"]
        assert by_name[f"{name}+"]["grad"] == by_name["k2"]["grad"]
        assert by_name[name]["grad"] != by_name["k2"]["grad"]


@pytest.mark.parametrize("case", FIXTURE["value_loss"], ids=_id)
def test_value_loss_and_clipfrac_match_verl(case):
    vpreds = BATCH["new_values"].clone().requires_grad_(True)
    loss_mat, stats = clipped_value_loss(vpreds, BATCH["values"], BATCH["returns"], MASK,
                                         cliprange_value=case["cliprange_value"])
    loss = agg_loss(loss_mat, MASK, case["agg"])
    (grad,) = torch.autograd.grad(loss, vpreds)
    assert float(loss.detach()) == pytest.approx(case["loss"], abs=ATOL, rel=ATOL)
    assert_close_on_mask(grad, _t(case["grad"]))
    clipfrac = float(stats["vf_clip_frac"].sum() / MASK.sum())
    assert clipfrac == pytest.approx(case["clipfrac"], abs=1e-6)
    assert 0 < clipfrac < 1


@pytest.mark.parametrize("case", FIXTURE["agg"], ids=_id)
def test_loss_aggregation_matches_verl_with_an_empty_row(case):
    agg_mask = _t(FIXTURE["agg_mask"])
    assert int((agg_mask.sum(-1) == 0).sum()) == 1
    got = agg_loss(BATCH["advantages"], agg_mask, case["mode"])
    assert float(got) == pytest.approx(case["loss"], abs=ATOL, rel=ATOL)


def test_every_aggregation_mode_is_checked():
    assert {c["mode"] for c in FIXTURE["agg"]} == set(LOSS_AGG_MODES)


@pytest.mark.parametrize("case", FIXTURE["rollout_correction"], ids=_id)
def test_rollout_correction_matches_verl(case):
    opts = {k: ("" if v is None else str(v) if "threshold" in k else v)
            for k, v in case["opts"].items()}
    weights, mask = rollout_correction(BATCH["old_logprobs"] - BATCH["rollout_logprobs"], MASK,
                                       RolloutCorrectionParams(**opts))
    assert torch.equal(mask, _t(case["mask"]))
    if case["weights"] is None:
        assert weights is None
    else:
        assert_close_on_mask(weights, _t(case["weights"]))
    # Each case changes something: weights, or a rejected token for every rejection option.
    if case["opts"].get("rollout_rs"):
        assert bool((mask != MASK).any())
    else:
        assert weights is not None


def test_adaptive_kl_controller_input_matches_verl():
    agg_mask = _t(FIXTURE["agg_mask"])
    kl = kl_penalty(BATCH["old_logprobs"], BATCH["ref_logprobs"], "kl") * agg_mask
    sums = controller_kl_sums(kl, agg_mask)
    assert float(sums[0] / sums[1]) == pytest.approx(FIXTURE["adaptive_kl_input"], abs=1e-9)
    # ... which is not the token mean the controller used to get.
    token_mean = float((kl * agg_mask).sum() / agg_mask.sum())
    assert abs(token_mean - FIXTURE["adaptive_kl_input"]) > 1e-3


def test_every_registered_name_has_a_verl_reference():
    # cpgd is siiRL's (not in verl): tests/test_algorithms_more.py checks it by hand.
    assert {c["name"] for c in FIXTURE["advantages"]} == set(ADVANTAGE_ESTIMATORS.names()) - {
        "cpgd"}
    assert {c["name"] for c in FIXTURE["losses"]} == set(POLICY_LOSSES.names()) - {"cpgd"}
