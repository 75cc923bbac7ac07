"""LoRA for the actor, through `peft`: low-rank adapters on the frozen base weights,

    W' = W + (alpha / r) · B A,     A [r, in], B [out, r], B = 0 at the start,

so only A and B get gradients and AdamW state (a few MB instead of two model-sized buffers).
Three things outside training must see it right:
- the **reference policy** is the base model, i.e. the actor with its adapters switched off
  (`ReferenceView`): no second copy of the weights is loaded for it;
- **weight sync** hands the rollout engine plain HF weights with the adapters merged in
  (`merged_weights`), so every backend (native, hf, vLLM) runs it unchanged; an in-process
  rollout copy is built from the actor, sharing the tensors LoRA never changes (`plain_copy`);
- **checkpoints** hold the peft model's state (base + adapters) and the adapter config
  (`ADAPTER_DIR`), so `dagrl export` can merge them into a plain HF model.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from dagrl.config.loader import ConfigError
from dagrl.data.vision import reads_images
from dagrl.extras import MissingExtraError

# In a checkpoint directory: peft's adapter_config.json of a LoRA actor (absent without LoRA).
ADAPTER_DIR = "lora"
_PEFT_PREFIX = "base_model.model."
# The modules of an image-text model's vision tower (Qwen2-VL family: `model.visual.*`).
VISION_TOWER = r".*\bvisual\b.*"


@contextmanager
def _quiet_peft():
    """peft's wrapping calls a transformers API deprecated in 5.x, and warns when a saved
    adapter config's base path differs from where it is loaded (always so for a checkpoint):
    neither is anything the user can act on."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
        warnings.filterwarnings("ignore", message=".*base_model_name_or_path.*")
        yield


def apply_lora(model: torch.nn.Module, rank: int, alpha: float,
               target_modules: str | list[str], dropout: float) -> torch.nn.Module:
    """Wrap a HF causal LM in peft's LoRA (before sharding, like activation checkpointing)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as err:
        raise MissingExtraError("actor.lora.rank > 0 needs peft: pip install -e '.[lora]'") from err

    # An image-text model: adapters on its language model, the vision tower frozen as loaded
    # (verl's `exclude_modules='.*visual.*'`; vLLM applies adapters to the language model
    # alone, and the tower's MLP names, gate/up/down_proj, would otherwise match too).
    exclude = VISION_TOWER if reads_images(model.config) else None
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout,
                        target_modules=target_modules, exclude_modules=exclude,
                        task_type="CAUSAL_LM")
    try:
        with _quiet_peft():
            return get_peft_model(model, config)
    except ValueError as err:   # e.g. target_modules that match no module of this model
        raise ConfigError(f"actor.lora.target_modules={target_modules!r}: {err}") from err


def is_lora(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config")


def save_adapter_config(model: torch.nn.Module, out: Path) -> None:
    """peft's adapter_config.json of `model` into `out` (what `load_lora_config` reads)."""
    model.peft_config["default"].save_pretrained(str(out))


def wrap_like_checkpoint(model: torch.nn.Module, adapter_dir: Path) -> torch.nn.Module:
    """A plain HF model wrapped with the LoRA config a checkpoint was trained with, so the
    checkpoint's peft-named state loads into it (`dagrl export`)."""
    from peft import LoraConfig, get_peft_model

    with _quiet_peft():
        return get_peft_model(model, LoraConfig.from_pretrained(str(adapter_dir)))


def lora_scalings(model: torch.nn.Module) -> dict[str, float]:
    """{peft module name: alpha / r} for every adapted linear of a peft model."""
    return {name: float(module.scaling["default"]) for name, module in model.named_modules()
            if hasattr(module, "lora_A") and "default" in getattr(module, "scaling", {})}


def hf_name(peft_name: str) -> str:
    """The plain HF parameter name of a peft one, e.g.
    base_model.model.model.layers.0.mlp.up_proj.base_layer.weight
    -> model.layers.0.mlp.up_proj.weight"""
    name = peft_name.removeprefix(_PEFT_PREFIX)
    return name.replace(".base_layer.", ".")


# peft's parameter names of an adapted linear, by the part of W + s · B A each one is.
_LORA_PARTS = ((".base_layer", "weight", "W"), (".lora_A.default", "weight", "A"),
               (".lora_B.default", "weight", "B"))


def _lora_part(name: str) -> tuple[str, str] | None:
    """(adapted module, "W" | "A" | "B") of a peft parameter name, or None for any other."""
    module, _, leaf = name.rpartition(".")
    for suffix, want, part in _LORA_PARTS:
        if module.endswith(suffix) and leaf == want:
            return module.removesuffix(suffix), part
    return None


def is_adapter(name: str) -> bool:
    """Whether a peft parameter is one of the adapters' A or B matrices."""
    part = _lora_part(name)
    return part is not None and part[1] != "W"


