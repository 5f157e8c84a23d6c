#!/bin/sh
# `make compare`, on full Fashion-MNIST: the float CNN, int8 and int4
# (per-channel) PTQ of it, QAT to w4a8 with TQT ranges, and QT from scratch
# (int8 forward; int8 and int4 gradients, stochastic vs nearest rounding)
# against float training of the same 4 epochs, side by side; and at about
# 4.5 bits per weight, a format per module chosen by qtrain autoquant against
# uniform int4 and nf4 per channel (the CNN, and ResNet-8 when
# runs/resnet8/final.h5 exists: configs/resnet8.yaml trains it, ~1 h).
# Every step resumes (or skips) what an earlier run already did.
set -e
. scripts/lib.sh

pretrain_once
step "PTQ int8 per channel"
"$Q" --config configs/ptq.yaml --resume auto -q
step "PTQ int4 per channel"
"$Q" --config configs/ptq.yaml --resume auto -q --set run.name=ptq-int4 --set run.out_dir=runs/ptq-int4 \
     --set quant.rules.0.weight_qtype=int4
step "PTQ nf4 per channel"
"$Q" --config configs/ptq.yaml --resume auto -q --set run.name=ptq-nf4-ch --set run.out_dir=runs/ptq-nf4-ch \
     --set quant.rules.0.weight_qtype=nf4 --set quant.rules.0.tile_size=0
step "autoquant: a format per module under 4.5 bits per weight (qtrain autoquant)"
[ -f runs/autoquant-4.5/autoquant.yaml ] ||
    "$Q" autoquant --config configs/pretrain.yaml --checkpoint runs/pretrain/final.h5 --budget 4.5 \
         --out runs/autoquant-4.5 -q
"$Q" --config runs/autoquant-4.5/autoquant.yaml --resume auto -q
resnet=""
if [ -f runs/resnet8/final.h5 ]; then
    step "ResNet-8: PTQ int4 and nf4 per channel, and autoquant under 4.5 bits per weight"
    for f in int4 nf4; do
        "$Q" --config configs/resnet8-ptq.yaml --resume auto -q --set run.name=resnet8-$f-ch \
             --set run.out_dir=runs/resnet8-$f-ch --set quant.rules.0.weight_qtype=$f --set quant.rules.0.tile_size=0
    done
    [ -f runs/resnet8-autoquant-4.5/autoquant.yaml ] ||
        "$Q" autoquant --config configs/resnet8.yaml --checkpoint runs/resnet8/final.h5 --budget 4.5 \
             --out runs/resnet8-autoquant-4.5 -q
    "$Q" --config runs/resnet8-autoquant-4.5/autoquant.yaml --resume auto -q --set run.name=resnet8-autoquant-4.5
    resnet="runs/resnet8 runs/resnet8-int4-ch runs/resnet8-nf4-ch runs/resnet8-autoquant-4.5"
else
    echo "runs/resnet8/final.h5 is missing: the ResNet-8 rows are left out (qtrain --config configs/resnet8.yaml)"
fi
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
# shellcheck disable=SC2086 # $resnet is a list of run directories
"$Q" compare runs/pretrain runs/ptq runs/ptq-int4 runs/ptq-nf4-ch runs/autoquant-4.5 runs/qat runs/float-4ep runs/qt \
     runs/qt-bwd4-sr runs/qt-bwd4-rne $resnet --out runs/compare
