/* test_safetensors.c - the safetensors suite: base/safetensors.c's reader of
 * untrusted .safetensors files and its float32 writer.
 *
 * Round trips through st_write_f32 and st_open (awkward names, metadata,
 * ranks 0-8, empty tensors); F16, BF16 and F64 files built byte by byte
 * with known values; one test per kind of hostile file, each refused by
 * st_open on a file and by st_parse on the same bytes with the same status
 * and message; and a file qtrain writes read by a minimal NumPy reader
 * (skipped, saying why, without /usr/bin/python3 and numpy). */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "base/safetensors.h"
#include "test_util.h"

#define PYTHON "/usr/bin/python3"

static char *tmp_root;

static int st_suite_init(void) {
    tmp_root = test_tmpdir_new();
    return tmp_root ? 0 : -1;
}

static int st_suite_cleanup(void) {
    bool ok = test_tmpdir_remove(tmp_root);
    tmp_root = NULL;
    return ok ? 0 : -1;
}

static uint32_t fbits(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    return u;
}

/* A file in buf[cap]: the 8-byte length of json, json, then data[n_data] (a pattern if data is NULL); its size. */
static size_t build_st(uint8_t *buf, size_t cap, const char *json, const void *data, size_t n_data) {
    size_t h = strlen(json);
    CU_ASSERT_FATAL(8 + h + n_data <= cap);
    for (int k = 0; k < 8; k++) buf[k] = (uint8_t)((uint64_t)h >> (8 * k));
    memcpy(buf + 8, json, h);
    for (size_t i = 0; i < n_data; i++) buf[8 + h + i] = data ? ((const uint8_t *)data)[i] : (uint8_t)(i * 37 + 11);
    return 8 + h + n_data;
}

/* Reads the bytes as file <tmp>/name with st_open and from memory with st_parse: both must give status want
 * and the same message, which (failing) holds the file's path, m1 and m2 unless NULL. On success *out (if
 * given) keeps the open file, to be closed by the caller. */
static void expect_st(const char *name, const uint8_t *buf, size_t n, QtStatus want, const char *m1, const char *m2,
                      StFile *out) {
    char *path = test_path_join(tmp_root, name);
    test_file_write(path, buf, n);
    StFile f, mem;
    QtError err = {0}, merr = {0};
    QtStatus st = st_open(&f, path, &err);
    QtStatus mst = st_parse(&mem, buf, n, n, path, &merr);
    if (st != want) fprintf(stderr, "\n  %s: status %d, want %d: %s\n", name, (int)st, (int)want, err.msg);
    CU_ASSERT_EQUAL(st, want);
    CU_ASSERT_EQUAL(mst, st);
    CU_ASSERT_STRING_EQUAL(merr.msg, err.msg);
    if (want != QT_OK) {
        CU_ASSERT(test_msg_has(&err, path));
        if (m1) CU_ASSERT(test_msg_has(&err, m1));
        if (m2) CU_ASSERT(test_msg_has(&err, m2));
    }
    if (st == QT_OK && mst == QT_OK) {
        CU_ASSERT_EQUAL(f.n, mem.n);
        CU_ASSERT(f.n == mem.n && (f.n == 0 || memcmp(f.tensors, mem.tensors, (size_t)f.n * sizeof *f.tensors) == 0));
        CU_ASSERT_EQUAL(f.data_start, mem.data_start);
    }
    if (mst == QT_OK) st_close(&mem);
    if (st == QT_OK) {
        if (out) *out = f;
        else st_close(&f);
    }
    free(path);
}

/* A hostile header: json then n_data pattern bytes, refused as QT_ERR_FORMAT with m1 and m2 in the message. */
static void bad(const char *name, const char *json, size_t n_data, const char *m1, const char *m2) {
    uint8_t buf[4096];
    size_t n = build_st(buf, sizeof buf, json, NULL, n_data);
    expect_st(name, buf, n, QT_ERR_FORMAT, m1, m2, NULL);
}

/* ---- round trip ------------------------------------------------------------------------------------------------ */

#define N_RT 14

