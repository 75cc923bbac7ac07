"""`dagrl plan --memory`: bytes per rank of what a run holds, estimated from the model's config
and the run's config before anything loads, so a run that cannot fit is changed before it
starts (the run report then sets the estimate beside the measured peak).

Both the estimate and the engine build read one engine layout (engines/layout.py): the
ranks each model shards over, the mesh, HSDP, LoRA, offload, dtypes, what the rollout copy is.
The **states** are counted from the same model build the engines make (engines/model_build.py:
LoRA wrapping, the reference's low-precision linears, the value and score heads), run on the
meta device from the model's config: every parameter's bytes in its own dtype, split over tp
for the ones tensor parallelism splits (engines/tensor_parallel.split_dims; the rest, norms and
k/v projections with fewer KV heads than tp, whole on every tp rank), then divided by the
ranks FSDP2 shards over (the layout's model_shard_size: the side's ranks, an HSDP group, or
dp x sp on the mesh; uneven shards differ from this average by under a row per parameter):

    actor weights      every parameter (under LoRA: the frozen base and the adapters)
    gradients          the trained parameters (freed after each optimizer step)
    AdamW state        2 x the trained parameters (exp_avg, exp_avg_sq)
    reference weights  a model of its own (0 under LoRA: the actor with adapters off;
                       linears in bfloat16 under mixed precision)
    critic             weights, gradients, AdamW state of the value model (PPO)
    rollout weights    layout.rollout_copy: 0 when shared with the actor or held outside the
                       worker (servers), the adapted linears only (LoRA, one worker), vLLM's
                       copy in the rollout dtype split over its tensor parallelism (its
                       backend's `engine_memory`), else the whole model in the rollout dtype

trainer.mode=async: the trained states are the trainer side's, the rollout copy and KV cache
the rollout side's, the reference where its node runs; the peak then adds both sides.

The **transients** stay formulas over the model's shape (`ModelShape`) and the layout, with
one worker's R rollout rows and M samples per micro-batch of S = prompt + response tokens
(b bytes per parameter, b' per rollout value):

    KV cache           2 L R S n_kv d b'      (the native decoder preallocates it; the larger
                       of a training and a validation rollout)
    activations        M S H b L              (checkpointed: each layer's input; one layer's
                       intermediates on top) or M S L (8H + 2 n_kv d + 4I) b without
                       (M S: max_tokens_per_micro_batch when set, the tokens a micro-batch
                       computes with model.share_prompts, whose rows it counts padded, or
                       pack_sequences; engines/micro_batches.py)
    LM head            3 C V 4 + V H b         (C = logits_chunk_tokens rows of fp32 logits,
                       their log-softmax and gradient; C = M x response tokens without chunks;
                       and the head weight's gradient before it is added to the kept one, plus
                       its bfloat16 per-chunk part under mixed precision, V H 2)
    autocast casts     2 T                     (mixed precision: the bfloat16 copies of the
                       trained weights autocast keeps during a forward; the layers'
                       intermediates then count 2 bytes)

Under tensor parallelism (tp) and sequence parallelism (sp) a rank's activations are those of
S / sp tokens (Ulysses), of which the tp-split intermediates (q, attention output, k, v, MLP)
count 1/tp; the logits chunk is [C, V / tp]. No [S, S] attention mask is built under sp
(engines/ulysses.py).

With actor/ref/critic.offload on an accelerator those shards count 0 on the device (their
bytes are named in the line's note: they are in host memory).

Not counted: the allocator's fragmentation and the Python/torch runtime (the estimate reports
this process's RSS after importing them as a line of its own). vLLM's KV cache is its pool:
rollout.vllm.cpu_kv_cache_gb on the host; on accelerators what gpu_memory_utilization of the
device leaves after its weights (the line says so, counting 0). Servers hold their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from dagrl.config.model_source import BUILTIN_PREFIX, TINY_FAMILIES, TINY_REWARD_MODEL
from dagrl.config.schema import Config
from dagrl.device import HOST
from dagrl.engines.layout import EngineLayout, rollout_owns_memory
from dagrl.engines.model_build import actor_model, meta_model, reference_model
from dagrl.engines.models import (
    DTYPES,
    resolve_builtin_model,
    tiny_model_config,
    tiny_tokenizer,
)
from dagrl.engines.tensor_parallel import split_dims
from dagrl.engines.tiny_reward_model import tiny_digit_rm_config
from dagrl.rollout import rollout_backend

GiB = 2**30


@dataclass(frozen=True)
class ModelShape:
    """What the transients' formulas need of a decoder-only model (Llama / Qwen2 layout), and
    the HF config the states are counted from (`config`, when made by `of`)."""
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    qkv_bias: bool = False      # Qwen2's q/k/v projections carry biases
    config: object = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, config) -> ModelShape:
        # an image-text model's decoder (its vision tower's states come from `config`)
        c = config.get_text_config() if hasattr(config, "get_text_config") else config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return cls(c.hidden_size, c.num_hidden_layers, c.num_attention_heads,
                   c.num_key_value_heads or c.num_attention_heads, head_dim,
                   c.intermediate_size, c.vocab_size,
                   bool(getattr(c, "tie_word_embeddings", config.tie_word_embeddings)),
                   bool(getattr(c, "attention_bias", c.model_type.startswith("qwen2"))),
                   config=config)

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
        family = m.path[len(BUILTIN_PREFIX):]
        return tiny_model_config(family, len(tiny_tokenizer(family)), m.tiny_hidden_size,
                                 m.tiny_layers, heads=m.tiny_heads)
    return _config_at(m.path, m.gguf_file)


def model_shape(cfg: Config) -> ModelShape:
    """The configured model's shape, from its config only (no weights are read)."""
    return ModelShape.of(model_config(cfg))


