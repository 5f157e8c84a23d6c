/* interrupt.c - the stop request of SIGINT/SIGTERM (interrupt.h). */
#include "trainer/interrupt.h"

#include <signal.h>
#include <stdatomic.h>
#include <string.h>
#include <unistd.h>

/* Lock-free, so the handler may exchange it: of two signals arriving on two
 * threads at once, exactly one sees the other's request. */
static atomic_int stop_signal;
_Static_assert(ATOMIC_INT_LOCK_FREE == 2, "the stop request must be lock-free to be touched by a signal handler");

static void say(const char *msg) {
    ssize_t unused = write(STDERR_FILENO, msg, strlen(msg));
    (void)unused; /* nothing to do if stderr is gone */
}

static atomic_int phase; /* InterruptPhase */
_Static_assert(ATOMIC_INT_LOCK_FREE == 2, "the phase must be lock-free to be read by a signal handler");

/* "qtrain: SIGTERM<rest>" in one write, then the exit. strlen and strcat
 * are async-signal-safe (POSIX.1-2008 TC2). */
static _Noreturn void say_and_exit(int sig, const char *rest) {
    char msg[256] = "\nqtrain: ";
    strcat(msg, interrupt_signal_name(sig));
    if (strlen(msg) + strlen(rest) < sizeof msg) strcat(msg, rest);
    say(msg);
    _exit(INTERRUPT_EXIT_STATUS);
}

/* Only async-signal-safe calls: write, string copies, _exit. */
static void on_stop_signal(int sig) {
    int where = atomic_load(&phase);
    if (where == INTERRUPT_OUTSIDE) say_and_exit(sig, " before the first step: exiting now; nothing to save\n");
    if (where == INTERRUPT_FINISHING)
        say_and_exit(sig, " after the last step: exiting now; --resume auto runs the final evaluation and writes "
                          "final.h5 again\n");
    if (atomic_exchange(&stop_signal, sig) != 0) {
        say("\nqtrain: second stop signal: exiting now; the checkpoint files are left as they were\n");
        _exit(INTERRUPT_EXIT_STATUS);
    }
    say(sig == SIGINT ? "\nqtrain: SIGINT: stopping after the current step, with a checkpoint "
                        "(press Ctrl-C again to exit at once)\n"
        : sig == SIGTERM ? "\nqtrain: SIGTERM: stopping after the current step, with a checkpoint "
                           "(send it again to exit at once)\n"
                         : "\nqtrain: SIGUSR1: stopping after the current step, with a checkpoint "
                           "(send it again to exit at once)\n");
}

int interrupt_install(void) {
    atomic_store(&stop_signal, 0);
    atomic_store(&phase, INTERRUPT_OUTSIDE);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_stop_signal;
    /* SA_RESTART: a read or write the signal lands in carries on, so a save
     * in progress completes instead of failing with EINTR. */
    sa.sa_flags = SA_RESTART;
    sigemptyset(&sa.sa_mask);
    /* SIGUSR1 too: mpirun hands it to every rank as it is, where it kills
     * the job 1 s after passing on SIGINT/SIGTERM (docs/DISTRIBUTED.md). */
    if (sigaction(SIGINT, &sa, NULL) != 0 || sigaction(SIGTERM, &sa, NULL) != 0 || sigaction(SIGUSR1, &sa, NULL) != 0)
        return -1;
    return 0;
}

int interrupt_requested(void) { return atomic_load(&stop_signal); }

void interrupt_set_phase(InterruptPhase p) { atomic_store(&phase, (int)p); }

const char *interrupt_signal_name(int sig) {
    return sig == SIGINT ? "SIGINT" : sig == SIGTERM ? "SIGTERM" : sig == SIGUSR1 ? "SIGUSR1" : "signal";
}