static void test_round_trip(void) {
    static const char *const names[N_RT] = {
        "r0",       "r1", "r2", "r3", "r4", "r5", "r6", "r7", "r8", "say \"hi\"", "back\\slash\\",
        "\xc3\xbcnic\xc3\xb6" "de \xe2\x9c\x93 \xf0\x9d\x84\x9e", "ctl\ttab\nline\x01", "empty.weight"};
    StWrite w[N_RT];
    float *data[N_RT];
    memset(w, 0, sizeof w);
    for (int k = 0; k < N_RT; k++) {
        w[k].name = names[k];
        int r = k <= 8 ? k : k == 13 ? 2 : 1;
        w[k].ndim = r;
        size_t n = 1;
        for (int d = 0; d < r; d++) {
            w[k].shape[d] = k == 13 ? (d == 0 ? 3 : 0) : (d % 3 == 0 ? 2 : 1 + d % 2);
            n *= (size_t)w[k].shape[d];
        }
        data[k] = malloc((n ? n : 1) * sizeof(float));
        for (size_t i = 0; i < n; i++) data[k][i] = (float)i * 0.37f - (float)k + (i == 1 ? -0.0f : 0.0f);
        if (k == 5) data[k][0] = INFINITY, data[k][1] = NAN;
        w[k].data = n ? data[k] : NULL;
    }
    const char *const meta[3][2] = {{"format", "pt"}, {"k\"ey\\", "v\\al\nue \xc3\xa9"}, {"empty", ""}};
    char *path = test_path_join(tmp_root, "rt.safetensors");
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(st_write_f32(path, w, N_RT, meta, 3, &err), QT_OK);
    StFile f;
    QtStatus ost = st_open(&f, path, &err);
    if (ost != QT_OK) fprintf(stderr, "\n  %s\n", err.msg);
    CU_ASSERT_EQUAL_FATAL(ost, QT_OK);
    CU_ASSERT_EQUAL(f.n, N_RT);
    CU_ASSERT_EQUAL(f.data_start % 8, 0);
    CU_ASSERT_EQUAL(f.n_meta, 3);
    CU_ASSERT_STRING_EQUAL(st_meta(&f, "format"), "pt");
    CU_ASSERT_PTR_NOT_NULL(st_meta(&f, "k\"ey\\"));
    if (st_meta(&f, "k\"ey\\")) CU_ASSERT_STRING_EQUAL(st_meta(&f, "k\"ey\\"), "v\\al\nue \xc3\xa9");
    CU_ASSERT_PTR_NOT_NULL(st_meta(&f, "empty"));
    CU_ASSERT_PTR_NULL(st_meta(&f, "none"));
    for (int k = 0; k < N_RT && k < f.n; k++) {
        const StTensor *t = &f.tensors[k];
        CU_ASSERT_STRING_EQUAL(t->name, names[k]);
        CU_ASSERT_PTR_EQUAL(st_find(&f, names[k]), t);
        CU_ASSERT_EQUAL(t->dtype, ST_F32);
        CU_ASSERT_EQUAL(t->ndim, w[k].ndim);
        size_t n = 1;
        for (int d = 0; d < t->ndim; d++) {
            CU_ASSERT_EQUAL(t->shape[d], w[k].shape[d]);
            n *= (size_t)w[k].shape[d];
        }
        float *got = malloc((n ? n : 1) * sizeof(float));
        CU_ASSERT_EQUAL(st_read_f32(&f, t, got, n, &err), QT_OK);
        for (size_t i = 0; i < n; i++) CU_ASSERT_EQUAL(fbits(got[i]), fbits(data[k][i]));
        /* a count that is not the tensor's is the caller's mistake */
        QtError e2 = {0};
        CU_ASSERT_EQUAL(st_read_f32(&f, t, got, n + 1, &e2), QT_ERR_ARG);
        free(got);
    }
    CU_ASSERT_PTR_NULL(st_find(&f, "missing"));
    st_close(&f);
    /* the header is padded with spaces to a multiple of 8 */
    size_t len = 0;
    uint8_t *bytes = (uint8_t *)test_file_read(path, &len);
    CU_ASSERT_FATAL(bytes && len >= 8);
    uint64_t h = 0;
    for (int k = 7; k >= 0; k--) h = h << 8 | bytes[k];
    CU_ASSERT_EQUAL(h % 8, 0);
    CU_ASSERT(bytes[8] == '{');
    size_t last = 8 + (size_t)h - 1;
    while (last > 8 && bytes[last] == ' ') last--;
    CU_ASSERT(bytes[last] == '}');
    free(bytes);
    /* no temp file is left beside it */
    char tmp[1100];
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid());
    CU_ASSERT(access(tmp, F_OK) != 0);
    for (int k = 0; k < N_RT; k++) free(data[k]);
    free(path);
}

