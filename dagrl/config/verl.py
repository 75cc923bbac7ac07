"""verl launch lines as dagrl configs: `dagrl train --from-verl run.sh` and `dagrl train --verl
key=value ...`.

A verl user's overrides (`data.train_batch_size=1024 actor_rollout_ref.actor.optim.lr=1e-6
algorithm.adv_estimator=grpo trainer.n_gpus_per_node=8 ...`) become dagrl overrides. Every
verl key given is one of:

  mapped       onto a dagrl key, its value converted where the two differ in form
               (`top_k=-1` -> 0, `save_freq=-1` -> 0, `n_gpus_per_node x nnodes` -> n_workers);
  the same     a verl switch for what dagrl always does (`use_remove_padding` aside, e.g.
               `data.return_raw_chat=True`, `trainer.critic_warmup=0`), accepted for the values
               that mean dagrl's behaviour and refused by name for the others;
  refused      with the reason (verl's Megatron backend, a Hydra config file of verl's, a key
               dagrl does not know): never dropped in silence.

Keys the line leaves out take **verl's** defaults where they differ from dagrl's (`rollout.n`
1, AdamW betas (0.9, 0.999) and weight decay 0.01, no KL loss unless `use_kl_loss=True`, ...),
so the run is the one the line describes in verl. The table of docs/coming-from-verl.md is
generated from this module (`python -m dagrl.config.verl --markdown`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dagrl.config.loader import ConfigError, _yaml_load
from dagrl.config.loader import render_value as _render

A, R, REF, M = ("actor_rollout_ref.actor.", "actor_rollout_ref.rollout.",
                "actor_rollout_ref.ref.", "actor_rollout_ref.model.")

# verl key -> dagrl key, the value as it is.
SAME_KEYS: dict[str, str] = {
    "data.train_files": "data.train_files", "data.val_files": "data.val_files",
    "data.train_batch_size": "data.train_batch_size", "data.val_batch_size": "data.val_batch_size",
    "data.max_prompt_length": "data.max_prompt_length", "data.prompt_key": "data.prompt_key",
    "data.max_response_length": "rollout.max_new_tokens", "data.shuffle": "data.shuffle",
    "data.seed": "trainer.seed", "data.truncation": "data.truncation",
    M + "path": "model.path", M + "enable_gradient_checkpointing": "actor.activation_checkpointing",
    M + "use_remove_padding": "model.pack_sequences", M + "lora_rank": "actor.lora.rank",
    M + "lora_alpha": "actor.lora.alpha", M + "target_modules": "actor.lora.target_modules",
    A + "optim.lr": "actor.lr", A + "optim.weight_decay": "actor.weight_decay",
    A + "optim.betas": "actor.betas", A + "optim.lr_warmup_steps": "actor.warmup_steps",
    A + "grad_clip": "actor.grad_clip", A + "ppo_mini_batch_size": "actor.mini_batch_size",
    A + "ppo_micro_batch_size_per_gpu": "actor.micro_batch_size",
    A + "ppo_epochs": "actor.ppo_epochs", A + "kl_loss_coef": "algorithm.kl_loss_coef",
    A + "kl_loss_type": "algorithm.kl_loss_type", A + "entropy_coeff": "algorithm.entropy_coeff",
    A + "clip_ratio_low": "algorithm.clip_ratio_low",
    A + "clip_ratio_high": "algorithm.clip_ratio_high",
    A + "clip_ratio_c": "algorithm.clip_ratio_c",
    A + "loss_agg_mode": "algorithm.loss_agg_mode",
    A + "policy_loss.loss_mode": "algorithm.policy_loss",
    A + "ulysses_sequence_parallel_size": "actor.sequence_parallel_size",
    A + "fsdp_config.fsdp_size": "trainer.fsdp_shard_size",
    REF + "log_prob_micro_batch_size_per_gpu": "ref.micro_batch_size",
    REF + "fsdp_config.param_offload": "ref.offload",
    R + "n": "rollout.n", R + "temperature": "rollout.temperature", R + "top_p": "rollout.top_p",
    R + "gpu_memory_utilization": "rollout.vllm.gpu_memory_utilization",
    R + "tensor_model_parallel_size": "rollout.vllm.tensor_parallel_size",
    R + "enable_prefix_caching": "rollout.vllm.enable_prefix_caching",
    R + "val_kwargs.n": "rollout.val_n",
    R + "multi_turn.enable": "rollout.multi_turn.enable",
    R + "multi_turn.max_assistant_turns": "rollout.multi_turn.max_turns",
    R + "multi_turn.format": "rollout.multi_turn.format",
    "critic.optim.lr": "critic.lr", "critic.optim.weight_decay": "critic.weight_decay",
    "critic.optim.betas": "critic.betas", "critic.optim.lr_warmup_steps": "critic.warmup_steps",
    "critic.grad_clip": "critic.grad_clip",
    "critic.model.enable_gradient_checkpointing": "critic.activation_checkpointing",
    "critic.ppo_micro_batch_size_per_gpu": "critic.micro_batch_size",
    "critic.ppo_epochs": "critic.ppo_epochs", "critic.cliprange_value": "critic.cliprange_value",
    "algorithm.gamma": "algorithm.gamma", "algorithm.lam": "algorithm.lam",
    "algorithm.norm_adv_by_std_in_grpo": "algorithm.norm_adv_by_std",
    "algorithm.use_kl_in_reward": "algorithm.kl_in_reward",
    "algorithm.kl_penalty": "algorithm.kl_reward_type",
    "algorithm.kl_ctrl.kl_coef": "algorithm.kl_coef", "algorithm.kl_ctrl.type": "algorithm.kl_ctrl",
    "algorithm.kl_ctrl.target_kl": "algorithm.kl_target",
    "algorithm.kl_ctrl.horizon": "algorithm.kl_horizon",
    "algorithm.filter_groups.max_num_gen_batches": "algorithm.filter_max_rounds",
    "custom_reward_function.overlong_buffer.len": "reward.overlong_buffer_len",
    "custom_reward_function.overlong_buffer.penalty_factor": "reward.overlong_penalty_factor",
    "trainer.total_training_steps": "trainer.total_steps",
    "trainer.val_before_train": "trainer.val_before_train",
    "trainer.project_name": "logging.project", "trainer.experiment_name": "logging.run_name",
    "trainer.default_local_dir": "trainer.checkpoint_dir",
    "trainer.max_actor_ckpt_to_keep": "trainer.keep_last", "trainer.device": "trainer.device",
}

# verl's defaults where they differ from dagrl's: applied unless the line sets the verl key.
VERL_DEFAULTS: dict[str, Any] = {
    R + "n": 1, A + "optim.lr": 1e-6, A + "optim.weight_decay": 0.01,
    A + "optim.betas": [0.9, 0.999], "critic.optim.lr": 1e-5, "critic.optim.weight_decay": 0.01,
    "critic.optim.betas": [0.9, 0.999], A + "use_kl_loss": False,
    A + "ppo_mini_batch_size": 256, "data.train_batch_size": 1024,
    "data.max_prompt_length": 512, "data.max_response_length": 512,
    "data.val_batch_size": None, R + "top_k": -1,
}

# verl switches for what dagrl always does: key -> (the values that mean it, why).
SAME_BEHAVIOUR: dict[str, tuple[Callable[[Any], bool], str]] = {
    "trainer.critic_warmup": (lambda v: v == 0, "the critic and the actor train from step 1"),
    "data.return_raw_chat": (lambda v: True, "dagrl keeps each row's chat for the rollout"),
    "data.filter_overlong_prompts": (
        lambda v: True, "a prompt over data.max_prompt_length is named by row before any work "
        "(data.truncation=error), never dropped in silence"),
    "trainer.use_legacy_worker_impl": (lambda v: True, "one worker implementation"),
    "trainer.log_val_generations": (lambda v: True, "logging.val_generations sets it"),
    A + "use_torch_compile": (lambda v: True, "actor.compile is off unless set"),
    A + "fsdp_config.grad_offload": (lambda v: True, "gradients follow actor.offload"),
    R + "enable_chunked_prefill": (lambda v: True, "vLLM's V1 engine chunks prefills itself"),
    R + "max_num_batched_tokens": (lambda v: True, "vLLM's scheduler budget: vLLM's default"),
    R + "log_prob_micro_batch_size_per_gpu": (
        lambda v: True, "the old-logprob pass runs in actor.micro_batch_size samples"),
    R + "log_prob_micro_batch_size": (
        lambda v: True, "the old-logprob pass runs in actor.micro_batch_size samples"),
    R + "log_prob_use_dynamic_bsz": (
        lambda v: True, "the old-logprob pass follows actor.max_tokens_per_micro_batch"),
    R + "log_prob_max_token_len_per_gpu": (
        lambda v: True, "the old-logprob pass follows actor.max_tokens_per_micro_batch"),
    R + "val_kwargs.do_sample": (lambda v: True, "rollout.val_temperature=0 means greedy"),
    R + "mode": (lambda v: v in ("sync", "async"), "dagrl's rollout engine is the same in "
                 "either; trainer.mode=async overlaps rollout and training"),
    "reward_model.reward_manager": (
        lambda v: v in ("naive", "dapo", "prime", "batch"),
        "scorers run per sample in reward.num_workers processes; DAPO's overlong shaping is "
        "reward.overlong_buffer_len"),
    "algorithm.filter_groups.metric": (
        lambda v: v in ("acc", "score", "seq_reward", "seq_final_reward"),
        "groups whose rewards are all equal are filtered"),
}

# Keys refused with a reason (a prefix ends in ".").
REFUSED: dict[str, str] = {
    "actor_rollout_ref.actor.megatron.": "verl's Megatron backend; dagrl trains with FSDP2 "
                                         "(actor.tensor_parallel_size for tensor parallelism)",
    "actor_rollout_ref.ref.megatron.": "verl's Megatron backend",
    "critic.megatron.": "verl's Megatron backend",
    R + "multi_turn.tool_config_path": "verl's tool classes are verl code: name dagrl's tools "
                                       "in rollout.multi_turn.tools (README: Agents)",
    R + "multi_turn.interaction_config_path": "verl's interaction classes are verl code: set "
                                              "rollout.multi_turn.environment",
}


@dataclass
class Translation:
    overrides: list[str] = field(default_factory=list)      # dagrl key=value
    # (verl key or "(verl default)", dagrl override or "", note), one per verl key
    lines: list[tuple[str, str, str]] = field(default_factory=list)

    def table(self) -> str:
        width = max((len(v) for v, _, _ in self.lines), default=0)
        return "\n".join(f"  {v:<{width}}  ->  {d}" + (f"   ({note})" if note else "")
                         for v, d, note in self.lines)


def _parse(items: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip().lstrip("+~")
        if not sep or not key:
            raise ConfigError(f"verl override {item!r} must have the form key=value")
        if key in out:
            raise ConfigError(f"verl key {key} is given twice")
        out[key] = _yaml_load(raw) if raw.strip() else ""
    return out


def translate(items: Sequence[str], train_rows: Callable[[list[str]], int] | None = None
              ) -> Translation:
    """verl `key=value` overrides -> dagrl overrides and the table of what became what.
    `train_rows(files)`: the rows of the train files (for trainer.total_epochs)."""
    given = _parse(items)
    for key in given:
        reason = next((why for prefix, why in REFUSED.items()
                       if key == prefix or (prefix.endswith(".") and key.startswith(prefix))),
                      None)
        if reason is not None:
            raise ConfigError(f"verl key {key}: not translated ({reason})")
    # verl's critic settings matter only to PPO (gae): no critic keys in other runs' configs
    critic = given.get("algorithm.adv_estimator", "gae") == "gae"
    values = {**{k: v for k, v in VERL_DEFAULTS.items()
                 if k not in given and (critic or not k.startswith("critic."))}, **given}
    out = Translation()

    def emit(verl_key: str, dagrl_key: str, value: Any, note: str = "") -> None:
        item = f"{dagrl_key}={_render(value)}"
        out.overrides.append(item)
        label = verl_key if verl_key in given else f"{verl_key} (verl default)"
        out.lines.append((label, item, note))

    handled = set()
    for convert in CONVERTERS:
        handled |= convert(values, emit)
    for verl_key, value in values.items():
        if verl_key in handled:
            continue
        if verl_key in SAME_KEYS:
            if value is not None:
                emit(verl_key, SAME_KEYS[verl_key], value)
        elif verl_key.startswith(M + "override_config."):
            # dagrl turns every dropout off (RL updates on sampled tokens; TRL does the same)
            if not (verl_key.endswith(("dropout", "pdrop")) and value == 0):
                raise ConfigError(f"verl key {verl_key}={_render(value)}: dagrl does not "
                                  "override model config fields (dropout is always off)")
            out.lines.append((verl_key, "", "the same in dagrl: dropout is always off"))
        elif verl_key in SAME_BEHAVIOUR:
            accepts, why = SAME_BEHAVIOUR[verl_key]
            if not accepts(value):
                raise ConfigError(f"verl key {verl_key}={_render(value)}: dagrl has no "
                                  f"equivalent of this value ({why})")
            out.lines.append((verl_key, "", f"the same in dagrl: {why}"))
        elif verl_key not in SPECIAL_KEYS:
            raise ConfigError(f"verl key {verl_key}: dagrl does not know it (no translation; "
                              "docs/coming-from-verl.md lists the keys it maps)")
    _workers_and_steps(given, values, emit, train_rows)
    return out


# --- keys that need more than a copy --------------------------------------------------------

def _algorithm(values: dict, emit) -> set[str]:
    """adv_estimator (and DAPO's filter_groups) -> algorithm.name, whose graph dagrl runs."""
    estimator = values.get("algorithm.adv_estimator", "gae")
    filtered = bool(values.get("algorithm.filter_groups.enable", False))
    if filtered:
        if estimator != "grpo":
            raise ConfigError("verl key algorithm.filter_groups.enable=true: dagrl's dynamic "
                              "sampling (algorithm.name=dapo) groups GRPO samples, not "
                              f"{estimator}")
        emit("algorithm.filter_groups.enable", "algorithm.name", "dapo",
             "DAPO's graph: dynamic sampling")
        # the dapo preset's overlong shaping applies only where the line enables it
        if not values.get("custom_reward_function.overlong_buffer.enable", False):
            emit("custom_reward_function.overlong_buffer.enable", "reward.overlong_buffer_len",
                 0)
    elif estimator == "gae":
        emit("algorithm.adv_estimator", "algorithm.name", "ppo", "a critic and GAE")
    elif estimator in ("rloo", "remax", "cpgd"):
        emit("algorithm.adv_estimator", "algorithm.name", estimator)
    elif estimator == "reinforce_plus_plus":
        emit("algorithm.adv_estimator", "algorithm.name", "reinforce_pp")
    else:
        emit("algorithm.adv_estimator", "algorithm.name", "grpo")
        if estimator != "grpo":
            emit("algorithm.adv_estimator", "algorithm.adv_estimator", estimator)
    # Every preset sets kl_in_reward and its own kl_loss_coef: verl's values, as the line gives.
    emit("algorithm.use_kl_in_reward", "algorithm.kl_in_reward",
         bool(values.get("algorithm.use_kl_in_reward", False)))
    if not values.get(A + "use_kl_loss", False):   # verl reads kl_loss_coef only with it
        emit(A + "use_kl_loss", "algorithm.kl_loss_coef", 0.0, "no KL loss")
    else:
        emit(A + "kl_loss_coef", "algorithm.kl_loss_coef", values.get(A + "kl_loss_coef", 0.001))
    return {"algorithm.adv_estimator", "algorithm.filter_groups.enable", A + "use_kl_loss",
            A + "kl_loss_coef",
            "algorithm.use_kl_in_reward", "custom_reward_function.overlong_buffer.enable"}


def _rollout(values: dict, emit) -> set[str]:
    name = values.get(R + "name")
    if name is not None:
        backends = {"vllm": "vllm", "hf": "hf", "native": "native"}
        if name not in backends:
            raise ConfigError(f"verl key {R}name={name}: dagrl runs vllm, hf or native in its "
                              "workers; an SGLang engine is served (rollout.server.urls)")
        emit(R + "name", "rollout.backend", backends[name])
    if values.get(R + "top_k") is not None:
        top_k = values[R + "top_k"]
        emit(R + "top_k", "rollout.top_k", 0 if top_k in (-1, 0) else top_k,
             "-1 (off) is 0 in dagrl" if top_k == -1 else "")
    kwargs = {k[len(R + "val_kwargs."):]: v for k, v in values.items()
              if k.startswith(R + "val_kwargs.")}
    if kwargs:   # verl validates greedily unless do_sample is set
        sampled = bool(kwargs.get("do_sample", False))
        emit(R + "val_kwargs.do_sample", "rollout.val_temperature",
             kwargs.get("temperature", 0.0) if sampled else 0.0, "" if sampled else "greedy")
    for knob, train_default in (("top_p", 1.0), ("top_k", -1)):
        if knob in kwargs and kwargs[knob] != values.get(R + knob, train_default):
            raise ConfigError(f"verl key {R}val_kwargs.{knob}={kwargs[knob]}: dagrl validates "
                              f"with the training {knob} ({R}{knob}); set them equal")
    return {R + "name", R + "top_k", R + "val_kwargs.temperature", R + "val_kwargs.top_p",
            R + "val_kwargs.top_k"}


def _offload_and_batches(values: dict, emit) -> set[str]:
    """Pairs that are one dagrl key: offload of params + optimizer; dynamic batch size + its
    token budget; a global micro-batch size (per GPU in dagrl)."""
    for side, dagrl in ((A, "actor"), ("critic.model.", "critic")):
        params, optim = (values.get(side + f"fsdp_config.{k}_offload") for k in ("param",
                                                                                    "optimizer"))
        if params is not None or optim is not None:
            if bool(params) != bool(optim):
                raise ConfigError(f"verl keys {side}fsdp_config.param_offload={params} and "
                                  f"optimizer_offload={optim}: dagrl offloads both or neither "
                                  f"({dagrl}.offload)")
            emit(side + "fsdp_config.param_offload", f"{dagrl}.offload", bool(params))
    for prefix, dyn, budget, dagrl in (
            (A, "use_dynamic_bsz", "ppo_max_token_len_per_gpu", "actor"),
            (REF, "log_prob_use_dynamic_bsz", "log_prob_max_token_len_per_gpu", "ref"),
            ("critic.", "use_dynamic_bsz", "ppo_max_token_len_per_gpu", "critic")):
        if values.get(prefix + dyn):
            tokens = values.get(prefix + budget, 16384)
            emit(prefix + budget, f"{dagrl}.max_tokens_per_micro_batch", tokens,
                 "dynamic batch size: micro-batches cut by tokens")
    return {A + "fsdp_config.param_offload", A + "fsdp_config.optimizer_offload",
            "critic.model.fsdp_config.param_offload", "critic.model.fsdp_config.optimizer_offload",
            A + "use_dynamic_bsz", A + "ppo_max_token_len_per_gpu",
            REF + "log_prob_use_dynamic_bsz", REF + "log_prob_max_token_len_per_gpu",
            "critic.use_dynamic_bsz", "critic.ppo_max_token_len_per_gpu",
            REF + "ulysses_sequence_parallel_size"} | _checked_equal(values)


def _checked_equal(values: dict) -> set[str]:
    """verl keys dagrl reads from another one, accepted when they agree with it."""
    sp, ref_sp = (values.get(p + "ulysses_sequence_parallel_size") for p in (A, REF))
    if ref_sp is not None and ref_sp != (sp or 1):
        raise ConfigError(f"verl key {REF}ulysses_sequence_parallel_size={ref_sp}: the reference "
                          f"runs on the actor's mesh in dagrl (actor sp = {sp or 1})")
    packed, critic_packed = values.get(M + "use_remove_padding", False), values.get(
        "critic.model.use_remove_padding")
    if critic_packed is not None and bool(critic_packed) != bool(packed):
        raise ConfigError(f"verl key critic.model.use_remove_padding={critic_packed}: the critic "
                          f"packs as the actor does in dagrl (model.pack_sequences={packed})")
    return {"critic.model.use_remove_padding"}


def _logging_and_checkpoints(values: dict, emit) -> set[str]:
    if "trainer.logger" in values:
        loggers = values["trainer.logger"]
        loggers = [loggers] if isinstance(loggers, str) else list(loggers)
        known = {"console", "wandb", "tensorboard", "mlflow"}
        unknown = [x for x in loggers if x not in known]
        if unknown:
            raise ConfigError(f"verl key trainer.logger: dagrl has no logger {unknown[0]!r} "
                              f"(it has {', '.join(sorted(known))})")
        emit("trainer.logger", "logging.backends", [*loggers, "jsonl"],
             "metrics.jsonl is always written")
    for verl_key, dagrl_key in (("trainer.save_freq", "trainer.save_every"),
                                ("trainer.test_freq", "trainer.val_every")):
        if verl_key in values:
            freq = values[verl_key]
            emit(verl_key, dagrl_key, max(int(freq), 0), "-1 (never) is 0" if freq < 0 else "")
    mode = values.get("trainer.resume_mode")
    if mode is not None:
        resume = {"auto": "auto", "disable": "never"}.get(mode)
        if mode == "resume_path":
            resume = values.get("trainer.resume_from_path")
        if not resume:
            raise ConfigError(f"verl key trainer.resume_mode={mode}: expected auto, disable, or "
                              "resume_path with trainer.resume_from_path")
        emit("trainer.resume_mode", "trainer.resume", resume)
    return {"trainer.logger", "trainer.save_freq", "trainer.test_freq", "trainer.resume_mode",
            "trainer.resume_from_path"}


def _rewards(values: dict, emit) -> set[str]:
    path = values.get("custom_reward_function.path")
    if values.get("custom_reward_function.name") and not path:
        raise ConfigError("verl key custom_reward_function.name: give custom_reward_function.path "
                          "with it")
    if path:
        name = values.get("custom_reward_function.name", "compute_score")
        emit("custom_reward_function.path", "reward.custom_fn", f"{path}:{name}")
    if values.get("custom_reward_function.overlong_buffer.enable"):
        pass  # its len and penalty_factor are copied (SAME_KEYS)
    elif "custom_reward_function.overlong_buffer.len" in values:
        values.pop("custom_reward_function.overlong_buffer.len")   # disabled: its length is moot
    return {"custom_reward_function.path", "custom_reward_function.name"}


def _critic_path(values: dict, emit) -> set[str]:
    """verl's recipes name the actor's model again as the critic's: dagrl's critic.path is
    empty for that (the actor's model.path, with a new value head)."""
    path = values.get("critic.model.path")
    if path is not None and path != values.get(M + "path"):
        emit("critic.model.path", "critic.path", path)
    return {"critic.model.path"}


def _workers_and_steps(given: dict, values: dict, emit, train_rows) -> None:
    gpus = int(values.get("trainer.n_gpus_per_node", 8)) * int(values.get("trainer.nnodes", 1))
    if "trainer.n_gpus_per_node" in given or "trainer.nnodes" in given:
        emit("trainer.n_gpus_per_node", "trainer.n_workers", gpus, "n_gpus_per_node x nnodes")
    micro = values.get(A + "ppo_micro_batch_size")
    if micro is not None and A + "ppo_micro_batch_size_per_gpu" not in values:
        emit(A + "ppo_micro_batch_size", "actor.micro_batch_size", max(1, micro // gpus),
             f"global {micro} over {gpus} GPUs")
    ref_micro = values.get(REF + "log_prob_micro_batch_size")
    if ref_micro is not None and REF + "log_prob_micro_batch_size_per_gpu" not in values:
        emit(REF + "log_prob_micro_batch_size", "ref.micro_batch_size", max(1, ref_micro // gpus),
             f"global {ref_micro} over {gpus} GPUs")
    if "trainer.total_training_steps" in given or "trainer.total_epochs" not in given:
        return
    if train_rows is None:
        raise ConfigError("verl key trainer.total_epochs: give trainer.total_training_steps "
                          "(the steps cannot be counted without the train files)")
    files = values.get("data.train_files")
    files = [files] if isinstance(files, str) else list(files or [])
    rows, batch = train_rows(files), int(values["data.train_batch_size"])
    steps = int(values["trainer.total_epochs"]) * (rows // batch)
    emit("trainer.total_epochs", "trainer.total_steps", steps,
         f"{values['trainer.total_epochs']} epochs x ({rows} rows // {batch})")


CONVERTERS = (_algorithm, _rollout, _offload_and_batches, _logging_and_checkpoints, _rewards,
              _critic_path)
# Keys read by the converters or _workers_and_steps (not copied on their own).
SPECIAL_KEYS = {A + "ppo_micro_batch_size", REF + "log_prob_micro_batch_size",
                "trainer.total_epochs", "trainer.n_gpus_per_node", "trainer.nnodes",
                R + "val_kwargs.do_sample"}


def parquet_rows(files: list[str]) -> int:
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(f).metadata.num_rows for f in files)


def markdown_table() -> str:
    """The key table of docs/coming-from-verl.md."""
    rows = ["| verl key | dagrl key |", "|---|---|"]
    rows += [f"| `{v}` | `{d}` |" for v, d in sorted(SAME_KEYS.items())]
    rows += ["", "| verl key | how dagrl reads it |", "|---|---|"]
    notes = {
        "algorithm.adv_estimator": "`algorithm.name`: gae -> ppo, grpo -> grpo, rloo, remax, "
                                   "cpgd, reinforce_plus_plus -> reinforce_pp; others: grpo's "
                                   "graph with `algorithm.adv_estimator`",
        "algorithm.filter_groups.enable": "`algorithm.name=dapo` (dynamic sampling)",
        A + "use_kl_loss": "false: `algorithm.kl_loss_coef=0`",
        R + "name": "`rollout.backend` (vllm, hf, native)",
        R + "top_k": "`rollout.top_k` (-1 -> 0)",
        R + "val_kwargs.do_sample / temperature": "`rollout.val_temperature` (no sampling -> 0)",
        A + "fsdp_config.param_offload + optimizer_offload": "`actor.offload` (both or neither)",
        A + "use_dynamic_bsz + ppo_max_token_len_per_gpu": "`actor.max_tokens_per_micro_batch`",
        A + "ppo_micro_batch_size": "`actor.micro_batch_size` = global / GPUs",
        "trainer.n_gpus_per_node x trainer.nnodes": "`trainer.n_workers`",
        "trainer.total_epochs": "`trainer.total_steps` = epochs x (train rows // batch)",
        "trainer.save_freq / test_freq": "`trainer.save_every` / `val_every` (-1 -> 0)",
        "trainer.logger": "`logging.backends` (+ jsonl)",
        "trainer.resume_mode": "`trainer.resume` (auto, disable -> never, resume_path -> the path)",
        "custom_reward_function.path + name": "`reward.custom_fn` = path:name",
        "critic.model.path": "`critic.path`; empty (the actor's model) when it names the actor's",
    }
    rows += [f"| `{k}` | {v} |" for k, v in notes.items()]
    rows += ["", "| verl key | accepted: dagrl does this already |", "|---|---|"]
    rows += [f"| `{k}` | {why} |" for k, (_, why) in sorted(SAME_BEHAVIOUR.items())]
    rows += ["", "| verl key | refused |", "|---|---|"]
    rows += [f"| `{k}` | {why} |" for k, why in sorted(REFUSED.items())]
    rows += ["", "| verl default applied when the line leaves the key out | value |", "|---|---|"]
    rows += [f"| `{k}` | `{_render(v)}` |" for k, v in sorted(VERL_DEFAULTS.items())
             if v is not None]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--markdown"]:
        print(markdown_table(), end="")
    else:
        print("usage: python -m dagrl.config.verl --markdown", file=sys.stderr)
        sys.exit(2)
