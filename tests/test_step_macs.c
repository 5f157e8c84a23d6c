/* test_step_macs.c - net_step_macs: a training step's multiply-adds per
 * example, counted from the shapes, against counts worked out by hand on a
 * tiny model with dense, plain, depthwise and grouped conv2d layers:
 * trained in full, and under LoRA adapters over a frozen base (both conv
 * adapter forms, a first layer whose input needs no gradient, modules
 * before any trainable parameter). */
#include <CUnit/CUnit.h>
#include <stdlib.h>

#include "test_util.h"
#include "trainer/net.h"

/* Input (2, 6, 6); every conv 3x3, padding 1, so 6x6 = 36 output positions.
 * Forward multiply-adds per example, OC * positions * (C / groups) * 9:
 *   conv1  2 -> 8            8 * 36 * 2 * 9 =  5184  (fan 18)
 *   conv2  8 -> 8 depthwise  8 * 36 * 1 * 9 =  2592  (fan 9)
 *   conv3  8 -> 8 groups 2   8 * 36 * 4 * 9 = 10368  (fan 36)
 *   pool -> (8, 3, 3), flatten 72
 *   fc1    72 -> 6           72 * 6         =   432
 *   head   6 -> 3            6 * 3          =    18
 *                                      total  18594 */
static const char *const yaml =
    "run: {name: macs, out_dir: runs/test-macs, seed: 1}\n"
    "data: {dir: data/fashion-mnist-mini, cache_dir: none}\n"
    "model:\n"
    "  input: [2, 6, 6]\n"
    "  layers:\n"
    "    - {name: conv1, type: conv2d, out_channels: 8, kernel: 3, padding: 1}\n"
    "    - {type: relu}\n"
    "    - {name: conv2, type: conv2d, out_channels: 8, kernel: 3, padding: 1, groups: 8}\n"
    "    - {name: conv3, type: conv2d, out_channels: 8, kernel: 3, padding: 1, groups: 2}\n"
    "    - {type: maxpool2d, kernel: 2}\n"
    "    - {type: flatten}\n"
    "    - {name: fc1, type: dense, units: 6}\n"
    "    - {type: relu}\n"
    "    - {name: head, type: dense, units: 3}\n"
    "train: {steps: 1, batch_size: 4, optimizer: {name: sgd, lr: 0.1}}\n";

static void expect_macs(const char *const *ov, int n_ov, double fwd, double dx, double dw) {
    Config *c = malloc(sizeof *c);
    Net *n = malloc(sizeof *n);
    CU_ASSERT_FATAL(c && n);
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(config_load_string(c, yaml, "t.yaml", ov, n_ov, &err), QT_OK);
    CU_ASSERT_EQUAL_FATAL(net_build(n, c, NET_SHELL, &err), QT_OK);
    StepMacs m = {-1, -1, -1};
    CU_ASSERT_EQUAL(net_step_macs(n, &m, &err), QT_OK);
    CU_ASSERT_DOUBLE_EQUAL(m.forward, fwd, 1e-9);
    CU_ASSERT_DOUBLE_EQUAL(m.backward_dx, dx, 1e-9);
    CU_ASSERT_DOUBLE_EQUAL(m.backward_dw, dw, 1e-9);
    CU_ASSERT_DOUBLE_EQUAL(step_macs_total(&m), fwd + dx + dw, 1e-9);
    if (m.forward != fwd || m.backward_dx != dx || m.backward_dw != dw)
        fprintf(stderr, "\n  got forward %.0f dx %.0f dw %.0f, want %.0f %.0f %.0f\n", m.forward, m.backward_dx,
                m.backward_dw, fwd, dx, dw);
    net_free(n);
    free(n);
    free(c);
}

/* Every weight trains. Input gradients for every layer but conv1, which
 * reads the data: 2592 + 10368 + 432 + 18 = 13410; weight gradients for all. */
