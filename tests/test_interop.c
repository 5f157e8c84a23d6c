/* test_interop.c - models in and out of PyTorch: `qtrain export` and
 * model.init_from of a .safetensors file.
 *
 * A residual batch-norm CNN trained on the mini set, exported as
 * safetensors, starts a run (init_from) that evaluates to the same loss bit
 * for bit, with the same parameters and statistics; the h5 export evaluates
 * the same; an int8 PTQ model with its batch norms folded exports its
 * dequantized weights, which evaluate as the PTQ model did; a QLoRA run
 * exports with --merge as `merge --dequantize` does; PyTorch (Debian's
 * python3-torch, skipped without it) loads the export into the config's
 * model and reproduces `eval --dump-logits` within 1e-5 relative; a
 * safetensors file of another model is an error listing the missing or
 * extra tensors or naming both shapes. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/safetensors.h"
#include "test_proc.h"
#include "test_runs.h"
#include "test_util.h"

static TestRuns runs;

static int suite_init(void) { return test_runs_init(&runs); }
static int suite_cleanup(void) { return test_runs_cleanup(&runs); }

static const char *path_in(const char *name) {
    static char buf[4][1100];
    static int k;
    k = (k + 1) % 4;
    snprintf(buf[k], sizeof buf[k], "%s/%s", runs.root, name);
    return buf[k];
}

/* qtrain ARGS... to completion; its exit status. */
static int qtrain(const char *log, const char *const *args) { return test_proc_run(path_in(log), args, 300); }

/* test_loss of `qtrain eval --checkpoint ckpt`, as its line prints it (or NAN). */
static double eval_loss(const char *ckpt) {
    const char *args[] = {"eval", "--checkpoint", ckpt, "--out", path_in("eval.json"), "--quiet", NULL};
    if (qtrain("eval.log", args) != 0) return NAN;
    char *text = test_file_read(path_in("eval.json"), NULL);
    const char *at = text ? strstr(text, "\"test_loss\":") : NULL;
    double v = at ? strtod(at + strlen("\"test_loss\":"), NULL) : NAN;
    free(text);
    return v;
}

/* The residual BN CNN (tests/configs/tiny-res.yaml) trained once; its final.h5. */
static const char *trained_res(void) {
    static char ckpt[1100];
    if (ckpt[0]) return ckpt;
    char out[1100];
    snprintf(out, sizeof out, "run.out_dir=%s/res", runs.root);
    const char *args[] = {"--config", "tests/configs/tiny-res.yaml", "--set", out, "--quiet", NULL};
    if (qtrain("res.log", args) != 0) return NULL;
    snprintf(ckpt, sizeof ckpt, "%s/res/final.h5", runs.root);
    return ckpt;
}

static void test_safetensors_round_trip(void) {
    const char *ckpt = trained_res();
    CU_ASSERT_PTR_NOT_NULL_FATAL(ckpt);
    char st_path[1100], h5_path[1100], from[1200], out[1100];
    snprintf(st_path, sizeof st_path, "%s", path_in("res.safetensors"));
    snprintf(h5_path, sizeof h5_path, "%s", path_in("res-float.h5"));
    const char *ex[] = {"export", "--checkpoint", ckpt, "--format", "safetensors", "--out", st_path, NULL};
    CU_ASSERT_EQUAL_FATAL(qtrain("export.log", ex), 0);
    const char *ex2[] = {"export", "--checkpoint", ckpt, "--format", "h5", "--out", h5_path, NULL};
    CU_ASSERT_EQUAL_FATAL(qtrain("export.log", ex2), 0);
    /* names and metadata as PyTorch's state_dict has them */
    StFile f;
    QtError e = {0};
    CU_ASSERT_EQUAL_FATAL(st_open(&f, st_path, &e), QT_OK);
    CU_ASSERT_PTR_NOT_NULL(st_find(&f, "stem.weight"));
    CU_ASSERT_PTR_NOT_NULL(st_find(&f, "stem_bn.running_var"));
    const StTensor *nbt = st_find(&f, "stem_bn.num_batches_tracked");
    CU_ASSERT_PTR_NOT_NULL(nbt);
    if (nbt) CU_ASSERT(nbt->dtype == ST_I64 && nbt->ndim == 0 && nbt->end - nbt->begin == 8); /* PyTorch's int64 */
    CU_ASSERT(st_meta(&f, "format") && strcmp(st_meta(&f, "format"), "pt") == 0);
    st_close(&f);
    /* a run started from it (no training) evaluates to the same loss, bit for bit, with the same state */
    snprintf(from, sizeof from, "model.init_from=%s", st_path);
    snprintf(out, sizeof out, "run.out_dir=%s/from-st", runs.root);
    const char *run[] = {"--config", "tests/configs/tiny-res.yaml", "--set", from, "--set", out, "--set",
                         "train.epochs=0", "--set", "train.steps=0", "--quiet", NULL};
    CU_ASSERT_EQUAL_FATAL(qtrain("from-st.log", run), 0);
    const double l0 = eval_loss(ckpt), l1 = eval_loss(path_in("from-st/final.h5")), l2 = eval_loss(h5_path);
    CU_ASSERT(isfinite(l0));
    CU_ASSERT_EQUAL(l1, l0);
    CU_ASSERT_EQUAL(l2, l0);
    Config *c = test_runs_config(&runs, "tests/configs/tiny-res.yaml", "cmp", NULL, 0);
    CU_ASSERT_PTR_NOT_NULL_FATAL(c);
    test_runs_assert_same_state(c, ckpt, path_in("from-st/final.h5"));
    free(c);
}

