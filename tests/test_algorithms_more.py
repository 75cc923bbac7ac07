from __future__ import annotations

import contextlib
import math

import pytest
import torch

from dagrl.algorithms import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    AdaptiveKLController,
    AdvantageInputs,
    FixedKLController,
    PolicyLossParams,
    apply_kl_penalty,
    clipped_value_loss,
    compute_grpo_advantages,
    global_masked_whiten,
    groups_with_variance,
    kl_penalty,
    masked_whiten,
    overlong_penalty,
)

# ----------------------------------------------------------------------------- helpers


class _Pause(Exception):
    """Raised by a simulated worker's reducer when the other workers' sums are not known yet."""


def run_ranks(fn, shards):
    """Run ``fn(shard, reducer)`` as if each shard sat on its own worker.

    Reducer call k of every worker must return the sum of what all workers passed to call k.
    A worker cannot wait for the others here, so the simulation replays: each round runs every
    worker with the totals known so far; the first unknown call records its input and stops the
    worker; the recorded inputs are summed into the next total. Returns each worker's output.
    """
    totals: list[torch.Tensor] = []
    while True:
        outputs, sent = [], []
        for shard in shards:
            replies = iter(totals)

            def reducer(t: torch.Tensor, replies=replies, sent=sent) -> torch.Tensor:
                reply = next(replies, None)
                if reply is None:
                    sent.append(t.clone())
                    raise _Pause
                assert reply.shape == t.shape
                return reply.clone()

            with contextlib.suppress(_Pause):
                outputs.append(fn(shard, reducer))
        if not sent:
            return outputs
        assert len(sent) == len(shards), "workers disagree on the number of reductions"
        totals.append(torch.stack(sent).sum(0))


def right_padded(lengths: list[int], T: int) -> torch.Tensor:
    return (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).float()


def random_batch(seed: int, B: int = 9, T: int = 6):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = right_padded(lengths.tolist(), T)
    rewards = torch.randn(B, T, generator=g) * mask
    values = torch.randn(B, T, generator=g)  # garbage on the padding on purpose
    return rewards, mask, values


def shards_of(*tensors, n: int = 3):
    return list(zip(*(t.tensor_split(n) for t in tensors), strict=True))


def whiten_list(vals: list[float]) -> list[float]:
    n = len(vals)
    mean = sum(vals) / n
    var = sum((v - mean) ** 2 for v in vals) / (n - 1)
    return [(v - mean) / math.sqrt(var + 1e-8) for v in vals]


# Groups interleaved: group 0 = samples 0, 2, 4 (scores 1, 0, 2), group 1 = samples 1, 3
# (scores 3, 1), group 2 = sample 5 alone (score 0.5).
SCORES = [1.0, 3.0, 0.0, 1.0, 2.0, 0.5]
LENGTHS = [4, 2, 3, 1, 4, 2]
GROUPS = torch.tensor([0, 1, 0, 1, 0, 2])


def rewards_at_last_token(scores=SCORES, lengths=LENGTHS, T: int = 4):
    mask = right_padded(lengths, T)
    rewards = torch.zeros(len(scores), T)
    for i, (s, n) in enumerate(zip(scores, lengths, strict=True)):
        rewards[i, n - 1] = s
    return rewards, mask


def assert_broadcast(adv: torch.Tensor, per_sample: list[float], lengths=LENGTHS) -> None:
    for i, a in enumerate(per_sample):
        n = lengths[i]
        assert torch.allclose(adv[i, :n], torch.full((n,), a), atol=1e-6), i
        assert torch.all(adv[i, n:] == 0), i


# ------------------------------------------------------------------- global whitening


