"""The native rollout backend against transformers' generate, a forward pass and the hf backend."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from dagrl.engines.forward import response_logprobs
from dagrl.engines.models import load_model, load_tokenizer, write_tiny_model
from dagrl.rollout import model_rollout, native_ops
from dagrl.rollout.hf import HFRollout
from dagrl.rollout.native import NativeRollout
from dagrl.rollout.native_decoder import FastDecoder, fast_path_unsupported
from dagrl.rollout.sampling import SamplingParams, mix_seed
from tests.prompts import left_padded

PROMPTS = ["1+2=", "13+7=", "4+4=", "20+19=", "0+0=", "99*9=", "a", "abc+def=xyz"]


@pytest.fixture(scope="module", params=["tiny-qwen2", "tiny-llama"])
def family_dir(request, tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("fast") / request.param, request.param)


@pytest.fixture()
def setup(family_dir):
    """(model, tokenizer, prompt ids [B, 14], prompt mask [B, 14]) with left padding."""
    model, tok = load_model(str(family_dir)), load_tokenizer(str(family_dir))
    return (model, tok, *left_padded(tok, PROMPTS, width=14))


def generators(model, tok) -> tuple[NativeRollout, HFRollout]:
    kwargs = {"eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    return NativeRollout(model, **kwargs), HFRollout(model, **kwargs)


def seeds_for(n: int, salt: int = 0) -> torch.Tensor:
    return mix_seed(salt, 1, torch.arange(n), torch.zeros(n, dtype=torch.long))


@pytest.mark.parametrize("limits", [{}, {"WEIGHT_MAJOR_MAX_ROWS": 0},
                                    {"WEIGHT_MAJOR_MAX_ROWS": 10**9,
                                     "MATH_ATTENTION_MAX_SCORES": 0},
                                    {"WEIGHT_MAJOR_CHUNK_ROWS": 24}],
                         ids=["default", "token-major", "feature-major-sdpa", "chunked-weights"])
def test_greedy_identical_to_transformers_generate(setup, monkeypatch, limits):
    """Every layout (feature-major few-row steps, token-major many-row steps), both prefill
    attentions (matmul-softmax, SDPA) and weights multiplied in row blocks reproduce
    generate's tokens."""
    for name, value in limits.items():
        monkeypatch.setattr(native_ops, name, value)
    model, tok, ids, mask = setup
    fast, _ = generators(model, tok)
    ours = fast.generate(ids, mask, seeds_for(len(PROMPTS)), SamplingParams(temperature=0),
                         max_new_tokens=16)
    batched = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    for i in range(len(PROMPTS)):
        row = ids[i][mask[i].bool()][None]   # alone and unpadded: no padding effects on HF's side
        alone = model.generate(row, attention_mask=torch.ones_like(row), do_sample=False,
                               max_new_tokens=16, eos_token_id=tok.eos_token_id,
                               pad_token_id=tok.pad_token_id)[0, row.shape[1]:]
        n = int(ours.response_mask[i].sum())
        assert ours.responses[i, :n].tolist() == alone[:n].tolist()
        assert n == len(alone) or alone[n - 1] == tok.eos_token_id
        assert ours.responses[i, :n].tolist() == batched[i, ids.shape[1]:][:n].tolist()


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7),
                                    SamplingParams(temperature=1.0, top_k=20, top_p=0.9),
                                    SamplingParams(temperature=0)])
def test_logprobs_match_forward(setup, params):
    model, tok, ids, mask = setup
    fast, _ = generators(model, tok)
    out = fast.generate(ids, mask, seeds_for(len(PROMPTS)), params, max_new_tokens=12)
    ref = response_logprobs(model, ids, mask, out.responses, out.response_mask,
                            temperature=params.temperature or 1.0).logprobs
    assert out.response_mask.sum() > len(PROMPTS)
    torch.testing.assert_close(out.logprobs, ref, atol=1e-4, rtol=0)


