"""`dagrl.train(...)` from Python (dagrl/api.py): a list of dicts, a `datasets.Dataset` and a
pandas frame as the train set, reward functions as callables (in this process, or by import
path), overrides as keywords; the run's directory, metrics and checkpoint come back."""

from __future__ import annotations

import pytest

import dagrl
from dagrl.config.loader import ConfigError
from dagrl.rewards.scorers import arith_score

STEPS = {"trainer__total_steps": 3, "data__train_batch_size": 8, "actor__mini_batch_size": 8,
         "rollout__n": 4, "logging__progress_bar": False}


def sums(n: int = 40) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": f"{a}+{b}="}], "data_source": "sums",
             "reward_model": {"ground_truth": str(a + b)}} for a in range(n // 8)
            for b in range(8)]


def exact_or_partial(data_source, solution_str, ground_truth, extra_info=None):
    """An importable reward function (verl's signature)."""
    return arith_score(solution_str, ground_truth)


def test_a_list_of_dicts_and_a_notebook_style_reward_train_in_this_process(tmp_path):
    calls = []

    def reward(data_source, solution_str, ground_truth, extra_info=None):   # a local closure
        calls.append(data_source)
        return float(solution_str.strip() == ground_truth)

    result = dagrl.train(reward_fn=reward, train_dataset=sums(),
                         trainer__run_dir=str(tmp_path / "run"), trainer__save_every=3, **STEPS)
    assert result.run_dir == tmp_path / "run"
    assert len(result.metrics) == 3
    assert 0.0 <= result.final["reward/mean"] <= 1.0
    assert set(calls) == {"sums"} and len(calls) >= 3 * 8 * 4   # every sample it scored
    assert result.checkpoint is not None and result.checkpoint.name.endswith("3")
    assert (result.run_dir / "inputs" / "train.parquet").is_file()


@pytest.mark.parametrize("kind", ["dataset", "pandas"])
def test_a_datasets_dataset_or_a_dataframe_trains_with_an_importable_reward(kind, tmp_path):
    import datasets
    import pandas as pd

    rows = sums()
    data = datasets.Dataset.from_list(rows) if kind == "dataset" else pd.DataFrame(rows)
    result = dagrl.train({"trainer": {"run_dir": str(tmp_path / "run")}},
                         reward_fn=exact_or_partial, train_dataset=data, val_dataset=rows[:8],
                         trainer__val_every=3, **STEPS)
    assert len(result.metrics) == 3
    assert any(key.startswith("val/sums/") for key in result.final)
    assert result.checkpoint.name == "step_00000003"   # the final one (trainer.save_final)
    saved = (result.run_dir / "config.yaml").read_text()
    assert ":exact_or_partial" in saved and "in-process" not in saved   # by import path


def test_a_reward_other_processes_cannot_import_is_refused_with_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="define it in a module file"):
        dagrl.train(reward_fn=lambda *a, **k: 0.0, train_dataset=sums(),
                    trainer__n_workers=2, trainer__run_dir=str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_a_trl_style_batch_reward_is_refused_with_the_signature_dagrl_calls(tmp_path):
    def accuracy(prompts, completions, ground_truth, **kwargs):   # TRL's reward_funcs kind
        return [float(c == g) for c, g in zip(completions, ground_truth, strict=True)]

    with pytest.raises(ConfigError, match=r"takes TRL's batch arguments .* compute_score\("
                                          r"data_source, solution_str, ground_truth"):
        dagrl.train(reward_fn=accuracy, train_dataset=sums(),
                    trainer__run_dir=str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("dataset", "named"), [
    ([], "has no rows"), (["2+3="], "row 0 is a str"), (42, "got int")])
def test_bad_datasets_are_named(dataset, named, tmp_path):
    with pytest.raises(ConfigError, match=named):
        dagrl.train(train_dataset=dataset, trainer__run_dir=str(tmp_path / "run"))
