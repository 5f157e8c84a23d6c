/* test_qlora.c - PTQ bases, LoRA and QLoRA end to end on the shipped mini
 * data set: rules, runs, the frozen base, resume, adapters.h5, quantize,
 * merge, and the errors a user meets before training. Its QAT and QT runs
 * are test_qlora_qat.c's. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <hdf5.h>

#include "lora/lora.h"
#include "quant/qarray_io.h"
#include "quant/qlayer.h"
#include "test_lora.h"
#include "test_proc.h"
#include "test_qlora.h"
#include "test_util.h"
#include "trainer/checkpoint.h"
#include "cli/compare.h"
#include "trainer/config.h"
#include "base/h5io.h"
#include "trainer/net.h"
#include "trainer/sha256.h"
#include "trainer/tools.h"
#include "trainer/train.h"

TestRuns qlora_runs; /* the suite's directory and float base (test_qlora.h) */

static int qlora_suite_init(void) { return test_runs_init(&qlora_runs); }

static int qlora_suite_cleanup(void) { return test_runs_cleanup(&qlora_runs); }

/* Two QArrays hold the same bytes in every buffer. */
static bool qarrays_equal(const QArray *a, const QArray *b) {
    QArrayBlob ba[QARRAY_MAX_BLOBS], bb[QARRAY_MAX_BLOBS];
    int na = qarray_blobs(a, ba), nb = qarray_blobs(b, bb);
    if (na != nb) return false;
    for (int i = 0; i < na; i++) {
        size_t size = ba[i].type == QARRAY_BLOB_U8 ? 1 : ba[i].type == QARRAY_BLOB_U16 ? 2 : 4;
        if (ba[i].count != bb[i].count || memcmp(ba[i].data, bb[i].data, ba[i].count * size) != 0) return false;
    }
    return a->double_quant == b->double_quant && (!a->double_quant || a->dq.offset == b->dq.offset);
}

/* ---- rules ------------------------------------------------------------------ */

static void test_rules_first_full_match(void) {
    const char *ov[] = {"quant.rules.0.module_path=conv", "quant.rules.1.module_path=fc.|conv1",
                        "quant.rules.1.weight_qtype=int8", "quant.rules.1.tile_size=0",
                        "quant.rules.1.double_quant=false", "lora.rules.0.op_types=[dense]"};
    Config *c = load_cfg("tests/configs/tiny-qlora.yaml", "rules", ov, 6);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    Net n;
    int count = 0;
    char *warnings = test_runs_net_warnings(&n, c, NET_SHELL, &count);
    Module *conv1 = model_find_module(&n.model, "conv1"), *fc1 = model_find_module(&n.model, "fc1");
    /* "conv" is not a full match of conv1, so rule 1 applies to both */
    CU_ASSERT_EQUAL(n.quant_rule[conv1 - n.model.modules], 1);
    CU_ASSERT_EQUAL(n.quant_rule[fc1 - n.model.modules], 1);
    CU_ASSERT_EQUAL(net_hook_count(&n, &HOOK_PTQ), 2);
    CU_ASSERT_STRING_EQUAL(qtype_name(net_qlayer(&n, 0)->spec.weight_qtype), "int8");
    /* the head is lora.trainable: neither quantized nor adapted; op_types keep conv1 from adapters */
    CU_ASSERT_EQUAL(net_hook_count(&n, &HOOK_LORA), 1);
    CU_ASSERT_PTR_EQUAL(net_adapter(&n, 0)->module, fc1);
    CU_ASSERT_EQUAL(count, 1);
    CU_ASSERT(strstr(warnings, "quant.rules[0]") && strstr(warnings, "\"conv\"") &&
              strstr(warnings, "applies to no module"));
    free(warnings);
    net_free(&n);
    free(c);
}

/* A rule that matches only modules earlier rules (or lora.trainable) took is
 * named with them, not sent to "check the regex". */
static void test_rules_shadowed_warning(void) {
    const char *ov[] = {"quant.rules.1.module_path=fc1|head", "lora.rules=[{module_path: \"conv1|fc1\", rank: 2}, "
                        "{module_path: \"fc.*\", rank: 2}, {module_path: nothing, rank: 2}]"};
    Config *c = load_cfg("tests/configs/tiny-qlora.yaml", "rules-shadow", ov, 2);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    Net n;
    int count = 0;
    char *line = test_runs_net_warnings(&n, c, NET_SHELL, &count), *second = strchr(line, '\n');
    CU_ASSERT_EQUAL(count, 2);
    CU_ASSERT_PTR_NOT_NULL_FATAL(second);
    *second++ = '\0';
    CU_ASSERT(strstr(line, "lora.rules[1]") && strstr(line, "matches fc1") && strstr(line, "lora.rules[0] took them"));
    CU_ASSERT_PTR_NULL(strstr(line, "check the regex"));
    CU_ASSERT(strstr(second, "lora.rules[2]") && strstr(second, "check the regex"));
    free(line);
    net_free(&n);
    /* a rule whose only module is lora.trainable names that */
    const char *ov2[] = {"quant.rules=[{module_path: conv1, weight_qtype: int8}, {module_path: fc1, weight_qtype: "
                         "int8}, {module_path: head, weight_qtype: int8}]"};
    Config *c2 = load_cfg("tests/configs/tiny-qlora.yaml", "rules-shadow2", ov2, 1);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c2);
    line = test_runs_net_warnings(&n, c2, NET_SHELL, &count);
    CU_ASSERT_EQUAL(count, 1);
    CU_ASSERT(strstr(line, "quant.rules[2]") && strstr(line, "matches head") && strstr(line, "lora.trainable took"));
    free(line);
    net_free(&n);
    free(c);
    free(c2);
}