static void test_write_refusals(void) {
    float v = 1;
    char *path = test_path_join(tmp_root, "refused.safetensors");
    StWrite w[2] = {{.name = "a", .data = &v}, {.name = "a", .data = &v}};
    QtError err = {0};
    CU_ASSERT_EQUAL(st_write_f32(path, w, 2, NULL, 0, &err), QT_ERR_ARG);
    CU_ASSERT(test_msg_has(&err, "given twice"));
    qt_error_clear(&err);
    w[1].name = "__metadata__";
    CU_ASSERT_EQUAL(st_write_f32(path, w, 2, NULL, 0, &err), QT_ERR_ARG);
    CU_ASSERT(test_msg_has(&err, "__metadata__"));
    qt_error_clear(&err);
    w[1].name = "";
    CU_ASSERT_EQUAL(st_write_f32(path, w, 2, NULL, 0, &err), QT_ERR_ARG);
    CU_ASSERT(test_msg_has(&err, "empty"));
    qt_error_clear(&err);
    w[1].name = "bad\xff utf8";
    CU_ASSERT_EQUAL(st_write_f32(path, w, 2, NULL, 0, &err), QT_ERR_ARG);
    CU_ASSERT(test_msg_has(&err, "UTF-8"));
    qt_error_clear(&err);
    w[1].name = "b", w[1].ndim = 1, w[1].shape[0] = -1;
    CU_ASSERT_EQUAL(st_write_f32(path, w, 2, NULL, 0, &err), QT_ERR_ARG);
    CU_ASSERT(test_msg_has(&err, "negative"));
    CU_ASSERT(access(path, F_OK) != 0);
    free(path);
}

/* ---- other dtypes, built byte by byte ------------------------------------------------------------------------- */

