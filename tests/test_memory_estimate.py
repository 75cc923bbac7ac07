"""`dagrl plan --memory`: the estimate's parameter counts equal the real model's, and each
setting moves the line it should."""

from __future__ import annotations

import pytest
import torch

from dagrl.config.loader import load_config
from dagrl.config.schema import Config
from dagrl.engines.lora import apply_lora
from dagrl.engines.memory_estimate import (
    ModelShape,
    estimate_memory,
    estimated_peak,
    model_shape,
)
from dagrl.engines.models import load_model, write_tiny_model


@pytest.mark.parametrize("family", ["tiny-qwen2", "tiny-llama"])
def test_parameter_counts_equal_the_model(tmp_path, family):
    path = write_tiny_model(tmp_path / family, family, hidden_size=64, layers=3)
    model = load_model(str(path))
    shape = ModelShape.of(model.config)
    assert shape.params == sum(p.numel() for p in model.parameters())
    lora = apply_lora(model, 8, 16.0, "all-linear", 0.0)
    assert shape.lora_params(8) == sum(p.numel() for p in lora.parameters() if p.requires_grad)
    from dagrl.engines.critic import load_value_model

    critic = load_value_model(str(path), "float32", torch.device("cpu"))
    assert shape.value_params == sum(p.numel() for p in critic.parameters())


def _lines(*overrides: str) -> dict[str, int]:
    cfg = load_config(Config, None, list(overrides))
    return {line.name: line.bytes for line in estimate_memory(cfg, model_shape(cfg))}


def test_each_setting_moves_its_line():
    base = _lines("rollout.backend=native")
    p = base["actor weights"]
    assert base["gradients"] == p and base["AdamW state"] == 2 * p
    assert base["reference weights"] == p and base["rollout weights"] == 0   # reads the actor's
    lora = _lines("rollout.backend=native", "actor.lora.rank=4")
    assert lora["reference weights"] == 0 and 0 < lora["gradients"] < p / 4
    assert 0 < lora["rollout weights"] < p                  # the adapted linears only
    two = _lines("rollout.backend=native", "trainer.n_workers=2")
    assert two["actor weights"] == p // 2 and two["rollout weights"] == 2 * two["actor weights"]
    # HSDP: sharded over a group of 2 of the 4 workers, so each holds half, not a quarter
    hsdp = _lines("rollout.backend=native", "trainer.n_workers=4", "trainer.fsdp_shard_size=2")
    assert hsdp["actor weights"] == p // 2 and hsdp["AdamW state"] == 2 * (p // 2)
    ckpt = _lines("actor.activation_checkpointing=true")
    assert ckpt["activations"] < base["activations"]
    assert _lines("actor.logits_chunk_tokens=16")["LM head"] < _lines(
        "actor.logits_chunk_tokens=1024")["LM head"]
    assert _lines("rollout.n=16")["KV cache"] == 2 * _lines("rollout.n=8")["KV cache"]


def test_peak_is_the_states_plus_the_larger_phase():
    cfg = load_config(Config, None, [])
    lines = estimate_memory(cfg, model_shape(cfg))
    states = sum(x.bytes for x in lines if x.phase == "state")
    update = sum(x.bytes for x in lines if x.phase == "update")
    rollout = sum(x.bytes for x in lines if x.phase == "rollout")
    assert estimated_peak(lines, 100) == 100 + states + max(update, rollout)


def test_plan_memory_prints_the_breakdown(capsys):
    from dagrl.cli import main

    assert main(["plan", "--memory", "actor.lora.rank=4"]) == 0
    out = capsys.readouterr().out
    assert "memory per rank:" in out and "adapters off: no copy" in out
    assert "peak" in out and "runtime" in out