def _config_at(path: str, gguf_file: str):
    """The HF config of a model directory, an installed package's model, or the built-in tiny
    reward model (no weights read)."""
    from transformers import AutoConfig

    if path == BUILTIN_PREFIX + TINY_REWARD_MODEL:
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
    if "reward_model" in shapes:   # sharded like any FSDP2 model, never on the mesh
        s = EngineLayout.of(cfg, cfg.trainer.n_workers).fsdp_shard_size
        rm = held_bytes(meta_model(shapes["reward_model"].config, cfg.reward_model.dtype,
                                   "score"), s)
        lines.append(MemoryLine("reward model weights", rm.bytes,
                                f"{rm.params / 1e6:.1f}M params" + (f" / {s} workers (FSDP2)"
                                                                    if s > 1 else "")))
    if "judge" in shapes:
        judge = held_bytes(meta_model(shapes["judge"].config, cfg.judge.dtype), 1)
        lines.append(MemoryLine("judge weights", judge.bytes,
                                f"{judge.params / 1e6:.1f}M params, a whole copy per rank"))
    return lines


@dataclass(frozen=True)
class MemoryLine:
    name: str
    bytes: int
    note: str
    phase: str = "state"    # state: held all run; rollout / update: alive in that phase only


@dataclass(frozen=True)
class HeldBytes:
    """What a model holds: its parameters and trained parameters (whole-model counts), and
    their bytes on one rank."""
    params: int
    trained: int
    bytes: int
    trained_bytes: int


