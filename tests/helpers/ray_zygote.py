"""Ray worker processes of the suite's shared Ray instance, forked from an interpreter that
imported torch, transformers, diffusers and peft once.

Why hand-written: a Ray actor gets a new process, and a worker of a tiny run spends ~4.5 of its
~5.3 CPU seconds importing those libraries (``PYTHONPROFILEIMPORTTIME=1`` on a worker: torch with
its compiler stack, diffusers' models, peft, transformers with scikit-learn and pandas). The
suite's runs start hundreds of such workers on 2 cores. Ray has no fork server of its own, but it
lets a runtime environment name the command that starts a worker (``py_executable``): this
module's client is that command. It hands its argv, environment, directory and standard streams
to the zygote, which forks a child that runs Ray's own ``default_worker.py`` as ``python`` would
have. The worker is a real Ray worker of the real cluster (it registers itself with the raylet
by its startup token), with the same environment; only the imports above were done before it
started, in a process that never imported Ray or veRL (checked at its start).

    python tests/helpers/ray_zygote.py serve SOCKET MODULES  # the zygote (the suite starts it)
    python -I -S tests/helpers/ray_zygote.py client ARGV...  # what Ray runs for a worker

Lifetimes: the zygote exits when its parent (the pytest process) is gone or on SIGTERM; a child
exits when its client is gone (Ray stops a worker by its client's pid when it never registered);
a client exits with its child's exit status and passes on the signals Ray sends it.
``DIGEN_TEST_ZYGOTE=0`` turns it off (plain Ray workers).

Linux only (``SCM_RIGHTS``, ``os.pidfd_open`` with a polling fallback).
"""

from __future__ import annotations

import array
import json
import os
import signal
import socket
import struct
import sys

# Imported once by the zygote: the libraries a DiffusionWorker imports that do not import Ray
# (veRL does, through verl.protocol: Ray reads its environment when imported, so it is imported
# fresh by each child). The diffusers and transformers submodules are the ones the tiny models use.
PRELOAD = [
    "torch",
    "torch.distributed.fsdp",
    "tensordict",
    "transformers",
    "peft",
    "diffusers",
    "diffusers.models.autoencoders",
    "diffusers.models.transformers",
    "diffusers.schedulers",
    "transformers.models.clip.modeling_clip",
    "transformers.models.t5.modeling_t5",
    "safetensors.torch",
    "PIL.Image",
]
ENV = "DIGEN_ZYGOTE"  # the socket path, in the workers' environment
# where a child starts instead of the raylet's directory, when the job's environment says so: the
# directory of a driver that joined the suite's shared instance (runs.shared_ray_driver_env), as a
# worker of an instance that driver had started would
CWD_ENV = "DIGEN_ZYGOTE_CWD"


def _send(sock: socket.socket, payload: bytes, fds: list[int]) -> None:
    sock.sendall(struct.pack("!I", len(payload)))
    sent = sock.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    sock.sendall(payload[sent:])


def _recv(sock: socket.socket) -> tuple[bytes, list[int]]:
    head = sock.recv(4, socket.MSG_WAITALL)
    if len(head) < 4:
        raise EOFError
    (size,) = struct.unpack("!I", head)
    fds = array.array("i")
    data, ancillary, _, _ = sock.recvmsg(size, socket.CMSG_LEN(3 * fds.itemsize))
    for level, kind, raw in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(raw[: len(raw) - len(raw) % fds.itemsize])
    while len(data) < size:
        more = sock.recv(size - len(data))
        if not more:
            raise EOFError
        data += more
    return data, list(fds)


# ---------------------------------------------------------------------------------- the client


def _plain(argv: list[str], why: str) -> None:
    """Become ``python ARGV`` (a plain worker), saying why on the worker's stderr."""
    print(f"ray_zygote: {why}; starting a plain worker", file=sys.stderr, flush=True)
    os.execv(sys.executable, [sys.executable, *argv])


