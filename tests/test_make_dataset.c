/* test_make_dataset.c - scripts/make_dataset.py against qtrain's own HDF5
 * reader: the script runs (Debian's /usr/bin/python3) on inputs a Python
 * generator writes into a temporary directory (NumPy arrays and an .npz, a
 * CSV file with string labels, one with numeric labels, one with float
 * targets, a 3-class folder of PNG images), and dataset_load_hdf5 reads
 * what it wrote: shapes, element types, labels, class counts, targets and
 * every stored value are checked exactly, and the --mean-std attributes
 * equal numpy's. Each refused input exits non-zero with its message and
 * writes nothing. The CSV data set trains with the qtrain binary, and the
 * commands run here are the ones docs/DATA.md shows. Without python3, numpy
 * or h5py (PIL for the images) the tests say they are skipped and why. */
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "data/dataset.h"
#include "test_proc.h"
#include "test_util.h"

#define PYTHON "/usr/bin/python3"

static char *tmp_root;
static char repo[PATH_MAX];

static int mkds_suite_init(void) {
    tmp_root = test_tmpdir_new();
    if (!getcwd(repo, sizeof repo)) return -1;
    return tmp_root ? 0 : -1;
}

static int mkds_suite_cleanup(void) {
    bool ok = test_tmpdir_remove(tmp_root);
    tmp_root = NULL;
    return ok ? 0 : -1;
}

/* tmp_root/name in a static buffer (one of four, so a few can be used at once). */
static const char *tmp(const char *name) {
    static char buf[4][PATH_MAX];
    static int k;
    k = (k + 1) % 4;
    snprintf(buf[k], sizeof buf[k], "%s/%s", tmp_root, name);
    return buf[k];
}

