"""One engine layout (engines/layout.py), read by the engine build and by `dagrl plan --memory`:
its decisions and their checks, and the estimate's per-rank model states equal, byte for byte,
what the built engines hold on each rank (parameter shards, gradients after a backward, AdamW
state after a step, the reference, the rollout copy) for one worker, FSDP2, TP=2, HSDP, LoRA,
LoRA under TP=2, offload and async 1+1."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dagrl.config.loader import ConfigError, load_config, with_defaults
from dagrl.config.schema import Config
from dagrl.engines.layout import EngineLayout
from tests.dist_helpers import run_distributed

SMALL = ["rollout.backend=native", "trainer.device=cpu", "trainer.torch_threads=1",
         "data.train_batch_size=8", "actor.mini_batch_size=8", "rollout.n=2"]
STATES = ("actor weights", "gradients", "AdamW state", "reference weights", "rollout weights")
CRITIC = ("critic weights", "critic gradients", "critic AdamW state")


def _cfg(model_dir, *overrides: str) -> Config:
    return load_config(Config, None, with_defaults([f"model.path={model_dir}", *SMALL],
                                                   overrides))


def test_decisions_of_a_sync_run():
    one = EngineLayout.of(_cfg("m"), 1)
    assert (one.side, one.side_ranks, one.mesh, one.model_shard_size) == ("all", (0,), None, 1)
    assert one.rollout_copy == "shared" and one.mini_batch_samples == 16 and one.grad_scale == 1
    hsdp = EngineLayout.of(_cfg("m", "trainer.n_workers=4", "trainer.fsdp_shard_size=2"), 4)
    assert hsdp.hsdp and hsdp.model_shard_size == 2 and hsdp.grad_scale == 4
    assert hsdp.rollout_copy == "whole" and hsdp.mini_batch_samples == 4
    tp = EngineLayout.of(_cfg("m", "trainer.n_workers=4", "actor.tensor_parallel_size=2"), 4)
    assert tp.mesh == (2, 1, 2) and tp.model_shard_size == 2 and tp.grad_scale == 2
    assert tp.mini_batch_samples == 8          # per replica: 8 prompts x 2 samples / 2 replicas
    lora = EngineLayout.of(_cfg("m", "actor.lora.rank=4"), 1)
    assert lora.ref_is_actor and lora.rollout_copy == "merged"
    mixed = EngineLayout.of(_cfg("m", "model.mixed_precision=bfloat16"), 1)
    assert (mixed.rollout_copy, mixed.rollout_dtype, mixed.ref_dtype) == ("cast", "bfloat16",
                                                                         "bfloat16")
    server = _cfg("m", "rollout.backend=server", "rollout.server.urls=[http://x:1]",
                  "rollout.server.frozen_policy=true")
    assert EngineLayout.of(server, 1).rollout_copy == "external"
    offload = EngineLayout.of(_cfg("m", "trainer.n_workers=2", "actor.offload=true"), 2)
    assert offload.offload == {"actor"}


def test_decisions_of_the_async_sides():
    cfg = _cfg("m", "trainer.n_workers=4", "trainer.mode=async", "actor.lora.rank=4",
               "trainer.val_before_train=false")
    trainer = EngineLayout.of(cfg, 4)         # default: the trainer side of the default placement
    assert (trainer.side, trainer.side_ranks, trainer.model_shard_size) == ("trainer", (0, 1), 2)
    assert trainer.mini_batch_samples == 8 and trainer.ref_is_actor
    rollout = EngineLayout.of(cfg, 4, side_ranks=(2, 3), side="rollout")
    assert rollout.rollout_copy == "whole" and not rollout.ref_is_actor   # loads the base


def test_each_decision_names_its_key():
    with pytest.raises(ConfigError, match=r"actor.tensor_parallel_size \(2\) x "
                                          r"actor.sequence_parallel_size \(1\) must divide the 3"):
        EngineLayout.of(_cfg("m", "trainer.n_workers=2", "actor.tensor_parallel_size=2"), 3)
    async_cfg = ["trainer.mode=async", "trainer.val_before_train=false"]
    with pytest.raises(ConfigError, match=r"actor.offload=true .* trainer side's models are not "
                                          r"sharded \(1 rank\)"):
        EngineLayout.of(_cfg("m", "trainer.n_workers=2", "actor.offload=true", *async_cfg), 2)
    with pytest.raises(ConfigError, match=r"actor.mini_batch_size \(8\) must be divisible by the "
                                          r"3 data-parallel ranks"):
        EngineLayout.of(_cfg("m", "trainer.n_workers=4", *async_cfg), 4, side_ranks=(0, 1, 2))
    with pytest.raises(ConfigError, match=r"trainer.mode=async: the rollout side's ranks \(5,\)"):
        EngineLayout.of(_cfg("m", "trainer.n_workers=2", *async_cfg), 2, side_ranks=(5,),
                        side="rollout")


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def _storage(t: torch.Tensor) -> int:
    return (t.to_local() if hasattr(t, "to_local") else t).untyped_storage().data_ptr()


def _inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.randint(4, 48, (4, 6), generator=g), torch.ones(4, 6, dtype=torch.long),
            torch.randint(4, 48, (4, 5), generator=g), torch.ones(4, 5))


def _trained_bytes(engine, forward) -> tuple[int, int]:
    """Gradient bytes after one backward, AdamW state bytes after one step (exp_avg and
    exp_avg_sq; the scalar step counters are not counted)."""
    forward(engine.model, *_inputs()).sum().backward()
    grads = _local_bytes(p.grad for p in engine.model.parameters() if p.grad is not None)
    engine.optimizer.step()
    state = _local_bytes(v for s in engine.optimizer.state.values() for v in s.values()
                         if torch.is_tensor(v) and v.dim() > 0)
    return grads, state


def _held(engines) -> dict[str, int]:
    """What the built engines hold on this rank, by the estimate's line names."""
    from dagrl.engines.forward import response_logprobs, response_values
    from dagrl.engines.lora import ReferenceView

    held = {}
    if engines.actor is not None:
        held["actor weights"] = _local_bytes(engines.actor.model.parameters())
        held["gradients"], held["AdamW state"] = _trained_bytes(
            engines.actor, lambda m, *x: response_logprobs(m, *x).logprobs)
    if engines.critic is not None:
        held["critic weights"] = _local_bytes(engines.critic.model.parameters())
        held["critic gradients"], held["critic AdamW state"] = _trained_bytes(
            engines.critic, response_values)
    if engines.ref_model is not None:
        ref = engines.ref_model
        held["reference weights"] = (0 if isinstance(ref, ReferenceView)
                                     else _local_bytes(ref.parameters()))
    if engines.rollout is not None:   # its own storage: not the actor's tensors
        actor = {_storage(p) for p in engines.actor.model.parameters()} if engines.actor else set()
        held["rollout weights"] = sum(p.numel() * p.element_size()
                                      for p in engines.rollout.model.parameters()
                                      if _storage(p) not in actor)
    return held


