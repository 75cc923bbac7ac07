"""A small discrete-event simulator for the weak-scaling model (benchmarks/scale_model.py).

A task occupies one or more resources (a device, every device of a collective, the single
controller's driver) for a duration; it starts when each of its dependencies has ended and
each of its resources is free (tasks take a resource in the order they are submitted: the
program order of an SPMD worker or of a driver loop). A collective is one task on all its
participants, so it starts when the last of them arrives: the straggler sets the pace.

Two readings of a finished run: `critical_path()` walks back from the last task through
whichever predecessor (a dependency, or the previous task on a resource) ended last and sums
the durations by category (what the step's time is made of); `device_phases()` times each
phase per device as a worker's own clock would (waits included).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Task:
    name: str
    category: str
    resources: tuple
    duration: float
    deps: tuple[int, ...] = ()
    start: float = 0.0
    end: float = 0.0
    pred: int | None = None   # the predecessor that set the start (critical-path walk)


@dataclass
class Sim:
    tasks: list[Task] = field(default_factory=list)
    # resource -> (time it is free, index of the task that holds it until then)
    _free: dict = field(default_factory=dict)

    def add(self, name: str, category: str, resources, duration: float,
            deps=()) -> int:
        """Schedule a task now (earliest start given its dependencies and resources); returns
        its id."""
        if duration < 0:
            raise ValueError(f"task {name}: negative duration {duration}")
        resources = tuple(resources)
        start, pred = 0.0, None
        for d in deps:
            if self.tasks[d].end > start:
                start, pred = self.tasks[d].end, d
        for r in resources:
            free, holder = self._free.get(r, (0.0, None))
            if free > start:
                start, pred = free, holder
        task = Task(name, category, resources, duration, tuple(deps), start, start + duration,
                    pred)
        self.tasks.append(task)
        tid = len(self.tasks) - 1
        for r in resources:
            self._free[r] = (task.end, tid)
        return tid

    def end(self) -> float:
        return max((t.end for t in self.tasks), default=0.0)

    def critical_path(self) -> dict[str, float]:
        """Seconds per category along the path that ends last."""
        if not self.tasks:
            return {}
        tid: int | None = max(range(len(self.tasks)), key=lambda i: self.tasks[i].end)
        out: dict[str, float] = {}
        while tid is not None:
            t = self.tasks[tid]
            out[t.category] = out.get(t.category, 0.0) + t.duration
            tid = t.pred
        return out


def device_phases(sim: Sim, phase_of: dict[str, str]) -> dict[str, float]:
    """Per phase (`phase_of`: task name -> phase), the slowest device's time in it; a task's
    time on a device runs from the end of the device's previous task, so waiting for a
    collective counts. Resources other than devices (the driver) are left out."""
    prev: dict = {}
    spans: dict[str, dict] = {}
    for task in sim.tasks:
        phase = phase_of.get(task.name)
        for r in task.resources:
            if r == "driver":
                continue
            if phase is not None:
                per = spans.setdefault(phase, {})
                per[r] = per.get(r, 0.0) + task.end - prev.get(r, task.start)
            prev[r] = task.end
    return {k: max(v.values()) for k, v in spans.items()}
