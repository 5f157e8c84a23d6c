#!/bin/sh
# bench/export_bench.sh - the reference CNN exported as C (`qtrain export
# --format c`) against qtrain's own int8 paths and PyTorch's int8, each on
# one core, then one table (make bench-export; make bench runs it last).
#
#   sh bench/export_bench.sh
#
# 1. A real PTQ w8a8 checkpoint, quickly: configs/pretrain.yaml's CNN trained
#    for 20 steps, then configs/ptq-w8a8.yaml on it (its model and rules).
#    The weights' values do not change the speed; the accuracies printed
#    only show that every side runs the same trained model.
# 2. `qtrain export --format c --name cnn`, then bench/export_timing.c built
#    against the export twice (-std=c99 -O2 -DQRT_PORTABLE: the plain C
#    kernels; -std=c99 -O2 -march=native: the runtime's SIMD path where the
#    CPU has one, as qrt_simd() reports) and run on the Fashion-MNIST test
#    images, one thread, a few seconds each.
# 3. qtrain, one thread: `qtrain eval --integer` (the same integer program
#    inside qtrain) and `qtrain eval` (the int8 kernels of a PTQ checkpoint),
#    each timed as a whole command, load included, over the whole test set;
#    and `qtrain bench` on configs/ptq-w8a8.yaml over the same float base
#    (steady-state eval, batch 128, load excluded).
# 4. PyTorch's int8 of the same model and weights (bench/export_torch.py:
#    torch.ao static quantization as the *-ptq-int8 rows of bench-torch,
#    one thread) at batch 1 and batch 128; skipped when Debian's
#    python3-torch is not installed.
#
# Environment:
#   QTRAIN      the binary (default build/qtrain)
#   PYTHON      the interpreter with torch (default /usr/bin/python3, Debian's)
#   CC          the C compiler of the harness (default cc)
#   EXPORT_BENCH_OUT   where everything goes (default build/bench/export; must
#               be under build/, since the script replaces its run directories)
#   EXPORT_BENCH_SECONDS   timed seconds per C and PyTorch measurement (default 2.5)
# Exit status: 0 if every step ran (whatever the speed), 1 if one failed (the
# table still prints what was measured), 2 on a bad setup.
set -u

QTRAIN=${QTRAIN:-build/qtrain}
PYTHON=${PYTHON:-/usr/bin/python3}
CC=${CC:-cc}
OUT=${EXPORT_BENCH_OUT:-build/bench/export}
SECONDS_EACH=${EXPORT_BENCH_SECONDS:-2.5}
DATA=/usr/share/datasets/fashion-mnist
DIR=$(dirname "$0")
ROOT=$(cd "$DIR/.." && pwd) || exit 2
NAME=cnn

case "$OUT" in
    build/*|./build/*) ;;
    *) echo "bench/export_bench.sh: EXPORT_BENCH_OUT=$OUT is not under build/ (the script replaces" \
            "directories there)" >&2
       exit 2 ;;
esac
case "$OUT" in *..*) echo "bench/export_bench.sh: EXPORT_BENCH_OUT=$OUT must not contain '..'" >&2; exit 2 ;; esac
if [ ! -x "$QTRAIN" ]; then
    echo "bench/export_bench.sh: $QTRAIN is not an executable; run make first or set QTRAIN" >&2
    exit 2
fi
for f in t10k-images-idx3-ubyte t10k-labels-idx1-ubyte train-images-idx3-ubyte train-labels-idx1-ubyte; do
    if [ ! -f "$DATA/$f.gz" ] && [ ! -f "$DATA/$f" ]; then
        echo "bench/export_bench.sh: $DATA/$f.gz is missing; run make deps (Debian's dataset-fashion-mnist)" >&2
        exit 2
    fi
done
mkdir -p "$OUT" || exit 1
failed=""

. "$DIR/busy.sh" # cpu_busy, BUSY, warn_busy

# step LOG WHAT COMMAND...: runs the command, its stdout and stderr into $OUT/LOG.txt; on failure says so.
# STEP_MS is its wall time in milliseconds.
step() {
    name=$1 log="$OUT/$1.txt" what=$2
    shift 2
    printf '  %-44s' "$what"
    t0=$(date +%s%N)
    "$@" </dev/null >"$log" 2>&1
    rc=$?
    t1=$(date +%s%N)
    STEP_MS=$(( (t1 - t0) / 1000000 ))
    if [ $rc -ne 0 ]; then
        failed="$failed $name"
        echo " FAILED (exit $rc), see $log:"
        tail -n 3 "$log" | sed 's/^/    /'
        return 1
    fi
    echo " $STEP_MS ms"
}
# A setup step that everything after it needs.
must() { step "$@" || { echo "bench/export_bench.sh: failed:$failed" >&2; exit 1; }; }

# key:value of the first line of FILE starting with PREFIX.
field() { sed -n "s/^$2.* $3:\([^ ]*\).*/\1/p" "$1" 2>/dev/null | head -n 1; }

