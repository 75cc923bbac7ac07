"""`dagrl bench dataplane`: our direct reshard vs a single-controller (verl-style) emulation.

    dagrl bench dataplane [--workers 2,4,8] [--sizes 16,64,256] [--per-worker-mib 32]
                          [--repeats 3] [--rounds 3] [--seed 0] [--json PATH]
    python -m benchmarks.dataplane [same options]

For every worker count W and total step size (MiB of tensor data summed over workers), W
fresh CPU processes (gloo) each build their shard of an RL batch and move every sample to a
seeded random rank (an all-to-all, like a rebalance), twice, in separate launches:

- ours:   every rank calls `dagrl.data.buffer.exchange` (sizes, then one all_to_all);
- single: every rank packs its shard and sends it to rank 0, the coordinator, which unpacks
          and concatenates the whole batch (as verl's driver holds one DataProto), splits it by
          destination, packs each piece and sends it on; the receivers unpack.

Both use the same torch.distributed gloo transport and pack/unpack, so the comparison is about
the architecture. A fixed-per-worker sweep (`--per-worker-mib` at each W) checks that our
per-process peak memory does not grow with W. Every move is verified (counts, order, uids,
data sources and a tensor checksum per receiver) and the run aborts if one is wrong.

On a busy machine a launch can land in a slow stretch, so every point runs `--rounds` times,
ours and single back to back in each round (the order swapped every other round): speedup is
the median of the rounds' ratios (each taken between two launches seconds apart), and the
rounds' ratios are printed beside it; times are the medians over rounds.

Columns: *_s wall seconds of the move (median over repeats of the slowest rank); *_peak_mib
peak RSS increase during the move (max over repeats; ours: the largest rank, single: the
coordinator); cpu_speedup the coordinator's CPU seconds over our busiest rank's, i.e. where
speedup heads when every worker has a core of its own (W processes on fewer cores share them).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dagrl.data.batch import Batch
from dagrl.data.buffer import exchange, pack, unpack

# A realistic RL sample: 512 prompt + 1024 response tokens -> 28 KiB of tensor data per sample.
PROMPT_LEN, RESPONSE_LEN, VOCAB, GROUP = 512, 1024, 151_936, 8  # GROUP: responses per prompt
SAMPLE_BYTES = 8 * PROMPT_LEN + (8 + 4 * 4) * RESPONSE_LEN     # two int64 + four float32 fields
SOURCES = ("gsm8k", "math", "arith", "codecontests")
MIB = 1 << 20
FLAT_TOLERANCE = 1.25   # "roughly flat": max/min of our per-process peak across W


# --- the data every rank can regenerate (so each receiver knows what it must get) -------------
def _shard(rank: int, n: int, seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    lengths = torch.randint(RESPONSE_LEN // 4, RESPONSE_LEN + 1, (n,), generator=g)
    mask = (torch.arange(RESPONSE_LEN) < lengths[:, None]).float()
    old = -5 * torch.rand(n, RESPONSE_LEN, generator=g) * mask
    tensors = {
        "prompt_ids": torch.randint(0, VOCAB, (n, PROMPT_LEN), generator=g),
        "responses": torch.randint(0, VOCAB, (n, RESPONSE_LEN), generator=g),
        "response_mask": mask,
        "old_logprobs": old,
        "ref_logprobs": old + 0.01 * torch.randn(n, RESPONSE_LEN, generator=g) * mask,
        "advantages": torch.randn(n, 1, generator=g) * mask,
    }
    return Batch(tensors, {"uid": _uids(rank, range(n)), "data_source": _sources(rank, range(n))})


def _uids(src: int, rows) -> list[str]:       # uuid-sized strings, shared by a prompt's GROUP
    return [str(uuid.UUID(int=(src << 64) | (i // GROUP))) for i in rows]


def _sources(src: int, rows) -> list[str]:
    return [SOURCES[(src + i // GROUP) % len(SOURCES)] for i in rows]


def _dests(src: int, n: int, world: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 104_729 + 1 + src)
    return torch.randint(0, world, (n,), generator=g)


def _signature(batch: Batch) -> torch.Tensor:
    """Per-sample int64 checksum: every tensor field's bytes as int16, summed, field-weighted.
    Exact integer arithmetic (no overflow at these sizes), so it is independent of order."""
    sig = torch.zeros(len(batch), dtype=torch.int64)
    for j, key in enumerate(sorted(batch.tensors.keys())):
        t = batch.tensors[key].contiguous()
        row = t.reshape(len(batch), t[0].numel() if len(batch) else 0).view(torch.int16)
        sig += (j + 1) * row.sum(1, dtype=torch.int64)
    return sig


# --- the two movements ---------------------------------------------------------------------------
def move_ours(batch: Batch, dest: torch.Tensor, all_dests: list[torch.Tensor]) -> Batch:
    return exchange(batch, dest, group=None)


def move_single(batch: Batch, dest: torch.Tensor, all_dests: list[torch.Tensor]) -> Batch:
    """verl-style: gather everything into rank 0, which re-splits and scatters it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank != 0:
        buf = pack(batch)
        dist.gather(torch.tensor([buf.numel()]), None, dst=0)      # sizes first
        dist.send(buf, 0)
        del buf
        size = torch.zeros(1, dtype=torch.int64)
        dist.scatter(size, None, src=0)
        piece = torch.empty(int(size), dtype=torch.uint8)
        dist.recv(piece, 0)
        return unpack(piece, copy=False)  # views, as exchange gives a single received chunk
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.gather(torch.zeros(1, dtype=torch.int64), sizes, dst=0)
    bufs = [torch.empty(int(s), dtype=torch.uint8) for s in sizes]
    for req in [dist.irecv(bufs[r], src=r) for r in range(1, world)]:
        req.wait()
    # Views into the received buffers (the coordinator's own shard needs no transport): the
    # concatenation into the driver's global batch is then the only copy, as in exchange.
    parts = [batch] + [unpack(bufs[r], copy=False) for r in range(1, world)]
    del bufs
    # verl's driver keeps the global batch for the whole step, so it stays alive here too.
    whole = Batch.concat(parts)
    del parts                            # frees the received buffers
    # The driver decides the dispatch itself, so it knows every sample's destination.
    dest_all = torch.cat(all_dests)
    rows = [torch.nonzero(dest_all == d).flatten() for d in range(world)]
    # All pieces are serialised before any is delivered, as the driver's remote calls put every
    # argument into the object store first. Random destinations need a gather (select, a copy,
    # freed once packed) and then serialisation (pack): two copies, as verl's reorder + put.
    out = [torch.empty(0, dtype=torch.uint8)]
    out += [pack(whole.select(rows[d])) for d in range(1, world)]
    dist.scatter(torch.zeros(1, dtype=torch.int64),
                 [torch.tensor([o.numel()]) for o in out], src=0)
    for req in [dist.isend(out[d], dst=d) for d in range(1, world)]:
        req.wait()
    return whole.select(rows[0])


