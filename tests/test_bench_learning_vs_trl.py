"""`dagrl bench learning --vs trl --quick`: both sides really train (dagrl's `dagrl train`, TRL's
GRPOTrainer in its venv) on the tiny model, one evaluator scores the initial model and every
checkpoint, and an interrupted run resumes from each side's newest checkpoint. No timing
asserts: the figures are for the bench's reader."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from benchmarks import learning
from benchmarks.learning_eval import saved_steps
from benchmarks.learning_report import next_chase_step, paired_interval, print_report
from benchmarks.learning_vs_trl import WORKLOADS, Progress, ours_args, trl_args
from dagrl.runtime.checkpoint import list_checkpoints


def test_quick_run_compares_both_sides_and_resumes_each_from_its_checkpoint(tmp_path, capsys):
    out, plot, figures = tmp_path / "run", tmp_path / "curves.svg", tmp_path / "figures.json"
    base = ["--vs", "trl", "--quick", "--out", str(out), "--plot", str(plot),
            "--json", str(figures)]
    args = [*base, "--max-steps", "4"]    # the chase past step 4 is tested at the end
    assert learning.main(args) == 0
    printed = capsys.readouterr().out
    assert "| step | dagrl held-out |" in printed and "TRL held-out" in printed
    assert "peak RSS dagrl / TRL" in printed
    result = json.loads(figures.read_text())
    assert set(result["evaluations"]) == {"initial", "ours/2", "ours/4", "trl/2", "trl/4"}
    for side in ("ours", "trl"):
        assert [step for step, _, _ in result[side]["accuracy"]] == [0, 2, 4]
        assert all(0 <= acc <= 1 for _, _, acc in result[side]["accuracy"])
        assert sorted(map(int, result[side]["reward"])) == [1, 2, 3, 4]
        assert result[side]["peak_rss_gb"] > 0.1
    # The initial model is scored once and is the first point of both curves.
    assert result["ours"]["accuracy"][0] == result["trl"]["accuracy"][0]
    # Each held-out problem's score is kept, so the gap gets its paired interval.
    held_out = pq.ParquetFile(out / "data" / "test.parquet").metadata.num_rows
    for record in result["evaluations"].values():
        assert len(record["scores"]) == held_out
        assert sum(record["scores"]) / held_out == pytest.approx(record["accuracy"])
    assert set(result["comparison"]["accuracy_gap_interval"]) == {"2", "4"}
    assert "(±: the 95% interval of the gap over the held-out problems, paired" in printed
    assert plot.read_text().lstrip().startswith(("<?xml", "<svg"))

    # An interruption after step 2 on both sides: the step-4 checkpoints never completed.
    shutil.rmtree(dict(list_checkpoints(out / "ours" / "run" / "checkpoints"))[4])
    shutil.rmtree(out / "ours" / "hf" / "step_4")
    shutil.rmtree(out / "trl" / "checkpoints" / "checkpoint-4")
    evaluations = json.loads((out / "evaluations.json").read_text())
    del evaluations["ours/4"], evaluations["trl/4"]
    (out / "evaluations.json").write_text(json.dumps(evaluations))
    before = {side: Progress(out / side / "progress.json").clock[2] for side in ("ours", "trl")}

    assert learning.main(args) == 0
    printed = capsys.readouterr().out
    assert "ours: training steps 3..4" in printed and "trl: training steps 3..4" in printed
    assert "evaluating 2 model(s) on the held-out set: ours/4, trl/4" in printed
    for side in ("ours", "trl"):
        progress = Progress(out / side / "progress.json")
        assert [seg["from_step"] for seg in progress.segments] == [0, 2]
        assert progress.clock[2] == before[side]          # kept: its checkpoint survived
        assert progress.clock[4] > progress.clock[2]      # the resumed segment counts from it
        assert saved_steps(side, out / side) == [2, 4]

    # A finished run is not trained again; another workload in the same --out is refused.
    assert learning.main(args) == 0
    assert "ours: trained to step 4 already" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="holds a run of another workload"):
        learning.main([*args, "--steps", "6"])

    # dagrl below TRL's last accuracy inside half of TRL's clock (TRL's record edited: step 4 at
    # accuracy 1.0 after 1000 min): dagrl trains on from its step-4 checkpoint, one block of
    # --every steps, which is evaluated, then stops at --max-steps.
    evaluations = json.loads((out / "evaluations.json").read_text())
    evaluations["trl/4"]["accuracy"] = 1.0
    (out / "evaluations.json").write_text(json.dumps(evaluations))
    trl = Progress(out / "trl" / "progress.json")
    trl.clock[4] = 60_000.0
    trl.save()
    assert learning.main([*base, "--max-steps", "6"]) == 0
    printed = capsys.readouterr().out
    assert "below TRL's step-4 (1.000)" in printed and "dagrl trains on to step 6" in printed
    assert "ours: training steps 5..6" in printed and "trl: trained to step 4 already" in printed
    assert "evaluating 1 model(s) on the held-out set: ours/6" in printed
    assert "dagrl past step 4: step 8 would pass --max-steps 6" in printed
    assert "dagrl: 4 of 4 steps, then on to step 6;" in printed
    assert "dagrl does not reach TRL's step-4 accuracy (1.000)" in printed
    result = json.loads(figures.read_text())
    assert [step for step, _, _ in result["ours"]["accuracy"]] == [0, 2, 4, 6]
    assert [step for step, _, _ in result["trl"]["accuracy"]] == [0, 2, 4]
    progress = Progress(out / "ours" / "progress.json")
    assert [seg["from_step"] for seg in progress.segments] == [0, 2, 4]
    # (two steps whose records land within one 0.2 s look of the watcher share a time)
    assert progress.clock[6] >= progress.clock[5] > progress.clock[4]
    assert saved_steps("ours", out / "ours") == [2, 4, 6]


def test_a_side_part_way_gets_no_memory_verdict(tmp_path, capsys):
    """TRL stopped at its model load (peak 1.7 GiB, no step): the report says how far each side
    got and gives the peak RSS ratio only once both have run every step."""
    work = WORKLOADS["tiny"]      # 4 steps, evaluated every 2
    ours, trl = Progress(tmp_path / "ours.json"), Progress(tmp_path / "trl.json")
    for step in range(1, 5):
        ours.step(step, 10.0 * step, 0.5)
    ours.peak_rss_gb, trl.peak_rss_gb = 4.7, 1.7
    ours.segments = trl.segments = [{"from_step": 0, "load_before": 1.0, "load_after": 2.0}]
    evaluations = {"initial": {"accuracy": 0.2}, "ours/2": {"accuracy": 0.4},
                   "ours/4": {"accuracy": 0.6}}
    result = print_report(work, {"ours": ours, "trl": trl}, evaluations)
    printed = capsys.readouterr().out
    assert "dagrl: 4 of 4 steps" in printed and "TRL: 0 of 4 steps" in printed
    assert "peak RSS compared when both sides have run all 4 steps (dagrl at step 4, TRL at " \
           "step 0)" in printed
    assert "peak RSS dagrl / TRL" not in printed and "peak_rss_ratio" not in result["comparison"]

    for step in range(1, 5):      # TRL's side finished: now the ratio and its verdict
        trl.step(step, 20.0 * step, 0.4)
    trl.peak_rss_gb = 9.4
    evaluations.update({"trl/2": {"accuracy": 0.3}, "trl/4": {"accuracy": 0.5}})
    result = print_report(work, {"ours": ours, "trl": trl}, evaluations)
    printed = capsys.readouterr().out
    assert "peak RSS dagrl / TRL = 0.50x (target <= 0.6x: met)" in printed
    assert result["comparison"]["peak_rss_ratio"] == pytest.approx(4.7 / 9.4)
    assert "dagrl reaches TRL's step-4 accuracy (0.500) at step 4, after 0.7 min = 0.50x TRL's " \
           "1.3 min (target <= 0.5x: met)" in printed


def test_dagrl_trains_on_only_while_the_time_to_trls_accuracy_is_open(tmp_path):
    """The chase's decision: on while below TRL's last accuracy, under 0.5x TRL's clock and
    --max-steps; each stop names its reason."""
    work = WORKLOADS["tiny"]      # 4 steps, evaluated every 2
    ours, trl = Progress(tmp_path / "ours.json"), Progress(tmp_path / "trl.json")
    for step in range(1, 5):
        ours.step(step, 10.0 * step, 0.5)
        trl.step(step, 30.0 * step, 0.5)
    evaluations = {"initial": {"accuracy": 0.2}, "ours/2": {"accuracy": 0.4},
                   "ours/4": {"accuracy": 0.5}, "trl/2": {"accuracy": 0.3},
                   "trl/4": {"accuracy": 0.6}}
    progress = {"ours": ours, "trl": trl}

    def decide(max_steps: int = 16) -> tuple:
        return next_chase_step(work, max_steps, progress, evaluations)

    step, why = decide()          # 0.5 < 0.6 after 40 s of TRL's 120: on, one block
    assert step == 6 and "below TRL's step-4 (0.600) after 0.7 of TRL's 2.0 min" in why
    assert decide(max_steps=5) == (None, "step 6 would pass --max-steps 5 (dagrl below TRL's "
                                         "step-4 accuracy, 0.600, up to step 4)")
    ours.step(6, 60.0, 0.5)       # step 6 at 60 s = 0.5x TRL's 120 s: the bound is reached
    evaluations["ours/6"] = {"accuracy": 0.55}
    step, why = decide()
    assert step is None and "past 0.5x TRL's 2.0 min" in why
    ours.clock[6] = 50.0          # ... or, inside it, the accuracy reached: no more steps
    evaluations["ours/6"] = {"accuracy": 0.6}
    assert decide() == (None, "dagrl has reached TRL's step-4 accuracy (0.600)")
    del evaluations["trl/4"]      # TRL's last checkpoint not evaluated: nothing to chase yet
    assert decide() == (None, "TRL has no evaluated step-4 checkpoint yet")


@pytest.mark.slow   # kill and recover, three bench processes (~70 s): with the slow runs
def test_a_side_stopped_by_sigterm_records_its_segment_and_resumes(tmp_path):
    """`kill` of a long bench: the running side stops with the bench (its time and peak RSS so
    far recorded); run again, it goes on from its newest checkpoint."""
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "dagrl.cli", "bench", "learning", "--vs", "trl", "--quick",
           "--sides", "ours", "--steps", "12", "--every", "4", "--out", str(out)]
    bench = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    progress = out / "ours" / "progress.json"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not (
            progress.is_file() and len(json.loads(progress.read_text())["clock"]) >= 5):
        time.sleep(0.2)
    os.kill(bench.pid, signal.SIGTERM)
    printed, _ = bench.communicate(timeout=60)
    assert bench.returncode != 0 and "stopped (the side's peak RSS so far" in printed, printed
    stopped = Progress(progress)
    assert stopped.segments[-1]["interrupted"] and stopped.segments[-1]["peak_rss_gb"] > 0.1
    saved = saved_steps("ours", out / "ours")
    assert saved[-1] in (4, 8)

    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert f"ours: training steps {saved[-1] + 1}..12" in rerun.stdout
    done = Progress(progress)
    assert [seg["from_step"] for seg in done.segments] == [0, saved[-1]]
    assert sorted(done.clock) == list(range(1, 13))

    # Stopped while it scores the checkpoints: the evaluator's process stops with the bench.
    (out / "evaluations.json").unlink()
    spec = out / "evaluate.spec.json"
    spec.unlink()
    bench = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)

    def evaluator() -> str:
        return subprocess.run(["pgrep", "-f", str(spec)], capture_output=True, text=True).stdout

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not evaluator():
        time.sleep(0.2)
    os.kill(bench.pid, signal.SIGTERM)
    printed, _ = bench.communicate(timeout=60)
    assert "evaluation: stopped" in printed, printed
    time.sleep(1)
    assert evaluator() == ""


def test_the_seed_reaches_both_sides():
    # --seed: another draw of both curves (sampling and data order), the same on both sides.
    work = dataclasses.replace(WORKLOADS["tiny"], seed=3)
    ours = ours_args(work, Path("model"), Path("train.parquet"), Path("run"))
    theirs = trl_args(work, Path("model"), Path("train.parquet"), Path("trl"))
    assert "trainer.seed=3" in ours and theirs[theirs.index("--seed") + 1] == "3"


def test_the_gap_between_two_checkpoints_is_paired_over_the_same_problems():
    # d = (1, 0, 0, -1): std sqrt(2/3), over sqrt(4) problems.
    assert paired_interval([1, 1, 0, 0], [0, 1, 0, 1]) == pytest.approx(
        1.96 * (2 / 3) ** 0.5 / 2)
    # The same answers on every problem: no noise in the gap at all.
    assert paired_interval([1, 0, 1], [1, 0, 1]) == 0
    # Recorded before per-problem scores were kept, or on different problems: no interval.
    assert paired_interval(None, [1, 0]) is None and paired_interval([1, 0], [1, 0, 1]) is None


def _run_json(path: Path, seed: int, sides: dict, **workload) -> Path:
    """A --json result as the bench writes it: {side: {"accuracy": [[step, seconds, acc]],
    "peak_rss_gb"}}."""
    work = {**dataclasses.asdict(dataclasses.replace(WORKLOADS["tiny"], seed=seed)), **workload}
    path.write_text(json.dumps({"workload": work, **{
        side: {"accuracy": curve, "peak_rss_gb": peak} for side, (curve, peak) in sides.items()}}))
    return path


def test_runs_of_several_seeds_are_read_together(tmp_path, capsys):
    a = _run_json(tmp_path / "a.json", 0, {
        "ours": ([[0, 0, 0.2], [2, 60, 0.5], [4, 120, 0.6]], 4.0),
        "trl": ([[0, 0, 0.2], [2, 300, 0.4], [4, 600, 0.7]], 9.0)})
    b = _run_json(tmp_path / "b.json", 1, {
        "ours": ([[0, 0, 0.2], [2, 100, 0.7], [4, 180, 0.8]], 4.2)})
    c = _run_json(tmp_path / "c.json", 2, {
        "trl": ([[0, 0, 0.2], [2, 340, 0.5], [4, 680, 0.5]], 8.6)})
    figures = tmp_path / "seeds.json"
    assert learning.main(["--vs", "trl", "--across", str(a), str(b), str(c),
                          "--json", str(figures)]) == 0
    printed = capsys.readouterr().out
    assert "| 2 | 0.600 (0.500, 0.700) | 1.3 | 0.450 (0.400, 0.500) | 5.3 |" in printed
    assert "dagrl: 2 run(s), seeds 0, 1; step 4: 0.600-0.800, std 14.1 points" in printed
    # Mean curves: dagrl (0.6, 0.7) against TRL (0.45, 0.6); dagrl's mean reaches TRL's mean
    # final 0.6 at step 2, after 80 s of TRL's 640.
    assert "mean step 4: dagrl 0.700 vs TRL 0.600 (+10.0 points): ok" in printed
    assert "at step 2, 1.3 min = 0.12x TRL's mean 10.7 min (target <= 0.5x: met)" in printed
    assert "mean peak RSS dagrl / TRL = 0.47x" in printed
    result = json.loads(figures.read_text())
    assert result["comparison"]["time_to_trl_final"] == {"step": 2, "ratio": 80 / 640}

    # Another workload (here another learning rate) is refused, naming the file and the key.
    d = _run_json(tmp_path / "d.json", 3, {"ours": ([[0, 0, 0.2]], 4.0)}, lr=1e-4)
    with pytest.raises(SystemExit, match=r"d.json: another workload than .*a.json \(lr: "):
        learning.main(["--vs", "trl", "--across", str(a), str(d)])
    (tmp_path / "e.json").write_text("{}")
    with pytest.raises(SystemExit, match="e.json: not a --json result of the learning bench"):
        learning.main(["--vs", "trl", "--across", str(a), str(tmp_path / "e.json")])
