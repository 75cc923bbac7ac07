"""Batch: the container that carries samples through the RL DAG.

Per-sample tensor fields (``input_ids`` [N, L], ``responses`` [N, T], ``scores`` [N], ...)
live in one ``TensorDict`` with ``batch_size=[N]``. Per-sample non-tensor fields (prompt text,
ground truth, ``uid``, ``extra_info`` dicts, ...) live in a dict of 1-D numpy object arrays of
length N. Every operation keeps every field in sync, works for N = 0 and never drops or
reorders samples silently, because the runtime splits, ships and re-concatenates batches.

Copy vs view (tensors and object arrays alike):
  views:  ``slice``, ``split``, ``chunk``, ``select_keys``, ``drop_keys``, construction
  copies: ``select``, ``repeat_interleave`` (advanced indexing), ``concat`` (always new storage)
Non-tensor *elements* (dicts, lists) are never deep-copied; only the arrays holding them are.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict
from torch import Tensor

Indices = Sequence[int] | Sequence[bool] | Tensor | np.ndarray


def _object_array(key: str, value: Sequence | np.ndarray) -> np.ndarray:
    """Turn a sequence into a 1-D object array without numpy collapsing nested rows."""
    if isinstance(value, np.ndarray):
        if value.ndim != 1:
            raise ValueError(
                f"non-tensor field '{key}' must be 1-D, got shape {tuple(value.shape)}; "
                f"pass a list of per-sample rows instead"
            )
        return value if value.dtype == object else value.astype(object)
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise TypeError(
            f"non-tensor field '{key}' must be a list, tuple or 1-D ndarray, "
            f"got {type(value).__name__}"
        )
    # Element-wise assignment: np.array([[1, 2], [3, 4]], dtype=object) would be 2-D.
    arr = np.empty(len(value), dtype=object)
    for i, v in enumerate(value):
        arr[i] = v
    return arr


def _check_tensor(key: str, value: Any) -> Tensor:
    if not isinstance(value, Tensor):
        raise TypeError(
            f"tensor field '{key}' must be a torch.Tensor, got {type(value).__name__} "
            f"(nested TensorDicts and non-tensor data go in non_tensors)"
        )
    if value.ndim == 0:
        raise ValueError(f"tensor field '{key}' needs a leading batch dim, got a 0-d tensor")
    return value


class Batch:
    """N samples: tensor fields in a TensorDict [N], non-tensor fields as object arrays [N]."""

    def __init__(
        self,
        tensors: Mapping[str, Tensor] | TensorDict | None = None,
        non_tensors: Mapping[str, Sequence | np.ndarray] | None = None,
        batch_size: int | None = None,
    ) -> None:
        device = None
        sizes: list[tuple[str, int]] = []  # (source name, N) for the agreement check
        if isinstance(tensors, TensorDict):
            device = tensors.device
            if len(tensors.batch_size) > 0:
                sizes.append(("tensors.batch_size", tensors.batch_size[0]))
        # `tensors or {}` would call TensorDict.__bool__, which raises.
        tensor_items = tensors.items() if tensors is not None else ()
        tensor_fields = {k: _check_tensor(k, v) for k, v in tensor_items}
        object_fields = {k: _object_array(k, v) for k, v in (non_tensors or {}).items()}
        both = sorted(set(tensor_fields) & set(object_fields))
        if both:
            raise ValueError(f"keys {both} are given as both tensor and non-tensor fields")
        for k in (*tensor_fields, *object_fields):
            if not isinstance(k, str):
                raise TypeError(f"field keys must be str, got {k!r}")
        sizes += [(k, v.shape[0]) for k, v in tensor_fields.items()]
        sizes += [(k, len(v)) for k, v in object_fields.items()]
        if batch_size is not None:
            if batch_size < 0:
                raise ValueError(f"batch_size must be >= 0, got {batch_size}")
            sizes.insert(0, ("batch_size", batch_size))
        if not sizes:
            raise ValueError("Batch has no fields; pass batch_size to build an empty-keyed batch")
        ref_name, n = sizes[0]
        for name, size in sizes[1:]:
            if size != n:
                raise ValueError(f"field '{name}' has {size} samples but '{ref_name}' has {n}")
        # Rebuild the TensorDict so the caller's container is never mutated through us.
        self._td = TensorDict(tensor_fields, batch_size=[n], device=device)
        self._nt: dict[str, np.ndarray] = object_fields

    @classmethod
    def _from_parts(cls, td: TensorDict, nt: dict[str, np.ndarray]) -> Batch:
        """Wrap already-consistent parts; skips validation (hot path for split/concat)."""
        out = cls.__new__(cls)
        out._td, out._nt = td, nt
        return out

    # ---- fields -------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._td.batch_size[0]

    @property
    def tensors(self) -> TensorDict:
        return self._td

    @property
    def non_tensors(self) -> dict[str, np.ndarray]:
        return self._nt

    def keys(self) -> list[str]:
        """Tensor keys, then non-tensor keys, each in insertion order."""
        return [*self._td.keys(), *self._nt]

    def __contains__(self, key: str) -> bool:
        return key in self._nt or key in self._td.keys()

    def __getitem__(self, key: str) -> Tensor | np.ndarray:
        if not isinstance(key, str):
            raise TypeError(f"Batch keys are str, got {type(key).__name__}; use select()/slice()")
        if key in self._nt:
            return self._nt[key]
        if key in self._td.keys():
            return self._td[key]
        raise KeyError(f"no field '{key}' in batch; keys are {self.keys()}")

    def get(self, key: str,
            default: Tensor | np.ndarray | None = None) -> Tensor | np.ndarray | None:
        """The field `key`, or `default` when the batch has none."""
        try:
            return self[key]
        except KeyError:
            return default

    def __setitem__(self, key: str, value: Tensor | Sequence | np.ndarray) -> None:
        if not isinstance(key, str):
            raise TypeError(f"field keys must be str, got {key!r}")
        n = len(self)
        if isinstance(value, Tensor):
            _check_tensor(key, value)
            if key in self._nt:
                raise ValueError(f"'{key}' is a non-tensor field; pop it before storing a tensor")
            if value.shape[0] != n:
                raise ValueError(
                    f"tensor field '{key}' has {value.shape[0]} samples "
                    f"(shape {list(value.shape)}) but the batch has {n}"
                )
            self._td[key] = value
            return
        arr = _object_array(key, value)
        if key in self._td.keys():
            raise ValueError(f"'{key}' is a tensor field; pop it before storing non-tensor data")
        if len(arr) != n:
            raise ValueError(
                f"non-tensor field '{key}' has {len(arr)} samples but the batch has {n}"
            )
        self._nt[key] = arr

    def pop(self, key: str) -> Tensor | np.ndarray:
        """Remove a field and return it."""
        if key in self._nt:
            return self._nt.pop(key)
        if key in self._td.keys():
            return self._td.pop(key)
        raise KeyError(f"no field '{key}' in batch; keys are {self.keys()}")

    # ---- row operations -----------------------------------------------------------------

    def select(self, indices: Indices) -> Batch:
        """Rows by index (any order, repeats allowed) or by bool mask of length N. Copies."""
        n = len(self)
        if isinstance(indices, Tensor):
            idx = indices.detach().cpu()
        else:
            arr = np.asarray(indices)
            if arr.size == 0:
                arr = arr.astype(np.int64)  # np.asarray([]) is float64
            idx = torch.from_numpy(arr)
        if idx.ndim != 1:
            raise ValueError(f"indices must be 1-D, got shape {list(idx.shape)}")
        if idx.dtype == torch.bool:
            if idx.shape[0] != n:
                raise ValueError(f"bool mask has length {idx.shape[0]} but the batch has {n}")
            idx = idx.nonzero().squeeze(1)
        elif idx.dtype.is_floating_point or idx.dtype.is_complex:
            raise TypeError(f"indices must be integers or a bool mask, got {idx.dtype}")
        idx = idx.long()
        if idx.numel() and (idx.min() < -n or idx.max() >= n):
            raise IndexError(
                f"indices out of range for batch of {n}: min {idx.min().item()}, "
                f"max {idx.max().item()}"
            )
        np_idx = idx.numpy()
        return Batch._from_parts(self._td[idx], {k: v[np_idx] for k, v in self._nt.items()})

    def slice(self, start: int, stop: int) -> Batch:
        """Rows [start, stop) with 0 <= start <= stop <= N; no clamping. Views."""
        n = len(self)
        if not 0 <= start <= stop <= n:
            raise IndexError(f"slice [{start}, {stop}) is not within [0, {n}] with start <= stop")
        return Batch._from_parts(
            self._td[start:stop], {k: v[start:stop] for k, v in self._nt.items()}
        )

    def split(self, sizes: int | Sequence[int]) -> list[Batch]:
        """Consecutive parts (views). int: chunks of that size, the last may be smaller, and an
        empty batch gives one empty part; sequence: exact part sizes summing to N, zeros allowed."""
        n = len(self)
        if isinstance(sizes, int):
            if sizes <= 0:
                raise ValueError(f"split size must be > 0, got {sizes}")
            sizes = [min(sizes, n - s) for s in range(0, n, sizes)] or [0]
        sizes = list(sizes)
        if any(s < 0 for s in sizes):
            raise ValueError(f"split sizes must be >= 0, got {sizes}")
        if sum(sizes) != n:
            raise ValueError(f"split sizes {sizes} sum to {sum(sizes)} but the batch has {n}")
        parts, start = [], 0
        for s in sizes:
            parts.append(self.slice(start, start + s))
            start += s
        return parts

    def chunk(self, n: int) -> list[Batch]:
        """Exactly n consecutive parts whose sizes differ by at most 1, earlier ones larger."""
        if n <= 0:
            raise ValueError(f"chunk count must be > 0, got {n}")
        q, r = divmod(len(self), n)
        return self.split([q + (i < r) for i in range(n)])

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Stack batches along the sample dim, in order. Always copies tensor storage."""
        if len(batches) == 0:
            raise ValueError("concat needs at least one batch, got an empty sequence")
        first = batches[0]
        t_keys, nt_keys = set(first._td.keys()), set(first._nt)
        for i, b in enumerate(batches[1:], start=1):
            bt, bnt = set(b._td.keys()), set(b._nt)
            flipped = sorted((t_keys & bnt) | (nt_keys & bt))
            if flipped:
                k = flipped[0]
                kind = "tensor" if k in t_keys else "non-tensor"
                raise ValueError(f"concat: field '{k}' is a {kind} in batch 0 but not in batch {i}")
            missing = sorted((t_keys | nt_keys) - (bt | bnt))
            extra = sorted((bt | bnt) - (t_keys | nt_keys))
            if missing or extra:
                raise ValueError(
                    f"concat: batch {i} keys differ from batch 0: "
                    f"missing {missing}, extra {extra}"
                )
            for k in first._td.keys():
                a, c = first._td[k], b._td[k]
                if a.shape[1:] != c.shape[1:] or a.dtype != c.dtype or a.device != c.device:
                    raise ValueError(
                        f"concat: tensor field '{k}' is {list(a.shape)} {a.dtype} on {a.device} "
                        f"in batch 0 but {list(c.shape)} {c.dtype} on {c.device} in batch {i}"
                    )
        # TensorDict cat aligns fields by key; it would silently promote dtypes, hence the check.
        td = torch.cat([b._td for b in batches], dim=0)
        nt = {k: np.concatenate([b._nt[k] for b in batches]) for k in first._nt}
        return Batch._from_parts(td, nt)

    def repeat_interleave(self, n: int) -> Batch:
        """Each sample n >= 1 times consecutively: [a, b] -> [a, a, b, b]. Copies."""
        if n < 1:
            raise ValueError(f"repeat count must be >= 1, got {n}")
        return self.select(torch.arange(len(self)).repeat_interleave(n))

    # ---- field operations ---------------------------------------------------------------

    def _check_keys(self, keys: Sequence[str]) -> None:
        if isinstance(keys, str):
            raise TypeError(f"keys must be a sequence of str, got the str {keys!r}")
        unknown = [k for k in keys if k not in self]
        if unknown:
            raise KeyError(f"no fields {unknown} in batch; keys are {self.keys()}")

    def select_keys(self, keys: Sequence[str]) -> Batch:
        """Only these fields (in batch order), sharing storage with self."""
        self._check_keys(keys)
        wanted = set(keys)
        td = self._td.select(*[k for k in self._td.keys() if k in wanted])
        return Batch._from_parts(td, {k: v for k, v in self._nt.items() if k in wanted})

    def drop_keys(self, keys: Sequence[str]) -> Batch:
        """All fields but these, sharing storage with self."""
        self._check_keys(keys)
        unwanted = set(keys)
        td = self._td.exclude(*[k for k in self._td.keys() if k in unwanted])
        return Batch._from_parts(td, {k: v for k, v in self._nt.items() if k not in unwanted})

    def to(self, device: torch.device | str) -> Batch:
        """Move tensor fields; non-tensor arrays are shared with self."""
        return Batch._from_parts(self._td.to(device), dict(self._nt))

    def nbytes(self) -> int:
        """Bytes of tensor data (numel * itemsize per field): what a reshard moves."""
        return sum(t.nbytes for t in self._td.values())

    def __repr__(self) -> str:
        tensors = ", ".join(
            f"{k}: {list(t.shape)} {str(t.dtype).removeprefix('torch.')}"
            for k, t in self._td.items()
        )
        return f"Batch(n={len(self)}, tensors={{{tensors}}}, non_tensors=[{', '.join(self._nt)}])"


# A multi-turn response holds the policy's tokens and, between its turns, tool and environment
# tokens that the policy reads but is not trained on: `response_mask` (the loss mask) has gaps
# there, and `response_attention_mask` marks every token of the response, policy or not.
RESPONSE_ATTENTION_MASK = "response_attention_mask"


def response_attention(batch: Batch) -> Tensor:
    """[N, R]: 1 on every token of each response that the model reads (what teacher-forced
    passes attend to and what token counts count); a single-turn batch without the field has
    no gaps, so its `response_mask` is that."""
    mask = batch.get(RESPONSE_ATTENTION_MASK)
    return batch["response_mask"] if mask is None else mask
