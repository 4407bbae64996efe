#!/usr/bin/env bash
# Coverage-guided fuzzing on the stable toolchain (docs/robustness.md).
#
#   bash scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]
#
# Builds the fuzz crate (fuzz/, its own workspace) with libFuzzer and SanitizerCoverage
# instrumentation through stable rustc flags, then runs each target (default: all) for
# SECONDS_PER_TARGET seconds (default 60), one after the other. Each target grows a working
# corpus under fuzz/target/corpus/<target>/, seeded from the committed fuzz/corpus/<target>/
# (which is only read). Exits non-zero if any target crashes, panics, aborts, times out or
# runs out of memory; the reproducer is left under fuzz/target/artifacts/<target>/.
# Needs only the Rust toolchain, a C++ compiler (libFuzzer is compiled by the libfuzzer-sys
# crate) and the crates in fuzz/Cargo.lock.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"

seconds="${1:-60}"
if ! [[ "$seconds" =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: bash scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]" >&2
  exit 2
fi
shift || true
all_targets=(plan_create case_file)
targets=("${@:-${all_targets[@]}}")
for t in "${targets[@]}"; do
  if [[ ! -f "fuzz_targets/$t.rs" ]]; then
    echo "fuzz.sh: no target $t (have: ${all_targets[*]})" >&2
    exit 2
  fi
done

# What cargo-fuzz asks of nightly's -Zsanitizer=fuzzer, spelled with stable flags: the
# SanitizerCoverage pass with edge counters, the PC table and comparison tracing libFuzzer
# reads, `cfg(fuzzing)`, and debug assertions plus overflow checks so that arithmetic bugs
# and std's unsafe-precondition checks abort instead of wrapping silently.
export RUSTFLAGS="-Cpasses=sancov-module \
-Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters \
-Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares \
--cfg fuzzing -Cdebug-assertions -Coverflow-checks"
# An explicit --target keeps RUSTFLAGS off build scripts, which are not linked with libFuzzer.
host="$(rustc -vV | sed -n 's/^host: //p')"
unset NCCL_RESHARD_DEBUG

echo "== building fuzz targets (release, $host)"
# Not --locked: fuzz/Cargo.lock pins every crates.io version, but it also records the
# library's own version, which a release bump changes; cargo updates that entry (and adds any
# new dependency) without moving the pinned ones.
build_start=$SECONDS
cargo build --release --target "$host" --bins
echo "built in $((SECONDS - build_start)) s"

bin_dir="target/$host/release"
failed=()
summary=()
for t in "${targets[@]}"; do
  corpus="target/corpus/$t"
  artifacts="target/artifacts/$t"
  log="target/logs/$t.log"
  mkdir -p "$corpus" "$artifacts" "$(dirname "$log")"
  cp -n "corpus/$t"/* "$corpus"/ 2>/dev/null || true
  echo "== fuzzing $t for $seconds s (log: fuzz/$log)"
  status=0
  found_before="$(find "$artifacts" -type f | wc -l)"
  flags=(-max_total_time="$seconds" -rss_limit_mb=2048 -timeout=10 -max_len=4096
    -artifact_prefix="$artifacts/" -print_final_stats=1)
  # A fixed seed replays the same mutations (CI): a run differs only in how far it gets.
  if [[ -n "${FUZZ_SEED:-}" ]]; then
    flags+=(-seed="$FUZZ_SEED")
  fi
  if [[ "${FUZZ_KEEP_GOING:-0}" == 1 ]]; then
    flags+=(-fork=1 -ignore_crashes=1 -ignore_timeouts=1 -ignore_ooms=1)
  fi
  start=$SECONDS
  "$bin_dir/$t" "$corpus" "${flags[@]}" >"$log" 2>&1 || status=$?
  elapsed=$((SECONDS - start))
  found=$(($(find "$artifacts" -type f | wc -l) - found_before))
  # Executions: the final stats (single process) or the last status line (fork mode,
  # "#N: cov: …").
  runs="$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)"
  if [[ -z "$runs" ]]; then
    runs="$(sed -n 's/^#\([0-9]*\): cov:.*/\1/p' "$log" | tail -n 1)"
  fi
  rate=$(( ${runs:-0} / (elapsed > 0 ? elapsed : 1) ))
  line="$t: ${runs:-?} executions in $elapsed s ($rate/s), corpus $(find "$corpus" -type f | wc -l) files, $found new findings, exit $status"
  summary+=("$line")
  echo "$line"
  if [[ $status -ne 0 || $found -gt 0 ]]; then
    failed+=("$t")
    echo "-- $t FAILED; the end of its log:"
    tail -n 40 "$log"
    echo "-- reproducers in fuzz/$artifacts/; replay one with:"
    echo "   fuzz/$bin_dir/$t fuzz/$artifacts/<file>"
  fi
done

echo "== summary"
printf '%s\n' "${summary[@]}"
if [[ ${#failed[@]} -gt 0 ]]; then
  echo "fuzzing found problems in: ${failed[*]}" >&2
  exit 1
fi
