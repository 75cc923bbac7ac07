"""Every built-in algorithm graph runs 3 steps with 2 workers (gloo, CPU).

All nine run inside one pair of processes (starting processes is the slow part); each gets a
fresh Worker, its own run directory and its preset.
"""

from __future__ import annotations

import math

import pytest

from dagrl.config.presets import PRESETS
from tests.dist_helpers import run_distributed

SMALL = ["trainer.total_steps=3", "data.train_batch_size=8", "actor.mini_batch_size=8",
         "rollout.n=4", "rollout.max_new_tokens=4", "logging.progress_bar=false",
         "logging.console_every=1000"]

# A metric only the algorithm's own nodes produce.
SIGNATURE_METRIC = {"ppo": "critic/vf_loss", "dapo": "filter/rounds",
                    "remax": "reward/greedy_baseline/mean", "rloo": "actor/reward_kl",
                    "reinforce_pp": "actor/reward_kl", "grpo": "actor/kl"}


def _run_all(rank, world, root):
    from dagrl.config.presets import load_run_config
    from dagrl.runtime.distributed import DistContext
    from dagrl.runtime.run_dir import prepare_run
    from dagrl.runtime.worker import Worker

    ctx = DistContext(rank=rank, world_size=world)
    results = {}
    for name in PRESETS:
        cfg = load_run_config(None, [f"algorithm.name={name}", f"trainer.run_dir={root}/{name}",
                                     "trainer.n_workers=2", *SMALL])
        resolved = ctx.broadcast_object(prepare_run(cfg) if rank == 0 else None)
        worker = Worker(resolved, ctx)
        results[name] = (worker.graph.roles, worker.train())
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_distributed(_run_all, 2, str(tmp_path_factory.mktemp("algos")), timeout=600)


@pytest.mark.parametrize("name", list(PRESETS))
def test_graph_runs_three_steps_on_two_workers(runs, name):
    roles, history = runs[0][name]
    assert len(history) == 3
    assert history == runs[1][name][1]            # both ranks see the same reduced metrics
    for step in history:
        for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "advantage/abs_mean"):
            assert math.isfinite(step[key]), (name, key)
        assert step["actor/optimizer_steps"] == 1.0
        if name != "dapo":   # 8 prompts x 4 samples over 2 ranks (DAPO may generate more)
            assert step["batch/max_samples_per_rank"] == 16
    if name in SIGNATURE_METRIC:
        assert SIGNATURE_METRIC[name] in history[-1], name
    if name == "ppo":
        assert {"values", "critic_update"} <= roles
    if name == "remax":
        assert "greedy_baseline" in roles
    if name == "dapo":
        assert "filter" in roles


def test_dapo_filter_on_two_workers_keeps_the_groups_one_worker_keeps(tmp_path):
    """Half the groups of a round have rewards that vary, so each step takes a second round and
    cuts it mid-way: the kept groups are the first of the global order (round by round, rank by
    rank within a round), so 2 workers train on one worker's groups."""
    from dagrl.config.presets import load_run_config
    from dagrl.runtime.launch import launch
    from tests.dist_helpers import assert_same_steps, step_metrics, torchrun_train

    scorer = tmp_path / "score.py"
    scorer.write_text("def compute_score(data_source, solution_str, ground_truth, "
                      "extra_info=None):\n    return float(len(solution_str.strip()) % 3 == 0)\n")
    common = ["algorithm.name=dapo", "trainer.total_steps=3", "data.train_batch_size=4",
              "actor.mini_batch_size=4", "rollout.n=4", "rollout.max_new_tokens=4",
              f"reward.custom_fn={scorer}:compute_score", "algorithm.filter_max_rounds=6",
              "logging.progress_bar=false", "logging.console_every=1000",
              "trainer.torch_threads=1"]
    one = launch(load_run_config(None, [*common, f"trainer.run_dir={tmp_path / 'one'}"]))
    # a step whose second round kept more groups than it needed (6 of 8 for 4): a cut mid-round
    assert any(s["filter/rounds"] == 2 and s["filter/keep_rate"] > 0.5 for s in one), one
    torchrun_train(tmp_path / "two", 2, *common)
    keys = ["reward/mean", "actor/pg_loss", "actor/grad_norm", "filter/groups_kept",
            "filter/keep_rate", "filter/rounds"]
    assert_same_steps(step_metrics(tmp_path / "two"), step_metrics(tmp_path / "one"), keys)
