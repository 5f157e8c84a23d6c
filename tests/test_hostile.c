/* test_hostile.c - crafted checkpoints and adapter files, each through every
 * command that loads one (a resume, model.init_from, model.adapters_from,
 * eval, inspect, quantize, merge), run as the qtrain binary: each must be
 * refused with a message naming the dataset or attribute, never read. The
 * files are made at test time through the HDF5 API from two tiny runs: a
 * float base (tiny-base.yaml) and a QLoRA run over it (tiny-qlora.yaml).
 *
 *   ext_passwd   a parameter stored externally in /etc/passwd
 *   ext_fifo     ... in a FIFO (reading it would block for good)
 *   vds_missing  a parameter as a virtual dataset whose source is missing
 *   vds_fifo     ... whose source is a FIFO (opening it would block)
 *   elink_param  a parameter as an external link to a FIFO
 *   elink_group  /data (attributes only, read by a resume) as one
 *   soft_link    a parameter as a soft link to a dataset of its shape
 *   filter       a parameter through the lossy scale-offset filter
 *   chunk_huge   a parameter chunked as 2^22 elements (a memory bomb)
 *   unalloc      a parameter never written (it reads as zeros)
 *   bomb_small   a parameter in one deflated chunk that inflates to 64 KiB
 *   bomb_big     ... to 8 MiB (libhdf5 would inflate all of it)
 *   vlen_damaged the root 'format' attribute as a variable-length string
 *                whose global heap entry is damaged
 *   nan, negative    a dataset's first value NaN or -1 (for the corpus)
 *   chunk_huge_raw   chunk_huge with one short chunk (a small file, for the corpus)
 *
 * The committed corpus tests/hostile/ is made by these and replayed by
 * test_hostile_corpus.c.
 *
 * A FIFO that nobody writes blocks its reader, so a loader that touched one
 * would hang: every run has a timeout (test_proc), and a killed run fails. */
#include <errno.h>
#include <hdf5.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zlib.h>

#include "test_hostile.h"
#include "test_proc.h"
#include "test_util.h"
#include "base/h5io.h"

#define RUN_TIMEOUT_S 120.0 /* a sanitizer build is slow; a run blocked on a FIFO is killed */
#define PATH_CAP 1024

static char *tmp_root;
static char base_ckpt[PATH_CAP], lora_ckpt[PATH_CAP], lora_adapters[PATH_CAP], fifo_path[PATH_CAP];

static char *path_in(const char *name) {
    static char buf[8][PATH_CAP];
    static int k;
    k = (k + 1) % 8;
    snprintf(buf[k], sizeof buf[k], "%s/%s", tmp_root, name);
    return buf[k];
}

/* Runs qtrain with args; its exit status (-1: killed or a signal) and its output in *out (malloc'd). */
int hostile_qtrain_run(const char *const *args, char **out) {
    char *log = path_in("run.log");
    unlink(log);
    int rc = test_proc_run(log, args, RUN_TIMEOUT_S);
    char *text = test_file_read(log, NULL);
    *out = text ? text : calloc(1, 1);
    return rc;
}

