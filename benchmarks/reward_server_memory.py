"""How much memory the reward server's decoding takes: peak RSS above idle, bytes per decoded pixel.

    python benchmarks/reward_server_memory.py [--requests 4] [--images 64] [--size 1024] [-- SERVER ARGS...]

Starts ``python -m verl_digen.rewards.serve --reward brightness`` on a free loopback port (any
arguments after ``--`` are passed on to it), waits until it is idle, resets its peak-RSS counter
(``/proc/<pid>/clear_refs``), then sends ``--requests`` JSON requests at once, each of
``--images`` black ``--size`` x ``--size`` PNGs (made by the ``http`` reward's own encoder,
``encode_images_png_b64``; ``--noise``: uniform noise, which does not compress, for large
bodies), and reads the server's peak RSS (``VmHWM`` in ``/proc/<pid>/status``).
Prints one JSON object:

- ``idle_rss_mib``: the server's resident memory before the requests;
- ``peak_above_idle_mib``: the peak during the requests minus that;
- ``pixels_per_request`` and ``bytes_per_pixel``: peak above idle divided by the pixels of one
  request (run with ``--requests 1`` for the cost of decoding and scoring one request);
- ``statuses``: each request's HTTP status (200: scored; 503: refused for a full budget) and
  ``errors`` the messages of the refused ones.

Linux only (``/proc``). The same helpers back ``tests/unit/test_reward_server_memory.py``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

__all__ = ["black_png_request", "measure", "post", "read_status_kib", "reset_peak", "start_server", "stop_server"]


def read_status_kib(pid: int, field: str) -> int:
    """A memory field of ``/proc/<pid>/status`` (``VmRSS``, ``VmHWM``), in KiB."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(f"no {field} in /proc/{pid}/status")


def reset_peak(pid: int) -> bool:
    """Reset the process's peak RSS (``VmHWM``) to its current RSS; False where the kernel refuses."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


def black_png_request(images: int = 64, size: int = 1024, noise: bool = False) -> bytes:
    """The JSON body of one request: ``images`` black ``size`` x ``size`` 8-bit RGB PNGs (``noise``:
    one uniform-noise PNG, which does not compress, ``images`` times: a body-heavy request)."""
    import torch

    from verl_digen.rewards import encode_images_png_b64

    pixels = torch.zeros(1, 3, size, size)
    if noise:
        pixels = torch.rand(1, 3, size, size, generator=torch.Generator().manual_seed(0))
    (png,) = encode_images_png_b64(pixels)
    return json.dumps({"prompts": ["black"] * images, "images": [png] * images}).encode()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(
    args: list[str], *, token: str | None = None, timeout_s: float = 60.0, port: int | None = None
) -> tuple[subprocess.Popen, str, Any]:
    """Start the CLI server on a loopback port (``port``, else a free one); returns (process,
    base URL, its log file) once ``/health`` answers. Stop it with :func:`stop_server`."""
    port = port or free_port()
    env = {**os.environ, "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
    env.pop("VERL_DIGEN_REWARD_TOKEN", None)
    if token:
        env["VERL_DIGEN_REWARD_TOKEN"] = token
    log = tempfile.TemporaryFile(mode="w+")
    command = [sys.executable, "-m", "verl_digen.rewards.serve", "--reward", "brightness", "--port", str(port),
               "--log-level", "WARNING", *args]
    proc = subprocess.Popen(command, env=env, stdout=log, stderr=log, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"server exited with {proc.returncode}: {log.read()[-4000:]}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                conn.close()
                return proc, url, log
            conn.close()
        except OSError:
            pass
        if time.monotonic() > deadline:
            stop_server(proc, log)
            raise RuntimeError(f"server did not answer /health within {timeout_s:g} s")
        time.sleep(0.05)


def stop_server(proc: subprocess.Popen, log: Any = None) -> None:
    """Stop the server started by :func:`start_server` (SIGTERM, then SIGKILL), by its PID."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)
    if log is not None:
        log.close()


def post(url: str, body: bytes, *, token: str | None = None, timeout_s: float = 120.0) -> tuple[int, dict]:
    """POST a JSON body to ``url + "/score"``; returns (status, decoded JSON answer)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        conn.request("POST", "/score", body=body, headers=headers)
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def measure(requests: int = 4, images: int = 64, size: int = 1024, server_args: list[str] | None = None,
            timeout_s: float = 120.0, noise: bool = False) -> dict[str, Any]:
    """Start a server, send ``requests`` requests at once, return the measurements (see module doc)."""
    body = black_png_request(images, size, noise)
    proc, url, log = start_server(list(server_args or []))
    try:
        time.sleep(1.0)  # let start-up settle
        idle_kib = read_status_kib(proc.pid, "VmRSS")
        reset = reset_peak(proc.pid)
        with concurrent.futures.ThreadPoolExecutor(requests) as pool:
            answers = list(pool.map(lambda _: post(url, body, timeout_s=timeout_s), range(requests)))
        peak_kib = read_status_kib(proc.pid, "VmHWM")
    finally:
        stop_server(proc, log)
    pixels = images * size * size
    above = (peak_kib - idle_kib) * 1024
    return {
        "requests": requests,
        "images_per_request": images,
        "size": size,
        "noise": noise,
        "body_kib": round(len(body) / 1024, 1),
        "server_args": list(server_args or []),
        "idle_rss_mib": round(idle_kib / 1024, 1),
        "peak_above_idle_mib": round(above / 2**20, 1),
        "peak_reset_at_idle": reset,
        "pixels_per_request": pixels,
        "bytes_per_pixel": round(above / pixels, 2),
        "statuses": [status for status, _ in answers],
        "errors": [answer.get("error") for status, answer in answers if status != 200],
    }


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    server_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=4, help="requests sent at once (default 4)")
    parser.add_argument("--images", type=int, default=64, help="images per request (default 64)")
    parser.add_argument("--size", type=int, default=1024, help="image side, pixels (default 1024)")
    parser.add_argument("--noise", action="store_true", help="noise images instead of black: large bodies")
    args = parser.parse_args(argv)
    print(json.dumps(measure(args.requests, args.images, args.size, server_args, noise=args.noise), indent=1))


if __name__ == "__main__":
    main()
