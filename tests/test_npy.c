/* test_npy.c - the data_npy suite: data/npy.c's reader of NumPy .npy files.
 *
 * Files written by Debian's NumPy (/usr/bin/python3, at test time into a
 * temporary directory) for every dtype qtrain reads, ranks 0-4 and format
 * versions 1.0, 2.0 and 3.0 read with the shape, dtype and bytes NumPy
 * wrote (skipped, saying why, without python3 and numpy). Hostile files,
 * one test per kind, are built byte by byte here, so they always run: each
 * is refused with a message naming the file and the fault, by
 * npy_read_info on a file and by npy_read_header_bytes on the same bytes. */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "data/npy.h"
#include "test_util.h"

#define PYTHON "/usr/bin/python3"

static char *tmp_root;

static int npy_suite_init(void) {
    tmp_root = test_tmpdir_new();
    return tmp_root ? 0 : -1;
}

static int npy_suite_cleanup(void) {
    bool ok = test_tmpdir_remove(tmp_root);
    tmp_root = NULL;
    return ok ? 0 : -1;
}

/* ---- files built here ------------------------------------------------------------------------------------------ */

/* A .npy file in buf[cap]: the magic, version major.0, the header length
 * (2 bytes for 1.0, else 4), dict padded with spaces and a '\n' to a
 * multiple of align (0: no padding, just the '\n'), then data_bytes bytes
 * of a pattern. Returns its size. */
static size_t build_npy(uint8_t *buf, size_t cap, int major, const char *dict, int align, size_t data_bytes) {
    size_t pre = major == 1 ? 10 : 12, dlen = strlen(dict);
    size_t hlen = dlen + 1;
    if (align > 0) hlen += (size_t)(align - (int)((pre + hlen) % (size_t)align)) % (size_t)align;
    CU_ASSERT_FATAL(pre + hlen + data_bytes <= cap);
    memcpy(buf, "\x93NUMPY", 6);
    buf[6] = (uint8_t)major, buf[7] = 0;
    for (size_t i = 0; i < pre - 8; i++) buf[8 + i] = (uint8_t)(hlen >> (8 * i));
    memcpy(buf + pre, dict, dlen);
    memset(buf + pre + dlen, ' ', hlen - dlen - 1);
    buf[pre + hlen - 1] = '\n';
    for (size_t i = 0; i < data_bytes; i++) buf[pre + hlen + i] = (uint8_t)(i * 37 + 11);
    return pre + hlen + data_bytes;
}

/* Writes buf[n] to <tmp>/name; the path, malloc'd. */
static char *put_file(const char *name, const uint8_t *buf, size_t n) {
    char *path = test_path_join(tmp_root, name);
    test_file_write(path, buf, n);
    return path;
}

/* Reads the bytes as a file named name and from memory: both must give
 * status want (and, failing, a message holding the file's name, m1 and m2
 * unless NULL). info gets the file read's result. */
static void expect_npy(const char *name, const uint8_t *buf, size_t n, QtStatus want, const char *m1, const char *m2,
                       NpyInfo *info_out) {
    char *path = put_file(name, buf, n);
    NpyInfo info, mem;
    QtError err = {0}, merr = {0};
    QtStatus st = npy_read_info(path, &info, &err);
    QtStatus mst = npy_read_header_bytes(buf, n, n, &mem, path, &merr);
    if (st != want) fprintf(stderr, "\n  %s: status %d, want %d: %s\n", name, (int)st, (int)want, err.msg);
    CU_ASSERT_EQUAL(st, want);
    CU_ASSERT_EQUAL(mst, st);
    if (want != QT_OK) {
        CU_ASSERT(test_msg_has(&err, path));
        if (m1) CU_ASSERT(test_msg_has(&err, m1));
        if (m2) CU_ASSERT(test_msg_has(&err, m2));
        CU_ASSERT_STRING_EQUAL(merr.msg, err.msg);
    } else {
        CU_ASSERT_EQUAL(err.status, QT_OK);
        CU_ASSERT(memcmp(&info, &mem, sizeof info) == 0);
        if (info_out) *info_out = info;
    }
    free(path);
}

#define GOOD_DICT "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }"

