"""LoRA (peft) on the actor: only the adapters train, the reference is the frozen base, the
rollout engine gets the merged weights, and `dagrl export` writes the merged model."""

from __future__ import annotations

import copy

import pytest
import torch

from dagrl.config.loader import ConfigError
from dagrl.engines.forward import response_logprobs
from dagrl.engines.lora import (
    ReferenceView,
    apply_lora,
    hf_name,
    lora_scalings,
    merged_weights,
    plain_copy,
)
from dagrl.engines.models import load_model
from tests.dist_helpers import run_distributed


def _lora_model(model_dir, rank=4, alpha=8.0, seed=0):
    """A LoRA-wrapped tiny model whose B matrices are non-zero (as after some training)."""
    torch.manual_seed(seed)   # peft draws A from the global generator (the worker seeds it)
    model = apply_lora(load_model(str(model_dir)), rank, alpha, "all-linear", 0.0)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def test_merged_weights_equal_peft_merge_and_unload(tiny_model_dir):
    model = _lora_model(tiny_model_dir)
    ours = dict(merged_weights(((n, p.detach()) for n, p in model.named_parameters()),
                               lora_scalings(model)))
    reference = copy.deepcopy(model).merge_and_unload()
    expected = dict(reference.named_parameters())
    assert sorted(ours) == sorted(expected)               # plain HF names, every parameter
    changed = 0
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, expected[name], atol=1e-6, rtol=1e-6, msg=name)
        changed += not torch.equal(tensor, load_model(str(tiny_model_dir)).state_dict()[name])
    assert changed >= 7 * 2                                # every adapted linear of 2 layers
    assert hf_name("base_model.model.model.layers.0.mlp.up_proj.base_layer.bias") == \
        "model.layers.0.mlp.up_proj.bias"


def test_merged_weights_take_the_parts_in_any_order(tiny_model_dir):
    # Under tensor parallelism the gather yields the whole adapter halves (A of a column-,
    # B of a row-parallel linear) before the split base weights.
    model = _lora_model(tiny_model_dir)
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    scalings = lora_scalings(model)
    in_order = dict(merged_weights(iter(named), scalings))
    reverse = dict(merged_weights(iter(named[::-1]), scalings))
    assert sorted(reverse) == sorted(in_order)
    for name, tensor in in_order.items():
        assert torch.equal(reverse[name], tensor), name
    with pytest.raises(RuntimeError, match="without their pair"):
        list(merged_weights(iter(n for n in named if ".lora_B." not in n[0]), scalings))


def test_reference_view_is_the_base_model(tiny_model_dir):
    model, base = _lora_model(tiny_model_dir), load_model(str(tiny_model_dir))
    g = torch.Generator().manual_seed(1)
    prompt_ids, responses = torch.randint(4, 40, (3, 5), generator=g), torch.randint(4, 40, (3, 4),
                                                                                   generator=g)
    masks = torch.ones(3, 5, dtype=torch.long), torch.ones(3, 4, dtype=torch.long)
    args = (prompt_ids, masks[0], responses, masks[1])
    with torch.no_grad():
        ref = response_logprobs(ReferenceView(model), *args).logprobs
        plain = response_logprobs(base, *args).logprobs
        adapted = response_logprobs(model, *args).logprobs
    torch.testing.assert_close(ref, plain, atol=1e-6, rtol=0)
    assert (adapted - plain).abs().max() > 1e-3            # the adapters do change the policy


def test_rollout_copy_shares_frozen_tensors_and_syncs_to_the_adapted_policy(tiny_model_dir):
    from dagrl.rollout.hf import HFRollout

    model = _lora_model(tiny_model_dir)
    fresh = load_model(str(tiny_model_dir)).state_dict()
    with torch.no_grad():                  # adapters away from their zero init: W + s·BA != W
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    rollout_copy = plain_copy(model)
    base = model.get_base_model()
    shared = {n for n, p in rollout_copy.named_parameters()
              if any(p.data_ptr() == q.data_ptr() for q in base.parameters())}
    # Embeddings, norms (and a tied LM head) are the actor's; no adapted linear is.
    assert "model.embed_tokens.weight" in shared and "model.norm.weight" in shared
    assert not any(n.endswith("proj.weight") for n in shared)
    assert set(rollout_copy.state_dict()) == set(fresh)     # a plain HF model, every tensor
    g = torch.Generator().manual_seed(2)
    args = (torch.randint(4, 40, (3, 5), generator=g), torch.ones(3, 5, dtype=torch.long),
            torch.randint(4, 40, (3, 4), generator=g), torch.ones(3, 4, dtype=torch.long))
    with torch.no_grad():                   # built with the adapters merged in
        torch.testing.assert_close(response_logprobs(rollout_copy, *args).logprobs,
                                   response_logprobs(model, *args).logprobs, atol=1e-5, rtol=0)
        for name, p in model.named_parameters():        # a later update moves the adapters
            if "lora_A" in name:
                p.add_(0.01)

    engine = HFRollout(rollout_copy, eos_token_id=2, pad_token_id=0)
    engine.update_weights(merged_weights(model.named_parameters(), lora_scalings(model)), 1)
    with torch.no_grad():
        torch.testing.assert_close(response_logprobs(engine.model, *args).logprobs,
                                   response_logprobs(model, *args).logprobs, atol=1e-5, rtol=0)
    for name, tensor in base.state_dict().items():          # the sync left the base untouched
        if ".lora_" not in name:
            torch.testing.assert_close(tensor, fresh[name.replace(".base_layer.", ".")],
                                       atol=0, rtol=0, msg=name)


