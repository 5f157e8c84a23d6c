/* test_augment.c - data.augment: random_crop, hflip and random_erase against
 * pixels computed here by hand, their dependence on (seed, epoch, index) and
 * nothing else, the config key (errors at their place, the resolved YAML,
 * resume refusing a change), and training runs on the mini data set: an
 * augmented run differs from a plain one, resumes bit for bit mid-epoch,
 * repeats bit for bit under one seed, and evaluates without augmentation. */
#include <CUnit/CUnit.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "data/augment.h"
#include "test_runs.h"
#include "test_util.h"
#include "trainer/checkpoint.h"
#include "trainer/config.h"
#include "trainer/train.h"

#define AUG_CFG "tests/configs/tiny-aug.yaml"

static TestRuns runs;

static AugmentList list_of(AugmentSpec s) {
    AugmentList l;
    memset(&l, 0, sizeof l);
    l.items[0] = s;
    l.n = 1;
    return l;
}

static AugmentSpec crop_spec(int h, int w, int padding) {
    AugmentSpec s;
    augment_spec_default(&s, AUGMENT_RANDOM_CROP);
    s.size_h = h, s.size_w = w, s.padding = padding;
    return s;
}

static AugmentSpec flip_spec(float p) {
    AugmentSpec s;
    augment_spec_default(&s, AUGMENT_HFLIP);
    s.p = p;
    return s;
}

/* in (2, 3, 4): channel 0 holds 1..12 row by row, channel 1 101..112. */
static void fill_image(float *x) {
    for (int c = 0; c < 2; c++)
        for (int i = 0; i < 12; i++) x[c * 12 + i] = (float)(c * 100 + i + 1);
}

/* ---- pixels ------------------------------------------------------------------------------ */

/* Every crop of the zero-padded image is one of the (2p + 1)^2 windows of an explicitly padded copy, the same
 * window in both channels, and over 600 examples each window occurs. One of them written out by hand: top 0,
 * left 2 of the image padded by 1 is the image moved down one row and left one column. */
static void test_crop_pixels(void) {
    const int shape[3] = {2, 3, 4}, p = 1;
    float padded[2][5][6];
    memset(padded, 0, sizeof padded);
    float img[24];
    fill_image(img);
    for (int c = 0; c < 2; c++)
        for (int i = 0; i < 3; i++)
            for (int j = 0; j < 4; j++) padded[c][i + p][j + p] = img[c * 12 + i * 4 + j];
    const float by_hand[12] = {0, 0, 0, 0, 2, 3, 4, 0, 6, 7, 8, 0}; /* channel 0 at top 0, left 2 */
    AugmentList l = list_of(crop_spec(3, 4, p));
    int seen[3][3] = {{0}}, by_hand_seen = 0;
    for (uint32_t idx = 0; idx < 600; idx++) {
        float x[24];
        fill_image(x);
        augment_batch(&l, 5, 0, &idx, 1, shape, x);
        int found = 0;
        for (int top = 0; top < 3; top++)
            for (int left = 0; left < 3; left++) {
                bool same = true;
                for (int c = 0; c < 2; c++)
                    for (int i = 0; i < 3; i++)
                        for (int j = 0; j < 4; j++)
                            same = same && x[c * 12 + i * 4 + j] == padded[c][i + top][j + left];
                if (same) seen[top][left]++, found++;
            }
        CU_ASSERT_EQUAL(found, 1);
        by_hand_seen += memcmp(x, by_hand, sizeof by_hand) == 0;
    }
    for (int top = 0; top < 3; top++)
        for (int left = 0; left < 3; left++) CU_ASSERT(seen[top][left] > 30); /* ~67 each */
    CU_ASSERT(by_hand_seen == seen[0][2]);
    /* padding 0: the crop is the image */
    AugmentList none = list_of(crop_spec(3, 4, 0));
    float x[24], y[24];
    fill_image(x), fill_image(y);
    uint32_t idx = 3;
    augment_batch(&none, 5, 0, &idx, 1, shape, x);
    CU_ASSERT(memcmp(x, y, sizeof x) == 0);
}

