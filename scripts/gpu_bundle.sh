#!/usr/bin/env bash
# The wheels a GPU machine without a package index lacks, into .whl/ (ignored; carried next to the
# working tree): bash scripts/gpu_bundle.sh [--python-version 3.12] [--out .whl] [--also NAME]
# Details: scripts/gpu_bundle.py. PYTHON: the interpreter that runs pip (default .venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
exec "$PY" scripts/gpu_bundle.py "$@"