static int hostile_suite_init(void) {
    h5io_init();
    tmp_root = test_tmpdir_new();
    if (!tmp_root) return -1;
    snprintf(base_ckpt, sizeof base_ckpt, "%s/base/final.h5", tmp_root);
    snprintf(lora_ckpt, sizeof lora_ckpt, "%s/lora/final.h5", tmp_root);
    snprintf(lora_adapters, sizeof lora_adapters, "%s/lora/adapters.h5", tmp_root);
    snprintf(fifo_path, sizeof fifo_path, "%s/fifo", tmp_root);
    if (mkfifo(fifo_path, 0600) != 0) {
        fprintf(stderr, "\n  mkfifo %s: %s\n", fifo_path, strerror(errno));
        return -1;
    }
    char out_base[PATH_CAP + 32], out_lora[PATH_CAP + 32], init[PATH_CAP + 32];
    snprintf(out_base, sizeof out_base, "run.out_dir=%s/base", tmp_root);
    snprintf(out_lora, sizeof out_lora, "run.out_dir=%s/lora", tmp_root);
    snprintf(init, sizeof init, "model.init_from=%s", base_ckpt);
    const char *base[] = {"--config", "tests/configs/tiny-base.yaml", "--set", out_base, "--set", "train.steps=2",
                          "--set", "train.log_every=1", "--quiet", NULL};
    const char *lora[] = {"--config", "tests/configs/tiny-qlora.yaml", "--set", out_lora, "--set", init, "--set",
                          "train.steps=2", "--set", "train.log_every=1", "--set", "train.checkpoint_every=2",
                          "--quiet", NULL};
    char *log = NULL;
    int rc = hostile_qtrain_run(base, &log);
    if (rc == 0) {
        free(log);
        rc = hostile_qtrain_run(lora, &log);
    }
    if (rc != 0) fprintf(stderr, "\n  setup run: exit %d: %s\n", rc, log);
    free(log);
    return rc == 0 && test_file_exists(tmp_root, "lora/adapters.h5") ? 0 : -1;
}

static int hostile_suite_cleanup(void) {
    bool ok = test_tmpdir_remove(tmp_root);
    tmp_root = NULL;
    return ok ? 0 : -1;
}

/* ---- crafting ------------------------------------------------------------------------------ */

const char *const HOSTILE_NAMES[] = {"ext_passwd", "ext_fifo", "vds_missing", "vds_fifo", "elink_param",
                                     "elink_group", "soft_link", "filter", "chunk_huge", "unalloc",
                                     "bomb_small", "bomb_big", "vlen_damaged", "nan", "negative",
                                     "chunk_huge_raw"};

const char *hostile_tmp(void) { return tmp_root; }

/* The rank and shape of dataset ds of f; -1 if there is none. */
static int ds_dims(hid_t f, const char *ds, hsize_t *dims) {
    hid_t d = H5Dopen2(f, ds, H5P_DEFAULT);
    if (d < 0) return -1;
    hid_t s = H5Dget_space(d);
    int rank = H5Sget_simple_extent_dims(s, dims, NULL);
    H5Sclose(s);
    H5Dclose(d);
    return rank;
}

/* Replaces float32 dataset ds of f (its shape kept) by one made with dcpl and,
 * if write is set, written with 0.5s. */
static bool replace_dataset(hid_t f, const char *ds, hid_t dcpl, bool write, bool unlimited) {
    hid_t d = H5Dopen2(f, ds, H5P_DEFAULT);
    if (d < 0) return false;
    hid_t s = H5Dget_space(d);
    H5Dclose(d);
    hsize_t dims[H5S_MAX_RANK], max[H5S_MAX_RANK];
    int rank = H5Sget_simple_extent_dims(s, dims, NULL);
    hssize_t n = H5Sget_simple_extent_npoints(s);
    H5Sclose(s);
    for (int i = 0; i < rank; i++) max[i] = unlimited ? H5S_UNLIMITED : dims[i];
    s = H5Screate_simple(rank, dims, max);
    bool ok = H5Ldelete(f, ds, H5P_DEFAULT) >= 0;
    d = ok ? H5Dcreate2(f, ds, H5T_IEEE_F32LE, s, H5P_DEFAULT, dcpl, H5P_DEFAULT) : H5I_INVALID_HID;
    ok = d >= 0;
    if (ok && write) {
        float *v = malloc((size_t)n * sizeof *v);
        for (hssize_t i = 0; v && i < n; i++) v[i] = 0.5f;
        ok = v && H5Dwrite(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, v) >= 0;
        free(v);
    }
    if (d >= 0) H5Dclose(d);
    H5Sclose(s);
    return ok;
}

/* A virtual dataset over all of ds, mapped from /x of file src. */
static bool make_virtual(hid_t f, const char *ds, const char *src) {
    hid_t d = H5Dopen2(f, ds, H5P_DEFAULT);
    if (d < 0) return false;
    hid_t s = H5Dget_space(d);
    H5Dclose(d);
    hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
    bool ok = H5Pset_virtual(dcpl, s, src, "/x", s) >= 0;
    H5Sclose(s);
    ok = ok && replace_dataset(f, ds, dcpl, false, false);
    H5Pclose(dcpl);
    return ok;
}

