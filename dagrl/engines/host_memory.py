"""Keep freed host memory in the process, so each training step reuses the previous step's
pages instead of faulting in fresh ones.

glibc's malloc serves blocks above a (dynamic, initially 128 KiB) threshold with fresh mmaps
and returns the top of its heap to the OS once more than a few MiB of it is free. A training
step frees its activations and allocates the same sizes again, so by default every step
faults its activation memory back in, page by page, and the kernel zeroes each page: on the
CPU e2e benchmark that was 2-25 thousand faults per update and 155-162 ms per update, against
143-146 ms with this setting and almost no faults. Intel's PyTorch CPU tuning guide makes the
same point with jemalloc/tcmalloc; this needs no extra library.

The cost: the process keeps its peak heap (it does not shrink after a spike). Set
`trainer.keep_freed_memory=false` to keep glibc's defaults.

For models whose live tensors take most of the machine (`trainer.trim_host_memory`), a heap
that keeps freed blocks also fragments: a backward pass frees and allocates activations of
many sizes between long-lived small objects, and the heap grows past what is live. Measured on
one SmolLM2-135M LoRA micro-batch (4 x 135 tokens, activation checkpointing, forward and
backward): live allocations peak +0.30 GiB, RSS +0.69 GiB with blocks up to 32 MiB from the
heap; with every block of 1 MiB and more mapped on its own (`map_large_blocks`), RSS +0.29
GiB, for 10-15% more update time (the pages are faulted in again each time).

`release_freed_memory` is the counterweight for models whose phases each need gigabytes
(`trainer.trim_host_memory`): called between two nodes, it hands the heap the finished node
freed back to the OS, so the next node's peak adds to what is live, not to every earlier
node's high-water mark. Measured on SmolLM2-135M (AdamW, activation checkpointing, 32 x 128
tokens, 2 threads): RSS after the update 4.63 GB untrimmed against 2.46 GB trimmed, for the
same live tensors.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

# mallopt parameters, from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Blocks up to this size come from the heap (glibc's maximum, 32 MiB on 64-bit); larger ones
# (a big KV cache, a checkpoint buffer) still get their own mapping, returned when freed.
MMAP_THRESHOLD = 32 * 2**20
# With trainer.trim_host_memory: blocks from this size up get their own mapping, returned to the
# OS when freed, so the heap holds only small objects and cannot fragment (activations of a
# 100M+ model are MiBs each). A fixed threshold also stops glibc's dynamic one from rising.
LARGE_BLOCK = 2**20
# The same under model.mixed_precision: autocast allocates a bfloat16 cast of each weight at
# each use (0.2-3 MiB apiece, thousands a step), and faulting all of those in fresh made a
# SmolLM2-135M bfloat16 step 17-22 s instead of 13.5-14.5 s; from 8 MiB up, 14 s at +0.25 GiB
# peak (docs/performance.md).
LARGE_BLOCK_MIXED_PRECISION = 8 * 2**20
# Free memory at the top of the heap is returned to the OS only above this much (the largest
# value mallopt's int takes, ~2 GiB).
TRIM_THRESHOLD = 2**31 - 1


def _libc():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def release_freed_memory() -> bool:
    """glibc's malloc_trim(0): return every free page of the heap to the OS. True if some
    memory was released; False where there is none or no glibc."""
    trim = getattr(_libc(), "malloc_trim", None)
    return bool(trim(0)) if trim is not None else False


def keep_freed_memory() -> bool:
    """Tune glibc malloc as described above; True if applied, False where there is no glibc
    (macOS, musl) and nothing changed."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        logger.debug("no glibc mallopt here; host memory settings left as they are")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success, 0 on a rejected value.
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
                and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def map_large_blocks(threshold: int = LARGE_BLOCK) -> bool:
    """Serve every block of `threshold` bytes or more with its own mmap (returned when freed):
    RSS then follows the live tensors instead of the heap's high-water mark. True if applied,
    False where there is no glibc."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold))