def test_other_models_are_counted(tmp_path):
    """Another trained policy holds what the main one holds; a reward model its weights over
    the workers; a judge a whole copy per rank. Counts equal the real models'."""
    from transformers import AutoModelForSequenceClassification

    from dagrl.engines.memory_estimate import other_model_lines, other_model_shapes
    from dagrl.engines.tiny_reward_model import tiny_digit_rm_config

    judge = write_tiny_model(tmp_path / "judge", "tiny-llama", hidden_size=64, layers=3)
    cfg = load_config(Config, None, [
        "rollout.backend=native", "trainer.n_workers=2", "models.other.actor.lr=1e-4",
        "reward.source=judge", f"judge.path={judge}"])
    shapes = other_model_shapes(cfg)
    lines = {x.name: x.bytes for x in other_model_lines(cfg, shapes, with_ref={"other"})}
    main = {x.name: x.bytes for x in estimate_memory(cfg, model_shape(cfg))}
    for name in ("actor weights", "AdamW state", "reference weights", "rollout weights"):
        assert lines[f"other: {name}"] == main[name] > 0, name
    assert "other: gradients" not in lines          # an update phase: not added to the states
    assert lines["judge weights"] == 4 * sum(p.numel() for p in load_model(str(judge)).parameters())
    assert "other: reference weights" not in {
        x.name for x in other_model_lines(cfg, shapes) if x.bytes}      # no ref node for it

    rm = load_config(Config, None, ["trainer.n_workers=2", "reward.source=reward_model",
                                    "reward_model.path=builtin:tiny-digit-rm"])
    (line,) = other_model_lines(rm, other_model_shapes(rm))
    classifier = AutoModelForSequenceClassification.from_config(tiny_digit_rm_config())
    assert line.bytes == sum(p.numel() for p in classifier.parameters()) * 4 // 2


def test_offloaded_shards_leave_the_accelerator_but_not_a_cpu_worker():
    on = ["rollout.backend=native", "trainer.n_workers=2", "actor.offload=true",
          "ref.offload=true", "critic.offload=true"]
    base = {x.name: x.bytes for x in estimate_memory(
        *_cfg_shape("rollout.backend=native", "trainer.n_workers=2", "trainer.device=cuda"),
        has_critic=True)}
    gpu = {x.name: x for x in estimate_memory(*_cfg_shape(*on, "trainer.device=cuda"),
                                              has_critic=True)}
    for name in ("actor weights", "gradients", "AdamW state", "reference weights",
                 "critic weights", "critic gradients", "critic AdamW state"):
        assert gpu[name].bytes == 0 and f"{base[name] / 2**30:.2f} GiB in host memory" in \
            gpu[name].note, name
    assert gpu["rollout weights"].bytes == base["rollout weights"] > 0   # not offloaded
    assert _lines(*on, "trainer.device=cpu") == _lines(*on[:2], "trainer.device=cpu")


def _cfg_shape(*overrides: str):
    cfg = load_config(Config, None, list(overrides))
    return cfg, model_shape(cfg)


def test_the_critic_is_counted_where_the_graph_trains_one(capsys):
    from dagrl.cli import main

    cfg = load_config(Config, None, ["trainer.n_workers=2"])
    shape = model_shape(cfg)
    lines = {x.name: x.bytes for x in estimate_memory(cfg, shape, has_critic=True)}
    assert lines["critic weights"] == shape.value_params * 4 // 2
    assert lines["critic AdamW state"] == 2 * lines["critic weights"]
    assert "critic weights" not in {x.name for x in estimate_memory(cfg, shape)}
    assert main(["plan", "--memory", "algorithm.name=ppo"]) == 0
    assert "critic AdamW state" in capsys.readouterr().out
    assert main(["plan", "--memory"]) == 0          # GRPO: no critic
    assert "critic" not in capsys.readouterr().out.split("memory per rank:")[1]