def test_global_masked_whiten_three_ranks_equal_full_batch():
    torch.manual_seed(1)
    x = torch.randn(7, 5) * 2 - 3
    mask = right_padded([5, 1, 3, 4, 2, 5, 3], 5)
    assert torch.allclose(global_masked_whiten(x, mask), masked_whiten(x, mask), atol=1e-6)
    kept = global_masked_whiten(x, mask, shift_mean=False)
    assert torch.allclose(kept, masked_whiten(x, mask, shift_mean=False), atol=1e-6)
    with pytest.raises(ValueError, match="at least 2"):
        global_masked_whiten(x, right_padded([1, 0, 0, 0, 0, 0, 0], 5))

    calls: list[int] = []

    def rank(shard, reducer):
        def counting(t):
            calls.append(t.numel())
            return reducer(t)

        return global_masked_whiten(shard[0], shard[1], counting)

    outputs = run_ranks(rank, shards_of(x, mask))
    assert torch.allclose(torch.cat(outputs), masked_whiten(x, mask), atol=1e-6)
    # Two reductions per worker: the packed (Σ x·m, Σ m), then Σ (x − μ)²·m.
    assert calls[-2:] == [2, 1]
    # A rank's own statistics differ from the global ones, so the reducer really matters.
    local = global_masked_whiten(x[:3], mask[:3])
    assert not torch.allclose(local, outputs[0], atol=1e-3)


# ------------------------------------------------------------------------------ RLOO


def test_rloo_hand_values():
    rewards, mask = rewards_at_last_token()
    adv, ret = ADVANTAGE_ESTIMATORS.get("rloo")(AdvantageInputs(rewards, mask, GROUPS))
    # Group 0: 1 − (0+2)/2, 0 − (1+2)/2, 2 − (1+0)/2; group 1: 3 − 1, 1 − 3; singleton: r.
    assert_broadcast(adv, [0.0, 2.0, -1.5, -2.0, 1.5, 0.5])
    assert torch.equal(adv, ret)


def test_rloo_matches_loop_and_sums_to_zero_per_group():
    g = torch.Generator().manual_seed(3)
    B, T, G = 20, 4, 5
    group_index = torch.randint(0, G, (B,), generator=g)
    group_index[:G] = torch.arange(G)
    mask = right_padded(torch.randint(1, T + 1, (B,), generator=g).tolist(), T)
    rewards = torch.randn(B, T, generator=g) * mask
    adv, _ = ADVANTAGE_ESTIMATORS.get("rloo")(AdvantageInputs(rewards, mask, group_index))
    scores = rewards.sum(-1).tolist()
    for gid in range(G):
        members = [i for i in range(B) if group_index[i] == gid]
        for i in members:
            others = [scores[j] for j in members if j != i]
            expected = scores[i] - sum(others) / len(others) if others else scores[i]
            assert adv[i, 0].item() == pytest.approx(expected, abs=1e-5)
        if len(members) > 1:
            assert sum(adv[i, 0].item() for i in members) == pytest.approx(0.0, abs=1e-5)
    assert torch.all(adv[mask == 0] == 0)


# ---------------------------------------------------------------------- REINFORCE++


def test_reinforce_plus_plus_hand_values():
    rewards = torch.tensor([[1.0, 0.0, 2.0], [0.0, 3.0, 9.0]])  # 9 sits on padding
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]])
    fn = ADVANTAGE_ESTIMATORS.get("reinforce_plus_plus")
    adv, ret = fn(AdvantageInputs(rewards, mask, gamma=0.5))
    # Row 0: G2 = 2, G1 = 0 + ½·2, G0 = 1 + ½·1; row 1: G1 = 3, G0 = 0 + ½·3.
    assert torch.allclose(ret, torch.tensor([[1.5, 1.0, 2.0], [1.5, 3.0, 0.0]]))
    expected = whiten_list([1.5, 1.0, 2.0, 1.5, 3.0])
    assert torch.allclose(adv[mask.bool()], torch.tensor(expected), atol=1e-6)
    assert adv[1, 2] == 0


