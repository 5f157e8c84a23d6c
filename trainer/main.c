/* main.c - the qtrain command line. Only this layer decides to exit:
 * 0 success, 1 runtime failure, 2 usage error. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "trainer/demo.h"
#include "trainer/version.h"

static void usage(FILE *out) {
    fprintf(out,
            "usage: qtrain demo [--steps N] [--batch-size B] [--seed S] [--threads T] [--quiet]\n"
            "       qtrain --help | --version\n"
            "\n"
            "  demo   train a small MLP on a synthetic 3-class spiral problem and report\n"
            "         test accuracy: an end-to-end check of the engine that needs no data.\n"
            "\n"
            "Exit status: 0 success, 1 runtime failure, 2 usage error.\n");
}

/* Parses a positive integer option value; exits 2 on garbage. */
static long parse_positive(const char *opt, const char *value) {
    char *end = NULL;
    long v = value ? strtol(value, &end, 10) : 0;
    if (!value || *end || v < 1) {
        fprintf(stderr, "qtrain: %s needs a positive integer, got '%s'\n", opt, value ? value : "(nothing)");
        exit(2);
    }
    return v;
}

static int cmd_demo(int argc, char **argv) {
    DemoOptions o = demo_options_default();
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--steps") == 0) o.steps = (int)parse_positive(a, v), i++;
        else if (strcmp(a, "--batch-size") == 0) o.batch_size = (int)parse_positive(a, v), i++;
        else if (strcmp(a, "--seed") == 0) o.seed = (unsigned long long)parse_positive(a, v), i++;
        else if (strcmp(a, "--threads") == 0) o.threads = (int)parse_positive(a, v), i++;
        else if (strcmp(a, "--quiet") == 0) o.quiet = true;
        else {
            fprintf(stderr, "qtrain demo: unknown option '%s'\n", a);
            usage(stderr);
            return 2;
        }
    }
    QtError err = {0};
    double acc = 0.0;
    if (demo_run(&o, &acc, &err) != QT_OK) {
        fprintf(stderr, "qtrain: %s\n", err.msg);
        return err.status == QT_ERR_ARG ? 2 : 1;
    }
    if (o.quiet) printf("test_accuracy:%.4f\n", acc);
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    if (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0) {
        usage(stdout);
        return 0;
    }
    if (strcmp(argv[1], "--version") == 0) {
        printf("qtrain %s\n", QTRAIN_VERSION);
        return 0;
    }
    if (strcmp(argv[1], "demo") == 0) return cmd_demo(argc - 2, argv + 2);
    fprintf(stderr, "qtrain: unknown command '%s'\n", argv[1]);
    usage(stderr);
    return 2;
}
