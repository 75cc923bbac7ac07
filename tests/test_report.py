"""Loggers and the run report on one short real run: TensorBoard events and an offline wandb
run are written and read back, MLflow's file store when mlflow is installed; `dagrl report`
writes a self-contained HTML page with every plot, which headless Chromium renders."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import struct
import subprocess
import sys
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path

import pytest

from dagrl.config.loader import load_config
from dagrl.config.schema import Config, LoggingConfig
from dagrl.runtime.launch import launch

HAS_MLFLOW = importlib.util.find_spec("mlflow") is not None
STEPS = 3
PLOT_IDS = ["reward", "kl", "entropy", "response_length", "node_time", "throughput", "memory"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, monkeypatch_module):
    # wandb must never reach for the network or a login, whatever the machine has configured.
    for key, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true",
                       "WANDB_DISABLE_GIT": "true", "WANDB_API_KEY": ""}.items():
        monkeypatch_module.setenv(key, value)
    backends = ["console", "jsonl", "tensorboard", "wandb"] + (["mlflow"] if HAS_MLFLOW else [])
    run_dir = tmp_path_factory.mktemp("report") / "run"
    cfg = load_config(Config, None, [
        f"trainer.run_dir={run_dir}", f"trainer.total_steps={STEPS}", "trainer.torch_threads=1",
        "data.train_batch_size=8", "actor.mini_batch_size=8", "rollout.n=4",
        "logging.progress_bar=false", "logging.console_every=1000",
        f"logging.backends=[{','.join(backends)}]", "profiler.enable=true", "profiler.steps=[2]"])
    launch(cfg)
    return run_dir


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_tensorboard_events_read_back(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert len(files) == 1
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    for tag in ("reward/mean", "timing/rollout_s", "timing/rollout_spread_s",
                "throughput/tokens_per_s", "memory/host_peak_gb"):
        assert tag in tags, tag
    jsonl = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    events = acc.Scalars("reward/mean")
    assert [e.step for e in events] == list(range(1, STEPS + 1))
    assert [e.value for e in events] == pytest.approx([r["reward/mean"] for r in jsonl])


def read_wandb_records(path: Path):
    """Records of a .wandb file: a 7-byte header (':W&B', magic, version), then a LevelDB-style
    log of 32 KiB blocks, each record chunk with a 7-byte header (crc32, length, type)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:                     # block trailer too short for a header: padding
            pos += left
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):               # FULL or LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def test_offline_wandb_run_read_back(run_dir):
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    files = list(runs[0].glob("run-*.wandb"))
    assert len(files) == 1
    records = read_wandb_records(files[0])
    history = [{item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in r.history.item} for r in records if r.HasField("history")]
    rewards = [h["reward/mean"] for h in history if "reward/mean" in h]
    jsonl = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rewards == pytest.approx([r["reward/mean"] for r in jsonl])
    run = next(r.run for r in records if r.HasField("run"))
    assert run.project == "dagrl" and run.display_name == "run"
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["trainer"]["total_steps"] == STEPS and config["profiler"]["enable"] is True


@pytest.mark.skipif(not HAS_MLFLOW, reason="mlflow is not installed (pip install 'dagrl[mlflow]')")
def test_mlflow_file_store_read_back(run_dir):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name("dagrl")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    assert run.data.params["trainer.total_steps"] == str(STEPS)
    history = client.get_metric_history(run.info.run_id, "reward/mean")
    assert [m.step for m in history] == list(range(1, STEPS + 1))


def test_missing_extra_names_it(tmp_path, monkeypatch):
    from dagrl.observe.backends import MissingExtraError
    from dagrl.observe.loggers import RunLogger

    for module, extra in (("wandb", "wandb"), ("tensorboard", "tensorboard"),
                          ("mlflow", "mlflow")):
        monkeypatch.setitem(sys.modules, module, None)      # import now raises ImportError
        with pytest.raises(MissingExtraError, match=rf"pip install 'dagrl\[{extra}\]'"):
            RunLogger(LoggingConfig(backends=["jsonl", extra], progress_bar=False), tmp_path, 1)


class _Sections(HTMLParser):
    """The ids of `div.plot` sections and the images inside each."""

    def __init__(self):
        super().__init__()
        self.plots: dict[str, list[str]] = {}
        self.current = None
        self.svgs = 0

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "div" and attrs.get("class") == "plot":
            self.current = attrs["id"].removeprefix("plot-")
            self.plots[self.current] = []
        elif tag == "img" and self.current:
            self.plots[self.current].append(attrs.get("src", ""))
        elif tag == "svg":
            self.svgs += 1


def test_report_has_every_plot_the_dag_config_and_trace(run_dir):
    from dagrl.cli import main

    assert main(["report", str(run_dir)]) == 0
    html = (run_dir / "report.html").read_text()
    parser = _Sections()
    parser.feed(html)
    for pid in PLOT_IDS:
        (src,) = parser.plots[pid]
        assert src.startswith("data:image/png;base64,") and len(src) > 2000, pid
    assert parser.plots["validation"] == []             # this run did not validate
    # one worker: no straggler panel of zeros, a line saying why
    assert parser.plots["straggler"] == [] and "0 at every step (one rank" in html
    assert "tiny_hidden_size" not in html               # the built-in model is already written
    # self-contained: no outside resources, the DAG as inline SVG naming every node
    assert not re.search(r"""(src|href)=['"](?!data:|https://ui.perfetto.dev)""", html)
    assert parser.svgs == 1 and all(f'data-node="{n}"' in html for n in
                                    ("rollout", "reward", "advantage", "actor_update"))
    assert "node:actor_update" in html and "Top time consumers" in html      # from the trace
    assert "total_steps: 3" in html                                         # resolved config


