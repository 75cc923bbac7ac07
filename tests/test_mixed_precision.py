"""Mixed precision (model.mixed_precision=bfloat16): bfloat16 matmuls under autocast, float32
master weights, gradients, optimizer state and log-probs; a bfloat16 rollout copy kept in sync."""

from __future__ import annotations

import pytest
import torch

from dagrl.config.loader import ConfigError, load_config
from dagrl.config.schema import Config
from dagrl.engines.forward import response_logprobs
from dagrl.engines.memory_estimate import estimate_memory, model_shape
from dagrl.engines.models import cast_copy, load_model
from dagrl.engines.precision import autocast
from dagrl.rollout.hf import HFRollout
from dagrl.rollout.native import NativeRollout
from dagrl.rollout.sampling import SamplingParams, mix_seed
from tests.prompts import left_padded

FAST = ["logging.progress_bar=false", "logging.console_every=1000", "trainer.torch_threads=1"]
PROMPTS = ["12+7=", "3*4=", "99-1=", "5+5=", "1+2+3=", "7*8=", "100-3=", "2*2="]
CPU = torch.device("cpu")


def test_cast_copy_equals_a_bfloat16_load(tiny_model_dir):
    model = load_model(str(tiny_model_dir))
    copy = cast_copy(model, torch.bfloat16)
    loaded = load_model(str(tiny_model_dir), dtype="bfloat16")
    for (name, p), (_, q) in zip(copy.named_parameters(), loaded.named_parameters(), strict=True):
        assert p.dtype == torch.bfloat16 and torch.equal(p, q), name
        assert not p.requires_grad
    # Tied weights stay tied; the rotary frequencies stay float32 and are the model's own.
    assert copy.lm_head.weight is copy.model.embed_tokens.weight
    assert copy.model.rotary_emb.inv_freq.dtype == torch.float32
    assert copy.model.rotary_emb.inv_freq is model.model.rotary_emb.inv_freq
    # The source is untouched (a cast copy, not a view).
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_autocast_keeps_logprobs_and_gradients_float32(tiny_model_dir, tokenizer):
    model = load_model(str(tiny_model_dir))
    ids, mask = left_padded(tokenizer, PROMPTS, width=10)
    g = torch.Generator().manual_seed(0)
    responses = torch.randint(4, 40, (len(PROMPTS), 6), generator=g)
    rmask = torch.ones(len(PROMPTS), 6)
    rmask[2, 3:] = 0

    def run(precision: str):
        model.zero_grad(set_to_none=True)
        with autocast(precision, CPU):
            out = response_logprobs(model, ids, mask, responses, rmask, with_entropy=True,
                                    chunk_tokens=5)
        (out.logprobs.sum() + out.entropy.sum()).backward()
        return out, {n: p.grad.clone() for n, p in model.named_parameters()}

    full, full_grads = run("none")
    mixed, mixed_grads = run("bfloat16")
    assert mixed.logprobs.dtype == torch.float32 and mixed.entropy.dtype == torch.float32
    gap = (mixed.logprobs - full.logprobs).abs().max()
    assert 0 < gap < 0.05, gap                     # bfloat16 matmuls, not float32 ones
    for name, grad in mixed_grads.items():
        assert grad.dtype == torch.float32, name   # master weights get float32 gradients
        cos = torch.nn.functional.cosine_similarity(grad.flatten(), full_grads[name].flatten(),
                                                    dim=0)
        assert cos > 0.99, (name, float(cos))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_native_decoder_in_bfloat16_matches_hf(tiny_model_dir, tokenizer, temperature):
    """The bfloat16 rollout copy generates with the native decoder as with HF's forward, and
    its log-probs are those of the actor's autocast pass up to bfloat16 rounding."""
    model = load_model(str(tiny_model_dir))
    copy = cast_copy(model, torch.bfloat16)
    ids, mask = left_padded(tokenizer, PROMPTS, width=10)
    seeds = mix_seed(0, 1, torch.arange(len(PROMPTS)), torch.zeros(len(PROMPTS),
                                                                  dtype=torch.long))
    kwargs = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    params = SamplingParams(temperature=temperature)
    native = NativeRollout(copy, **kwargs).generate(ids, mask, seeds, params, max_new_tokens=10)
    hf = HFRollout(copy, **kwargs).generate(ids, mask, seeds, params, max_new_tokens=10)
    assert torch.equal(native.responses, hf.responses)
    torch.testing.assert_close(native.logprobs, hf.logprobs, atol=0.03, rtol=0)
    with autocast("bfloat16", CPU):
        actor = response_logprobs(model, ids, mask, native.responses, native.response_mask,
                                  temperature=temperature or 1.0).logprobs
    torch.testing.assert_close(native.logprobs, actor, atol=0.03, rtol=0)


