#!/bin/sh
# fuzz/run.sh SECONDS TARGET... - runs each built libFuzzer target
# (build/fuzz/fuzz_<target>) for SECONDS, one after the other, on its
# committed seeds fuzz/corpus/<target>/. New inputs go to the scratch corpus
# build/fuzz/corpus/<target>/ (read again by later runs), crashes to
# build/fuzz/artifacts/<target>/, the full output to build/fuzz/<target>.log.
# Prints libFuzzer's closing stats line per target; exits 1 if any target
# found a crash, leak, timeout or sanitizer report.
set -u
secs=$1
shift
targets="$*"
failed=""
for t in $targets; do
    bin=build/fuzz/fuzz_$t
    scratch=build/fuzz/corpus/$t
    art=build/fuzz/artifacts/$t
    log=build/fuzz/$t.log
    mkdir -p "$scratch" "$art"
    opts="-max_total_time=$secs -timeout=20 -rss_limit_mb=2048 -print_final_stats=1 -artifact_prefix=$art/"
    [ -f "fuzz/$t.dict" ] && opts="$opts -dict=fuzz/$t.dict"
    [ "$t" = config ] && opts="$opts -max_len=8192"
    echo "fuzz: $t for $secs s on fuzz/corpus/$t (log: $log)"
    # The harness's scratch files, on tmpfs where there is one; a crash skips
    # the harness's own cleanup, so the directory is removed here.
    tmp=$(mktemp -d /dev/shm/qtrain-fuzz-run-XXXXXX 2>/dev/null || mktemp -d)
    # shellcheck disable=SC2086 # opts is a list of options without spaces
    TMPDIR=$tmp "$bin" $opts "$scratch" "fuzz/corpus/$t" >"$log" 2>&1
    rc=$?
    rm -rf "$tmp"
    # The closing status line ("#N DONE cov: ... exec/s: ...") and "Done N runs in S second(s)".
    grep -E '^#[0-9]+[[:space:]]+DONE' "$log" | tail -n 1 | sed "s/^/  $t: /"
    grep -E '^Done [0-9]+ runs in' "$log" | tail -n 1 | sed "s/^/  $t: /"
    if [ "$rc" -ne 0 ]; then
        echo "  $t: FAILED (exit $rc); the report:"
        grep -n -E 'ERROR:|SUMMARY:|fuzz_[a-z]+: |Test unit written|deadly signal|timeout' "$log" | head -n 20 |
            sed 's/^/    /'
        echo "  reproduce: $bin <artifact>  (see fuzz/README.md)"
        failed="$failed $t"
    fi
done
if [ -n "$failed" ]; then
    echo "fuzz: FAILED:$failed"
    exit 1
fi
echo "fuzz: no crash in: $targets"
