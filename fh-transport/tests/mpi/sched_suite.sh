#!/usr/bin/env bash
# The scheduler's multi-rank suite (fh-scheduler/examples/sched_suite.rs) across processes:
# under mpirun with FH_TRANSPORT=mpi at 2, 3 and 4 ranks for each preset (horovod, and
# fasthorovod with K = 1, 2, 4 channels), once more at 4 ranks in MPI's serialized mode, and
# under fhrun with FH_TRANSPORT=tcp at 3 ranks (the same program on another transport).
#
#   fh-transport/tests/mpi/sched_suite.sh    # from anywhere inside the repository
#
# Also run at the end of run.sh. Without mpirun the MPI runs are skipped (named) and the TCP run
# still happens. Environment: CARGO (default cargo), FH_MPI_RUN_TIMEOUT (seconds per run,
# default 120), FH_SUITE_SEED (fixed seed; default: a new one per run, printed by rank 0),
# FH_SUITE_ARGS (extra arguments for sched_suite, e.g. "--steps 5 --tensors 64").
set -euo pipefail

cd "$(dirname "$0")/../../.."
CARGO="${CARGO:-cargo}"
TIMEOUT="${FH_MPI_RUN_TIMEOUT:-120}"

have_mpi=1
command -v mpirun >/dev/null 2>&1 && command -v mpicc >/dev/null 2>&1 || have_mpi=0

features=()
[ "$have_mpi" = 1 ] && features=(--features fh-transport/mpi)
"$CARGO" build -q --profile test -p fh-scheduler --example sched_suite "${features[@]}"
"$CARGO" build -q --profile test -p fh-launch --bin fhrun
TARGET="$("$CARGO" metadata --format-version 1 --no-deps |
    sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')"
SUITE="$TARGET/debug/examples/sched_suite"
FHRUN="$TARGET/debug/fhrun"

ARGS=()
[ -n "${FH_SUITE_SEED:-}" ] && ARGS+=(--seed "$FH_SUITE_SEED")
# shellcheck disable=SC2206 # word splitting intended
[ -n "${FH_SUITE_ARGS:-}" ] && ARGS+=($FH_SUITE_ARGS)

FLAGS=()
if [ "$have_mpi" = 1 ] && mpirun --version 2>/dev/null | grep -q "Open MPI"; then
    FLAGS+=(--oversubscribe --bind-to none -x FH_TRANSPORT -x FH_MPI_THREAD_LEVEL)
    [ "$(id -u)" = 0 ] && FLAGS+=(--allow-run-as-root)
fi

failed=0
run() { # name, then the command
    local name="$1"; shift
    local start=$SECONDS
    if timeout --kill-after=10 "$TIMEOUT" "$@"; then
        echo "sched_suite: $name: ok ($((SECONDS - start)) s)"
    else
        echo "sched_suite: $name: FAILED (status $?)" >&2
        failed=1
    fi
}

if [ "$have_mpi" = 1 ]; then
    export FH_TRANSPORT=mpi FH_MPI_THREAD_LEVEL=multiple
    for np in 2 3 4; do
        for sch in horovod fasthorovod; do
            run "mpi np=$np $sch" mpirun -np "$np" "${FLAGS[@]}" "$SUITE" --schedule "$sch" "${ARGS[@]}"
        done
    done
    FH_MPI_THREAD_LEVEL=serialized run "mpi np=4 serialized" \
        mpirun -np 4 "${FLAGS[@]}" "$SUITE" "${ARGS[@]}"
    unset FH_TRANSPORT FH_MPI_THREAD_LEVEL
else
    echo "sched_suite: MPI runs SKIPPED: needs mpirun and MPI headers (Debian: openmpi-bin libopenmpi-dev libclang-dev)" >&2
fi
# The same program over TCP under fhrun (rendezvous and token set by fhrun).
run "tcp np=3 (fhrun)" "$FHRUN" -np 3 --transport tcp -- "$SUITE" "${ARGS[@]}"

if [ "$failed" != 0 ]; then
    echo "sched_suite: FAILED" >&2
    exit 1
fi
echo "sched_suite: all runs passed"