static void test_built_good(void) {
    uint8_t buf[512];
    NpyInfo info;
    size_t n = build_npy(buf, sizeof buf, 1, GOOD_DICT, 64, 24);
    expect_npy("good.npy", buf, n, QT_OK, NULL, NULL, &info);
    CU_ASSERT_EQUAL(info.dtype, NPY_F32);
    CU_ASSERT_EQUAL(info.elem_bytes, 4);
    CU_ASSERT_EQUAL(info.ndim, 2);
    CU_ASSERT(info.shape[0] == 2 && info.shape[1] == 3 && info.shape[2] == 0);
    CU_ASSERT_EQUAL(info.data_offset, 128); /* 10 + 60 + '\n', padded to 64 */
    CU_ASSERT(info.n_elems == 6 && info.n_bytes == 24);
    /* What other writers produce: double quotes, keys in another order, no trailing comma, 16-byte or no
     * alignment, '=' and '|' byte orders, one-byte types with '<' or '>', a one-dimensional array marked
     * Fortran order (the same bytes), a scalar, an empty array. */
    n = build_npy(buf, sizeof buf, 1, "{\"shape\": (6,), \"fortran_order\": False, \"descr\": \"=f4\"}", 16, 24);
    expect_npy("variant1.npy", buf, n, QT_OK, NULL, NULL, &info);
    CU_ASSERT(info.ndim == 1 && info.shape[0] == 6 && info.dtype == NPY_F32 && info.data_offset == 80);
    n = build_npy(buf, sizeof buf, 2, "{'descr':'>u1','shape':(2,3,),'fortran_order':False}", 0, 6);
    expect_npy("variant2.npy", buf, n, QT_OK, NULL, NULL, &info);
    CU_ASSERT(info.version == 2 && info.dtype == NPY_U8 && info.ndim == 2 && info.data_offset == 12 + 52 + 1);
    n = build_npy(buf, sizeof buf, 3, "{'descr': '|b1', 'fortran_order': True, 'shape': (5,), }", 64, 5);
    expect_npy("fortran-1d.npy", buf, n, QT_OK, NULL, NULL, &info);
    CU_ASSERT(info.dtype == NPY_BOOL && info.version == 3);
    n = build_npy(buf, sizeof buf, 1, "{'descr': '<f8', 'fortran_order': False, 'shape': (), }", 64, 8);
    expect_npy("scalar.npy", buf, n, QT_OK, NULL, NULL, &info);
    CU_ASSERT(info.ndim == 0 && info.n_elems == 1 && info.n_bytes == 8);
    n = build_npy(buf, sizeof buf, 1, "{'descr': '<i8', 'fortran_order': False, 'shape': (0, 1099511627776), }", 64,
                  0);
    expect_npy("empty.npy", buf, n, QT_OK, NULL, NULL, &info);
    CU_ASSERT(info.n_elems == 0 && info.n_bytes == 0 && info.shape[1] == ((int64_t)1 << 40));
}

static void test_bad_magic(void) {
    uint8_t buf[256];
    size_t n = build_npy(buf, sizeof buf, 1, GOOD_DICT, 64, 24);
    buf[5] = 'Z';
    expect_npy("magic.npy", buf, n, QT_ERR_FORMAT, "not a NumPy .npy file", "\\x93NUMPZ", NULL);
    expect_npy("empty-file.npy", buf, 0, QT_ERR_FORMAT, "is empty", NULL, NULL);
    expect_npy("hdf5.npy", (const uint8_t *)"\x89HDF\r\n\x1a\n", 8, QT_ERR_FORMAT, "starts with \"\\x89HDF", NULL,
               NULL);
}

/* Shorter than the magic and version, or than the header length field. */
static void test_truncated_header(void) {
    uint8_t buf[256];
    size_t n = build_npy(buf, sizeof buf, 1, GOOD_DICT, 64, 24);
    expect_npy("trunc-6.npy", buf, 6, QT_ERR_FORMAT, "truncated", "6 bytes", NULL);
    expect_npy("trunc-9.npy", buf, 9, QT_ERR_FORMAT, "truncated", "the 10 bytes before a version 1.0 header", NULL);
    n = build_npy(buf, sizeof buf, 2, GOOD_DICT, 64, 24);
    expect_npy("trunc-v2.npy", buf, 11, QT_ERR_FORMAT, "truncated", "the 12 bytes before a version 2.0 header", NULL);
    (void)n;
}