/* ---- adapter gradients over a quantized base ------------------------------------ */

static void check_qbase_adapter(const char *name, const LayerSpec *layer, int in_ndim, const int *in_shape,
                                const int *x_shape) {
    Model m;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(model_init(&m, in_ndim, in_shape, layer, 1, &err), QT_OK);
    Rng rng;
    rng_init(&rng, 11, 1);
    model_init_params(&m, &rng);
    Module *mod = &m.modules[0];
    param_freeze(mod->bias);
    QLayerSpec spec = qlayer_spec_default();
    spec.weight_qtype = qtype_find("int4", NULL);
    spec.tile_size = 8;
    QLayer q;
    CU_ASSERT_EQUAL_FATAL(qlayer_init_quantize(&q, mod, &spec, mod->weight->var.value.data, &err), QT_OK);
    param_release(mod->weight);
    qlayer_install(&q);
    LoraAdapter a;
    LoraSpec ls = {.rank = 2, .alpha = 3.0f};
    CU_ASSERT_EQUAL_FATAL(lora_adapter_init(&a, mod, &ls, &err), QT_OK);
    lora_adapter_init_params(&a, &rng);
    rng_fill_normal(&rng, a.B.var.value.data, var_numel(&a.B.var), 0.0f, 0.5f); /* B = 0 would hide A's grad */
    lora_adapter_install(&a);
    int nx = 1;
    for (int d = 0; d <= in_ndim; d++) nx *= x_shape[d];
    float *x = malloc((size_t)nx * sizeof(float));
    rng_fill_normal(&rng, x, (size_t)nx, 0.0f, 1.0f);
    GradcheckInput in[3] = {{x, in_ndim + 1, {0}, true},
                            {a.A.var.value.data, a.A.var.value.ndim, {0}, true},
                            {a.B.var.value.data, a.B.var.value.ndim, {0}, true}};
    memcpy(in[0].shape, x_shape, sizeof(int) * (size_t)(in_ndim + 1));
    memcpy(in[1].shape, a.A.var.value.shape, sizeof in[1].shape);
    memcpy(in[2].shape, a.B.var.value.shape, sizeof in[2].shape);
    LoraGradCtx ctx = {&m, &a};
    CU_ASSERT(gradcheck(name, lora_test_model_fn, &ctx, in, 3, 1e-3, 2e-3, 1e-2));
    free(x);
    lora_adapter_free(&a);
    qlayer_free(&q);
    model_free(&m);
}

static void test_adapter_grads_over_quantized_base(void) {
    LayerSpec dense = {.type = LAYER_DENSE, .units = 6};
    snprintf(dense.name, sizeof dense.name, "fc");
    int din[1] = {12}, dx[2] = {3, 12};
    check_qbase_adapter("dense over int4", &dense, 1, din, dx);
    LayerSpec conv = {.type = LAYER_CONV2D, .out_channels = 4, .kernel = 3, .stride = 2, .padding = 1};
    snprintf(conv.name, sizeof conv.name, "conv");
    int cin[3] = {2, 5, 5}, cx[4] = {2, 2, 5, 5};
    check_qbase_adapter("conv over int4", &conv, 3, cin, cx);
}

/* ---- a QLoRA run ------------------------------------------------------------ */

static void test_qlora_run_learns_and_keeps_base(void) {
    const char *pre[] = {"train.steps=0", "train.epochs=0"};
    Config *c0 = load_cfg("tests/configs/tiny-qlora.yaml", "q0", pre, 2);
    Config *c = load_cfg("tests/configs/tiny-qlora.yaml", "q1", NULL, 0);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c0);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    TrainResult r0, r;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(run(c0, NULL, 0, &r0, &err), QT_OK);
    CU_ASSERT_EQUAL_FATAL(run(c, NULL, 0, &r, &err), QT_OK);
    CU_ASSERT_STRING_EQUAL(r.mode, "qlora");
    CU_ASSERT(r.test_loss < r0.test_loss - 0.1);
    CU_ASSERT(r.test_accuracy > r0.test_accuracy);
    CU_ASSERT(r.base_bits_per_param < 5.0);
    /* the head (330) and the adapters of conv1 (4x9 + 8x4) and fc1 (4x1568 + 32x4) train */
    CU_ASSERT_EQUAL(r.params_trainable, 330 + 36 + 32 + 6272 + 128);
    /* The base after training is bit for bit the base before. */
    Net a, b;
    CU_ASSERT_EQUAL_FATAL(net_build(&a, c, NET_SHELL, &err), QT_OK);
    CU_ASSERT_EQUAL_FATAL(net_build(&b, c, NET_SHELL, &err), QT_OK);
    CheckpointNet pa = hook_layers_only(&a.hooks, &HOOK_PTQ), pb = net_checkpoint_parts(&b);
    CU_ASSERT_EQUAL(checkpoint_load_model(path_in("q0", "final.h5"), &a.model, &pa, &err), QT_OK);
    CU_ASSERT_EQUAL(checkpoint_load_model(path_in("q1", "final.h5"), &b.model, &pb, &err), QT_OK);
    for (int i = 0; i < net_hook_count(&a, &HOOK_PTQ); i++)
        CU_ASSERT(qarrays_equal(&net_qlayer(&a, i)->weight, &net_qlayer(&b, i)->weight));
    Param *ba = model_find_param(&a.model, "fc1/bias"), *bb = model_find_param(&b.model, "fc1/bias");
    CU_ASSERT(memcmp(ba->var.value.data, bb->var.value.data, 32 * sizeof(float)) == 0);
    net_free(&a);
    net_free(&b);
    free(c0);
    free(c);
}

