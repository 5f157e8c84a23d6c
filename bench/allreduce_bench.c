/* allreduce_bench.c - the gradient sum of data-parallel training over MPI_COMM_WORLD: latency and bandwidth of
 * dist_sum_floats (trainer/dist.c, the code a training step runs) on mpi/dist_mpi.c's backend.
 *
 *   mpirun -np 2 build/bench/allreduce_bench [--size LABEL=FLOATS]... [--no-sweep] [--seconds S] [--warmup N]
 *
 * Sizes: 16 floats ("tiny": a step's doubles are as small), each --size (bench/mpi_bench.sh passes the
 * reference configs' trainable value counts), and unless --no-sweep a sweep of 1 KB to 16 MB in powers of two.
 * For each size: --warmup untimed sums, then as many timed sums as fit in --seconds (at least 5). Every timed
 * sum starts after a barrier, from the same values (copied in untimed, as a step copies its gradients in
 * before the sum), and its time is the slowest rank's. Rank 0 prints one line per size (bench/README.md):
 *
 *   bench:allreduce label:L world:W floats:N bytes:B sent_bytes:S reps:R latency_us:MEDIAN latency_us_min:MIN
 *                   mb_per_s:BW
 *
 * sent_bytes is dist_sum_bytes_sent (what each rank sends); mb_per_s = sent_bytes / median time (10^6 bytes/s).
 * Exits non-zero only on an error (a bad argument, memory, MPI, a wrong sum), never because a result is slow. */
#include <errno.h>
#include <mpi.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "mpi/dist_mpi.h"
#include "trainer/dist.h"

#define MAX_SIZES 64
#define TINY_FLOATS 16
#define SWEEP_MIN_BYTES ((size_t)1 << 10)
#define SWEEP_MAX_BYTES ((size_t)16 << 20)
#define MIN_REPS 5
#define MAX_REPS 5000

typedef struct {
    char label[64];
    size_t n; /* floats */
} Size;

typedef struct {
    Size sizes[MAX_SIZES];
    int n_sizes, warmup;
    double seconds;
} Args;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void usage(FILE *out) {
    fprintf(out, "usage: mpirun -np N allreduce_bench [--size LABEL=FLOATS]... [--no-sweep] [--seconds S] "
                 "[--warmup N]\ndefaults: --seconds 0.25 (per size) --warmup 5; sizes: tiny (16 floats), each "
                 "--size, then 1 KB..16 MB\n");
}

static bool add_size(Args *a, const char *label, size_t n) {
    if (a->n_sizes == MAX_SIZES) return false;
    Size *s = &a->sizes[a->n_sizes++];
    snprintf(s->label, sizeof s->label, "%s", label);
    s->n = n;
    return true;
}

/* LABEL=FLOATS, FLOATS in [1, 2^28] (1 GB of floats). */
static bool parse_size(Args *a, const char *v) {
    const char *eq = strchr(v, '=');
    if (!eq || eq == v || (size_t)(eq - v) >= sizeof a->sizes[0].label) return false;
    for (const char *p = v; p < eq; p++)
        if (*p == ' ' || *p == ':') return false; /* the label is one greppable token */
    char *end;
    errno = 0;
    unsigned long long n = strtoull(eq + 1, &end, 10);
    if (errno || end == eq + 1 || *end || n < 1 || n > (1ull << 28)) return false;
    char label[64];
    snprintf(label, sizeof label, "%.*s", (int)(eq - v), v);
    return add_size(a, label, (size_t)n);
}

