"""A reward-bound run, measured: colocated vs disaggregated (+GAP, +TCSS) with a reward pool,
on the ``digits`` preset, its digit classifier served over HTTP behind a fixed latency.

    python benchmarks/reward_bound.py [--latency-s 0.3] [--steps 120] [--reward-devices 4]
                                      [--modes colocated,+gap,+tcss] [--out runs/reward_bound]

Starts ``python -m verl_digen.rewards.serve --reward digit_classifier --latency-s S`` on a free
loopback port: every answer is held S seconds after scoring, a stand-in for a remote judge on
its own GPU whose answers take that long (a VLM judge decodes for seconds). Then runs
``python -m verl_digen.compare --config-name digits`` with ``digen.reward.name=http`` pointed at
it: the colocated mode on the preset's 2 devices (each fused worker waits for the answers to
what it generated), the disaggregated modes on 1 rollout + 1 trainer device plus
``--reward-devices`` reward workers, which only wait on HTTP (``compare --reward-devices``).
Prints the compare table and each disaggregated mode's images/s over colocated's; the run
directories, ``summary.json`` and the charts are under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from reward_server_memory import start_server, stop_server  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--latency-s", type=float, default=0.3, help="seconds the reward server holds each answer")
    p.add_argument("--steps", type=int, default=120, help="training steps per mode")
    p.add_argument("--reward-devices", type=int, default=4, help="reward workers of the disaggregated modes")
    p.add_argument("--modes", default="colocated,+gap,+tcss")
    p.add_argument("--target-reward", type=float, default=0.6)
    p.add_argument("--report-targets", default="0.55,0.6", help="rewards to report the time to, from the curves")
    p.add_argument("--out", default="runs/reward_bound")
    p.add_argument("--port", type=int, default=0, help="the reward server's port (0: a free one)")
    p.add_argument("--resume", action="store_true",
                   help="reuse the modes a run with the same arguments (and --port) finished in --out")
    args, extra = p.parse_known_args(argv)

    from verl_digen.compare import main as compare

    server_args = ["--reward", "digit_classifier", "--latency-s", str(args.latency_s)]
    proc, url, log = start_server(server_args, timeout_s=180, port=args.port or None)
    try:
        rc = compare([*(["--resume"] if args.resume else []),
            "--out", args.out, "--config-name", "digits", "--modes", args.modes,
            "--target-reward", str(args.target_reward), "--reward-devices", str(args.reward_devices),
            f"trainer.total_training_steps={args.steps}", "digen.reward.name=http",
            f"+digen.reward.kwargs.url={url}/score", "+digen.reward.kwargs.timeout_s=120", *extra,
        ])
    finally:
        stop_server(proc, log)
    if rc:
        return rc
    from verl_digen.compare import time_to_target

    with open(os.path.join(args.out, "summary.json")) as f:
        rows = {r["mode"]: r for r in json.load(f)}
    base = rows.get("colocated")
    targets = [float(x) for x in args.report_targets.split(",") if x.strip()]
    for mode, r in rows.items():
        line = f"{mode}: {r['images_per_s']:.1f} images/s"
        if base and mode != "colocated":
            line += (f" ({r['images_per_s'] / base['images_per_s']:.2f}x colocated; {r['devices']} workers, "
                     f"{args.reward_devices} of them reward workers, vs {base['devices']})")
        for t in targets:
            val, ma = time_to_target(r["curve"], t, r["images_per_step"])
            line += f"; to {t:g}: validation {_s(val.wall_s)} (step {val.step}), moving average {_s(ma.wall_s)} (step {ma.step})"
        print(line)
    print(f"latency {args.latency_s:g} s per reward request, {args.steps} steps")
    return 0


def _s(seconds: float | None) -> str:
    return "not reached" if seconds is None else f"{seconds:.1f} s"


if __name__ == "__main__":
    sys.exit(main())