static void test_f16_bf16_f64(void) {
    /* F16: 1, -2, 65504, 2^-24, 1023 * 2^-24 (largest subnormal), 2^-14 (smallest normal), inf, -inf, nan, -0 */
    static const uint16_t h16[10] = {0x3c00, 0xc000, 0x7bff, 0x0001, 0x03ff, 0x0400, 0x7c00, 0xfc00, 0x7e00, 0x8000};
    const float want16[10] = {1, -2, 65504, ldexpf(1, -24), ldexpf(1023, -24), ldexpf(1, -14), INFINITY, -INFINITY,
                              NAN, -0.0f};
    /* BF16: 1, -2, the largest finite, 2^-133 (a subnormal), inf, nan */
    static const uint16_t b16[6] = {0x3f80, 0xc000, 0x7f7f, 0x0001, 0x7f80, 0x7fc0};
    const uint32_t wantb[6] = {0x3f800000, 0xc0000000, 0x7f7f0000, 0x00010000, 0x7f800000, 0x7fc00000};
    /* F64: a tie (1 + 2^-24: to even, 1), just above it (to 1 + 2^-23), 0.1, 1e300 (inf), 2^-140 (exact subnormal),
     * 1e-50 (0) */
    const double d64[6] = {1 + ldexp(1, -24), 1 + ldexp(1, -24) + ldexp(1, -52), 0.1, 1e300, ldexp(1, -140), -1e-50};
    const float want64[6] = {1, 1 + ldexpf(1, -23), 0.1f, INFINITY, ldexpf(1, -140), -0.0f};
    uint8_t data[20 + 12 + 48];
    for (int i = 0; i < 10; i++) data[2 * i] = (uint8_t)h16[i], data[2 * i + 1] = (uint8_t)(h16[i] >> 8);
    for (int i = 0; i < 6; i++) data[20 + 2 * i] = (uint8_t)b16[i], data[20 + 2 * i + 1] = (uint8_t)(b16[i] >> 8);
    for (int i = 0; i < 6; i++) {
        uint64_t u;
        memcpy(&u, &d64[i], 8);
        for (int k = 0; k < 8; k++) data[32 + 8 * i + k] = (uint8_t)(u >> (8 * k));
    }
    const char *json = "{\"h\":{\"dtype\":\"F16\",\"shape\":[2,5],\"data_offsets\":[0,20]},"
                       "\"b\":{\"shape\":[6],\"data_offsets\":[20,32],\"dtype\":\"BF16\"},"
                       "\"d\":{\"data_offsets\":[32,80],\"dtype\":\"F64\",\"shape\":[3,2]},"
                       "\"i\":{\"dtype\":\"I32\",\"shape\":[0],\"data_offsets\":[80,80]}}";
    uint8_t buf[1024];
    size_t n = build_st(buf, sizeof buf, json, data, sizeof data);
    StFile f;
    memset(&f, 0, sizeof f);
    expect_st("dtypes.safetensors", buf, n, QT_OK, NULL, NULL, &f);
    CU_ASSERT_EQUAL_FATAL(f.n, 4);
    float out[10];
    QtError err = {0};
    CU_ASSERT_EQUAL(st_read_f32(&f, st_find(&f, "h"), out, 10, &err), QT_OK);
    for (int i = 0; i < 10; i++) {
        if (isnan(want16[i])) {
            CU_ASSERT(isnan(out[i]));
        } else {
            CU_ASSERT_EQUAL(fbits(out[i]), fbits(want16[i]));
        }
    }
    CU_ASSERT_EQUAL(st_read_f32(&f, st_find(&f, "b"), out, 6, &err), QT_OK);
    for (int i = 0; i < 6; i++) CU_ASSERT_EQUAL(fbits(out[i]), wantb[i]);
    CU_ASSERT_EQUAL(st_read_f32(&f, st_find(&f, "d"), out, 6, &err), QT_OK);
    for (int i = 0; i < 6; i++) CU_ASSERT_EQUAL(fbits(out[i]), fbits(want64[i]));
    /* an integer tensor is not read as weights */
    CU_ASSERT_EQUAL(st_read_f32(&f, st_find(&f, "i"), out, 0, &err), QT_ERR_FORMAT);
    CU_ASSERT(test_msg_has(&err, "'i'"));
    CU_ASSERT(test_msg_has(&err, "I32"));
    st_close(&f);
}

/* \u escapes with a surrogate pair, and every other escape, decode to UTF-8; whitespace anywhere; an empty header. */
static void test_escapes_and_empty(void) {
    const char *json = " { \"\\ud834\\udd1e\\u00e9\\\"\\\\\\/\\b\\f\\n\\r\\t\" : {\"dtype\" : \"U8\" , \"shape\" : "
                       "[ ] , \"data_offsets\" : [ 0 , 1 ] } ,\r\n\t\"__metadata__\":{}}   ";
    uint8_t buf[512];
    size_t n = build_st(buf, sizeof buf, json, NULL, 1);
    StFile f;
    memset(&f, 0, sizeof f);
    expect_st("escapes.safetensors", buf, n, QT_OK, NULL, NULL, &f);
    CU_ASSERT_EQUAL_FATAL(f.n, 1);
    CU_ASSERT_STRING_EQUAL(f.tensors[0].name, "\xf0\x9d\x84\x9e\xc3\xa9\"\\/\b\f\n\r\t");
    CU_ASSERT_EQUAL(f.tensors[0].ndim, 0);
    CU_ASSERT_EQUAL(f.n_meta, 0);
    st_close(&f);
    n = build_st(buf, sizeof buf, "{}", NULL, 0);
    expect_st("empty.safetensors", buf, n, QT_OK, NULL, NULL, NULL);
}

/* ---- hostile files --------------------------------------------------------------------------------------------- */

#define T1(off, end) "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[" #off "," #end "]}}"

static void test_truncated(void) {
    uint8_t buf[256];
    expect_st("short.safetensors", (const uint8_t *)"\x10\0\0\0\0", 5, QT_ERR_FORMAT, "shorter than the 8 bytes",
              NULL, NULL);
    expect_st("zero.safetensors", buf, 0, QT_ERR_FORMAT, "0 bytes", NULL, NULL);
    /* a good file cut inside its data */
    size_t n = build_st(buf, sizeof buf, T1(0, 8), NULL, 8);
    expect_st("cut.safetensors", buf, n - 3, QT_ERR_FORMAT, "past the end of the data", "'a'", NULL);
    /* a good file cut inside its header */
    expect_st("cuthead.safetensors", buf, 20, QT_ERR_FORMAT, "only 12", NULL, NULL);
}