static void assert_same_adapters(const Net *a, const Net *b) {
    CU_ASSERT_EQUAL_FATAL(net_hook_count(a, &HOOK_LORA), net_hook_count(b, &HOOK_LORA));
    for (int i = 0; i < net_hook_count(a, &HOOK_LORA); i++) {
        size_t na = var_numel(&net_adapter(a, i)->A.var), nb = var_numel(&net_adapter(a, i)->B.var);
        CU_ASSERT(memcmp(net_adapter(a, i)->A.var.value.data, net_adapter(b, i)->A.var.value.data, na * 4) == 0);
        CU_ASSERT(memcmp(net_adapter(a, i)->B.var.value.data, net_adapter(b, i)->B.var.value.data, nb * 4) == 0);
    }
    const Param *ha = model_find_param((Model *)&a->model, "head/weight");
    const Param *hb = model_find_param((Model *)&b->model, "head/weight");
    CU_ASSERT(memcmp(ha->var.value.data, hb->var.value.data, var_numel(&ha->var) * 4) == 0);
}

static void test_qlora_resume_is_exact(void) {
    Config *c = load_cfg("tests/configs/tiny-qlora.yaml", "r-straight", NULL, 0);
    Config *s = load_cfg("tests/configs/tiny-qlora.yaml", "r-split", NULL, 0);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    CU_ASSERT_PTR_NOT_NULL_FATAL(s);
    TrainResult r;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(run(c, NULL, 0, &r, &err), QT_OK);
    CU_ASSERT_EQUAL_FATAL(run(s, NULL, 11, &r, &err), QT_OK);
    CU_ASSERT_EQUAL_FATAL(run(s, "auto", 0, &r, &err), QT_OK);
    Net a, b;
    test_runs_load_net(&a, c, path_in("r-straight", "final.h5"));
    test_runs_load_net(&b, s, path_in("r-split", "final.h5"));
    assert_same_adapters(&a, &b);
    /* adapters.h5 holds the same adapters and head */
    Config *f = load_cfg("tests/configs/tiny-qlora.yaml", "r-from", NULL, 0);
    snprintf(f->model.adapters_from, sizeof f->model.adapters_from, "%s", path_in("r-split", "adapters.h5"));
    Net d;
    CU_ASSERT_EQUAL_FATAL(net_build(&d, f, NET_FRESH, &err), QT_OK);
    assert_same_adapters(&a, &d);
    net_free(&a);
    net_free(&b);
    net_free(&d);
    free(c);
    free(s);
    free(f);
}

/* ---- where a file comes from -------------------------------------------------- */

typedef struct {
    char names[64][192];
    int n;
} NameList;

static herr_t collect_dataset(hid_t g, const char *name, const H5L_info_t *info, void *data) {
    (void)info;
    NameList *l = data;
    H5O_info_t oi;
    if (H5Oget_info_by_name(g, name, &oi, H5P_DEFAULT) < 0 || oi.type != H5O_TYPE_DATASET || l->n == 64) return 0;
    char mod[64], t[64], extra[64];
    /* params/<module>/<tensor> of a frozen module (head is lora.trainable), quant/<module>/weight/<blob> */
    if ((sscanf(name, "params/%63[^/]/%63[^/]%63s", mod, t, extra) == 2 && strcmp(mod, "head") != 0) ||
        sscanf(name, "quant/%63[^/]/weight/%63[^/]%63s", mod, t, extra) == 2)
        snprintf(l->names[l->n++], sizeof l->names[0], "%s", name);
    return 0;
}

static int cmp_names(const void *a, const void *b) { return strcmp(a, b); }

/* checkpoint.h's definition of the base hash, recomputed from the file with the HDF5 API alone. */
static void base_sha256_from_file(const char *path, char hex[SHA256_HEX_CHARS]) {
    hex[0] = '\0';
    hid_t f = H5Fopen(path, H5F_ACC_RDONLY, H5P_DEFAULT);
    CU_ASSERT_FATAL(f >= 0);
    NameList *l = calloc(1, sizeof *l);
    CU_ASSERT_PTR_NOT_NULL_FATAL(l);
    H5Lvisit(f, H5_INDEX_NAME, H5_ITER_INC, collect_dataset, l);
    qsort(l->names, (size_t)l->n, sizeof l->names[0], cmp_names);
    Sha256 s;
    sha256_init(&s);
    for (int i = 0; i < l->n; i++) {
        hid_t d = H5Dopen2(f, l->names[i], H5P_DEFAULT), ty = H5Dget_type(d), sp = H5Dget_space(d);
        size_t size = H5Tget_size(ty);
        bool fl = H5Tget_class(ty) == H5T_FLOAT, sg = !fl && H5Tget_sign(ty) == H5T_SGN_2;
        const char *dtype = fl ? "float32" : sg ? "int32" : size == 1 ? "uint8" : "uint16";
        hid_t mem = fl ? H5T_NATIVE_FLOAT : sg ? H5T_NATIVE_INT32 : size == 1 ? H5T_NATIVE_UINT8 : H5T_NATIVE_UINT16;
        hsize_t dims[8];
        int nd = H5Sget_simple_extent_dims(sp, dims, NULL);
        char shape[64] = "";
        size_t len = 0, numel = 1;
        for (int k = 0; k < nd; k++) {
            len += (size_t)snprintf(shape + len, sizeof shape - len, "%s%llu", k ? "," : "",
                                    (unsigned long long)dims[k]);
            numel *= (size_t)dims[k];
        }
        uint64_t bytes = numel * size;
        uint8_t *buf = malloc(bytes ? bytes : 1), le[8];
        CU_ASSERT(H5Dread(d, mem, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf) >= 0);
        for (int k = 0; k < 8; k++) le[k] = (uint8_t)(bytes >> (8 * k));
        sha256_update(&s, l->names[i], strlen(l->names[i]) + 1);
        sha256_update(&s, dtype, strlen(dtype) + 1);
        sha256_update(&s, shape, strlen(shape) + 1);
        sha256_update(&s, le, 8);
        sha256_update(&s, buf, bytes);
        free(buf);
        H5Sclose(sp), H5Tclose(ty), H5Dclose(d);
    }
    uint8_t dg[SHA256_DIGEST_BYTES];
    sha256_final(&s, dg);
    sha256_hex(dg, hex);
    /* conv1/bias, fc1/bias; conv1's qvalue, scale; fc1's qvalue, scale, scale_absmax (double quantization) */
    CU_ASSERT(l->n == 7);
    free(l);
    H5Fclose(f);
}

