#!/usr/bin/env bash
# The one command of a session on a lent GPU machine without a package index (one H200, minutes
# of device time): the bundle built beforehand on a CPU machine (bash scripts/gpu_bundle.sh, into
# .whl/, carried beside the working tree) is installed offline, then the GPU check's versions and
# the disaggregated-run rehearsals run at real size under one time budget, the report (rewritten
# after every part, so a cut-off run keeps what it measured) and the log written to $OUT:
#
#   bash scripts/gpu_device_run.sh        # carry: .whl
#
# BUDGET_S: the whole check's limit (default 520 s, under a 10-minute command). PARTS: the parts,
# in order (the quick ones first; the part the budget cuts off is reported as started, not finished,
# the others stay in the report). RUN_TIMEOUT_S: each run's limit (default 240 s).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device_out}
mkdir -p "$OUT"
BUDGET_S=${BUDGET_S:-520}
PARTS=${PARTS:-versions,snapshot_order,tsp_prompt_cache,reward_pool,disaggregated_one_gpu,full_ft_one_rank}
export PYTHON=${PYTHON:-python3} PYTHONUNBUFFERED=1 DIGEN_CHECK_DISK=${DIGEN_CHECK_DISK:-/tmp}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$OUT/nvidia_smi.csv" 2>&1
timeout --kill-after=10 "$BUDGET_S" bash scripts/gpu_check.sh "$OUT/gpu_check.json" --parts "$PARTS" \
    --size real --run-timeout "${RUN_TIMEOUT_S:-240}" 2>&1 | tee "$OUT/gpu_check.log"
rc=${PIPESTATUS[0]}
echo "[gpu_device_run] exit $rc (124: the budget of $BUDGET_S s ran out); report: $OUT/gpu_check.json"
exit "$rc"