/* Damages the first global heap object's size field (GCOL collection,
 * 16-byte header, then index, refcount, reserved, size) in the file. */
static bool damage_global_heap(const char *path) {
    size_t n = 0;
    char *b = test_file_read(path, &n);
    if (!b) return false;
    char *g = NULL;
    for (size_t i = 0; i + 4 <= n && !g; i++)
        if (memcmp(b + i, "GCOL", 4) == 0) g = b + i;
    bool ok = g && (size_t)(g - b) + 16 + 16 <= n;
    if (ok) {
        uint64_t huge = 0x7ffffff0u;
        memcpy(g + 16 + 8, &huge, sizeof huge); /* little-endian like the file */
        test_file_write(path, b, n);
    }
    free(b);
    return ok;
}

/* Sets element 0 of float32 dataset ds of f to x. */
static bool poke_first(hid_t f, const char *ds, float x) {
    hsize_t dims[H5S_MAX_RANK], n = 1;
    int rank = ds_dims(f, ds, dims);
    for (int i = 0; i < rank; i++) n *= dims[i];
    hid_t d = rank > 0 ? H5Dopen2(f, ds, H5P_DEFAULT) : H5I_INVALID_HID;
    float *v = d >= 0 ? malloc(n * sizeof *v) : NULL;
    bool ok = v && H5Dread(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, v) >= 0;
    if (ok) v[0] = x;
    ok = ok && H5Dwrite(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, v) >= 0;
    free(v);
    if (d >= 0) H5Dclose(d);
    return ok;
}

/* Copies src to <tmp>/<name>-<h>.h5 and makes it hostile at dataset ds.
 * An external link or a virtual dataset's source points at `elsewhere`
 * (NULL: the suite's FIFO, or a missing file in the temporary directory). */
