# bench/busy.sh - sourced by bench/run.sh and bench/export_bench.sh: how busy
# the CPUs are over a second (percent) before a benchmark starts, and the
# warning both print. Other processes make every figure noisy, and PyTorch's
# OpenMP threads suffer most from sharing a CPU.
cpu_busy() {
    { head -n 1 /proc/stat; sleep 1; head -n 1 /proc/stat; } 2>/dev/null | awk '
        { idle = $5 + $6; total = 0; for (i = 2; i <= NF; i++) total += $i }
        NR == 1 { idle0 = idle; total0 = total }
        NR == 2 && total > total0 { printf "%.0f", 100 * (1 - (idle - idle0) / (total - total0)) }'
}
BUSY=$(cpu_busy)
warn_busy() {
    if [ -n "$BUSY" ] && [ "$BUSY" -gt 20 ]; then
        echo "WARNING: the CPUs were $BUSY% busy with other work before the benchmark started; the figures are noisy"
    fi
}
