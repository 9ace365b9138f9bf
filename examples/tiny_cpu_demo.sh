#!/usr/bin/env bash
# Tiny FLUX, colocated on 2 CPU slots, brightness reward: the reward rises within 20 steps.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m verl_digen.main "$@"
