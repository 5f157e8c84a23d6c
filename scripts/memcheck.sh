#!/bin/sh
# scripts/memcheck.sh - `make memcheck`: tiny end-to-end qtrain runs under
# valgrind's memcheck, each of which must end with no error and no heap block
# left at exit (lost or still reachable), apart from the third-party blocks
# tests/valgrind.supp names. Covers float training stopped and resumed, eval,
# the conv/dropout/SGD path, PTQ + QLoRA, merge, quantize, QAT + convert, the C
# export and the integer evaluation, QT,
# inspect, compare and demo, and two runs that must fail cleanly. qtrain's
# thread pool is on (run.threads, one thread per core unless set; 2 in some).
# Prints one line per run with valgrind's error and leak summaries; stops at
# the first failing run and shows its report. Logs: build/memcheck/<run>.log
# (valgrind) and <run>.out (qtrain's own output). Run outputs go to a
# temporary directory removed at the end.
set -u
Q=${QTRAIN:-./build/qtrain}
VALGRIND=${VALGRIND:-valgrind}
logs=build/memcheck
vg_fail=99 # valgrind's exit status when it found an error; qtrain's own are 0, 1 and 2

# valgrind runs the program on an emulated CPU without AVX-512 (CPUID and
# XCR0 both say so), so qtrain's run-time checks pick its AVX2 and portable
# kernels, it never re-executes itself for OpenBLAS's AVX-512 kernels
# (nn/gemm.h), and OpenBLAS picks its Haswell ones. A pinned
# OPENBLAS_CORETYPE such as SkylakeX would force AVX-512 code valgrind cannot
# decode (SIGILL), so the choice is left to OpenBLAS.
unset OPENBLAS_CORETYPE
# One BLAS thread: qtrain splits products over its own pool (run.threads).
OPENBLAS_NUM_THREADS=1
export OPENBLAS_NUM_THREADS

command -v "$VALGRIND" >/dev/null 2>&1 || {
    echo "memcheck: $VALGRIND not found (make memcheck installs it)" >&2
    exit 1
}
[ -x "$Q" ] || { echo "memcheck: $Q not built (run make)" >&2; exit 1; }
mkdir -p "$logs"
tmp=$(mktemp -d "${TMPDIR:-/tmp}/qtrain-memcheck-XXXXXX") || exit 1
trap 'rm -rf "$tmp"' EXIT
trap 'exit 130' INT TERM

vg_opts="--tool=memcheck --leak-check=full --show-leak-kinds=all --errors-for-leak-kinds=all \
--error-exitcode=$vg_fail --track-origins=yes --num-callers=40 \
--gen-suppressions=all --suppressions=tests/valgrind.supp"

# One line from a valgrind log: "ERROR SUMMARY: ..." and the leak summary.
summary() {
    awk '
        /ERROR SUMMARY:/ { sub(/^==[0-9]+== /, ""); err = $0 }
        /no leaks are possible/ { leak = "no leaks are possible" }
        /definitely lost:/ { d = $4 " " $5 } /indirectly lost:/ { i = $4 " " $5 }
        /possibly lost:/ { p = $4 " " $5 } /still reachable:/ { r = $4 " " $5 }
        /suppressed:/ && !/ERROR/ { s = $3 " " $4 }
        END {
            if (leak == "" && d != "")
                leak = "definitely lost " d ", indirectly " i ", possibly " p ", still reachable " r ", suppressed " s
            printf "%s; %s\n", err == "" ? "no ERROR SUMMARY" : err, leak == "" ? "no leak summary" : leak
        }' "$1"
}

# run NAME ARG...: qtrain ARG... under memcheck; qtrain must exit $want.
want=0
run() {
    name=$1
    shift
    log=$logs/$name.log
    # shellcheck disable=SC2086 # vg_opts is a list of options without spaces
    "$VALGRIND" $vg_opts --log-file="$log" "$Q" "$@" >"$logs/$name.out" 2>&1
    rc=$?
    printf 'memcheck: %-13s %s\n' "$name" "$(summary "$log")"
    [ "$rc" -eq "$want" ] && return 0
    if [ "$rc" -eq "$vg_fail" ]; then
        echo "memcheck: $name: FAILED, valgrind found errors or leaks (full log: $log); the report:"
    else
        echo "memcheck: $name: FAILED, qtrain exited $rc, not $want (its output: $logs/$name.out," \
             "valgrind's log: $log):"
        tail -n 20 "$logs/$name.out" | sed 's/^/    /'
    fi
    # valgrind's records (not the suppression stubs --gen-suppressions adds), when it found
    # something or the program died of a signal.
    if [ "$rc" -eq "$vg_fail" ] || grep -q 'Process terminating' "$log"; then
        awk '/Parent PID:/ { on = 1; next } /^{/ { skip = 1 } on && !skip && /^==[0-9]+== ./ { print "    " $0 }
             /^}/ { skip = 0 }' "$log" | head -n 150
    fi
    echo "memcheck: the command (after the runs above): env -u OPENBLAS_CORETYPE OPENBLAS_NUM_THREADS=1 $VALGRIND" \
         "$vg_opts $Q $*"
    exit 1
}

# train NAME CONFIG [ARG...]: a 4-step run of tests/configs/CONFIG.yaml into $tmp/CONFIG, a checkpoint every 2 steps.
train() {
    name=$1 cfg=$2
    shift 2
    run "$name" --config "tests/configs/$cfg.yaml" --set "run.out_dir=$tmp/$cfg" --set train.steps=4 \
        --set train.checkpoint_every=2 --set train.log_every=2 "$@"
}
# fails NAME ARG...: a run that must stop with qtrain's error status 1, its clean-up checked.
fails() {
    want=1
    run "$@"
    want=0
}
base="model.init_from=$tmp/tiny-base/final.h5"