METHODS = {"ours": move_ours, "single": move_single}


# --- peak memory -------------------------------------------------------------------------------
class PeakRSS:
    """Peak RSS increase (bytes) of this process over a `with` window.

    Preferred: Linux's resettable high-water mark. Writing "5" to /proc/self/clear_refs resets
    VmHWM to the current RSS; the kernel then tracks the exact peak, at no cost and without
    missing short spikes. ru_maxrss is no use here: it is a lifetime peak that never resets, so
    building the shard (whose temporaries are larger than some moves) would hide the move's peak.
    Fallback where clear_refs cannot be written: a thread sampling RSS every 1 ms with psutil
    (it can miss spikes shorter than that, and it waits for the GIL while pickle holds it).
    """

    def __enter__(self) -> PeakRSS:
        self.hwm = _reset_hwm()
        self.base = _status_kib("VmRSS") * 1024
        self.peak, self._stop = self.base, threading.Event()
        if not self.hwm:
            import psutil

            proc = psutil.Process()

            def sample() -> None:
                while not self._stop.wait(0.001):
                    self.peak = max(self.peak, proc.memory_info().rss)

            self._thread = threading.Thread(target=sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.hwm:
            self.peak = _status_kib("VmHWM") * 1024
        else:
            self._stop.set()
            self._thread.join()
        self.increase = max(0, self.peak - self.base)


def _trim() -> None:
    """Hand free heap pages back to the OS before a window. Otherwise glibc keeps memory freed
    by shard building or an earlier repeat resident, a move reuses it without raising RSS, and
    its peak looks smaller than it is. (Forcing every large block onto mmap with
    MALLOC_MMAP_THRESHOLD_ would do the same, but it made every move 2-3x slower and noisy.)"""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


# --- one worker process --------------------------------------------------------------------------
def _verify(out: Batch, sent: torch.Tensor, all_dests: list[torch.Tensor], method: str) -> None:
    """Every rank must hold exactly its samples, in source-rank then sender order."""
    rank, world = dist.get_rank(), dist.get_world_size()
    totals = sent.clone()
    dist.all_reduce(totals)              # [W, 2]: samples and checksum sum per destination
    got = torch.tensor([len(out), int(_signature(out).sum())])
    rows = [torch.nonzero(d == rank).flatten().tolist() for d in all_dests]
    uids = [u for s, r in enumerate(rows) for u in _uids(s, r)]
    sources = [x for s, r in enumerate(rows) for x in _sources(s, r)]
    problems = []
    if not torch.equal(got, totals[rank]):
        problems.append(f"(count, checksum) {got.tolist()} != expected {totals[rank].tolist()}")
    if len(out) and (list(out["uid"]) != uids or list(out["data_source"]) != sources):
        problems.append("uids/data sources differ from the expected samples or order")
    everyone: list = [None] * world
    dist.all_gather_object(everyone, problems)     # so whichever rank reports says it all
    failed = {r: p for r, p in enumerate(everyone) if p}
    if failed:
        raise RuntimeError(f"dataplane {method}: correctness check FAILED: {failed}")


def _worker(rank: int, world: int, method: str, n: int, repeats: int, seed: int,
            out_dir: str) -> None:
    torch.set_num_threads(1)             # W processes share few cores: no intra-op threads
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(minutes=10))
    try:
        move = METHODS[method]
        batch = _shard(rank, n, seed)
        all_dests = [_dests(src, n, world, seed) for src in range(world)]
        dest = all_dests[rank]
        sig = _signature(batch)
        sent = torch.zeros(world, 2, dtype=torch.int64)
        sent[:, 0] = torch.bincount(dest, minlength=world)
        sent[:, 1].index_add_(0, dest, sig)
        # Warm-up on a few samples: first-call costs (gloo pairs, allocator) are not timed.
        k = min(n, 4)
        move(batch.slice(0, k), dest[:k], [d[:k] for d in all_dests])
        times, cpus, peaks = [], [], []
        for _ in range(repeats):
            gc.collect()
            _trim()
            dist.barrier()
            with PeakRSS() as mem:
                t0, c0 = time.perf_counter(), time.process_time()   # CPU: all threads
                out = move(batch, dest, all_dests)
                times.append(time.perf_counter() - t0)
                cpus.append(time.process_time() - c0)
            peaks.append(mem.increase)
            _verify(out, sent, all_dests, method)
            del out
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"times": times, "cpus": cpus, "peaks": peaks, "bytes": batch.nbytes()}, f)
    finally:
        dist.destroy_process_group()