def test_unknown_target_module_is_named(tiny_model_dir):
    with pytest.raises(ConfigError, match="actor.lora.target_modules"):
        apply_lora(load_model(str(tiny_model_dir)), 4, 8.0, ["no_such_proj"], 0.0)


def test_lora_run_trains_adapters_only_syncs_merged_weights_and_exports_them(tmp_path):
    from dagrl.config.loader import load_config
    from dagrl.config.schema import Config
    from dagrl.export import export_checkpoint
    from dagrl.runtime.run_dir import prepare_run
    from dagrl.runtime.worker import Worker

    cfg = load_config(Config, None, [
        f"trainer.run_dir={tmp_path / 'run'}", "trainer.total_steps=3", "trainer.save_every=3",
        "actor.lora.rank=4", "actor.lora.alpha=8", "actor.lr=1e-2", "trainer.torch_threads=1",
        "actor.skip_on_policy_old_logprob=false", "rollout.backend=native",
        "logging.progress_bar=false", "logging.console_every=1000"])
    worker = Worker(prepare_run(cfg))
    history = worker.train()
    actor = worker.engines.actor.model
    base = load_model(worker.cfg.model.path)

    # Only the adapters moved, and only they have optimizer state.
    trained = {n for n, p in actor.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    base_state = base.state_dict()
    for name, p in actor.named_parameters():
        if name not in trained:
            assert torch.equal(p, base_state[hf_name(name)]), name
    state = worker.engines.actor.optimizer.state
    assert len(state) == len(trained)
    # The reference (adapters off) and the policy part: the KL penalty sees a difference.
    assert history[-1]["actor/kl"] > 0
    # The rollout engine holds the merged weights: it computes the actor's own log-probs.
    assert history[-1]["actor/rollout_logprob_gap"] < 1e-5
    merged = dict(merged_weights(((n, p.detach()) for n, p in actor.named_parameters()),
                                 lora_scalings(actor)))
    rollout_params = dict(worker.engines.rollout.model.named_parameters())
    for name, tensor in merged.items():
        torch.testing.assert_close(rollout_params[name], tensor, atol=0, rtol=0, msg=name)
    assert any(not torch.equal(merged[n], base_state[n]) for n in merged)

    # Export: a plain HF model equal to the merged weights (peft's merge, ours above).
    out = export_checkpoint(tmp_path / "run", tmp_path / "exported")
    exported = load_model(str(out)).state_dict()
    assert not (out / "adapter_config.json").exists()
    for name, tensor in merged.items():
        torch.testing.assert_close(exported[name], tensor, atol=1e-6, rtol=1e-6, msg=name)


def _sharded_merged(rank, world, model_dir):
    from dagrl.engines.sharding import shard_model
    from dagrl.engines.weight_sync import gather_full_weights

    model = shard_model(_lora_model(model_dir), world, "cpu")
    # numpy arrays: torch tensors would cross the process boundary as shared memory that
    # dies with the worker.
    return {n: t.numpy().copy() for n, t in merged_weights(gather_full_weights(model),
                                                           lora_scalings(model))}


def test_merged_weights_from_fsdp2_shards_equal_one_process(tiny_model_dir):
    one = _sharded_merged(0, 1, str(tiny_model_dir))
    results = run_distributed(_sharded_merged, 2, str(tiny_model_dir))
    for got in results:
        assert sorted(got) == sorted(one)
        for name, tensor in one.items():
            torch.testing.assert_close(torch.from_numpy(got[name]), torch.from_numpy(tensor),
                                       atol=0, rtol=0, msg=name)
