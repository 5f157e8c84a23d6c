/* finetune.c - train or fine-tune a model with libqtrain, through its one
 * public header only (docs/LIBRARY.md).
 *
 *   finetune CONFIG OUT.h5 [KEY=VALUE]...
 *
 * Loads the YAML config CONFIG with the overrides (as `qtrain --set`
 * takes them), builds the run (model.init_from loaded, quantized and given
 * LoRA adapters as the config's quant and lora rules say), runs every step
 * the config plans, evaluates on the test split, saves OUT.h5 and prints
 *   finetune: steps:N test_accuracy:A test_loss:L checkpoint:OUT.h5
 * A QLoRA fine-tune of a pretrained float model:
 *   finetune configs/qlora.yaml runs/qlora.h5 model.init_from=runs/pretrain/final.h5
 *
 * Build against an installed libqtrain (libqtrain.so; docs/LIBRARY.md
 * links libqtrain.a, which -lqtrain does not pick where both are installed):
 *   cc examples/finetune.c $(pkg-config --cflags --libs qtrain) -o finetune */
#include <stdio.h>

#include <qtrain.h>

/* Prints what failed and why; returns the exit status. */
static int fail(const char *what, qtrain_status st) {
    fprintf(stderr, "finetune: %s: %s: %s\n", what, qtrain_status_name(st), qtrain_last_error());
    return 1;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: finetune CONFIG OUT.h5 [KEY=VALUE]...\n"
                        "  (libqtrain %s, built with qtrain.h %d.%d.%d)\n", qtrain_version(),
                QTRAIN_VERSION_MAJOR, QTRAIN_VERSION_MINOR, QTRAIN_VERSION_PATCH);
        return 2;
    }
    const char *config_path = argv[1], *out = argv[2];
    const char *const *overrides = (const char *const *)argv + 3;

    /* 1. the config */
    qtrain_config *cfg = NULL;
    qtrain_status st = qtrain_config_load(&cfg, config_path, overrides, argc - 3);
    if (st != QTRAIN_OK) return fail("config", st);

    /* 2. the run: the model, its quantized base and adapters, the optimizer */
    qtrain_run *run = NULL;
    st = qtrain_run_new(&run, cfg);
    qtrain_config_free(cfg); /* the run keeps its own copy */
    if (st != QTRAIN_OK) return fail("building the run", st);
    printf("finetune: %lld steps to run\n", (long long)qtrain_run_steps_left(run));

    /* 3. training */
    double loss = 0.0;
    while (st == QTRAIN_OK && qtrain_run_steps_left(run) > 0) {
        st = qtrain_run_step(run, &loss);
        long long step = (long long)qtrain_run_steps_done(run);
        if (st == QTRAIN_OK && step % 10 == 0) printf("finetune: step %lld loss %.4f\n", step, loss);
    }
    if (st != QTRAIN_OK) {
        qtrain_run_free(run);
        return fail("training", st);
    }

    /* 4. evaluation */
    qtrain_metrics m;
    if ((st = qtrain_run_evaluate(run, &m)) != QTRAIN_OK) {
        qtrain_run_free(run);
        return fail("evaluating", st);
    }

    /* 5. the checkpoint: `qtrain eval --checkpoint OUT.h5` reads it */
    st = qtrain_run_save(run, out);
    qtrain_run_free(run);
    if (st != QTRAIN_OK) return fail("saving", st);
    printf("finetune: params %lld trainable, %lld frozen; base %.3f bits/param\n", (long long)m.params_trainable,
           (long long)m.params_frozen, m.base_bits_per_param);
    printf("finetune: steps:%lld test_accuracy:%.17g test_loss:%.17g checkpoint:%s\n", (long long)m.step,
           m.test_accuracy, m.test_loss, out);
    return 0;
}
