#!/usr/bin/env bash
# A real model (a local diffusers directory or a hub id) with one of the family presets in
# configs/ (shipped inside the wheel; found by --config-name alone).
#   examples/real_model.sh flux_disaggregated /models/FLUX.1-dev [more overrides]
#   examples/real_model.sh wan_disaggregated /models/Wan2.1-T2V-14B-Diffusers trainer.nnodes=2
# Presets: {flux,sd3,qwen_image,wan,hunyuan_video}_{colocated,disaggregated}.
# Plan the pool split first: python -m verl_digen.sim.planner --model flux-12b --devices 16
set -euo pipefail
cd "$(dirname "$0")/.."
preset=$1; model=$2; shift 2
.venv/bin/python -m verl_digen.main --config-name "$preset" "digen.model.path=$model" "$@"
