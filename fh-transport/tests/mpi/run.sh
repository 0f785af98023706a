#!/usr/bin/env bash
# Run the MPI transport's collective suite under mpirun with 2, 3 and 4 ranks, once more in the
# serialized fallback mode, through `fhrun --mpi`, and as an MPI singleton.
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
TARGET="$("$CARGO" metadata --format-version 1 --no-deps |
    sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')"
EXE="$TARGET/debug/examples/mpi_suite"
FHRUN="$TARGET/debug/fhrun"

FLAGS=()
if mpirun --version 2>/dev/null | grep -q "Open MPI"; then
    FLAGS+=(--oversubscribe --bind-to none -x FH_MPI_THREAD_LEVEL -x FH_MPI_SUITE_VERBOSE -x FH_TRANSPORT)
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

export FH_TRANSPORT="${FH_TRANSPORT:-}"
for np in 2 3; do
    FH_MPI_THREAD_LEVEL=multiple run "np=$np" mpirun -np "$np" "${FLAGS[@]}" "$EXE"
done
# Also through fh_transport::from_env().
FH_TRANSPORT=mpi FH_MPI_THREAD_LEVEL=multiple run "np=4 FH_TRANSPORT=mpi" mpirun -np 4 "${FLAGS[@]}" "$EXE"
FH_MPI_THREAD_LEVEL=serialized run "np=3 serialized" mpirun -np 3 "${FLAGS[@]}" "$EXE"
# fhrun --mpi hands the job to mpirun; --transport mpi selects this backend in from_env().
FH_MPI_THREAD_LEVEL=multiple run "fhrun --mpi np=3" "$FHRUN" -np 3 --mpi --transport mpi -- "$EXE"
FH_MPI_THREAD_LEVEL=multiple run "singleton" "$EXE"

if [ "$failed" != 0 ]; then
    echo "mpi: FAILED" >&2
    exit 1
fi
echo "mpi: all runs passed"
