"""``python -m verl_digen.rewards.serve``: serve a registered reward from the command line."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from typing import Any

from verl_digen.rewards.serve.app import RewardServer
from verl_digen.rewards.serve.auth import TOKEN_ENV
from verl_digen.rewards.serve.limits import (
    DEFAULT_DECODE_THREADS,
    DEFAULT_DECODE_WAIT_S,
    DEFAULT_MAX_BODY_MB,
    DEFAULT_MAX_BODY_TOTAL_MB,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_DECODE_PIXELS,
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MAX_REQUEST_PIXELS,
    DEFAULT_MAX_UNAUTHENTICATED_CONNECTIONS,
    DEFAULT_READ_TIMEOUT_S,
    DEFAULT_SCORE_CHUNK_PIXELS,
    MIB,
    memory_budget_bytes,
)

logger = logging.getLogger("verl_digen.rewards.serve")


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m verl_digen.rewards.serve",
        description="Serve a registered verl_digen reward over HTTP (the protocols of the 'http' reward).",
        epilog="Memory: request handling stays within 3 B x --max-decode-pixels + 4 B x min(--max-decode-pixels, "
               "--decode-threads x --max-image-pixels) + 12 B x --score-chunk-pixels + 3 x --max-body-total-mb "
               f"above idle, the reward's own memory aside: {memory_budget_bytes() / MIB:g} MiB with the defaults "
               "(docs/reward_server.md).",
    )
    parser.add_argument("--reward", required=True, help="registered reward name, e.g. brightness, clip_score")
    parser.add_argument("--reward-kwargs", default="{}", help="JSON object of keyword arguments for the reward")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                        help="where a reward model runs: auto (default) = the GPU when one is visible "
                             "(CUDA_VISIBLE_DEVICES), else CPU; a device in --reward-kwargs wins")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    parser.add_argument(
        "--token", default=None, help=f"bearer token required from clients (default: ${TOKEN_ENV}; prefer the env var)"
    )
    mib = MIB
    parser.add_argument("--max-body-mb", type=float, default=DEFAULT_MAX_BODY_MB,
                        help=f"largest request body, MiB; larger: 413 before reading (default {DEFAULT_MAX_BODY_MB:g})")
    parser.add_argument("--max-body-total-mb", type=float, default=DEFAULT_MAX_BODY_TOTAL_MB,
                        help="most request-body MiB held across concurrent requests (while read and parsed; their "
                             "encoded images until scored); more wait up to --decode-wait-s, then 503 "
                             f"(default {DEFAULT_MAX_BODY_TOTAL_MB:g})")
    parser.add_argument("--max-batch", type=int, default=256, help="most samples per request (default 256)")
    parser.add_argument("--max-image-pixels", type=int, default=DEFAULT_MAX_IMAGE_PIXELS,
                        help="largest image or frame, width x height, read from its header; larger: 400 "
                             f"(default {DEFAULT_MAX_IMAGE_PIXELS // mib} Mi = 4096x4096)")
    parser.add_argument("--max-request-pixels", type=int, default=DEFAULT_MAX_REQUEST_PIXELS,
                        help="most decoded pixels per request; more: 413 "
                             f"(default {DEFAULT_MAX_REQUEST_PIXELS // mib} Mi)")
    parser.add_argument("--max-decode-pixels", type=int, default=DEFAULT_MAX_DECODE_PIXELS,
                        help="most decoded pixels (3 bytes each) across concurrent requests; more wait up to "
                             f"--decode-wait-s, then 503 (default {DEFAULT_MAX_DECODE_PIXELS // mib} Mi)")
    parser.add_argument("--score-chunk-pixels", type=int, default=DEFAULT_SCORE_CHUNK_PIXELS,
                        help="most pixels converted to float32 (12 bytes each) for one reward call; requests are "
                             "scored in chunks of this size, a larger sample (image or clip) gets 413 "
                             f"(default {DEFAULT_SCORE_CHUNK_PIXELS // mib} Mi)")
    parser.add_argument("--decode-wait-s", type=float, default=DEFAULT_DECODE_WAIT_S,
                        help="how long a request waits for room in the body or decode budget before its 503, "
                             f"seconds (default {DEFAULT_DECODE_WAIT_S:g})")
    parser.add_argument("--read-timeout-s", type=float, default=DEFAULT_READ_TIMEOUT_S,
                        help="how long the server waits for a request's head, and then separately for its body, "
                             "in total (not per read), seconds; a slower client gets 408 and is disconnected "
                             f"(default {DEFAULT_READ_TIMEOUT_S:g})")
    parser.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                        help="most open authenticated connections (that sent a request with the token; without a "
                             f"token, any request); more: 503 (default {DEFAULT_MAX_CONNECTIONS})")
    parser.add_argument("--max-unauthenticated-connections", type=int,
                        default=DEFAULT_MAX_UNAUTHENTICATED_CONNECTIONS,
                        help="most open connections that have not authenticated yet (idle, or no token sent); one "
                             "more closes the oldest of them with 503, so they never starve clients with the token "
                             f"(default {DEFAULT_MAX_UNAUTHENTICATED_CONNECTIONS})")
    parser.add_argument("--decode-threads", type=int, default=DEFAULT_DECODE_THREADS,
                        help=f"threads that parse, decode and score (default {DEFAULT_DECODE_THREADS})")
    parser.add_argument("--no-pickle", action="store_true", help="refuse the pickle protocol")
    parser.add_argument("--latency-s", type=float, default=0.0,
                        help="hold every answer this many seconds after scoring (concurrent requests overlap): a "
                             "stand-in for a remote judge on its own GPU, for benchmarks (default 0)")
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    args = parser.parse_args(argv)
    try:
        args.reward_kwargs = json.loads(args.reward_kwargs)
    except ValueError as exc:
        parser.error(f"--reward-kwargs is not valid JSON: {exc}")
    if not isinstance(args.reward_kwargs, dict):
        parser.error("--reward-kwargs must be a JSON object")
    if args.token is None:
        args.token = os.environ.get(TOKEN_ENV) or None
    return args


def _fix_mmap_threshold() -> None:
    """Have glibc give image-sized blocks (1 MiB and up) back to the OS when they are freed.

    glibc raises its mmap threshold (up to 32 MiB) each time it frees a large block, so later
    blocks of that size come from per-thread arenas, which keep their high-water mark: with four
    decode threads the idle RSS then drifts up by tens of MiB per thread. Setting the threshold
    (``mallopt(M_MMAP_THRESHOLD)``, as ``MALLOC_MMAP_THRESHOLD_`` would) turns that off. Only the
    CLI does this: it owns its process; an embedding program keeps its own malloc settings."""
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD = -3 in glibc's malloc.h
    except (OSError, AttributeError):  # not glibc (musl, ...): nothing to fix
        pass


def reward_kwargs_on_device(reward: str, kwargs: dict[str, Any], device: str) -> dict[str, Any]:
    """The reward's kwargs with ``--device`` resolved (``auto``: the first visible GPU, else the
    CPU) for a reward that has a model; ``cuda`` without a visible GPU is refused."""
    import torch

    from verl_digen.rewards.base import with_device

    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no GPU is visible to this process (check CUDA_VISIBLE_DEVICES)")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return with_device(reward, dict(kwargs), device)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    _fix_mmap_threshold()
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        server = RewardServer(
            args.reward,
            reward_kwargs_on_device(args.reward, args.reward_kwargs, args.device),
            host=args.host,
            port=args.port,
            token=args.token,
            max_body_mb=args.max_body_mb,
            max_body_total_mb=args.max_body_total_mb,
            max_batch=args.max_batch,
            max_image_pixels=args.max_image_pixels,
            max_request_pixels=args.max_request_pixels,
            max_decode_pixels=args.max_decode_pixels,
            score_chunk_pixels=args.score_chunk_pixels,
            decode_wait_s=args.decode_wait_s,
            read_timeout_s=args.read_timeout_s,
            max_connections=args.max_connections,
            max_unauthenticated_connections=args.max_unauthenticated_connections,
            decode_threads=args.decode_threads,
            allow_pickle=not args.no_pickle,
            latency_s=args.latency_s,
        )
    except (ValueError, TypeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()

    def _on_signal(signum: int, _frame: Any) -> None:
        logger.info("received %s, shutting down", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    server.start()
    device = getattr(server.reward, "device", "cpu")
    print(f"reward server ready: reward={server.reward_name} device={device} url={server.url}", file=sys.stderr, flush=True)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        server.stop()
        logger.info("reward server stopped")
    return 0
