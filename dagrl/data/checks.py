"""Type checks of a prompt dataset: its parquet schema, and the values of a sample of rows.

Loading alone proves little: a `binary` message content decodes to `b'...'` inside the chat
template and the run trains on garbage; an integer ground truth passes every column check and
fails inside the scorer at the first reward, naming neither column nor file. These checks name
the file, the column (as a path: `prompt[].content`, `reward_model.ground_truth`) and, for
values, the row, before any model loads.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dagrl.data.errors import DatasetError
from dagrl.data.images import IMAGE_COLUMN, image_problem

# How many first rows of each file are checked before a run (values, prompt lengths).
PREFLIGHT_ROWS = 1024

TEXT_HINT = "expected UTF-8 text (a parquet string column)"


def _is_text(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _describe(t: pa.DataType) -> str:
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        return f"{t} (raw bytes; decode them to text when writing the file)"
    return str(t)


def check_prompt_type(path: str, column: str, t: pa.DataType) -> None:
    """A prompt column is text, or a list of chat messages whose `content` (and `role`, when
    present) are text."""
    if _is_text(t):
        return
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        item = t.value_type
        if pa.types.is_struct(item) and item.get_field_index("content") >= 0:
            for name in ("content", "role"):
                if item.get_field_index(name) < 0:
                    continue
                ft = item.field(name).type
                if not _is_text(ft) and not pa.types.is_null(ft):
                    raise DatasetError(f"{path}: column {column}[].{name} is {_describe(ft)}; "
                                       f"{TEXT_HINT}")
            return
    raise DatasetError(f"{path}: column {column} is {_describe(t)}; expected text or a list of "
                       "chat messages {role, content} (verl layout)")


def check_schema_types(path: str, schema: pa.Schema, prompt_key: str,
                       text_ground_truth: bool) -> None:
    """Column types, from the schema alone (no rows read). `text_ground_truth`: the built-in
    scorers compare text, so reward_model.ground_truth must be a string column; a user's
    reward.custom_fn may take any type."""
    check_prompt_type(path, prompt_key, schema.field(prompt_key).type)
    source = schema.field("data_source").type
    if not _is_text(source) and not pa.types.is_null(source):
        raise DatasetError(f"{path}: column data_source is {_describe(source)}; {TEXT_HINT}")
    if text_ground_truth:
        truth = schema.field("reward_model").type
        gt = truth.field(truth.get_field_index("ground_truth")).type
        if not _is_text(gt):
            raise DatasetError(
                f"{path}: column reward_model.ground_truth is {_describe(gt)}; the built-in "
                "scorers compare text: write it as strings (e.g. '42'), or score with your "
                "own reward.custom_fn")


def prompt_problem(prompt: Any, prompt_key: str) -> str:
    """Why a prompt value cannot be tokenized ("" when it can): null, bytes, a message without
    text content."""
    if prompt is None:
        return f"has no prompt ({prompt_key} is null)"
    if isinstance(prompt, str):
        return ""
    if isinstance(prompt, (bytes, bytearray)):
        return f"has a prompt of raw bytes in {prompt_key}; {TEXT_HINT}"
    if not isinstance(prompt, (list, tuple)) or not prompt:
        return (f"has a prompt of type {type(prompt).__name__} in {prompt_key}; expected text "
                "or a non-empty list of chat messages {role, content}")
    for i, message in enumerate(prompt):
        if not isinstance(message, dict) or "content" not in message:
            return f"has {prompt_key}[{i}] without a 'content' field"
        content = message["content"]
        if not isinstance(content, str):
            what = "raw bytes" if isinstance(content, (bytes, bytearray)) else \
                type(content).__name__
            return f"has {prompt_key}[{i}].content of {what}; {TEXT_HINT}"
        role = message.get("role")
        if role is not None and not isinstance(role, str):
            return f"has {prompt_key}[{i}].role of {type(role).__name__}; {TEXT_HINT}"
    return ""


def check_rows(rows: Iterable[tuple[int, dict]], prompt_key: str,
               text_ground_truth: bool, max_image_pixels: int = 0) -> dict[str, str]:
    """Values of (global row index, row) pairs read by ParquetPrompts (each with its `_file`):
    the first problem is raised, naming file, row and column. Returns each data_source seen,
    with the file and row of its first appearance (for the caller's scorer check). Rows with
    an `images` column: their images decode, one `<image>` per image, none above
    `max_image_pixels` (data/images.py)."""
    sources: dict[str, str] = {}
    for index, row in rows:
        where = f"{row['_file']}: row {index}"
        problem = prompt_problem(row.get(prompt_key), prompt_key)
        if problem:
            raise DatasetError(f"{where} {problem}")
        if IMAGE_COLUMN in row:
            problem = image_problem(row[IMAGE_COLUMN], row.get(prompt_key), max_image_pixels)
            if problem:
                raise DatasetError(f"{where}, {problem}")
        if not isinstance(row.get("data_source"), str):
            raise DatasetError(f"{where} has data_source {row.get('data_source')!r}; "
                               f"{TEXT_HINT}")
        truth = (row.get("reward_model") or {}).get("ground_truth")
        if text_ground_truth and not isinstance(truth, str):
            raise DatasetError(f"{where} has reward_model.ground_truth {truth!r} "
                               f"({type(truth).__name__}); the built-in scorers compare text")
        sources.setdefault(row["data_source"], where)
    return sources


def _may_hold_nulls(group: pq.RowGroupMetaData, column: str) -> bool:
    """Whether any leaf of `column` in this row group may hold a null, from the statistics the
    writer stored (absent statistics: it may). An empty list counts as a null leaf, so a row
    group of list prompts flagged here is read to tell."""
    for i in range(group.num_columns):
        chunk = group.column(i)
        if chunk.path_in_schema != column and not chunk.path_in_schema.startswith(column + "."):
            continue
        stats = chunk.statistics
        if stats is None or not stats.has_null_count or stats.null_count > 0:
            return True
    return False


def check_nulls(path: str, pf: pq.ParquetFile, first_row: int, prompt_key: str,
                text_ground_truth: bool) -> None:
    """Every row of a file, cheaply: the columns a step reads without a fallback (the prompt,
    data_source and, for the built-in scorers, reward_model.ground_truth) hold no null. Row
    groups whose statistics say "no nulls" are not read; the first null found is named by
    file, row and column. `first_row`: the global index of the file's first row."""
    columns = [(prompt_key, None), ("data_source", None)]
    if text_ground_truth:
        columns.append(("reward_model", "ground_truth"))
    start = first_row
    for gi in range(pf.metadata.num_row_groups):
        meta = pf.metadata.row_group(gi)
        for column, field in columns:
            if not _may_hold_nulls(meta, f"{column}.{field}" if field else column):
                continue
            values = pf.read_row_group(gi, columns=[column]).column(column)
            if field:
                values = pc.struct_field(values, field)
            nulls = pc.is_null(values)
            if pc.any(nulls).as_py():
                row = start + pc.index(nulls, True).as_py()
                name = f"{column}.{field}" if field else column
                hint = ("; the built-in scorers compare text" if field else
                        "; every row needs one")
                raise DatasetError(f"{path}: row {row} has {name} null{hint}")
        start += meta.num_rows
