#!/bin/sh
# bench/mpi_bench.sh - data-parallel training on this machine, and a scaling model fed by what it measures
# (make bench-mpi; bench/README.md, "Data-parallel training").
#
# For each of bench/configs/cnn, cnn-lora, cnn-qlora, resnet8 and configs/resnet8-qlora.yaml (QLoRA, and as
# float LoRA with quant.mode none) - real Fashion-MNIST from the config's data.dir; a config whose data is
# missing is skipped, visibly:
#   a. one process x 2 threads: `qtrain bench --set run.threads=2` (its bench:config line also gives the
#      trainable value count: the floats a data-parallel step sums);
#   b. 2 ranks x 1 thread: `mpirun -np 2 qtrain-mpi --set run.threads=1 --set train.steps=K`, samples/s and the
#      collectives' share of the step (`comm:NN%`) of the step lines after the first (warm-up) window;
#   c. one rank's part of a step: `qtrain bench --set run.threads=1 --set train.batch_size=64` (64 examples,
#      1 thread): step and forward (eval batch) medians, so backward + optimizer = step - forward.
# Then allreduce_bench under mpirun -np 2 (dist_sum_floats on the loopback: shared memory) at those gradient
# sizes, 16 floats and 1 KB..16 MB; then bench/mpi_scaling.py on the figures, written to
# $OUT/mpi_measured.txt. About two minutes on a 2-vCPU machine.
#
# Environment:
#   QTRAIN     the data-parallel binary (default build/qtrain-mpi)
#   QTRAIN1    the one-process binary (default build/qtrain)
#   ALLREDUCE  default build/bench/allreduce_bench
#   MPIRUN     default mpirun (Open MPI; run as root it gets --allow-run-as-root)
#   PYTHON     default /usr/bin/python3 (the model needs the standard library only)
#   BENCH_OUT  where the raw outputs go (default build/bench/mpi)
# Exit status: 0 if every measurement ran (skipped configs included), 1 otherwise.
set -u
set -f # quant.rules=[] below is a value, not a pattern

QTRAIN=${QTRAIN:-build/qtrain-mpi}
QTRAIN1=${QTRAIN1:-build/qtrain}
ALLREDUCE=${ALLREDUCE:-build/bench/allreduce_bench}
MPIRUN=${MPIRUN:-mpirun}
PYTHON=${PYTHON:-/usr/bin/python3}
OUT=${BENCH_OUT:-build/bench/mpi}
DIR=$(dirname "$0")
ROOT=$DIR/..

# name, config, warm-up and timed steps of (a), of (c), steps of (b) (~10-20 s per config in all), the run whose
# final checkpoint is the float base (model.init_from: LoRA and QLoRA train over one; its values do not change
# the speed) or -, then --set options of the config's own.
PLAN="cnn bench/configs/cnn.yaml 3 40 25 80 -
cnn-lora bench/configs/cnn-lora.yaml 3 50 30 120 cnn
cnn-qlora bench/configs/cnn-qlora.yaml 3 50 30 120 cnn
resnet8 bench/configs/resnet8.yaml 2 12 8 30 -
resnet8-lora configs/resnet8-qlora.yaml 2 10 6 30 resnet8 --set quant.mode=none --set quant.rules=[]
resnet8-qlora configs/resnet8-qlora.yaml 2 10 6 30 resnet8"

for b in "$QTRAIN" "$QTRAIN1" "$ALLREDUCE"; do
    if [ ! -x "$b" ]; then
        echo "bench/mpi_bench.sh: $b is not an executable; run make bench-mpi (or make MPI=1 and" \
            "make build/bench/allreduce_bench) first" >&2
        exit 2
    fi
done
if ! command -v "$MPIRUN" >/dev/null 2>&1; then
    echo "bench/mpi_bench.sh: $MPIRUN not found; install Open MPI (make mpi-deps)" >&2
    exit 2
