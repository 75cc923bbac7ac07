"""Bad inputs are refused by `dagrl train` before anything is written: one error line naming
the file, column, row, node or key, no traceback, and no run directory (issue 22, cases 1, 4,
6 and 7; done-when 4)."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dagrl.data.dataset import DatasetError, PromptLoader
from dagrl.data.parquet import ParquetPrompts
from tests.reliability.helpers import (
    SMALL,
    arith_rows,
    assert_one_error_line,
    dagrl_cmd,
    run,
    write_rows,
)


def train(run_dir: Path, *overrides: str):
    return run(dagrl_cmd("train", f"trainer.run_dir={run_dir}", *SMALL, *overrides))


def binary_content(path: Path) -> Path:
    """Case 1: the messages' content column is `binary` (bytes, as some exporters write it)."""
    rows = arith_rows(8)
    for row in rows:
        row["prompt"][0]["content"] = row["prompt"][0]["content"].encode()
    return write_rows(path, rows)


def invalid_utf8(path: Path) -> Path:
    """A `string` column holding bytes that are not UTF-8 (written without validation)."""
    table = pa.Table.from_pylist(arith_rows(8))
    content = pa.array([b"\xff\xfe1+1="] * 8, type=pa.binary()).view(pa.string())
    messages = pa.ListArray.from_arrays(
        pa.array(range(9), pa.int32()),
        pa.StructArray.from_arrays([pa.array(["user"] * 8), content], ["role", "content"]))
    pq.write_table(table.set_column(table.schema.get_field_index("prompt"), "prompt", messages),
                   path)
    return path


def int_ground_truth(path: Path) -> Path:
    """Case 6: reward_model.ground_truth is int64."""
    rows = arith_rows(8)
    for i, row in enumerate(rows):
        row["reward_model"]["ground_truth"] = i + 1
    return write_rows(path, rows)


@pytest.mark.parametrize("make, shown", [
    (binary_content, "column prompt[].content is binary"),
    (invalid_utf8, "column prompt, row 0, holds text that is not valid UTF-8"),
    (int_ground_truth, "column reward_model.ground_truth is int64"),
], ids=["binary-content", "invalid-utf8", "int64-ground-truth"])
def test_bad_data_is_refused_before_the_run_directory_exists(tmp_path, make, shown):
    data = make(tmp_path / "bad.parquet")
    proc = train(tmp_path / "run", f"data.train_files=[{data}]")
    assert proc.returncode == 1
    line = assert_one_error_line(proc, f"error: {data}: {shown}")
    assert proc.stderr.strip() == line            # the whole terminal output: one line
    assert not (tmp_path / "run").exists()        # nothing written, nothing trained


def test_an_overlong_prompt_is_refused_before_the_run_directory_exists(tmp_path, tiny_model_dir):
    """With a model directory the prompts' token lengths are checked with its tokenizer
    before anything is written, like the data's schema (row 900: deep in the file)."""
    rows = arith_rows(1000)
    rows[900]["prompt"][0]["content"] = "1+" * 40 + "1="
    data = write_rows(tmp_path / "long.parquet", rows)
    proc = train(tmp_path / "run", f"data.train_files=[{data}]", f"model.path={tiny_model_dir}",
                 "data.max_prompt_length=16")
    assert proc.returncode == 1
    assert_one_error_line(proc, f"error: {data}: row 900",
                          "more than data.max_prompt_length=16")
    assert not (tmp_path / "run").exists()


def test_a_binary_prompt_beyond_the_checked_rows_is_never_tokenized(tmp_path, tokenizer):
    """The pre-flight reads the first rows only; every batch checks its own prompts too, so a
    prompt of bytes in a row the pre-flight did not read stops the run instead of being
    rendered as "b'...'" and trained on."""
    source = ParquetPrompts([str(write_rows(tmp_path / "ok.parquet", arith_rows(8)))])
    loader = PromptLoader(source, tokenizer, batch_size=4, shuffle=False, max_prompt_length=16)
    row = {"prompt": [{"role": "user", "content": b"1+1="}], "data_source": "arith",
           "reward_model": {"ground_truth": "2"}, "_file": "f.parquet"}
    with pytest.raises(DatasetError, match=re.escape(
            "f.parquet: row 700 (uid e0-r700) has prompt[0].content of raw bytes")):
        loader._build([row], [700], [0], 0)


