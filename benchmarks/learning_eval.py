"""The learning bench's held-out evaluator (benchmarks/learning_vs_trl.py): one scorer for the
initial model and both sides' checkpoints, and the child processes the bench runs.

Each model directory (dagrl's checkpoints exported with `dagrl export`, TRL's checkpoint
directories as they are) goes through dagrl's own validation, greedy, in a process of its own,
so a checkpoint's accuracy does not depend on which framework wrote it. Every problem's score is
kept beside the accuracy (out/evaluations.json), which lets the report pair two checkpoints
problem by problem.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks import e2e

if TYPE_CHECKING:
    from benchmarks.learning_vs_trl import Workload

CHECKOUT = Path(__file__).resolve().parents[1]
SIDES = ("ours", "trl")


def precision_args(work: Workload) -> list[str]:
    return ["model.mixed_precision=bfloat16"] if work.precision == "bfloat16" else []


def saved_steps(side: str, side_dir: Path) -> list[int]:
    """The steps of the side's complete checkpoints, ascending (ours: committed ones under
    run/checkpoints/step_N; TRL: checkpoints/checkpoint-N with their trainer state)."""
    if side == "ours":
        from dagrl.runtime.checkpoint import list_checkpoints

        return [step for step, _ in list_checkpoints(side_dir / "run" / "checkpoints")]
    return sorted(int(p.name.split("-")[1]) for p in (side_dir / "checkpoints").glob(
        "checkpoint-*") if (p / "trainer_state.json").is_file())


def checkpoint_model(side: str, side_dir: Path, step: int) -> Path:
    """A HF model directory of the side's weights at `step` (ours: exported once)."""
    if side == "trl":
        return side_dir / "checkpoints" / f"checkpoint-{step}"
    out = side_dir / "hf" / f"step_{step}"
    if not out.is_dir():
        from dagrl.export import export_checkpoint
        from dagrl.runtime.checkpoint import list_checkpoints

        found = dict(list_checkpoints(side_dir / "run" / "checkpoints"))
        export_checkpoint(found[step], out)
    return out


class Interrupted(Exception):
    """The bench was stopped while a side trained; `peak_gb`: that side's peak RSS so far."""

    def __init__(self, peak_gb: float) -> None:
        super().__init__(f"stopped (the side's peak RSS so far: {peak_gb:.2f} GiB)")
        self.peak_gb = peak_gb


def run_child(cmd: list[str], env: dict, output) -> tuple[int, float]:
    """Run a side to completion: (exit status, peak RSS in GiB, the kernel's ru_maxrss of the
    process tree). Stopped (Ctrl-C, SIGTERM to the bench), the side is terminated too — its
    finished checkpoints stay — and Interrupted carries its peak so far."""
    proc = subprocess.Popen(cmd, env=env, cwd=CHECKOUT, stdout=output,
                            stderr=subprocess.STDOUT)
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    except BaseException:
        proc.terminate()
        _, status, usage = os.wait4(proc.pid, 0)
        raise Interrupted(usage.ru_maxrss / 2**20) from None
    return os.waitstatus_to_exitcode(status), usage.ru_maxrss / 2**20


def evaluator_args(work: Workload, train: Path, test: Path, run_dir: Path) -> list[str]:
    """The same validation settings for every model directory (model.path is added). Every
    held-out sample is kept (logging.val_generations), so each problem's score is recorded and
    two checkpoints can be compared problem by problem."""
    import pyarrow.parquet as pq

    config = [str(e2e.SMOLLM2_EXAMPLE), "model.gguf_file="] if work.name == "smollm2" else \
        ["data.max_prompt_length=8"]
    return [*config, f"data.train_files=[{train}]", f"data.val_files=[{test}]",
            f"rollout.max_new_tokens={work.max_tokens}", f"reward.scorer={work.reward}",
            "rollout.val_temperature=0", "trainer.val_before_train=true",
            f"trainer.torch_threads={work.threads}",
            "trainer.device=cpu", f"trainer.run_dir={run_dir}", "logging.backends=[jsonl]",
            f"logging.val_generations={pq.ParquetFile(test).metadata.num_rows}",
            "logging.progress_bar=false", *precision_args(work)]