/* PyTorch loads the export into the config's model (bench/torch_model.py) and gives qtrain's logits. */
static void test_pytorch_reproduces_logits(void) {
    if (access("/usr/bin/python3", X_OK) != 0) {
        test_skip("interop: /usr/bin/python3 is missing (Debian's python3)");
        return;
    }
    const char *ckpt = trained_res();
    CU_ASSERT_PTR_NOT_NULL_FATAL(ckpt);
    char st_path[1100], npy[1100], cmd[4096];
    snprintf(st_path, sizeof st_path, "%s", path_in("res-torch.safetensors"));
    snprintf(npy, sizeof npy, "%s", path_in("res-logits.npy"));
    const char *ex[] = {"export", "--checkpoint", ckpt, "--format", "safetensors", "--out", st_path, NULL};
    CU_ASSERT_EQUAL_FATAL(qtrain("export.log", ex), 0);
    const char *ev[] = {"eval", "--checkpoint", ckpt, "--out", path_in("e.json"), "--dump-logits", npy, NULL};
    CU_ASSERT_EQUAL_FATAL(qtrain("dump.log", ev), 0);
    snprintf(cmd, sizeof cmd, "OMP_NUM_THREADS=1 /usr/bin/python3 tests/interop_check.py --config "
             "tests/configs/tiny-res.yaml --set data.dir=data/fashion-mnist-mini --safetensors %s --logits %s "
             ">%s 2>&1", st_path, npy, path_in("torch.log"));
    int rc = system(cmd);
    char *text = test_file_read(path_in("torch.log"), NULL);
    if (rc != 0 && text && strstr(text, "No module named")) {
        test_skip("interop: /usr/bin/python3 cannot import torch and numpy (install python3-torch)");
    } else {
        if (rc != 0) fprintf(stderr, "\n  %s\n", text ? text : "(no output)");
        CU_ASSERT_EQUAL(rc, 0);
        CU_ASSERT(text && strstr(text, "interop: ok") != NULL);
    }
    free(text);
}

/* An int8 PTQ model (batch norms folded) exports its dequantized weights and identity batch norms: a float run
 * from the export evaluates as the PTQ model; a QLoRA run exports with --merge as `merge --dequantize` does. */
