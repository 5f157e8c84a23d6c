/* test_proc.c - the qtrain binary as a child process. */
#include "test_proc.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

const char *test_qtrain_bin(void) {
    const char *bin = getenv("QTRAIN_BIN");
    return bin && bin[0] ? bin : "build/qtrain";
}

pid_t test_proc_start(const char *log_path, const char *const *args) {
    const char *argv[64];
    int n = 0;
    argv[n++] = test_qtrain_bin();
    for (int i = 0; args[i] && n < 63; i++) argv[n++] = args[i];
    argv[n] = NULL;
    int fd = open(log_path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd < 0) {
        fprintf(stderr, "\n  cannot open %s: %s\n", log_path, strerror(errno));
        return -1;
    }
    fflush(NULL); /* the child must not flush this process's buffers a second time */
    pid_t pid = fork();
    if (pid == 0) {
        dup2(fd, STDOUT_FILENO);
        dup2(fd, STDERR_FILENO);
        /* a clean signal state whatever the runner inherited */
        signal(SIGINT, SIG_DFL), signal(SIGTERM, SIG_DFL);
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        execv(argv[0], (char *const *)argv);
        fprintf(stderr, "cannot run %s: %s\n", argv[0], strerror(errno));
        _exit(127);
    }
    close(fd);
    if (pid < 0) fprintf(stderr, "\n  fork: %s\n", strerror(errno));
    return pid;
}

int test_proc_wait(pid_t pid, double timeout_s) {
    struct timespec t0, now, nap = {0, 2000000};
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        int status;
        pid_t r = waitpid(pid, &status, WNOHANG);
        if (r == pid) return status;
        if (r < 0 && errno != EINTR) return -1;
        clock_gettime(CLOCK_MONOTONIC, &now);
        if ((double)(now.tv_sec - t0.tv_sec) + 1e-9 * (double)(now.tv_nsec - t0.tv_nsec) > timeout_s) {
            fprintf(stderr, "\n  %s (pid %ld) still running after %.0f s: killed\n", test_qtrain_bin(), (long)pid,
                    timeout_s);
            kill(pid, SIGKILL);
            return waitpid(pid, &status, 0) == pid ? status : -1;
        }
        nanosleep(&nap, NULL);
    }
}

int test_proc_run(const char *log_path, const char *const *args, double timeout_s) {
    pid_t pid = test_proc_start(log_path, args);
    if (pid < 0) return -1;
    int status = test_proc_wait(pid, timeout_s);
    return status != -1 && WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}
