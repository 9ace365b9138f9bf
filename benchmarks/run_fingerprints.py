"""Fingerprints of a few tiny runs: the SHA-256 of each run's final weights and its metrics
without the timing ones, as JSON. Run it in two checkouts and diff the outputs to show that a
change left training bitwise the same (a refactor must):

    git worktree add /tmp/before <commit>
    .venv/bin/python benchmarks/run_fingerprints.py /tmp/before.json --tree /tmp/before
    .venv/bin/python benchmarks/run_fingerprints.py /tmp/after.json && diff /tmp/before.json /tmp/after.json

``--tree``: the checkout whose code runs (default: this one), for the driver and the Ray workers.

``--cases a,b`` runs only those. TCSS is not among the cases: its look-ahead depth comes from
costs measured during the run, so two runs of the same code may differ. About 7 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DISAGG = ["digen.placement=disaggregated", "digen.pools.rollout.devices=1", "digen.pools.trainer.devices=1"]
CASES = {
    "coloc_flux": ["trainer.total_training_steps=2"],
    "disagg_gap": DISAGG + ["trainer.total_training_steps=3", "digen.gap.enable=true", "digen.batch.groups_per_step=4"],
    "disagg_sync_sd3_full": DISAGG + ["trainer.total_training_steps=2", "digen.model.tiny_arch=sd3",
                                      "digen.model.lora.enable=false"],
    "tsp_tag": ["digen.placement=disaggregated", "digen.pools.rollout.devices=2", "digen.pools.trainer.devices=1",
                "digen.tsp.stages=2", "digen.tag.enable=true", "trainer.n_gpus_per_node=3",
                "trainer.total_training_steps=2", "digen.batch.groups_per_step=4"],
    "fsdp2_wan": ["digen.placement=disaggregated", "digen.pools.rollout.devices=1", "digen.pools.trainer.devices=2",
                  "digen.fsdp.enable=true", "digen.model.tiny_arch=wan", "trainer.n_gpus_per_node=3",
                  "trainer.total_training_steps=2"],
}
# Metric names that hold measured times or memory peaks (they differ between any two runs).
TIMING = ("time", "_s", "wall", "throughput", "per_s", "bubble", "util", "timing", "per_group", "memory/")


def fingerprint(weights_file: str) -> str:
    from safetensors.torch import load_file

    weights = load_file(weights_file)
    digest = hashlib.sha256()
    for name in sorted(weights):
        digest.update(name.encode())
        digest.update(weights[name].float().numpy().tobytes())
    return digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="the JSON file to write")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    parser.add_argument("--tree", default=ROOT, help="the checkout whose code runs (default: this one)")
    args = parser.parse_args()
    names = args.cases.split(",")
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown cases {unknown}; known: {', '.join(CASES)}")

    tree = os.path.abspath(args.tree)
    # its verl_digen and its runs.py: tests/helpers/, or tests/ in a checkout older than the lanes' folders
    sys.path[:0] = [tree, os.path.join(tree, "tests", "helpers"), os.path.join(tree, "tests")]
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (tree, os.environ.get("PYTHONPATH")) if p)  # Ray workers
    import ray

    from runs import run

    os.environ.setdefault("VERL_DIGEN_CACHE", tempfile.mkdtemp())  # tiny models built here
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    out: dict[str, dict] = {}
    try:
        tmp = pathlib.Path(tempfile.mkdtemp())
        for name in names:
            result = run(tmp, name, *CASES[name], "digen.save_final_weights=true")
            metrics = [{k: v for k, v in m.items() if not any(t in k for t in TIMING)} for m in result.metrics]
            out[name] = {"weights_sha256": fingerprint(result.extra["final_weights"]), "metrics": metrics}
            print(name, out[name]["weights_sha256"], flush=True)
    finally:
        ray.shutdown()
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
