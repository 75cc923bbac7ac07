"""Prompt batches from verl/siiRL-layout parquet, each worker building its own shard.

`ParquetPrompts` (data/parquet.py) indexes the row groups of the files without reading them;
`PromptLoader` walks a seeded global order, one global batch per step, and materialises only
this worker's slice of each batch, reading only the row groups that hold it. Its state (epoch,
batch within the epoch) is a small dict that a checkpoint can save.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from dagrl.data.batch import Batch
from dagrl.data.checks import prompt_problem
from dagrl.data.errors import DatasetError
from dagrl.data.images import IMAGE_COLUMN, checked_images
from dagrl.data.parquet import ParquetPrompts
from dagrl.data.vision import IMAGE_FIELD, ImageEncoder, ImageInputs

# The roles of the chat-template convention (transformers, verl, OpenAI); a template may name
# others (e.g. "ipython", "developer"), which it then knows how to render.
CHAT_ROLES = ("system", "user", "assistant", "tool")


def encode_prompt(tokenizer, messages: Any, tools: Sequence[dict] | None = None) -> list[int]:
    """Token ids of a prompt: the chat template (with the generation prompt, and the schemas of
    `tools` for multi-turn rollouts) when the tokenizer has one, otherwise the message contents
    joined by newlines."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    if getattr(tokenizer, "chat_template", None):
        kwargs = {"tools": list(tools)} if tools else {}
        text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True,
                                             tokenize=False, **kwargs)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    text = "\n".join(m["content"] for m in messages)
    return tokenizer(text, add_special_tokens=True)["input_ids"]


