"""Stops the Ray agents of a local instance when the job's driver dies, however it dies.

Run by path (``python ray_reaper.py``, standard library only) by
:func:`verl_digen.trainer.runtime.init_ray` when the job starts a local Ray instance. Why: Ray
kills the GCS, the raylet and its monitors with the driver (``PR_SET_PDEATHSIG``) and the
workers exit within seconds of their raylet, but the raylet's two agents (dashboard agent,
runtime-env agent) first report the raylet's death to the GCS, which died with it, and wait
out that call's fixed 60 s timeout (``ray/_private/process_watcher.py``): after a SIGKILLed
driver they linger about a minute, holding their ports and memory.

Protocol: stdin carries lines ``<pid> <start time>`` (the start time is field 22 of
``/proc/<pid>/stat``, so that a recycled pid is never signalled). End of stdin means the driver
is gone (the pipe closes when it exits, even by SIGKILL): every listed process still alive gets
SIGTERM, then SIGKILL after a grace period. The reaper also leaves once none of its processes
is alive (the job stopped Ray itself).
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time

GRACE_S = 3.0  # SIGTERM -> SIGKILL
POLL_S = 5.0  # how often to look whether any listed process is still alive


def start_time(pid: int) -> str | None:
    """Field 22 of ``/proc/<pid>/stat`` (clock ticks after boot), or None if ``pid`` is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) "; comm may hold spaces
    if not fields or fields[0] == "Z":
        return None
    return fields[19]


def alive(targets: dict[int, str]) -> list[int]:
    return [pid for pid, started in targets.items() if start_time(pid) == started]


def stop(targets: dict[int, str]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in alive(targets):
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + GRACE_S
        while alive(targets) and time.monotonic() < deadline:
            time.sleep(0.1)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle; the pipe decides
    targets: dict[int, str] = {}
    buffered = b""
    fd = sys.stdin.fileno()
    while True:
        ready, _, _ = select.select([fd], [], [], POLL_S)
        if not ready:
            if targets and not alive(targets):
                return
            continue
        chunk = os.read(fd, 4096)
        if not chunk:  # the driver is gone
            stop(targets)
            return
        buffered += chunk
        *lines, buffered = buffered.split(b"\n")
        for line in lines:
            parts = line.split()
            if len(parts) == 2 and parts[0].isdigit():
                targets[int(parts[0])] = parts[1].decode()


if __name__ == "__main__":
    main()
