"""Rollout backends are one class each in `ROLLOUT_BACKENDS`: the registry lists them, their
declared capabilities (not their names) drive the graph, their own refusals are one line naming
the key before any model loads, and a backend defined outside dagrl trains with one
registration."""

from __future__ import annotations

from collections import Counter
from typing import ClassVar

import pytest
import torch

from dagrl.config.loader import ConfigError, load_config
from dagrl.config.schema import Config
from dagrl.roles.plan import build_graph, plan_for
from dagrl.rollout import (
    MODEL_BACKENDS,
    ROLLOUT_BACKENDS,
    RolloutBackend,
    ServerRollout,
    build_rollout,
    model_rollout,
    rollout_backend,
)
from dagrl.rollout.hf import HFRollout
from dagrl.rollout.native import NativeRollout
from dagrl.rollout.vllm import VLLMRollout
from dagrl.runtime.launch import launch
from dagrl.train import load_cli_config

FAST = ["logging.progress_bar=false", "logging.console_every=1000", "trainer.torch_threads=1"]
ASYNC = ["trainer.mode=async", "trainer.n_workers=2", "actor.mini_batch_size=32"]
SERVER = ["rollout.backend=server", "rollout.server.urls=[http://127.0.0.1:9]",
          "rollout.server.frozen_policy=true", "rollout.server.model=m"]


# A backend from outside the package: the hf engine, counting what the worker asks of it. One
# class and one decorator call (in the `registered` fixture); nothing in dagrl changes.
class CountingHF(HFRollout):
    calls: ClassVar[Counter] = Counter()

    def generate(self, *args, **kwargs):
        type(self).calls["generate"] += 1
        return super().generate(*args, **kwargs)

    def update_weights(self, named_tensors, version: int) -> None:
        type(self).calls["update_weights"] += 1
        super().update_weights(named_tensors, version)


# The same engine declaring log-probs that are not the trainer's (as vLLM's are).
class ForeignNumerics(CountingHF):
    trainer_numerics = False


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> None:
    """The two test backends, registered for one test: the registry is process-wide, so it
    gets a copy that the test's names leave with."""
    monkeypatch.setattr(ROLLOUT_BACKENDS, "_items", dict(ROLLOUT_BACKENDS._items))
    ROLLOUT_BACKENDS.register("test_counting_hf")(CountingHF)
    ROLLOUT_BACKENDS.register("test_foreign_numerics")(ForeignNumerics)


def test_the_registry_lists_the_built_in_backends():
    assert ROLLOUT_BACKENDS.names() == ["auto", "hf", "native", "server", "vllm"]
    assert all(issubclass(ROLLOUT_BACKENDS.get(n), RolloutBackend) for n in ROLLOUT_BACKENDS)
    assert ROLLOUT_BACKENDS.get("native") is NativeRollout
    assert ROLLOUT_BACKENDS.get("vllm") is VLLMRollout     # importable without vLLM
    assert dict(MODEL_BACKENDS) == {"native": NativeRollout, "hf": HFRollout}


@pytest.mark.parametrize("name, numerics, owns, shares, joins, updates", [
    ("native", True, False, True, False, True),
    ("hf", True, False, False, False, True),
    ("auto", True, False, True, False, True),
    ("vllm", False, True, False, True, True),
    ("server", False, True, False, False, True),   # unless rollout.server.frozen_policy
])
def test_capabilities_are_declared_by_each_backend(name, numerics, owns, shares, joins, updates):
    b = ROLLOUT_BACKENDS.get(name)
    assert (b.trainer_numerics, b.owns_memory, b.shares_actor_weights, b.joins_process_group,
            b.takes_weight_updates) == (numerics, owns, shares, joins, updates)
    assert b.multi_turn and b.ranks_per_engine(load_cli_config([])) == 1


def _refusal(*overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        load_cli_config(list(overrides))
    message = str(err.value)
    assert "\n" not in message, message
    return message


def test_each_refusal_is_one_line_naming_the_key():
    assert _refusal("rollout.backend=vlm").startswith(
        "rollout.backend: unknown rollout backend 'vlm'. Did you mean 'vllm'?")
    assert "model.gguf_file must be empty" in _refusal("rollout.backend=vllm",
                                                       "model.gguf_file=m.gguf")
    assert "use model.dtype=float32" in _refusal("rollout.backend=vllm", "model.dtype=float64")
    assert "needs rollout.server.urls" in _refusal("rollout.backend=server")
    # async: the rollout ranks take each new policy (vLLM's engine, which joins the process
    # group, is built on the trainer ranks too: accepted); servers with a frozen policy cannot
    assert "the servers would never take the versions the trainer sends" in _refusal(
        *ASYNC, *SERVER)
    load_cli_config([*ASYNC, "rollout.backend=hf"])
    load_cli_config([*ASYNC, "rollout.backend=vllm"])
    # an extra policy's backend is checked too, under its key
    assert _refusal("models.other.rollout.backend=server").startswith(
        "models.other: rollout.backend=server needs rollout.server.urls")


def test_the_config_layer_takes_any_name_and_planning_checks_it():
    cfg = load_config(Config, None, ["rollout.backend=vlm"])   # config/ cannot see the registry
    with pytest.raises(ConfigError, match="rollout.backend: unknown rollout backend 'vlm'"):
        plan_for(cfg, 1)
    with pytest.raises(ConfigError, match="rollout.server.urls"):
        plan_for(load_config(Config, None, ["rollout.backend=server"]), 1)


@pytest.mark.parametrize("backend, recomputes", [
    ("native", False), ("hf", False), ("auto", False), ("vllm", True), ("server", True),
    ("test_counting_hf", False), ("test_foreign_numerics", True)])
def test_trainer_numerics_decides_the_old_logprob_pass(registered, backend, recomputes):
    overrides = [f"rollout.backend={backend}"] if backend != "server" else SERVER
    roles = build_graph(load_cli_config(overrides)).roles   # on-policy GRPO: one step a batch
    assert ("old_logprob" in roles) == recomputes


def test_build_rollout_builds_the_named_class_without_a_model():
    def no_model() -> torch.nn.Module:
        raise AssertionError("a server backend loads no model")

    engine = build_rollout(load_cli_config(SERVER), no_model, torch.device("cpu"),
                           eos_token_id=2, pad_token_id=0, extra_stop_token_ids=[5])
    assert isinstance(engine, ServerRollout) and engine.stop_token_ids == [2, 5]
    with pytest.raises(ValueError, match="weights of its own"):
        model_rollout("server", torch.nn.Linear(1, 1), eos_token_id=2, pad_token_id=0)


def test_a_backend_registered_outside_dagrl_trains(registered, tmp_path):
    cfg = load_cli_config([f"trainer.run_dir={tmp_path / 'run'}", "trainer.total_steps=2", *FAST,
                           "rollout.backend=test_counting_hf"])
    assert rollout_backend(cfg) is CountingHF
    CountingHF.calls.clear()
    history = launch(cfg)
    assert len(history) == 2 and all(m["reward/mean"] == m["reward/mean"] for m in history)
    # it generated every step and took the new weights after the first update
    assert CountingHF.calls["generate"] >= 2 and CountingHF.calls["update_weights"] >= 1
    # trainer numerics (inherited from hf): pi_old is the rollout's, no old_logprob pass
    assert "timing/old_logprob_s" not in history[0]
