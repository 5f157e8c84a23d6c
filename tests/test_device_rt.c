/* test_device_rt.c - device/qtrain_rt.c, the integer runtime of `qtrain export --format c`: its rounding and
 * clamping, every kernel against an int64 reference on thousands of random cases (tests/device/rt_cases.h), and
 * the same outputs, bit for bit, from every build there is: this library's, the portable and the AVX2 host
 * builds, aarch64 and armhf NEON under qemu (tests/device/rt_check.c), and a Cortex-M4 compile. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "test_util.h"
#include "tests/device/rt_cases.h"

/* Random cases per kernel in the in-process run (the cross builds run RTC_CHECK_CASES). */
#define RANDOM_CASES 3000

/* The strict flags the export's program is built with (the device compilers add theirs). */
#define STRICT_FLAGS "-std=c99 -O2 -Wall -Wextra -Werror -pedantic"

/* Runs cmd with sh, its stdout and stderr into log; returns the exit status, -1 if it did not exit. */
static int run_shell(const char *cmd, const char *log) {
    size_t cap = strlen(cmd) + strlen(log) + 32;
    char *full = malloc(cap);
    CU_ASSERT_PTR_NOT_NULL_FATAL(full);
    snprintf(full, cap, "( %s ) >'%s' 2>&1", cmd, log);
    fflush(NULL);
    int st = system(full);
    free(full);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* The first of the space-separated programs that is not on PATH, NULL if all are. */
static const char *missing_tool(const char *tools) {
    static char name[64]; /* the tests run on one thread */
    const char *p = tools;
    while (*p) {
        size_t n = strcspn(p, " ");
        char cmd[160];
        snprintf(name, sizeof name, "%.*s", (int)n, p);
        snprintf(cmd, sizeof cmd, "command -v '%s'", name);
        if (run_shell(cmd, "/dev/null") != 0) return name;
        p += n;
        while (*p == ' ') p++;
    }
    return NULL;
}

static void show_log(const char *what, const char *log) {
    char *text = test_file_read(log, NULL);
    fprintf(stderr, "\n  %s:\n%s\n", what, text ? text : "(no output)");
    free(text);
}

/* ---- rounding and clamping ------------------------------------------------------------------------------- */

/* qrt_rshift_round is floor((v + 2^(n-1)) / 2^n): half up, so -2.5 is -2 and 2.5 is 3; checked on fixed values
 * and, for every n in [1, 62], on the values next to each tie and at the ends of the range the runtime uses
 * (|acc * mult| < 2^62), against the division in rt_cases.h. */
static void test_rshift_round(void) {
    static const struct {
        int64_t v;
        int n;
        int64_t want;
    } fixed[] = {
        {5, 1, 3},   {-5, 1, -2},  {3, 1, 2},    {-3, 1, -1},   {-1, 1, 0},   {1, 1, 1},     {0, 1, 0},
        {-6, 2, -1}, {-7, 2, -2},  {-2, 2, 0},   {-10, 2, -2},  {6, 2, 2},    {-4, 3, 0},    {-12, 3, -1},
        {-13, 3, -2}, {(int64_t)1 << 61, 62, 1}, {-((int64_t)3 << 61), 62, -1}, {-((int64_t)1 << 61), 62, 0},
        {((int64_t)1 << 62) - 1, 62, 1}, {-((int64_t)1 << 62), 62, -1},
        {-((int64_t)1 << 62) - ((int64_t)1 << 61), 62, -1},
        {(int64_t)INT32_MAX * INT32_MAX, 31, INT32_MAX - 1}, {-(int64_t)INT32_MAX * INT32_MAX, 31, -(INT32_MAX - 1)},
    };
    for (size_t i = 0; i < sizeof fixed / sizeof fixed[0]; i++) {
        int64_t got = qrt_rshift_round(fixed[i].v, fixed[i].n);
        if (got != fixed[i].want)
            fprintf(stderr, "\n  qrt_rshift_round(%lld, %d) = %lld, want %lld\n", (long long)fixed[i].v, fixed[i].n,
                    (long long)got, (long long)fixed[i].want);
        CU_ASSERT_EQUAL(got, fixed[i].want);
        CU_ASSERT_EQUAL(rtc_ref_rshift(fixed[i].v, fixed[i].n), fixed[i].want);
    }
    long bad = 0;
    RtcRng r = {42};
    for (int n = 1; n <= 62; n++) {
        static const int64_t ties[] = {0, 1, -1, 3, -3, 5, -5, 12345, -777}; /* times 2^(n-1) */
        int64_t h = (int64_t)1 << (n - 1), lim = ((int64_t)1 << 62) - 1;
        int64_t base[sizeof ties / sizeof ties[0] + 4] = {lim, -lim, lim - h, -lim + h};
        size_t nb = 4;
        for (size_t t = 0; t < sizeof ties / sizeof ties[0]; t++)
            if (h <= lim / (ties[t] < 0 ? -ties[t] : ties[t] ? ties[t] : 1)) base[nb++] = ties[t] * h;
        for (size_t b = 0; b < nb; b++)
            for (int d = -2; d <= 2; d++) {
                int64_t v = base[b] + d;
                if (v > lim || v < -lim) continue;
                bad += qrt_rshift_round(v, n) != rtc_ref_rshift(v, n);
            }
        for (int i = 0; i < 200; i++) {
            int64_t v = (int64_t)(rtc_next(&r) % ((uint64_t)1 << 63)) - ((int64_t)1 << 62);
            bad += qrt_rshift_round(v, n) != rtc_ref_rshift(v, n);
        }
    }
    CU_ASSERT_EQUAL(bad, 0);
}

/* qrt_requant adds the zero point after rounding and clamps in int64: values far outside int32 (a shift of 1
 * on acc * mult near 2^62) clamp instead of wrapping. */
static void test_requant_clamp(void) {
    CU_ASSERT_EQUAL(qrt_requant(-3, 1, 0, -128, 127), -1);
    CU_ASSERT_EQUAL(qrt_requant(-3, 1, 10, -128, 127), 9);
    CU_ASSERT_EQUAL(qrt_requant(-5, 1, -3, -128, 127), -5);
    CU_ASSERT_EQUAL(qrt_requant(-5, 1, -3, -4, 127), -4);      /* -5 clamps to act_min */
    CU_ASSERT_EQUAL(qrt_requant(255, 1, 0, -128, 127), 127);   /* 127.5 rounds up to 128, clamps to 127 */
    CU_ASSERT_EQUAL(qrt_requant(-257, 1, 0, -128, 127), -128); /* -128.5 rounds to -128 */
    CU_ASSERT_EQUAL(qrt_requant(-259, 1, 0, -128, 127), -128); /* -129.5 rounds to -129, clamps */
    CU_ASSERT_EQUAL(qrt_requant((int64_t)1 << 61, 1, -128, -128, 127), 127);
    CU_ASSERT_EQUAL(qrt_requant(-((int64_t)1 << 61), 1, 127, -128, 127), -128);
    CU_ASSERT_EQUAL(qrt_requant(((int64_t)1 << 32) + 5 * 2, 1, 0, -128, 127), 127); /* 2^31 + 5 wraps to < 0 in int32 */
    CU_ASSERT_EQUAL(qrt_requant(-((int64_t)1 << 33), 1, 0, -128, 127), -128);
    CU_ASSERT_EQUAL(qrt_requant(((int64_t)1 << 62) - 1, 62, 5, -128, 127), 6);
    CU_ASSERT_EQUAL(qrt_requant(-((int64_t)1 << 61), 62, 5, -128, 127), 5);      /* -0.5 rounds up to 0 */
    CU_ASSERT_EQUAL(qrt_requant(-((int64_t)1 << 61) - 1, 62, 5, -128, 127), 4);
    CU_ASSERT_EQUAL(qrt_requant(7, 1, 0, 3, 3), 3);
}

/* ---- the kernels against the reference ------------------------------------------------------------------- */

/* The kernels round half up too: a dense layer whose accumulators are its biases -4 .. 3, multiplier 1, shift 1
 * (-2, -1.5, -1, -0.5, 0, 0.5, 1, 1.5), and a depthwise conv of the same values on 16 pixels. */
static void test_kernels_round_half_up(void) {
    static const int8_t want[8] = {-2, -1, -1, 0, 0, 1, 1, 2}, ones[16] = {1, 1, 1, 1, 1, 1, 1, 1};
    int32_t bias[8], mult[8];
    int8_t shift[8], y[16], x = 0, xs[16];
    for (int i = 0; i < 8; i++) bias[i] = i - 4, mult[i] = 1, shift[i] = 1;
    qrt_dense_t d;
    memset(&d, 0, sizeof d);
    d.in = 1, d.out = 8, d.w_bits = 8, d.weight = ones, d.bias = bias, d.mult = mult, d.shift = shift;
    d.act_min = -128, d.act_max = 127;
    qrt_dense(&d, &x, y);
    CU_ASSERT_EQUAL(memcmp(y, want, 8), 0);
    qrt_conv2d_t p;
    memset(&p, 0, sizeof p);
    p.in_c = p.out_c = p.groups = 1, p.in_h = p.out_h = 1, p.in_w = p.out_w = 16;
    p.k_h = p.k_w = p.stride_h = p.stride_w = p.dil_h = p.dil_w = 1, p.w_bits = 8;
    p.weight = ones, p.bias = &bias[4], p.mult = mult, p.shift = shift, p.act_min = -128, p.act_max = 127;
    for (int i = 0; i < 16; i++) xs[i] = (int8_t)(i % 8 - 4);
    unsigned char scratch[1024];
    CU_ASSERT_FATAL(qrt_conv2d_scratch(&p) <= sizeof scratch);
    qrt_conv2d(&p, xs, y, scratch);
    CU_ASSERT_EQUAL(memcmp(y, want, 8), 0);
    CU_ASSERT_EQUAL(memcmp(y + 8, want, 8), 0);
}

/* RANDOM_CASES of each kernel (conv2d with groups, depthwise, multipliers, strides, padding and dilation per axis,
 * int4 and int8 weights; dense; max, average and global average pools; add, requant_n, relu in and out of place;
 * input tables) on this build of the runtime against the int64 reference, guard bytes after every output. */
static void test_kernels_random(void) {
    RtcResult res;
    rtc_run(0x1234abcdULL, RANDOM_CASES, &res);
    if (res.mismatches) fprintf(stderr, "\n  %ld values differ; %s\n", res.mismatches, res.first);
    CU_ASSERT_EQUAL(res.cases, 4L * RANDOM_CASES + 3); /* and rtc_case_ties' three */
    CU_ASSERT_EQUAL(res.mismatches, 0);
}

/* The shapes of a small CNN: a 3x3 conv 32 -> 64 padding 1 on 14x14, 16 -> 32 on 28x28 (several im2col tiles),
 * depthwise 64 channels (stride 1 and 2), 1 -> 16 on 28x28, dense 3136 -> 128: the paths the random cases reach
 * only with small sizes. */
static void test_kernels_cnn_shapes(void) {
    static const int shapes[][8] = {
        /* in_c, h, out_c, groups, stride, w_bits, dil */
        {32, 14, 64, 1, 1, 8, 1, 0}, {16, 28, 32, 1, 1, 4, 1, 0}, {64, 14, 64, 64, 1, 8, 1, 0},
        {64, 28, 64, 64, 2, 8, 1, 0}, {1, 28, 16, 1, 1, 8, 1, 0},  {64, 7, 64, 1, 1, 8, 2, 0},
        {32, 14, 64, 4, 2, 4, 1, 0},
    };
    RtcRng r = {7};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        qrt_conv2d_t p;
        memset(&p, 0, sizeof p);
        p.in_c = shapes[s][0], p.in_h = p.in_w = shapes[s][1], p.out_c = shapes[s][2], p.groups = shapes[s][3];
        p.k_h = p.k_w = 3, p.stride_h = p.stride_w = shapes[s][4], p.w_bits = shapes[s][5];
        p.dil_h = p.dil_w = shapes[s][6], p.pad_t = p.pad_l = shapes[s][6];
        p.out_h = p.out_w = (p.in_h + 2 * p.pad_t - 2 * p.dil_h - 1) / p.stride_h + 1;
        p.in_zp = -3, p.out_zp = -128, p.act_min = -128, p.act_max = 127;
        size_t k = (size_t)(p.in_c / p.groups) * 9, nx = (size_t)p.in_c * p.in_h * p.in_w;
        size_t ny = (size_t)p.out_c * p.out_h * p.out_w;
        int8_t *x = malloc(nx), *y = malloc(ny), *want = malloc(ny), *shift = malloc((size_t)p.out_c);
        int32_t *bias = malloc(sizeof(int32_t) * p.out_c), *mult = malloc(sizeof(int32_t) * p.out_c);
        void *w = rtc_weights(&r, p.w_bits, (size_t)p.out_c * k), *scratch = malloc(qrt_conv2d_scratch(&p));
        CU_ASSERT_FATAL(x && y && want && shift && bias && mult && scratch);
        rtc_fill(&r, x, nx);
        for (int o = 0; o < p.out_c; o++)
            bias[o] = (int32_t)rtc_int(&r, -5000, 5000), mult[o] = 1500000000, shift[o] = (int8_t)(36 + o % 3);
        p.weight = w, p.bias = bias, p.mult = mult, p.shift = shift;
        qrt_conv2d(&p, x, y, scratch);
        rtc_ref_conv2d(&p, x, want);
        long bad = 0, distinct = 0;
        for (size_t i = 0; i < ny; i++) bad += y[i] != want[i], distinct += i && want[i] != want[i - 1];
        if (bad) fprintf(stderr, "\n  shape %zu: %ld of %zu differ\n", s, bad, ny);
        CU_ASSERT_EQUAL(bad, 0);
        CU_ASSERT(distinct > (long)ny / 4); /* outputs that say something, not all clamped */
        free(x), free(y), free(want), free(shift), free(bias), free(mult), free(w), free(scratch);
    }
    qrt_dense_t d;
    memset(&d, 0, sizeof d);
    d.in = 3136, d.out = 128, d.w_bits = 8, d.in_zp = -128, d.out_zp = 0, d.act_min = 0, d.act_max = 127;
    int8_t *x = malloc((size_t)d.in), y[128], want[128], shift[128];
    int32_t bias[128], mult[128];
    void *w = rtc_weights(&r, 8, (size_t)d.in * d.out);
    CU_ASSERT_FATAL(x && w);
    rtc_fill(&r, x, (size_t)d.in);
    for (int o = 0; o < d.out; o++) bias[o] = o * 1000 - 64000, mult[o] = 1 << 30, shift[o] = 45;
    d.weight = w, d.bias = bias, d.mult = mult, d.shift = shift;
    qrt_dense(&d, x, y);
    rtc_ref_dense(&d, x, want);
    CU_ASSERT_EQUAL(memcmp(y, want, sizeof y), 0);
    free(x), free(w);
}

