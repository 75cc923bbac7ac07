"""`gsm8k-synth`: verl's GSM8K layout, correct worked answers, disjoint seeded splits."""

from __future__ import annotations

import re
from collections import Counter

import pyarrow.parquet as pq
import pytest

from dagrl.data.gsm8k_synth import INSTRUCTION, TEMPLATES, make_gsm8k_synth
from dagrl.data.makers import MAKERS
from dagrl.rewards.scorers import gsm8k_score

STEP = re.compile(r"<<([0-9+\-*/]+)=([0-9]+)>>")


def test_layout_is_verls_gsm8k_and_every_worked_answer_is_right(tmp_path):
    paths = MAKERS["gsm8k-synth"](tmp_path, seed=0)
    train, test = (pq.read_table(paths[s]).to_pylist() for s in ("train", "test"))
    assert (len(train), len(test)) == (4096, 256)
    assert pq.read_schema(paths["train"]).names == ["data_source", "prompt", "ability",
                                                    "reward_model", "extra_info"]
    for row in train + test:
        assert row["data_source"] == "openai/gsm8k" and row["ability"] == "math"
        [message] = row["prompt"]
        assert message["role"] == "user" and message["content"].endswith(INSTRUCTION)
        info, truth = row["extra_info"], row["reward_model"]["ground_truth"]
        assert message["content"] == info["question"] + INSTRUCTION
        # Each <<expression=value>> note evaluates exactly; the last value is the answer.
        steps = STEP.findall(info["answer"])
        assert len(steps) >= 2
        for expression, value in steps:
            assert eval(expression) == int(value), (expression, info["question"])  # noqa: S307
        assert steps[-1][1] == truth and int(truth) >= 0
        assert gsm8k_score(info["answer"], truth) == 1.0     # verl's strict scorer accepts it
    assert not {r["extra_info"]["question"] for r in train} & {r["extra_info"]["question"]
                                                             for r in test}
    # Every template is used, none dominates.
    first_words = Counter(r["extra_info"]["answer"].split("\n")[0].split(" ")[1] for r in train)
    assert len(first_words) >= sum(n >= 2 for n, _ in TEMPLATES) - 3


@pytest.mark.parametrize("steps, counts", [("1", {1}), ("2,3", {2, 3}), ("1,2,3", {1, 2, 3})])
def test_steps_picks_the_problems_levels(tmp_path, steps, counts):
    paths = make_gsm8k_synth(tmp_path, n_train=300, n_test=20, steps=steps,
                             instruction=" Answer with the number only.")
    rows = pq.read_table(paths["train"]).to_pylist() + pq.read_table(paths["test"]).to_pylist()
    seen = set()
    for row in rows:
        notes = STEP.findall(row["extra_info"]["answer"])
        seen.add(len(notes))
        for expression, value in notes:
            assert eval(expression) == int(value)  # noqa: S307
        assert notes[-1][1] == row["reward_model"]["ground_truth"]
        assert row["prompt"][0]["content"] == (row["extra_info"]["question"]
                                               + " Answer with the number only.")
    assert seen == counts


def test_the_default_level_is_unchanged_by_the_new_levels(tmp_path):
    # steps="2,3" draws from the same templates in the same order as before one-step ones
    # existed: a seed keeps giving the same problems.
    paths = make_gsm8k_synth(tmp_path, n_train=4, n_test=1)
    [first] = pq.read_table(paths["test"]).to_pylist()
    assert first["extra_info"]["question"].startswith("Zoe bakes 5 trays of 3 cookies.")


def test_seeded(tmp_path):
    a = make_gsm8k_synth(tmp_path / "a", seed=3, n_train=50, n_test=10)
    b = make_gsm8k_synth(tmp_path / "b", seed=3, n_train=50, n_test=10)
    c = make_gsm8k_synth(tmp_path / "c", seed=4, n_train=50, n_test=10)
    read = lambda p: pq.read_table(p).to_pylist()   # noqa: E731
    assert read(a["train"]) == read(b["train"]) != read(c["train"])


@pytest.mark.parametrize("kwargs, name", [({"n_train": 0}, "n_train"),
                                          ({"max_number": 1}, "max_number"),
                                          ({"seed": -1}, "seed"),
                                          ({"steps": "4"}, "steps='4'"),
                                          ({"steps": "1,x"}, "steps='1,x'"),
                                          ({"steps": ""}, "steps=''")])
def test_bad_arguments_name_the_argument(tmp_path, kwargs, name):
    with pytest.raises(ValueError, match=name):
        make_gsm8k_synth(tmp_path, **kwargs)


def test_data_make_takes_the_makers_options(tmp_path, capsys):
    from dagrl.cli import data_main

    assert data_main(["make", "gsm8k-synth", "--out", str(tmp_path), "n_train=8", "n_test=2",
                      "steps=1", "instruction= Answer with the number only."]) == 0
    rows = pq.read_table(tmp_path / "train.parquet").to_pylist()
    assert len(rows) == 8
    assert all(r["prompt"][0]["content"].endswith(" Answer with the number only.") for r in rows)
    assert all(len(STEP.findall(r["extra_info"]["answer"])) == 1 for r in rows)
    assert data_main(["make", "gsm8k-synth", "--out", str(tmp_path), "n_train=eight"]) == 2
    assert "n_train='eight' is not int" in capsys.readouterr().err
    assert data_main(["make", "gsm8k-synth", "--out", str(tmp_path), "stepz=1"]) == 2
    assert "'stepz=1': give options as key=value with key one of" in capsys.readouterr().err
