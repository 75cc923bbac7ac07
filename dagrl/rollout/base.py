"""The rollout seam: what every generation backend provides, and what they share.

A backend holds an inference copy of the policy, samples responses for left-padded prompts,
and takes new weights after each update. The rollout node, validation and ReMax's greedy
baseline only ever talk to this interface, so a backend (native, hf; vLLM and server mode in
their own modules) can be swapped with `rollout.backend` and nothing else changes. Each backend
is also a `RolloutBackend` class, registered by name (registry.py), that declares what it can
do; the rest of dagrl reads those declarations, never the name.

Conventions every backend keeps (tests check them on each):
- prompts [B, P] are left-padded, so each row's last prompt token sits in column P-1;
- responses are right-padded to exactly `max_new_tokens` columns (batches from different steps
  or workers concatenate without re-padding), pad after the stop token;
- a response ends at the first of `stop_token_ids` (EOS included), which is part of it;
- token t of sample b is drawn with the uniform number `uniform_draws(sample_seed[b], t)`
  (sampling.py), so a sample's tokens do not depend on its batch or worker;
- `logprobs` are log softmax(z / T) at the sampled token (T = 1 for greedy), before top-k /
  top-p truncation: the quantity the actor recomputes in training.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch

from dagrl.config.loader import ConfigError
from dagrl.config.model_source import model_reads_images
from dagrl.rollout.sampling import SamplingParams

if TYPE_CHECKING:
    from dagrl.config.model_rewards import JudgeConfig
    from dagrl.config.schema import Config


@dataclass
class GenerationOutput:
    responses: torch.Tensor       # [B, R] int64, pad after the stop token
    response_mask: torch.Tensor   # [B, R] float32, 1 up to and including the stop token
    logprobs: torch.Tensor        # [B, R] float32, 0 where masked
    # [B, R] int64: the policy version that drew each token (-1 where masked), from engines
    # whose weights change while a run generates (the async rollout side, rollout/versioned.py)
    token_versions: torch.Tensor | None = None


class RolloutEngine(Protocol):
    """A generation backend (see the module docstring for the conventions)."""

    stop_token_ids: list[int]     # EOS first, then rollout.stop_token_ids
    weights_version: int          # the actor version whose weights it holds

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                 sample_seed: torch.Tensor, params: SamplingParams, *, max_new_tokens: int,
                 min_new_tokens: int = 0) -> GenerationOutput:
        """One response per row. prompt_ids/prompt_mask: [B, P]; sample_seed: [B]."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                     version: int) -> None:
        """Take every parameter of the policy, by name (streamed: each tensor is only
        valid until the next is drawn)."""


@dataclass(frozen=True)
class RolloutBuild:
    """What the worker hands a backend's `from_config` besides the config."""
    device: torch.device
    eos_token_id: int
    pad_token_id: int
    # Stops beside EOS: rollout.stop_token_ids, then a multi-turn tool-call format's.
    stop_token_ids: tuple[int, ...] = ()
    # A fresh inference copy of the policy, for backends that generate in this process.
    load_model: Callable[[], torch.nn.Module] | None = None
    # The whole (unsharded) trained model, with one worker: a backend that declares
    # `shares_actor_weights` may generate with it instead of loading a copy.
    actor_model: torch.nn.Module | None = None


