"""TRL's side of `dagrl bench e2e` and `dagrl bench learning --vs trl`; run by the benchmark
with the TRL virtual environment's python.

    python _trl_worker.py --model DIR --data TRAIN.parquet --out RESULT.json [--steps 20 ...]
    python _trl_worker.py ... --output-dir DIR --save-every 25 --steps-log STEPS.jsonl

It imports nothing from dagrl (the venv has only torch, transformers and TRL), trains TRL's
`GRPOTrainer` on the model directory and prompts the benchmark wrote, and writes the wall time
(and process CPU time) of every optimizer step and TRL's completion-length metrics to RESULT.json.

One step is one generation batch of `prompts x samples` completions followed by exactly one
optimizer step on all of them, like one step of ours: per-device batch = generation batch =
prompts x samples, no gradient accumulation, one GRPO iteration per batch.

For the learning comparison (`--output-dir`): checkpoints every `--save-every` steps (model,
optimizer and scheduler, so an interrupted run resumes from the newest), one JSON line per
step in `--steps-log` with dagrl's metric names, and the learning-rate warm-up of dagrl's actor.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import resource
import sys
import tempfile
import time
from pathlib import Path

_DIGITS = "0123456789"


def arith_reward(completions: list, ground_truth: list[str], **_: object) -> list[float]:
    """The arithmetic rule of dagrl's `arith` scorer (dagrl/rewards/scorers.py), restated here
    because the TRL venv cannot import dagrl: exact answer 1, else shaped partial credit.
    Its cost is negligible next to a step; it only has to be the same kind of cheap rule."""
    rewards = []
    for completion, gt in zip(completions, ground_truth, strict=True):
        text = completion[0]["content"] if isinstance(completion, list) else completion
        resp, gt = text.strip(), gt.strip()
        if resp == gt:
            rewards.append(1.0)
            continue
        n_digits = sum(c in _DIGITS for c in resp) + resp.startswith("-")
        digit_frac = n_digits / len(resp) if resp else 0.0
        length_score = max(0.0, 1.0 - abs(len(resp) - len(gt)) / len(gt))
        position_match = sum(r == g for r, g in zip(resp, gt, strict=False)) / len(gt)
        rewards.append(0.2 * digit_frac + 0.2 * length_score + 0.4 * position_match)
    return rewards


_ANY_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")


def gsm8k_flexible_reward(completions: list, ground_truth: list[str], **_: object) -> list[float]:
    """dagrl's `gsm8k_flexible` scorer (verl's flexible GSM8K extraction) restated: the last
    number in the last 300 characters equals the ground truth -> 1, else 0."""
    rewards = []
    for completion, gt in zip(completions, ground_truth, strict=True):
        text = completion[0]["content"] if isinstance(completion, list) else completion
        numbers = [n for n in _ANY_NUMBER.findall(text[-300:]) if n not in ("", ".")]
        rewards.append(float(bool(numbers) and numbers[-1] == str(gt).strip()))
    return rewards


def gsm8k_numeric_reward(completions: list, ground_truth: list[str], **_: object) -> list[float]:
    """dagrl's `gsm8k_numeric` scorer restated: the last number in the last 300 characters,
    "$", "," and a trailing "." removed, equal by value to the ground truth -> 1, else 0."""
    rewards = []
    for completion, gt in zip(completions, ground_truth, strict=True):
        text = completion[0]["content"] if isinstance(completion, list) else completion
        numbers = [n for n in _ANY_NUMBER.findall(text[-300:]) if n not in ("", ".")]
        try:
            value = float(numbers[-1].replace(",", "").replace("$", "").rstrip(".")) \
                if numbers else None
        except ValueError:
            value = None
        rewards.append(float(value is not None and value == float(str(gt).replace(",", ""))))
    return rewards


REWARDS = {"arith": arith_reward, "gsm8k_flexible": gsm8k_flexible_reward,
           "gsm8k_numeric": gsm8k_numeric_reward}


def load_prompts(path: str):
    """The benchmark's verl-layout parquet as a conversational `datasets.Dataset`: the chat
    template then renders `<bos>a+b=`, the same tokens our side feeds its generator."""
    import pyarrow.parquet as pq
    from datasets import Dataset

    rows = pq.read_table(path, columns=["prompt", "reward_model"]).to_pylist()
    return Dataset.from_dict({
        "prompt": [r["prompt"] for r in rows],
        "ground_truth": [r["reward_model"]["ground_truth"] for r in rows],
    })


def argument_parser() -> argparse.ArgumentParser:
    """The worker's options (the update replay, _trl_replay.py, adds its own to them)."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="HF model directory (with tokenizer)")
    parser.add_argument("--data", required=True, help="train parquet in the verl layout")
    parser.add_argument("--out", required=True, help="where to write the result JSON")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32, help="max completion tokens")
    parser.add_argument("--min-tokens", type=int,
                        help="EOS masked until this many tokens (default: --tokens, exact length)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--warmup", type=int, default=0,
                        help="dagrl's warm-up: lr x min(1, (s + 1) / warmup) at optimizer step s")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--beta", type=float, default=0.0,
                        help="KL coefficient (> 0 loads TRL's reference model)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--reward", choices=tuple(REWARDS), default="arith")
    parser.add_argument("--bf16", action="store_true",
                        help="TrainingArguments.bf16: mixed precision (autocast to bfloat16)")
    parser.add_argument("--compile", action="store_true",
                        help="TrainingArguments.torch_compile (the model wrapped in torch.compile)")
    parser.add_argument("--output-dir", help="keep checkpoints here (and resume from the newest)")
    parser.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps")
    parser.add_argument("--steps-log", help="append one JSON line per step to this file")
    return parser


