"""Rollout: generation behind one interface (`RolloutEngine`, base.py), chosen by
`rollout.backend`, a name in the backend registry (`ROLLOUT_BACKENDS`, registry.py):

    native   dagrl's decoder for Llama / Qwen2 models (native.py), runs anywhere
    hf       the Hugging Face model's own forward (hf.py): any causal LM, the reference
    auto     native when it supports the model, else hf (auto.py; the default)
    vllm     vLLM's engine in the worker process (vllm.py; the vllm extra)
    server   OpenAI-compatible servers you run (server.py): vLLM, trained weights via RPC

A backend is one class (a `RolloutBackend`, base.py), registered under its name with
`@ROLLOUT_BACKENDS.register("name")` in its own module. It declares its capabilities as class
attributes (`trainer_numerics`, `owns_memory`, `shares_actor_weights`, `joins_process_group`,
`takes_weight_updates`, `multi_turn`; `ranks_per_engine` and `engine_memory` as class methods:
rollout tensor parallelism and what `plan --memory` counts), refuses what it cannot serve in
`check_config` (a `ConfigError` naming the key) and builds its engine in `from_config`. The rest
of dagrl reads the declarations of `rollout_backend(cfg)`, never the name; a user's backend is
one class in a module imported before the run (docs/extending.md).

Multi-turn rollouts (agents: tools, environments) run on top of any of them: multi_turn.py,
with the chat formats and token bookkeeping of chat.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from dagrl.config.model_rewards import JudgeConfig
from dagrl.config.schema import Config

# The built-in backends register themselves when their modules are imported.
from dagrl.rollout.auto import AutoRollout
from dagrl.rollout.base import (
    GenerationOutput,
    ModelCopy,
    RolloutBackend,
    RolloutBuild,
    RolloutEngine,
)
from dagrl.rollout.hf import HFRollout
from dagrl.rollout.native import NativeRollout
from dagrl.rollout.registry import ROLLOUT_BACKENDS, check_rollout_config, rollout_backend
from dagrl.rollout.sampling import SamplingParams
from dagrl.rollout.server import ServerRollout, ServerSettings
from dagrl.rollout.vllm import VLLMRollout, VLLMSettings  # imports vLLM only when built

# The built-in backends that generate with an in-process HF model (the judge's choices).
MODEL_BACKENDS: dict[str, type[ModelCopy]] = {"native": NativeRollout, "hf": HFRollout}


def model_rollout(backend: str, model: torch.nn.Module, *, eos_token_id: int, pad_token_id: int,
                  stop_token_ids: Sequence[int] = ()) -> RolloutEngine:
    """The engine of the registered `backend` (auto, native, hf, or a user's in-process one)
    over `model`, an inference copy it then owns (the judge's, benchmarks')."""
    if backend not in ROLLOUT_BACKENDS:
        raise ValueError(ROLLOUT_BACKENDS.unknown_message(backend))
    return ROLLOUT_BACKENDS.get(backend).over_model(
        model, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
        stop_token_ids=stop_token_ids)


def judge_rollout(judge: JudgeConfig, load_model: Callable[[], torch.nn.Module], *,
                  eos_token_id: int, pad_token_id: int) -> RolloutEngine:
    """The frozen engine judge.backend names for the judge (engines/judge.py): over the judge
    model loaded in this process, or, for a backend with weights of its own (servers), built
    by that backend's `for_judge`."""
    if judge.backend not in ROLLOUT_BACKENDS:
        raise ValueError(ROLLOUT_BACKENDS.unknown_message(judge.backend))
    return ROLLOUT_BACKENDS.get(judge.backend).for_judge(
        judge, load_model, eos_token_id=eos_token_id, pad_token_id=pad_token_id)


def build_rollout(cfg: Config, load_model: Callable[[], torch.nn.Module], device: torch.device,
                  *, eos_token_id: int, pad_token_id: int,
                  actor_model: torch.nn.Module | None = None,
                  extra_stop_token_ids: Sequence[int] = ()) -> RolloutEngine:
    """The engine `rollout.backend` names, built by its class's `from_config`. `load_model`
    gives a fresh copy of the policy (used by the in-process backends; vLLM loads `model.path`
    itself, servers hold their own). `actor_model`: the whole (unsharded) trained model, which a
    backend declaring `shares_actor_weights` may read in place instead of holding a copy.
    `extra_stop_token_ids`: stops beside EOS and rollout.stop_token_ids (a multi-turn tool-call
    format's)."""
    stop = tuple(dict.fromkeys([*cfg.rollout.stop_token_ids, *extra_stop_token_ids]))
    build = RolloutBuild(device=device, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                         stop_token_ids=stop, load_model=load_model, actor_model=actor_model)
    return rollout_backend(cfg).from_config(cfg, build)


__all__ = ["MODEL_BACKENDS", "ROLLOUT_BACKENDS", "AutoRollout", "GenerationOutput", "HFRollout",
           "NativeRollout", "RolloutBackend", "RolloutBuild", "RolloutEngine", "SamplingParams",
           "ServerRollout", "ServerSettings", "VLLMRollout", "VLLMSettings", "build_rollout",
           "check_rollout_config", "judge_rollout", "model_rollout", "rollout_backend"]
