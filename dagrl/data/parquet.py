"""Random access to prompt rows in the verl/siiRL parquet layout, by global row index.

Layout (one row per prompt): `prompt` (a chat message list), `data_source`,
`reward_model.ground_truth`, and optionally `extra_info`, `ability` and `images`. Datasets
prepared for verl load unchanged. `ParquetPrompts` indexes the row groups of the files without
reading them and checks their schemas; it needs neither torch nor a tokenizer, so the launcher's
input checks (runtime/input_checks.py) refuse a malformed file before any model code loads.
`PromptLoader` (data/dataset.py) turns its rows into token batches.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dagrl.data.checks import check_nulls, check_rows, check_schema_types
from dagrl.data.errors import DatasetError
from dagrl.data.images import IMAGE_COLUMN
from dagrl.data.listed_files import missing_file_error

REQUIRED_COLUMNS = ("data_source", "reward_model")
LAYOUT_HINT = ("verl layout: the prompt column (data.prompt_key), data_source, "
               "reward_model{ground_truth}, optional extra_info")


@dataclass(frozen=True)
class _RowGroup:
    file: int
    index: int
    start: int     # global index of its first row
    rows: int


class ParquetPrompts:
    """Random access to the rows of one or more parquet files, by global row index.

    Every file is opened and its schema checked here, so a missing, corrupt or malformed file
    fails when the dataset is opened rather than at the step that first reads it. `config_key`
    names the setting that listed the files, for the messages.
    """

    def __init__(self, files: Sequence[str], prompt_key: str = "prompt", cache_row_groups: int = 64,
                 config_key: str = "data.train_files", text_ground_truth: bool = False,
                 max_image_pixels: int = 0):
        if not files:
            raise DatasetError(f"{config_key} is empty")
        self.files = [str(f) for f in files]
        self.prompt_key, self.config_key = prompt_key, config_key
        # The built-in scorers need text ground truths; a user's reward function may take any.
        self.text_ground_truth = text_ground_truth
        self.max_image_pixels = max_image_pixels   # data.max_image_pixels (0: no limit)
        self.columns = [prompt_key, *REQUIRED_COLUMNS]
        self._optional: list[list[str]] = []   # per file: the optional columns it has
        self._groups: list[_RowGroup] = []
        self._handles: dict[int, pq.ParquetFile] = {}
        total = 0
        for fi, path in enumerate(self.files):
            pf = self._open(fi)
            self._check_schema(path, pf.schema_arrow)
            self._optional.append([c for c in ("extra_info", IMAGE_COLUMN)
                                   if c in pf.schema_arrow.names])
            for gi in range(pf.metadata.num_row_groups):
                rows = pf.metadata.row_group(gi).num_rows
                if rows:
                    self._groups.append(_RowGroup(fi, gi, total, rows))
                    total += rows
        if total == 0:
            raise DatasetError(f"{config_key}: no rows in {', '.join(self.files)}")
        self.num_rows = total
        self._starts = np.array([g.start for g in self._groups])
        self._cache: OrderedDict[tuple[int, int], list[dict]] = OrderedDict()
        self._cache_size = cache_row_groups
        self.row_groups_read = 0   # for tests and logs: how much I/O this worker did
        # verl's multimodal layout (data/images.py): some file has an images column
        self.has_images = any(IMAGE_COLUMN in names for names in self._optional)

    def _check_schema(self, path: str, schema: pa.Schema) -> None:
        names = schema.names
        missing = [c for c in self.columns if c not in names]
        if missing:
            raise DatasetError(f"{path}: missing column(s) {missing}; it has {sorted(names)} "
                               f"({LAYOUT_HINT})")
        # The reward reads reward_model.ground_truth: a struct without it would only fail at
        # the first reward, after a whole rollout.
        reward_type = schema.field("reward_model").type
        if not pa.types.is_struct(reward_type) or reward_type.get_field_index("ground_truth") < 0:
            fields = ([reward_type.field(i).name for i in range(reward_type.num_fields)]
                      if pa.types.is_struct(reward_type) else [])
            raise DatasetError(f"{path}: missing column reward_model.ground_truth; reward_model "
                               f"is {reward_type} with fields {fields} ({LAYOUT_HINT})")
        check_schema_types(path, schema, self.prompt_key, self.text_ground_truth)

    def _open(self, fi: int) -> pq.ParquetFile:
        if fi not in self._handles:
            path = self.files[fi]
            if not Path(path).is_file():
                raise missing_file_error(path, self.config_key)
            try:
                self._handles[fi] = pq.ParquetFile(path)
            except Exception as err:  # pyarrow raises several types for a corrupt file
                raise DatasetError(f"{path}: not a readable parquet file ({err})") from err
        return self._handles[fi]

    def __len__(self) -> int:
        return self.num_rows

    def _group_rows(self, group: _RowGroup) -> list[dict]:
        key = (group.file, group.index)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        path = self.files[group.file]
        try:
            table = self._open(group.file).read_row_group(
                group.index, columns=self.columns + self._optional[group.file])
        except (OSError, pa.ArrowException) as err:   # a damaged page behind a valid footer
            raise DatasetError(f"{path}: not a readable parquet file: row group {group.index} is "
                               f"corrupt ({err})") from err
        try:
            rows = table.to_pylist()
        except UnicodeDecodeError as err:   # a string column holding bytes that are not UTF-8
            raise DatasetError(f"{path}: {_undecodable(table, group.start)} holds text that is "
                               f"not valid UTF-8 ({err.reason}); re-encode the file's strings "
                               "as UTF-8") from err
        self.row_groups_read += 1
        self._cache[key] = rows
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return rows

    def check_sample(self, rows: int) -> dict[str, str]:
        """Check the values of the first `rows` rows (data/checks.py): file, row and column of
        the first bad value are named. Returns the data_sources seen (-> "file: row i")."""
        indices = list(range(min(rows, len(self))))
        return check_rows(zip(indices, self.read(indices), strict=True), self.prompt_key,
                          self.text_ground_truth, self.max_image_pixels)

    def check_nulls(self) -> None:
        """No null prompt, data_source or (built-in scorers) ground truth in any row of any
        file (data/checks.py: from the parquet statistics, reading only flagged row groups)."""
        first = 0
        for fi, path in enumerate(self.files):
            pf = self._open(fi)
            check_nulls(path, pf, first, self.prompt_key, self.text_ground_truth)
            first += pf.metadata.num_rows

    def read(self, indices: Sequence[int]) -> list[dict]:
        """Rows at the given global indices, in that order; reads only their row groups."""
        bad = [int(i) for i in indices if not 0 <= int(i) < len(self)]
        if bad:
            raise IndexError(f"rows {bad[:5]} do not exist: {', '.join(self.files)} hold "
                             f"{len(self)} rows (0..{len(self) - 1})")
        out = []
        for idx in indices:
            gpos = int(np.searchsorted(self._starts, idx, side="right")) - 1
            group = self._groups[gpos]
            row = dict(self._group_rows(group)[idx - group.start])
            row["_file"] = self.files[group.file]
            out.append(row)
        return out


def _undecodable(table: pa.Table, first_row: int) -> str:
    """'column C, row R': where the first value that is not valid UTF-8 sits."""
    for name in table.column_names:
        column = table.column(name)
        for i in range(len(column)):
            try:
                column[i].as_py()
            except UnicodeDecodeError:
                return f"column {name}, row {first_row + i},"
    return f"row group starting at row {first_row}"
