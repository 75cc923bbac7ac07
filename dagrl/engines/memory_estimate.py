"""`dagrl plan --memory`: bytes per rank of what a run holds, estimated from the model's config
and the run's config before anything loads, so a run that cannot fit is changed before it
starts (the run report then sets the estimate beside the measured peak).

With P parameters (b bytes each), T of them trained (all, or the LoRA adapters), W workers
(FSDP2 shards everything trained over all of them; under HSDP, trainer.fsdp_shard_size = k,
W below stands for k: each group of k ranks holds a whole copy), one worker's R rollout rows
and M samples per micro-batch of S = prompt + response tokens:

    actor weights      P b / W
    gradients          T b / W                 (freed after each optimizer step)
    AdamW state        2 T b / W               (exp_avg, exp_avg_sq)
    reference weights  P b / W                 (0 under LoRA: the actor with adapters off;
                                            linears in 2 bytes under mixed precision)
    critic             (1 + 1 + 2) P_v b / W     (PPO: weights, gradients, AdamW state of the
                       value model, P_v = P without an untied LM head, plus a scalar head)

Under tensor parallelism (tp) and sequence parallelism (sp), with dp = W / (tp sp) replicas,
the P_r parameters tp replicates (norms; k/v projections with fewer KV heads than tp) are
sharded over dp x sp ranks only: weights, gradients and AdamW state count (P - P_r) / W +
P_r / (dp sp) of each. A rank's activations are those of S / sp tokens (Ulysses), of which the
tp-split intermediates (q, attention output, k, v, MLP) count 1/tp; the logits chunk is
[C, V / tp]. No [S, S] attention mask is built under sp (engines/ulysses.py).
    rollout weights    P b' (a whole copy; 0 when the native decoder reads the actor's own
                       weights, one worker without LoRA; the adapted linears only under LoRA;
                       b' = 2 under mixed precision, a bfloat16 copy)
    KV cache           2 L R S n_kv d b'      (the native decoder preallocates it; the larger
                       of a training and a validation rollout)
    activations        M S H b L              (checkpointed: each layer's input; one layer's
                       intermediates on top) or M S L (6H + 2 n_kv d + 4I) b without
    logits             3 C V 4                 (C = logits_chunk_tokens rows of fp32 logits,
                       their log-softmax and gradient; C = M x response tokens without chunks)
    autocast casts     2 T                     (mixed precision: the bfloat16 copies of the
                       trained weights autocast keeps during a forward; the layers'
                       intermediates then count 2 bytes)

With actor/ref/critic.offload on an accelerator those shards count 0 on the device (their
bytes are named in the line's note: they are in host memory).

Not counted: the allocator's fragmentation and the Python/torch runtime (the estimate reports
this process's RSS after importing them as a line of its own). vLLM and server rollouts hold
their own memory (rollout.vllm.gpu_memory_utilization).
"""

from __future__ import annotations

from dataclasses import dataclass

from dagrl.config.schema import Config
from dagrl.device import HOST, device_type
from dagrl.engines.models import (
    BUILTIN_PREFIX,
    DTYPES,
    TINY_FAMILIES,
    build_char_tokenizer,
    resolve_builtin_model,
    tiny_model_config,
)
from dagrl.engines.tiny_reward_model import NAME as TINY_RM
from dagrl.engines.tiny_reward_model import tiny_digit_rm_config

