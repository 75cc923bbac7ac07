"""Every rollout backend against transformers' generate and a plain forward pass, and the
sampler they share."""

from __future__ import annotations

import pytest
import torch

from dagrl.data.dataset import encode_prompt
from dagrl.engines.forward import response_logprobs
from dagrl.rollout import MODEL_BACKENDS, model_rollout
from dagrl.rollout.sampling import SamplingParams, filter_logits, mix_seed, uniform_draws


def left_padded(tokenizer, texts, width=12):
    ids = torch.full((len(texts), width), tokenizer.pad_token_id)
    mask = torch.zeros(len(texts), width, dtype=torch.long)
    for i, text in enumerate(texts):
        toks = encode_prompt(tokenizer, [{"role": "user", "content": text}])
        ids[i, width - len(toks):] = torch.tensor(toks)
        mask[i, width - len(toks):] = 1
    return ids, mask


PROMPTS = ["1+2=", "13+7=", "4+4=", "20+19=", "0+0="]


@pytest.fixture(params=sorted(MODEL_BACKENDS))
def backend(request):
    return request.param


def test_greedy_matches_transformers_generate(backend, tiny_model, tokenizer):
    gen = model_rollout(backend, tiny_model, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id)
    ids, mask = left_padded(tokenizer, PROMPTS)
    ours = gen.generate(ids, mask, torch.zeros(len(PROMPTS), dtype=torch.long),
                        SamplingParams(temperature=0), max_new_tokens=10)
    for i in range(len(PROMPTS)):   # one at a time, unpadded: no padding effects on HF's side
        row = ids[i][mask[i].bool()][None]
        hf = tiny_model.generate(row, attention_mask=torch.ones_like(row), do_sample=False,
                                 max_new_tokens=10, eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id)[0, row.shape[1]:]
        n = int(ours.response_mask[i].sum())
        assert ours.responses[i, :n].tolist() == hf[:n].tolist()
        assert n == len(hf) or hf[n - 1] == tokenizer.eos_token_id


def test_sampled_logprobs_match_forward(backend, tiny_model, tokenizer):
    gen = model_rollout(backend, tiny_model, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id)
    ids, mask = left_padded(tokenizer, PROMPTS)
    seeds = mix_seed(0, 1, torch.arange(len(PROMPTS)), torch.zeros(len(PROMPTS), dtype=torch.long))
    out = gen.generate(ids, mask, seeds, SamplingParams(temperature=0.7), max_new_tokens=8)
    ref = response_logprobs(tiny_model, ids, mask, out.responses, out.response_mask,
                            temperature=0.7).logprobs
    assert out.response_mask.sum() > len(PROMPTS)
    torch.testing.assert_close(out.logprobs, ref, atol=1e-4, rtol=1e-4)


def test_sampling_is_per_sample_not_per_batch(backend, tiny_model, tokenizer):
    """A sequence draws the same tokens alone or inside a larger batch."""
    gen = model_rollout(backend, tiny_model, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id)
    ids, mask = left_padded(tokenizer, PROMPTS)
    seeds = mix_seed(7, 3, torch.arange(len(PROMPTS)), torch.zeros(len(PROMPTS), dtype=torch.long))
    params = SamplingParams(temperature=1.0, top_k=20, top_p=0.95)
    full = gen.generate(ids, mask, seeds, params, max_new_tokens=8)
    for i in (0, 3):
        alone = gen.generate(ids[i:i + 1], mask[i:i + 1], seeds[i:i + 1], params, max_new_tokens=8)
        assert alone.responses[0].tolist() == full.responses[i].tolist()
    other = gen.generate(ids, mask, seeds + 1, params, max_new_tokens=8)
    assert not torch.equal(other.responses, full.responses)


