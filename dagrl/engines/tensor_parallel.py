"""Tensor parallelism for Llama / Qwen2-layout decoders (Megatron's split, torchtitan's recipe).

Per decoder layer, with tp ranks:

    q_proj, k_proj, v_proj, gate_proj, up_proj   ColwiseParallel: rank t holds 1/tp of the
                                                 output rows (whole heads, MLP columns)
    o_proj, down_proj                            RowwiseParallel: 1/tp of the input columns;
                                                 the partial outputs are all-reduced
    input / post-attention norms                 Replicate (the residual stream is whole)

and for the model: the token embedding is RowwiseParallel over the vocabulary (each rank looks
up its rows, an all-reduce sums), the LM head's weight is sharded over the vocabulary the same
way (tied to the embedding, it is the same parameter), so the head's logits are [n, V / tp] per
rank and the log-softmax reduces over ranks (vocab_parallel.py); the final norm is replicated.
Every parameter is then a DTensor on the tp mesh, and FSDP2 shards it over the dp dimension
on top (a 2-D mesh).

HF's attention reshapes projections with `view(..., -1, head_dim)`, so each rank simply runs
attention on its local heads. Fewer KV heads than ranks (the tiny models have one): k_proj and
v_proj stay whole on every rank, each rank slices out the KV head its query heads read, and the
gradients of that weight and of its input are summed over the tp group in backward (only the
ranks reading a head contribute to it), as Megatron and vLLM replicate KV heads.

LoRA (peft) wraps a linear as base_layer + B A x · s; the adapters are split with their base so
that each rank's share of base(x) + s B(A(x)) is exactly the one-device math:

    column-parallel base (output rows split)   A [r, in] whole, B [out, r] split on its rows:
                                               rank t computes its output rows from A x
    row-parallel base (input columns split)    A split on its columns, A x all-reduced (the
                                               base's own partial sums are), B whole
    replicated KV base (fewer KV heads)        A whole, B whole with the rank's head rows
                                               sliced, like the base weight
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from dagrl.engines.sharding import decoder_layers

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def head_counts(config) -> tuple[int, int]:
    """(query heads, key/value heads) of a HF model config."""
    heads = config.num_attention_heads
    return heads, getattr(config, "num_key_value_heads", None) or heads


def check_tensor_parallel(config, tp: int, key: str = "actor.tensor_parallel_size") -> None:
    """Raise ValueError naming `key` unless `tp` splits the model's heads: the query heads
    evenly, and the KV heads evenly or each KV head onto a whole number of ranks."""
    if getattr(config, "vision_config", None) is not None:
        # the plan below shards the decoder and a vocabulary-parallel head; the vision tower
        # has no plan, and the sharded head's log-probs do not remove the image pad from the
        # policy (forward._token_logprobs)
        raise ValueError(f"{key}={tp}: an image-text model's vision tower has no tensor-parallel "
                         "plan yet; use tensor_parallel_size=1 (FSDP2 shards both towers)")
    heads, kv = head_counts(config)
    if heads % tp:
        raise ValueError(f"{key}={tp} must divide the model's num_attention_heads ({heads})")
    if kv % tp and tp % kv:
        raise ValueError(f"{key}={tp} must divide the model's num_key_value_heads ({kv}) or be "
                         f"a multiple of it (KV heads are then replicated)")
    inter = getattr(config, "intermediate_size", 0)
    if inter % tp:
        raise ValueError(f"{key}={tp} must divide the model's intermediate_size ({inter})")
    vocab = config.vocab_size
    if vocab % tp:
        raise ValueError(f"{key}={tp} must divide the model's vocab_size ({vocab})")


# A linear's split: colwise shards the output rows (weight and bias dim 0), rowwise the input
# columns (weight dim 1; a bias stays whole).
STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def layer_plan(kv_heads: int, tp: int) -> dict[str, str]:
    """{linear's path in a decoder layer: "colwise" | "rowwise"}: the linears tensor parallelism
    splits; k/v_proj only when the KV heads split evenly (else they stay whole, see above)."""
    plan = {"self_attn.q_proj": "colwise", "self_attn.o_proj": "rowwise",
            "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise"}
    if kv_heads % tp == 0:
        plan["self_attn.k_proj"] = plan["self_attn.v_proj"] = "colwise"
    return plan


def lora_adapters(module: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, torch.nn.Module]]:
    """{adapter name: (A, B)} of a peft LoRA linear; {} for a plain linear."""
    lora_a = getattr(module, "lora_A", None)
    return {name: (lora_a[name], module.lora_B[name]) for name in lora_a} if lora_a else {}


def _base(module: torch.nn.Module) -> torch.nn.Module:
    """The linear itself: peft's base_layer under LoRA, else the module."""
    return getattr(module, "base_layer", module)


def split_dims(model: torch.nn.Module, tp: int) -> dict[int, int]:
    """{id(parameter): the dim tensor parallelism over `tp` ranks splits it on} for the
    parameters `tensor_parallelize` splits (`layer_plan` and its LoRA adapters, the embedding
    and LM head over the vocabulary); the others stay whole on every tp rank. Reads the module
    tree only, so it works on a meta-device model (`dagrl plan --memory`)."""
    if tp == 1:
        return {}
    dims: dict[int, int] = {}
    for layer in decoder_layers(model):
        for path, style in layer_plan(head_counts(model.config)[1], tp).items():
            module = layer.get_submodule(path)
            linear = _base(module)
            dims[id(linear.weight)] = 0 if style == "colwise" else 1
            if linear.bias is not None and style == "colwise":
                dims[id(linear.bias)] = 0
            for a, b in lora_adapters(module).values():   # B's rows, or A's columns
                dims[id(b.weight) if style == "colwise" else id(a.weight)] = (
                    0 if style == "colwise" else 1)
    dims[id(model.get_input_embeddings().weight)] = 0
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None:
        dims.update({id(p): 0 for p in head.parameters()})
    return dims


def sum_grad_over(t: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Identity in forward; in backward the gradient is summed over `mesh` (Megatron's "f"):
    a tensor used whole on every rank, each rank's gradient being a partial sum."""
    return DTensor.from_local(t, mesh, [Replicate()], run_check=False).to_local(
        grad_placements=[Partial()])


def _replicate_params(module: torch.nn.Module, mesh: DeviceMesh) -> None:
    """Every parameter of `module` a Replicate DTensor; inputs converted to, outputs back from,
    DTensors (the math runs on the whole tensors, as without TP)."""
    distribute_module(
        module, mesh,
        input_fn=lambda mod, inputs, m: tuple(
            DTensor.from_local(x, m, [Replicate()], run_check=False)
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x
            for x in inputs),
        output_fn=lambda mod, out, m: out.to_local() if isinstance(out, DTensor) else out)


def _replicated_kv(linear: torch.nn.Linear, mesh: DeviceMesh, rows: slice) -> None:
    """k_proj / v_proj with fewer KV heads than tp ranks (or their LoRA B): the weight stays
    whole (Replicate) and rank t computes only `rows` (its KV head): [.., in] -> [.., head_dim].
    Each rank's gradient of the weight and of the input covers its head's rows only: both
    are summed over tp."""
    distribute_module(linear, mesh)          # Replicate parameters, no input/output hooks

    def forward(x: torch.Tensor) -> torch.Tensor:
        weight = sum_grad_over(linear.weight.to_local(), mesh)[rows]
        bias = (sum_grad_over(linear.bias.to_local(), mesh)[rows]
                if linear.bias is not None else None)
        return F.linear(sum_grad_over(x, mesh), weight, bias)

    linear.forward = forward


def _layer_styles(layer: torch.nn.Module, plan: dict[str, str]
                  ) -> tuple[dict[str, ParallelStyle], list[torch.nn.Module]]:
    """`parallelize_module`'s plan for a decoder layer's linears (under LoRA: peft's base layer
    and, of each adapter, B of a column-parallel linear, A of a row-parallel one, in the
    base's style), and the adapter halves that stay whole (see the module docstring)."""
    styles: dict[str, ParallelStyle] = {}
    whole: list[torch.nn.Module] = []
    for path, style in plan.items():
        module = layer.get_submodule(path)
        adapters = lora_adapters(module)
        styles[f"{path}.base_layer" if adapters else path] = STYLES[style]()
        for name, (a, b) in adapters.items():
            split = f"{path}.lora_B.{name}" if style == "colwise" else f"{path}.lora_A.{name}"
            styles[split] = STYLES[style]()
            whole.append(a if style == "colwise" else b)
    return styles, whole


def check_lora_tensor_parallel(model: torch.nn.Module) -> None:
    """Raise ValueError unless every LoRA adapter of `model` can be split as the module
    docstring says: on the decoder layers' attention / MLP linears, plain LoRA, no dropout."""
    handled = {id(layer.get_submodule(f"{part}.{name}")) for layer in decoder_layers(model)
               for part, names in (("self_attn", ATTENTION), ("mlp", MLP))
               for name in names if hasattr(layer.get_submodule(part), name)}
    for name, module in model.named_modules():
        if not hasattr(module, "lora_A"):
            continue
        if id(module) not in handled:
            raise ValueError(f"tensor parallelism splits LoRA adapters on the decoder layers' "
                             f"attention and MLP linears only; actor.lora.target_modules also "
                             f"adapts {name}")
        if getattr(module, "lora_variant", None):
            raise ValueError(f"tensor parallelism splits plain LoRA adapters only ({name} has "
                             f"{sorted(module.lora_variant)})")
        if any(getattr(d, "p", 0) > 0 for d in module.lora_dropout.values()):
            raise ValueError("actor.lora.dropout > 0 with tensor parallelism: a column-parallel "
                             "adapter's input is whole on every tp rank, and each rank would "
                             "draw its own dropout mask for it (set actor.lora.dropout=0)")


def tensor_parallelize(model: torch.nn.Module, mesh: DeviceMesh) -> torch.nn.Module:
    """Shard `model` (a HF causal LM or token-classification model of the Llama/Qwen2 layout,
    optionally wrapped in peft's LoRA) over the 1-D tp `mesh` in place; see the module
    docstring."""
    tp, rank = mesh.size(), mesh.get_local_rank()
    config = model.config
    check_tensor_parallel(config, tp)
    heads, kv = head_counts(config)
    for layer in decoder_layers(model):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if (attn is None or mlp is None or not all(hasattr(attn, n) for n in ATTENTION)
                or not all(hasattr(mlp, n) for n in MLP)):
            raise ValueError(f"tensor parallelism supports Llama/Qwen2-layout decoder layers "
                             f"(self_attn.{{q,k,v,o}}_proj, mlp.{{gate,up,down}}_proj); "
                             f"{type(layer).__name__} differs")
    check_lora_tensor_parallel(model)
    for layer in decoder_layers(model):
        attn = layer.self_attn
        styles, whole = _layer_styles(layer, layer_plan(kv, tp))
        parallelize_module(layer, mesh, styles)
        for module in whole:
            _replicate_params(module, mesh)
        if kv % tp:
            head_dim = attn.head_dim
            head = rank // (tp // kv)            # the KV head this rank's query heads read
            rows = slice(head * head_dim, (head + 1) * head_dim)
            for proj in (attn.k_proj, attn.v_proj):
                _replicated_kv(_base(proj), mesh, rows)
                for a, b in lora_adapters(proj).values():
                    _replicate_params(a, mesh)
                    _replicated_kv(b, mesh, rows)
        # Query heads per KV head on this rank (sdpa / eager repeat the KV heads by it).
        attn.num_key_value_groups = (heads // tp) // max(kv // tp, 1)
        for name, child in layer.named_children():
            if name not in ("self_attn", "mlp"):
                _replicate_params(child, mesh)
    _parallelize_ends(model, mesh)
    return model


def _parallelize_ends(model: torch.nn.Module, mesh: DeviceMesh) -> None:
    """Embedding and LM head sharded over the vocabulary, the rest (final norm, a critic's
    score head, the rotary embedding has no parameters) replicated."""
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = head is not None and head.weight is embed.weight
    parallelize_module(embed, mesh, RowwiseParallel(input_layouts=Replicate()))
    if tied:
        head.weight = embed.weight                 # the same DTensor parameter
    elif head is not None:
        # No hooks: the head only runs through forward.py's vocabulary-parallel log-probs.
        head.weight = torch.nn.Parameter(distribute_tensor(head.weight, mesh, [Shard(0)]),
                                         requires_grad=head.weight.requires_grad)
        if head.bias is not None:
            head.bias = torch.nn.Parameter(distribute_tensor(head.bias, mesh, [Shard(0)]),
                                           requires_grad=head.bias.requires_grad)
    layers = {id(p) for layer in decoder_layers(model) for p in layer.parameters()}
    done = {id(embed.weight)} | ({id(p) for p in head.parameters()} if head is not None else set())
    for module in model.modules():
        own = [p for p in module.parameters(recurse=False)
               if id(p) not in layers and id(p) not in done and not isinstance(p, DTensor)]
        if own:
            _replicate_params(module, mesh)