/* hflip p 1 mirrors every row of every channel (written out), p 0 never changes anything, p 0.5 does one of the
 * two, both over 200 examples. */
static void test_hflip_pixels(void) {
    const int shape[3] = {2, 3, 4};
    const float mirrored[24] = {4,   3,   2,   1,   8,   7,   6,   5,   12,  11,  10,  9,
                                104, 103, 102, 101, 108, 107, 106, 105, 112, 111, 110, 109};
    float orig[24];
    fill_image(orig);
    AugmentList always = list_of(flip_spec(1.0f)), never = list_of(flip_spec(0.0f)), half = list_of(flip_spec(0.5f));
    int flipped = 0;
    for (uint32_t idx = 0; idx < 200; idx++) {
        float a[24], b[24], c[24];
        fill_image(a), fill_image(b), fill_image(c);
        augment_batch(&always, 9, (int64_t)idx % 3, &idx, 1, shape, a);
        augment_batch(&never, 9, (int64_t)idx % 3, &idx, 1, shape, b);
        augment_batch(&half, 9, (int64_t)idx % 3, &idx, 1, shape, c);
        CU_ASSERT(memcmp(a, mirrored, sizeof a) == 0);
        CU_ASSERT(memcmp(b, orig, sizeof b) == 0);
        bool is_flip = memcmp(c, mirrored, sizeof c) == 0;
        CU_ASSERT(is_flip || memcmp(c, orig, sizeof c) == 0);
        flipped += is_flip;
    }
    CU_ASSERT(flipped > 60 && flipped < 140);
    /* an odd width keeps its middle column */
    const int odd[3] = {1, 1, 3};
    float r[3] = {1, 2, 3};
    uint32_t idx = 0;
    augment_batch(&always, 1, 0, &idx, 1, odd, r);
    CU_ASSERT(r[0] == 3 && r[1] == 2 && r[2] == 1);
}

/* random_erase on a 4x4 image with scale [0.25, 0.25] and ratio [1, 1]: the area is 4 and the aspect 1, so a
 * 2x2 square of `value` somewhere, the same in both channels, every other pixel kept; over 300 examples all 9
 * places occur. scale [1, 1] never fits strictly inside (torchvision then erases nothing); p 0 erases nothing. */
static void test_erase_pixels(void) {
    const int shape[3] = {2, 4, 4};
    AugmentSpec s;
    augment_spec_default(&s, AUGMENT_RANDOM_ERASE);
    s.p = 1.0f, s.scale[0] = s.scale[1] = 0.25f, s.ratio[0] = s.ratio[1] = 1.0f, s.value = -7.0f;
    AugmentList l = list_of(s);
    int places[3][3] = {{0}};
    for (uint32_t idx = 0; idx < 300; idx++) {
        float x[32];
        for (int i = 0; i < 32; i++) x[i] = (float)(i + 1);
        augment_batch(&l, 3, 1, &idx, 1, shape, x);
        int top = -1, left = -1;
        for (int i = 0; i < 16 && top < 0; i++)
            if (x[i] == -7.0f) top = i / 4, left = i % 4;
        CU_ASSERT_FATAL(top >= 0 && top <= 2 && left >= 0 && left <= 2);
        places[top][left]++;
        for (int c = 0; c < 2; c++)
            for (int i = 0; i < 4; i++)
                for (int j = 0; j < 4; j++) {
                    bool inside = i >= top && i < top + 2 && j >= left && j < left + 2;
                    float want = inside ? -7.0f : (float)(c * 16 + i * 4 + j + 1);
                    CU_ASSERT(x[c * 16 + i * 4 + j] == want);
                }
    }
    for (int i = 0; i < 3; i++)
        for (int j = 0; j < 3; j++) CU_ASSERT(places[i][j] > 10); /* ~33 each */
    AugmentSpec whole = s, off = s;
    whole.scale[0] = whole.scale[1] = 1.0f;
    off.p = 0.0f, off.scale[0] = 0.02f, off.scale[1] = 0.33f;
    AugmentList lw = list_of(whole), lo = list_of(off);
    for (uint32_t idx = 0; idx < 50; idx++) {
        float a[32], b[32];
        for (int i = 0; i < 32; i++) a[i] = b[i] = (float)(i + 1);
        augment_batch(&lw, 3, 0, &idx, 1, shape, a);
        CU_ASSERT(memcmp(a, b, sizeof a) == 0);
        augment_batch(&lo, 3, 0, &idx, 1, shape, a);
        CU_ASSERT(memcmp(a, b, sizeof a) == 0);
    }
}

