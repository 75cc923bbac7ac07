"""Checkpoints, exact and elastic resume, export, NaN stop, validation and worker restarts."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from dagrl.config.presets import load_run_config
from dagrl.config.schema import Config
from dagrl.file_modes import current_umask
from dagrl.runtime import checkpoint as ckpt
from dagrl.runtime.checkpoint import CheckpointError, list_checkpoints
from dagrl.runtime.launch import launch
from dagrl.runtime.run_dir import prepare_run
from dagrl.runtime.worker import Worker
from tests.dist_helpers import free_port

FAST = ["logging.progress_bar=false", "logging.console_every=1000", "trainer.torch_threads=1"]
# What a step computes; timings, memory and throughput differ from run to run.
VOLATILE = ("timing/", "throughput/", "memory/", "perf/")


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def stable(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(VOLATILE)}


def config(run_dir, *overrides) -> Config:
    return load_run_config(None, [f"trainer.run_dir={run_dir}", *FAST, *overrides])


class Crash(Exception):
    """Stands in for the process being killed."""


def crash_at(monkeypatch, step: int) -> None:
    real = Worker.run_step

    def run_step(self, s):
        if s == step:
            raise Crash(f"killed before step {s}")
        return real(self, s)

    monkeypatch.setattr(Worker, "run_step", run_step)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """14 steps of the default run: 400 rows / 32 prompts = 12 batches per epoch, so step 13 is
    the first of epoch 1."""
    run_dir = tmp_path_factory.mktemp("ref") / "run"
    launch(config(run_dir, "trainer.total_steps=14"))
    return metrics(run_dir)


@pytest.mark.parametrize("save_every,killed_at,total", [(3, 5, 6), (12, 13, 14)],
                         ids=["mid-epoch", "epoch-boundary"])
def test_killed_run_resumes_with_identical_metrics(tmp_path, monkeypatch, uninterrupted,
                                                   save_every, killed_at, total):
    run_dir = tmp_path / "run"
    crash_at(monkeypatch, killed_at)
    with pytest.raises(Crash):
        launch(config(run_dir, f"trainer.total_steps={total}", f"trainer.save_every={save_every}"))
    assert [s for s, _ in list_checkpoints(run_dir / "checkpoints")] == [save_every]
    assert len(metrics(run_dir)) == killed_at - 1     # the steps after the checkpoint ran too
    monkeypatch.undo()

    history = launch(config(run_dir, f"trainer.total_steps={total}",
                            f"trainer.save_every={save_every}"))
    assert len(history) == total - save_every          # resumed after the checkpoint
    resumed = metrics(run_dir)
    assert [r["step"] for r in resumed] == list(range(1, total + 1))   # re-run steps replaced
    for ours, ref in zip(resumed, uninterrupted[:total], strict=True):
        assert stable(ours) == stable(ref), ours["step"]


def test_ppo_resume_restores_the_critic_and_the_adaptive_kl_controller(tmp_path, monkeypatch):
    ppo = ["algorithm.name=ppo", "algorithm.kl_ctrl=adaptive", "trainer.total_steps=4"]
    reference = tmp_path / "reference"
    launch(config(reference, *ppo))
    run_dir = tmp_path / "run"
    crash_at(monkeypatch, 4)
    with pytest.raises(Crash):
        launch(config(run_dir, *ppo, "trainer.save_every=2"))
    monkeypatch.undo()
    state = json.loads((run_dir / "checkpoints" / "step_00000002" / "trainer_state.json")
                       .read_text())
    assert set(state["versions"]) == {"actor", "critic"} and state["kl_controller"]["value"] > 0
    launch(config(run_dir, *ppo, "trainer.save_every=2"))
    resumed, expected = metrics(run_dir), metrics(reference)
    assert "critic/vf_loss" in resumed[-1] and "actor/kl_coef" in resumed[-1]
    assert [stable(r) for r in resumed] == [stable(r) for r in expected]


def test_interrupted_checkpoint_write_leaves_the_previous_one_loadable(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    launch(config(run_dir, "trainer.total_steps=2", "trainer.save_every=2"))
    real_save = ckpt.dcp.save

    def disk_full(state, checkpoint_id, **kwargs):
        real_save(state, checkpoint_id=checkpoint_id, **kwargs)   # shards written, then...
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt.dcp, "save", disk_full)
    with pytest.raises(CheckpointError, match=r"step_00000004 failed .*No space left on device"
                                              r".*previous checkpoint .*step_00000002.* untouched"):
        launch(config(run_dir, "trainer.total_steps=4", "trainer.save_every=2"))
    root = run_dir / "checkpoints"
    assert [s for s, _ in list_checkpoints(root)] == [2]
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002"]   # no temporary left
    monkeypatch.undo()
    # The previous checkpoint still loads and training goes on from it.
    history = launch(config(run_dir, "trainer.total_steps=3"))
    assert len(history) == 1 and [r["step"] for r in metrics(run_dir)] == [1, 2, 3]


def test_keep_last_prunes_and_resume_never_starts_over(tmp_path):
    run_dir = tmp_path / "run"
    launch(config(run_dir, "trainer.total_steps=4", "trainer.save_every=1", "trainer.keep_last=2"))
    assert [s for s, _ in list_checkpoints(run_dir / "checkpoints")] == [3, 4]
    history = launch(config(run_dir, "trainer.total_steps=2", "trainer.resume=never"))
    assert len(history) == 2
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        launch(config(tmp_path / "other", f"trainer.resume={run_dir}"))


def test_nan_loss_stops_before_the_checkpoint_is_overwritten(tmp_path):
    run_dir = tmp_path / "run"
    # A huge learning rate makes the weights blow up in the first update: update 2 is NaN.
    with pytest.raises(FloatingPointError, match="actor update 2: gradient norm nan"):
        launch(config(run_dir, "trainer.total_steps=4", "trainer.save_every=1", "actor.lr=1e8",
                      "actor.grad_clip=0"))
    assert [s for s, _ in list_checkpoints(run_dir / "checkpoints")] == [1]
    assert [r["step"] for r in metrics(run_dir)] == [1]


def test_export_loads_in_transformers_and_generates_like_the_actor(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dagrl.export import export_checkpoint

    cfg = prepare_run(config(tmp_path / "run", "trainer.total_steps=3", "trainer.save_every=3"))
    worker = Worker(cfg)
    # What a GGUF load records; the trained weights are dense, so no file may carry it.
    gguf = {"quant_method": "gguf", "gguf_file": "model.gguf", "dequantize": False}
    worker.engines.actor.model.config.quantization_config = gguf
    worker.train()
    saved = json.loads(next((tmp_path / "run").rglob("hf/config.json")).read_text())
    assert "quantization_config" not in saved
    out = export_checkpoint(tmp_path / "run", tmp_path / "hf")
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    # readable as the umask says (safetensors writes 0600), with a model card beside the files
    mask = current_umask()
    assert {f.name: oct(f.stat().st_mode & 0o777) for f in out.iterdir()} == {
        f.name: oct(0o666 & ~mask) for f in out.iterdir()}
    card = (out / "README.md").read_text()
    assert "step 3" in card and "- algorithm: `grpo`" in card and "| reward/mean |" in card
    assert "dagrl train config.yaml" in card and "total_steps: 3" in card
    # a checkpoint written before that fix (and before manifests) still exports a plain model
    hf_config = next((tmp_path / "run").rglob("hf/config.json"))
    hf_config.write_text(json.dumps({**saved, "quantization_config": gguf}))
    (hf_config.parent.parent / "manifest.json").unlink()
    state_file = hf_config.parent.parent / "trainer_state.json"   # no format field then
    state_file.write_text(json.dumps({k: v for k, v in json.loads(state_file.read_text()).items()
                                      if k != "format"}))
    old = export_checkpoint(tmp_path / "run", tmp_path / "hf-old")
    assert "quantization_config" not in json.loads((old / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    actor = worker.engines.actor.model.eval()
    for (name, p), (_, q) in zip(actor.named_parameters(), model.named_parameters(), strict=True):
        assert torch.equal(p, q), name
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "3+4="}],
                                           add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    kwargs = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": tokenizer.pad_token_id}
    ours = model.generate(**prompt, **kwargs)
    with torch.no_grad():
        trained = actor.generate(**prompt, **kwargs)
    assert torch.equal(ours, trained)
    with pytest.raises(FileExistsError):
        export_checkpoint(tmp_path / "run", out)


def test_made_datasets_are_readable_as_the_umask_says(tmp_path):
    from dagrl.data.makers import make_arith

    for path in make_arith(tmp_path / "arith", seed=0).values():
        assert path.stat().st_mode & 0o777 == 0o666 & ~current_umask()   # mkstemp's is 0600


def test_a_default_run_can_be_exported(tmp_path, capsys):
    """No checkpoint key set: the run still ends with a checkpoint, which `dagrl export` reads;
    and the end of the run says so."""
    from dagrl.export import main as export_main

    run_dir = tmp_path / "run"
    launch(config(run_dir, "trainer.total_steps=2"))
    assert [s for s, _ in list_checkpoints(run_dir / "checkpoints")] == [2]
    assert f"dagrl export {run_dir} --out DIR" in capsys.readouterr().out
    assert export_main([str(run_dir), "--out", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "config.json").is_file()


def test_export_of_a_run_without_checkpoints_names_the_key(tmp_path, capsys):
    from dagrl.export import main as export_main

    launch(config(tmp_path / "run", "trainer.total_steps=1", "trainer.save_final=false"))
    capsys.readouterr()
    assert export_main([str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 2
    assert "unless trainer.save_final=false" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


def test_an_empty_val_files_turns_validation_off_and_says_so(tmp_path, capsys):
    run_dir = tmp_path / "run"
    launch(config(run_dir, "trainer.total_steps=2", "trainer.val_every=1",
                  "trainer.val_before_train=true", "data.val_files=[]",
                  "trainer.save_final=false"))
    printed = capsys.readouterr().out
    assert "validation off: data.val_files is empty" in printed
    # where the run writes, said when it starts and again when it ends
    assert f"[dagrl] run directory: {run_dir}\n" in printed
    assert f"[dagrl] done; run directory: {run_dir} (dagrl report {run_dir}; no checkpoint: " \
           "trainer.save_final=true writes one after the last step)" in printed
    assert [r["step"] for r in metrics(run_dir)] == [1, 2]
    assert not any(k.startswith("val/") for r in metrics(run_dir) for k in r)


def test_validation_shows_a_bar_of_its_own(tmp_path, capsys):
    launch(load_run_config(None, [f"trainer.run_dir={tmp_path / 'run'}", *FAST[1:],
                                  "trainer.total_steps=1", "trainer.val_before_train=true",
                                  "data.val_files=[builtin:arith]"]))   # the bar is on
    err = capsys.readouterr().err
    assert "validate" in err and "prompt" in err    # tqdm: "validate: ... 41/41 [...prompt/s]"


def test_validation_metrics_before_and_during_training(tmp_path):
    run_dir = tmp_path / "run"
    launch(config(run_dir, "trainer.total_steps=2", "trainer.val_every=2",
                  "trainer.val_before_train=true", "data.val_files=[builtin:arith]",
                  "rollout.val_n=3", "rollout.val_temperature=1.0", "logging.val_generations=4"))
    import pyarrow.parquet as pq

    records = {r["step"]: r for r in metrics(run_dir)}
    assert sorted(records) == [0, 1, 2]
    test_rows = pq.read_metadata(run_dir / "artifacts" / "arith-data" / "test.parquet").num_rows
    for step in (0, 2):
        r = records[step]
        assert r["val/samples"] == test_rows * 3      # every test row, val_n samples each
        assert 0 <= r["val/arith/score"] <= 1
        assert r["val/arith/score"] <= r["val/arith/pass@3"] or r["val/arith/pass@3"] == 0
        assert "val/arith/maj@3" in r
    assert "val/arith/score" not in records[1]

    # logging.val_generations=4: the first 4 samples of each validation as text, scored as the
    # scorer scores them; with val_n=3 the first three share their prompt.
    from dagrl.rewards.scorers import SCORERS

    samples = [json.loads(line)
               for line in (run_dir / "val_generations.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [0] * 4 + [2] * 4
    for s in samples:
        assert s["data_source"] == "arith" and s["prompt"].endswith("=")
        assert s["score"] == SCORERS.get("arith")(s["response"], s["ground_truth"])
    assert len({s["prompt"] for s in samples[:3]}) == 1 != len({s["prompt"] for s in samples[:4]})


def _torchrun(run_dir, *overrides, workers=2):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(workers),
           "--master-port", str(free_port()), "-m", "dagrl.train", f"trainer.run_dir={run_dir}",
           f"trainer.n_workers={workers}", *FAST, *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


COMPARED = ["reward/mean", "reward/std", "response/length/mean", "actor/pg_loss",
            "actor/entropy", "actor/grad_norm"]


def assert_close_runs(ours, reference):
    assert [m["step"] for m in ours] == [m["step"] for m in reference]
    for a, b in zip(ours, reference, strict=True):
        for key in COMPARED:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["step"], key)


@pytest.mark.slow
@pytest.mark.parametrize("before,after", [(2, 1), (1, 2)], ids=["2-to-1", "1-to-2"])
def test_elastic_resume_continues_the_run(tmp_path, uninterrupted, before, after):
    run_dir = tmp_path / "run"
    first = ["trainer.total_steps=2", "trainer.save_every=2"]
    if before == 1:
        launch(config(run_dir, *first))
    else:
        _torchrun(run_dir, *first, workers=before)
    # Validation runs distributed too: every test row exactly once over the workers.
    then = ["trainer.total_steps=4", "trainer.val_every=4", "data.val_files=[builtin:arith]"]
    if after == 1:
        launch(config(run_dir, *then))
    else:
        proc = _torchrun(run_dir, *then, workers=after)
        assert f"saved by {before} worker(s), now {after}" in proc.stdout
    # Same data order and the same training state: steps 3-4 match the uninterrupted 1-worker
    # run up to the float noise of a different reduction order (see test_runtime.py).
    assert_close_runs(metrics(run_dir), uninterrupted[:4])
    import pyarrow.parquet as pq

    test_rows = pq.read_metadata(run_dir / "artifacts" / "arith-data" / "test.parquet").num_rows
    assert metrics(run_dir)[-1]["val/samples"] == test_rows


@pytest.mark.slow
def test_ray_restarts_all_workers_from_the_last_checkpoint(tmp_path, capfd):
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    run_dir = tmp_path / "run"
    cfg = config(run_dir, "trainer.n_workers=2", "trainer.total_steps=12", "trainer.save_every=2",
                 "trainer.max_restarts=1")
    pid_file = run_dir / "workers" / "rank1.pid"
    killed: dict = {}

    def kill_rank1_after_first_checkpoint():
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if list_checkpoints(run_dir / "checkpoints") and pid_file.exists():
                os.kill(int(pid_file.read_text()), signal.SIGKILL)   # a worker dies mid-run
                killed["pid"] = int(pid_file.read_text())
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_rank1_after_first_checkpoint, daemon=True)
    killer.start()
    history = launch(cfg)
    killer.join()
    assert "pid" in killed and len(history) >= 1
    out = capfd.readouterr().out
    assert "restart 1/1" in out
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, 13))
    assert int(pid_file.read_text()) != killed["pid"]     # rank 1 is a new process