static void test_header_past_end(void) {
    uint8_t buf[256] = {0};
    buf[0] = 0xe8, buf[1] = 0x03; /* 1000 */
    memcpy(buf + 8, "{}", 2);
    expect_st("hlen.safetensors", buf, 40, QT_ERR_FORMAT, "header of 1000 bytes", "only 32", NULL);
    memset(buf, 0xff, 8); /* 2^64 - 1: no overflow in 8 + N */
    expect_st("hlen-max.safetensors", buf, 40, QT_ERR_FORMAT, "18446744073709551615", NULL, NULL);
    /* st_parse given fewer bytes than a file's header: the caller must read more */
    size_t n = build_st(buf, sizeof buf, T1(0, 8), NULL, 8);
    StFile f;
    QtError err = {0};
    CU_ASSERT_EQUAL(st_parse(&f, buf, 20, n, "x", &err), QT_ERR_ARG);
}

static void test_header_too_large(void) {
    uint8_t buf[64] = {0};
    uint64_t h = ST_HEADER_MAX + 1;
    for (int k = 0; k < 8; k++) buf[k] = (uint8_t)(h >> (8 * k));
    expect_st("hbig.safetensors", buf, 64, QT_ERR_FORMAT, "104857601", "more than", NULL);
    /* st_parse refuses it by the length alone, before the header would be read */
    StFile f;
    QtError err = {0};
    CU_ASSERT_EQUAL(st_parse(&f, buf, 8, (uint64_t)1 << 40, "big", &err), QT_ERR_FORMAT);
    CU_ASSERT(test_msg_has(&err, "more than"));
}

static void test_ranges(void) {
    bad("overlap.safetensors",
        "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
        "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", 12, "overlap", "'b'");
    bad("same.safetensors",
        "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
        "\"b\":{\"dtype\":\"I64\",\"shape\":[],\"data_offsets\":[0,8]}}", 8, "overlap", NULL);
    bad("past.safetensors", T1(0, 8), 4, "past the end of the data", "'a'");
    bad("past-far.safetensors", T1(18446744073709551608, 18446744073709551615), 8, "needs 8 bytes", NULL);
    bad("reversed.safetensors", T1(8, 0), 8, "end before they begin", NULL);
    bad("gap.safetensors", T1(4, 12), 12, "4 bytes", "belong to no tensor");
    bad("trailing.safetensors", T1(0, 8), 9, "extra bytes", NULL);
    bad("size.safetensors", "{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", 8, "needs 12 bytes",
        "(3,)");
    bad("size-bf16.safetensors", "{\"a\":{\"dtype\":\"BF16\",\"shape\":[2,2],\"data_offsets\":[0,16]}}", 16,
        "needs 8 bytes", "(2, 2)");
}

static void test_dtypes_refused(void) {
    bad("dtype-unknown.safetensors", "{\"a\":{\"dtype\":\"Q7\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8,
        "'Q7'", "does not know");
    bad("dtype-fp8.safetensors", "{\"a\":{\"dtype\":\"F8_E4M3\",\"shape\":[2],\"data_offsets\":[0,2]}}", 2,
        "'F8_E4M3'", "does not read");
    bad("dtype-lower.safetensors", "{\"a\":{\"dtype\":\"f32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, "'f32'",
        NULL);
    bad("dtype-num.safetensors", "{\"a\":{\"dtype\":32,\"shape\":[2],\"data_offsets\":[0,8]}}", 8, "'\"' expected",
        NULL);
}

