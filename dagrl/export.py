"""Export a checkpoint's actor as a Hugging Face model directory (safetensors + tokenizer).

    dagrl export runs/grpo-20261122-101500/checkpoints/step_00000060 --out my-model
    dagrl export runs/grpo-20261122-101500 --out my-model     # the run's newest checkpoint

The result loads with `AutoModelForCausalLM.from_pretrained(DIR)` and `AutoTokenizer`. The
weights are read from the checkpoint's DCP shards in one process, whatever the number of
workers that wrote them; the model config and tokenizer come from the checkpoint's `hf/`. A
LoRA actor's adapters (config in the checkpoint's `lora/`) are merged into the weights.

The files read are first checked against the checkpoint's manifest (sizes and SHA-256 written
at save): a damaged checkpoint is refused with the file named, never exported in part.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from dagrl.engines.lora import ADAPTER_DIR, wrap_like_checkpoint
from dagrl.engines.models import plain_config
from dagrl.file_modes import apply_umask
from dagrl.runtime.checkpoint import (
    LOAD_ERRORS,
    STATE_FILE,
    CheckpointError,
    checkpoint_problem,
    first_line,
    latest_checkpoint,
    list_checkpoints,
    single_process_quiet,
)


def find_checkpoint(path: Path) -> Path:
    """A checkpoint directory, or a run directory / checkpoint root -> its newest checkpoint."""
    if (path / STATE_FILE).is_file():
        return path
    for root in (path / "checkpoints", path):
        found = latest_checkpoint(root)
        if found is not None:
            return found
    raise CheckpointError(f"{path}: no checkpoint there (expected {STATE_FILE}, or a run "
                          "directory with checkpoints/step_<N>); a run writes one after its last "
                          "step unless trainer.save_final=false, and every N steps with "
                          "trainer.save_every=N")


def verify_for_export(checkpoint: Path) -> None:
    """The files an export reads (weights, HF config, tokenizer, adapters) match the manifest;
    otherwise a CheckpointError naming the file (and an older checkpoint to try)."""
    problem = checkpoint_problem(checkpoint, under=("dcp/", "hf/", f"{ADAPTER_DIR}/"))
    if not problem:
        return
    older = [p for _, p in list_checkpoints(checkpoint.parent) if p.name < checkpoint.name]
    hint = f"; the checkpoint before it is {older[-1]}" if older else ""
    raise CheckpointError(f"checkpoint {checkpoint}: {problem}; not exported{hint}")


def export_checkpoint(checkpoint: Path, out: Path, dtype: str | None = None) -> Path:
    """Write the actor of `checkpoint` to `out` as a HF model directory. `out` appears only
    when complete (written beside it, then renamed); an existing `out` is an error."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    checkpoint, out = find_checkpoint(Path(checkpoint)), Path(out)
    if out.exists():
        raise FileExistsError(f"{out} already exists; choose a new --out directory")
    verify_for_export(checkpoint)
    hf = checkpoint / "hf"
    if not (hf / "config.json").is_file():
        raise CheckpointError(f"{checkpoint}: no hf/config.json (this checkpoint holds no actor)")
    try:
        config = plain_config(AutoConfig.from_pretrained(hf))   # (checkpoints before the fix)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        adapters = checkpoint / ADAPTER_DIR
        if adapters.is_dir():   # a LoRA actor: load base + adapters, then merge them in
            model = wrap_like_checkpoint(model, adapters)
        state = {"actor": {"model": get_model_state_dict(model)}}
        with single_process_quiet():
            dcp.load(state, checkpoint_id=str(checkpoint / "dcp"), no_dist=True)
    except LOAD_ERRORS as err:   # a checkpoint without a manifest (older) can still be damaged
        raise CheckpointError(f"checkpoint {checkpoint}: cannot read the actor "
                              f"({first_line(err)})") from err
    set_model_state_dict(model, state["actor"]["model"])
    if adapters.is_dir():
        model = model.merge_and_unload()
    if dtype is not None:
        model = model.to(getattr(torch, dtype))
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    hf_logging.disable_progress_bar()   # one line says what was written, at the end
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        AutoTokenizer.from_pretrained(hf).save_pretrained(tmp)
        write_model_card(tmp / "README.md", checkpoint)
        apply_umask(tmp)   # safetensors writes 0600
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# The metrics a model card lists, when the step has them (and every val/*/score).
CARD_METRICS = ("reward/mean", "response/length/mean", "actor/kl", "actor/entropy")


def write_model_card(path: Path, checkpoint: Path) -> None:
    """README.md of an exported model (Hugging Face's model card): the base model, algorithm,
    data, step, the metrics of that step and the command that trains it again, from the run
    directory the checkpoint belongs to (what the checkpoint alone knows, when it is kept
    elsewhere)."""
    import json

    import yaml

    from dagrl.observe.run_files import read_jsonl

    step = json.loads((checkpoint / STATE_FILE).read_text()).get("step")
    run_dir = checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else None
    config_file = run_dir / "config.yaml" if run_dir is not None else None
    cfg = yaml.safe_load(config_file.read_text()) if config_file and config_file.is_file() else {}
    model, data = cfg.get("model", {}), cfg.get("data", {})
    base = model.get("path", "unknown") + (f" ({model['gguf_file']})" if model.get("gguf_file")
                                           else "")
    algorithm = cfg.get("algorithm", {}).get("name", "unknown")
    metrics: dict = {}
    if run_dir is not None and (run_dir / "metrics.jsonl").is_file():
        rows = [r for r in read_jsonl(run_dir / "metrics.jsonl").records if r.get("step") == step]
        metrics = rows[-1] if rows else {}
    shown = {k: v for k, v in metrics.items() if k in CARD_METRICS or (
        k.startswith("val/") and k.endswith("/score"))}
    lines = ["---", "library_name: transformers",
             f"tags: [dagrl, reinforcement-learning, {algorithm}]",
             *([f"base_model: {base}"] if "/" in base and not base.startswith(("builtin:", "/"))
               else []), "---", "",
             f"# {path.parent.name.lstrip('.').removesuffix('.tmp')}", "",
             f"Trained with [dagrl](https://github.com/dagrl/dagrl) ({algorithm}), exported from "
             f"checkpoint `{checkpoint.name}` (step {step}).", "",
             f"- base model: `{base}`", f"- algorithm: `{algorithm}`",
             f"- train data: {', '.join(f'`{f}`' for f in data.get('train_files', [])) or '?'}",
             f"- steps: {step} of {cfg.get('trainer', {}).get('total_steps', '?')}", ""]
    if shown:
        lines += ["| metric at this step | value |", "|---|---|",
                  *(f"| {k} | {v:.4g} |" for k, v in shown.items()
                    if isinstance(v, int | float)), ""]
    if config_file is not None and config_file.is_file():
        lines += ["Train it again with the run's config (below): `dagrl train config.yaml`", "",
                  "```yaml", config_file.read_text().rstrip(), "```", ""]
    path.write_text("\n".join(lines))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dagrl export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="checkpoint directory (step_<N>) or run dir")
    parser.add_argument("--out", type=Path, required=True, help="new HF model directory")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                        help="cast the weights (default: as trained, float32)")
    ns = parser.parse_args(argv)
    try:
        checkpoint = find_checkpoint(ns.checkpoint)
        path = export_checkpoint(checkpoint, ns.out, ns.dtype)
    except (CheckpointError, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"exported {checkpoint} -> {path}")
    return 0