/* ---- what the randomness depends on ----------------------------------------------------------------------- */

static AugmentList full_list(void) {
    AugmentList l;
    memset(&l, 0, sizeof l);
    l.items[0] = crop_spec(8, 8, 2);
    l.items[1] = flip_spec(0.5f);
    augment_spec_default(&l.items[2], AUGMENT_RANDOM_ERASE);
    l.n = 3;
    return l;
}

static void image_of(float *x, uint32_t idx) {
    for (int i = 0; i < 3 * 8 * 8; i++) x[i] = (float)(idx * 1000 + (uint32_t)i + 1);
}

/* The same (seed, epoch, index) gives the same pixels wherever the example is in a batch; another seed, epoch or
 * index gives another augmentation (compared on one image, so only the randomness differs). */
static void test_pure_function(void) {
    const int shape[3] = {3, 8, 8};
    const int feat = 3 * 8 * 8;
    AugmentList l = full_list();
    float *batch = malloc(4 * (size_t)feat * sizeof(float)), *one = malloc((size_t)feat * sizeof(float));
    CU_ASSERT_FATAL(batch && one);
    const uint32_t idx[4] = {7, 2, 41, 7};
    for (int e = 0; e < 4; e++) image_of(batch + e * feat, idx[e]);
    augment_batch(&l, 123, 5, idx, 4, shape, batch);
    for (int e = 0; e < 4; e++) {
        image_of(one, idx[e]);
        augment_batch(&l, 123, 5, &idx[e], 1, shape, one);
        CU_ASSERT(memcmp(one, batch + e * feat, (size_t)feat * sizeof(float)) == 0);
    }
    /* Pixel values do not enter the draws: image_of(7) with index 7 and a copy with another index differ only in
       their randomness. Count the indices (of 64) whose augmentation equals index 0's: crop (25 places) x flip
       alone makes a match rare. */
    int same_index = 0, same_epoch = 0, same_seed = 0;
    float *ref = malloc((size_t)feat * sizeof(float));
    CU_ASSERT_FATAL(ref != NULL);
    for (uint32_t k = 0; k < 64; k++) {
        uint32_t i0 = k, i1 = k + 1000;
        image_of(ref, 0), image_of(one, 0);
        augment_batch(&l, 123, 5, &i0, 1, shape, ref);
        augment_batch(&l, 123, 5, &i1, 1, shape, one);
        same_index += memcmp(ref, one, (size_t)feat * sizeof(float)) == 0;
        image_of(one, 0);
        augment_batch(&l, 123, 6, &i0, 1, shape, one);
        same_epoch += memcmp(ref, one, (size_t)feat * sizeof(float)) == 0;
        image_of(one, 0);
        augment_batch(&l, 124, 5, &i0, 1, shape, one);
        same_seed += memcmp(ref, one, (size_t)feat * sizeof(float)) == 0;
    }
    CU_ASSERT(same_index < 8 && same_epoch < 8 && same_seed < 8);
    free(batch), free(one), free(ref);
}

