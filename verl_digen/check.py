"""``python -m verl_digen.check --config-name PRESET [hydra overrides]``: would this run start?

Runs every check ``python -m verl_digen.main`` makes before Ray starts, through the same code
(:func:`verl_digen.trainer.resolve.check_run_config`): veRL's keys mapped onto ours, the typed
config, the pools against the declared cluster, the transformer call rows (a micro-batch dealt
over the FSDP ranks in whole calls), the prompt files, the loggers, the reward (a custom file
loads and its function takes the reward's arguments, a server answers), the model directory and
the memory plan of every role. It starts no Ray and loads no weights: when ``digen.model.path``
is not a directory on this machine (the shipped presets name none), the family's shipped real
configs stand in for the model and the output says so. Nothing is written.

Exit status 0 with a short summary (placement, pools, call rows, each role's memory peak per GPU
against the GPU) when the run would start; 2 with the error, naming the key, when it would not.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from verl_digen.config.compose import CONFIG_DIR, CONFIG_NAME
from verl_digen.config.schema import ConfigError
from verl_digen.memory.object_store import describe as object_store_lines
from verl_digen.sim.deadlines import check_lines as check_deadlines


def summary(checked: Any) -> list[str]:
    """What the run would be: cluster, placement and pools, call rows, the model, the memory plan."""
    from verl_digen.memory.plan import GIB, host_ram_lines

    cfg, cluster = checked.cfg, checked.cluster
    devices = cluster.devices
    pools = ", ".join(f"{name} {sum(counts)}" for name, (counts, _accel) in checked.layout.pools.items())
    fsdp = cfg.fsdp_ranks(devices)
    lines = [
        f"cluster: {cluster.nnodes} node(s) x {cluster.n_devices_per_node} GPU(s) "
        f"(trainer.nnodes, trainer.n_gpus_per_node)",
        f"placement: {cfg.placement}; pools (GPUs): {pools}",
        f"call rows: {cfg.pass_rows(devices)} sample(s) per transformer call, in rollout and in each training pass"
        + (f" (FSDP over {fsdp} ranks)" if fsdp > 1 else " (no FSDP)"),
        f"gradient checkpointing: {cfg.model.gradient_checkpointing}; steps: {checked.total_steps}; "
        f"prompts: {len(checked.prompt_records)}",
        f"model: {checked.model_path}",
    ]
    if cfg.tag.enable and cfg.placement == "disaggregated":
        lines.append(_tag_line(cfg))
    if checked.model_note:
        lines.append(f"note: {checked.model_note}")
    if checked.memory_plan is None:
        why = "digen.memory.check=false" if not cfg.memory.check else "no real-size model"
        lines.append(f"memory: not planned ({why})")
    for plan in checked.memory_plan or []:
        lines.append(f"memory: {plan.role} peaks at {plan.peak_bytes / GIB:.1f} GiB of {plan.device_gib:g} GiB per GPU "
                     f"({100 * plan.headroom:.0f}% free) in its {plan.phase} phase, {plan.devices} GPU(s)")
    lines.extend(check_deadlines(checked))
    lines.extend(object_store_lines(cfg, checked.model_path))
    lines.extend(host_ram_lines(cfg, cluster, checked.model_path) if checked.memory_plan else [])
    return lines


def _tag_line(cfg: Any) -> str:
    """How TAG's share is cut: whole tasks, and on FSDP trainers equal slices per rank."""
    ranks, fsdp, unit = cfg.pools.trainer.world_size, cfg.fsdp.enable, cfg.tag_unit
    share = "decided every step" if cfg.tag.fixed is None else f"{cfg.tag.fixed} group(s) every step"
    how = (f", each group in {cfg.tag_slices} sample slice(s), as many on each of the {ranks} FSDP ranks"
           if fsdp else "")
    return f"TAG: the trainers' share ({share}) in multiples of {unit} group(s){how}"


def check(config_name: str, overrides: list[str], config_dir: str = CONFIG_DIR) -> tuple[int, list[str]]:
    """(exit status, lines to print) for the run ``config_name`` + ``overrides`` would be."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from verl_digen.config.compose import compose_config
    from verl_digen.rewards.http_client import RewardServerError
    from verl_digen.trainer.resolve import check_run_config

    try:
        config = compose_config(list(overrides), config_name=config_name, config_dir=config_dir)
        checked = check_run_config(config, without_weights=True)
    except (ConfigError, FileNotFoundError, RewardServerError, HydraException, OmegaConfBaseException) as e:
        return 2, [f"[verl-digen] error: {e}", "check: the run would NOT start"]
    return 0, summary(checked) + ["check: OK, the run would start"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m verl_digen.check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config-name", "-cn", default=CONFIG_NAME, help="the preset (a YAML file of --config-dir, no .yaml)")
    parser.add_argument("--config-dir", "-cd", default=CONFIG_DIR, help="the presets' directory (default: the package's)")
    parser.add_argument("overrides", nargs="*", help="hydra overrides, as for python -m verl_digen.main")
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)  # diffusers' dtype notes while building the meta models
    try:
        from verl_digen.config.omni_keys import plain_overrides

        # veRL-Omni's diffusion keys without '+', as verl_digen.main and main_ppo take them
        status, lines = check(args.config_name, plain_overrides(args.overrides), args.config_dir)
    finally:
        logging.disable(logging.NOTSET)
    for line in lines:
        print(line, file=sys.stderr if status else sys.stdout)
    return status


if __name__ == "__main__":
    sys.exit(main())
