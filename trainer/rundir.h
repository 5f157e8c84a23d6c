/* rundir.h - the exclusive lock of a run directory.
 *
 * A training run holds "<out_dir>/.lock" (an fcntl write lock on it, the
 * file holding the owner's pid for people) from before it reads or writes
 * anything in out_dir until the process ends, so two runs never share an
 * out_dir. The lock dies with its process: a .lock file left by a killed
 * run is taken over without complaint. Other commands that write into a
 * run directory (eval.json; quantize, merge and convert outputs) take the
 * lock only around that write, and only where a .lock file exists.
 *
 * fcntl locks belong to the process and are dropped when any descriptor of
 * the file is closed, so nothing else opens .lock; a child process does not
 * inherit the lock. */
#ifndef QTRAIN_TRAINER_RUNDIR_H
#define QTRAIN_TRAINER_RUNDIR_H

#include <stdbool.h>

#include "base/error.h"

#define RUNDIR_LOCK_NAME ".lock"

typedef struct {
    bool held;  /* zero-initialized: not held */
    int fd;     /* the open .lock while held */
    char path[4096 + 8];
} RunDirLock;

/* Takes the lock of out_dir, which must exist: creates or opens
 * "<out_dir>/.lock" (never through a symlink), locks it without waiting and
 * writes our pid into it. If another live process holds it: QT_ERR_IO
 * naming that process's pid (qtrain exits 1), and lk stays not held. */
QtStatus rundir_lock(const char *out_dir, RunDirLock *lk, QtError *err);

/* rundir_lock of the directory holding `file`, if that directory holds a
 * .lock file (a run directory); otherwise QT_OK with lk not held. */
QtStatus rundir_lock_if_run(const char *file, RunDirLock *lk, QtError *err);

/* Releases a held lock (no-op otherwise). The .lock file stays, unless
 * remove_file: a caller that is about to remove the out_dir it created
 * unlinks .lock this way (while still holding it, so no other process
 * can be left locking the unlinked file; rundir_lock checks for that). */
void rundir_unlock(RunDirLock *lk, bool remove_file);

#endif
