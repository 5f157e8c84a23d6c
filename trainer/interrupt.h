/* interrupt.h - SIGINT/SIGTERM (and SIGUSR1) for a training run: the first signal asks
 * the run to stop after its current step, with a checkpoint (exit status
 * 130); a second one exits at once, leaving every checkpoint file as it is
 * (a save in flight leaves only its temp file, which the next save removes). */
#ifndef QTRAIN_TRAINER_INTERRUPT_H
#define QTRAIN_TRAINER_INTERRUPT_H

/* The exit status of an interrupted run, as a shell reports Ctrl-C. */
#define INTERRUPT_EXIT_STATUS 130

/* Installs the handlers for SIGINT and SIGTERM and clears any earlier request.
 * Returns 0, or -1 with errno set if sigaction fails. */
int interrupt_install(void);

/* The signal that asked the run to stop (SIGINT or SIGTERM), 0 if none.
 * Without interrupt_install it stays 0, so library callers never stop. */
int interrupt_requested(void);

/* Where a run is, for the handler: only inside the step loop (and the
 * stop that follows it) is there a step to finish and a checkpoint to
 * write; before it (loading data, building the model, resuming) and after
 * it (the final evaluation and save, which --resume auto does again) the
 * first signal exits at once, with a message, so a run stuck there (a slow
 * or hung library call) still ends on one SIGTERM. */
typedef enum { INTERRUPT_OUTSIDE, INTERRUPT_IN_LOOP, INTERRUPT_FINISHING } InterruptPhase;
void interrupt_set_phase(InterruptPhase phase);

/* The signal's name for messages: "SIGINT", "SIGTERM", "SIGUSR1" or "signal". */
const char *interrupt_signal_name(int sig);

#endif
