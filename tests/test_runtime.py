"""The multi-worker runtime end to end: torchrun and Ray launch the same workers, N workers
reproduce a 1-worker run, a failing worker stops the run with its error, and the distributed
dataloader gives each rank a disjoint, resumable shard."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from dagrl.config.loader import load_config
from dagrl.config.schema import Config
from dagrl.runtime.launch import launch
from tests.dist_helpers import free_port, run_distributed

FAST = ["logging.progress_bar=false", "logging.console_every=1000"]
COMPARED = ["reward/mean", "reward/std", "response/length/mean", "actor/pg_loss", "actor/kl",
            "actor/entropy", "actor/grad_norm", "actor/clip_frac"]


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def one_worker_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("one") / "run"
    cfg = load_config(Config, None, [f"trainer.run_dir={run_dir}", "trainer.total_steps=3", *FAST])
    launch(cfg)
    return metrics(run_dir)


def assert_same_run(ours, reference, rel=1e-4):
    assert [m["step"] for m in ours] == [m["step"] for m in reference]
    for a, b in zip(ours, reference, strict=True):
        for key in COMPARED:
            assert a[key] == pytest.approx(b[key], rel=rel, abs=1e-6), (a["step"], key)


def test_torchrun_two_workers_match_one_worker_with_reward_on_one_rank_and_memory_features(
        tmp_path, one_worker_run):
    # The reward node runs on rank 0 only: samples are resharded there and back every step.
    graph = tmp_path / "grpo_subset.yaml"
    graph.write_text(textwrap.dedent("""
        name: grpo_reward_on_rank0
        nodes:
          - {id: rollout, role: rollout}
          - {id: reward, role: reward, deps: [rollout], options: {ranks: [0]}}
          - {id: old_logprob, role: old_logprob, deps: [rollout]}
          - {id: ref_logprob, role: ref_logprob, deps: [rollout]}
          - {id: advantage, role: advantage, deps: [reward]}
          - {id: actor_update, role: actor_update, deps: [advantage, old_logprob, ref_logprob]}
    """))
    run_dir = tmp_path / "two"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), "-m", "dagrl.train", f"trainer.run_dir={run_dir}",
           "trainer.n_workers=2", "trainer.total_steps=3", f"dag.graph={graph}", *FAST,
           # memory features under FSDP2: layers recomputed in backward, the LM head in chunks
           # of 100 tokens (one worker's run has neither); the numbers must not move
           "actor.activation_checkpointing=true", "actor.logits_chunk_tokens=100",
           "ref.logits_chunk_tokens=100"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours = metrics(run_dir)
    assert_same_run(ours, one_worker_run)
    # no rank ever held the global batch, except rank 0 for the one node placed on it alone
    assert one_worker_run[0]["batch/max_samples_per_rank"] == 256 == ours[0]["batch/samples"]
    assert "timing/reshard_reward_s" in ours[0] and "timing/balance_actor_update_s" in ours[0]


@pytest.mark.slow
def test_ray_two_workers_match_and_a_failing_worker_stops_the_run(tmp_path, one_worker_run,
                                                                   capfd):
    from dagrl.runtime.failures import WorkerFailed

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    run_dir = tmp_path / "ray"
    cfg = load_config(Config, None, [f"trainer.run_dir={run_dir}", "trainer.n_workers=2",
                                     "trainer.total_steps=3", *FAST])
    history = launch(cfg)
    # the driver receives only the reduced metrics, never sample data
    assert all(isinstance(v, float) for step in history for v in step.values())
    assert_same_run(metrics(run_dir), one_worker_run)
    assert metrics(run_dir)[0]["batch/max_samples_per_rank"] == 128   # half of 32 prompts x 8
    # The driver draws the step lines from metrics.jsonl: no worker prints (and Ray forwards,
    # prefixed with the worker's pid) a console of its own.
    lines = capfd.readouterr().out.splitlines()
    assert any(line.startswith("step 1: reward=") for line in lines), lines
    assert not any("step 1:" in line and "pid=" in line for line in lines), lines
    # ... and prints the lines the lead wrote (to a file the driver named), without Ray's prefix
    assert any(line.startswith("[dagrl] pre-flight: train prompts ok") for line in lines), lines
    assert not any("pid=" in line for line in lines), lines

    bad = tmp_path / "rank1_fails.py"
    bad.write_text("import os\n"
                   "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                   "    if os.environ['RANK'] == '1':\n"
                   "        raise RuntimeError('scorer crashed on rank 1')\n"
                   "    return 0.0\n")
    cfg = load_config(Config, None, [f"trainer.run_dir={tmp_path / 'fail'}", "trainer.n_workers=2",
                                     "trainer.total_steps=3",
                                     f"reward.custom_fn={bad}:compute_score", *FAST])
    start = time.monotonic()
    with pytest.raises(WorkerFailed) as err:
        launch(cfg)
    assert "rank 1" in str(err.value) and "scorer crashed on rank 1" in str(err.value)
    assert time.monotonic() - start < 120     # the surviving worker was stopped, not waited for


def _loader_shards(rank, world, files, restore_at):
    from dagrl.data.dataset import PromptLoader
    from dagrl.data.parquet import ParquetPrompts
    from dagrl.engines.models import build_char_tokenizer

    tok = build_char_tokenizer()

    def make(shuffle=True):
        return PromptLoader(ParquetPrompts(files), tok, batch_size=32, rank=rank,
                            world_size=world, seed=5, shuffle=shuffle, max_prompt_length=16)

    loader = make()
    epoch0 = [loader.next_batch()["row_index"].tolist() for _ in range(loader.batches_per_epoch)]
    loader = make()
    for _ in range(restore_at):
        loader.next_batch()
    state = loader.state_dict()
    expected = [loader.next_batch()["row_index"].tolist() for _ in range(6)]
    restored = make()
    restored.load_state_dict(state)
    resumed = [restored.next_batch()["row_index"].tolist() for _ in range(6)]
    ordered = make(shuffle=False)
    ordered.next_batch()
    return epoch0, expected, resumed, ordered.source.row_groups_read


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_dataloader_shards_are_disjoint_cover_the_epoch_and_resume(world, arith_files):
    files = [str(arith_files["train"])]    # 400 rows in row groups of 64
    results = run_distributed(_loader_shards, world, files, 10)
    per_rank_rows = [sorted(r for batch in res[0] for r in batch) for res in results]
    everything = sorted(r for rows in per_rank_rows for r in rows)
    assert len(everything) == len(set(everything)) == 12 * 32      # disjoint, 16 dropped (tail)
    for res in results:
        assert res[2] == res[1]                 # restored mid-epoch: same order, across the epoch
        assert res[3] == 1                      # unshuffled: a rank's 32/W rows are in 1 row group
    # the global order does not depend on the number of workers
    single = _loader_shards(0, 1, files, 10)[0]
    assert [list(itertools.chain.from_iterable(results[r][0][b] for r in range(world)))
            for b in range(12)] == single


def test_plan_shows_balance_and_reshards(capsys):
    from dagrl.cli import main

    assert main(["plan", "trainer.n_workers=2"]) == 0
    out = capsys.readouterr().out
    assert "rank 1:" in out and "balance tokens over ranks 0,1 (before actor_update)" in out