/* A header length field past the end of the file, and one past NPY_HEADER_MAX. */
static void test_header_length_past_file(void) {
    uint8_t buf[256];
    build_npy(buf, sizeof buf, 1, GOOD_DICT, 64, 0);
    expect_npy("hlen-past.npy", buf, 40, QT_ERR_FORMAT, "declares a header of 118 bytes", "the file is 40 bytes", NULL);
    size_t n = build_npy(buf, sizeof buf, 2, GOOD_DICT, 64, 24);
    buf[10] = 0xff, buf[11] = 0xff; /* 4 GB */
    expect_npy("hlen-huge.npy", buf, n, QT_ERR_FORMAT, "declares a header of 4294901876 bytes", "more than the 65536",
               NULL);
    /* The parser on a buffer holding less than the header of a longer file: the caller's mistake. */
    n = build_npy(buf, sizeof buf, 1, GOOD_DICT, 64, 24);
    NpyInfo info;
    QtError err = {0};
    CU_ASSERT_EQUAL(npy_read_header_bytes(buf, 40, n, &info, "short.npy", &err), QT_ERR_ARG);
    CU_ASSERT(test_msg_has(&err, "40 bytes given"));
}

static void test_missing_key(void) {
    uint8_t buf[256];
    size_t n = build_npy(buf, sizeof buf, 1, "{'descr': '<f4', 'fortran_order': False, }", 64, 4);
    expect_npy("no-shape.npy", buf, n, QT_ERR_FORMAT, "no 'shape' key", "save the array again", NULL);
    n = build_npy(buf, sizeof buf, 1, "{'fortran_order': False, 'shape': (1,)}", 64, 4);
    expect_npy("no-descr.npy", buf, n, QT_ERR_FORMAT, "no 'descr' key", NULL, NULL);
    n = build_npy(buf, sizeof buf, 1, "{}", 64, 4);
    expect_npy("empty-dict.npy", buf, n, QT_ERR_FORMAT, "no 'descr' key", NULL, NULL);
}

static void test_extra_key(void) {
    uint8_t buf[256];
    size_t n = build_npy(buf, sizeof buf, 1, "{'descr': '<f4', 'fortran_order': False, 'shape': (1,), 'x': 1}", 64, 4);
    expect_npy("extra-key.npy", buf, n, QT_ERR_FORMAT, "unexpected key 'x'", NULL, NULL);
    n = build_npy(buf, sizeof buf, 1, "{'descr': '<f4', 'shape': (2,), 'fortran_order': False, 'shape': (1,)}", 64, 4);
    expect_npy("repeated-key.npy", buf, n, QT_ERR_FORMAT, "repeated key 'shape'", NULL, NULL);
}

static void test_big_endian(void) {
    uint8_t buf[256];
    size_t n = build_npy(buf, sizeof buf, 1, "{'descr': '>f4', 'fortran_order': False, 'shape': (2, 3), }", 64, 24);
    char *path = test_path_join(tmp_root, "big.npy");
    char want[1024];
    snprintf(want, sizeof want, "np.save('%s', np.load('%s').astype('<f4'))", path, path);
    expect_npy("big.npy", buf, n, QT_ERR_FORMAT, "big-endian (dtype '>f4')", want, NULL);
    free(path);
    n = build_npy(buf, sizeof buf, 1, "{'descr': '>i8', 'fortran_order': False, 'shape': (3,), }", 64, 24);
    expect_npy("big-i8.npy", buf, n, QT_ERR_FORMAT, "big-endian", "astype('<i8')", NULL);
}

static void test_fortran_order(void) {
    uint8_t buf[256];
    size_t n = build_npy(buf, sizeof buf, 1, "{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3), }", 64, 24);
    expect_npy("fortran.npy", buf, n, QT_ERR_FORMAT, "Fortran order", "np.ascontiguousarray(np.load(", NULL);
    n = build_npy(buf, sizeof buf, 1, "{'descr': '<f4', 'fortran_order': Truex, 'shape': (2, 3), }", 64, 24);
    expect_npy("fortran-word.npy", buf, n, QT_ERR_FORMAT, "True or False", NULL, NULL);
    n = build_npy(buf, sizeof buf, 1, "{'descr': '<f4', 'fortran_order': 0, 'shape': (2, 3), }", 64, 24);
    expect_npy("fortran-int.npy", buf, n, QT_ERR_FORMAT, "True or False", NULL, NULL);
}

