"""How fast the tiny VLM learns the built-in picture tasks, without the trainer around it
(docs/vlm.md, "Learning"): the answer is one token, so a step is one forward of the prompts.

    python scripts/vlm_probe.py --task count                  # supervised: cross-entropy
    python scripts/vlm_probe.py --task count --grpo --ent 0.01  # GRPO on the same token

Supervised: cross-entropy of the answer digit at the last prompt position. GRPO: `--n`
samples of that token per prompt from softmax(z / T), reward 1 when it is the answer, the
group-normalised advantage, loss -A log pi (minus `--ent` times the entropy of pi). Prints
held-out greedy accuracy (argmax over the whole vocabulary) every 100 steps, and for GRPO the
mean reward of the last 100 steps. Prompts are rendered as the trainer renders them (the chat
template, the picture's image tokens expanded; data/vision.py).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch

from dagrl.data.images import IMAGE_PLACEHOLDER, decode_image
from dagrl.data.shapes import make_shapes
from dagrl.data.vision import IMAGE_BLOCK, ImageEncoder, ImageInputs
from dagrl.engines.models import load_model, load_tokenizer, write_tiny_model


def encoded_rows(path: Path, tokenizer, encoder: ImageEncoder) -> list[tuple]:
    """(prompt ids, ImageInputs, answer token) per row of a shapes parquet file."""
    rows = []
    for row in pq.read_table(path).to_pylist():
        messages = [{**m, "content": m["content"].replace(IMAGE_PLACEHOLDER, IMAGE_BLOCK)}
                    for m in row["prompt"]]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=False)
        images = encoder.encode([decode_image(row["images"][0])])
        ids = encoder.expand(tokenizer(text, add_special_tokens=False)["input_ids"], images)
        answer = tokenizer(row["reward_model"]["ground_truth"],
                           add_special_tokens=False)["input_ids"][0]
        rows.append((ids, images, answer))
    return rows


def last_logits(model, rows: list[tuple]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits at each left-padded prompt's last position [B, V], and the answers [B]."""
    width = max(len(r[0]) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (row_ids, _, _) in enumerate(rows):
        ids[i, width - len(row_ids):] = torch.tensor(row_ids)
        mask[i, width - len(row_ids):] = 1
    images = ImageInputs.concat([r[1] for r in rows])
    out = model(input_ids=ids, attention_mask=mask, pixel_values=images.pixel_values,
                image_grid_thw=images.image_grid_thw)
    return out.logits[:, -1].float(), torch.tensor([r[2] for r in rows])


def grpo_loss(model, rows: list[tuple], args) -> tuple[torch.Tensor, float]:
    with torch.no_grad():
        logits, answers = last_logits(model, rows)
        samples = torch.multinomial((logits / args.temperature).softmax(-1), args.n,
                                    replacement=True)                          # [B, n]
        reward = (samples == answers[:, None]).float()
        advantage = (reward - reward.mean(1, keepdim=True)) / (reward.std(1, keepdim=True)
                                                               + 1e-6)
    logits, _ = last_logits(model, rows)
    logp = logits.log_softmax(-1)
    entropy = -(logp.exp() * logp).sum(-1).mean()
    loss = -(advantage * logp.gather(1, samples)).mean() - args.ent * entropy
    return loss, reward.mean().item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", default="count", choices=["count", "quadrant", "colour"])
    p.add_argument("--distractors", type=int, default=3)
    p.add_argument("--blank", action="store_true", help="the blank-picture control")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=64, help="prompts per optimizer step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--grpo", action="store_true")
    p.add_argument("--n", type=int, default=8, help="GRPO: samples per prompt")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--ent", type=float, default=0.0, help="GRPO: entropy bonus")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.manual_seed(args.seed)
    work = Path(tempfile.mkdtemp(prefix="vlm-probe-"))
    path = write_tiny_model(work / "model", "tiny-qwen2.5-vl", seed=args.seed)
    tokenizer = load_tokenizer(str(path))
    model = load_model(str(path))
    encoder = ImageEncoder.of_model(path, tokenizer)
    files = make_shapes(work / "data", task=args.task, distractors=args.distractors,
                        blank=args.blank, seed=args.seed)
    train, test = (encoded_rows(files[s], tokenizer, encoder) for s in ("train", "test"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    draws = torch.Generator().manual_seed(args.seed)
    rewards: list[float] = []
    start = time.time()
    for step in range(1, args.steps + 1):
        rows = [train[i] for i in torch.randint(len(train), (args.batch,),
                                                generator=draws).tolist()]
        if args.grpo:
            loss, reward = grpo_loss(model, rows, args)
            rewards.append(reward)
        else:
            logits, answers = last_logits(model, rows)
            loss = torch.nn.functional.cross_entropy(logits, answers)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 100 == 0 or step == args.steps:
            with torch.no_grad():
                right = sum(int((lg.argmax(-1) == ans).sum()) for lg, ans in
                            (last_logits(model, test[i:i + 64]) for i in range(0, len(test), 64)))
            recent = rewards[-100:]
            extra = f" reward {sum(recent) / len(recent):.3f}" if recent else ""
            print(f"step {step} loss {loss.item():.3f} held-out {right / len(test):.3f}"
                  f"{extra} ({time.time() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