static void test_base_identity(void) {
    /* adapters.h5 of q1 (24 steps of 16 per epoch, trained by the qlora run test) */
    CheckpointProvenance *p = malloc(sizeof *p), *q = malloc(sizeof *q);
    CU_ASSERT_PTR_NOT_NULL_FATAL(p);
    CU_ASSERT_PTR_NOT_NULL_FATAL(q);
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(checkpoint_read_provenance(path_in("q1", "adapters.h5"), p, &err), QT_OK);
    CU_ASSERT_EQUAL(p->step, 24);
    CU_ASSERT_EQUAL(p->epoch, 1);
    CU_ASSERT_EQUAL(strlen(p->base_sha256), 64);
    CU_ASSERT_STRING_EQUAL(p->base_init_from, qlora_runs.base_ckpt);
    /* every checkpoint of the run, and a run resumed on the same base, record the same identity */
    const char *same[][2] = {{"q1", "final.h5"}, {"q1", "ckpt-00000016.h5"}, {"r-split", "final.h5"},
                             {"q0", "final.h5"}};
    for (size_t i = 0; i < sizeof same / sizeof same[0]; i++) {
        CU_ASSERT_EQUAL_FATAL(checkpoint_read_provenance(path_in(same[i][0], same[i][1]), q, &err), QT_OK);
        CU_ASSERT_STRING_EQUAL(q->base_sha256, p->base_sha256);
    }
    char hex[SHA256_HEX_CHARS];
    base_sha256_from_file(path_in("q1", "final.h5"), hex);
    CU_ASSERT_STRING_EQUAL(hex, p->base_sha256);
    /* the adapter config: per-module dropout and init, and lora.trainable */
    H5ioFile f = H5IO_FILE_INIT;
    CU_ASSERT_EQUAL_FATAL(h5io_open(&f, path_in("q1", "adapters.h5"), &err), QT_OK);
    double dropout = 0;
    char *s = NULL;
    CU_ASSERT_EQUAL(h5io_attr_read_f64(&f, "lora/fc1", "dropout", &dropout, &err), QT_OK);
    CU_ASSERT(fabs(dropout - 0.1) < 1e-6);
    CU_ASSERT_EQUAL(h5io_attr_read_str(&f, "lora/fc1", "init", &s, &err), QT_OK);
    CU_ASSERT_STRING_EQUAL(s, "default");
    free(s);
    CU_ASSERT_EQUAL(h5io_attr_read_str(&f, "", "lora_trainable", &s, &err), QT_OK);
    CU_ASSERT_STRING_EQUAL(s, "head");
    free(s);
    h5io_close(&f, NULL);

    /* adapters over another base (fc1 int8 instead of nf4): a warning naming both hashes */
    const char *other[] = {"quant.rules.1.weight_qtype=int8", "quant.rules.1.tile_size=0",
                           "quant.rules.1.double_quant=false"};
    Config *c = load_cfg("tests/configs/tiny-qlora.yaml", "id-other", other, 3);
    Config *same_cfg = load_cfg("tests/configs/tiny-qlora.yaml", "id-same", NULL, 0);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    CU_ASSERT_PTR_NOT_NULL_FATAL(same_cfg);
    Net n;
    char line[1024] = "";
    CU_ASSERT_EQUAL_FATAL(net_build(&n, same_cfg, NET_FRESH, &err), QT_OK);
    FILE *w = tmpfile();
    CU_ASSERT_EQUAL(net_check_adapters_base(&n, path_in("q1", "adapters.h5"), w, &err), QT_OK);
    CU_ASSERT_EQUAL(ftell(w), 0); /* the same base: nothing to say */
    fclose(w);
    net_free(&n);
    CU_ASSERT_EQUAL_FATAL(net_build(&n, c, NET_FRESH, &err), QT_OK);
    char mine[SHA256_HEX_CHARS];
    CheckpointNet parts = net_checkpoint_parts(&n);
    CU_ASSERT_EQUAL(checkpoint_base_sha256(&n.model, &parts, mine, &err), QT_OK);
    CU_ASSERT_STRING_NOT_EQUAL(mine, p->base_sha256);
    w = tmpfile();
    CU_ASSERT_EQUAL(net_check_adapters_base(&n, path_in("q1", "adapters.h5"), w, &err), QT_OK);
    rewind(w);
    CU_ASSERT_PTR_NOT_NULL(fgets(line, sizeof line, w));
    CU_ASSERT(strstr(line, "warning") && strstr(line, "another base") && strstr(line, p->base_sha256) &&
              strstr(line, mine));
    fclose(w);
    c->lora.strict_base = true; /* n reads its config */
    CU_ASSERT_EQUAL(net_check_adapters_base(&n, path_in("q1", "adapters.h5"), stderr, &err), QT_ERR_CONFIG);
    CU_ASSERT(test_msg_has(&err, p->base_sha256) && test_msg_has(&err, mine) && test_msg_has(&err, "strict_base"));
    c->lora.strict_base = false;
    /* a file without the identity (an older qtrain's): loads, with a warning that the base cannot be checked */
    size_t size = 0;
    char *bytes = test_file_read(path_in("q1", "adapters.h5"), &size);
    char *old = path_in("q1", "old-adapters.h5");
    test_file_write(old, bytes, size);
    free(bytes);
    hid_t h = H5Fopen(old, H5F_ACC_RDWR, H5P_DEFAULT);
    CU_ASSERT_FATAL(h >= 0);
    CU_ASSERT(H5Adelete_by_name(h, "/", "base_sha256", H5P_DEFAULT) >= 0);
    H5Fclose(h);
    w = tmpfile();
    CU_ASSERT_EQUAL(net_check_adapters_base(&n, old, w, &err), QT_OK);
    rewind(w);
    CU_ASSERT_PTR_NOT_NULL(fgets(line, sizeof line, w));
    CU_ASSERT(strstr(line, "no base identity") && strstr(line, "cannot be checked"));
    fclose(w);
    net_free(&n);
    /* lora.strict_base: true through the config: the run is refused before training */
    char from[1200];
    snprintf(from, sizeof from, "model.adapters_from=%s", path_in("q1", "adapters.h5"));
    const char *strict[] = {other[0], other[1], other[2], from, "lora.strict_base=true"};
    Config *cs = load_cfg("tests/configs/tiny-qlora.yaml", "id-strict", strict, 5);
    CU_ASSERT_PTR_NOT_NULL_FATAL(cs);
    TrainResult r;
    CU_ASSERT_EQUAL(run(cs, NULL, 0, &r, &err), QT_ERR_CONFIG);
    CU_ASSERT(test_msg_has(&err, "another base") && test_msg_has(&err, p->base_sha256));
    free(cs);
    free(c);
    free(same_cfg);
    free(p);
    free(q);
}

