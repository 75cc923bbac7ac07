"""verl launch lines translated to dagrl (dagrl/config/verl.py): every key mapped, accepted as
dagrl's behaviour, or refused by name; verl's defaults where the line leaves a key out; launch
scripts read as bash would expand them; and three tiny verl-style recipes (GRPO, PPO, DAPO) run
through `dagrl train --from-verl`."""

from __future__ import annotations

import json

import pytest

from dagrl.config.loader import ConfigError
from dagrl.config.presets import load_run_config
from dagrl.config.verl import markdown_table, translate
from dagrl.config.verl_script import overrides_from_script
from dagrl.train import main as train_main

TINY = ["actor_rollout_ref.model.path=builtin:tiny-qwen2", "data.train_files=[builtin:arith]",
        "data.max_prompt_length=16", "data.max_response_length=6", "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8", "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1", "trainer.logger=['console']", "trainer.save_freq=-1",
        "trainer.test_freq=-1", "trainer.total_training_steps=3"]

GRPO = """set -x
# verl's GRPO example, scaled down to the tiny model
python3 -m verl.trainer.main_ppo \\
    algorithm.adv_estimator=grpo \\
    data.train_files=[builtin:arith] \\
    data.train_batch_size=8 \\
    data.max_prompt_length=16 \\
    data.max_response_length=6 \\
    data.filter_overlong_prompts=True \\
    data.truncation='error' \\
    actor_rollout_ref.model.path=builtin:tiny-qwen2 \\
    actor_rollout_ref.actor.optim.lr=3e-3 \\
    actor_rollout_ref.model.use_remove_padding=True \\
    actor_rollout_ref.actor.ppo_mini_batch_size=8 \\
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 \\
    actor_rollout_ref.actor.use_kl_loss=True \\
    actor_rollout_ref.actor.kl_loss_coef=0.001 \\
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \\
    actor_rollout_ref.actor.entropy_coeff=0 \\
    actor_rollout_ref.model.enable_gradient_checkpointing=True \\
    actor_rollout_ref.actor.fsdp_config.param_offload=False \\
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False \\
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16 \\
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \\
    actor_rollout_ref.rollout.name=hf \\
    actor_rollout_ref.rollout.n=4 \\
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16 \\
    actor_rollout_ref.ref.fsdp_config.param_offload=False \\
    algorithm.use_kl_in_reward=False \\
    trainer.critic_warmup=0 \\
    trainer.logger=['console'] \\
    trainer.project_name='verl_grpo_example_gsm8k' \\
    trainer.experiment_name='tiny_function_rm' \\
    trainer.n_gpus_per_node=1 \\
    trainer.nnodes=1 \\
    trainer.save_freq=-1 \\
    trainer.test_freq=-1 \\
    trainer.total_epochs=15 $@
"""

PPO = [*TINY, "algorithm.adv_estimator=gae", "actor_rollout_ref.actor.optim.lr=3e-3",
       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
       "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
       "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.n=2",
       "critic.optim.lr=1e-3", "critic.model.use_remove_padding=False",
       "critic.model.path=builtin:tiny-qwen2", "critic.model.enable_gradient_checkpointing=True",
       "critic.ppo_micro_batch_size_per_gpu=16", "critic.model.fsdp_config.param_offload=False",
       "critic.model.fsdp_config.optimizer_offload=False", "algorithm.use_kl_in_reward=False",
       "trainer.critic_warmup=0"]

