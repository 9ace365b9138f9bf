"""Where the CPU time of one end-to-end test's run goes: every process's CPU seconds during one
in-process run on the suite's shared Ray instance.

    python benchmarks/run_cpu.py                                   # the default two-step run
    python benchmarks/run_cpu.py digen.placement=disaggregated ...  # any overrides of a run

It starts the Ray instance the suite shares (``tests/helpers/runs.py: shared_ray_up``) with the tiny
models in a temporary cache, makes one run to warm this process up (imports, the tiny model
built), then snapshots the CPU times of every process on the machine (psutil) before and after a
second run and prints the wall time, the total, and the processes that used the most. The worker
processes of the measured run are new, so their whole start is in it, as in a test: forked from the
suite's zygote (``tests/helpers/ray_zygote.py``), or started plain by Ray with ``DIGEN_TEST_ZYGOTE=0``.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def cpu_by_process() -> dict[int, tuple[float, float, str]]:
    """pid -> (user s, system s, command line) of every process psutil can read."""
    import psutil

    seen = {}
    for proc in psutil.process_iter(["pid", "name", "cmdline", "cpu_times"]):
        try:
            times, cmd = proc.info["cpu_times"], proc.info["cmdline"] or [proc.info["name"] or "?"]
            seen[proc.info["pid"]] = (times.user, times.system, " ".join(cmd)[:90])
        except Exception:  # noqa: BLE001 - a process that ended or is not ours to read
            continue
    return seen


def main(overrides: list[str]) -> None:
    work = tempfile.mkdtemp(prefix="run_cpu_")
    os.environ.setdefault("VERL_DIGEN_CACHE", os.path.join(work, "cache"))
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "helpers"))
    import runs

    class Dir(str):  # what runs.run expects of pytest's tmp_path: `tmp_path / name`
        def __truediv__(self, name: str) -> str:
            return os.path.join(self, name)

    overrides = overrides or ["trainer.total_training_steps=2"]
    runs.shared_ray_up()
    try:
        runs.run(Dir(work), "warm_up", *overrides)
        time.sleep(2)  # let the warm-up run's workers exit
        before, start = cpu_by_process(), time.time()
        runs.run(Dir(work), "measured", *overrides)
        after, wall = cpu_by_process(), time.time() - start
    finally:
        runs.shared_ray_down()
    rows = []
    for pid, (user, system, cmd) in after.items():
        user0, system0, _ = before.get(pid, (0.0, 0.0, ""))
        if user - user0 + system - system0 > 0.05:
            rows.append((user - user0, system - system0, pid, cmd))
    rows.sort(key=lambda r: -(r[0] + r[1]))
    print(f"run {' '.join(overrides)}: {wall:.1f} s wall, {sum(r[0] + r[1] for r in rows):.1f} s CPU "
          f"({sum(r[0] for r in rows):.1f} user + {sum(r[1] for r in rows):.1f} system)")
    print(f"{'user s':>7} {'sys s':>6} {'pid':>7}  process")
    for user, system, pid, cmd in rows[:12]:
        print(f"{user:7.2f} {system:6.2f} {pid:7d}  {cmd}")


if __name__ == "__main__":
    main(sys.argv[1:])