def test_reinforce_plus_plus_baseline_hand_values():
    rewards, mask = rewards_at_last_token()
    fn = ADVANTAGE_ESTIMATORS.get("reinforce_plus_plus_baseline")
    adv, ret = fn(AdvantageInputs(rewards, mask, GROUPS))
    centred = [0.0, 1.0, -1.0, -1.0, 1.0, 0.5]  # score − group mean (singleton: mean 0)
    # broadcast, then whiten
    tokens = [c for c, n in zip(centred, LENGTHS, strict=True) for _ in range(n)]
    white = whiten_list(tokens)
    assert_broadcast(adv, [white[sum(LENGTHS[:i])] for i in range(len(LENGTHS))])
    assert torch.equal(adv, ret)

    # A per-token −β·KL in the rewards enters (like verl) through the sequence sum.
    kl_part = torch.full_like(rewards, -0.1) * mask
    adv, _ = fn(AdvantageInputs(rewards + kl_part, mask, GROUPS))
    scores = (rewards + kl_part).sum(-1)
    mean = torch.tensor([(scores[0] + scores[2] + scores[4]) / 3, (scores[1] + scores[3]) / 2, 0])
    centred = (scores - mean[GROUPS]).unsqueeze(-1) * mask
    assert torch.allclose(adv, masked_whiten(centred, mask), atol=1e-6)


# ----------------------------------------------------------------------------- ReMax