start=$(date +%s)
echo "memcheck: valgrind memcheck of tiny qtrain runs (logs in $logs/)"
# Float MLP on two threads: stop after step 2 (checkpoint), resume, evaluate.
train mlp-stop tiny-mlp --set run.threads=2 --set train.eval_every=2 --stop-at-step 2
train mlp-resume tiny-mlp --set run.threads=2 --set train.eval_every=2 --resume auto
run mlp-eval eval --checkpoint "$tmp/tiny-mlp/final.h5"
# Conv, max-pool, dropout, SGD with Nesterov momentum, cosine warm-up,
# clipping; it writes the inflated IDX cache, from which the next run reads
# its images batch by batch (data.storage auto = file).
train cnn tiny-cnn --set train.eval_every=2 --set "data.cache_dir=$tmp/cache"
# A residual block with batch norm, whose 8-channel 3x3 convs run as F(2x2, 3x3) (forward, input and weight
# gradients).
train res tiny-res
# The float CNN the quantized runs start from.
train base tiny-base --set "data.cache_dir=$tmp/cache"
# nf4 (+ double quantization) base with LoRA adapters on two threads, then the merge.
train qlora tiny-qlora --set "$base" --set run.threads=2
run merge merge --checkpoint "$tmp/tiny-qlora/final.h5" --out "$tmp/merged.h5"
# The float merge, evaluated into a file of our choosing; new adapters started from the run's adapters.h5
# (the base identity is checked); a PTQ base quantized with stochastic rounding.
run merge-float merge --checkpoint "$tmp/tiny-qlora/final.h5" --out "$tmp/merged-float.h5" --dequantize
run eval-out eval --checkpoint "$tmp/merged-float.h5" --out "$tmp/merged-eval.json"
run adapters-from --config tests/configs/tiny-qlora.yaml --set "run.out_dir=$tmp/qlora2" --set train.steps=2 \
    --set "$base" --set "model.adapters_from=$tmp/tiny-qlora/adapters.h5" --set quant.rules.0.rounding=stochastic
run quantize quantize --config tests/configs/tiny-qlora.yaml --checkpoint "$tmp/tiny-base/final.h5" --out "$tmp/nf4.h5"
run inspect inspect "$tmp/nf4.h5"
# QAT (learned pof2 ranges, int4/int8) from the base, then its conversion to a PTQ checkpoint.
train qat tiny-qat --set "$base" --set quant.calibration_batches=1
run convert convert --checkpoint "$tmp/tiny-qat/final.h5" --out "$tmp/qat-ptq.h5"
# To the device: the QAT run as int8 C (converted on the way), and the integer program of its conversion.
run export-c export --format c --checkpoint "$tmp/tiny-qat/final.h5" --out "$tmp/device-c"
run eval-integer eval --integer --checkpoint "$tmp/qat-ptq.h5" --dump-logits "$tmp/integer.npy"
# QT: int8 GEMMs forward and backward with stochastic rounding.
train qt tiny-qt
run compare compare "$tmp/tiny-mlp" "$tmp/tiny-qlora" "$tmp/tiny-qt" --out "$tmp/compare"
run demo demo --steps 4 --threads 2
# Out to PyTorch and back: the float MLP as safetensors, a run started from it; the QLoRA run as a PEFT directory.
run export export --checkpoint "$tmp/tiny-mlp/final.h5" --format safetensors --out "$tmp/mlp.safetensors"
run from-st --config tests/configs/tiny-mlp.yaml --set "run.out_dir=$tmp/from-st" --set train.steps=2 \
    --set "model.init_from=$tmp/mlp.safetensors"
run export-peft export --checkpoint "$tmp/tiny-qlora/final.h5" --format peft --out "$tmp/peft"
# An HDF5 data set (3 channels, float32, chunked and gzip'd) read per batch, per-channel normalize; made with
# Debian's python3-h5py (make test installs it), else this run is skipped with a line that says so.
if /usr/bin/python3 -c 'import h5py, numpy' 2>/dev/null; then
    /usr/bin/python3 - "$tmp/data.h5" <<'PY'
import sys, h5py, numpy as np
r = np.random.default_rng(1)
with h5py.File(sys.argv[1], "w") as f:
    for s, n in (("train", 96), ("test", 32)):
        f.create_dataset(s + "/x", data=r.standard_normal((n, 3, 8, 8)).astype("float32"), chunks=(16, 3, 8, 8),
                         compression="gzip")
        f[s + "/y"] = r.integers(0, 4, n)
PY
    run hdf5-data --config tests/configs/tiny-mlp.yaml --set "run.out_dir=$tmp/h5" --set train.steps=4 \
        --set data.dataset=hdf5 --set "data.path=$tmp/data.h5" --set data.storage=file \
        --set 'data.transform=[{normalize: {per_channel: true}}]' --set 'model.input=[3, 8, 8]' \
        --set model.layers.3.units=4
else
    echo "memcheck: hdf5-data      skipped: /usr/bin/python3 with h5py and numpy is needed to write its data file"
fi
# Error paths: a truncated checkpoint, and a base of another model for QLoRA.
head -c 4096 "$tmp/tiny-mlp/final.h5" >"$tmp/truncated.h5"
fails bad-ckpt eval --checkpoint "$tmp/truncated.h5"
fails bad-init --config tests/configs/tiny-qlora.yaml --set "run.out_dir=$tmp/bad-init" \
    --set "model.init_from=$tmp/tiny-mlp/final.h5"
echo "memcheck: no errors and no leaks in any run ($(($(date +%s) - start)) s)"