/* Returns 0 to run, 1 to exit successfully (--help), -1 on a bad argument. Rank 0 alone (loud) prints. */
static int parse_args(int argc, char **argv, Args *a, bool loud) {
    *a = (Args){.warmup = 5, .seconds = 0.25};
    add_size(a, "tiny", TINY_FLOATS);
    bool sweep = true;
    for (int i = 1; i < argc; i++) {
        const char *opt = argv[i], *val = i + 1 < argc ? argv[i + 1] : NULL;
        bool ok = true, takes_value = true;
        char *end;
        if (!strcmp(opt, "--help") || !strcmp(opt, "-h")) {
            if (loud) usage(stdout);
            return 1;
        } else if (!strcmp(opt, "--no-sweep")) {
            sweep = false, takes_value = false;
        } else if (!val) {
            ok = false;
        } else if (!strcmp(opt, "--size")) {
            ok = parse_size(a, val);
        } else if (!strcmp(opt, "--seconds")) {
            errno = 0;
            a->seconds = strtod(val, &end);
            ok = !errno && end != val && !*end && a->seconds > 0.0 && a->seconds <= 600.0;
        } else if (!strcmp(opt, "--warmup")) {
            errno = 0;
            long w = strtol(val, &end, 10);
            ok = !errno && end != val && !*end && w >= 1 && w <= 1000;
            a->warmup = (int)w;
        } else {
            ok = false;
        }
        if (!ok) {
            if (loud) {
                fprintf(stderr, "allreduce_bench: bad or incomplete option '%s%s%s'%s\n", opt,
                        val && takes_value ? " " : "", val && takes_value ? val : "",
                        !strcmp(opt, "--size") && a->n_sizes == MAX_SIZES ? " (too many sizes)" : "");
                usage(stderr);
            }
            return -1;
        }
        i += takes_value;
    }
    for (size_t b = SWEEP_MIN_BYTES; sweep && b <= SWEEP_MAX_BYTES; b *= 2)
        if (!add_size(a, "sweep", b / sizeof(float))) {
            if (loud) fprintf(stderr, "allreduce_bench: too many sizes (at most %d with the sweep)\n", MAX_SIZES);
            return -1;
        }
    return 0;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Rank r's values: exact in float, and their sum over ranks in any order too, so the check below is exact. */
static void fill_src(float *src, size_t n, int rank) {
    for (size_t i = 0; i < n; i++) src[i] = 0.5f * (float)((i % 97) + (size_t)rank);
}

/* One size: warm-up (the first sum checked against the known total), the repetition count from the warm-up's
 * pace (rank 0's, broadcast), then the timed sums. Returns 0, or -1 after an error (message printed). */
static int bench_size(Dist *d, const Args *a, const Size *s, float *src, float *buf, float *work, double *times,
                      double *slowest) {
    QtError err = {0};
    fill_src(src, s->n, d->rank);
    double t_warm = 0.0;
    for (int w = 0; w < a->warmup; w++) {
        memcpy(buf, src, s->n * sizeof *buf);
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = now_s();
        if (dist_sum_floats(d, buf, s->n, work, &err) != QT_OK) {
            fprintf(stderr, "allreduce_bench: rank %d, %s of %zu floats: %s\n", d->rank, s->label, s->n, err.msg);
            return -1;
        }
        if (w > 0 || a->warmup == 1) t_warm += now_s() - t0; /* the first one faults the pages in */
        if (w > 0) continue;
        for (size_t i = 0; i < s->n; i++) {
            float want = 0.0f;
            for (int r = 0; r < d->world; r++) want += 0.5f * (float)((i % 97) + (size_t)r);
            if (buf[i] != want) {
                fprintf(stderr, "allreduce_bench: rank %d, %s of %zu floats: element %zu is %g after the sum, not "
                        "%g: the backend moved the wrong bytes\n", d->rank, s->label, s->n, i, buf[i], want);
                return -1;
            }
        }
    }
    int reps = MIN_REPS;
    if (d->rank == 0) {
        double per = t_warm / (a->warmup > 1 ? a->warmup - 1 : 1);
        double r = per > 0 ? a->seconds / per : MAX_REPS;
        reps = r < MIN_REPS ? MIN_REPS : r > MAX_REPS ? MAX_REPS : (int)r;
    }
    MPI_Bcast(&reps, 1, MPI_INT, 0, MPI_COMM_WORLD);
    for (int k = 0; k < reps; k++) {
        memcpy(buf, src, s->n * sizeof *buf);
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = now_s();
        if (dist_sum_floats(d, buf, s->n, work, &err) != QT_OK) {
            fprintf(stderr, "allreduce_bench: rank %d, %s of %zu floats: %s\n", d->rank, s->label, s->n, err.msg);
            return -1;
        }
        times[k] = now_s() - t0;
    }
    /* a sum ends for the job when its slowest rank has it */
    MPI_Reduce(times, slowest, reps, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    if (d->rank != 0) return 0;
    qsort(slowest, (size_t)reps, sizeof *slowest, cmp_double);
    double median = reps % 2 ? slowest[reps / 2] : 0.5 * (slowest[reps / 2 - 1] + slowest[reps / 2]);
    uint64_t sent = dist_sum_bytes_sent(d, s->n);
    printf("bench:allreduce label:%s world:%d floats:%zu bytes:%zu sent_bytes:%llu reps:%d latency_us:%.1f "
           "latency_us_min:%.1f mb_per_s:%.1f\n", s->label, d->world, s->n, s->n * sizeof(float),
           (unsigned long long)sent, reps, 1e6 * median, 1e6 * slowest[0], median > 0 ? sent / median / 1e6 : 0.0);
    fflush(stdout);
    return 0;
}

int main(int argc, char **argv) {
    Dist d;
    QtError err = {0};
    if (dist_mpi_start(&argc, &argv, &d, &err) != QT_OK) {
        fprintf(stderr, "allreduce_bench: %s\n", err.msg);
        return 1;
    }
    Args a;
    int pr = parse_args(argc, argv, &a, d.rank == 0);
    if (pr != 0) {
        dist_mpi_stop();
        return pr > 0 ? 0 : 2;
    }
    if (d.world < 2 && d.rank == 0)
        printf("note: 1 rank: dist_sum_floats does nothing; run under mpirun -np 2 or more\n");
    size_t max_n = 0, max_work = 0;
    for (int i = 0; i < a.n_sizes; i++) {
        max_n = a.sizes[i].n > max_n ? a.sizes[i].n : max_n;
        size_t w = dist_sum_work_floats(&d, a.sizes[i].n);
        max_work = w > max_work ? w : max_work;
    }
    float *src = malloc(max_n * sizeof *src), *buf = malloc(max_n * sizeof *buf);
    float *work = malloc((max_work ? max_work : 1) * sizeof *work);
    double *times = malloc(MAX_REPS * sizeof *times), *slowest = malloc(MAX_REPS * sizeof *slowest);
    int rc = 0;
    if (!src || !buf || !work || !times || !slowest) {
        fprintf(stderr, "allreduce_bench: rank %d: out of memory for %zu floats\n", d.rank, 2 * max_n + max_work);
        rc = 1;
    }
    if (d.rank == 0 && rc == 0) {
        char version[MPI_MAX_LIBRARY_VERSION_STRING] = "";
        int len = 0;
        MPI_Get_library_version(version, &len);
        version[strcspn(version, ",\n")] = '\0';
        for (char *p = version; *p; p++)
            if (*p == ' ') *p = '_';
        printf("bench:allreduce_env world:%d backend:%s mpi:%s warmup:%d seconds_per_size:%.2f\n", d.world,
               d.ops ? d.ops->name : "none", version, a.warmup, a.seconds);
        fflush(stdout);
    }
    for (int i = 0; i < a.n_sizes && rc == 0; i++)
        if (bench_size(&d, &a, &a.sizes[i], src, buf, work, times, slowest) != 0) rc = 1;
    free(src), free(buf), free(work), free(times), free(slowest);
    if (rc != 0) dist_abort(&d, rc); /* the other ranks may be waiting in a collective */
    dist_mpi_stop();
    return rc;
}