const char *hostile_craft(Hostile h, const char *src, const char *name, const char *ds, const char *elsewhere) {
    static char out[PATH_CAP];
    snprintf(out, sizeof out, "%s/%s-%s.h5", tmp_root, name, HOSTILE_NAMES[h]);
    if (!test_file_copy(src, out)) return NULL;
    hid_t f = H5Fopen(out, H5F_ACC_RDWR, H5P_DEFAULT);
    if (f < 0) return NULL;
    hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
    bool ok = true;
    switch (h) {
    case EXT_PASSWD:
    case EXT_FIFO:
        ok = H5Pset_external(dcpl, h == EXT_PASSWD ? "/etc/passwd" : fifo_path, 0, H5F_UNLIMITED) >= 0 &&
             replace_dataset(f, ds, dcpl, false, false);
        break;
    case VDS_MISSING: ok = make_virtual(f, ds, elsewhere ? elsewhere : path_in("missing-source.h5")); break;
    case VDS_FIFO: ok = make_virtual(f, ds, elsewhere ? elsewhere : fifo_path); break;
    case ELINK_PARAM:
        ok = H5Ldelete(f, ds, H5P_DEFAULT) >= 0 &&
             H5Lcreate_external(elsewhere ? elsewhere : fifo_path, ds, f, ds, H5P_DEFAULT, H5P_DEFAULT) >= 0;
        break;
    case ELINK_GROUP:
        ok = H5Ldelete(f, "/data", H5P_DEFAULT) >= 0 &&
             H5Lcreate_external(elsewhere ? elsewhere : fifo_path, "/data", f, "/data", H5P_DEFAULT, H5P_DEFAULT) >= 0;
        break;
    case SOFT_LINK: {
        char target[256];
        snprintf(target, sizeof target, "/optim%s/m", ds + strlen("/params"));
        ok = H5Ldelete(f, ds, H5P_DEFAULT) >= 0 && H5Lcreate_soft(target, f, ds, H5P_DEFAULT, H5P_DEFAULT) >= 0;
        break;
    }
    case FILTER: {
        hsize_t chunk[H5S_MAX_RANK];
        int rank = ds_dims(f, ds, chunk);
        ok = rank > 0 && H5Pset_chunk(dcpl, rank, chunk) >= 0 &&
             H5Pset_scaleoffset(dcpl, H5Z_SO_FLOAT_DSCALE, 1) >= 0 && replace_dataset(f, ds, dcpl, true, false);
        break;
    }
    case CHUNK_HUGE:
    case CHUNK_HUGE_RAW: {
        hsize_t chunk[H5S_MAX_RANK], off[H5S_MAX_RANK] = {0};
        int rank = ds_dims(f, ds, chunk);
        hsize_t rest = 1, n = chunk[0];
        for (int i = 1; i < rank; i++) rest *= chunk[i];
        chunk[0] = ((hsize_t)1 << 22) / rest; /* 16 MiB chunks, far beyond the dataset */
        ok = rank > 0 && H5Pset_chunk(dcpl, rank, chunk) >= 0 && H5Pset_deflate(dcpl, 9) >= 0 &&
             replace_dataset(f, ds, dcpl, h == CHUNK_HUGE, true);
        if (ok && h == CHUNK_HUGE_RAW) { /* one chunk of the dataset's size of zeros, deflated: a small file */
            uLong len = (uLong)(n * rest * sizeof(float));
            uLongf packed_n = compressBound(len);
            Bytef *raw = calloc(len, 1), *packed = malloc(packed_n);
            hid_t d = H5Dopen2(f, ds, H5P_DEFAULT);
            ok = raw && packed && d >= 0 && compress2(packed, &packed_n, raw, len, 9) == Z_OK &&
                 H5Dwrite_chunk(d, H5P_DEFAULT, 0, off, packed_n, packed) >= 0;
            if (d >= 0) H5Dclose(d);
            free(raw);
            free(packed);
        }
        break;
    }
    case UNALLOC: ok = replace_dataset(f, ds, dcpl, false, false); break;
    case BOMB_SMALL:
    case BOMB_BIG: { /* one chunk of the whole dataset, written raw: a stream of zeros far longer than it */
        hsize_t chunk[H5S_MAX_RANK], off[H5S_MAX_RANK] = {0};
        int rank = ds_dims(f, ds, chunk);
        uLong n = h == BOMB_SMALL ? 1ul << 16 : 8ul << 20;
        uLongf packed_n = compressBound(n);
        Bytef *zeros = calloc(n, 1), *packed = malloc(packed_n);
        ok = rank > 0 && zeros && packed && compress2(packed, &packed_n, zeros, n, 9) == Z_OK &&
             H5Pset_chunk(dcpl, rank, chunk) >= 0 && H5Pset_deflate(dcpl, 9) >= 0 &&
             replace_dataset(f, ds, dcpl, false, false);
        hid_t d = ok ? H5Dopen2(f, ds, H5P_DEFAULT) : H5I_INVALID_HID;
        ok = d >= 0 && H5Dwrite_chunk(d, H5P_DEFAULT, 0, off, packed_n, packed) >= 0;
        if (d >= 0) H5Dclose(d);
        free(zeros);
        free(packed);
        break;
    }
    case VLEN_DAMAGED: {
        hid_t t = H5Tcopy(H5T_C_S1), s = H5Screate(H5S_SCALAR);
        const char *v = "qtrain";
        H5Tset_size(t, H5T_VARIABLE);
        ok = H5Adelete(f, "format") >= 0;
        hid_t a = ok ? H5Acreate2(f, "format", t, s, H5P_DEFAULT, H5P_DEFAULT) : H5I_INVALID_HID;
        ok = a >= 0 && H5Awrite(a, t, &v) >= 0;
        if (a >= 0) H5Aclose(a);
        H5Sclose(s);
        H5Tclose(t);
        break;
    }
    case NAN_VALUE: ok = poke_first(f, ds, NAN); break;
    case NEGATIVE_VALUE: ok = poke_first(f, ds, -1.0f); break;
    }
    H5Pclose(dcpl);
    if (H5Fclose(f) < 0) ok = false;
    if (ok && h == VLEN_DAMAGED) ok = damage_global_heap(out);
    if (!ok) fprintf(stderr, "\n  cannot craft %s from %s at %s\n", HOSTILE_NAMES[h], src, ds);
    return ok ? out : NULL;
}