/* ---- builds ---------------------------------------------------------------------------------------------- */

/* The runtime's #include lines are qtrain_rt.h, <stdint.h>, <stddef.h>, <string.h> and the intrinsics headers. */
static void test_includes(void) {
    char *text = test_file_read("device/qtrain_rt.c", NULL);
    CU_ASSERT_PTR_NOT_NULL_FATAL(text);
    static const char *const allowed[] = {"\"qtrain_rt.h\"", "<stdint.h>", "<stddef.h>", "<string.h>",
                                          "<immintrin.h>", "<arm_neon.h>"};
    int n = 0;
    for (const char *p = strstr(text, "#include"); p; p = strstr(p + 1, "#include")) {
        const char *h = p + strlen("#include");
        while (*h == ' ') h++;
        int ok = 0;
        for (size_t i = 0; i < sizeof allowed / sizeof allowed[0]; i++)
            ok |= strncmp(h, allowed[i], strlen(allowed[i])) == 0;
        if (!ok) fprintf(stderr, "\n  device/qtrain_rt.c includes %.30s\n", h);
        CU_ASSERT(ok);
        n++;
    }
    CU_ASSERT(n >= 4);
    CU_ASSERT(strstr(text, "malloc") == NULL && strstr(text, "free(") == NULL); /* as the export's check greps */
    free(text);
    const char *simd = qrt_simd();
    CU_ASSERT(!strcmp(simd, "portable") || !strcmp(simd, "avx2") || !strcmp(simd, "neon"));
}

