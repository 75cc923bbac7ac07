"""FSDP2 CPU offload (actor.offload, ref.offload, critic.offload): every FSDP unit gets FSDP2's
CPUOffloadPolicy, a 2-worker GRPO run with the actor and reference offloaded reproduces the
1-worker run across a checkpoint and a resume, and so does a PPO run with the critic offloaded.

On these CPU workers the shards already live in host memory, so the policy moves nothing:
what is tested is the wiring (policy on every unit, optimizer on the offloaded shards, weight
gathers for the rollout, DCP checkpoints, gradient-norm all-reduce). The accelerator path
(shards copied to the GPU per unit, collectives on host tensors over gloo beside NCCL) runs in
scripts/gpu_smoke.sh."""

from __future__ import annotations

import pytest

from dagrl.config.loader import ConfigError, load_config
from dagrl.config.presets import load_run_config
from dagrl.config.schema import Config
from dagrl.device import collective_backend
from dagrl.runtime.launch import launch
from tests.dist_helpers import (
    assert_resumed_run_matches_one_worker,
    assert_same_steps,
    run_distributed,
    step_metrics,
    torchrun_train,
)

SMALL = ["logging.progress_bar=false", "logging.console_every=1000", "trainer.torch_threads=1",
         "data.train_batch_size=8", "actor.mini_batch_size=8", "rollout.n=2",
         "rollout.max_new_tokens=8"]
COMPARED = ["reward/mean", "response/length/mean", "actor/pg_loss", "actor/kl",
            "actor/entropy", "actor/grad_norm"]


@pytest.mark.parametrize("overrides, message", [
    (["actor.offload=true"], "actor.offload=true offloads FSDP2 shards, and one worker holds "
                             r"its models whole \(nothing is sharded\); it needs "
                             "trainer.n_workers >= 2"),
    (["ref.offload=true"], "ref.offload=true offloads FSDP2 shards"),
    (["critic.offload=true"], "critic.offload=true offloads FSDP2 shards"),
    (["ref.offload=true", "trainer.n_workers=2", "actor.lora.rank=4"],
     "ref.offload=true with actor.lora.rank > 0: the reference is the actor with its adapters "
     "off"),
])
def test_offload_is_refused_where_there_are_no_fsdp2_shards_to_offload(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(Config, None, overrides)


def test_accelerator_workers_get_a_host_backend_for_offloaded_tensors():
    assert collective_backend("cuda") == "nccl"
    assert collective_backend("cuda", host_tensors=True) == "cpu:gloo,cuda:nccl"
    assert collective_backend("cpu", host_tensors=True) == "gloo"


def _policies(rank, world, model_dir):
    from torch.distributed.fsdp import CPUOffloadPolicy

    from dagrl.engines.models import load_model
    from dagrl.engines.sharding import shard_model

    model = shard_model(load_model(model_dir), world, "cpu", offload=True)
    units = [m for m in model.modules() if hasattr(m, "_get_fsdp_state")]
    groups = [m._get_fsdp_state()._fsdp_param_group for m in units]
    return len(units), all(isinstance(g.offload_policy, CPUOffloadPolicy) for g in groups if g)


def test_every_fsdp_unit_gets_the_offload_policy(tiny_model_dir):
    for units, offloaded in run_distributed(_policies, 2, str(tiny_model_dir)):
        assert units >= 3 and offloaded     # the decoder layers and the root


def _policies_on_the_mesh(rank, world, model_dir):
    from torch.distributed.fsdp import CPUOffloadPolicy
    from torch.distributed.tensor import DTensor

    from dagrl.engines.mesh import build_train_mesh, parallelize_model
    from dagrl.engines.models import load_model

    mesh = build_train_mesh(world, 2, 1, "cpu")
    model = parallelize_model(load_model(model_dir), mesh, offload=True)
    units = [m for m in model.modules() if hasattr(m, "_get_fsdp_state")]
    groups = [m._get_fsdp_state()._fsdp_param_group for m in units]
    q = model.model.layers[0].self_attn.q_proj.weight
    return (len(units), all(isinstance(g.offload_policy, CPUOffloadPolicy) for g in groups if g),
            isinstance(q, DTensor) and q.device_mesh.mesh_dim_names)


@pytest.mark.slow   # offload under tp trains in CI in the vLLM venv's matrix runs 8 and 16
def test_tensor_parallel_slices_get_the_offload_policy(tiny_model_dir):
    """Under tensor parallelism FSDP2 offloads its shards of each tp slice (a 2-D DTensor over
    the dp and tp dimensions); 4 ranks: 2 replicas of tp 2."""
    for units, offloaded, dims in run_distributed(_policies_on_the_mesh, 4, str(tiny_model_dir)):
        assert units >= 3 and offloaded
        assert dims == ("dp", "tp")


@pytest.mark.slow
def test_two_offloaded_workers_match_one_worker_across_a_resume(tmp_path):
    assert_resumed_run_matches_one_worker(tmp_path, 2, SMALL,
                                          ["actor.offload=true", "ref.offload=true"], COMPARED)


@pytest.mark.slow
def test_two_workers_with_an_offloaded_critic_match_one_worker(tmp_path):
    ppo = [*SMALL, "algorithm.name=ppo", "trainer.total_steps=2"]
    one = tmp_path / "one"
    launch(load_run_config(None, [f"trainer.run_dir={one}", *ppo]))   # ppo's preset
    run_dir = tmp_path / "offload"
    torchrun_train(run_dir, 2, *ppo, "critic.offload=true")
    reference = step_metrics(one)
    keys = [*(k for k in COMPARED if k in reference[0]), "critic/values", "critic/vf_loss",
            "critic/grad_norm"]
    assert [m["step"] for m in reference] == [1, 2]
    assert_same_steps(step_metrics(run_dir), reference, keys)