/* Object, structured, string, complex, datetime and unknown dtypes, each named. */
static void test_unsupported_dtypes(void) {
    static const struct {
        const char *descr, *m1, *m2;
    } cases[] = {
        {"'|O'", "dtype '|O'", "Python objects"},
        {"[('x', '<f4'), ('y', '<i2')]", "structured array", "[('x', '<f4'), ('y', '<i2')]"},
        {"'<U2'", "dtype '<U2'", "strings"},
        {"'|S3'", "dtype '|S3'", "strings"},
        {"'<c8'", "dtype '<c8'", "complex"},
        {"'<M8[ns]'", "dtype '<M8[ns]'", "dates"},
        {"'|V4'", "dtype '|V4'", "void"},
        {"'<f16'", "dtype '<f16'", "does not read"},
        {"'<i3'", "dtype '<i3'", "does not read"},
        {"'<f04'", "dtype '<f04'", "not a NumPy type string"},
        {"'float32'", "dtype 'float32'", "not a NumPy type string"},
        {"'f4'", "dtype 'f4'", "not a NumPy type string"},
        {"''", "dtype ''", "not a NumPy type string"},
        {"4", "the descr string", NULL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char dict[256], name[32];
        snprintf(dict, sizeof dict, "{'descr': %s, 'fortran_order': False, 'shape': (2,), }", cases[i].descr);
        snprintf(name, sizeof name, "dtype-%zu.npy", i);
        uint8_t buf[512];
        size_t n = build_npy(buf, sizeof buf, 1, dict, 64, 8);
        expect_npy(name, buf, n, QT_ERR_FORMAT, cases[i].m1, cases[i].m2, NULL);
    }
}

static void test_negative_or_huge_shape(void) {
    uint8_t buf[256];
    size_t n = build_npy(buf, sizeof buf, 1, "{'descr': '<f4', 'fortran_order': False, 'shape': (2, -3), }", 64, 24);
    expect_npy("negative.npy", buf, n, QT_ERR_FORMAT, "negative dimension", "-3)", NULL);
    n = build_npy(buf, sizeof buf, 1, "{'descr': '|u1', 'fortran_order': False, 'shape': (1099511627777,), }", 64, 0);
    expect_npy("huge.npy", buf, n, QT_ERR_FORMAT, "dimension of 1099511627777,)", "2^40", NULL);
    n = build_npy(buf, sizeof buf, 1,
                  "{'descr': '|u1', 'fortran_order': False, 'shape': (123456789012345678901234567890,), }", 64, 0);
    expect_npy("digits.npy", buf, n, QT_ERR_FORMAT, "dimension of 123456789012345678901234567890", NULL, NULL);
    n = build_npy(buf, sizeof buf, 1, "{'descr': '|u1', 'fortran_order': False, 'shape': (1, 2, 3, 4, 5, 6, 7, 8, 9), }",
                  64, 0);
    expect_npy("rank9.npy", buf, n, QT_ERR_FORMAT, "more than 8 dimensions", "reshape", NULL);
    /* 2^40 elements exactly is accepted: the header with the size a file of them would have. */
    n = build_npy(buf, sizeof buf, 1, "{'descr': '|u1', 'fortran_order': False, 'shape': (1099511627776,), }", 64, 0);
    NpyInfo info;
    QtError err = {0};
    CU_ASSERT_EQUAL(npy_read_header_bytes(buf, n, n + ((uint64_t)1 << 40), &info, "big.npy", &err), QT_OK);
    CU_ASSERT_EQUAL(info.n_bytes, (uint64_t)1 << 40);
}

/* Dimensions each allowed whose product is not (2^60 elements; 2^64 would wrap to 0). */
static void test_product_overflow(void) {
    uint8_t buf[256];
    size_t n = build_npy(buf, sizeof buf, 1,
                         "{'descr': '<f8', 'fortran_order': False, 'shape': (1048576, 1048576, 1048576), }", 64, 0);
    expect_npy("product.npy", buf, n, QT_ERR_FORMAT, "shape (1048576, 1048576, 1048576)", "2^40", NULL);
    n = build_npy(buf, sizeof buf, 1,
                  "{'descr': '<f8', 'fortran_order': False, 'shape': (4294967296, 4294967296), }", 64, 0);
    expect_npy("product-wrap.npy", buf, n, QT_ERR_FORMAT, "shape (4294967296, 4294967296)", "2^40", NULL);
}

/* A lying header: fewer data bytes than the shape needs, or more. */
static void test_file_shorter(void) {
    uint8_t buf[256];
    size_t n = build_npy(buf, sizeof buf, 1, GOOD_DICT, 64, 24);
    CU_ASSERT_EQUAL_FATAL(n, 152); /* a 128-byte preamble and header */
    expect_npy("short.npy", buf, n - 1, QT_ERR_FORMAT, "truncated", "should be 152 bytes, but it is 151 bytes", NULL);
    expect_npy("header-only.npy", buf, 128, QT_ERR_FORMAT, "truncated", "shape (2, 3) of float32, 24 bytes of data",
               NULL);
}

static void test_file_longer(void) {
    uint8_t buf[256];
    size_t n = build_npy(buf, sizeof buf, 1, GOOD_DICT, 64, 25);
    CU_ASSERT_EQUAL_FATAL(n, 153);
    expect_npy("long.npy", buf, n, QT_ERR_FORMAT, "is 153 bytes", "should be 152 bytes: 1 bytes follow the data", NULL);
}

/* Bytes that are not ASCII, and text that is not the dict. */
static void test_garbage_in_dict(void) {
    static const struct {
        const char *dict, *m1;
    } cases[] = {
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), \xc3\xa9}", "0xc3, not ASCII"},
        {"{'descr': '<f4', 'fortran_order': False,\n'shape': (2, 3), }", "0x0a, not ASCII"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), } x", "only spaces after the dict"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }}", "only spaces after the dict"},
        {"['descr', '<f4']", "'{'"},
        {"{'descr' '<f4', 'fortran_order': False, 'shape': (2, 3)}", "':' after the key"},
        {"{'descr': '<f4' 'fortran_order': False, 'shape': (2, 3)}", "',' or '}'"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3),,}", "a quoted key"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': [2, 3]}", "a tuple"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (6)}", "',' after the only dimension"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (2 3)}", "',' or ')'"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (02, 3)}", "without leading zeros"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (2.0, 3)}", "',' or ')'"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3)", "',' or '}'"},
        {"{'descr': '<f\\x34', 'fortran_order': False, 'shape': (2, 3)}", "without backslashes"},
        {"{'descr': '<f4, 'fortran_order': False, 'shape': (2, 3)}", "dtype '<f4, '"},
        {"{descr: '<f4', 'fortran_order': False, 'shape': (2, 3)}", "a quoted key"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char name[32];
        snprintf(name, sizeof name, "garbage-%zu.npy", i);
        uint8_t buf[512];
        size_t n = build_npy(buf, sizeof buf, 1, cases[i].dict, 64, 24);
        expect_npy(name, buf, n, QT_ERR_FORMAT, cases[i].m1, NULL, NULL);
    }
    uint8_t buf[256];
    size_t n = build_npy(buf, sizeof buf, 1, GOOD_DICT, 64, 24);
    buf[127] = ' '; /* the '\n' that ends the header */
    expect_npy("no-newline.npy", buf, n, QT_ERR_FORMAT, "does not end with a newline", NULL, NULL);
    n = build_npy(buf, sizeof buf, 1, GOOD_DICT, 64, 24);
    buf[30] = 0;
    expect_npy("nul.npy", buf, n, QT_ERR_FORMAT, "byte 20 of its header is 0x00", NULL, NULL);
    n = build_npy(buf, sizeof buf, 1, GOOD_DICT, 64, 24);
    buf[6] = 4;
    expect_npy("version.npy", buf, n, QT_ERR_FORMAT, "format version 4.0", "1.0, 2.0 and 3.0", NULL);
    buf[6] = 1, buf[7] = 1;
    expect_npy("minor.npy", buf, n, QT_ERR_FORMAT, "format version 1.1", NULL, NULL);
}