GRAPHS = {
    "cycle": ("""
        - {id: rollout, role: rollout, deps: [update]}
        - {id: reward, role: reward, deps: [rollout]}
        - {id: update, role: actor_update, deps: [reward]}""",
              "has a cycle: rollout -> reward -> update -> rollout"),
    "unknown-role": ("""
        - {id: rollout, role: rollout}
        - {id: reward, role: rewrd, deps: [rollout]}""",
                     "node 'reward' has an unknown DAG role 'rewrd'"),
    "dangling-dependency": ("""
        - {id: rollout, role: rollout}
        - {id: reward, role: reward, deps: [rolout]}""",
                            "node 'reward' depends on unknown node(s) ['rolout']"),
    "duplicate-ids": ("""
        - {id: rollout, role: rollout}
        - {id: rollout, role: reward}""", "duplicate node id(s) ['rollout']"),
}


def graph_case(tmp_path: Path, case: str) -> tuple[Path, str]:
    graph = tmp_path / "graph.yaml"
    if case == "missing-file":
        return graph, f"dag.graph: no such file '{graph}'"
    nodes, shown = GRAPHS[case]
    graph.write_text("name: g\nnodes:" + textwrap.dedent(nodes) + "\n")
    return graph, shown


@pytest.mark.parametrize("case", ["cycle", "missing-file"])
def test_bad_graph_is_refused_before_the_run_directory_exists(tmp_path, case):
    """Case 4: `dagrl train` reports graph errors like `dagrl plan`, before the model is
    written to the run directory."""
    graph, shown = graph_case(tmp_path, case)
    proc = train(tmp_path / "run", f"dag.graph={graph}")
    assert proc.returncode == 1
    line = assert_one_error_line(proc, shown)
    assert proc.stderr.strip() == line and "GraphError" not in line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("case", ["unknown-role", "dangling-dependency", "duplicate-ids"])
def test_other_graph_errors_through_the_cli_entry_point(tmp_path, capfd, case):
    """The same path as above, run in this process (an interpreter start each costs seconds)."""
    from dagrl.train import main

    graph, shown = graph_case(tmp_path, case)
    assert main([f"trainer.run_dir={tmp_path / 'run'}", *SMALL, f"dag.graph={graph}"]) == 1
    err = capfd.readouterr().err
    assert err.splitlines() == [line for line in err.splitlines() if line.startswith("error:")]
    assert len(err.splitlines()) == 1 and shown in err and "GraphError" not in err
    assert not (tmp_path / "run").exists()


def test_checkpoint_dir_that_is_a_file_is_refused_at_start(tmp_path):
    """Case 7: reported before any work, not at the first save."""
    blocker = tmp_path / "ckpt"
    blocker.write_text("a file")
    proc = train(tmp_path / "run", f"trainer.checkpoint_dir={blocker}", "trainer.save_every=1")
    assert proc.returncode == 1
    assert_one_error_line(proc, f"error: trainer.checkpoint_dir='{blocker}' is a file")
    assert not (tmp_path / "run").exists() and blocker.read_text() == "a file"


def test_reward_function_that_does_not_import_is_refused_at_start(tmp_path):
    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth,\n")
    proc = train(tmp_path / "run", f"reward.custom_fn={reward}:compute_score")
    assert proc.returncode == 1
    assert_one_error_line(proc, f"reward.custom_fn='{reward}:compute_score': cannot be imported",
                          "SyntaxError")
    assert not (tmp_path / "run").exists()


def test_debug_prints_the_traceback(tmp_path, capfd):
    from dagrl.train import main

    data = int_ground_truth(tmp_path / "bad.parquet")
    args = [f"trainer.run_dir={tmp_path / 'run'}", *SMALL, f"data.train_files=[{data}]"]
    assert main(args) == 1
    assert "Traceback" not in capfd.readouterr().err
    assert main(["--debug", *args]) == 1
    err = capfd.readouterr().err
    assert err.startswith("error: ") and "DatasetError" not in err.splitlines()[0]
    assert "Traceback (most recent call last)" in err and "in check_schema_types" in err


def test_a_key_given_twice_on_the_command_line_is_refused(tmp_path):
    proc = train(tmp_path / "run", "actor.lr=1e-3", "actor.lr=1e-6")
    assert proc.returncode == 2   # a config error
    line = assert_one_error_line(proc, "given twice: actor.lr=1e-3, actor.lr=1e-6")
    assert proc.stderr.strip() == line and not (tmp_path / "run").exists()
    # a key inside one given whole is the same ambiguity
    proc = train(tmp_path / "run", "reward={source: rule}", "reward.source=rule")
    assert_one_error_line(proc, "given twice: reward={source: rule}, reward.source=rule")
