/* export_timing.c - single-threaded speed of a model exported with
 * `qtrain export --format c` (bench/export_bench.sh builds and runs it).
 *
 *   cc -std=c99 -O2 [-DQRT_PORTABLE | -march=native] -I EXPORT_DIR \
 *      -DEXPORT_NAME=cnn -DEXPORT_UPPER=CNN -DEXPORT_HEADER='"cnn.h"' \
 *      bench/export_timing.c EXPORT_DIR/cnn.c EXPORT_DIR/qtrain_rt.c -o export_timing
 *   ./export_timing IMAGES LABELS [--seconds S] [--warmup S] [--min-images N]
 *
 * IMAGES, LABELS: uncompressed IDX files of uint8 (Fashion-MNIST's
 * t10k-images-idx3-ubyte and t10k-labels-idx1-ubyte). NAME_predict runs on
 * the images in file order, cycling through the set: first untimed for
 * --warmup seconds (default 0.3), then timed for --seconds (default 2.5),
 * one clock read per image, and on past --seconds until --min-images
 * images (default 10) were timed. The accuracy is over the distinct images
 * the warm-up and the timed run covered (every image once at most; all of
 * them with --min-images the set's size), a sanity check that the program is
 * the trained model, not a measurement.
 *
 * Prints one line:
 *   export:timing name:cnn simd:avx2 images:N seconds:S images_per_s:X us_per_image:U us_per_image_min:M
 *                 macs:MACS mmac_per_s:Y accuracy:A accuracy_images:K
 * Exit status: 0 on success, 1 on unreadable data, 2 on a bad argument. */
#define _POSIX_C_SOURCE 199309L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifndef EXPORT_NAME
#define EXPORT_NAME cnn
#endif
#ifndef EXPORT_UPPER
#define EXPORT_UPPER CNN
#endif
#ifndef EXPORT_HEADER
#define EXPORT_HEADER "cnn.h"
#endif
#include EXPORT_HEADER
#include "qtrain_rt.h"

/* NAME_predict and the NAME_ macros from the two name parts. */
#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#define STR_(a) #a
#define STR(a) STR_(a)
#define PREDICT CAT(EXPORT_NAME, _predict)
#define INPUT_SIZE CAT(EXPORT_UPPER, _INPUT_SIZE)
#define OUTPUT_SIZE CAT(EXPORT_UPPER, _OUTPUT_SIZE)
#define MACS CAT(EXPORT_UPPER, _MACS)

#if !CAT(EXPORT_UPPER, _HAS_BYTE_INPUT)
#error "the export has no NAME_predict from stored bytes (its input is not an affine map of bytes)"
#endif

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* An IDX file of uint8 (00 00 08 ndim, big-endian dims): its data (*count elements of *size bytes each, the
 * first dim being the count), or NULL with a message. */
static unsigned char *load_idx(const char *path, long *count, long *size) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        perror(path);
        return NULL;
    }
    unsigned char head[4 + 4 * 4];
    long dims[4], n = 1;
    int ndim = 0;
    if (fread(head, 1, 4, f) == 4 && head[0] == 0 && head[1] == 0 && head[2] == 0x08 && head[3] >= 1 && head[3] <= 4) {
        ndim = head[3];
        if (fread(head + 4, 4, (size_t)ndim, f) != (size_t)ndim) ndim = 0;
    }
    if (ndim == 0) {
        fprintf(stderr, "%s: not an IDX file of uint8 (a gunzipped t10k-*-ubyte)\n", path);
        fclose(f);
        return NULL;
    }
    for (int i = 0; i < ndim; i++) {
        const unsigned char *d = head + 4 + 4 * i;
        dims[i] = (long)d[0] << 24 | (long)d[1] << 16 | (long)d[2] << 8 | (long)d[3];
        n *= dims[i];
    }
    unsigned char *b = malloc(n ? (size_t)n : 1);
    if (!b || fread(b, 1, (size_t)n, f) != (size_t)n) {
        fprintf(stderr, "%s: shorter than its IDX header says (%ld bytes)\n", path, n);
        fclose(f);
        free(b);
        return NULL;
    }
    fclose(f);
    *count = dims[0];
    *size = dims[0] ? n / dims[0] : 0;
    return b;
}

