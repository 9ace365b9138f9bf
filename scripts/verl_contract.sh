#!/usr/bin/env bash
# Check verl-digen against a veRL source checkout (another version than the installed one): its
# `verl` package is imported first, then the veRL contract tests run and a 2-step tiny
# disaggregated run trains. See patches/README.md.
#   scripts/verl_contract.sh /path/to/verl-checkout      (PYTHON=... to use another interpreter)
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
verl_src="$(cd "$1" && pwd)"
py="${PYTHON:-$repo/.venv/bin/python}"
export PYTHONPATH="$verl_src:$repo${PYTHONPATH:+:$PYTHONPATH}"  # Ray workers inherit it
"$py" -c "import verl; print('veRL', verl.__version__, 'from', verl.__file__)"
cd "$repo"
# the installed distribution's metadata still says the installed version: skip that one test
"$py" -m pytest -q -p no:cacheprovider tests/unit/test_verl_contract.py tests/unit/test_verl_hooks.py -k "not pinned_version"
out="$(mktemp -d)"
"$py" -m verl_digen.main --config-name flux_disaggregated +smoke=tiny digen.progress_bar=false \
    "trainer.logger=[console]" "digen.output_dir=$out/run"
echo "trained $(wc -l < "$out/run/metrics.jsonl") steps: $out/run/metrics.jsonl"