DAPO_SCRIPT = """#!/usr/bin/env bash
set -euxo pipefail
adv_estimator=grpo
kl_coef=0.0
kl_loss_coef=0.0
clip_ratio_low=0.2
clip_ratio_high=0.28
enable_overlong_buffer=True
overlong_buffer_len=$((1 * 2))
overlong_penalty_factor=1.0
enable_filter_groups=True
filter_groups_metric=acc
max_num_gen_batches=10
train_prompt_bsz=8
n_resp_per_prompt=4
train_prompt_mini_bsz=8
MODEL_PATH=${MODEL_PATH:-"builtin:tiny-qwen2"}
max_prompt_length=$((8 * 2))
max_response_length=6
max_tokens=$((max_prompt_length + max_response_length))
top_k=-1 # 0 for HF rollout, -1 for vLLM rollout
python3 -m recipe.dapo.main_dapo \\
    data.train_files="[builtin:arith]" \\
    data.prompt_key=prompt \\
    data.truncation='error' \\
    data.max_prompt_length=${max_prompt_length} \\
    data.max_response_length=${max_response_length} \\
    data.train_batch_size=${train_prompt_bsz} \\
    actor_rollout_ref.rollout.n=${n_resp_per_prompt} \\
    algorithm.adv_estimator=${adv_estimator} \\
    algorithm.kl_ctrl.kl_coef=${kl_coef} \\
    actor_rollout_ref.actor.kl_loss_coef=${kl_loss_coef} \\
    actor_rollout_ref.actor.clip_ratio_low=${clip_ratio_low} \\
    actor_rollout_ref.actor.clip_ratio_high=${clip_ratio_high} \\
    algorithm.filter_groups.enable=${enable_filter_groups} \\
    algorithm.filter_groups.max_num_gen_batches=${max_num_gen_batches} \\
    algorithm.filter_groups.metric=${filter_groups_metric} \\
    actor_rollout_ref.model.use_remove_padding=True \\
    actor_rollout_ref.actor.use_dynamic_bsz=True \\
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=${max_tokens} \\
    actor_rollout_ref.model.path="${MODEL_PATH}" \\
    +actor_rollout_ref.model.override_config.attention_dropout=0. \\
    actor_rollout_ref.actor.optim.lr=3e-3 \\
    actor_rollout_ref.actor.optim.lr_warmup_steps=1 \\
    actor_rollout_ref.actor.optim.weight_decay=0.1 \\
    actor_rollout_ref.actor.ppo_mini_batch_size=${train_prompt_mini_bsz} \\
    actor_rollout_ref.actor.entropy_coeff=0 \\
    actor_rollout_ref.actor.grad_clip=1.0 \\
    actor_rollout_ref.actor.loss_agg_mode=token-mean \\
    actor_rollout_ref.rollout.name=hf \\
    actor_rollout_ref.rollout.temperature=1.0 \\
    actor_rollout_ref.rollout.top_p=1.0 \\
    actor_rollout_ref.rollout.top_k="${top_k}" \\
    reward_model.reward_manager=dapo \\
    custom_reward_function.overlong_buffer.enable=${enable_overlong_buffer} \\
    custom_reward_function.overlong_buffer.len=${overlong_buffer_len} \\
    custom_reward_function.overlong_buffer.penalty_factor=${overlong_penalty_factor} \\
    trainer.logger=['console'] \\
    trainer.n_gpus_per_node=1 \\
    trainer.nnodes=1 \\
    trainer.test_freq=-1 \\
    trainer.save_freq=-1 \\
    trainer.total_training_steps=3 \\
    trainer.resume_mode=auto
"""


def config_of(verl_args):
    return load_run_config(None, translate(verl_args, lambda files: 4000).overrides)


def test_grpo_script_is_read_as_bash_expands_it_and_every_key_lands():
    args = overrides_from_script(GRPO)
    assert "trainer.total_epochs=15" in args and "$@" not in args
    translation = translate(args, lambda files: 100)   # 100 rows // 8 = 12 steps per epoch
    cfg = load_run_config(None, translation.overrides)
    assert cfg.algorithm.name == "grpo" and cfg.algorithm.kl_loss_coef == 0.001
    assert cfg.trainer.total_steps == 15 * 12 and cfg.trainer.n_workers == 1
    assert cfg.model.pack_sequences and cfg.actor.activation_checkpointing
    assert cfg.rollout.backend == "hf" and cfg.rollout.n == 4 and cfg.ref.micro_batch_size == 16
    assert cfg.logging.project == "verl_grpo_example_gsm8k" and cfg.trainer.save_every == 0
    # verl's AdamW defaults, not dagrl's, where the line leaves them out
    assert cfg.actor.betas == [0.9, 0.999] and cfg.actor.weight_decay == 0.01
    noted = {verl for verl, _, _ in translation.lines}
    assert "trainer.critic_warmup" in noted and "data.filter_overlong_prompts" in noted


def test_dapo_script_with_variables_and_arithmetic():
    args = overrides_from_script(DAPO_SCRIPT, {})
    assert "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=22" in args
    assert "custom_reward_function.overlong_buffer.len=2" in args
    assert "actor_rollout_ref.model.path=builtin:tiny-qwen2" in args
    cfg = config_of(args)
    assert cfg.algorithm.name == "dapo" and cfg.algorithm.filter_max_rounds == 10
    assert (cfg.algorithm.clip_ratio_low, cfg.algorithm.clip_ratio_high) == (0.2, 0.28)
    assert cfg.reward.overlong_buffer_len == 2 and cfg.reward.overlong_penalty_factor == 1.0
    assert cfg.actor.max_tokens_per_micro_batch == 22 and cfg.actor.weight_decay == 0.1
    assert cfg.rollout.top_k == 0 and cfg.trainer.resume == "auto"