def adapter_tensors(named: Iterator[tuple[str, torch.Tensor]]
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapters' (name, tensor) as peft saves them (adapter_model.safetensors: the
    adapter's name dropped, base_model.model.<module>.lora_A.weight), from the peft model's
    gathered A and B matrices."""
    for name, tensor in named:
        yield name.replace(".lora_A.default.", ".lora_A.").replace(
            ".lora_B.default.", ".lora_B."), tensor


def adapter_config(model: torch.nn.Module) -> dict:
    """peft's adapter_config.json of `model`, as a dict."""
    config = model.peft_config["default"].to_dict()
    # sets (peft's target_modules after it resolved `all-linear`) are not JSON
    return {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}


@torch.no_grad()
def merged_weights(named: Iterator[tuple[str, torch.Tensor]],
                   scalings: dict[str, float]) -> Iterator[tuple[str, torch.Tensor]]:
    """Plain HF (name, tensor) pairs from a peft model's full (gathered) parameters, each
    adapted weight replaced by W + s · B A.

    peft registers an adapted linear's parameters as base_layer.weight, [base_layer.bias],
    lora_A.default.weight, lora_B.default.weight: the three parts of a merge are held until
    the last of them arrives, in whatever order (under tensor parallelism the gather yields
    the whole adapter halves before the split base weights); every other tensor passes
    through under its HF name at once.
    """
    held: dict[str, dict[str, torch.Tensor]] = {}   # adapted module -> {"W", "A", "B"}
    for name, tensor in named:
        part = _lora_part(name)
        if part is None:
            yield hf_name(name), tensor
            continue
        owner, which = part
        parts = held.setdefault(owner, {})
        parts[which] = tensor
        if len(parts) == len(_LORA_PARTS):
            del held[owner]
            base, a, b = parts["W"], parts["A"], parts["B"]
            yield hf_name(owner + ".weight"), base + scalings[owner] * (
                b.to(base.dtype) @ a.to(base.dtype))
    if held:
        raise RuntimeError(f"weight sync: LoRA parameters without their pair: {sorted(held)[:4]}")


@torch.no_grad()
def plain_copy(peft_model: torch.nn.Module) -> torch.nn.Module:
    """A plain HF model of the actor's current policy for an in-process rollout engine, built
    without reading the checkpoint again: the module tree is created on the meta device (no
    memory), every tensor LoRA leaves untouched — embeddings, a tied LM head, norms, linears
    without adapters, rotary buffers — is the actor's own frozen tensor, and only the adapted
    linears get storage of their own, holding W + s · B A. Frozen tensors never change, so the
    sharing is safe; it needs the whole (unsharded) actor. SmolLM2-135M: the copy holds 0.43 of
    0.54 GB, and no second model is ever loaded (a load held both at once: +0.5 GiB peak)."""
    base = peft_model.get_base_model()
    with torch.device("meta"):
        copy = type(base)(base.config)
    merged = dict(merged_weights(peft_model.named_parameters(remove_duplicate=False),
                                 lora_scalings(peft_model)))
    params: dict[int, torch.nn.Parameter] = {}    # one Parameter per tensor: ties stay tied
    for name, _ in list(copy.named_parameters(remove_duplicate=False)):
        tensor = merged.get(name)
        if tensor is None:
            raise RuntimeError(f"rollout copy: the actor has no parameter {name!r}")
        if id(tensor) not in params:
            # a trained tensor that is not an adapter (peft's modules_to_save) gets its own
            params[id(tensor)] = torch.nn.Parameter(
                tensor.detach().clone() if tensor.requires_grad else tensor, requires_grad=False)
        module, _, leaf = name.rpartition(".")
        setattr(copy.get_submodule(module), leaf, params[id(tensor)])
    for name, buffer in base.named_buffers(remove_duplicate=False):
        module, _, leaf = hf_name(name).rpartition(".")
        copy.get_submodule(module)._buffers[leaf] = buffer
    left = [n for n, t in [*copy.named_parameters(), *copy.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"rollout copy: no value for {left[:4]}")
    return copy.eval()


class ReferenceView:
    """The reference policy of a LoRA actor: the same (sharded) model with the adapters off,
    i.e. exactly the frozen base weights. Called like a model by the teacher-forced passes."""

    def __init__(self, peft_model: torch.nn.Module) -> None:
        self.peft_model = peft_model

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.peft_model.get_output_embeddings()

    def get_input_embeddings(self) -> torch.nn.Module:
        """(The dtype of a shared-prompt pass's attention mask, engines/forward.py.)"""
        return self.peft_model.get_input_embeddings()

    @property
    def config(self):
        """The model's config (an image-text model's image tokens, data/vision.py)."""
        return self.peft_model.config

    def modules(self):
        """The model's modules (an image-text model's M-RoPE module, data/vision.py)."""
        return self.peft_model.modules()

    @property
    def dagrl_sp_mesh(self):
        """The actor's sequence-parallel mesh (ulysses.sequence_parallel_mesh reads this
        attribute): the reference pass must shard its sequences the same way, since the
        model's attention expects 1/sp of every sequence."""
        return getattr(self.peft_model, "dagrl_sp_mesh", None)

    @torch.no_grad()
    def __call__(self, *args, **kwargs):
        training = self.peft_model.training
        self.peft_model.eval()
        try:
            with self.peft_model.disable_adapter():
                return self.peft_model(*args, **kwargs)
        finally:
            self.peft_model.train(training)
