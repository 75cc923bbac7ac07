"""End to end on one worker: a seeded short GRPO run learns, writes its files, and is
reproducible; reward failures stop it with a clear error."""

from __future__ import annotations

import json
import math

import pytest
import torch

from dagrl.config.loader import load_config
from dagrl.config.schema import Config
from dagrl.rewards.manager import RewardError
from dagrl.runtime.launch import launch

FAST = ["logging.progress_bar=false", "logging.console_every=1000", "trainer.torch_threads=1"]


def run(tmp_path, *overrides, name="run"):
    cfg = load_config(Config, None, [f"trainer.run_dir={tmp_path / name}", *FAST, *overrides])
    return launch(cfg), tmp_path / name


def test_seeded_grpo_run_reward_rises_and_logs(tmp_path):
    history, run_dir = run(tmp_path, "trainer.total_steps=24")
    rewards = [m["reward/mean"] for m in history]
    first, last = sum(rewards[:6]) / 6, sum(rewards[-6:]) / 6
    assert last > first + 0.1, rewards
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, 25))
    required = ["reward/mean", "reward/std", "response/length/mean", "actor/kl", "actor/entropy",
                "actor/clip_frac", "actor/grad_norm", "timing/rollout_s", "timing/actor_update_s",
                "timing/step_s", "throughput/tokens_per_s"]
    for key in required:
        assert key in lines[-1] and math.isfinite(lines[-1][key]), key
    assert (run_dir / "config.yaml").read_text().startswith("model:")
    # On-policy, one mini-batch: the update's ratio starts at exactly 1, so nothing is clipped.
    assert lines[0]["actor/clip_frac"] == 0.0
    # rollout and training compute the same log-probs
    assert lines[0]["actor/rollout_logprob_gap"] < 1e-4


def test_run_is_reproducible(tmp_path):
    a, _ = run(tmp_path, "trainer.total_steps=3", name="a")
    b, _ = run(tmp_path, "trainer.total_steps=3", name="b")
    for ma, mb in zip(a, b, strict=True):
        for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/kl"):
            assert ma[key] == mb[key], key


def test_skipping_the_on_policy_old_logprob_pass_changes_nothing(tmp_path):
    skipped, _ = run(tmp_path, "trainer.total_steps=3", name="skip")
    kept, _ = run(tmp_path, "trainer.total_steps=3", "actor.skip_on_policy_old_logprob=false",
                  name="keep")
    assert "timing/old_logprob_s" in kept[0] and "timing/old_logprob_s" not in skipped[0]
    for ms, mk in zip(skipped, kept, strict=True):
        assert ms["reward/mean"] == mk["reward/mean"]
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
            assert ms[key] == pytest.approx(mk[key], rel=1e-4, abs=1e-7), key


@pytest.mark.slow   # torch.compile's C++ build on the CPU: ~17 s, ~60 s with shared prompts
@pytest.mark.parametrize("layout", [(), ("model.share_prompts=true",)],
                         ids=["padded", "shared-prompts"])
def test_compiled_layers_train_like_eager_ones(tmp_path, layout):
    """Compiled decoder layers give the eager run's losses, in the padded layout and in the
    shared-prompt one (a group in one row under a tree mask whose shape changes per
    micro-batch)."""
    # A KL term, so the reference model's compiled layers run too.
    compiled, _ = run(tmp_path, "trainer.total_steps=2", "actor.compile=true",
                      "algorithm.kl_loss_coef=0.001", *layout, name="compiled")
    reference, _ = run(tmp_path, "trainer.total_steps=2", "algorithm.kl_loss_coef=0.001",
                       *layout, name="reference")
    for mc, me in zip(compiled, reference, strict=True):
        assert mc["reward/mean"] == me["reward/mean"]
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl"):
            assert mc[key] == pytest.approx(me[key], rel=1e-4, abs=1e-6), key


def test_missing_old_logprobs_with_several_updates_is_refused(tmp_path):
    graph = tmp_path / "no_old.yaml"
    graph.write_text("""
name: no_old
nodes:
  - {id: rollout, role: rollout}
  - {id: reward, role: reward, deps: [rollout]}
  - {id: advantage, role: advantage, deps: [reward]}
  - {id: actor_update, role: actor_update, deps: [advantage]}
""")
    with pytest.raises(KeyError, match="old_logprob node"):
        run(tmp_path, "trainer.total_steps=1", f"dag.graph={graph}", "actor.mini_batch_size=16",
            "algorithm.kl_loss_coef=0")


def test_generator_follows_the_actor(tmp_path):
    from dagrl.runtime.run_dir import prepare_run
    from dagrl.runtime.worker import Worker

    cfg = prepare_run(load_config(Config, None, [f"trainer.run_dir={tmp_path / 'w'}", *FAST,
                                                 "trainer.total_steps=2"]))
    worker = Worker(cfg)
    worker.train()
    actor, gen = worker.engines.actor, worker.engines.rollout
    assert actor.version == 2 and gen.weights_version == 2   # synced after every update
    for (name, p), (_, q) in zip(actor.model.named_parameters(), gen.model.named_parameters(),
                                 strict=True):
        assert torch.equal(p, q), name


def test_raising_reward_names_the_sample(tmp_path):
    bad = tmp_path / "bad_reward.py"
    # (the pre-flight's probe scores the ground truth itself: a function that fails there is
    # refused before training, tests/reliability/test_refused_rows.py)
    bad.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                   "    if solution_str != ground_truth:\n"
                   "        raise ValueError('judge unavailable')\n"
                   "    return 1.0\n")
    with pytest.raises(RewardError) as err:
        run(tmp_path, "trainer.total_steps=1", f"reward.custom_fn={bad}:compute_score")
    assert "sample" in str(err.value) and "judge unavailable" in repr(err.value.__cause__)


def test_counted_reward_failures_are_reported(tmp_path):
    flaky = tmp_path / "flaky.py"
    flaky.write_text("def compute_score(data_source, solution_str, ground_truth,"
                     " extra_info=None):\n"
                     "    if extra_info['a'] % 2:\n"
                     "        raise ValueError('odd')\n"
                     "    return 1.0\n")
    history, _ = run(tmp_path, "trainer.total_steps=1", f"reward.custom_fn={flaky}:compute_score",
                     "reward.on_error=count", "reward.error_score=-1.0")
    errors = history[0]["reward/errors"]
    assert errors > 0
    n = 32 * 8
    assert history[0]["reward/mean"] == pytest.approx(((n - errors) * 1.0 - errors) / n)