def test_remax_hand_values():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.5, 1.0, 9.0]])  # 9 sits on padding
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]])
    baseline = torch.tensor([0.4, 1.0])
    remax = ADVANTAGE_ESTIMATORS.get("remax")
    adv, ret = remax(AdvantageInputs(rewards, mask, baseline_scores=baseline))
    assert torch.allclose(ret, torch.tensor([[1.0, 1.0, 1.0], [1.5, 1.0, 0.0]]))
    assert torch.allclose(adv, torch.tensor([[0.6, 0.6, 0.6], [0.5, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="baseline_scores"):
        remax(AdvantageInputs(rewards, mask, baseline_scores=torch.zeros(3)))


# ------------------------------------------------------------------------------- GAE


def gae_by_definition(rewards, values, mask, gamma, lam):
    """Â_t = Σ_l (γλ)^l δ_{t+l} by a direct double sum, V = 0 after the last response token."""
    B, T = rewards.shape
    adv = torch.zeros(B, T)
    for i in range(B):
        n = int(mask[i].sum())
        v = [values[i, t].item() for t in range(n)] + [0.0]
        delta = [rewards[i, t].item() + gamma * v[t + 1] - v[t] for t in range(n)]
        for t in range(n):
            adv[i, t] = sum((gamma * lam) ** length * delta[t + length] for length in range(n - t))
    return adv


def test_gae_matches_definition_and_whitens_advantages_only():
    rewards, mask, values = random_batch(seed=4)
    gae = ADVANTAGE_ESTIMATORS.get("gae")
    adv, ret = gae(AdvantageInputs(rewards, mask, values=values, gamma=0.9, lam=0.8))
    raw = gae_by_definition(rewards, values, mask, 0.9, 0.8)
    assert torch.allclose(ret, (raw + values) * mask, atol=1e-5)
    assert torch.allclose(adv, masked_whiten(raw, mask), atol=1e-5)
    with pytest.raises(ValueError, match="values"):
        ADVANTAGE_ESTIMATORS.get("gae")(AdvantageInputs(rewards, mask, values=values[:, :2]))


def test_gae_lambda_gamma_one_returns_are_reward_to_go():
    rewards, mask, values = random_batch(seed=5)
    gae = ADVANTAGE_ESTIMATORS.get("gae")
    _, ret = gae(AdvantageInputs(rewards, mask, values=values, gamma=1.0, lam=1.0))
    B, T = rewards.shape
    for i in range(B):
        for t in range(T):
            to_go = sum(rewards[i, k].item() for k in range(t, T)) if mask[i, t] else 0.0
            # returns − values = Σ_{k≥t} r_k − V_t, i.e. returns are the plain reward-to-go.
            assert ret[i, t].item() == pytest.approx(to_go, abs=1e-5)


@pytest.mark.parametrize("name", ["reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae",
                                  "gdpo", "gpg"])
def test_whitening_estimators_three_ranks_equal_single_process(name):
    rewards, mask, values = random_batch(seed=6, B=12)
    # Zero scores on the first two ranks only (GPG's α counts the nonzero ones globally).
    rewards[[0, 1, 5]] = 0.0
    group_index = torch.arange(12) // 4  # 3 prompts × 4 samples, one prompt per rank
    fn = ADVANTAGE_ESTIMATORS.get(name)

    def call(shard, reducer):
        rewards, mask, group_index, values = shard
        return fn(AdvantageInputs(rewards, mask, group_index, values, reducer=reducer))

    full_adv, full_ret = call((rewards, mask, group_index, values), None)
    outputs = run_ranks(call, shards_of(rewards, mask, group_index, values))
    assert torch.allclose(torch.cat([a for a, _ in outputs]), full_adv, atol=1e-5)
    assert torch.allclose(torch.cat([r for _, r in outputs]), full_ret, atol=1e-5)
    # Each rank's own statistics would give other advantages: the reducer is what matters.
    alone = call(shards_of(rewards, mask, group_index, values)[0], None)[0]
    assert not torch.allclose(alone, outputs[0][0], atol=1e-3)


# ------------------------------------------------------------------------------ CPGD


@pytest.mark.parametrize(
    "norm_by_std, expected",
    [
        (True, [0.0, 1 / math.sqrt(2), -1.0, -1 / math.sqrt(2), 1.0, 0.5]),  # STD weight
        (False, [0.0, 1.0, -1.0, -1.0, 1.0, 0.5]),  # equal weight
    ],
)
def test_cpgd_advantage_hand_values(norm_by_std, expected):
    rewards, mask = rewards_at_last_token()
    fn = ADVANTAGE_ESTIMATORS.get("cpgd")
    adv, ret = fn(AdvantageInputs(rewards, mask, GROUPS, norm_by_std=norm_by_std, eps=0.0))
    assert_broadcast(adv, expected)
    assert torch.equal(adv, ret)
    # The paper: with the STD weight A^CPGD is GRPO's advantage.
    grpo, _ = compute_grpo_advantages(
        AdvantageInputs(rewards, mask, GROUPS, norm_by_std=norm_by_std, eps=0.0))
    assert torch.allclose(adv, grpo)


NEEDS = {"grpo": "group_index", "rloo": "group_index", "cpgd": "group_index",
         "reinforce_plus_plus_baseline": "group_index", "remax": "baseline_scores",
         "gae": "values", "grpo_vectorized": "group_index", "rloo_vectorized": "group_index",
         "opo": "group_index", "gpg": "group_index", "grpo_passk": "group_index",
         "gdpo": "group_index", "optimal_token_baseline": "group_index",
         "tir_optimal_token_baseline": "group_index"}


@pytest.mark.parametrize("name", ADVANTAGE_ESTIMATORS.names())
def test_estimators_name_a_missing_input_and_its_node(name):
    rewards, mask = rewards_at_last_token()
    fn = ADVANTAGE_ESTIMATORS.get(name)
    if name not in NEEDS:   # rewards and mask are all it reads
        fn(AdvantageInputs(rewards, mask))
        return
    with pytest.raises(KeyError, match=rf"needs '{NEEDS[name]}'.*before the advantage node"):
        fn(AdvantageInputs(rewards, mask))


# ----------------------------------------------------------------------- policy losses

CLIP = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)


def test_gspo_hand_values_and_gradient():
    # Per-token log-ratios; the third column is padding (its 7.0 must not count).
    log_ratio = torch.tensor([
        [0.1, 0.3, 7.0],    # mean 0.2: s = e^0.2 = 1.2214, A = 1  -> unclipped
        [0.6, 0.0, 7.0],    # mean 0.3: s = 1.3499,          A = 2  -> clipped at 1.28
        [-0.5, -0.1, 7.0],  # mean −0.3: s = 0.7408,         A = −1 -> clipped at 0.8
        [0.2, 0.4, 7.0],    # mean 0.3: s = 1.3499,          A = −1 -> unclipped
    ])
    mask = torch.tensor([[1.0, 1, 0]] * 4)
    adv = torch.tensor([[1.0], [2.0], [-1.0], [-1.0]]).expand(4, 3)
    old = torch.full((4, 3), -1.5)
    logp = (old + log_ratio).requires_grad_(True)
    loss, stats = POLICY_LOSSES.get("gspo")(logp, old, adv, mask, PolicyLossParams(**CLIP))

    s = [math.exp(0.2), math.exp(0.3), math.exp(-0.3), math.exp(0.3)]
    per_seq = [-s[0], -2 * 1.28, 0.8, s[3]]
    expected = torch.tensor([[v, v, 0.0] for v in per_seq])
    assert torch.allclose(loss, expected, atol=1e-5)
    assert torch.equal(stats["clip_frac"], torch.tensor([[0.0, 0, 0], [1, 1, 0], [1, 1, 0],
                                                         [0, 0, 0]]))
    # The ratio is the sequence's, the same at every token.
    assert torch.allclose(stats["ratio"], torch.tensor([[v, v, 0.0] for v in s]), atol=1e-5)

    # ∂(−A·s_i,t)/∂log π(y_t) = −A·s_i on every token of an unclipped sequence, 0 if clipped.
    loss.sum().backward()
    grad = [-s[0], 0.0, 0.0, s[3]]
    assert torch.allclose(logp.grad, torch.tensor([[g, g, 0.0] for g in grad]), atol=1e-5)


def test_gspo_token_gradient_equals_sequence_level_gspo():
    g = torch.Generator().manual_seed(7)
    B, T = 5, 6
    mask = right_padded([6, 3, 1, 5, 4], T)
    old = -torch.rand(B, T, generator=g) * 3
    logp = (old + 0.01 * torch.randn(B, T, generator=g)).requires_grad_(True)  # all unclipped
    adv_seq = torch.randn(B, generator=g)
    adv = adv_seq[:, None].expand(B, T)
    loss, stats = POLICY_LOSSES.get("gspo")(logp, old, adv, mask, PolicyLossParams(**CLIP))
    assert torch.all(stats["clip_frac"] == 0)
    (grad_token,) = torch.autograd.grad((loss.sum(-1) / mask.sum(-1)).sum(), logp)

    # Sequence-level GSPO written directly: −A_i · exp(mean_t log r_t), differentiated fully.
    lengths = mask.sum(-1)
    s = torch.exp(((logp - old) * mask).sum(-1) / lengths)
    (grad_seq,) = torch.autograd.grad((-adv_seq * s).sum(), logp)
    assert torch.allclose(grad_token, grad_seq, atol=1e-6)
    assert torch.all(grad_token[mask.bool()] != 0)  # every response token gets a gradient


@pytest.mark.parametrize("name", ["gspo", "cpgd"])
def test_on_policy_no_clipping_and_plain_policy_gradient(name):
    torch.manual_seed(0)
    old = torch.randn(3, 4) - 2
    logp = old.clone().requires_grad_(True)
    adv = torch.randn(3, 4)
    mask = right_padded([4, 2, 3], 4)
    loss, stats = POLICY_LOSSES.get(name)(logp, old, adv, mask, PolicyLossParams(**CLIP))
    assert torch.all(stats["clip_frac"] == 0)
    assert torch.allclose(stats["ratio"], mask)
    assert torch.all(stats["approx_kl"] == 0)
    # At π = π_old both reduce to the REINFORCE gradient −A·∇log π (CPGD's drift is 0 there).
    loss.sum().backward()
    assert torch.allclose(logp.grad, -adv * mask)


def test_cpgd_loss_hand_values_and_gradient():
    ln_r = torch.tensor([[0.1, 0.5, -0.5, 1.5, 0.3]])
    adv = torch.tensor([[1.0, 2.0, -1.0, -1.0, 1.0]])
    mask = torch.tensor([[1.0, 1, 1, 1, 0]])
    old = torch.tensor([[-1.0, -2.0, -0.5, -3.0, -1.0]])
    logp = (old + ln_r).requires_grad_(True)
    alpha = 0.1
    loss, stats = POLICY_LOSSES.get("cpgd")(logp, old, adv, mask,
                                            PolicyLossParams(**CLIP, drift_coef=alpha))

    lo, hi = math.log(0.8), math.log(1.28)
    phi = [0.1 * 1, hi * 2, lo * -1, 1.5 * -1]  # unclipped, clipped, clipped, unclipped
    coef = [min(math.exp(v) - 1, 2.0) for v in ln_r[0, :4].tolist()]  # token 3 is capped at c
    lp = logp[0, :4].tolist()
    expected = [-p + alpha * c * q for p, c, q in zip(phi, coef, lp, strict=True)] + [0.0]
    assert torch.allclose(loss, torch.tensor([expected]), atol=1e-5)
    assert torch.equal(stats["clip_frac"], torch.tensor([[0.0, 1, 1, 0, 0]]))

    # ∇ = −A on unclipped tokens (no ratio factor), 0 on clipped ones, plus α·min(r − 1, c).
    loss.sum().backward()
    unclipped = [1.0, 0.0, 0.0, 1.0]
    grad = [-a * u + alpha * c
            for a, u, c in zip(adv[0, :4].tolist(), unclipped, coef, strict=True)] + [0.0]
    assert torch.allclose(logp.grad, torch.tensor([grad]), atol=1e-5)


def test_new_policy_losses_validate_arguments():
    x = torch.zeros(1, 2)
    for name in ("gspo", "cpgd"):
        with pytest.raises(ValueError, match="clip_ratio_low"):
            POLICY_LOSSES.get(name)(x, x, x, x, PolicyLossParams(
                clip_ratio_low=1.0, clip_ratio_high=0.2, clip_ratio_c=3.0))
        with pytest.raises(ValueError, match="advantages"):
            POLICY_LOSSES.get(name)(x, x, torch.zeros(1, 3), x, PolicyLossParams(**CLIP))
    with pytest.raises(ValueError, match="drift_coef"):
        POLICY_LOSSES.get("cpgd")(x, x, x, x, PolicyLossParams(**CLIP, drift_coef=-1.0))


# ------------------------------------------------------------------------ value loss


def test_clipped_value_loss_hand_values():
    values = torch.tensor([[1.0, 2.0, 0.0, 5.0]], requires_grad=True)
    old = torch.tensor([[0.8, 1.0, 0.5, 0.0]])
    returns = torch.tensor([[1.5, 1.9, 0.6, 0.0]])
    mask = torch.tensor([[1.0, 1, 1, 0]])
    loss, stats = clipped_value_loss(values, old, returns, mask, cliprange_value=0.2)
    # 0: within range, ½·0.25; 1: v_clip = 1.2 is worse, ½·0.49; 2: v_clip = 0.3 is better,
    # so the unclipped ½·0.36 is kept; 3: padding.
    assert torch.allclose(loss, torch.tensor([[0.125, 0.245, 0.18, 0.0]]), atol=1e-6)
    assert torch.equal(stats["vf_clip_frac"], torch.tensor([[0.0, 1, 0, 0]]))
    # v_clip is clamp(V, V_old − c, V_old + c): a V inside the band is its own v_clip, so no
    # rounding of V_old + (V − V_old) can make an unclipped value count as clipped.
    # (float32 values found by search where V_old + clamp(V − V_old) != V and the rounded
    # v_clip lands further from R.)
    v_in = torch.tensor([[0.0026754653081297874, 0.03510507196187973, -0.07088997215032578]])
    v_old = torch.tensor([[0.3206188678741455, 0.26261842250823975, 0.23244187235832214]])
    ret = torch.tensor([[-1.3026106357574463, -0.8414995670318604, 0.1523282378911972]])
    assert bool(((v_in - v_old).abs() < 0.5).all())
    assert bool((v_old + (v_in - v_old) != v_in).all())
    _, stats_in = clipped_value_loss(v_in, v_old, ret, torch.ones(1, 3), cliprange_value=0.5)
    assert torch.equal(stats_in["vf_clip_frac"], torch.zeros(1, 3))
    loss.sum().backward()
    # d½(v − R)²/dv = v − R where the unclipped term wins; 0 where the clipped term is constant.
    assert torch.allclose(values.grad, torch.tensor([[-0.5, 0.0, -0.6, 0.0]]), atol=1e-6)
    with pytest.raises(ValueError, match="returns"):
        clipped_value_loss(values, old, returns[:, :2], mask, cliprange_value=0.2)


# ------------------------------------------------------------------------ KL control


def test_kl_controllers():
    fixed = FixedKLController(0.05)
    fixed.update(current_kl=100.0, n_steps=1000)
    assert fixed.value == 0.05
    restored_fixed = FixedKLController(0.0)
    restored_fixed.load_state_dict(fixed.state_dict())
    assert restored_fixed.value == 0.05

    ctl = AdaptiveKLController(init_coef=0.1, target=6.0, horizon=10000)
    ctl.update(current_kl=12.0, n_steps=256)  # e = clip(1.0) = 0.2
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 256 / 10000))
    up = ctl.value
    ctl.update(current_kl=6.6, n_steps=100)  # e = 0.1, inside the clip
    assert ctl.value == pytest.approx(up * (1 + 0.1 * 100 / 10000))
    before = ctl.value
    ctl.update(current_kl=3.0, n_steps=256)  # e = clip(−0.5) = −0.2
    assert ctl.value == pytest.approx(before * (1 - 0.2 * 256 / 10000))
    assert ctl.value < before

    restored = AdaptiveKLController(init_coef=1.0, target=6.0, horizon=10000)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == ctl.value
    with pytest.raises(ValueError, match="target"):
        AdaptiveKLController(init_coef=0.1, target=0.0, horizon=10)


