/* rt_check.c - runs tests/device/rt_cases.h's fixed set through one build of device/qtrain_rt.c and prints
 *
 *   rt_check: simd=<path> cases=<n> mismatches=<n> hash=<16 hex digits>
 *
 * The device_rt suite builds it with every compiler and SIMD path there is (portable, AVX2, aarch64 and armhf
 * NEON under qemu) and requires no mismatch and one hash for all. A standalone C99 program, so it lives outside
 * the tests/ files the test runner links (the Makefile takes tests/ *.c, not its subdirectories):
 *
 *   cc -std=c99 -I. tests/device/rt_check.c device/qtrain_rt.c -o rt_check */
#include "tests/device/rt_cases.h"

int main(void) {
    RtcResult res;
    rtc_run(RTC_CHECK_SEED, RTC_CHECK_CASES, &res);
    printf("rt_check: simd=%s cases=%ld mismatches=%ld hash=%016llx\n", qrt_simd(), res.cases, res.mismatches,
           (unsigned long long)res.hash);
    if (res.mismatches) printf("rt_check: first mismatch: %s\n", res.first);
    return res.mismatches ? 1 : 0;
}
