#!/usr/bin/env bash
# The GPU tests on emulated devices (docs/design.md §7.6), part of the README's test command. Builds the
# CPU emulation of the CUDA driver, cudart and NCCL (emu/, scripts/build-emulator.sh) and runs
# the unchanged library on 8 emulated devices, ranks as threads:
#  - tests/gpu.rs: every mode, rounds and relays, colocated ranks, strided views, per-tensor
#    calls, plans inside a caller's NCCL group, graph capture, concurrent streams and threads,
#    a nonblocking communicator, NCCL_RESHARD_CHECK, stream checks, the copy kernel's paths on
#    every row length 1-600 bytes at every alignment pair mod 16, the conversion kernels against
#    the host executor on every bf16/f16 pattern (speed is not measured);
#  - examples/c/refit with 8 ranks, built by scripts/native-tests.sh against the installed
#    package and linked to the real libcudart/libnccl, loading the emulated ones at run time;
#  - the loopback NCCL stand-in (loopback/, scripts/build-loopback.sh) on ONE emulated device:
#    its own tests, then tests/gpu.rs again with 8 ranks as threads on that device, NCCL's
#    sends and receives as device copies ordered by stream memory operations.
# Needs scripts/native-tests.sh to have run first (its venv has the NVRTC wheel, its build the
# examples). Ends with `emulated gpus: N passed, M failed`.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
venv="$root/target/native-venv"
[ -x "$venv/bin/python" ] || { echo "run scripts/native-tests.sh first (it installs NVRTC)"; exit 2; }
nvidia=$("$venv/bin/python" -c "import nvidia, os; print(list(nvidia.__path__)[0])")

bash scripts/build-emulator.sh
lib="$root/target/emu/lib"
export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export NCCL_RESHARD_NCCL_LIBRARY="$lib/libnccl.so.2"
export NCCL_RESHARD_NVRTC_LIBRARY="$nvidia/cuda_nvrtc/lib/libnvrtc.so.12"
export NCCL_RESHARD_EMU_DEVICES=8

passed=0
failed=0
log=$(mktemp)

# Runs a cargo test command, adds its counts to the totals.
count() {
  local status=0 summary ok bad
  "$@" 2>&1 | tee "$log" || status=$?
  summary=$(grep -o '[0-9]* passed; [0-9]* failed' "$log" | grep -v '^0 passed; 0 failed' | tail -1 || true)
  ok=$(echo "${summary:-0 passed; 0 failed}" | awk '{print $1}')
  bad=$(echo "${summary:-0 passed; 0 failed}" | awk '{print $3}')
  passed=$((passed + ok))
  failed=$((failed + bad))
  if [ "$status" -ne 0 ] && [ "$bad" -eq 0 ]; then
    failed=$((failed + 1)) # the run itself broke (an emulator abort names the fault above)
  fi
}

echo "== tests/gpu.rs on 8 emulated devices"
count cargo test --locked --test gpu -- --ignored --skip copy_kernel_bandwidth --test-threads=1 \
  --nocapture

echo "== examples/c/refit on 8 emulated devices"
refit="$root/target/c-examples/refit"
if [ -x "$refit" ]; then
  if "$refit"; then passed=$((passed + 1)); else failed=$((failed + 1)); fi
else
  echo "refit was not built (scripts/native-tests.sh builds it when it finds libnccl and libcudart)"
  failed=$((failed + 1))
fi

# Skipped there, so the pass stays within a minute: the one-rank layout sweep (one rank's self
# messages are covered above and by the stand-in's own tests) and the deadline's overhead (a
# measurement; healthy calls with a deadline on 8 ranks run in the shrink-and-grow test).
echo "== the loopback NCCL stand-in on 1 emulated device: its tests, then tests/gpu.rs with 8 ranks"
loopback=$(bash scripts/build-loopback.sh)
count env NCCL_RESHARD_EMU_DEVICES=1 cargo test --locked -p ncclreshard-loopback -- --ignored \
  --test-threads=1
count env LD_LIBRARY_PATH="$loopback:$LD_LIBRARY_PATH" \
  NCCL_RESHARD_NCCL_LIBRARY="$loopback/libnccl.so.2" NCCL_RESHARD_EMU_DEVICES=1 \
  CUDA_DEVICE_MAX_CONNECTIONS=32 \
  cargo test --locked --test gpu -- --ignored --skip copy_kernel_bandwidth \
  --skip one_rank_colocated_layouts_are_byte_exact --skip deadline_overhead_on_healthy_calls \
  --test-threads=1 --nocapture

rm -f "$log"
echo "emulated gpus: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
