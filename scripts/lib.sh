# Shared by main-job.sh and compare.sh (sourced): the qtrain binary, step
# headers, and the float CNN every later run starts from or compares with.
Q=${QTRAIN:-./build/qtrain}

step() { printf '\n=== %s\n' "$*"; }

pretrain_once() {
    step "pretrain the float CNN (configs/pretrain.yaml)"
    if [ -f runs/pretrain/final.h5 ]; then echo "runs/pretrain/final.h5 exists: using it"
    else "$Q" --config configs/pretrain.yaml --resume auto; fi
}