# The CPU: model name and the ISA extensions that matter for int8.
{
    lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -n 1
    flags=$(sed -n 's/^flags[[:space:]]*: //p' /proc/cpuinfo 2>/dev/null | head -n 1)
    isa=""
    for f in avx2 avx_vnni avx512f avx512_vnni amx_int8 asimd asimddp; do
        case " $flags " in *" $f "*) isa="$isa $f" ;; esac
    done
    echo "${isa# }"
} >"$OUT/cpu.txt"
CPU_MODEL=$(sed -n 1p "$OUT/cpu.txt")
CPU_ISA=$(sed -n 2p "$OUT/cpu.txt")

echo "Exported C against qtrain and PyTorch, one core each (outputs in $OUT)"
warn_busy

# 1. The checkpoint (the run directories are the script's own, under build/).
rm -rf "$OUT/pretrain" "$OUT/ptq" "$OUT/harness"
must pretrain "pretrain: configs/pretrain.yaml, 20 steps" env OPENBLAS_NUM_THREADS=1 "$QTRAIN" \
    --config "$ROOT/configs/pretrain.yaml" --set train.steps=20 --set train.schedule.warmup_steps=0 \
    --set train.eval_every=0 --set train.checkpoint_every=0 --set run.out_dir="$OUT/pretrain" --quiet
BASE=$OUT/pretrain/final.h5
must ptq "ptq: configs/ptq-w8a8.yaml" env OPENBLAS_NUM_THREADS=1 "$QTRAIN" --config "$ROOT/configs/ptq-w8a8.yaml" \
    --set model.init_from="$BASE" --set run.out_dir="$OUT/ptq" --quiet
CKPT=$OUT/ptq/final.h5

# 2. The export and the harness.
must export "qtrain export --format c --name $NAME" "$QTRAIN" export --format c --checkpoint "$CKPT" \
    --out "$OUT/c" --name "$NAME" --force
mkdir -p "$OUT/data" "$OUT/harness" || exit 1
for f in t10k-images-idx3-ubyte t10k-labels-idx1-ubyte; do
    if [ -f "$DATA/$f.gz" ]; then gunzip -c "$DATA/$f.gz" >"$OUT/data/$f" || exit 1
    else cp "$DATA/$f" "$OUT/data/$f" || exit 1
    fi
done
IMAGES=$OUT/data/t10k-images-idx3-ubyte
LABELS=$OUT/data/t10k-labels-idx1-ubyte
TEST_N=$(( $(wc -c <"$LABELS") - 8 ))
UPPER=$(echo "$NAME" | tr 'a-z' 'A-Z')
harness() { # $1 = the variant's name, then the compiler flags
    v=$1
    shift
    step "build-$v" "build export_timing ($*)" "$CC" -std=c99 -O2 "$@" -I"$OUT/c" -DEXPORT_NAME="$NAME" \
        -DEXPORT_UPPER="$UPPER" -DEXPORT_HEADER="\"$NAME.h\"" "$DIR/export_timing.c" "$OUT/c/$NAME.c" \
        "$OUT/c/qtrain_rt.c" -o "$OUT/harness/export_timing-$v" &&
        step "c-$v" "run export_timing-$v (${SECONDS_EACH} s)" "$OUT/harness/export_timing-$v" "$IMAGES" "$LABELS" \
            --seconds "$SECONDS_EACH"
}
harness portable -DQRT_PORTABLE
harness native -march=native
# AVX2 alone, what an AVX2-only CPU (AMD Zen 3, say) runs, when this CPU has it
if grep -qw avx2 /proc/cpuinfo 2>/dev/null; then harness avx2 -mavx2; fi