/* A missing file, a directory, and a FIFO (refused at once, not read). */
static void test_not_a_file(void) {
    NpyInfo info;
    QtError err = {0};
    char *missing = test_path_join(tmp_root, "missing.npy");
    CU_ASSERT_EQUAL(npy_read_info(missing, &info, &err), QT_ERR_IO);
    CU_ASSERT(test_msg_has(&err, missing) && test_msg_has(&err, "No such file"));
    free(missing);
    qt_error_clear(&err);
    CU_ASSERT_EQUAL(npy_read_info(tmp_root, &info, &err), QT_ERR_IO);
    CU_ASSERT(test_msg_has(&err, "not a regular file"));
    char *fifo = test_path_join(tmp_root, "fifo.npy");
    CU_ASSERT_EQUAL_FATAL(mkfifo(fifo, 0600), 0);
    qt_error_clear(&err);
    CU_ASSERT_EQUAL(npy_read_info(fifo, &info, &err), QT_ERR_IO);
    CU_ASSERT(test_msg_has(&err, "not a regular file"));
    unlink(fifo);
    free(fifo);
    qt_error_clear(&err);
    CU_ASSERT_EQUAL(npy_read_info(NULL, &info, &err), QT_ERR_ARG);
}

/* Rows read by pread: the right bytes, ranges checked, a file that shrinks after opening. */
static void test_read_rows(void) {
    uint8_t buf[512];
    size_t n = build_npy(buf, sizeof buf, 2, "{'descr': '<i2', 'fortran_order': False, 'shape': (5, 2, 3), }", 64,
                         60);
    char *path = put_file("rows.npy", buf, n);
    NpyFile f;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(npy_file_open(&f, path, &err), QT_OK);
    CU_ASSERT(f.row_elems == 6 && f.row_bytes == 12 && f.info.data_offset == 128);
    uint8_t rows[36];
    CU_ASSERT_EQUAL(npy_file_read_rows(&f, 2, 3, rows, sizeof rows, &err), QT_OK);
    CU_ASSERT(memcmp(rows, buf + 128 + 24, 36) == 0);
    CU_ASSERT_EQUAL(npy_file_read_rows(&f, 5, 0, rows, sizeof rows, &err), QT_OK);
    CU_ASSERT_EQUAL(npy_file_read_rows(&f, 3, 3, rows, sizeof rows, &err), QT_ERR_ARG);
    qt_error_clear(&err);
    CU_ASSERT_EQUAL(npy_file_read_rows(&f, UINT64_MAX, 2, rows, sizeof rows, &err), QT_ERR_ARG);
    qt_error_clear(&err);
    CU_ASSERT_EQUAL(npy_file_read_rows(&f, 0, 4, rows, sizeof rows, &err), QT_ERR_ARG);
    CU_ASSERT(test_msg_has(&err, "do not fit in 36 bytes"));
    qt_error_clear(&err);
    CU_ASSERT_EQUAL(truncate(path, (off_t)n - 1), 0);
    CU_ASSERT_EQUAL(npy_file_read_rows(&f, 0, 3, rows, sizeof rows, &err), QT_OK); /* before the cut */
    CU_ASSERT_EQUAL(npy_file_read_rows(&f, 4, 1, rows, sizeof rows, &err), QT_ERR_IO);
    CU_ASSERT(test_msg_has(&err, path) && test_msg_has(&err, "became shorter") && test_msg_has(&err, "187 bytes") &&
              test_msg_has(&err, "188 when opened"));
    npy_file_close(&f);
    CU_ASSERT_EQUAL(f.fd, -1);
    /* A scalar has no rows. */
    n = build_npy(buf, sizeof buf, 1, "{'descr': '<f4', 'fortran_order': False, 'shape': (), }", 64, 4);
    free(path);
    path = put_file("scalar-rows.npy", buf, n);
    qt_error_clear(&err);
    CU_ASSERT_EQUAL_FATAL(npy_file_open(&f, path, &err), QT_OK);
    CU_ASSERT_EQUAL(npy_file_read_rows(&f, 0, 1, rows, sizeof rows, &err), QT_ERR_SHAPE);
    CU_ASSERT(test_msg_has(&err, "scalar"));
    npy_file_close(&f);
    free(path);
}

