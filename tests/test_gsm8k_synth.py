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
    assert len(first_words) >= len(TEMPLATES) - 3


def test_seeded(tmp_path):
    a = make_gsm8k_synth(tmp_path / "a", seed=3, n_train=50, n_test=10)
    b = make_gsm8k_synth(tmp_path / "b", seed=3, n_train=50, n_test=10)
    c = make_gsm8k_synth(tmp_path / "c", seed=4, n_train=50, n_test=10)
    read = lambda p: pq.read_table(p).to_pylist()   # noqa: E731
    assert read(a["train"]) == read(b["train"]) != read(c["train"])


@pytest.mark.parametrize("kwargs, name", [({"n_train": 0}, "n_train"),
                                          ({"max_number": 1}, "max_number"),
                                          ({"seed": -1}, "seed")])
def test_bad_arguments_name_the_argument(tmp_path, kwargs, name):
    with pytest.raises(ValueError, match=name):
        make_gsm8k_synth(tmp_path, **kwargs)
