"""Transformer calls of 1..N rows: seconds per sample against the cost model, and whether a sample's
velocity depends on the rows it shares a call with.

    python benchmarks/call_rows.py --out call_rows.json                    # FLUX.1 at real size on CUDA
    python benchmarks/call_rows.py --size tiny --device cpu --out r.json   # the same code on the tiny FLUX

Two questions behind the planner's choices (docs/benchmarks_sim.md, "The ceiling"):

* **How much a fuller call gains.** The cost model's forward efficiency grows with the tokens of a
  call (``CostModel.efficiency``: half of its peak at ``forward_half_tokens``), which is why the
  planner looks for the largest call the FSDP ranks allow. Each ``--rows`` value runs the same
  ``--samples`` samples in calls of that many rows, timed after a warm-up pass, next to
  ``CostModel.denoise_seconds`` for the same samples and call size on the device's row of the
  device table.
* **Whether rollout and training must make the same calls.** The runtime's exactness rule (the
  behaviour log-probs the rollout records are the ones the trainer recomputes, bitwise, in bf16
  too) makes a sample's training call hold the rows its rollout call held. That is needed only if
  a sample's velocity changes with its call's other rows. For every call size this reports the
  largest difference from the one-row calls (``vs_one_row``) and whether a call under autograd
  (the training recompute's forward) gives the rollout's numbers at the same call size
  (``grad_vs_no_grad``, which the runtime relies on).

Random weights at real size, built from the shipped configs on the device in bf16
(``gpu_check.build_real_flux``); one denoising step's inputs (sigma 0.5, random latents and prompt
embeddings, the ``flux_colocated`` preset's 512 x 512 and distilled guidance).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from verl_digen import gpu_check  # noqa: E402


def _inputs(adapter, spec, samples: int, device: torch.device, seed: int = 0):
    """One denoising step's inputs for ``samples`` different samples."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    latents = adapter.prepare_latents(samples, spec, gen).to(device)
    cond = adapter.encode_prompts(["warm-up"])
    rand = {k: torch.randn((samples, *v.shape[1:]), generator=gen).to(device=device, dtype=v.dtype)
            for k, v in cond.items()}
    sigma = torch.full((samples,), 0.5, device=device)
    return latents, sigma, rand


def _velocity(adapter, spec, latents, sigma, cond, rows: int, grad: bool) -> torch.Tensor:
    """Every sample's velocity, computed in calls of ``rows`` rows (under autograd when ``grad``)."""
    outs = []
    with torch.set_grad_enabled(grad):
        for i in range(0, latents.shape[0], rows):
            part = {k: v[i:i + rows] for k, v in cond.items()}
            outs.append(adapter.predict_velocity(latents[i:i + rows], sigma[i:i + rows], part, spec).detach())
    return torch.cat(outs)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cost_model(device_type: str, height: int, width: int, samples: int, cfg: bool):
    """The shipped cost model for FLUX.1 at this shape: ``denoise_seconds(samples, device, rows)``
    is its time for one denoising step of ``samples`` samples in calls of ``rows`` rows."""
    from verl_digen.sim.cost_model import CostModel, load_catalog

    return CostModel.from_catalog(load_catalog(), "flux-12b", devices=[device_type], height=height, width=width,
                                  num_steps=1, group_size=samples, groups_per_step=1, cfg=cfg)


def measure(size: str, device_name: str, rows_list: list[int], samples: int, repeats: int) -> dict:
    from verl_digen.workers.fsdp import enable_gradient_checkpointing
    from verl_digen.workers.worker import sampling_settings

    device = gpu_check._device(device_name)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    _cfg, dcfg = gpu_check._preset_config(size, samples, ["digen.model.dtype=" + ("bf16" if dtype == torch.bfloat16 else "fp32")])
    spec = sampling_settings(dcfg).spec
    adapter = gpu_check._load_flux(size, device, dtype)
    # The training forward: a graph (as with LoRA on) and activation checkpointing, as training runs it.
    adapter.transformer.requires_grad_(True)
    checkpointing = enable_gradient_checkpointing(adapter.transformer)
    latents, sigma, cond = _inputs(adapter, spec, samples, device)
    meter = gpu_check.device_type(device)
    cm = cost_model(meter, spec.height, spec.width, samples, spec.guidance_scale > 1.0)
    dev = cm.device(meter)
    out = {"size": size, "device": str(device), "device_type": meter, "dtype": str(dtype).replace("torch.", ""),
           "cfg": spec.guidance_scale > 1.0,
           "samples": samples, "height": spec.height, "width": spec.width, "tokens_per_row": cm.tokens()[1],
           "transformer_params": sum(p.numel() for p in adapter.transformer.parameters()),
           "gradient_checkpointing": checkpointing, "rows": {}}
    reference = None
    for rows in rows_list:
        no_grad = _velocity(adapter, spec, latents, sigma, cond, rows, grad=False)  # also the warm-up
        times = []
        for _ in range(repeats):
            _sync(device)
            t0 = time.perf_counter()
            _velocity(adapter, spec, latents, sigma, cond, rows, grad=False)
            _sync(device)
            times.append(time.perf_counter() - t0)
        with_grad = _velocity(adapter, spec, latents, sigma, cond, rows, grad=True)
        if reference is None:
            reference = no_grad
        seconds = min(times)
        predicted = cm.denoise_seconds(samples, dev, rows)
        out["rows"][str(rows)] = {
            "seconds_per_sample": seconds / samples,
            "predicted_seconds_per_sample": predicted / samples,
            "measured_over_predicted": seconds / predicted,
            "vs_one_row_max_abs": float((no_grad - reference).abs().max()),
            "vs_one_row_bitwise": bool(torch.equal(no_grad, reference)),
            "grad_vs_no_grad_bitwise": bool(torch.equal(with_grad, no_grad)),
        }
        print(f"[call_rows] {rows:>3} rows: {seconds / samples:.4f} s/sample (model {predicted / samples:.4f}); "
              f"vs one-row calls max |dv| {out['rows'][str(rows)]['vs_one_row_max_abs']:.3g}; "
              f"autograd call bitwise {out['rows'][str(rows)]['grad_vs_no_grad_bitwise']}", flush=True)
    one = out["rows"][str(rows_list[0])]["seconds_per_sample"]
    for r in out["rows"].values():
        r["speedup_over_first"] = one / r["seconds_per_sample"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="call_rows.json")
    p.add_argument("--size", choices=("real", "tiny"), default="real")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--rows", default="1,2,3,4,6,12", help="call sizes; the first is the reference")
    p.add_argument("--samples", type=int, default=12, help="samples per pass (each call size must divide it)")
    p.add_argument("--repeats", type=int, default=3, help="timed passes per call size (the fastest is kept)")
    args = p.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    bad = [r for r in rows if r < 1 or args.samples % r]
    if bad:
        p.error(f"--rows {bad} do not divide --samples {args.samples}")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    result = measure(args.size, device, rows, args.samples, args.repeats)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    print(f"[call_rows] report: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