static void test_names_and_fields(void) {
    bad("dup.safetensors",
        "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
        "\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]}}", 16, "'a' appears twice", NULL);
    bad("dup-field.safetensors", "{\"a\":{\"dtype\":\"F32\",\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}",
        8, "'dtype' of tensor 'a' appears twice", NULL);
    bad("missing.safetensors", "{\"a\":{\"dtype\":\"F32\",\"shape\":[2]}}", 8, "no field 'data_offsets'", NULL);
    bad("missing-shape.safetensors", "{\"a\":{\"dtype\":\"F32\",\"data_offsets\":[0,8]}}", 8, "no field 'shape'",
        NULL);
    bad("extra-field.safetensors", "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8],\"x\":1}}", 8,
        "unknown field 'x'", NULL);
    bad("empty-name.safetensors", "{\"\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, "empty name",
        NULL);
    bad("nul-name.safetensors", "{\"a\\u0000b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, "NUL",
        NULL);
    bad("offsets-3.safetensors", "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8,8]}}", 8,
        "more than 2 entries", NULL);
    bad("offsets-1.safetensors", "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0]}}", 8, "2 numbers",
        NULL);
    bad("rank9.safetensors", "{\"a\":{\"dtype\":\"U8\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,1]}}", 1,
        "more than 8 entries", NULL);
    bad("meta-num.safetensors", "{\"__metadata__\":{\"k\":1}}", 0, "not a string", NULL);
    bad("meta-obj.safetensors", "{\"__metadata__\":{\"k\":{\"x\":\"y\"}}}", 0, "not a string", NULL);
    bad("meta-dup.safetensors", "{\"__metadata__\":{\"k\":\"1\",\"k\":\"2\"}}", 0, "'k' appears twice", NULL);
    bad("meta-twice.safetensors", "{\"__metadata__\":{},\"__metadata__\":{}}", 0, "appears twice", NULL);
    bad("tensor-array.safetensors", "{\"a\":[1,2]}", 0, "'{' expected", NULL);
}

static void test_json_syntax(void) {
    static const struct {
        const char *json, *msg;
    } CASES[] = {
        {"", "it ends where '{' was expected"},
        {"[]", "'{' expected, found '['"},
        {"{", "it ends where '\"' was expected"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}", "',' or '}'"},
        {"{}x", "after the header's closing '}'"},
        {"{}\0", "after the header's closing '}'"},
        {"{} {}", "after the header's closing '}'"},
        {"{\"a", "not closed"},
        {"{'a':{}}", "'\"' expected, found '''"},
        {"{\"__metadata__\":{},}", "'\"' expected, found '}'"},
        {"{\"a\" {}}", "':' expected"},
        {"{\"\\x\":{}}", "unknown escape"},
        {"{\"\\u12\":{}}", "4 hex digits"},
        {"{\"\\ud834\":{}}", "high surrogate"},
        {"{\"\\udd1e\":{}}", "low surrogate"},
        {"{\"\\ud834\\u0041\":{}}", "high surrogate"},
        {"{\"a\tb\":{}}", "control character"},
        {"{\"a\xff\":{}}", "not valid UTF-8"},
        {"{\"\xc0\xaf\":{}}", "not valid UTF-8"},
        {"{\"\xed\xa0\x80\":{}}", "not valid UTF-8"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2,],\"data_offsets\":[0,8]}}", "non-negative integer"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[02],\"data_offsets\":[0,8]}}", "leading zero"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2] \"data_offsets\":[0,8]}}", "',' or '}'"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":null,\"data_offsets\":[0,8]}}", "'[' expected"},
    };
    for (size_t k = 0; k < sizeof CASES / sizeof CASES[0]; k++) {
        char name[64];
        snprintf(name, sizeof name, "json%zu.safetensors", k);
        uint8_t buf[512];
        size_t len = strlen(CASES[k].json) + (k == 5 ? 1 : 0); /* case 5 holds a NUL after the '}' */
        size_t h = len;
        for (int b = 0; b < 8; b++) buf[b] = (uint8_t)((uint64_t)h >> (8 * b));
        memcpy(buf + 8, CASES[k].json, len);
        expect_st(name, buf, 8 + len, QT_ERR_FORMAT, CASES[k].msg, "JSON header is invalid", NULL);
    }
}