# --- the driver (this process only launches and reports; it moves no data) ---------------------
@contextlib.contextmanager
def _env(**values: str):
    """Set variables for the spawned workers; restore ours afterwards (main runs in-process)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_once(method: str, world: int, n: int, repeats: int, seed: int) -> dict:
    """One fresh launch of `world` processes. seconds: median over repeats of the max over
    ranks; peak (max over repeats) and CPU seconds (median): of the busiest rank for ours, of
    the coordinator (rank 0) for single."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp, _env(**env):
        mp.start_processes(_worker, args=(world, method, n, repeats, seed, tmp), nprocs=world,
                           join=True, start_method="spawn")
        ranks = []
        for r in range(world):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
    per_rep = lambda key, rs: [max(x[key][i] for x in rs) for i in range(repeats)]  # noqa: E731
    peak_ranks = ranks if method == "ours" else ranks[:1]
    return {"seconds": statistics.median(per_rep("times", ranks)),
            "cpu_seconds": statistics.median(per_rep("cpus", peak_ranks)),
            "peak_mib": max(per_rep("peaks", peak_ranks)) / MIB,
            "mib": sum(x["bytes"] for x in ranks) / MIB}


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dagrl bench dataplane", description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=lambda s: [int(x) for x in _floats(s)], default=[2, 4, 8],
                   help="worker process counts (default 2,4,8)")
    p.add_argument("--sizes", type=_floats, default=[16.0, 64.0, 256.0],
                   help="MiB of sample data per step, summed over workers (default 16,64,256)")
    p.add_argument("--per-worker-mib", type=float, default=32.0,
                   help="fixed-per-worker sweep: MiB per worker at each W (0 turns it off)")
    p.add_argument("--repeats", type=int, default=3, help="timed moves per launch (median)")
    p.add_argument("--rounds", type=int, default=3,
                   help="launch pairs per point, order alternating (median ratio)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write the rows and verdicts as JSON")
    return p.parse_args(argv)


