"""Measurements on this machine that the scaling model is fitted to (not the training runs:
benchmarks/scale_calibrate.py does those).

- `matmul_peak()`: one core's float32 matmul FLOP/s, the "device peak" of a CPU worker;
- `collectives()`: gloo all_gather / all_to_all / all_reduce between local processes, and the
  alpha-beta fit T = (P-1) alpha + (P-1)/P n beta (all_reduce: twice that);
- `fsdp_overhead()`: the CPU work FSDP2 adds to a worker's forward pass and update of the
  calibration model at 2 and 4 processes (dagrl's shard_model), against one unsharded process;
- `driver_emulation()`: a Ray driver doing what a single controller does with a batch: get
  every worker's output (deserialise), concatenate it (copy), put one chunk per worker (serialise
  into the object store); the per-object and per-byte costs of each, and the driver's peak RSS
  against the batch size.

Each figure is the median (timings: the minimum where noise only adds) of repeats, because
this machine is shared: see docs/scaling.md.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.dataplane import _reset_hwm, _status_kib  # /proc readers, shared

MIB = 1 << 20


def matmul_peak(size: int = 384, repeats: int = 30) -> float:
    """Best FLOP/s of one float32 matmul on one thread (what a 1-thread worker can reach)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(old)
    return 2.0 * size ** 3 / best


# --- collectives -------------------------------------------------------------------------------
COLLECTIVE_SIZES = (4 << 10, 256 << 10, 2 * MIB, 8 * MIB)


