#!/usr/bin/env bash
# The prepared check of the GPU path (fh-transport feature `cuda`) for a machine with an NVIDIA
# GPU and driver. Downloads nothing (cargo runs --offline: bring the repository's target/ and
# ~/.cargo registry, or a vendored tree); finishes in well under 5 minutes on one GPU.
#
#   scripts/gpu-check.sh            # from the repository root
#
# Steps: build the workspace with the feature; NCCL loader test (finds the wheel's
# libnccl.so.2); the GPU tests (NCCL at world size 1, scaling kernels and device fusion,
# event readiness, host staging with 2 processes on one GPU, NCCL with 2 processes when 2
# GPUs are visible); the engine driving device tensors (fh-scheduler feature `cuda`: 1 rank
# on NCCL, 2 ranks on one GPU through host staging; fused, scaled, partitioned allreduce and
# broadcast); device-side timings (fusion copy-in/out against device copy bandwidth).
#
# NCCL is found through FH_NCCL_LIBRARY, the loader's path, or a Python environment with
# NVIDIA's nvidia-nccl wheel: $VIRTUAL_ENV, else target/fh-venv (set FH_VENV to another one).
set -uo pipefail
cd "$(dirname "$0")/.."

STEP_TIMEOUT=${STEP_TIMEOUT:-240}
LOG=target/gpu-check.log
mkdir -p target
: >"$LOG"
pass=0
fail=0
failed=()

venv=${FH_VENV:-${VIRTUAL_ENV:-target/fh-venv}}
if [ -d "$venv/lib" ]; then
    export VIRTUAL_ENV
    VIRTUAL_ENV=$(cd "$venv" && pwd)
fi

step() {
    local name=$1
    shift
    echo "=== $name: $*" | tee -a "$LOG"
    local start=$SECONDS
    if timeout "$STEP_TIMEOUT" "$@" 2>&1 | tee -a "$LOG"; then
        pass=$((pass + 1))
        echo "=== $name: ok ($((SECONDS - start)) s)" | tee -a "$LOG"
    else
        fail=$((fail + 1))
        failed+=("$name")
        echo "=== $name: FAILED ($((SECONDS - start)) s)" | tee -a "$LOG"
    fi
}

echo "=== machine" | tee -a "$LOG"
(command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv) 2>&1 | tee -a "$LOG" || true
echo "VIRTUAL_ENV=${VIRTUAL_ENV:-<none>} FH_NCCL_LIBRARY=${FH_NCCL_LIBRARY:-<unset>}" | tee -a "$LOG"

step build cargo build --offline --workspace --all-targets --features fh-transport/cuda,fh-scheduler/cuda
step nccl-loader cargo test --offline -p fh-nccl-sys -- --nocapture
step cuda-unit cargo test --offline -p fh-transport --features cuda --lib cuda -- --nocapture
step gpu-tests cargo test --offline -p fh-transport --features cuda --test cuda_gpu -- --nocapture --test-threads=1
step engine-gpu cargo test --offline -p fh-scheduler --features cuda --test device -- --nocapture --test-threads=1
# Device-side timings: events on the channel stream, so the debug build measures the device.
step timings cargo run --offline -q -p fh-transport --features cuda --example cuda_fusion_bw -- 256 64

# The GPU tests print "skipped: ..." when they could not run. On a one-GPU machine only the
# two-GPU NCCL test should skip.
if grep -q "skipped:" "$LOG"; then
    echo "=== skipped checks:"
    grep -o "skipped:.*" "$LOG" | sort | uniq -c
fi
echo "=== gpu-check: $pass passed, $fail failed${failed:+ (${failed[*]})}; log in $LOG"
if grep -q "skipped: no CUDA driver\|skipped: the CUDA driver sees no GPU" "$LOG"; then
    echo "=== gpu-check: NO GPU here: the GPU tests skipped, nothing device-side was checked"
    exit 2
fi
[ "$fail" -eq 0 ]