fi
MPIFLAGS="--oversubscribe"
[ "$(id -u)" -eq 0 ] && MPIFLAGS="$MPIFLAGS --allow-run-as-root"
mkdir -p "$OUT" || exit 1
RUNS=$(mktemp -d "${TMPDIR:-/tmp}/qtrain-mpi-bench-XXXXXX") || exit 1
trap 'rm -rf "$RUNS"' EXIT INT TERM
MEASURED="$OUT/mpi_measured.txt"
: >"$MEASURED"
failed=""

. "$DIR/busy.sh" # cpu_busy, BUSY, warn_busy

# The CPU: model name and the SIMD/matrix extensions the kernels use.
CPU_MODEL=$(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -n 1)
flags=$(sed -n 's/^flags[[:space:]]*: //p' /proc/cpuinfo 2>/dev/null | head -n 1)
CPU_ISA=""
for f in avx2 avx512f avx512_vnni avx_vnni amx_tile amx_int8 amx_bf16 asimd; do
    case " $flags " in *" $f "*) CPU_ISA="$CPU_ISA $f" ;; esac
done
CPU_ISA=${CPU_ISA# }
VCPUS=$(nproc 2>/dev/null || echo '?')
echo "mpi:cpu vcpus:$VCPUS isa:$(echo "${CPU_ISA:-none}" | tr ' ' ',') model:${CPU_MODEL:-?}" >>"$MEASURED"

echo "Data-parallel training on this machine: 1 process x 2 threads against 2 ranks x 1 thread (outputs in $OUT)"
echo "CPU: ${CPU_MODEL:-?}, $VCPUS vCPUs (${CPU_ISA:-no avx2/avx512/amx flags})"
warn_busy

# field FILE LINE-PREFIX KEY: the value of KEY:VALUE on FILE's first line starting with LINE-PREFIX.
field() {
    awk -v p="$2" -v k="$3" 'index($0, p) == 1 { for (i = 2; i <= NF; i++) if (index($i, k ":") == 1) {
        print substr($i, length(k) + 2); exit } }' "$1"
}

# run LOG COMMAND...: stdout and stderr into $OUT/LOG.txt; on failure says so (and returns 1). A process killed
# by SIGKILL (exit 137: never qtrain's own doing; on a shared machine, someone else's kill) is run once more.
run() {
    log="$OUT/$1.txt"
    shift
    for attempt in 1 2; do
        t0=$(date +%s%N)
        "$@" </dev/null >"$log" 2>&1
        rc=$?
        printf ' %s ms' "$(( ($(date +%s%N) - t0) / 1000000 ))"
        [ $rc -eq 137 ] && [ $attempt -eq 1 ] || break
        printf ' (killed by SIGKILL from outside, once more)'
    done
    if [ $rc -ne 0 ]; then
        echo " FAILED (exit $rc), see $log:"
        tail -n 3 "$log" | sed 's/^/    /'
        return 1
    fi
}

