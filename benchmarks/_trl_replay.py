"""TRL's side of `dagrl bench learning --vs trl --update-parity`; run by the benchmark with the
TRL virtual environment's python.

    python _trl_replay.py --model DIR --data TRAIN.parquet --out RESULT.json \
        --replay DIR [the learning bench's TRL options]

--replay holds what dagrl's steps saw and did (benchmarks/update_vs_trl.py writes it):
replay.json (each step's prompts, completion tokens, scores and advantages),
grads_<step>.safetensors (the gradient dagrl's optimizer stepped with, after clipping) and
final.safetensors (dagrl's weights after the last step).

TRL's GRPOTrainer, configured exactly as the learning bench configures it (_trl_worker.py),
trains on those prompts in dagrl's order, with its generation replaced by dagrl's completions.
Everything after generation is TRL's own: decoding, the reward function, the group
advantages, the reference log-probs, the loss, clipping, AdamW and the warm-up. At each step,
just before the optimizer steps, its gradient is compared with dagrl's; after the last, its
change of the weights. Only sums (dot products, squared norms) are computed here, the verdict
is the benchmark's.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections import defaultdict, deque
from pathlib import Path

from _trl_worker import REWARDS, argument_parser, grpo_trainer


def replay_dataset(steps: list[dict]):
    """Every step's prompts, in order: with shuffle_dataset=False, TRL's step k takes rows
    [k·P, (k+1)·P), each repeated `samples` times, as dagrl's step k had them."""
    from datasets import Dataset

    rows = [row for step in steps for row in step["rows"]]
    return Dataset.from_dict({"prompt": [r["prompt"] for r in rows],
                              "ground_truth": [r["ground_truth"] for r in rows]})


def compare(ours: dict, theirs: dict) -> dict:
    """Sums for the cosine and the relative difference of two equal-keyed tensor dicts, and
    the tensor whose relative difference is largest."""
    dot = ours_sq = theirs_sq = diff_sq = 0.0
    worst, worst_rel = "", 0.0
    for name, t in theirs.items():
        o = ours[name].to(t.dtype)
        d = float((o - t).square().sum())
        t_sq = float(t.square().sum())
        dot += float((o * t).sum())
        ours_sq += float(o.square().sum())
        theirs_sq += t_sq
        diff_sq += d
        rel = (d / t_sq) ** 0.5 if t_sq > 0 else (0.0 if d == 0 else float("inf"))
        if rel > worst_rel:
            worst, worst_rel = name, rel
    return {"dot": dot, "ours_sq": ours_sq, "theirs_sq": theirs_sq, "diff_sq": diff_sq,
            "worst_tensor": worst, "worst_rel": worst_rel}


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser()
    parser.add_argument("--replay", required=True, help="the directory dagrl's side wrote")
    ns = parser.parse_args(argv)
    ns.save_every = 0   # nothing to resume: the replay is a few steps

    import torch

    torch.set_num_threads(ns.threads)
    from safetensors.torch import load_file
    from transformers import TrainerCallback
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    replay_dir = Path(ns.replay)
    steps = json.loads((replay_dir / "replay.json").read_text())["steps"]
    ns.steps = len(steps)

    # The completions of each prompt, in dagrl's order: TRL's k-th copy of a prompt in a batch
    # gets the k-th completion of dagrl's group.
    queued: dict[tuple[int, ...], deque] = defaultdict(deque)
    for step in steps:
        for row, completions in zip(step["rows"], step["completions"], strict=True):
            queued[tuple(row["prompt_ids"])].extend(completions)

    def replayed_generation(prompt_ids, *args, **kwargs):
        completions = []
        for ids in prompt_ids:
            key = tuple(int(t) for t in ids)
            if not queued.get(key):
                raise RuntimeError("TRL tokenised a prompt to ids dagrl never generated for: "
                                   f"{list(key)[-12:]} (last 12): the two sides' prompt "
                                   "tokens differ")
            completions.append(list(queued[key].popleft()))
        return completions, None

    record: dict[str, list] = {"rewards": [], "advantages": [], "loss": []}
    reward_rule = REWARDS[ns.reward]

    def recorded_reward(completions, ground_truth, **kwargs):
        rewards = reward_rule(completions, ground_truth, **kwargs)
        record["rewards"].append([float(r) for r in rewards])
        return rewards

    recorded_reward.__name__ = reward_rule.__name__

    class Probe(TrainerCallback):
        """The gradient just before each optimizer step (after TRL's clipping), against
        dagrl's at the same step; TRL's logged pre-clip norm."""

        def __init__(self) -> None:
            self.grads: list[dict] = []
            self.logs: list[dict] = []

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            ours = load_file(str(replay_dir / f"grads_{state.global_step + 1}.safetensors"))
            theirs = {n: p.grad.detach() for n, p in model.named_parameters()
                      if p.grad is not None}
            missing = sorted(set(ours) ^ set(theirs))
            if missing:
                raise RuntimeError(f"parameters on one side only: {missing[:5]}")
            self.grads.append(compare(ours, theirs))

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                self.logs.append(dict(logs))

    probe = Probe()
    with tempfile.TemporaryDirectory(prefix="dagrl-trl-replay-") as out_dir:
        trainer = grpo_trainer(ns, out_dir, replay_dataset(steps), [probe],
                               reward_func=recorded_reward, shuffle=False)
        trainer._generate_single_turn = replayed_generation
        score = trainer._generate_and_score_completions
        compute_loss = trainer._compute_loss

        def recorded_scoring(generation_batch):   # the advantages in generation order
            scored = score(generation_batch)
            record["advantages"].append(scored["advantages"].reshape(-1).tolist())
            return scored

        def recorded_loss(model, inputs):
            loss = compute_loss(model, inputs)
            record["loss"].append(float(loss.detach()))
            return loss

        trainer._generate_and_score_completions = recorded_scoring
        trainer._compute_loss = recorded_loss
        initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.train()
        ours_final = load_file(str(replay_dir / "final.safetensors"))
        ours_change = {n: ours_final[n] - w for n, w in initial.items()}
        theirs_change = {n: p.detach() - initial[n]
                         for n, p in trainer.model.named_parameters()}
        weights = compare(ours_change, theirs_change)

    result = {"steps": [{"grad": g, "grad_norm": log.get("grad_norm"), "loss": loss,
                         "kl": log.get("kl"), "entropy": log.get("entropy"),
                         "rewards": rewards, "advantages": adv}
                        for g, log, loss, rewards, adv in zip(
                            probe.grads, probe.logs, record["loss"], record["rewards"],
                            record["advantages"], strict=True)],
              "weight_change": weights}
    Path(ns.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