GiB = 2**30


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of a decoder-only model (Llama / Qwen2 layout)."""
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    qkv_bias: bool = False      # Qwen2's q/k/v projections carry biases

    @classmethod
    def of(cls, c) -> ModelShape:
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return cls(c.hidden_size, c.num_hidden_layers, c.num_attention_heads,
                   c.num_key_value_heads or c.num_attention_heads, head_dim,
                   c.intermediate_size, c.vocab_size, bool(c.tie_word_embeddings),
                   bool(getattr(c, "attention_bias", c.model_type == "qwen2")))

    @property
    def linear_params(self) -> int:
        """Parameters of the decoder layers' linears (what LoRA's all-linear adapts)."""
        kv = self.kv_heads * self.head_dim
        q = self.heads * self.head_dim
        return self.layers * (2 * self.hidden * q + 2 * self.hidden * kv
                              + 3 * self.hidden * self.intermediate)

    @property
    def params(self) -> int:
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        norms = self.hidden * (2 * self.layers + 1)
        biases = self.layers * (self.heads + 2 * self.kv_heads) * self.head_dim * self.qkv_bias
        return self.linear_params + embeddings + norms + biases

    @property
    def value_params(self) -> int:
        """The critic built from this model (`*ForTokenClassification`, one label): the
        backbone without the LM head, plus a scalar head with its bias."""
        return self.params - (0 if self.tied else self.vocab * self.hidden) + self.hidden + 1

    def replicated_params(self, tp: int) -> int:
        """Parameters tensor parallelism over `tp` ranks keeps whole on every rank: the norms,
        and k_proj / v_proj (with biases) when there are fewer KV heads than ranks."""
        if tp == 1:
            return 0
        norms = self.hidden * (2 * self.layers + 1)
        kv = self.kv_heads * self.head_dim
        kv_proj = self.layers * 2 * (self.hidden * kv + kv * self.qkv_bias)
        return norms + (kv_proj if self.kv_heads % tp else 0)

    def lora_params(self, rank: int) -> int:
        """A [r, in] and B [out, r] on every linear of every layer (all-linear)."""
        kv = self.kv_heads * self.head_dim
        q = self.heads * self.head_dim
        h, i = self.hidden, self.intermediate
        shapes = [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]
        return self.layers * sum(rank * (a + b) for a, b in shapes)


def model_config(cfg: Config):
    """The configured model's HF config (config.json or the GGUF header; no weights read)."""
    m = cfg.model
    if m.path.startswith(BUILTIN_PREFIX) and m.path[len(BUILTIN_PREFIX):] in TINY_FAMILIES:
        return tiny_model_config(m.path[len(BUILTIN_PREFIX):], len(build_char_tokenizer()),
                                 m.tiny_hidden_size, m.tiny_layers)
    return _config_at(m.path, m.gguf_file)


def model_shape(cfg: Config) -> ModelShape:
    """The configured model's shape, from its config only (no weights are read)."""
    return ModelShape.of(model_config(cfg))


def _config_at(path: str, gguf_file: str):
    """The HF config of a model directory, an installed package's model, or the built-in tiny
    reward model (no weights read)."""
    from transformers import AutoConfig

    if path == BUILTIN_PREFIX + TINY_RM:
        return tiny_digit_rm_config()
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    return AutoConfig.from_pretrained(resolve_builtin_model(path, "", hidden_size=0, layers=0,
                                                            seed=0),
                                      local_files_only=True, **kwargs)


def other_model_shapes(cfg: Config) -> dict[str, ModelShape]:
    """The shapes of the run's models besides the main policy: each extra policy of `models`
    by its name, the reward model as 'reward_model', the judge as 'judge' (configs only)."""
    shapes = {name: model_shape(derived) for name, derived in cfg.derived_models.items()}
    if cfg.reward.source == "reward_model":
        shapes["reward_model"] = ModelShape.of(_config_at(cfg.reward_model.path, ""))
    if cfg.reward.source == "judge":
        shapes["judge"] = ModelShape.of(_config_at(cfg.judge.path, cfg.judge.gguf_file))
    return shapes


def other_model_lines(cfg: Config, shapes: dict[str, ModelShape],
                      with_ref: set[str] = frozenset()) -> list[MemoryLine]:
    """Per-rank bytes the run's other models hold all run (`shapes` from other_model_shapes):
    an extra policy its weights, AdamW state, reference (if its name is in `with_ref`: a graph
    node computes its reference log-probs) and rollout copy as the main one does
    (its gradients and transients are not added: the models' updates run one after another,
    so the main policy's update phase stands for them); the reward model its weights (decoder
    and a one-label score head), FSDP2 over the workers; the judge a whole copy per rank."""
    lines = []
    for name, derived in cfg.derived_models.items():
        for line in estimate_memory(derived, shapes[name], has_ref=name in with_ref):
            if line.phase == "state" and line.bytes:
                lines.append(MemoryLine(f"{name}: {line.name}", line.bytes, line.note))
    w = cfg.trainer.n_workers
    s = cfg.trainer.fsdp_shard_size or w
    if "reward_model" in shapes:
        shape = shapes["reward_model"]   # the LM head (if untied) is a one-label score head
        p = shape.params - (0 if shape.tied else shape.vocab * shape.hidden) + shape.hidden
        b = DTYPES[cfg.reward_model.dtype].itemsize
        lines.append(MemoryLine("reward model weights", p * b // s,
                                f"{p / 1e6:.1f}M params" + (f" / {s} workers (FSDP2)" if s > 1
                                                            else "")))
    if "judge" in shapes:
        p = shapes["judge"].params
        lines.append(MemoryLine("judge weights", p * DTYPES[cfg.judge.dtype].itemsize,
                                f"{p / 1e6:.1f}M params, a whole copy per rank"))
    return lines


