"""trainer.mode=async end to end, 2 CPU workers: with max_staleness=0 it reproduces a sync run;
under torchrun a run whose trainer rank is killed (SIGKILL) resumes from its checkpoint, with the
rollout correction (TIS) applied to its stale batches; under Ray a rollout rank or a trainer rank
killed with SIGKILL is survived (trainer.max_restarts); the data order holds through all of them
(every step trains on the prompts of its global batch: none twice, none dropped)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from dagrl.config.loader import load_config
from dagrl.config.schema import Config
from dagrl.runtime.launch import launch
from tests.dist_helpers import free_port

FAST = ["logging.progress_bar=false", "logging.console_every=1000", "trainer.torch_threads=1"]
SMALL = ["data.train_batch_size=8", "actor.mini_batch_size=8", "rollout.n=4",
         "algorithm.kl_loss_coef=0"]
COMPARED = ["reward/mean", "reward/std", "response/length/mean", "actor/pg_loss",
            "actor/entropy", "actor/grad_norm", "actor/clip_frac"]

RECORDER = textwrap.dedent('''
    """A trainer-side node that records which prompts each step trains on, and kills its own
    process (SIGKILL: no cleanup, as the OOM killer would) in step KILL_STEP, once."""
    import json
    import os
    import signal

    from dagrl import register_role


    @register_role("ROLE")
    def record_rows(ctx, batch):
        path = os.path.join(ctx.config.trainer.run_dir, f"rows-rank{ctx.rank}.jsonl")
        with open(path, "a") as f:
            f.write(json.dumps({"step": ctx.step,
                                "rows": sorted(set(batch["row_index"].tolist()))}) + "\\n")
        if ctx.step == KILL_STEP and not os.path.exists(MARKER):
            open(MARKER, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return batch
''')
GRAPH = textwrap.dedent("""
    name: grpo_recorded
    nodes:
      - {id: rollout, role: rollout}
      - {id: reward, role: reward, deps: [rollout]}
      - {id: record, role: ROLE, deps: [reward]}
      - {id: old_logprob, role: old_logprob, deps: [record]}
      - {id: advantage, role: advantage, deps: [old_logprob]}
      - {id: actor_update, role: actor_update, deps: [advantage]}
