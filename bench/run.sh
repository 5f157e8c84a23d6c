#!/bin/sh
# bench/run.sh - `qtrain bench` on every config in bench/configs/, each in its
# own process (so peak RSS and start-up are per measurement), then one table.
#
#   sh bench/run.sh            qtrain only (make bench)
#   sh bench/run.sh --torch    and the same measurements in PyTorch
#                              (bench/torch_bench.py), each group of
#                              configs on qtrain and then on PyTorch, and a
#                              side-by-side table with the targets (make
#                              bench-torch)
#
# Environment:
#   QTRAIN      the binary (default build/qtrain)
#   PYTHON      the interpreter with torch (default /usr/bin/python3, Debian's)
#   BENCH_OUT   where the raw outputs go (default build/bench/results):
#               $BENCH_OUT/qtrain/<config>.txt, $BENCH_OUT/torch/<config>.txt
#               (the previous run's are removed first)
#   BENCH_KEEP_CORETYPE=1   run qtrain under the caller's OPENBLAS_CORETYPE;
#               by default it is unset, so qtrain picks the best kernels
#               this CPU runs, and PyTorch is then run under the family
#               qtrain reports.
# Exit status: 0 if every measurement ran, 1 otherwise (the table still prints).
set -u

QTRAIN=${QTRAIN:-build/qtrain}
PYTHON=${PYTHON:-/usr/bin/python3}
OUT=${BENCH_OUT:-build/bench/results}
DIR=$(dirname "$0")
TORCH=0
case "${1:-}" in
    --torch) TORCH=1 ;;
    "") ;;
    *) echo "usage: sh bench/run.sh [--torch]" >&2; exit 2 ;;
esac

# config, warm-up steps, timed steps, eval batches: a few seconds each.
# The GEMM-accounting pass adds half the timed steps (qtrain only). A
# shared machine's speed drifts from minute to minute, and the ratio of two
# processes minutes apart measures that drift as much as the two programs.
# So the configs whose step ratio is a target run back to back (cnn, then
# its LoRA, QLoRA and QT steps; the MLP's likewise), with their float
# config's warm-up and timed steps, so one slow second weighs the same in
# each mean; and with --torch each group ("-" ends one) runs on qtrain and
# then at once on PyTorch, so a qtrain / PyTorch ratio compares processes
# seconds apart, not the two halves of a run minutes long.
PLAN="mlp 20 400 200
mlp-lora 20 400 200
mlp-qlora 20 400 200
-
cnn 5 60 40
cnn-lora 5 60 40
cnn-qlora 5 60 40
cnn-qt 5 60 0
-
mlp-ptq-int8 0 1 200
cnn-ptq-int8 0 1 100
-
resnet8 3 20 20
resnet8-ptq-int8 0 1 60
-
dscnn 3 15 20
dscnn-ptq-int8 0 1 60
-"

if [ ! -x "$QTRAIN" ]; then
    echo "bench/run.sh: $QTRAIN is not an executable; run make first or set QTRAIN" >&2
    exit 2