@pytest.mark.parametrize("kind", ["k1", "k3"])
def test_apply_kl_penalty(kind):
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 7.0]])
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.5, -3.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.5], [-2.0, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]])
    rewards, kl = apply_kl_penalty(scores, logp, ref, mask, coef=0.5, kind=kind)
    expected_kl = kl_penalty(logp, ref, kind) * mask
    assert torch.allclose(kl, expected_kl)
    if kind == "k1":
        assert torch.allclose(kl, torch.tensor([[0.5, -1.0, 0.0], [1.0, -0.5, 0.0]]))
    assert torch.allclose(rewards, (scores - 0.5 * expected_kl) * mask)
    assert rewards[1, 2] == 0


# --------------------------------------------------------------------------- shaping


def test_overlong_penalty_three_regions():
    lengths = torch.tensor([0, 6, 7, 8, 10, 11, 20])  # max 10, buffer 4: ramp over (6, 10]
    got = overlong_penalty(lengths, max_len=10, buffer_len=4)
    assert torch.allclose(got, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0]))
    doubled = overlong_penalty(lengths, max_len=10, buffer_len=4, penalty_factor=2.0)
    assert torch.allclose(doubled, 2 * got)
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(lengths, max_len=10, buffer_len=0)
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(lengths, max_len=10, buffer_len=11)


