"""Where a step's metrics go: a progress bar with a compact console line, metrics.jsonl
(always: `dagrl report` reads it), and TensorBoard / wandb / MLflow when selected in
`logging.backends` (dagrl/observe/backends.py).

Only rank 0 creates a RunLogger; the metrics it receives are already reduced over all ranks.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from tqdm import tqdm

from dagrl.config.schema import LoggingConfig
from dagrl.observe.run_files import naming_path

# The metrics shown on the console line, in this order, with their short labels.
CONSOLE_KEYS = [("reward/mean", "reward"), ("response/length/mean", "len"), ("actor/kl", "kl"),
                ("actor/entropy", "ent"), ("actor/grad_norm", "gnorm"), ("timing/step_s", "s/step"),
                ("throughput/tokens_per_s", "tok/s"), ("tools/errors", "tool_err")]


class JsonlLogger:
    """One JSON object per step, with `step`; appended and flushed every step."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (open for the run; close())
        self._failed = False   # a write failed: closing fails the same way, and says nothing new

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **{k: (None if isinstance(v, float) and not math.isfinite(v)
                                       else v) for k, v in metrics.items()}}
        try:
            with naming_path(self.path):
                self._file.write(json.dumps(record) + "\n")
                self._file.flush()
        except OSError:
            self._failed = True
            raise

    def close(self) -> None:
        try:
            with naming_path(self.path):
                self._file.close()
        except OSError:
            if not self._failed:
                raise


# logging.val_generations: validation samples as text, one JSON record per sample.
GENERATIONS_FILE = "val_generations.jsonl"


def append_generations(path: Path, step: int, samples: list[dict]) -> None:
    """Append validation samples (dicts of prompt, response, ...) as records of `step`."""
    with naming_path(path), path.open("a", encoding="utf-8") as f:
        for sample in samples:
            f.write(json.dumps({"step": step, **sample}, ensure_ascii=False) + "\n")


class ConsoleLogger:
    def __init__(self, total_steps: int, start_step: int, every: int, progress_bar: bool) -> None:
        self.every = every
        self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step",
                        dynamic_ncols=True, file=sys.stderr) if progress_bar else None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        shown = {label: metrics[key] for key, label in CONSOLE_KEYS if key in metrics}
        # Every other policy's reward (`models.<name>`: its metrics carry the prefix "<name>/").
        shown.update({f"{key[:-len('/reward/mean')]}:reward": v for key, v in metrics.items()
                      if key.endswith("/reward/mean") and not key.startswith("val/")})
        # Validation scores (val/<data_source>/score, pass@n, maj@n) whenever a step has them.
        validated = {key[len("val/"):]: v for key, v in metrics.items()
                     if key.startswith("val/") and key.rsplit("/", 1)[-1].startswith(
                         ("score", "pass@", "maj@"))}
        if self.bar is not None and step > 0:   # step 0: validation before training
            self.bar.update(1)
            self.bar.set_postfix({k: f"{v:.3g}" for k, v in shown.items()}, refresh=False)
        shown.update({f"val:{k}": v for k, v in validated.items()})
        if step % self.every == 0 or step == 1 or validated:
            line = f"step {step}: " + "  ".join(f"{k}={v:.4g}" for k, v in shown.items())
            (self.bar.write if self.bar is not None else print)(line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class _AppendedLines:
    """The whole lines appended to a file since the last read (a file another process writes)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        # A resumed run's metrics file already holds the earlier steps: only what is appended
        # counts.
        self.position = path.stat().st_size if path.exists() else 0
        self.pending = b""

    def read(self) -> list[bytes]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.position)
                chunk = f.read()
        except FileNotFoundError:
            return []
        self.position += len(chunk)
        *lines, self.pending = (self.pending + chunk).split(b"\n")
        return lines


class MetricsFileConsole:
    """The console of a run whose lead worker is another process on this host (Ray actors):
    the driver draws the progress bar and the step lines from RUN_DIR/metrics.jsonl as the lead
    appends to it — one bar on the terminal, not each worker's stderr forwarded line by line —
    and prints the lines the workers wrote to their standard output (`messages`, the file the
    driver gave them) above the bar, without Ray's `(RayWorker pid=...)` prefix."""

    def __init__(self, path: Path, cfg: LoggingConfig, total_steps: int,
                 messages: Path | None = None) -> None:
        self.records = _AppendedLines(path)
        self.messages = _AppendedLines(messages) if messages is not None else None
        self.cfg, self.total_steps = cfg, total_steps
        self.console: ConsoleLogger | None = None   # made at the first record: its step

    def poll(self) -> None:
        """Show the lines and records appended since the last poll."""
        for line in self.messages.read() if self.messages is not None else []:
            text = line.decode(errors="replace")
            bar = self.console.bar if self.console is not None else None
            (bar.write if bar is not None else print)(text)
        for line in self.records.read():
            try:
                record = json.loads(line)
            except ValueError:   # metrics.jsonl's readers name damaged lines; the bar skips them
                continue
            step = int(record.pop("step", 0))
            if self.console is None:
                self.console = ConsoleLogger(self.total_steps, max(step - 1, 0),
                                             self.cfg.console_every, self.cfg.progress_bar)
            self.console.log(step, record)

    def close(self) -> None:
        self.poll()
        if self.console is not None:
            self.console.close()


class RunLogger:
    def __init__(self, cfg: LoggingConfig, run_dir: Path, total_steps: int, start_step: int = 0):
        self.backends = []
        try:
            if "console" in cfg.backends:
                self.backends.append(ConsoleLogger(total_steps, start_step, cfg.console_every,
                                                   cfg.progress_bar))
            self.backends.append(JsonlLogger(run_dir / "metrics.jsonl"))
            optional = [b for b in cfg.backends if b in ("tensorboard", "wandb", "mlflow")]
            if optional:
                from dagrl.observe import backends

                config = _resolved_config(run_dir)
                for name in optional:
                    if name == "tensorboard":
                        self.backends.append(backends.TensorBoardLogger(run_dir, config))
                    elif name == "wandb":
                        self.backends.append(backends.WandbLogger(cfg, run_dir, config))
                    else:
                        self.backends.append(backends.MlflowLogger(cfg, run_dir, config))
        except BaseException:
            self.close()
            raise

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for backend in self.backends:
            backend.log(step, metrics)

    def close(self) -> None:
        for backend in self.backends:
            backend.close()
        self.backends = []


def _resolved_config(run_dir: Path) -> dict | None:
    """The run's resolved config (written by launch.prepare_run), for wandb/MLflow/TensorBoard."""
    path = run_dir / "config.resolved.yaml"
    if not path.exists():
        return None
    import yaml

    return yaml.safe_load(path.read_text())
