#!/bin/sh
# `make research`: does LoftQ's init rescue QLoRA at low bit widths? QLoRA on
# the shifted task (configs/qlora.yaml, from runs/pretrain/final.h5) with
# int2, int3 and int4 bases in configs/qlora.yaml's block scheme (conv1 in
# blocks of 32, the others in blocks of 64, double-quantized scales), default
# init against lora.init: loftq, 3 epochs each; then the table of
# docs/BENCHMARKS.md ("LoftQ against the default init"). A finished run
# (summary.json) is reused, an interrupted one resumed. The variables choose
# other runs: the bit widths, the inits, LoftQ's iterations, the rank (its
# alpha 2 x rank), the directory, and further --set overrides for every run.
#   BITS="2 3 4" INITS="default loftq" ITERS=5 RANK=8 OUT=runs/research-loftq SETS="" \
#     sh scripts/research-loftq.sh
set -e
. scripts/lib.sh

OUT=${OUT:-runs/research-loftq}
ITERS=${ITERS:-5}
RANK=${RANK:-8}
BITS=${BITS:-2 3 4}
INITS=${INITS:-default loftq}
SETS=${SETS:-}
pretrain_once
mkdir -p "$OUT"
for bits in $BITS; do
    for init in $INITS; do
        dir=$OUT/int$bits-$init
        step "QLoRA, int$bits base, lora.init $init (loftq_iters $ITERS, rank $RANK${SETS:+, $SETS})"
        if [ -f "$dir/summary.json" ]; then echo "$dir/summary.json exists: using it"; continue; fi
        extra=""
        for s in $SETS; do extra="$extra --set $s"; done
        # shellcheck disable=SC2086 # $extra: one word per override
        "$Q" --config configs/qlora.yaml --resume auto --set run.name="qlora-int$bits-$init" \
             --set run.out_dir="$dir" --set quant.rules.0.weight_qtype=int$bits \
             --set quant.rules.1.weight_qtype=int$bits --set lora.init=$init --set lora.loftq_iters=$ITERS \
             --set lora.rules.0.rank=$RANK --set lora.rules.0.alpha=$((2 * RANK)) $extra > "$dir.log" 2>&1 ||
            { tail -5 "$dir.log"; exit 1; }
        grep -E '^(lora_init|done):' "$dir.log"
    done
done

# "key": value of a flat summary.json
val() { sed -n "s/^ *\"$2\": *\"\{0,1\}\([^\",]*\)\"\{0,1\},\{0,1\}$/\1/p" "$1/summary.json"; }
# the mean over modules of the init's relative residual (lora_init_rel_error_*), or of the default's
mean_err() {
    sed -n "s/^ *\"lora_init_$2_[^\"]*\": *\([0-9.e+-]*\),\{0,1\}$/\1/p" "$1/summary.json" |
        awk '{s += $1; n++} END {if (n) printf "%.4f", s / n; else printf "-"}'
}
step "table ($(lscpu 2>/dev/null | sed -n 's/^Model name: *//p'), $(nproc) cores)"
printf '| base | lora.init | test acc | against default (points) | rel. residual ‖W − (Q + s·B·A)‖ / ‖W‖ (mean over modules) |\n'
printf '|---|---|---|---|---|\n'
for bits in $BITS; do
    ad=""
    [ -f "$OUT/int$bits-default/summary.json" ] && ad=$(val "$OUT/int$bits-default" test_accuracy)
    for init in $INITS; do
        d=$OUT/int$bits-$init
        a=$(val "$d" test_accuracy)
        diff=$([ -n "$ad" ] && awk -v a="$a" -v b="$ad" 'BEGIN {printf "%+.2f", (a - b) * 100}' || echo -)
        err=$(mean_err "$d" rel_error)
        [ "$init" = default ] && err=$(mean_err "$OUT/int$bits-loftq" default_rel_error)
        printf '| int%s | %s | %.4f | %s | %s |\n' "$bits" "$init" "$a" "$diff" "$err"
    done
done
