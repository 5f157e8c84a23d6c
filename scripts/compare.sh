#!/bin/sh
# `make compare`, on full Fashion-MNIST: the float CNN, int8 and int4
# (per-channel) PTQ of it, QAT to w4a8 with TQT ranges, and QT from scratch
# (int8 forward; int8 and int4 gradients, stochastic vs nearest rounding)
# against float training of the same 4 epochs, side by side.
# Every step resumes (or skips) what an earlier run already did.
set -e
. scripts/lib.sh

pretrain_once
step "PTQ int8 per channel"
"$Q" --config configs/ptq.yaml --resume auto -q
step "PTQ int4 per channel"
"$Q" --config configs/ptq.yaml --resume auto -q --set run.name=ptq-int4 --set run.out_dir=runs/ptq-int4 \
     --set quant.rules.0.weight_qtype=int4
step "QAT w4a8, TQT (configs/qat.yaml)"
"$Q" --config configs/qat.yaml --resume auto
step "float CNN, 4 epochs (the QT runs' reference)"
"$Q" --config configs/pretrain.yaml --resume auto --set run.name=float-4ep --set run.out_dir=runs/float-4ep \
     --set train.epochs=4 --set train.checkpoint_every=938
step "QT: int8 forward, int8 gradients with stochastic rounding (configs/qt.yaml)"
"$Q" --config configs/qt.yaml --resume auto
step "QT: int4 gradients, stochastic rounding"
"$Q" --config configs/qt.yaml --resume auto --set run.name=qt-bwd4-sr --set run.out_dir=runs/qt-bwd4-sr \
     --set quant.rules.0.bwd_qtype=int4
step "QT: int4 gradients, round to nearest"
"$Q" --config configs/qt.yaml --resume auto --set run.name=qt-bwd4-rne --set run.out_dir=runs/qt-bwd4-rne \
     --set quant.rules.0.bwd_qtype=int4 --set quant.rules.0.bwd_stochastic_rounding=none
step "compare"
"$Q" compare runs/pretrain runs/ptq runs/ptq-int4 runs/qat runs/float-4ep runs/qt runs/qt-bwd4-sr runs/qt-bwd4-rne \
     --out runs/compare --force
