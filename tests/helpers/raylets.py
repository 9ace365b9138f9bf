"""Real raylets on this machine for the cluster tests: ``ray start --block`` with self-bound ports
(the caller adds its own temp dir and GCS port), each node stopped with everything it started,
by PID (never ``ray stop``, which would stop every other Ray on the machine)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import psutil


def free_ports(n: int) -> list[int]:
    """``n`` TCP ports free on the loopback right now."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def ray_start(*args: str, env: dict[str, str], log: str | None = None) -> subprocess.Popen:
    """``ray start --block *args`` on this machine's loopback (``log``: the file its output goes
    to; none kept otherwise). The node's own servers (raylet, object manager, runtime-env and
    dashboard agents, metrics) bind port 0 and report what they got: a port picked here and
    bound seconds later by a slow agent could meanwhile be taken by another Ray instance of this
    machine (a test of the other xdist worker), and this node's raylet would then send its
    requests to that instance's agent (a CI failure: "HTTP request returns non-ok status code
    401 ... Missing authentication token" from a token-mode agent not of this cluster). Ray's
    one fixed default among them, the dashboard agent's 52365, is set to 0 for the same reason."""
    cmd = [os.path.join(os.path.dirname(sys.executable), "ray"), "start", "--block", "--node-ip-address=127.0.0.1",
           "--disable-usage-stats", "--dashboard-agent-listen-port=0", *args]
    out = open(log, "ab") if log else subprocess.DEVNULL
    try:
        return subprocess.Popen(cmd, env=env, start_new_session=True, stdout=out, stderr=subprocess.STDOUT)
    finally:
        if log:
            out.close()


def stop(procs: list[subprocess.Popen]) -> None:
    """Stop the ``ray start`` processes and everything they started, by PID."""
    victims = []
    for p in procs:
        try:
            victims += [psutil.Process(p.pid)] + psutil.Process(p.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            pass
    for v in victims:
        try:
            v.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(victims, timeout=3)
    for v in alive:
        try:
            v.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=15)
