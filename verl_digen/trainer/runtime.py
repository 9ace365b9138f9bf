"""The Ray side of a run: the cluster, the worker groups, the weight channel, the final check.

Worker groups come from a *factory* ``layout -> (groups, actors)``: :func:`real_worker_groups`
builds ``DiffusionWorker`` groups on Ray resource pools; the emulated cluster
(:func:`verl_digen.workers.emulated.emulated_worker_groups`) builds workers that sleep for the
cost model's seconds. The loop does not know which it drives.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
from typing import Any, Callable, Iterator

from verl_digen.config.schema import DEVICES, ConfigError, DigenConfig
from verl_digen.placement.pools import (
    ClusterSpec,
    PoolLayout,
    assign_nodes,
    build_worker_groups,
    check_accelerator_types,
    check_cluster,
    cluster_nodes,
)
from verl_digen.schedule.plan import WorkerId
from verl_digen.sim.deadlines import Deadlines
from verl_digen.trainer.ray_auth import follow_cluster_auth

WorkerGroupFactory = Callable[[PoolLayout], "tuple[dict[str, Any], dict[WorkerId, Any]]"]

# Keep the console for the progress bar and the metrics, not per-worker loading bars.
QUIET_ENV = {
    "TOKENIZERS_PARALLELISM": "false",
    "TRANSFORMERS_VERBOSITY": "error",
    "DIFFUSERS_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
}


def quiet_logs() -> None:
    """Quiet the driver's libraries (workers get the same through Ray's runtime env)."""
    for k, v in QUIET_ENV.items():
        os.environ.setdefault(k, v)


class RunInterrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM reached the driver: the run stops cleanly (checkpoint, message, exit
    ``128 + signal``)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def __str__(self) -> str:
        return f"{signal.Signals(self.signum).name} received"


_received: list[int] = []  # signals caught by stop_signals' handler, latest last


def as_interrupt(error: KeyboardInterrupt) -> RunInterrupted:
    """The :class:`RunInterrupted` behind a ``KeyboardInterrupt``: Ray's blocking calls catch the
    handler's exception and raise a plain ``KeyboardInterrupt`` of their own, so the signal is
    looked up in what the handler recorded."""
    if isinstance(error, RunInterrupted):
        return error
    return RunInterrupted(_received[-1] if _received else signal.SIGINT)


@contextlib.contextmanager
def stop_signals() -> Iterator[None]:
    """Inside, SIGINT and SIGTERM raise :class:`RunInterrupted` in the driver's main thread.

    The run installs its own handlers rather than relying on Python's default SIGINT handler:
    a process started from a non-interactive shell's background job inherits SIGINT as
    *ignored*, and Ray installs its own SIGTERM handler that exits without a checkpoint. The
    previous handlers come back on exit. Outside the main thread (no handlers can be set) this
    does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_interrupt(signum: int, _frame: Any) -> None:
        _received.append(signum)
        raise RunInterrupted(signum)

    previous = {s: signal.signal(s, raise_interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    _received.clear()
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


#: How long a Ray cluster's GCS has to accept a TCP connection before the job gives up on it
#: (``ray.init`` itself retries a dead address for minutes, printing only "Failed to connect to GCS").
GCS_PROBE_S = 5.0
#: ``RAY_ADDRESS`` / ``ray_kwargs.ray_init.address``: Ray's own word for "start a new local instance".
LOCAL = "local"


def ray_marker_file() -> str:
    """The file in which ``ray start`` records the cluster it started on this machine (the one
    ``ray.init()`` with no address joins): ``ray_current_cluster`` in Ray's temp directory
    (``$RAY_TMPDIR/ray``, else ``$TMPDIR/ray``, else ``/tmp/ray``)."""
    try:
        from ray._private.utils import get_ray_address_file
    except ImportError:  # a Ray without the helper: its documented default place
        return os.path.join(os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp", "ray",
                            "ray_current_cluster")
    return get_ray_address_file(None)


def ray_target(explicit: str | None) -> tuple[str | None, str]:
    """The Ray cluster to connect to and where its address comes from; ``(None, ...)`` to start a
    local instance.

    In order: ``explicit`` (``ray_kwargs.ray_init.address``), ``RAY_ADDRESS``, then the cluster
    that ``ray start`` last started on this machine (:func:`ray_marker_file`, read by Ray's own
    lookup, so that the job finds exactly the cluster ``ray.init()`` would). ``local`` in either
    key starts a local instance whatever the marker says; ``auto`` is Ray's lookup (the marker,
    else a GCS process running here), as ``ray.init(address="auto")`` reads it.
    """
    from ray._private.services import get_ray_address_from_environment

    env = os.environ.get("RAY_ADDRESS") or None
    if explicit and explicit != "auto":
        address, source = explicit, "ray_kwargs.ray_init.address"
    elif env and env != "auto":
        address, source = env, "RAY_ADDRESS"
    else:
        try:
            address = get_ray_address_from_environment(explicit, None)  # explicit: None or "auto"
        except ConnectionError as e:  # "auto" and no cluster runs here
            key = "ray_kwargs.ray_init.address" if explicit else "RAY_ADDRESS"
            raise ConfigError(f"invalid config: {key}=auto finds no Ray cluster on this machine ({e}); start one "
                              f"with `ray start --head`, or set it to {LOCAL} to start a local instance") from None
        from ray._private.utils import read_ray_address

        marker = ray_marker_file()
        if address is not None and address == read_ray_address(None):
            source = f"the marker file {marker}"
        else:
            source = "a Ray GCS process running on this machine (address=auto)"
    if address == LOCAL:
        return None, source
    return address, source


def ray_address(explicit: str | None) -> str | None:
    """The Ray cluster to connect to, or None to start a local instance (:func:`ray_target`)."""
    return ray_target(explicit)[0]


def gcs_unreachable(address: str, timeout_s: float = GCS_PROBE_S) -> str | None:
    """Why nothing accepts a TCP connection at ``address`` (``host:port``, or ``ray://host:port``)
    within ``timeout_s``; None when something does, or when the address is not ``host:port``
    (then Ray reads it itself)."""
    import socket

    host, _, port = address.split("://", 1)[-1].rstrip("/").rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit():
        return None
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return None
    except socket.timeout:
        return f"no answer within {timeout_s:g} s"
    except OSError as e:
        return e.strerror or str(e)


def check_ray_target(address: str, source: str, timeout_s: float = GCS_PROBE_S) -> None:
    """Refuse, in one line, a Ray cluster whose GCS does not accept a connection within
    ``timeout_s``: ``ray.init`` would retry it for minutes with nothing but Ray's own
    "Failed to connect to GCS" warnings. The message names where the address came from and what
    to do (a stale marker file: remove it, start that cluster, or choose another)."""
    why = gcs_unreachable(address, timeout_s)
    if why is None:
        return
    if source.startswith("the marker file "):
        marker = source[len("the marker file "):]
        raise ConfigError(
            f"the Ray cluster at {address} does not answer ({why}); that address comes from {marker}, left by an "
            f"earlier `ray start`: remove that file (the job then starts a local Ray instance), start "
            f"that cluster again, or set RAY_ADDRESS={LOCAL} (or ray_kwargs.ray_init.address={LOCAL}) for a local "
            f"instance, RAY_ADDRESS=<host:port> for another cluster")
    if source in ("RAY_ADDRESS", "ray_kwargs.ray_init.address"):
        raise ConfigError(
            f"the Ray cluster at {source}={address} does not answer ({why}); start that cluster, correct "
            f"{source}, or set {source}={LOCAL} to start a local Ray instance")
    raise ConfigError(
        f"the Ray cluster at {address} ({source}) does not answer ({why}); set RAY_ADDRESS=<host:port> to "
        f"join a cluster, or RAY_ADDRESS={LOCAL} to start a local Ray instance")


def init_ray(devices: int, cfg: DigenConfig, *, address: str | None = None, num_cpus: int | None = None) -> bool:
    """Connect to the Ray cluster there is, or start a local one; return whether the job did
    (then :func:`release` disconnects, or stops the local instance); False when the caller had
    already initialised Ray.

    ``address``: ``ray_kwargs.ray_init.address`` (see :func:`ray_target` for the others).
    Connecting passes no resource counts: the cluster's nodes declared theirs at ``ray start``
    (and Ray refuses counts from a connecting driver), so ``digen.ray_num_cpus`` /
    ``ray_kwargs.ray_init.num_cpus`` set while connecting is an error. A cluster whose GCS does
    not accept a connection within :data:`GCS_PROBE_S` is refused (:func:`check_ray_target`)
    instead of being retried by ``ray.init`` for minutes; one that requires token authentication
    is joined with this machine's token, or refused in one line naming ``RAY_AUTH_MODE`` /
    ``RAY_AUTH_TOKEN`` (:func:`verl_digen.trainer.ray_auth.follow_cluster_auth`).

    The instance the job starts is a single node: every Ray process (GCS, raylet, workers,
    dashboard agent) listens on 127.0.0.1 only, and no dashboard is started; ``devices``
    (and at least the machine's cores) CPU slots, unless a count is given.
    """
    import ray

    if ray.is_initialized():
        return False
    env = {"env_vars": {**QUIET_ENV, "OMP_NUM_THREADS": "1"}}
    target, source = ray_target(address)
    counts = cfg.ray_num_cpus or num_cpus
    if target is not None:
        if counts:
            key = "digen.ray_num_cpus" if cfg.ray_num_cpus else "ray_kwargs.ray_init.num_cpus"
            raise ConfigError(
                f"invalid config: {key}={counts} sizes a Ray instance the job starts, but the job connects to the "
                f"Ray cluster at {target} (whose nodes declared their resources at `ray start`); unset it"
            )
        check_ray_target(target, source)
        follow_cluster_auth(target)
        ray.init(address=target, log_to_driver=True, runtime_env=env)
        print(f"[verl-digen] connected to the Ray cluster at {target} ({len(ray.nodes())} node(s))", flush=True)
        return True
    start_local_ray(lambda: ray.init(
        address=LOCAL,  # never the marker file's cluster: ray_target found none, or was told local
        num_cpus=counts or max(devices + 2, os.cpu_count() or 1),
        include_dashboard=False,
        ignore_reinit_error=True,
        log_to_driver=True,
        runtime_env=env,
    ), cfg.ray_start_timeout_s)
    _start_reaper()
    return True


def _stop_ray_children(since: float) -> None:
    """Stop this process's Ray processes (GCS, raylet, their agents and monitors: a command line
    naming a file under Ray's package directory) started since ``since`` (``time.time()``), which a
    ``ray.init`` that raised mid-start leaves running (it never recorded its node)."""
    import psutil

    procs = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.create_time() >= since - 1.0 and any(f"{os.sep}ray{os.sep}" in part for part in p.cmdline()):
                procs.append(p)
        except psutil.Error:
            continue
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=10)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()


class RayStartError(RuntimeError):
    """The local Ray instance did not come up (one line: what timed out, Ray's logs, the key to raise)."""


# What Ray raises when its raylet does not register with the GCS within its fixed 30 s
# (ray/_private/node.py): a busy machine, not a broken install.
_NODE_START_TIMEOUT = "timed out during startup"


def ray_logs_dir() -> str:
    """The logs of the newest Ray session on this machine (``<Ray's temp dir>/session_latest/logs``)."""
    base = os.path.dirname(ray_marker_file())  # $RAY_TMPDIR/ray, else $TMPDIR/ray, else /tmp/ray
    return os.path.join(base, "session_latest", "logs")


def start_local_ray(init: Callable[[], Any], timeout_s: float) -> None:
    """``init()`` (a local ``ray.init``) under a bound: when Ray's node start times out (its raylet
    did not register within Ray's own 30 s, as on a loaded machine), what it started is shut down
    and ``init`` runs again: at least once more, then while ``timeout_s`` lasts (``digen.ray_start_timeout_s``).
    Then :class:`RayStartError` in one line. Ray's other errors pass as they are."""
    import time

    import ray

    start, started_at = time.monotonic(), time.time()  # elapsed time; the attempts' processes' start
    attempt = 0
    while True:
        attempt += 1
        try:
            with _loopback_node():
                init()
            return
        except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception for this one
            if _NODE_START_TIMEOUT not in str(e):
                raise
        ray.shutdown()
        _stop_ray_children(since=started_at)  # a failed ray.init leaves the GCS and raylet it started running
        elapsed = time.monotonic() - start
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        busy = f"load {load:.1f} on {os.cpu_count()} cores"
        if attempt >= 2 and elapsed >= timeout_s:
            raise RayStartError(
                f"the local Ray instance did not start: its raylet did not register within Ray's 30 s, {attempt} "
                f"times in {elapsed:.0f} s ({busy}); Ray's logs: {ray_logs_dir()} (raylet.out, gcs_server.out); on a "
                f"busy machine raise digen.ray_start_timeout_s (now {timeout_s:g} s), or join a running cluster "
                "(RAY_ADDRESS)")
        print(f"[verl-digen] the local Ray instance did not start within Ray's 30 s ({busy}); trying again "
              f"({max(timeout_s - elapsed, 0):.0f} s left of digen.ray_start_timeout_s={timeout_s:g})", flush=True)


_reaper: Any = None  # the subprocess.Popen of ray_reaper.py for the local instance the job started


def _start_reaper() -> None:
    """Bind the Ray agents of the local instance just started to this driver's life
    (:mod:`verl_digen.trainer.ray_reaper`: without it they outlive a SIGKILLed driver by about
    a minute). The reaper gets the raylet's processes (agents, prestarted workers) and stops
    those still alive when this process is gone; Linux only (the kernel-level fate sharing Ray
    relies on for the rest is Linux's too). Best effort: a reaper that cannot start is said once."""
    import subprocess
    import sys

    global _reaper
    if not sys.platform.startswith("linux"):
        return
    import psutil

    from verl_digen.trainer import ray_reaper

    try:
        raylets = [c for c in psutil.Process().children() if c.name() == "raylet"]
        procs = [p for r in raylets for p in r.children(recursive=True)]
        lines = [f"{p.pid} {t}\n" for p in procs if (t := ray_reaper.start_time(p.pid)) is not None]
        reaper = subprocess.Popen([sys.executable, "-I", ray_reaper.__file__], stdin=subprocess.PIPE,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        reaper.stdin.write("".join(lines).encode())
        reaper.stdin.flush()
    except (OSError, psutil.Error) as e:
        print(f"[verl-digen] warning: no reaper for the Ray agents ({e}); if this process is killed, they "
              "exit about a minute later", flush=True)
        return
    _reaper = reaper


def _stop_reaper() -> None:
    """After ``ray.shutdown``: close the reaper's pipe (it stops whatever of the instance is
    left, normally nothing, and exits)."""
    global _reaper
    reaper, _reaper = _reaper, None
    if reaper is None:
        return
    import subprocess

    try:
        reaper.stdin.close()
        reaper.wait(timeout=15)
    except (OSError, subprocess.TimeoutExpired):
        reaper.kill()


def device_kind(trainer_device: str, cluster_gpus: float) -> str:
    """``cuda`` or ``cpu``: what the job's devices are, from ``trainer.device`` and the GPUs the
    Ray cluster offers (``ray.cluster_resources()["GPU"]``).

    Decided from the cluster's resources, not the driver's own CUDA (a driver on a CPU-only
    head node still runs a GPU cluster's job on its GPUs). ``trainer.device=cpu`` always runs
    on CPU slots; ``cuda`` (veRL's default) runs on GPUs when the cluster has any, and on CPU
    slots, saying so, when it has none.
    """
    if trainer_device not in DEVICES:
        raise ConfigError(f"invalid config: trainer.device={trainer_device!r}; valid: {', '.join(DEVICES)}")
    if trainer_device == "cpu":
        return "cpu"
    if cluster_gpus > 0:
        return "cuda"
    print("[verl-digen] the Ray cluster has no GPU: trainer.device=cuda runs on CPU slots", flush=True)
    return "cpu"


@contextlib.contextmanager
def _loopback_node() -> Iterator[None]:
    """Make ``ray.init`` give a new local node the loopback address.

    Ray picks the node's routable address on Linux and then binds its gRPC servers on every
    interface; with the loopback address it binds 127.0.0.1 only. Ray has no public switch for
    this: its own ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (read once, at import) sets the
    constant below, which we flip for the duration of the call. Guarded: if a Ray version lacks
    the constant, nothing is changed (tests/e2e/test_hardening_e2e.py checks the bound addresses).
    """
    from ray._private import ray_constants

    if not isinstance(getattr(ray_constants, "ENABLE_RAY_CLUSTER", None), bool):
        yield
        return
    before = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before


class WorkerError(RuntimeError):
    """A Ray task's or actor's failure in :func:`error_summary`'s few words; the Ray error, with
    its remote traceback, is the ``__cause__`` (and goes to the run's ``error.log``)."""


#: The file under the run's output directory that receives a stopped run's full tracebacks.
ERROR_LOG = "error.log"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_LINE_CHARS = 400  # a kept line is clipped to this many characters


def error_summary(error: BaseException) -> str:
    """A failure in one line: what the user reads when a run stops, instead of Ray's traceback.

    A Ray task error becomes its remote cause (``OSError: [Errno 28] No space left on device``)
    and where it ran (``in DiffusionWorker.save_checkpoint_shard, pid 1234``); a message of many
    lines (a traceback inside it, DCP's per-rank failures) keeps its first and last line, joined
    by ``[...]``. The type is named unless the text starts with it or it is one of the run's own
    stop errors, whose messages already say what failed. The full text belongs in the log (:func:`write_error_log`)."""
    import ray

    cause, where, root = error, "", ""
    while isinstance(cause, ray.exceptions.RayTaskError) and cause.cause is not None and cause.cause is not cause:
        where = where or _task_site(cause)
        root = root or _root_cause_line(str(cause))
        cause = cause.cause
    inner = cause  # raise ... from e, in this process (the run's own errors already word their causes)
    while (inner.__cause__ is not None and inner.__cause__ is not inner and not _ours(cause)
           and not isinstance(inner.__cause__, ray.exceptions.RayError)):
        inner = inner.__cause__
    if inner is not cause:
        root = f"{type(inner).__name__}: {inner}".splitlines()[0]
    lines = [line.strip() for line in _ANSI.sub("", str(cause)).splitlines() if line.strip()]
    lines = [line if len(line) <= _LINE_CHARS else line[:_LINE_CHARS] + "..." for line in lines]
    text = " ".join(lines) if len(lines) <= 2 else f"{lines[0]} [...] {lines[-1]}"
    name = type(cause).__name__
    if not _ours(cause) and not text.startswith(name):
        text = f"{name}: {text}" if text else name
    root = root[:_LINE_CHARS]
    if root and root not in text:
        text += f" (caused by {root})"
    return text + where


def _ours(error: BaseException) -> bool:
    """One of the run's own stop errors (WorkerFailure, WorkerError, ...): its message says what failed."""
    return type(error).__module__.startswith("verl_digen.trainer")


_CHAINED = "The above exception was the direct cause of the following exception:"


def _root_cause_line(text: str) -> str:
    """The first exception's last line in a remote traceback text whose exceptions are chained
    (``raise ... from e`` in the worker: Ray keeps that chain as text only), else ''."""
    text = _ANSI.sub("", text)
    if _CHAINED not in text:
        return ""
    lines = [line.strip() for line in text.split(_CHAINED, 1)[0].splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _task_site(error: Any) -> str:
    """`` (in DiffusionWorker.save_checkpoint_shard, pid 1234)``: where a Ray task error ran. The
    instance ``ray.get`` raises (``RayTaskError(OSError)``) keeps only its cause and its text, so
    the text's first line (``ray::DiffusionWorker.save_checkpoint_shard() (pid=1234, ...``) is read."""
    found = re.search(r"ray::([\w.]+)\(\)\s*\(pid=(\d+)", _ANSI.sub("", str(error)))
    return f" (in {found.group(1)}, pid {found.group(2)})" if found else ""


def stop_message(error: BaseException, output_dir: str, checkpoints: Any,
                 describe: Callable[[BaseException], str]) -> str:
    """Print and return the few-line message of a stopped run: ``describe`` words the failure
    (given it as a one-line :class:`WorkerError`, or the interrupt itself) and the checkpoint
    taken at the stop; every traceback (the failure's and a failed stop checkpoint's) goes to
    ``<output_dir>/error.log``, which the message names. An interrupt needs no log."""
    import sys

    if isinstance(error, KeyboardInterrupt):
        message = describe(error)
    else:
        failed_saves = checkpoints.failed_saves if checkpoints is not None else []
        failed_saves.clear()
        message = describe(WorkerError(error_summary(error)))
        also = [e for e in failed_saves if e is not error.__cause__]
        message += "\n" + write_error_log(output_dir, error, also)
    print(message, file=sys.stderr, flush=True)
    return message


def write_error_log(output_dir: str, error: BaseException, also: list[BaseException] | tuple = ()) -> str:
    """Append ``error``'s full traceback (with its causes and, for a Ray error, the remote
    traceback), and those of ``also``, to ``<output_dir>/error.log``; return the line that says
    where. If the log cannot be written (a full disk), the tracebacks go to stderr instead."""
    import sys
    import time
    import traceback

    text = "".join("".join(traceback.format_exception(e)) + "\n" for e in (error, *also))
    text = _ANSI.sub("", text)
    path = os.path.join(output_dir, ERROR_LOG)
    try:
        with open(path, "a") as f:
            f.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()}\n{text}")
        return f"[verl-digen] full traceback: {path}"
    except OSError as e:
        print(text, file=sys.stderr, flush=True)
        return f"[verl-digen] full traceback: above ({path} could not be written: {e.strerror or e})"


def release(groups: dict[str, Any], owns_ray: bool) -> None:
    """Kill the run's actors, free their placement groups, and stop (or disconnect from) Ray if
    the job initialised it."""
    import ray
    from ray.util.placement_group import remove_placement_group

    for wg in groups.values():
        for a in wg.workers:
            ray.kill(a, no_restart=True)
        for pg in getattr(wg.resource_pool, "pgs", None) or []:
            remove_placement_group(pg)
    if owns_ray:
        ray.shutdown()
        _stop_reaper()


def finish_tracking(tracker: Any) -> None:
    """Flush and close veRL's loggers. ``Tracking.finish`` exists from veRL 0.9.0; the 0.9.0.dev
    builds before it (verl-omni's pinned veRL commit among them) close them in ``__del__`` only, so
    there is nothing to call (patches/README.md: supported veRL versions)."""
    finish = getattr(tracker, "finish", None)
    if finish is not None:
        finish()


def real_worker_groups(
    cfg: DigenConfig, model_path: str, *, use_gpu: bool, devices: int, cluster: ClusterSpec
) -> WorkerGroupFactory:
    """The factory of ``DiffusionWorker`` groups, one Ray resource pool per role.

    ``cluster``: ``trainer.nnodes`` x ``trainer.n_gpus_per_node``, checked against the Ray
    cluster's nodes; the pools are placed per node (:func:`verl_digen.placement.pools.assign_nodes`).
    """
    import ray

    threads = max(1, (os.cpu_count() or 1) // max(devices, 1)) if not use_gpu else 4
    kind = "cuda" if use_gpu else "cpu"

    def build(layout: PoolLayout) -> tuple[dict[str, Any], dict[WorkerId, Any]]:
        every = cluster_nodes(ray.nodes(), kind)
        types = layout.accelerator_types
        check_accelerator_types(types, every)  # names the types of the whole cluster
        nodes = check_cluster(every, cluster, kind, frozenset(t for t in types.values() if t))
        placement = assign_nodes(layout.worker_counts, nodes, cluster.n_devices_per_node, types)
        return build_worker_groups(layout, config=cfg, model_path=model_path, use_gpu=use_gpu, num_threads=threads,
                                   placement=placement)

    return build


def init_models(actors: dict[WorkerId, Any], deadlines: Deadlines) -> list[dict[str, Any]]:
    """Every worker's ``init_model``, after each worker got the run's deadlines (its process
    groups' timeouts, its weight send's waits) and rank 0 of each training group opened the
    group's rendezvous on a port the OS assigned (``open_rendezvous``), handed to every rank of
    its pool. The load's deadline covers reading the weights at real size (``deadlines.load_s``)."""
    import ray

    ray.get([a.set_deadlines.remote(deadlines) for a in actors.values()], timeout=deadlines.load_s)
    ports = ray.get([a.open_rendezvous.remote() for a in actors.values()], timeout=deadlines.load_s)
    by_pool = {w.pool: port for w, port in zip(actors, ports) if port is not None}
    return ray.get([a.init_model.remote(by_pool.get(w.pool)) for w, a in actors.items()], timeout=deadlines.load_s)


def open_weight_channel(spec: Any, actors: dict[WorkerId, Any], cfg: DigenConfig, use_gpu: bool,
                        deadlines: Deadlines | None = None) -> None:
    """Connect trainer rank 0 to every rollout worker (gloo or NCCL) and check they agree.
    ``deadlines``: the run's (None: ``digen.task_timeout_s`` for every call)."""
    deadlines = deadlines or Deadlines.floor(cfg.task_timeout_s)
    import ray

    backend = cfg.sync.backend
    if backend == "auto":
        backend = "nccl" if use_gpu else "gloo"
    sender = actors[WorkerId("trainer", 0)]
    receivers = [actors[WorkerId("rollout", r)] for r in range(spec.rollout_workers)]
    addr, port = ray.get(sender.sync_master_endpoint.remote(), timeout=60)
    world = len(receivers) + 1
    # the channel's collectives may wait as long as the send waits for its receivers (they join
    # it after generating what they were generating, a whole step with TCSS): the plan's deadline
    ray.get(
        [sender.sync_open.remote(0, world, addr, port, backend, deadlines.channel_s)]
        + [w.sync_open.remote(i + 1, world, addr, port, backend, deadlines.channel_s) for i, w in enumerate(receivers)],
        timeout=deadlines.load_s,
    )
    digests = ray.get([sender.weights_digest.remote(), receivers[0].weights_digest.remote()], timeout=60)
    if digests[0] != digests[1]:
        raise RuntimeError("rollout and trainer start from different weights (same model dir and LoRA seed expected)")


def finish_weights(spec: Any, actors: dict[WorkerId, Any], cfg: DigenConfig, output_dir: str, *, save: bool,
                   deadlines: Deadlines | None = None) -> dict[str, Any]:
    """Check rollout holds the trainer's final weights; optionally save them. ``deadlines``: the
    run's (None: ``digen.task_timeout_s``); the last send may still wait for its receivers."""
    import ray

    final_s = (deadlines or Deadlines.floor(cfg.task_timeout_s)).final_s
    extra: dict[str, Any] = {}
    source = actors[spec.trainers[0]]
    if spec.placement == "disaggregated":
        # the last send has ended (its receivers have the weights); raise what it raised, if anything
        ray.get(source.sync_join.remote(final_s), timeout=final_s + 60)
        digests = ray.get(
            [source.weights_digest.remote()] + [actors[w].weights_digest.remote() for w in spec.generators], timeout=120
        )
        extra["weights_in_sync"] = all(d == digests[0] for d in digests[1:])
        if not extra["weights_in_sync"]:
            raise RuntimeError("after the final sync, rollout weights differ from the trainer's")
    if save:  # written by the first trainer rank itself: the weights never pass through the driver
        if cfg.fsdp.enable:  # a collective: a colocated run streams the full state only now (disaggregated: no-op)
            ray.get([actors[w].refresh_full_state.remote() for w in spec.trainers], timeout=final_s)
        path = os.path.join(output_dir, "final_weights.safetensors")
        extra["final_weights"] = ray.get(source.save_final_weights.remote(path), timeout=final_s)
    return extra
