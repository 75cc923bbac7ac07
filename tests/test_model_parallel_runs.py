"""Tensor and sequence parallelism end to end: `torchrun --nproc-per-node 2 -m dagrl.train
trainer.n_workers=2 actor.tensor_parallel_size=2` (and sequence_parallel_size=2, both also
under Ray) reproduce the 1-worker run's first 5 steps within 1e-5 (float32, CPU, gloo); a
checkpoint written under TP=2 resumes with one worker (TP=1); PPO's critic on the TP mesh
matches too; the tensor fields the roles declare (what `dagrl plan` counts in a move's bytes)
are the ones a real step's batch holds."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from dagrl.config.loader import with_defaults
from dagrl.config.presets import load_run_config
from dagrl.runtime.launch import launch
from tests.dist_helpers import free_port

FAST = ["logging.progress_bar=false", "logging.console_every=1000", "trainer.torch_threads=1"]
STEPS = 5
# What a step computes: rewards, lengths, the losses, the gradient norm; and what is counted
# (samples once per replica, one optimizer step).
COMPARED = ["reward/mean", "reward/std", "response/length/mean", "actor/pg_loss", "actor/kl",
            "actor/entropy", "actor/grad_norm", "actor/clip_frac", "advantage/abs_mean",
            "batch/samples", "actor/optimizer_steps", "tokens/total"]


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_same_run(ours, reference, extra=()):
    assert [m["step"] for m in ours] == [m["step"] for m in reference]
    for a, b in zip(ours, reference, strict=True):
        # (PPO puts the KL in the reward: no actor/kl)
        for key in [*(k for k in COMPARED if k in b or k != "actor/kl"), *extra]:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (a["step"], key)


def config(run_dir, *overrides):
    return load_run_config(None, [f"trainer.run_dir={run_dir}", *FAST, *overrides])


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("one") / "run"
    launch(config(run_dir, f"trainer.total_steps={STEPS}"))
    return metrics(run_dir)


def torchrun(run_dir, *overrides):
    # The defaults under the caller's overrides (dagrl refuses a key given twice).
    args = with_defaults([f"trainer.run_dir={run_dir}", "trainer.n_workers=2",
                          f"trainer.total_steps={STEPS}", *FAST], overrides)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), "-m", "dagrl.train", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_torchrun_tensor_parallel_matches_one_worker_and_resumes_with_one(tmp_path, one_worker,
                                                                          capfd):
    run_dir = tmp_path / "tp"
    torchrun(run_dir, "actor.tensor_parallel_size=2", "trainer.save_every=2")
    ours = metrics(run_dir)
    assert_same_run(ours, one_worker)
    # both ranks held the whole batch: one replica of 2 ranks
    assert ours[0]["batch/max_samples_per_rank"] == 256 == ours[0]["batch/samples"]
    assert "timing/replicate_ref_logprob_s" in ours[0]

    # The checkpoint of step 2 (TP=2: 2-D DTensor shards) into one worker (TP=1): DCP
    # reshards model and AdamW state; steps 3-4 continue the uninterrupted run.
    resumed = tmp_path / "resumed"
    launch(config(resumed, "trainer.total_steps=4",
                  f"trainer.resume={run_dir / 'checkpoints' / 'step_00000002'}"))
    assert "saved by 2 worker(s), now 1" in capfd.readouterr().out
    assert_same_run(metrics(resumed), one_worker[2:4])


@pytest.mark.slow   # SP parity is also in the composition matrix (docs/composition.md)
def test_torchrun_sequence_parallel_matches_one_worker(tmp_path, one_worker):
    # with the memory features on: layers recomputed in backward, the LM head in chunks
    run_dir = tmp_path / "sp"
    torchrun(run_dir, "actor.sequence_parallel_size=2", "actor.activation_checkpointing=true",
             "actor.logits_chunk_tokens=100", "ref.logits_chunk_tokens=100")
    assert_same_run(metrics(run_dir), one_worker)


# Under Ray: the composition matrix's Ray runs with tp and sp (docs/composition.md) check the
# same parity with 1 worker.


@pytest.mark.slow
def test_torchrun_ppo_critic_under_tensor_parallel_matches_one_worker(tmp_path):
    # the critic (and its value head) on the same mesh: values, its loss and gradient norm
    ppo = ["algorithm.name=ppo"]
    one = tmp_path / "one"
    launch(config(one, f"trainer.total_steps={STEPS}", *ppo))
    torchrun(tmp_path / "tp", "actor.tensor_parallel_size=2", *ppo)
    critic = ["critic/values", "critic/vf_loss", "critic/grad_norm", "critic/optimizer_steps"]
    assert_same_run(metrics(tmp_path / "tp"), metrics(one), extra=critic)


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_declared_fields_are_the_batch_fields(tmp_path, algorithm):
    from dagrl.observe.metrics import StepMetrics
    from dagrl.roles.plan import PROMPT_FIELDS
    from dagrl.roles.registry import ROLES
    from dagrl.runtime.run_dir import prepare_run
    from dagrl.runtime.worker import Worker

    cfg = prepare_run(config(tmp_path / "run", f"algorithm.name={algorithm}",
                             "data.train_batch_size=4", "actor.mini_batch_size=4"))
    worker = Worker(cfg)
    batch = worker.run_tasks(worker.plan.tasks, worker.source.next_batch(1, StepMetrics()), 1,
                             StepMetrics())
    declared = dict(PROMPT_FIELDS)
    for task in worker.plan.tasks:
        declared.update(ROLES.get(task.role).adds)
    widths = {"P": cfg.data.max_prompt_length, "R": cfg.rollout.max_new_tokens}
    held = {}
    for key in batch.tensors.keys():   # noqa: SIM118 (a TensorDict iterates over rows)
        t = batch[key]
        width = next((w for w, n in widths.items() if t.shape[1:] == (n,)), "")
        held[key] = f"{width} {str(t.dtype).removeprefix('torch.')}".strip()
    assert held == declared
    assert isinstance(batch["responses"], torch.Tensor)