def evaluate_child(spec_path: str) -> int:
    """In the evaluator's process: dagrl's validation of every listed model directory, each
    result appended to the spec's output as it is made."""
    from dagrl.config.presets import load_run_config
    from dagrl.runtime.distributed import init_distributed
    from dagrl.runtime.run_dir import prepare_run
    from dagrl.runtime.worker import Worker

    spec = json.loads(Path(spec_path).read_text())
    args = spec["args"]
    dist = init_distributed("cpu")
    for key, model in spec["models"].items():
        cfg = load_run_config(args[0] if args[0].endswith(".yaml") else None,
                              [a for a in args if not a.endswith(".yaml")]
                              + [f"model.path={model}"])
        start = time.perf_counter()
        worker = Worker(prepare_run(cfg), dist)
        metrics = worker.validate(0)
        scores = [v for k, v in metrics.items() if k.startswith("val/") and k.endswith("/score")]
        if len(scores) != 1:
            raise RuntimeError(f"expected one val/<source>/score, got {sorted(metrics)}")
        record = {"key": key, "accuracy": scores[0], "seconds": time.perf_counter() - start}
        each = [sample["score"] for sample in worker.validator.samples]
        if each:    # in the held-out split's order (one rank, no shuffling)
            if abs(sum(each) / len(each) - scores[0]) > 1e-6:
                raise RuntimeError(f"{key}: the kept samples' mean score {sum(each) / len(each)} "
                                   f"is not the validation's {scores[0]}")
            record["scores"] = each
        del worker          # one model at a time in memory
        gc.collect()
        with open(spec["out"], "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
    return 0


def evaluate(work: Workload, model: Path, train: Path, test: Path, out: Path) -> dict:
    """Held-out accuracy of the initial model and of every side's checkpoint at multiples of
    work.every; kept in out/evaluations.json."""
    path = out / "evaluations.json"
    done = json.loads(path.read_text()) if path.is_file() else {}
    wanted = {"initial": model}
    for side in SIDES:
        side_dir = out / side
        for step in saved_steps(side, side_dir):
            if step % work.every == 0 or step == work.steps:
                wanted[f"{side}/{step}"] = (side, side_dir, step)
    todo = {k: v for k, v in wanted.items() if k not in done}
    if not todo:
        return done
    models = {k: str(v if isinstance(v, Path) else checkpoint_model(*v)) for k, v in todo.items()}
    print(f"evaluating {len(models)} model(s) on the held-out set: {', '.join(models)}",
          flush=True)
    results = out / "evaluations.jsonl"
    results.unlink(missing_ok=True)
    spec = out / "evaluate.spec.json"
    spec.write_text(json.dumps({"args": evaluator_args(work, train, test, out / "eval-run"),
                                "models": models, "out": str(results)}))
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": str(work.threads)}
    log = out / "evaluate.log"
    try:
        with log.open("a") as output:   # stopped with the bench (run_child), as a side is
            code, _ = run_child([sys.executable, "-m", "benchmarks.learning_eval", str(spec)],
                                env, output)
        if code != 0:
            tail = log.read_text(errors="replace").splitlines()[-15:]
            raise SystemExit("\n".join(tail) + f"\nevaluation exited with status {code} "
                             f"(above: the end of {log}); the scores made are kept")
    except Interrupted:
        raise SystemExit("evaluation: stopped; run the bench again to score the models left "
                         "(the scores made are kept)") from None
    finally:   # what was scored before a failure or a stop is kept
        if results.is_file():
            for line in results.read_text().splitlines():
                record = json.loads(line)
                done[record.pop("key")] = record
            path.write_text(json.dumps(done, indent=2))
    return done


if __name__ == "__main__":
    raise SystemExit(evaluate_child(sys.argv[1]))
