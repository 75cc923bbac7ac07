"""Agents end to end on one worker: the tool_calc example and the guess_number environment run
real training steps (rollout with tools or an environment, rewards, gapped masks through the
update and, for PPO, the critic and GAE), log the agent metrics, and validate."""

from __future__ import annotations

import math
from pathlib import Path

from dagrl.config.loader import load_config
from dagrl.config.schema import Config
from dagrl.runtime.launch import launch

EXAMPLE = str(Path(__file__).parents[1] / "examples" / "tool_calc.yaml")
FAST = ["logging.progress_bar=false", "logging.console_every=1000", "trainer.torch_threads=1",
        "data.train_batch_size=8", "actor.mini_batch_size=8", "rollout.n=4"]


def run(tmp_path, path, *overrides):
    cfg = load_config(Config, path, [f"trainer.run_dir={tmp_path / 'run'}", *FAST, *overrides])
    return launch(cfg)


def test_the_tool_calc_example_trains_with_tool_calls_and_validates(tmp_path, capsys):
    history = run(tmp_path, EXAMPLE, "trainer.total_steps=2", "data.val_files=[builtin:tool-calc]",
                  "trainer.val_every=2", "data.val_batch_size=16")
    # Failed calls in both steps: the first one is described once, the counts go to the metrics.
    assert capsys.readouterr().out.count("rollout: a tool call failed:") == 1
    last = history[-1]
    for key in ("multi_turn/turns_mean", "tools/calls_mean", "tools/errors", "reward/mean",
                "actor/pg_loss", "actor/grad_norm", "multi_turn/observation_tokens_mean",
                "val/tool_calc/score", "val/multi_turn/turns_mean"):
        assert key in last and math.isfinite(last[key]), key
    # The random policy ends some turns with `=`: it calls the calculator from the first step.
    assert history[0]["tools/calls_mean"] > 0 and history[0]["tools/errors"] > 0
    assert last["actor/rollout_logprob_gap"] < 1e-4


def test_an_environment_trains_with_ppo_over_gapped_masks(tmp_path, capfd):
    history = run(tmp_path, None, "trainer.total_steps=2", "algorithm.name=ppo",
                  "data.train_files=[builtin:guess-number]", "data.max_prompt_length=40",
                  "rollout.max_new_tokens=40", "rollout.multi_turn.enable=true",
                  "rollout.multi_turn.environment=guess_number", "rollout.multi_turn.max_turns=4",
                  "rollout.multi_turn.max_tokens_per_turn=4")
    # the critic's new value head is not reported as a missing weight (transformers' table)
    printed = capfd.readouterr()
    assert "LOAD REPORT" not in printed.err + printed.out
    last = history[-1]
    for key in ("multi_turn/turns_mean", "reward/mean", "critic/vf_loss", "actor/pg_loss"):
        assert key in last and math.isfinite(last[key]), key
    assert last["multi_turn/turns_mean"] > 1
    # -0.1 per wrong guess, +1 for the right one: a random policy mostly collects penalties
    assert last["reward/min"] >= -0.4 - 1e-6 and last["reward/max"] <= 1.0
