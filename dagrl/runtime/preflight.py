"""Pre-flight: what can be checked with the tokenizer and the data alone, before any model
loads (loading a real model takes a minute; a typo should not).

- prompts: the first `PREFLIGHT_ROWS` rows of the train and validation files are tokenized as a
  batch would be, so an overlong prompt (data.max_prompt_length, truncation=error) or a null
  one is named with its file and row now, not at the step that first draws it;
- CPU threads: torch threads x workers on this host above the cores, or other processes
  already busy on the cores the run wants, make every step several times slower with no
  error; say so;
- mixed precision on a CPU that emulates bfloat16 (no AVX512-BF16 or AMX) is slower than
  float32; say so;
- tensor / sequence parallelism against the model's head counts, vocabulary and MLP width,
  read from its config alone.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

from dagrl.config.loader import ConfigError
from dagrl.config.schema import Config
from dagrl.data.checks import PREFLIGHT_ROWS
from dagrl.data.dataset import PromptLoader
from dagrl.device import native_bf16_matmul
from dagrl.engines.memory_estimate import model_config
from dagrl.engines.tensor_parallel import check_tensor_parallel
from dagrl.engines.ulysses import check_sequence_parallel


def check_prompts(loaders: dict[str, PromptLoader], log: Callable[[str], None]) -> None:
    """Tokenize the first rows of each loader (by name: train, val); raises DatasetError."""
    for name, loader in loaders.items():
        longest = loader.check_prompt_lengths(PREFLIGHT_ROWS)
        log(f"pre-flight: {name} prompts ok (first {min(PREFLIGHT_ROWS, len(loader.source))} "
            f"rows: longest {longest} of data.max_prompt_length={loader.max_prompt_length} "
            "tokens)")


def check_cpu_threads(torch_threads: int, workers_here: int, log: Callable[[str], None],
                      window_s: float = 0.25, async_trainer_threads: int = 0) -> None:
    """Warn when this host's CPUs are oversubscribed: by our own workers' threads, or (one
    worker on the host) by other processes busy right now, measured over `window_s`; in that
    last case with trainer.torch_threads=0 (auto), use only the free cores instead. Async
    trainer ranks may take more (`async_trainer_threads`) if their threads sleep while they
    wait for a core."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = torch_threads or torch.get_num_threads()
    if async_trainer_threads and os.environ.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE":
        log(f"warning: trainer.async_trainer_threads={async_trainer_threads} without "
            "OMP_WAIT_POLICY=PASSIVE in the workers' environment: threads waiting for a core "
            "spin against the rollout ranks' (set it where the workers start; dagrl train "
            "does)")
    if threads * workers_here > cores:
        log(f"warning: {workers_here} worker(s) x {threads} torch threads = "
            f"{threads * workers_here} threads on {cores} cores; steps will be much slower "
            f"than with trainer.torch_threads={max(1, cores // workers_here)}")
        return
    others = busy_cores_of_others(window_s) if workers_here == 1 else 0.0
    if others >= 0.5 and threads + others > cores:
        free = max(1, round(cores - others))
        if not torch_threads and free < threads:
            # Auto threads: take the free cores only. A torch thread on a busy core makes every
            # parallel region wait for it (a step took 40x the CPU time with 2 threads and one
            # core busy): one thread is never slower than that.
            torch.set_num_threads(free)
            log(f"other processes keep {others:.1f} of {cores} cores busy: {free} torch "
                f"thread(s) instead of {threads} (trainer.torch_threads=N chooses)")
            return
        log(f"warning: other processes keep {others:.1f} of {cores} cores busy while this run "
            f"wants {threads} threads: every step will be slower (lower "
            "trainer.torch_threads, or stop the other jobs)")


def busy_cores_of_others(window_s: float) -> float:
    """Cores kept busy over the next `window_s` seconds by processes other than this one
    (Linux /proc/stat; 0 elsewhere)."""
    def busy_s() -> float:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)      # idle + iowait
        return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")

    try:
        busy0, own0 = busy_s(), time.process_time()
        time.sleep(window_s)
        busy1, own1 = busy_s(), time.process_time()
    except (OSError, ValueError):
        return 0.0
    return max(0.0, (busy1 - busy0) - (own1 - own0)) / window_s


def check_mixed_precision(mixed_precision: str, device: torch.device,
                          log: Callable[[str], None]) -> None:
    """Warn when model.mixed_precision asks for bfloat16 matmuls the device only emulates."""
    if mixed_precision != "none" and not native_bf16_matmul(device):
        log(f"warning: model.mixed_precision={mixed_precision} on a CPU without AVX512-BF16 or "
            "AMX: bfloat16 matmuls are emulated and slower than float32 here; use "
            "model.mixed_precision=none")


def check_model_parallel(cfg: Config) -> None:
    """Raise ConfigError naming actor.tensor_parallel_size / sequence_parallel_size when the
    model's heads (or vocabulary, MLP width) do not split over them; reads only its config."""
    a = cfg.actor
    if cfg.trainer.n_workers == 1 or a.model_parallel_size == 1:
        return
    config = model_config(cfg)
    try:
        if a.tensor_parallel_size > 1:
            check_tensor_parallel(config, a.tensor_parallel_size)
        if a.sequence_parallel_size > 1:
            check_sequence_parallel(config, a.sequence_parallel_size, a.tensor_parallel_size)
    except ValueError as err:
        raise ConfigError(f"{err} ({cfg.model.path})") from None