/* ---- quantize and merge ------------------------------------------------------ */

static void test_quantize_then_init_from(void) {
    const char *pre[] = {"train.steps=0", "train.epochs=0"};
    Config *c = load_cfg("tests/configs/tiny-qlora.yaml", "qz", pre, 2);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    QtError err = {0};
    char *out = path_in("qz-file", "ptq.h5");
    char dir[1100];
    snprintf(dir, sizeof dir, "%s/qz-file", qlora_runs.root);
    CU_ASSERT_EQUAL_FATAL(mkdir(dir, 0777), 0);
    CU_ASSERT_EQUAL_FATAL(tools_quantize(c, qlora_runs.base_ckpt, out, false, NULL, &err), QT_OK);
    TrainResult direct, via;
    CU_ASSERT_EQUAL_FATAL(run(c, NULL, 0, &direct, &err), QT_OK);
    Config *c2 = load_cfg("tests/configs/tiny-qlora.yaml", "qz2", pre, 2);
    snprintf(c2->model.init_from, sizeof c2->model.init_from, "%s", out);
    CU_ASSERT_EQUAL(run(c2, NULL, 0, &via, &err), QT_OK);
    CU_ASSERT_EQUAL(direct.test_accuracy, via.test_accuracy);
    CU_ASSERT_EQUAL(direct.test_loss, via.test_loss);
    /* a quantized file under a config that keeps a module float is refused */
    Config *c3 = load_cfg("tests/configs/tiny-qlora.yaml", "qz3", pre, 2);
    snprintf(c3->model.init_from, sizeof c3->model.init_from, "%s", out);
    c3->quant.rules[0].spec.weight_qtype = NULL;
    CU_ASSERT_EQUAL(run(c3, NULL, 0, &via, &err), QT_ERR_CONFIG);
    CU_ASSERT(test_msg_has(&err, "conv1") && test_msg_has(&err, "keep it float"));
    free(c);
    free(c2);
    free(c3);
}

/* A merged checkpoint says what it is: its base's mode, where it came from
 * (the source and its base identity), in its attributes and in eval.json;
 * n_quant modules remain quantized. */
