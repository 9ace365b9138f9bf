"""The shared Ray instance's workers forked from the suite's zygote (tests/helpers/ray_zygote.py):
one sees what a fresh worker sees (environment, directory, thread pools, its own Ray import, the
suite's folders on its path), and a killed worker or a stopped instance leaves no process. The
client and zygote alone: tests/unit/test_ray_zygote.py."""

from __future__ import annotations

import os
import sys
import time

import pytest

import runs
from test_ray_zygote import zygote  # noqa: F401 (a fixture)


def _worker_facts() -> dict:
    """What one actor of the shared instance sees of itself (a new actor, so a new worker)."""
    import ray

    @ray.remote
    class Probe:
        def facts(self) -> dict:
            import sys

            import threadpoolctl
            import torch
            from diffusers import AutoencoderKL  # noqa: F401 - what a DiffusionWorker imports,
            import verl_digen.workers.worker  # noqa: F401 - and what they add to the environment

            return {
                "pid": os.getpid(),
                "ppid": os.getppid(),
                "cwd": os.getcwd(),
                "argv0": os.path.basename(sys.argv[0]),
                "env": {k: v for k, v in os.environ.items() if k not in ("DIGEN_ZYGOTE", "DIGEN_TEST_ZYGOTE")},
                "tests_on_path": os.path.dirname(os.path.abspath(runs.__file__)) in sys.path,
                "torch_threads": torch.get_num_threads(),
                "pools": sorted({p["num_threads"] for p in threadpoolctl.threadpool_info()}),
                "ray_job": ray.get_runtime_context().get_job_id(),
            }

    probe = Probe.remote()
    try:
        return ray.get(probe.facts.remote(), timeout=120)
    finally:
        ray.kill(probe)


@pytest.mark.e2e
def test_a_forked_worker_sees_what_a_fresh_worker_sees(tiny_cache, monkeypatch):
    """The same actor on the shared instance with plain Ray workers (``DIGEN_TEST_ZYGOTE=0``) and
    with the zygote's: the zygote's is its child, and has the same environment (but the socket
    variable and what Ray sets per worker process), directory, path and thread pools."""
    runs.shared_ray_down()
    monkeypatch.setenv("DIGEN_TEST_ZYGOTE", "0")
    try:
        runs.shared_ray_up()
        plain = _worker_facts()
        runs.shared_ray_down()
        monkeypatch.delenv("DIGEN_TEST_ZYGOTE")
        runs.shared_ray_up()
        forked = _worker_facts()
    finally:
        runs.shared_ray_down()
    assert runs._zygote is not None, "the zygote did not start (see the warning above)"
    zygote = runs._zygote[0]
    assert forked["ppid"] == zygote.pid and plain["ppid"] != zygote.pid
    assert forked["argv0"] == plain["argv0"] == "default_worker.py"
    assert forked["cwd"] == plain["cwd"] and forked["tests_on_path"] and plain["tests_on_path"]
    # per-process values Ray gives each worker (its ids, ports, the job's start time) differ
    per_process = {k for k in plain["env"] if plain["env"][k] != forked["env"].get(k)}
    assert set(plain["env"]) == set(forked["env"]), set(plain["env"]) ^ set(forked["env"])
    assert all(k.startswith("RAY_") for k in per_process), per_process
    assert forked["env"]["OMP_NUM_THREADS"] == plain["env"]["OMP_NUM_THREADS"] == "1"
    assert forked["torch_threads"] == plain["torch_threads"] == 1
    assert forked["pools"] == plain["pools"] == [1]


@pytest.mark.e2e
def test_a_killed_worker_and_a_stopped_instance_leave_no_process(shared_ray):
    import psutil
    import ray

    @ray.remote
    class Pid:
        def pid(self) -> int:
            return os.getpid()

    actors = [Pid.remote() for _ in range(2)]
    pids = [ray.get(a.pid.remote(), timeout=120) for a in actors]
    assert runs._zygote is not None, "the zygote did not start (see the warning above)"
    zygote = psutil.Process(runs._zygote[0].pid)
    assert set(pids) <= {c.pid for c in zygote.children()}
    ray.kill(actors[0])
    deadline = time.monotonic() + 60
    while psutil.pid_exists(pids[0]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not psutil.pid_exists(pids[0])
    runs.shared_ray_down()
    deadline = time.monotonic() + 60
    while any(psutil.pid_exists(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(psutil.pid_exists(p) for p in pids)
    while zygote.children() and time.monotonic() < deadline:  # the instance's other workers
        time.sleep(0.2)
    assert not zygote.children()
    # the zygote outlives the instance (Ray kills a stopped worker's process group, which is the
    # worker's own) and serves the next one (ray.init's own variables do not restart it)
    assert zygote.is_running() and zygote.status() != psutil.STATUS_ZOMBIE
    runs.shared_ray_up()
    again = Pid.remote()
    assert psutil.Process(ray.get(again.pid.remote(), timeout=120)).ppid() == zygote.pid == runs._zygote[0].pid