/* Images only, and a crop keeps their size. */
static void test_check(void) {
    AugmentList l = full_list();
    QtError e = {0};
    CU_ASSERT_EQUAL(augment_check(&l, 3, (int[]){3, 8, 8}, &e), QT_OK);
    CU_ASSERT_EQUAL(augment_check(&l, 1, (int[]){64}, &e), QT_ERR_CONFIG);
    CU_ASSERT(test_msg_has(&e, "data.augment[0] (random_crop)") && test_msg_has(&e, "vectors of 64 values") &&
              test_msg_has(&e, "remove data.augment"));
    AugmentList flip = list_of(flip_spec(0.5f));
    qt_error_clear(&e);
    CU_ASSERT_EQUAL(augment_check(&flip, 1, (int[]){64}, &e), QT_ERR_CONFIG);
    CU_ASSERT(test_msg_has(&e, "data.augment[0] (hflip)"));
    AugmentList big = list_of(crop_spec(13, 8, 2));
    qt_error_clear(&e);
    CU_ASSERT_EQUAL(augment_check(&big, 3, (int[]){3, 8, 8}, &e), QT_ERR_CONFIG);
    CU_ASSERT(test_msg_has(&e, "size [13, 8] is larger than the padded image [12, 12]"));
    AugmentList small = list_of(crop_spec(6, 8, 2));
    qt_error_clear(&e);
    CU_ASSERT_EQUAL(augment_check(&small, 3, (int[]){3, 8, 8}, &e), QT_ERR_CONFIG);
    CU_ASSERT(test_msg_has(&e, "size [6, 8] differs from the images' [8, 8]") &&
              test_msg_has(&e, "set size to [8, 8]"));
}

/* ---- config --------------------------------------------------------------------------------------------------- */

#define MODEL "model:\n  input: [1, 4, 4]\n  layers:\n    - {type: flatten}\n    - {type: dense, units: 10}\n"

static void test_config_values(void) {
    const char *text = MODEL "data:\n  augment:\n    - {random_crop: {size: [4, 4], padding: 1}}\n"
                             "    - hflip\n    - {hflip: {p: 1}}\n    - random_erase\n"
                             "    - {random_erase: {p: 0.25, scale: [0.1, 0.2], ratio: [0.5, 2], value: -1.5}}\n";
    Config *a = malloc(sizeof *a), *b = malloc(sizeof *b);
    CU_ASSERT_FATAL(a && b);
    QtError e = {0};
    QtStatus st = config_load_string(a, text, "t.yaml", NULL, 0, &e);
    if (st != QT_OK) fprintf(stderr, "\n  %s\n", e.msg);
    CU_ASSERT_FATAL(st == QT_OK);
    const AugmentList *l = &a->data.augment;
    CU_ASSERT_EQUAL(l->n, 5);
    CU_ASSERT(l->items[0].kind == AUGMENT_RANDOM_CROP && l->items[0].size_h == 4 && l->items[0].size_w == 4 &&
              l->items[0].padding == 1);
    CU_ASSERT(l->items[1].kind == AUGMENT_HFLIP && l->items[1].p == 0.5f);
    CU_ASSERT(l->items[2].kind == AUGMENT_HFLIP && l->items[2].p == 1.0f);
    CU_ASSERT(l->items[3].kind == AUGMENT_RANDOM_ERASE && l->items[3].p == 0.5f && l->items[3].scale[0] == 0.02f &&
              l->items[3].scale[1] == 0.33f && l->items[3].ratio[0] == 0.3f && l->items[3].ratio[1] == 3.3f &&
              l->items[3].value == 0.0f);
    CU_ASSERT(l->items[4].p == 0.25f && l->items[4].scale[0] == 0.1f && l->items[4].scale[1] == 0.2f &&
              l->items[4].ratio[0] == 0.5f && l->items[4].ratio[1] == 2.0f && l->items[4].value == -1.5f);
    /* the resolved YAML lists every setting and loads back to the same Config */
    char *yaml = config_to_yaml(a);
    CU_ASSERT_FATAL(yaml != NULL);
    CU_ASSERT(strstr(yaml, "  augment:\n    - {random_crop: {size: 4, padding: 1}}\n    - {hflip: {p: 0.5}}\n") !=
              NULL);
    CU_ASSERT(strstr(yaml, "{random_erase: {p: 0.25, scale: [0.1, 0.2], ratio: [0.5, 2], value: -1.5}}") != NULL);
    st = config_load_string(b, yaml, "t.yaml", NULL, 0, &e);
    CU_ASSERT_FATAL(st == QT_OK);
    CU_ASSERT(memcmp(&a->data.augment, &b->data.augment, sizeof a->data.augment) == 0);
    free(yaml);
    /* --set reaches into the list by index, and appends */
    const char *ov[] = {"data.augment.0.random_crop.padding=2", "data.augment.2={hflip: {p: 0.9}}",
                        "data.augment.5=random_erase"};
    st = config_load_string(b, text, "t.yaml", ov, 3, &e);
    if (st != QT_OK) fprintf(stderr, "\n  %s\n", e.msg);
    CU_ASSERT_FATAL(st == QT_OK);
    CU_ASSERT(b->data.augment.n == 6 && b->data.augment.items[0].padding == 2 && b->data.augment.items[2].p == 0.9f &&
              b->data.augment.items[5].kind == AUGMENT_RANDOM_ERASE);
    /* none: an empty list, written as [] */
    st = config_load_string(b, MODEL, "t.yaml", NULL, 0, &e);
    CU_ASSERT_FATAL(st == QT_OK);
    CU_ASSERT_EQUAL(b->data.augment.n, 0);
    yaml = config_to_yaml(b);
    CU_ASSERT(yaml && strstr(yaml, "  augment: []\n"));
    free(yaml);
    /* resume: a changed, added or removed augmentation is refused as data.augment */
    char fixed[128], changed[256];
    config_diff_for_resume(a, a, fixed, sizeof fixed, changed, sizeof changed);
    CU_ASSERT_STRING_EQUAL(fixed, "");
    *b = *a;
    b->data.augment.items[2].p = 0.75f;
    config_diff_for_resume(a, b, fixed, sizeof fixed, changed, sizeof changed);
    CU_ASSERT_STRING_EQUAL(fixed, "data.augment");
    b->data.augment = a->data.augment;
    b->data.augment.n = 4;
    config_diff_for_resume(a, b, fixed, sizeof fixed, changed, sizeof changed);
    CU_ASSERT_STRING_EQUAL(fixed, "data.augment");
    free(a), free(b);
}