static void check_merged(const char *merged, const char *source, const char *mode, int n_quant) {
    CheckpointProvenance *p = malloc(sizeof *p), *s = malloc(sizeof *s);
    Config *c = malloc(sizeof *c);
    CU_ASSERT_FATAL(p && s && c);
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(checkpoint_read_provenance(merged, p, &err), QT_OK);
    CU_ASSERT_EQUAL_FATAL(checkpoint_read_provenance(source, s, &err), QT_OK);
    CU_ASSERT_STRING_EQUAL(p->merged_from, source);
    CU_ASSERT_EQUAL(strlen(s->base_sha256), 64);
    CU_ASSERT_STRING_EQUAL(p->merged_from_base_sha256, s->base_sha256);
    char paths[8][MODULE_NAME_MAX];
    int n = -1;
    CU_ASSERT_EQUAL(checkpoint_list_quant(merged, paths, 8, &n, &err), QT_OK);
    CU_ASSERT_EQUAL(n, n_quant);
    H5ioFile f = H5IO_FILE_INIT;
    char *m = NULL;
    CU_ASSERT_EQUAL_FATAL(h5io_open(&f, merged, &err), QT_OK);
    CU_ASSERT_EQUAL(h5io_attr_read_str(&f, "", "mode", &m, &err), QT_OK);
    CU_ASSERT_STRING_EQUAL(m, mode);
    CU_ASSERT_EQUAL(h5io_kind(&f, "lora"), H5IO_MISSING);
    free(m);
    h5io_close(&f, NULL);
    /* qtrain eval of it: eval.json reports the mode and the source */
    char *text = NULL;
    CU_ASSERT_EQUAL_FATAL(checkpoint_read_config(merged, &text, &err), QT_OK);
    CU_ASSERT_EQUAL_FATAL(config_load_string(c, text, "merged", NULL, 0, &err), QT_OK);
    free(text);
    char json[1200];
    snprintf(json, sizeof json, "%s/merged-eval-%s.json", qlora_runs.root, mode);
    TrainResult r;
    CU_ASSERT_EQUAL_FATAL(train_eval_checkpoint_to(c, merged, json, &r, &err), QT_OK);
    CU_ASSERT_STRING_EQUAL(r.mode, mode);
    CU_ASSERT_STRING_EQUAL(r.merged_from, source);
    text = test_file_read(json, NULL);
    CU_ASSERT_PTR_NOT_NULL_FATAL(text);
    char want[160];
    snprintf(want, sizeof want, "\"merged_from_base_sha256\": \"%s\"", s->base_sha256);
    CU_ASSERT_PTR_NOT_NULL(strstr(text, want));
    snprintf(want, sizeof want, "\"mode\": \"%s\"", mode);
    CU_ASSERT_PTR_NOT_NULL(strstr(text, want));
    CU_ASSERT_PTR_NOT_NULL(strstr(text, "\"merged_from\": "));
    free(text);
    free(p);
    free(s);
    free(c);
}

static void test_merge(void) {
    /* a float base: the merge is exact up to float rounding */
    const char *float_base[] = {"quant.mode=none", "quant.rules=[]"};
    Config *c = load_cfg("tests/configs/tiny-qlora.yaml", "m-float", float_base, 2);
    Config *q = load_cfg("tests/configs/tiny-qlora.yaml", "m-q", NULL, 0);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    CU_ASSERT_PTR_NOT_NULL_FATAL(q);
    TrainResult r;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(run(c, NULL, 0, &r, &err), QT_OK);
    CU_ASSERT_STRING_EQUAL(r.mode, "lora");
    MergeReport rep;
    CU_ASSERT_EQUAL_FATAL(tools_merge(path_in("m-float", "final.h5"), path_in("m-float", "merged.h5"), false, false, NULL,
                                      &rep, &err), QT_OK);
    CU_ASSERT_EQUAL(rep.modules, 2);
    CU_ASSERT_STRING_EQUAL(rep.mode, "float");
    CU_ASSERT_EQUAL(rep.weight_rel_rmse, 0.0);
    CU_ASSERT(fabs(rep.test_accuracy_after - rep.test_accuracy_before) <= 0.002);
    /* a quantized base: re-quantization costs a little */
    CU_ASSERT_EQUAL_FATAL(run(q, NULL, 0, &r, &err), QT_OK);
    CU_ASSERT_EQUAL_FATAL(tools_merge(path_in("m-q", "final.h5"), path_in("m-q", "merged.h5"), false, false, NULL, &rep,
                                      &err), QT_OK);
    CU_ASSERT(rep.weight_rel_rmse > 0.0 && rep.weight_rel_rmse < 0.2);
    CU_ASSERT(fabs(rep.test_accuracy_after - rep.test_accuracy_before) < 0.1);
    CU_ASSERT(rep.test_loss_before > 0.0 && rep.test_loss_after > 0.0 && isfinite(rep.test_loss_after));
    CU_ASSERT_STRING_EQUAL(rep.mode, "ptq");
    check_merged(path_in("m-q", "merged.h5"), path_in("m-q", "final.h5"), "ptq", 2);
    /* --dequantize: a float model, the dequantized base plus the adapters, without re-quantization */
    MergeReport deq;
    CU_ASSERT_EQUAL_FATAL(tools_merge(path_in("m-q", "final.h5"), path_in("m-q", "merged-float.h5"), true, false, NULL, &deq,
                                      &err), QT_OK);
    CU_ASSERT(deq.dequantized);
    CU_ASSERT_EQUAL(deq.weight_rel_rmse, 0.0);
    CU_ASSERT_STRING_EQUAL(deq.mode, "float");
    CU_ASSERT_EQUAL(deq.test_accuracy_before, rep.test_accuracy_before);
    /* the same function as the adapters over the quantized base, up to float rounding */
    CU_ASSERT(fabs(deq.test_accuracy_after - deq.test_accuracy_before) <= 0.002);
    CU_ASSERT(fabs(deq.test_loss_after - deq.test_loss_before) < 1e-3);
    check_merged(path_in("m-q", "merged-float.h5"), path_in("m-q", "final.h5"), "float", 0);
    /* the command line: --dequantize, and the accuracy and loss before and after on the last line */
    char *log = path_in("m-q", "merge-cli.log");
    const char *args[] = {"merge", "--dequantize", "--checkpoint", path_in("m-q", "final.h5"), "--out",
                          path_in("m-q", "merged-cli.h5"), "--quiet", NULL};
    CU_ASSERT_EQUAL(test_proc_run(log, args, 120.0), 0);
    char *out = test_file_read(log, NULL);
    CU_ASSERT_PTR_NOT_NULL_FATAL(out);
    CU_ASSERT(strstr(out, "merged:2 mode:float weight_rel_rmse:0 ") && strstr(out, "test_accuracy_before:") &&
              strstr(out, "test_loss_before:") && strstr(out, "test_loss_after:"));
    free(out);
    /* --dequantize is merge's alone */
    const char *conv[] = {"convert", "--dequantize", "--checkpoint", path_in("m-q", "final.h5"), "--out",
                          path_in("m-q", "converted-cli.h5"), NULL};
    CU_ASSERT_EQUAL(test_proc_run(log, conv, 120.0), 2);
    out = test_file_read(log, NULL);
    CU_ASSERT(out && strstr(out, "qtrain convert: unknown option '--dequantize'"));
    free(out);
    free(c);
    free(q);
}

