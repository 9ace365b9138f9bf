"""The suite's shared Ray instance starts its workers from a zygote (tests/ray_zygote.py): a worker
forked from it must be what a fresh worker is (environment, directory, thread pools, its own Ray
import), and a stopped worker must leave no process behind. The first tests check the client and
zygote alone, on a script instead of Ray's worker and with nothing preloaded (fast lane)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import ray_zygote
import runs

SCRIPT = """
import json, os, signal, sys, time
what = sys.argv[1]
if what == "facts":
    print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "x": os.environ.get("X"),
                      "ppid": os.getppid(), "pid": os.getpid(), "pgid": os.getpgid(0), "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, ())),
                      "main": __name__}), flush=True)
    sys.exit(3)
if what == "signal":
    os.kill(os.getpid(), signal.SIGTERM)
if what == "wait":
    print(os.getpid(), flush=True)
    time.sleep(120)
"""


@pytest.fixture
def zygote(tmp_path):
    proc, fields = ray_zygote.start(str(tmp_path / "z"), preload=["json"])
    try:
        yield proc, fields
    finally:
        ray_zygote.stop(proc)


def _client(tmp_path, socket_path: str, *args: str, block_sigint: bool = False) -> subprocess.Popen:
    script = tmp_path / "work" / "script.py"
    script.parent.mkdir(exist_ok=True)
    script.write_text(SCRIPT)
    env = {**os.environ, ray_zygote.ENV: socket_path, "X": "y"}
    block = (lambda: signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])) if block_sigint else None
    return subprocess.Popen([sys.executable, "-I", "-S", ray_zygote.__file__, "client", str(script), *args],
                            env=env, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=block)


def test_a_zygote_child_runs_the_command_as_python_would_and_exits_with_its_status(tmp_path, zygote):
    proc, fields = zygote
    client = _client(tmp_path, fields["env_vars"][ray_zygote.ENV], "facts", "more", block_sigint=True)
    out, err = client.communicate(timeout=60)
    assert client.returncode == 3, err
    facts = json.loads(out)
    script = str(tmp_path / "work" / "script.py")
    assert facts["argv"] == [script, "facts", "more"] and facts["path0"] == str(tmp_path / "work")
    assert facts["cwd"] == str(tmp_path) and facts["x"] == "y" and facts["main"] == "__main__"
    assert facts["ppid"] == proc.pid  # forked by the zygote, not run by the client
    assert facts["pgid"] == facts["pid"]  # a group of its own (Ray kills a stopped worker's group)
    assert int(signal.SIGINT) in facts["blocked"]  # Ray's workers start with SIGINT blocked
    # a worker killed by a signal: its client ends by the same signal
    client = _client(tmp_path, fields["env_vars"][ray_zygote.ENV], "signal")
    client.communicate(timeout=60)
    assert client.returncode == -signal.SIGTERM


def test_a_signal_to_the_client_reaches_the_worker_and_a_killed_client_takes_it_along(tmp_path, zygote):
    import psutil

    socket_path = zygote[1]["env_vars"][ray_zygote.ENV]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        client = _client(tmp_path, socket_path, "wait")
        worker = int(client.stdout.readline())
        os.kill(client.pid, sig)
        client.communicate(timeout=60)
        assert client.returncode == -sig
        deadline = time.monotonic() + 30
        while not _gone(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(worker)


def _gone(pid: int) -> bool:
    """Whether process ``pid`` ended (a zombie counts): it may end between any two looks at it."""
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_client_with_no_zygote_starts_a_plain_python_and_says_so(tmp_path):
    client = _client(tmp_path, str(tmp_path / "nowhere.sock"), "facts")
    out, err = client.communicate(timeout=60)
    assert client.returncode == 3
    assert json.loads(out)["ppid"] == os.getpid()  # the client became the script: our child
    assert "starting a plain worker" in err


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


def test_a_zygote_whose_preloads_start_a_thread_refuses_to_start(tmp_path, monkeypatch):
    """A fork copies only the forking thread: a lock another thread held stays held in the child.
    A preload that leaves a thread running stops the zygote at its start (and the suite on plain
    workers, see runs.py)."""
    (tmp_path / "threader.py").write_text("import threading, time\nthreading.Thread(target=time.sleep, args=(60,), "
                                          "daemon=True).start()\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    with pytest.raises(RuntimeError, match="threads after the preloads"):
        ray_zygote.start(str(tmp_path / "z"), preload=["threader"])
    assert not (tmp_path / "z").exists()  # its socket folder removed