static void test_numbers(void) {
    bad("neg.safetensors", "{\"a\":{\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]}}", 8, "negative", "'a'");
    bad("neg-off.safetensors", "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[-8,0]}}", 8, "negative",
        "data_offsets");
    bad("float.safetensors", "{\"a\":{\"dtype\":\"F32\",\"shape\":[2.0],\"data_offsets\":[0,8]}}", 8, "fraction",
        "'a'");
    bad("exp.safetensors", "{\"a\":{\"dtype\":\"F32\",\"shape\":[2e0],\"data_offsets\":[0,8]}}", 8, "exponent", NULL);
    bad("plus.safetensors", "{\"a\":{\"dtype\":\"F32\",\"shape\":[+2],\"data_offsets\":[0,8]}}", 8,
        "non-negative integer", NULL);
    bad("str.safetensors", "{\"a\":{\"dtype\":\"F32\",\"shape\":[\"2\"],\"data_offsets\":[0,8]}}", 8,
        "non-negative integer", NULL);
    /* the product overflows 64 bits: 2^32 * 2^32 * 16 */
    bad("huge.safetensors", "{\"a\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296,16],\"data_offsets\":[0,8]}}",
        8, "more than 2^64", "'a'");
    /* one dimension past int64 */
    bad("huge-dim.safetensors", "{\"a\":{\"dtype\":\"U8\",\"shape\":[9223372036854775808],\"data_offsets\":[0,8]}}", 8,
        "larger than 9223372036854775807", NULL);
    bad("huge-off.safetensors", "{\"a\":{\"dtype\":\"U8\",\"shape\":[8],\"data_offsets\":[0,99999999999999999999]}}",
        8, "larger than", NULL);
    /* a zero dimension makes a huge product empty */
    uint8_t buf[512];
    size_t n = build_st(buf, sizeof buf,
                        "{\"a\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296,0],\"data_offsets\":[0,0]}}",
                        NULL, 0);
    expect_st("huge-empty.safetensors", buf, n, QT_OK, NULL, NULL, NULL);
}

/* A file that changes size after st_open is an I/O error when a tensor is read. */
static void test_changed_file(void) {
    uint8_t buf[256];
    size_t n = build_st(buf, sizeof buf, T1(0, 8), NULL, 8);
    StFile f;
    memset(&f, 0, sizeof f);
    expect_st("changed.safetensors", buf, n, QT_OK, NULL, NULL, &f);
    CU_ASSERT_EQUAL_FATAL(f.n, 1);
    CU_ASSERT_EQUAL_FATAL(truncate(f.path, (off_t)n - 4), 0);
    float out[2];
    QtError err = {0};
    CU_ASSERT_EQUAL(st_read_f32(&f, &f.tensors[0], out, 2, &err), QT_ERR_IO);
    CU_ASSERT(test_msg_has(&err, "changed while in use"));
    st_close(&f);
    /* a directory, and a missing file */
    qt_error_clear(&err);
    CU_ASSERT_EQUAL(st_open(&f, tmp_root, &err), QT_ERR_IO);
    CU_ASSERT(test_msg_has(&err, "not a regular file"));
    qt_error_clear(&err);
    char *missing = test_path_join(tmp_root, "absent.safetensors");
    CU_ASSERT_EQUAL(st_open(&f, missing, &err), QT_ERR_IO);
    CU_ASSERT(test_msg_has(&err, "absent.safetensors"));
    free(missing);
}

/* ---- NumPy reads what qtrain writes ---------------------------------------------------------------------------- */

static const char NUMPY_READER[] =
    "import json, sys\n"
    "import numpy as np\n"
    "b = open(sys.argv[1], 'rb').read()\n"
    "n = int.from_bytes(b[:8], 'little')\n"
    "assert n % 8 == 0, n\n"
    "h = json.loads(b[8:8 + n].decode('utf-8'))\n"
    "data = b[8 + n:]\n"
    "meta = h.pop('__metadata__')\n"
    "assert meta == {'format': 'pt', 'note': '\\u00fc \"q\" \\\\'}, meta\n"
    "assert list(h) == ['w', 'sca\\u0142ar', 'empty', 'b\\\\\"', 'count'], list(h)\n"
    "c = h.pop('count')\n"
    "end = 0\n"
    "for k, (name, t) in enumerate(h.items()):\n"
    "    s, e = t['data_offsets']\n"
    "    assert t['dtype'] == 'F32' and s == end, (name, t)\n"
    "    end = e\n"
    "    a = np.frombuffer(data[s:e], dtype='<f4').reshape(t['shape'])\n"
    "    want = (np.arange(a.size, dtype=np.float32) * np.float32(0.25) - np.float32(k)).reshape(t['shape'])\n"
    "    assert a.shape == tuple(t['shape']) and np.array_equal(a, want), (name, a, want)\n"
    "assert c['dtype'] == 'I64' and c['shape'] == [2] and c['data_offsets'] == [end, end + 16], c\n"
    "assert np.frombuffer(data[end:end + 16], dtype='<i8').tolist() == [-4, 1 << 40]\n"
    "assert end + 16 == len(data), (end, len(data))\n"
    "print('ok', len(h) + 1)\n";