/* ---- compare ------------------------------------------------------------------------ */

static void test_compare(void) {
    const char *dirs[3] = {"m-float", "q0", "q1"};
    CompareRun runs[3];
    QtError err = {0};
    for (int i = 0; i < 3; i++) {
        char d[1024];
        snprintf(d, sizeof d, "%s/%s", qlora_runs.root, dirs[i]);
        CU_ASSERT_EQUAL_FATAL(compare_load_run(&runs[i], d, &err), QT_OK);
    }
    CU_ASSERT_STRING_EQUAL(runs[0].mode, "lora");
    CU_ASSERT_STRING_EQUAL(runs[0].weights, "float32");
    CU_ASSERT_STRING_EQUAL(runs[2].mode, "qlora");
    CU_ASSERT_STRING_EQUAL(runs[2].weights, "nf4/8,nf4/64+dq");
    CU_ASSERT(runs[2].bits_per_param > 4.0 && runs[2].bits_per_param < 5.5);
    CU_ASSERT_EQUAL(runs[1].n_points, 0); /* an evaluation-only run has no training curve */
    CU_ASSERT_EQUAL(runs[2].n_points, 6);  /* 24 steps logged every 4 */
    CU_ASSERT_EQUAL(runs[2].steps[5], 24.0);
    char out[1024];
    snprintf(out, sizeof out, "%s/cmp", qlora_runs.root);
    FILE *table = tmpfile();
    CU_ASSERT_EQUAL(compare_write(runs, 3, out, table, &err), QT_OK);
    rewind(table);
    char text[4096] = "";
    CU_ASSERT(fread(text, 1, sizeof text - 1, table) > 0);
    fclose(table);
    /* no float run among these: no delta column values */
    CU_ASSERT_PTR_NOT_NULL(strstr(text, "Δ vs float (none)"));
    CU_ASSERT_PTR_NOT_NULL(strstr(text, "| test-tiny-qlora | qlora | nf4/8,nf4/64+dq | none | none |"));
    size_t n = 0;
    char *svg = test_file_read(path_in("cmp", "compare.svg"), &n);
    CU_ASSERT(svg && strstr(svg, "<polyline") && strstr(svg, "</svg>"));
    free(svg);
    CU_ASSERT(test_file_exists(out, "compare.md"));
    for (int i = 0; i < 3; i++) compare_run_free(&runs[i]);
    CompareRun none;
    CU_ASSERT_EQUAL(compare_load_run(&none, qlora_runs.root, &err), QT_ERR_IO);
    CU_ASSERT(test_msg_has(&err, "summary.json"));
}

/* A run directory with a summary and the given metrics.csv rows. */
static void write_fake_run(const char *dir, const char *name, const char *rows) {
    CU_ASSERT_FATAL(mkdir(dir, 0777) == 0);
    char path[1200];
    snprintf(path, sizeof path, "%s/summary.json", dir);
    FILE *f = fopen(path, "w");
    CU_ASSERT_FATAL(f != NULL);
    fprintf(f, "{\n  \"name\": \"%s\",\n  \"mode\": \"float\",\n  \"test_accuracy\": 0.5\n}\n", name);
    fclose(f);
    snprintf(path, sizeof path, "%s/metrics.csv", dir);
    f = fopen(path, "w");
    CU_ASSERT_FATAL(f != NULL);
    fprintf(f, "split,step,epoch,loss,accuracy,lr,samples_per_s,wall_s\n%s", rows);
    fclose(f);
}

/* compare on a metrics.csv with a row at step inf, and on one whose losses
 * are near 1e-19: the tick loops used to run away (gigabytes of SVG). Run
 * in a child with a 4 MB file-size limit and a 60 s alarm, so the old
 * behaviour fails the test instead of filling the disk. */
