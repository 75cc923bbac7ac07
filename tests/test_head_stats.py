"""The LM head's hand-written backward (engines/head_stats.py) against autograd through the
textbook computation: log-prob, entropy and Σp², their values and their gradients in the
hidden states, the weight and the bias."""

from __future__ import annotations

import pytest
import torch

from dagrl.algorithms.utils import entropy_from_logits, logprobs_from_logits
from dagrl.engines.head_stats import head_token_stats


def _textbook(hidden, weight, bias, targets, temperature, removed):
    """Removed tokens have probability 0: the distribution is the softmax over the others
    (autograd through a lowest-value fill would give 0 * huge = NaN in the entropy's gradient;
    the hand-written backward must not)."""
    z = torch.nn.functional.linear(hidden, weight, bias).float() / temperature
    if removed:
        kept = [v for v in range(z.shape[-1]) if v not in removed]
        z = z[:, kept]
        targets = torch.tensor([kept.index(int(t)) for t in targets])
    p = torch.softmax(z, -1)
    return torch.stack([logprobs_from_logits(z, targets), entropy_from_logits(z),
                        p.square().sum(-1)], -1)


def _inputs(n=37, h=16, v=50, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g) * 2).requires_grad_(True)
    weight = torch.randn(v, h, generator=g).requires_grad_(True)
    b = torch.randn(v, generator=g).requires_grad_(True) if bias else None
    return hidden, weight, b, torch.randint(0, v - 3, (n,), generator=g)


def _grads(out, weights, params):
    for p in params:
        p.grad = None
    (out * weights).sum().backward()
    return [p.grad.clone() for p in params]


@pytest.mark.parametrize("chunk", [0, 8, 1000])
@pytest.mark.parametrize(("temperature", "removed", "bias"),
                         [(1.0, (), False), (0.7, (), True), (1.3, (47, 48, 49), True)])
def test_values_and_gradients_equal_autograd(chunk, temperature, removed, bias):
    hidden, weight, b, targets = _inputs(bias=bias)
    params = [t for t in (hidden, weight, b) if t is not None]
    weights = torch.randn(len(targets), 3, generator=torch.Generator().manual_seed(1))
    ref = _textbook(hidden, weight, b, targets, temperature, list(removed))
    ref_grads = _grads(ref, weights, params)
    out = head_token_stats(hidden, weight, b, targets, temperature, with_entropy=True,
                           with_sum_pi_squared=True, removed=removed, chunk_tokens=chunk)
    torch.testing.assert_close(out, ref.detach(), atol=1e-5, rtol=1e-5)
    for got, want in zip(_grads(out, weights, params), ref_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.isfinite(out).all()


def test_what_is_not_asked_for_is_zero_and_gets_no_gradient():
    hidden, weight, b, targets = _inputs()
    out = head_token_stats(hidden, weight, b, targets, 1.0, with_entropy=False)
    assert out[:, 1:].abs().sum() == 0
    ref = _textbook(hidden, weight, b, targets, 1.0, [])
    weights = torch.ones(len(targets), 3)      # a gradient reaches the zero columns too
    got = _grads(out, weights, [hidden, weight, b])
    want = _grads(ref[:, :1], weights[:, :1], [hidden, weight, b])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_bfloat16_autocast_runs_the_matmuls_in_bfloat16_and_the_rest_in_float32():
    # Under autocast the values are those of autograd's computation to float32's rounding
    # (the same bfloat16 matmul, then float32), the gradients within bfloat16's rounding.
    hidden, weight, b, targets = _inputs(n=300, h=64, v=512)
    weights = torch.randn(300, 3, generator=torch.Generator().manual_seed(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _textbook(hidden, weight, b, targets, 0.7, [])
        out = head_token_stats(hidden, weight, b, targets, 0.7, with_entropy=True,
                               with_sum_pi_squared=True, chunk_tokens=128)
    torch.testing.assert_close(out.detach(), ref.detach(), atol=5e-5, rtol=1e-6)
    ref_grads = _grads(ref, weights, [hidden, weight, b])
    got = _grads(out, weights, [hidden, weight, b])
    for g, w in zip(got, ref_grads, strict=True):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w, atol=2e-2 * w.abs().max().item(), rtol=0)


def test_an_empty_chunk_still_backpropagates():
    hidden, weight, b, targets = _inputs(n=0)
    out = head_token_stats(hidden, weight, b, targets, 1.0, with_entropy=True)
    assert out.shape == (0, 3)
    out.sum().backward()
    assert weight.grad is not None and weight.grad.abs().sum() == 0


def test_kept_scratch_tensors_of_other_sizes_do_not_change_the_results():
    # The workspace keeps the largest tensors asked for and serves smaller views of them; a
    # release drops them. Calls of different sizes in any order give the same numbers.
    from dagrl.engines.head_stats import release_workspace

    def stats(n):
        hidden, weight, b, targets = _inputs(n=n)
        out = head_token_stats(hidden, weight, b, targets, 0.7, with_entropy=True,
                               chunk_tokens=16)
        out[:, 0].sum().backward()
        return out.detach(), hidden.grad, weight.grad

    release_workspace()
    first = stats(37)
    stats(5)
    stats(60)
    again = stats(37)
    release_workspace()
    fresh = stats(37)
    for a, b, c in zip(first, again, fresh, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_a_float32_head_keeps_no_weight_sized_scratch():
    # In the weight's dtype each chunk's weight gradient is added into the returned tensor
    # (addmm_): no kept [V, H] scratch. Under autocast the bfloat16 products need one.
    from dagrl.engines.head_stats import _WORKSPACE, release_workspace

    release_workspace()
    hidden, weight, b, targets = _inputs(n=40)
    head_token_stats(hidden, weight, b, targets, 0.7, with_entropy=True,
                     chunk_tokens=16)[:, 0].sum().backward()
    assert "grad_weight" not in _WORKSPACE.tensors and weight.grad is not None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = head_token_stats(hidden, weight, b, targets, 0.7, with_entropy=True,
                               chunk_tokens=16)
    out[:, 0].sum().backward()
    assert _WORKSPACE.tensors["grad_weight"].dtype == torch.bfloat16
    release_workspace()
