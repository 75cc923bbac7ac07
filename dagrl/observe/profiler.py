"""torch.profiler around the chosen tasks, one Chrome trace per rank, and one merged timeline.

With `profiler.enable=true`, every rank in `profiler.ranks` records the tasks of the chosen
`profiler.roles` (a node task, and the reshard / balance task before it) in the chosen
`profiler.steps`. Each recorded task is one profiler session wrapped in a span named
`node:<id>`, `reshard:<id>` or `balance:<id>`, so DAG nodes show up as named spans with the
operators, kernels and collectives (`gloo:*`, `nccl:*`, `record_param_comms`) under them; a
`memory` counter track holds host RSS and device peak memory at each task's end.

After the last profiled step, each recording rank writes `RUN_DIR/profile/rank<r>.trace.json`;
at the end of the run the traces are gathered to rank 0 over the CPU group (so no shared
filesystem is needed), which writes `RUN_DIR/profile/trace.json`: one process track per rank,
on one clock. Open it in https://ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from dagrl.config.loader import ConfigError
from dagrl.config.schema import ProfilerConfig
from dagrl.dag.planner import Task
from dagrl.device import profiler_for
from dagrl.observe.run_files import naming_path

PROFILE_DIR = "profile"
MERGED_TRACE = "trace.json"


def span_name(task: Task) -> str:
    """The trace span of a task: node:<id>, reshard:<id> or balance:<id>."""
    return f"{task.kind}:{task.node_id}"


class TaskProfiler:
    """One rank's recorder (`rank`: its global rank). `task()` brackets a task, `end_step()`
    follows each step, `merge()` is collective at the end of the run."""

    def __init__(self, cfg: ProfilerConfig, graph_roles: set[str], rank: int,
                 device: torch.device, run_dir: Path) -> None:
        unknown = sorted(set(cfg.roles) - graph_roles)
        if cfg.enable and unknown:
            raise ConfigError(f"profiler.roles: {unknown} not in the graph (its roles: "
                              f"{', '.join(sorted(graph_roles))})")
        self.cfg, self.rank, self.device = cfg, rank, device
        self.out_dir = run_dir / PROFILE_DIR
        self.records_rank = cfg.enable and (not cfg.ranks or rank in cfg.ranks)
        self.last_step = max(cfg.steps) if cfg.enable else 0
        self.events: list[dict] = []
        self.base_ns: int | None = None     # the clock origin of this rank's trace
        self.device_properties: list = []
        self.trace: dict | None = None      # this rank's, once its last profiled step is done
        self._recording = False

    def records(self, step: int, task: Task) -> bool:
        return (self.records_rank and step in self.cfg.steps
                and (not self.cfg.roles or task.role in self.cfg.roles))

    @contextlib.contextmanager
    def task(self, step: int, task: Task) -> Iterator[None]:
        if not self.records(step, task):
            yield
            return
        if self._recording:
            # A task run from inside a recorded one (DAPO's filter re-running the plan):
            # the profiler is already on, one more span is enough.
            with torch.profiler.record_function(span_name(task)):
                yield
            return
        profile, activities = profiler_for(self.device.type)
        prof = profile(activities=activities)
        self._recording = True
        try:
            with prof, torch.profiler.record_function(span_name(task)):
                yield
        finally:
            self._recording = False
        self._collect(prof, step)

    def _collect(self, prof, step: int) -> None:
        """Export the session and append its events, shifted onto this rank's clock origin."""
        fd, tmp = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        try:
            prof.export_chrome_trace(tmp)
            with open(tmp, encoding="utf-8") as f:
                trace = json.load(f)
        finally:
            os.unlink(tmp)
        base = int(trace.get("baseTimeNanoseconds", 0))
        if self.base_ns is None:
            self.base_ns = base
            self.device_properties = trace.get("deviceProperties", [])
        shift_us = (base - self.base_ns) / 1000
        for event in trace.get("traceEvents", []):
            if "ts" in event:
                event["ts"] = float(event["ts"]) + shift_us
            name = event.get("name", "")
            if event.get("cat") == "user_annotation" and name.split(":", 1)[0] in (
                    "node", "reshard", "balance"):
                event.setdefault("args", {})["step"] = step
            self.events.append(event)

    def counter(self, values: dict[str, float]) -> None:
        """A `memory` counter sample now; call right after a task this rank recorded."""
        if self.base_ns is None:
            return
        ts = (time.time_ns() - self.base_ns) / 1000
        self.events.append({"ph": "C", "name": "memory", "pid": os.getpid(), "tid": 0,
                            "ts": ts, "args": values})

    def end_step(self, step: int) -> None:
        """Call after each step. After the last profiled step: write this rank's trace."""
        if step != self.last_step or not (self.records_rank and self.events):
            return
        self.trace = {"traceEvents": self.events, "baseTimeNanoseconds": self.base_ns,
                      "deviceProperties": self.device_properties, "displayTimeUnit": "ms",
                      "dagrl": {"rank": self.rank, "steps": list(self.cfg.steps),
                                "roles": list(self.cfg.roles)}}
        self.events = []
        self.out_dir.mkdir(parents=True, exist_ok=True)
        _write_json(self.out_dir / f"rank{self.rank}.trace.json", self.trace)

    def merge(self, group: dist.ProcessGroup | None, distributed: bool) -> Path | None:
        """Collective over every rank, once, at the end of the run (an async run's two sides
        finish their profiled steps at different times): gather the traces to rank 0, which
        writes the merged one (returned on rank 0)."""
        if not self.cfg.enable:
            return None
        if distributed:
            gathered = [None] * dist.get_world_size(group) if self.rank == 0 else None
            dist.gather_object(self.trace, gathered, dst=0, group=group)
        else:
            gathered = [self.trace]
        if self.rank != 0:
            return None
        traces = [t for t in gathered if t is not None]
        if not traces:
            return None
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / MERGED_TRACE
        _write_json(path, merge_traces(traces))
        return path


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    with naming_path(tmp), open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f)
    tmp.replace(path)