def test_groups_with_variance():
    scores = torch.tensor([1.0, 0.0, 1.0, 0.5, 1.0, 0.5, 3.0])
    groups = torch.tensor([0, 1, 0, 2, 1, 2, 3])
    # Group 0: {1, 1} equal; group 1: {0, 1} varies; group 2: {0.5, 0.5}; group 3: singleton.
    got = groups_with_variance(scores, groups)
    assert got.dtype == torch.bool
    assert got.tolist() == [False, True, False, False, True, False, False]
    with pytest.raises(ValueError, match="group_index"):
        groups_with_variance(scores, groups[:3])


# ------------------------------------------------------- multi-turn: masks with gaps
#
# One multi-turn response: the policy's tokens at columns 0, 1 and 4, a tool's answer at
# columns 2-3 (masked: read by the policy, not trained on), padding at column 5. The values 9
# and 7 sit where nothing may read them. Observation tokens carry no reward and take no
# discount or TD step: the policy's tokens 0, 1, 4 are three consecutive steps.
GAP_MASK = torch.tensor([[1.0, 1, 0, 0, 1, 0]])
GAP_REWARDS = torch.tensor([[0.0, 0.5, 9.0, 9.0, 1.0, 9.0]])
GAP_VALUES = torch.tensor([[0.2, 0.4, 7.0, 7.0, 0.6, 7.0]])


