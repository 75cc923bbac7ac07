"""dagrl's GRPO update beside TRL's on the same samples: is a step of learning the same step?

    dagrl bench learning --vs trl --update-parity              # SmolLM2-135M, 3 steps
    dagrl bench learning --vs trl --update-parity --quick      # the tiny model

`dagrl bench learning --vs trl` compares two learning curves, and two curves differ by their
samples as well as by their updates. This takes the samples out: dagrl trains the learning
workload's first --steps steps for real (its worker, rollout, reward, reference, advantage and
update nodes, the learning bench's settings), recording each step's prompts, completion
tokens, scores and advantages, and the gradient its optimizer steps with (after clipping).
TRL's GRPOTrainer, configured as in the learning bench, then trains on the same prompts in
the same order with its generation replaced by dagrl's completions (benchmarks/_trl_replay.py);
the rest is TRL's own: decoding, the reward function, group advantages, reference log-probs,
the loss, clipping, AdamW with the warm-up.

Printed per step: both sides' rewards and advantages (largest difference), pre-clip gradient
norms, and the gradient's cosine and relative difference |g_dagrl - g_TRL| / |g_TRL|; then the
same for the change of the weights over all steps. Equal updates show as a cosine of 1 to
float32 rounding; a different loss (aggregation, advantage scaling, temperature, KL term) shows
at once, because it changes the gradient's direction, not only its length.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks import e2e
from benchmarks.learning_vs_trl import WORKLOADS, Workload, ours_args, trl_args, write_workload

REPLAY_WORKER = Path(__file__).with_name("_trl_replay.py")


def run_ours(work: Workload, model: Path, train: Path, out: Path, steps: int) -> list[dict]:
    """dagrl's first `steps` steps; writes out/replay (the samples, each step's gradient, the
    final weights) and returns the steps' metrics."""
    import pyarrow.parquet as pq
    from safetensors.torch import save_file

    from dagrl.runtime.distributed import init_distributed
    from dagrl.runtime.run_dir import prepare_run
    from dagrl.runtime.worker import Worker
    from dagrl.train import load_cli_config

    replay = out / "replay"
    replay.mkdir(parents=True, exist_ok=True)
    cfg = load_cli_config([*ours_args(work, model, train, out / "run", steps),
                           "trainer.save_final=false"])
    worker = Worker(prepare_run(cfg), init_distributed("cpu"))
    actor = worker.engines.actor
    names = {p: n for n, p in actor.model.named_parameters()}

    def save_gradient(optimizer, args, kwargs) -> None:   # after clipping, before the step
        grads = {names[p]: p.grad.detach().contiguous() for group in optimizer.param_groups
                 for p in group["params"] if p.grad is not None}
        save_file(grads, str(replay / f"grads_{actor.version + 1}.safetensors"))

    actor.optimizer.register_step_pre_hook(save_gradient)
    batches = {}
    run_tasks = worker.run_tasks

    def recording(tasks, batch, step, metrics):
        batches[step] = out_batch = run_tasks(tasks, batch, step, metrics)
        return out_batch

    worker.run_tasks = recording
    history = worker.train()
    save_file({n: p.detach().contiguous() for n, p in actor.model.named_parameters()},
              str(replay / "final.safetensors"))
    table = pq.read_table(train, columns=["prompt", "reward_model"])
    steps_out = [replay_step(batches[step], table) for step in sorted(batches)]
    (replay / "replay.json").write_text(json.dumps({"steps": steps_out}))
    return history


def replay_step(batch, table) -> dict:
    """One step's samples as the replay reads them: its prompts in order (the dataset row, and
    the prompt tokens dagrl generated from) with their groups' completions, scores and
    advantages. A group is the consecutive rows of one uid."""
    rows, completions, scores, advantages = [], [], [], []
    mask, responses = batch["response_mask"].bool(), batch["responses"]
    first = mask.float().argmax(-1)   # GRPO's advantage is one value per sample
    previous = None
    for i, uid in enumerate(batch["uid"]):
        if uid != previous:
            row = table.slice(int(batch["row_index"][i]), 1).to_pylist()[0]
            prompt = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()].tolist()
            rows.append({"prompt": row["prompt"], "prompt_ids": prompt,
                         "ground_truth": row["reward_model"]["ground_truth"]})
            completions.append([])
            previous = uid
        completions[-1].append(responses[i][mask[i]].tolist())
        scores.append(float(batch["scores"][i]))
        advantages.append(float(batch["advantages"][i, first[i]]))
    # On-policy samples: the sampled tokens' mean -log pi equals the policy's mean entropy over
    # the same positions in expectation; a sampler sharper or flatter than pi (a temperature
    # applied twice, say) shows here, and a sharper one would learn faster and collapse sooner.
    nll = -float(batch["rollout_logprobs"][mask].mean())
    return {"rows": rows, "completions": completions, "scores": scores,
            "advantages": advantages, "sampled_nll": nll}


def run_trl(work: Workload, model: Path, train: Path, out: Path, trl_python: Path) -> dict:
    """TRL on dagrl's samples (benchmarks/_trl_replay.py); returns its comparison."""
    args = trl_args(work, model, train, out / "trl")
    args[0] = str(REPLAY_WORKER)
    result = out / "trl.json"
    args[args.index("--out") + 1] = str(result)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": str(work.threads)}
    with (out / "trl.log").open("w") as log:
        code = subprocess.call([str(trl_python), *args, "--replay", str(out / "replay")],
                               env=env, stdout=log, stderr=subprocess.STDOUT)
    if code != 0:
        tail = (out / "trl.log").read_text(errors="replace").splitlines()[-15:]
        raise SystemExit("\n".join(tail) + f"\nTRL's replay exited with status {code} "
                         f"(above: the end of {out / 'trl.log'})")
    return json.loads(result.read_text())


