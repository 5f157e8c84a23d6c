#!/bin/bash
# readme-examples.sh - runs the README's `qtrain ...` examples, as printed, on
# the mini data set, and fails if one exits non-zero.
#   scripts/readme-examples.sh [QTRAIN_BIN [README]]
# Exit status: 0 all ran, 1 an example failed (or none was found), 77 skipped
# (no binary or no mini data; the reason on stdout).
#
# The examples are the lines of README.md's ```sh blocks that start with
# `qtrain ` (a trailing backslash joins the next line; a `# ...` comment is
# cut). Each runs in a temporary directory holding a link to configs/, so
# runs/ and the files the examples write land there. Substitutions:
#   - every example with --config gets --set data.dir=<repo>/data/fashion-mnist-mini
#     --set data.cache_dir=none, and a training example --set train.epochs=1
#     unless its config only evaluates (epochs: 0) or it sets train.epochs;
#   - --stop-at-step N becomes --stop-at-step 5; when the README resumes it
#     itself (the same line with --resume auto instead of --stop-at-step N,
#     later), that line continues the stopped run; otherwise the stop runs
#     in its own run.out_dir (runs/stop-example), then resumed here with
#     --resume auto;
#   - training examples run first, in README order, then the other commands
#     (eval, inspect, compare, convert, quantize, merge need those runs).
# Skipped, and why:
#   - `qtrain --help | --version | CMD --help`: a synopsis of three forms, not
#     one command (the commands suite runs --help of every command).
set -u

bin=$(realpath "${1:-build/qtrain}" 2>/dev/null)
readme=$(realpath "${2:-README.md}" 2>/dev/null)
if [ -z "$bin" ] || [ ! -x "$bin" ]; then
    echo "readme-examples: skipped: no qtrain binary at ${1:-build/qtrain}"
    exit 77
fi
if [ -z "$readme" ] || [ ! -r "$readme" ]; then
    echo "readme-examples: skipped: no README at ${2:-README.md}"
    exit 77
fi
repo=$(dirname "$readme")
mini=$repo/data/fashion-mnist-mini
if [ ! -e "$mini/train-images-idx3-ubyte.gz" ]; then
    echo "readme-examples: skipped: no mini data set in $mini"
    exit 77
fi

work=$(mktemp -d /tmp/qtrain-readme-XXXXXX) || exit 1
trap 'rm -rf "$work"' EXIT
ln -s "$repo/configs" "$work/configs"
cd "$work" || exit 1

mapfile -t examples < <(awk '
    /^```sh/ { block = 1; next }
    /^```/   { block = 0; next }
    !block   { next }
    {
        line = (pending != "" ? pending " " : "") $0
        sub(/^[ \t]+/, "", line)
        if (line ~ /\\$/) { sub(/[ \t]*\\$/, "", line); pending = line; next }
        pending = ""
        sub(/[ \t]+#.*$/, "", line)
        gsub(/[ \t]+/, " ", line)
        if (line ~ /^qtrain /) print substr(line, 8)
    }' "$readme")

ran=0 failed=0 skipped=0
start=$(date +%s)

# run LABEL ARGS...: one qtrain command; its output is shown only if it fails.
run() {
    local label=$1
    shift
    local log
    log=$(mktemp "$work/log-XXXXXX")
    if OPENBLAS_NUM_THREADS=1 "$bin" "$@" >"$log" 2>&1; then
        echo "ok      qtrain $label"
    else
        echo "FAILED  qtrain $label (exit $?): qtrain $*"
        sed 's/^/        /' "$log" | tail -20
        failed=$((failed + 1))
    fi
    ran=$((ran + 1))
}

data_sets=(--set "data.dir=$mini" --set data.cache_dir=none)

# example LINE: runs one example line with the substitutions above.
example() {
    local line=$1
    local -a args extra=()
    read -ra args <<<"$line"
    local config="" i stop=""
    for ((i = 0; i < ${#args[@]}; i++)); do
        [ "${args[i]}" = --config ] && config=${args[i + 1]:-}
        if [ "${args[i]}" = --stop-at-step ]; then
            args[i + 1]=5
            stop=1
        fi
    done
    [ -n "$config" ] && extra+=("${data_sets[@]}")
    if [ "${args[0]}" = --config ] && ! grep -Eq '^ *epochs: 0' "$config" && [[ $line != *train.epochs=* ]]; then
        extra+=(--set train.epochs=1)
    fi
    if [ -n "$stop" ]; then
        local -a resume=()
        for ((i = 0; i < ${#args[@]}; i++)); do
            if [ "${args[i]}" = --stop-at-step ]; then i=$((i + 1)); else resume+=("${args[i]}"); fi
        done
        local e
        for e in "${examples[@]}"; do
            if [ "$e" = "${resume[*]} --resume auto" ]; then # the README resumes it itself
                run "$line" "${args[@]}" "${extra[@]}"
                return
            fi
        done
        extra+=(--set run.out_dir=runs/stop-example)
        run "$line" "${args[@]}" "${extra[@]}"
        run "$line (resumed)" "${resume[@]}" "${extra[@]}" --resume auto
        return
    fi
    run "$line" "${args[@]}" "${extra[@]}"
}

if [ ${#examples[@]} -eq 0 ]; then
    echo "readme-examples: no qtrain example found in $readme"
    exit 1
fi
for line in "${examples[@]}"; do # training first: the other commands read its runs
    if [[ $line == *"|"* ]]; then continue; fi
    if [[ $line == --config* ]]; then example "$line"; fi
done
for line in "${examples[@]}"; do
    if [[ $line == *"|"* ]]; then
        echo "skipped qtrain $line (a synopsis, not one command)"
        skipped=$((skipped + 1))
        continue
    fi
    if [[ $line != --config* ]]; then example "$line"; fi
done
echo "readme-examples: ${#examples[@]} examples: $ran commands ran, $failed failed, $skipped skipped" \
     "($(($(date +%s) - start)) s)"
[ "$failed" -eq 0 ]