def _worker(tmp_path, *overrides):
    from dagrl.runtime.run_dir import prepare_run
    from dagrl.runtime.worker import Worker

    cfg = prepare_run(load_config(Config, None, [f"trainer.run_dir={tmp_path / 'w'}", *FAST,
                                                 "model.mixed_precision=bfloat16", *overrides]))
    return Worker(cfg)


@pytest.mark.slow
def test_mixed_precision_run_learns_and_keeps_the_rollout_copy_in_sync(tmp_path):
    worker = _worker(tmp_path, "trainer.total_steps=24", "algorithm.kl_loss_coef=0.001")
    history = worker.train()
    # The reference and the update share the autocast: at step 1 pi = pi_ref to the bit.
    assert history[0]["actor/kl"] == 0.0 and history[0]["actor/clip_frac"] == 0.0
    rewards = [m["reward/mean"] for m in history]
    assert sum(rewards[-6:]) / 6 > sum(rewards[:6]) / 6 + 0.1, rewards
    actor, rollout = worker.engines.actor, worker.engines.rollout
    assert rollout.weights_version == actor.version == 24
    for (name, p), (_, q) in zip(actor.model.named_parameters(),
                                 rollout.model.named_parameters(), strict=True):
        assert p.dtype == torch.float32 and q.dtype == torch.bfloat16, name
        assert torch.equal(p.to(torch.bfloat16), q), name   # synced after every update
    state = actor.optimizer.state[actor.trained[0]]
    assert state["exp_avg"].dtype == torch.float32


def test_mixed_precision_with_lora_and_a_critic(tmp_path):
    """LoRA: the rollout copy is a bfloat16 cast of the merged weights; PPO: the critic's
    values stay float32. Two steps each run to the end with finite losses."""
    lora = _worker(tmp_path / "lora", "trainer.total_steps=2", "actor.lora.rank=4",
                   "actor.lr=1e-3")
    history = lora.train()
    assert all(torch.isfinite(torch.tensor(m["actor/pg_loss"])) for m in history)
    copy = lora.engines.rollout.model
    assert all(p.dtype == torch.bfloat16 for p in copy.parameters())
    ppo = _worker(tmp_path / "ppo", "trainer.total_steps=2", "algorithm.name=ppo")
    history = ppo.train()
    assert all(torch.isfinite(torch.tensor(m["critic/vf_loss"])) for m in history)


def test_mixed_precision_needs_float32_master_weights():
    with pytest.raises(ConfigError, match="mixed_precision=bfloat16 .* dtype=float32"):
        load_config(Config, None, ["model.mixed_precision=bfloat16", "model.dtype=bfloat16"])


def test_memory_estimate_counts_the_bfloat16_copy_and_casts():
    cfg = load_config(Config, None, ["model.mixed_precision=bfloat16"])
    lines = {line.name: line for line in estimate_memory(cfg, model_shape(cfg))}
    plain = load_config(Config, None, [])
    plain_lines = {line.name: line for line in estimate_memory(plain, model_shape(plain))}
    weights = plain_lines["actor weights"].bytes
    assert plain_lines["rollout weights"].bytes == 0           # shares the actor's weights
    assert lines["rollout weights"].bytes == weights // 2     # a bfloat16 copy
    assert lines["KV cache"].bytes == plain_lines["KV cache"].bytes // 2
    assert lines["autocast weight casts"].bytes == weights // 2


def test_reference_with_bfloat16_linears_is_bit_identical_under_autocast(tiny_model_dir,
                                                                          tokenizer):
    from dagrl.engines.precision import store_linears_in_low_precision

    model = load_model(str(tiny_model_dir)).requires_grad_(False)
    ref = store_linears_in_low_precision(load_model(str(tiny_model_dir)).requires_grad_(False),
                                         "bfloat16")
    assert ref.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    assert ref.model.layers[0].self_attn.q_proj.bias.dtype == torch.bfloat16
    # Embeddings, norms and the tied head stay float32 (they are not autocast ops).
    assert ref.model.embed_tokens.weight.dtype == torch.float32
    assert ref.lm_head.weight is ref.model.embed_tokens.weight
    assert ref.model.norm.weight.dtype == torch.float32
    ids, mask = left_padded(tokenizer, PROMPTS, width=10)
    responses = torch.randint(4, 40, (len(PROMPTS), 6), generator=torch.Generator().manual_seed(2))
    rmask = torch.ones(len(PROMPTS), 6)
    with autocast("bfloat16", CPU):
        a = response_logprobs(model, ids, mask, responses, rmask).logprobs
        b = response_logprobs(ref, ids, mask, responses, rmask).logprobs
    assert torch.equal(a, b)
