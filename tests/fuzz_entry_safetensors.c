/* fuzz_entry_safetensors.c - the safetensors target: the input is a whole
 * .safetensors file, parsed from memory (st_parse) and opened as a file
 * (st_open).
 *
 * Checked besides crashes: both agree (status, message, tensors, metadata);
 * an accepted header is consistent (known dtypes, ranks, names unique and
 * non-empty, each byte range the shape's product times the dtype's size,
 * the ranges tiling the data exactly) and describes exactly this file (one
 * byte more is refused); every float tensor reads with st_read_f32 (F32
 * bit for bit as stored), an integer one is refused; and the float tensors
 * written again by st_write_f32 with the metadata read back the same. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/safetensors.h"
#include "fuzz_harness.h"

static int cmp_u64(const void *a, const void *b) {
    const uint64_t *x = a, *y = b;
    return x[0] != y[0] ? (x[0] < y[0] ? -1 : 1) : x[1] != y[1] ? (x[1] < y[1] ? -1 : 1) : 0;
}

/* The accepted header's promises, checked from scratch. */
static int check_header(const StFile *f, size_t size, char *why, size_t why_cap) {
    uint64_t data = size - f->data_start;
    if (f->data_start < 8 || f->data_start > size || f->file_size != size || f->n < 0 || f->n_meta < 0) {
        snprintf(why, why_cap, "accepted with data_start %" PRIu64 ", file_size %" PRIu64 " of a %zu-byte input",
                 f->data_start, f->file_size, size);
        return 1;
    }
    uint64_t *r = malloc((size_t)(f->n ? f->n : 1) * 2 * sizeof *r);
    if (!r) {
        snprintf(why, why_cap, "out of memory");
        return 1;
    }
    for (int k = 0; k < f->n; k++) {
        const StTensor *t = &f->tensors[k];
        const char *bad = NULL;
        if ((unsigned)t->dtype >= ST_DTYPE_COUNT) bad = "dtype";
        else if (t->ndim < 0 || t->ndim > ST_MAX_DIMS) bad = "ndim";
        else if (memchr(t->name, 0, ST_NAME_MAX) == NULL || t->name[0] == 0) bad = "name";
        uint64_t bytes = bad ? 0 : st_dtype_bytes(t->dtype);
        bool over = false, zero = false;
        for (int d = 0; !bad && d < t->ndim; d++) {
            uint64_t s = (uint64_t)t->shape[d];
            if (t->shape[d] < 0) bad = "shape";
            else if (s == 0) zero = true;
            else if (bytes > UINT64_MAX / s) over = true;
            else bytes *= s;
        }
        if (zero) bytes = 0, over = false;
        if (!bad && (over || t->begin > t->end || t->end - t->begin != bytes)) bad = "byte range against the shape";
        else if (!bad && t->end > data) bad = "byte range past the data";
        for (int j = 0; !bad && j < k; j++)
            if (strcmp(f->tensors[j].name, t->name) == 0) bad = "duplicate name";
        if (bad) {
            snprintf(why, why_cap, "st_parse accepted tensor %d with a bad %s", k, bad);
            free(r);
            return 1;
        }
        r[2 * k] = t->begin, r[2 * k + 1] = t->end;
    }
    qsort(r, (size_t)f->n, 2 * sizeof *r, cmp_u64);
    uint64_t at = 0;
    for (int k = 0; k < f->n; k++) {
        if (r[2 * k] != at) {
            snprintf(why, why_cap, "st_parse accepted ranges that do not tile the data (a range starts at %" PRIu64
                     ", the previous ended at %" PRIu64 ")", r[2 * k], at);
            free(r);
            return 1;
        }
        at = r[2 * k + 1];
    }
    free(r);
    if (at != data) {
        snprintf(why, why_cap, "st_parse accepted ranges ending at %" PRIu64 " of %" PRIu64 " data bytes", at, data);
        return 1;
    }
    for (int m = 0; m < f->n_meta; m++)
        if (!f->meta[m].value || memchr(f->meta[m].key, 0, ST_NAME_MAX) == NULL) {
            snprintf(why, why_cap, "st_parse accepted metadata entry %d without a value or key", m);
            return 1;
        }
    return 0;
}