def test_plan_draws_dot_and_svg(tmp_path, capsys):
    from dagrl.cli import main

    assert main(["plan", "trainer.n_workers=2", "--format", "dot"]) == 0
    dot = capsys.readouterr().out
    assert dot.startswith('digraph "grpo"') and '"n:advantage" -> "n:actor_update";' in dot
    assert "cluster_rank1" in dot
    out = tmp_path / "plan.svg"
    assert main(["plan", "trainer.n_workers=2", "--format", "svg", "--out", str(out)]) == 0
    root = ET.fromstring(out.read_text())               # well-formed XML
    texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert "rank 1" in texts and "actor_update" in texts
    assert {"training node", "model forward / generation", "reshard"} <= set(texts)   # legend


@pytest.mark.skipif(shutil.which("chromium") is None, reason="no chromium to render with")
def test_report_renders_in_headless_chromium(run_dir, tmp_path):
    from dagrl.observe.report import write_report
    from dagrl.roles.plan import plan_for

    html, _ = write_report(run_dir, tmp_path / "report.html", plan_for)
    png = tmp_path / "report.png"
    cmd = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
           "--no-first-run", "--disable-background-networking", "--disable-component-update",
           "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={png}",
           "--window-size=1400,3000", html.as_uri()]
    subprocess.run(cmd, capture_output=True, timeout=120, check=False)
    assert png.exists()
    from matplotlib.image import imread

    pixels = imread(png)
    assert pixels.shape[:2] == (3000, 1400)
    # Not a blank page: plots fill a good share of it with non-white pixels.
    assert (pixels[..., :3].mean(-1) < 0.9).mean() > 0.05


def test_report_plots_validation_scores_and_survives_a_bare_run_dir(tmp_path):
    from dagrl.observe.report import render_report

    rows = [{"step": 0, "val/arith/score": 0.1, "val/samples": 64, "timing/validation_s": 1.0}]
    rows += [{"step": s, "reward/mean": 0.1 * s, "timing/step_s": 1.0, "timing/rollout_s": 0.6,
              "timing/actor_update_s": 0.3, "val/arith/score": 0.1 + 0.1 * s,
              "reward/acc": 0.2 * s, "reward/errors": 0.0} for s in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    parser = _Sections()
    html = render_report(tmp_path)              # no config.resolved.yaml: no DAG picture
    parser.feed(html)
    assert len(parser.plots["validation"]) == 1 and len(parser.plots["node_time"]) == 1
    assert parser.plots["kl"] == [] and "could not be drawn" in html
    # a custom scorer's extra key gets a plot; the distribution and error count do not
    from dagrl.observe.report import reward_component_keys

    assert reward_component_keys(rows) == ["reward/acc"]
    assert len(parser.plots["reward_components"]) == 1
    assert str(tmp_path) not in html            # no absolute path of the writer's machine
    # validation time counted: the step-0 validation took 1 of the 3 s
    assert "<b>time validating</b> 1 s (33% of the steps + validation)" in html
    from dagrl.observe.report import _node_times

    labels = [t.get_text() for t in _node_times(rows, None).axes[0].get_legend().get_texts()]
    assert "validation" in labels


def test_the_step_line_shows_every_policy_and_the_tool_failures(capsys):
    from dagrl.observe.loggers import ConsoleLogger

    console = ConsoleLogger(total_steps=2, start_step=0, every=1, progress_bar=False)
    console.log(1, {"reward/mean": 0.25, "refiner/reward/mean": 0.5, "tools/errors": 3.0,
                    "val/refiner/reward/mean": 0.1})
    line = capsys.readouterr().out.strip()
    assert line == "step 1: reward=0.25  tool_err=3  refiner:reward=0.5"


def test_the_driver_draws_the_console_from_the_metrics_file(tmp_path, capsys):
    """Under Ray the driver shows the lead worker's steps from metrics.jsonl: only what is
    appended after it starts (a resumed run's earlier lines are not shown again), a line cut
    mid-write waits for its end, a damaged line is skipped."""
    from dagrl.observe.loggers import MetricsFileConsole

    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1, "reward/mean": 0.1}) + "\n")   # before the resume
    console = MetricsFileConsole(path, LoggingConfig(console_every=1, progress_bar=False), 4)
    with path.open("a") as f:
        f.write(json.dumps({"step": 2, "reward/mean": 0.25}) + "\n" + '{"step": 3, "rew')
    console.poll()
    assert capsys.readouterr().out == "step 2: reward=0.25\n"
    with path.open("a") as f:
        f.write('ard/mean": 0.5}\nnot json\n' + json.dumps({"step": 4, "reward/mean": 1}) + "\n")
    console.close()
    assert capsys.readouterr().out == "step 3: reward=0.5\nstep 4: reward=1\n"


def test_the_driver_prints_the_lines_the_workers_wrote(tmp_path, capsys):
    """The workers' standard output goes to a file the driver prints from, line by line (a line
    cut mid-write waits for its end), before the steps logged in the same interval."""
    from dagrl.observe.loggers import MetricsFileConsole

    path, messages = tmp_path / "metrics.jsonl", tmp_path / "console.log"
    messages.write_text("")
    console = MetricsFileConsole(path, LoggingConfig(console_every=1, progress_bar=False), 2,
                                 messages=messages)
    messages.write_text("[dagrl] pre-flight: train prompts ok\n[dagrl] memo")
    path.write_text(json.dumps({"step": 1, "reward/mean": 0.5}) + "\n")
    console.poll()
    assert capsys.readouterr().out == "[dagrl] pre-flight: train prompts ok\nstep 1: reward=0.5\n"
    with messages.open("a") as f:
        f.write("ry: estimated peak 1 GiB\n")
    console.close()
    assert capsys.readouterr().out == "[dagrl] memory: estimated peak 1 GiB\n"