def _forward(child: int):
    def handler(number: int, _frame) -> None:
        try:
            os.kill(child, number)
        except ProcessLookupError:
            pass

    return handler


def client_command() -> str:
    """The command line of the client (what a runtime environment names as ``py_executable``)."""
    import shlex

    return " ".join(shlex.quote(a) for a in (sys.executable, "-I", "-S", os.path.abspath(__file__), "client"))


def client(argv: list[str]) -> int:
    """Run ``python ARGV`` (Ray's worker command) as a child of the zygote; return its exit status
    (or end by its signal). A zygote that cannot be reached or does not answer: a plain worker.
    ``ARGV`` may be Ray's worker set-up (``setup_worker.py ...``, :class:`as_ray_python`): its
    part is done here first (:func:`_setup_worker`)."""
    if argv and argv[0].endswith("setup_worker.py"):
        argv = _setup_worker(argv, client_command())
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(os.environ.get(ENV, ""))  # none: a worker of an instance the suite did not start
        request = {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "client": os.getpid(),
                   "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, ()))}
        _send(sock, json.dumps(request).encode(), [0, 1, 2])
        answer = sock.recv(4, socket.MSG_WAITALL)
    except OSError as e:
        sock.close()
        _plain(argv, f"no zygote ({e})")
    if len(answer) < 4:
        sock.close()
        _plain(argv, "the zygote did not start the worker")
    (child,) = struct.unpack("!i", answer)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, _forward(child))
    status = sock.recv(4, socket.MSG_WAITALL)
    sock.close()
    if len(status) < 4:
        return 1  # the zygote went away: its child exits with its client (this process)
    (code,) = struct.unpack("!i", status)
    if code < 0:  # the worker died of a signal: so does this process
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        return 128 - code
    return code


# ----------------------------------------------------------------------------------- the zygote


def _watch_client(pid: int) -> None:
    """In a child: exit when its client process is gone (Ray killed it)."""
    import threading

    def watch() -> None:
        try:
            import select

            fd = os.pidfd_open(pid)
            select.select([fd], [], [])
        except OSError:  # no pidfd (old kernel, sandbox): poll
            import time

            while True:
                time.sleep(1.0)
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
        os._exit(1)

    threading.Thread(target=watch, name="zygote-client-watch", daemon=True).start()


def _child(request: dict, fds: list[int], import_env: dict[str, str]) -> None:
    """In the forked child: become ``python ARGV`` with the client's environment, streams and
    blocked signals (Ray starts its workers with SIGINT blocked), and what the preloaded imports
    added to the environment unless the client's sets it. Returns only by raising: SystemExit
    when the worker ends, which ends this process as it ends a fresh interpreter (atexit
    handlers, thread shutdown, flushed streams)."""
    for sig in (signal.SIGCHLD, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, request["blocked"])
    # a process group of its own, as Ray gives each worker: the raylet kills a stopped worker's
    # group (its subprocesses), which must not be the zygote's
    os.setpgid(0, 0)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update({**import_env, **request["env"]})
    for entry in reversed(request["env"].get("PYTHONPATH", "").split(os.pathsep)):
        if entry and entry not in sys.path:  # what a new interpreter puts on its path
            sys.path.insert(0, entry)
    os.chdir(request["env"].get(CWD_ENV) or request["cwd"])
    _watch_client(request["client"])
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(os.path.realpath(sys.argv[0]))  # the script's folder, as python puts it
    import runpy

    runpy.run_path(sys.argv[0], run_name="__main__")
    sys.exit(0)


