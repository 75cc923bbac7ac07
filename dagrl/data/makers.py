"""Dataset makers: write ready-to-train parquet files in the verl / siiRL layout.

Each row is one prompt::

    data_source:  str
    prompt:       list<struct<role: str, content: str>>   # a chat message list
    ability:      str
    reward_model: struct<style: str, ground_truth: str>
    extra_info:   struct<split: str, index: int64, ...task fields>

so files made here and files made by verl's example preprocessors load the same way.
``MAKERS`` maps a task name to its maker for ``dagrl data make NAME --out DIR``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa

from dagrl.data.agent_tasks import make_guess_number, make_tool_calc
from dagrl.data.gsm8k_synth import make_gsm8k_synth, make_gsm8k_synth_1step
from dagrl.data.parquet_write import check_int, write_parquet_atomic
from dagrl.data.shapes import make_shapes

ARITH_OPS = "+-*"

_ARITH_SCHEMA = pa.schema(
    [
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
        (
            "extra_info",
            pa.struct(
                [
                    ("split", pa.string()),
                    ("index", pa.int64()),
                    ("a", pa.int64()),
                    ("b", pa.int64()),
                    ("op", pa.string()),
                ]
            ),
        ),
    ]
)


def _apply(a: int, op: str, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    return a * b


def _arith_rows(problems: list[tuple[int, str, int]], split: str) -> dict[str, list]:
    cols: dict[str, list] = {name: [] for name in _ARITH_SCHEMA.names}
    for index, (a, op, b) in enumerate(problems):
        cols["data_source"].append("arith")
        cols["prompt"].append([{"role": "user", "content": f"{a}{op}{b}="}])
        cols["ability"].append("arith")
        cols["reward_model"].append({"style": "rule", "ground_truth": str(_apply(a, op, b))})
        cols["extra_info"].append({"split": split, "index": index, "a": a, "b": b, "op": op})
    return cols


def make_arith(
    out_dir: str | Path,
    *,
    seed: int = 0,
    max_operand: int = 20,
    ops: str = "+",
    n_test: int = 41,
    row_group_size: int = 64,
) -> dict[str, Path]:
    """Write the default task: every distinct ``f"{a}{op}{b}="`` with a, b in [0, max_operand].

    The ``len(ops) * (max_operand + 1) ** 2`` problems are shuffled with ``seed``; the first
    ``n_test`` become ``test.parquet``, the rest ``train.parquet``. The ground truth is the
    exact integer result (negative for some subtractions). Prompts use only digits and
    ``+-*=``, all inside the character tokenizer's vocabulary.

    Returns ``{"train": path, "test": path}``.
    """
    check_int("max_operand", max_operand, 0)
    check_int("n_test", n_test, 0)
    check_int("row_group_size", row_group_size, 1)
    check_int("seed", seed, 0)
    if not isinstance(ops, str) or not ops:
        raise ValueError(f"ops must be a non-empty string of operators {ARITH_OPS!r}, got {ops!r}")
    for op in ops:
        if op not in ARITH_OPS:
            raise ValueError(f"ops={ops!r} contains {op!r}; valid operators: {ARITH_OPS!r}")
        if ops.count(op) > 1:
            raise ValueError(f"ops={ops!r} repeats {op!r}; list each operator once")

    operands = range(max_operand + 1)
    problems = [(a, op, b) for op in ops for a in operands for b in operands]
    if n_test >= len(problems):
        raise ValueError(
            f"n_test={n_test} must leave at least one train row: ops={ops!r} and "
            f"max_operand={max_operand} give only {len(problems)} distinct problems"
        )
    random.Random(seed).shuffle(problems)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, rows in (("train", problems[n_test:]), ("test", problems[:n_test])):
        table = pa.Table.from_pydict(_arith_rows(rows, split), schema=_ARITH_SCHEMA)
        path = out / f"{split}.parquet"
        paths[split] = write_parquet_atomic(table, path, row_group_size=row_group_size)
    return paths


MAKERS: dict[str, Callable[..., dict[str, Path]]] = {"arith": make_arith,
                                                    "gsm8k-synth": make_gsm8k_synth,
                                                    "gsm8k-synth-1step": make_gsm8k_synth_1step,
                                                    "tool-calc": make_tool_calc,
                                                    "guess-number": make_guess_number,
                                                    "shapes": make_shapes}