""")


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def torchrun(run_dir, *overrides, check=True):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), "-m", "dagrl.train", f"trainer.run_dir={run_dir}",
           "trainer.n_workers=2", *FAST, *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    if check:
        assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def recorded(tmp_path, kill_step: int = 0, role: str = "record_rows"):
    """Overrides adding the recording node; it kills its rank in step `kill_step` (0: never),
    leaving tmp_path/"killed" behind. `role`: its name (a process registers a name once, and
    the Ray driver imports the module too)."""
    code = RECORDER.replace("KILL_STEP", str(kill_step)).replace(
        "MARKER", repr(str(tmp_path / "killed"))).replace("ROLE", role)
    (tmp_path / "record.py").write_text(code)
    (tmp_path / "graph.yaml").write_text(GRAPH.replace("ROLE", role))
    return [f"dag.modules=[{tmp_path / 'record.py'}]", f"dag.graph={tmp_path / 'graph.yaml'}"]


def trained_rows(run_dir) -> dict[int, list[int]]:
    """The last record of each step (a step re-run after a resume replaces the earlier one)."""
    out: dict[int, list[int]] = {}
    for line in (run_dir / "rows-rank0.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = rec["rows"]
    return out


def expected_rows(run_dir, steps: int, batch: int) -> dict[int, list[int]]:
    from dagrl.data.dataset import PromptLoader
    from dagrl.data.parquet import ParquetPrompts
    from dagrl.engines.models import build_char_tokenizer

    source = ParquetPrompts([str(run_dir / "artifacts" / "arith-data" / "train.parquet")])
    loader = PromptLoader(source, build_char_tokenizer(), batch_size=batch,
                          seed=0, max_prompt_length=16)
    return {s: sorted(loader.next_batch()["row_index"].tolist()) for s in range(1, steps + 1)}


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("sync") / "run"
    launch(load_config(Config, None, [f"trainer.run_dir={run_dir}", "trainer.total_steps=4",
                                      *FAST, *SMALL]))
    return metrics(run_dir)


def test_async_with_staleness_0_reproduces_sync_and_resumes_exactly(tmp_path, sync_run):
    run_dir = tmp_path / "async"
    torchrun(run_dir, "trainer.mode=async", "rollout.max_staleness=0", "trainer.total_steps=4",
             *SMALL)
    ours = metrics(run_dir)
    assert [m["step"] for m in ours] == [1, 2, 3, 4]
    for a, b in zip(ours, sync_run, strict=True):
        assert a["async/staleness_max"] == 0
        for key in COMPARED:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["step"], key)

    # Killed after the checkpoint of step 2 (a scorer that fails once, in step 4), resumed:
    # with staleness 0 nothing in flight depends on timing, so the metrics are the same again.
    fail = tmp_path / "fail_once.py"
    marker = tmp_path / "failed"
    fail.write_text(textwrap.dedent(f"""
        import os
        from dagrl.rewards.scorers import arith_score
        calls = 0
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            global calls
            calls += 1
            if calls > 96 and not os.path.exists({str(marker)!r}):   # step 4 (32 samples/step)
                open({str(marker)!r}, "w").close()
                raise RuntimeError("scorer crashed once")
            return arith_score(solution_str, ground_truth, extra_info)
    """))
    resumed_dir = tmp_path / "resumed"
    args = ["trainer.mode=async", "rollout.max_staleness=0", "trainer.total_steps=4",
            "trainer.save_every=2", f"reward.custom_fn={fail}:compute_score", *SMALL]
    proc = torchrun(resumed_dir, *args, check=False)
    assert proc.returncode != 0 and marker.exists()
    assert len(metrics(resumed_dir)) == 3
    again = torchrun(resumed_dir, *args)
    assert "resumed from" in again.stdout and "step 2" in again.stdout
    resumed = metrics(resumed_dir)
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    for a, b in zip(resumed, ours, strict=True):
        for key in COMPARED:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["step"], key)


@pytest.mark.slow
def test_torchrun_async_trainer_killed_resumes_and_trains_every_prompt_once(tmp_path):
    # max_staleness=1 with TIS: rank 0 (the trainer) dies by SIGKILL in step 5, after the
    # checkpoint of step 4, while the rollout rank is already generating ahead; torchrun stops
    # the run. Launched again, it resumes from step 4 and regenerates what was in flight.
    run_dir, steps = tmp_path / "run", 6
    args = ["trainer.mode=async", "rollout.max_staleness=1", f"trainer.total_steps={steps}",
            "trainer.save_every=2", "algorithm.rollout_correction.rollout_is=token",
            "algorithm.rollout_correction.rollout_is_threshold=1.05", *SMALL,
            *recorded(tmp_path, kill_step=5)]
    proc = torchrun(run_dir, *args, check=False)
    assert proc.returncode != 0 and (tmp_path / "killed").exists()
    assert [m["step"] for m in metrics(run_dir)] == [1, 2, 3, 4]
    again = torchrun(run_dir, *args)
    assert "resumed from" in again.stdout and "step 4" in again.stdout
    records = metrics(run_dir)
    assert [m["step"] for m in records] == list(range(1, steps + 1))
    assert all(m["async/staleness_max"] <= 1 for m in records)
    assert trained_rows(run_dir) == expected_rows(run_dir, steps, batch=8)
    # The batch regenerated after the resume was drawn by the checkpoint's weights: on-policy.
    assert records[4]["async/staleness_max"] == 0
    # The correction ran on every step (old_logprob on the trainer: weights pi_old / pi_rollout
    # truncated at 1.05): about 1 and never truncated where every token is on-policy (rollout
    # and trainer compute the same log-probs), truncated somewhere where tokens are 1 version old.
    for m in records:
        assert 0 < m["rollout_corr/is_weight_mean"] <= 1.05
        if m["async/staleness_max"] == 0:
            assert m["rollout_corr/is_weight_mean"] == pytest.approx(1.0, abs=1e-3)
            assert m["rollout_corr/is_clipped_fraction"] == 0
        else:
            assert 0 < m["rollout_corr/is_clipped_fraction"] < 1


@pytest.mark.slow
@pytest.mark.parametrize("dies", ["rollout", "trainer"])
def test_ray_async_survives_a_rank_killed_mid_run(tmp_path, dies):
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    steps = 6
    marker = tmp_path / "killed"
    overrides = []
    if dies == "rollout":
        killer = tmp_path / "kill_rollout.py"
        killer.write_text(textwrap.dedent(f"""
            import os, signal
            from dagrl.rewards.scorers import arith_score
            calls = 0
            def compute_score(data_source, solution_str, ground_truth, extra_info=None):
                global calls
                calls += 1
                # rank 1 is the rollout rank; in its 5th batch (32 samples each), once
                once = not os.path.exists({str(marker)!r})
                if os.environ.get("RANK") == "1" and calls > 128 and once:
                    open({str(marker)!r}, "w").close()
                    os.kill(os.getpid(), signal.SIGKILL)
                return arith_score(solution_str, ground_truth, extra_info)
        """))
        overrides = [f"reward.custom_fn={killer}:compute_score",
                     *recorded(tmp_path, role="record_rows_r")]
    else:   # rank 0, the trainer (and the rank that logs), in step 5
        overrides = recorded(tmp_path, kill_step=5, role="record_rows_t")
    run_dir = tmp_path / "run"
    cfg = load_config(Config, None, [
        f"trainer.run_dir={run_dir}", "trainer.n_workers=2", "trainer.mode=async",
        "rollout.max_staleness=1", f"trainer.total_steps={steps}", "trainer.save_every=2",
        "trainer.max_restarts=1", *FAST, *SMALL, *overrides])
    history = launch(cfg)
    assert marker.exists()                                    # it did die once
    assert len(history) < steps                 # the last attempt resumed from a checkpoint
    records = metrics(run_dir)
    assert [m["step"] for m in records] == list(range(1, steps + 1))
    assert all(m["async/staleness_max"] <= 1 for m in records)
    # every step trained on exactly its global batch's prompts: none twice, none dropped
    assert trained_rows(run_dir) == expected_rows(run_dir, steps, batch=8)


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun"])
def test_async_learns_the_default_task_within_the_staleness_bound(tmp_path, launcher):
    # The acceptance command: the default task, 2 workers, max_staleness=1, 60 steps.
    # Under torchrun only: Ray's async runs are the composition matrix's (parity) and the
    # kill tests above (staleness 1); the learning is the same code on either launcher.
    run_dir = tmp_path / "run"
    args = ["trainer.mode=async", "rollout.max_staleness=1"]
    if launcher == "torchrun":
        torchrun(run_dir, *args)
    else:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        launch(load_config(Config, None, [f"trainer.run_dir={run_dir}", "trainer.n_workers=2",
                                          *args, *FAST]))
    records = metrics(run_dir)
    assert [m["step"] for m in records] == list(range(1, 61))
    rewards = [m["reward/mean"] for m in records]
    assert sum(rewards[-10:]) / 10 >= sum(rewards[:10]) / 10 + 0.1
    assert all(m["async/staleness_max"] <= 1 for m in records)
    assert max(m["async/staleness_max"] for m in records) == 1     # it did run off-policy
    assert all(m["async/trainer_wait_s"] >= 0 and m["async/rollout_wait_s"] >= 0
               for m in records)