/* Both parses agree: status, message and (accepted) everything parsed. */
static int same(const StFile *a, const StFile *b, char *why, size_t why_cap) {
    bool eq = a->n == b->n && a->n_meta == b->n_meta && a->data_start == b->data_start &&
              a->file_size == b->file_size &&
              (a->n == 0 || memcmp(a->tensors, b->tensors, (size_t)a->n * sizeof *a->tensors) == 0);
    for (int m = 0; eq && m < a->n_meta; m++)
        eq = strcmp(a->meta[m].key, b->meta[m].key) == 0 && strcmp(a->meta[m].value, b->meta[m].value) == 0;
    if (!eq) snprintf(why, why_cap, "st_open and st_parse accepted the file with different contents");
    return !eq;
}

/* Every tensor read: floats succeed (F32 as stored), integers are refused. Then the float tensors and the
 * metadata written again read back the same. */
static int check_reads(const StFile *f, const uint8_t *data, char *why, size_t why_cap) {
    StWrite *w = calloc((size_t)(f->n ? f->n : 1), sizeof *w);
    const char *(*meta)[2] = calloc((size_t)(f->n_meta ? f->n_meta : 1), sizeof *meta);
    float **vals = calloc((size_t)(f->n ? f->n : 1), sizeof *vals);
    int nw = 0, bad = 0;
    if (!w || !meta || !vals) {
        snprintf(why, why_cap, "out of memory");
        bad = 1;
    }
    for (int k = 0; !bad && k < f->n; k++) {
        const StTensor *t = &f->tensors[k];
        size_t n = (size_t)((t->end - t->begin) / st_dtype_bytes(t->dtype));
        bool fl = t->dtype == ST_F32 || t->dtype == ST_F16 || t->dtype == ST_BF16 || t->dtype == ST_F64;
        float *out = malloc((n ? n : 1) * sizeof *out);
        QtError err = {0};
        QtStatus st = out ? st_read_f32(f, t, out, n, &err) : QT_ERR_NOMEM;
        bad = fuzz_check_status("st_read_f32", st, &err, why, why_cap);
        if (!bad && st != (fl ? QT_OK : QT_ERR_FORMAT)) {
            snprintf(why, why_cap, "st_read_f32 of a %s tensor gave status %d (%s)", st_dtype_name(t->dtype), (int)st,
                     err.msg);
            bad = 1;
        }
        if (!bad && t->dtype == ST_F32 && n && memcmp(out, data + f->data_start + t->begin, n * 4) != 0) {
            snprintf(why, why_cap, "st_read_f32 of F32 tensor %d differs from the file's bytes", k);
            bad = 1;
        }
        if (!bad && fl) {
            w[nw].name = t->name;
            w[nw].data = n ? out : NULL;
            w[nw].ndim = t->ndim;
            memcpy(w[nw].shape, t->shape, sizeof t->shape);
            vals[nw++] = out;
        } else free(out);
    }
    for (int m = 0; !bad && m < f->n_meta; m++) meta[m][0] = f->meta[m].key, meta[m][1] = f->meta[m].value;
    char path[512];
    if (!bad && fuzz_write_file("rewritten.safetensors", "", 0, path, sizeof path) != 0) {
        snprintf(why, why_cap, "cannot write the scratch file");
        bad = 1;
    }
    if (!bad) {
        QtError err = {0};
        QtStatus st = st_write_f32(path, w, nw, (const char *const(*)[2])meta, f->n_meta, &err);
        bad = fuzz_check_status("st_write_f32", st, &err, why, why_cap);
        if (!bad && st != QT_OK) {
            snprintf(why, why_cap, "st_write_f32 refused what st_open accepted: %s", err.msg);
            bad = 1;
        }
        StFile g;
        if (!bad) {
            st = st_open(&g, path, &err);
            bad = fuzz_check_status("st_open (rewritten)", st, &err, why, why_cap);
            if (!bad && st != QT_OK) {
                snprintf(why, why_cap, "st_open refused what st_write_f32 wrote: %s", err.msg);
                bad = 1;
            }
            if (!bad) {
                bool eq = g.n == nw && g.n_meta == f->n_meta && g.data_start % 8 == 0;
                for (int k = 0; eq && k < nw; k++) {
                    const StTensor *t = &g.tensors[k];
                    size_t n = (size_t)((t->end - t->begin) / 4);
                    float *back = malloc((n ? n : 1) * sizeof *back);
                    eq = back && strcmp(t->name, w[k].name) == 0 && t->ndim == w[k].ndim && t->dtype == ST_F32 &&
                         memcmp(t->shape, w[k].shape, sizeof t->shape) == 0 &&
                         st_read_f32(&g, t, back, n, &err) == QT_OK && (!n || memcmp(back, w[k].data, n * 4) == 0);
                    free(back);
                }
                for (int m = 0; eq && m < g.n_meta; m++)
                    eq = strcmp(st_meta(&g, meta[m][0]) ? st_meta(&g, meta[m][0]) : "\x01", meta[m][1]) == 0;
                if (!eq) {
                    snprintf(why, why_cap, "the float tensors written again by st_write_f32 read back differently");
                    bad = 1;
                }
                st_close(&g);
            }
        }
    }
    for (int k = 0; k < nw; k++) free(vals[k]);
    free(vals);
    free(w);
    free(meta);
    return bad;
}

