"""The hardware limit of `dagrl bench e2e`: the FLOPs of a GRPO step of the workload, this
machine's matmul rate, and each role's share of the time that rate allows."""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from benchmarks.e2e import Workload


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the FLOP count needs of a decoder (Llama / Qwen2 layout)."""
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool

    @classmethod
    def of(cls, model_dir: Path) -> ModelShape:
        from transformers import AutoConfig

        c = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        return cls(c.hidden_size, c.num_hidden_layers, c.num_attention_heads,
                   c.num_key_value_heads, c.intermediate_size, c.vocab_size,
                   bool(c.tie_word_embeddings))


def matmul_gflops(threads: int, n: int = 1024, repeats: int = 20,
                  dtype: str = "float32") -> float:
    """Best GFLOP/s of an n x n matmul in `dtype` at `threads` threads (best, not mean: the
    limit is what the cores can do, and other load on the machine only lowers a sample)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    a, b = (torch.randn(n, n, dtype=getattr(torch, dtype)) for _ in range(2))
    try:
        torch.mm(a, b)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(previous)
    return 2 * n**3 / best / 1e9


def step_flops(work: Workload, prompt_tokens: float, shape: ModelShape, kl: bool) -> dict:
    """FLOPs of one GRPO step of useful work (no padding), float32, counting multiply-adds as 2.

    P = matmul weights a token passes through = layers * (2 H^2 [q, o] + 2 H * kv_dim [k, v]
        + 3 H * I [gate, up, down]) + V * H [LM head]      (the embedding lookup is free)
    attention (QK^T and AV) at context c costs 4 * c * H per token per layer, forward.
    With S = prompt + completion tokens per sequence and B = prompts x samples sequences:
      generation  = B * (2 P S + 4 H L sum_{c=1..S} c)           (prefill + decode, KV cache)
      reference   = one forward, with a KL term                    (x1)
      update      = forward + backward = 3 x forward              (x3)
    so a step is 4 forwards of the batch (5 with a KL term); the generation forward is the same
    count as the teacher-forced one because a KV cache makes each new token cost one token's
    forward. Neither side runs a separate old-logprob forward: each batch gets one optimizer
    step, so pi_old = pi (TRL with num_iterations=1; ours with actor.skip_on_policy_old_logprob).
    Recomputation under activation checkpointing is not useful work and is not counted.

    `shared_*`: the same step with each prompt computed once per group of `samples`, not once
    per sample (p prompt, r completion tokens; the native decoder's prefill and the
    `model.share_prompts` passes do this):
      shared forward = prompts * (2 P (p + n r) + 4 H L (sum_{c<=p} c + n sum_{p<c<=p+r} c))
    The plain figures count the work as the algorithm states it (and TRL does it); a side that
    shares prompts can pass the plain limit's share, never the shared one's.
    """
    h, layers = shape.hidden, shape.layers
    kv_dim = h // shape.heads * shape.kv_heads
    params = layers * (2 * h**2 + 2 * h * kv_dim + 3 * h * shape.intermediate) \
        + shape.vocab * h
    seq = prompt_tokens + work.tokens
    batch = work.prompts * work.samples
    forward = batch * (2 * params * seq + 4 * h * layers * seq * (seq + 1) / 2)
    forwards = 5 if kl else 4
    p, r, n = prompt_tokens, work.tokens, work.samples
    context = p * (p + 1) / 2 + n * ((p + r) * (p + r + 1) / 2 - p * (p + 1) / 2)
    shared = work.prompts * (2 * params * (p + n * r) + 4 * h * layers * context)
    return {"matmul_params": params, "seq_tokens": seq, "forward": forward, "forwards": forwards,
            "generation": forward, "reference": forward if kl else 0.0, "update": 3 * forward,
            "total": forwards * forward, "shared_forward": shared,
            "shared_total": forwards * shared}


def mean_prompt_tokens(data: Path, model: Path, name: str) -> float:
    """Prompt tokens per sequence as both sides feed them. tiny: `<bos>` + one token per
    character; smollm2: the tokenizer's chat template with the generation prompt."""
    import pyarrow.parquet as pq

    prompts = pq.read_table(data, columns=["prompt"]).column("prompt").to_pylist()
    if name == "tiny":
        return statistics.mean(1 + len(p[0]["content"]) for p in prompts)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model, local_files_only=True)
    return statistics.mean(len(tok.apply_chat_template(p, add_generation_prompt=True,
                                                       tokenize=True, return_dict=False))
                           for p in prompts[:256])


# Our node names -> the FLOP count of `step_flops` each does.
ROLE_FLOPS = {"rollout": "generation", "ref_logprob": "reference", "actor_update": "update"}


def role_line(roles: dict[str, list[float]], flops: dict, gflops: float) -> str:
    """'rollout 6.70 s (limit 1.20 s, 18%), ...': the median seconds of every node of the
    step, and for the FLOP-counted ones the time the matmul rate allows and the share of it;
    with the shared-prompt count in `flops`, also that limit's share ('; shared 0.60 s, 9%')."""
    shared = flops.get("shared_forward", 0.0) / flops["forward"] if flops.get("forward") else 0
    parts = []
    for name, seconds in sorted(roles.items(), key=lambda kv: -statistics.median(kv[1])):
        median = statistics.median(seconds)
        if median < 0.005:
            continue
        part = f"{name} {median:.2f} s"
        if ROLE_FLOPS.get(name) and flops.get(ROLE_FLOPS[name]):
            limit = flops[ROLE_FLOPS[name]] / (gflops * 1e9)
            part += f" (limit {limit:.2f} s, {limit / median:.0%}"
            part += f"; shared {limit * shared:.2f} s, {limit * shared / median:.0%})" \
                if shared else ")"
        parts.append(part)
    return "median per node: " + ", ".join(parts)