SIZES=""
while read -r name cfg warm steps psteps ksteps from extra; do
    cfg="$ROOT/$cfg"
    data=$(sed -n 's/^  dir: *//p' "$cfg" | head -n 1)
    printf '  %-13s' "$name"
    if [ -n "$data" ] && [ ! -e "$data/train-images-idx3-ubyte.gz" ] && [ ! -e "$data/train-images-idx3-ubyte" ]; then
        echo " skipped: its data (data.dir $data) is missing; Debian's dataset-fashion-mnist (make deps) brings it"
        echo "mpi:skipped name:$name reason:data-missing" >>"$MEASURED"
        continue
    fi
    base=""
    if [ "$from" != - ]; then
        if [ ! -f "$RUNS/$from/final.h5" ]; then
            echo " skipped: it trains over the $from run's checkpoint (model.init_from), and that run failed"
            failed="$failed $name"
            continue
        fi
        base="--set model.init_from=$RUNS/$from/final.h5"
    fi
    # (a) one process, 2 threads (qtrain runs its own pool; OpenBLAS one thread under it, as the tests run it)
    printf ' 1x2:'
    run "$name-1x2" env OPENBLAS_NUM_THREADS=1 "$QTRAIN1" bench --config "$cfg" $base $extra --set run.threads=2 \
        --warmup "$warm" --steps "$steps" --eval-batches 5 || { failed="$failed $name-1x2"; continue; }
    # (c) one rank's part: 64 examples, 1 thread
    printf ' part:'
    run "$name-part" env OPENBLAS_NUM_THREADS=1 "$QTRAIN1" bench --config "$cfg" $base $extra --set run.threads=1 \
        --set train.batch_size=64 --set train.eval_batch_size=64 --warmup "$warm" --steps "$psteps" \
        --eval-batches 20 || { failed="$failed $name-part"; continue; }
    # (b) 2 ranks x 1 thread, five log windows; the first is the warm-up
    printf ' 2x1:'
    run "$name-2x1" env OPENBLAS_NUM_THREADS=1 "$MPIRUN" $MPIFLAGS -np 2 "$QTRAIN" --config "$cfg" $base $extra \
        --set run.threads=1 --set train.steps="$ksteps" --set train.log_every=$((ksteps / 5)) \
        --set train.schedule.warmup_steps=0 --set run.out_dir="$RUNS/$name" || { failed="$failed $name-2x1"; continue; }
    echo
    one="$OUT/$name-1x2.txt" part="$OUT/$name-part.txt" two="$OUT/$name-2x1.txt"
    params=$(field "$one" bench:config params_trainable)
    # samples/s of windows 2..5 (harmonic mean: equal steps each) and their mean comm share
    steady=$(awk '/^step:/ { w++; if (w < 2) next; for (i = 1; i <= NF; i++) {
            if ($i ~ /^samples\/s:/) { v = substr($i, 11); if (v > 0) { inv += 1 / v; n++ } }
            if ($i ~ /^comm:/) { c = substr($i, 6); sub(/%/, "", c); comm += c; nc++ } } }
        END { if (n && nc) printf "%.1f %.1f", n / inv, comm / nc }' "$two")
    whole=$(sed -n 's/.*"samples_per_s": *\([0-9.eE+-]*\).*/\1/p' "$RUNS/$name/summary.json" 2>/dev/null | head -n 1)
    if [ -z "$params" ] || [ -z "$steady" ]; then
        echo "    cannot read the figures of $name from $one and $two"
        failed="$failed $name-parse"
        continue
    fi
    echo "mpi:config name:$name mode:$(field "$one" bench:config mode) params:$params" \
        "batch:$(field "$one" bench:config batch)" \
        "one_proc_2t:$(field "$one" bench:train samples_per_s)" \
        "one_proc_2t_step_ms_median:$(field "$one" bench:train step_ms_median) two_ranks_1t:${steady% *}" \
        "two_ranks_1t_whole_run:${whole:-0} comm_pct:${steady#* }" \
        "part_step_ms:$(field "$part" bench:train step_ms_median)" \
        "part_fwd_ms:$(field "$part" bench:eval batch_ms_median)" >>"$MEASURED"
    SIZES="$SIZES --size $name=$params"
done <<EOF
$PLAN
EOF

# The sum alone, 2 ranks on the loopback
printf '  %-13s' allreduce
if run allreduce "$MPIRUN" $MPIFLAGS -np 2 "$ALLREDUCE" $SIZES --seconds 0.15; then
    echo
    grep '^bench:allreduce' "$OUT/allreduce.txt" >>"$MEASURED"
else
    failed="$failed allreduce"
fi

echo
if grep -q '^mpi:config ' "$MEASURED"; then
    "$PYTHON" "$DIR/mpi_scaling.py" "$MEASURED" || failed="$failed model"
else
    echo "No config was measured (see above): no table and no scaling model."
fi
warn_busy
if [ -n "$failed" ]; then
    echo "bench/mpi_bench.sh: failed:$failed" >&2
    exit 1
fi