static void test_quantized_exports(void) {
    const char *ckpt = trained_res();
    CU_ASSERT_PTR_NOT_NULL_FATAL(ckpt);
    char from[1200], out[1100], st_path[1100];
    snprintf(from, sizeof from, "model.init_from=%s", ckpt);
    snprintf(out, sizeof out, "run.out_dir=%s/ptq", runs.root);
    const char *ptq[] = {"--config", "tests/configs/tiny-res.yaml", "--set", from, "--set", out, "--set",
                         "quant.mode=ptq", "--set", "quant.rules=[{module_path: \".*\", weight_qtype: int8}]",
                         "--set", "train.epochs=0", "--set", "train.steps=0", "--quiet", NULL};
    CU_ASSERT_EQUAL_FATAL(qtrain("ptq.log", ptq), 0);
    snprintf(st_path, sizeof st_path, "%s", path_in("ptq.safetensors"));
    const char *ex[] = {"export", "--checkpoint", path_in("ptq/final.h5"), "--format", "safetensors", "--out",
                        st_path, NULL};
    CU_ASSERT_EQUAL_FATAL(qtrain("export.log", ex), 0);
    snprintf(from, sizeof from, "model.init_from=%s", st_path);
    snprintf(out, sizeof out, "run.out_dir=%s/from-ptq", runs.root);
    const char *run[] = {"--config", "tests/configs/tiny-res.yaml", "--set", from, "--set", out, "--set",
                         "train.epochs=0", "--set", "train.steps=0", "--quiet", NULL};
    CU_ASSERT_EQUAL_FATAL(qtrain("from-ptq.log", run), 0);
    const double lq = eval_loss(path_in("ptq/final.h5")), lf = eval_loss(path_in("from-ptq/final.h5"));
    CU_ASSERT(isfinite(lq));
    CU_ASSERT(fabs(lf - lq) <= 1e-6 * fabs(lq));
    if (!(fabs(lf - lq) <= 1e-6 * fabs(lq))) fprintf(stderr, "\n  ptq %.9g, float export %.9g\n", lq, lf);
    /* a folded batch norm without affine parameters: exported without them, and the export loads back */
    snprintf(out, sizeof out, "run.out_dir=%s/bn-na", runs.root);
    const char *bn[] = {"--config", "tests/configs/tiny-bn.yaml", "--set", out, "--set", "model.layers.0.bias=true",
                        "--set", "model.layers.1.affine=false", "--set", "train.steps=4", "--quiet", NULL};
    CU_ASSERT_EQUAL_FATAL(qtrain("bn-na.log", bn), 0);
    snprintf(from, sizeof from, "model.init_from=%s/bn-na/final.h5", runs.root);
    snprintf(out, sizeof out, "run.out_dir=%s/bn-na-ptq", runs.root);
    const char *bnq[] = {"--config", "tests/configs/tiny-bn.yaml", "--set", out, "--set", from, "--set",
                         "model.layers.0.bias=true", "--set", "model.layers.1.affine=false", "--set", "quant.mode=ptq",
                         "--set", "quant.rules=[{module_path: \".*\", weight_qtype: int8}]", "--set", "train.epochs=0",
                         "--set", "train.steps=0", "--quiet", NULL};
    CU_ASSERT_EQUAL_FATAL(qtrain("bn-na-ptq.log", bnq), 0);
    snprintf(st_path, sizeof st_path, "%s", path_in("bn-na.safetensors"));
    const char *exb[] = {"export", "--checkpoint", path_in("bn-na-ptq/final.h5"), "--format", "safetensors", "--out",
                         st_path, NULL};
    CU_ASSERT_EQUAL_FATAL(qtrain("export.log", exb), 0);
    StFile fb;
    QtError eb = {0};
    CU_ASSERT_EQUAL_FATAL(st_open(&fb, st_path, &eb), QT_OK);
    CU_ASSERT(st_find(&fb, "bn1.running_var") && !st_find(&fb, "bn1.weight") && !st_find(&fb, "bn1.bias"));
    st_close(&fb);
    snprintf(from, sizeof from, "model.init_from=%s", st_path);
    snprintf(out, sizeof out, "run.out_dir=%s/bn-na-back", runs.root);
    const char *bnb[] = {"--config", "tests/configs/tiny-bn.yaml", "--set", out, "--set", from, "--set",
                         "model.layers.0.bias=true", "--set", "model.layers.1.affine=false", "--set", "train.epochs=0",
                         "--set", "train.steps=0", "--quiet", NULL};
    CU_ASSERT_EQUAL_FATAL(qtrain("bn-na-back.log", bnb), 0);
    const double lp = eval_loss(path_in("bn-na-ptq/final.h5")), lb = eval_loss(path_in("bn-na-back/final.h5"));
    CU_ASSERT(isfinite(lp) && fabs(lb - lp) <= 1e-6 * fabs(lp));
    /* --merge of a run without adapters is refused; export of a format it does not write too */
    const char *merge[] = {"export", "--checkpoint", ckpt, "--format", "safetensors", "--merge", "--out",
                           path_in("none.safetensors"), NULL};
    CU_ASSERT_EQUAL(qtrain("refused.log", merge), 2);
    char *text = test_file_read(path_in("refused.log"), NULL);
    CU_ASSERT(text && strstr(text, "has no LoRA adapters"));
    free(text);
    const char *peft[] = {"export", "--checkpoint", ckpt, "--format", "onnx", "--out", path_in("x.onnx"), NULL};
    CU_ASSERT_EQUAL(qtrain("refused2.log", peft), 2);
}