/* ---- loading ------------------------------------------------------------------------------- */

typedef enum { L_RESUME, L_INIT_FROM, L_EVAL, L_INSPECT, L_QUANTIZE, L_MERGE, L_ADAPTERS_FROM } Loader;

static const char *const LOADER_NAMES[] = {"--resume", "model.init_from", "eval", "inspect", "quantize", "merge",
                                           "model.adapters_from"};

/* Runs loader l on file; expects a refusal (exit status 1 or 2, not killed)
 * whose message names `what` and shows nothing of /etc/passwd. */
static void expect_refused(Loader l, const char *file, const char *what, const char *hostile) {
    char out_dir[PATH_CAP + 32], from[PATH_CAP + 32], init[PATH_CAP + 32];
    snprintf(out_dir, sizeof out_dir, "run.out_dir=%s/out-%d", tmp_root, (int)l);
    snprintf(init, sizeof init, "model.init_from=%s", base_ckpt);
    const char *args[24] = {0};
    switch (l) {
    case L_RESUME: {
        const char *a[] = {"--config", "tests/configs/tiny-base.yaml", "--set", out_dir, "--set", "train.steps=3",
                           "--resume", file, "--quiet", NULL};
        memcpy(args, a, sizeof a);
        break;
    }
    case L_INIT_FROM: {
        snprintf(from, sizeof from, "model.init_from=%s", file);
        const char *a[] = {"--config", "tests/configs/tiny-base.yaml", "--set", out_dir, "--set", from, "--set",
                           "train.steps=1", "--quiet", NULL};
        memcpy(args, a, sizeof a);
        break;
    }
    case L_EVAL: {
        const char *a[] = {"eval", "--config", "tests/configs/tiny-base.yaml", "--checkpoint", file, "--set", out_dir,
                           "--quiet", NULL};
        memcpy(args, a, sizeof a);
        break;
    }
    case L_INSPECT: {
        const char *a[] = {"inspect", file, NULL};
        memcpy(args, a, sizeof a);
        break;
    }
    case L_QUANTIZE: {
        const char *a[] = {"quantize", "--config", "tests/configs/tiny-qlora.yaml", "--checkpoint", file, "--out",
                           path_in("quantized.h5"), NULL};
        memcpy(args, a, sizeof a);
        break;
    }
    case L_MERGE: {
        const char *a[] = {"merge", "--checkpoint", file, "--out", path_in("merged.h5"), NULL};
        memcpy(args, a, sizeof a);
        break;
    }
    case L_ADAPTERS_FROM: {
        snprintf(from, sizeof from, "model.adapters_from=%s", file);
        const char *a[] = {"--config", "tests/configs/tiny-qlora.yaml", "--set", out_dir, "--set", init, "--set", from,
                           "--set", "train.steps=1", "--quiet", NULL};
        memcpy(args, a, sizeof a);
        break;
    }
    }
    char *log = NULL;
    int rc = hostile_qtrain_run(args, &log);
    /* inspect lists a link as one, without following it */
    bool listed = l == L_INSPECT && strstr(hostile, "link") && rc == 0 && strstr(log, "not followed");
    if (listed) rc = 1;
    bool named = strstr(log, what) != NULL;
    bool leaked = strstr(log, "root:") != NULL;
    if (getenv("QTRAIN_TEST_VERBOSE")) /* every output, to read the messages */
        fprintf(stderr, "\n  %s on %s: exit %d:\n%s\n", LOADER_NAMES[l], hostile, rc, log);
    if (rc != 1 && rc != 2)
        fprintf(stderr, "\n  %s on %s: exit status %d (-1: killed, a hang?), expected a refusal; output:\n%s\n",
                LOADER_NAMES[l], hostile, rc, log);
    else if (!named || leaked)
        fprintf(stderr, "\n  %s on %s: the message does not name %s%s:\n%s\n", LOADER_NAMES[l], hostile, what,
                leaked ? " (and shows /etc/passwd)" : "", log);
    CU_ASSERT(rc == 1 || rc == 2);
    CU_ASSERT(named && !leaked);
    free(log);
    unlink(path_in("quantized.h5"));
    unlink(path_in("merged.h5"));
}

