#!/usr/bin/env bash
# The native side of the tests (docs/design.md §7.3–7.5), with real NVIDIA parts from PyPI and no GPU:
#  - the copy kernels compiled by the real NVRTC for sm_80, sm_90 and sm_100;
#  - NCCL's group depth found in the real libnccl's symbol table (open groups seen silently);
#  - the top-level CMake project's ctest suite (header as C11/C++17 with -Werror against the
#    real nccl.h, the C API test plain / ASan+UBSan / valgrind / static, exported symbols and
#    SONAME);
#  - install into a prefix, then build and run examples/c against the *installed* package.
# cmake and the NVIDIA wheels are installed into a venv under target/ on first use.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
source "$root/scripts/pip-retry.sh"
venv="$root/target/native-venv"
stamp="$venv/.requirements"
if ! cmp -s "$root/scripts/requirements-native.txt" "$stamp" 2>/dev/null; then
  echo "== installing cmake and NVIDIA header wheels into $venv"
  rm -rf "$venv"
  python3 -m venv "$venv"
  pip_install "$venv/bin/python" --quiet -r "$root/scripts/requirements-native.txt"
  cp "$root/scripts/requirements-native.txt" "$stamp"
fi
export PATH="$venv/bin:$PATH"
nvidia=$("$venv/bin/python" -c "import nvidia, os; print(list(nvidia.__path__)[0])")

echo "== NVRTC: compile the embedded kernels for sm_80, sm_90, sm_100"
NCCL_RESHARD_NVRTC_LIBRARY="$nvidia/cuda_nvrtc/lib/libnvrtc.so.12" \
  cargo test --locked --test kernels -- --include-ignored

echo "== NCCL's group depth read from the real libnccl's symbol table (groups need no GPU)"
NCCL_RESHARD_TEST_NCCL="$nvidia/nccl/lib/libnccl.so.2" \
  cargo test --locked --lib group_depth -- --nocapture

build="$root/target/c-build"
prefix="$root/target/c-prefix"
examples="$root/target/c-examples"
echo "== cmake: configure, build, ctest"
cmake -S "$root" -B "$build" -DCMAKE_INSTALL_PREFIX="$prefix" -DCMAKE_BUILD_TYPE=Release
cmake --build "$build" -j 2
ctest --test-dir "$build" --output-on-failure

echo "== cmake: install, then build examples/c against the installed package"
rm -rf "$prefix" "$examples"
cmake --install "$build"
cmake -S "$root/examples/c" -B "$examples" -DCMAKE_PREFIX_PATH="$prefix"
cmake --build "$examples" -j 2
ctest --test-dir "$examples" --output-on-failure
