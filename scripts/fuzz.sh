#!/usr/bin/env bash
# Coverage-guided fuzzing on stable Rust.
#
#   scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]
#
# Runs each fuzz target in fuzz/ (default: all five) for SECONDS_PER_TARGET seconds (default 20)
# and fails if any input makes one panic, hang (5 s on one input), run out of memory or make a
# huge allocation, printing that input's path.
#
# The engine is libFuzzer, from the libfuzzer-sys crate (its build script compiles libFuzzer's
# C++ sources, so a C++ compiler is all it needs besides cargo). The targets are compiled with
# LLVM's SanitizerCoverage through stable rustc flags (-C passes=sancov-module and
# -C llvm-args=-sanitizer-coverage-*): the instrumentation `cargo fuzz` adds, without the
# nightly-only -Z sanitizer=... (so no AddressSanitizer, which safe Rust hardly needs; overflow
# checks and debug assertions stay on). The fuzz/ layout also suits `cargo fuzz run -s none`.
#
# Each target's corpus grows in fuzz/corpus/<target> (kept between runs; git ignores it), seeded
# from fuzz/src/harness.rs on every run; fuzz/dicts/<target>.dict, where there is one, gives
# libFuzzer tokens it would not guess (JSON field names). Findings land in fuzz/artifacts/<target>/. To keep one
# as a regression test, copy it into tests/fuzz-regressions/<target>/: `cargo test` replays
# those files (crates/dgr/tests/fuzz_regressions.rs). To rerun one input:
#   fuzz/target/<host triple>/release/<target> <file>
set -euo pipefail
cd "$(dirname "$0")/.."

secs=${1:-20}
[ $# -eq 0 ] || shift
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(gguf_parse stage_frame ticket tracker_frame openai_body)
[[ $secs =~ ^[0-9]+$ ]] || { echo "usage: $0 [SECONDS_PER_TARGET] [TARGET...]" >&2; exit 2; }

# libfuzzer-sys compiles libFuzzer with the system's C++ compiler.
if ! command -v c++ >/dev/null 2>&1; then
    echo "fuzz: installing a C++ compiler (g++)"
    if [ "$(id -u)" -eq 0 ]; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ >/dev/null
    else
        sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ >/dev/null
    fi
fi

host=$(rustc -vV | sed -n 's/^host: //p')
# SanitizerCoverage as cargo-fuzz sets it up: 8-bit edge counters and the PC table (coverage
# feedback), comparison tracing (libFuzzer learns the operands of failed comparisons: magic
# numbers, lengths, keys), stack depth. `--target` keeps these flags off build scripts and
# proc macros.
export RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares -Cllvm-args=-sanitizer-coverage-stack-depth \
--cfg fuzzing -Cdebug-assertions -Coverflow-checks"
start=$SECONDS
bins=()
for t in "${targets[@]}"; do bins+=(--bin "$t"); done
cargo build --release --manifest-path fuzz/Cargo.toml --target "$host" "${bins[@]}"
echo "fuzz: built in $((SECONDS - start)) s"

failed=()
for t in "${targets[@]}"; do
    corpus=fuzz/corpus/$t
    artifacts=fuzz/artifacts/$t
    mkdir -p "$corpus" "$artifacts"
    log=$artifacts/last-run.log
    dict=()
    [ ! -f "fuzz/dicts/$t.dict" ] || dict=(-dict="fuzz/dicts/$t.dict")
    status=0
    "fuzz/target/$host/release/$t" "$corpus" -max_total_time="$secs" -timeout=5 -rss_limit_mb=2048 \
        -artifact_prefix="$artifacts/" -print_final_stats=1 ${dict[@]+"${dict[@]}"} >"$log" 2>&1 || status=$?
    summary=$(sed -En 's/^#([0-9]+)[[:space:]]+DONE[[:space:]]+/\1 runs, /p' "$log" | tail -n1)
    if [ "$status" -eq 0 ]; then
        echo "fuzz: $t: ok (${summary:-no stats}; corpus $(find "$corpus" -type f | wc -l) files)"
    else
        failed+=("$t")
        echo "fuzz: $t: FAILED (exit $status); its log: $log"
        grep -E -m1 -A12 "panicked at|ERROR: libFuzzer|memory allocation of|ALARM|out-of-memory" "$log" | cut -c1-160 | sed 's/^/    /' || true
        input=$(sed -n 's/.*Test unit written to \(.*\)$/\1/p' "$log" | tail -n1)
        if [ -n "$input" ]; then
            echo "fuzz: $t: the input: $input"
            echo "fuzz: $t: rerun it: fuzz/target/$host/release/$t $input"
            echo "fuzz: $t: keep it as a regression test: cp $input tests/fuzz-regressions/$t/"
        fi
    fi
done

echo "fuzz: ${#targets[@]} targets, ${secs} s each, $((SECONDS - start)) s in all"
if [ ${#failed[@]} -gt 0 ]; then
    echo "fuzz: findings in: ${failed[*]}"
    exit 1
fi