/* Each hostile file made from the float base, through each loader of a base. */
static void test_base_files(void) {
    static const Loader loaders[] = {L_RESUME, L_INIT_FROM, L_EVAL, L_INSPECT, L_QUANTIZE};
    const char *ds = "/params/fc1/bias";
    for (int h = EXT_PASSWD; h <= VLEN_DAMAGED; h++) {
        const char *file = hostile_craft((Hostile)h, base_ckpt, "base", ds, NULL);
        CU_ASSERT_PTR_NOT_NULL(file);
        if (!file) continue;
        const char *what = h == VLEN_DAMAGED ? "'format'" : h == ELINK_GROUP ? "/data" : ds;
        for (size_t k = 0; k < sizeof loaders / sizeof loaders[0]; k++) {
            /* /data is read by a resume only; inspect lists a link without following it. */
            if (h == ELINK_GROUP && loaders[k] != L_RESUME) continue;
            expect_refused(loaders[k], file, what, HOSTILE_NAMES[h]);
        }
    }
}

/* The same in a LoRA run's checkpoint (merge) and its adapters.h5 (model.adapters_from). */
static void test_lora_files(void) {
    static const Hostile hs[] = {EXT_PASSWD, EXT_FIFO, VDS_MISSING, VDS_FIFO, ELINK_PARAM, FILTER, CHUNK_HUGE,
                                 UNALLOC, BOMB_SMALL};
    const char *ds = "/lora/fc1/A";
    for (size_t i = 0; i < sizeof hs / sizeof hs[0]; i++) {
        const char *file = hostile_craft(hs[i], lora_ckpt, "lora", ds, NULL);
        CU_ASSERT_PTR_NOT_NULL(file);
        if (file) expect_refused(L_MERGE, file, ds, HOSTILE_NAMES[hs[i]]);
        file = hostile_craft(hs[i], lora_adapters, "adapters", ds, NULL);
        CU_ASSERT_PTR_NOT_NULL(file);
        if (file) expect_refused(L_ADAPTERS_FROM, file, ds, HOSTILE_NAMES[hs[i]]);
    }
}

/* The h5io check in-process: a file of qtrain's own (contiguous) and one as
 * h5py writes compressed arrays (chunks within the dataset, deflate and
 * shuffle, str attributes variable-length) both still load. */
