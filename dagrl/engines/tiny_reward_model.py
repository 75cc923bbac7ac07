"""`builtin:tiny-digit-rm`: a tiny reward model trained in code, for examples and tests.

It is a 2-layer Qwen2 sequence classifier over the character vocabulary of the built-in tiny
policies, trained by regression to score the share of digits in the answer that follows the
last `=` of an arithmetic prompt:

    target(prompt, response) = #digits(response) / len(response)     (0 for an empty response)

Trained on random `a+b=` prompts with random answers (mixtures of digits, letters and
symbols). It plays the part of a learned preference model whose preference ("answer with
numbers") a policy can discover from its scores alone: examples/reward_model.yaml trains the
built-in tiny policy with GRPO on these scores and no rule reward.
"""

from __future__ import annotations

import fcntl
import os
import random
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForSequenceClassification
from transformers.utils import logging as hf_logging

from dagrl.config.model_source import TINY_REWARD_MODEL
from dagrl.engines.models import (
    CHARACTERS,
    build_char_tokenizer,
    tiny_model_config,
    write_model_dir,
)
from dagrl.engines.reward_model import render_pair

# Bump when the training recipe below changes: the cache key of the trained model.
RECIPE = 1
DIGITS = "0123456789"
NON_DIGITS = [c for c in CHARACTERS if c not in DIGITS and c != "="]


def digit_share(response: str) -> float:
    """The regression target: the share of digit characters in the response."""
    return sum(c in DIGITS for c in response) / len(response) if response else 0.0


def _example(rng: random.Random) -> tuple[list[dict], str]:
    prompt = [{"role": "user", "content": f"{rng.randint(0, 20)}+{rng.randint(0, 20)}="}]
    length, p_digit = rng.randint(0, 12), rng.random()
    response = "".join(rng.choice(DIGITS) if rng.random() < p_digit else rng.choice(NON_DIGITS)
                       for _ in range(length))
    return prompt, response


def tiny_digit_rm_config(hidden_size: int = 64, layers: int = 2):
    """The tiny reward model's HF config: a tiny Qwen2 with a one-label regression head."""
    config = tiny_model_config("tiny-qwen2", len(build_char_tokenizer()), hidden_size, layers)
    config.num_labels = 1
    config.problem_type = "regression"
    return config


def train_tiny_digit_rm(*, seed: int = 0, steps: int = 300, batch_size: int = 64,
                        hidden_size: int = 64, layers: int = 2):
    """(model, tokenizer, held-out mean absolute error) of a freshly trained tiny reward model."""
    tokenizer = build_char_tokenizer()
    config = tiny_digit_rm_config(hidden_size, layers)
    rng = random.Random(seed)
    hf_logging.disable_progress_bar()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_config(config)

    def encode(examples):
        texts = [render_pair(tokenizer, p, r) for p, r in examples]
        enc = tokenizer(texts, add_special_tokens=False, padding=True, return_tensors="pt")
        targets = torch.tensor([digit_share(r) for _, r in examples])
        return enc["input_ids"], enc["attention_mask"], targets

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / steps)
    model.train()
    for _ in range(steps):
        ids, mask, targets = encode([_example(rng) for _ in range(batch_size)])
        loss = torch.nn.functional.mse_loss(
            model(input_ids=ids, attention_mask=mask).logits[:, 0], targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    model.eval()
    with torch.no_grad():
        ids, mask, targets = encode([_example(random.Random(seed + 1)) for _ in range(512)])
        error = float((model(input_ids=ids, attention_mask=mask).logits[:, 0] - targets)
                      .abs().mean())
    return model, tokenizer, error


def write_tiny_digit_rm(out_dir: str | Path, *, seed: int = 0) -> Path:
    """Train the tiny reward model and write it as a HF directory (atomically, like the tiny
    policies: a crash never leaves a half-written model)."""
    model, tokenizer, error = train_tiny_digit_rm(seed=seed)
    note = (f"{TINY_REWARD_MODEL}: trained in code (dagrl/engines/tiny_reward_model.py), "
            f"seed {seed}; held-out mean absolute error {error:.4f} on the digit share in [0, 1]\n")
    return write_model_dir(Path(out_dir), model, tokenizer, {"TRAINING.txt": note})


def cache_dir() -> Path:
    """Where built-in models trained in code are kept between runs ($DAGRL_CACHE_DIR, else
    ~/.cache/dagrl), as the Hugging Face cache keeps downloaded ones."""
    return Path(os.environ.get("DAGRL_CACHE_DIR") or Path.home() / ".cache" / "dagrl")


def copy_tiny_digit_rm(out_dir: str | Path, *, seed: int = 0) -> Path:
    """The trained model written as `out_dir`: copied from the cache, where it is trained the
    first time (a minute on a CPU core; the training is seeded, so the copy is the model this
    run would train). The copy is made beside `out_dir` and renamed into place. Processes
    that start at once (parallel test workers, the ranks of a run) train it once: the first
    holds a lock on the cache entry, the others wait and copy its model."""
    out_dir = Path(out_dir)
    cached = cache_dir() / f"{TINY_REWARD_MODEL}-s{seed}-r{RECIPE}"
    if not (cached / "config.json").exists():
        cached.parent.mkdir(parents=True, exist_ok=True)
        with open(cached.parent / f"{cached.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)   # released when the file closes
            if not (cached / "config.json").exists():
                write_tiny_digit_rm(cached, seed=seed)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        shutil.copytree(cached, tmp, dirs_exist_ok=True)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