def test_the_vllm_engines_copy_and_pool_are_counted_per_rollout_layout():
    """vLLM holds its own copy of the weights (on the host twice: plain and packed) and a KV
    pool of rollout.vllm.cpu_kv_cache_gb; at tensor_parallel_size 2 each rank holds half of
    every split weight. A server holds nothing on the worker."""
    from dagrl.engines.memory_estimate import held_bytes
    from dagrl.engines.model_build import meta_model

    one = _lines("rollout.backend=vllm", "trainer.n_workers=2", "data.train_batch_size=32")
    two = _lines("rollout.backend=vllm", "trainer.n_workers=2", "data.train_batch_size=32",
                 "rollout.vllm.tensor_parallel_size=2", "rollout.vllm.cpu_kv_cache_gb=0.5")
    cfg = load_config(Config, None, [])
    config = model_shape(cfg).config
    whole = held_bytes(meta_model(config, "float32"), 1).bytes
    assert one["rollout weights"] == 2 * whole
    assert two["rollout weights"] == 2 * held_bytes(meta_model(config, "float32"), 1, 2).bytes
    assert whole < two["rollout weights"] < one["rollout weights"]
    assert one["KV cache"] == 2**30 and two["KV cache"] == 2**29
    server = _lines("rollout.backend=server", "rollout.server.urls=[http://127.0.0.1:1]")
    assert server["rollout weights"] == 0 and server["KV cache"] == 0


def test_auto_checkpointing_decides_on_the_estimate_without_it():
    from dagrl.engines.checkpointing_choice import (
        FILL,
        checkpointing_needed,
        describe_choice,
        peak_without_checkpointing,
    )

    cfg = load_config(Config, None, ["actor.activation_checkpointing=auto"])
    peak = peak_without_checkpointing(cfg, model_shape(cfg), 100, has_ref=True,
                                      has_critic=False)
    off = load_config(Config, None, ["actor.activation_checkpointing=false"])
    on = load_config(Config, None, ["actor.activation_checkpointing=true"])
    assert peak == estimated_peak(estimate_memory(off, model_shape(off)), 100)
    assert peak > estimated_peak(estimate_memory(on, model_shape(on)), 100)
    assert not checkpointing_needed(peak, int(peak / FILL) + 1)
    assert checkpointing_needed(peak, int(peak / FILL) - 1)
    assert checkpointing_needed(peak, None)          # unknown free memory: the safe side
    assert describe_choice(False, peak, 2**40).startswith(
        "actor.activation_checkpointing=auto: off (estimated peak")


@pytest.mark.parametrize("free_gib, checkpointed", [(64.0, False), (1e-3, True)])
def test_a_run_resolves_auto_checkpointing_before_building_the_actor(
        tmp_path, monkeypatch, capsys, free_gib, checkpointed):
    """The worker turns auto into on or off from the memory free to it (here set by the test)
    before the engines exist, logs why, and builds the actor accordingly."""
    import dagrl.engines.checkpointing_choice as choice_module
    import dagrl.runtime.worker as worker_module
    from dagrl.runtime.run_dir import prepare_run

    monkeypatch.setattr(choice_module, "room_for_rank",
                        lambda device, ranks_here: int(free_gib * 2**30))
    cfg = load_config(Config, None, [f"trainer.run_dir={tmp_path / 'run'}",
                                     "actor.activation_checkpointing=auto",
                                     "trainer.total_steps=1", "trainer.torch_threads=1",
                                     "logging.progress_bar=false"])
    worker = worker_module.Worker(prepare_run(cfg))
    assert worker.cfg.actor.activation_checkpointing is checkpointed
    model = worker.engines.actor.model     # transformers >= 5.20 renamed the flag
    flag = getattr(model, "is_activation_checkpointing", None)
    assert (model.is_gradient_checkpointing if flag is None else flag) is checkpointed
    line = next(x for x in capsys.readouterr().out.splitlines() if "=auto:" in x)
    assert ("auto: on" if checkpointed else "auto: off") in line and "GiB free" in line


def test_plan_memory_says_what_auto_checkpointing_would_choose(capsys):
    from dagrl.cli import main

    assert main(["plan", "--memory", "actor.activation_checkpointing=auto"]) == 0
    out = capsys.readouterr().out
    # a tiny model fits any machine that runs this test
    assert "actor.activation_checkpointing=auto: off (estimated peak" in out
