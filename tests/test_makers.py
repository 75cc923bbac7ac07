from __future__ import annotations

import math
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dagrl.data import parquet_write
from dagrl.data.makers import MAKERS, make_arith

APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def rows(path):
    return pq.read_table(path).to_pylist()


def test_default_files_layout_and_row_groups(tmp_path):
    paths = make_arith(tmp_path)
    assert paths == {"train": tmp_path / "train.parquet", "test": tmp_path / "test.parquet"}
    # Only the two finished files: no temp leftovers.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["test.parquet", "train.parquet"]

    schema = pq.read_schema(paths["train"])
    assert schema.names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    assert schema.field("prompt").type == pa.list_(
        pa.struct([("role", pa.string()), ("content", pa.string())])
    )
    assert schema.field("reward_model").type == pa.struct(
        [("style", pa.string()), ("ground_truth", pa.string())]
    )
    info_type = schema.field("extra_info").type
    assert [info_type.field(i).name for i in range(info_type.num_fields)] == [
        "split", "index", "a", "b", "op",
    ]
    assert info_type.field("index").type == pa.int64()

    # 21 * 21 = 441 problems with the defaults: 41 test, 400 train; 64-row groups.
    train_meta = pq.ParquetFile(paths["train"]).metadata
    assert train_meta.num_rows == 400
    assert train_meta.num_row_groups == math.ceil(400 / 64)
    sizes = [train_meta.row_group(i).num_rows for i in range(train_meta.num_row_groups)]
    assert sizes == [64] * 6 + [16]
    test_meta = pq.ParquetFile(paths["test"]).metadata
    assert test_meta.num_rows == 41 and test_meta.num_row_groups == 1


def test_rows_are_correct_and_splits_disjoint(tmp_path):
    paths = make_arith(tmp_path, ops="+-*", max_operand=4, n_test=10, row_group_size=8)
    seen = []
    for split in ("train", "test"):
        split_rows = rows(paths[split])
        assert [r["extra_info"]["index"] for r in split_rows] == list(range(len(split_rows)))
        n_groups = pq.ParquetFile(paths[split]).metadata.num_row_groups
        assert n_groups == math.ceil(len(split_rows) / 8)
        for r in split_rows:
            info = r["extra_info"]
            a, b, op = info["a"], info["b"], info["op"]
            assert info["split"] == split
            assert r["data_source"] == "arith" and r["ability"] == "arith"
            assert r["prompt"] == [{"role": "user", "content": f"{a}{op}{b}="}]
            assert r["reward_model"] == {"style": "rule", "ground_truth": str(APPLY[op](a, b))}
            # Everything the model sees must be inside the character tokenizer's vocabulary.
            assert re.fullmatch(r"[0-9a-z+\-*=:?. ]+", r["prompt"][0]["content"])
            seen.append((split, a, op, b))
    assert sum(s == "test" for s, *_ in seen) == 10
    problems = [tuple(p) for _, *p in seen]
    assert len(set(problems)) == len(problems) == 3 * 5 * 5  # disjoint, nothing missing
    assert set(problems) == {(a, op, b) for op in "+-*" for a in range(5) for b in range(5)}
    assert any(r["reward_model"]["ground_truth"].startswith("-") for r in rows(paths["train"]))


def test_deterministic_for_a_seed(tmp_path):
    first = make_arith(tmp_path / "a", seed=3)
    again = make_arith(tmp_path / "b", seed=3)
    other = make_arith(tmp_path / "c", seed=4)
    for split in ("train", "test"):
        assert pq.read_table(first[split]).equals(pq.read_table(again[split]))
        assert not pq.read_table(first[split]).equals(pq.read_table(other[split]))


def test_makers_registry():
    assert MAKERS["arith"] is make_arith


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"ops": "/"}, "ops"),
        ({"ops": ""}, "ops"),
        ({"ops": "++"}, "ops"),
        ({"n_test": 441}, "n_test"),  # 21 * 21 problems: no train row would be left
        ({"n_test": -1}, "n_test"),
        ({"max_operand": -1}, "max_operand"),
        ({"row_group_size": 0}, "row_group_size"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_invalid_arguments_name_the_argument(tmp_path, kwargs, name):
    with pytest.raises(ValueError, match=name):
        make_arith(tmp_path, **kwargs)
    assert not any(tmp_path.iterdir())


def test_largest_valid_n_test_leaves_one_train_row(tmp_path):
    paths = make_arith(tmp_path, max_operand=1, n_test=3)
    assert len(rows(paths["train"])) == 1 and len(rows(paths["test"])) == 3


def test_interrupted_write_keeps_old_file_and_leaves_no_temp(tmp_path, monkeypatch):
    make_arith(tmp_path)
    before = (tmp_path / "train.parquet").read_bytes()

    def half_write(table, where, **kwargs):
        with open(where, "wb") as f:
            f.write(b"PAR1 half")
        raise RuntimeError("disk full")

    monkeypatch.setattr(parquet_write.pq, "write_table", half_write)
    with pytest.raises(RuntimeError, match="disk full"):
        make_arith(tmp_path, seed=9)
    assert (tmp_path / "train.parquet").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["test.parquet", "train.parquet"]