def _fmt(x: float) -> str:
    return f"{x:.3f}" if x < 10 else f"{x:.1f}"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # (W, samples per rank) -> the sweeps that asked for it; shared points are measured once.
    points: dict[tuple[int, int], set[str]] = {}
    for w in args.workers:
        for mib in args.sizes:
            n = max(1, round(mib * MIB / (w * SAMPLE_BYTES)))
            points.setdefault((w, n), set()).add("total")
        if args.per_worker_mib > 0:
            n = max(1, round(args.per_worker_mib * MIB / SAMPLE_BYTES))
            points.setdefault((w, n), set()).add("per-worker")
    rows = []
    for (w, n), sweeps in sorted(points.items()):
        print(f"[dataplane] W={w}, {n * w * SAMPLE_BYTES / MIB:.0f} MiB/step ...",
              file=sys.stderr, flush=True)
        rows.append(measure_point(w, n, sweeps, args))
    cols = ["workers", "mib_per_step", "mib_per_worker", "ours_s", "single_s", "speedup",
            "ours_peak_mib", "coordinator_peak_mib", "mem_ratio", "cpu_speedup", "sweep",
            "round_ratios"]
    table = [cols] + [[r[c] if isinstance(r[c], (int, str)) else _fmt(r[c]) for c in cols]
                      for r in rows]
    widths = [max(len(str(line[i])) for line in table) for i in range(len(cols))]
    for line in table:
        print("  ".join(str(v).rjust(wd) for v, wd in zip(line, widths, strict=True)))
    print("all moves verified: every rank received exactly its samples (count, order, checksum)")
    print(f"speedup = median over {args.rounds} round(s) of single_s / ours_s, the two launched "
          f"back to back (load average {os.getloadavg()[0]:.1f} now)")
    for sweep in ("total", "per-worker"):
        pts = [r for r in rows if sweep in r["sweep"]]
        if sweep == "total":   # the largest step size, at each W
            pts = [max((r for r in pts if r["workers"] == w), key=lambda r: r["mib_per_step"])
                   for w in sorted({r["workers"] for r in pts})]
        if len(pts) >= 2:
            print(f"single-controller coordinator peak vs workers ({sweep} sweep): "
                  + ", ".join(f"W={r['workers']} {r['coordinator_peak_mib']:.0f} MiB "
                              f"({r['mib_per_step']:.0f} MiB/step)" for r in pts)
                  + "; ours per process: "
                  + ", ".join(f"{r['ours_peak_mib']:.0f}" for r in pts) + " MiB")
    print(f"cpu_speedup = coordinator CPU s / our busiest rank's CPU s: the speedup with a core "
          f"per worker ({os.cpu_count()} cores here)")
    targets = verdicts(rows, args)
    for line in targets["lines"]:
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "targets": targets}, f, indent=2)
    return 0