def grpo_trainer(ns: argparse.Namespace, out_dir: str, dataset, callbacks: list, *,
                 reward_func=None, shuffle: bool = True):
    """TRL's GRPOTrainer as both benchmarks configure it: one step = one generation batch of
    prompts x samples = one optimizer step, our actor's optimizer and warm-up. `reward_func`:
    instead of the --reward rule (the replay wraps it to record the rewards); `shuffle`:
    False takes the prompts in the dataset's order."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    batch = ns.prompts * ns.samples
    min_tokens = ns.tokens if ns.min_tokens is None else ns.min_tokens
    saving = ({"save_strategy": "steps", "save_steps": ns.save_every, "save_only_model": False}
              if ns.save_every else {"save_strategy": "no"})
    config = GRPOConfig(
        output_dir=out_dir, seed=ns.seed, use_cpu=True, bf16=ns.bf16, fp16=False,
        max_steps=ns.steps, logging_steps=1, eval_strategy="no", **saving,
        report_to="none", disable_tqdm=True, dataloader_num_workers=0, shuffle_dataset=shuffle,
        # One step = one generation batch of prompts x samples = one optimizer step.
        per_device_train_batch_size=batch, gradient_accumulation_steps=1,
        steps_per_generation=1, num_iterations=1, num_generations=ns.samples,
        # e2e: exactly `tokens` completion tokens per sample (EOS masked until then, as on
        # ours); learning: up to `tokens`, stopping at EOS.
        max_completion_length=ns.tokens, generation_kwargs={"min_new_tokens": min_tokens},
        temperature=ns.temperature, top_p=1.0, top_k=0,
        beta=ns.beta,                   # 0: no KL term, hence no reference model
        # dagrl's KL loss is k3 (low_var_kl) as it stands; TRL's default multiplies it by the
        # (differentiable) importance ratio, which changes its gradient even on-policy.
        use_bias_correction_kl=False,
        disable_dropout=True,
        # Our actor's optimiser settings (throughput does not depend on them, but keep the
        # update the same kind of update).
        learning_rate=ns.lr, adam_beta1=0.9, adam_beta2=0.99, weight_decay=0.0,
        max_grad_norm=1.0, lr_scheduler_type="constant", warmup_steps=0,
        torch_compile=ns.compile,
        # Everything else (gradient checkpointing, loss type, ...) is TRL's default.
    )
    model = AutoModelForCausalLM.from_pretrained(ns.model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(ns.model)
    optimizers = (None, None)
    if ns.warmup:   # dagrl's schedule: lr / warmup at the first step, not HF's 0
        optimizer = torch.optim.AdamW(model.parameters(), lr=ns.lr, betas=(0.9, 0.99),
                                      weight_decay=0.0)
        optimizers = (optimizer, torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: min(1.0, (s + 1) / ns.warmup)))
    return GRPOTrainer(model=model, reward_funcs=reward_func or REWARDS[ns.reward], args=config,
                       train_dataset=dataset, processing_class=tokenizer, callbacks=callbacks,
                       optimizers=optimizers)


def main(argv: list[str] | None = None) -> int:
    ns = argument_parser().parse_args(argv)

    import torch

    torch.set_num_threads(ns.threads)
    import transformers
    import trl
    from transformers import TrainerCallback
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()   # a weight-loading bar is noise in the bench's output

    class StepClock(TrainerCallback):
        """Wall and process CPU time at the end of every optimizer step; consecutive
        differences are step times that include everything TRL does between steps
        (generation, logging)."""

        def __init__(self) -> None:
            self.marks: list[tuple[float, float]] = []
            self.logs: list[dict] = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.marks = [(time.perf_counter(), time.process_time())]

        def on_step_end(self, args, state, control, **kwargs):
            self.marks.append((time.perf_counter(), time.process_time()))

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append(dict(logs or {}))
            if ns.steps_log and logs and "reward" in logs:   # a training step's record
                with open(ns.steps_log, "a", encoding="utf-8") as f:
                    f.write(json.dumps({"step": state.global_step, "reward/mean": logs["reward"],
                                        "response/length/mean":
                                            logs.get("completions/mean_length")}) + "\n")

    with contextlib.ExitStack() as stack:
        out_dir = ns.output_dir or stack.enter_context(
            tempfile.TemporaryDirectory(prefix="dagrl-trl-"))
        clock = StepClock()
        trainer = grpo_trainer(ns, out_dir, load_prompts(ns.data), [clock])
        config = trainer.args
        resume = ns.output_dir and any(Path(out_dir).glob("checkpoint-*"))
        trainer.train(resume_from_checkpoint=True if resume else None)

    step_logs = [log for log in clock.logs if "completions/mean_length" in log]
    result = {
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__,
                     "torch": torch.__version__},
        "threads": torch.get_num_threads(),
        "config": {"gradient_checkpointing": config.gradient_checkpointing, "bf16": config.bf16,
                   "loss_type": config.loss_type, "beta": config.beta},
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "step_seconds": [b[0] - a[0] for a, b in itertools.pairwise(clock.marks)],
        "step_cpu_seconds": [b[1] - a[1] for a, b in itertools.pairwise(clock.marks)],
        "mean_length": [log["completions/mean_length"] for log in step_logs],
        "min_length": [log.get("completions/min_length", float("nan")) for log in step_logs],
        "max_length": [log.get("completions/max_length", float("nan")) for log in step_logs],
    }
    Path(ns.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
