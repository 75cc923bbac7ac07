"""Dataset makers for agent tasks (multi-turn rollouts), in the verl parquet layout:

- `tool-calc`: multi-step arithmetic, `a*b+c` with two-digit numbers, that a tiny model cannot
  do in its head and the `calculator` tool does exactly: the way to the right answer is to call
  it on the problem. data_source `tool_calc` (scored on the final answer, the number after the
  last `=`; partial credit by how close it is as a ratio). Prompts use only characters of the
  tiny models' vocabulary.
- `guess-number`: rows for the `guess_number` environment (the secret is the ground truth).

    dagrl data make tool-calc --out data/tool_calc
    dagrl data make guess-number --out data/guess
"""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa

from dagrl.data.parquet_write import check_int, write_parquet_atomic


def _schema(extra: list[tuple[str, pa.DataType]]) -> pa.Schema:
    return pa.schema([
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
        ("extra_info", pa.struct([("split", pa.string()), ("index", pa.int64()), *extra])),
    ])


_TOOL_CALC = _schema([("expression", pa.string())])
_GUESS = _schema([("low", pa.int64()), ("high", pa.int64())])


def _write(out_dir: str | Path, splits: dict[str, list[dict]], schema: pa.Schema,
           row_group_size: int) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, rows in splits.items():
        cols = {name: [row[name] for row in rows] for name in schema.names}
        paths[split] = write_parquet_atomic(pa.Table.from_pydict(cols, schema=schema),
                                            out / f"{split}.parquet",
                                            row_group_size=row_group_size)
    return paths


def make_tool_calc(out_dir: str | Path, *, seed: int = 0, n_train: int = 4096,
                   n_test: int = 64, row_group_size: int = 256) -> dict[str, Path]:
    """`a*b+c` with a, b, c in [10, 99], distinct problems, shuffled with `seed`; the user
    message is the expression and `=` (e.g. `37*48+19=`, like `arith`'s prompts), the ground
    truth its value. Returns {"train": path, "test": path}."""
    check_int("n_train", n_train, 1)
    check_int("n_test", n_test, 0)
    check_int("row_group_size", row_group_size, 1)
    check_int("seed", seed, 0)
    rng = random.Random(seed)
    seen: set[tuple[int, int, int]] = set()
    while len(seen) < n_train + n_test:
        seen.add((rng.randint(10, 99), rng.randint(10, 99), rng.randint(10, 99)))
    problems = sorted(seen)
    rng.shuffle(problems)
    splits = {"train": problems[n_test:], "test": problems[:n_test]}
    return _write(out_dir, {
        split: [{"data_source": "tool_calc",
                 "prompt": [{"role": "user", "content": f"{a}*{b}+{c}="}],
                 "ability": "arith",
                 "reward_model": {"style": "rule", "ground_truth": str(a * b + c)},
                 "extra_info": {"split": split, "index": i, "expression": f"{a}*{b}+{c}"}}
                for i, (a, b, c) in enumerate(rows)]
        for split, rows in splits.items()}, _TOOL_CALC, row_group_size)


def make_guess_number(out_dir: str | Path, *, seed: int = 0, n_train: int = 1024,
                      n_test: int = 64, low: int = 1, high: int = 100,
                      row_group_size: int = 256) -> dict[str, Path]:
    """Secrets drawn uniformly from [low, high]; the prompt states the range."""
    check_int("n_train", n_train, 1)
    check_int("n_test", n_test, 0)
    check_int("seed", seed, 0)
    if not low < high:
        raise ValueError(f"low ({low}) must be below high ({high})")
    rng = random.Random(seed)
    rows = {"train": n_train, "test": n_test}
    return _write(out_dir, {
        split: [{"data_source": "guess_number",
                 "prompt": [{"role": "user", "content": f"guess a number from {low} to {high}: "}],
                 "ability": "game",
                 "reward_model": {"style": "environment",
                                  "ground_truth": str(rng.randint(low, high))},
                 "extra_info": {"split": split, "index": i, "low": low, "high": high}}
                for i in range(count)]
        for split, count in rows.items()}, _GUESS, row_group_size)
