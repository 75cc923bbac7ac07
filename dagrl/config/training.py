"""The sections of the trained and reference models: `actor` (with its `lora`), `critic` and
`ref`: optimizer, micro-batches, memory features and model parallelism."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dagrl.config.loader import require


@dataclass
class OptimConfig:
    """AdamW with linear warmup and gradient clipping: the fields actor and critic share."""
    lr: float = 3e-3
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])
    warmup_steps: int = 0           # linear warmup of the learning rate, in optimizer steps
    grad_clip: float = 1.0          # max global grad norm; 0 disables clipping

    def __post_init__(self) -> None:
        require(self.lr > 0, "lr must be > 0")
        require(self.weight_decay >= 0, "weight_decay must be >= 0")
        require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
               "betas must be two numbers in [0, 1)")
        require(self.grad_clip >= 0, "grad_clip must be >= 0 (0 disables it)")
        require(self.warmup_steps >= 0, "warmup_steps must be >= 0")


@dataclass
class LoraConfig:
    """LoRA adapters on the actor (peft): only they are trained; the reference policy is the
    actor with its adapters off (no second copy of the model is loaded for it)."""
    rank: int = 0           # r, the adapters' rank; 0: no LoRA, every weight is trained
    alpha: float = 16.0     # the update is scaled by alpha / rank
    # Linear layers that get adapters: peft's `all-linear` (every linear but the LM head), or
    # module names such as [q_proj, k_proj, v_proj, o_proj].
    target_modules: str | list[str] = "all-linear"
    dropout: float = 0.0

    def __post_init__(self) -> None:
        require(self.rank >= 0, "rank must be >= 0 (0: no LoRA)")
        require(self.alpha > 0, "alpha must be > 0")
        require(0 <= self.dropout < 1, "dropout must be in [0, 1)")
        require(bool(self.target_modules), "target_modules must name at least one module")


@dataclass
class ActorConfig(OptimConfig):
    # Prompts per optimizer step, summed over workers (verl's ppo_mini_batch_size): a step's
    # batch of train_batch_size prompts gives train_batch_size / mini_batch_size updates.
    mini_batch_size: int = 32
    # Samples per forward/backward on one worker; gradients accumulate over micro-batches.
    micro_batch_size: int = 64
    # Response tokens whose [tokens, vocab] logits are computed at once in a teacher-forced
    # pass (the LM head runs in chunks, recomputed in backward): bounds the logits memory,
    # e.g. 1024 x 49152 x 4 B = 0.2 GB for SmolLM2 instead of a whole micro-batch's. 0: all.
    logits_chunk_tokens: int = 1024
    # > 0: micro-batches are cut by this budget of real tokens (prompt + response) instead of
    # micro_batch_size samples, longest samples first (verl's ppo_max_token_len_per_gpu); with
    # model.share_prompts, the tokens the shared layout runs (each prompt once, the rows
    # padded to the longest), a prompt's samples kept together.
    max_tokens_per_micro_batch: int = 0
    # Keep only each decoder layer's input during the update's forward and recompute the layer
    # in backward (transformers' activation checkpointing): the saved activations shrink from
    # every layer's intermediates to one hidden state per layer, for about one more forward
    # (+30-45% update time on CPU). auto: off when `dagrl plan --memory`'s estimated peak
    # without it fits in 85% of the memory free to this rank when the engines are built, on
    # otherwise (engines/checkpointing_choice.py; the worker logs which and why).
    activation_checkpointing: bool | Literal["auto"] = False
    ppo_epochs: int = 1
    # When a batch gets exactly one optimizer step (ppo_epochs=1, mini_batch_size =
    # data.train_batch_size) and no KL penalty is folded into the reward, the policy that
    # generated the batch is the one being updated: pi_old = pi, so the built-in graphs leave out
    # the old_logprob forward pass and the loss uses pi.detach() (same values, same gradient; the
    # ratio is exactly 1). false keeps the pass, e.g. to watch actor/rollout_logprob_gap.
    skip_on_policy_old_logprob: bool = True
    # torch.compile each decoder layer of the actor and the reference model (before FSDP2
    # sharding, one compiled block reused by every layer). Pays on the update's forward and
    # backward (-17% on the CPU e2e workload); the first step compiles (~8 s there), and a
    # new sequence length may recompile once with dynamic shapes.
    compile: bool = False
    lora: LoraConfig = field(default_factory=LoraConfig)
    # Tensor parallelism: heads, MLP columns and the vocabulary split over this many
    # consecutive workers on top of FSDP2 (engines/tensor_parallel.py); the reference and the
    # critic use the same mesh.
    tensor_parallel_size: int = 1
    # Ulysses sequence parallelism: every sequence split over this many workers
    # (engines/ulysses.py). tp x sp workers form one data-parallel replica holding the same
    # samples on each of its ranks; trainer.n_workers / (tp x sp) replicas.
    sequence_parallel_size: int = 1
    # FSDP2 CPU offload (verl's param_offload + optimizer_offload): the actor's parameter
    # shards, gradients and AdamW state live in host memory; each FSDP unit's parameters are
    # copied to the accelerator for its forward/backward only and the optimizer steps on the
    # host. Frees ~16 bytes per parameter / workers of accelerator memory for host-device
    # copies every pass. FSDP2 only: trainer.n_workers >= 2, no tensor/sequence parallelism.
    # On a CPU worker the shards already live in host memory: nothing moves.
    offload: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.tensor_parallel_size > 0, "tensor_parallel_size must be > 0")
        require(self.sequence_parallel_size > 0, "sequence_parallel_size must be > 0")
        require(self.model_parallel_size == 1 or not self.compile,
               "tensor_parallel_size / sequence_parallel_size > 1 with compile=true is not "
               "supported yet")
        require(self.mini_batch_size > 0, "mini_batch_size must be > 0")
        require(self.micro_batch_size > 0, "micro_batch_size must be > 0")
        require(self.logits_chunk_tokens >= 0, "logits_chunk_tokens must be >= 0 (0: no chunks)")
        require(self.max_tokens_per_micro_batch >= 0,
               "max_tokens_per_micro_batch must be >= 0 (0: micro_batch_size samples)")
        require(self.ppo_epochs > 0, "ppo_epochs must be > 0")

    @property
    def model_parallel_size(self) -> int:
        """Workers per data-parallel replica: tensor_parallel_size x sequence_parallel_size."""
        return self.tensor_parallel_size * self.sequence_parallel_size


@dataclass
class CriticConfig(OptimConfig):
    """The value model (PPO). Built only when the graph has a values or critic_update node.
    It steps on the actor's mini-batches (actor.mini_batch_size)."""
    # Empty: initialised from model.path (the actor's checkpoint) with a new scalar head.
    path: str = ""
    micro_batch_size: int = 64
    max_tokens_per_micro_batch: int = 0     # as actor.max_tokens_per_micro_batch
    ppo_epochs: int = 1
    cliprange_value: float = 0.5    # PPO2 value clipping around the old values
    # Recompute each decoder layer in backward, as actor.activation_checkpointing.
    activation_checkpointing: bool = False
    # The critic's shards, gradients and AdamW state in host memory; as actor.offload.
    offload: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.micro_batch_size > 0, "micro_batch_size must be > 0")
        require(self.max_tokens_per_micro_batch >= 0,
               "max_tokens_per_micro_batch must be >= 0 (0: micro_batch_size samples)")
        require(self.ppo_epochs > 0, "ppo_epochs must be > 0")
        require(self.cliprange_value > 0, "cliprange_value must be > 0")


@dataclass
class RefConfig:
    micro_batch_size: int = 64      # samples per forward pass of the reference model
    logits_chunk_tokens: int = 1024     # as actor.logits_chunk_tokens
    max_tokens_per_micro_batch: int = 0     # as actor.max_tokens_per_micro_batch
    # The reference's parameter shards in host memory, copied to the accelerator one FSDP unit
    # at a time for its forward (verl's ref param_offload); as actor.offload.
    offload: bool = False

    def __post_init__(self) -> None:
        require(self.micro_batch_size > 0, "micro_batch_size must be > 0")
        require(self.max_tokens_per_micro_batch >= 0,
               "max_tokens_per_micro_batch must be >= 0 (0: micro_batch_size samples)")
        require(self.logits_chunk_tokens >= 0, "logits_chunk_tokens must be >= 0 (0: no chunks)")