/* device/qtrain_rt.c compiles without a warning as strict C99 (-Wall -Wextra -pedantic -Werror) with gcc and
 * clang on each path, and for a Cortex-M4 (compile only: nothing runs it here). */
static void test_strict_compiles(void) {
    static const struct {
        const char *label, *cc, *flags, *deb;
    } builds[] = {
        {"gcc portable", "gcc", "-DQRT_PORTABLE", "gcc"},
        {"gcc AVX2", "gcc", "-mavx2", "gcc"},
        {"clang portable", "clang", "-DQRT_PORTABLE", "clang"},
        {"clang AVX2", "clang", "-mavx2", "clang"},
        {"aarch64 NEON", "aarch64-linux-gnu-gcc", "", "gcc-aarch64-linux-gnu"},
        {"aarch64 NEON + dotprod", "aarch64-linux-gnu-gcc", "-march=armv8.2-a+dotprod", "gcc-aarch64-linux-gnu"},
        {"gcc AVX2 + AVX-VNNI", "gcc", "-mavx2 -mavxvnni", "gcc"},
        {"armhf NEON", "arm-linux-gnueabihf-gcc", "-mfpu=neon -mfloat-abi=hard", "gcc-arm-linux-gnueabihf"},
        {"Cortex-M4", "arm-none-eabi-gcc", "-mcpu=cortex-m4 -mthumb -Os", "gcc-arm-none-eabi libnewlib-arm-none-eabi"},
    };
    char *dir = test_tmpdir_new(), cmd[1024], log[600];
    snprintf(log, sizeof log, "%s/cc.log", dir);
    for (size_t i = 0; i < sizeof builds / sizeof builds[0]; i++) {
        if (missing_tool(builds[i].cc)) {
            test_skip("%s: %s is not installed (Debian: %s)", builds[i].label, builds[i].cc, builds[i].deb);
            continue;
        }
        snprintf(cmd, sizeof cmd, "%s " STRICT_FLAGS " %s -c device/qtrain_rt.c -o %s/rt.o", builds[i].cc,
                 builds[i].flags, dir);
        int code = run_shell(cmd, log);
        if (code != 0) show_log(cmd, log);
        CU_ASSERT_EQUAL(code, 0);
    }
    test_tmpdir_remove(dir);
}