def test_min_new_tokens_and_eos_masking(backend, tiny_model, tokenizer):
    gen = model_rollout(backend, tiny_model, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id)
    ids, mask = left_padded(tokenizer, PROMPTS)
    out = gen.generate(ids, mask, torch.arange(len(PROMPTS)), SamplingParams(),
                       max_new_tokens=6, min_new_tokens=6)
    assert out.response_mask.sum(-1).tolist() == [6] * len(PROMPTS)
    assert not (out.responses == tokenizer.eos_token_id).any()


def test_draws_are_uniform_and_filters_work():
    u = uniform_draws(torch.arange(20000), start=0, count=3)
    assert u.dtype == torch.float64 and u.shape == (20000, 3)
    assert float(u.min()) >= 0 and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.var()) - 1 / 12) < 0.005
    # neighbouring positions and seeds are uncorrelated
    assert abs(float(torch.corrcoef(torch.stack([u[:, 0], u[:, 1]]))[0, 1])) < 0.03
    assert abs(float(torch.corrcoef(torch.stack([u[:-1, 0], u[1:, 0]]))[0, 1])) < 0.03
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])

    def dropped(top_k, top_p):
        return torch.isinf(filter_logits(logits, top_k=top_k, top_p=top_p)).tolist()

    assert dropped(2, 1.0) == [[False, False, True, True]]
    # softmax of [3,2,1,0] = [.644, .237, .087, .032]: the 0.8 nucleus keeps the first two
    assert dropped(0, 0.8) == [[False, False, True, True]]
    assert dropped(0, 0.5) == [[False, True, True, True]]


def test_sampling_matches_softmax_distribution():
    from dagrl.rollout.sampling import sample_next_token

    probs = torch.tensor([0.5, 0.3, 0.0, 0.15, 0.05])     # a zero-probability token in between
    logits = torch.log(probs).repeat(40000, 1)
    tokens = sample_next_token(logits, SamplingParams(), torch.arange(40000), position=3)
    freq = torch.bincount(tokens, minlength=5).float() / 40000
    assert freq[2] == 0
    torch.testing.assert_close(freq, probs, atol=0.01, rtol=0)
    # with temperature 2 the distribution is softmax(z / 2) and top-k 2 keeps the two largest
    tokens = sample_next_token(logits, SamplingParams(temperature=2.0, top_k=2),
                               torch.arange(40000), position=3)
    expected = torch.tensor([0.5, 0.3]).sqrt() / torch.tensor([0.5, 0.3]).sqrt().sum()
    freq = torch.bincount(tokens, minlength=5).float() / 40000
    torch.testing.assert_close(freq[:2], expected, atol=0.01, rtol=0)
    assert freq[2:].sum() == 0


def test_draws_are_the_documented_hash():
    """u = (hi >> 5) 2^-27 + (lo >> 6) 2^-53 with hi = h(seed ^ h(t + 1)), lo = h(hi ^ 0x5bd1e995),
    recomputed here with Python integers: the draws (and so every sample) must never drift."""
    from dagrl.rollout.sampling import _M32, _hash32

    seeds = mix_seed(7, torch.arange(5))
    u = uniform_draws(seeds, 248, 4)                          # positions 248..251
    for b in range(5):
        for i, position in enumerate(range(248, 252)):
            hi = _hash32((int(seeds[b]) & _M32) ^ _hash32(position + 1))
            lo = _hash32(hi ^ 0x5BD1E995)
            assert float(u[b, i]) == ((hi >> 5) * 2**26 + (lo >> 6)) / 2**53
    assert torch.equal(u[:, 2:], uniform_draws(seeds, 250, 2))   # a block equals its positions


def test_inverse_cdf_picks_the_documented_token():
    """The token is the first v whose running probability exceeds u (times the total)."""
    from dagrl.rollout.sampling import sample_next_token

    logits = torch.log(torch.tensor([[0.25, 0.25, 0.5]] * 4))
    seeds = torch.arange(4)
    tokens = sample_next_token(logits, SamplingParams(), seeds, position=0)
    u = uniform_draws(seeds, 0, 1)[:, 0]
    expected = (u >= 0.25).long() + (u >= 0.5).long()
    assert tokens.tolist() == expected.tolist()
