#!/usr/bin/env bash
# Create .venv and install verl-digen with its test extra. Idempotent.
#
# torch goes in first, pinned, so that veRL/diffusers/peft find it satisfied and never pull
# a CUDA build onto a CPU machine. On a CPU machine without the local torch 2.13.0 wheel, set
# TORCH_INDEX=https://download.pytorch.org/whl/cpu; on a GPU machine, install the CUDA torch
# you want into .venv first (this script keeps an existing torch).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
VPY=.venv/bin/python
if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
        "$VPY" -m pip install -q "torch>=2.6"
    else
        "$VPY" -m pip install -q "torch==2.13.0" ${TORCH_INDEX:+--index-url "$TORCH_INDEX"}
    fi
fi
# Constraints: the versions the suite is known to work with (scripts/constraints.txt, so pip
# does not backtrack for tens of minutes), and the torch installed above whatever an extra asks
# for (a dependency that wants a newer torch would otherwise pull a CUDA build onto a CPU
# machine; on a GPU machine, the CUDA torch you installed stays).
CONSTRAINTS=$(mktemp)
trap 'rm -f "$CONSTRAINTS"' EXIT
grep -v '^torch==' scripts/constraints.txt > "$CONSTRAINTS"
"$VPY" -c "import torch; print('torch==' + torch.__version__)" >> "$CONSTRAINTS"
"$VPY" -m pip install -q -c "$CONSTRAINTS" -e ".[test]"
"$VPY" -c "import verl_digen, verl, torch; print('verl-digen', verl_digen.__version__, '| verl', verl.__version__, '| torch', torch.__version__)"