/* ---- files NumPy wrote -------------------------------------------------------------------------------------- */

/* Runs a shell command (printf-style) with its output in log; the exit status, -1 if it did not exit. */
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

static const struct {
    const char *numpy; /* NumPy's dtype name, as the script and npy_dtype_name spell it */
    NpyDtype dtype;
    int bytes;
} NUMPY_DTYPES[] = {
    {"uint8", NPY_U8, 1},     {"int8", NPY_I8, 1},       {"uint16", NPY_U16, 2},   {"int16", NPY_I16, 2},
    {"uint32", NPY_U32, 4},   {"int32", NPY_I32, 4},     {"int64", NPY_I64, 8},    {"uint64", NPY_U64, 8},
    {"float16", NPY_F16, 2},  {"float32", NPY_F32, 4},   {"float64", NPY_F64, 8},  {"bool", NPY_BOOL, 1},
};

/* Shapes by rank 0-4 (rank 4 has a dimension of 1). */
static const int64_t NUMPY_SHAPES[5][4] = {{0}, {5}, {3, 4}, {2, 3, 4}, {2, 1, 3, 2}};

/* For each dtype, rank and version: <dir>/<dtype>-r<rank>-v<version>.npy and the array's bytes in .bin. */
static const char NUMPY_SCRIPT[] =
    "import sys, numpy as np\n"
    "d = sys.argv[1]\n"
    "shapes = [(), (5,), (3, 4), (2, 3, 4), (2, 1, 3, 2)]\n"
    "for dt in sys.argv[2:]:\n"
    "    for r, shape in enumerate(shapes):\n"
    "        n = int(np.prod(shape))\n"
    "        a = ((np.arange(n) * 37 + 11) % 251 - 100).astype(dt).reshape(shape)\n"
    "        if dt == 'bool': a = (np.arange(n) % 3 == 1).reshape(shape)\n"
    "        for v in (1, 2, 3):\n"
    "            name = '%s/%s-r%d-v%d' % (d, dt, r, v)\n"
    "            with open(name + '.npy', 'wb') as f:\n"
    "                np.lib.format.write_array(f, a, version=(v, 0))\n"
    "            open(name + '.bin', 'wb').write(a.tobytes())\n"
    "    np.save('%s/%s-fortran.npy' % (d, dt), np.asfortranarray(np.zeros((2, 3), dtype=dt)))\n"
    "    if np.dtype(dt).itemsize > 1: np.save('%s/%s-big.npy' % (d, dt), np.zeros((2, 3), dtype=np.dtype(dt).newbyteorder('>')))\n";