def test_sample_alone_equals_sample_in_batch(setup):
    model, tok, ids, mask = setup
    fast, _ = generators(model, tok)
    params = SamplingParams(temperature=1.0, top_k=20, top_p=0.95)
    seeds = seeds_for(len(PROMPTS), salt=7)
    full = fast.generate(ids, mask, seeds, params, max_new_tokens=10)
    for i in (0, 5, 7):
        # Alone, and with its prompt padding removed: the sample must not notice either.
        keep = mask[i].bool()
        alone = fast.generate(ids[i:i + 1, keep], mask[i:i + 1, keep], seeds[i:i + 1], params,
                              max_new_tokens=10)
        assert alone.responses[0].tolist() == full.responses[i].tolist()
        torch.testing.assert_close(alone.logprobs[0], full.logprobs[i], atol=1e-5, rtol=0)


def test_repeated_prompts_prefill_once(setup, monkeypatch):
    """GRPO's n samples of a prompt share one prefill; each sample still decodes as it would
    with its prompt prefilled alone."""
    model, tok, ids, mask = setup
    fast, _ = generators(model, tok)
    params = SamplingParams(temperature=1.0)
    order = torch.tensor([0, 3, 0, 5, 3, 0])          # prompts 0, 3 and 5, repeated
    seeds = seeds_for(len(order), salt=3)
    prefill_tokens = []
    forward = FastDecoder._forward

    def counting_forward(self, layers, x, *args):
        if not prefill_tokens:                          # the first call is the prefill
            prefill_tokens.append(x.shape[0])
        return forward(self, layers, x, *args)

    monkeypatch.setattr(FastDecoder, "_forward", counting_forward)
    out = fast.generate(ids[order], mask[order], seeds, params, max_new_tokens=8)
    assert prefill_tokens == [int(mask[[0, 3, 5]].sum())]
    for i, p in enumerate(order.tolist()):
        alone = fast.generate(ids[p:p + 1], mask[p:p + 1], seeds[i:i + 1], params,
                              max_new_tokens=8)
        assert alone.responses[0].tolist() == out.responses[i].tolist()
        torch.testing.assert_close(alone.logprobs[0], out.logprobs[i], atol=1e-5, rtol=0)


def test_compaction_with_mixed_finish_times_matches_hf_path(setup):
    """Rows that stop early are dropped from the batch; the rest must be unaffected (the fast
    path draws every position's uniform up front, the HF path one position at a time)."""
    model, tok, ids, mask = setup
    fast, slow = generators(model, tok)
    ids, mask = ids.repeat(4, 1), mask.repeat(4, 1)          # 32 rows, distinct seeds
    seeds = seeds_for(len(ids), salt=3)
    params = SamplingParams(temperature=1.5)
    ours = fast.generate(ids, mask, seeds, params, max_new_tokens=24)
    ref = slow.generate(ids, mask, seeds, params, max_new_tokens=24)
    lengths = ours.response_mask.sum(-1)
    assert len(set(lengths.tolist())) >= 3 and lengths.max() == 24   # finish times really mix
    assert torch.equal(ours.responses, ref.responses)
    assert torch.equal(ours.response_mask, ref.response_mask)
    torch.testing.assert_close(ours.logprobs, ref.logprobs, atol=1e-5, rtol=0)
    # after EOS: pad tokens, zero mask and zero log-probs
    ended = torch.arange(24)[None, :] >= lengths[:, None]
    assert (ours.responses[ended] == tok.pad_token_id).all()
    assert (ours.logprobs[ended] == 0).all()


def test_min_new_tokens(setup):
    model, tok, ids, mask = setup
    fast, slow = generators(model, tok)
    seeds = seeds_for(len(PROMPTS), salt=3)
    params = SamplingParams(temperature=1.5)
    out = fast.generate(ids, mask, seeds, params, max_new_tokens=6, min_new_tokens=6)
    assert out.response_mask.sum(-1).tolist() == [6] * len(PROMPTS)
    assert not (out.responses == tok.eos_token_id).any()
    out = fast.generate(ids, mask, seeds, params, max_new_tokens=16, min_new_tokens=4)
    ref = slow.generate(ids, mask, seeds, params, max_new_tokens=16, min_new_tokens=4)
    assert not (out.responses[:, :4] == tok.eos_token_id).any()
    assert torch.equal(out.responses, ref.responses)


