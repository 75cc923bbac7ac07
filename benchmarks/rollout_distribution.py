"""`dagrl bench rollout --distribution`: do dagrl's native decoder and transformers' `generate`
(what TRL samples with) draw from the same distribution?

    dagrl bench rollout --distribution                  # SmolLM2, 64 prompts x 4, T 0.7
    dagrl bench rollout --distribution --quick          # the tiny model

The learning bench's model and train prompts (benchmarks/learning_vs_trl.py: SmolLM2 on
gsm8k-synth-1step, chat template, up to 128 tokens at temperature 0.7, top-k and top-p off),
sampled by both, each sample then scored with the workload's reward and rescored by one forward
of the model at the same temperature. Printed per sampler: the samples' accuracy, mean length,
share ended by EOS, and the mean -log π of the sampled tokens beside π's mean entropy at the
same positions. For a sampler drawing from π the two are equal in expectation; one drawing from
a sharper distribution (a temperature applied twice, say) has the first well below the second.
The rest compares the two samplers' outputs, within their sampling noise.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from benchmarks.learning_vs_trl import WORKLOADS, Workload, write_workload


def padded_prompts(tokenizer, rows: list[dict], samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's prompt (dagrl's chat-template encoding, the tokens TRL renders too) `samples`
    times, left-padded: ids and mask [N, P]."""
    from dagrl.data.dataset import encode_prompt

    ids = [encode_prompt(tokenizer, row["prompt"]) for row in rows for _ in range(samples)]
    width = max(map(len, ids))
    prompt = torch.full((len(ids), width), tokenizer.pad_token_id)
    mask = torch.zeros(len(ids), width, dtype=torch.long)
    for i, x in enumerate(ids):
        prompt[i, width - len(x):], mask[i, width - len(x):] = torch.tensor(x), 1
    return prompt, mask


def generate_responses(model, tokenizer, prompt, mask, work: Workload, seed: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' sampling: responses and their mask [N, max_tokens], up to and with the
    first EOS, as TRL cuts them."""
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(input_ids=prompt, attention_mask=mask, do_sample=True,
                             temperature=work.temperature, top_k=0, top_p=1.0,
                             max_new_tokens=work.max_tokens, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id)
    responses = torch.full((len(prompt), work.max_tokens), tokenizer.pad_token_id)
    generated = out[:, prompt.shape[1]:]
    responses[:, :generated.shape[1]] = generated
    is_eos = responses == tokenizer.eos_token_id
    ends = torch.where(is_eos.any(1), is_eos.int().argmax(1), work.max_tokens)
    return responses, (torch.arange(work.max_tokens)[None] <= ends[:, None]).float()


def native_responses(model, tokenizer, prompt, mask, work: Workload, seed: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    from dagrl.rollout.native import NativeRollout
    from dagrl.rollout.sampling import SamplingParams

    engine = NativeRollout(model, eos_token_id=tokenizer.eos_token_id,
                           pad_token_id=tokenizer.pad_token_id)
    seeds = torch.arange(len(prompt)) + seed * len(prompt)
    out = engine.generate(prompt, mask, seeds, SamplingParams(temperature=work.temperature),
                          max_new_tokens=work.max_tokens)
    return out.responses, out.response_mask


@torch.no_grad()
def rescore(model, prompt, mask, responses, response_mask, temperature: float,
            rows: int = 16) -> tuple[float, float]:
    """Token means over the responses of -log π(sampled token) and of H(π), π = softmax(z / T)."""
    nll = entropy = 0.0
    for s in range(0, len(prompt), rows):
        ids = torch.cat([prompt[s:s + rows], responses[s:s + rows]], 1)
        attention = torch.cat([mask[s:s + rows], response_mask[s:s + rows].long()], 1)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=attention, position_ids=positions).logits
        logp = (logits[:, prompt.shape[1] - 1:-1].float() / temperature).log_softmax(-1)
        m = response_mask[s:s + rows]
        nll -= float((logp.gather(-1, responses[s:s + rows, :, None])[..., 0] * m).sum())
        entropy -= float(((logp.exp() * logp).sum(-1) * m).sum())
    tokens = float(response_mask.sum())
    return nll / tokens, entropy / tokens


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dagrl bench rollout --distribution",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--distribution", action="store_true", required=True)
    parser.add_argument("--quick", action="store_true", help="the tiny model")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("runs/bench-rollout-distribution"))
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    ns = parser.parse_args(argv)
    import pyarrow.parquet as pq
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dagrl.rewards.scorers import SCORERS

    work = WORKLOADS["tiny" if ns.quick else "smollm2"]
    torch.set_num_threads(work.threads)
    model_dir, train, _ = write_workload(ns.out, work)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = pq.read_table(train).slice(0, ns.prompts).to_pylist()
    truths = [row["reward_model"]["ground_truth"] for row in rows for _ in range(ns.samples)]
    prompt, mask = padded_prompts(tokenizer, rows, ns.samples)
    score = SCORERS.get(work.reward)
    print(f"{len(prompt)} samples ({ns.prompts} prompts x {ns.samples}), temperature "
          f"{work.temperature}, up to {work.max_tokens} tokens", flush=True)
    print("\n| sampler | accuracy | mean length | ended by EOS | -log π of sampled tokens | "
          "entropy of π there | seconds |")
    print("|---|---|---|---|---|---|---|")
    figures = {}
    for name, sample in (("dagrl native", native_responses),
                         ("transformers generate", generate_responses)):
        began = time.perf_counter()
        responses, response_mask = sample(model, tokenizer, prompt, mask, work, ns.seed)
        seconds = time.perf_counter() - began
        nll, entropy = rescore(model, prompt, mask, responses, response_mask, work.temperature)
        kept = response_mask.bool()
        texts = [tokenizer.decode(r[k], skip_special_tokens=True)
                 for r, k in zip(responses, kept, strict=True)]
        accuracy = sum(float(score(t, g)) for t, g in zip(texts, truths, strict=True)) / len(texts)
        ended = float(((responses == tokenizer.eos_token_id) & kept).any(1).float().mean())
        figures[name] = {"accuracy": accuracy, "mean_length": float(kept.sum(1).float().mean()),
                         "ended": ended, "nll": nll, "entropy": entropy, "seconds": seconds}
        f = figures[name]
        print(f"| {name} | {accuracy:.3f} | {f['mean_length']:.1f} | {ended:.3f} | {nll:.4f} | "
              f"{entropy:.4f} | {seconds:.0f} |", flush=True)
    if ns.json:
        ns.json.parent.mkdir(parents=True, exist_ok=True)
        ns.json.write_text(json.dumps(figures, indent=2))
    return 0
