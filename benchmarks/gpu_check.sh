#!/usr/bin/env bash
# One GPU check: the CUDA tests, then every GPU benchmark, then one table of figures against
# targets, ready for benchmarks/RESULTS.md. Each step has a time limit (110 + 35 + 100 + 35 + 80
# + 30 + 30 + 40 s) so the whole stays under 8 minutes on an H100/H200; a step that runs out
# counts as failed. The CUDA tests include offloaded execution's and watch()'s (requires_cuda).
# The checkpoint load also sweeps the CUDA reader's thread count and the pinned pool's shape
# (bench_load_gpu.py --sweep): its table says what _reader.CUDA_READ_THREADS should be.
#
#   bash benchmarks/gpu_check.sh            # from the source tree (PYTHONPATH=src is set here)
#   bash benchmarks/gpu_check.sh --dry-run  # print what it would run, run nothing
#
# Without CUDA it says so and exits 0. Exit 1 when a CUDA test fails or a target is missed.
# PYTHON picks the interpreter (default: python).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python}"

DRY=0
if [ "${1:-}" = "--dry-run" ]; then
    DRY=1
fi

ROWS="$(mktemp -t torchplace-gpu-rows.XXXXXX)"
XDIST=""
if "$PY" -c "import xdist" 2>/dev/null; then
    XDIST="-n 4 -p no:benchmark"  # pytest-benchmark does not run under xdist
fi

# step LIMIT_SECONDS COMMAND...: run (or print) one step, remembering a failure.
FAILED=()
step() {
    local limit="$1"
    shift
    echo "+ timeout $limit $*"
    if [ "$DRY" = 1 ]; then
        return 0
    fi
    timeout "$limit" "$@"
    local rc=$?
    if [ "$rc" != 0 ]; then
        FAILED+=("$* (exit $rc)")
    fi
}

if [ "$DRY" = 0 ] && ! "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
    echo "gpu_check: no CUDA device here, nothing to check (run it on a GPU machine)"
    exit 0
fi

if [ "$DRY" = 0 ]; then
    "$PY" -c "import torch; print('device:', torch.cuda.get_device_name(0), '| torch', torch.__version__)"
    date -u "+date: %Y-%m-%d %H:%M UTC"
fi
# shellcheck disable=SC2086  # XDIST is several words on purpose
step 110 "$PY" -m pytest -m requires_cuda -q $XDIST tests src/torchplace
step 35 "$PY" benchmarks/bench_copies.py --rows "$ROWS"
step 100 "$PY" benchmarks/bench_move.py --rows "$ROWS"
step 45 "$PY" benchmarks/bench_loader.py --batches 16 --rows "$ROWS"
step 80 "$PY" benchmarks/bench_load_gpu.py --sweep --rows "$ROWS"
step 30 "$PY" benchmarks/bench_offload.py --rounds 5 --rows "$ROWS"
step 30 "$PY" benchmarks/bench_estimate.py --gpu --rows "$ROWS"
step 40 "$PY" benchmarks/bench_save.py --gpu --rows "$ROWS"

if [ "$DRY" = 1 ]; then
    echo "+ $PY benchmarks/_rows.py $ROWS"
    rm -f "$ROWS"
    exit 0
fi
echo
echo "Figures against targets (paste into benchmarks/RESULTS.md):"
echo
"$PY" benchmarks/_rows.py "$ROWS"
rm -f "$ROWS"
if [ "${#FAILED[@]}" != 0 ]; then
    echo
    echo "gpu_check: failed or missed:"
    printf '  %s\n' "${FAILED[@]}"
    exit 1
fi