def test_weight_updates_reach_the_fast_path(setup):
    model, tok, ids, mask = setup
    fast, slow = generators(model, tok)
    before = fast.generate(ids, mask, seeds_for(len(PROMPTS)), SamplingParams(temperature=0),
                           max_new_tokens=8)
    g = torch.Generator().manual_seed(1)
    new = [(n, p + 0.05 * torch.randn(p.shape, generator=g)) for n, p in model.named_parameters()]
    fast.update_weights(new, version=1)
    after = fast.generate(ids, mask, seeds_for(len(PROMPTS)), SamplingParams(temperature=0),
                          max_new_tokens=8)
    ref = slow.generate(ids, mask, seeds_for(len(PROMPTS)), SamplingParams(temperature=0),
                        max_new_tokens=8)
    assert not torch.equal(before.responses, after.responses)
    assert torch.equal(after.responses, ref.responses)


def test_fused_projections_share_the_modules_storage(setup):
    """q/k/v (and gate/up) are fused once into tensors the module parameters are views of: no
    second copy of the weights; a replaced parameter object is fused again."""
    model, tok, ids, mask = setup
    fast, slow = generators(model, tok)
    fast.generate(ids, mask, seeds_for(len(PROMPTS)), SamplingParams(temperature=0),
                  max_new_tokens=4)
    attn = model.model.layers[0].self_attn
    qkv, _ = fast.decoder._fused[0, "qkv"]
    assert attn.k_proj.weight.data_ptr() == qkv[attn.q_proj.out_features:].data_ptr()
    with torch.no_grad():
        attn.k_proj.weight = torch.nn.Parameter(attn.k_proj.weight + 0.5)
    greedy = SamplingParams(temperature=0)
    ours = fast.generate(ids, mask, seeds_for(len(PROMPTS)), greedy, max_new_tokens=8)
    ref = slow.generate(ids, mask, seeds_for(len(PROMPTS)), greedy, max_new_tokens=8)
    assert torch.equal(ours.responses, ref.responses)
    assert fast.decoder._fused[0, "qkv"][0].data_ptr() != qkv.data_ptr()


