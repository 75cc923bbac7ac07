"""Everything about a run's inputs that can be checked without loading a model or writing a
file, checked before the run directory is touched: the reward function, the datasets (schema,
column types and the values of their first rows), the run and checkpoint directories, the
graph and its roles, whether the model's heads split over the tensor / sequence-parallel
sizes, the prompts' token lengths, and the checkpoint a resume would start from.

`check_inputs` runs in the launching process (the Ray driver, the single worker) or on every
torchrun rank before the process group forms, so a typo costs seconds, not a model load, and a
refused run leaves nothing behind. Each error is one of the user-error types of
runtime/failures.py and names the file, column, row, key or node.

The checks that read only files come first and import no torch: a malformed dataset or reward
function is refused in well under a second. The graph's roles, the tokenizer and the model's
config need torch and transformers (seconds to import), so their checks import them late.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from dagrl.config.loader import ConfigError
from dagrl.config.model_source import (
    BUILTIN_PREFIX,
    PACKAGE_PREFIX,
    TINY_VLM,
    check_model_sources,
    model_reads_images,
    package_dir,
)
from dagrl.config.schema import Config
from dagrl.dag.spec import GraphError
from dagrl.data.checks import PREFLIGHT_ROWS
from dagrl.data.errors import DatasetError
from dagrl.data.makers import MAKERS
from dagrl.data.parquet import ParquetPrompts
from dagrl.observe.backends import check_backends_installed
from dagrl.registry import UnknownNameError
from dagrl.rewards.custom import load_function
from dagrl.rewards.manager import unpack_score
from dagrl.rewards.pool import call_scorer
from dagrl.rewards.scorers import SCORERS
from dagrl.runtime.manifest import read_manifest
from dagrl.runtime.model_identity import identity_mismatch, model_identity
from dagrl.runtime.run_dir import RunDirError

if TYPE_CHECKING:
    from dagrl.data.vision import ImageEncoder


def check_inputs(cfg: Config) -> None:
    """Raise the first problem with `cfg`'s inputs; write nothing."""
    check_file_inputs(cfg)
    check_model_inputs(cfg)


def check_file_inputs(cfg: Config) -> None:
    """What reads files alone (no model code: well under a second): the logging backends,
    the model directory, the reward function (imported, then called on the first row), the
    datasets, the run and checkpoint directories."""
    check_backends_installed(cfg.logging)
    check_model_sources(cfg)
    check_reward(cfg)
    for key in data_keys(cfg):
        check_datasets(cfg, key)
    r = cfg.reward
    # With reward.timeout_s the scorer may hang by design: only its pool can stop it.
    if r.custom_fn and r.source == "rule" and r.on_error == "raise" and not r.timeout_s:
        probe_reward(cfg, load_function(r.custom_fn, isolated=True))
    check_dir_usable(run_dir_of(cfg), "trainer.run_dir")
    check_dir_usable(checkpoint_root(cfg), "trainer.checkpoint_dir")


def check_model_inputs(cfg: Config) -> None:
    """What needs the model code (torch, transformers: seconds to import): the graph and its
    roles, the heads against tensor / sequence parallelism, the prompts' token lengths, the
    checkpoint a resume would start from."""
    check_graph(cfg)
    from dagrl.runtime.preflight import check_model_parallel

    check_model_parallel(cfg)
    check_prompt_lengths(cfg, data_keys(cfg))
    check_resume_model(cfg, checkpoint_root(cfg))


def data_keys(cfg: Config) -> list[str]:
    """The data settings whose files the run reads."""
    return ["train_files", "val_files"] if cfg.validates else ["train_files"]


def run_dir_of(cfg: Config) -> Path:
    """The run directory as the launcher will resolve it (its default parent when unset)."""
    return Path(cfg.trainer.run_dir or "runs")


def checkpoint_root(cfg: Config) -> Path:
    """Where the run's checkpoints go: trainer.checkpoint_dir, else under the run directory."""
    t = cfg.trainer
    return Path(t.checkpoint_dir) if t.checkpoint_dir else run_dir_of(cfg) / "checkpoints"