static long parse_count(const char *opt, const char *v) {
    char *end;
    long n = v ? strtol(v, &end, 10) : -1;
    if (!v || *end || n < 1 || n > 1000000000L) {
        fprintf(stderr, "export_timing: %s needs an integer in [1, 1e9], got '%s'\n", opt, v ? v : "(nothing)");
        exit(2);
    }
    return n;
}

static double parse_seconds(const char *opt, const char *v) {
    char *end;
    double s = v ? strtod(v, &end) : -1.0;
    if (!v || *end || !(s >= 0.0 && s <= 3600.0)) {
        fprintf(stderr, "export_timing: %s needs seconds in [0, 3600], got '%s'\n", opt, v ? v : "(nothing)");
        exit(2);
    }
    return s;
}

int main(int argc, char **argv) {
    const char *images = NULL, *labels = NULL;
    double seconds = 2.5, warmup = 0.3;
    long min_images = 10;
    for (int k = 1; k < argc; k++) {
        if (strcmp(argv[k], "--seconds") == 0) seconds = parse_seconds(argv[k], argv[k + 1]), k++;
        else if (strcmp(argv[k], "--warmup") == 0) warmup = parse_seconds(argv[k], argv[k + 1]), k++;
        else if (strcmp(argv[k], "--min-images") == 0) min_images = parse_count(argv[k], argv[k + 1]), k++;
        else if (argv[k][0] != '-' && !images) images = argv[k];
        else if (argv[k][0] != '-' && !labels) labels = argv[k];
        else {
            fprintf(stderr, "usage: %s IMAGES LABELS [--seconds S] [--warmup S] [--min-images N]\n", argv[0]);
            return 2;
        }
    }
    if (!labels) {
        fprintf(stderr, "usage: %s IMAGES LABELS [--seconds S] [--warmup S] [--min-images N]\n", argv[0]);
        return 2;
    }
    long n, size, ny, ysize;
    unsigned char *x = load_idx(images, &n, &size), *y = x ? load_idx(labels, &ny, &ysize) : NULL;
    if (!y) return 1;
    if (size != INPUT_SIZE || ny != n || ysize != 1 || n == 0) {
        fprintf(stderr, "export_timing: %s holds %ld examples of %ld bytes and %s %ld labels of %ld; %s wants "
                "examples of %d bytes and one label each\n", images, n, size, labels, ny, ysize, STR(EXPORT_NAME),
                (int)INPUT_SIZE);
        return 1;
    }

    int8_t logits[OUTPUT_SIZE];
    long i = 0, seen = 0, correct = 0;
    /* One inference; counts the accuracy on the first pass through the set. */
#define RUN_ONE()                                                                  \
    do {                                                                           \
        int c = PREDICT(x + (size_t)i * INPUT_SIZE, logits);                       \
        if (seen < n) seen++, correct += c == y[i];                                \
        if (++i == n) i = 0;                                                       \
    } while (0)

    double t0 = now_s(), t = t0;
    long warm = 0;
    while (t - t0 < warmup || warm < 10) {
        RUN_ONE();
        warm++;
        t = now_s();
    }
    long count = 0;
    double best = 1e30, start = now_s(), last = start;
    do {
        RUN_ONE();
        count++;
        t = now_s();
        if (t - last < best) best = t - last;
        last = t;
    } while (t - start < seconds || count < min_images);
    double wall = t - start, per_s = (double)count / wall;
    printf("export:timing name:%s simd:%s images:%ld seconds:%.3f images_per_s:%.1f us_per_image:%.2f "
           "us_per_image_min:%.2f macs:%.0f mmac_per_s:%.1f accuracy:%.4f accuracy_images:%ld\n",
           STR(EXPORT_NAME), qrt_simd(), count, wall, per_s, 1e6 * wall / (double)count, 1e6 * best, (double)MACS,
           (double)MACS * per_s * 1e-6, (double)correct / (double)seen, seen);
    free(x);
    free(y);
    return 0;
}