#define AUG_ERR(items, ...) test_expect_config_error(__FILE__, __LINE__, MODEL "data:\n  augment:\n" items, __VA_ARGS__)

/* Each kind of error, at its line and column (the model is lines 1-5, data.augment's items from line 8). */
static void test_config_errors(void) {
    AUG_ERR("    - {hflip: {p: 1.5}}\n", "t.yaml:8:19:", "data.augment[0].hflip.p", "[0, 1]");
    AUG_ERR("    - hflip\n    - {random_erase: {p: -0.1}}\n", "t.yaml:9:26:", "data.augment[1].random_erase.p",
            "[0, 1]");
    AUG_ERR("    - {random_crop: {size: 28, padding: -1}}\n", "t.yaml:8:41:", "random_crop.padding", "[0, 65536]");
    AUG_ERR("    - {random_crop: {size: 0}}\n", "t.yaml:8:28:", "data.augment[0].random_crop.size", NULL);
    AUG_ERR("    - {random_crop: {size: [28, 28, 1]}}\n", "t.yaml:8:28:", "an int or [h, w]", NULL);
    AUG_ERR("    - {random_crop: {padding: 4}}\n", "t.yaml:8:21:", "random_crop.size", "missing");
    AUG_ERR("    - random_crop\n", "t.yaml:8:7:", "data.augment[0].random_crop", "missing the crop's size");
    AUG_ERR("    - {random_erase: {scale: [0.4, 0.1]}}\n", "t.yaml:8:30:", "random_erase.scale",
            "min 0.4 is larger than max 0.1");
    AUG_ERR("    - {random_erase: {scale: [0, 0.1]}}\n", "t.yaml:8:31:", "random_erase.scale[0]", NULL);
    AUG_ERR("    - {random_erase: {ratio: [0.5]}}\n", "t.yaml:8:30:", "random_erase.ratio", "[min, max]");
    AUG_ERR("    - {random_erase: {area: 0.1}}\n", "t.yaml:8:23:", "unknown key 'area'", NULL);
    AUG_ERR("    - {hflip: {p: 0.5, size: 3}}\n", "t.yaml:8:24:", "data.augment[0].hflip", "size");
    AUG_ERR("    - vflip\n", "t.yaml:8:7:", "unknown augmentation 'vflip'", "random_crop, hflip, random_erase");
    AUG_ERR("    - {hflip: 0.5}\n", "t.yaml:8:15:", "data.augment[0].hflip", "nothing or a mapping");
    AUG_ERR("    - {hflip: {}, random_erase: {}}\n", "t.yaml:8:7:", "data.augment[0]", "single-key mapping");
    test_expect_config_error(__FILE__, __LINE__, MODEL "data:\n  augment: hflip\n", "t.yaml:7:12:", "data.augment",
                             "a sequence of augmentations");
    test_expect_config_error(__FILE__, __LINE__,
                             MODEL "data:\n  augment: [hflip, hflip, hflip, hflip, hflip, hflip, hflip, hflip, "
                                   "hflip]\n",
                             "t.yaml:7:12:", "at most 8 augmentations", NULL);
}

