#!/usr/bin/env bash
# The same work colocated and disaggregated (+GAP, +TSP when >= 2 rollout devices, +TAG, +TCSS).
# Add the main job's overrides, e.g. trainer.n_gpus_per_node=8 digen.model.path=/models/FLUX.1-dev
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m verl_digen.compare --out "${OUT:-runs/compare}" trainer.total_training_steps=10 "$@"