def measure_point(w: int, n: int, sweeps: set[str], args: argparse.Namespace) -> dict:
    """`args.rounds` pairs of launches (ours and single back to back, order alternating)."""
    runs: dict[str, list[dict]] = {"ours": [], "single": []}
    for r in range(args.rounds):
        for method in (("ours", "single") if r % 2 == 0 else ("single", "ours")):
            runs[method].append(run_once(method, w, n, args.repeats, args.seed))
    ratios = [s["seconds"] / o["seconds"] for o, s in zip(runs["ours"], runs["single"],
                                                          strict=True)]
    cpu = [s["cpu_seconds"] / o["cpu_seconds"] for o, s in zip(runs["ours"], runs["single"],
                                                              strict=True)]
    med = lambda method, key: statistics.median(x[key] for x in runs[method])  # noqa: E731
    ours_peak = max(x["peak_mib"] for x in runs["ours"])
    single_peak = max(x["peak_mib"] for x in runs["single"])
    return {
        "workers": w, "mib_per_step": round(runs["ours"][0]["mib"], 2),
        "mib_per_worker": round(runs["ours"][0]["mib"] / w, 2), "sweep": "+".join(sorted(sweeps)),
        "ours_s": med("ours", "seconds"), "single_s": med("single", "seconds"),
        "speedup": statistics.median(ratios), "round_ratios": ",".join(f"{x:.2f}" for x in ratios),
        "ours_cpu_s": med("ours", "cpu_seconds"), "single_cpu_s": med("single", "cpu_seconds"),
        "cpu_speedup": statistics.median(cpu),
        "ours_peak_mib": ours_peak, "coordinator_peak_mib": single_peak,
        "mem_ratio": single_peak / max(ours_peak, 1e-9), "verified": True}


def verdicts(rows: list[dict], args: argparse.Namespace) -> dict:
    """Target 1: speedup >= 3 at the largest size (for every W). Target 2: our per-process peak
    within FLAT_TOLERANCE (max/min) across W at a fixed per-worker batch."""
    out: dict = {"lines": []}
    totals = [r for r in rows if "total" in r["sweep"]]
    biggest = [max((r for r in totals if r["workers"] == w), key=lambda r: r["mib_per_step"])
               for w in sorted({r["workers"] for r in totals})]
    if biggest:
        ok = all(r["speedup"] >= 3 for r in biggest)
        out["speedup_met"] = ok
        shown = ", ".join(f"W={r['workers']} {r['speedup']:.1f}x" for r in biggest)
        cpu = ", ".join(f"{r['cpu_speedup']:.1f}x" for r in biggest)
        out["lines"].append(f"target speedup >= 3x at {biggest[0]['mib_per_step']:.0f} MiB/step: "
                            f"{shown} -> {'MET' if ok else 'NOT MET'} (cpu_speedup {cpu})")
    flat = [r for r in rows if "per-worker" in r["sweep"]]
    if len(flat) >= 2:
        peaks = [r["ours_peak_mib"] for r in flat]
        spread = max(peaks) / max(min(peaks), 1e-9)
        ok = spread <= FLAT_TOLERANCE
        out["flat_memory_met"] = ok
        ours = ", ".join(f"W={r['workers']} {r['ours_peak_mib']:.0f}" for r in flat)
        coord = ", ".join(f"{r['coordinator_peak_mib']:.0f}" for r in flat)
        out["lines"].append(
            f"target flat per-process peak at {args.per_worker_mib:g} MiB/worker: ours {ours} MiB "
            f"(max/min {spread:.2f}, tolerance {FLAT_TOLERANCE}) -> {'MET' if ok else 'NOT MET'}; "
            f"coordinator {coord} MiB")
    return out


if __name__ == "__main__":
    # Import through the package so spawned workers find `_worker` as benchmarks.dataplane._worker.
    from benchmarks.dataplane import main as _main

    sys.exit(_main())