def merge_traces(traces: list[dict]) -> dict:
    """Per-rank traces (as written by TaskProfiler) -> one Chrome trace: pid = rank (one
    process track per rank, named `rank <r>`), each original (process, thread) a thread track
    inside it, all on one clock starting at 0."""
    base = min(int(t["baseTimeNanoseconds"]) for t in traces)
    merged: list[dict] = []
    for trace in sorted(traces, key=lambda t: t["dagrl"]["rank"]):
        rank = trace["dagrl"]["rank"]
        shift_us = (int(trace["baseTimeNanoseconds"]) - base) / 1000
        process_names: dict = {}
        thread_names: dict = {}
        for e in trace["traceEvents"]:
            if e.get("ph") == "M" and e.get("name") == "process_name":
                process_names[e["pid"]] = e["args"]["name"]
            elif e.get("ph") == "M" and e.get("name") == "thread_name":
                thread_names[(e["pid"], e["tid"])] = e["args"]["name"]
        tids: dict = {}
        for e in trace["traceEvents"]:
            if e.get("ph") == "M":
                continue
            if e.get("ph") == "C":      # counters belong to the process, not a thread
                out = dict(e, pid=rank, tid=0)
            else:
                key = (e.get("pid"), e.get("tid"))
                if key not in tids:
                    tids[key] = len(tids)
                out = dict(e, pid=rank, tid=tids[key])
            if "ts" in out:
                out["ts"] = float(out["ts"]) + shift_us
            if out.get("ph") in ("s", "t", "f") and "id" in out:
                out["id"] = f"{rank}:{out['id']}"      # flow ids are per process: keep distinct
            merged.append(out)
        merged.append(_meta("process_name", rank, 0, name=f"rank {rank}"))
        merged.append(_meta("process_sort_index", rank, 0, sort_index=rank))
        for (pid, tid), new_tid in tids.items():
            pname = process_names.get(pid, "")
            tname = thread_names.get((pid, tid), f"thread {tid}")
            label = tname if pname in ("", "python") or pname in tname else f"{pname} {tname}"
            merged.append(_meta("thread_name", rank, new_tid, name=label))
            merged.append(_meta("thread_sort_index", rank, new_tid, sort_index=new_tid))
    timed = [e["ts"] for e in merged if e.get("ph") != "M" and "ts" in e]
    t0 = min(timed) if timed else 0.0
    for e in merged:
        if "ts" in e and e.get("ph") != "M":
            e["ts"] = round(e["ts"] - t0, 3)
    return {"traceEvents": merged, "displayTimeUnit": "ms",
            "baseTimeNanoseconds": base + int(t0 * 1000),
            "otherData": {"dagrl": {"ranks": sorted(t["dagrl"]["rank"] for t in traces),
                                    "steps": traces[0]["dagrl"]["steps"]}}}


def _meta(kind: str, pid: int, tid: int, **args) -> dict:
    return {"ph": "M", "name": kind, "pid": pid, "tid": tid, "args": args}


def top_spans(trace: dict, limit: int = 15, skip_categories: frozenset | set = frozenset()
              ) -> list[dict]:
    """The complete events taking the most total (inclusive) time, summed over ranks:
    name, cat, count, total_ms."""
    totals: dict[tuple[str, str], list[float]] = {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and "dur" in e and e.get("cat", "") not in skip_categories:
            entry = totals.setdefault((e.get("name", ""), e.get("cat", "")), [0, 0.0])
            entry[0] += 1
            entry[1] += float(e["dur"]) / 1000
    rows = [{"name": n, "cat": c, "count": k, "total_ms": ms} for (n, c), (k, ms) in totals.items()]
    return sorted(rows, key=lambda r: -r["total_ms"])[:limit]