static void test_full(void) {
    expect_macs(NULL, 0, 18594, 13410, 18594);
    /* model_forward_flops counts the same forward, twice (FLOPs) */
    Config *c = malloc(sizeof *c);
    Net *n = malloc(sizeof *n);
    CU_ASSERT_FATAL(c && n);
    QtError err = {0};
    CU_ASSERT_EQUAL_FATAL(config_load_string(c, yaml, "t.yaml", NULL, 0, &err), QT_OK);
    CU_ASSERT_EQUAL_FATAL(net_build(n, c, NET_SHELL, &err), QT_OK);
    CU_ASSERT_DOUBLE_EQUAL(model_forward_flops(&n->model), 2.0 * 18594, 1e-9);
    CU_ASSERT_DOUBLE_EQUAL(model_module_macs(model_find_module(&n->model, "conv2")), 2592, 1e-9);
    CU_ASSERT_DOUBLE_EQUAL(model_module_macs(&n->model.modules[1]), 0, 1e-9); /* the relu */
    net_free(n);
    free(n);
    free(c);
}

/* Rank 2 on conv1, conv3 and fc1 (a depthwise conv takes no adapter), the
 * head trained in full, every other weight frozen (no weight gradient).
 *   conv1 adapter: full gradient 8 * 18 = 144 a position against its own
 *     products 2 (r fan + OC r) = 2 (36 + 16) = 104: its own, per position
 *     A col 36 (forward), dt 16 (dx), dA 36 + dB 16 (dw); x 36 positions:
 *     forward 1296, dx 576, dw 1872. conv1 itself: no dx (the data), no dw.
 *   conv2, conv3: their input needs a gradient (conv1's adapter trains):
 *     dx 2592 and 10368.
 *   conv3 adapter (g 2, B reads r/g = 1): full 8 * 36 = 288 against
 *     2 (2 * 36 + 8 * 1) = 160: A col 72, dt 8, dA 72 + dB 8; x 36:
 *     forward 2592, dx 288, dw 2880.
 *   fc1: dx 432; its adapter (in 72, out 6): x A^T 144 + h B^T 12 forward,
 *     dh 12 + dh A 144 dx, dA 144 + dB 12 dw: 156 each.
 *   head: dx 18, dw 18.
 * forward 18594 + 1296 + 2592 + 156 = 22638
 * dx 576 + 2592 + 10368 + 288 + 432 + 156 + 18 = 14430
 * dw 1872 + 2880 + 156 + 18 = 4926 */
static void test_lora_own_products(void) {
    const char *ov[] = {"lora.rules=[{module_path: \"conv1|conv3|fc1\", rank: 2}]", "lora.trainable=[head]"};
    expect_macs(ov, 2, 22638, 14430, 4926);
}

/* An adapter on fc1 alone: nothing before fc1 trains, so neither conv2,
 * conv3 nor fc1 forms an input gradient, and fc1's adapter only dh (12),
 * not dh A; the head's input needs one (18).
 * forward 18594 + 156 = 18750, dx 12 + 18 = 30, dw 156 + 18 = 174 */
static void test_lora_late_adapter(void) {
    const char *ov[] = {"lora.rules=[{module_path: fc1, rank: 2}]", "lora.trainable=[head]"};
    expect_macs(ov, 2, 18750, 30, 174);
}

/* Rank 4 on conv1: its own products would be 2 (4 * 18 + 8 * 4) = 208 a
 * position, more than the full weight gradient's 144, which it takes
 * instead (dw 36 * 144 = 5184; dA and dB then once a batch, not counted);
 * rank 2 on fc1 as above; conv3 frozen without an adapter.
 * forward 18594 + 156 = 18750
 * dx 2592 + 10368 + 432 + 156 + 18 = 13566
 * dw 5184 + 156 + 18 = 5358 */
static void test_lora_full_gradient_form(void) {
    const char *ov[] = {"lora.rules=[{module_path: conv1, rank: 4}, {module_path: fc1, rank: 2}]",
                        "lora.trainable=[head]"};
    expect_macs(ov, 2, 18750, 13566, 5358);
}

int register_step_macs_suite(void) {
    CU_pSuite s = CU_add_suite("step_macs", NULL, NULL);
    if (!s) return -1;
    return !CU_add_test(s, "full training: every weight gradient, no input gradient for the first layer",
                        test_full) ||
           !CU_add_test(s, "LoRA: adapters' own products, frozen base, grouped conv", test_lora_own_products) ||
           !CU_add_test(s, "LoRA: nothing trains before the adapter, no input gradients there",
                        test_lora_late_adapter) ||
           !CU_add_test(s, "LoRA: a conv adapter through the full weight gradient", test_lora_full_gradient_form);
}