int fuzz_safetensors_one(const uint8_t *data, size_t size, char *why, size_t why_cap) {
    char path[512];
    if (fuzz_write_file("input.safetensors", data, size, path, sizeof path) != 0) {
        snprintf(why, why_cap, "cannot write the scratch .safetensors file");
        return 1;
    }
    StFile mem, file;
    QtError merr = {0}, ferr = {0};
    QtStatus mst = st_parse(&mem, data, size, size, path, &merr);
    if (fuzz_check_status("st_parse", mst, &merr, why, why_cap)) return 1;
    if (mst == QT_ERR_ARG) {
        snprintf(why, why_cap, "st_parse of a whole file blamed its caller: %s", merr.msg);
        return 1;
    }
    QtStatus fst = st_open(&file, path, &ferr);
    int bad = fuzz_check_status("st_open", fst, &ferr, why, why_cap);
    if (!bad && (fst != mst || strcmp(ferr.msg, merr.msg) != 0)) {
        snprintf(why, why_cap, "st_open disagrees with st_parse: status %d vs %d (%s | %s)", (int)fst, (int)mst,
                 ferr.msg, merr.msg);
        bad = 1;
    }
    if (!bad && mst == QT_OK) bad = same(&mem, &file, why, why_cap) || check_header(&mem, size, why, why_cap);
    if (!bad && mst == QT_OK) {
        /* the same bytes in a file one byte longer are refused: the tensors must cover the data exactly */
        StFile longer;
        QtError lerr = {0};
        QtStatus lst = st_parse(&longer, data, size, (uint64_t)size + 1, path, &lerr);
        bad = fuzz_check_status("st_parse (one byte longer)", lst, &lerr, why, why_cap);
        if (!bad && lst != QT_ERR_FORMAT) {
            snprintf(why, why_cap, "the header of a %zu-byte file was accepted for one a byte longer (status %d)",
                     size, (int)lst);
            bad = 1;
        }
        if (lst == QT_OK) st_close(&longer);
    }
    if (!bad && fst == QT_OK) bad = check_reads(&file, data, why, why_cap);
    if (mst == QT_OK) st_close(&mem);
    if (fst == QT_OK) st_close(&file);
    return bad;
}