def check_resume_model(cfg: Config, root: Path) -> None:
    """The checkpoint a resume would start from (trainer.resume under `root`) exists
    and was written for the configured model (its identity in the manifest, or, for a
    checkpoint older than that, its hf/ files); compared from configs and vocabularies only,
    before anything is built."""
    from dagrl.engines.memory_estimate import model_config
    from dagrl.engines.models import load_tokenizer
    from dagrl.runtime.checkpoint import CheckpointError, resolve_resume

    checkpoint = resolve_resume(cfg.trainer.resume, root)
    if checkpoint is None:
        return
    saved = (read_manifest(checkpoint) or {}).get("model")
    if saved is None and (checkpoint / "hf" / "config.json").is_file():
        from transformers import AutoConfig

        hf = checkpoint / "hf"
        saved = model_identity(AutoConfig.from_pretrained(hf, local_files_only=True),
                               load_tokenizer(str(hf)), str(hf))
    if saved is None:
        return
    problem = identity_mismatch(checkpoint, saved, model_identity(
        model_config(cfg), model_tokenizer(cfg), cfg.model.path))
    if problem:
        raise CheckpointError(problem)


def check_graph(cfg: Config) -> None:
    """Import dag.modules, build the graph, validate it against the roles and plan it."""
    # The built-in roles import torch and the engines.
    from dagrl.roles.plan import plan_for

    try:
        plan_for(cfg, cfg.trainer.n_workers)
    except (GraphError, UnknownNameError, ConfigError):
        raise
    except FileNotFoundError as err:
        raise GraphError(str(err)) from err
    except Exception as err:   # a user module that fails to import: name it and the cause
        raise ConfigError(f"dag.modules={cfg.dag.modules}: importing them failed "
                          f"({type(err).__name__}: {err})") from err


def check_reward(cfg: Config) -> None:
    """reward.custom_fn imports and is callable (the workers import it again)."""
    spec = cfg.reward.custom_fn
    if not spec:
        return
    try:
        load_function(spec)
    except Exception as err:   # anything the user's file raises while it is imported
        message = str(err) if spec in str(err) else f"{type(err).__name__}: {err}"
        raise ConfigError(f"reward.custom_fn={spec!r}: cannot be imported: {message}") from err


def probe_reward(cfg: Config, fn) -> None:
    """Call the user's reward function once, on the first training row with its ground truth
    as the response, as a step would: a function that raises or returns a string fails now,
    not after the first rollout. `fn` is a copy of its own (a file is imported afresh), so a
    function that keeps state starts training as if never called. (Built-in datasets are made
    in a temporary directory.)"""
    spec = cfg.reward.custom_fn
    with tempfile.TemporaryDirectory() as tmp:
        first = cfg.data.train_files[0]
        if first.startswith(BUILTIN_PREFIX):
            first = str(MAKERS[first[len(BUILTIN_PREFIX):]](Path(tmp), seed=0)["train"])
        row = ParquetPrompts([first], cfg.data.prompt_key).read([0])[0]
    truth = (row.get("reward_model") or {}).get("ground_truth")
    where = f"{first}: row 0 (data_source {row['data_source']!r})"
    # As a worker calls it: a function may read the rank from the environment, which the
    # launching process (the Ray driver, a single worker) does not set; rank 0's is lent.
    lent = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(cfg.trainer.n_workers)}
    lent = {key: value for key, value in lent.items() if key not in os.environ}
    os.environ.update(lent)
    try:
        unpack_score(call_scorer(fn, row["data_source"], str(truth), truth,
                                 row.get("extra_info")))
    except Exception as err:   # what the user's function raises, or a malformed score
        raise ConfigError(f"reward.custom_fn={spec!r} on {where}, its ground truth as the "
                          f"response: {type(err).__name__}: {err}") from err
    finally:
        for key in lent:
            del os.environ[key]


def check_datasets(cfg: Config, key: str) -> None:
    """Open `data.<key>`'s files, check their schemas and the values of their first rows; with
    the built-in scorers, also that each data_source of those rows has one."""
    files = getattr(cfg.data, key)
    builtin = [f for f in files if f.startswith(BUILTIN_PREFIX)]
    for spec in builtin:   # written by prepare_run later: only the name can be checked now
        if spec[len(BUILTIN_PREFIX):] not in MAKERS:
            raise DatasetError(f"data.{key}: unknown built-in dataset {spec!r}; choose one of "
                               f"{', '.join(BUILTIN_PREFIX + k for k in MAKERS)}")
    files = [f for f in files if not f.startswith(BUILTIN_PREFIX)]
    if not files and builtin:
        return
    r = cfg.reward
    # Training samples are scored by the rule scorers only with reward.source=rule;
    # validation always reports the rule score.
    rule_scored = r.source == "rule" or key == "val_files"
    source = ParquetPrompts(files, cfg.data.prompt_key, config_key=f"data.{key}",
                            text_ground_truth=rule_scored and not r.custom_fn,
                            max_image_pixels=cfg.data.max_image_pixels)
    seen = source.check_sample(PREFLIGHT_ROWS)
    if source.has_images and not model_reads_images(cfg.model.path):
        # Trained on as text, the images would be dropped and "<image>" read as words.
        raise DatasetError(f"data.{key}: {', '.join(files)} hold an images column, but "
                           f"model.path={cfg.model.path} reads text only (an image-text model, "
                           "e.g. of the Qwen2-VL family, reads them)")
    source.check_nulls()   # every row: a null past the sample would fail only at its step
    if rule_scored and not r.custom_fn and not r.scorer:
        for data_source, where in seen.items():
            if data_source not in SCORERS:
                raise DatasetError(f"{where} has data_source {data_source!r}, which no reward "
                                   f"scorer handles ({SCORERS.unknown_message(data_source)}); "
                                   "set reward.custom_fn or reward.scorer to score it")


