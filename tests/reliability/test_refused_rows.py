"""Rows a step would fail on, refused before anything is written (issue 38): a null where a step
reads text, anywhere in the file (not only in the pre-flight's first rows); a chat role the
model's template does not know; a template that raises on a row. One error line naming file,
row and column; no traceback; no run directory."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dagrl.data.checks import check_nulls
from dagrl.data.errors import DatasetError
from tests.reliability.helpers import SMALL, arith_rows, assert_one_error_line, dagrl_cmd, run

SCHEMA = pa.schema([
    ("data_source", pa.string()),
    ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
    ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
    ("extra_info", pa.struct([("index", pa.int64())])),
])


def write(path: Path, rows: list[dict], row_group_size: int = 500) -> Path:
    pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), path, row_group_size=row_group_size)
    return path


def train(tmp_path: Path, data: Path, *overrides: str):
    return run(dagrl_cmd("train", f"trainer.run_dir={tmp_path / 'run'}", *SMALL,
                         f"data.train_files=[{data}]", *overrides))


def test_a_null_ground_truth_past_the_preflight_sample_is_refused_at_start(tmp_path):
    rows = arith_rows(2000)
    rows[1500]["reward_model"]["ground_truth"] = None
    data = write(tmp_path / "late-null.parquet", rows)
    proc = train(tmp_path, data)
    assert proc.returncode == 1
    line = assert_one_error_line(proc, f"{data}: row 1500 has reward_model.ground_truth null")
    assert proc.stderr.strip() == line and not (tmp_path / "run").exists()


def test_the_null_check_reads_only_row_groups_whose_statistics_allow_a_null(tmp_path):
    rows = arith_rows(2000)
    rows[1999]["data_source"] = None
    pf = pq.ParquetFile(write(tmp_path / "d.parquet", rows))
    read = []
    original = pf.read_row_group
    pf.read_row_group = lambda i, **kw: read.append(i) or original(i, **kw)
    with pytest.raises(DatasetError, match="row 2099 has data_source null"):
        check_nulls("d.parquet", pf, 100, "prompt", text_ground_truth=True)   # first row 100
    assert read == [3]                       # the 3 clean row groups were never read


def test_a_role_the_template_does_not_know_is_refused(tmp_path, tiny_model_dir):
    # The tiny models' template renders any role: "human" would be trained on silently.
    rows = arith_rows(8)
    rows[5]["prompt"] = [{"role": "human", "content": "1+1="}]
    data = write(tmp_path / "human.parquet", rows)
    proc = train(tmp_path, data, f"model.path={tiny_model_dir}")
    assert proc.returncode == 1
    assert_one_error_line(proc, f"{data}: row 5", "prompt[0].role 'human'",
                          "the model's chat template does not name it")
    assert not (tmp_path / "run").exists()


def test_a_template_that_raises_is_a_data_error_naming_the_row(tmp_path, tiny_model_dir):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] != 'user' %}"
        "{{ raise_exception('only user turns, got ' + m['role']) }}{% endif %}"
        "{{ m['content'] }}{% endfor %}")
    rows = arith_rows(8)
    rows[3]["prompt"] = [{"role": "system", "content": "be brief"}, rows[3]["prompt"][0]]
    data = write(tmp_path / "system.parquet", rows)
    proc = train(tmp_path, data, f"model.path={model}")
    assert proc.returncode == 1
    line = assert_one_error_line(proc, f"{data}: row 3", "chat template refused this prompt",
                                 "only user turns, got system")
    assert proc.stderr.strip() == line and not (tmp_path / "run").exists()


def test_a_reward_function_that_returns_a_string_is_refused_before_any_model_loads(tmp_path):
    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, "
                      "extra_info=None):\n    return f'{float(solution_str == ground_truth)}'\n")
    data = write(tmp_path / "d.parquet", arith_rows(8))
    proc = train(tmp_path, data, f"reward.custom_fn={reward}:compute_score")
    assert proc.returncode == 1
    line = assert_one_error_line(proc, f"reward.custom_fn='{reward}:compute_score'",
                                 f"{data}: row 0", "returned str '1.0', expected a finite number")
    assert proc.stderr.strip() == line and not (tmp_path / "run").exists()


def test_an_overlong_prompt_with_the_builtin_model_is_refused_before_the_run_dir(tmp_path):
    rows = arith_rows(1000)
    rows[900]["prompt"][0]["content"] = "1+" * 40 + "1="
    data = write(tmp_path / "long.parquet", rows)
    proc = train(tmp_path, data, "model.path=builtin:tiny-qwen2", "data.max_prompt_length=16")
    assert proc.returncode == 1
    assert_one_error_line(proc, f"{data}: row 900", "more than data.max_prompt_length=16")
    assert not (tmp_path / "run").exists()