def _thread_name(tid: str) -> str:
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def serve(path: str, preload: list[str]) -> None:
    """Import ``preload``, then fork a child per client on ``path`` until the parent is gone.
    Single-threaded (a select loop and a SIGCHLD pipe), so that every fork is of one thread."""
    import select

    # OpenMP and OpenBLAS size their thread pools when loaded, from OMP_NUM_THREADS. A fresh worker
    # loads them after Ray set it to the actor's CPUs (1 for every actor here, Ray's default for
    # one without num_cpus too): load them as that worker would.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    before = dict(os.environ)
    for name in preload:
        __import__(name)
    # what the imports set in the environment (scikit-learn: KMP_DUPLICATE_LIB_OK), as they
    # would have in a fresh worker
    import_env = {k: v for k, v in os.environ.items() if before.get(k) != v}
    leaked = [m for m in ("ray", "verl") if m in sys.modules]
    if leaked:
        raise SystemExit(f"ray_zygote: the preloaded modules imported {leaked}; the children must import them fresh")
    # Every fork is of one thread: no Python thread, and no native one but jemalloc's background
    # thread (pyarrow's allocator, through pandas), whose fork handlers make a fork safe.
    import threading

    native = [_thread_name(t) for t in os.listdir("/proc/self/task") if int(t) != os.getpid()]
    unsafe = [n for n in native if n != "jemalloc_bg_thd"]
    if threading.active_count() != 1 or unsafe:
        raise SystemExit(f"ray_zygote: threads after the preloads ({threading.enumerate()}, native: {unsafe}); "
                         "a fork would copy their locks")
    parent = os.getppid()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print("ready", flush=True)
    clients: dict[int, socket.socket] = {}  # child pid -> its client's connection
    while os.getppid() == parent:
        ready, _, _ = select.select([listener, wake_r], [], [], 1.0)
        if wake_r in ready:
            os.read(wake_r, 4096)
        if listener in ready:
            try:
                conn, _ = listener.accept()
            except OSError:  # out of descriptors, say: the client falls back to a plain worker
                continue
            try:
                data, fds = _recv(conn)
                pid = os.fork()
            except (EOFError, OSError):  # a client gone, or no fork (process limit): plain worker
                conn.close()
                continue
            if pid == 0:
                listener.close()
                conn.close()
                for other in clients.values():
                    other.close()
                os.close(wake_r)
                os.close(wake_w)
                signal.set_wakeup_fd(-1)
                _child(json.loads(data), fds, import_env)
            for fd in fds:
                os.close(fd)
            clients[pid] = conn
            try:
                conn.sendall(struct.pack("!i", pid))
            except OSError:
                pass
        while clients:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = clients.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(struct.pack("!i", os.waitstatus_to_exitcode(status)))
                except OSError:
                    pass
                conn.close()


# ------------------------------------------------------------------------ the suite's side


def start(tmp_dir: str, preload: list[str] = PRELOAD):
    """Start a zygote (a ``subprocess.Popen``) listening in ``tmp_dir`` (its own: :func:`stop`
    removes it); return it and the runtime
    environment fields that make Ray start its workers through it. Raises RuntimeError if it does
    not come up within two minutes."""
    import select
    import shlex
    import subprocess
    import time

    os.makedirs(tmp_dir, exist_ok=True)
    path = os.path.join(tmp_dir, "zygote.sock")
    # its own session: a Ctrl-C at the terminal reaches pytest, not the zygote or its workers
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "serve", path, ",".join(preload)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    proc.socket_dir = tmp_dir  # removed by stop()
    deadline = time.monotonic() + 120
    said: list[str] = []
    while time.monotonic() < deadline and proc.poll() is None and "ready" not in said:
        if select.select([proc.stdout], [], [], 1.0)[0]:
            said.append(proc.stdout.readline().strip())
    if "ready" not in said:
        stop(proc)
        said = [line for line in said if line]
        raise RuntimeError(f"the Ray worker zygote did not start (exit status {proc.poll()}, said {said[-3:]!r})")
    command = client_command()
    _write_interpreter(os.path.join(tmp_dir, INTERPRETER), command)
    return proc, {"py_executable": command, "env_vars": {ENV: path}}


# The interpreter a local Ray instance is started with (:class:`as_ray_python`), next to the socket.
INTERPRETER = "python"