/* 0 if /usr/bin/python3 can import numpy, else 1 after test_skip with the reason. */
static int need_numpy(const char *log) {
    if (access(PYTHON, X_OK) != 0) {
        test_skip(PYTHON " is missing (Debian's python3)");
        return 1;
    }
    if (sh(log, PYTHON " -c 'import numpy'") != 0) {
        char *text = test_file_read(log, NULL);
        size_t len = text ? strlen(text) : 0;
        while (len && text[len - 1] == '\n') text[--len] = 0;
        const char *last = text ? strrchr(text, '\n') : NULL;
        test_skip(PYTHON " cannot import numpy (install python3-numpy): %s",
                  last ? last + 1 : text && *text ? text : "no output");
        free(text);
        return 1;
    }
    return 0;
}

static void test_numpy_written(void) {
    char *log = test_path_join(tmp_root, "numpy.log"), *dir = test_path_join(tmp_root, "numpy");
    if (need_numpy(log)) goto out;
    CU_ASSERT_EQUAL_FATAL(mkdir(dir, 0700), 0);
    char *script = test_path_join(dir, "write.py");
    test_file_write(script, NUMPY_SCRIPT, sizeof NUMPY_SCRIPT - 1);
    char dtypes[512] = "";
    for (size_t i = 0; i < sizeof NUMPY_DTYPES / sizeof NUMPY_DTYPES[0]; i++)
        snprintf(dtypes + strlen(dtypes), sizeof dtypes - strlen(dtypes), " %s", NUMPY_DTYPES[i].numpy);
    int code = sh(log, PYTHON " %s %s%s", script, dir, dtypes);
    free(script);
    if (code != 0) {
        char *text = test_file_read(log, NULL);
        fprintf(stderr, "\n%s\n", text ? text : "(no output)");
        free(text);
    }
    CU_ASSERT_EQUAL_FATAL(code, 0);
    int checked = 0;
    for (size_t t = 0; t < sizeof NUMPY_DTYPES / sizeof NUMPY_DTYPES[0]; t++) {
        for (int rank = 0; rank <= 4; rank++) {
            for (int v = 1; v <= 3; v++) {
                char name[1024], bin[1024];
                snprintf(name, sizeof name, "%s/%s-r%d-v%d.npy", dir, NUMPY_DTYPES[t].numpy, rank, v);
                snprintf(bin, sizeof bin, "%s/%s-r%d-v%d.bin", dir, NUMPY_DTYPES[t].numpy, rank, v);
                NpyFile f;
                QtError err = {0};
                QtStatus st = npy_file_open(&f, name, &err);
                if (st != QT_OK) fprintf(stderr, "\n  %s\n", err.msg);
                CU_ASSERT_EQUAL(st, QT_OK);
                if (st != QT_OK) continue;
                const NpyInfo *in = &f.info;
                uint64_t n = 1;
                for (int i = 0; i < rank; i++) n *= (uint64_t)NUMPY_SHAPES[rank][i];
                CU_ASSERT_EQUAL(in->dtype, NUMPY_DTYPES[t].dtype);
                CU_ASSERT_STRING_EQUAL(npy_dtype_name(in->dtype), NUMPY_DTYPES[t].numpy);
                CU_ASSERT_EQUAL(in->elem_bytes, NUMPY_DTYPES[t].bytes);
                CU_ASSERT_EQUAL(npy_dtype_bytes(in->dtype), NUMPY_DTYPES[t].bytes);
                CU_ASSERT_EQUAL(in->version, v);
                CU_ASSERT_EQUAL(in->ndim, rank);
                CU_ASSERT(memcmp(in->shape, NUMPY_SHAPES[rank], sizeof(int64_t) * (size_t)rank) == 0);
                CU_ASSERT(in->n_elems == n && in->n_bytes == n * (uint64_t)NUMPY_DTYPES[t].bytes);
                CU_ASSERT_EQUAL(in->data_offset % 64, 0); /* NumPy aligns the data to 64 bytes */
                size_t want_len = 0;
                char *want = test_file_read(bin, &want_len);
                CU_ASSERT_FATAL(want != NULL);
                CU_ASSERT_EQUAL(want_len, in->n_bytes);
                if (rank >= 1 && want_len == in->n_bytes) {
                    uint8_t got[512];
                    uint64_t rows = (uint64_t)in->shape[0];
                    CU_ASSERT_EQUAL(npy_file_read_rows(&f, 0, rows, got, sizeof got, &err), QT_OK);
                    CU_ASSERT(memcmp(got, want, want_len) == 0);
                    CU_ASSERT_EQUAL(npy_file_read_rows(&f, rows - 1, 1, got, sizeof got, &err), QT_OK);
                    CU_ASSERT(memcmp(got, want + (rows - 1) * f.row_bytes, f.row_bytes) == 0);
                }
                free(want);
                npy_file_close(&f);
                checked++;
            }
        }
        char name[1024];
        NpyInfo info;
        QtError err = {0};
        snprintf(name, sizeof name, "%s/%s-fortran.npy", dir, NUMPY_DTYPES[t].numpy);
        CU_ASSERT_EQUAL(npy_read_info(name, &info, &err), QT_ERR_FORMAT);
        CU_ASSERT(test_msg_has(&err, "Fortran order"));
        if (NUMPY_DTYPES[t].bytes > 1) {
            qt_error_clear(&err);
            snprintf(name, sizeof name, "%s/%s-big.npy", dir, NUMPY_DTYPES[t].numpy);
            CU_ASSERT_EQUAL(npy_read_info(name, &info, &err), QT_ERR_FORMAT);
            CU_ASSERT(test_msg_has(&err, "big-endian"));
        }
    }
    CU_ASSERT_EQUAL(checked, 12 * 5 * 3);
out:
    free(log);
    free(dir);
}

