"""``python -m verl_digen.memory``: per-GPU peak memory of each role of a preset, at real size.

    python -m verl_digen.memory --preset flux_colocated [hydra overrides ...]
    python -m verl_digen.memory --all-presets [--json FILE] [--configs-dir DIR]
    python -m verl_digen.memory --all-presets --trace   # activations per row, with / without checkpointing

A preset whose ``digen.model.path`` does not exist on this machine (or is unset: the presets
name none) is planned with its family's shipped real configs. Prints a markdown table; ``--json``
also writes ``{"rows": [{"preset", "role", "peak_gib", "device_gib", ...}]}``. Exit status 1
when a role does not fit.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

from verl_digen.memory.plan import plan_job

from verl_digen.config.compose import CONFIG_DIR as DEFAULT_CONFIGS  # the presets (configs/ or the wheel's copy)
COLUMNS = (
    ("preset", "preset"), ("role", "role"), ("devices", "GPUs"), ("phase", "peak phase"), ("peak_gib", "peak GiB"),
    ("device_gib", "GPU GiB"), ("headroom", "headroom"), ("weights_gib", "weights"), ("gradients_gib", "grads"),
    ("optimizer_gib", "optimizer"), ("activations_gib", "activations"), ("encoders_vae_gib", "encoders+VAE"),
    ("sync_buffers_gib", "sync"), ("overhead_gib", "overhead"),
)

TRACE_COLUMNS = (
    ("preset", "preset"), ("size", "HxWxframes"), ("tokens", "tokens"), ("text_tokens", "text tokens"),
    ("train_gib", "train GiB/row"), ("train_checkpointed_gib", "train GiB/row, checkpointed"),
    ("rollout_gib", "rollout GiB/row"),
)


def preset_names(configs_dir: str) -> list[str]:
    """The presets of a real model family: YAML files that set ``digen.model.arch`` (the packaged
    config directory also holds the base configs and the ``digits`` preset, whose model is built
    here)."""
    import yaml

    names = []
    for f in sorted(os.listdir(configs_dir)):
        if not f.endswith(".yaml"):
            continue
        with open(os.path.join(configs_dir, f)) as fh:
            doc = yaml.safe_load(fh) or {}
        if ((doc.get("digen") or {}).get("model") or {}).get("arch"):
            names.append(f[:-5])
    return names


def plan_preset(name: str, overrides: list[str], configs_dir: str) -> list[dict[str, Any]]:
    from omegaconf import OmegaConf

    from verl_digen.config.compose import compose_config
    from verl_digen.config.schema import digen_config_from_dict

    cfg = compose_config(list(overrides), config_name=name, config_dir=configs_dir)
    digen = digen_config_from_dict(OmegaConf.to_container(cfg.digen, resolve=True))
    plans = plan_job(digen, devices_per_node=int(cfg.trainer.n_gpus_per_node), nnodes=int(cfg.trainer.nnodes))
    return [p.row(name) for p in plans]


def trace_preset(name: str, overrides: list[str], configs_dir: str) -> dict[str, Any]:
    """The activation trace of the preset's transformer at its sample size, per forward row."""
    from omegaconf import OmegaConf

    from verl_digen.config.compose import compose_config
    from verl_digen.config.schema import digen_config_from_dict
    from verl_digen.memory.plan import GIB, job_shape, plan_trace

    cfg = compose_config(list(overrides), config_name=name, config_dir=configs_dir)
    digen = digen_config_from_dict(OmegaConf.to_container(cfg.digen, resolve=True))
    job = job_shape(digen, devices_per_node=int(cfg.trainer.n_gpus_per_node), nnodes=int(cfg.trainer.nnodes))
    t = plan_trace(job)  # the planner's own trace of the job (LoRA jobs with their adapters)
    return {
        "preset": name, "size": f"{job.height}x{job.width}x{job.num_frames}", "tokens": t.tokens,
        "text_tokens": t.text_tokens,
        "train_gib": round(t.training_bytes(1, checkpointing=False) / GIB, 2),
        "train_checkpointed_gib": round(t.training_bytes(1, checkpointing=True) / GIB, 2),
        "rollout_gib": round(t.inference_bytes(1) / GIB, 3),
    }


def markdown(rows: list[dict[str, Any]], columns=COLUMNS) -> str:
    def cell(key: str, value: Any) -> str:
        if key == "headroom":
            return f"{100 * value:.0f}%"
        if isinstance(value, float):
            return f"{value:.1f}"
        return str(value)

    lines = ["| " + " | ".join(title for _, title in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(cell(key, row[key]) for key, _ in columns) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m verl_digen.memory", description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--preset", help="a preset of --configs-dir (file name without .yaml)")
    which.add_argument("--all-presets", action="store_true", help="every preset of --configs-dir")
    parser.add_argument("--configs-dir", default=DEFAULT_CONFIGS, help="the presets' directory (default: configs/ of the checkout, or the wheel's packaged copy)")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    parser.add_argument("--trace", action="store_true",
                        help="print each preset's transformer activations per forward row instead of the plan")
    parser.add_argument("overrides", nargs="*", help="hydra overrides (with --preset)")
    args = parser.parse_args(argv)
    if args.all_presets and args.overrides:
        parser.error("overrides apply to --preset only")
    logging.disable(logging.WARNING)  # diffusers' dtype notes while building the meta models
    names = preset_names(args.configs_dir) if args.all_presets else [args.preset]
    if args.trace:
        print(markdown([trace_preset(name, args.overrides, args.configs_dir) for name in names], TRACE_COLUMNS))
        return 0
    rows = [row for name in names for row in plan_preset(name, args.overrides, args.configs_dir)]
    print(markdown(rows))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"rows": rows}, f, indent=2)
    return 0 if all(row["fits"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