static void test_compare_bad_rows_stay_small(void) {
    char inf_dir[1024], tiny_dir[1024], out[1024], log[1100];
    snprintf(inf_dir, sizeof inf_dir, "%s/cmp-inf", qlora_runs.root);
    snprintf(tiny_dir, sizeof tiny_dir, "%s/cmp-tiny", qlora_runs.root);
    snprintf(out, sizeof out, "%s/cmp-bad", qlora_runs.root);
    snprintf(log, sizeof log, "%s/cmp-bad.log", qlora_runs.root);
    write_fake_run(inf_dir, "inf-step", "train,10,1.0,2.0,0.1,0.001,1.0,1.0\ntrain,inf,2.0,1.5,0.2,0.001,1.0,2.0\n"
                   "train,30,3.0,nan,0.3,0.001,1.0,3.0\ntrain,40,4.0,1.0,0.4,0.001,1.0,4.0\n");
    write_fake_run(tiny_dir, "tiny-loss", "train,10,1.0,3e-19,0.9,0.001,1.0,1.0\ntrain,20,2.0,1e-19,0.9,0.001,1.0,2.0\n");
    fflush(NULL);
    pid_t pid = fork();
    CU_ASSERT_FATAL(pid >= 0);
    if (pid == 0) {
        struct rlimit lim = {4u << 20, 4u << 20};
        setrlimit(RLIMIT_FSIZE, &lim);
        alarm(60);
        if (!freopen(log, "w", stderr)) _exit(3);
        CompareRun runs[2];
        QtError err = {0};
        if (compare_load_run(&runs[0], inf_dir, &err) != QT_OK || compare_load_run(&runs[1], tiny_dir, &err) != QT_OK)
            _exit(4);
        int rc = compare_write(runs, 2, out, NULL, &err) == QT_OK ? (runs[0].n_points == 2 ? 0 : 5) : 6;
        fflush(stderr);
        _exit(rc);
    }
    int status = 0;
    CU_ASSERT(waitpid(pid, &status, 0) == pid);
    CU_ASSERT(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    if (!(WIFEXITED(status) && WEXITSTATUS(status) == 0)) fprintf(stderr, "\n  compare child: status %#x\n", status);
    struct stat st;
    char svg[1200];
    snprintf(svg, sizeof svg, "%s/compare.svg", out);
    CU_ASSERT(stat(svg, &st) == 0 && st.st_size < (1 << 20));
    char *text = test_file_read(log, NULL), want[1200];
    snprintf(want, sizeof want, "%s/metrics.csv:3: a train row with step inf", inf_dir);
    CU_ASSERT(text && strstr(text, want));
    snprintf(want, sizeof want, "%s/metrics.csv:4: a train row with step 30 and loss nan", inf_dir);
    CU_ASSERT(text && strstr(text, want));
    if (!text || !strstr(text, want)) fprintf(stderr, "\n  compare's warnings:\n%s\n", text ? text : "(none)");
    free(text);
}

/* ---- bad input ------------------------------------------------------------------ */

static void expect_run_error(const char *sub, const char *const *ov, int n, QtStatus want, const char *a,
                             const char *b) {
    Config *c = load_cfg("tests/configs/tiny-qlora.yaml", sub, ov, n);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    TrainResult r;
    QtError err = {0};
    CU_ASSERT_EQUAL(run(c, NULL, 0, &r, &err), want);
    if (!test_msg_has(&err, a) || !test_msg_has(&err, b)) {
        fprintf(stderr, "\n  unexpected message: %s\n", err.msg);
        CU_FAIL("message");
    }
    free(c);
}

static void test_bad_inputs(void) {
    const char *rank[] = {"lora.rules.0.rank=9"};
    expect_run_error("e-rank", rank, 1, QT_ERR_CONFIG, "conv1", "rank 9");
    /* the second adapted module fails: everything built so far is freed cleanly */
    const char *head[] = {"lora.trainable=[]", "lora.rules.0.op_types=[dense]", "lora.rules.0.rank=11"};
    expect_run_error("e-head", head, 3, QT_ERR_CONFIG, "head", "rank 11");
    const char *no_init[] = {"model.init_from="};
    expect_run_error("e-init", no_init, 1, QT_ERR_CONFIG, "model.init_from", "ptq");
    const char *tile[] = {"quant.rules.0.tile_size=7"};
    expect_run_error("e-tile", tile, 1, QT_ERR_CONFIG, "quant.rules[0]", "conv1");
    /* adapters of another model: rank 4 file, rank 2 run */
    char from[1200];
    snprintf(from, sizeof from, "model.adapters_from=%s", path_in("q1", "adapters.h5"));
    const char *other[] = {from, "lora.rules.0.rank=2"};
    expect_run_error("e-adapters", other, 2, QT_ERR_CONFIG, "conv1 was trained with rank 4", "gives rank 2");
    /* the stored alpha and rslora win over nothing: a mismatch is refused, naming both values */
    const char *alpha[] = {from, "lora.rules.0.alpha=4"};
    expect_run_error("e-alpha", alpha, 2, QT_ERR_CONFIG, "rank 4, alpha 8, rslora false", "rank 4, alpha 4,");
    const char *rs[] = {from, "lora.rules.0.rslora=true"};
    expect_run_error("e-rslora", rs, 2, QT_ERR_CONFIG, "conv1 was trained with", "rslora true; set that rule");
    const char *nothing[] = {"lora.rules=[]", "lora.trainable=[]"};
    expect_run_error("e-nothing", nothing, 2, QT_ERR_CONFIG, "nothing to train", "epochs: 0");
}

int register_qlora_suite(void) {
    CU_pSuite s = CU_add_suite("qlora", qlora_suite_init, qlora_suite_cleanup);
    if (!s) return -1;
    return !CU_add_test(s, "adapter gradients over a quantized base (dense, conv)",
                        test_adapter_grads_over_quantized_base) ||
           !CU_add_test(s, "rules: first full match, op_types, unused-rule warning", test_rules_first_full_match) ||
           !CU_add_test(s, "rules: a shadowed rule names the rule that took its modules",
                        test_rules_shadowed_warning) ||
           !CU_add_test(s, "qlora run: learns, base bit-identical", test_qlora_run_learns_and_keeps_base) ||
           !CU_add_test(s, "qlora resume exact; adapters.h5 round trip", test_qlora_resume_is_exact) ||
           !CU_add_test(s, "base identity: recorded, recomputable, checked on adapters_from", test_base_identity) ||
           !CU_add_test(s, "quantize, then init_from the PTQ file", test_quantize_then_init_from) ||
           !CU_add_test(s, "merge: float exact, quantized small error", test_merge) ||
           !CU_add_test(s, "compare: table, compare.md, compare.svg", test_compare) ||
           !CU_add_test(s, "compare: a step of inf or losses near 1e-19 give a small chart, bad rows named",
                        test_compare_bad_rows_stay_small) ||
           !CU_add_test(s, "errors before training", test_bad_inputs) || qlora_add_qat_tests(s) != 0;
}