int register_data_npy_suite(void) {
    CU_pSuite s = CU_add_suite("data_npy", npy_suite_init, npy_suite_cleanup);
    if (!s) return -1;
    return !CU_add_test(s, "files written by NumPy: 12 dtypes, ranks 0-4, versions 1.0-3.0", test_numpy_written) ||
           !CU_add_test(s, "accepted header variants", test_built_good) ||
           !CU_add_test(s, "bad magic", test_bad_magic) ||
           !CU_add_test(s, "truncated preamble", test_truncated_header) ||
           !CU_add_test(s, "header length past the file", test_header_length_past_file) ||
           !CU_add_test(s, "missing key", test_missing_key) || !CU_add_test(s, "extra key", test_extra_key) ||
           !CU_add_test(s, "big-endian", test_big_endian) || !CU_add_test(s, "Fortran order", test_fortran_order) ||
           !CU_add_test(s, "object, structured and other dtypes", test_unsupported_dtypes) ||
           !CU_add_test(s, "negative or huge shape", test_negative_or_huge_shape) ||
           !CU_add_test(s, "shape product overflow", test_product_overflow) ||
           !CU_add_test(s, "file shorter than the header says", test_file_shorter) ||
           !CU_add_test(s, "file longer than the header says", test_file_longer) ||
           !CU_add_test(s, "garbage or non-ASCII in the dict", test_garbage_in_dict) ||
           !CU_add_test(s, "missing file, directory, FIFO", test_not_a_file) ||
           !CU_add_test(s, "rows by pread", test_read_rows);
}