def held_bytes(model: torch.nn.Module, shards: int, tp: int = 1) -> HeldBytes:
    """Per-rank bytes of `model`'s parameters (each tied tensor once), in their own dtypes:
    tensor parallelism over `tp` ranks splits the ones `split_dims` names, then FSDP2 shards
    everything over `shards` ranks."""
    dims = split_dims(model, tp)
    params = trained = held = held_trained = 0
    for p in model.parameters():
        local = p.numel() * p.element_size() // (tp if id(p) in dims else 1)
        params += p.numel()
        held += local
        if p.requires_grad:
            trained += p.numel()
            held_trained += local
    return HeldBytes(params, trained, held // shards, held_trained // shards)


def estimate_memory(cfg: Config, shape: ModelShape, *, has_ref: bool = True,
                    has_critic: bool = False, layout: EngineLayout | None = None,
                    rollout_layout: EngineLayout | None = None,
                    ref_layout: EngineLayout | None = None) -> list[MemoryLine]:
    """Per-rank bytes of the run's states and largest transients (see the module docstring);
    `has_critic`: the graph trains a value model (PPO), counted like the actor's states.
    `layout`: the trained models' (default: the config's over trainer.n_workers; async: the
    default trainer side); `rollout_layout`, `ref_layout`: the layouts of the ranks that
    generate and that run the reference, when not `layout`'s (async: the other side)."""
    layout = layout or EngineLayout.of(cfg, cfg.trainer.n_workers)
    rollout_layout = rollout_layout or _rollout_side(cfg, layout)
    ref_layout = ref_layout or (rollout_layout if layout.side == "trainer" else layout)
    config = shape.config or model_config(cfg)
    actor = actor_model(meta_model(config, layout.param_dtype), layout, cfg.actor.lora)
    held = held_bytes(actor, layout.model_shard_size, layout.tp)
    lines = _actor_lines(held, layout)
    lines.append(_reference_line(config, ref_layout, has_ref))
    if has_critic:      # FSDP2 over the same ranks as the actor
        critic = _config_at(cfg.critic.path, "") if cfg.critic.path else config
        lines += _critic_lines(critic, layout)
    lines = _offloaded(lines, layout, ref_layout)
    lines.append(_rollout_line(cfg, config, rollout_layout, actor))
    lines += _transient_lines(cfg, shape, layout, rollout_layout, held)
    if layout.side == "all":
        return lines
    # async: each line is held by one side's ranks
    sides = {"reference weights": ref_layout.side, "rollout weights": rollout_layout.side,
             "KV cache": rollout_layout.side}
    return [replace(x, note=f"{x.note}{'; ' if x.note else ''}{sides.get(x.name, layout.side)} "
                            "ranks") for x in lines]


def _rollout_side(cfg: Config, layout: EngineLayout) -> EngineLayout:
    """The layout of the ranks that generate: `layout`'s own, or (async) the other side's."""
    if layout.side != "trainer":
        return layout
    others = tuple(r for r in range(layout.world_size) if r not in layout.side_ranks)
    return EngineLayout.of(cfg, layout.world_size, side_ranks=others, side="rollout",
                           device_type=layout.device_type)


def _shard_note(layout: EngineLayout) -> str:
    if layout.mesh:
        dp, sp, tp = layout.mesh
        return f" over {dp} dp x {sp} sp x {tp} tp"
    s = layout.model_shard_size
    return f" / {s} workers (FSDP2{' group' if layout.hsdp else ''})" if s > 1 else ""


def _actor_lines(held: HeldBytes, layout: EngineLayout) -> list[MemoryLine]:
    lora = " (LoRA)" if layout.lora_rank else ""
    return [MemoryLine("actor weights", held.bytes,
                       f"{held.params / 1e6:.1f}M params" + _shard_note(layout)),
            MemoryLine("gradients", held.trained_bytes, f"{held.trained / 1e6:.2f}M trained"
                       + lora, "update"),
            MemoryLine("AdamW state", 2 * held.trained_bytes, "exp_avg + exp_avg_sq")]


def _reference_line(config, layout: EngineLayout, has_ref: bool) -> MemoryLine:
    if layout.ref_is_actor:
        return MemoryLine("reference weights", 0, "adapters off: no copy")
    if not has_ref:
        return MemoryLine("reference weights", 0, "no ref")
    ref = reference_model(meta_model(config, layout.param_dtype), layout)
    mixed = layout.mixed_precision != "none"
    return MemoryLine("reference weights",
                      held_bytes(ref, layout.model_shard_size, layout.tp).bytes,
                      f"linears in {layout.mixed_precision}" if mixed else "")


def _critic_lines(config, layout: EngineLayout) -> list[MemoryLine]:
    held = held_bytes(meta_model(config, layout.param_dtype, "value"), layout.model_shard_size,
                      layout.tp)
    return [MemoryLine("critic weights", held.bytes,
                       f"{held.params / 1e6:.1f}M params (value model)"),
            MemoryLine("critic gradients", held.trained_bytes, "", "update"),
            MemoryLine("critic AdamW state", 2 * held.trained_bytes, "")]


OFFLOADED_LINES = {"actor": ("actor weights", "gradients", "AdamW state"),
                   "ref": ("reference weights",),
                   "critic": ("critic weights", "critic gradients", "critic AdamW state")}


def _offloaded(lines: list[MemoryLine], layout: EngineLayout,
               ref_layout: EngineLayout) -> list[MemoryLine]:
    """FSDP2 CPU offload on an accelerator: those shards are in host memory, not on the device
    (one unit at a time is gathered there, like any FSDP2 unit: not counted)."""
    names = {name for model, names in OFFLOADED_LINES.items()
             if model in (ref_layout if model == "ref" else layout).offload for name in names}
    if layout.device_type == HOST or not names:
        return lines
    return [replace(x, bytes=0, note=f"{x.bytes / GiB:.2f} GiB in host memory "
                                     f"({_offload_key(x.name)}.offload)")
            if x.name in names and x.bytes else x for x in lines]


def _offload_key(line: str) -> str:
    return next(model for model, names in OFFLOADED_LINES.items() if line in names)


def _rollout_line(cfg: Config, config, layout: EngineLayout,
                  actor: torch.nn.Module) -> MemoryLine:
    """The rollout engine's own weights, as layout.rollout_copy says they are built (an
    external engine: as its backend says, e.g. vLLM's copy in this process, split over the
    ranks of its tensor parallelism)."""
    kind = layout.rollout_copy
    if kind == "external":
        backend = rollout_backend(cfg)
        copies, _, where = backend.engine_memory(cfg, layout.device_type == HOST)
        if not copies:
            return MemoryLine("rollout weights", 0, where)
        tp = backend.ranks_per_engine(cfg)
        split = f", split over {tp} ranks (rollout tp)" if tp > 1 else ""
        twice = " x 2 (plain and packed for the host's kernels)" if copies == 2 else ""
        copy = held_bytes(meta_model(config, layout.rollout_dtype), 1, tp).bytes
        return MemoryLine("rollout weights", copies * copy,
                          f"the engine's copy in {layout.rollout_dtype}{split}{twice}")
    if kind == "shared":
        return MemoryLine("rollout weights", 0, "reads the actor's weights")
    if kind == "merged":   # lora.plain_copy: storage for W + s B A of each adapted linear only
        merged = sum(p.numel() * p.element_size() for name, p in actor.named_parameters()
                     if name.endswith(".base_layer.weight"))
        return MemoryLine("rollout weights", merged, "merged adapted linears; the rest shared")
    whole = held_bytes(meta_model(config, layout.rollout_dtype), 1).bytes
    if kind == "cast":
        return MemoryLine("rollout weights", whole, f"a {layout.rollout_dtype} cast of the actor")
    return MemoryLine("rollout weights", whole, "a whole copy on every worker")


def _transient_lines(cfg: Config, shape: ModelShape, layout: EngineLayout,
                     rollout_layout: EngineLayout, held: HeldBytes) -> list[MemoryLine]:
    """The rollout's KV cache and the update's activations, autocast casts and logits."""
    d, r = cfg.data, cfg.rollout
    rb = DTYPES[rollout_layout.rollout_dtype].itemsize      # the rollout copy's bytes per value
    kv_per_token = 2 * shape.layers * shape.kv_heads * shape.head_dim * rb
    train_rows = d.train_batch_size // rollout_layout.side_size * r.n
    val_rows = d.val_batch_size * r.val_n
    rows = max(train_rows, val_rows) if cfg.validates \
        else train_rows
    seq = d.max_prompt_length + r.max_new_tokens
    if rollout_owns_memory(cfg):   # the engine's own pool
        _, pool, where = rollout_backend(cfg).engine_memory(
            cfg, rollout_layout.device_type == HOST)
        lines = [MemoryLine("KV cache", pool or 0, where, "rollout")]
    else:
        lines = [MemoryLine("KV cache", kv_per_token * rows * seq,
                            f"{rows} rows x {seq} tokens", "rollout")]
    lines.append(_activation_line(cfg, shape, layout, seq))
    if layout.mixed_precision != "none":
        # autocast keeps its bfloat16 casts of the trained weights for the forward (frozen
        # ones are cast at each use and freed: not kept)
        lines.append(MemoryLine("autocast weight casts", held.trained * 2, "bfloat16 copies of "
                                "the linears' weights during a forward", "update"))
    a = cfg.actor
    head_rows = a.logits_chunk_tokens or a.micro_batch_size * r.max_new_tokens // layout.sp
    vocab = shape.vocab // layout.tp
    # Backward returns the head weight's [V, H] gradient as a tensor of its own, alive beside
    # the micro-batch's activations until autograd adds it to the kept gradient.
    head_grad = vocab * shape.hidden * DTYPES[layout.param_dtype].itemsize
    if layout.mixed_precision != "none":   # each chunk's product in bfloat16 (head_stats.py)
        head_grad += vocab * shape.hidden * 2
    lines.append(MemoryLine("LM head", 3 * head_rows * vocab * 4 + head_grad,
                            f"{head_rows} x {vocab} fp32 logits, x3 in backward; the weight's "
                            "gradient", "update"))
    return lines


def _activation_line(cfg: Config, shape: ModelShape, layout: EngineLayout,
                     seq: int) -> MemoryLine:
    a, tp, sp = cfg.actor, layout.tp, layout.sp
    if a.max_tokens_per_micro_batch:
        tokens = a.max_tokens_per_micro_batch
        note = f"{tokens} tokens a micro-batch"
    else:
        tokens = a.micro_batch_size * seq
        note = f"{a.micro_batch_size} x {seq} tokens a micro-batch"
    b = DTYPES[layout.param_dtype].itemsize
    h, kvd = shape.hidden, shape.kv_heads * shape.head_dim
    # Under autocast the matmuls' outputs (most saved intermediates) are bfloat16; the
    # residual stream, hence each checkpointed layer input, stays float32.
    ab = 2 if layout.mixed_precision != "none" else b
    # Per token and layer, what autograd keeps (counted on SmolLM2's update): 6 hidden-size
    # tensors stay whole under tp (the two residual sums, and per RMSNorm its normalised input
    # and its weighted output); q, the attention output, k, v and the MLP's 4 split.
    kv_split = kvd / tp if shape.kv_heads % tp == 0 else shape.head_dim
    per_layer_token = (6 * h + (2 * h + 4 * shape.intermediate) / tp + 2 * kv_split) * ab
    local = tokens / sp                                   # Ulysses: this rank's tokens
    if a.activation_checkpointing:
        act = local * h * b * shape.layers + local * per_layer_token
        note += ", checkpointed" + (" (auto: decided when the run starts)"
                                    if a.activation_checkpointing == "auto" else "")
    else:
        act = local * per_layer_token * shape.layers
    if sp > 1:
        note += f", 1/{sp} of each sequence per rank"
    return MemoryLine("activations", int(act), note, "update")


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