def test_defaults_follow_verl_and_kl_loss_needs_use_kl_loss():
    cfg = config_of(["algorithm.adv_estimator=grpo", *TINY])
    assert cfg.rollout.n == 1 and cfg.actor.lr == 1e-6        # verl's defaults
    assert cfg.algorithm.kl_loss_coef == 0.0                   # use_kl_loss defaults to False
    cfg = config_of(["algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.use_kl_loss=True",
                     *TINY])
    assert cfg.algorithm.kl_loss_coef == 0.001


def test_ppo_gets_a_critic_and_verl_kl_settings():
    cfg = config_of(PPO)
    assert cfg.algorithm.name == "ppo" and cfg.algorithm.adv_estimator == "gae"
    assert cfg.algorithm.kl_in_reward is False and cfg.critic.lr == 1e-3
    # the actor's model named again: dagrl's critic.path stays empty (the actor's model)
    assert cfg.critic.path == "" and cfg.critic.micro_batch_size == 16
    assert cfg.critic.activation_checkpointing
    other = config_of([*(a for a in PPO if not a.startswith("critic.model.path=")),
                       "critic.model.path=/models/critic"])
    assert other.critic.path == "/models/critic"


@pytest.mark.parametrize(("line", "named"), [
    ("actor_rollout_ref.actor.no_such_knob=1", "actor_rollout_ref.actor.no_such_knob: dagrl "
                                               "does not know it"),
    ("actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2", "Megatron"),
    ("actor_rollout_ref.rollout.multi_turn.tool_config_path=tools.yaml",
     "rollout.multi_turn.tools"),
    ("actor_rollout_ref.rollout.name=sglang", "rollout.server.urls"),
    ("trainer.critic_warmup=5", "trainer.critic_warmup=5: dagrl has no equivalent"),
    ("trainer.logger=['console','swanlab']", "no logger 'swanlab'"),
])
def test_a_key_dagrl_cannot_honour_is_refused_by_name(line, named):
    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace(")", r"\)")):
        translate(["algorithm.adv_estimator=grpo", line])


def test_offload_halves_and_hydra_config_files_are_refused():
    with pytest.raises(ConfigError, match="offloads both or neither"):
        translate(["actor_rollout_ref.actor.fsdp_config.param_offload=True",
                   "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False"])
    with pytest.raises(ConfigError, match="Hydra config file"):
        overrides_from_script("python3 -m verl.trainer.main_ppo --config-path=x "
                              "--config-name=gsm8k_multiturn_grpo data.train_batch_size=8\n")
    with pytest.raises(ConfigError, match="no `python -m verl.trainer.main_ppo"):
        overrides_from_script("echo hello\n")


def test_docs_table_is_generated_from_the_mapping():
    table = markdown_table()
    assert "| `actor_rollout_ref.actor.optim.lr` | `actor.lr` |" in table
    assert "Megatron" in table


@pytest.mark.parametrize("recipe", ["grpo", "ppo", "dapo"])
def test_verl_recipes_run_on_the_tiny_model(recipe, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    if recipe == "ppo":
        argv = ["--verl", *PPO]
    else:
        script = tmp_path / "run.sh"
        script.write_text(GRPO if recipe == "grpo" else DAPO_SCRIPT)
        # the script's `$@`: verl keys after it (GRPO: 3 steps instead of 15 epochs)
        argv = ["--from-verl", str(script)] + (
            ["trainer.total_training_steps=3"] if recipe == "grpo" else [])
    code = train_main(argv)
    printed = capsys.readouterr()
    assert code == 0, printed.err[-3000:]
    assert "verl -> dagrl" in printed.err
    metrics = [json.loads(line) for path in tmp_path.glob("runs/*/metrics.jsonl")
               for line in path.read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    if recipe == "ppo":
        assert "critic/value_loss" in metrics[-1] or any(k.startswith("critic/")
                                                         for k in metrics[-1])


def test_coming_from_verl_page_holds_the_generated_tables():
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "coming-from-verl.md").read_text()
    assert page.endswith(markdown_table()), (
        "docs/coming-from-verl.md is out of date: replace its tables with the output of "
        "python -m dagrl.config.verl --markdown")


def test_a_custom_reward_function_is_path_colon_name():
    cfg = config_of(["algorithm.adv_estimator=grpo", *TINY,
                     "custom_reward_function.path=/tmp/my_reward.py",
                     "custom_reward_function.name=score"])
    assert cfg.reward.custom_fn == "/tmp/my_reward.py:score"
    with pytest.raises(ConfigError, match="give custom_reward_function.path"):
        translate(["custom_reward_function.name=score"])