# 3. qtrain, one thread.
step eval-integer "qtrain eval --integer (whole command)" env OPENBLAS_NUM_THREADS=1 "$QTRAIN" eval --integer \
    --checkpoint "$CKPT" --set run.threads=1 && EVAL_INT_MS=$STEP_MS
step eval "qtrain eval (whole command)" env OPENBLAS_NUM_THREADS=1 "$QTRAIN" eval --checkpoint "$CKPT" \
    --set run.threads=1 && EVAL_MS=$STEP_MS
step bench "qtrain bench configs/ptq-w8a8.yaml" env OPENBLAS_NUM_THREADS=1 "$QTRAIN" bench \
    --config "$ROOT/configs/ptq-w8a8.yaml" --set model.init_from="$BASE" --set run.threads=1 \
    --set train.eval_batch_size=128 --warmup 0 --steps 1 --eval-batches 100

# 4. PyTorch, one thread.
TORCH=""
if "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    step torch "PyTorch int8, batch 1 and 128" "$PYTHON" "$DIR/export_torch.py" \
        --config "$ROOT/configs/ptq-w8a8.yaml" --init-from "$BASE" --seconds "$SECONDS_EACH" && TORCH=yes
else
    TORCH="skipped (python3-torch not installed)"
    echo "  PyTorch: $TORCH"
fi

