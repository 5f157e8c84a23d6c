/* test_proc.h - the qtrain binary as a child process, for the tests that
 * signal, kill and resume it (QTRAIN_BIN, default build/qtrain). */
#ifndef QTRAIN_TESTS_TEST_PROC_H
#define QTRAIN_TESTS_TEST_PROC_H

#include <stdbool.h>
#include <sys/types.h>

/* The binary the tests run: $QTRAIN_BIN, else build/qtrain. */
const char *test_qtrain_bin(void);

/* Starts the qtrain binary with args (NULL-terminated, without argv[0]);
 * its stdout and stderr are appended to log_path. Returns the pid, or -1
 * (with a message on stderr) if it cannot start. */
pid_t test_proc_start(const char *log_path, const char *const *args);

/* test_proc_start with the child's resource limit `resource` (RLIMIT_AS,
 * RLIMIT_FSIZE, ...) set to `limit` (soft and hard) before the exec. */
pid_t test_proc_start_limited(const char *log_path, const char *const *args, int resource, unsigned long long limit);

/* Starts argv (argv[0] searched on PATH, NULL-terminated) with stdout and
 * stderr appended to log_path, and resource limited to limit if >= 0. */
pid_t test_proc_spawn(const char *log_path, const char *const *argv, int resource, unsigned long long limit);

/* Waits for pid at most timeout_s seconds, then SIGKILLs it (and says so on
 * stderr). Returns the raw wait status, or -1 if waitpid fails. */
int test_proc_wait(pid_t pid, double timeout_s);

/* Runs the binary to completion (test_proc_start + test_proc_wait). Returns
 * its exit status, or -1 if it did not exit normally (a signal, a timeout). */
int test_proc_run(const char *log_path, const char *const *args, double timeout_s);

/* Whether every float32 dataset below `group` of checkpoint a (at least
 * one) is in b with the same shape and bits; prints the first difference.
 * Both ways round: the two groups are equal. */
bool test_ckpt_group_within(const char *a, const char *b, const char *group);

/* The largest relative difference |a - b| / |a| (L2 norms) of a float32 dataset below `group` in a and b (each in
 * both, at least one), INFINITY if one is missing or unreadable (said on stderr). */
double test_ckpt_group_rel_diff(const char *a, const char *b, const char *group);

#endif