/* ---- training runs --------------------------------------------------------------------------------------------- */

static int augment_suite_init(void) {
    memset(&runs, 0, sizeof runs);
    runs.root = test_tmpdir_new(); /* no base: test_runs_config leaves model.init_from alone */
    return runs.root ? 0 : -1;
}

static int augment_suite_cleanup(void) { return test_runs_cleanup(&runs); }

/* 20 steps (2.5 epochs) straight equal 11 (mid-epoch), stop, resume, 9, bit for bit; a second straight run
 * under the same seed ends with the same parameters; the same run without augmentation ends elsewhere (so the
 * augmentation was applied). */
static void test_run_resume_and_repeat(void) {
    double acc = test_runs_resume_exact(&runs, AUG_CFG, "aug", 11, NULL);
    printf("(test accuracy %.3f) ", acc);
    CU_ASSERT(acc > 0.15);
    const char *plain_ov[] = {"data.augment=[]"};
    Config *again = test_runs_config(&runs, AUG_CFG, "again", NULL, 0);
    Config *plain = test_runs_config(&runs, AUG_CFG, "plain", plain_ov, 1);
    CU_ASSERT_FATAL(again && plain);
    TrainResult r;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(test_runs_train(again, NULL, 0, &r, &err), QT_OK);
    CU_ASSERT_EQUAL_FATAL(test_runs_train(plain, NULL, 0, &r, &err), QT_OK);
    test_runs_assert_same_state(again, test_runs_path(&runs, "aug-straight", "final.h5"),
                                test_runs_path(&runs, "again", "final.h5"));
    Model ma, mb;
    CU_ASSERT_EQUAL_FATAL(model_init(&ma, 3, again->model.input_shape, again->model.layers, again->model.n_layers,
                                     &err), QT_OK);
    CU_ASSERT_EQUAL_FATAL(model_init(&mb, 3, again->model.input_shape, again->model.layers, again->model.n_layers,
                                     &err), QT_OK);
    CU_ASSERT_EQUAL(checkpoint_load_params(test_runs_path(&runs, "again", "final.h5"), &ma, &err), QT_OK);
    CU_ASSERT_EQUAL(checkpoint_load_params(test_runs_path(&runs, "plain", "final.h5"), &mb, &err), QT_OK);
    CU_ASSERT(!test_params_equal(&ma, &mb));
    model_free(&ma), model_free(&mb);
    free(again), free(plain);
}

/* Evaluation never augments: the run's own test loss equals an evaluation of final.h5 under the config without
 * augmentation; resuming with another augmentation is refused. */