def test_reinforce_plus_plus_on_a_gapped_mask_equals_the_hand_computed_returns():
    # γ = 0.5 over the steps 0 -> 1 -> 4:
    #   G4 = 1;  G1 = 0.5 + 0.5·1 = 1.0;  G0 = 0 + 0.5·1.0 = 0.5
    fn = ADVANTAGE_ESTIMATORS.get("reinforce_plus_plus")
    adv, ret = fn(AdvantageInputs(GAP_REWARDS, GAP_MASK, gamma=0.5))
    assert ret.tolist() == [[0.5, 1.0, 0.0, 0.0, 1.0, 0.0]]
    assert torch.allclose(adv[GAP_MASK.bool()], torch.tensor(whiten_list([0.5, 1.0, 1.0])),
                          atol=1e-6)
    assert adv[0, 2:4].abs().sum() == 0 and adv[0, 5] == 0


def test_gae_on_a_gapped_mask_equals_the_hand_computed_advantages():
    # γ = 0.9, λ = 0.8 (γλ = 0.72), V after the last step = 0:
    #   δ4 = 1 + 0.9·0 − 0.6 = 0.4                      Â4 = 0.4
    #   δ1 = 0.5 + 0.9·0.6 − 0.4 = 0.64                 Â1 = 0.64 + 0.72·0.4 = 0.928
    #   δ0 = 0 + 0.9·0.4 − 0.2 = 0.16                   Â0 = 0.16 + 0.72·0.928 = 0.82816
    # returns R = Â + V: 1.02816, 1.328, 1.0
    gae = ADVANTAGE_ESTIMATORS.get("gae")
    adv, ret = gae(AdvantageInputs(GAP_REWARDS, GAP_MASK, values=GAP_VALUES, gamma=0.9, lam=0.8))
    assert torch.allclose(ret, torch.tensor([[1.02816, 1.328, 0, 0, 1.0, 0]]), atol=1e-6)
    assert torch.allclose(adv[GAP_MASK.bool()],
                          torch.tensor(whiten_list([0.82816, 0.928, 0.4])), atol=1e-6)
    assert adv[0, 2:4].abs().sum() == 0 and adv[0, 5] == 0


