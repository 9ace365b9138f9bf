"""Timelines: who ran what, when; bubble fraction; Gantt charts."""

from __future__ import annotations

import bisect
import json
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class TaskRecord:
    task: str
    kind: str
    workers: list[str]
    start: float
    end: float
    step: int
    version: int
    groups: list[int] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    stage: int | None = None  # a TSP generate stage's index

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class Timeline:
    """Task intervals, appended as tasks finish.

    The loop asks per-step questions every step (this step's records, the busy time in the
    last window); an index by step and the finishing order (runners record tasks as they
    end, so ends never decrease) keep those questions proportional to one step, not to the
    whole run so far.
    """

    workers: list[str]
    records: list[TaskRecord] = field(default_factory=list)

    def __post_init__(self) -> None:
        given, self.records = self.records, []
        self._ends: list[float] = []
        self._by_step: dict[int, list[TaskRecord]] = {}
        self._ordered = True
        for r in given:
            self.add(r)

    def add(self, record: TaskRecord) -> None:
        if self._ends and record.end < self._ends[-1]:
            self._ordered = False  # added out of finishing order: window queries scan everything
        self.records.append(record)
        self._ends.append(record.end)
        self._by_step.setdefault(record.step, []).append(record)

    def of_step(self, step: int) -> list[TaskRecord]:
        """The records of tasks serving training step ``step``."""
        return self._by_step.get(step, [])

    def since(self, t0: float) -> list[TaskRecord]:
        """The records that end after ``t0``: the only ones that can overlap a window from ``t0``."""
        if self._ordered:
            return self.records[bisect.bisect_right(self._ends, t0) :]
        return [r for r in self.records if r.end > t0]

    def busy_seconds(self, t0: float, t1: float) -> dict[str, float]:
        """Busy time of each worker clipped to the window ``[t0, t1]``."""
        busy = {w: 0.0 for w in self.workers}
        for r in self.since(t0):
            lo, hi = max(r.start, t0), min(r.end, t1)
            if hi > lo:
                for w in r.workers:
                    busy[w] += hi - lo
        return busy

    def bubble_fraction(self, t0: float, t1: float) -> float:
        """1 - busy device-time / (devices x wall time) over ``[t0, t1]``."""
        wall = t1 - t0
        if wall <= 0 or not self.workers:
            return 0.0
        busy = sum(self.busy_seconds(t0, t1).values())
        return max(0.0, 1.0 - busy / (len(self.workers) * wall))

    def edge_idle(
        self, workers: list[str], t0: float, t1: float, *, head_kind: str | None = None, drain_kind: str | None = None
    ) -> tuple[float, float]:
        """Mean idle fraction of ``workers`` at the start (head) and the end (drain) of ``[t0, t1]``.

        Head: idle time from ``t0`` until a worker's first ``head_kind`` task (any task when
        None); drain: idle time after its last ``drain_kind`` task until ``t1``. Other work in
        those intervals (a weight sync, say) is not idle. A worker without such a task is idle
        for the whole window (head).
        """
        wall = t1 - t0
        if wall <= 0 or not workers:
            return 0.0, 0.0
        head = drain = 0.0
        for w in workers:
            recs = [r for r in self.since(t0) if w in r.workers and r.start < t1]

            def busy(a: float, b: float) -> float:
                return sum(max(0.0, min(r.end, b) - max(r.start, a)) for r in recs)

            firsts = [r.start for r in recs if head_kind is None or r.kind == head_kind]
            if not firsts:
                head += wall - busy(t0, t1)
                continue
            first = max(min(firsts), t0)
            head += (first - t0) - busy(t0, first)
            lasts = [r.end for r in recs if drain_kind is None or r.kind == drain_kind]
            last = min(max(lasts), t1) if lasts else t0
            drain += (t1 - last) - busy(last, t1)
        n = len(workers) * wall
        return max(0.0, head / n), max(0.0, drain / n)

    def write_jsonl(self, path: str, t0: float = 0.0) -> None:
        with open(path, "w") as f:
            for r in self.records:
                d = asdict(r)
                d["worker"] = ",".join(r.workers)  # gang tasks (optimizer step, sync) list every worker
                d["start"] -= t0
                d["end"] -= t0
                f.write(json.dumps(d) + "\n")

    @classmethod
    def read_jsonl(cls, path: str) -> "Timeline":
        records = []
        with open(path) as f:
            for line in f:
                d = json.loads(line)
                d.pop("worker", None)
                records.append(TaskRecord(**d))
        workers = sorted({w for r in records for w in r.workers})
        return cls(workers=workers, records=records)


KIND_COLORS = {
    "generate": "#4C72B0",
    "reward": "#DD8452",
    "train": "#55A868",
    "optimizer_step": "#C44E52",
    "sync": "#8172B3",
}


def save_gantt(timeline: Timeline, path: str, *, t0: float, t1: float, title: str = "") -> None:
    """A Gantt chart PNG of ``[t0, t1]``: one row per worker, one colour per task kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    workers = timeline.workers
    height = 1.3 + 0.45 * len(workers)  # inches: the rows, the axis and a legend strip below
    fig, ax = plt.subplots(figsize=(10, height))
    for r in timeline.records:
        if r.end < t0 or r.start > t1:
            continue
        for w in r.workers:
            y = workers.index(w)
            ax.barh(y, r.end - r.start, left=r.start - t0, height=0.8, color=KIND_COLORS.get(r.kind, "grey"),
                    edgecolor="black", linewidth=0.3)
            if r.kind == "generate" and (r.end - r.start) > (t1 - t0) * 0.03:
                ax.text(r.start - t0 + (r.end - r.start) / 2, y, f"v{r.version}", ha="center", va="center", fontsize=6)
    ax.set_yticks(range(len(workers)))
    ax.set_yticklabels(workers)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    bubble = timeline.bubble_fraction(t0, t1)
    ax.set_title(f"{title}  bubble fraction {bubble:.2f}".strip())
    fig.legend(handles=[Patch(color=c, label=k) for k, c in KIND_COLORS.items()], loc="lower center", ncol=5,
               fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.3 / height, 1, 1))  # the bottom 0.3 inch is the legend's
    fig.savefig(path, dpi=110)
    plt.close(fig)