class RolloutBackend:
    """A rollout backend as `rollout.backend` names it: one class, registered in
    `dagrl.rollout.registry.ROLLOUT_BACKENDS`, that declares what it can do and builds its engine
    (usually the class is the engine itself). The rest of dagrl reads these declarations, never
    the backend's name. Each says a physical property of the engine, so a new backend answers
    them from what it is; the defaults are those of an engine in the worker's own process.
    """

    # Its log-probs are computed with the trainer's own numerics (same kernels, same dtype),
    # so when the policy has not moved they are pi_old and the graph may skip the old_logprob
    # pass (dag/builtin.py). False: the trainer recomputes pi_old.
    trainer_numerics: ClassVar[bool] = True
    # It holds its weights and KV cache in a memory pool of its own (another allocator, another
    # process or machine), which `dagrl plan --memory` does not count.
    owns_memory: ClassVar[bool] = False
    # It can generate with the actor's own unsharded weights (one worker), so no rollout copy
    # of the policy exists.
    shares_actor_weights: ClassVar[bool] = False
    # Its engine joins torch.distributed when it starts: building it is collective, so every
    # rank must build one at the same point (the rollout node on every rank; in async mode the
    # trainer ranks build one too, which they validate with).
    joins_process_group: ClassVar[bool] = False
    # It takes each new policy's weights (`update_weights`); False: its weights stay frozen.
    takes_weight_updates: ClassVar[bool] = True
    # The multi-turn agent loop (multi_turn.py) can drive it: it only needs `generate` over
    # left-padded contexts and the engine's `stop_token_ids`.
    multi_turn: ClassVar[bool] = True
    # It runs an image-text model on prompts with images (`generate(..., images=)`: the
    # pixels go into the prefill, data/vision.py).
    generates_from_images: ClassVar[bool] = False

    @classmethod
    def check_config(cls, cfg: Config) -> None:
        """Refuse, with the physical reason, a config this backend cannot serve; raises
        `ConfigError` naming the key. Runs when the config is loaded and when the graph is
        planned, before any model loads. Subclasses add their own refusals and call super()."""
        name = cfg.rollout.backend
        if cfg.is_async and not cls.takes_weight_updates:
            # Async rollout ranks generate with every new policy version the trainer sends.
            raise ConfigError(f"trainer.mode=async with rollout.backend={name}: it cannot take "
                              "the new weights the trainer ranks send; use a backend that "
                              "does, or trainer.mode=sync")
        if not cls.generates_from_images and model_reads_images(cfg.model.path):
            raise ConfigError(f"model.path={cfg.model.path} is an image-text model and "
                              f"rollout.backend={name} takes no images in its prompts; use "
                              "rollout.backend=hf (or auto)")
        if cfg.rollout.multi_turn.enable and not cls.multi_turn:
            raise ConfigError(f"rollout.multi_turn.enable with rollout.backend={name}: this "
                              "backend cannot run the multi-turn agent loop")
        if cfg.rollout.partial and model_reads_images(cfg.model.path):
            # versioned.py re-prompts the unfinished rows chunk by chunk, and a subset of rows
            # would need its own rows' images split out of the batch's concatenated ones
            raise ConfigError(f"rollout.partial with model.path={cfg.model.path}, an image-text "
                              "model: partial rollout does not carry the images of the rows "
                              "it continues yet; use rollout.partial=false")

    @classmethod
    def engine_memory(cls, cfg: Config, on_host: bool) -> tuple[int, int | None, str]:
        """With `owns_memory`, what its engine holds on each rank, for `dagrl plan --memory`:
        (the copies of the weights it holds here, each split over `ranks_per_engine`; the
        bytes of its KV cache pool, None where they depend on the device; a note)."""
        return 0, 0, "held outside this worker"

    @classmethod
    def ranks_per_engine(cls, cfg: Config) -> int:
        """The ranks one engine is sharded over (rollout tensor parallelism): the nodes that
        generate run on replicas of that many consecutive ranks, every rank of a replica
        holding the replica's prompts and driving its shard of the one engine (dag/planner.py).
        1: an engine per rank, each generating its own shard."""
        return 1

    @classmethod
    def from_config(cls, cfg: Config, build: RolloutBuild) -> RolloutEngine:
        """The engine for `cfg`: by default over a fresh in-process copy of the policy
        (`build.load_model`); a backend with weights of its own overrides this."""
        return cls.over_model(build.load_model(), eos_token_id=build.eos_token_id,
                              pad_token_id=build.pad_token_id,
                              stop_token_ids=build.stop_token_ids)

    @classmethod
    def for_judge(cls, judge: JudgeConfig, load_model: Callable[[], torch.nn.Module], *,
                  eos_token_id: int, pad_token_id: int) -> RolloutEngine:
        """The frozen engine a judge grades with (engines/judge.py): by default over the judge
        model loaded in this process (`load_model`); a backend with weights of its own
        overrides this."""
        return cls.over_model(load_model(), eos_token_id=eos_token_id, pad_token_id=pad_token_id)

    @classmethod
    def over_model(cls, model: torch.nn.Module, *, eos_token_id: int, pad_token_id: int,
                   stop_token_ids: Sequence[int] = ()) -> RolloutEngine:
        """An engine generating with the in-process `model` (the judge's): only backends that
        generate with an HF model in this process can."""
        raise ValueError(f"{cls.__name__} generates with weights of its own, not with a model "
                         "handed to it; use auto, native or hf")