def _collective_worker(rank: int, world: int, port: int, sizes, repeats: int, out: str) -> None:
    import warnings

    # torch 2.13 renames all_gather_into_tensor (dagrl's weight sync still calls it too).
    warnings.filterwarnings("ignore", category=FutureWarning)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(minutes=5))
    rows = []
    try:
        for nbytes in sizes:
            n = max(world, nbytes // 4 // world * world)      # float32 elements, divisible
            ops = {
                "all_gather": lambda n=n: dist.all_gather_into_tensor(
                    torch.empty(n), torch.ones(n // world)),
                "all_to_all": lambda n=n: dist.all_to_all_single(torch.empty(n), torch.ones(n)),
                "all_reduce": lambda n=n: dist.all_reduce(torch.ones(n)),
            }
            for name, op in ops.items():
                op()   # warm-up: gloo pairs, buffers
                times = []
                for _ in range(repeats):
                    dist.barrier()
                    t0 = time.perf_counter()
                    op()
                    times.append(time.perf_counter() - t0)
                box = torch.tensor(times, dtype=torch.float64)
                dist.all_reduce(box, op=dist.ReduceOp.MAX)   # a collective ends with its last
                rows.append({"op": name, "world": world, "bytes": n * 4,
                             "seconds": float(box.min())})
        if rank == 0:
            with open(out, "w") as f:
                json.dump(rows, f)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def collectives(worlds=(2, 4), sizes=COLLECTIVE_SIZES, repeats: int = 7) -> dict:
    """Measured gloo collectives (min over repeats of the slowest rank) and the alpha-beta fit."""
    rows: list[dict] = []
    for world in worlds:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.json")
            mp.start_processes(_collective_worker, args=(world, _free_port(), sizes, repeats, out),
                               nprocs=world, join=True, start_method="spawn")
            with open(out) as f:
                rows += json.load(f)
    return {"measurements": rows, **fit_alpha_beta(rows)}


def fit_alpha_beta(rows: list[dict]) -> dict:
    """Least squares of T = k((P-1) alpha + (P-1)/P n beta), k = 2 for all_reduce (reduce-scatter
    then all-gather), else 1; relative residuals, so small and large messages weigh alike."""
    a = np.array([[(r["world"] - 1) * (2 if r["op"] == "all_reduce" else 1),
                   (r["world"] - 1) / r["world"] * r["bytes"]
                   * (2 if r["op"] == "all_reduce" else 1)] for r in rows], dtype=np.float64)
    t = np.array([r["seconds"] for r in rows], dtype=np.float64)
    w = 1.0 / t
    (alpha, beta), *_ = np.linalg.lstsq(a * w[:, None], t * w, rcond=None)
    alpha, beta = max(float(alpha), 0.0), max(float(beta), 1e-15)
    pred = a @ np.array([alpha, beta])
    return {"alpha_s": alpha, "seconds_per_byte": beta,
            "fit_error_median": float(np.median(np.abs(pred - t) / t))}


# --- FSDP2's own cost on CPU workers --------------------------------------------------------
def _calibration_passes(shape: dict, world: int = 1) -> dict:
    """The calibration model (a tiny Qwen2 of `shape`), sharded with dagrl's shard_model over
    `world` gloo processes when > 1, and its passes on one batch: `forward` (no grad: the
    reference), `update` (forward, backward, grad-norm clip, AdamW step) and `decode` (a
    decode-like loop of small forwards: 32 forwards of 4 rows x 8 tokens)."""
    from transformers import AutoModelForCausalLM

    from dagrl.engines.models import build_char_tokenizer, tiny_model_config
    from dagrl.engines.sharding import shard_model

    vocab = len(build_char_tokenizer())
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_model_config(
        "tiny-qwen2", vocab, shape["hidden"], shape["layers"]))
    model = shard_model(model, world, "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, vocab, (shape["samples"], shape["seq"]))

    def forward() -> None:
        with torch.no_grad():
            model(ids).logits.float().log_softmax(-1)

    def update() -> None:
        model(ids).logits.float().log_softmax(-1).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()

    def decode() -> None:
        with torch.no_grad():
            for _ in range(32):
                model(ids[:4, :8])

    return {"forward": forward, "update": update, "decode": decode}


def _fsdp_worker(rank: int, world: int, port: int, shape: dict, repeats: int, out: str) -> None:
    """Per iteration, this process's CPU seconds for a forward pass (no grad: the reference)
    and an update (forward, backward, grad-norm clip, AdamW step) of the calibration model,
    sharded with dagrl's own shard_model when world > 1. CPU time, not wall time: the figure
    is work, which other load on a shared machine does not change (waiting in a collective
    costs no CPU; the model times collectives itself)."""
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=timedelta(minutes=5))
    try:
        ops = _calibration_passes(shape, world)
        rows = {}
        for name in ("forward", "update"):
            op = ops[name]
            op()   # warm-up
            times = []
            for _ in range(repeats):
                if world > 1:
                    dist.barrier()
                t0 = time.process_time()
                op()
                times.append(time.process_time() - t0)
            rows[name] = statistics.median(times)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(rows, f)
    finally:
        if world > 1:
            dist.destroy_process_group()


def fsdp_overhead(shape: dict, worlds=(1, 2, 4), repeats: int = 7) -> dict:
    """CPU seconds per process of a forward pass and of an update, unsharded (1 process) and
    sharded over 2 and 4 gloo processes, and their differences: what FSDP2 (all-gathers,
    reduce-scatters, hooks, DTensor dispatch of the optimizer) adds to each worker's work."""
    per: dict[int, dict] = {}
    for world in worlds:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.json")
            mp.start_processes(_fsdp_worker, args=(world, _free_port(), shape, repeats, out),
                               nprocs=world, join=True, start_method="spawn")
            with open(out) as f:
                per[world] = json.load(f)
    base = per[1]
    return {"cpu_s": {str(w): v for w, v in per.items()},
            "workers": [w for w in worlds if w > 1],
            "forward_s": [per[w]["forward"] - base["forward"] for w in worlds if w > 1],
            "update_s": [per[w]["update"] - base["update"] for w in worlds if w > 1]}


def _sharing_worker(rank: int, kind: str, shape: dict, seconds: float, out: str) -> None:
    """Wall seconds per op of the calibration model in this process (one thread, no process
    group): an update, a no-grad forward, or a decode-like loop of small forwards."""
    torch.set_num_threads(1)
    ops = _calibration_passes(shape)
    op = ops[kind]
    op()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        op()
        n += 1
    with open(f"{out}.{rank}", "w") as f:
        f.write(str((time.perf_counter() - start) / n))


def time_sharing(shape: dict, counts=(2, 4), seconds: float = 3.0) -> dict:
    """How this host time-shares the model's own work when more one-thread processes run
    than it has cores: for each kind of pass, the wall time per op of `k` independent
    processes at once over a solo process's, divided by the ideal max(1, k / cores). No
    collectives and no dagrl run: an input to the model, independent of the measured runs it
    is checked against. (Large matmuls time-share ideally; small-op work loses more to
    switching.)"""
    cores = os.cpu_count() or 1
    out: dict = {"cores": cores, "ratios": [k / cores for k in counts]}
    for kind in ("update", "forward", "decode"):
        per_count = {}
        for k in (1, *counts):
            with tempfile.TemporaryDirectory() as tmp:
                base = os.path.join(tmp, "t")
                mp.start_processes(_sharing_worker, args=(kind, shape, seconds, base), nprocs=k,
                                   join=True, start_method="spawn")
                per_count[k] = statistics.median(
                    float(Path(f"{base}.{r}").read_text()) for r in range(k))
        out[kind] = [per_count[k] / per_count[1] / max(1.0, k / cores) for k in counts]
    return out


# --- the single controller's driver ------------------------------------------------------------
class _Producer:
    """A worker of the emulation: makes its output batch (verl's DataProto holds torch tensors:
    token ids and masks int64, log-probs float32), and takes its input chunk."""

    def produce(self, nbytes: int, seed: int) -> dict:
        rows = max(1, nbytes // (8 * 3 * 1024 + 4 * 2 * 1024))
        g = torch.Generator().manual_seed(seed)
        return {"input_ids": torch.randint(0, 1 << 17, (rows, 1024), generator=g),
                "attention_mask": torch.ones(rows, 1024, dtype=torch.int64),
                "position_ids": torch.arange(1024).repeat(rows, 1),
                "old_log_probs": torch.randn(rows, 1024, generator=g),
                "ref_log_prob": torch.randn(rows, 1024, generator=g)}

    def consume(self, chunk: dict) -> int:
        return int(sum(t.numel() for t in chunk.values()))


def driver_emulation(workers=(1, 2, 4), mib=(8, 32, 96), repeats: int = 3,
                     small_objects: int = 64) -> dict:
    """Time the driver's get / concat / put for W workers and B bytes (module docstring), and
    the per-object cost of a get and a put alone (many small objects); fit the per-byte costs
    and the driver's RSS growth per byte of batch."""
    import logging

    import ray

    rows = []
    temp = tempfile.mkdtemp(prefix="dagrl-ray-", dir="/tmp")
    checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # Our own instance (its own temp dir): never another Ray running on this machine. The
    # store holds a few batches at once, so no put waits for space or spills to disk.
    ray.init(num_cpus=max(workers) + 1, include_dashboard=False, _temp_dir=temp,
             logging_level=logging.ERROR, log_to_driver=False,
             object_store_memory=max(mib) * 8 * MIB,
             runtime_env={"env_vars": {"PYTHONPATH": checkout, "OMP_NUM_THREADS": "1"}})
    try:
        producer = ray.remote(num_cpus=1)(_Producer)
        for w in workers:
            actors = [producer.remote() for _ in range(w)]
            ray.get([a.consume.remote({}) for a in actors])   # started
            for total in mib:
                for rep in range(repeats):
                    rows.append(_emulate_once(ray, actors, total * MIB // w, rep))
            if w == max(workers):
                per_object = _per_object(ray, actors, small_objects)
            for a in actors:
                ray.kill(a)
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
    return {"measurements": rows, **per_object, **fit_driver(rows, per_object)}


def _per_object(ray, actors, n: int) -> dict:
    """Seconds per object of a get (from the workers) and a put (by the driver) of small
    batches (4 rows): the fixed cost a single controller pays once per worker and call."""
    small = 4 * (8 * 3 * 1024 + 4 * 2 * 1024)
    refs = [actors[i % len(actors)].produce.remote(small, i) for i in range(n)]
    ray.wait(refs, num_returns=n)
    t0 = time.perf_counter()
    parts = ray.get(refs)
    get_s = (time.perf_counter() - t0) / n
    t0 = time.perf_counter()
    puts = [ray.put(p) for p in parts]
    put_s = (time.perf_counter() - t0) / n
    del puts
    return {"get_s_per_object": get_s, "put_s_per_object": put_s}


def _emulate_once(ray, actors, shard_bytes: int, rep: int) -> dict:
    refs = [a.produce.remote(shard_bytes, rep * 100 + i) for i, a in enumerate(actors)]
    ray.wait(refs, num_returns=len(refs))           # produced; the driver's part starts now
    import gc

    gc.collect()
    hwm = _reset_hwm()
    base = _status_kib("VmRSS")
    t0 = time.perf_counter()
    parts = ray.get(refs)                           # gather: fetch + deserialise
    t1 = time.perf_counter()
    whole = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}   # DataProto.concat
    nbytes = sum(t.numel() * t.element_size() for t in whole.values())
    t2 = time.perf_counter()
    rows = next(iter(whole.values())).shape[0]
    bounds = np.linspace(0, rows, len(actors) + 1).astype(int)
    chunks = [ray.put({k: v[bounds[i]:bounds[i + 1]] for k, v in whole.items()})
              for i in range(len(actors))]          # scatter: serialise into the store
    t3 = time.perf_counter()
    peak = (_status_kib("VmHWM") if hwm else _status_kib("VmRSS")) - base
    ray.get([a.consume.remote(c) for a, c in zip(actors, chunks, strict=True)])
    del parts, whole, chunks
    return {"workers": len(actors), "bytes": nbytes, "get_s": t1 - t0, "concat_s": t2 - t1,
            "put_s": t3 - t2, "peak_bytes": peak * 1024}


def _fit_two(x1: np.ndarray, x2: np.ndarray, t: np.ndarray) -> tuple[float, float]:
    a = np.stack([x1, x2], axis=1)
    (c1, c2), *_ = np.linalg.lstsq(a, t, rcond=None)
    return max(float(c1), 0.0), max(float(c2), 0.0)


def fit_driver(rows: list[dict], per_object: dict) -> dict:
    """Per (workers, bytes) point the median over repeats; per-byte cost of a get and a put:
    the median over points of (time - objects x per-object cost) / bytes; of the
    concatenation, time / bytes; peak RSS: least squares m0 + k x bytes."""
    points: dict[tuple[int, int], list[dict]] = {}
    for r in rows:
        points.setdefault((r["workers"], round(r["bytes"] / MIB)), []).append(r)
    med = [{k: statistics.median(x[k] for x in rs) for k in rs[0]} for rs in points.values()]

    def per_byte(key: str, obj: float) -> float:
        return max(0.0, statistics.median((m[key] - m["workers"] * obj) / m["bytes"]
                                          for m in med))

    b = np.array([m["bytes"] for m in med], dtype=np.float64)
    mem_base, mem_per_byte = _fit_two(np.ones_like(b), b, np.array([m["peak_bytes"] for m in med]))
    return {"get_s_per_byte": per_byte("get_s", per_object["get_s_per_object"]),
            "put_s_per_byte": per_byte("put_s", per_object["put_s_per_object"]),
            "copy_s_per_byte": statistics.median(m["concat_s"] / m["bytes"] for m in med),
            "mem_base_bytes": mem_base, "mem_per_batch_byte": mem_per_byte, "points": med}
