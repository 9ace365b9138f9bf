"""What a flatter efficiency curve would do to our colocated and best disaggregated plans.

    python benchmarks/half_tokens.py --half-tokens 200 --cases flux-12b@16,flux-12b@32

The cost model's forward and training efficiency grow with a call's tokens,
``mfu x t / (t + mfu_half_tokens)``, with ``mfu_half_tokens`` fitted to veRL-Omni's published
generation phases (2,513 tokens on the H800). Our own rollout's forward on an H200 is much flatter
over call sizes (``benchmarks/call_rows.py``, docs/results_gpu.md: about 200 tokens
reproduces its one-row and 24-row calls). This sets the half-point of our system's device rows to
``--half-tokens`` (the asymptotes unchanged) and runs the planner's searches of
``benchmarks/paper_scale.py`` for our colocated mode and our best disaggregated plan, on H800
clusters. It is a what-if on one constant, not a recalibration: the asymptotes, the training
efficiency factor and veRL-Omni's profile keep their fitted values.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import paper_scale as ps  # noqa: E402

from verl_digen.sim.cost_model import load_catalog  # noqa: E402
from verl_digen.sim.planner import Inventory  # noqa: E402

CASES = "flux-12b@16,flux-12b@32,qwen-image-20b@16,qwen-image-20b@32,wan2.1-14b@16,wan2.1-14b@32,hunyuanvideo-13b@16,hunyuanvideo-13b@32"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--half-tokens", type=float, required=True, help="mfu_half_tokens for our system (0: the curve off)")
    p.add_argument("--cases", default=CASES, help="comma list of MODEL@DEVICES (H800, 8 per node)")
    p.add_argument("--device-type", default="H800")
    args = p.parse_args(argv)
    catalog = load_catalog()
    print("| case | half-tokens | ours colocated img/s | best disaggregated img/s | its plan | disaggregated / colocated |")
    print("|---|---:|---:|---:|---|---:|")
    for case in args.cases.split(","):
        model, n = case.strip().split("@")
        t0 = time.perf_counter()
        inv = Inventory({args.device_type: int(n)}, 8)
        for half in (None, args.half_tokens):
            ours = ps.costs_of(catalog, model, [args.device_type], ps.OURS)
            base = ours.devices[args.device_type].mfu_half_tokens
            if half is not None:
                devices = {name: dataclasses.replace(d, mfu_half_tokens=half) for name, d in ours.devices.items()}
                ours = dataclasses.replace(ours, devices=devices)
            col = ps.summary(ps.best(ours, inv, ps.COLOCATED), ours)
            dis = ps.summary(ps.best(ours, inv, ps.DISAGGREGATED), ours)
            if col is None or dis is None:
                rates = ["-" if x is None else f"{x['images_per_s']:.4g}" for x in (col, dis)]
                print(f"| {case} | {base if half is None else half:,.0f} | {rates[0]} | {rates[1]} | nothing fits | - |")
                continue
            print(f"| {case} | {base if half is None else half:,.0f} | {col['images_per_s']:.4g} | {dis['images_per_s']:.4g} | "
                  f"{dis['strategy']} {dis['split']} {dis['micro']} | {dis['images_per_s'] / col['images_per_s']:.3f}x |",
                  flush=True)
        print(f"<!-- {case}: {time.perf_counter() - t0:.0f} s -->", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
