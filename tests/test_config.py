"""The real config schema through the loader and the CLI: strict keys, types, validation."""

from __future__ import annotations

import pytest

from dagrl.cli import main as cli_main
from dagrl.config.loader import ConfigError, dump_yaml, load_config
from dagrl.config.schema import Config


def test_defaults_are_valid_and_round_trip(tmp_path):
    cfg = Config()
    path = tmp_path / "c.yaml"
    path.write_text(dump_yaml(cfg))
    assert load_config(Config, path) == cfg


def test_overrides_apply_with_types():
    cfg = load_config(Config, None, ["actor.lr=1e-4", "rollout.n=4", "data.train_batch_size=8",
                                     "actor.mini_batch_size=8", "logging.backends=[jsonl]"])
    assert cfg.actor.lr == pytest.approx(1e-4) and isinstance(cfg.actor.lr, float)
    assert cfg.rollout.n == 4 and cfg.logging.backends == ["jsonl"]


@pytest.mark.parametrize("override, fragment", [
    ("trainer.no_such_key=1", "trainer.no_such_key"),
    ("actor.lrr=0.1", "did you mean 'actor.lr'"),
    ("nosection.x=1", "nosection"),
    ("rollout.n=many", "rollout.n"),
    ("algorithm.loss_agg_mode=mean", "algorithm.loss_agg_mode"),
    ("algorithm.clip_ratio_c=0.5", "algorithm.clip_ratio_c"),
    ("rollout.top_p=0", "rollout.top_p"),
    ("rollout.multi_turn.max_turns=0", "rollout.multi_turn.max_turns"),
    ("rollout.multi_turn.format=json", "rollout.multi_turn.format"),
    ("rollout.multi_turn.enable=true", "rollout.multi_turn.enable=true needs tools"),
    ("rollout.multi_turn.sandbox.cpu_time_s=0", "rollout.multi_turn.sandbox.cpu_time_s"),
    ("rollout.multi_turn.sandbox.memory_mb=8", "rollout.multi_turn.sandbox.memory_mb"),
    ("reward.timeout_s=5", "timeout_s needs num_workers"),
    ("reward.num_workers=-1", "reward.num_workers"),
])
def test_bad_config_names_the_key(override, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(Config, None, [override])
    assert fragment in str(err.value)


def test_cross_section_check_names_both_keys():
    with pytest.raises(ConfigError, match="actor.mini_batch_size.*data.train_batch_size"):
        load_config(Config, None, ["data.train_batch_size=30", "actor.mini_batch_size=8"])


def test_cli_train_rejects_unknown_key(capsys):
    assert cli_main(["train", "trainer.no_such_key=1"]) == 2
    assert "trainer.no_such_key" in capsys.readouterr().err


def test_cli_print_config(capsys):
    assert cli_main(["train", "--print-config", "rollout.n=3"]) == 0
    out = capsys.readouterr().out
    assert "rollout:\n  n: 3\n" in out and "trainer:" in out


def test_cli_plan_prints_graph_and_tasks(capsys):
    assert cli_main(["plan"]) == 0
    out = capsys.readouterr().out
    assert "graph grpo" in out and "rank 0:" in out and "run actor_update [actor_update]" in out


def test_multi_turn_composes_and_refuses_only_column_aligned_baselines():
    base = ["rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[calculator]"]
    for extra in (["trainer.mode=async", "trainer.n_workers=2", "actor.mini_batch_size=32"],
                  ["actor.tensor_parallel_size=2", "trainer.n_workers=2"],
                  ["reward.source=judge", "judge.path=x"]):
        load_config(Config, None, [*base, *extra])
    # column-aligned baselines and gapped masks: refused, naming the variant that fits
    with pytest.raises(ConfigError, match="use tir_optimal_token_baseline"):
        load_config(Config, None, [*base, "algorithm.adv_estimator=optimal_token_baseline"])
    load_config(Config, None, [*base, "algorithm.adv_estimator=tir_optimal_token_baseline"])


def test_agent_names_are_checked_at_load(capsys):
    from dagrl.train import load_cli_config

    base = ["rollout.multi_turn.enable=true"]
    with pytest.raises(ConfigError, match="rollout.multi_turn.tools.*'calculater'.*calculator"):
        load_cli_config([*base, "rollout.multi_turn.tools=[calculater]"])
    with pytest.raises(ConfigError, match="rollout.multi_turn.environment.*'guess'"):
        load_cli_config([*base, "rollout.multi_turn.environment=guess"])
    with pytest.raises(ConfigError, match="min_new_tokens must be 0 with multi_turn"):
        load_cli_config([*base, "rollout.multi_turn.tools=[calculator]",
                         "rollout.min_new_tokens=1"])
    cfg = load_cli_config([*base, "rollout.multi_turn.tools=[calculator, my.py:fn]"])
    assert cfg.rollout.multi_turn.tools == ["calculator", "my.py:fn"]
