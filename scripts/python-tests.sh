#!/usr/bin/env bash
# The Python package's tests (python/, docs/design.md §7), part of the README's test command:
#  - `pip install ./python` into target/py-venv (the build runs cargo and puts
#    libncclreshard.so in the wheel), torch and pytest from scripts/requirements-python.txt;
#  - the ncclreshard CLI, which the JSON tests replay Python-written case files through;
#  - pytest python/tests (CPU only: torch's fake process group, host runs of exported plans);
#    test_header_structs.py compiles against the NVIDIA headers scripts/native-tests.sh puts in
#    target/native-venv (or NCCL_RESHARD_NATIVE_INCLUDE) and fails without them;
#  - python/examples/refit_torchrun.py on 8 emulated GPUs when scripts/build-emulator.sh and
#    scripts/native-tests.sh (NVRTC) have run, as scripts/test.sh does before this; then again
#    with an inference rank dying mid-refit (--kill 5): the survivors must recover byte-exact.
# The venv is reused while the requirements file is unchanged (torch is about 3 GB).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
source "$root/scripts/pip-retry.sh"
cd "$root"
venv="$root/target/py-venv"
stamp="$venv/.requirements"
if ! cmp -s "$root/scripts/requirements-python.txt" "$stamp" 2>/dev/null; then
  echo "== installing torch and pytest into $venv"
  rm -rf "$venv"
  python3 -m venv "$venv"
  pip_install "$venv/bin/python" --quiet -r "$root/scripts/requirements-python.txt"
  cp "$root/scripts/requirements-python.txt" "$stamp"
fi
py="$venv/bin/python"

echo "== pip install ./python (builds libncclreshard.so into the wheel)"
"$py" -m pip install --quiet --disable-pip-version-check ./python
echo "== the CLI the JSON tests replay cases through"
cargo build --release --locked -p ncclreshard-cli

echo "== pytest python/tests"
"$py" -m pytest -q python/tests

emu="$root/target/emu/lib"
nvrtc=$("$root/target/native-venv/bin/python" -c "import nvidia; print(list(nvidia.__path__)[0])" 2>/dev/null || true)
if [ -e "$emu/libnccl.so.2" ] && [ -n "$nvrtc" ]; then
  echo "== python/examples/refit_torchrun.py on 8 emulated GPUs"
  NCCL_RESHARD_NVRTC_LIBRARY="$nvrtc/cuda_nvrtc/lib/libnvrtc.so.12" \
    "$py" python/examples/refit_torchrun.py --emulated "$emu" --ranks 8 --steps 3
  echo "== the same with inference rank 5 dying before step 1 (deadline, shrink, survivors' plan)"
  log=$(mktemp)
  status=0
  NCCL_RESHARD_NVRTC_LIBRARY="$nvrtc/cuda_nvrtc/lib/libnvrtc.so.12" \
    "$py" python/examples/refit_torchrun.py --emulated "$emu" --ranks 8 --steps 3 --kill 5 \
    >"$log" 2>&1 || status=$?
  # The survivors' deadline reports are long; one is enough to see.
  grep -m1 ': step 1: ncclReshardCommWait' "$log" || true
  grep -v ': step 1: ncclReshardCommWait' "$log" || true
  [ "$status" -eq 0 ] && grep -q 'rank 5 died and the others recovered: every byte OK' "$log"
  rm -f "$log"
else
  echo "== the example on emulated GPUs needs scripts/build-emulator.sh and scripts/native-tests.sh first: skipped"
fi
