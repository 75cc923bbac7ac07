"""TRL's side of `dagrl bench e2e`; run by the benchmark with the TRL virtual environment's python.

    python _trl_worker.py --model DIR --data TRAIN.parquet --out RESULT.json [--steps 20 ...]

It imports nothing from dagrl (the venv has only torch, transformers and TRL), trains TRL's
`GRPOTrainer` on the model directory and prompts the benchmark wrote, and writes the wall time
(and process CPU time) of every optimizer step and TRL's completion-length metrics to RESULT.json.

One step is one generation batch of `prompts x samples` completions followed by exactly one
optimizer step on all of them, like one step of ours: per-device batch = generation batch =
prompts x samples, no gradient accumulation, one GRPO iteration per batch.
"""

from __future__ import annotations

import argparse
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


REWARDS = {"arith": arith_reward, "gsm8k_flexible": gsm8k_flexible_reward}


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="HF model directory (with tokenizer)")
    parser.add_argument("--data", required=True, help="train parquet in the verl layout")
    parser.add_argument("--out", required=True, help="where to write the result JSON")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
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
    ns = parser.parse_args(argv)

    import torch

    torch.set_num_threads(ns.threads)
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.utils import logging as hf_logging
    from trl import GRPOConfig, GRPOTrainer

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

    batch = ns.prompts * ns.samples
    with tempfile.TemporaryDirectory(prefix="dagrl-trl-") as out_dir:
        config = GRPOConfig(
            output_dir=out_dir, seed=ns.seed, use_cpu=True, bf16=ns.bf16, fp16=False,
            max_steps=ns.steps, logging_steps=1, save_strategy="no", eval_strategy="no",
            report_to="none", disable_tqdm=True, dataloader_num_workers=0,
            # One step = one generation batch of prompts x samples = one optimizer step.
            per_device_train_batch_size=batch, gradient_accumulation_steps=1,
            steps_per_generation=1, num_iterations=1, num_generations=ns.samples,
            # Exactly `tokens` completion tokens per sample: EOS is masked until then, as on ours.
            max_completion_length=ns.tokens, generation_kwargs={"min_new_tokens": ns.tokens},
            temperature=1.0, top_p=1.0, top_k=0,
            beta=ns.beta,                   # 0: no KL term, hence no reference model
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
        clock = StepClock()
        trainer = GRPOTrainer(model=model, reward_funcs=REWARDS[ns.reward], args=config,
                              train_dataset=load_prompts(ns.data), processing_class=tokenizer,
                              callbacks=[clock])
        trainer.train()

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
