#!/usr/bin/env bash
# The fault campaign (docs/resilience.md): N random failure scenarios on 8 emulated GPUs, one
# process each (tests/faults.rs, `fault_scenario`): random refit layouts with and without
# replicas, every mode, several rounds and relays, blocking and nonblocking communicators; a
# trainer or inference rank (one or two) that never calls, dies in the middle of a round's
# group, is slow below or above the deadline, or loses a link. Each scenario checks that every
# survivor's call ends by its deadline plus the stated bound, recovers (shrink, the survivors'
# plan, a byte-exact call) or is refused alike on every survivor, and that a rank slow within the
# deadline is not declared dead.
#
# Use: bash scripts/fault-campaign.sh [--seed S] [--scenarios N]   (defaults: seed 1, 12)
# Builds what it needs (the emulator; NVRTC comes from scripts/native-tests.sh's venv, which it
# installs when missing). Ends with exactly one line:
#   faults: N scenarios, R recovered, E refused, H hung, W wrong, C crashed
# and fails unless recovered + refused = N.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
source "$root/scripts/pip-retry.sh"
cd "$root"
seed=1
scenarios=12
while [ $# -gt 0 ]; do
  case "$1" in
    --seed) seed=$2; shift 2 ;;
    --scenarios) scenarios=$2; shift 2 ;;
    *) echo "usage: bash scripts/fault-campaign.sh [--seed S] [--scenarios N]" >&2; exit 2 ;;
  esac
done

venv="$root/target/native-venv"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  pip_install "$venv/bin/python" --quiet -r "$root/scripts/requirements-native.txt"
  cp "$root/scripts/requirements-native.txt" "$venv/.requirements"
fi
nvidia=$("$venv/bin/python" -c "import nvidia, os; print(list(nvidia.__path__)[0])")
bash scripts/build-emulator.sh >/dev/null
lib="$root/target/emu/lib"
export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export NCCL_RESHARD_NCCL_LIBRARY="$lib/libnccl.so.2"
export NCCL_RESHARD_NVRTC_LIBRARY="$nvidia/cuda_nvrtc/lib/libnvrtc.so.12"
export NCCL_RESHARD_EMU_DEVICES=8
# A scenario's own deadlines are seconds; the emulator's deadlock report must come later.
export NCCL_RESHARD_EMU_DEADLOCK_SECONDS=60

cargo test --locked --test faults --no-run >/dev/null 2>&1 || cargo test --locked --test faults --no-run
recovered=0 refused=0 hung=0 wrong=0 crashed=0
log=$(mktemp)
trap 'rm -f "$log"' EXIT
for ((i = 0; i < scenarios; i++)); do
  status=0
  FAULT_SEED=$seed FAULT_SCENARIO=$i timeout 180 \
    cargo test --locked --test faults -- --ignored --exact fault_scenario --nocapture \
    >"$log" 2>&1 || status=$?
  line=$(grep '^fault-scenario:' "$log" | tail -1 || true)
  case "$line" in
    *"=> recovered"*) recovered=$((recovered + 1)) ;;
    *"=> refused"*) refused=$((refused + 1)) ;;
    *"=> hung"*) hung=$((hung + 1)) ;;
    *"=> wrong"*) wrong=$((wrong + 1)) ;;
    *)
      if [ "$status" -eq 124 ]; then hung=$((hung + 1)); line="fault-scenario: seed $seed #$i => hung (killed after 180 s)"
      else crashed=$((crashed + 1)); line="fault-scenario: seed $seed #$i => crashed (exit $status)"; fi
      tail -30 "$log" >&2 ;;
  esac
  echo "$line"
done
echo "faults: $scenarios scenarios, $recovered recovered, $refused refused, $hung hung, $wrong wrong, $crashed crashed"
[ $((recovered + refused)) -eq "$scenarios" ]