def check_prompt_lengths(cfg: Config, keys: list[str]) -> None:
    """The first rows of the user's parquet files rendered with the model's tokenizer and chat
    template, so an overlong or empty prompt is refused before the run directory exists. Only
    a tokenizer is loaded (no weights); a built-in model's is built in memory. The built-in
    datasets are written by prepare_run: the worker's pre-flight checks those
    (runtime/preflight.py)."""
    d = cfg.data
    files = {key: [f for f in getattr(d, key) if not f.startswith(BUILTIN_PREFIX)]
             for key in keys}
    if not any(files.values()):
        return
    from dagrl.data.dataset import PromptLoader

    tokenizer = model_tokenizer(cfg)
    images = model_image_encoder(cfg, tokenizer)
    for key, paths in files.items():
        if paths:
            source = ParquetPrompts(paths, d.prompt_key, config_key=f"data.{key}",
                                    max_image_pixels=d.max_image_pixels)
            PromptLoader(source, tokenizer, batch_size=1, tail="pad",
                         max_prompt_length=d.max_prompt_length, truncation=d.truncation,
                         images=images).check_prompt_lengths(PREFLIGHT_ROWS)


def model_image_encoder(cfg: Config, tokenizer) -> ImageEncoder | None:
    """The configured model's image encoder (data/vision.py) when it reads images, from its
    directory or, for the built-in image-text model, built in memory."""
    from dagrl.data.vision import ImageEncoder
    from dagrl.engines.tiny_vlm import tiny_image_processor

    m = cfg.model
    if m.path == BUILTIN_PREFIX + TINY_VLM:
        return ImageEncoder(tiny_image_processor(), tokenizer)
    if m.path.startswith(BUILTIN_PREFIX):
        return None
    path = str(package_dir(m.path)) if m.path.startswith(PACKAGE_PREFIX) else m.path
    return ImageEncoder.of_model(path, tokenizer)


def model_tokenizer(cfg: Config):
    """The configured model's tokenizer, without its weights: a built-in model's built in memory
    (what prepare_run writes beside the tiny model), an installed package's, a directory's."""
    from dagrl.engines.models import load_tokenizer, tiny_tokenizer

    m = cfg.model
    if m.path.startswith(BUILTIN_PREFIX):
        return tiny_tokenizer(m.path[len(BUILTIN_PREFIX):])
    path = str(package_dir(m.path)) if m.path.startswith(PACKAGE_PREFIX) else m.path
    return load_tokenizer(path, m.gguf_file)


def check_dir_usable(path: Path, key: str) -> None:
    """`path` is a directory, or can be created as one, and can be written; nothing is left
    behind (a refused run must leave no directory)."""
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        what = "is a file" if probe == path else f"cannot be written: {str(probe)!r} is a file"
        raise RunDirError(f"{key}={str(path)!r} {what}, not a directory; choose another path")
    if os.statvfs(probe).f_flag & os.ST_RDONLY:
        raise RunDirError(f"{key}={str(path)!r} cannot be written ({str(probe)!r} is on a "
                          "read-only file system); choose another directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise RunDirError(f"{key}={str(path)!r} cannot be written ({str(probe)!r}: permission "
                          "denied for this user); choose another directory")
    # os.access answers yes to root everywhere, and /proc or /sys refuse a new directory
    # whatever the mode bits say: make one and remove it.
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".dagrl-probe-", dir=probe))
    except OSError as err:
        raise RunDirError(f"{key}={str(path)!r} cannot be written (a directory cannot be made in "
                          f"{str(probe)!r}: {err.strerror or err}); choose another "
                          "directory") from err