def _settings(overrides) -> tuple[list[str], set[str]]:
    """The config overrides and the engines to build ("critic" in `overrides` adds a critic)."""
    needed = {"actor", "rollout", "ref"} | ({"critic"} if "critic" in overrides else set())
    return [o for o in overrides if o != "critic"], needed


def _build(model_dir, overrides, rank=0, world=1, groups=None):
    """This rank's engines for `overrides`; `groups` (async): the trainer and the rollout
    side's groups, rank 0 training, rank 1 generating and running the reference."""
    from dagrl.engines.bundle import build_engines

    overrides, needed = _settings(overrides)
    cfg = _cfg(model_dir, *overrides)
    if groups is None:
        return cfg, build_engines(cfg, needed, torch.device("cpu"), world_size=world)
    from dagrl.engines.layout import EngineLayout

    mine = {"actor"} if rank == 0 else {"rollout", "ref"}
    layout = EngineLayout.of(cfg, 2, side_ranks=(rank,), side="trainer" if rank == 0 else
                             "rollout", device_type="cpu")
    return cfg, build_engines(cfg, mine, torch.device("cpu"), layout=layout,
                              dp_group=groups[rank])


# Run on 2 processes, one spawn for all: name -> overrides ("critic" also builds a critic).
TWO_WORKERS = {
    "fsdp2": ["trainer.n_workers=2", "critic"],
    "tp2": ["trainer.n_workers=2", "actor.tensor_parallel_size=2", "critic"],
    "hsdp": ["trainer.n_workers=2", "trainer.fsdp_shard_size=1"],
    "lora": ["trainer.n_workers=2", "actor.lora.rank=4"],
    # adapters split with their base linears: B of column-, A of row-parallel ones
    "lora_tp2": ["trainer.n_workers=2", "actor.tensor_parallel_size=2", "actor.lora.rank=4"],
    "offload": ["trainer.n_workers=2", "actor.offload=true", "ref.offload=true"],
    "async": ["trainer.n_workers=2", "trainer.mode=async", "trainer.val_before_train=false"],
}