fi
mkdir -p "$OUT/qtrain" || exit 1
# the tables read only this run's outputs: a config that fails shows "-", not an earlier run's figure
rm -f "$OUT"/qtrain/*.txt "$OUT"/torch/*.txt
failed=""

. "$DIR/busy.sh" # cpu_busy, BUSY, warn_busy
warn_busy

# One measurement: $1 = side (qtrain | torch), $2 = config, then warm-up,
# steps, eval batches. The start time is taken right before the process.
measure() {
    side=$1 name=$2 warmup=$3 steps=$4 evals=$5
    case "$side/$name" in
    torch/*-qt) # QT has no PyTorch counterpart: what counts is qtrain's own QT step against its float step
        printf '  %-7s %-14s skipped: no PyTorch counterpart (the QT / float step ratio is qtrain'"'"'s own)\n' \
            "$side" "$name"
        return ;;
    esac
    cfg="$DIR/configs/$name.yaml" out="$OUT/$side/$name.txt"
    printf '  %-7s %-14s' "$side" "$name"
    since=$(date +%s%N)
    if [ "$side" = qtrain ]; then
        if [ "${BENCH_KEEP_CORETYPE:-0}" = 1 ]; then
            "$QTRAIN" bench --config "$cfg" --warmup "$warmup" --steps "$steps" --eval-batches "$evals" \
                --since-ns "$since" </dev/null >"$out" 2>&1
        else
            env -u OPENBLAS_CORETYPE "$QTRAIN" bench --config "$cfg" --warmup "$warmup" --steps "$steps" \
                --eval-batches "$evals" --since-ns "$since" </dev/null >"$out" 2>&1
        fi
    else
        env OPENBLAS_CORETYPE="$CORE" OPENBLAS_NUM_THREADS=1 "$PYTHON" "$DIR/torch_bench.py" run --config "$cfg" \
            --warmup "$warmup" --steps "$steps" --eval-batches "$evals" --since-ns "$since" </dev/null >"$out" 2>&1
    fi
    rc=$?
    end=$(date +%s%N)
    if [ $rc -ne 0 ]; then
        failed="$failed $side/$name"
        echo " FAILED (exit $rc), see $out:"
        tail -n 3 "$out" | sed 's/^/    /'
    else
        echo " $(( (end - since) / 1000000 )) ms"
    fi
}

# The OpenBLAS family qtrain ran (its first output that names one), for PyTorch's OPENBLAS_CORETYPE.
find_core() {
    [ -n "$CORE" ] && return
    CORE=$(sed -n 's/^bench:blas core:\([^ ]*\).*/\1/p' "$OUT/qtrain/mlp.txt" 2>/dev/null | head -n 1)
    [ -n "$CORE" ] || CORE=$(sed -n 's/^bench:blas core:\([^ ]*\).*/\1/p' "$OUT"/qtrain/*.txt 2>/dev/null | head -n 1)
}

# The configs of one group ($2: PLAN lines) on each side of $1 in turn, in the current shell (so `failed` sticks).
measure_group() {
    for side in $1; do
        [ "$side" = torch ] && find_core
        while read -r name warmup steps evals; do
            [ -n "$name" ] && measure "$side" "$name" "$warmup" "$steps" "$evals"
        done <<EOF
$2
EOF
    done
}

# Every group of PLAN on the sides $1 ("qtrain", or "qtrain torch").
measure_plan() {
    group=""
    while read -r line; do
        if [ "$line" = - ]; then
            measure_group "$1" "$group"
            group=""
        else
            group="$group$line
"
        fi
    done <<EOF
$PLAN
EOF
}

CORE=""
if [ $TORCH = 1 ]; then
    mkdir -p "$OUT/torch" || exit 1
    echo "qtrain bench and PyTorch: every config in $DIR/configs, one process each; each group of configs on qtrain,"
    echo "then on PyTorch under OPENBLAS_NUM_THREADS=1 and the OpenBLAS family qtrain ran (outputs in $OUT/qtrain"
    echo "and $OUT/torch)"
    measure_plan "qtrain torch"
else
    echo "qtrain bench: every config in $DIR/configs, one process each (outputs in $OUT/qtrain)"
    measure_plan qtrain
fi
find_core

# The qtrain table: one row per measurement, one column per model.
awk -v core="${CORE:-?}" '
function base(f) { sub(/.*\//, "", f); sub(/\.txt$/, "", f); return f }
/^bench:/ {
    kind = substr($1, 7)
    for (i = 2; i <= NF; i++) {
        k = $i; sub(/:.*/, "", k)
        v = $i; sub(/^[^:]*:/, "", v)
        val[base(FILENAME), kind, k] = v
    }
}
function get(c, kind, k) { return ((c, kind, k) in val) ? val[c, kind, k] : "" }
function num(s, unit) {
    if (s == "") return "-"
    if (unit == "s") return sprintf("%.3f", s)
    if (unit == "f2") return sprintf("%.2f", s)
    return s >= 100 ? sprintf("%.0f", s) : sprintf("%.1f", s)
}
function ratio(a, b) { return (a == "" || b == "" || b + 0 == 0) ? "" : a / b }
function line(what, a, b, c, d) { printf "| %-30s | %10s | %10s | %10s | %10s |\n", what, a, b, c, d }
# "*": the mean step (batch) is over 1.25x the median, a few slow steps pulled the figure down
function noisy(c, kind,    mean, median) {
    mean = kind == "train" ? "step_ms" : kind == "eval" ? "batch_ms" : ""
    if (mean == "" || get(c, kind, mean) == "" || get(c, kind, mean "_median") == "") return ""
    if (get(c, kind, mean) > 1.25 * get(c, kind, mean "_median")) { marked = 1; return "*" }
    return ""
}
function cell(c, kind, k, unit) { return num(get(c, kind, k), unit) (k == "samples_per_s" ? noisy(c, kind) : "") }
# "-" where a model has no such config (no LoRA or QLoRA configs for resnet8 and dscnn)
function row(what, suffix, kind, k, unit) {
    line(what, cell("mlp" suffix, kind, k, unit), cell("cnn" suffix, kind, k, unit),
         cell("resnet8" suffix, kind, k, unit), cell("dscnn" suffix, kind, k, unit))
}
# a text field as printed ("vnni", "float-emulated", ...)
function text(c, kind, k) { return get(c, kind, k) == "" ? "-" : get(c, kind, k) }
function srow(what, suffix, kind, k) {
    line(what, text("mlp" suffix, kind, k), text("cnn" suffix, kind, k), text("resnet8" suffix, kind, k),
         text("dscnn" suffix, kind, k))
}
function step_ratio(m, a, b) { return num(ratio(get(m a, "train", "step_ms"), get(m b, "train", "step_ms")), "f2") }
function rrow(what, a, b) {
    line(what, step_ratio("mlp", a, b), step_ratio("cnn", a, b), step_ratio("resnet8", a, b), step_ratio("dscnn", a, b))
}
# the LoRA bound: multiply-adds per sample (bench:train macs_per_sample) of the LoRA step over those of the full one
function macs_ratio(m) { return ratio(get(m "-lora", "train", "macs_per_sample"), get(m, "train", "macs_per_sample")) }
function mrow(what) {
    line(what, num(macs_ratio("mlp"), "f2"), num(macs_ratio("cnn"), "f2"), num(macs_ratio("resnet8"), "f2"),
         num(macs_ratio("dscnn"), "f2"))
}
END {
    rate = get("cnn", "sgemm", "gflops")
    conv = get("cnn", "blas", "conv_kernel")
    printf "\nqtrain: batch 128, 2 threads, OpenBLAS %s kernels%s, same stride-1 convs on %s\n", core,
        rate == "" ? "" : sprintf(", sgemm %.0f GFLOP/s (1024 cube, best of %d, cnn run)", rate, get("cnn", "sgemm", "reps")),
        conv == "" ? "-" : conv == "gemm" ? "im2col + sgemm" : "the " conv " taps kernels"
    line("measurement", "mlp", "cnn", "resnet8", "dscnn")
    printf "|%s|%s|%s|%s|%s|\n", "--------------------------------", "------------", "------------", "------------",
        "------------"
    row("train samples/s", "", "train", "samples_per_s")
    row("train step ms", "", "train", "step_ms", "f2")
    row("eval samples/s", "", "eval", "samples_per_s")
    row("LoRA step samples/s", "-lora", "train", "samples_per_s")
    row("QLoRA step samples/s", "-qlora", "train", "samples_per_s")
    row("PTQ int8 eval samples/s", "-ptq-int8", "eval", "samples_per_s")
    srow("PTQ int8 kernel", "-ptq-int8", "eval", "int8_kernel")
    row("peak RSS MB (training)", "", "mem", "peak_rss_mb")
    row("start-up to 1st step s", "", "startup", "first_step_s", "s")
    row("GEMM share of a train step", "", "train", "gemm_share", "f2")
    row("train step / GEMM-bound limit", "", "train", "of_bound", "f2")
    rrow("LoRA step / full step", "-lora", "")
    mrow("LoRA bound (MACs LoRA / full)")
    rrow("QLoRA step / LoRA step", "-qlora", "-lora")
    rrow("QT step / float step", "-qt", "")
    if (marked) print "* the mean step (batch) is over 1.25x the median: a few slow steps, usually other processes " \
        "on the machine, pull this figure down; the medians are in the raw outputs"
    lb = macs_ratio("cnn")
    print "targets: the CNN train step at >= 0.75 of its GEMM-bound limit (multiply-adds per sample at the sgemm rate);"
    printf "  the CNN LoRA step / full step <= 1.05x its LoRA bound (%s)\n", lb == "" ? "-" : sprintf("<= %.2f", 1.05 * lb)
}' "$OUT"/qtrain/*.txt

if [ $TORCH = 1 ]; then
    echo
    echo "PyTorch ran with OPENBLAS_CORETYPE=${CORE:-?}"
    "$PYTHON" "$DIR/torch_bench.py" table --qtrain "$OUT/qtrain" --torch "$OUT/torch" --core "${CORE:-?}" ||
        failed="$failed table"
fi

warn_busy
if [ -n "$failed" ]; then
    echo "bench/run.sh: failed:$failed" >&2
    exit 1
fi