/* init_from of a safetensors file of another model: missing, extra and misshapen tensors named. */
static void test_wrong_model_refused(void) {
    const char *ckpt = trained_res();
    CU_ASSERT_PTR_NOT_NULL_FATAL(ckpt);
    char st_path[1100], from[1200], out[1100];
    snprintf(st_path, sizeof st_path, "%s", path_in("res2.safetensors"));
    const char *ex[] = {"export", "--checkpoint", ckpt, "--format", "safetensors", "--out", st_path, NULL};
    CU_ASSERT_EQUAL_FATAL(qtrain("export.log", ex), 0);
    snprintf(from, sizeof from, "model.init_from=%s", st_path);
    struct {
        const char *config, *extra, *want;
    } cases[] = {
        {"tests/configs/tiny-mlp.yaml", "run.seed=1",
         "lacks 2 tensors the model needs (fc1.weight, fc1.bias) and holds 18 it does not have (stem.weight, "},
        {"tests/configs/tiny-res.yaml", "model.layers.0.kernel=5", "tensor stem.weight has shape (8, 1, 3, 3), "
                                                                   "but the config's model needs (8, 1, 5, 5)"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        snprintf(out, sizeof out, "run.out_dir=%s/wrong%zu", runs.root, k);
        const char *run[] = {"--config", cases[k].config, "--set", from, "--set", out, "--set", cases[k].extra,
                             "--quiet", NULL};
        int rc = qtrain("wrong.log", run);
        char *text = test_file_read(path_in("wrong.log"), NULL);
        CU_ASSERT(rc != 0 && text && strstr(text, cases[k].want));
        if (!(text && strstr(text, cases[k].want))) fprintf(stderr, "\n  want '%s' in:\n%s\n", cases[k].want, text);
        free(text);
        unlink(path_in("wrong.log"));
    }
}

/* Trains config from the shared base into <root>/<run> (log <run>.log), then exports its final.h5 as the PEFT
 * directory path_in(peft) (log <peft>.log): the checkpoint's path into ck, the directory's into dir. Fatal on a
 * failure. */
static bool train_export_peft(const char *config, const char *run, const char *peft, char *ck, size_t ck_n,
                              char *dir, size_t dir_n) {
    char base[1200], out[1100], log[64];
    snprintf(base, sizeof base, "model.init_from=%s", runs.base_ckpt);
    snprintf(out, sizeof out, "run.out_dir=%s/%s", runs.root, run);
    const char *train[] = {"--config", config, "--set", base, "--set", out, "--quiet", NULL};
    snprintf(log, sizeof log, "%s.log", run);
    if (qtrain(log, train) != 0) return false;
    snprintf(ck, ck_n, "%s/%s/final.h5", runs.root, run);
    snprintf(dir, dir_n, "%s", path_in(peft));
    const char *ex[] = {"export", "--checkpoint", ck, "--format", "peft", "--out", dir, NULL};
    snprintf(log, sizeof log, "%s.log", peft);
    return qtrain(log, ex) == 0;
}

/* A QLoRA run (nf4 base, adapters on a conv and a dense layer, the head trained in full) as a PEFT adapter
 * directory: adapter_config.json's fields; PyTorch applying PEFT's conventions to base_model.safetensors
 * reproduces the run's logits; refusals. */
static void test_peft_export(void) {
    char base[1200], ql[1200], dir[1100], npy[1100], cmd[4096];
    CU_ASSERT_FATAL(train_export_peft("tests/configs/tiny-qlora.yaml", "ql", "peft", ql, sizeof ql, dir, sizeof dir));
    snprintf(base, sizeof base, "model.init_from=%s", runs.base_ckpt);
    snprintf(npy, sizeof npy, "%s", path_in("ql-logits.npy"));
    const char *ex[] = {"export", "--checkpoint", ql, "--format", "peft", "--out", dir, NULL};
    char *conf = test_file_read(path_in("peft/adapter_config.json"), NULL);
    CU_ASSERT_PTR_NOT_NULL_FATAL(conf);
    static const char *const want[] = {"\"peft_type\": \"LORA\"", "\"r\": 4", "\"lora_alpha\": 8",
                                       "\"use_rslora\": false", "\"lora_dropout\": 0.1,", "\"bias\": \"none\"",
                                       "\"target_modules\": [\"conv1\", \"fc1\"]",
                                       "\"modules_to_save\": [\"head\"]"};
    for (size_t k = 0; k < sizeof want / sizeof want[0]; k++) {
        if (!strstr(conf, want[k])) fprintf(stderr, "\n  adapter_config.json lacks %s:\n%s\n", want[k], conf);
        CU_ASSERT(strstr(conf, want[k]) != NULL);
    }
    free(conf);
    StFile f;
    QtError e = {0};
    CU_ASSERT_EQUAL_FATAL(st_open(&f, path_in("peft/adapter_model.safetensors"), &e), QT_OK);
    const StTensor *a = st_find(&f, "base_model.model.conv1.lora_A.weight");
    const StTensor *b = st_find(&f, "base_model.model.fc1.lora_B.weight");
    CU_ASSERT(a && a->ndim == 4 && a->shape[0] == 4 && a->shape[1] == 1 && a->shape[2] == 3);
    CU_ASSERT(b && b->ndim == 2 && b->shape[0] == 32 && b->shape[1] == 4);
    CU_ASSERT_PTR_NOT_NULL(st_find(&f, "base_model.model.head.weight"));
    st_close(&f);
    /* refusals: the directory exists; no adapters; --merge */
    CU_ASSERT_EQUAL(qtrain("peft2.log", ex), 1);
    const char *none[] = {"export", "--checkpoint", runs.base_ckpt, "--format", "peft", "--out", path_in("p2"), NULL};
    CU_ASSERT_EQUAL(qtrain("peft3.log", none), 2);
    const char *ev[] = {"eval", "--checkpoint", ql, "--out", path_in("ql.json"), "--dump-logits", npy, NULL};
    CU_ASSERT_EQUAL_FATAL(qtrain("ql-dump.log", ev), 0);
    /* back in: model.adapters_from of the directory gives the same adapters and head, bit for bit */
    char from[1200], out2[1100];
    snprintf(from, sizeof from, "model.adapters_from=%s", dir);
    snprintf(out2, sizeof out2, "run.out_dir=%s/ql-back", runs.root);
    const char *back[] = {"--config", "tests/configs/tiny-qlora.yaml", "--set", base, "--set", from, "--set", out2,
                          "--set", "train.steps=0", "--set", "train.epochs=0", "--quiet", NULL};
    CU_ASSERT_EQUAL_FATAL(qtrain("ql-back.log", back), 0);
    CU_ASSERT(test_ckpt_group_within(ql, path_in("ql-back/final.h5"), "lora"));
    CU_ASSERT(test_ckpt_group_within(ql, path_in("ql-back/final.h5"), "params/head"));
    CU_ASSERT_EQUAL(eval_loss(path_in("ql-back/final.h5")), eval_loss(ql));
    /* refused by name: DoRA, bias adapters, another rank */
    /* eval --dump-logits never over the checkpoint it evaluates */
    const char *over[] = {"eval", "--checkpoint", ql, "--dump-logits", ql, NULL};
    CU_ASSERT_EQUAL(qtrain("over.log", over), 2);
    CU_ASSERT(eval_loss(ql) == eval_loss(ql) && isfinite(eval_loss(ql)));
    static const char *const edits[4][2] = {{"\"use_dora\": false", "\"use_dora\": true"},
                                           {"\"bias\": \"none\"", "\"bias\": \"lora_only\""},
                                           {"\"r\": 4", "\"r\": 2"},
                                           {"\"peft_type\": \"LORA\"", "\"peft_type\": \"IA3\""}};
    static const char *const wants[4] = {"use_dora is true", "bias is \"lora_only\"", "has rank 2 and scale 4",
                                         "peft_type is IA3; qtrain reads LORA adapters only"};
    char *orig = test_file_read(path_in("peft/adapter_config.json"), NULL);
    CU_ASSERT_PTR_NOT_NULL_FATAL(orig);
    for (int k = 0; k < 4; k++) {
        char *edited = malloc(strlen(orig) + 64), *at = strstr(orig, edits[k][0]);
        CU_ASSERT_PTR_NOT_NULL_FATAL(at);
        snprintf(edited, strlen(orig) + 64, "%.*s%s%s", (int)(at - orig), orig, edits[k][1], at + strlen(edits[k][0]));
        FILE *fc = fopen(path_in("peft/adapter_config.json"), "w");
        fputs(edited, fc);
        fclose(fc);
        snprintf(out2, sizeof out2, "run.out_dir=%s/ql-bad%d", runs.root, k);
        CU_ASSERT_NOT_EQUAL(qtrain("ql-bad.log", back), 0);
        char *text = test_file_read(path_in("ql-bad.log"), NULL);
        if (!(text && strstr(text, wants[k])))
            fprintf(stderr, "\n  want '%s' in: %s\n", wants[k], text ? text : "(no log)");
        CU_ASSERT(text && strstr(text, wants[k]) != NULL);
        free(text), free(edited);
        unlink(path_in("ql-bad.log"));
    }
    FILE *fc = fopen(path_in("peft/adapter_config.json"), "w");
    fputs(orig, fc);
    fclose(fc);
    free(orig);
    if (access("/usr/bin/python3", X_OK) != 0) {
        test_skip("interop: /usr/bin/python3 is missing (Debian's python3)");
        return;
    }
    snprintf(cmd, sizeof cmd, "OMP_NUM_THREADS=1 /usr/bin/python3 tests/peft_check.py --config "
             "tests/configs/tiny-qlora.yaml --data-dir data/fashion-mnist-mini --adapter %s --logits %s >%s 2>&1",
             dir, npy, path_in("peft-torch.log"));
    int rc = system(cmd);
    char *text = test_file_read(path_in("peft-torch.log"), NULL);
    if (rc != 0 && text && strstr(text, "No module named")) {
        test_skip("interop: /usr/bin/python3 cannot import torch and numpy (install python3-torch)");
    } else {
        if (rc != 0) fprintf(stderr, "\n  %s\n", text ? text : "(no output)");
        CU_ASSERT(rc == 0 && text && strstr(text, "peft: ok") != NULL);
    }
    free(text);
}

/* scripts/torch_import.py on a residual CNN defined in PyTorch (tests/torch_import_model.py): the config and
 * weights it writes evaluate in qtrain to PyTorch's outputs within 1e-5 relative, and fine-tune; a model with a
 * layer qtrain cannot express is reported by module name and type, nothing written. */
static void test_torch_import(void) {
    if (access("/usr/bin/python3", X_OK) != 0 ||
        system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") != 0) {
        test_skip("interop: scripts/torch_import.py needs /usr/bin/python3 with torch (install python3-torch)");
        return;
    }
    char cmd[4096], dir[1100], out[1100], cfg[1200], npy[1100];
    snprintf(dir, sizeof dir, "%s", path_in("imported"));
    snprintf(cmd, sizeof cmd, "OMP_NUM_THREADS=1 /usr/bin/python3 scripts/torch_import.py "
             "tests/torch_import_model.py:make --input 1,28,28 --out %s >%s 2>&1", dir, path_in("import.log"));
    CU_ASSERT_EQUAL_FATAL(system(cmd), 0);
    snprintf(cfg, sizeof cfg, "%s/config.yaml", dir);
    snprintf(out, sizeof out, "run.out_dir=%s/imported-run", runs.root);
    const char *run[] = {"--config", cfg, "--set", "data.dir=data/fashion-mnist-mini", "--set", out, "--set",
                         "train.epochs=0", "--quiet", NULL};
    CU_ASSERT_EQUAL_FATAL(qtrain("imported.log", run), 0);
    snprintf(npy, sizeof npy, "%s", path_in("imported.npy"));
    const char *ev[] = {"eval", "--checkpoint", path_in("imported-run/final.h5"), "--out", path_in("i.json"),
                        "--dump-logits", npy, NULL};
    CU_ASSERT_EQUAL_FATAL(qtrain("imported-eval.log", ev), 0);
    snprintf(cmd, sizeof cmd, "OMP_NUM_THREADS=1 /usr/bin/python3 tests/torch_import_check.py "
             "tests/torch_import_model.py:make --config %s --data-dir data/fashion-mnist-mini --logits %s >%s 2>&1",
             cfg, npy, path_in("import-check.log"));
    int rc = system(cmd);
    char *text = test_file_read(path_in("import-check.log"), NULL);
    if (rc != 0) fprintf(stderr, "\n  %s\n", text ? text : "(no output)");
    CU_ASSERT(rc == 0 && text && strstr(text, "torch_import: ok"));
    free(text);
    /* it fine-tunes: 30 steps from the imported weights, the training loss (metrics.csv) finite and falling */
    snprintf(out, sizeof out, "run.out_dir=%s/imported-tune", runs.root);
    const char *tune[] = {"--config", cfg, "--set", "data.dir=data/fashion-mnist-mini", "--set", out, "--set",
                          "train.steps=30", "--set", "train.log_every=10", "--set", "train.optimizer.lr=0.01",
                          "--quiet", NULL};
    CU_ASSERT_EQUAL(qtrain("imported-tune.log", tune), 0);
    char *csv = test_file_read(path_in("imported-tune/metrics.csv"), NULL);
    double first = NAN, last = NAN;
    for (char *line = csv ? strstr(csv, "\ntrain,") : NULL; line; line = strstr(line + 1, "\ntrain,")) {
        const char *p = line + 1;
        for (int comma = 0; comma < 3 && p; comma++) p = strchr(p, ',') ? strchr(p, ',') + 1 : NULL;
        if (!p) break;
        last = strtod(p, NULL);
        if (isnan(first)) first = last;
    }
    CU_ASSERT(isfinite(first) && isfinite(last) && last < first);
    free(csv);
    /* what qtrain cannot express: named, nothing written */
    snprintf(dir, sizeof dir, "%s", path_in("bad-import"));
    snprintf(cmd, sizeof cmd, "OMP_NUM_THREADS=1 /usr/bin/python3 scripts/torch_import.py "
             "tests/torch_import_model.py:bad --input 1,28,28 --out %s >%s 2>&1", dir, path_in("bad-import.log"));
    CU_ASSERT_NOT_EQUAL(system(cmd), 0);
    text = test_file_read(path_in("bad-import.log"), NULL);
    CU_ASSERT(text && strstr(text, "up (Upsample): no qtrain layer for Upsample"));
    CU_ASSERT(access(dir, F_OK) != 0);
    free(text);
    snprintf(cmd, sizeof cmd, "OMP_NUM_THREADS=1 /usr/bin/python3 scripts/torch_import.py "
             "tests/torch_import_model.py:bad2 --input 1,28,28 --out %s >%s 2>&1", dir, path_in("bad-import.log"));
    CU_ASSERT_NOT_EQUAL(system(cmd), 0);
    text = test_file_read(path_in("bad-import.log"), NULL);
    CU_ASSERT(text && strstr(text, "bn (BatchNorm2d): momentum None") && strstr(text, "add with alpha 2"));
    CU_ASSERT(access(dir, F_OK) != 0);
    free(text);
}

/* lora.batchnorm: train: the trained batch norm is one of PEFT's modules_to_save, statistics included, and the
 * directory loads back to the run's loss bit for bit; a grouped conv's adapter is refused (PEFT's is another
 * function). */
static void test_peft_batchnorm_and_groups(void) {
    char out[1100], from[1200], dir[1100], run_ck[1200];
    snprintf(out, sizeof out, "run.out_dir=%s/bn-base", runs.root);
    const char *base[] = {"--config", "tests/configs/tiny-bn.yaml", "--set", out, "--set", "train.steps=6", "--quiet",
                          NULL};
    CU_ASSERT_EQUAL_FATAL(qtrain("bn-base.log", base), 0);
    snprintf(from, sizeof from, "model.init_from=%s/bn-base/final.h5", runs.root);
    snprintf(out, sizeof out, "run.out_dir=%s/bn-lora", runs.root);
    const char *lora[] = {"--config", "tests/configs/tiny-bn.yaml", "--set", out, "--set", from, "--set",
                          "lora.rules=[{module_path: conv1, rank: 4, alpha: 8}]", "--set", "lora.trainable=[head]",
                          "--set", "lora.batchnorm=train", "--set", "train.steps=6", "--quiet", NULL};
    CU_ASSERT_EQUAL_FATAL(qtrain("bn-lora.log", lora), 0);
    snprintf(run_ck, sizeof run_ck, "%s/bn-lora/final.h5", runs.root);
    snprintf(dir, sizeof dir, "%s", path_in("bn-peft"));
    const char *ex[] = {"export", "--checkpoint", run_ck, "--format", "peft", "--out", dir, NULL};
    CU_ASSERT_EQUAL_FATAL(qtrain("bn-peft.log", ex), 0);
    char *conf = test_file_read(path_in("bn-peft/adapter_config.json"), NULL);
    CU_ASSERT(conf && strstr(conf, "\"modules_to_save\": [\"bn1\", \"head\"]"));
    if (conf && !strstr(conf, "\"modules_to_save\": [\"bn1\", \"head\"]")) fprintf(stderr, "\n%s\n", conf);
    free(conf);
    char ad[1200];
    snprintf(ad, sizeof ad, "model.adapters_from=%s", dir);
    snprintf(out, sizeof out, "run.out_dir=%s/bn-back", runs.root);
    const char *back[] = {"--config", "tests/configs/tiny-bn.yaml", "--set", out, "--set", from, "--set", ad, "--set",
                          "lora.rules=[{module_path: conv1, rank: 4, alpha: 8}]", "--set", "lora.trainable=[head]",
                          "--set", "lora.batchnorm=train", "--set", "train.steps=0", "--set", "train.epochs=0",
                          "--quiet", NULL};
    CU_ASSERT_EQUAL_FATAL(qtrain("bn-back.log", back), 0);
    CU_ASSERT_EQUAL(eval_loss(path_in("bn-back/final.h5")), eval_loss(run_ck));
    /* a grouped conv's adapter: refused, naming the module */
    snprintf(out, sizeof out, "run.out_dir=%s/dw-lora", runs.root);
    const char *dw[] = {"--config", "tests/configs/tiny-dw.yaml", "--set", out, "--set",
                        "lora.rules=[{module_path: pw, rank: 2}]", "--set", "model.layers.6.groups=2", "--set",
                        "train.steps=2", "--quiet", NULL};
    CU_ASSERT_EQUAL_FATAL(qtrain("dw-lora.log", dw), 0);
    char ck[1200];
    snprintf(ck, sizeof ck, "%s/dw-lora/final.h5", runs.root);
    const char *exd[] = {"export", "--checkpoint", ck, "--format", "peft", "--out", path_in("dw-peft"), NULL};
    CU_ASSERT_EQUAL(qtrain("dw-peft.log", exd), 2);
    char *text = test_file_read(path_in("dw-peft.log"), NULL);
    CU_ASSERT(text && strstr(text, "pw is a grouped conv"));
    free(text);
}

/* A DoRA run over the QLoRA base (tests/configs/tiny-dora.yaml) as a PEFT directory: use_dora true and each
 * module's lora_magnitude_vector in PEFT's shapes; PyTorch merging PEFT's DoRA weight reproduces the run's logits;
 * it loads back bit for bit through adapters_from, and a use_dora that is not the rule's dora is refused by name. */
static void test_peft_dora(void) {
    char base[1200], ck[1200], dir[1100], npy[1100], cmd[4096];
    CU_ASSERT_FATAL(train_export_peft("tests/configs/tiny-dora.yaml", "dora", "dora-peft", ck, sizeof ck, dir,
                                      sizeof dir));
    snprintf(base, sizeof base, "model.init_from=%s", runs.base_ckpt);
    char *conf = test_file_read(path_in("dora-peft/adapter_config.json"), NULL);
    CU_ASSERT(conf && strstr(conf, "\"use_dora\": true"));
    free(conf);
    StFile f;
    QtError e = {0};
    CU_ASSERT_EQUAL_FATAL(st_open(&f, path_in("dora-peft/adapter_model.safetensors"), &e), QT_OK);
    const StTensor *mc = st_find(&f, "base_model.model.conv1.lora_magnitude_vector");
    const StTensor *mf = st_find(&f, "base_model.model.fc1.lora_magnitude_vector");
    CU_ASSERT(mc && mc->ndim == 4 && mc->shape[0] == 1 && mc->shape[1] == 8 && mc->shape[2] == 1 && mc->shape[3] == 1);
    CU_ASSERT(mf && mf->ndim == 1 && mf->shape[0] == 32);
    st_close(&f);
    /* back in, bit for bit */
    char from[1200], out2[1100];
    snprintf(from, sizeof from, "model.adapters_from=%s", dir);
    snprintf(out2, sizeof out2, "run.out_dir=%s/dora-back", runs.root);
    const char *back[] = {"--config", "tests/configs/tiny-dora.yaml", "--set", base, "--set", from, "--set", out2,
                          "--set", "train.steps=0", "--set", "train.epochs=0", "--quiet", NULL};
    CU_ASSERT_EQUAL_FATAL(qtrain("dora-back.log", back), 0);
    CU_ASSERT(test_ckpt_group_within(ck, path_in("dora-back/final.h5"), "lora"));
    CU_ASSERT_EQUAL(eval_loss(path_in("dora-back/final.h5")), eval_loss(ck));
    /* the directory's DoRA adapters into plain LoRA rules */
    snprintf(out2, sizeof out2, "run.out_dir=%s/dora-plain", runs.root);
    const char *plain[] = {"--config", "tests/configs/tiny-dora.yaml", "--set", base, "--set", from, "--set", out2,
                           "--set", "lora.rules.0.dora=false", "--set", "train.steps=0", "--set", "train.epochs=0",
                           "--quiet", NULL};
    CU_ASSERT_NOT_EQUAL(qtrain("dora-plain.log", plain), 0);
    char *text = test_file_read(path_in("dora-plain.log"), NULL);
    CU_ASSERT(text && strstr(text, "use_dora is true but this run's lora rule for module conv1 has dora: false; set "
                                   "dora: true in that rule"));
    if (text && !strstr(text, "use_dora is true but")) fprintf(stderr, "\n%s\n", text);
    free(text);
    if (access("/usr/bin/python3", X_OK) != 0) {
        test_skip("interop: /usr/bin/python3 is missing (Debian's python3)");
        return;
    }
    snprintf(npy, sizeof npy, "%s", path_in("dora-logits.npy"));
    const char *ev[] = {"eval", "--checkpoint", ck, "--out", path_in("dora.json"), "--dump-logits", npy, NULL};
    CU_ASSERT_EQUAL_FATAL(qtrain("dora-dump.log", ev), 0);
    snprintf(cmd, sizeof cmd, "OMP_NUM_THREADS=1 /usr/bin/python3 tests/peft_check.py --config "
             "tests/configs/tiny-dora.yaml --data-dir data/fashion-mnist-mini --adapter %s --logits %s >%s 2>&1",
             dir, npy, path_in("dora-torch.log"));
    int rc = system(cmd);
    text = test_file_read(path_in("dora-torch.log"), NULL);
    if (rc != 0 && text && strstr(text, "No module named")) {
        test_skip("interop: /usr/bin/python3 cannot import torch and numpy (install python3-torch)");
    } else {
        if (rc != 0) fprintf(stderr, "\n  %s\n", text ? text : "(no output)");
        CU_ASSERT(rc == 0 && text && strstr(text, "peft: ok") != NULL);
    }
    free(text);
}

int register_interop_suite(void) {
    CU_pSuite s = CU_add_suite("interop", suite_init, suite_cleanup);
    if (!s) return -1;
    return !CU_add_test(s, "export safetensors and h5; init_from the export evaluates bit for bit",
                        test_safetensors_round_trip) ||
           !CU_add_test(s, "PyTorch loads the export and reproduces eval --dump-logits within 1e-5",
                        test_pytorch_reproduces_logits) ||
           !CU_add_test(s, "an int8 PTQ model with folded batch norms exports what it evaluates; refusals",
                        test_quantized_exports) ||
           !CU_add_test(s, "init_from a safetensors file of another model names what does not fit",
                        test_wrong_model_refused) ||
           !CU_add_test(s, "a QLoRA run as a PEFT directory: PEFT's conventions reproduce its logits, it loads "
                           "back bit for bit; refusals",
                        test_peft_export) ||
           !CU_add_test(s, "PEFT export: a trained batch norm saved with its statistics; a grouped conv refused",
                        test_peft_batchnorm_and_groups) ||
           !CU_add_test(s, "a DoRA run as a PEFT directory: lora_magnitude_vector, PyTorch's DoRA merge reproduces "
                           "its logits, it loads back; a use_dora mismatch refused", test_peft_dora) ||
           !CU_add_test(s, "scripts/torch_import.py: a residual CNN from PyTorch evaluates to its outputs, fine-tunes; "
                           "what qtrain cannot express is named",
                        test_torch_import)
               ? -1
               : 0;
}