/* Whether /proc/cpuinfo's flags list flag. */
static bool cpu_has_flag(const char *flag) {
    char *text = test_file_read("/proc/cpuinfo", NULL), pat[64];
    snprintf(pat, sizeof pat, " %s", flag);
    bool found = false;
    for (const char *p = text ? strstr(text, pat) : NULL; p && !found; p = strstr(p + 1, pat))
        found = p[strlen(pat)] == ' ' || p[strlen(pat)] == '\n';
    free(text);
    return found;
}

/* rt_check's fixed set gives no mismatch and the same hash of every output in each build that can run here
 * as in this library's build: host portable and AVX2 (gcc, clang, and gcc with AVX-VNNI's dot products),
 * aarch64 (with and without the dotprod extension) and armhf NEON static binaries under qemu. A missing
 * compiler, qemu or CPU feature is a skip that names it. */
static void test_cross_builds_agree(void) {
    static const struct {
        const char *label, *cc, *flags, *runner, *simd, *deb;
        int need_avx2; /* 1: AVX2, 2: AVX2 and AVX-VNNI */
    } builds[] = {
        {"host portable", "cc", "-DQRT_PORTABLE", "", "portable", "gcc", 0},
        {"host AVX2", "cc", "-mavx2", "", "avx2", "gcc", 1},
        {"clang AVX2", "clang", "-mavx2", "", "avx2", "clang", 1},
        {"host AVX2 + AVX-VNNI", "cc", "-mavx2 -mavxvnni", "", "avx2", "gcc", 2},
        {"aarch64 NEON", "aarch64-linux-gnu-gcc", "-static", "qemu-aarch64", "neon", "gcc-aarch64-linux-gnu qemu-user",
         0},
        {"aarch64 NEON + dotprod", "aarch64-linux-gnu-gcc", "-static -march=armv8.2-a+dotprod", "qemu-aarch64", "neon",
         "gcc-aarch64-linux-gnu qemu-user", 0},
        {"armhf NEON", "arm-linux-gnueabihf-gcc", "-static -mfpu=neon -mfloat-abi=hard", "qemu-arm", "neon",
         "gcc-arm-linux-gnueabihf qemu-user", 0},
    };
    RtcResult mine;
    rtc_run(RTC_CHECK_SEED, RTC_CHECK_CASES, &mine);
    CU_ASSERT_EQUAL(mine.mismatches, 0);
    char *dir = test_tmpdir_new(), cmd[1400], log[600];
    int ran = 0;
    for (size_t i = 0; i < sizeof builds / sizeof builds[0]; i++) {
        char tools[160];
        snprintf(tools, sizeof tools, "%s %s", builds[i].cc, builds[i].runner);
        const char *missing = missing_tool(tools);
        if (missing) {
            test_skip("%s: %s is not installed (Debian: %s)", builds[i].label, missing, builds[i].deb);
            continue;
        }
#if defined(__x86_64__) || defined(__i386__)
        if (builds[i].need_avx2 && !__builtin_cpu_supports("avx2")) {
            test_skip("%s: this CPU has no AVX2", builds[i].label);
            continue;
        }
        if (builds[i].need_avx2 == 2 && !cpu_has_flag("avx_vnni")) {
            test_skip("%s: this CPU has no AVX-VNNI (avx_vnni in /proc/cpuinfo)", builds[i].label);
            continue;
        }
#else
        if (builds[i].need_avx2) {
            test_skip("%s: not an x86 host", builds[i].label);
            continue;
        }
#endif
        snprintf(log, sizeof log, "%s/build%zu.log", dir, i);
        snprintf(cmd, sizeof cmd,
                 "%s " STRICT_FLAGS " %s -I. tests/device/rt_check.c device/qtrain_rt.c -o %s/rt_check%zu && "
                 "%s %s/rt_check%zu",
                 builds[i].cc, builds[i].flags, dir, i, builds[i].runner, dir, i);
        int code = run_shell(cmd, log);
        char *text = test_file_read(log, NULL), simd[32] = "";
        const char *line = text ? strstr(text, "rt_check: simd=") : NULL;
        long cases = -1, mismatches = -1;
        unsigned long long hash = 0;
        int fields = line ? sscanf(line, "rt_check: simd=%31s cases=%ld mismatches=%ld hash=%llx", simd, &cases,
                                   &mismatches, &hash)
                          : 0;
        int ok = code == 0 && fields == 4 && !strcmp(simd, builds[i].simd) && cases == mine.cases && mismatches == 0 &&
                 hash == mine.hash;
        if (!ok) {
            fprintf(stderr, "\n  %s: want simd=%s cases=%ld mismatches=0 hash=%016llx\n", builds[i].label,
                    builds[i].simd, mine.cases, (unsigned long long)mine.hash);
            show_log(cmd, log);
        }
        CU_ASSERT(ok);
        ran++;
        free(text);
    }
    CU_ASSERT(ran >= 1);
    test_tmpdir_remove(dir);
}

int register_device_rt_suite(void) {
    CU_pSuite s = CU_add_suite("device_rt", NULL, NULL);
    return !s || !CU_add_test(s, "qrt_rshift_round rounds half up, also at shift 1 and 62", test_rshift_round) ||
           !CU_add_test(s, "qrt_requant adds the zero point and clamps in int64", test_requant_clamp) ||
           !CU_add_test(s, "the kernels round half up, negative ties too", test_kernels_round_half_up) ||
           !CU_add_test(s, "every kernel matches the int64 reference on random cases", test_kernels_random) ||
           !CU_add_test(s, "conv2d and dense on a small CNN's shapes", test_kernels_cnn_shapes) ||
           !CU_add_test(s, "the runtime includes only its allowed headers", test_includes) ||
           !CU_add_test(s, "the runtime compiles as strict C99 with every compiler", test_strict_compiles) ||
           !CU_add_test(s, "portable, AVX2 and NEON builds write the same bytes", test_cross_builds_agree);
}
