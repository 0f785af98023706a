/* OpenMPI's MPI_Allreduce timed like fh-bench's collectives sweep, for side-by-side figures.
 *
 * usage: mpi_allreduce WARMUP REPEATS BYTES...
 * For each size: WARMUP untimed MPI_Allreduce (sum of floats; the first result is checked),
 * then REPEATS timed ones, each after an MPI_Barrier; a repeat's time is the slowest rank's.
 * Rank 0 prints one JSON object per size on stdout:
 *   {"bytes": B, "seconds": [s1, s2, ...]}
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (argc < 4) {
        if (rank == 0) fprintf(stderr, "usage: %s WARMUP REPEATS BYTES...\n", argv[0]);
        MPI_Finalize();
        return 2;
    }
    int warmup = atoi(argv[1]);
    int repeats = atoi(argv[2]);
    for (int a = 3; a < argc; a++) {
        long bytes = atol(argv[a]);
        long count = bytes / 4;
        if (count < 1) count = 1;
        float *buf = malloc(count * sizeof(float));
        float *out = malloc(count * sizeof(float));
        double *times = malloc((repeats > 0 ? repeats : 1) * sizeof(double));
        if (!buf || !out || !times) {
            fprintf(stderr, "rank %d: out of memory for %ld bytes\n", rank, bytes);
            MPI_Abort(MPI_COMM_WORLD, 1);
        }
        for (long i = 0; i < count; i++) buf[i] = 1.0f;
        for (int w = 0; w < (warmup > 0 ? warmup : 1); w++) {
            MPI_Allreduce(buf, out, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            if (w == 0 && (out[0] != (float)size || out[count - 1] != (float)size)) {
                fprintf(stderr, "rank %d: wrong MPI_Allreduce result %f (expected %d)\n", rank,
                        out[0], size);
                MPI_Abort(MPI_COMM_WORLD, 1);
            }
        }
        for (int r = 0; r < repeats; r++) {
            MPI_Barrier(MPI_COMM_WORLD);
            double t = MPI_Wtime();
            MPI_Allreduce(buf, out, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            double mine = MPI_Wtime() - t, slowest = 0;
            MPI_Reduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
            times[r] = slowest;
        }
        if (rank == 0) {
            printf("{\"bytes\": %ld, \"seconds\": [", count * 4);
            for (int r = 0; r < repeats; r++) printf("%s%.9g", r ? ", " : "", times[r]);
            printf("]}\n");
            fflush(stdout);
        }
        free(buf);
        free(out);
        free(times);
    }
    MPI_Finalize();
    return 0;
}
