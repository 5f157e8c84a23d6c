#!/bin/sh
# `make compare`, on full Fashion-MNIST: the float CNN, int8 and int4
# (per-channel) PTQ of it, and QAT to w4a8 with TQT ranges, side by side.
# Every step resumes (or skips) what an earlier run already did.
set -e
Q=${QTRAIN:-./build/qtrain}
step() { printf '\n=== %s\n' "$*"; }

step "float CNN (configs/pretrain.yaml)"
if [ -f runs/pretrain/final.h5 ]; then echo "runs/pretrain/final.h5 exists: using it"
else "$Q" --config configs/pretrain.yaml --resume auto; fi
step "PTQ int8 per channel"
"$Q" --config configs/ptq.yaml --resume auto -q
step "PTQ int4 per channel"
"$Q" --config configs/ptq.yaml --resume auto -q --set run.name=ptq-int4 --set run.out_dir=runs/ptq-int4 \
     --set quant.rules.0.weight_qtype=int4
step "QAT w4a8, TQT (configs/qat.yaml)"
"$Q" --config configs/qat.yaml --resume auto
step "compare"
"$Q" compare runs/pretrain runs/ptq runs/ptq-int4 runs/qat --out runs/compare
