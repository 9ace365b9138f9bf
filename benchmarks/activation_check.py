"""How far the cost model's activation bytes are from the memory planner's measured ones.

    python benchmarks/activation_check.py

For each paper model profile at its default workload (full fine-tuning, bf16), prints the
activations one sample keeps for its backward (both CFG branches) as the cost model charges them
(``CostModel.activation_bytes_per_sample``: a per-token formula, ``activation_bytes`` x tokens x
hidden per block) and as the memory planner measures them (``memory/trace.py``: the family's real
transformer config traced on the meta device), with and without activation checkpointing. The
two are not one model yet (docs/cost_model.md, "Memory"); this shows by how much they differ.
"""

from __future__ import annotations

from verl_digen.memory.trace import TraceShape, trace_transformer
from verl_digen.sim.cost_model import CostModel, load_catalog

# model profile -> the model family whose shipped real config the memory planner traces
FAMILY_OF = {"flux-12b": "flux", "qwen-image-20b": "qwen_image", "wan2.1-14b": "wan",
             "hunyuanvideo-13b": "hunyuan_video", "sd3.5-large": "sd3"}


def main() -> int:
    catalog = load_catalog()
    gib = 2**30
    print(f"{'profile':18s} {'ckpt':5s} {'cost model GiB':>15s} {'traced GiB':>11s} {'ratio':>6s}")
    for profile, family in FAMILY_OF.items():
        costs = CostModel.from_catalog(catalog, profile, devices=["H800"])
        w = costs.workload
        trace = trace_transformer(TraceShape(family, None, "bf16", w.height, w.width, w.frames, 0, ()))
        for checkpointing in (False, True):
            model = costs.activation_bytes_per_sample(checkpointing)
            traced = trace.training_bytes(w.cfg_factor, checkpointing=checkpointing)
            print(f"{profile:18s} {str(checkpointing):5s} {model / gib:15.2f} {traced / gib:11.2f} {model / traced:6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