static void test_accepted_layouts(void) {
    const char *path = path_in("h5py-like.h5");
    hid_t f = H5Fcreate(path, H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
    hsize_t dims[2] = {5, 7}, chunk[2] = {3, 7};
    H5Pset_chunk(dcpl, 2, chunk);
    H5Pset_shuffle(dcpl);
    H5Pset_deflate(dcpl, 4);
    H5Pset_fletcher32(dcpl);
    hid_t s = H5Screate_simple(2, dims, NULL);
    hid_t d = H5Dcreate2(f, "w", H5T_IEEE_F32LE, s, H5P_DEFAULT, dcpl, H5P_DEFAULT);
    float w[35];
    for (int i = 0; i < 35; i++) w[i] = (float)i * 0.25f;
    CU_ASSERT(H5Dwrite(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, w) >= 0);
    H5Dclose(d);
    hid_t t = H5Tcopy(H5T_C_S1), sc = H5Screate(H5S_SCALAR);
    H5Tset_size(t, H5T_VARIABLE);
    H5Tset_cset(t, H5T_CSET_UTF8);
    const char *v = "qtrain";
    hid_t a = H5Acreate2(f, "format", t, sc, H5P_DEFAULT, H5P_DEFAULT);
    CU_ASSERT(H5Awrite(a, t, &v) >= 0);
    H5Aclose(a);
    H5Tclose(t);
    H5Sclose(sc);
    H5Sclose(s);
    H5Pclose(dcpl);
    H5Fclose(f);

    H5ioFile hf = H5IO_FILE_INIT;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(h5io_open(&hf, path, &err), QT_OK);
    float got[35];
    char *fmt = NULL;
    CU_ASSERT_EQUAL(h5io_read_f32(&hf, "w", got, 2, (int[]){5, 7}, &err), QT_OK);
    CU_ASSERT_EQUAL(memcmp(got, w, sizeof w), 0);
    CU_ASSERT_EQUAL(h5io_attr_read_str(&hf, "", "format", &fmt, &err), QT_OK);
    CU_ASSERT(fmt && strcmp(fmt, "qtrain") == 0);
    free(fmt);
    if (err.status) fprintf(stderr, "\n  %s\n", err.msg);
    CU_ASSERT_EQUAL(h5io_close(&hf, &err), QT_OK);
    test_assert_hdf5_closed();
}

/* In-process, through h5io: a chunked dataset with one of its chunks
 * written is refused (H5Dget_space_status calls compressed chunks partly
 * allocated, so the chunks are counted); an external link cannot be
 * traversed even by a direct HDF5 call once h5io_init ran. */
static void test_partly_written_and_elink(void) {
    const char *path = path_in("partly.h5"), *other = path_in("other.h5");
    hid_t f = H5Fcreate(other, H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    hid_t g = H5Gcreate2(f, "g", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    H5Gclose(g);
    H5Fclose(f);
    f = H5Fcreate(path, H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
    hsize_t dims[1] = {8}, chunk[1] = {4}, start[1] = {0}, count[1] = {4};
    H5Pset_chunk(dcpl, 1, chunk);
    H5Pset_deflate(dcpl, 1);
    hid_t s = H5Screate_simple(1, dims, NULL), ms = H5Screate_simple(1, count, NULL);
    hid_t d = H5Dcreate2(f, "w", H5T_IEEE_F32LE, s, H5P_DEFAULT, dcpl, H5P_DEFAULT);
    float w[4] = {1, 2, 3, 4};
    H5Sselect_hyperslab(s, H5S_SELECT_SET, start, NULL, count, NULL);
    CU_ASSERT(H5Dwrite(d, H5T_NATIVE_FLOAT, ms, s, H5P_DEFAULT, w) >= 0);
    H5Dclose(d);
    H5Sclose(ms);
    H5Sclose(s);
    H5Pclose(dcpl);
    CU_ASSERT(H5Lcreate_external(other, "/g", f, "ext", H5P_DEFAULT, H5P_DEFAULT) >= 0);
    hid_t o = H5Oopen(f, "ext", H5P_DEFAULT);
    CU_ASSERT(o < 0); /* not followed */
    if (o >= 0) H5Oclose(o);
    H5Fclose(f);

    H5ioFile hf = H5IO_FILE_INIT;
    QtError err = {0}, e1 = {0}, e2 = {0};
    CU_ASSERT_EQUAL_FATAL(h5io_open(&hf, path, &err), QT_OK);
    float got[8];
    CU_ASSERT_EQUAL(h5io_read_f32(&hf, "w", got, 1, (int[]){8}, &e1), QT_ERR_FORMAT);
    CU_ASSERT(test_msg_has(&e1, "refusing dataset /w: its data was only partly written"));
    CU_ASSERT_EQUAL(h5io_attr_read_i64(&hf, "ext", "x", &(int64_t){0}, &e2), QT_ERR_FORMAT);
    CU_ASSERT(test_msg_has(&e2, "no group or dataset /ext"));
    CU_ASSERT_EQUAL(h5io_close(&hf, &err), QT_OK);
    test_assert_hdf5_closed();
}

/* inspect shows a file's names and strings without control characters (a
 * terminal escape) and cut: an attribute named with an escape, holding
 * 100 KB on one line. */
static void test_inspect_strings(void) {
    const char *path = path_in("strings.h5"), *out = path_in("inspect.txt");
    CU_ASSERT_FATAL(test_file_copy(base_ckpt, path));
    hid_t f = H5Fopen(path, H5F_ACC_RDWR, H5P_DEFAULT);
    CU_ASSERT_FATAL(f >= 0);
    char *big = malloc(100001);
    memset(big, 'z', 100000);
    big[100000] = '\0';
    big[10] = '\033';
    hid_t t = H5Tcopy(H5T_C_S1), sc = H5Screate(H5S_SCALAR);
    H5Tset_size(t, H5T_VARIABLE);
    hid_t a = H5Acreate2(f, "note\033[2J", t, sc, H5P_DEFAULT, H5P_DEFAULT);
    CU_ASSERT(a >= 0 && H5Awrite(a, t, &big) >= 0);
    if (a >= 0) H5Aclose(a);
    H5Tclose(t);
    H5Sclose(sc);
    H5Fclose(f);
    free(big);
    const char *args[] = {"inspect", path, NULL};
    unlink(out);
    CU_ASSERT_EQUAL(test_proc_run(out, args, RUN_TIMEOUT_S), 0);
    size_t n = 0;
    char *text = test_file_read(out, &n);
    CU_ASSERT_PTR_NOT_NULL_FATAL(text);
    CU_ASSERT_PTR_NULL(memchr(text, '\033', n));
    CU_ASSERT_PTR_NOT_NULL(strstr(text, "@note?[2J = \"zzzzzzzzzz?zzz"));
    size_t longest = 0;
    for (char *p = text, *e; *p; p = *e ? e + 1 : e) {
        e = strchr(p, '\n');
        if (!e) e = p + strlen(p);
        if ((size_t)(e - p) > longest) longest = (size_t)(e - p);
    }
    CU_ASSERT(longest < 300);
    free(text);
}

/* Messages cut what a file says: a 100 KB attribute shows 200 bytes. */
static void test_clip(void) {
    char *big = malloc(100001);
    memset(big, 'x', 100000);
    big[100000] = '\0';
    big[3] = '\n';
    big[4] = '\033';
    char buf[QT_CLIP_BUF];
    const char *c = qt_clip(big, buf);
    CU_ASSERT_EQUAL(strlen(c), strlen("...(100000 bytes)") + QT_CLIP_SHOW);
    CU_ASSERT(strncmp(c, "xxx??x", 6) == 0);
    CU_ASSERT_PTR_NOT_NULL(strstr(c, "...(100000 bytes)"));
    CU_ASSERT_STRING_EQUAL(qt_clip("short", buf), "short");
    QtError e = {0};
    qt_error_set(&e, QT_ERR_FORMAT, "x %s", big); /* a message cut at 1 KiB says so */
    CU_ASSERT_EQUAL(strlen(e.msg), QT_ERROR_MSG_MAX - 1);
    CU_ASSERT_STRING_EQUAL(e.msg + QT_ERROR_MSG_MAX - 4, "...");
    free(big);
}

int register_hostile_suite(void) {
    CU_pSuite s = CU_add_suite("hostile", hostile_suite_init, hostile_suite_cleanup);
    if (!s) return -1;
    if (getenv("QTRAIN_HOSTILE_WRITE")) return hostile_corpus_add_tests(s); /* the generator alone */
    return hostile_corpus_add_tests(s) ||
           !CU_add_test(s, "base checkpoints: every loader refuses each, naming it", test_base_files) ||
           !CU_add_test(s, "LoRA checkpoints and adapters.h5: merge, adapters_from", test_lora_files) ||
           !CU_add_test(s, "h5py's chunked, filtered, vlen-string files still load", test_accepted_layouts) ||
           !CU_add_test(s, "partly written chunks refused, external links not traversable",
                        test_partly_written_and_elink) ||
           !CU_add_test(s, "inspect shows file strings cut, without control characters", test_inspect_strings) ||
           !CU_add_test(s, "messages cut strings from files", test_clip);
}