def _random_model(config):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def test_unsupported_architectures_fall_back():
    small = {"vocab_size": 50, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "intermediate_size": 64}
    sliding = _random_model(Qwen2Config(**small, use_sliding_window=True, sliding_window=8,
                                        max_window_layers=1))
    scaled = _random_model(LlamaConfig(**small, rope_parameters={
        "rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}))
    gelu = _random_model(LlamaConfig(**small, hidden_act="gelu"))
    plain = _random_model(LlamaConfig(**small))
    for model in (sliding, scaled, gelu):
        assert fast_path_unsupported(model) is not None
        assert isinstance(model_rollout("auto", model, eos_token_id=2, pad_token_id=0), HFRollout)
        with pytest.raises(ValueError, match="rollout.backend=hf"):
            NativeRollout(model, eos_token_id=2, pad_token_id=0)
        with pytest.raises(ValueError):
            FastDecoder(model)
    assert fast_path_unsupported(plain) is None
    # The fallback still generates.
    gen = model_rollout("auto", sliding, eos_token_id=2, pad_token_id=0)
    out = gen.generate(torch.tensor([[0, 5, 6], [7, 8, 9]]), torch.tensor([[0, 1, 1], [1, 1, 1]]),
                       torch.arange(2), SamplingParams(), max_new_tokens=4)
    assert out.responses.shape == (2, 4)


def test_stop_tokens_end_responses_on_both_paths(setup):
    model, tok, ids, mask = setup
    fast, _ = generators(model, tok)
    seeds = seeds_for(len(PROMPTS))
    free = fast.generate(ids, mask, seeds, SamplingParams(temperature=0), max_new_tokens=12)
    stop_id = int(free.responses[0, 2])   # what row 0 emits third: make it a stop token
    kwargs = {"eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id,
                  "stop_token_ids": [stop_id]}
    for gen in (NativeRollout(model, **kwargs), HFRollout(model, **kwargs)):
        out = gen.generate(ids, mask, seeds, SamplingParams(temperature=0), max_new_tokens=12)
        for i in range(len(PROMPTS)):
            row = free.responses[i][free.response_mask[i].bool()].tolist()
            ends = [k for k, t in enumerate(row) if t in (stop_id, tok.eos_token_id)]
            n = ends[0] + 1 if ends else len(row)   # the stop token is part of the response
            assert int(out.response_mask[i].sum()) == n, (type(gen).__name__, i)
            assert out.responses[i, :n].tolist() == row[:n]
        held = gen.generate(ids, mask, seeds, SamplingParams(temperature=0), max_new_tokens=12,
                            min_new_tokens=12)
        assert int(held.response_mask.sum()) == 12 * len(PROMPTS)
        assert not torch.isin(held.responses, torch.tensor([stop_id])).any()


def test_right_padded_prompts_are_refused(setup):
    """The packed prefill reads each row's last prompt token from the last column: a row that
    ends in padding would silently decode from a pad token, so it is an error."""
    model, tok, ids, mask = setup
    fast, _ = generators(model, tok)
    mask = mask.clone()
    mask[2, -1] = 0
    with pytest.raises(ValueError, match=r"prompt rows \[2\] do not end in a real token"):
        fast.generate(ids, mask, seeds_for(len(PROMPTS)), SamplingParams(), max_new_tokens=4)


def test_lm_head_blocks_give_row_major_logits(monkeypatch):
    """The decode LM head in vocabulary blocks (the last one partial), each transposed into a
    row-major result, equals F.linear."""
    monkeypatch.setattr(native_ops, "WEIGHT_MAJOR_CHUNK_ROWS", 32)
    torch.manual_seed(0)
    x, weight = torch.randn(5, 16), torch.randn(100, 16)
    logits = native_ops.head_logits(x, weight)
    assert logits.shape == (5, 100) and logits.is_contiguous()
    torch.testing.assert_close(logits, torch.nn.functional.linear(x, weight), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("layout", ["row-major", "feature-major"])
def test_projection_of_every_decode_row_count_equals_linear(monkeypatch, layout):
    """`project` pads its few-row operand to the row count MKL runs fastest (up to 8 rows more,
    row-major): for every count, and with a bias and a blocked weight, each row's result is
    F.linear's and keeps the decode step's feature-major layout."""
    monkeypatch.setattr(native_ops, "WEIGHT_MAJOR_CHUNK_ROWS", 48)
    torch.manual_seed(0)
    weight, bias = torch.randn(40, 24), torch.randn(40)
    big = torch.randn(100, 24)                                # 100 > 48: in blocks
    for rows in range(1, 34):
        x = torch.randn(rows, 24)
        if layout == "feature-major":
            x = native_ops.feature_major(x)
        for w, b in ((weight, None), (weight, bias), (big, None)):
            out = native_ops.project(x, w, b)
            assert out.shape == (rows, w.shape[0])
            assert rows == 1 or native_ops.is_feature_major(out)
            torch.testing.assert_close(out, torch.nn.functional.linear(x, w, b),
                                       rtol=1e-5, atol=1e-5)
        logits = native_ops.head_logits(x, big)
        assert logits.is_contiguous()
        torch.testing.assert_close(logits, torch.nn.functional.linear(x, big), rtol=1e-5,
                                   atol=1e-5)


def test_finished_rows_leave_the_cache_in_place():
    """Dropping finished rows moves the kept rows' written columns to the front of the same
    storage: they equal the rows picked out of the old cache, and nothing is allocated at the
    cache's size."""
    from dagrl.rollout.native_decoder import _drop_rows

    torch.manual_seed(0)
    cache = torch.randn(3, 7, 2, 5, 9)                 # [L, A, nkv, S, hd], 5 columns
    keep = torch.tensor([True, True, False, True, False, False, True])
    written = 3
    expected = cache[:, keep, :, :written].clone()
    out = _drop_rows(cache, keep, written=written, column_dim=3)
    assert out.shape == (3, 4, 2, 5, 9)
    assert out.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()
    assert torch.equal(out[:, :, :, :written], expected)
    out[:, 1, :, written] = 7.0                        # the next column is still writable
    assert (cache[:, 1, :, written] == 7.0).all()
