"""What a tensor-parallel rollout engine's rank reads of each weight (`RolloutShard`): declared
by the rollout backend (vLLM at tensor_parallel_size > 1), used by the weight sync that sends
each rank only its blocks (engines/rollout_shards.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass

# Megatron's split (vLLM's parallel linears), by the HF parameter's name.
_ROWS = re.compile(r"\.(q_proj|gate_proj|up_proj)\.(weight|bias)$")
_KV = re.compile(r"\.(k_proj|v_proj)\.(weight|bias)$")
_COLUMNS = re.compile(r"\.(o_proj|down_proj)\.weight$")


@dataclass(frozen=True)
class RolloutShard:
    """A rollout engine over `size` consecutive ranks of the world (rank t of an engine: its
    global rank mod `size`); `kv_heads`: the model's KV heads (split only when `size` divides
    them, else each rank keeps them whole)."""
    size: int
    kv_heads: int

    def split_dim(self, name: str, shape: tuple[int, ...]) -> int | None:
        """The dim the engine splits weight `name` on (None: whole on every rank)."""
        if _ROWS.search(name) or (_KV.search(name) and self.kv_heads % self.size == 0):
            dim = 0
        elif _COLUMNS.search(name):
            dim = 1
        else:
            return None
        return dim if shape[dim] % self.size == 0 else None

    def block(self, name: str, shape: tuple[int, ...], global_rank: int) -> tuple[slice, ...]:
        """The part of the whole weight the engine's rank at `global_rank` reads."""
        whole = tuple(slice(0, n) for n in shape)
        dim = self.split_dim(name, shape)
        if dim is None:
            return whole
        width = shape[dim] // self.size
        t = global_rank % self.size
        return whole[:dim] + (slice(t * width, (t + 1) * width),) + whole[dim + 1:]