# The table.
per_s() { # whole-command images/s from the step's milliseconds
    [ -n "${1:-}" ] && [ "$1" -gt 0 ] && awk -v n="$TEST_N" -v ms="$1" 'BEGIN { printf "%.1f", n * 1000 / ms }'
}
MACS=$(field "$OUT/c-portable.txt" export:timing macs)
[ -n "$MACS" ] || MACS=$(field "$OUT/c-native.txt" export:timing macs)
[ -n "$MACS" ] || MACS=$(field "$OUT/export.txt" export:c macs)
SIMD=$(field "$OUT/c-native.txt" export:timing simd)
row() { printf '%s|%s|%s|%s|%s\n' "$@"; } # key, what, images/s, target ratio, accuracy
timing() { field "$OUT/c-$1.txt" export:timing "$2"; }
torch_per_s() { sed -n "s/^export:torch_eval batch:$1 .*images_per_s:\([^ ]*\).*/\1/p" "$OUT/torch.txt" 2>/dev/null; }
{
    row portable "exported C, -O2 -DQRT_PORTABLE" "$(timing portable images_per_s)" 0.5 "$(timing portable accuracy)"
    row simd "exported C, -O2 -march=native (${SIMD:-?})" "$(timing native images_per_s)" 1.0 \
        "$(timing native accuracy)"
    if [ -f "$OUT/c-avx2.txt" ]; then
        row avx2 "exported C, -O2 -mavx2 (AVX2 alone)" "$(timing avx2 images_per_s)" 1.0 "$(timing avx2 accuracy)"
    fi
    row evalint "qtrain eval --integer, 1 thread *" "$(per_s "${EVAL_INT_MS:-}")" "" \
        "$(sed -n 's/^integer test_accuracy:\([^ ]*\).*/\1/p' "$OUT/eval-integer.txt" 2>/dev/null)"
    row eval "qtrain eval (int8 kernels), 1 thread *" "$(per_s "${EVAL_MS:-}")" "" \
        "$(sed -n 's/^test_accuracy:\([^ ]*\).*/\1/p' "$OUT/eval.txt" 2>/dev/null)"
    row bench "qtrain bench int8 eval, 1 thread, b128" "$(field "$OUT/bench.txt" bench:eval samples_per_s)" "" ""
    if [ "$TORCH" = yes ]; then
        acc=$(field "$OUT/torch.txt" export:torch accuracy)
        row torch1 "PyTorch int8, 1 thread, batch 1" "$(torch_per_s 1)" "" "$acc"
        row torch128 "PyTorch int8, 1 thread, batch 128" "$(torch_per_s 128)" "" "$acc"
    else
        row torch1 "PyTorch int8, 1 thread, batch 1" "$TORCH" "" ""
        row torch128 "PyTorch int8, 1 thread, batch 128" "$TORCH" "" ""
    fi
} >"$OUT/table.txt"
ENGINE=$(field "$OUT/torch.txt" export:torch engine)
TORCH_IMPL=$(field "$OUT/torch.txt" export:torch impl)
echo
echo "$NAME (configs/ptq-w8a8.yaml's CNN, ${MACS:-?} MACs per image), one core each"
echo "CPU: ${CPU_MODEL:-?} (${CPU_ISA:-no avx2/vnni/amx flags}); C: $($CC --version 2>/dev/null | head -n 1)"
[ "$TORCH" = yes ] && echo "PyTorch: ${TORCH_IMPL:-?}, quantized engine ${ENGINE:-?}"
awk -F'|' -v macs="${MACS:-0}" '
function num(s) { return s == "" ? "-" : s + 0 >= 100 ? sprintf("%.0f", s) : sprintf("%.1f", s) }
function known(a, b) { return a != "" && b != "" && b ~ /^[0-9.]+$/ && b + 0 > 0 }
function ratio(a, b) { return !known(a, b) ? "-" : sprintf(a / b >= 0.1 ? "%.2f" : "%.4f", a / b) }
function met(a, b, t) { return !known(a, b) ? "?" : a / b >= t ? "yes" : "NO" }
{ key[NR] = $1; what[NR] = $2; v[NR] = $3; target[NR] = $4; acc[NR] = $5; row[$1] = NR }
END {
    b1 = v[row["torch1"]]; b128 = v[row["torch128"]]
    printf "| %-42s | %9s | %8s | %9s | %9s | %-19s | %8s |\n", "path", "images/s", "MMAC/s", "/ PT b1", "/ PT b128",
        "target (b1 / b128)", "accuracy"
    printf "|%s|%s|%s|%s|%s|%s|%s|\n", "--------------------------------------------", "-----------", "----------",
        "-----------", "-----------", "---------------------", "----------"
    for (i = 1; i <= NR; i++) {
        skipped = v[i] != "" && v[i] !~ /^[0-9.]+$/
        t = target[i] == "" ? "-" : sprintf(">= %.1fx: %s / %s", target[i], met(v[i], b1, target[i]),
                                            met(v[i], b128, target[i]))
        if (skipped) { printf "| %-42s | %s\n", what[i], v[i]; continue }
        printf "| %-42s | %9s | %8s | %9s | %9s | %-19s | %8s |\n", what[i], num(v[i]),
            v[i] == "" ? "-" : num(v[i] * macs / 1e6), key[i] ~ /^torch/ ? "-" : ratio(v[i], b1),
            key[i] ~ /^torch/ ? "-" : ratio(v[i], b128), t, acc[i] == "" ? "-" : acc[i]
    }
    print "* the whole command over the test set: process start, checkpoint and data loading, every image; " \
        "the other rows time inference only"
    print "accuracy: a sanity check (the same trained model everywhere); the exported C rows over the first " \
        "test images they reached (accuracy_images in c-*.txt), the others over the whole test set"
}' "$OUT/table.txt"

warn_busy
if [ -n "$failed" ]; then
    echo "bench/export_bench.sh: failed:$failed" >&2
    exit 1
fi