def _write_interpreter(path: str, client_command: str) -> None:
    """A shell script that runs Ray's worker set-up and worker commands (``.../setup_worker.py
    ARGS``, ``.../default_worker.py ARGS``) as the zygote's client, and anything else (Ray's
    agents, its log monitor) with the real interpreter."""
    import shlex

    with open(path, "w") as f:
        f.write("#!/bin/sh\n"
                'case "$1" in\n'
                f'  */setup_worker.py|*/default_worker.py) exec {client_command} "$@" ;;\n'
                "esac\n"
                f'exec {shlex.quote(sys.executable)} "$@"\n')
    os.chmod(path, 0o755)


class as_ray_python:
    """Within: a local ``ray.init`` starts an instance whose raylet runs :data:`INTERPRETER` (in
    ``tmp_dir``, the zygote's folder) where it would run ``sys.executable``, which it reads when
    it starts; restored on exit.

    Why: a worker of a job or actor with a runtime environment (the suite's jobs have one: it names
    the zygote's client as ``py_executable``; veRL gives each of its workers one) is started as
    ``python setup_worker.py ARGS``, a full interpreter that imports part of Ray only to apply
    the environment's variables and ``exec`` ``py_executable`` (~0.6 CPU-seconds a worker here,
    hundreds of workers in a suite). Through the interpreter script, the client does that itself
    (:func:`_setup_worker`) for the suite's environments and hands every other one back to Ray's."""

    def __init__(self, tmp_dir: str) -> None:
        self.interpreter = os.path.join(tmp_dir, INTERPRETER)

    def __enter__(self) -> None:
        self.saved = sys.executable
        sys.executable = self.interpreter

    def __exit__(self, *exc) -> None:
        sys.executable = self.saved


def _setup_worker(argv: list[str], client_command: str) -> list[str]:
    """What Ray's ``setup_worker.py`` (``argv[0]``) does before it ``exec``s the worker, for a
    runtime environment whose context holds only variables and the zygote's client as
    ``py_executable``: set the variables as ``ray._private.utils.update_envs`` does (``${X}``
    expanded, unknown ones empty) and return the worker's command (``default_worker.py ...``).
    Any other context (a command prefix, another interpreter, a container's entry point, Java):
    ``exec`` Ray's own set-up with the arguments unchanged."""
    import argparse
    import re

    parser = argparse.ArgumentParser()  # setup_worker.py's own arguments
    parser.add_argument("--serialized-runtime-env-context", type=str)
    parser.add_argument("--language", type=str)
    args, rest = parser.parse_known_args(argv[1:])
    context = json.loads(args.serialized_runtime_env_context or "{}")
    simple = (args.language == "PYTHON" and not context.get("command_prefix") and not context.get("java_jars")
              and not context.get("override_worker_entrypoint") and context.get("py_executable") == client_command
              and set(context) <= {"command_prefix", "env_vars", "py_executable", "override_worker_entrypoint",
                                   "java_jars"})
    if not simple:
        os.execv(sys.executable, [sys.executable, *argv])
    for key, value in (context.get("env_vars") or {}).items():
        os.environ[key] = re.sub(r"\$\{[A-Z0-9_]+\}", "", os.path.expandvars(value))
    return rest


def stop(proc) -> None:
    """Stop a zygote started by :func:`start`. Its children are workers of a Ray instance and end
    with it (or with their clients); stop the instance first."""
    import subprocess

    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)
    if proc.stdout is not None:
        proc.stdout.close()
    import shutil

    shutil.rmtree(getattr(proc, "socket_dir", ""), ignore_errors=True)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2], [m for m in sys.argv[3].split(",") if m])
    elif sys.argv[1] == "client":
        sys.exit(client(sys.argv[2:]))
    else:
        raise SystemExit(f"usage: {sys.argv[0]} serve SOCKET MODULES | client ARGV...")
