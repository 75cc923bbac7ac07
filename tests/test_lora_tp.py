"""LoRA under tensor and sequence parallelism: the adapters split with their base linears
(engines/tensor_parallel.py) compute the one-device model's log-probs, adapter gradients,
merged rollout weights and reference (adapters off); `dagrl train trainer.n_workers=2
actor.lora.rank=8 actor.tensor_parallel_size=2` (torchrun and Ray) and sequence_parallel_size=2
reproduce the 1-worker LoRA run's first 5 steps within 1e-5, and a TP=2 LoRA checkpoint resumes
with one worker."""

from __future__ import annotations

import json
import os

import pytest
import torch

from dagrl.engines.lora import apply_lora
from dagrl.engines.models import load_model
from dagrl.engines.tensor_parallel import check_lora_tensor_parallel
from dagrl.runtime.launch import launch
from tests.dist_helpers import run_distributed
from tests.test_lora import _lora_model
from tests.test_model_parallel_runs import STEPS, assert_same_run, config, metrics, torchrun

LORA = ["actor.lora.rank=8", "actor.lora.alpha=16"]


def _inputs():
    """Left-padded prompts, right-padded responses (rows of different lengths)."""
    g = torch.Generator().manual_seed(3)
    prompt_ids, responses = (torch.randint(4, 48, (4, 6), generator=g),
                             torch.randint(4, 48, (4, 5), generator=g))
    prompt_mask, response_mask = torch.ones(4, 6, dtype=torch.long), torch.ones(4, 5)
    prompt_mask[0, :2] = 0
    response_mask[1, 3:] = 0
    return prompt_ids, prompt_mask, responses, response_mask


def _pass(model, weights):
    """Log-probs, the reference's (adapters off), the adapters' gradients of a weighted sum of
    the log-probs, their clipped norm, and the merged weights the rollout engine would get."""
    from dagrl.engines.forward import response_logprobs
    from dagrl.engines.lora import ReferenceView, lora_scalings, merged_weights
    from dagrl.engines.weight_sync import gather_full_weights

    def full(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    out = response_logprobs(model, *_inputs()).logprobs
    (out * weights).sum().backward()
    trained = [p for p in model.parameters() if p.requires_grad]
    norm = full(torch.nn.utils.clip_grad_norm_(trained, float("inf")))
    with torch.no_grad():
        ref = response_logprobs(ReferenceView(model), *_inputs()).logprobs
    return {
        "logprobs": out.detach(), "ref": ref, "norm": norm.reshape(1),
        **{f"grad {n}": full(p.grad) for n, p in model.named_parameters() if p.requires_grad},
        **{f"merged {n}": t for n, t in merged_weights(gather_full_weights(model),
                                                       lora_scalings(model))},
        "frozen without grad": torch.tensor([all(p.grad is None for p in model.parameters()
                                                 if not p.requires_grad)]),
    }


def _tp_against_one(rank, world, model_dir):
    """{what: max |TP=2 - one process|} on this rank, and the trained parameter names."""
    from dagrl.engines.mesh import build_train_mesh, parallelize_model

    weights = torch.rand(4, 5, generator=torch.Generator().manual_seed(4)) - 0.5
    one = _pass(_lora_model(model_dir), weights)
    model = parallelize_model(_lora_model(model_dir), build_train_mesh(world, world, 1, "cpu"))
    tp = _pass(model, weights)
    assert sorted(tp) == sorted(one)
    trained = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    return {k: float((tp[k].double() - one[k].double()).abs().max()) for k in one}, trained


@pytest.mark.slow
def test_adapters_split_with_their_base_compute_the_one_device_model(tiny_model_dir):
    per_rank = run_distributed(_tp_against_one, 2, str(tiny_model_dir))
    for diffs, trained in per_rank:
        # only the adapters train: A and B of all 7 linears of 2 layers
        assert len(trained) == 2 * 7 * 2 and all(".lora_" in n for n in trained)
        assert sum(k.startswith("grad ") for k in diffs) == len(trained)
        assert sum(k.startswith("merged ") for k in diffs) > len(trained) // 2
        assert diffs["frozen without grad"] == 0
        assert max(diffs.values()) < 1e-5, {k: v for k, v in diffs.items() if v >= 1e-5}


def test_adapters_tensor_parallelism_cannot_split_are_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="actor.lora.dropout > 0 with tensor parallelism"):
        check_lora_tensor_parallel(apply_lora(load_model(str(tiny_model_dir)), 4, 8.0,
                                              "all-linear", 0.1))
    with pytest.raises(ValueError, match="also adapts .*embed_tokens"):
        check_lora_tensor_parallel(apply_lora(load_model(str(tiny_model_dir)), 4, 8.0,
                                              ["q_proj", "embed_tokens"], 0.0))
    check_lora_tensor_parallel(apply_lora(load_model(str(tiny_model_dir)), 4, 8.0,
                                          "all-linear", 0.0))


@pytest.fixture(scope="module")
def lora_one_worker(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("lora-one") / "run"
    launch(config(run_dir, f"trainer.total_steps={STEPS}", *LORA))
    return metrics(run_dir)


def test_torchrun_lora_tensor_parallel_matches_one_worker_and_resumes_with_one(
        tmp_path, lora_one_worker, capfd):
    run_dir = tmp_path / "tp"
    torchrun(run_dir, "actor.tensor_parallel_size=2", "trainer.save_every=2", *LORA)
    assert_same_run(metrics(run_dir), lora_one_worker)
    # The adapters moved the policy away from the reference, so the merged weights the
    # rollout engine generated with are tested by the matching rewards of steps 2-5.
    assert lora_one_worker[-1]["actor/kl"] > 0
    step_2 = run_dir / "checkpoints" / "step_00000002"
    adapter = json.loads((step_2 / "lora" / "adapter_config.json").read_text())
    assert adapter["r"] == 8

    # TP=2 adapter shards and their AdamW state into one worker: steps 3-4 continue the run.
    resumed = tmp_path / "resumed"
    launch(config(resumed, "trainer.total_steps=4", f"trainer.resume={step_2}", *LORA))
    assert "saved by 2 worker(s), now 1" in capfd.readouterr().out
    assert_same_run(metrics(resumed), lora_one_worker[2:4])


@pytest.mark.slow
def test_ray_lora_tensor_parallel_matches_one_worker(tmp_path, lora_one_worker):
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    run_dir = tmp_path / "ray"
    launch(config(run_dir, "trainer.n_workers=2", "actor.tensor_parallel_size=2",
                  f"trainer.total_steps={STEPS}", *LORA))
    assert_same_run(metrics(run_dir), lora_one_worker)


@pytest.mark.composition   # a 2-worker run: with the matrix (pytest -m composition)
def test_torchrun_lora_sequence_parallel_matches_one_worker(tmp_path, lora_one_worker):
    run_dir = tmp_path / "sp"
    torchrun(run_dir, "actor.sequence_parallel_size=2", *LORA)
    assert_same_run(metrics(run_dir), lora_one_worker)
