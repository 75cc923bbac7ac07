"""The built-in generator against transformers' generate and a plain forward pass."""

from __future__ import annotations

import torch

from dagrl.data.dataset import encode_prompt
from dagrl.engines.forward import response_logprobs
from dagrl.engines.generator import Generator
from dagrl.engines.sampling import SamplingParams, filter_logits, mix_seed, uniform_noise


def left_padded(tokenizer, texts, width=12):
    ids = torch.full((len(texts), width), tokenizer.pad_token_id)
    mask = torch.zeros(len(texts), width, dtype=torch.long)
    for i, text in enumerate(texts):
        toks = encode_prompt(tokenizer, [{"role": "user", "content": text}])
        ids[i, width - len(toks):] = torch.tensor(toks)
        mask[i, width - len(toks):] = 1
    return ids, mask


PROMPTS = ["1+2=", "13+7=", "4+4=", "20+19=", "0+0="]


def test_greedy_matches_transformers_generate(tiny_model, tokenizer):
    gen = Generator(tiny_model, eos_token_id=tokenizer.eos_token_id,
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


def test_sampled_logprobs_match_forward(tiny_model, tokenizer):
    gen = Generator(tiny_model, eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id)
    ids, mask = left_padded(tokenizer, PROMPTS)
    seeds = mix_seed(0, 1, torch.arange(len(PROMPTS)), torch.zeros(len(PROMPTS), dtype=torch.long))
    out = gen.generate(ids, mask, seeds, SamplingParams(temperature=0.7), max_new_tokens=8)
    ref = response_logprobs(tiny_model, ids, mask, out.responses, out.response_mask,
                            temperature=0.7).logprobs
    assert out.response_mask.sum() > len(PROMPTS)
    torch.testing.assert_close(out.logprobs, ref, atol=1e-4, rtol=1e-4)


def test_sampling_is_per_sample_not_per_batch(tiny_model, tokenizer):
    """A sequence draws the same tokens alone or inside a larger batch."""
    gen = Generator(tiny_model, eos_token_id=tokenizer.eos_token_id,
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


def test_min_new_tokens_and_eos_masking(tiny_model, tokenizer):
    gen = Generator(tiny_model, eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id)
    ids, mask = left_padded(tokenizer, PROMPTS)
    out = gen.generate(ids, mask, torch.arange(len(PROMPTS)), SamplingParams(),
                       max_new_tokens=6, min_new_tokens=6)
    assert out.response_mask.sum(-1).tolist() == [6] * len(PROMPTS)
    assert not (out.responses == tokenizer.eos_token_id).any()


def test_noise_is_uniform_and_filters_work():
    u = uniform_noise(torch.arange(64), position=0, vocab_size=1000)
    assert 0 < float(u.min()) and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.var()) - 1 / 12) < 0.005
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    assert torch.isinf(filter_logits(logits, top_k=2, top_p=1.0)).tolist() == [[False, False, True, True]]
    # softmax of [3,2,1,0] = [.644, .237, .087, .032]: the 0.8 nucleus keeps the first two
    assert torch.isinf(filter_logits(logits, top_k=0, top_p=0.8)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_logits(logits, top_k=0, top_p=0.5)).tolist() == [[False, True, True, True]]


def test_gumbel_sampling_matches_softmax_distribution():
    from dagrl.engines.sampling import sample_next_token

    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])).repeat(20000, 1)
    tokens = sample_next_token(logits, SamplingParams(), torch.arange(20000), position=3)
    freq = torch.bincount(tokens, minlength=4).float() / 20000
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.015, rtol=0)


def test_uniform_noise_is_the_documented_hash():
    """u[b, v] = (h(row_b ^ h(v * 0x9E3779B1)) >> 8 + 0.5) / 2^24 with row_b = h(seed_b ^ h(t + 1)),
    recomputed here with Python integers: the noise (and so every sample) must never drift."""
    import numpy as np

    from dagrl.engines.sampling import _M32, _hash32, mix_seed, uniform_noise

    seeds = mix_seed(7, torch.arange(5))
    for position in (0, 3, 250):
        u = uniform_noise(seeds, position, 40)
        for b in range(5):
            row = _hash32((int(seeds[b]) & _M32) ^ _hash32(position + 1))
            for v in (0, 1, 39):
                h = _hash32((row ^ _hash32(v * 0x9E3779B1 & _M32)) & _M32)
                f32 = np.float32   # the same float32 roundings as the tensor code
                assert float(u[b, v]) == float((f32(h >> 8) + f32(0.5)) / f32(1 << 24))


def test_gumbel_block_equals_the_noise_position_by_position():
    from dagrl.engines.sampling import gumbel_block, mix_seed, uniform_noise

    seeds = mix_seed(11, torch.arange(6))
    block = gumbel_block(seeds, 5, 4, 33)                       # positions 5..8
    assert block.shape == (6, 4, 33)
    for i in range(4):
        assert torch.equal(block[:, i], -torch.log(-torch.log(uniform_noise(seeds, 5 + i, 33))))
