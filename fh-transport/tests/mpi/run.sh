#!/usr/bin/env bash
# Run the MPI transport's collective suite under mpirun with 2, 3 and 4 ranks, once more in the
# serialized fallback mode, through `fhrun --mpi`, and as an MPI singleton; then the scheduler
# (fh-scheduler/examples/train_env.rs) over MPI with both presets, and mixed with TCP
# (FH_TRANSPORT=mpi+tcp and tcp+mpi); last the scheduler's multi-rank suite (sched_suite.sh).
#
#   fh-transport/tests/mpi/run.sh            # from anywhere inside the repository
#
# Needs an MPI library with headers and libclang (bindgen): Debian/Ubuntu `openmpi-bin
# libopenmpi-dev libclang-dev`. When they are missing and this runs as root with apt-get, they are
# installed; otherwise the script names them and exits with status 77 ("skipped").
# Environment: CARGO (default cargo), FH_MPI_RUN_TIMEOUT (seconds per mpirun, default 300),
# FH_MPI_SUITE_VERBOSE=1 (rank 0 prints each stage).
set -euo pipefail

cd "$(dirname "$0")/../../.."
CARGO="${CARGO:-cargo}"
TIMEOUT="${FH_MPI_RUN_TIMEOUT:-300}"
PKGS="openmpi-bin libopenmpi-dev libclang-dev"

have_mpi() {
    command -v mpirun >/dev/null 2>&1 && command -v mpicc >/dev/null 2>&1 &&
        { ls /usr/lib/llvm-*/lib/libclang*.so* >/dev/null 2>&1 || ldconfig -p 2>/dev/null | grep -q libclang; }
}

if ! have_mpi; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "mpi: installing $PKGS" >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y $PKGS >/dev/null ||
            { apt-get update >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y $PKGS >/dev/null; }
    else
        echo "mpi: SKIPPED: needs mpirun, MPI headers and libclang (Debian: apt-get install $PKGS)" >&2
        exit 77
    fi
fi

# The test profile (opt-level 1): the local reference computations are slow unoptimised.
"$CARGO" build -q --profile test -p fh-transport --features mpi --example mpi_suite
"$CARGO" build -q --profile test -p fh-launch --bin fhrun
"$CARGO" build -q --profile test -p fh-scheduler --example train_env --features fh-transport/mpi
TARGET="$("$CARGO" metadata --format-version 1 --no-deps |
    sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')"
EXE="$TARGET/debug/examples/mpi_suite"
FHRUN="$TARGET/debug/fhrun"
TRAIN="$TARGET/debug/examples/train_env"

FLAGS=()
if mpirun --version 2>/dev/null | grep -q "Open MPI"; then
    FLAGS+=(--oversubscribe --bind-to none -x FH_MPI_THREAD_LEVEL -x FH_MPI_SUITE_VERBOSE -x FH_TRANSPORT -x FH_SCHEDULE -x FH_CHANNELS)
    [ "$(id -u)" = 0 ] && FLAGS+=(--allow-run-as-root)
fi
export FH_MPI_SUITE_VERBOSE="${FH_MPI_SUITE_VERBOSE:-}"

failed=0
run() { # name, then the command
    local name="$1"; shift
    local start=$SECONDS
    if timeout --kill-after=10 "$TIMEOUT" "$@"; then
        echo "mpi: $name: ok ($((SECONDS - start)) s)"
    else
        echo "mpi: $name: FAILED (status $?)" >&2
        failed=1
    fi
}

export FH_TRANSPORT="${FH_TRANSPORT:-}" FH_SCHEDULE="${FH_SCHEDULE:-}" FH_CHANNELS="${FH_CHANNELS:-}"
for np in 2 3; do
    FH_MPI_THREAD_LEVEL=multiple run "np=$np" mpirun -np "$np" "${FLAGS[@]}" "$EXE"
done
# Also through fh_transport::from_env().
FH_TRANSPORT=mpi FH_MPI_THREAD_LEVEL=multiple run "np=4 FH_TRANSPORT=mpi" mpirun -np 4 "${FLAGS[@]}" "$EXE"
FH_MPI_THREAD_LEVEL=serialized run "np=3 serialized" mpirun -np 3 "${FLAGS[@]}" "$EXE"
# fhrun --mpi hands the job to mpirun; --transport mpi selects this backend in from_env().
FH_MPI_THREAD_LEVEL=multiple run "fhrun --mpi np=3" "$FHRUN" -np 3 --mpi --transport mpi -- "$EXE"
FH_MPI_THREAD_LEVEL=multiple run "singleton" "$EXE"

# Scheduler smoke over MPI: train_tiny through the engine, both presets, 3 channels.
for sch in fasthorovod horovod; do
    FH_TRANSPORT=mpi FH_SCHEDULE=$sch FH_CHANNELS=3 FH_MPI_THREAD_LEVEL=multiple \
        run "scheduler $sch np=3" mpirun -np 3 "${FLAGS[@]}" "$TRAIN" 100
done
FH_TRANSPORT=mpi FH_SCHEDULE=fasthorovod FH_CHANNELS=3 FH_MPI_THREAD_LEVEL=serialized \
    run "scheduler fasthorovod np=4 serialized" mpirun -np 4 "${FLAGS[@]}" "$TRAIN" 100

# Engine mixing: control plane over MPI and data over TCP, and the reverse (TCP needs a
# rendezvous address and a token: a free local port and a fixed test token).
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
# (Forwarded only to these runs, which set both: an empty FH_JOB_TOKEN is an error.)
MIXFLAGS=(-x FH_RENDEZVOUS_ADDR -x FH_JOB_TOKEN)
if [ ${#FLAGS[@]} -gt 0 ]; then MIXFLAGS=("${FLAGS[@]}" "${MIXFLAGS[@]}"); fi
mixes="mpi+tcp tcp+mpi"
command -v python3 >/dev/null 2>&1 || { echo "mpi: engine mixing SKIPPED (needs python3 to pick a free port)"; mixes=""; }
for mix in $mixes; do
    for sch in fasthorovod horovod; do
        FH_RENDEZVOUS_ADDR="127.0.0.1:$(free_port)" FH_JOB_TOKEN=6d70692d6d6978696e672d7465737421 \
            FH_TRANSPORT=$mix FH_SCHEDULE=$sch FH_CHANNELS=2 FH_MPI_THREAD_LEVEL=multiple \
            run "scheduler $sch np=3 FH_TRANSPORT=$mix" mpirun -np 3 "${MIXFLAGS[@]}" "$TRAIN" 100
    done
done

# The scheduler's multi-rank suite: MPI at 2, 3 and 4 ranks with both presets, and TCP (its own
# script, also runnable alone).
run "scheduler multi-rank suite" fh-transport/tests/mpi/sched_suite.sh

if [ "$failed" != 0 ]; then
    echo "mpi: FAILED" >&2
    exit 1
fi
echo "mpi: all runs passed"
