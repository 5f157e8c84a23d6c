/* autoquant.h - `qtrain sensitivity` and `qtrain autoquant` (trainer/sensitivity.h); each returns the exit
 * status (0, 1 runtime failure, 2 usage or config error). main.c answers their --help. */
#ifndef QTRAIN_CLI_AUTOQUANT_H
#define QTRAIN_CLI_AUTOQUANT_H

int autoquant_cmd_sensitivity(int argc, char **argv);
int autoquant_cmd_autoquant(int argc, char **argv);

#endif
