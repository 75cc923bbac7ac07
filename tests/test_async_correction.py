"""Off-policy correction as trainer.mode=async uses it (the rollout correction of
dagrl/algorithms/rollout_correction.py): TIS and MIS weights at token and sequence level, the
threshold-hit fractions, and the corrected PPO loss, each against numbers computed by hand here
(plain Python floats, not the code under test)."""

from __future__ import annotations

import math

import pytest
import torch

from dagrl.algorithms.loss_agg import agg_loss
from dagrl.algorithms.policy_loss import POLICY_LOSSES, PolicyLossParams
from dagrl.algorithms.rollout_correction import (
    is_threshold_hits,
    rejection_mask,
    rollout_is_weights,
)

# δ = log π_old − log π_rollout for 2 responses of 3 tokens; the last token of row 1 is padding
# (its huge δ must change nothing).
DELTA = [[0.5, -0.2, 1.5], [-1.0, 0.3, 9.9]]
MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]


def tensors():
    return torch.tensor(DELTA, dtype=torch.float64), torch.tensor(MASK, dtype=torch.float64)


def hand_token_weights(upper, lower=None):
    out = []
    for drow, mrow in zip(DELTA, MASK, strict=True):
        row = []
        for d, m in zip(drow, mrow, strict=True):
            w = math.exp(d) * m
            if lower is None:
                w = min(w, upper)                        # TIS: truncate at U
            elif not lower <= w <= upper:
                w = 0.0                                  # MIS: mask outside [L, U]
            row.append(w * m)
        out.append(row)
    return out


def hand_sequence_weights(upper, lower=None):
    out = []
    for drow, mrow in zip(DELTA, MASK, strict=True):
        w = math.exp(sum(d * m for d, m in zip(drow, mrow, strict=True)))
        if lower is None:
            w = min(w, upper)
        elif not lower <= w <= upper:
            w = 0.0
        out.append([w * m for m in mrow])
    return out


@pytest.mark.parametrize("level,threshold", [("token", "2.0"), ("token", "0.5_2.0"),
                                             ("sequence", "2.0"), ("sequence", "0.4_2.0")],
                         ids=["token-TIS", "token-MIS", "sequence-TIS", "sequence-MIS"])
def test_tis_and_mis_weights_equal_the_hand_computed_ones(level, threshold):
    delta, mask = tensors()
    upper_text = threshold.rpartition("_")
    upper = float(upper_text[2])
    lower = float(upper_text[0]) if upper_text[0] else None
    expected = (hand_token_weights if level == "token" else hand_sequence_weights)(upper, lower)
    got = rollout_is_weights(delta, mask, level, threshold)
    assert torch.allclose(got, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)
    # The fraction the threshold acted on (the async metrics' clipped / masked fraction).
    raw = (hand_token_weights(1e30) if level == "token" else hand_sequence_weights(1e30))
    hits = [[m > 0 and (r > upper or (lower is not None and r < lower))
             for r, m in zip(rrow, mrow, strict=True)] for rrow, mrow in zip(raw, MASK,
                                                                              strict=True)]
    assert is_threshold_hits(delta, mask, level, threshold).tolist() == hits


def test_the_hand_computed_cases_are_not_trivial():
    # Each case truncates or masks something and keeps something, so each can fail.
    assert hand_token_weights(2.0)[0][2] == 2.0 and hand_token_weights(2.0)[1][0] < 0.5
    assert hand_token_weights(2.0, 0.5)[1][0] == 0.0 and hand_token_weights(2.0, 0.5)[0][2] == 0
    assert hand_sequence_weights(2.0)[0] == [2.0, 2.0, 2.0]
    assert hand_sequence_weights(2.0, 0.4)[0] == [0.0, 0.0, 0.0]
    assert hand_sequence_weights(2.0, 0.4)[1][0] == pytest.approx(math.exp(-0.7))


def test_rejection_masks_tokens_and_sequences_by_hand():
    delta, mask = tensors()
    # token_k1 keeps a token when -δ lies in [log 0.5, log 2]: |δ| <= 0.693.
    assert rejection_mask(delta, mask, "token_k1", "0.5_2.0").tolist() == \
        [[1.0, 1.0, 0.0], [0.0, 1.0, 0.0]]
    # seq_mean_k3 keeps a sequence when its mean e^δ − 1 − δ is <= 0.5: row 0's mean is
    # (0.1487 + 0.0187 + 1.9817) / 3 = 0.716 (rejected), row 1's (0.3679 + 0.0499) / 2 = 0.209.
    k3 = [[math.exp(d) - 1 - d for d in row] for row in DELTA]
    assert sum(k3[0]) / 3 > 0.5 > sum(k3[1][:2]) / 2
    assert rejection_mask(delta, mask, "seq_mean_k3", "0.5").tolist() == \
        [[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]


def test_corrected_ppo_loss_equals_the_hand_computed_one():
    # log π − log π_old per token (the PPO ratio), advantages, and token-level TIS weights.
    log_ratio = [[0.1, -0.3, 0.25], [0.05, 0.6, 0.0]]
    adv = [[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]]
    delta, mask = tensors()
    weights = rollout_is_weights(delta, mask, "token", "2.0")
    eps_low, eps_high, c = 0.2, 0.28, 3.0
    total, count = 0.0, 0.0
    for i in range(2):
        for t in range(3):
            if not MASK[i][t]:
                continue
            r, a = math.exp(log_ratio[i][t]), adv[i][t]
            clipped = max(-a * r, -a * min(max(r, 1 - eps_low), 1 + eps_high))
            if a < 0:
                clipped = min(clipped, -a * c)
            total += hand_token_weights(2.0)[i][t] * clipped
            count += 1
    expected = total / count
    logprobs = torch.tensor(log_ratio, dtype=torch.float64)
    old = torch.zeros_like(logprobs)
    params = PolicyLossParams(clip_ratio_low=eps_low, clip_ratio_high=eps_high, clip_ratio_c=c)
    loss_mat, _ = POLICY_LOSSES.get("vanilla")(logprobs, old, torch.tensor(adv).double(), mask,
                                               params, rollout_is_weights=weights)
    assert float(agg_loss(loss_mat, mask, "token-mean")) == pytest.approx(expected, abs=1e-12)
    # and the weights matter: without them the loss differs
    plain, _ = POLICY_LOSSES.get("vanilla")(logprobs, old, torch.tensor(adv).double(), mask,
                                            params)
    assert float(agg_loss(plain, mask, "token-mean")) != pytest.approx(expected, abs=1e-6)