def stop_tokens(eos_token_id: int, extra: Sequence[int]) -> list[int]:
    """EOS and `rollout.stop_token_ids`, without repeats, EOS first."""
    return list(dict.fromkeys([eos_token_id, *extra]))


def unpadded_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[list[int]]:
    """Each row's real prompt tokens, for engines that take token-id lists: [B, P] -> B lists."""
    return [row[mask.bool()].tolist()
            for row, mask in zip(prompt_ids.cpu(), prompt_mask.cpu(), strict=True)]


def padded_output(tokens: Sequence[Sequence[int]], logprobs: Sequence[Sequence[float]],
                  max_new_tokens: int, pad_token_id: int,
                  device: torch.device) -> GenerationOutput:
    """Per-sample token and log-prob lists -> the fixed-width, right-padded GenerationOutput."""
    batch = len(tokens)
    responses = torch.full((batch, max_new_tokens), pad_token_id, dtype=torch.long)
    mask = torch.zeros(batch, max_new_tokens)
    out_logprobs = torch.zeros(batch, max_new_tokens)
    for i, (ids, lps) in enumerate(zip(tokens, logprobs, strict=True)):
        n = min(len(ids), max_new_tokens)
        responses[i, :n] = torch.tensor(list(ids[:n]), dtype=torch.long)
        mask[i, :n] = 1.0
        out_logprobs[i, :n] = torch.tensor(list(lps[:n]), dtype=torch.float32)
    return GenerationOutput(responses.to(device), mask.to(device), out_logprobs.to(device))


class ModelCopy(RolloutBackend):
    """A backend that generates with an in-process HF model (native and hf): holds the model
    and copies new weights into its parameters in place, so no second copy is ever made."""

    def __init__(self, model: torch.nn.Module, *, eos_token_id: int, pad_token_id: int,
                 stop_token_ids: Sequence[int] = (), shared: bool = False) -> None:
        """`shared`: `model` is the trained actor itself (one worker, native decoder), not a
        copy: it is left trainable, and there is never anything to sync."""
        self.model = model if shared else model.eval().requires_grad_(False)
        self.shared = shared
        self.pad_token_id = pad_token_id
        self.stop_token_ids = stop_tokens(eos_token_id, stop_token_ids)
        self.weights_version = 0

    @classmethod
    def over_model(cls, model: torch.nn.Module, *, eos_token_id: int, pad_token_id: int,
                   stop_token_ids: Sequence[int] = ()) -> RolloutEngine:
        return cls(model, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                   stop_token_ids=stop_token_ids)

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                       version: int) -> None:
        """Copy parameters in place by name; every parameter of the model must be given."""
        params = dict(self.model.named_parameters())
        seen = set()
        for name, tensor in named_tensors:
            if name not in params:
                raise KeyError(f"weight sync: the rollout model has no parameter {name!r}")
            if params[name].data_ptr() != tensor.data_ptr():   # not a tensor shared with the actor
                params[name].copy_(tensor)
            seen.add(name)
        missing = set(params) - seen
        if missing:
            raise KeyError(f"weight sync: no value given for {sorted(missing)[:5]}")
        self.weights_version = version
