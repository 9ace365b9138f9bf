"""The suite's shared Ray instance starts its workers from a zygote (tests/helpers/ray_zygote.py):
a worker forked from it must be what a fresh worker is (environment, directory, thread pools, its
own Ray import), and a stopped worker must leave no process behind. The tests here check the
client and zygote alone, on a script instead of Ray's worker and with nothing preloaded; the
shared instance's real workers: tests/e2e/test_ray_zygote_e2e.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import ray_zygote

SCRIPT = """
import json, os, signal, sys, time
what = sys.argv[1]
if what == "facts":
    print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "x": os.environ.get("X"), "y": os.environ.get("Y"),
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


SETUP_STAND_IN = """
import json, sys
print(json.dumps({"ray_setup": sys.argv[1:]}), flush=True)
"""


def _through_interpreter(tmp_path, zygote, context: dict, *args: str) -> subprocess.CompletedProcess:
    """Run what a raylet started with :class:`ray_zygote.as_ray_python` runs for a worker with a
    runtime environment: the interpreter script, Ray's set-up (a stand-in that prints its
    arguments, run only if the client hands the set-up back) and ``default_worker.py`` (SCRIPT)."""
    work = tmp_path / "ray_workers"
    work.mkdir(exist_ok=True)
    (work / "setup_worker.py").write_text(SETUP_STAND_IN)
    (work / "default_worker.py").write_text(SCRIPT)
    interpreter = os.path.join(zygote[0].socket_dir, ray_zygote.INTERPRETER)
    env = {**os.environ, ray_zygote.ENV: zygote[1]["env_vars"][ray_zygote.ENV], "X": "y"}
    return subprocess.run([interpreter, str(work / "setup_worker.py"),
                           f"--serialized-runtime-env-context={json.dumps(context)}", "--language=PYTHON",
                           str(work / "default_worker.py"), *args],
                          env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=60)


def test_the_interpreter_script_does_rays_worker_setup_in_the_client_for_the_suites_environments(tmp_path, zygote):
    context = {"command_prefix": [], "env_vars": {"X": "${X}-z", "Y": "${NOT_SET}w"},
               "py_executable": ray_zygote.client_command(), "override_worker_entrypoint": None, "java_jars": []}
    done = _through_interpreter(tmp_path, zygote, context, "facts")
    assert done.returncode == 3, done.stderr
    facts = json.loads(done.stdout)
    assert facts["ppid"] == zygote[0].pid  # the worker, forked by the zygote: Ray's set-up never ran
    assert facts["argv"] == [str(tmp_path / "ray_workers" / "default_worker.py"), "facts"]
    assert (facts["x"], facts["y"]) == ("y-z", "w")  # ${X} expanded, an unset one empty, as Ray's update_envs
    # any other context (a command prefix, another interpreter): Ray's own set-up, arguments unchanged
    for other in ({**context, "command_prefix": ["nice"]}, {**context, "py_executable": sys.executable}):
        done = _through_interpreter(tmp_path, zygote, other, "facts")
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["ray_setup"][:2] == [f"--serialized-runtime-env-context={json.dumps(other)}",
                                                            "--language=PYTHON"]
    # and what is not a worker runs on the real interpreter
    interpreter = os.path.join(zygote[0].socket_dir, ray_zygote.INTERPRETER)
    out = subprocess.run([interpreter, "-c", "import sys; print(sys.executable)"], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == sys.executable


def test_a_client_with_no_zygote_starts_a_plain_python_and_says_so(tmp_path):
    client = _client(tmp_path, str(tmp_path / "nowhere.sock"), "facts")
    out, err = client.communicate(timeout=60)
    assert client.returncode == 3
    assert json.loads(out)["ppid"] == os.getpid()  # the client became the script: our child
    assert "starting a plain worker" in err


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
