"""How long the planner's searches take, and a fingerprint of everything they decide.

    python benchmarks/planner_speed.py                     # timings and fingerprints
    python benchmarks/planner_speed.py --rows rows.json    # also every row and skipped configuration

Each search runs once to warm up (imports, the real models' configs built on the meta device)
and then ``--repeat`` times; the best time is printed. Run it in two checkouts to compare a
change to the simulator: the fingerprints (SHA-256 of every row, the skipped configurations with
their problems and the best configuration, as JSON) must match, and the times say what the change
gained. The searches: FLUX.1 on 16 H800 (16 groups a step), HunyuanVideo on 16, Qwen-Image on 16
(one sample per VAE decode call), SD3.5-medium on 8, veRL-Omni's OCR-judge LoRA workload on 16,
FLUX.1 LoRA on 8 H800 + 8 L40S.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time

from verl_digen.sim.calibrate import load_runs
from verl_digen.sim.cost_model import CostModel, load_catalog
from verl_digen.sim.planner import Inventory, search


def searches(catalog) -> dict:
    """name -> (cost model, inventory, search keywords)."""
    judge = next(r for r in load_runs() if r.name == "lora-4xH800")
    return {
        "flux-12b@16": (CostModel.from_catalog(catalog, "flux-12b", devices=["H800"], groups_per_step=16),
                        Inventory({"H800": 16}), {}),
        "hunyuanvideo-13b@16": (CostModel.from_catalog(catalog, "hunyuanvideo-13b", devices=["H800"]),
                                Inventory({"H800": 16}, 8), {}),
        "qwen-image-20b@16": (CostModel.from_catalog(catalog, "qwen-image-20b", devices=["H800"], vae_decode_chunk=1),
                              Inventory({"H800": 16}, 8), {}),
        "sd3.5-medium@8": (CostModel.from_catalog(catalog, "sd3.5-medium", devices=["H800"], groups_per_step=16),
                           Inventory({"H800": 8}), {"steps": 3, "warmup": 1}),
        "ocr-judge-lora@16": (CostModel.from_catalog(catalog, judge.model, devices=["H800"], **judge.workload),
                              Inventory({"H800": 16}, 8), {}),
        "flux-12b-lora@8xH800+8xL40S": (CostModel.from_catalog(catalog, "flux-12b", devices=["H800", "L40S"], lora=True),
                                        Inventory({"H800": 8, "L40S": 8}), {}),
    }


def decided(result) -> dict:
    """Everything a search decides: its rows, what it skipped and why, its best configuration."""
    return {
        "rows": result.rows(),
        "skipped": [[str(e.candidate.spec), e.problems] for e in result.evaluations if not e.feasible],
        "best": str(result.best.candidate.spec),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="", help="comma list of search names (default: all)")
    p.add_argument("--repeat", type=int, default=3, help="timed runs of each search after its warm-up")
    p.add_argument("--rows", default=None, help="write every search's rows, skipped configurations and best as JSON")
    args = p.parse_args(argv)
    catalog = load_catalog()
    chosen = searches(catalog)
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = sorted(set(names) - set(chosen))
        if unknown:
            print(f"unknown search {unknown}; known: {', '.join(chosen)}", file=sys.stderr)
            return 2
        chosen = {n: chosen[n] for n in names}
    out = {}
    for name, (costs, inventory, kw) in chosen.items():
        result = search(costs, inventory, **kw)  # warm-up
        times = []
        for _ in range(max(1, args.repeat)):
            t0 = time.perf_counter()
            again = search(costs, inventory, **kw)
            times.append(time.perf_counter() - t0)
        out[name] = decided(result)
        if decided(again) != out[name]:
            print(f"{name}: two runs of the same search decided differently", file=sys.stderr)
            return 1
        digest = hashlib.sha256(json.dumps(out[name], sort_keys=True, default=str).encode()).hexdigest()[:16]
        print(f"{name:30s} {len(result.evaluations):5d} configurations, {len(result.evaluated):4d} simulated: "
              f"best of {len(times)} {min(times):7.2f} s  (runs {', '.join(f'{t:.2f}' for t in times)})  "
              f"fingerprint {digest}", flush=True)
    if args.rows:
        with open(args.rows, "w") as f:
            json.dump(out, f, indent=1, sort_keys=True, default=str)
        print(f"wrote {args.rows}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