def _held_on_two(rank, world, model_dir):
    """{case: (what this rank holds, the layout its trained engines read)}."""
    import torch.distributed as dist

    out = {}
    for name, overrides in TWO_WORKERS.items():
        groups = (dist.new_group([0]), dist.new_group([1])) if name == "async" else None
        _, engines = _build(model_dir, overrides, rank, world, groups)
        layout = engines.actor.layout if engines.actor is not None else None
        out[name] = (_held(engines),
                     dataclasses.replace(layout, dp_group=None) if layout else None)
    return out


def _estimate(model_dir, overrides) -> dict[str, int]:
    from dagrl.engines.memory_estimate import estimate_memory, model_shape

    overrides, needed = _settings(overrides)
    cfg = _cfg(model_dir, *overrides)
    return {x.name: x.bytes for x in estimate_memory(cfg, model_shape(cfg),
                                                     has_critic="critic" in needed)}


@pytest.mark.parametrize("overrides", [[], ["actor.lora.rank=4"],
                                       ["model.mixed_precision=bfloat16"]],
                         ids=["plain", "lora", "mixed"])
def test_one_worker_holds_what_the_estimate_says(tiny_model_dir, overrides):
    cfg, engines = _build(tiny_model_dir, overrides)
    held = _held(engines)
    estimate = _estimate(tiny_model_dir, overrides)
    assert {k: estimate[k] for k in STATES} == held
    assert engines.actor.layout == EngineLayout.of(cfg, 1)
    if overrides:   # LoRA: no reference model, the adapted linears merged; bfloat16 cast copy
        assert held["rollout weights"] > 0
    else:           # the native decoder reads the actor's own weights
        assert held["rollout weights"] == 0


@pytest.mark.slow
def test_two_workers_hold_what_the_estimate_says(tiny_model_dir):
    per_rank = run_distributed(_held_on_two, 2, str(tiny_model_dir), timeout=240)
    for name, overrides in TWO_WORKERS.items():
        estimate = _estimate(tiny_model_dir, overrides)
        lines = STATES + (CRITIC if "critic" in overrides else ())
        if name == "async":   # rank 0 trains, rank 1 generates and runs the reference
            held = {**per_rank[0][name][0], **per_rank[1][name][0]}
            assert per_rank[0][name][1] == EngineLayout.of(_cfg(tiny_model_dir, *overrides), 2)
        else:   # the average rank: an uneven shard (the critic's one-row score head) is
            # rank 0's alone; the model's own parameters split evenly here
            held = {k: (v + per_rank[1][name][0][k]) // 2 for k, v in per_rank[0][name][0].items()}
            assert all(per_rank[1][name][0][k] == held[k] for k in STATES), name
            cfg = _cfg(tiny_model_dir, *_settings(overrides)[0])
            assert per_rank[0][name][1] == EngineLayout.of(cfg, 2), name
        assert {k: estimate[k] for k in lines} == held, name