class PromptLoader:
    """Seeded, resumable, epoch-aware batches of prompts; each worker builds its own slice.

    The global order of epoch e is a permutation seeded by (seed, e), the same whatever the
    number of workers. Step k of the epoch takes positions [k·B, (k+1)·B) of that order and
    worker r keeps the r-th contiguous 1/W of them, so concatenating the workers' slices in rank
    order gives exactly the 1-worker batch.
    """

    def __init__(self, source: ParquetPrompts, tokenizer, *, batch_size: int, rank: int = 0,
                 world_size: int = 1, seed: int = 0, shuffle: bool = True, tail: str = "drop",
                 max_prompt_length: int, truncation: str = "error",
                 images: ImageEncoder | None = None) -> None:
        """`images`: an image-text model's encoder (data/vision.py): rows with images then get
        the model's image tokens in their prompts and their encoded images in the batch field
        `image_inputs`."""
        if batch_size % world_size:
            raise ValueError(f"data.train_batch_size ({batch_size}) must be divisible by the "
                             f"number of workers ({world_size})")
        if tail not in ("drop", "pad"):
            raise ValueError(f"data.tail must be 'drop' or 'pad', got {tail!r}")
        if tail == "drop" and len(source) < batch_size:
            raise DatasetError(f"the dataset has {len(source)} rows, fewer than one batch of "
                               f"data.train_batch_size={batch_size} (use data.tail=pad)")
        self.source, self.tokenizer = source, tokenizer
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.seed, self.shuffle, self.tail = seed, shuffle, tail
        self.max_prompt_length, self.truncation = max_prompt_length, truncation
        self.images = images
        self.epoch, self.batch_in_epoch = 0, 0

    # --- order -------------------------------------------------------------------------
    def epoch_order(self, epoch: int) -> np.ndarray:
        n = len(self.source)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    @property
    def batches_per_epoch(self) -> int:
        n = len(self.source)
        return n // self.batch_size if self.tail == "drop" else -(-n // self.batch_size)

    @property
    def dropped_per_epoch(self) -> int:
        return len(self.source) % self.batch_size if self.tail == "drop" else 0

    def _global_batch(self) -> tuple[np.ndarray, np.ndarray]:
        """Row indices of the current global batch and the epoch each row is drawn from."""
        start = self.batch_in_epoch * self.batch_size
        rows = self.epoch_order(self.epoch)[start:start + self.batch_size]
        epochs = np.full(len(rows), self.epoch)
        lap = self.epoch
        # tail == "pad": borrow from the next epochs' orders (more than one when the dataset is
        # smaller than a batch). A row borrowed from epoch e+1 is tagged e+1, so its uid differs
        # from the same row's in this epoch and the two never merge into one GRPO group.
        while len(rows) < self.batch_size:
            lap += 1
            more = self.epoch_order(lap)[:self.batch_size - len(rows)]
            rows = np.concatenate([rows, more])
            epochs = np.concatenate([epochs, np.full(len(more), lap)])
        return rows, epochs

    def next_batch(self) -> Batch:
        """This worker's slice of the next global batch, tokenized and left-padded."""
        rows, epochs = self._global_batch()
        per_rank = self.batch_size // self.world_size
        mine = slice(self.rank * per_rank, (self.rank + 1) * per_rank)
        positions = np.arange(self.rank * per_rank, (self.rank + 1) * per_rank)
        self.batch_in_epoch += 1
        if self.batch_in_epoch >= self.batches_per_epoch:
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0
        return self._build(self.source.read(rows[mine].tolist()), rows[mine], positions,
                           epochs[mine])

    def batch_of_rows(self, row_ids: Sequence[int], epoch: int = 0) -> Batch:
        """The given rows, in order, tokenized like a training batch (for validation)."""
        ids = np.asarray(row_ids, dtype=np.int64)
        return self._build(self.source.read(ids.tolist()), ids, ids, epoch)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch, "seed": self.seed,
                "batch_size": self.batch_size, "num_rows": len(self.source)}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "batch_size", "num_rows"):
            if state[key] != self.state_dict()[key]:
                raise ValueError(f"dataloader state was saved with {key}={state[key]}, but this "
                                 f"run has {key}={self.state_dict()[key]}")
        self.epoch, self.batch_in_epoch = int(state["epoch"]), int(state["batch_in_epoch"])

    # --- tokenization ----------------------------------------------------------------------
    def check_prompt_lengths(self, max_rows: int) -> int:
        """Tokenize the first `max_rows` rows as a batch would, so an overlong or empty prompt
        is reported before any model loads (the pre-flight); returns the longest length."""
        rows = list(range(min(max_rows, len(self.source))))
        longest = 0
        for start in range(0, len(rows), 256):
            chunk = rows[start:start + 256]
            built = self._build(self.source.read(chunk), np.asarray(chunk), np.asarray(chunk), 0)
            longest = max(longest, int(built.tensors["prompt_mask"].sum(-1).max()))
        return longest

    def _build(self, rows: list[dict], row_ids: np.ndarray, positions: np.ndarray,
               epoch: int | np.ndarray) -> Batch:
        """`epoch`: one for all rows, or one per row (see `_global_batch`)."""
        width = self.max_prompt_length
        pad = self.tokenizer.pad_token_id
        uids = [f"e{int(e)}-r{int(r)}"
                for e, r in zip(np.broadcast_to(epoch, len(rows)), row_ids, strict=True)]
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        image_inputs = []
        for i, row in enumerate(rows):
            prompt = row[self.source.prompt_key]
            # Every row, not only the pre-flight's sample: bytes must never reach the tokenizer
            # (a chat template renders them as "b'...'" and the run trains on that).
            problem = prompt_problem(prompt, self.source.prompt_key)
            if problem:
                raise DatasetError(f"{row['_file']}: row {int(row_ids[i])} (uid {uids[i]}) "
                                   f"{problem}")
            where = f"{row['_file']}: row {int(row_ids[i])} (uid {uids[i]})"
            prompt, inputs = self._with_images(row, prompt, where)
            tokens = self._encode(prompt, where)
            if inputs is not None:
                tokens = self.images.expand(tokens, inputs)
                if len(tokens) > width:   # cutting would split an image's tokens
                    raise DatasetError(f"{where} has a prompt of {len(tokens)} tokens with its "
                                       f"images, more than data.max_prompt_length={width}; "
                                       "raise it (images are never truncated)")
            image_inputs.append(inputs)
            tokens = self._truncate(tokens, row, int(row_ids[i]), uids[i])
            if tokens:   # left padding: the last prompt token sits in the last column
                ids[i, width - len(tokens):] = torch.tensor(tokens)
                mask[i, width - len(tokens):] = 1
        reward_model = [r["reward_model"] or {} for r in rows]
        return Batch(
            tensors={"prompt_ids": ids, "prompt_mask": mask,
                     "row_index": torch.as_tensor(row_ids, dtype=torch.long),
                     # position of the prompt in the global batch: orders results across workers
                     "batch_position": torch.as_tensor(positions, dtype=torch.long)},
            non_tensors={
                "uid": uids,
                "data_source": [r["data_source"] for r in rows],
                "ground_truth": [rm.get("ground_truth") for rm in reward_model],
                "extra_info": [r.get("extra_info") for r in rows],
                "prompt": [r[self.source.prompt_key] for r in rows],
                **({IMAGE_FIELD: image_inputs} if self.images is not None else {}),
            },
            batch_size=len(rows))

    def _with_images(self, row: dict, prompt: Any, where: str) -> tuple[Any, ImageInputs | None]:
        """The prompt with its images as the model's image tokens, and the images encoded;
        (prompt, None) for a text-only model or a row without images. A row whose images do
        not decode, or do not match its placeholders, is refused naming it."""
        pictures = row.get(IMAGE_COLUMN)
        if self.images is None or not pictures:
            return prompt, None
        # decoded once: checked (every row a step reads), then encoded
        decoded, problem = checked_images(pictures, prompt, self.source.max_image_pixels)
        if problem:
            raise DatasetError(f"{where} {problem}")
        return self.images.prompt_images(prompt, decoded)

    def _encode(self, prompt: Any, where: str) -> list[int]:
        """The prompt's tokens; a role the chat template does not know, or a template that
        refuses the messages, is a data error naming the row (`where`)."""
        template = getattr(self.tokenizer, "chat_template", None)
        if template and not isinstance(prompt, str):
            key = self.source.prompt_key
            for i, message in enumerate(prompt):
                role = message.get("role")
                # A template that renders any role would train on "<|im_start|>human" silently.
                if role not in CHAT_ROLES and f"'{role}'" not in template \
                        and f'"{role}"' not in template:
                    raise DatasetError(
                        f"{where} has {key}[{i}].role {role!r}: not one of the chat roles "
                        f"({', '.join(CHAT_ROLES)}) and the model's chat template does not name "
                        "it")
        try:
            return encode_prompt(self.tokenizer, prompt)
        except Exception as err:   # jinja2's TemplateError, or what the template's code raises
            reason = str(err).strip().splitlines()[0] if str(err).strip() else ""
            raise DatasetError(f"{where}: the model's chat template refused this prompt "
                               f"({type(err).__name__}: {reason[:200]})") from err

    def _truncate(self, tokens: list[int], row: dict, row_id: int, uid: str) -> list[int]:
        limit = self.max_prompt_length
        if len(tokens) <= limit:
            return tokens
        if self.truncation == "left":
            return tokens[-limit:]
        if self.truncation == "right":
            return tokens[:limit]
        raise DatasetError(f"{row['_file']}: row {row_id} (uid {uid}) has a prompt of "
                           f"{len(tokens)} tokens, more than data.max_prompt_length={limit} "
                           "(raise it, or set data.truncation=left|right)")
