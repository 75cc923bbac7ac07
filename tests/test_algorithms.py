from __future__ import annotations

import math

import pytest
import torch

from dagrl.algorithms import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    AdvantageInputs,
    PolicyLossParams,
    agg_denominator,
    agg_loss,
    compute_grpo_advantages,
    entropy_from_logits,
    kl_penalty,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_whiten,
)
from dagrl.registry import UnknownNameError

# ----------------------------------------------------------------------------------- utils


def test_masked_sum_and_mean_by_hand():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]], dtype=torch.bool)
    assert masked_sum(x, mask).item() == 3.0
    assert torch.equal(masked_sum(x, mask, dim=-1), torch.tensor([3.0, 0.0]))
    assert masked_mean(x, mask).item() == 1.5
    # The empty second row gives 0, not NaN.
    assert torch.equal(masked_mean(x, mask, dim=-1), torch.tensor([1.5, 0.0]))
    assert masked_mean(x, torch.zeros_like(mask)).item() == 0.0


def test_masked_mean_empty_row_has_finite_grad():
    x = torch.randn(2, 3, requires_grad=True)
    mask = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    masked_mean(x, mask, dim=-1).sum().backward()
    assert torch.equal(x.grad, mask)


def test_masked_whiten():
    torch.manual_seed(0)
    x = torch.randn(3, 6) * 4 + 2
    mask = torch.ones(3, 6)
    mask[0, 4:] = 0
    mask[2, 1:] = 0
    vals = x[mask.bool()]
    out = masked_whiten(x, mask)
    w = out[mask.bool()]
    assert torch.allclose(w, (vals - vals.mean()) / vals.std(), atol=1e-5)
    assert torch.all(out[~mask.bool()] == 0)
    kept = masked_whiten(x, mask, shift_mean=False)[mask.bool()]
    assert torch.allclose(kept, (vals - vals.mean()) / vals.std() + vals.mean(), atol=1e-5)
    with pytest.raises(ValueError, match="at least 2"):
        masked_whiten(x, torch.zeros(3, 6))


def test_logprobs_from_logits_matches_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 11)
    labels = torch.randint(0, 11, (2, 4))
    got = logprobs_from_logits(logits, labels)
    for b in range(2):
        for t in range(4):
            z = logits[b, t]
            expected = float(z[labels[b, t]]) - math.log(sum(math.exp(v) for v in z.tolist()))
            assert got[b, t].item() == pytest.approx(expected, abs=1e-5)
    with pytest.raises(ValueError, match="labels shape"):
        logprobs_from_logits(logits, labels[:, :3])


def test_entropy_from_logits():
    # Uniform over V = 8 has entropy log 8, whatever the (shared) logit value.
    assert entropy_from_logits(torch.full((8,), 3.0)).item() == pytest.approx(math.log(8))
    torch.manual_seed(0)
    logits = torch.randn(3, 5)
    probs = torch.softmax(logits, -1)
    expected = -(probs * probs.log()).sum(-1)
    assert torch.allclose(entropy_from_logits(logits), expected, atol=1e-6)


# ------------------------------------------------------------------------------ advantages


def _rewards_at_last_token(scores: list[float], lengths: list[int], T: int = 4):
    rewards = torch.zeros(len(scores), T)
    mask = torch.zeros(len(scores), T)
    for i, (s, n) in enumerate(zip(scores, lengths, strict=True)):
        mask[i, :n] = 1
        rewards[i, n - 1] = s
    return rewards, mask


# Groups interleaved: group 0 = samples 0, 2, 4 (scores 1, 0, 2; mean 1, std 1),
# group 1 = samples 1, 3 (scores 3, 1; mean 2, std √2), group 2 = sample 5 alone (score 0.5).
SCORES = [1.0, 3.0, 0.0, 1.0, 2.0, 0.5]
LENGTHS = [4, 2, 3, 1, 4, 2]
GROUPS = torch.tensor([0, 1, 0, 1, 0, 2])


@pytest.mark.parametrize(
    "norm_by_std, expected",
    [
        (True, [0.0, 1 / math.sqrt(2), -1.0, -1 / math.sqrt(2), 1.0, 0.5]),
        (False, [0.0, 1.0, -1.0, -1.0, 1.0, 0.5]),
    ],
)
def test_grpo_hand_values(norm_by_std, expected):
    rewards, mask = _rewards_at_last_token(SCORES, LENGTHS)
    adv, ret = compute_grpo_advantages(
        AdvantageInputs(rewards, mask, GROUPS, norm_by_std=norm_by_std, eps=0.0))
    assert torch.equal(adv, ret)
    for i, a in enumerate(expected):
        n = LENGTHS[i]
        assert torch.allclose(adv[i, :n], torch.full((n,), a), atol=1e-6), i
        assert torch.all(adv[i, n:] == 0), i