def similarity(sums: dict) -> tuple[float, float]:
    """(cosine, |ours - theirs| / |theirs|) from _trl_replay's sums."""
    norms = (sums["ours_sq"] * sums["theirs_sq"]) ** 0.5
    cosine = sums["dot"] / norms if norms else float("nan")
    rel = (sums["diff_sq"] / sums["theirs_sq"]) ** 0.5 if sums["theirs_sq"] else float("nan")
    return cosine, rel


def report(history: list[dict], replay: dict, trl: dict) -> dict:
    """Print the per-step table and the weight change; return every figure."""
    print("\n| step | dagrl's samples: -log pi / entropy | reward dagrl / TRL | advantages max "
          "abs diff | grad norm dagrl / TRL (pre-clip) | gradient cosine | gradient rel. diff "
          "| worst tensor (rel. diff) |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for k, (metrics, ours, theirs) in enumerate(
            zip(history, replay["steps"], trl["steps"], strict=True), start=1):
        cosine, rel = similarity(theirs["grad"])
        reward_ours = sum(ours["scores"]) / len(ours["scores"])
        reward_trl = sum(theirs["rewards"]) / len(theirs["rewards"])
        adv_diff = max(abs(a - b) for a, b in zip(ours["advantages"], theirs["advantages"],
                                                   strict=True))
        row = {"step": k, "sampled_nll": ours["sampled_nll"],
               "entropy": [metrics["actor/entropy"], theirs["entropy"]],
               "reward": [reward_ours, reward_trl],
               # dagrl keeps scores in float32, TRL's reward list is Python floats
               "score_max_abs_diff": max(abs(a - b) for a, b in zip(
                   ours["scores"], theirs["rewards"], strict=True)),
               "advantage_max_abs_diff": adv_diff,
               "grad_norm": [metrics["actor/grad_norm"], theirs["grad_norm"]],
               "grad_cosine": cosine, "grad_rel_diff": rel,
               "worst_tensor": [theirs["grad"]["worst_tensor"], theirs["grad"]["worst_rel"]]}
        rows.append(row)
        print(f"| {k} | {ours['sampled_nll']:.4f} / {row['entropy'][0]:.4f} | "
              f"{reward_ours:.3f} / {reward_trl:.3f} | {adv_diff:.2e} | "
              f"{row['grad_norm'][0]:.4f} / {row['grad_norm'][1]:.4f} | {cosine:.6f} | "
              f"{rel:.2e} | {row['worst_tensor'][0]} ({row['worst_tensor'][1]:.2e}) |")
    cosine, rel = similarity(trl["weight_change"])
    print(f"\nweights after {len(rows)} step(s): change |dθ| dagrl "
          f"{trl['weight_change']['ours_sq'] ** 0.5:.4e}, TRL "
          f"{trl['weight_change']['theirs_sq'] ** 0.5:.4e}; cosine {cosine:.6f}, rel. diff "
          f"{rel:.2e} (worst tensor {trl['weight_change']['worst_tensor']}, "
          f"{trl['weight_change']['worst_rel']:.2e})")
    return {"steps": rows, "weight_change": {"cosine": cosine, "rel_diff": rel,
                                             "norm": [trl["weight_change"]["ours_sq"] ** 0.5,
                                                      trl["weight_change"]["theirs_sq"] ** 0.5]}}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dagrl bench learning --vs trl --update-parity",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vs", choices=("trl",), required=True)
    parser.add_argument("--update-parity", action="store_true", required=True)
    parser.add_argument("--workload", choices=tuple(WORKLOADS), default="smollm2")
    parser.add_argument("--quick", action="store_true", help="--workload tiny")
    parser.add_argument("--steps", type=int, default=3, help="steps compared (default 3)")
    parser.add_argument("--venv", type=Path, default=e2e.DEFAULT_VENV, help="TRL's venv")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-update-vs-trl"))
    parser.add_argument("--json", type=Path, help="also write every figure to this file")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    ns = parse_args(argv)
    base = WORKLOADS["tiny" if ns.quick else ns.workload]
    # Float32 on both sides: the comparison is of the arithmetic, not of bf16 rounding; no
    # checkpoints (every=0).
    work = dataclasses.replace(base, steps=ns.steps, every=0, precision="float32")
    trl_python = e2e.ensure_trl_venv(ns.venv)
    ns.out.mkdir(parents=True, exist_ok=True)
    model, train, _ = write_workload(ns.out, work)
    print(f"workload: {work}; load {os.getloadavg()[0]:.1f}", flush=True)
    history = run_ours(work, model, train, ns.out, ns.steps)
    gc.collect()   # dagrl's worker (a reference cycle) freed before TRL's process starts
    replay = json.loads((ns.out / "replay" / "replay.json").read_text())
    print(f"dagrl: {ns.steps} step(s) recorded; TRL replays them (log {ns.out / 'trl.log'})",
          flush=True)
    trl = run_trl(work, model, train, ns.out, trl_python)
    result = report(history, replay, trl)
    if ns.json:
        ns.json.parent.mkdir(parents=True, exist_ok=True)
        ns.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