static void test_run_eval_and_resume_refusal(void) {
    const char *erase_ov[] = {"data.augment=[{random_erase: {p: 1, scale: [0.3, 0.33], value: 2}}]"};
    Config *c = test_runs_config(&runs, AUG_CFG, "erase", erase_ov, 1);
    Config *plain = test_runs_config(&runs, AUG_CFG, "erase", (const char *[]){"data.augment=[]"}, 1);
    CU_ASSERT_FATAL(c && plain);
    TrainResult r, ev;
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(test_runs_train(c, NULL, 0, &r, &err), QT_OK);
    QtStatus st = train_eval_checkpoint(plain, test_runs_path(&runs, "erase", "final.h5"), false, &ev, &err);
    if (st != QT_OK) fprintf(stderr, "\n  %s\n", err.msg);
    CU_ASSERT_EQUAL_FATAL(st, QT_OK);
    CU_ASSERT_EQUAL(ev.test_loss, r.test_loss);
    CU_ASSERT_EQUAL(ev.test_accuracy, r.test_accuracy);
    st = test_runs_train(plain, test_runs_path(&runs, "erase", "final.h5"), 0, &r, &err);
    CU_ASSERT_EQUAL(st, QT_ERR_CONFIG);
    CU_ASSERT(test_msg_has(&err, "data.augment"));
    free(c), free(plain);
}

/* A crop that does not fit the images is refused at run start, naming the config and what to set. */
static void test_run_refuses_bad_crop(void) {
    const char *big[] = {"data.augment=[{random_crop: {size: 40, padding: 4}}]"};
    const char *small[] = {"data.augment=[hflip, {random_crop: {size: [28, 24], padding: 4}}]"};
    Config *a = test_runs_config(&runs, AUG_CFG, "bad-big", big, 1);
    Config *b = test_runs_config(&runs, AUG_CFG, "bad-small", small, 1);
    CU_ASSERT_FATAL(a && b);
    TrainResult r;
    QtError err = {0};
    CU_ASSERT_EQUAL(test_runs_train(a, NULL, 0, &r, &err), QT_ERR_CONFIG);
    CU_ASSERT(test_msg_has(&err, AUG_CFG ": data.augment[0] (random_crop): size [40, 40] is larger than the padded "
                                 "image [36, 36]"));
    qt_error_clear(&err);
    CU_ASSERT_EQUAL(test_runs_train(b, NULL, 0, &r, &err), QT_ERR_CONFIG);
    CU_ASSERT(test_msg_has(&err, "data.augment[1] (random_crop): size [28, 24] differs from the images' [28, 28]"));
    free(a), free(b);
}

int register_augment_suite(void) {
    CU_pSuite s = CU_add_suite("augment", augment_suite_init, augment_suite_cleanup);
    if (!s) return -1;
    return !CU_add_test(s, "random_crop: every window of the zero-padded image, one written out", test_crop_pixels) ||
           !CU_add_test(s, "hflip: p 1 mirrors, p 0 never, p 0.5 one or the other", test_hflip_pixels) ||
           !CU_add_test(s, "random_erase: a 2x2 square in every channel; no fit or p 0 erases nothing",
                        test_erase_pixels) ||
           !CU_add_test(s, "a pure function of (seed, epoch, index); another of any differs", test_pure_function) ||
           !CU_add_test(s, "images only; a crop keeps their size", test_check) ||
           !CU_add_test(s, "data.augment: values, defaults, resolved YAML, resume refuses a change",
                        test_config_values) ||
           !CU_add_test(s, "data.augment: each error at its line and column", test_config_errors) ||
           !CU_add_test(s, "augmented run: resumes mid-epoch bit for bit, repeats under one seed, differs from plain",
                        test_run_resume_and_repeat) ||
           !CU_add_test(s, "augmented run: evaluation unaugmented; resume with another augmentation refused",
                        test_run_eval_and_resume_refusal) ||
           !CU_add_test(s, "a crop that does not fit the images is refused at run start", test_run_refuses_bad_crop);
}