def test_grpo_eps_and_registry():
    rewards, mask = _rewards_at_last_token(SCORES, LENGTHS)
    fn = ADVANTAGE_ESTIMATORS.get("grpo")
    adv, _ = fn(AdvantageInputs(rewards, mask, GROUPS))  # default eps = 1e-6
    # Sample 1: (3 - 2) / (√2 + 1e-6); the singleton: 0.5 / (1 + 1e-6).
    assert adv[1, 0].item() == pytest.approx(1 / (math.sqrt(2) + 1e-6), rel=1e-6)
    assert adv[5, 0].item() == pytest.approx(0.5 / (1 + 1e-6), rel=1e-6)


def test_grpo_permutation_equivariant():
    rewards, mask = _rewards_at_last_token(SCORES, LENGTHS)
    adv, _ = compute_grpo_advantages(AdvantageInputs(rewards, mask, GROUPS))
    perm = torch.tensor([3, 0, 5, 2, 4, 1])
    adv_p, _ = compute_grpo_advantages(AdvantageInputs(rewards[perm], mask[perm], GROUPS[perm]))
    assert torch.allclose(adv_p, adv[perm])


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_random_groups_match_loop_and_sum_to_zero(norm_by_std):
    g = torch.Generator().manual_seed(1)
    B, T, G = 24, 5, 5
    group_index = torch.randint(0, G, (B,), generator=g)
    group_index[:G] = torch.arange(G)  # every id used at least once
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    rewards = torch.randn(B, T, generator=g) * mask
    adv, _ = compute_grpo_advantages(
        AdvantageInputs(rewards, mask, group_index, norm_by_std=norm_by_std))

    scores = rewards.sum(-1).tolist()
    for gid in range(G):
        members = [i for i in range(B) if group_index[i] == gid]
        vals = [scores[i] for i in members]
        n = len(vals)
        mean = sum(vals) / n if n > 1 else 0.0
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1)) if n > 1 else 1.0
        for i in members:
            a = (scores[i] - mean) / (std + 1e-6) if norm_by_std else scores[i] - mean
            assert adv[i, 0].item() == pytest.approx(a, abs=1e-5)
        if n > 1:
            assert sum(adv[i, 0].item() for i in members) == pytest.approx(0.0, abs=1e-5)
    assert torch.all(adv[mask == 0] == 0)


def test_grpo_input_errors():
    rewards, mask = _rewards_at_last_token(SCORES, LENGTHS)
    with pytest.raises(ValueError, match="group_index"):
        compute_grpo_advantages(AdvantageInputs(rewards, mask, GROUPS[:4]))
    with pytest.raises(ValueError, match="integer"):
        compute_grpo_advantages(AdvantageInputs(rewards, mask, GROUPS.float()))
    with pytest.raises(ValueError, match="response_mask"):
        compute_grpo_advantages(AdvantageInputs(rewards, mask[:, :3], GROUPS))


# ------------------------------------------------------------------------------------- KL


def test_kl_hand_values_and_aliases():
    logp = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-2.0, -1.0])
    expected = {
        "k1": [1.0, -1.0],
        "abs": [1.0, 1.0],
        "k2": [0.5, 0.5],
        # δ = ref − logp = [-1, 1]: e^δ − δ − 1 = [e⁻¹, e − 2]
        "k3": [math.exp(-1), math.e - 2],
    }
    for kind, vals in expected.items():
        assert torch.allclose(kl_penalty(logp, ref, kind), torch.tensor(vals)), kind
    for alias, name in [("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3")]:
        assert KL_ESTIMATORS.get(alias) is KL_ESTIMATORS.get(name)


def test_kl_zero_when_equal_and_k3_nonnegative():
    torch.manual_seed(0)
    logp = torch.randn(4, 7) - 2
    for kind in KL_ESTIMATORS.names():
        assert torch.all(kl_penalty(logp, logp.clone(), kind) == 0), kind
    ref = torch.randn(4, 7) * 3 - 2
    assert torch.all(kl_penalty(logp, ref, "k3") >= 0)


def test_k3_clamped_with_finite_grad():
    logp = torch.tensor([-50.0, -1.0], requires_grad=True)
    ref = torch.tensor([-1.0, -1.0])
    out = kl_penalty(logp, ref, "k3")
    assert out[0].item() == 10.0
    out.sum().backward()
    assert torch.isfinite(logp.grad).all()


def test_kl_unknown_kind():
    with pytest.raises(UnknownNameError, match="k3"):
        kl_penalty(torch.zeros(2), torch.zeros(2), "k4")


# ---------------------------------------------------------------------------- policy loss

CLIP = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0}


