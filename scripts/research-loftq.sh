#!/bin/sh
# `make research`: does LoftQ's init rescue QLoRA at low bit widths? QLoRA on
# the shifted task (configs/qlora.yaml, from runs/pretrain/final.h5) with
# int2, int3 and int4 bases in configs/qlora.yaml's block scheme (conv1 in
# blocks of 32, the others in blocks of 64, double-quantized scales), default
# init against lora.init: loftq, 3 epochs each; then the table of
# docs/BENCHMARKS.md ("LoftQ against the default init"). A finished run
# (summary.json) is reused, an interrupted one resumed.
#   BITS="2 3 4" ITERS=5 RANK=8 OUT=runs/research-loftq sh scripts/research-loftq.sh
set -e
. scripts/lib.sh

OUT=${OUT:-runs/research-loftq}
ITERS=${ITERS:-5}
RANK=${RANK:-8}
BITS=${BITS:-2 3 4}
pretrain_once
mkdir -p "$OUT"
for bits in $BITS; do
    for init in default loftq; do
        dir=$OUT/int$bits-$init
        step "QLoRA, int$bits base, lora.init $init (loftq_iters $ITERS, rank $RANK)"
        if [ -f "$dir/summary.json" ]; then echo "$dir/summary.json exists: using it"; continue; fi
        "$Q" --config configs/qlora.yaml --resume auto --set run.name="qlora-int$bits-$init" \
             --set run.out_dir="$dir" --set quant.rules.0.weight_qtype=int$bits \
             --set quant.rules.1.weight_qtype=int$bits --set lora.init=$init --set lora.loftq_iters=$ITERS \
             --set lora.rules.0.rank=$RANK --set lora.rules.0.alpha=$((2 * RANK)) > "$dir.log" 2>&1 ||
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
printf '| base | default init: test acc | LoftQ: test acc | difference (points) | rel. residual, default -> LoftQ (mean over modules) |\n'
printf '|---|---|---|---|---|\n'
for bits in $BITS; do
    d=$OUT/int$bits-default l=$OUT/int$bits-loftq
    ad=$(val "$d" test_accuracy) al=$(val "$l" test_accuracy)
    diff=$(awk -v a="$al" -v b="$ad" 'BEGIN {printf "%+.2f", (a - b) * 100}')
    printf '| int%s | %.4f | %.4f | %s | %s -> %s |\n' "$bits" "$ad" "$al" "$diff" "$(mean_err "$l" default_rel_error)" \
        "$(mean_err "$l" rel_error)"
done
