#!/usr/bin/env bash
# The one-command GPU check: bash scripts/gpu_check.sh [report.json] [extra gpu_check flags]
#
# Runs `python -m verl_digen.gpu_check` (versions and the doctor, `pytest -m gpu`, real-size
# random-weight FLUX.1 phases against the memory planner and the cost model, our rollout against
# diffusers' FluxPipeline, an NCCL world-size-1 FSDP2 + DCP round trip, a 3-step tiny bf16 run
# with checkpoint and resume) and writes one JSON report. About 5 minutes on one 80 GB GPU.
# PYTHON: the interpreter of the environment to check (default: .venv/bin/python, else python3).
# With a bundle folder (.whl/, from bash scripts/gpu_bundle.sh; BUNDLE names another) the wheels
# are installed first into SITE (default /tmp/site), offline and without their dependencies, and
# SITE goes on PYTHONPATH behind the checkout: the bundle's packages take precedence over the
# interpreter's, while torch (never in the bundle) stays the interpreter's own CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
BUNDLE=${BUNDLE:-.whl}
if compgen -G "$BUNDLE/*.whl" >/dev/null; then
    SITE=${SITE:-/tmp/site}
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$BUNDLE"/*.whl
    export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
OUT=${1:-gpu_check.json}
shift || true
export PYTHONUNBUFFERED=1
exec "$PY" -m verl_digen.gpu_check --out "$OUT" "$@"