def test_vanilla_policy_loss_branches():
    # One token per branch; the last column is padding.
    ratios = [1.1, 1.5, 0.5, 4.0, 0.5, 2.0]
    advs = [1.0, 1.0, -1.0, -1.0, 2.0, 5.0]
    mask = torch.tensor([[1.0, 1, 1, 1, 1, 0]])
    old = torch.tensor([[-1.0, -2.0, -0.5, -3.0, -1.5, -1.0]])
    logp = (old + torch.tensor([ratios]).log()).requires_grad_(True)
    adv = torch.tensor([advs])
    fn = POLICY_LOSSES.get("vanilla")
    loss, stats = fn(logp, old, adv, mask, PolicyLossParams(**CLIP))

    # 0 unclipped: -1·1.1; 1 clipped high: -1·1.28; 2 clipped low: max(0.5, 0.8) = 0.8;
    # 3 dual clip: min(max(4, 1.28), 3) = 3; 4 A>0 with small r: max(-1, -1.6) = -1; 5 padding.
    expected = torch.tensor([[-1.1, -1.28, 0.8, 3.0, -1.0, 0.0]])
    assert torch.allclose(loss, expected, atol=1e-6)
    assert torch.equal(stats["clip_frac"], torch.tensor([[0.0, 1, 1, 0, 0, 0]]))
    assert torch.equal(stats["clip_frac_lower"], torch.tensor([[0.0, 0, 0, 1, 0, 0]]))
    assert torch.allclose(stats["ratio"], torch.tensor([ratios]) * mask, atol=1e-6)
    assert torch.allclose(stats["approx_kl"], -torch.tensor([ratios]).log() * mask, atol=1e-6)

    # d(-A·r)/d logp = -A·r on unclipped tokens, 0 on clipped and padded ones.
    loss.sum().backward()
    expected_grad = torch.tensor([[-1.1, 0.0, 0.0, 0.0, -1.0, 0.0]])
    assert torch.allclose(logp.grad, expected_grad, atol=1e-6)


def test_vanilla_policy_loss_on_policy():
    torch.manual_seed(0)
    logp = torch.randn(3, 4)
    adv = torch.randn(3, 4)
    mask = torch.ones(3, 4)
    loss, stats = POLICY_LOSSES.get("vanilla")(logp, logp.clone(), adv, mask,
                                               PolicyLossParams(**CLIP))
    assert torch.all(stats["clip_frac"] == 0)
    assert torch.all(stats["clip_frac_lower"] == 0)
    assert torch.allclose(loss, -adv)


def test_vanilla_policy_loss_validates_clip_ratio_c():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        POLICY_LOSSES.get("vanilla")(
            x, x, x, x, PolicyLossParams(clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=1.0)
        )
    with pytest.raises(ValueError, match="advantages"):
        POLICY_LOSSES.get("vanilla")(x, x, torch.zeros(1, 3), x, PolicyLossParams(**CLIP))


# --------------------------------------------------------------------------- loss agg

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


# A third row with no valid token: the seq-mean modes divide by the 2 rows that have one.
LOSS3 = torch.cat([LOSS, torch.tensor([[9.0, 9.0, 9.0]])])
MASK3 = torch.cat([MASK, torch.zeros(1, 3)])


@pytest.mark.parametrize(
    "mode, expected, denom",
    [
        ("token-mean", 7 / 3, 3.0),
        ("token-sum", 7.0, 0.0),
        ("seq-mean-token-sum", (3 + 4) / 2, 2.0),
        ("seq-mean-token-mean", (3 / 2 + 4 / 1) / 2, 2.0),
        ("seq-mean-token-sum-norm", (3 + 4) / (2 * 3), 2.0),
    ],
)
def test_agg_loss_hand_values(mode, expected, denom):
    assert agg_loss(LOSS3, MASK3, mode).item() == pytest.approx(expected)
    assert agg_denominator(MASK3, mode) == denom
    # An explicit denominator replaces the local one (token-sum's D of 0 is floored to 1).
    d = max(denom, 1.0)
    assert agg_loss(LOSS3, MASK3, mode, denom=4.0).item() == pytest.approx(expected * d / 4)
    assert agg_loss(LOSS3, MASK3, mode, denom=torch.tensor(4.0)).item() == pytest.approx(
        expected * d / 4
    )


def test_agg_loss_max_len_and_empty_mask():
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", max_len=7).item() == pytest.approx(
        7 / 14
    )
    for mode in LOSS_AGG_MODES:
        assert agg_loss(LOSS, torch.zeros_like(MASK), mode).item() == 0.0
    assert set(LOSS_AGG_MODES) == {
        "token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
        "seq-mean-token-sum-norm"
    }


def test_agg_loss_errors():
    with pytest.raises(ValueError, match="token-mean"):
        agg_loss(LOSS, MASK, "token-max")
    with pytest.raises(ValueError, match="seq-mean-token-sum-norm"):
        agg_denominator(MASK, "mean")
    with pytest.raises(ValueError, match="mask"):
        agg_loss(LOSS, MASK[:, :2], "token-mean")


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batches_with_global_denom_sum_to_full_batch(mode):
    g = torch.Generator().manual_seed(0)
    B, T = 7, 6
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    loss_full = torch.randn(B, T, generator=g).requires_grad_(True)
    full = agg_loss(loss_full, mask, mode)
    (grad_full,) = torch.autograd.grad(full, loss_full)

    global_denom = agg_denominator(mask, mode)
    pieces = [
        agg_loss(lm, m, mode, denom=global_denom)
        for lm, m in zip(loss_full.tensor_split(3), mask.tensor_split(3), strict=True)
    ]
    total = sum(pieces)
    (grad_split,) = torch.autograd.grad(total, loss_full)
    assert total.item() == pytest.approx(full.item(), abs=1e-6)
    assert torch.allclose(grad_split, grad_full, atol=1e-7)
