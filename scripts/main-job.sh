#!/bin/sh
# The main job (`make run`), on full Fashion-MNIST: pretrain the CNN if its
# checkpoint does not exist yet -> int8 PTQ evaluation -> the nf4 base on the
# shifted task before fine-tuning -> QLoRA fine-tuning -> the w8a8 PTQ model
# exported as int8 C, built and run on the test set -> a summary table.
# Every step resumes (or skips) what an earlier `make run` already did.
set -e
. scripts/lib.sh

pretrain_once
step "int8 per-channel PTQ of the pretrained CNN (configs/ptq.yaml)"
"$Q" --config configs/ptq.yaml --resume auto
step "the nf4+DQ base on the shifted task, before fine-tuning"
"$Q" --config configs/qlora.yaml --resume auto --set run.name=qlora-base --set run.out_dir=runs/qlora-base \
     --set train.epochs=0
step "QLoRA fine-tuning on the shifted task (configs/qlora.yaml)"
"$Q" --config configs/qlora.yaml --resume auto
step "int8 weights and inputs (configs/ptq-w8a8.yaml), exported as C, built and run on the test set"
"$Q" --config configs/ptq-w8a8.yaml --resume auto
"$Q" export --format c --checkpoint runs/ptq-w8a8/final.h5 --out runs/device-c --name cnn --force
make -s -C runs/device-c
DATA=/usr/share/datasets/fashion-mnist
zcat "$DATA/t10k-images-idx3-ubyte.gz" > runs/device-c/t10k-images
zcat "$DATA/t10k-labels-idx1-ubyte.gz" > runs/device-c/t10k-labels
runs/device-c/cnn_example runs/device-c/t10k-images runs/device-c/t10k-labels | tee runs/device-c/accuracy.txt

# One value of a summary.json (our writer puts one key per line).
get() { sed -n "s/^ *\"$2\": *\"\{0,1\}\([^\",]*\)\"\{0,1\},\{0,1\}$/\1/p" "$1/summary.json"; }
pct() { awk -v v="$1" 'BEGIN { if (v == "" || v == "null") print "-"; else printf "%.2f %%", 100 * v }'; }
num() { awk -v v="$1" -v f="$2" 'BEGIN { if (v == "" || v == "null") print "-"; else printf f, v }'; }

step "summary"
printf '| %-22s | %-5s | %-8s | %-9s | %-9s | %-9s | %-10s | %-9s |\n' run mode task "test acc" trainable frozen \
       "base b/par" "peak RSS"
printf '|%s|\n' "------------------------|-------|----------|-----------|-----------|-----------|------------|-----------"
for d in pretrain:original ptq:original qlora-base:shifted lora:shifted qlora:shifted ptq-w8a8:original; do
    dir=runs/${d%%:*}
    [ -f "$dir/summary.json" ] || continue
    printf '| %-22s | %-5s | %-8s | %9s | %9s | %9s | %10s | %9s |\n' "$(get "$dir" name)" "$(get "$dir" mode)" \
        "${d##*:}" "$(pct "$(get "$dir" test_accuracy)")" "$(get "$dir" params_trainable)" \
        "$(get "$dir" params_frozen)" "$(num "$(get "$dir" base_bits_per_param)" %.3f)" \
        "$(num "$(get "$dir" peak_rss_mb)" '%.0f MB')"
done
# the exported program: its accuracy as it printed it, its sizes from export.json
acc=$(sed -n 's/.*accuracy:\([0-9.]*\).*/\1/p' runs/device-c/accuracy.txt 2>/dev/null)
ram=$(sed -n 's/^ *"ram_bytes": \([0-9]*\).*/\1/p' runs/device-c/export.json 2>/dev/null)
[ -n "$acc" ] && printf '| %-22s | %-5s | %-8s | %9s | %9s | %9s | %10s | %9s |\n' "device-c (int8 C)" c original \
    "$(pct "$acc")" 0 "$(sed -n 's/^ *"weight_bytes": \([0-9]*\).*/\1/p' runs/device-c/export.json)" 8.000 \
    "$(num "$ram" '%.0f B')"
printf '(device-c: the exported program run on the test set; frozen: its weights; peak RSS: its RAM, arena + input + output)\n'