/* Runs a shell command (printf-style) in tmp_root with its output in log; the exit status, -1 if it did not exit. */
static int sh(const char *log, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int sh(const char *log, const char *fmt, ...) {
    char args[4096], cmd[4096 + 2 * PATH_MAX + 32];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(args, sizeof args, fmt, ap);
    va_end(ap);
    snprintf(cmd, sizeof cmd, "cd '%s' && %s >'%s' 2>&1", tmp_root, args, log);
    fflush(NULL);
    int st = system(cmd);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void show_log(const char *log) {
    char *text = test_file_read(log, NULL);
    fprintf(stderr, "\n%s\n", text ? text : "(no output)");
    free(text);
}

/* Whether /usr/bin/python3 imports `modules` (with the Debian package to name); skips the test if not. */
static bool have_python(const char *modules, const char *debs) {
    if (access(PYTHON, X_OK) != 0) {
        test_skip(PYTHON " is missing (Debian's python3): scripts/make_dataset.py is not tested");
        return false;
    }
    const char *log = tmp("import.log");
    if (sh(log, PYTHON " -c 'import %s'", modules) != 0) {
        char *text = test_file_read(log, NULL), *last = text;
        for (char *p = text; p && *p; p++) /* the last line of the traceback: the ImportError */
            if (*p == '\n' && p[1]) last = p + 1;
        if (last) last[strcspn(last, "\n")] = '\0';
        test_skip(PYTHON " cannot import %s (install %s): %s", modules, debs, last ? last : "");
        free(text);
        return false;
    }
    return true;
}

/* The inputs, written by Python into the current directory (tmp_root). A value of example array index i is
 * v = (i * 37 + 11) % 251 over the flattened array: uint8 v, int8 v - 125, float (v - 125) / 4. The expected
 * --mean-std values are numpy's, written one per line to NAME.stats as repr (exact). */
static const char GEN_PY[] =
    "import os, sys\n"
    "import numpy as np\n"
    "def vals(n, shape):\n"
    "    return ((np.arange(n * int(np.prod(shape))) * 37 + 11) % 251).reshape((n,) + shape)\n"
    "def stats(name, x, units):\n"
    "    with open(name + '.stats', 'w') as f:\n"
    "        for c in range(x.shape[1]):\n"
    "            v = x[:, c].astype(np.float64) / units\n"
    "            f.write('%r %r\\n' % (v.mean(), v.std()))\n"
    "def npy():\n"
    "    x = vals(12, (3, 4, 5)).astype(np.uint8)\n"
    "    np.save('train_x.npy', x); np.save('train_y.npy', np.arange(12) % 4)\n"
    "    np.save('test_x.npy', vals(5, (3, 4, 5)).astype(np.uint8)); np.save('test_y.npy', (np.arange(5) + 1) % 4)\n"
    "    stats('arrays', x, 255.0)\n"
    "    tg = lambda n: np.stack([np.arange(n) * 0.5, 3 - np.arange(n) * 1.5], 1)\n"
    "    np.savez('data.npz', train_x=(vals(10, (6,)) - 125) / 4.0, train_y=tg(10),\n"
    "             test_x=(vals(4, (6,)) - 125) / 4.0, test_y=tg(4))\n"
    "    for s, n in (('train', 9), ('val', 3), ('test', 4)):\n"
    "        np.save('small_%s_x.npy' % s, (vals(n, (5, 6)) - 125).astype(np.int8))\n"
    "        np.save('small_%s_y.npy' % s, np.arange(n) % 3)\n"
    "        np.save('half_%s_x.npy' % s, ((vals(n, (7,)) - 125) / 4.0).astype(np.float16))\n"
    "        np.save('half_%s_y.npy' % s, np.arange(n, dtype=np.int32) % 2)\n"
    "    wx = ((vals(6, (70,)) - 125) / 4.0).astype(np.float32)\n"
    "    np.save('wide_train_x.npy', wx); np.save('wide_train_y.npy', np.arange(6) % 2)\n"
    "    np.save('wide_test_x.npy', wx[:2]); np.save('wide_test_y.npy', np.arange(2))\n"
    "    v = wx.astype(np.float64)\n"
    "    open('wide.stats', 'w').write('%r %r\\n' % (v.mean(), v.std()))\n"
    "def csv():\n"
    "    names = ['setosa', 'virginica', 'versicolor']\n"
    "    row = lambda i: {'f0': '%g' % (i * 0.5), 'f1': '%d' % -(i % 7), 'f2': '%g' % ((i * i) % 11 * 0.25),\n"
    "                     'species': names[i % 3]}\n"
    "    for s, n, cols in (('train', 30, ['f0', 'f1', 'species', 'f2']), ('test', 9, ['species', 'f2', 'f0', 'f1'])):\n"
    "        with open('flowers-%s.csv' % s, 'w') as f:\n"
    "            f.write(','.join(cols) + '\\n')\n"
    "            for i in range(n): f.write(','.join(row(i)[c] for c in cols) + '\\n')\n"
    "    x = np.array([[float(row(i)[c]) for c in ('f0', 'f1', 'f2')] for i in range(30)]).astype(np.float32)\n"
    "    stats('flowers', x, 1.0)\n"
    "    for s, n in (('train', 20), ('test', 8)):\n"
    "        with open('sensors-%s.csv' % s, 'w') as f:\n"
    "            f.write('t,y1,a,y2,b\\n')\n"
    "            for i in range(n): f.write('%d,%g,%g,%g,%d\\n' % (i, i * 0.5, i * 0.125, 3 - i * 0.25, -i))\n"
    "        with open('digits-%s.csv' % s, 'w') as f:\n"
    "            f.write('x1,x2,class\\n')\n"
    "            for i in range(n): f.write('%d,%d,%d\\n' % (i, 2 * i, [0, 2, 5][i % 3]))\n"
    "def images():\n"
    "    from PIL import Image\n"
    "    xs = []\n"
    "    for s, counts in (('train', (3, 2, 4)), ('test', (1, 1, 1))):\n"
    "        for k, name in reversed(list(enumerate(('cat', 'dog', 'frog')))):\n"
    "            os.makedirs('photos/%s/%s' % (s, name))\n"
    "            for i in range(counts[k]):\n"
    "                y, x, c = np.meshgrid(np.arange(4), np.arange(5), np.arange(3), indexing='ij')\n"
    "                a = ((k * 50 + i * 7 + y * 5 + x * 3 + c * 11) % 256).astype(np.uint8)\n"
    "                Image.fromarray(a).save('photos/%s/%s/img%d.png' % (s, name, i))\n"
    "                if s == 'train': xs.append((k, i, a.transpose(2, 0, 1)))\n"
    "    stats('photos', np.stack([a for _, _, a in sorted(xs, key=lambda t: t[:2])]), 255.0)\n"
    "def bad():\n"
    "    open('bad-ragged.csv', 'w').write('a,b,label\\n1,2,x\\n3,4\\n')\n"
    "    open('bad-cell.csv', 'w').write('a,b,label\\n1,2,x\\n3,oops,y\\n')\n"
    "    open('bad-nan.csv', 'w').write('a,b,label\\n1,nan,x\\n')\n"
    "    open('bad-nolabel.csv', 'w').write('a,b,kind\\n1,2,x\\n')\n"
    "    open('bad-emptylabel.csv', 'w').write('a,b,label\\n1,2,x\\n3,4,\\n')\n"
    "    open('bad-neglabel.csv', 'w').write('a,b,label\\n1,2,0\\n3,4,-2\\n')\n"
    "    x = np.zeros((5, 4), np.float32); x[1, 2] = np.inf\n"
    "    np.save('bad-inf.npy', x); np.save('bad-f64.npy', np.zeros((5, 4)))\n"
    "    np.save('ok-x.npy', np.zeros((5, 4), np.float32)); np.save('ok-y.npy', np.arange(5))\n"
    "    np.save('bad-frac.npy', np.full((5, 4), 0.5)); np.save('bad-range.npy', np.full((5, 4), 300.0))\n"
    "    np.save('bad-y4.npy', np.arange(4)); np.save('bad-neg.npy', np.array([0, 1, -1, 2, 0]))\n"
    "def bad_images():\n"
    "    from PIL import Image\n"
    "    for d, sizes in (('mixed/a', [(4, 5)]), ('mixed/b', [(4, 5), (3, 3)]), ('empty/a', [(4, 5)]), ('empty/b', [])):\n"
    "        os.makedirs(d)\n"
    "        for i, (h, w) in enumerate(sizes): Image.fromarray(np.zeros((h, w, 3), np.uint8)).save('%s/%d.png' % (d, i))\n"
    "{'npy': npy, 'csv': csv, 'images': images, 'bad': bad, 'bad-images': bad_images}[sys.argv[1]]()\n";

/* Writes the generator and runs it for `what`; false (with its output) if it fails. */
static bool gen(const char *what) {
    test_file_write(tmp("gen.py"), GEN_PY, strlen(GEN_PY));
    const char *log = tmp("gen.log");
    if (sh(log, PYTHON " gen.py %s", what) != 0) {
        show_log(log);
        return false;
    }
    return true;
}

/* The commands docs/DATA.md shows, run here as they are written there (in the inputs' directory). */
#define MKDS "scripts/make_dataset.py "
static const char *const DOC_COMMANDS[] = {
    MKDS "npy --train-x train_x.npy --train-y train_y.npy --test-x test_x.npy --test-y test_y.npy --mean-std "
         "-o arrays.h5",
    MKDS "npy --npz data.npz --dtype float32 --gzip -o data.h5",
    MKDS "csv --train flowers-train.csv --test flowers-test.csv --label species --mean-std -o flowers.h5",
    MKDS "csv --train sensors-train.csv --test sensors-test.csv --target y1,y2 -o sensors.h5",
    MKDS "images --train photos/train --test photos/test --mean-std -o photos.h5",
    MKDS "images --train photos/train --test photos/test --size 3 4 --grayscale -o photos-gray.h5",
};
enum { DOC_NPY, DOC_NPZ, DOC_CSV_LABELS, DOC_CSV_TARGETS, DOC_IMAGES, DOC_IMAGES_GRAY, DOC_COUNT };

/* Runs make_dataset.py with `args` (starting with scripts/make_dataset.py, relative to the repository); its exit
 * status, the output in tmp_root/mkds.log. */
static int mkds(const char *args) {
    return sh(tmp("mkds.log"), PYTHON " '%s/'%s", repo, args);
}

/* mkds that must succeed and write `out`, then loads it with qtrain's reader (examples in memory). */
static bool run_and_load(const char *args, const char *out, Dataset d[3]) {
    int code = mkds(args);
    if (code != 0) {
        fprintf(stderr, "\n  %s: exit %d", args, code);
        show_log(tmp("mkds.log"));
        return false;
    }
    QtError e = {0};
    if (dataset_load_hdf5(&d[0], &d[1], &d[2], tmp(out), DATA_STORAGE_MEMORY, 1u << 30, &e) != QT_OK) {
        fprintf(stderr, "\n  %s: %s\n", out, e.msg);
        return false;
    }
    return true;
}

static void free3(Dataset d[3]) {
    for (int i = 0; i < 3; i++) dataset_free(&d[i]);
}

/* Whether d's n examples of shape (c, h, w) and element type elem hold GEN_PY's values. */
static bool examples_are(const Dataset *d, int n, int c, int h, int w, DataElem elem) {
    CU_ASSERT_EQUAL(d->n, n);
    CU_ASSERT_EQUAL(d->elem, elem);
    CU_ASSERT(d->shape[0] == c && d->shape[1] == h && d->shape[2] == w);
    if (d->n != n || d->elem != elem || d->feat != c * h * w || !d->pixels) return false;
    for (long i = 0; i < (long)n * d->feat; i++) {
        const int v = (int)((i * 37 + 11) % 251);
        const float f = (float)(v - 125) / 4.0f;
        bool ok = elem == DATA_ELEM_U8   ? d->pixels[i] == v
                  : elem == DATA_ELEM_I8 ? ((const int8_t *)d->pixels)[i] == v - 125
                  : elem == DATA_ELEM_F16 ? data_half_to_float(((const uint16_t *)d->pixels)[i]) == f
                                          : ((const float *)d->pixels)[i] == f;
        if (!ok) {
            fprintf(stderr, "\n  value %ld differs (%s)\n", i, data_elem_name(elem));
            return false;
        }
    }
    return true;
}

/* Whether d's file statistics are exactly the numpy values in tmp_root/name.stats (one "mean std" line each). */
static bool stats_are(const Dataset *d, const char *name) {
    char *text = test_file_read(tmp(name), NULL);
    if (!text) return false;
    int k = 0;
    bool ok = true;
    for (char *p = text, *end; *p; p = end, k++) {
        double m = strtod(p, &end);
        if (end == p) break;
        double s = strtod(end, &end);
        if (k >= d->n_stats || d->stats_mean[k] != m || d->stats_std[k] != s) {
            fprintf(stderr, "\n  %s channel %d: numpy %.17g %.17g, the file %.17g %.17g\n", name, k, m, s,
                    k < d->n_stats ? d->stats_mean[k] : 0.0, k < d->n_stats ? d->stats_std[k] : 0.0);
            ok = false;
        }
        while (*end == '\n') end++;
    }
    free(text);
    if (k != d->n_stats) fprintf(stderr, "\n  %s: numpy has %d channels, the file %d\n", name, k, d->n_stats);
    return ok && k == d->n_stats && k > 0;
}

/* ---- the tests ------------------------------------------------------------------------------------------------ */

/* .npy files (uint8 (N, C, H, W), with --mean-std), an .npz (float64 converted by --dtype float32, float targets
 * (N, 2), gzip'd), int8 (N, H, W) with a validation split and --classes, float16 (N, F) with int32 labels. */
static void test_from_numpy(void) {
    if (!have_python("numpy, h5py", "python3-numpy python3-h5py")) return;
    CU_ASSERT_FATAL(gen("npy"));
    Dataset d[3];
    if (run_and_load(DOC_COMMANDS[DOC_NPY], "arrays.h5", d)) {
        CU_ASSERT(examples_are(&d[0], 12, 3, 4, 5, DATA_ELEM_U8));
        CU_ASSERT(examples_are(&d[2], 5, 3, 4, 5, DATA_ELEM_U8));
        CU_ASSERT_EQUAL(d[1].n, 0);
        CU_ASSERT_EQUAL(d[0].n_classes, 4);
        CU_ASSERT_PTR_NULL(d[0].targets);
        for (int i = 0; i < 12 && d[0].labels; i++) CU_ASSERT_EQUAL(d[0].labels[i], i % 4);
        for (int i = 0; i < 5 && d[2].labels; i++) CU_ASSERT_EQUAL(d[2].labels[i], (i + 1) % 4);
        CU_ASSERT(stats_are(&d[0], "arrays.stats"));
        free3(d);
    } else {
        CU_FAIL("npy");
    }
    if (run_and_load(DOC_COMMANDS[DOC_NPZ], "data.h5", d)) {
        CU_ASSERT(examples_are(&d[0], 10, 6, 1, 1, DATA_ELEM_F32));
        CU_ASSERT(examples_are(&d[2], 4, 6, 1, 1, DATA_ELEM_F32));
        CU_ASSERT_EQUAL(d[0].ndim, 1);
        CU_ASSERT_PTR_NULL(d[0].labels);
        CU_ASSERT_EQUAL(d[0].n_classes, 0);
        CU_ASSERT_EQUAL(d[0].n_targets, 2);
        CU_ASSERT_EQUAL(d[0].n_stats, 0);
        for (int i = 0; i < 10 && d[0].targets; i++)
            CU_ASSERT(d[0].targets[2 * i] == i * 0.5f && d[0].targets[2 * i + 1] == 3 - i * 1.5f);
        free3(d);
    } else {
        CU_FAIL("npz");
    }
    if (run_and_load(MKDS "npy --train-x small_train_x.npy --train-y small_train_y.npy --val-x small_val_x.npy "
                     "--val-y small_val_y.npy --test-x small_test_x.npy --test-y small_test_y.npy --classes a b c d e "
                     "-o small.h5", "small.h5", d)) {
        const int n[3] = {9, 3, 4};
        for (int s = 0; s < 3; s++) {
            CU_ASSERT(examples_are(&d[s], n[s], 1, 5, 6, DATA_ELEM_I8));
            CU_ASSERT_EQUAL(d[s].n_classes, 5); /* the classes attribute, not 1 + the largest label (2) */
            for (int i = 0; i < n[s] && d[s].labels; i++) CU_ASSERT_EQUAL(d[s].labels[i], i % 3);
        }
        free3(d);
    } else {
        CU_FAIL("int8");
    }
    if (run_and_load(MKDS "npy --train-x half_train_x.npy --train-y half_train_y.npy --test-x half_test_x.npy "
                     "--test-y half_test_y.npy --gzip -o half.h5", "half.h5", d)) {
        CU_ASSERT(examples_are(&d[0], 9, 7, 1, 1, DATA_ELEM_F16));
        CU_ASSERT(examples_are(&d[2], 4, 7, 1, 1, DATA_ELEM_F16));
        CU_ASSERT_EQUAL(d[0].n_classes, 2);
        for (int i = 0; i < 9 && d[0].labels; i++) CU_ASSERT_EQUAL(d[0].labels[i], i % 2);
        free3(d);
    } else {
        CU_FAIL("float16");
    }
    /* 70 features, more than qtrain's 64 per-channel statistics: one mean and std over all values */
    if (run_and_load(MKDS "npy --train-x wide_train_x.npy --train-y wide_train_y.npy --test-x wide_test_x.npy "
                     "--test-y wide_test_y.npy --mean-std -o wide.h5", "wide.h5", d)) {
        CU_ASSERT(d[0].ndim == 1 && d[0].shape[0] == 70 && d[0].elem == DATA_ELEM_F32);
        CU_ASSERT(stats_are(&d[0], "wide.stats"));
        free3(d);
    } else {
        CU_FAIL("70 features");
    }
}

/* CSV files: string labels (sorted into 0..K-1, columns in another order in the test file, --mean-std), float
 * targets (N, 2) from two columns, numeric labels kept as they are. */
static void test_from_csv(void) {
    if (!have_python("numpy, h5py", "python3-numpy python3-h5py")) return;
    CU_ASSERT_FATAL(gen("csv"));
    Dataset d[3];
    static const int species[3] = {0, 2, 1}; /* setosa, virginica, versicolor in sorted order */
    if (run_and_load(DOC_COMMANDS[DOC_CSV_LABELS], "flowers.h5", d)) {
        const int n[3] = {30, 0, 9};
        for (int s = 0; s < 3; s += 2) {
            CU_ASSERT_EQUAL(d[s].n, n[s]);
            CU_ASSERT_EQUAL(d[s].elem, DATA_ELEM_F32);
            CU_ASSERT(d[s].ndim == 1 && d[s].shape[0] == 3);
            CU_ASSERT_EQUAL(d[s].n_classes, 3);
            if (d[s].n != n[s] || d[s].feat != 3 || !d[s].labels || d[s].elem != DATA_ELEM_F32) continue;
            const float *x = (const float *)d[s].pixels;
            for (int i = 0; i < n[s]; i++) {
                CU_ASSERT_EQUAL(d[s].labels[i], species[i % 3]);
                CU_ASSERT(x[3 * i] == i * 0.5f && x[3 * i + 1] == (float)-(i % 7) &&
                          x[3 * i + 2] == (float)((i * i) % 11) * 0.25f);
            }
        }
        CU_ASSERT(stats_are(&d[0], "flowers.stats"));
        free3(d);
    } else {
        CU_FAIL("csv labels");
    }
    if (run_and_load(DOC_COMMANDS[DOC_CSV_TARGETS], "sensors.h5", d)) {
        const int n[3] = {20, 0, 8};
        for (int s = 0; s < 3; s += 2) {
            CU_ASSERT_EQUAL(d[s].n, n[s]);
            CU_ASSERT(d[s].ndim == 1 && d[s].shape[0] == 3 && d[s].elem == DATA_ELEM_F32);
            CU_ASSERT_PTR_NULL(d[s].labels);
            CU_ASSERT_EQUAL(d[s].n_targets, 2);
            if (d[s].n != n[s] || d[s].feat != 3 || !d[s].targets || d[s].n_targets != 2) continue;
            const float *x = (const float *)d[s].pixels;
            for (int i = 0; i < n[s]; i++) {
                CU_ASSERT(x[3 * i] == (float)i && x[3 * i + 1] == i * 0.125f && x[3 * i + 2] == (float)-i);
                CU_ASSERT(d[s].targets[2 * i] == i * 0.5f && d[s].targets[2 * i + 1] == 3 - i * 0.25f);
            }
        }
        free3(d);
    } else {
        CU_FAIL("csv targets");
    }
    if (run_and_load(MKDS "csv --train digits-train.csv --test digits-test.csv --label class -o digits.h5",
                     "digits.h5", d)) {
        CU_ASSERT_EQUAL(d[0].n_classes, 6);
        static const int labels[3] = {0, 2, 5};
        for (int i = 0; i < 20 && d[0].labels; i++) CU_ASSERT_EQUAL(d[0].labels[i], labels[i % 3]);
        free3(d);
    } else {
        CU_FAIL("csv numeric labels");
    }
}

/* A folder of PNG images, one subfolder per class (written in reverse order; sorted names are the classes):
 * uint8 (N, 3, 4, 5) with the exact pixels and --mean-std; resized and grayscale (N, 1, 3, 4). */
static void test_from_images(void) {
    if (!have_python("numpy, h5py, PIL", "python3-numpy python3-h5py python3-pil")) return;
    CU_ASSERT_FATAL(gen("images"));
    Dataset d[3];
    static const int counts[2][3] = {{3, 2, 4}, {1, 1, 1}};
    if (run_and_load(DOC_COMMANDS[DOC_IMAGES], "photos.h5", d)) {
        for (int s = 0; s < 2; s++) {
            const Dataset *ds = &d[s ? 2 : 0];
            const int n = counts[s][0] + counts[s][1] + counts[s][2];
            CU_ASSERT_EQUAL(ds->n, n);
            CU_ASSERT_EQUAL(ds->elem, DATA_ELEM_U8);
            CU_ASSERT(ds->shape[0] == 3 && ds->shape[1] == 4 && ds->shape[2] == 5);
            CU_ASSERT_EQUAL(ds->n_classes, 3);
            if (ds->n != n || ds->feat != 60 || !ds->labels || ds->elem != DATA_ELEM_U8) continue;
            int e = 0, bad = 0;
            for (int k = 0; k < 3; k++)
                for (int i = 0; i < counts[s][k]; i++, e++) {
                    CU_ASSERT_EQUAL(ds->labels[e], k);
                    for (int c = 0; c < 3; c++)
                        for (int y = 0; y < 4; y++)
                            for (int x = 0; x < 5; x++)
                                bad += ds->pixels[e * 60 + (c * 4 + y) * 5 + x] !=
                                       (k * 50 + i * 7 + y * 5 + x * 3 + c * 11) % 256;
                }
            CU_ASSERT_EQUAL(bad, 0);
        }
        CU_ASSERT(stats_are(&d[0], "photos.stats"));
        free3(d);
    } else {
        CU_FAIL("images");
    }
    if (run_and_load(DOC_COMMANDS[DOC_IMAGES_GRAY], "photos-gray.h5", d)) {
        CU_ASSERT_EQUAL(d[0].n, 9);
        CU_ASSERT_EQUAL(d[2].n, 3);
        CU_ASSERT(d[0].elem == DATA_ELEM_U8 && d[0].shape[0] == 1 && d[0].shape[1] == 3 && d[0].shape[2] == 4);
        CU_ASSERT_EQUAL(d[0].n_classes, 3);
        for (int i = 0; i < 9 && d[0].labels; i++) CU_ASSERT_EQUAL(d[0].labels[i], i < 3 ? 0 : i < 5 ? 1 : 2);
        free3(d);
    } else {
        CU_FAIL("images resized, grayscale");
    }
}

/* Each refused input: a non-zero exit, its message, and no output file (the image folders skipped without PIL). */
static void test_refused_inputs(void) {
    if (!have_python("numpy, h5py", "python3-numpy python3-h5py")) return;
    CU_ASSERT_FATAL(gen("bad"));
    const bool pil = have_python("PIL", "python3-pil");
    if (pil) CU_ASSERT_FATAL(gen("bad-images"));
    static const struct {
        const char *args, *msg;
    } CASES[] = {
        {"csv --train bad-ragged.csv --test bad-ragged.csv --label label",
         "bad-ragged.csv, line 3: 2 cells, but the header has 3 columns"},
        {"csv --train bad-cell.csv --test bad-cell.csv --label label",
         "bad-cell.csv, line 3, column 'b': 'oops' is not a number"},
        {"csv --train bad-nan.csv --test bad-nan.csv --label label",
         "bad-nan.csv, line 2, column 'b': nan; qtrain refuses NaN and infinity"},
        {"csv --train bad-nolabel.csv --test bad-nolabel.csv --label label",
         "bad-nolabel.csv: no column 'label' in the header row (a, b, kind)"},
        {"csv --train bad-emptylabel.csv --test bad-emptylabel.csv --label label",
         "bad-emptylabel.csv, line 3, column 'label': the label is empty"},
        {"npy --npz ok-x.npy", "ok-x.npy: a single array, not an .npz archive"},
        {"csv --train bad-neglabel.csv --test bad-neglabel.csv --label label",
         "bad-neglabel.csv, line 3: label -2 is negative"},
        {"npy --train-x bad-inf.npy --train-y ok-y.npy --test-x ok-x.npy --test-y ok-y.npy",
         "bad-inf.npy: an example value at index (1, 2) is inf"},
        {"npy --train-x ok-x.npy --train-y bad-y4.npy --test-x ok-x.npy --test-y ok-y.npy",
         "ok-x.npy: train has 5 examples but 4 labels or targets"},
        {"npy --train-x ok-x.npy --train-y bad-neg.npy --test-x ok-x.npy --test-y ok-y.npy",
         "bad-neg.npy: label -1 at index 2 is negative"},
        {"npy --train-x bad-f64.npy --train-y ok-y.npy --test-x ok-x.npy --test-y ok-y.npy",
         "bad-f64.npy: the examples are float64; qtrain stores uint8, int8, float16 or float32"},
        {"npy --train-x bad-frac.npy --train-y ok-y.npy --test-x ok-x.npy --test-y ok-y.npy --dtype int8",
         "bad-frac.npy: --dtype int8 needs whole numbers"},
        {"npy --train-x bad-range.npy --train-y ok-y.npy --test-x ok-x.npy --test-y ok-y.npy --dtype uint8",
         "bad-range.npy: --dtype uint8 holds 0..255, but the examples range over 300.0..300.0"},
        {"npy --train-x ok-x.npy --train-y ok-y.npy --test-x ok-x.npy --test-y ok-y.npy --mean-std",
         "--mean-std: channel 0 of the training examples is constant (std 0)"},
        {"images --train mixed --test mixed", "mixed/b/1.png: 3x3 pixels, but mixed/a/0.png is 5x4; give --size H W"},
        {"images --train empty --test empty", "empty/b: an empty class folder"},
    };
    for (size_t k = 0; k < sizeof CASES / sizeof CASES[0]; k++) {
        if (!pil && strncmp(CASES[k].args, "images ", 7) == 0) continue;
        char args[1024];
        snprintf(args, sizeof args, MKDS "%s -o bad.h5", CASES[k].args);
        unlink(tmp("bad.h5"));
        int code = mkds(args);
        char *log = test_file_read(tmp("mkds.log"), NULL);
        bool said = log && strstr(log, CASES[k].msg);
        if (code != 1 || !said)
            fprintf(stderr, "\n  %s: exit %d, wanted 1 and \"%s\"; got: %s\n", CASES[k].args, code, CASES[k].msg,
                    log ? log : "(no output)");
        CU_ASSERT_EQUAL(code, 1);
        CU_ASSERT(said);
        CU_ASSERT(access(tmp("bad.h5"), F_OK) != 0);
        free(log);
    }
}

/* Runs the qtrain binary on `h5` with a dense model of `in` inputs and `out` outputs (with `loss`) for 6 steps in
 * tmp_root/<name>-run; whether it exits 0 with final.h5 and a summary.json that holds `key`. */
static bool trains(const char *name, const char *h5, int in, int out, const char *loss, const char *key) {
    char yaml[2 * PATH_MAX + 600], dir[PATH_MAX], cfg[PATH_MAX], log[PATH_MAX];
    snprintf(dir, sizeof dir, "%s/%s-run", tmp_root, name);
    snprintf(cfg, sizeof cfg, "%s/%s.yaml", tmp_root, name);
    snprintf(log, sizeof log, "%s/%s-run.log", tmp_root, name);
    snprintf(yaml, sizeof yaml,
             "run: {seed: 1, out_dir: %s}\n"
             "data: {dataset: hdf5, path: %s, cache_dir: none, transform: [{normalize: {per_channel: true}}]}\n"
             "model:\n  input: [%d]\n  layers:\n"
             "    - {name: fc1, type: dense, units: 8}\n    - {type: relu}\n    - {name: head, type: dense, units: %d}\n"
             "train: {loss: %s, steps: 6, batch_size: 8, optimizer: {name: adamw, lr: 1e-2}, log_every: 2,"
             " eval_every: 3, checkpoint_every: 3}\n",
             dir, tmp(h5), in, out, loss);
    test_file_write(cfg, yaml, strlen(yaml));
    const char *args[] = {"--config", cfg, "--quiet", NULL};
    int code = test_proc_run(log, args, 120.0);
    if (code != 0) show_log(log);
    char path[PATH_MAX + 32];
    snprintf(path, sizeof path, "%s/summary.json", dir);
    char *summary = test_file_read(path, NULL);
    bool ok = code == 0 && summary && strstr(summary, "\"steps\": 6") && strstr(summary, key);
    if (code == 0 && !ok) fprintf(stderr, "\n  %s: summary.json without 6 steps or %s: %s\n", name, key, summary);
    free(summary);
    snprintf(path, sizeof path, "%s/final.h5", dir);
    return ok && access(path, F_OK) == 0;
}

/* The CSV data sets train with the qtrain binary on a dense model, normalized by the file's mean and std: the
 * one of 3 string classes (3 features) on cross entropy, the one of two float targets on mse. */
static void test_csv_trains(void) {
    if (!have_python("numpy, h5py", "python3-numpy python3-h5py")) return;
    CU_ASSERT_FATAL(gen("csv"));
    if (mkds(DOC_COMMANDS[DOC_CSV_LABELS]) != 0) {
        show_log(tmp("mkds.log"));
        CU_FAIL_FATAL("make_dataset.py csv --label");
    }
    CU_ASSERT(trains("flowers", "flowers.h5", 3, 3, "cross_entropy", "\"test_accuracy\""));
    if (mkds(MKDS "csv --train sensors-train.csv --test sensors-test.csv --target y1,y2 --mean-std -o sensors-ms.h5")
        != 0) {
        show_log(tmp("mkds.log"));
        CU_FAIL_FATAL("make_dataset.py csv --target");
    }
    CU_ASSERT(trains("sensors", "sensors-ms.h5", 3, 2, "mse", "\"test_mse\""));
}

/* docs/DATA.md shows each command the tests above run, as they run it. */
static void test_doc_shows_the_commands(void) {
    char *doc = test_file_read("docs/DATA.md", NULL);
    CU_ASSERT_PTR_NOT_NULL_FATAL(doc);
    for (int k = 0; k < DOC_COUNT; k++) {
        bool found = strstr(doc, DOC_COMMANDS[k]) != NULL;
        if (!found) fprintf(stderr, "\n  docs/DATA.md does not show: %s\n", DOC_COMMANDS[k]);
        CU_ASSERT(found);
    }
    free(doc);
}

int register_make_dataset_suite(void) {
    CU_pSuite s = CU_add_suite("make_dataset", mkds_suite_init, mkds_suite_cleanup);
    if (!s) return 1;
    return !CU_add_test(s, "NumPy arrays and an .npz: uint8, int8, float16, float32 (--dtype), targets, --classes, "
                           "--mean-std", test_from_numpy) ||
           !CU_add_test(s, "CSV files: string labels sorted, float targets, numeric labels, --mean-std",
                        test_from_csv) ||
           !CU_add_test(s, "an image folder: exact pixels, classes, --mean-std; resized grayscale", test_from_images) ||
           !CU_add_test(s, "refused inputs: each a message and no file", test_refused_inputs) ||
           !CU_add_test(s, "the CSV data sets train with qtrain: class labels, float targets on mse", test_csv_trains) ||
           !CU_add_test(s, "docs/DATA.md shows the commands tested", test_doc_shows_the_commands);
}