static int sh(const char *log, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int sh(const char *log, const char *fmt, ...) {
    char args[4096], cmd[8192];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(args, sizeof args, fmt, ap);
    va_end(ap);
    snprintf(cmd, sizeof cmd, "%s >%s 2>&1", args, log);
    fflush(NULL);
    int st = system(cmd);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void test_numpy_reads(void) {
    char *log = test_path_join(tmp_root, "numpy.log");
    if (access(PYTHON, X_OK) != 0) {
        test_skip(PYTHON " is missing (Debian's python3)");
        free(log);
        return;
    }
    if (sh(log, PYTHON " -c 'import numpy'") != 0) {
        test_skip(PYTHON " cannot import numpy (install python3-numpy)");
        free(log);
        return;
    }
    float w[6], s[1], bq[3];
    for (int i = 0; i < 6; i++) w[i] = (float)i * 0.25f;
    s[0] = -1;
    for (int i = 0; i < 3; i++) bq[i] = (float)i * 0.25f - 3;
    const int64_t count[2] = {-4, (int64_t)1 << 40};
    StWrite t[5] = {{.name = "w", .data = w, .ndim = 2, .shape = {2, 3}},
                    {.name = "sca\xc5\x82" "ar", .data = s},
                    {.name = "empty", .ndim = 2, .shape = {0, 4}},
                    {.name = "b\\\"", .data = bq, .ndim = 1, .shape = {3}},
                    {.name = "count", .data_i64 = count, .ndim = 1, .shape = {2}}};
    const char *const meta[2][2] = {{"format", "pt"}, {"note", "\xc3\xbc \"q\" \\"}};
    char *path = test_path_join(tmp_root, "np.safetensors"), *script = test_path_join(tmp_root, "reader.py");
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(st_write_f32(path, t, 5, meta, 2, &err), QT_OK);
    test_file_write(script, NUMPY_READER, sizeof NUMPY_READER - 1);
    int code = sh(log, PYTHON " %s %s", script, path);
    char *text = test_file_read(log, NULL);
    if (code != 0) fprintf(stderr, "\n%s\n", text ? text : "(no output)");
    CU_ASSERT_EQUAL(code, 0);
    CU_ASSERT(text && strstr(text, "ok 5"));
    free(text);
    free(script);
    free(path);
    free(log);
}

int register_safetensors_suite(void) {
    CU_pSuite s = CU_add_suite("safetensors", st_suite_init, st_suite_cleanup);
    if (!s) return -1;
    return !CU_add_test(s, "write and read back: names, metadata, ranks 0-8, empty", test_round_trip) ||
           !CU_add_test(s, "the writer refuses bad names and shapes", test_write_refusals) ||
           !CU_add_test(s, "F16, BF16, F64 to float32 exactly / rounded", test_f16_bf16_f64) ||
           !CU_add_test(s, "string escapes, whitespace, an empty header", test_escapes_and_empty) ||
           !CU_add_test(s, "truncated files", test_truncated) ||
           !CU_add_test(s, "header length past the end", test_header_past_end) ||
           !CU_add_test(s, "header larger than ST_HEADER_MAX", test_header_too_large) ||
           !CU_add_test(s, "byte ranges: overlap, past the end, gap, size", test_ranges) ||
           !CU_add_test(s, "unknown and unsupported dtypes", test_dtypes_refused) ||
           !CU_add_test(s, "names and fields: duplicate, missing, unknown", test_names_and_fields) ||
           !CU_add_test(s, "JSON syntax errors", test_json_syntax) ||
           !CU_add_test(s, "numbers: negative, float, overflow", test_numbers) ||
           !CU_add_test(s, "a file changed after opening; not a file", test_changed_file) ||
           !CU_add_test(s, "NumPy reads what st_write_f32 writes", test_numpy_reads);
}