@pytest.mark.parametrize("name", ["reinforce_plus_plus", "gae", "remax", "grpo", "rloo"])
def test_observation_tokens_change_nothing(name):
    # The gapped response gives its policy tokens exactly what the same response without the
    # observation columns gives (a second, contiguous row keeps the whitening statistics alike).
    # As the reward node writes them, rewards are 0 off the policy's tokens (the sequence
    # score of GRPO and RLOO is the row's sum).
    packed_mask = torch.tensor([[1.0, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0]])
    packed_rewards = torch.tensor([[0.0, 0.5, 1.0, 0, 0, 0], [0.3, 0, 0, 0.7, 0, 0]])
    packed_values = torch.tensor([[0.2, 0.4, 0.6, 0, 0, 0], [0.1, 0.5, 0.2, 0.3, 0, 0]])
    gapped = (torch.cat([GAP_REWARDS * GAP_MASK, packed_rewards[1:]]),
              torch.cat([GAP_MASK, packed_mask[1:]]),
              torch.cat([GAP_VALUES, packed_values[1:]]))
    fn = ADVANTAGE_ESTIMATORS.get(name)

    def run(rewards, mask, values):
        return fn(AdvantageInputs(rewards, mask, group_index=torch.tensor([0, 0]), values=values,
                                  baseline_scores=torch.tensor([0.2, 0.1]), gamma=0.9, lam=0.8))

    adv_g, ret_g = run(*gapped)
    adv_p, ret_p = run(packed_rewards, packed_mask, packed_values)
    policy = GAP_MASK[0].bool()
    assert torch.allclose(adv_g[0, policy], adv_p[0, :3], atol=1e-6)
    assert torch.allclose(ret_g[0, policy], ret_p[0, :3], atol=1e-6)
    assert torch.allclose(adv_g[1], adv_p[1], atol=1e-6)
    assert adv_g[0, ~policy].abs().sum() == 0 and ret_g[0, ~policy].abs().sum() == 0