@dataclass(frozen=True)
class MemoryLine:
    name: str
    bytes: int
    note: str
    phase: str = "state"    # state: held all run; rollout / update: alive in that phase only


def critic_shape(cfg: Config, shape: ModelShape) -> ModelShape:
    """The critic's source model: critic.path's config, or the actor's (`shape`)."""
    return ModelShape.of(_config_at(cfg.critic.path, "")) if cfg.critic.path else shape


def estimate_memory(cfg: Config, shape: ModelShape, *, has_ref: bool = True,
                    has_critic: bool = False) -> list[MemoryLine]:
    """Per-rank bytes of the run's states and largest transients (see the module docstring);
    `has_critic`: the graph trains a value model (PPO), counted like the actor's states."""
    b = DTYPES[cfg.model.dtype].itemsize
    w = cfg.trainer.n_workers
    a = cfg.actor
    tp, sp = (a.tensor_parallel_size, a.sequence_parallel_size) if w > 1 else (1, 1)
    # Ranks a model is sharded over: all W, or (HSDP, tp = sp = 1 only) its group of
    # trainer.fsdp_shard_size, each group holding a whole copy.
    s = cfg.trainer.fsdp_shard_size or w
    lora = cfg.actor.lora.rank
    p = shape.params
    trained = shape.lora_params(lora) if lora else p
    rep = shape.replicated_params(tp)

    def per_rank(count: int, nbytes: int = b) -> int:
        """Bytes per rank of `count` parameters: FSDP2 over the s ranks of a shard group (all
        W without HSDP), the ones tp replicates (when `count` is the whole model) over dp x sp
        only."""
        held = count + rep * (tp - 1) if count == p else count
        return held * nbytes // s

    mesh = (f" / {s} workers (FSDP2{' group' if s < w else ''})" if s > 1 and tp * sp == 1
            else f" over {w // (tp * sp)} dp x {sp} sp x {tp} tp" if w > 1 and tp * sp > 1
            else "")
    lines = [MemoryLine("actor weights", per_rank(p), f"{p / 1e6:.1f}M params" + mesh)]
    lines.append(MemoryLine("gradients", per_rank(trained),
                            f"{trained / 1e6:.2f}M trained" + (" (LoRA)" if lora else ""),
                            "update"))
    lines.append(MemoryLine("AdamW state", per_rank(trained, 2 * b),
                            "exp_avg + exp_avg_sq"))
    mixed = cfg.model.mixed_precision != "none"
    ref_note = "adapters off: no copy" if lora else ("" if has_ref else "no ref")
    ref = per_rank(p) if has_ref and not lora else 0
    if ref and mixed:   # the linears in bfloat16 (engines/precision.py), the rest in b bytes
        linears = shape.linear_params + (0 if shape.tied else shape.vocab * shape.hidden)
        ref = ((p - linears) * b + linears * 2 + rep * (tp - 1) * b) // s
        ref_note = "linears in bfloat16"
    lines.append(MemoryLine("reference weights", ref, ref_note))
    if has_critic:      # FSDP2 over the same ranks as the actor
        pc = critic_shape(cfg, shape).value_params
        lines.append(MemoryLine("critic weights", per_rank(pc), f"{pc / 1e6:.1f}M params "
                                "(value model)"))
        lines.append(MemoryLine("critic gradients", per_rank(pc), "", "update"))
        lines.append(MemoryLine("critic AdamW state", per_rank(pc, 2 * b), ""))
    # FSDP2 CPU offload on an accelerator: those shards are in host memory, not on the device
    # (one unit at a time is gathered there, like any FSDP2 unit: not counted).
    # (trainer.device names the run's device, present here or not; auto: this machine's)
    on_accelerator = (cfg.trainer.device if cfg.trainer.device != "auto"
                      else device_type("auto")) != HOST
    for key, on, names in (
            ("actor.offload", a.offload, ("actor weights", "gradients", "AdamW state")),
            ("ref.offload", cfg.ref.offload, ("reference weights",)),
            ("critic.offload", cfg.critic.offload,
             ("critic weights", "critic gradients", "critic AdamW state"))):
        if on and on_accelerator:
            lines = [MemoryLine(x.name, 0, f"{x.bytes / GiB:.2f} GiB in host memory ({key})",
                                x.phase) if x.name in names and x.bytes else x for x in lines]
    backend = cfg.rollout.backend
    rb = DTYPES[cfg.model.rollout_dtype].itemsize      # the rollout copy's bytes per value
    if backend in ("vllm", "server"):
        rollout, note = 0, "held by the engine (not counted)"
    elif w == 1 and mixed:
        rollout, note = p * rb, f"a {cfg.model.rollout_dtype} cast of the actor"
    elif w == 1 and not lora and backend in ("native", "auto"):
        rollout, note = 0, "reads the actor's weights"
    elif w == 1 and lora:
        rollout, note = shape.linear_params * b, "merged adapted linears; the rest shared"
    else:
        rollout, note = p * rb, "a whole copy on every worker"
    lines.append(MemoryLine("rollout weights", rollout, note))

    d, r = cfg.data, cfg.rollout
    kv_per_token = 2 * shape.layers * shape.kv_heads * shape.head_dim * rb
    train_rows = d.train_batch_size // w * r.n
    val_rows = d.val_batch_size * r.val_n
    rows = max(train_rows, val_rows) if cfg.trainer.val_every or cfg.trainer.val_before_train \
        else train_rows
    seq = d.max_prompt_length + r.max_new_tokens
    kv = kv_per_token * rows * seq if backend not in ("vllm", "server") else 0
    lines.append(MemoryLine("KV cache", kv, f"{rows} rows x {seq} tokens", "rollout"))

    micro = a.micro_batch_size
    if a.max_tokens_per_micro_batch:
        tokens = a.max_tokens_per_micro_batch
        micro_note = f"{tokens} tokens a micro-batch"
    else:
        tokens = micro * seq
        micro_note = f"{micro} x {seq} tokens a micro-batch"
    h, kvd = shape.hidden, shape.kv_heads * shape.head_dim
    # Under autocast the matmuls' outputs (most saved intermediates) are bfloat16; the
    # residual stream, hence each checkpointed layer input, stays float32.
    ab = 2 if mixed else b
    # Per token and layer: 4 hidden-size tensors stay whole under tp (layer input, the two
    # norms' outputs, o_proj's output); q, the attention output, k, v and the MLP's 4 split.
    kv_split = kvd / tp if shape.kv_heads % tp == 0 else shape.head_dim
    per_layer_token = (4 * h + (2 * h + 4 * shape.intermediate) / tp + 2 * kv_split) * ab
    local = tokens / sp                                   # Ulysses: this rank's tokens
    if a.activation_checkpointing:
        act = local * h * b * shape.layers + local * per_layer_token
        act_note = micro_note + ", checkpointed"
    else:
        act = local * per_layer_token * shape.layers
        act_note = micro_note
    if sp > 1:
        act_note += f", 1/{sp} of each sequence per rank"
    lines.append(MemoryLine("activations", int(act), act_note, "update"))
    if mixed:   # autocast keeps its bfloat16 casts of the trained weights for the forward
        cast = trained * 2   # (frozen ones are cast at each use and freed: not kept)
        lines.append(MemoryLine("autocast weight casts", cast, "bfloat16 copies of the linears'"
                                " weights during a forward", "update"))
    head_rows = a.logits_chunk_tokens or micro * r.max_new_tokens // sp
    vocab = shape.vocab // tp
    lines.append(MemoryLine("logits", 3 * head_rows * vocab * 4,
                            f"{head_rows} x {vocab} fp32, x3 in backward", "update"))
    return lines


def estimated_peak(lines: list[MemoryLine], runtime_bytes: int = 0) -> int:
    """States held all run, plus the larger of the rollout's and the update's transients."""
    states = sum(line.bytes for line in lines if line.phase == "state")
    phases = {line.phase for line in lines} - {"state"}
    largest = max((sum(x.bytes for x in lines if x.phase == ph) for ph in phases), default=0)
    return runtime_bytes + states + largest


def format_estimate(lines: list[MemoryLine], runtime_bytes: int = 0) -> str:
    width = max(len(line.name) for line in lines) + len(" (update)")
    out = []
    for line in lines:
        name = line.name + (f" ({line.phase})" if line.phase != "state" else "")
        out.append(f"{name:<{width}}  {line.bytes / GiB:6.2f} GiB  {line.note}")
    out.append(f"{'runtime':<{width}}  {runtime_bytes / GiB:6.2f} GiB  this process's RSS "
               "after importing torch and transformers")
    out.append(f"{'peak':<{width}}  {estimated_peak(lines, runtime_bytes) / GiB:6.2f} GiB  "
               "states + the larger phase + runtime; allocator fragmentation not included")
    return "\n".join(out)
