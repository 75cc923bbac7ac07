"""Time the LM head's statistics, forward and backward, two ways in one run: autograd through
the textbook computation with each chunk checkpointed (how engines/forward.py did it before
engines/head_stats.py) and `head_token_stats`; and check they agree.

    python scripts/head_probe.py                         # SmolLM2-135M's head shape
    python scripts/head_probe.py --tokens 768 --vocab 49152 --hidden 576 --precision bfloat16

Random weights and hidden states of the given shape (the time does not depend on the values);
2 threads by default, like the e2e benchmark.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dagrl.algorithms.utils import entropy_from_logits, logprobs_from_logits
from dagrl.engines.head_stats import head_token_stats


def _textbook_chunk(hidden, weight, targets, temperature):
    z = F.linear(hidden, weight).float() / temperature
    return torch.stack([logprobs_from_logits(z, targets), entropy_from_logits(z)], -1)


def autograd_head(hidden, weight, targets, temperature, chunk):
    return torch.cat([checkpoint(_textbook_chunk, hidden[i:i + chunk], weight,
                                 targets[i:i + chunk], temperature, use_reentrant=False)
                      for i in range(0, len(hidden), chunk)])


def dagrl_head(hidden, weight, targets, temperature, chunk):
    return head_token_stats(hidden, weight, None, targets, temperature, with_entropy=True,
                            chunk_tokens=chunk)[:, :2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--precision", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=4)
    ns = parser.parse_args()
    torch.set_num_threads(ns.threads)
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(ns.vocab, ns.hidden, generator=g) * 0.05).requires_grad_(True)
    hidden0 = torch.randn(ns.tokens, ns.hidden, generator=g) * 3
    targets = torch.randint(0, ns.vocab, (ns.tokens,), generator=g)
    coef = torch.randn(ns.tokens, generator=g)

    def run(head):
        hidden = hidden0.clone().requires_grad_(True)
        weight.grad = None
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=ns.precision == "bfloat16"):
            out = head(hidden, weight, targets, ns.temperature, ns.chunk)
        (out[:, 0] * coef).sum().backward()      # the entropy as a metric, as the update uses it
        return time.perf_counter() - start, out.detach(), hidden.grad, weight.grad

    best = {"autograd": float("inf"), "dagrl": float("inf")}
    for _ in range(ns.repeats):                  # alternate, so drift reaches both
        for name, head in (("autograd", autograd_head), ("dagrl", dagrl_head)):
            seconds, *_ = run(head)
            best[name] = min(best[name], seconds)
    _, out_a, dh_a, dw_a = run(autograd_head)
    _, out_d, dh_d, dw_d = run(dagrl_head)
    print(f"{ns.tokens} tokens x vocabulary {ns.vocab} x hidden {ns.hidden}, chunks of "
          f"{ns.chunk}, {ns.precision}, {ns.threads} threads; best of {ns.repeats}:")
    print(f"  autograd + checkpoint  {best['autograd']:.3f} s")
    ratio = best["autograd"] / best["dagrl"]
    print(f"  head_token_stats       {best['dagrl']:.3f} s  ({ratio:.2f}x)")
    print(f"  max |difference|: log-prob and entropy {(out_a - out_d).abs().max():.2e}, "
          f"hidden grad {(dh_a - dh_d).abs().max() / dh_a.abs().max():.2e} (relative), "
          f"weight grad {(dw_a - dw_d).abs().max() / dw_a.abs().max():.2e} (relative)")


if __name__ == "__main__":
    main()
