"""Export a checkpoint's actor as a Hugging Face model directory (safetensors + tokenizer).

    dagrl export runs/grpo-20261122-101500/checkpoints/step_00000060 --out my-model
    dagrl export runs/grpo-20261122-101500 --out my-model     # the run's newest checkpoint

The result loads with `AutoModelForCausalLM.from_pretrained(DIR)` and `AutoTokenizer`. The
weights are read from the checkpoint's DCP shards in one process, whatever the number of
workers that wrote them; the model config and tokenizer come from the checkpoint's `hf/`. A
LoRA actor's adapters (config in the checkpoint's `lora/`) are merged into the weights.
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
from dagrl.runtime.checkpoint import (
    STATE_FILE,
    CheckpointError,
    latest_checkpoint,
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
                          "directory with checkpoints/step_<N>)")


def export_checkpoint(checkpoint: Path, out: Path, dtype: str | None = None) -> Path:
    """Write the actor of `checkpoint` to `out` as a HF model directory. `out` appears only
    when complete (written beside it, then renamed); an existing `out` is an error."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    checkpoint, out = find_checkpoint(Path(checkpoint)), Path(out)
    if out.exists():
        raise FileExistsError(f"{out} already exists; choose a new --out directory")
    hf = checkpoint / "hf"
    if not (hf / "config.json").is_file():
        raise CheckpointError(f"{checkpoint}: no hf/config.json (this checkpoint holds no actor)")
    config = plain_config(AutoConfig.from_pretrained(hf))   # (checkpoints before the fix)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    adapters = checkpoint / ADAPTER_DIR
    if adapters.is_dir():   # a LoRA actor: load base + adapters, then merge them in
        model = wrap_like_checkpoint(model, adapters)
    state = {"actor": {"model": get_model_state_dict(model)}}
    with single_process_quiet():
        dcp.load(state, checkpoint_id=str(checkpoint / "dcp"), no_dist=True)
    set_model_state_dict(model, state["actor"]["model"])
    if adapters.is_dir():
        model = model.merge_and_unload()
    if dtype is not None:
        model = model.to(getattr(torch, dtype))
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        AutoTokenizer.from_pretrained(hf).save_pretrained(tmp)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


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
