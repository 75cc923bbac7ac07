"""trainer.mode=async with the features of a sync run, 2 CPU workers under torchrun. With
max_staleness=0 an async run reproduces the sync run, so each composition is checked against a
1-worker sync run of the same config:

- an agent (multi-turn tool calls: gapped masks and turn fields through the async buffer) with
  validation (on the trainer ranks, with their own rollout engine refreshed at validation
  steps) and the profiler (one merged trace of both sides);
- DAPO's filter (on the rollout side, where `more()` reads fresh prompts) with a reward model
  (scoring on the rollout side);
- an agent on an image-text model (each episode's pictures, read again by every turn, cross
  the async buffer with its turns).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from dagrl.runtime.launch import launch
from dagrl.train import load_cli_config
from tests.dist_helpers import free_port
from tests.test_async_runs import FAST, metrics

# Minutes of runs: with the composition matrix (`pytest -m composition`, .ci/slow).
pytestmark = pytest.mark.composition

ROOT = Path(__file__).parents[1]
COMPARED = ["reward/mean", "reward/std", "response/length/mean", "actor/pg_loss",
            "actor/grad_norm"]
# examples/tool_calc.yaml, smaller.
AGENT = [str(ROOT / "examples" / "tool_calc.yaml"), "data.train_batch_size=8",
         "actor.mini_batch_size=8", "rollout.n=4", "trainer.total_steps=3",
         "data.val_files=[builtin:tool-calc]", "trainer.val_every=2", "rollout.val_n=1",
         "profiler.enable=true", "profiler.steps=[2]", "algorithm.kl_loss_coef=0"]
# tests/test_vision_multi_turn.py's run: the picture task, 3 turns with an environment.
VISION_AGENT = ["model.path=builtin:tiny-qwen2.5-vl", "data.train_files=[builtin:shapes]",
                "data.val_files=[]", "data.max_prompt_length=128", "data.train_batch_size=8",
                "actor.mini_batch_size=8", "rollout.n=4", "trainer.total_steps=3",
                "trainer.save_final=false", "rollout.max_new_tokens=32",
                "rollout.multi_turn.enable=true", "rollout.multi_turn.environment=guess_number",
                "rollout.multi_turn.max_turns=3", "rollout.multi_turn.max_tokens_per_turn=2",
                "rollout.multi_turn.format=tiny"]
FILTERED = ["algorithm.name=dapo", "reward.source=reward_model",
            "reward_model.path=builtin:tiny-digit-rm", "data.train_batch_size=8",
            "actor.mini_batch_size=8", "rollout.n=4", "trainer.total_steps=3"]


def sync_one_worker(run_dir: Path, args: list[str]) -> list[dict]:
    """The config as `dagrl train` reads it (algorithm.name's preset applied), one worker."""
    launch(load_cli_config([*args, f"trainer.run_dir={run_dir}", *FAST]))
    return metrics(run_dir)


def async_torchrun(run_dir: Path, args: list[str]) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), "-m", "dagrl.train", *args,
           f"trainer.run_dir={run_dir}", "trainer.n_workers=2", "trainer.mode=async",
           "rollout.max_staleness=0", *FAST]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return metrics(run_dir)


def assert_same(ours: list[dict], reference: list[dict], keys: list[str]) -> None:
    assert [m["step"] for m in ours] == [m["step"] for m in reference]
    for a, b in zip(ours, reference, strict=True):
        assert a["async/staleness_max"] == 0
        for key in keys:
            assert math.isfinite(a[key]), (a["step"], key)
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["step"], key)


def test_async_agent_with_validation_and_profiler_reproduces_sync(tmp_path):
    reference = sync_one_worker(tmp_path / "sync", AGENT)
    run_dir = tmp_path / "async"
    ours = async_torchrun(run_dir, AGENT)
    assert_same(ours, reference, COMPARED + ["tools/calls_mean", "multi_turn/turns_mean"])
    # Validation ran on the trainer rank at the sync run's steps, with the same weights.
    validated = [m["step"] for m in ours if "val/tool_calc/score" in m]
    assert validated == [2, 3]
    for a, b in zip(ours[1:], reference[1:], strict=True):
        assert a["val/tool_calc/score"] == pytest.approx(b["val/tool_calc/score"], abs=1e-9)
    # The agent made tool calls (the fields of its episodes crossed the buffer).
    assert sum(m["tools/calls_mean"] for m in ours) > 0
    # One merged trace: the trainer rank's update and the rollout rank's generation.
    trace = json.loads((run_dir / "profile" / "trace.json").read_text())
    spans = {(e["pid"], e["name"]) for e in trace["traceEvents"]
             if e.get("cat") == "user_annotation"}
    assert (0, "node:actor_update") in spans and (1, "node:rollout") in spans, spans


def test_async_dapo_filter_with_a_reward_model_reproduces_sync(tmp_path):
    reference = sync_one_worker(tmp_path / "sync", FILTERED)
    ours = async_torchrun(tmp_path / "async", FILTERED)
    assert_same(ours, reference, COMPARED + ["filter/keep_rate", "filter/rounds"])


def test_async_agent_on_an_image_text_model_reproduces_sync(tmp_path):
    reference = sync_one_worker(tmp_path / "sync", VISION_AGENT)
    ours = async_torchrun(tmp_path / "async", VISION_AGENT)
    assert_same(ours, reference, COMPARED + ["multi_turn/turns_mean", "actor/entropy"])
    # Episodes went on after the environment's first answer: later turns read the picture.
    assert all(m["multi_turn/turns_mean"] > 1.5 for m in ours)
